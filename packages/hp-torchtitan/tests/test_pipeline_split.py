"""Single-process checks of hp's pipelining function: torchtitan's stage split, the parts, the refusals.

The multi-process parity (hp_pipeline against torchtitan's ``pipeline_llm``) is in
``test_parity.py``; here, what can be checked without a process group: which modules land on
which stage (the same as torchtitan's rules, written out by hand), that the model parts chained
compute exactly what the whole model computes (values and gradients), and that what the
pipelining function cannot do is refused before it builds anything.
"""

from __future__ import annotations

import types

import pytest
import torch


def _layers(*indices: int) -> list[str]:
    return [f"layers.{i}" for i in indices]


@pytest.mark.parametrize(
    ("num_stages", "weights", "expected"),
    [
        # debugmodel (6 layers), Interleaved1F1B on pp=2: 4 stages of 2 effective layers each
        (
            4,
            (1, 1),
            [["tok_embeddings", *_layers(0)], _layers(1, 2), _layers(3, 4), [*_layers(5), "norm", "lm_head"]],
        ),
        (2, (1, 1), [["tok_embeddings", *_layers(0, 1, 2)], [*_layers(3, 4, 5), "norm", "lm_head"]]),
        # 8 effective layers over 3 stages: the first two take the extra one
        (3, (1, 1), [["tok_embeddings", *_layers(0, 1)], _layers(2, 3, 4), [*_layers(5), "norm", "lm_head"]]),
        # heavier ends: 10 effective layers, 5 a stage, 2 of them the embedding / the head
        (2, (2, 2), [["tok_embeddings", *_layers(0, 1, 2)], [*_layers(3, 4, 5), "norm", "lm_head"]]),
        (1, (1, 1), [["tok_embeddings", *_layers(0, 1, 2, 3, 4, 5), "norm", "lm_head"]]),
    ],
)
def test_stage_split_follows_torchtitans_rules(
    num_stages: int, weights: tuple[int, int], expected: list[list[str]]
) -> None:
    from hp_torchtitan.pipeline import decoder_stage_fqns

    assert decoder_stage_fqns(num_stages, 6, *weights) == expected


def test_impossible_splits_are_refused() -> None:
    from hp_torchtitan.pipeline import decoder_stage_fqns

    with pytest.raises(ValueError, match=r"9 stages for 8 effective layers .* leaves stages empty"):
        decoder_stage_fqns(9, 6)
    with pytest.raises(ValueError, match=r"weight of 3 exceeds the 2 layers a stage gets"):
        decoder_stage_fqns(4, 4, 3, 1)


def test_model_parts_chained_compute_the_whole_model() -> None:
    """The parts of a 4-stage split, run one after another, give the whole model's logits and gradients."""
    import hp_torchtitan
    from hp_torchtitan.pipeline import decoder_stage_fqns, split_decoder
    from hp_torchtitan.spec import with_sdpa_attention

    spec = with_sdpa_attention(hp_torchtitan.hp_llama3_spec("debugmodel"))
    torch.manual_seed(0)
    whole = spec.model.build()
    with torch.no_grad():
        whole.init_weights(buffer_device=None)
    fqns = decoder_stage_fqns(4, len(spec.model.layers))
    parts = [split_decoder(whole, names) for names in fqns]

    names = [sorted(n for n, _ in part.named_parameters()) for part in parts]
    assert sorted(n for group in names for n in group) == sorted(n for n, _ in whole.named_parameters())
    assert names[1] == sorted(n for n, _ in whole.layers["1"].named_parameters(prefix="layers.1")) + sorted(
        n for n, _ in whole.layers["2"].named_parameters(prefix="layers.2")
    )

    tokens = torch.randint(0, 2048, (2, 16))
    positions = torch.arange(16).expand(2, 16)
    expected = whole(tokens, positions=positions)
    h = tokens
    for part in parts:
        h = part(h, positions=positions)
    torch.testing.assert_close(h, expected, rtol=0, atol=0)

    expected.square().mean().backward()
    h.square().mean().backward()
    grads = {n: p.grad for part in parts for n, p in part.named_parameters()}
    for name, param in whole.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=0, atol=0, msg=name)


def _pipelining_call(**parallelism_overrides):  # type: ignore[no-untyped-def]
    import hp_torchtitan
    from hp_torchtitan.pipeline import pipeline_decoder
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig

    spec = hp_torchtitan.hp_llama3_spec("debugmodel")
    options = {"spmd_backend": "partial_dtensor", "pipeline_parallel_degree": 2, **parallelism_overrides}
    untouched = torch.nn.Linear(2, 2)  # nothing may be split or parallelized before the refusal
    return pipeline_decoder(
        untouched,
        parallel_dims=types.SimpleNamespace(pp=2),
        training=TrainingConfig(local_batch_size=4),
        parallelism=ParallelismConfig(**options),
        compile_config=CompileConfig(),
        ac_config=None,
        dump_folder="unused",
        device=torch.device("cpu"),
        model_config=spec.model,
        parallelize_fn=hp_torchtitan.parallelize_decoder,
        loss_fn=lambda *args: None,
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"pipeline_parallel_schedule_csv": "order.csv"}, r"pipeline_parallel_schedule_csv='order.csv'"),
        ({"pipeline_parallel_microbatch_size": 3}, r"local_batch_size=4 is not a multiple of .*size=3"),
        ({"pipeline_parallel_schedule": "Threefold"}, r"Threefold"),
        (
            {"pipeline_parallel_schedule": "Interleaved1F1B", "pipeline_parallel_layers_per_stage": 3},
            r"layers_per_stage=3 cuts 6 layers into 3 stages, which pp=2 does not divide",
        ),
        (
            {"pipeline_parallel_schedule": "Interleaved1F1B", "pipeline_parallel_layers_per_stage": 4},
            r"runs 2 or more stages per rank but pipeline_parallel_layers_per_stage=4 gives 1",
        ),
        (
            {"pipeline_parallel_schedule": "1F1B", "pipeline_parallel_layers_per_stage": 2},
            r"runs one stage per rank but pipeline_parallel_layers_per_stage=2 gives 2; raise it to 3",
        ),
        (
            {"module_fqns_per_model_part": [["tok_embeddings"], ["layers.0"], ["norm"]]},
            r"3 model parts for pp=2",
        ),
    ],
)
def test_what_cannot_be_pipelined_is_refused_before_anything_is_built(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _pipelining_call(**overrides)


def test_hp_spec_pipelines_with_hp_pipeline() -> None:
    import hp_torchtitan

    spec = hp_torchtitan.hp_llama3_spec("debugmodel")
    assert spec.pipelining_fn is hp_torchtitan.pipeline_decoder
    assert spec.parallelize_fn is hp_torchtitan.parallelize_decoder


def test_train_losses_points_pipelined_runs_to_train_model_parts() -> None:
    from hp_torchtitan.driver import RunConfig, train_losses

    with pytest.raises(
        ValueError, match=r"config.pp=2 gives each rank its stages' model parts.*train_model_parts"
    ):
        train_losses(object(), [], {}, RunConfig(pp=2))
