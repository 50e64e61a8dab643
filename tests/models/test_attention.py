"""Every attention implementation against the dense reference, the choice by config and platform, and
the blockwise implementation's linear memory."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mage_jax.models import attention as attn
from mage_jax.models.config import ModelConfig
from mage_jax.models.hf_loading import load_hf_model
from mage_jax.models.transformer import Transformer
from tests.xla_env import fake_devices_env

from .conftest import hf_logits, jax_logits


def _inputs(b=3, t=37, heads=4, kv_heads=2, dim=16, seed=0):
    """GQA queries / keys / values with one left-padded, one right-padded and one two-segment row."""
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.normal(size=(b, t, h, dim)), jnp.float32) for h in (heads, kv_heads, kv_heads))
    seg = np.ones((3, t), np.int32)
    seg[0, :5] = 0
    seg[1, t - 7:] = 0
    seg[2, t // 3:] = 2
    return q, k, v, jnp.asarray(seg[:b])


def _output_and_grads(fn, q, k, v, seg):
    """Outputs and the gradients of a random projection of the real (non-padding) query rows."""
    weight = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.float32)
    weight = weight * (seg != 0)[:, :, None, None]

    @jax.jit
    def run(q, k, v, seg):
        loss = lambda q, k, v: jnp.sum(fn(q, k, v, seg) * weight)  # noqa: E731
        return fn(q, k, v, seg), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    out, grads = run(q, k, v, seg)
    return np.asarray(out)[np.asarray(seg) != 0], [np.asarray(g) for g in grads]


def _assert_matches_dense(fn, inputs, causal=True, sliding_window=None, atol=2e-5):
    def dense(q, k, v, seg):
        return attn.dense_attention(q, k, v, seg, causal=causal, sliding_window=sliding_window)

    want, want_grads = _output_and_grads(dense, *inputs)
    got, got_grads = _output_and_grads(fn, *inputs)
    np.testing.assert_allclose(got, want, atol=atol, rtol=1e-4)
    for g, w in zip(got_grads, want_grads):
        np.testing.assert_allclose(g, w, atol=atol, rtol=1e-4)


@pytest.mark.parametrize("causal, window", [(True, None), (False, 6)], ids=["causal", "bidirectional-window"])
def test_blockwise_matches_dense_outputs_and_gradients(causal, window):
    def blockwise(q, k, v, seg):  # 37 tokens in blocks of 8: a padded last block and skipped blocks
        return attn.blockwise_attention(q, k, v, seg, causal=causal, sliding_window=window, block_size=8)

    _assert_matches_dense(blockwise, _inputs(), causal=causal, sliding_window=window)


@pytest.mark.parametrize("causal, window", [(True, None), (True, 10), (False, None)],
                         ids=["causal", "causal-window", "bidirectional"])
def test_prefix_matches_dense_outputs_and_gradients(causal, window):
    def prefix(q, k, v, seg):  # 37 tokens in query blocks of 8: a short last block, skipped key blocks
        return attn.prefix_attention(q, k, v, seg, causal=causal, sliding_window=window, block_size=8)

    _assert_matches_dense(prefix, _inputs(), causal=causal, sliding_window=window)


def test_prefix_skips_the_keys_a_causal_block_cannot_see():
    """Its forward and backward programs hold fewer flops than dense's: the skipped blocks are gone."""
    q, k, v, seg = _inputs(b=1, t=64)

    def flops(fn):
        loss = lambda q, k, v: jnp.sum(fn(q, k, v, seg))  # noqa: E731
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile().cost_analysis()["flops"]

    dense = flops(attn.dense_attention)
    prefix = flops(lambda q, k, v, seg: attn.prefix_attention(q, k, v, seg, block_size=16))
    assert prefix < 0.8 * dense  # 4 query blocks: 10 of 16 block pairs, plus the same projections


def test_cudnn_path_moves_each_row_to_lengths_and_back(monkeypatch):
    """The cuDNN plumbing (per-row span -> lengths, rows shifted to the front and back) on CPU, with
    the library call's own XLA implementation standing in for the GPU kernel."""
    library = jax.nn.dot_product_attention

    def stand_in(*args, implementation=None, **kwargs):
        assert implementation == "cudnn"
        return library(*args, implementation="xla", **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", stand_in)
    q, k, v, seg = _inputs()
    seg = seg.at[2].set(jnp.where(seg[2] != 0, 1, 0))  # cuDNN takes one run of real tokens per row
    _assert_matches_dense(attn.cudnn_attention, (q, k, v, seg))


def test_splash_kernel_matches_dense_in_interpret_mode():
    """The TPU splash kernel, run by the Pallas interpreter on CPU (segment ids, GQA, left padding)."""
    q, k, v, seg = _inputs(b=2, t=128, heads=2, kv_heads=1, dim=128)

    def splash(q, k, v, seg):
        return attn.splash_attention(q, k, v, seg, interpret=True)

    want = attn.dense_attention(q, k, v, seg)
    got = splash(q, k, v, seg)
    real = np.asarray(seg) != 0
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=2e-5, rtol=1e-4)


