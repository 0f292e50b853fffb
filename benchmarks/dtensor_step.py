"""A training step under FSDP x TP with clip_grad_norm_ and fused AdamW: hp's packages against torch's.

Both sides train the same Llama-style decoder (examples/llama_3d.py's
``Stage``: embedding, blocks with grouped-query attention and a SwiGLU, RMSNorms,
head) on a 2 x 2 ``("dp", "tp")`` mesh, from the same weights on the same data:

- hp: ``hp_dtensor.parallelize_module`` on ``mesh["tp"]`` with llama_3d's plan,
  then ``hp_fsdp.fully_shard`` on ``mesh["dp"]`` per block and the root;
- torch: ``torch.distributed.tensor.parallel.parallelize_module`` with the same
  plan in torch's styles, then ``torch.distributed.fsdp.fully_shard`` (FSDP2),
  on the torch view of the same mesh (``DeviceMesh.to_torch()``: the same
  process groups);
- on both sides the layers TP does not cut (embedding, RMSNorms, head) are
  replicated over ``tp`` with the library's ``distribute_module``, torchtitan's
  layout: torch's ``clip_grad_norm_`` refuses to stack norms from a 1-D and a
  2-D mesh, so this is the layout torch can run;
- a step is forward, backward, ``torch.nn.utils.clip_grad_norm_`` (with a
  max_norm that clips) and ``torch.optim.AdamW(fused=True)``, then
  ``zero_grad``.

Figures, per rank, the largest over the ranks:

- ``step_bytes``: the payload of every collective one step issues, counted the
  same way for both at torch's dispatcher: a ``TorchDispatchMode`` sees each
  ``c10d`` op (what ``torch.distributed`` calls reach, hp_core's included) and
  each functional collective (torch's DTensor and TP), and adds the tensor an
  all-reduce or broadcast carries, the output of an all-gather and the input of
  a reduce-scatter or all-to-all (hp_testing's convention). The mode defers to
  tensor subclasses, so the collectives DTensor issues inside an op are seen as
  the plain-tensor calls they are. The clip + optimizer part is also given
  alone: torch all-reduces the stacked per-parameter norms once per mesh dim
  (a vector of one norm per parameter), hp one scalar per mesh dim.
- ``step_peak_memory``: the high-water mark of tensor memory during a step,
  above what is live when the step starts. On CUDA, the caching allocator's
  peak (``torch.cuda.max_memory_allocated``). On CPU there are no allocator
  counters and ``tracemalloc`` does not see torch's allocations, so the peak
  is replayed from the torch profiler's memory events (every allocation and
  free of the CPU allocator during the step, any thread): one measure that
  sees both libraries' buffers alike. The figure is the *floor* over several
  profiled steps, the median is printed beside it: see [Note: peak noise]
On gloo the same step's peak varies by whole activation-sized buffers (128 KiB
steps in the default configuration, up to 512 KiB), on both sides alike. In
the higher samples the extra live memory is the buffer of a partial's
all-reduce (a row-wise layer's output: hp's redistribute clone, torch's
functional all-reduce output) still held at the moment of the step's peak;
whether it is depends on timing, not on the library. The allocator's own
running total shows the same bumps, so they are real but not the step's:
every rank's floor is identical for both libraries (9.68 MiB in the default
configuration), while a median of three samples, maximised over four ranks,
drew 1.00 to 1.03 from the bumps alone. The floor over ``--memory-steps``
samples is what a step needs; the median stays in the table and the JSON
(``step_peak_memory_median``).

Before measuring, the first step's loss and total norm are compared between the
two sides: a benchmark of different work would be worthless.

Run: ``hp-run -n 4 benchmarks/dtensor_step.py`` (``torchrun --nproc-per-node
4`` works too). Prints a table, then as its last line one JSON object whose
``ratios`` are hp's figure over torch's (below 1.0: hp is ahead).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hp_core
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hp_core import DeviceMesh, init_device_mesh
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from llama_3d import TP_PLAN, Config, Stage

SIDES = ("hp", "torch")

# -- counting collectives at torch's dispatcher ------------------------------------------------

# c10d op -> (kind, index of the argument that is the payload); see the module docstring
_C10D: dict[str, tuple[str, int]] = {
    "allreduce_": ("all_reduce", 0),
    "allreduce_coalesced_": ("all_reduce", 0),
    "broadcast_": ("broadcast", 0),
    "_allgather_base_": ("all_gather", 0),
    "allgather_": ("all_gather", 0),
    "allgather_coalesced_": ("all_gather", 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "alltoall_base_": ("all_to_all", 1),
    "alltoall_": ("all_to_all", 1),
}
# functional collective -> kind; the payload is the input, times the group size for an all-gather
_FUNCTIONAL: dict[str, str] = {
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_reduce_coalesced_": "all_reduce",
    "broadcast": "broadcast",
    "broadcast_": "broadcast",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all",
}


def _dtensor_classes() -> tuple[type, ...]:
    import hp_dtensor
    from torch.distributed.tensor import DTensor as TorchDTensor

    return (hp_dtensor.DTensor, TorchDTensor)


_DTENSORS = _dtensor_classes()


def _nbytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor))


class CountCollectives(TorchDispatchMode):
    """Counts and payload bytes, per kind, of the collectives dispatched while the mode is on."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        if any(issubclass(t, _DTENSORS) for t in types):
            return NotImplemented  # a DTensor: let it run; the plain-tensor calls it makes come back here
        kwargs = kwargs or {}
        namespace, name = func.namespace, func._opname  # type: ignore[attr-defined]
        if namespace == "c10d" and name in _C10D:
            kind, index = _C10D[name]
            self._add(kind, _nbytes(args[index]))
        elif namespace == "_c10d_functional" and name in _FUNCTIONAL:
            kind = _FUNCTIONAL[name]
            size = _nbytes(args[0])
            self._add(kind, size * args[1] if kind == "all_gather" else size)
        return func(*args, **kwargs)

    def _add(self, kind: str, nbytes: int) -> None:
        self.counts[kind] += 1
        self.bytes[kind] += nbytes


