"""torch's ``clip_grad_norm_`` and AdamW (fused, foreach, for-loop) on FSDP x TP and FSDP parameters.

DESIGN promises that torch's optimizers and ``torch.nn.utils.clip_grad_norm_``
work on sharded parameters at torch's bytes, with no gathering fallback. Under
FSDP x TP the parameters of one model live on three meshes: ``("dp",)`` for
the plain ones (norms, embedding, head), ``("dp", "tp")`` for row-wise weights
and the permuted ``("tp", "dp")`` for column-wise weights, which TP and FSDP
both cut on dim 0 ([Note: FSDP x TP] in ``hp_fsdp.param``). torch groups all
of them into one ``_foreach_norm`` / ``_foreach_mul_`` / ``_fused_adamw_`` call
(one device, one dtype), so the DTensor ops must take lists that mix meshes.
torch's own FSDP2 x TP cannot mix a 1-D and a 2-D mesh in ``clip_grad_norm_``
(its ``stack`` of the norms refuses); torchtitan therefore replicates the
layers TP does not cut over ``tp`` (``layout="all-2d"`` here: every parameter
on a 2-D mesh, ours ``("dp", "tp")`` or the permuted ``("tp", "dp")``),
which is the case at torch's parity. The plan alone, the other layers plain,
mixes ``("dp",)`` with the 2-D mesh: a DTensor on ``("dp",)`` is not known to
be equal across ``tp``, so hp refuses it as torch does, on every rank, with
torchtitan's fix in the message (the last test).

Each case trains examples/llama_3d.py's decoder (embedding, Llama blocks with
grouped-query attention heads and the SwiGLU split over ``tp``, RMSNorms,
head) for a few steps, clipping at a norm small enough that every step clips,
against a deep copy trained in one process on the whole batch (float64, so
the comparison is about the algorithm, not rounding): the loss of every
step, the total norm ``clip_grad_norm_`` returns, every parameter after the
step. The clipping and the optimizer step are recorded apart. torch's FSDP2
x TP clips with one all-reduce per mesh dim, of the stacked per-parameter
norms (benchmarks/dtensor_step.py counts it); ours must issue as many or
fewer, each of one scalar (the total norm is a sum over every rank's shards,
partial on each mesh dim, so one number per dim is all it needs), and
nothing else: no all-gather, no reduce-scatter; the optimizer step issues no
collective at all. The forward, the backward, the clipping and the step all run
under hp_dtensor's ``fallback_policy("error")``: an op without a sharding rule
raises, naming itself, instead of gathering.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import hp_core
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hp_dtensor import DTensor, Replicate, distribute_module, fallback_policy, parallelize_module
from hp_fsdp import fully_shard
from hp_testing import CollectiveLog, record_collectives
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from llama_3d import TP_PLAN, Config, Stage

CONFIG = Config(vocab=24, dim=16, heads=4, kv_heads=2, hidden=24, layers=2, seq=6)
PER_RANK = 2  # sequences per data-parallel rank and step
STEPS = 3
LR = 1e-2
# The reference's total norm is 0.93-1.0 over the three steps: every step clips (checked below).
MAX_NORM = 0.5
RTOL, ATOL = 1e-9, 1e-12  # float64; the differences are summation orders only

# AdamW flavour -> (AdamW's keyword, clip_grad_norm_'s ``foreach``). The fused case calls
# clip_grad_norm_ exactly as users do (its default picks foreach when the grads allow it);
# the other two pin clip_grad_norm_'s own path to match, so each of its paths is covered too.
OPTIMIZERS: dict[str, tuple[dict[str, bool], bool | None]] = {
    "fused": ({"fused": True}, None),
    "foreach": ({"foreach": True}, True),
    "forloop": ({"foreach": False}, False),
}


def _build() -> nn.Module:
    """The whole decoder as one stage (embedding, blocks, norm, head), float64, the same on every rank."""
    torch.manual_seed(0)
    return Stage(CONFIG, CONFIG.layers, first=True, last=True).double()


def _batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(500 + step)
    tokens = torch.randint(0, CONFIG.vocab, (n, CONFIG.seq + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _norm_groups(mesh: Any) -> set[tuple[int, ...]]:
    """The groups the norm may be reduced over: each mesh dim's, or all the mesh's ranks at once."""
    groups = {tuple(dist.get_process_group_ranks(mesh.get_group(d))) for d in range(mesh.ndim)}
    return groups | {tuple(sorted(int(r) for r in mesh.mesh.flatten()))}


def _check_clip_traffic(log: CollectiveLog, mesh: Any, where: str) -> None:
    """The figure for ``clip_grad_norm_``: the total norm is a sum over every rank's shards,
    partial on each mesh dim, so it costs one all-reduce of one scalar per mesh dim, or a single
    one over all the mesh's ranks, and nothing else (scaling the gradients is local). torch's
    own issues the same count, of the vector of per-parameter norms instead of one scalar.

    Here, float64 gradients: 1 x 8 B over dp for FSDP alone; 1 or 2 x 8 B (over dp and tp, or
    once over the 4 ranks) for FSDP x TP on the 2 x 2 mesh.
    """
    itemsize = torch.empty((), dtype=torch.float64).element_size()
    others = {name: n for name, n in log.counts().items() if name != "all_reduce"}
    assert not others, f"{where}: clip_grad_norm_ issued {dict(log.counts())}; expected all_reduce only"
    reduces = log.of("all_reduce")
    seen = [(r.group_ranks, r.nbytes) for r in reduces]
    assert 1 <= len(reduces) <= mesh.ndim, (
        f"{where}: clip_grad_norm_ issued {len(reduces)} all-reduces (group, bytes) {seen}; expected 1 to "
        f"{mesh.ndim}: one scalar per mesh dim the norm is partial on"
    )
    allowed = _norm_groups(mesh)
    assert all(r.nbytes == itemsize and r.group_ranks in allowed for r in reduces), (
        f"{where}: clip_grad_norm_'s all-reduces (group, bytes) {seen}; expected {itemsize} B scalars "
        f"over one of {sorted(allowed)}"
    )


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def _train(model: nn.Module, reference: nn.Module, mesh: Any, optim: str, where: str) -> None:
    """``STEPS`` steps of ``model`` (already sharded) against ``reference``, its copy in one process."""
    dp_rank, dp_world = mesh.get_local_rank("dp"), mesh.size("dp")
    adam_kwargs, clip_foreach = OPTIMIZERS[optim]
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, **adam_kwargs)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.1, foreach=False)
    dp_group = mesh["dp"].get_group() if mesh.ndim > 1 else mesh.get_group()
    for step in range(STEPS):
        tokens, targets = _batch(step, dp_world * PER_RANK)
        ref_loss = _loss(reference, tokens, targets)
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM, foreach=False)
        assert ref_norm > MAX_NORM, f"step {step}: norm {float(ref_norm)} does not clip; lower MAX_NORM"
        ref_opt.step()
        ref_opt.zero_grad()

        mine = slice(dp_rank * PER_RANK, (dp_rank + 1) * PER_RANK)
        with fallback_policy("error"):  # forward and backward too: every op has a rule
            loss = _loss(model, tokens[mine], targets[mine])
            loss.backward()
        at = f"{where} step {step}"
        # hp_dtensor's "error" policy: an op without a sharding rule raises (naming it) instead of
        # gathering its inputs; the counts below would show the gathers too.
        with fallback_policy("error"):
            with record_collectives() as clip_log:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, foreach=clip_foreach)
            _check_clip_traffic(clip_log, mesh, at)
            with record_collectives() as step_log:
                opt.step()
        # the optimizer step is elementwise on the shards: torch's issues no collective at all
        assert len(step_log) == 0, f"{at}: AdamW.step communicated: {dict(step_log.counts())}"
        opt.zero_grad()

        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss, group=dp_group)
        _close(mean_loss / dp_world, ref_loss.detach(), f"{at}: loss")
        _close(_full(norm), ref_norm, f"{at}: total norm")
        want = dict(reference.named_parameters())
        for name, p in model.named_parameters():
            assert isinstance(p, DTensor), f"{at}: {name} is not a sharded parameter"
            _close(p.full_tensor(), want[name].detach(), f"{at}: {name} after the step")


def _replicated_input(module: nn.Module, inputs: tuple[Any, ...], mesh: Any) -> tuple[Any, ...]:
    return tuple(DTensor.from_local(x, mesh, [Replicate()]) for x in inputs)


def _local_output(module: nn.Module, output: Any, mesh: Any) -> Any:
    return output.to_local()


def _replicate_over_tp(model: nn.Module, tp_mesh: Any) -> None:
    """The layers TP does not cut (embedding, RMSNorms, head) replicated over ``tp``, torchtitan's way."""
    others = [model.embed, model.norm, model.head]
    others += [norm for block in model.blocks for norm in (block.attn_norm, block.mlp_norm)]
    for module in others:
        distribute_module(module, tp_mesh, input_fn=_replicated_input, output_fn=_local_output)


