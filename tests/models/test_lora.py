"""LoRA adapters (flax `nnx.LoRALinear`): zero B is the base model, the targets and scale are the
config's, Hugging Face loading adds fresh adapters, and export merges them into weights that
transformers loads with the same logits."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mage_jax.models import lora
from mage_jax.models import sharding as shd
from mage_jax.models.config import ModelConfig
from mage_jax.models.hf_loading import export_hf, load_hf_params
from mage_jax.models.sharding import path_to_str
from mage_jax.models.transformer import Transformer
from tests.models.conftest import hf_logits, jax_logits

BASE = ModelConfig.preset("tiny", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                          num_heads=2, num_kv_heads=1, head_dim=16)


def lora_model(rank=4, targets=lora.LORA_TARGETS, alpha=8.0, seed=0):
    config = dataclasses.replace(BASE, lora_rank=rank, lora_alpha=alpha, lora_targets=targets)
    graphdef, state = shd.init_sharded(config, shd.make_mesh(shd.MeshConfig(1, 1, 1)), seed=seed)
    return config, graphdef, state


def with_random_b(state, seed=1, std=0.3):
    """Adapters whose B is no longer zero (as after training)."""
    adapters, base = lora.split_adapters(state)
    keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(adapters))))

    def draw(path, x):
        if path_to_str(path).endswith("lora_b"):
            return std * jax.random.normal(next(keys), x.shape, x.dtype)
        return x

    return nnx.merge_state(base, jax.tree_util.tree_map_with_path(draw, adapters))


def base_logits(state, batch):
    """The logits of the plain model (no adapters in its graph) with the base leaves of `state`."""
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Transformer(BASE, rngs=nnx.Rngs(0))))
    return jax_logits(nnx.merge(graphdef, lora.split_adapters(state)[1]), *batch)


def test_adapters_sit_on_the_configured_targets_with_zero_b():
    _, _, state = lora_model(targets=("q_proj", "down_proj"))
    adapters = lora.split_adapters(state)[0]
    paths = {path_to_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(adapters)[0]}
    assert sorted(paths) == sorted(f"layers/{i}/{m}/lora/lora_{ab}" for i in range(2)
                                   for m in ("attn/q_proj", "mlp/down_proj") for ab in "ab")
    assert paths["layers/0/attn/q_proj/lora/lora_a"].shape == (32, 4)
    assert paths["layers/0/mlp/down_proj/lora/lora_b"].shape == (4, 32)
    assert all(x.dtype == jnp.float32 for x in paths.values())
    assert not any(np.any(np.asarray(x)) for p, x in paths.items() if p.endswith("lora_b"))
    assert all(np.any(np.asarray(x)) for p, x in paths.items() if p.endswith("lora_a"))


def test_zero_b_gives_exactly_the_base_models_logits(left_padded_batch):
    config, graphdef, state = lora_model()
    got = jax_logits(nnx.merge(graphdef, state), *left_padded_batch)
    np.testing.assert_array_equal(got, base_logits(state, left_padded_batch))
    # Trained adapters change the logits; switched off, the model is the base again.
    trained = with_random_b(state)
    moved = jax_logits(nnx.merge(graphdef, trained), *left_padded_batch)
    real = left_padded_batch[1][..., None]  # padding rows' outputs are garbage nobody reads
    assert np.abs(np.where(real, moved - got, 0)).max() > 1e-2
    off = jax_logits(nnx.merge(graphdef, lora.without_adapters(trained)), *left_padded_batch)
    np.testing.assert_array_equal(off, got)


def test_the_adapter_is_scaled_by_alpha_over_rank(left_padded_batch):
    """Doubling alpha doubles the adapters' contribution: merged kernels W + (alpha / r) A B agree."""
    config, graphdef, state = lora_model(alpha=8.0)
    trained = with_random_b(state)
    merged = lora.merge_adapters(trained, config.lora_scale)
    assert config.lora_scale == 2.0
    real = left_padded_batch[1][..., None]
    want = np.where(real, jax_logits(nnx.merge(graphdef, trained), *left_padded_batch), 0)
    np.testing.assert_allclose(np.where(real, base_logits(merged, left_padded_batch), 0), want,
                               atol=2e-5, rtol=1e-5)
    wrong = lora.merge_adapters(trained, 2 * config.lora_scale)
    assert np.abs(np.where(real, base_logits(wrong, left_padded_batch), 0) - want).max() > 1e-2


def test_hf_loading_adds_fresh_adapters_and_export_merges_them_with_matching_hf_logits(
        hf_checkpoint, left_padded_batch, tmp_path):
    from transformers import AutoModelForCausalLM

    folder, hf_model = hf_checkpoint("qwen3", tie=False)
    plain_config, _, plain = load_hf_params(folder)
    config = dataclasses.replace(plain_config, lora_rank=4, lora_alpha=4.0, lora_targets=("q_proj", "v_proj",
                                                                                         "up_proj"))
    config, graphdef, state = load_hf_params(folder, config, lora_seed=3)
    adapters, base = lora.split_adapters(state)
    assert config.scan_layers  # a folder's model scans its blocks: one stacked adapter per projection
    assert [a.shape[0] for a in jax.tree.leaves(adapters)] == [config.num_layers] * 2 * 3
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(base)):  # the base is the folder's weights
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    tokens, mask, positions = left_padded_batch
    want_hf = hf_logits(hf_model, tokens, mask, positions)
    valid = mask[..., None]
    np.testing.assert_allclose(np.where(valid, jax_logits(nnx.merge(graphdef, state), *left_padded_batch), 0),
                               np.where(valid, want_hf, 0), atol=2e-4, rtol=2e-4)

    trained = with_random_b(state, std=0.5)
    ours = jax_logits(nnx.merge(graphdef, trained), *left_padded_batch)
    assert np.abs(np.where(valid, ours - want_hf, 0)).max() > 1e-2  # the adapters matter
    export_hf(trained, config, tmp_path / "merged")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", local_files_only=True).eval()
    got = hf_logits(exported, tokens, mask, positions)
    np.testing.assert_allclose(np.where(valid, got, 0), np.where(valid, ours, 0), atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("overrides, message", [
    ({"lora_rank": -1}, "lora_rank must be an integer >= 0"),
    ({"lora_rank": 4, "lora_alpha": 0.0}, "lora_alpha must be > 0"),
    ({"lora_rank": 4, "lora_targets": ("q_proj", "lm_head")}, "lora_targets must be a non-empty subset"),
    ({"lora_rank": 4, "lora_targets": ()}, "lora_targets must be a non-empty subset"),
])
def test_bad_lora_settings_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(BASE, **overrides)
