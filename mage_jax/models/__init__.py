"""Decoder models: configuration, the NNX transformer, Hugging Face loading, sharding."""

from mage_jax.models.config import ModelConfig
from mage_jax.models.transformer import (
    KVCache,
    Transformer,
    init_cache,
    make_attention_mask,
    positions_from_mask,
)

__all__ = [
    "KVCache",
    "ModelConfig",
    "Transformer",
    "init_cache",
    "make_attention_mask",
    "positions_from_mask",
]