# -- the two sides ------------------------------------------------------------------------------


def _untouched_by_tp(model: nn.Module) -> list[nn.Module]:
    """The layers the TP plan leaves whole: embedding, every RMSNorm, head."""
    blocks = model.blocks  # type: ignore[union-attr]
    norms = [norm for block in blocks for norm in (block.attn_norm, block.mlp_norm)]
    return [model.embed, *norms, model.norm, model.head]  # type: ignore[list-item]


def _parallelize(
    model: nn.Module,
    dp_mesh: Any,
    tp_mesh: Any,
    dtensor_lib: Any,
    parallelize_module: Callable[..., Any],
    fully_shard: Callable[..., Any],
    plan: dict[str, Any],
) -> nn.Module:
    """TP inside each block, the rest replicated over tp, then FSDP per block and root: the same
    recipe in each library's API (``dtensor_lib``: ``hp_dtensor`` or ``torch.distributed.tensor``,
    both with ``DTensor``, ``Replicate`` and ``distribute_module``)."""

    def replicated_input(module: nn.Module, inputs: tuple[Any, ...], mesh: Any) -> tuple[Any, ...]:
        return tuple(dtensor_lib.DTensor.from_local(x, mesh, [dtensor_lib.Replicate()]) for x in inputs)

    def local_output(module: nn.Module, output: Any, mesh: Any) -> Any:
        return output.to_local()

    for block in model.blocks:  # type: ignore[union-attr]
        parallelize_module(block, tp_mesh, plan)
    for module in _untouched_by_tp(model):
        dtensor_lib.distribute_module(module, tp_mesh, input_fn=replicated_input, output_fn=local_output)
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model


