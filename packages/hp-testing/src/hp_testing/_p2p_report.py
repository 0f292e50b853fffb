"""The per-rank listing of posted sends and receives that an unmatched point-to-point error prints.

[Note: the current exchange]
A wrong peer in a ``batch_isend_irecv`` (rank 2 receives from 3 instead of
1) shows up as waits: the sender waits for a receive that never comes, the
receiver for a send that never comes. Which rank notices first, and whether
it sees a cycle or a peer that already finished, depends on timing; naming
one wait hides the mistake. So every error about a point-to-point wait
lists, for every rank, the ops of its *current exchange* (those posted since
the last moment all of its ops were matched, so a long pipeline does not
list its whole history) and marks each one whose other end was never posted.

Each rank publishes its exchange when it stops to wait (``blocked/<rank>``)
and when it finishes (``done/<rank>``). A rank that is still running has
published nothing yet; the report waits briefly for it and otherwise says so.
"""

from __future__ import annotations

from collections.abc import Callable

from hp_testing._wire import Posted

__all__ = ["counterpart_key", "exchange_report"]


def counterpart_key(op: Posted) -> str:
    """The store key of the other end of ``op`` (the receive of a send, the send of a receive)."""
    other = "r" if op.send else "s"
    return f"{other}/{op.group}/{op.src}/{op.dst}/{op.seq}"


def _describe(op: Posted, matched: bool) -> tuple[str, str, str]:
    if matched:
        verdict = "matched"
    elif op.send:
        verdict = f"NO COUNTERPART: rank {op.dst} posted no receive from rank {op.src}"
    else:
        verdict = f"NO COUNTERPART: rank {op.src} posted no send to rank {op.dst}"
    return op.shown, f"message #{op.seq} {op.src}->{op.dst}", verdict


def exchange_report(
    world_size: int,
    posted: dict[int, list[Posted] | None],
    exists: Callable[[str], bool],
    notes: dict[int, str] | None = None,
) -> str:
    """Every rank's current exchange, each op marked matched or not ([Note: the current exchange]).

    ``posted[r]`` is None when rank ``r`` published nothing: ``notes[r]`` says
    why (it failed or exited), else it is still running. ``exists`` tells
    whether a store key is set.
    """
    rows: list[tuple[str, str, str, str, str]] = []  # rank label, op, message, verdict, site
    for rank in range(world_size):
        label = f"rank {rank}:"
        ops = posted.get(rank)
        if ops is None:
            note = (notes or {}).get(rank, "(unknown: still running, it has not stopped to wait)")
            rows.append((label, note, "", "", ""))
            continue
        if not ops:
            rows.append((label, "(no point-to-point op in flight)", "", "", ""))
            continue
        for op in ops:
            shown, message, verdict = _describe(op, exists(counterpart_key(op)))
            rows.append((label, shown, message, verdict, op.site))
            label = ""
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = []
    for label, shown, message, verdict, site in rows:
        if not message:
            lines.append(f"  {label:<{widths[0]}} {shown}")
            continue
        lines.append(
            f"  {label:<{widths[0]}} {shown:<{widths[1]}}  {message:<{widths[2]}}  {verdict}  at {site}"
        )
    unmatched = sum(1 for row in rows if row[3].startswith("NO COUNTERPART"))
    return (
        f"Point-to-point ops posted by each rank since its last fully matched point ({unmatched} without "
        "a counterpart):\n" + "\n".join(lines)
    )
