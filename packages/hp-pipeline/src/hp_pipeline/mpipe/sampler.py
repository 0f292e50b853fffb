"""``PPRankOwnedSampler``: each pipeline rank reads only the micro-batches it owns.

Details: [Note: owned sampling].
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence, Sized
from typing import Any

from torch.utils.data import Sampler

__all__ = ["PPRankOwnedSampler"]


# [Note: owned sampling]
# Every rank of the pipeline wraps the *same* base sampler (same order: e.g. a
# ``SequentialSampler``, or a seeded / ``set_epoch``-driven sampler built the
# same way on every rank). The base order is cut into steps of
# ``n_microbatches * micro_batch_size`` indices; micro-batch ``k`` of a step is
# the ``k``-th slice of ``micro_batch_size`` indices. A rank yields, step after
# step, the indices of its owned micro-batches in increasing micro order, so a
# ``DataLoader(dataset, batch_size=micro_batch_size, sampler=...)`` hands it
# exactly the micro-batches ``ScheduleMPipe(in_schedule_loading=True)`` asks for,
# and over all ranks every index of an epoch's full steps is read exactly once.
# A trailing partial step is dropped (like ``drop_last``).
#
# ``state_dict()`` records the epoch and how many indices this epoch already
# yielded; after ``load_state_dict`` the next iteration skips them, so training
# resumes exactly where it stopped (the base sampler must give the same order
# again for that epoch). With a multi-worker ``DataLoader`` the sampler runs
# ahead of training; take the position from the loader then.


class PPRankOwnedSampler(Sampler[int]):
    """Wrap ``base_sampler`` so this rank yields only its owned micro-batches ([Note: owned sampling]).

    Args:
        base_sampler: any sized iterable of dataset indices, identical on every rank.
        owned_micros: this rank's micro-batches, e.g. ``mpipe_owned_micros(p, m, rank, mode)``.
        micro_batch_size: samples per micro-batch.
        n_microbatches: micro-batches per step (``m``).
        num_steps: optional: the steps per epoch training will run; a dataset
            too small for them fails here, naming the numbers, not mid-run.

    Raises:
        ValueError: bad sizes, no owned micro-batch, or a dataset too small
            for one step (or for ``num_steps``).
    """

    def __init__(
        self,
        base_sampler: Any,
        owned_micros: Sequence[int],
        micro_batch_size: int,
        n_microbatches: int,
        *,
        num_steps: int | None = None,
    ) -> None:
        for name, value in (("micro_batch_size", micro_batch_size), ("n_microbatches", n_microbatches)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PPRankOwnedSampler: {name} must be an int >= 1, got {value!r}")
        owned = sorted(set(owned_micros))
        if not owned:
            raise ValueError(
                "PPRankOwnedSampler: this rank owns no micro-batch, so it would read nothing; raise "
                f"n_microbatches (now {n_microbatches}) to at least the pipeline size"
            )
        bad = [k for k in owned if not (isinstance(k, int) and 0 <= k < n_microbatches)]
        if bad:
            raise ValueError(f"PPRankOwnedSampler: owned_micros {bad} are outside 0 .. {n_microbatches - 1}")
        if not isinstance(base_sampler, Sized):
            raise TypeError("PPRankOwnedSampler: base_sampler must have a length (len(base_sampler))")
        self.base = base_sampler
        self.owned_micros = owned
        self.micro_batch_size = micro_batch_size
        self.n_microbatches = n_microbatches
        self.step_size = micro_batch_size * n_microbatches
        self.steps_per_epoch = len(base_sampler) // self.step_size
        if self.steps_per_epoch < 1 or (num_steps is not None and self.steps_per_epoch < num_steps):
            wanted = 1 if num_steps is None else num_steps
            raise ValueError(
                f"PPRankOwnedSampler: the base sampler has {len(base_sampler)} samples, which feed "
                f"{self.steps_per_epoch} step(s) per epoch of n_microbatches * micro_batch_size = "
                f"{n_microbatches} * {micro_batch_size} = {self.step_size} samples, but {wanted} "
                f"step(s) were requested; use a larger dataset, fewer steps, or smaller micro-batches"
            )
        self.epoch = 0
        self._yielded = 0
        self._skip = 0

    def __len__(self) -> int:
        return self.steps_per_epoch * len(self.owned_micros) * self.micro_batch_size

    def set_epoch(self, epoch: int) -> None:
        """Forwarded to the base sampler when it has ``set_epoch`` (e.g. ``DistributedSampler``)."""
        self.epoch = epoch
        setter = getattr(self.base, "set_epoch", None)
        if callable(setter):
            setter(epoch)

    def __iter__(self) -> Iterator[int]:
        skip, self._skip = self._skip, 0
        self._yielded = skip
        source: Iterator[int] = iter(self.base)  # type: ignore[call-overload]
        mbs = self.micro_batch_size
        position = 0
        for _ in range(self.steps_per_epoch):
            chunk = [next(source) for _ in range(self.step_size)]
            for k in self.owned_micros:
                for index in chunk[k * mbs : (k + 1) * mbs]:
                    if position >= skip:
                        self._yielded = position + 1
                        yield index
                    position += 1
        self._yielded = 0

    def state_dict(self) -> dict[str, int]:
        """Where this rank stands in the epoch: ``{"epoch", "yielded"}``."""
        return {"epoch": self.epoch, "yielded": self._yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume: the next iteration skips the indices the saved one already yielded."""
        yielded = int(state["yielded"])
        if not 0 <= yielded <= len(self):
            raise ValueError(f"PPRankOwnedSampler: state yielded={yielded} is outside 0 .. {len(self)}")
        self.set_epoch(int(state.get("epoch", 0)))
        self._skip = self._yielded = yielded
