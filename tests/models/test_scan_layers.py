"""Specification of the scanned decoder (``ModelConfig.scan_layers``): the blocks run under one
``lax.scan`` over stacked parameters, so a program holds one block whatever the depth, and it gives the
unrolled reference path's outputs, caches, gradients, LoRA adapters, Hugging Face round trips and
greedy generations on the same weights."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from mage_jax.generate.engine import EngineRequest, generate_all
from mage_jax.generate.sampler import Sampler
from mage_jax.generate.slots import compiled_engine
from mage_jax.generate.spec import ModelSpec
from mage_jax.generate.step import KEY_PATH_LEN, SamplingParams
from mage_jax.models import lora
from mage_jax.models.config import ModelConfig
from mage_jax.models.hf_loading import export_hf, load_hf_params
from mage_jax.models.transformer import (
    KVSink,
    Transformer,
    init_cache,
    stack_layers,
    unstack_layers,
    update_layer,
)
from tests.xla_env import fake_devices_env

from .conftest import hf_logits

CONFIG = ModelConfig.preset("tiny", vocab_size=64, num_layers=3, hidden_size=64, intermediate_size=96)
TIGHT = dict(atol=2e-5, rtol=2e-5)  # float32: only the order of the same operations differs


def _graphdef(config: ModelConfig) -> nnx.GraphDef:
    return nnx.graphdef(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))


def _pair(config: ModelConfig = CONFIG, seed: int = 0):
    """(unrolled graphdef, state), (scanned graphdef, state): the same random weights (LoRA B included,
    so adapters matter) in both layouts."""
    unrolled = dataclasses.replace(config, scan_layers=False)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(unrolled, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(seed)
    state = jax.tree.map(lambda a: jnp.asarray(rng.normal(0, 0.2, a.shape), a.dtype), abstract)
    return (graphdef, state), (_graphdef(dataclasses.replace(config, scan_layers=True)), stack_layers(state))


def _assert_trees_close(a, b, **tol) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), **tol)


def _batch(rows: int = 3, length: int = 10, vocab: int = 64):
    rng = np.random.default_rng(1)
    tokens = rng.integers(1, vocab, size=(rows, length)).astype(np.int32)
    mask = np.ones_like(tokens, bool)
    mask[0, :3] = False  # a left-padded row
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    return tokens, mask, positions


# ------------------------------------------------------------------------------ layout
def test_scanned_parameters_are_the_unrolled_initialisation_stacked_on_a_layer_axis():
    unrolled = nnx.state(Transformer(dataclasses.replace(CONFIG, scan_layers=False), rngs=nnx.Rngs(0)))
    scanned = nnx.state(Transformer(dataclasses.replace(CONFIG, scan_layers=True), rngs=nnx.Rngs(0)))
    assert scanned["layers"]["attn"]["q_proj"]["kernel"].shape == (3, 64, 4 * 32)
    assert scanned["layers"]["input_norm"]["scale"].shape == (3, 64)
    assert scanned["embed"]["embedding"].shape == (64, 64)  # only the blocks are stacked
    _assert_trees_close(stack_layers(unrolled), scanned, atol=0, rtol=0)
    _assert_trees_close(unstack_layers(scanned), unrolled, atol=0, rtol=0)


def _program_size(config: ModelConfig, *, decode: bool) -> int:
    """Matrix products written in the jaxpr of a pass without a cache (training, the log-prob recompute)
    or of a decode step (a scan's body is written once)."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    tokens = jnp.zeros((2, 1), jnp.int32)

    def step(state, cache):
        m = nnx.merge(graphdef, state)
        if decode:
            return m(tokens, tokens, cache=cache, cache_index=3, kv_start=jnp.zeros(2, jnp.int32))
        return m(tokens, tokens, jnp.ones((2, 1), jnp.int32))

    cache = jax.eval_shape(lambda: init_cache(config, 2, 8))
    return str(jax.make_jaxpr(step)(state, cache)).count("dot_general")


def test_a_scanned_pass_without_a_cache_holds_one_block_whatever_the_depth_and_generation_unrolls():
    sizes = {(scan, n, decode): _program_size(dataclasses.replace(CONFIG, num_layers=n, scan_layers=scan),
                                              decode=decode)
             for scan in (False, True) for n in (2, 6) for decode in (False, True)}
    assert sizes[True, 2, False] == sizes[True, 6, False] >= 7  # q, k, v, o, gate, up, down (+ head)
    assert sizes[False, 6, False] - sizes[False, 2, False] >= 4 * 7  # unrolled: every block written out
    for scan in (False, True):  # generation reads each layer's own cache arrays: every block written out
        assert sizes[scan, 6, True] - sizes[scan, 2, True] >= 4 * 7


def test_the_scanned_decode_reads_the_cache_once_like_the_unrolled_one():
    """XLA copies a layer's slice of a cache stacked over layers before attention reads it (3 passes over
    the cache per step instead of 1); each layer's own array is read in place. Bytes accessed per decode
    step by XLA:CPU's own analysis (``experiments.hlo_cost``), the cache dominating the step."""
    from experiments.hlo_cost import program_cost

    config = dataclasses.replace(CONFIG, num_layers=4, vocab_size=64)
    accessed = {}
    for scan in (False, True):
        c = dataclasses.replace(config, scan_layers=scan)
        graphdef, state = nnx.split(nnx.eval_shape(lambda c=c: Transformer(c, rngs=nnx.Rngs(0))))
        cache = jax.eval_shape(lambda c=c: init_cache(c, 8, 4096))

        def decode(state, cache, graphdef=graphdef):
            m = nnx.merge(graphdef, state)
            tokens = jnp.zeros((8, 1), jnp.int32)
            return m(tokens, tokens + 5, cache=cache, cache_index=PER_ROW, kv_start=jnp.zeros(8, jnp.int32))

        compiled = jax.jit(decode, donate_argnums=1).lower(state, cache).compile()
        accessed[scan] = program_cost(compiled.as_text(), "cpu").bytes_accessed
        cache_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(cache))
    assert accessed[False] < 1.5 * cache_bytes  # the cache read about once
    assert accessed[True] < 1.1 * accessed[False], accessed


