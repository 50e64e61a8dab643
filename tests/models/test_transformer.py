"""The NNX decoder against Hugging Face's PyTorch implementation, plus cache and mask semantics."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mage_jax.models import transformer
from mage_jax.models.config import ModelConfig
from mage_jax.models.hf_loading import load_hf_model
from mage_jax.models.transformer import Transformer, init_cache, make_attention_mask, positions_from_mask
from tests.optional import require

from .conftest import hf_logits, jax_logits


def _forward(model: Transformer, tokens, mask, positions) -> np.ndarray:
    return jax_logits(model, tokens, mask, positions)


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("scan", [True, False], ids=["scanned", "unrolled"])
def test_fp32_logits_match_hugging_face_on_left_padded_batch(hf_checkpoint, left_padded_batch, arch, tie,
                                                              scan):
    folder, hf_model = hf_checkpoint(arch, tie)
    tokens, mask, positions = left_padded_batch
    model = load_hf_model(folder, ModelConfig.from_hf_dir(folder, scan_layers=scan))
    assert model.config.architecture == arch and model.config.tie_word_embeddings == tie
    ours = _forward(model, tokens, mask, positions)
    ref = hf_logits(hf_model, tokens, mask, positions)
    assert ours.dtype == np.float32 and ours.shape == (*tokens.shape, 97)
    assert np.abs(ref[mask]).max() > 1.0  # the comparison is not between near-zero numbers
    np.testing.assert_allclose(ours[mask], ref[mask], atol=1e-4, rtol=1e-4)


def test_llama3_rope_scaling_matches_at_large_positions(hf_checkpoint, left_padded_batch):
    folder, hf_model = hf_checkpoint("llama", False)
    tokens, mask, positions = left_padded_batch
    positions = positions + 900  # long wavelengths only matter far from the origin
    model = load_hf_model(folder)
    assert model.config.rope_scaling_dict["rope_type"] == "llama3"
    ours = _forward(model, tokens, mask, positions)
    ref = hf_logits(hf_model, tokens, mask, positions)
    np.testing.assert_allclose(ours[mask], ref[mask], atol=1e-4, rtol=1e-4)
    # Dropping the scaling changes the logits, so the check above really exercises it.
    plain = load_hf_model(folder, dataclasses.replace(model.config, rope_scaling=None))
    assert np.abs(_forward(plain, tokens, mask, positions) - ours)[mask].max() > 1e-2


@pytest.mark.parametrize("scan", [True, False], ids=["scanned", "unrolled"])
def test_cached_prefill_then_step_by_step_decoding_equals_full_forward(hf_checkpoint, left_padded_batch,
                                                                       scan):
    folder, _ = hf_checkpoint("qwen3", False)
    tokens, mask, positions = left_padded_batch
    model = load_hf_model(folder, ModelConfig.from_hf_dir(folder, scan_layers=scan))
    graphdef, state = nnx.split(model)
    full = _forward(model, tokens, mask, positions)

    @jax.jit
    def fill(state, tokens, positions, segments, cache):
        m = nnx.merge(graphdef, state)
        hidden, cache = m(tokens, positions, segments, cache, 0)
        return m.logits(hidden), cache

    @jax.jit
    def decode(state, tokens, positions, kv_start, cache, index):
        m = nnx.merge(graphdef, state)
        hidden, cache = m(tokens, positions, cache=cache, cache_index=index, kv_start=kv_start)
        return m.logits(hidden), cache

    b, t = tokens.shape
    max_len, prefill = 16, 6
    cache = init_cache(model.config, b, max_len, jnp.float32)
    assert [a.shape for a in cache.k] == [(b, 2, 16, max_len)] * 2  # per layer [B,Hkv,D,S], both layouts
    assert [a.shape for a in cache.v] == [(b, 2, max_len, 16)] * 2  # per layer [B,Hkv,S,D]
    logits, cache = fill(state, tokens[:, :prefill], positions[:, :prefill], mask[:, :prefill], cache)
    expected = np.broadcast_to(np.arange(max_len) < prefill, (b, max_len))
    for layer in range(2):  # prefill wrote exactly slots 0..prefill-1 of every layer
        for kv in map(np.asarray, cache.layer(layer)):
            assert kv.shape == (b, max_len, 2, 16)
            np.testing.assert_array_equal(np.abs(kv).sum(axis=(2, 3)) > 0, expected)
    chunks = [np.asarray(logits)]
    kv_start = jnp.asarray(np.argmax(mask, axis=1), jnp.int32)  # left padding: the first real slot
    for i in range(prefill, t):
        step = (tokens[:, i:i + 1], positions[:, i:i + 1])
        logits, cache = decode(state, *step, kv_start, cache, jnp.int32(i))
        chunks.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(chunks, axis=1)[mask], full[mask], atol=1e-5, rtol=1e-5)
    assert decode._cache_size() == 1  # one decode program for every step


def test_greedy_decoding_with_cache_matches_hugging_face_generate(hf_checkpoint):
    torch = require("torch")

    folder, hf_model = hf_checkpoint("qwen2", True)
    graphdef, state = nnx.split(load_hf_model(folder))
    prompt, new = [5, 17, 33, 2, 9], 6
    max_len = len(prompt) + new

    @jax.jit
    def step(state, tokens, positions, cache, index):
        m = nnx.merge(graphdef, state)
        if tokens.shape[1] > 1:  # prefill
            hidden, cache = m(tokens, positions, jnp.ones(tokens.shape, bool), cache, index)
        else:
            start = jnp.zeros(1, jnp.int32)
            hidden, cache = m(tokens, positions, cache=cache, cache_index=index, kv_start=start)
        return jnp.argmax(m.logits(hidden)[:, -1], axis=-1), cache

    cache = init_cache(nnx.merge(graphdef, state).config, 1, max_len)
    nxt, cache = step(state, jnp.asarray([prompt]), jnp.arange(len(prompt))[None], cache, 0)
    out = [int(nxt[0])]
    for i in range(len(prompt), max_len - 1):
        nxt, cache = step(state, nxt[:, None], jnp.asarray([[i]]), cache, i)
        out.append(int(nxt[0]))
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new,
                                do_sample=False, pad_token_id=0, eos_token_id=None)
    assert out == ref[0, len(prompt):].tolist()


def test_bfloat16_computation_stays_close_to_float32(hf_checkpoint, left_padded_batch):
    folder, _ = hf_checkpoint("qwen3", True)
    tokens, mask, positions = left_padded_batch
    fp32 = load_hf_model(folder)
    bf16_config = dataclasses.replace(fp32.config, param_dtype="bfloat16", dtype="bfloat16")
    bf16 = load_hf_model(folder, bf16_config)
    assert bf16.embed.embedding.value.dtype == jnp.bfloat16
    assert bf16.head_weight().dtype == jnp.bfloat16
    hidden = jax.eval_shape(lambda: bf16(tokens, positions, mask)[0])
    assert hidden.dtype == jnp.bfloat16
    logits = _forward(bf16, tokens, mask, positions)
    assert logits.dtype == np.float32
    ref = _forward(fp32, tokens, mask, positions)
    err = np.abs(logits - ref)[mask]
    assert err.max() < 0.25 and err.mean() < 0.05
    assert (logits.argmax(-1) == ref.argmax(-1))[mask].mean() > 0.9


def test_head_weight_is_the_transposed_embedding_when_tied(hf_checkpoint):
    tied = load_hf_model(hf_checkpoint("qwen3", True)[0])
    np.testing.assert_array_equal(tied.head_weight(), tied.embed.embedding.value.T)
    assert "lm_head" not in nnx.to_pure_dict(nnx.state(tied))
    untied = load_hf_model(hf_checkpoint("qwen3", False)[0])
    assert untied.head_weight().shape == (64, 97)
    np.testing.assert_array_equal(untied.head_weight(), untied.lm_head.kernel.value)


@pytest.mark.parametrize("policy", ["full", "dots_with_no_batch_dims_saveable"])
def test_remat_changes_neither_outputs_nor_gradients(left_padded_batch, policy):
    tokens, mask, positions = left_padded_batch
    config = ModelConfig.preset("tiny", vocab_size=64, num_layers=1, hidden_size=64, intermediate_size=96)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(0)
    state = jax.tree.map(lambda a: jnp.asarray(rng.normal(0, 0.2, a.shape), a.dtype), abstract)
    remat_graphdef = nnx.split(nnx.eval_shape(
        lambda: Transformer(dataclasses.replace(config, remat=policy), rngs=nnx.Rngs(0))))[0]

    def loss(state, graphdef):
        m = nnx.merge(graphdef, state)
        hidden, _ = m(tokens, positions, mask)
        return jnp.mean(m.logits(hidden) ** 2)

    plain = jax.jit(jax.value_and_grad(loss), static_argnums=1)(state, graphdef)
    remat = jax.jit(jax.value_and_grad(loss), static_argnums=1)(state, remat_graphdef)
    assert "remat" in str(jax.make_jaxpr(loss, static_argnums=1)(state, remat_graphdef))  # jax.checkpoint
    np.testing.assert_allclose(plain[0], remat[0], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(plain[1]), jax.tree.leaves(remat[1])):
        np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("scan", [False, True])
def test_building_a_model_updates_the_callers_key_count_once_and_draws_the_keys_it_would(monkeypatch, scan):
    """The layers draw ``rngs.params()``'s keys from a Python count (``KeyStream``) and the caller's count
    variable is advanced once at the end. Each update of an ``nnx.Rngs`` count under a trace (how a
    checkpoint's model is built) walked the whole trace so far: building SmolLM2's 30 layers took 3.6 s
    instead of 0.3 s, growing with the square of the depth. The parameters and the caller's stream
    are those of building the layers with the ``nnx.Rngs`` itself."""
    config = ModelConfig.preset("tiny", vocab_size=64, num_layers=3, hidden_size=64, intermediate_size=96,
                                lora_rank=2, tie_word_embeddings=False, scan_layers=scan)
    updates = []
    set_value = nnx.RngCount.set_value

    def counted(self, *args, **kwargs):
        updates.append(args)
        return set_value(self, *args, **kwargs)

    monkeypatch.setattr(nnx.RngCount, "set_value", counted)
    rngs = nnx.Rngs(7)
    model = Transformer(config, rngs=rngs)
    assert len(updates) == 1

    reference = nnx.Rngs(7)  # the layers built with the caller's stream, one update per key
    embed = transformer.Embed(config, reference)
    blocks = [transformer.Block(config, reference) for _ in range(3)]
    head = transformer._linear(config, 64, 64, False, reference)
    draws = 1 + 3 * 7 * 3 + 1  # embedding, each layer's 7 kernels and their A and B, head
    assert len(updates) == 1 + draws
    assert int(rngs.params.count[...]) == int(reference.params.count[...]) == draws
    np.testing.assert_array_equal(model.embed.embedding.value, embed.embedding.value)
    np.testing.assert_array_equal(model.lm_head.kernel.value, head.kernel.value)
    layers = nnx.state(model.layers)
    want = [nnx.state(block) for block in blocks]
    if scan:  # built by one vmapped initialiser per variable (KeyStream.stacked): the same values
        want = jax.tree.map(lambda *per_layer: jnp.stack(per_layer), *want)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(layers), strict=True):
        np.testing.assert_array_equal(b, a)
    random = [np.asarray(v) for v in jax.tree.leaves(nnx.state(model)) if np.ptp(np.asarray(v)) > 0]
    assert len({v.tobytes() for v in random}) == len(random) > 2  # no two parameters share a key


def test_attention_mask_is_causal_and_hides_padding_and_other_segments():
    mask = np.asarray(make_attention_mask(jnp.asarray([[0, 1, 1, 1]], bool)))[0]
    expected = np.array([[0, 0, 0, 0], [0, 1, 0, 0], [0, 1, 1, 0], [0, 1, 1, 1]], bool)
    np.testing.assert_array_equal(mask, expected)
    packed = np.asarray(make_attention_mask(jnp.asarray([[1, 1, 2, 2]])))[0]
    np.testing.assert_array_equal(packed[3], [False, False, True, True])
    bidirectional = np.asarray(make_attention_mask(jnp.asarray([[1, 1, 0]], bool), causal=False))[0]
    np.testing.assert_array_equal(bidirectional[0], [True, True, False])


def test_positions_count_real_tokens_from_zero():
    positions = positions_from_mask(jnp.asarray([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], bool))
    np.testing.assert_array_equal(positions, [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]])


def test_wrong_call_is_a_clear_error():
    config = ModelConfig.preset("tiny", vocab_size=40, num_layers=1)
    model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))  # the check precedes any math
    tokens = jnp.zeros((2, 3), jnp.int32)
    segments = jnp.ones((2, 3), bool)
    with pytest.raises(ValueError, match=r"segment_ids has shape \(2, 3, 3\), expected \(2, 3\)"):
        model(tokens, tokens, jnp.ones((2, 3, 3), bool))
    with pytest.raises(ValueError, match="exactly one of them"):
        model(tokens, tokens)
    with pytest.raises(ValueError, match="kv_start .decode. needs a cache"):
        model(tokens, tokens, kv_start=jnp.zeros(2, jnp.int32))
    with pytest.raises(ValueError, match="cache_index is required"):
        model(tokens, tokens, segments, init_cache(config, 2, 8))
    other = jax.eval_shape(lambda: init_cache(dataclasses.replace(config, num_layers=2), 2, 8))
    with pytest.raises(ValueError, match="the cache has 2 layers and 2 rows, expected 1 layers and 2 rows"):
        model(tokens, tokens, segments, other, 0)
    with pytest.raises(ValueError, match="the cache has 1 layers and 4 rows"):
        model(tokens, tokens, segments, jax.eval_shape(lambda: init_cache(config, 4, 8)), 0)
    with pytest.raises(ValueError, match=r"kv_start has shape \(3,\)"):
        model(tokens[:, :1], tokens[:, :1], cache=init_cache(config, 2, 8), cache_index=0,
              kv_start=jnp.zeros(3, jnp.int32))