def _fsdp_x_tp(mesh: Any, replicate_plain_layers: bool) -> tuple[nn.Module, nn.Module]:
    """The model under TP on ``mesh["tp"]`` and fully_shard on ``mesh["dp"]``, and its plain copy."""
    model = _build()
    reference = copy.deepcopy(model)
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], TP_PLAN)
    if replicate_plain_layers:
        _replicate_over_tp(model, mesh["tp"])
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model, reference


@pytest.mark.distributed(world_size=4, timeout=240)
@pytest.mark.parametrize("optim", sorted(OPTIMIZERS))
def test_fsdp_x_tp_clip_grad_norm_and_adamw(rank: int, device_mesh_factory: Any, optim: str) -> None:
    """dp=2 x tp=2: the parameters span ("dp", "tp") and the permuted ("tp", "dp"), one foreach list."""
    mesh = device_mesh_factory((2, 2), ("dp", "tp"))
    model, reference = _fsdp_x_tp(mesh, replicate_plain_layers=True)
    meshes = {p.device_mesh.mesh_dim_names for p in model.parameters()}
    assert meshes == {("dp", "tp"), ("tp", "dp")}, meshes  # what the case is about
    _train(model, reference, mesh, optim, f"fsdp x tp, {optim} AdamW")


@pytest.mark.distributed(world_size=4, timeout=240)
def test_fsdp_x_tp_with_plain_layers_on_the_dp_mesh_is_refused_with_the_fix(
    rank: int, device_mesh_factory: Any
) -> None:
    """Parameters on ("dp",) and on the 2-D mesh in one clip: refused on every rank, naming the fix."""
    mesh = device_mesh_factory((2, 2), ("dp", "tp"))
    model, _ = _fsdp_x_tp(mesh, replicate_plain_layers=False)
    meshes = {p.device_mesh.mesh_dim_names for p in model.parameters()}
    assert meshes == {("dp",), ("dp", "tp"), ("tp", "dp")}, meshes
    tokens, targets = _batch(0, mesh.size("dp") * PER_RANK)
    _loss(model, tokens[:PER_RANK], targets[:PER_RANK]).backward()
    with fallback_policy("error"), record_collectives() as log:
        with pytest.raises(ValueError, match=r"not known to be equal across \('tp',\).*distribute_module"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    assert not any(r.name == "all_gather_into_tensor" for r in log), dict(log.counts())
    assert hp_core.all_gather_object("refused") == ["refused"] * 4


@pytest.mark.distributed(world_size=2, timeout=240)
def test_fsdp_clip_grad_norm_and_fused_adamw(rank: int, device_mesh_factory: Any) -> None:
    """FSDP alone (dp=2): one mesh; the norm is partial on dp, one scalar all-reduce."""
    mesh = device_mesh_factory((2,), ("dp",))
    model = _build()
    reference = copy.deepcopy(model)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _train(model, reference, mesh, "fused", "fsdp, fused AdamW")
