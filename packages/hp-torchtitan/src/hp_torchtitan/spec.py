"""The "hp_llama3" model spec: torchtitan's Llama 3 with hp's parallelize function.

torchtitan 0.3.0 has no train-spec registry any more (0.2.x's
``register_train_spec`` is gone): a model is a ``ModelSpec`` that a
``config_registry`` function puts into ``Trainer.Config.model_spec``, chosen
on the command line with ``--module <python module> --config <function>``.
The spec here is torchtitan's own Llama 3 spec (same architecture config,
same initialisation, same state-dict adapter) with ``parallelize_fn`` swapped
for :func:`hp_torchtitan.parallelize.parallelize_decoder` and ``pipelining_fn``
for :func:`hp_torchtitan.pipeline.pipeline_decoder` (hp_pipeline's stages and
schedules, each stage's part parallelized by the former).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from hp_torchtitan.parallelize import parallelize_decoder
from hp_torchtitan.pipeline import pipeline_decoder

SPEC_NAME = "hp_llama3"


def with_sdpa_attention(spec: Any) -> Any:
    """A copy of ``spec`` whose attention layers use causal SDPA instead of flex attention.

    [Note: SDPA on CPU]
    torch 2.13's ``flex_attention`` has no backward on CPU ("FlexAttention does
    not support backward on CPU"), and torchtitan 0.3.0 builds language models
    with flex or varlen attention only. torchtitan's own graph_trainer tests
    swap each layer's ``inner_attention`` for ``ScaledDotProductAttention`` the
    same way; with one document per row (positions restarting at 0) causal SDPA
    computes what the document-causal flex mask does.
    """
    from torchtitan.models.common.attention import ScaledDotProductAttention

    model = copy.deepcopy(spec.model)
    for layer in model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return dataclasses.replace(spec, model=model)


def hp_llama3_spec(flavor: str = "debugmodel", **model_options: Any) -> Any:
    """torchtitan's Llama 3 ``ModelSpec`` for ``flavor``, parallelized by hp's packages.

    ``model_options`` go to torchtitan's ``llama3.model_registry`` unchanged
    (``attn_backend``, ``converters``, ...).
    """
    from torchtitan.models.llama3 import llama3_configs, model_registry

    if flavor not in llama3_configs:
        raise ValueError(
            f"hp_llama3_spec: unknown Llama 3 flavor {flavor!r}; torchtitan defines {sorted(llama3_configs)}."
        )
    torch_spec = model_registry(flavor, **model_options)
    return dataclasses.replace(
        torch_spec,
        name=SPEC_NAME,
        parallelize_fn=parallelize_decoder,
        pipelining_fn=pipeline_decoder,
    )
