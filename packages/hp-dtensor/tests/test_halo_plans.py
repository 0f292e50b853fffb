"""Halo plans in one process: the op on each rank's extended rows gives exactly that rank's outputs.

For random lengths, rank counts, kernels, strides, paddings, dilations,
``ceil_mode`` / ``count_include_pad`` / ``output_padding``, the plan of
:func:`hp_dtensor.ops.halo.plan_line` is checked against the op on the whole
row: for every rank, the op run on input rows ``[e0, e1)`` with its own
arguments, cut to ``[O_r - c, O_r+1 - c)``, equals the whole op's outputs
``[O_r, O_r+1)``. Convolutions, transposed convolutions, max and average
pooling (1-D: the planning is per dim). No plan means the caller gathers,
which is right by construction; the test also checks that most cases get one.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch
import torch.nn.functional as F
from hp_dtensor.ops.halo import Window, plan_line


def _cases(seed: int, n: int) -> list[tuple[str, Window, Callable[[torch.Tensor], torch.Tensor], int, int]]:
    rng = random.Random(seed)
    weight = torch.randn(2, 2, 5, dtype=torch.float64)
    cases = []
    for _ in range(n):
        kind = rng.choice(["conv", "transposed", "max", "avg"])
        kernel, stride, dilation = rng.randint(1, 5), rng.randint(1, 3), rng.randint(1, 2)
        length, ranks = rng.randint(4, 24), rng.randint(2, 4)
        if kind == "conv":
            pad = rng.randint(0, 3)
            w = weight[..., :kernel]
            fn = lambda x, w=w, s=stride, p=pad, d=dilation: F.conv1d(x, w, stride=s, padding=p, dilation=d)  # noqa: E731
            window = Window(dilation * (kernel - 1) + 1, stride, pad)
        elif kind == "transposed":
            pad = rng.randint(0, 3)
            extra = rng.randint(0, max(stride, dilation) - 1)
            w = weight[..., :kernel]

            def fn(x, w=w, s=stride, p=pad, d=dilation, o=extra):  # type: ignore[no-untyped-def]
                return F.conv_transpose1d(x, w, stride=s, padding=p, dilation=d, output_padding=o)

            window = Window(dilation * (kernel - 1) + 1, stride, pad, transposed=True, output_padding=extra)
        else:
            pad = rng.randint(0, kernel // 2)
            ceil = rng.random() < 0.5
            if kind == "max":

                def fn(x, k=kernel, s=stride, p=pad, d=dilation, c=ceil):  # type: ignore[no-untyped-def]
                    return F.max_pool1d(x, k, s, p, dilation=d, ceil_mode=c)

                window = Window(dilation * (kernel - 1) + 1, stride, pad, ceil)
            else:
                include = rng.random() < 0.5

                def fn(x, k=kernel, s=stride, p=pad, c=ceil, i=include):  # type: ignore[no-untyped-def]
                    return F.avg_pool1d(x, k, s, p, ceil_mode=c, count_include_pad=i)

                window = Window(kernel, stride, pad, ceil)
        cases.append((kind, window, fn, length, ranks))
    return cases


def test_each_rank_computes_its_own_outputs_from_its_extended_rows() -> None:
    torch.manual_seed(0)
    planned = tried = 0
    for kind, window, fn, length, ranks in _cases(0, 300):
        x = torch.randn(1, 2, length, dtype=torch.float64)
        try:
            whole = fn(x)
        except RuntimeError:
            continue  # arguments the op refuses on the whole row (output too small)
        tried += 1
        assert whole.shape[-1] == window.count(length), (kind, window, length)
        plan = plan_line(length, ranks, window)
        if plan is None:
            continue
        planned += 1
        for r in range(ranks):
            e0, e1 = plan.ends[r]
            assert plan.starts[max(r - 1, 0)] <= e0 and e1 <= plan.starts[min(r + 2, ranks)]
            local = fn(x[..., e0:e1])
            first, stop = plan.outs[r] - plan.shift[r], plan.outs[r + 1] - plan.shift[r]
            where = f"{kind} {window} L={length} ranks={ranks} r={r} rows [{e0}, {e1})"
            got, want = local[..., first:stop], whole[..., plan.outs[r] : plan.outs[r + 1]]
            assert got.shape == want.shape and torch.allclose(got, want), where
    assert tried > 150 and planned > tried // 2, (tried, planned)


def test_plans_need_rows_from_neighbours_only_and_no_empty_pieces() -> None:
    # 1 output over 2 ranks: a rank would have nothing to compute
    assert plan_line(5, 2, Window(3, 3, 0)) is None
    # a 7-row window over pieces of 2 rows reaches past the neighbour
    assert plan_line(8, 4, Window(7, 1, 3)) is None
    # 9 rows over 4 ranks by torch.chunk: 3, 3, 3, 0
    assert plan_line(9, 4, Window(3, 1, 1)) is None
    plan = plan_line(16, 2, Window(3, 1, 1))
    assert plan is not None and plan.ends == ((0, 9), (7, 16))
