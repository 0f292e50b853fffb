"""``hp-run``: launch a script on N local CPU ranks, as ``torchrun`` would.

Every rank gets the environment ``torchrun --standalone`` gives it (RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...), so a
training script written for a cluster runs unchanged on a laptop, and under
``torchrun`` later: nothing here is needed at run time. A rank skips interpreter
finalization ([Note: a rank ends without interpreter finalization] in
:mod:`hp_testing._rank_main`). When one rank fails, the others are given a few seconds to finish and are then
stopped, and the launcher names the rank that failed first, so a crash never
turns into a silent hang. SIGINT, SIGTERM and SIGHUP are forwarded to every
rank, and the ranks die with the launcher even if it is killed hard
([Note: signals reach every rank] in :mod:`hp_testing._supervisor`). A rank
that exits early is named to the peers waiting for it ([Note: a rank that
exits early]).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from typing import IO

from hp_testing._lifetime import preexec_die_with_parent
from hp_testing._supervisor import SignalCatcher, stop_after_failure, supervise

ENV_STRICT = "HP_RUN_STRICT"
_YES = ("1", "true", "yes", "on")
_NO = ("0", "false", "no", "off")


def _strict(flag: bool | None, emulate: str | None, parser: argparse.ArgumentParser) -> bool:
    """``--strict``/``--no-strict``, else ``$HP_RUN_STRICT``, else on exactly under ``--emulate``.

    On by default under emulation because that is where a script is checked
    for the GPU it will meet; plain ``hp-run`` stays a torchrun look-alike.
    """
    if flag is not None:
        return flag
    raw = os.environ.get(ENV_STRICT, "").strip().lower()
    if not raw:
        return emulate is not None
    if raw in _YES + _NO:
        return raw in _YES
    parser.error(
        f"{ENV_STRICT}={raw!r} is neither yes nor no; set it to 1 or 0, or unset it "
        "(then strict mode is on under --emulate)"
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rank_env(
    rank: int, world_size: int, master_port: int, base: dict[str, str] | None = None
) -> dict[str, str]:
    """The environment one rank sees, matching torchrun's variable names."""
    env = dict(os.environ if base is None else base)
    env.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "GROUP_RANK": "0",
            "GROUP_WORLD_SIZE": "1",
            "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(world_size),
            "ROLE_NAME": "default",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(master_port),
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": "hp-run",
        }
    )
    # torchrun's default: one intra-op thread per rank unless the user chose.
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _pump(stream: IO[bytes], rank: int, sink: IO[str]) -> None:
    for raw in iter(stream.readline, b""):
        sink.write(f"[rank{rank}]: {raw.decode(errors='replace')}")
        sink.flush()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hp-run",
        description="Run a script on N local CPU ranks with the environment torchrun would set.",
    )
    parser.add_argument(
        "-n", "--nproc-per-node", dest="nproc", type=int, required=True, help="number of ranks"
    )
    parser.add_argument("-m", "--module", action="store_true", help="run the target as a module (python -m)")
    parser.add_argument("--master-port", type=int, default=0, help="rendezvous port (default: a free one)")
    parser.add_argument(
        "--grace",
        type=float,
        default=5.0,
        help="seconds the other ranks get after one fails, or after a forwarded SIGINT/SIGTERM/SIGHUP, "
        "before they are killed (default 5)",
    )
    parser.add_argument("--tag-output", action="store_true", help="prefix every output line with its rank")
    parser.add_argument(
        "--emulate",
        choices=("nccl", "hccl"),
        default=None,
        help="run over gloo on CPU while the script sees a cuda/nccl (or npu/hccl) platform, with the "
        "backend's rules and the cross-rank checks of hp-testing",
    )
    parser.add_argument(
        "--no-checks",
        action="store_true",
        help="skip the cross-rank checks (under --emulate or --strict the rules stay; otherwise the "
        "ranks run bare, as under torchrun, and a rank that exits early is not reported to its peers)",
    )
    strict = parser.add_mutually_exclusive_group()
    strict.add_argument(
        "--strict",
        dest="strict",
        action="store_const",
        const=True,
        default=None,
        help="async hazards become errors (a read or write of a pending async call's buffers, "
        f"work never waited), as the pytest marker's strict=True; the default under --emulate "
        f"(or set {ENV_STRICT}=1/0)",
    )
    strict.add_argument(
        "--no-strict", dest="strict", action="store_const", const=False, help="turn strict mode off"
    )
    parser.add_argument(
        "--local",
        action="store_true",
        help="run every rank as a thread of this process over an in-memory backend (for world sizes "
        "too large to fork); --emulate applies its backend's rules, --strict (async hazards) is refused",
    )
    parser.add_argument("script", help="the script (or module with -m) to run")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``hp-run``; returns 0, the first failing rank's exit code, or ``128 + signum``."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.nproc < 1:
        _parser().error(f"-n must be at least 1, got {args.nproc}")
    if not args.module and not os.path.exists(args.script):
        _parser().error(f"script {args.script!r} does not exist (use -m to run a module)")
    if args.local:
        return _run_local(args, parser)
    target = ["-m", args.script] if args.module else [args.script]
    strict = _strict(args.strict, args.emulate, parser)
    checks = not args.no_checks
    if args.emulate is not None or strict or checks:
        # The layer of the pytest harness; without --emulate, under gloo's own rules.
        profile = f"{args.emulate}-emu" if args.emulate is not None else "gloo"
        mode = "strict" if strict else "no-strict"
        target = [
            "-m",
            "hp_testing._emulated_main",
            profile,
            "checks" if checks else "no-checks",
            mode,
            *target,
        ]
    else:  # the bare launcher still ends ranks safely ([Note: a rank ends without interpreter finalization])
        target = bare_rank_target(target)
    command = [sys.executable, "-u", *target, *args.script_args]
    if not checks:
        port = args.master_port or _free_port()
        return launch(command, args.nproc, port, grace_s=args.grace, tag_output=args.tag_output)
    with _AgentStore(args.master_port) as agent:
        return launch(
            command,
            args.nproc,
            agent.port,
            grace_s=args.grace,
            tag_output=args.tag_output,
            extra_env={"TORCHELASTIC_USE_AGENT_STORE": "True"},
            on_exit=agent.announce,
        )