def _initialisers(config: ModelConfig) -> int:
    """Keys drawn in the jaxpr of a program that builds the model (how fresh LoRA adapters are made for a
    checkpoint): one per initialiser written out."""
    jaxpr = jax.make_jaxpr(lambda: nnx.state(Transformer(config, rngs=nnx.Rngs(0))))()
    return str(jaxpr).count("random_fold_in")


def test_a_scanned_model_is_initialised_by_one_draw_per_variable_whatever_the_depth():
    """Thirty per-layer copies of each initialiser made loading SmolLM2 with fresh adapters take 10 s
    (uncached) instead of 1.7 s: the adapter program's compile."""
    lora = dataclasses.replace(CONFIG, lora_rank=2)
    draws = {(scan, n): _initialisers(dataclasses.replace(lora, num_layers=n, scan_layers=scan))
             for scan in (False, True) for n in (2, 6)}
    per_block = 3 * 7  # each kernel and its adapter's A and B
    assert draws[True, 2] == draws[True, 6] >= per_block
    assert draws[False, 6] - draws[False, 2] == 4 * per_block


# ------------------------------------------------------------------------------ outputs and caches
def _outputs(graphdef, state, tokens, mask, positions, prefill: int = 6, max_len: int = 16):
    """Self-attention logits; logits of a prefill and of decode steps (one write position for every row,
    then one per row, the last row's past the cache); the cache of every layer [B, S, Hkv, D]."""
    b, t = tokens.shape
    config = nnx.merge(graphdef, state).config

    @jax.jit
    def forward(state, tokens, positions, mask):
        m = nnx.merge(graphdef, state)
        return m.logits(m(tokens, positions, mask)[0])

    @jax.jit
    def fill(state, tokens, positions, mask, cache):
        m = nnx.merge(graphdef, state)
        hidden, cache = m(tokens, positions, mask, cache, 0)
        return m.logits(hidden), cache

    @functools.partial(jax.jit, donate_argnums=4)
    def decode(state, tokens, positions, kv_start, cache, index):
        m = nnx.merge(graphdef, state)
        hidden, cache = m(tokens, positions, cache=cache, cache_index=index, kv_start=kv_start)
        return m.logits(hidden), cache

    full = forward(state, tokens, positions, mask)
    logits, cache = fill(state, tokens[:, :prefill], positions[:, :prefill], mask[:, :prefill],
                         init_cache(config, b, max_len))
    steps = [logits]
    kv_start = jnp.asarray(np.argmax(mask, axis=1), jnp.int32)
    for i in range(prefill, t):
        step = (tokens[:, i:i + 1], positions[:, i:i + 1])
        logits, cache = decode(state, *step, kv_start, cache, jnp.int32(i))
        steps.append(logits)
    index = jnp.asarray([t, t + 2, max_len], jnp.int32)
    logits, cache = decode(state, tokens[:, :1], positions[:, -1:] + 1, kv_start, cache, index)
    steps.append(logits)
    layers = [tuple(map(np.asarray, cache.layer(i))) for i in range(config.num_layers)]
    return np.asarray(full), np.concatenate(steps, axis=1), layers


