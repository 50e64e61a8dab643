"""Flax NNX decoder for the Qwen3 / Qwen2 / Llama family, with a KV cache.

The three families share one block: pre-norm RMSNorm, rotary grouped-query attention, SwiGLU MLP.
They differ only in switches carried by `ModelConfig`: per-head q/k RMSNorm (Qwen3), q/k/v biases
(Qwen2), Llama-3 RoPE frequency scaling, tied or untied output head.

The model is meant to be used functionally: `graphdef, state = nnx.split(model)` once, then jitted
functions take `state` and call `nnx.merge(graphdef, state)` inside. The caller owns every position
and padding decision, which keeps this module free of padding policy. No call takes a dense mask:

    hidden, _ = model(tokens[B,T], positions[B,T], segment_ids[B,T])              # self-attention
    hidden, cache = model(tokens, positions, segment_ids, cache, cache_index)     # prefill
    hidden, cache = model(tokens, positions, cache=cache, cache_index=i, kv_start=start[B])  # decode
    hidden, into = model(tokens, positions, segment_ids, sink=KVSink(write, into))  # prefill into a sink

`cache_index` of a decode call may also be one write position per row, int32[B] (each row of the
rollout engine's slots sits at its own length); a row whose position lies past the cache writes nothing.

`segment_ids` (int, 0 = padding; a bool padding mask works too) say which of the T tokens see each
other (causally). Prefill attends over the T new tokens only and writes their keys and values at
slots `cache_index .. cache_index+T-1`. Decode writes the new tokens at `cache_index` and attends
over the per-row span of valid slots `kv_start[b] .. cache_index+t`. How attention is computed (dense,
blockwise, cuDNN, splash) is `ModelConfig.attention`; see `mage_jax.models.attention`.

`KVCache` holds keys and values head-major: keys [B, num_kv_heads, head_dim, S] (slots last) and
values [B, num_kv_heads, S, head_dim]. Both decode products are then plain batched matrix products
over (B, kv head) with no transposed operand: q·K contracts head_dim against the keys' rows, probs·V
contracts the slots against the values' rows. They are only ever written with
`lax.dynamic_update_slice` (or a scatter for per-row positions), so a donated cache is updated in place.

Two layouts of the blocks, chosen by `ModelConfig.scan_layers`:

* unrolled (the reference): `layers` is a list of blocks, each program holds one copy of every block;
* scanned: `layers` is one block whose every parameter has a leading layer axis [L, ...]. A pass without
  a cache (training, the log-prob recompute) runs it under one `jax.lax.scan`, so the program holds one
  copy of the block whatever the depth. Generation (a call with a cache or a KV sink) runs the blocks
  one after another from static slices of the stacked parameters, exactly as the unrolled layout does.

The cache holds one key and one value array per layer in both layouts, so that a layer's attention reads
its own array. A cache stacked over layers (one array carried through the scan, each layer's slice read
at the layer index) is read through a copy of that slice: XLA:CPU, the GPU compiler and the TPU compiler
all materialise a dynamically (or statically) indexed slice of a buffer before the attention products,
so a decode step moved each layer's cache three times (slice read, copy written, copy read) instead of
once, and on a TPU the stacked cache was also relaid out whole twice per step (8 times the cache's bytes
per step by XLA:TPU's own analysis, docs/scaling.md). Generation programs therefore compile in time
growing with depth, as unrolled ones do.

A prefill may hand each layer's keys and values to a `KVSink` instead of a cache (the rollout engine
copies them straight into its slots, layer by layer), so no program holds a cache of every layer of the
prompt rows besides its destination.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mage_jax.models import attention as attn
from mage_jax.models.config import ModelConfig
from mage_jax.models.lora import LoRALinear
from mage_jax.models.mesh_axes import constrain_rows

CPU_BF16_SCATTER_COPIES = jax.__version_info__ < (0, 12)
"""Whether XLA:CPU runs a bfloat16 scatter out of place in float32 (jax 0.10.2 did: 6.8 MB of temporaries
for a 3.1 MB cache in tests/models/test_scan_layers.py; 0.12.0.1 does not: 2.3 MB, where the row-by-row
writes of ``_write_rows`` cost 4.3 MB). 0.11 was not measured and keeps the row-by-row writes."""


# ---------------------------------------------------------------------------- KV cache
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys `k[i]` [B, Hkv, D, S] and values `v[i]` [B, Hkv, S, D] of every layer i (both layouts of the
    blocks; see the module docstring)."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @property
    def max_len(self) -> int:
        return self.v[0].shape[2]

    @property
    def batch_size(self) -> int:
        return self.v[0].shape[0]

    @property
    def num_layers(self) -> int:
        return len(self.k)

    def layer(self, i: int) -> tuple[jax.Array, jax.Array]:
        """Keys and values of layer `i` in token-major order, [B, S, Hkv, D] each (inspection, tests)."""
        return self.k[i].transpose(0, 3, 1, 2), self.v[i].transpose(0, 2, 1, 3)


@dataclasses.dataclass(frozen=True)
class KVSink:
    """Where a prefill's keys and values go in place of a cache: after layer `i` has computed the keys
    k [B, Hkv, D, T] and values v [B, Hkv, T, D] of the T prompt tokens (the cache layout, the compute
    dtype), `write(into, i, k, v)` returns the new `into` (any pytree; `i` is the layer's Python int). The
    prefill returns the final `into` in place of a cache."""

    write: Callable[[object, int | jax.Array, jax.Array, jax.Array], object]
    into: object


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype=None) -> KVCache:
    """A zero cache for `batch` rows of `max_len` slots (dtype defaults to the compute dtype)."""
    dtype = config.jnp_dtype if dtype is None else jnp.dtype(dtype)
    heads, dim, n = config.num_kv_heads, config.head_dim, config.num_layers
    return KVCache(
        k=tuple(jnp.zeros((batch, heads, dim, max_len), dtype) for _ in range(n)),
        v=tuple(jnp.zeros((batch, heads, max_len, dim), dtype) for _ in range(n)),
    )


def update_layer(update: Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]], cache: KVCache,
                 layer: int) -> KVCache:
    """``update(keys, values) -> (keys, values)`` on layer ``layer`` of ``cache``: keys [B, Hkv, D, S] and
    values [B, Hkv, S, D], the layer's own arrays."""
    k, v = update(cache.k[layer], cache.v[layer])
    return KVCache(k=cache.k[:layer] + (k,) + cache.k[layer + 1:],
                   v=cache.v[:layer] + (v,) + cache.v[layer + 1:])


# ---------------------------------------------------------------------------- masks and positions
def make_attention_mask(segments: jax.Array, causal: bool = True) -> jax.Array:
    """[B,T] padding mask (bool) or segment ids (int, 0 = padding) -> [B,T,T] bool (inspection, tests).

    Query t may attend key s when both are real tokens of the same segment and, if causal, s <= t.
    Padding query rows attend nothing; their outputs are finite garbage that callers ignore. The
    model never takes this array: every attention implementation derives it from the segment ids.
    """
    seg = jnp.asarray(segments).astype(jnp.int32)
    mask = (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] != 0)
    if causal:
        t = seg.shape[1]
        mask = mask & jnp.tril(jnp.ones((t, t), dtype=bool))[None]
    return mask


