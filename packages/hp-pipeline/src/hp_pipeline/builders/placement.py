"""Which rank hosts which stage.

* ``"loop"``: stage ``s`` on rank ``s % p``; rank ``r`` holds ``r, r+p, r+2p, ...``
  (Megatron's and torch's interleaved placement). With one stage per rank this
  is the plain ``stage == rank`` placement.
* ``"v"``: two stages per rank folded into a V, rank ``r`` holds ``r`` and
  ``2p-1-r``, so the first and the last stage share rank 0. The loss is then
  computed on the rank that loads the data, and the turn at the bottom of the
  V (stages ``p-1`` and ``p``, both on rank ``p-1``) is a local hand-off.
"""

from __future__ import annotations

from typing import Literal

from hp_pipeline.builders._common import check_count

__all__ = ["stage_to_rank", "stages_on_rank"]

Style = Literal["loop", "v"]


def stages_on_rank(
    rank: int, num_ranks: int, stages_per_rank: int = 1, *, style: Style = "loop"
) -> list[int]:
    """The stages rank ``rank`` hosts, in local order (its first chunk first)."""
    p = check_count("stages_on_rank", "num_ranks", num_ranks, "pass the pipeline group size")
    v = check_count("stages_on_rank", "stages_per_rank", stages_per_rank, "use 1 or more")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < p:
        raise ValueError(f"stages_on_rank: rank must be in 0 .. {p - 1}, got {rank!r}")
    if style == "loop":
        return [rank + j * p for j in range(v)]
    if style == "v":
        if v != 2:
            raise ValueError(
                f"stages_on_rank: the 'v' placement puts exactly 2 stages on each rank, got "
                f"stages_per_rank={v}; use stages_per_rank=2 or style='loop'"
            )
        return [rank, 2 * p - 1 - rank]
    raise ValueError(f"stages_on_rank: style must be 'loop' or 'v', got {style!r}")


def stage_to_rank(stage: int, num_ranks: int, *, style: Style = "loop") -> int:
    """The rank hosting ``stage`` under ``style`` (see the module docstring)."""
    p = check_count("stage_to_rank", "num_ranks", num_ranks, "pass the pipeline group size")
    if isinstance(stage, bool) or not isinstance(stage, int) or stage < 0:
        raise ValueError(f"stage_to_rank: stage must be an int >= 0, got {stage!r}")
    if style == "loop":
        return stage % p
    if style == "v":
        if stage >= 2 * p:
            raise ValueError(
                f"stage_to_rank: the 'v' placement over {p} ranks has stages 0 .. {2 * p - 1}, "
                f"got stage {stage}"
            )
        return stage if stage < p else 2 * p - 1 - stage
    raise ValueError(f"stage_to_rank: style must be 'loop' or 'v', got {style!r}")