def test_self_attention_prefill_and_decode_equal_the_unrolled_path():
    tokens, mask, positions = _batch()
    t = tokens.shape[1]
    (full, steps, layers), (full_s, steps_s, layers_s) = (_outputs(g, s, tokens, mask, positions)
                                                          for g, s in _pair())
    np.testing.assert_allclose(full_s[mask], full[mask], **TIGHT)
    np.testing.assert_allclose(steps_s, steps, **TIGHT)
    np.testing.assert_allclose(steps[:, :t][mask], full[mask], atol=1e-5)  # the cache is right at all
    _assert_trees_close(layers_s, layers, **TIGHT)
    written = np.abs(layers[0][0]).sum(axis=(2, 3)) > 0  # [B, S]: slots holding a key
    assert written[1, t + 2] and not written[1, t + 1] and not written[2, t:].any()


PER_ROW = jnp.arange(8, dtype=jnp.int32) + 5


@pytest.mark.parametrize("index, dtype",
                         [(jnp.int32(5), "float32"), (PER_ROW, "float32"), (PER_ROW, "bfloat16")],
                         ids=["one position", "one per row", "one per row, bfloat16"])
def test_the_scanned_decode_updates_a_donated_cache_in_place(index, dtype):
    """One position or one per row, each layer's write lands in its own donated array: no copy of the
    cache."""
    _, (graphdef, state) = _pair()
    config = nnx.merge(graphdef, state).config
    cache = init_cache(config, 8, 512, dtype)

    def decode(state, cache, index):
        m = nnx.merge(graphdef, state)
        tokens = jnp.zeros((8, 1), jnp.int32)
        return m(tokens, tokens + 5, cache=cache, cache_index=index, kv_start=jnp.zeros(8, jnp.int32))

    step = jax.jit(decode, donate_argnums=1)
    memory = step.lower(state, cache, index).compile().memory_analysis()
    cache_bytes = sum(a.nbytes for a in jax.tree.leaves(cache))
    float32_bytes = sum(a.size * 4 for a in jax.tree.leaves(cache))
    assert memory.alias_size_in_bytes == cache_bytes  # the updated cache lives in the donated buffers
    assert memory.temp_size_in_bytes < float32_bytes / 2  # no copy of the whole cache (one layer's read)
    before = cache.k[0].unsafe_buffer_pointer()
    _, cache = step(state, cache, index)
    assert cache.k[0].unsafe_buffer_pointer() == before


def _prefill_and_sink(graphdef, state, tokens, mask, positions):
    """A prefill into a cache, and the same prefill into a sink that fills a cache layer by layer."""
    config = nnx.merge(graphdef, state).config
    b, t = tokens.shape

    def write(into, layer, k, v):
        return update_layer(lambda ck, cv: (ck.at[..., :t].set(k), cv.at[:, :, :t].set(v)), into, layer)

    @jax.jit
    def both(state, tokens, positions, mask):
        m = nnx.merge(graphdef, state)
        hidden, cache = m(tokens, positions, mask, init_cache(config, b, t), 0)
        sunk_hidden, sunk = m(tokens, positions, mask, sink=KVSink(write, init_cache(config, b, t)))
        return hidden, cache, sunk_hidden, sunk

    return both(state, tokens, positions, mask)