def positions_from_mask(mask: jax.Array) -> jax.Array:
    """Positions for left- (or right-) padded rows: real tokens count 0, 1, 2, ...; padding gets 0."""
    mask = jnp.asarray(mask).astype(jnp.int32)
    return jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0).astype(jnp.int32)


# ---------------------------------------------------------------------------- RoPE
def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """Inverse frequencies [head_dim/2], with linear or Llama-3 scaling applied.

    Computed in float32 step by step like the reference implementation, because at positions in
    the thousands a one-ulp difference in a frequency is already visible in the logits.
    """
    f32 = np.float32
    dim = config.head_dim
    inv_freq = f32(1.0) / (f32(config.rope_theta) ** (np.arange(0, dim, 2).astype(f32) / f32(dim)))
    scaling = config.rope_scaling_dict
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = f32(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    # llama3: keep high frequencies, divide low frequencies by `factor`, interpolate in between.
    low, high = f32(scaling["low_freq_factor"]), f32(scaling["high_freq_factor"])
    old_len = f32(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = f32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (f32(1) - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(f32)


def rope_tables(config: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin of shape [B,T,head_dim/2] in float32."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(rope_inv_freq(config))
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate x [B,T,N,D] by half-split pairs (x_i, x_{i+D/2}), the Hugging Face convention."""
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


# ---------------------------------------------------------------------------- layers
class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, dtype, param_dtype):
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return normed.astype(self.dtype) * self.scale.value.astype(self.dtype)


class KeyStream:
    """The keys ``rngs.params()`` would give, counted in Python; it stands in for ``nnx.Rngs`` in the layer
    constructors (they only call ``rngs.params()``), and on leaving its ``with`` block advances the
    caller's count by the keys drawn, so the parameters and the stream's state are the same.

    ``nnx.Rngs`` counts its draws in a variable, and under a trace (``nnx.eval_shape``, ``jax.jit``: how a
    checkpoint's model is built) every update of it asks the traced count for its sharding, whose error
    message walks the whole trace so far: building SmolLM2's 30 layers took 3.6 s instead of 0.3 s,
    growing with the square of the depth. Here the count is updated once.
    """

    def __init__(self, rngs: nnx.Rngs | None, *, key: jax.Array | None = None,
                 start: jax.Array | None = None):
        """The keys of ``rngs``'s params stream, or (``rngs`` None) those of ``key`` from count ``start``."""
        self.stream = None if rngs is None else rngs.params
        self.key = self.stream.key[...] if key is None else key
        self.start, self.count = self.stream.count[...] if start is None else start, 0

    def params(self) -> jax.Array:
        key = jax.random.fold_in(self.key, self.start + self.count)
        self.count += 1
        return key

    def stacked(self, n: int, build: Callable[[KeyStream], nnx.Module]) -> nnx.Module:
        """``n`` modules that ``build`` would make one after another from this stream, as one module whose
        every variable has a leading axis of ``n``: the same values, drawn by one initialiser per variable
        vmapped over the ``n`` modules' keys. A program that initialises a scanned model (fresh LoRA
        adapters for a checkpoint, a random model) then holds one copy of each initialiser, not one per
        layer (loading SmolLM2 with fresh rank-8 adapters, uncached: 10 s with 30 copies, 1.7 s)."""
        first = self.start + self.count
        probe = KeyStream(None, key=self.key, start=first)
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: build(probe)))
        per_module = probe.count

        def one(index: jax.Array) -> nnx.State:
            return nnx.state(build(KeyStream(None, key=self.key, start=first + index * per_module)))

        state = jax.vmap(one)(jnp.arange(n, dtype=jnp.asarray(first).dtype))
        self.count += n * per_module
        return nnx.merge(graphdef, state)

    def __enter__(self) -> KeyStream:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.stream is not None:
            self.stream.count[...] = self.start + self.count


def _linear(config: ModelConfig, n_in: int, n_out: int, bias: bool, rngs: KeyStream,
            name: str = "") -> nnx.Linear:
    """A projection; a `LoRALinear` (same base parameters plus an adapter) when `name` is a LoRA target."""
    kwargs = dict(use_bias=bias, dtype=config.jnp_dtype, param_dtype=config.jnp_param_dtype,
                  kernel_init=nnx.initializers.normal(stddev=0.02), rngs=rngs)
    if config.lora_targeted(name):
        return LoRALinear(n_in, n_out, lora_rank=config.lora_rank, scale=config.lora_scale,
                          lora_dtype=config.jnp_dtype, lora_param_dtype=jnp.float32, **kwargs)
    return nnx.Linear(n_in, n_out, **kwargs)


class Attention(nnx.Module):
    def __init__(self, config: ModelConfig, rngs: KeyStream):
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.dtype = c.jnp_dtype
        self.block_size = c.attention_block_size
        self.q_proj = _linear(c, c.hidden_size, c.num_heads * c.head_dim, c.qkv_bias, rngs, "q_proj")
        self.k_proj = _linear(c, c.hidden_size, c.num_kv_heads * c.head_dim, c.qkv_bias, rngs, "k_proj")
        self.v_proj = _linear(c, c.hidden_size, c.num_kv_heads * c.head_dim, c.qkv_bias, rngs, "v_proj")
        self.o_proj = _linear(c, c.num_heads * c.head_dim, c.hidden_size, False, rngs, "o_proj")
        if c.qk_norm:
            norm = dict(dtype=c.jnp_dtype, param_dtype=c.jnp_param_dtype)
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, **norm)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, **norm)
        else:
            self.q_norm = nnx.data(None)
            self.k_norm = nnx.data(None)

    def __call__(self, x, cos, sin, segment_ids, kv, cache_index, kv_start, implementation: str,
                 emit_kv: bool = False):
        """-> (output [B,T,H], the updated (keys, values) cache or None).

        `kv` is this layer's (keys [B,Hkv,D,S], values [B,Hkv,S,D]). Without a cache, `emit_kv` returns
        the new keys [B,Hkv,D,T] and values [B,Hkv,T,D] in its place (a sink)."""
        b, t, _ = x.shape
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        q = constrain_rows(self.q_proj(x).reshape(b, t, heads, dim))
        k = constrain_rows(self.k_proj(x).reshape(b, t, kv_heads, dim))
        v = constrain_rows(self.v_proj(x).reshape(b, t, kv_heads, dim))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv is not None:
            kv = _write_cache(kv, k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3), cache_index)
        elif emit_kv:
            kv = (k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3))
        if kv_start is None:  # a prefill reads nothing back from the cache
            out = attn.self_attention(q, k, v, segment_ids, implementation=implementation,
                                      block_size=self.block_size)
        else:
            out = attn.cached_attention(q, *kv, kv_start, cache_index)
        return constrain_rows(self.o_proj(constrain_rows(out.reshape(b, t, heads * dim)))), kv