def test_choice_follows_platform_dtype_and_length():
    choose = attn.choose_implementation
    assert choose("auto", 1024, jnp.float32, dense_max_len=1024, platform="cpu") == "dense"
    assert choose("auto", 1025, jnp.float32, dense_max_len=1024, platform="cpu") == "blockwise"
    assert choose("auto", 4096, jnp.bfloat16, dense_max_len=1024, platform="gpu") == "cudnn"
    assert choose("auto", 4096, jnp.float32, dense_max_len=1024, platform="gpu") == "blockwise"
    assert choose("auto", 4096, jnp.bfloat16, dense_max_len=1024, platform="tpu") == "splash"
    assert choose("auto", 100, jnp.bfloat16, dense_max_len=1024, platform="tpu") == "dense"
    assert choose("blockwise", 8, jnp.float32, dense_max_len=1024, platform="cpu") == "blockwise"
    with pytest.raises(ValueError, match="attention='cudnn' needs an NVIDIA GPU, the platform is 'cpu'"):
        choose("cudnn", 4096, jnp.bfloat16, dense_max_len=1024, platform="cpu")
    with pytest.raises(ValueError, match="attention='cudnn' needs bfloat16 or float16"):
        choose("cudnn", 4096, jnp.float32, dense_max_len=1024, platform="gpu")
    with pytest.raises(ValueError, match="attention='splash' needs a TPU"):
        choose("splash", 4096, jnp.bfloat16, dense_max_len=1024, platform="cpu")


def test_config_refuses_unknown_implementation_and_remat_policy():
    with pytest.raises(ValueError, match="attention='flash' is not one of auto, dense, blockwise"):
        ModelConfig.preset("tiny", attention="flash")
    with pytest.raises(ValueError, match="remat='some' is not one of none, full, dots_saveable"):
        ModelConfig.preset("tiny", remat="some")
    assert ModelConfig.preset("tiny", remat=True).remat == "full"
    assert ModelConfig.preset("tiny", remat=False).remat == "none"


def test_decoder_with_cudnn_on_cpu_is_one_clear_error(left_padded_batch):
    tokens, mask, positions = left_padded_batch
    config = ModelConfig.preset("tiny", vocab_size=64, num_layers=1, attention="cudnn", dtype="bfloat16")
    model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="attention='cudnn' needs an NVIDIA GPU"):
        model(jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(mask))


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_blockwise_decoder_matches_hugging_face(hf_checkpoint, left_padded_batch, arch):
    folder, hf_model = hf_checkpoint(arch, False)
    tokens, mask, positions = left_padded_batch
    config = dataclasses.replace(ModelConfig.from_hf_dir(folder), attention="blockwise",
                                 attention_block_size=4)
    blockwise = load_hf_model(folder, config)
    np.testing.assert_allclose(jax_logits(blockwise, tokens, mask, positions)[mask],
                               hf_logits(hf_model, tokens, mask, positions)[mask], atol=1e-4, rtol=1e-4)


def test_blockwise_decoder_gradients_match_dense(hf_checkpoint, left_padded_batch):
    tokens, mask, positions = (jnp.asarray(a) for a in left_padded_batch)
    graphdef, state = nnx.split(load_hf_model(hf_checkpoint("qwen3", False)[0]))
    config = dataclasses.replace(nnx.merge(graphdef, state).config, attention="blockwise",
                                 attention_block_size=4)
    blockwise_graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))[0]

    @jax.jit
    def grads(state, dense_state):
        def loss(state, graphdef):
            model = nnx.merge(graphdef, state)
            hidden, _ = model(tokens, positions, mask)
            return jnp.sum(jnp.where(mask[:, :, None], model.logits(hidden), 0.0) ** 2) / 100

        return jax.grad(loss)(state, blockwise_graphdef), jax.grad(loss)(dense_state, graphdef)

    got, want = grads(state, state)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-3)