def test_a_prefill_into_a_kv_sink_hands_over_each_layers_keys_and_values_in_both_layouts():
    tokens, mask, positions = _batch()
    for graphdef, state in _pair():
        layers = CONFIG.num_layers
        hidden, cache, sunk_hidden, sunk = _prefill_and_sink(graphdef, state, tokens, mask, positions)
        np.testing.assert_array_equal(np.asarray(sunk_hidden), np.asarray(hidden))
        for i in range(layers):  # every layer handed over, and written at its own index
            _assert_trees_close(sunk.layer(i), cache.layer(i), atol=0, rtol=0)
        assert np.abs(np.asarray(cache.layer(layers - 1)[0])).sum() > 0
    model = nnx.merge(graphdef, state)
    with pytest.raises(ValueError, match="a KV sink takes a prefill"):
        model(tokens, positions, cache=init_cache(model.config, 3, 10), cache_index=0,
              kv_start=jnp.zeros(3, jnp.int32), sink=KVSink(lambda *a: a[0], None))


def test_a_cache_of_another_depth_is_a_clear_error():
    config = dataclasses.replace(CONFIG, scan_layers=True, num_layers=2, num_kv_heads=2)
    model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    deeper = jax.eval_shape(lambda: init_cache(dataclasses.replace(config, num_layers=3), 2, 8))
    tokens = jnp.zeros((2, 3), jnp.int32)
    with pytest.raises(ValueError, match=r"the cache has 3 layers and 2 rows, expected 2 layers"):
        model(tokens, tokens, jnp.ones((2, 3), bool), deeper, 0)


# ------------------------------------------------------------------------------ gradients, remat, LoRA
def _masked_square_loss(graphdef, state, tokens, mask, positions):
    m = nnx.merge(graphdef, state, copy=True)
    hidden, _ = m(tokens, positions, mask)
    return jnp.mean(jnp.where(mask[..., None], m.logits(hidden), 0.0) ** 2)


@pytest.mark.parametrize("remat", ["none", "dots_with_no_batch_dims_saveable"])  # "full": the LoRA test
def test_gradients_equal_the_unrolled_path_with_remat_on_the_scanned_body(remat):
    batch = _batch()
    (graphdef, state), (graphdef_s, state_s) = _pair(dataclasses.replace(CONFIG, remat=remat))
    value_and_grad = jax.jit(jax.value_and_grad(_masked_square_loss, argnums=1), static_argnums=0)
    value, grad = value_and_grad(graphdef, state, *batch)
    value_s, grad_s = value_and_grad(graphdef_s, state_s, *batch)
    jaxpr = str(jax.make_jaxpr(_masked_square_loss, static_argnums=0)(graphdef_s, state_s, *batch))
    assert ("remat" in jaxpr or "checkpoint" in jaxpr) == (remat != "none") and "scan" in jaxpr
    np.testing.assert_allclose(value_s, value, rtol=1e-6)
    _assert_trees_close(grad_s, stack_layers(grad), **TIGHT)
    assert np.abs(grad_s["layers"]["mlp"]["up_proj"]["kernel"]).max() > 1e-4  # not vanishing


def _adapter_loss(graphdef, adapters, base, tokens, mask, positions):
    return _masked_square_loss(graphdef, nnx.merge_state(base, adapters), tokens, mask, positions)


def test_lora_adapters_are_stacked_and_adapter_only_gradients_equal_the_unrolled_path():
    batch = _batch()
    config = dataclasses.replace(CONFIG, lora_rank=4, lora_alpha=8.0, lora_targets=("q_proj", "down_proj"),
                                 remat="full")
    adapter_grad = jax.jit(jax.grad(_adapter_loss, argnums=1), static_argnums=0)
    results = []
    for graphdef, state in _pair(config):
        adapters, base = lora.split_adapters(state)
        results.append((adapter_grad(graphdef, adapters, base, *batch),
                        lora.merge_adapters(state, config.lora_scale)))
    (grad, merged), (grad_s, merged_s) = results
    adapters_s = lora.split_adapters(_pair(config)[1][1])[0]
    assert adapters_s["layers"]["attn"]["q_proj"]["lora"]["lora_a"].shape == (3, 64, 4)
    assert adapters_s["layers"]["mlp"]["down_proj"]["lora"]["lora_b"].shape == (3, 4, 64)
    assert len(jax.tree.leaves(grad_s)) == 4  # gradients of the adapters only
    _assert_trees_close(grad_s, stack_layers(grad), **TIGHT)
    _assert_trees_close(merged_s, stack_layers(merged), atol=1e-6, rtol=1e-6)  # export folds them per layer