def _write_cache(kv: tuple[jax.Array, jax.Array], k_new: jax.Array, v_new: jax.Array,
                 cache_index: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Write keys [B,Hkv,D,T] and values [B,Hkv,T,D] at slots `cache_index ..` of one layer's cache, in
    place. `cache_index` is one position for every row, or one per row (the rollout engine's slots each
    sit at their own length); a per-row position past the cache writes nothing (a finished slot). A
    bfloat16 cache on the CPU is written row by row (`_write_rows`) where XLA:CPU's scatter would copy it
    (`CPU_BF16_SCATTER_COPIES`)."""
    cache_k, cache_v = kv
    k_new, v_new = k_new.astype(cache_k.dtype), v_new.astype(cache_v.dtype)
    if cache_index.ndim == 0:
        return (jax.lax.dynamic_update_slice(cache_k, k_new, (0, 0, 0, cache_index)),
                jax.lax.dynamic_update_slice(cache_v, v_new, (0, 0, cache_index, 0)))
    if cache_k.dtype == jnp.bfloat16 and attn.current_platform() == "cpu" and CPU_BF16_SCATTER_COPIES:
        return _write_rows(cache_k, cache_v, k_new, v_new, cache_index)
    b, t = k_new.shape[0], k_new.shape[-1]
    rows = jnp.arange(b)[:, None]
    at = cache_index[:, None] + jnp.arange(t)[None, :]  # [B,T]
    return (cache_k.at[rows, :, :, at].set(k_new.transpose(0, 3, 1, 2), mode="drop"),
            cache_v.at[rows, :, at, :].set(v_new.transpose(0, 2, 1, 3), mode="drop"))


def _write_rows(cache_k: jax.Array, cache_v: jax.Array, k_new: jax.Array, v_new: jax.Array,
                cache_index: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`_write_cache` at one position per row, one `dynamic_update_slice` per row: XLA:CPU runs a
    bfloat16 scatter out of place in float32 (a float32 copy of the layer's cache per step). A row whose
    position lies past the cache writes back what it holds (a slice's start is clamped, not dropped)."""
    t, slots = k_new.shape[-1], cache_k.shape[-1]
    for row in range(k_new.shape[0]):
        at = jnp.minimum(cache_index[row], slots - t)
        keep = cache_index[row] > slots - t
        old_k = jax.lax.dynamic_slice(cache_k, (row, 0, 0, at), (1,) + k_new.shape[1:3] + (t,))
        old_v = jax.lax.dynamic_slice(cache_v, (row, 0, at, 0), (1, v_new.shape[1], t, v_new.shape[3]))
        new_k, new_v = jnp.where(keep, old_k, k_new[row:row + 1]), jnp.where(keep, old_v, v_new[row:row + 1])
        cache_k = jax.lax.dynamic_update_slice(cache_k, new_k, (row, 0, 0, at))
        cache_v = jax.lax.dynamic_update_slice(cache_v, new_v, (row, 0, at, 0))
    return cache_k, cache_v


class MLP(nnx.Module):
    def __init__(self, config: ModelConfig, rngs: KeyStream):
        c = config
        self.gate_proj = _linear(c, c.hidden_size, c.intermediate_size, False, rngs, "gate_proj")
        self.up_proj = _linear(c, c.hidden_size, c.intermediate_size, False, rngs, "up_proj")
        self.down_proj = _linear(c, c.intermediate_size, c.hidden_size, False, rngs, "down_proj")

    def __call__(self, x: jax.Array) -> jax.Array:
        h = constrain_rows(jax.nn.silu(constrain_rows(self.gate_proj(x))) * constrain_rows(self.up_proj(x)))
        return constrain_rows(self.down_proj(h))


class Block(nnx.Module):
    def __init__(self, config: ModelConfig, rngs: KeyStream):
        norm = dict(dtype=config.jnp_dtype, param_dtype=config.jnp_param_dtype)
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **norm)
        self.attn = Attention(config, rngs)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **norm)
        self.mlp = MLP(config, rngs)

    def __call__(self, x, cos, sin, segment_ids, kv, cache_index, kv_start, implementation: str,
                 emit_kv: bool = False):
        h, kv = self.attn(self.input_norm(x), cos, sin, segment_ids, kv, cache_index, kv_start,
                          implementation, emit_kv)
        x = constrain_rows(x + h)
        x = constrain_rows(x + self.mlp(self.post_attn_norm(x)))
        return x, kv