def parallelize_hp(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    import hp_dtensor
    from hp_fsdp import fully_shard

    return _parallelize(
        model, mesh["dp"], mesh["tp"], hp_dtensor, hp_dtensor.parallelize_module, fully_shard, TP_PLAN
    )


def parallelize_torch(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    import hp_dtensor
    from torch.distributed import tensor as td
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import parallel as tp

    # llama_3d's plan in torch's styles: the same split of every layer
    plan = {
        name: tp.ColwiseParallel() if isinstance(style, hp_dtensor.ColwiseParallel) else tp.RowwiseParallel()
        for name, style in TP_PLAN.items()
    }
    torch_mesh = mesh.to_torch()
    return _parallelize(
        model, torch_mesh["dp"], torch_mesh["tp"], td, tp.parallelize_module, fully_shard, plan
    )


# -- one step and its measures --------------------------------------------------------------------


class Side:
    """One library's model and optimizer, and the step both sides run alike."""

    def __init__(self, model: nn.Module, max_norm: float, lr: float) -> None:
        self.model = model
        self.max_norm = max_norm
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)

    def forward_backward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        return loss.detach()

    def clip_and_step(self) -> torch.Tensor:
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return norm

    def step(self, tokens: torch.Tensor, targets: torch.Tensor) -> None:
        self.forward_backward(tokens, targets)
        self.clip_and_step()


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # either library's DTensor


def check_same_work(sides: dict[str, Side], batch: tuple[torch.Tensor, torch.Tensor], dp_group: Any) -> float:
    """The first step's loss (mean over dp) and total norm agree between the sides; returns the norm."""
    seen = {}
    for name, side in sides.items():
        loss = side.forward_backward(*batch)
        norm = _full(side.clip_and_step()).detach()
        dist.all_reduce(loss, group=dp_group)
        seen[name] = (loss / dist.get_world_size(dp_group), norm)
    for i, what in enumerate(("loss", "total norm")):
        torch.testing.assert_close(seen["hp"][i], seen["torch"][i], rtol=1e-4, atol=1e-6, msg=what)
    return float(seen["torch"][1])


def peak_bytes(fn: Callable[[], None], device: torch.device) -> int:
    """Tensor memory's high-water mark during ``fn`` above the start (see the module docstring)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - start
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    changes = sorted(
        (event.start_ns(), event.nbytes())
        for event in prof.profiler.kineto_results.events()  # type: ignore[union-attr]
        if event.name() == "[memory]"
    )
    live = high = 0
    for _, delta in changes:
        live += delta
        high = max(high, live)
    return high


def measure(mesh: DeviceMesh, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Every figure of both sides on this rank."""
    config = Config(
        **{f.name: getattr(args, f.name) for f in dataclasses.fields(Config) if f.name in vars(args)}
    )
    torch.manual_seed(0)
    base = Stage(config, config.layers, first=True, last=True)
    device_type = hp_core.get_platform().device_type
    device = torch.device("cpu")
    if device_type != "cpu":
        device = torch.device(device_type, torch.accelerator.current_device_index())
        base = base.to(device)
    sides = {
        "hp": Side(parallelize_hp(copy.deepcopy(base), mesh), args.max_norm, args.lr),
        "torch": Side(parallelize_torch(copy.deepcopy(base), mesh), args.max_norm, args.lr),
    }
    dp_group = mesh["dp"].get_group()
    gen = torch.Generator().manual_seed(100 + mesh.get_local_rank("dp"))  # tp ranks: the same data
    tokens = torch.randint(0, config.vocab, (args.batch, config.seq + 1), generator=gen).to(device)
    batch = (tokens[:, :-1], tokens[:, 1:])

    first_norm = check_same_work(sides, batch, dp_group)
    out: dict[str, dict[str, Any]] = {name: {"first_norm": first_norm} for name in SIDES}

    times: dict[str, list[float]] = {name: [] for name in SIDES}
    for it in range(args.warmup + args.iters):
        for name in SIDES if it % 2 == 0 else SIDES[::-1]:
            dist.barrier()
            start = time.perf_counter()
            sides[name].step(*batch)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if it >= args.warmup:
                times[name].append(time.perf_counter() - start)

    for name, side in sides.items():
        dist.barrier()
        with CountCollectives() as whole:
            side.forward_backward(*batch)
            with CountCollectives() as clip_opt:
                side.clip_and_step()
        out[name].update(
            step_s=statistics.median(times[name]),
            step_bytes=sum(whole.bytes.values()),
            step_counts=dict(whole.counts),
            step_bytes_by_kind=dict(whole.bytes),
            clip_opt_bytes=sum(clip_opt.bytes.values()),
            clip_opt_counts=dict(clip_opt.counts),
        )

    peaks: dict[str, list[int]] = {name: [] for name in SIDES}
    for it in range(args.memory_steps):
        for name in SIDES if it % 2 == 0 else SIDES[::-1]:
            dist.barrier()
            peaks[name].append(peak_bytes(lambda name=name: sides[name].step(*batch), device))
    for name in SIDES:  # see [Note: peak noise]
        out[name]["peak_bytes"] = min(peaks[name])
        out[name]["peak_bytes_median"] = statistics.median(peaks[name])
    return out


def _worst_over_ranks(per_rank: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """The slowest rank sets the pace, the largest rank the memory and link need; rank 0's details."""
    worst = copy.deepcopy(per_rank[0])
    for name in SIDES:
        for key in ("step_s", "step_bytes", "clip_opt_bytes", "peak_bytes", "peak_bytes_median"):
            worst[name][key] = max(r[name][key] for r in per_rank)
    return worst


def report(r: dict[str, dict[str, Any]], args: argparse.Namespace, world: int) -> None:
    hp, th = r["hp"], r["torch"]
    ratios = {
        "step_bytes": hp["step_bytes"] / th["step_bytes"],
        "step_peak_memory": hp["peak_bytes"] / th["peak_bytes"],
        "step_peak_memory_median": hp["peak_bytes_median"] / th["peak_bytes_median"],
        "step_time": hp["step_s"] / th["step_s"],
    }
    clip_ratio = hp["clip_opt_bytes"] / th["clip_opt_bytes"] if th["clip_opt_bytes"] else float("nan")
    print(
        f"dtensor_step: FSDP x TP 2x2 ({world} ranks), Llama blocks dim={args.dim} heads={args.heads}/"
        f"{args.kv_heads} hidden={args.hidden} layers={args.layers} vocab={args.vocab}, batch "
        f"{args.batch}x{args.seq} per dp rank; clip_grad_norm_({args.max_norm}) + AdamW(fused=True); "
        f"torch {torch.__version__}"
    )
    print(f"first step's total norm {hp['first_norm']:.4f} (clips: {hp['first_norm'] > args.max_norm})")
    peak = "step_peak_memory"
    rows = (
        ("step KiB communicated", hp["step_bytes"] / 2**10, th["step_bytes"] / 2**10, ratios["step_bytes"]),
        ("step peak MiB (floor)", hp["peak_bytes"] / 2**20, th["peak_bytes"] / 2**20, ratios[peak]),
        (
            f"step peak MiB (median {args.memory_steps})",
            hp["peak_bytes_median"] / 2**20,
            th["peak_bytes_median"] / 2**20,
            ratios["step_peak_memory_median"],
        ),
        (f"step ms (median of {args.iters})", 1e3 * hp["step_s"], 1e3 * th["step_s"], ratios["step_time"]),
        ("clip + AdamW bytes", hp["clip_opt_bytes"], th["clip_opt_bytes"], clip_ratio),
    )
    print(f"{'figure (max over ranks)':<28}{'hp':>12}{'torch':>12}{'hp/torch':>10}")
    for label, ours, theirs, ratio in rows:
        print(f"{label:<28}{ours:>12.2f}{theirs:>12.2f}{ratio:>10.3f}")
    for name in SIDES:
        print(
            f"{name:>6} collectives per step (rank 0): {dict(sorted(r[name]['step_counts'].items()))}; "
            f"clip + AdamW: {dict(sorted(r[name]['clip_opt_counts'].items()))}"
        )
    raw = {
        name: {
            k: (round(v, 6) if isinstance(v, float) else v)
            for k, v in r[name].items()
            if k not in ("step_counts", "clip_opt_counts")
        }
        | {"step_counts": r[name]["step_counts"], "clip_opt_counts": r[name]["clip_opt_counts"]}
        for name in SIDES
    }
    summary = {
        "benchmark": "dtensor_step",
        "ratios": {k: round(v, 4) for k, v in ratios.items()},
        "raw": raw,
        "world_size": world,
        "config": vars(args),
        "torch": torch.__version__,
    }
    print(json.dumps(summary))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=352)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4, help="sequences per data-parallel rank")
    parser.add_argument("--max-norm", type=float, default=0.5, help="small enough that every step clips")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--memory-steps", type=int, default=6, help="profiled steps per side")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")  # torch FSDP2's advice, not ours
    warnings.filterwarnings(
        "ignore", message=".*sequential all_reduce operations.*"
    )  # torch DTensor's advice
    hp_core.init_distributed()
    world = hp_core.get_world_size()
    if world != 4:
        raise SystemExit(
            f"dtensor_step: runs on a 2 x 2 mesh, 4 ranks, but {world} were started; hp-run -n 4"
        )
    mesh = init_device_mesh(hp_core.get_platform().device_type, (2, 2), mesh_dim_names=("dp", "tp"))
    mine = measure(mesh, args)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    if hp_core.get_rank() == 0:
        report(_worst_over_ranks(everyone), args, world)
    hp_core.destroy_distributed()


if __name__ == "__main__":
    main()
