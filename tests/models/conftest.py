"""Tiny random Hugging Face checkpoints built locally (nothing is downloaded)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.optional import require

ARCHS = ("qwen3", "qwen2", "llama")
LLAMA3_ROPE = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    # Short enough that all three frequency bands (kept, interpolated, divided) occur at head_dim 16.
    "original_max_position_embeddings": 16,
}


def build_hf_model(arch: str, tie: bool, *, vocab: int = 97, seed: int = 0, **overrides):
    """A 2-layer, hidden-64, GQA (4 query / 2 kv heads) model with weights large enough that any
    mistake in norms, biases or RoPE moves the logits well beyond the test tolerance."""
    torch = require("torch")
    import transformers

    common = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=tie,
        max_position_embeddings=4096,
    )
    if arch == "qwen3":
        config = transformers.Qwen3Config(**common, **overrides)
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**common, **overrides)
    elif arch == "llama":
        config = transformers.LlamaConfig(**common, rope_scaling=dict(LLAMA3_ROPE), **overrides)
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.15)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.3)
            else:  # RMSNorm weights
                p.uniform_(0.5, 1.5)
    return model


def hf_logits(model, tokens: np.ndarray, mask: np.ndarray, positions: np.ndarray) -> np.ndarray:
    torch = require("torch")

    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(tokens, dtype=torch.long),
            attention_mask=torch.tensor(mask.astype(np.int64)),
            position_ids=torch.tensor(positions, dtype=torch.long),
        )
    return out.logits.float().numpy()


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """Factory (arch, tie, **overrides) -> (folder, torch model), cached for the session."""
    cache: dict = {}

    def make(arch: str, tie: bool = False, **overrides):
        key = (arch, tie, tuple(sorted(overrides.items())))
        if key not in cache:
            model = build_hf_model(arch, tie, **overrides)
            folder = tmp_path_factory.mktemp(f"hf_{arch}_{'tied' if tie else 'untied'}")
            model.save_pretrained(folder, safe_serialization=True)
            cache[key] = (str(folder), model)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def left_padded_batch():
    """Two left-padded rows and one full row: tokens, padding mask, positions."""
    tokens = np.array(
        [[0, 0, 0, 5, 17, 33, 2, 9, 41, 7],
         [0, 11, 12, 13, 14, 15, 16, 17, 18, 19],
         [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]], dtype=np.int32)
    mask = tokens != 0
    mask[2] = True
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    return tokens, mask, positions


def _logits_impl(graphdef, state, tokens, positions, mask):
    from flax import nnx

    model = nnx.merge(graphdef, state)
    hidden, _ = model(tokens, positions, mask)
    return model.logits(hidden)


def jax_logits(model, tokens: np.ndarray, mask: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Full-sequence float32 logits of our model under one jit (eager dispatch is slow to warm up)."""
    import jax
    from flax import nnx

    global _JIT_LOGITS
    if _JIT_LOGITS is None:
        _JIT_LOGITS = jax.jit(_logits_impl, static_argnums=0)
    graphdef, state = nnx.split(model)
    return np.asarray(_JIT_LOGITS(graphdef, state, tokens, positions, mask))


_JIT_LOGITS = None