class Embed(nnx.Module):
    def __init__(self, config: ModelConfig, rngs: KeyStream):
        init = nnx.initializers.normal(stddev=0.02)
        self.embedding = nnx.Param(
            init(rngs.params(), (config.vocab_size, config.hidden_size), config.jnp_param_dtype)
        )

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return jnp.take(self.embedding.value, tokens, axis=0)


def stack_layers(state: nnx.State) -> nnx.State:
    """An unrolled model's state (`layers/<i>/...`) in the scanned layout (`layers/...`, layer i at index
    i of the leading axis); other variables are shared as they are."""
    flat, per_layer = {}, {}
    for path, variable in nnx.to_flat_state(state):
        if path[0] == "layers":
            per_layer.setdefault(path[2:], {})[int(path[1])] = variable
        else:
            flat[path] = variable
    for rest, layers in per_layer.items():
        values = [layers[i].get_value() for i in range(len(layers))]
        flat[("layers", *rest)] = layers[0].replace(jnp.stack(values))
    return nnx.from_flat_state(list(flat.items()))


def unstack_layers(state: nnx.State) -> nnx.State:
    """A scanned model's state in the unrolled layout: the inverse of `stack_layers`."""
    flat = {}
    for path, variable in nnx.to_flat_state(state):
        if path[0] != "layers" or isinstance(path[1], int):  # not a layer, or already one layer's
            flat[path] = variable
            continue
        stacked = variable.get_value()
        for i in range(stacked.shape[0]):
            flat[("layers", i, *path[1:])] = variable.replace(stacked[i])
    return nnx.from_flat_state(list(flat.items()))