# ------------------------------------------------------------------------------ Hugging Face folders
def test_hugging_face_import_into_the_stacked_layout_and_export_round_trip(hf_checkpoint, left_padded_batch,
                                                                           tmp_path):
    folder, hf_model = hf_checkpoint("qwen3", False)
    config, graphdef, state = load_hf_params(folder)
    assert config.scan_layers  # a folder's model scans its blocks by default
    assert state["layers"]["mlp"]["down_proj"]["kernel"].shape == (2, 128, 64)
    unrolled = load_hf_params(folder, dataclasses.replace(config, scan_layers=False))[2]
    _assert_trees_close(state, stack_layers(unrolled), atol=0, rtol=0)  # layer i at index i
    tokens, mask, positions = left_padded_batch
    m = nnx.merge(graphdef, state)
    ours = np.asarray(m.logits(m(tokens, positions, mask)[0]))
    np.testing.assert_allclose(ours[mask], hf_logits(hf_model, tokens, mask, positions)[mask], atol=1e-4,
                               rtol=1e-4)

    export_hf(state, config, tmp_path / "export")
    original, exported = load_file(os.path.join(folder, "model.safetensors")), load_file(
        tmp_path / "export" / "model.safetensors")
    assert sorted(exported) == sorted(original)  # one tensor per layer, under Hugging Face's names
    for name, tensor in original.items():
        np.testing.assert_array_equal(exported[name], tensor, err_msg=name)


# ------------------------------------------------------------------------------ greedy generation
def test_greedy_generation_equals_the_unrolled_path_in_the_sampler_and_the_engine():
    (graphdef, state), (graphdef_s, state_s) = _pair(dataclasses.replace(CONFIG, num_layers=2), seed=2)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [5, 6, 7], [20, 21, 22, 23, 24]]  # one prompt twice
    params = SamplingParams(greedy=True, max_new_tokens=6)
    outputs = []
    for g, s in ((graphdef, state), (graphdef_s, state_s)):
        spec = ModelSpec(g, nnx.merge(g, s).config, eos_ids=(3,), pad_id=0, prompt_buckets=(8,))
        lockstep = Sampler(spec, batch_buckets=(4,)).generate(s, prompts, params, jax.random.key(0))
        engine = compiled_engine(spec, slots=2, max_new_tokens=6, chunk=2)
        requests = [EngineRequest(tag=i, prompt_ids=tuple(p), limit=6, automaton=None,
                                  key_path=(i,) + (0,) * (KEY_PATH_LEN - 1)) for i, p in enumerate(prompts)]
        results = generate_all(engine.session(s, params, jax.random.key(0)), requests)
        outputs.append(([list(t) for t in lockstep.tokens], [list(results[i].tokens) for i in range(4)]))
        assert engine.last_stats.prefill_rows == 3  # the repeated prompt's keys and values were copied
    assert outputs[1] == outputs[0]
    assert outputs[0][0] == outputs[0][1]  # and the engine gives the lockstep tokens
    assert sum(map(len, outputs[0][0])) > 6  # tokens were generated


