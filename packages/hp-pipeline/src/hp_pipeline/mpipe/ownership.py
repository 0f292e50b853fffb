"""Which pipeline rank owns (preprocesses, and loads) which micro-batch.

Details: [Note: MPipe ownership].
"""

from __future__ import annotations

from typing import Literal

__all__ = ["OverflowMode", "check_owns_data", "mpipe_owned_micros", "mpipe_owner"]

OverflowMode = Literal["full", "min"]
_MODES = ("full", "min")


def _check(fn: str, pp_size: int, n_microbatches: int, mode: str) -> None:
    for name, value in (("pp_size", pp_size), ("n_microbatches", n_microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{fn}: {name} must be an int >= 1, got {value!r}")
    if mode not in _MODES:
        raise ValueError(f"{fn}: mode must be 'full' or 'min', got {mode!r}")


# [Note: MPipe ownership]
# With ``P`` pipeline ranks and ``M`` micro-batches, ``NT = min(P, M)`` ranks take
# part in the tower's work; with ``M < P`` the ranks ``NT .. P-1`` own nothing.
#
# * ``"full"``: micro-batch ``k`` belongs to rank ``k % NT``. Every taking-part
#   rank owns ``M // NT`` or ``M // NT + 1`` micro-batches, the extra ones going
#   to the lowest ranks.
# * ``"min"``: the first ``NT * (M // NT)`` micro-batches go round robin
#   (``k -> k % NT``), and the ``M % NT`` left over (the *overflow*, the last
#   micro-batches) all go to rank 0. Ranks ``1 .. NT-1`` own exactly the minimum
#   ``M // NT`` each, and rank 0 absorbs the rest: ``M // NT + M % NT``.
#
# Both modes give every micro-batch exactly one owner, and agree when ``NT``
# divides ``M``. A rank's owned micro-batches are returned in increasing order;
# it preprocesses (and, with in-schedule loading, reads) them in that order.


def mpipe_owner(pp_size: int, n_microbatches: int, micro: int, mode: OverflowMode = "full") -> int:
    """The pipeline rank that owns micro-batch ``micro`` ([Note: MPipe ownership])."""
    _check("mpipe_owner", pp_size, n_microbatches, mode)
    if isinstance(micro, bool) or not isinstance(micro, int) or not 0 <= micro < n_microbatches:
        raise ValueError(f"mpipe_owner: micro must be in 0 .. {n_microbatches - 1}, got {micro!r}")
    nt = min(pp_size, n_microbatches)
    if mode == "min" and micro >= nt * (n_microbatches // nt):
        return 0
    return micro % nt


def mpipe_owned_micros(
    pp_size: int, n_microbatches: int, pp_rank: int, mode: OverflowMode = "full"
) -> list[int]:
    """The micro-batches pipeline rank ``pp_rank`` owns, in increasing order.

    ``NT = min(pp_size, n_microbatches)``; ``"full"`` gives micro-batch ``k`` to
    rank ``k % NT``, ``"min"`` gives the ``M % NT`` overflow micro-batches to
    rank 0 (see [Note: MPipe ownership]). A rank ``>= NT`` owns nothing (``[]``).
    """
    _check("mpipe_owned_micros", pp_size, n_microbatches, mode)
    if isinstance(pp_rank, bool) or not isinstance(pp_rank, int) or not 0 <= pp_rank < pp_size:
        raise ValueError(f"mpipe_owned_micros: pp_rank must be in 0 .. {pp_size - 1}, got {pp_rank!r}")
    return [k for k in range(n_microbatches) if mpipe_owner(pp_size, n_microbatches, k, mode) == pp_rank]


def check_owns_data(
    pp_size: int, n_microbatches: int, pp_rank: int, mode: OverflowMode = "full"
) -> list[int]:
    """The owned micro-batches of a rank that must load data; a ValueError if it owns none."""
    owned = mpipe_owned_micros(pp_size, n_microbatches, pp_rank, mode)
    if not owned:
        raise ValueError(
            f"MPipe in-schedule loading: pipeline rank {pp_rank} owns no micro-batch "
            f"(n_microbatches={n_microbatches} < pp_size={pp_size}, so only ranks 0 .. "
            f"{n_microbatches - 1} own one) but every rank must load its own data; raise the "
            f"micro-batch count to at least {pp_size}"
        )
    return owned