# ---------------------------------------------------------------------------- the decoder
class Transformer(nnx.Module):
    """Decoder-only language model; see the module docstring for the calling convention."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        with KeyStream(rngs) as keys:
            self.embed = Embed(config, keys)
            # Scanned: the unrolled layout's blocks (the same values) as one with a leading layer axis.
            if config.scan_layers:
                self.layers = keys.stacked(config.num_layers, lambda layer_keys: Block(config, layer_keys))
            else:
                self.layers = nnx.List([Block(config, keys) for _ in range(config.num_layers)])
            self.final_norm = RMSNorm(
                config.hidden_size, config.rms_norm_eps, dtype=config.jnp_dtype,
                param_dtype=config.jnp_param_dtype,
            )
            if config.tie_word_embeddings:
                self.lm_head = nnx.data(None)
            else:
                self.lm_head = _linear(config, config.hidden_size, config.vocab_size, False, keys)

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array | None = None,
        cache: KVCache | None = None,
        cache_index: jax.Array | None = None,
        *,
        kv_start: jax.Array | None = None,
        sink: KVSink | None = None,
    ) -> tuple[jax.Array, KVCache | None]:
        """-> (hidden [B,T,H] after the final norm, updated cache or None, or with `sink` (a prefill
        without a cache) the sink's final state); see the module docstring."""
        config = self.config
        b, t = tokens.shape
        _check_call(config, b, t, segment_ids, cache, cache_index, kv_start)
        if sink is not None and (cache is not None or segment_ids is None):
            raise ValueError("a KV sink takes a prefill's keys and values: pass segment_ids and no cache")
        if cache is not None:
            cache_index = jnp.asarray(cache_index, jnp.int32)
        implementation = "dense"
        if kv_start is None:
            segment_ids = jnp.asarray(segment_ids).astype(jnp.int32)
            implementation = attn.choose_implementation(
                config.attention, t, config.jnp_dtype, dense_max_len=config.attention_dense_max_len)
        x = constrain_rows(self.embed(tokens).astype(config.jnp_dtype))
        cos, sin = rope_tables(config, positions)
        run = self._scan_blocks if config.scan_layers else self._unrolled_blocks
        x, cache = run(x, cos, sin, segment_ids, cache, cache_index, kv_start, implementation, sink)
        return constrain_rows(self.final_norm(x)), cache

    def _unrolled_blocks(self, x, cos, sin, segment_ids, cache, cache_index, kv_start, implementation, sink,
                         stacked=None):
        """The reference path: one block after the other, each with its own cache arrays. ``stacked``
        (graph, parameters) of a scanned model's blocks: block i is slice i of its parameters, tied to
        the previous block's output by an optimization barrier so that a compiler which keeps barriers
        does not slice every layer up front (XLA:CPU drops them and does: its generation programs hold
        a copy of every block's weights, tests/generate/test_slots.py)."""
        emit = sink is not None

        def run_block(block, x, cos, sin, segment_ids, kv, cache_index, kv_start):
            return block(x, cos, sin, segment_ids, kv, cache_index, kv_start, implementation, emit)

        if self.config.remat != "none" and cache is None and not emit:  # only a differentiated pass needs it
            run_block = nnx.remat(run_block, policy=self.config.remat_policy)
        new_k, new_v = [], []
        into = None if sink is None else sink.into
        for i in range(self.config.num_layers):
            if stacked is None:
                block = self.layers[i]
            else:
                x, params = jax.lax.optimization_barrier((x, stacked[1]))
                block = nnx.merge(stacked[0], jax.tree.map(lambda a, i=i: a[i], params))
            kv = None if cache is None else (cache.k[i], cache.v[i])
            x, kv = run_block(block, x, cos, sin, segment_ids, kv, cache_index, kv_start)
            if emit:  # written before the next block starts (a barrier), so that this layer's keys and values
                # need not outlive it
                x, into = jax.lax.optimization_barrier((x, sink.write(into, i, *kv)))
            elif kv is not None:
                new_k.append(kv[0])
                new_v.append(kv[1])
        if emit:
            return x, into
        if cache is not None:
            cache = KVCache(k=tuple(new_k), v=tuple(new_v))
        return x, cache

    def _scan_blocks(self, x, cos, sin, segment_ids, cache, cache_index, kv_start, implementation, sink):
        """The scanned path: one `lax.scan` over the stacked block parameters for a pass without a cache;
        generation (a cache or a sink) runs the blocks one after another from static slices of them over
        the per-layer cache (see the module docstring)."""
        config = self.config
        graphdef, params = nnx.split(self.layers)
        if cache is not None or sink is not None:
            return self._unrolled_blocks(x, cos, sin, segment_ids, cache, cache_index, kv_start,
                                         implementation, sink, (graphdef, params))

        def body(x, layer_params):
            block = nnx.merge(graphdef, layer_params)
            return block(x, cos, sin, segment_ids, None, cache_index, kv_start, implementation)[0], None

        if config.remat != "none":  # the policy applies to the scanned body
            body = jax.checkpoint(body, policy=config.remat_policy, prevent_cse=False)
        x, _ = jax.lax.scan(body, x, params)
        return x, None

    def head_weight(self) -> jax.Array:
        """The output projection [H,V] in the compute dtype (the embedding transposed when tied)."""
        if self.lm_head is None:
            w = self.embed.embedding.value.T
        else:
            w = self.lm_head.kernel.value
        return w.astype(self.config.jnp_dtype)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """[B,T,H] -> [B,T,V] float32 (accumulated in float32 whatever the compute dtype)."""
        return jnp.einsum(
            "bth,hv->btv", hidden.astype(self.config.jnp_dtype), self.head_weight(),
            preferred_element_type=jnp.float32,
        )


def _check_call(config: ModelConfig, b: int, t: int, segment_ids, cache, cache_index, kv_start) -> None:
    """One clear error for a call that mixes up the self-attention, prefill and decode conventions."""
    if (segment_ids is None) == (kv_start is None):
        raise ValueError("pass segment_ids [B,T] (self-attention, prefill) or kv_start [B] with a cache "
                         "(decode), exactly one of them")
    if segment_ids is not None and tuple(segment_ids.shape) != (b, t):
        raise ValueError(f"segment_ids has shape {tuple(segment_ids.shape)}, expected {(b, t)}")
    if kv_start is not None:
        if cache is None:
            raise ValueError("kv_start (decode) needs a cache")
        if tuple(kv_start.shape) != (b,):
            raise ValueError(f"kv_start has shape {tuple(kv_start.shape)}, expected {(b,)}")
    if cache is not None:
        if cache_index is None:
            raise ValueError("cache_index is required when a cache is given")
        layers = cache.num_layers
        if layers != config.num_layers or cache.batch_size != b:
            raise ValueError(
                f"the cache has {layers} layers and {cache.batch_size} rows, "
                f"expected {config.num_layers} layers and {b} rows"
            )