# [Note: a bare rank imports nothing of hp-testing]
# Under ``--no-checks`` a rank runs the script as under torchrun, through
# :mod:`hp_testing._rank_main` only for its safe ending. ``python -m
# hp_testing._rank_main`` would import the package ``hp_testing`` first, and with
# it torch and the whole harness (pool, local mode, fixtures): about 0.4 s of CPU
# per rank beyond what a torch script imports anyway, 2 s for a script that needs
# no torch, and modules the script never asked for. The rank loads
# ``_rank_main.py`` (standard library only) by its path instead, under
# ``python -c``, and puts the working directory first on ``sys.path`` as ``-m``
# would (``run_script`` replaces it with a script's folder, as ``python
# script.py`` does).
_BARE_RANK = (
    "import importlib.util, os, sys\n"
    "sys.path[0] = os.getcwd()\n"
    "spec = importlib.util.spec_from_file_location('_hp_run_rank', {path!r})\n"
    "rank_main = importlib.util.module_from_spec(spec)\n"
    "spec.loader.exec_module(rank_main)\n"
    "rank_main.main(sys.argv[1:])\n"
)


def bare_rank_target(target: list[str]) -> list[str]:
    """The interpreter arguments of a ``--no-checks`` rank running ``target``.

    See [Note: a bare rank imports nothing of hp-testing].
    """
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_rank_main.py")
    return ["-c", _BARE_RANK.format(path=path), *target]


