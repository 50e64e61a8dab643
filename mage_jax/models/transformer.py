"""Flax NNX decoder for the Qwen3 / Qwen2 / Llama family, with a KV cache.

The three families share one block: pre-norm RMSNorm, rotary grouped-query attention, SwiGLU MLP.
They differ only in switches carried by `ModelConfig`: per-head q/k RMSNorm (Qwen3), q/k/v biases
(Qwen2), Llama-3 RoPE frequency scaling, tied or untied output head.

The model is meant to be used functionally: `graphdef, state = nnx.split(model)` once, then jitted
functions take `state` and call `nnx.merge(graphdef, state)` inside. The caller owns every mask
and position, which keeps this module free of padding policy:

    hidden, cache = model(tokens[B,T], positions[B,T], attention_mask[B,T,S], cache, cache_index)

Without a cache, S == T (build the mask with `make_attention_mask`). With a cache, the keys and
values of the T new tokens are written at slots `cache_index .. cache_index+T-1` of every row and
the mask covers all S cache slots (`make_cached_attention_mask`).

`KVCache` holds one key and one value array per layer, head-major: keys [B, num_kv_heads, head_dim, S]
(slots last) and values [B, num_kv_heads, S, head_dim]. Both attention products are then plain
batched matrix products over (B, kv head) with no transposed operand: q·K contracts head_dim against
the keys' rows, probs·V contracts the slots against the values' rows. Separate arrays per layer let
a layer read its cache without slicing (copying) a stacked [L, ...] array every step. They are only
ever written with `lax.dynamic_update_slice`, so a donated cache is updated in place.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mage_jax.models.config import ModelConfig

_MASKED = -1e30  # finite so that a fully masked (padding) query row stays NaN-free


# ---------------------------------------------------------------------------- KV cache
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Per-layer keys `k[i]` [B, Hkv, D, S] and values `v[i]` [B, Hkv, S, D] (see the module docstring)."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @property
    def num_layers(self) -> int:
        return len(self.v)

    @property
    def max_len(self) -> int:
        return self.v[0].shape[2]

    @property
    def batch_size(self) -> int:
        return self.v[0].shape[0]

    def layer(self, i: int) -> tuple[jax.Array, jax.Array]:
        """Keys and values of layer `i` in token-major order, [B, S, Hkv, D] each (inspection, tests)."""
        return self.k[i].transpose(0, 3, 1, 2), self.v[i].transpose(0, 2, 1, 3)


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype=None) -> KVCache:
    """A zero cache for `batch` rows of `max_len` slots (dtype defaults to the compute dtype)."""
    dtype = config.jnp_dtype if dtype is None else jnp.dtype(dtype)
    heads, dim, n = config.num_kv_heads, config.head_dim, config.num_layers
    return KVCache(
        k=tuple(jnp.zeros((batch, heads, dim, max_len), dtype) for _ in range(n)),
        v=tuple(jnp.zeros((batch, heads, max_len, dim), dtype) for _ in range(n)),
    )


# ---------------------------------------------------------------------------- masks and positions
def make_attention_mask(segments: jax.Array, causal: bool = True) -> jax.Array:
    """[B,T] padding mask (bool) or segment ids (int, 0 = padding) -> [B,T,T] bool.

    Query t may attend key s when both are real tokens of the same segment and, if causal, s <= t.
    Padding query rows attend nothing; their outputs are finite garbage that callers ignore.
    """
    seg = jnp.asarray(segments).astype(jnp.int32)
    mask = (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] != 0)
    if causal:
        t = seg.shape[1]
        mask = mask & jnp.tril(jnp.ones((t, t), dtype=bool))[None]
    return mask


def make_cached_attention_mask(valid: jax.Array, cache_index: jax.Array, num_new: int) -> jax.Array:
    """Mask for `num_new` tokens written at `cache_index` into a cache of S slots -> [B,num_new,S].

    `valid[B,S]` marks the cache slots holding real tokens (including the new ones); new token t
    attends valid slots up to and including its own slot `cache_index + t`.
    """
    valid = jnp.asarray(valid, dtype=bool)
    slots = jnp.arange(valid.shape[1], dtype=jnp.int32)
    limit = jnp.asarray(cache_index, jnp.int32) + jnp.arange(num_new, dtype=jnp.int32)
    return valid[:, None, :] & (slots[None, None, :] <= limit[None, :, None])


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


def _linear(config: ModelConfig, n_in: int, n_out: int, bias: bool, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(
        n_in, n_out, use_bias=bias, dtype=config.jnp_dtype, param_dtype=config.jnp_param_dtype,
        kernel_init=nnx.initializers.normal(stddev=0.02), rngs=rngs,
    )


class Attention(nnx.Module):
    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.dtype = c.jnp_dtype
        self.q_proj = _linear(c, c.hidden_size, c.num_heads * c.head_dim, c.qkv_bias, rngs)
        self.k_proj = _linear(c, c.hidden_size, c.num_kv_heads * c.head_dim, c.qkv_bias, rngs)
        self.v_proj = _linear(c, c.hidden_size, c.num_kv_heads * c.head_dim, c.qkv_bias, rngs)
        self.o_proj = _linear(c, c.num_heads * c.head_dim, c.hidden_size, False, rngs)
        if c.qk_norm:
            norm = dict(dtype=c.jnp_dtype, param_dtype=c.jnp_param_dtype)
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, **norm)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, **norm)
        else:
            self.q_norm = nnx.data(None)
            self.k_norm = nnx.data(None)

    def __call__(self, x, cos, sin, mask, kv: tuple[jax.Array, jax.Array] | None, cache_index):
        """-> (output [B,T,H], this layer's updated (keys, values) cache or None)."""
        b, t, _ = x.shape
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        groups = heads // kv_heads
        q = self.q_proj(x).reshape(b, t, heads, dim)
        k = self.k_proj(x).reshape(b, t, kv_heads, dim)
        v = self.v_proj(x).reshape(b, t, kv_heads, dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        # Head-major: the G query heads sharing a kv head and the T tokens form the M rows of one
        # matrix product per (row, kv head); keys are stored transposed, [D, S].
        q = q.reshape(b, t, kv_heads, groups, dim).transpose(0, 2, 3, 1, 4).reshape(b, kv_heads, -1, dim)
        k = k.transpose(0, 2, 3, 1)  # [B,Hkv,D,T]
        v = v.transpose(0, 2, 1, 3)  # [B,Hkv,T,D]
        if kv is not None:
            cache_k, cache_v = kv
            cache_k = jax.lax.dynamic_update_slice(cache_k, k.astype(cache_k.dtype), (0, 0, 0, cache_index))
            cache_v = jax.lax.dynamic_update_slice(cache_v, v.astype(cache_v.dtype), (0, 0, cache_index, 0))
            kv = (cache_k, cache_v)
            k, v = cache_k.astype(self.dtype), cache_v.astype(self.dtype)
        s = k.shape[-1]

        scores = jnp.einsum("bkmd,bkds->bkms", q, k, preferred_element_type=jnp.float32)
        scores = scores.reshape(b, kv_heads, groups, t, s) / math.sqrt(dim)
        scores = jnp.where(mask[:, None, None, :, :], scores, _MASKED)
        probs = jax.nn.softmax(scores, axis=-1).astype(self.dtype).reshape(b, kv_heads, groups * t, s)
        # Accumulated in float32 like the scores: exact for bf16 and, on CPU, far faster than a bf16 result.
        out = jnp.einsum("bkms,bksd->bkmd", probs, v, preferred_element_type=jnp.float32)  # [B,Hkv,G*T,D]
        out = out.astype(self.dtype)
        out = out.reshape(b, kv_heads, groups, t, dim).transpose(0, 3, 1, 2, 4).reshape(b, t, heads * dim)
        return self.o_proj(out), kv


class MLP(nnx.Module):
    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        c = config
        self.gate_proj = _linear(c, c.hidden_size, c.intermediate_size, False, rngs)
        self.up_proj = _linear(c, c.hidden_size, c.intermediate_size, False, rngs)
        self.down_proj = _linear(c, c.intermediate_size, c.hidden_size, False, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):
    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        norm = dict(dtype=config.jnp_dtype, param_dtype=config.jnp_param_dtype)
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **norm)
        self.attn = Attention(config, rngs)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **norm)
        self.mlp = MLP(config, rngs)

    def __call__(self, x, cos, sin, mask, kv, cache_index):
        h, kv = self.attn(self.input_norm(x), cos, sin, mask, kv, cache_index)
        x = x + h
        x = x + self.mlp(self.post_attn_norm(x))
        return x, kv


