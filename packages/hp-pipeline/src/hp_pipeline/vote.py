"""The end-of-step failure vote: every rank of the pipeline learns whether any rank failed.

[Note: failure vote]
After a step every rank must agree on "did anyone fail?" before it returns
(see [Note: failures] in :mod:`hp_pipeline.executor`). This needs a message
after the last compute of the whole pipeline: the last stage finishes long
before stage 0's last backward, so nothing that already flows in the step can
carry stage 0's verdict to it. The vote is that message, and it is on the
critical path of every step, so it is made as cheap as we can:

* on gloo (CPU) it is a *star* of point-to-point flags around the pipeline
  group's first rank (the root, which hosts stage 0 and finishes last in every
  schedule here), on a tag of its own (``VOTE_TAG``). The receives are posted
  when the step *starts* (``open``): the root's one per peer, each peer's
  one for the verdict. At the end (``close``) each peer sends its one-element
  flag, which lands in a receive posted long ago, and the root, once its own
  step is done, sums them and sends the verdict back, again into posted
  receives. That is ``2 (p-1)`` tiny messages and one hop after the root
  finishes; the one-element ``all_reduce`` it replaces is, on gloo, a ring of
  ``2 (p-1)`` sequential hops per rank (``2 p (p-1)`` messages in all), and
  on a CPU shared by the ranks every hop is a wake-up of two processes;
* on other backends (NCCL, HCCL, ...) it stays a one-element ``all_reduce``,
  which is fast there, while point-to-point between non-adjacent ranks would
  set up communicators that nothing else uses.

The data traffic uses tag 0 and gloo matches receives by (peer, tag), so the
early receives never take a data message. A step that ends in a
communication error (the process group is suspect then) leaves its posted
receives pending; the next ``open`` reuses them instead of posting more, so
the messages of a later vote still pair up one to one.

Only when the verdict says some rank failed do the ranks gather the failure
records (``all_gather_object``); that path is rare and its cost is irrelevant.

The checks hp-core's point-to-point wrappers run per call (group membership,
peer not self, tensor layout) hold by construction here: the group is
resolved and the peers are the group's other ranks, computed once in
``__init__``; the flags are fresh contiguous int32 tensors. So ``open`` and
``close`` call ``torch.distributed`` directly.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from hp_core import capabilities_for

from hp_pipeline.errors import StageFailure

__all__: list[str] = []

VOTE_TAG = 0x4850  # "HP": any tag but the data transfers' 0 works; gloo keeps tags apart


class FailureVote:
    """One per schedule: ``open()`` when a step starts, ``close(failure)`` when it ends."""

    def __init__(self, group: dist.ProcessGroup | None, device: Any) -> None:
        self.group = group
        pg = dist.group.WORLD if group is None else group
        ranks = dist.get_process_group_ranks(pg)
        self.rank = dist.get_rank()
        if self.rank not in ranks:
            raise ValueError(
                f"rank {self.rank} is not in the pipeline group {ranks}; build the stages with a group "
                "this rank belongs to"
            )
        self.root = ranks[0]
        self.peers = [r for r in ranks if r != self.rank] if self.rank == self.root else [self.root]
        # Tags keep the vote apart from activations only on gloo; NCCL ignores tags.
        self.p2p = capabilities_for(pg).backend == "gloo" and len(ranks) > 1
        self._device = device
        self._bufs: list[torch.Tensor] = []
        self._works: list[Any] = []

    def open(self) -> None:
        """Post this rank's vote receives (gloo), unless a broken step left them posted."""
        if not self.p2p or self._works:
            return
        self._bufs = [torch.zeros(1, dtype=torch.int32) for _ in self.peers]
        self._works = [
            dist.irecv(buf, src, group=self.group, tag=VOTE_TAG)
            for buf, src in zip(self._bufs, self.peers, strict=True)
        ]

    def close(self, failure: StageFailure | None) -> list[StageFailure]:
        """The failure records of every rank that failed this step (``[]`` when none did)."""
        from hp_core import all_gather_object, all_reduce

        mine = 0 if failure is None else 1
        if self.p2p:
            self.open()  # no-op when open() ran at the start of the step
            works, bufs = self._works, self._bufs
            self._works, self._bufs = [], []
            if self.rank == self.root:
                for work in works:
                    work.wait()
                total = torch.tensor([mine + sum(int(b.item()) for b in bufs)], dtype=torch.int32)
                sends = [dist.isend(total, dst, group=self.group, tag=VOTE_TAG) for dst in self.peers]
                for sent in sends:
                    if sent is not None:
                        sent.wait()
                failed = int(total.item())
            else:
                send = dist.isend(
                    torch.tensor([mine], dtype=torch.int32), self.root, group=self.group, tag=VOTE_TAG
                )
                works[0].wait()
                if send is not None:
                    send.wait()
                failed = int(bufs[0].item())
        else:
            device = self._device() if callable(self._device) else self._device
            flag = torch.tensor([mine], dtype=torch.int32, device=device)
            all_reduce(flag, "sum", self.group)
            failed = int(flag.item())
        if failed == 0:
            return []
        gathered = all_gather_object(None if failure is None else failure.portable(), self.group)
        return [f for f in gathered if f is not None]