# ------------------------------------------------------------------------------ sharding
_SHARDED = textwrap.dedent(
    """
    import dataclasses, json, sys
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from mage_jax.models import lora
    from mage_jax.models.config import ModelConfig
    from mage_jax.models.transformer import init_cache, positions_from_mask
    from mage_jax.models.hf_loading import load_hf_params
    from mage_jax.models.sharding import MeshConfig, batch_sharding, cache_sharding, make_mesh

    path = sys.argv[1]
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 128, size=(8, 12)).astype(np.int32)
    tokens[::2, :3] = 0
    mask = tokens != 0
    positions = positions_from_mask(mask)

    def run(graphdef, state, tokens, positions, mask, cache):
        m = nnx.merge(graphdef, state)
        hidden, cache = m(tokens[:, :8], positions[:, :8], mask[:, :8], cache, 0)
        out = [m.logits(hidden)]
        for i in range(8, 12):
            hidden, cache = m(tokens[:, i:i + 1], positions[:, i:i + 1], cache=cache, cache_index=i,
                              kv_start=jnp.argmax(mask, axis=1).astype(jnp.int32))
            out.append(m.logits(hidden))
        return jnp.concatenate(out, axis=1)

    def grads(graphdef, state, tokens, positions, mask):
        adapters, base = lora.split_adapters(state)
        def loss(adapters):
            m = nnx.merge(graphdef, nnx.merge_state(base, adapters), copy=True)
            return jnp.mean(jnp.where(mask[..., None], m.logits(m(tokens, positions, mask)[0]), 0.0) ** 2)
        return jax.grad(loss)(adapters)

    config = dataclasses.replace(ModelConfig.from_hf_dir(path), lora_rank=4, remat="full")
    assert config.scan_layers
    unrolled = dataclasses.replace(config, scan_layers=False)
    graphdef_u, state_u = load_hf_params(path, unrolled, lora_seed=1)[1:]
    state_u = jax.tree.map(lambda a: a + 0.05, state_u)  # non-zero adapters B
    from mage_jax.models.transformer import stack_layers
    ref = np.asarray(jax.jit(run, static_argnums=0)(graphdef_u, state_u, tokens, positions, mask,
                                                    init_cache(unrolled, 8, 16)))
    ref_grads = jax.jit(grads, static_argnums=0)(graphdef_u, state_u, tokens, positions, mask)
    ref_grads = [np.asarray(g) for g in jax.tree.leaves(stack_layers(ref_grads))]

    mesh = make_mesh(MeshConfig(2, 2, 2))
    _, graphdef, sharded = load_hf_params(path, config, mesh=mesh, lora_seed=1)
    stacked = stack_layers(state_u)
    sharded = jax.tree.map(lambda s, u: jax.device_put(u, s.sharding), sharded, stacked)
    rows = batch_sharding(mesh)
    cache = jax.device_put(init_cache(config, 8, 16), cache_sharding(config, mesh, 8))
    with jax.set_mesh(mesh):
        got = jax.jit(run, static_argnums=0)(graphdef, sharded, *(jax.device_put(x, rows) for x in
                                             (tokens, positions, mask)), cache)
        got_grads = jax.jit(grads, static_argnums=0)(graphdef, sharded, *(jax.device_put(x, rows) for x in
                                                     (tokens, positions, mask)))
    kernel = sharded["layers"]["attn"]["q_proj"]["kernel"]
    print("RESULT" + json.dumps({
        "logits_diff": float(np.abs(np.asarray(got) - ref)[mask].max()),
        "grad_diff": max(float(np.abs(np.asarray(a) - b).max()) for a, b in zip(jax.tree.leaves(got_grads),
                                                                               ref_grads)),
        "kernel_spec": [a for a in kernel.sharding.spec],
        "kernel_bytes": [kernel.nbytes, max(s.data.nbytes for s in kernel.addressable_shards)],
        "cache_spec": [list(a) if isinstance(a, tuple) else a for a in cache.k[0].sharding.spec],
    }))
    """
)


def test_a_sharded_scanned_model_on_8_devices_matches_the_unrolled_one_on_one(hf_checkpoint):
    folder, _ = hf_checkpoint("qwen3", False, vocab=128)
    env = fake_devices_env(8)
    proc = subprocess.run([sys.executable, "-c", _SHARDED, folder], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert result["logits_diff"] < 1e-4 and result["grad_diff"] < 1e-5, result
    assert result["kernel_spec"] == [None, "fsdp", "tensor"]  # the layer axis is never split
    total, per_device = result["kernel_bytes"]
    assert per_device * 4 == total
    assert result["cache_spec"] == [["data", "fsdp"], "tensor", None, None]  # kv heads (x layers) split