class Embed(nnx.Module):
    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        init = nnx.initializers.normal(stddev=0.02)
        self.embedding = nnx.Param(
            init(rngs.params(), (config.vocab_size, config.hidden_size), config.jnp_param_dtype)
        )

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return jnp.take(self.embedding.value, tokens, axis=0)


# ---------------------------------------------------------------------------- the decoder
class Transformer(nnx.Module):
    """Decoder-only language model; see the module docstring for the calling convention."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.embed = Embed(config, rngs)
        self.layers = nnx.List([Block(config, rngs) for _ in range(config.num_layers)])
        self.final_norm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, dtype=config.jnp_dtype,
            param_dtype=config.jnp_param_dtype,
        )
        if config.tie_word_embeddings:
            self.lm_head = nnx.data(None)
        else:
            self.lm_head = _linear(config, config.hidden_size, config.vocab_size, False, rngs)

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        attention_mask: jax.Array,
        cache: KVCache | None = None,
        cache_index: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache | None]:
        """-> (hidden [B,T,H] after the final norm, updated cache or None)."""
        config = self.config
        b, t = tokens.shape
        expected_s = t if cache is None else cache.max_len
        if attention_mask.shape != (b, t, expected_s):
            raise ValueError(
                f"attention_mask has shape {attention_mask.shape}, expected {(b, t, expected_s)}"
                + (" (cache slots)" if cache is not None else " (no cache: [B,T,T])")
            )
        if cache is not None and cache_index is None:
            raise ValueError("cache_index is required when a cache is given")
        if cache is not None:
            if cache.num_layers != config.num_layers or cache.batch_size != b:
                raise ValueError(
                    f"the cache has {cache.num_layers} layers and {cache.batch_size} rows, "
                    f"expected {config.num_layers} layers and {b} rows"
                )
            cache_index = jnp.asarray(cache_index, jnp.int32)
        mask = attention_mask.astype(bool)
        x = self.embed(tokens).astype(config.jnp_dtype)
        cos, sin = rope_tables(config, positions)
        run_block = _remat_block if config.remat else _call_block
        new_k, new_v = [], []
        for i, block in enumerate(self.layers):
            kv = None if cache is None else (cache.k[i], cache.v[i])
            x, kv = run_block(block, x, cos, sin, mask, kv, cache_index)
            if kv is not None:
                new_k.append(kv[0])
                new_v.append(kv[1])
        if cache is not None:
            cache = KVCache(k=tuple(new_k), v=tuple(new_v))
        return self.final_norm(x), cache

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


def _call_block(block, x, cos, sin, mask, kv, cache_index):
    return block(x, cos, sin, mask, kv, cache_index)


_remat_block = nnx.remat(_call_block)
