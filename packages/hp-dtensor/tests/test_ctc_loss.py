"""CTC loss over a batch cut: values and gradients against plain autograd, no collective, no fallback.

``_ctc_loss_backward`` has no meta kernel, so its rule gives the output's
global meta itself ([Note: rule-supplied metas] in ``hp_dtensor.ops.calls``);
``log_alpha`` is padded to the batch's longest target on a rank whose targets
are shorter. Five samples over two ranks (3 and 2), target lengths that differ
between the ranks, padded and concatenated targets, every reduction.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hp_dtensor import Replicate, Shard, distribute_tensor, fallback_policy
from hp_testing import record_collectives

aten = torch.ops.aten
STEPS, BATCH, CLASSES, LONGEST = 7, 5, 6, 4
INPUT_LENGTHS = [7, 6, 7, 5, 7]
TARGET_LENGTHS = [1, 2, 1, 4, 3]  # rank 0's longest is 2, rank 1's is 4


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    logits = torch.randn(STEPS, BATCH, CLASSES, dtype=torch.float64)
    return logits, torch.randint(1, CLASSES, (BATCH, LONGEST))


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("concatenated", [False, True], ids=["padded", "concatenated"])
def test_batch_cut_matches_plain(rank, device_mesh_factory, reduction, concatenated) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((2,))
    logits, padded = _data()
    targets = torch.cat([padded[i, :n] for i, n in enumerate(TARGET_LENGTHS)]) if concatenated else padded
    ref = logits.clone().requires_grad_()
    expected = F.ctc_loss(ref.log_softmax(2), targets, INPUT_LENGTHS, TARGET_LENGTHS, reduction=reduction)
    (expected * 1.5).sum().backward()
    ours = distribute_tensor(logits, mesh, [Shard(1)]).requires_grad_()
    with fallback_policy("error"), record_collectives() as forward:
        loss = F.ctc_loss(ours.log_softmax(2), targets, INPUT_LENGTHS, TARGET_LENGTHS, reduction=reduction)
    assert len(forward) == 0, forward
    torch.testing.assert_close(loss.full_tensor(), expected.detach())
    with fallback_policy("error"), record_collectives() as backward:
        (loss * 1.5).sum().backward()
    assert len(backward) == 0, backward
    assert ours.grad is not None and ours.grad.placements == (Shard(1),)
    torch.testing.assert_close(ours.grad.full_tensor(), ref.grad)


@pytest.mark.distributed(world_size=2)
def test_ops_and_log_alpha_width(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    """The aten ops themselves: each output cut on the batch, log_alpha as wide as the whole batch needs."""
    mesh = device_mesh_factory((2,))
    logits, targets = _data()
    log_probs = logits.log_softmax(2)
    nll, alpha = aten._ctc_loss.default(log_probs, targets, INPUT_LENGTHS, TARGET_LENGTHS, 0, False)
    ours = distribute_tensor(log_probs, mesh, [Shard(1)])
    grad = distribute_tensor(torch.ones(BATCH, dtype=torch.float64), mesh, [Replicate()])
    with fallback_policy("error"), record_collectives() as log:
        d_nll, d_alpha = aten._ctc_loss.default(ours, targets, INPUT_LENGTHS, TARGET_LENGTHS, 0, False)
        d_grad = aten._ctc_loss_backward.default(
            grad, ours, targets, INPUT_LENGTHS, TARGET_LENGTHS, d_nll, d_alpha, 0, False
        )
    assert len(log) == 0, log
    assert d_nll.placements == d_alpha.placements == (Shard(0),) and d_grad.placements == (Shard(1),)
    assert d_alpha.shape == alpha.shape == (BATCH, STEPS, 2 * LONGEST + 1)
    torch.testing.assert_close(d_nll.full_tensor(), nll)
    full_alpha = d_alpha.full_tensor()
    for i, n in enumerate(TARGET_LENGTHS):  # the entries the dynamic program defines
        steps, width = INPUT_LENGTHS[i], 2 * n + 1
        torch.testing.assert_close(full_alpha[i, :steps, :width], alpha[i, :steps, :width])
    ones = torch.ones(BATCH, dtype=torch.float64)
    plain_grad = aten._ctc_loss_backward.default(
        ones, log_probs, targets, INPUT_LENGTHS, TARGET_LENGTHS, nll, alpha, 0, False
    )
    torch.testing.assert_close(d_grad.full_tensor(), plain_grad)


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("concatenated", [False, True], ids=["padded", "concatenated"])
def test_tensor_lengths(rank, device_mesh_factory, concatenated) -> None:  # type: ignore[no-untyped-def]
    """Lengths as tensors (``_ctc_loss.Tensor``): log_alpha's width read from their values, per call."""
    mesh = device_mesh_factory((2,))
    logits, padded = _data()
    targets = torch.cat([padded[i, :n] for i, n in enumerate(TARGET_LENGTHS)]) if concatenated else padded
    ref = logits.clone().requires_grad_()
    for lengths in (TARGET_LENGTHS, [1, 2, 1, 2, 1]):  # the second call's longest target is shorter
        if concatenated:
            targets = torch.cat([padded[i, :n] for i, n in enumerate(lengths)])
        inputs, target_lengths = torch.tensor(INPUT_LENGTHS), torch.tensor(lengths)
        ref.grad = None
        expected = F.ctc_loss(ref.log_softmax(2), targets, inputs, target_lengths)
        expected.backward()
        ours = distribute_tensor(logits, mesh, [Shard(1)]).requires_grad_()
        with fallback_policy("error"), record_collectives() as log:
            nll, alpha = aten._ctc_loss.Tensor(ours.log_softmax(2), targets, inputs, target_lengths, 0, False)
            loss = F.ctc_loss(ours.log_softmax(2), targets, inputs, target_lengths)
            loss.backward()
        assert len(log) == 0, log
        assert alpha.shape == (BATCH, STEPS, 2 * max(lengths) + 1) and nll.placements == (Shard(0),)
        torch.testing.assert_close(loss.full_tensor(), expected.detach())
        assert ours.grad is not None
        torch.testing.assert_close(ours.grad.full_tensor(), ref.grad)