def _run_local(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``--local``: refuse what needs concurrent ranks, then run the script on in-process ranks.

    ``--emulate`` applies the backend's rules there too; ``--strict`` (async
    hazards) needs ranks that really run at once.
    """
    from hp_testing._local_run import run_script
    from hp_testing.local import ConcurrencyNeededError, refuse_concurrency

    if _strict(args.strict, None, parser):  # asked for explicitly: not on by default here
        emulate = f" --emulate {args.emulate}" if args.emulate else ""
        try:
            refuse_concurrency(
                "--strict (async hazards)", f"hp-run -n {args.nproc}{emulate} --strict {args.script}"
            )
        except ConcurrencyNeededError as exc:
            parser.error(f"--local: {exc}")
    return run_script(args.script, args.module, args.script_args, args.nproc, emulate=args.emulate)


# [Note: a rank that exits early]
# A rank that ends (with any code, 0 included: its data ran out and it
# returned) while a peer waits for it in a collective leaves that peer waiting
# until gloo notices the closed socket, or forever in the checks' store polls,
# and nothing names the rank that left. Only the launcher sees every process
# end, so it posts an ``exited`` status for the rank, with its exit code, where
# the cross-rank checks of the others already look for failed peers
# (:func:`hp_testing._sidechannel.announce_exit`, the pool's mechanism): their
# wait ends within a poll with ``rank R exited (code C) while rank S waits for it
# in all_reduce(...) (collective #k ...) at file:line``. For that the store must
# outlive every rank, so with the checks on ``hp-run`` hosts the rendezvous
# TCPStore itself, as torchrun's agent does (``TORCHELASTIC_USE_AGENT_STORE``),
# instead of rank 0; and the checks are on by default, under gloo's own rules
# when there is no ``--emulate`` (``--no-checks`` gives the bare launcher).
class _AgentStore:
    """The rendezvous TCPStore, hosted by hp-run to outlive every rank ([Note: a rank that exits early])."""

    def __init__(self, port: int) -> None:
        self._want = port
        self.port = port
        self._store: object | None = None

    def __enter__(self) -> _AgentStore:
        import datetime

        import torch.distributed as dist

        self._store = dist.TCPStore(
            "127.0.0.1",
            self._want,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=300),
        )
        self.port = int(self._store.port)  # the one the OS picked when asked for 0
        return self

    def __exit__(self, *exc: object) -> None:
        self._store = None

    def announce(self, rank: int, code: int) -> None:
        """Post that ``rank`` ended with ``code``, for the checks of the ranks still running."""
        from hp_testing._emulated_main import channel_prefix
        from hp_testing._sidechannel import announce_exit

        if self._store is None:
            return
        try:
            announce_exit(self._store, channel_prefix(), rank, code, "hp-run saw its process end.")
        except Exception as exc:  # the report is a courtesy: never let it stop the supervision
            print(f"[hp-run] could not tell the other ranks that rank {rank} exited: {exc}", file=sys.stderr)


def launch(
    command: list[str],
    nproc: int,
    master_port: int,
    *,
    grace_s: float = 5.0,
    tag_output: bool = False,
    extra_env: dict[str, str] | None = None,
    on_exit: Callable[[int, int], None] | None = None,
) -> int:
    """Start ``nproc`` copies of ``command`` and supervise them until all exit.

    Returns hp-run's exit status: 0, the first failing rank's, or ``128 + signum``
    when a signal stopped the run ([Note: signals reach every rank]). ``extra_env``
    is added to every rank's environment; ``on_exit`` is :func:`supervise`'s.
    """
    pipe = subprocess.PIPE if tag_output else None
    procs: list[subprocess.Popen[bytes]] = []
    pumps: list[threading.Thread] = []
    # Caught from before the first rank starts: a signal during the start stops those started.
    with SignalCatcher() as catcher:
        try:
            preexec = preexec_die_with_parent()
            for rank in range(nproc):
                if catcher.received:
                    break  # stopping anyway: supervise() forwards it to the ranks started so far
                procs.append(
                    subprocess.Popen(
                        command,
                        env={**rank_env(rank, nproc, master_port), **(extra_env or {})},
                        stdout=pipe,
                        stderr=subprocess.STDOUT if pipe else None,
                        start_new_session=True,  # a terminal's Ctrl-C reaches a rank once, through us
                        preexec_fn=preexec,  # resolved before the fork: see hp_testing._lifetime
                    )
                )
            # The pumps start after every fork: no thread of ours runs while a child is made.
            pumps = [
                threading.Thread(target=_pump, args=(proc.stdout, rank, sys.stdout), daemon=True)
                for rank, proc in enumerate(procs)
                if proc.stdout is not None
            ]
            for pump in pumps:
                pump.start()
            code = supervise(procs, grace_s, catcher, on_exit)
        except BaseException:
            stop_after_failure(procs)  # never leave ranks behind, whatever went wrong here
            raise
    for pump in pumps:
        pump.join(2)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