def _temp_bytes(fn, t: int) -> int:
    """Compiled temporary bytes of the gradient of ``fn`` at length ``t`` (one row, 2 heads, GQA)."""
    shape = jax.ShapeDtypeStruct((1, t, 2, 32), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, t, 1, 32), jnp.float32)
    seg = jax.ShapeDtypeStruct((1, t), jnp.int32)
    grad = jax.grad(lambda q, k, v, s: jnp.sum(fn(q, k, v, s)), argnums=(0, 1, 2))
    return jax.jit(grad).lower(shape, kv, kv, seg).compile().memory_analysis().temp_size_in_bytes


def test_blockwise_memory_grows_linearly_in_length_where_dense_grows_quadratically():
    def blockwise(q, k, v, s):
        return attn.blockwise_attention(q, k, v, s, block_size=256)

    growth = _temp_bytes(blockwise, 4096) / _temp_bytes(blockwise, 1024)
    dense_growth = _temp_bytes(attn.dense_attention, 4096) / _temp_bytes(attn.dense_attention, 1024)
    assert growth < 6, f"blockwise temporaries grew {growth:.1f}x for 4x the tokens"
    assert dense_growth > 8  # the reference is quadratic: the measurement can tell the two apart



SPLASH_ON_A_MESH = """
import jax, jax.numpy as jnp, numpy as np
from mage_jax.models import attention as attn
from mage_jax.models.sharding import MeshConfig, make_mesh
rng = np.random.default_rng(0)
q = jnp.asarray(rng.normal(size=(2, 128, 2, 128)), jnp.float32)
k = jnp.asarray(rng.normal(size=(2, 128, 1, 128)), jnp.float32)
seg = np.ones((2, 128), np.int32)
seg[0, :9] = 0
seg = jnp.asarray(seg)
splash = jax.jit(lambda q, k, v, s: attn.splash_attention(q, k, v, s, interpret=True))
with jax.set_mesh(make_mesh(MeshConfig(data=1, fsdp=2, tensor=1))):
    assert "shard_map" in str(jax.make_jaxpr(splash)(q, k, k, seg))
    out = splash(q, k, k, seg)
real = np.asarray(seg) != 0
np.testing.assert_allclose(np.asarray(out)[real], np.asarray(attn.dense_attention(q, k, k, seg))[real],
                           atol=2e-5, rtol=1e-4)
print("OK")
"""


SPLASH_WHATEVER_THE_ROWS = """
import jax, jax.numpy as jnp, numpy as np
from mage_jax.models import attention as attn
from mage_jax.models.sharding import MeshConfig, make_mesh
rng = np.random.default_rng(0)
for rows, mesh in ((1, MeshConfig(data=1, fsdp=4, tensor=1)), (3, MeshConfig(data=1, fsdp=2, tensor=2))):
    q = jnp.asarray(rng.normal(size=(rows, 128, 4, 16)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(rows, 128, 2, 16)), jnp.float32)
    seg = np.ones((rows, 128), np.int32)
    seg[0, :9] = 0
    seg = jnp.asarray(seg)
    def loss(q, k, fn):
        return jnp.sum(jnp.where(seg[..., None, None] != 0, fn(q, k, k, seg), 0.0) ** 2)
    splash = lambda q, k, v, s: attn.splash_attention(q, k, v, s, interpret=True)
    with jax.set_mesh(make_mesh(mesh)):
        # rows that do not divide the devices: still under shard_map (the TPU cannot partition the kernel)
        assert "shard_map" in str(jax.make_jaxpr(splash)(q, k, k, seg)), rows
        out = jax.jit(splash)(q, k, k, seg)
        grads = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)(q, k, splash)
    real = np.asarray(seg) != 0
    np.testing.assert_allclose(np.asarray(out)[real], np.asarray(attn.dense_attention(q, k, k, seg))[real],
                               atol=2e-5, rtol=1e-4)
    want = jax.grad(loss, argnums=(0, 1))(q, k, attn.dense_attention)
    for got, ref in zip(grads, want):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-4, rtol=1e-3)
print("OK")
"""


def test_splash_runs_under_shard_map_whatever_the_rows_per_device():
    """One row on four devices, three rows over two devices with the heads split over two more: the
    kernel runs under shard_map (rows padded with all-padding rows), outputs and gradients equal dense."""
    env = fake_devices_env(4)
    out = subprocess.run([sys.executable, "-c", SPLASH_WHATEVER_THE_ROWS], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]


def test_splash_kernel_runs_on_each_devices_rows_under_a_mesh():
    """On a 2-device mesh the kernel runs under shard_map over the rows (a subprocess: fake devices)."""
    env = fake_devices_env(2)
    out = subprocess.run([sys.executable, "-c", SPLASH_ON_A_MESH], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]
