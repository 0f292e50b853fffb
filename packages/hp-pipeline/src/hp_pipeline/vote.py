"""The end-of-step failure vote: every rank of the pipeline learns whether any rank failed.

Details: [Note: failure vote], [Note: vote off the compute stream].
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from hp_core import DeviceHandle, EventLike, StreamLike, capabilities_for, get_platform

from hp_pipeline.errors import StageFailure

__all__: list[str] = []

# [Note: failure vote]
# After a step every rank must agree on "did anyone fail?" before it returns
# (see [Note: failures] in :mod:`hp_pipeline.executor`). This needs a message
# after the last compute of the whole pipeline: the last stage finishes long
# before stage 0's last backward, so nothing that already flows in the step can
# carry stage 0's verdict to it. The vote is that message, and it is on the
# critical path of every step, so it is made as cheap as we can:
#
# * on gloo (CPU) it is a *star* of point-to-point flags around the pipeline
#   group's first rank (the root, which hosts stage 0 and finishes last in every
#   schedule here), on a tag of its own (``VOTE_TAG``). The receives are posted
#   when the step *starts* (``open``): the root's one per peer, each peer's
#   one for the verdict. At the end (``close``) each peer sends its one-element
#   flag, which lands in a receive posted long ago, and the root, once its own
#   step is done, sums them and sends the verdict back, again into posted
#   receives. That is ``2 (p-1)`` tiny messages and one hop after the root
#   finishes; the one-element ``all_reduce`` it replaces is, on gloo, a ring of
#   ``2 (p-1)`` sequential hops per rank (``2 p (p-1)`` messages in all), and
#   on a CPU shared by the ranks every hop is a wake-up of two processes;
# * on other backends (NCCL, HCCL, ...) it stays a one-element ``all_reduce``,
#   which is fast there, while point-to-point between non-adjacent ranks would
#   set up communicators that nothing else uses. How it is issued and read
#   decides what it costs; see [Note: vote off the compute stream].
#
# The data traffic uses tag 0 and gloo matches receives by (peer, tag), so the
# early receives never take a data message. A step that ends in a
# communication error (the process group is suspect then) leaves its posted
# receives pending; the next ``open`` reuses them instead of posting more, so
# the messages of a later vote still pair up one to one.
#
# Only when the verdict says some rank failed do the ranks gather the failure
# records (``all_gather_object``); that path is rare and its cost is irrelevant.
#
# The checks hp-core's point-to-point wrappers run per call (group membership,
# peer not self, tensor layout) hold by construction here: the group is
# resolved and the peers are the group's other ranks, computed once in
# ``__init__``; the flags are fresh contiguous int32 tensors. So ``open`` and
# ``close`` call ``torch.distributed`` directly. The all-reduce goes through
# hp-core's ``all_reduce`` (imported when called, so that hp-testing's
# ``record_collectives`` sees it and tests can count the vote).


VOTE_TAG = 0x4850  # "HP": any tag but the data transfers' 0 works; gloo keeps tags apart


# [Note: vote off the compute stream]
# The flag is a host fact (did this rank's Python raise?), but on an
# accelerator the all-reduce and the read of its result are stream work, and
# the stream decides what the host waits for. Issued on the current (compute)
# stream, as it once was, the vote cost two host syncs of the whole step's
# queued compute: ``torch.tensor([flag], device=...)`` is a blocking
# host-to-device copy, which synchronises the current stream, and ``.item()``
# copies back and synchronises the current stream again (CUDA's
# ``_local_scalar_dense`` is a ``cudaMemcpyAsync`` plus ``cudaStreamSynchronize``
# on it). ProcessGroupNCCL also makes its communication stream wait for the
# current stream when a collective is enqueued, so the all-reduce itself sat
# behind all compute queued so far. The CPU lost its run-ahead into the
# optimizer step and the next step's launches at the end of every step.
#
# So on accelerators the vote runs on a *side stream* of its own, made once per
# :class:`FailureVote`, with everything the vote does on the device inside
# ``with handle.stream(side)``:
#
# 1. ``flag.fill_(mine)`` on a device buffer allocated once: a kernel with a
#    scalar argument, no host-to-device copy and no sync;
# 2. the all-reduce: NCCL's stream now waits for the side stream only (the
#    fill), not for the compute stream;
# 3. ``work.wait()``: on NCCL/HCCL it makes the *current* stream, the side
#    stream, wait for the collective (no host block);
# 4. a ``non_blocking`` copy into a pinned host buffer allocated once, an event
#    recorded on the side stream, and ``event.synchronize()``; then the host
#    buffer is read on the CPU.
#
# Step 4 instead of ``.item()``: both block the host until the side stream
# reaches the copy, and the side stream holds only the fill, the wait for the
# collective and the copy, so both wait for the same thing. The event makes that
# scope explicit through the platform seam's generic stream and event calls on
# every backend, rather than relying on each backend's ``_local_scalar_dense``
# (torch_npu implements its own), and it reuses one pinned buffer instead of
# taking one from the host allocator per step. On CPU platforms (gloo-backed
# emulation of NCCL/HCCL included) streams and events are no-ops and this is a
# plain blocking all-reduce.
#
# What the vote still waits for, honestly: the all-reduce completes only when
# every rank's communication stream of the pipeline group reaches it, and on
# NCCL that stream is shared. A ``batch_isend_irecv`` (the executor's coalesced
# batches, [Note: coalesced batches] in :mod:`hp_pipeline.executor`) runs on the
# group's own communicator and stream, like collectives (ProcessGroupNCCL keys
# batched point-to-point by device, not by peer pair), and each batch made that
# stream wait for the compute queued before it was posted. So the vote's
# all-reduce is ordered after every rank's last transfer of the step, and the
# last transfer of a rank that ends with a send (the last stage's final gradient
# send, say) waits for the compute that produced it. The host therefore still
# waits, per step, until the GPUs have run the pipeline up to each rank's last
# transfer; what it no longer waits for is the compute a rank queued after its
# last transfer (stage 0's final backward in 1F1B, trailing weight-gradient
# passes of the zero-bubble schedules) and anything queued on the compute
# stream after the vote. HCCL (torch_npu's ProcessGroupHCCL is built on the same
# model: a communication stream per communicator that waits for the current
# stream at enqueue) is expected to behave the same; we have not measured it.
# Removing the remaining wait would need a communicator the step's transfers do
# not use (a second process group over the same ranks: an NCCL one costs a
# communicator's buffers, a gloo one makes the vote a pure host exchange); that
# is a change of the groups the pipeline is built with, not of this module.


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
        # [Note: vote off the compute stream]: made at the first all-reduce vote, then reused.
        self._handle: DeviceHandle | None = None
        self._side: StreamLike | None = None
        self._flag: torch.Tensor | None = None  # on the compute device
        self._host: torch.Tensor | None = None  # pinned when the flag is off the CPU
        self._read: EventLike | None = None

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
        from hp_core import all_gather_object

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
            failed = self._all_reduce(mine)
        if failed == 0:
            return []
        gathered = all_gather_object(None if failure is None else failure.portable(), self.group)
        return [f for f in gathered if f is not None]

    def _all_reduce(self, mine: int) -> int:
        """Sum the flags over the group on the side stream ([Note: vote off the compute stream])."""
        from hp_core import all_reduce

        if self._handle is None:
            self._setup()
        handle, side = self._handle, self._side
        flag, host, read = self._flag, self._host, self._read
        assert handle is not None and flag is not None and host is not None and read is not None
        with handle.stream(side):
            flag.fill_(mine)
            all_reduce(flag, "sum", self.group, async_op=True).wait()
            host.copy_(flag, non_blocking=True)
            read.record(side)
            read.synchronize()
            return int(host.item())  # a CPU tensor: no device sync

    def _setup(self) -> None:
        """The side stream, the flag buffers and the read event, made once per vote.

        The stream must live on the flag's device: a collective waits for the
        current stream *of its tensor's device*, so a stream on another device
        would leave the compute stream in charge.
        """
        handle = get_platform().handle
        device = torch.device(self._device() if callable(self._device) else self._device)
        side: StreamLike | None = None
        if handle.is_accelerator:
            on_accelerator = device.type == handle.current_device().type
            side = handle.new_stream(device=device if on_accelerator else None)
        with handle.stream(side):  # allocated for the side stream, their only user
            self._flag = torch.zeros(1, dtype=torch.int32, device=device)
            self._host = torch.zeros(1, dtype=torch.int32, pin_memory=device.type != "cpu")
        self._read = handle.new_event()
        self._side = side
        self._handle = handle
