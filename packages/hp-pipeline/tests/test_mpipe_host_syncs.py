"""An MPipe step with a token-normalised loss makes no host sync after the first (2 ranks).

The count of valid tokens is summed over the group and divides the gradients
and losses on the device; ``last_token_count`` reads it only when asked. The
tower's gradient flags are read only by a rank that lacked a gradient (see
``MPipeRunner._unpack_reduced``). Counted with :func:`hp_testing.count_host_syncs`;
the end-of-step failure vote is the one read by design
([Note: vote off the compute stream] in ``hp_pipeline/vote.py``). Gradients
and the token count against a single-process reference.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from hp_pipeline import PipelineStage, ScheduleMPipe
from hp_testing import count_host_syncs

sys.path.insert(0, str(Path(__file__).parent))
from mpipe_testlib import token_sum
from test_mpipe_distributed import build_model, make_samples, ref_logits

VOTE = ["hp_pipeline/vote.py:close"]


@pytest.mark.distributed(world_size=2, timeout=120)
def test_token_normalised_mpipe_step_makes_no_host_sync(rank: int, world_size: int) -> None:
    tower, modules = build_model(2, frozen=False)
    ref_tower, ref_stages = copy.deepcopy(tower), copy.deepcopy(modules)
    mine = copy.deepcopy(modules[rank])
    replica = copy.deepcopy(tower)
    schedule = ScheduleMPipe(
        PipelineStage(mine, rank, 2), 2, preprocess=replica, loss_fn=token_sum, normalize_by_tokens=True
    )
    data = make_samples(4)
    tokens = int((data.labels != -100).sum())
    ref_loss = token_sum(ref_logits(ref_tower, ref_stages, data.pixels, data.ids), data.labels) / tokens
    ref_loss.backward()
    for step in range(3):
        mine.zero_grad()
        replica.zero_grad()
        with count_host_syncs(allow=VOTE) as log:
            schedule.step(data.ids, target=data.labels, preprocess_inputs=data.pixels)
        if step:  # the first step agrees on the schedule and learns the shapes, once
            assert log.count == 0, log.report()
        assert schedule.last_token_count == tokens
        for name, p in mine.named_parameters():
            want = dict(ref_stages[rank].named_parameters())[name].grad
            torch.testing.assert_close(p.grad, want, rtol=1e-7, atol=1e-9, msg=f"step {step}: {name}")
        for name, p in replica.named_parameters():
            want = dict(ref_tower.named_parameters())[name].grad
            torch.testing.assert_close(p.grad, want, rtol=1e-7, atol=1e-9, msg=f"step {step}: tower {name}")
