"""What the generation tests share: a 2-layer random decoder of a 64-token vocabulary (built once per
worker), and its ``ModelSpec`` at the prompt buckets a test file needs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from flax import nnx

from mage_jax.generate.spec import ModelSpec
from mage_jax.models.config import ModelConfig
from mage_jax.models.transformer import Transformer

VOCAB, EOS, PAD = 64, 3, 0
TINY = dict(vocab_size=VOCAB, num_layers=2, hidden_size=64, intermediate_size=128)
"""``ModelConfig.preset("tiny")`` overrides of the decoder the generation tests share."""


@pytest.fixture(scope="session")
def tiny_model() -> tuple[ModelConfig, Any, Any]:
    """(config, graphdef, state) of the shared random decoder."""
    config = ModelConfig.preset("tiny", **TINY)
    graphdef, state = nnx.split(Transformer(config, rngs=nnx.Rngs(0)))
    return config, graphdef, state


def spec_of(model: tuple[ModelConfig, Any, Any], prompt_buckets: Sequence[int], **options: Any) -> ModelSpec:
    """The ``ModelSpec`` of ``model`` (``tiny_model``) with end of sequence ``EOS``, padding ``PAD`` and
    ``prompt_buckets`` (``options``: mesh, cache dtype, ...)."""
    config, graphdef, _ = model
    return ModelSpec(graphdef, config, eos_ids=(EOS,), pad_id=PAD, prompt_buckets=tuple(prompt_buckets),
                     **options)
