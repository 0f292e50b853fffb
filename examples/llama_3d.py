"""The main job: a small Llama-style decoder trained with pipeline x FSDP x tensor parallelism.

Run by ``bash scripts/demo.sh`` (8 emulated ranks, then a resume on 4), or by hand:

    hp-run -n 8 --emulate nccl examples/llama_3d.py --layout 2,2,2 --steps 6 --save-at 3
    hp-run -n 4 --emulate nccl examples/llama_3d.py --layout 2,1,2 --resume demo-out/checkpoint

and unchanged on a cluster with ``torchrun``. What it composes, on a mesh
``("pp", "dp", "tp")`` made by ``hp_core.init_device_mesh``:

- tensor parallelism inside each block (hp_dtensor): q / k / v and the SwiGLU's
  gate and up projections column-wise, the output projections row-wise, so the
  attention heads (grouped-query: fewer k / v heads) are split over ``tp``;
- ``fully_shard`` on ``dp`` (hp_fsdp) for each block and each pipeline stage
  module, nested, bf16 compute with fp32 gradient reduction;
- pipeline stages on ``pp`` (hp_pipeline), two stages per rank, under
  ``--schedule``: Interleaved1F1B (default), InterleavedZeroBubble, LoopedBFS,
  ZBVZeroBubble or DualPipeV (torch's names, through ``get_schedule_class``);
- global gradient-norm clipping over every parameter of every stage, AdamW;
- a ``torch.distributed.checkpoint`` save (model and optimizer, sharded) and a
  resume on another layout that continues with the same losses;
- rank 0 trains the same model in one process on the same data (bf16 compute
  too) and prints both losses every step: the parity line.

Everything of the parallel run goes through the packages' public API.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from hp_core import DeviceMesh, get_platform, init_device_mesh, init_distributed
from hp_dtensor import ColwiseParallel, DTensor, RowwiseParallel, parallelize_module
from hp_fsdp import MixedPrecisionPolicy, fully_shard
from hp_pipeline import PipelineStage, get_schedule_class, render_order, stages_on_rank
from hp_testing import record_collectives
from torch import nn

# -- the model ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    vocab: int = 96
    dim: int = 32
    heads: int = 4
    kv_heads: int = 2
    hidden: int = 64
    layers: int = 4
    seq: int = 16
    rope_theta: float = 10000.0

    @classmethod
    def for_layout(cls, layout: tuple[int, int, int]) -> Config:
        """The default model, grown where a layout needs more: a layer per stage (two stages per
        pipeline rank), at least one k / v head per TP rank. Layouts up to 2,2,2 keep the default."""
        pp, _, tp = layout
        kv_heads = max(cls.kv_heads, tp)
        heads = max(cls.heads, kv_heads * (cls.heads // cls.kv_heads))
        return cls(layers=max(cls.layers, 2 * pp), heads=heads, kv_heads=kv_heads)


def rotary(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate pairs of features by position (RoPE); ``x`` is (batch, seq, heads, head_dim)."""
    _, seq, _, hd = x.shape
    freqs = theta ** (-torch.arange(0, hd, 2, dtype=torch.float32, device=x.device) / hd)
    angles = torch.arange(seq, dtype=torch.float32, device=x.device)[:, None] * freqs[None, :]
    cos, sin = angles.cos()[None, :, None, :].to(x.dtype), angles.sin()[None, :, None, :].to(x.dtype)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    """Grouped-query causal attention; under TP each rank holds whole heads (local views below)."""

    def __init__(self, c: Config) -> None:
        super().__init__()
        self.head_dim, self.group, self.theta = c.dim // c.heads, c.heads // c.kv_heads, c.rope_theta
        self.q = nn.Linear(c.dim, c.heads * self.head_dim, bias=False)
        self.k = nn.Linear(c.dim, c.kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(c.dim, c.kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(c.heads * self.head_dim, c.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (proj(x).view(b, s, -1, self.head_dim) for proj in (self.q, self.k, self.v))
        q, k = rotary(q, self.theta), rotary(k, self.theta)
        k, v = (t.repeat_interleave(self.group, dim=2) for t in (k, v))  # k / v head j serves group j
        out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.gate = nn.Linear(c.dim, c.hidden, bias=False)
        self.up = nn.Linear(c.dim, c.hidden, bias=False)
        self.down = nn.Linear(c.hidden, c.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.attn_norm, self.attn = nn.RMSNorm(c.dim), Attention(c)
        self.mlp_norm, self.mlp = nn.RMSNorm(c.dim), SwiGLU(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Stage(nn.Module):
    """A slice of the decoder: the embedding on the first stage, the norm and head on the last."""

    def __init__(self, c: Config, layers: int, first: bool, last: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(c.vocab, c.dim) if first else None
        self.blocks = nn.ModuleList([Block(c) for _ in range(layers)])
        self.norm = nn.RMSNorm(c.dim) if last else None
        self.head = nn.Linear(c.dim, c.vocab, bias=False) if last else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            h = self.embed(h)
        for block in self.blocks:
            h = block(h)
        if self.norm is not None and self.head is not None:
            h = self.head(self.norm(h))
        return h


def build(c: Config, num_stages: int, seed: int = 0) -> nn.Sequential:
    """The whole model as ``num_stages`` stages, identical on every rank (seeded)."""
    torch.manual_seed(seed)
    per = c.layers // num_stages
    return nn.Sequential(*[Stage(c, per, s == 0, s == num_stages - 1) for s in range(num_stages)])


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def batches(c: Config, global_batch: int, seed: int = 7) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """A synthetic corpus with structure to learn: each sequence counts up from a random start."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        start = torch.randint(0, c.vocab, (global_batch, 1), generator=gen)
        step = torch.randint(1, 4, (global_batch, 1), generator=gen)
        tokens = (start + step * torch.arange(c.seq + 1)) % c.vocab
        yield tokens[:, :-1], tokens[:, 1:]


# -- the parallel job -----------------------------------------------------------------------

SCHEDULES = ("Interleaved1F1B", "InterleavedZeroBubble", "LoopedBFS", "ZBVZeroBubble", "DualPipeV")
V_SHAPED = {"ZBVZeroBubble", "DualPipeV"}

TP_PLAN = {
    "attn.q": ColwiseParallel(),
    "attn.k": ColwiseParallel(),
    "attn.v": ColwiseParallel(),
    "attn.o": RowwiseParallel(),
    "mlp.gate": ColwiseParallel(),
    "mlp.up": ColwiseParallel(),
    "mlp.down": RowwiseParallel(),
}


def parallelize(model: nn.Sequential, mesh: DeviceMesh, local: list[int]) -> list[nn.Module]:
    """TP inside each block, then fully_shard per block and per stage (nested), bf16 compute."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    stages = []
    for s in local:
        stage = model[s]
        for block in stage.blocks:
            if mesh.size("tp") > 1:
                parallelize_module(block, mesh["tp"], TP_PLAN)
            fully_shard(block, mesh=mesh["dp"], mp_policy=policy)
        fully_shard(stage, mesh=mesh["dp"], mp_policy=policy)
        stages.append(stage)
    return stages


def clip_grad_norm(params: list[nn.Parameter], max_norm: float, pp_group: Any) -> torch.Tensor:
    """Clip by the norm over every parameter of every stage: per-parameter norms are exact DTensor
    reductions over dp and tp, their squares summed over the pipeline group."""
    squares = torch.zeros((), dtype=torch.float32)
    for p in params:
        if p.grad is not None:
            square = p.grad.float().pow(2).sum()  # a DTensor sum: partial over the shards, reduced once
            squares = squares + (square.full_tensor() if isinstance(square, DTensor) else square)
    dist.all_reduce(squares, group=pp_group)
    total = squares.sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(coef)
    return total


def optimizer_state(model: nn.Module, opt: torch.optim.Optimizer, local: list[int]) -> dict[str, Any]:
    """AdamW's state keyed by the whole model's parameter names (the same on every layout)."""
    out: dict[str, Any] = {}
    for s in local:
        for name, p in model[s].named_parameters():
            for key, value in opt.state.get(p, {}).items():
                out[f"{s}.{name}.{key}"] = value
    return out


def init_optimizer_state(model: nn.Module, opt: torch.optim.Optimizer, local: list[int]) -> None:
    """Allocate AdamW's state so a checkpoint can be loaded into it in place."""
    for s in local:
        for p in model[s].parameters():
            opt.state[p] = {
                "step": torch.zeros((), dtype=torch.float32),
                "exp_avg": torch.zeros_like(p),
                "exp_avg_sq": torch.zeros_like(p),
            }


def model_state(model: nn.Module, local: list[int]) -> dict[str, Any]:
    return {f"{s}.{k}": v for s in local for k, v in model[s].state_dict().items()}


class Reference:
    """The same model in one process on the whole batch, bf16 compute on fp32 master weights."""

    def __init__(self, model: nn.Module, lr: float, max_norm: float) -> None:
        self.model, self.max_norm = copy.deepcopy(model), max_norm
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        work = copy.deepcopy(self.model).to(torch.bfloat16)
        loss = loss_fn(work(x), y)
        loss.backward()
        for p, q in zip(self.model.parameters(), work.parameters(), strict=True):
            p.grad = q.grad.float()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm)
        self.opt.step()
        self.opt.zero_grad()
        return float(loss.detach())


@dataclass
class Args:
    layout: tuple[int, int, int]
    steps: int
    global_batch: int
    per_micro: int
    lr: float
    max_norm: float
    save_at: int
    resume: str | None
    out: str
    reference: bool
    schedule: str = "Interleaved1F1B"


def train(args: Args, c: Config | None = None) -> dict[str, Any]:
    """Run the job on the current process group; returns the per-step losses (and the reference's).

    ``c`` defaults to :meth:`Config.for_layout` of ``args.layout``."""
    pp, dp, tp = args.layout
    c = Config.for_layout(args.layout) if c is None else c
    world, rank = dist.get_world_size(), dist.get_rank()
    if pp * dp * tp != world:
        raise ValueError(f"--layout {args.layout} needs {pp * dp * tp} ranks, but {world} were started")
    if args.global_batch % (dp * args.per_micro) or (args.global_batch // (dp * args.per_micro)) % pp:
        raise ValueError(
            f"--global-batch {args.global_batch} must split into dp={dp} replicas of micro-batches of "
            f"{args.per_micro}, a multiple of pp={pp} of them; try {dp * args.per_micro * pp * 2}"
        )
    mesh = init_device_mesh(get_platform().device_type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    num_stages = 2 * pp
    style = "v" if args.schedule in V_SHAPED else "loop"  # rank r holds stages r and 2p-1-r
    local = stages_on_rank(mesh.get_local_rank("pp"), pp, 2, style=style)
    model = build(c, num_stages)
    reference = Reference(model, args.lr, args.max_norm) if args.reference and rank == 0 else None
    stage_modules = parallelize(model, mesh, local)
    pp_group = mesh["pp"].get_group()
    pipe = [
        PipelineStage(m, s, num_stages, group=pp_group) for m, s in zip(stage_modules, local, strict=True)
    ]
    micro = args.global_batch // (dp * args.per_micro)
    schedule = get_schedule_class(args.schedule)(pipe, micro, loss_fn)
    params = [p for m in stage_modules for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=args.lr)
    first_step = 0
    if args.resume:
        init_optimizer_state(model, opt, local)
        state = {"model": model_state(model, local), "optim": optimizer_state(model, opt, local)}
        dcp.load(state, checkpoint_id=args.resume)
        meta = json.loads((Path(args.resume) / "progress.json").read_text())
        first_step = meta["step"]
    out = Path(args.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        render_order(schedule.order, out / f"timeline-pp{pp}.svg", title=f"{args.schedule}, pp={pp}")
    replica = mesh.get_local_rank("dp")
    share = args.global_batch // dp  # sequences per dp replica and step: the global batch is fixed
    data = batches(c, args.global_batch)
    has_first, has_last = 0 in local, num_stages - 1 in local
    history: dict[str, Any] = {"loss": {}, "reference": {}, "layout": list(args.layout)}
    for step in range(args.steps):
        x, y = next(data)
        if step < first_step:
            if reference is not None:
                history["reference"][step] = reference.step(x, y)
            continue
        mine = slice(replica * share, (replica + 1) * share)
        losses: list[torch.Tensor] = []
        dist.barrier()
        start = time.perf_counter()
        with record_collectives() as log:
            schedule.step(
                *((x[mine],) if has_first else ()), target=y[mine] if has_last else None, losses=losses
            )
            norm = clip_grad_norm(params, args.max_norm, pp_group)
            opt.step()
            opt.zero_grad()
        elapsed = time.perf_counter() - start
        # the mean loss of the step, known on the last stage's ranks: one small sum to every rank
        report = torch.tensor([float(torch.stack(losses).mean()) if losses else 0.0, float(bool(losses))])
        dist.all_reduce(report)
        loss = float(report[0] / report[1])
        history["loss"][step] = loss
        ref = reference.step(x, y) if reference is not None else None
        if ref is not None:
            history["reference"][step] = ref
        if rank == 0:
            tokens = x.numel() / elapsed
            moved = sum(r.nbytes for r in log)
            line = f"step {step + 1:>2} | loss {loss:.4f}"
            line += f" | one process {ref:.4f} (diff {abs(loss - ref):.1e})" if ref is not None else ""
            line += f" | grad norm {float(norm):.3f} | {1e3 * elapsed:6.0f} ms | {tokens:7.0f} tok/s"
            line += f" | rank 0: {len(log)} collectives, {moved / 1024:.0f} KiB"
            print(line, flush=True)
        if args.save_at and step + 1 == args.save_at:
            target = out / "checkpoint"
            state = {"model": model_state(model, local), "optim": optimizer_state(model, opt, local)}
            dcp.save(state, checkpoint_id=target)
            if rank == 0:
                (target / "progress.json").write_text(
                    json.dumps({"step": step + 1, "layout": list(args.layout)})
                )
                print(
                    f"         saved the model and AdamW state (sharded, {world} ranks) to {target}",
                    flush=True,
                )
    history["max_param_diff"] = final_param_diff(model, local, mesh, reference)
    return history


def final_param_diff(
    model: nn.Module, local: list[int], mesh: DeviceMesh, reference: Reference | None
) -> float:
    """The largest difference between our parameters and the single-process run's (rank 0's answer).

    Each stage's full parameters are assembled on its ranks (DTensor ``full_tensor``), and the
    ranks at dp = tp = 0 of each pipeline coordinate hand them to rank 0.
    """
    full = {
        f"{s}.{name}": (p.full_tensor() if isinstance(p, DTensor) else p).detach()
        for s in local
        for name, p in model[s].named_parameters()
    }
    lead = mesh.get_local_rank("dp") == 0 and mesh.get_local_rank("tp") == 0
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, full if lead else {})
    if reference is None:
        return float("nan")
    ours = {k: v for part in gathered for k, v in part.items()}
    want = {
        f"{s}.{n}": p.detach() for s, stage in enumerate(reference.model) for n, p in stage.named_parameters()
    }
    return max(float((ours[k].float() - want[k]).abs().max()) for k in want)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layout", default="2,2,2", help="pp,dp,tp (their product is the number of ranks)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument(
        "--global-batch",
        type=int,
        default=None,
        help="sequences per step, all replicas (default: 16, or the least multiple of 16 the layout splits)",
    )
    parser.add_argument("--per-micro", type=int, default=2, help="sequences per micro-batch")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max-norm", type=float, default=1.0)
    parser.add_argument("--save-at", type=int, default=0, help="save a DCP checkpoint after this step")
    parser.add_argument("--resume", default=None, help="a checkpoint directory to continue from")
    parser.add_argument("--out", default="demo-out", help="where the timeline, losses and checkpoint go")
    parser.add_argument("--no-reference", action="store_true", help="skip the single-process run")
    parser.add_argument(
        "--schedule", default="Interleaved1F1B", choices=SCHEDULES, help="two stages per rank"
    )
    ns = parser.parse_args()
    layout = tuple(int(v) for v in ns.layout.split(","))
    if len(layout) != 3:
        parser.error(f"--layout takes pp,dp,tp, got {ns.layout!r}")
    args = Args(
        layout=layout,  # type: ignore[arg-type]
        steps=ns.steps,
        global_batch=ns.global_batch or math.lcm(16, layout[0] * layout[1] * ns.per_micro),
        per_micro=ns.per_micro,
        lr=ns.lr,
        max_norm=ns.max_norm,
        save_at=ns.save_at,
        resume=ns.resume,
        out=ns.out,
        reference=not ns.no_reference,
        schedule=ns.schedule,
    )
    init_distributed()
    history = train(args)
    if dist.get_rank() == 0:
        path = Path(args.out) / f"losses-{'resumed' if args.resume else 'run'}.json"
        path.write_text(json.dumps({"args": {**asdict(args)}, **history}))
        print(f"largest parameter difference to the single-process run: {history['max_param_diff']:.2e}")
        print(f"wrote {path}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
