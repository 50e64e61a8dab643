"""Policy losses over padded token arrays [B, T] (docs/method.md §5): PPO clip with dual clip, loss
aggregation, KL estimators, entropy, and chunked per-token log-probs from the final hidden states.

All functions are pure; B is rows (responses), T response tokens, and ``response_mask`` marks real
response tokens (padding tokens and padding rows are 0 and never change a result).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
KL_KINDS = {"k1": "k1", "kl": "k1", "k2": "k2", "mse": "k2", "k3": "k3", "low_var_kl": "k3"}

# Log-probability given to tokens that constrained decoding forbids: exp of it is exactly 0 in
# float32 (so it acts as −inf), yet it stays finite, so a fully masked padding position or a
# masked-out forbidden target never turns a loss or a gradient into NaN.
DISALLOWED_LOGIT = -1e30


@functools.partial(jax.jit, static_argnames="mode")
def aggregate(values: jax.Array, mask: jax.Array, mode: str = "token-mean",
              row_weights: jax.Array | None = None) -> jax.Array:
    """Reduce per-token values [B, T] to a scalar.

    token-mean: mean over all unmasked tokens of the batch. seq-mean-token-mean: mean over tokens
    of each sequence, then over sequences. seq-mean-token-sum: sum over tokens of each sequence,
    then mean over sequences. Sequences without any unmasked token (padding rows) do not count.
    ``row_weights`` [B] counts row b as that many rows (identical rows merged into one); None: 1 each.
    """
    mask = mask.astype(values.dtype)
    if mode == "token-mean":
        weighted = mask if row_weights is None else mask * row_weights.astype(values.dtype)[:, None]
        return (values * weighted).sum() / jnp.maximum(weighted.sum(), 1.0)
    masked = values * mask
    tokens = mask.sum(axis=-1)
    present = (tokens > 0).astype(values.dtype)
    if row_weights is not None:
        present = present * row_weights.astype(values.dtype)
    if mode == "seq-mean-token-mean":
        per_sequence = masked.sum(axis=-1) / jnp.maximum(tokens, 1.0)
    elif mode == "seq-mean-token-sum":
        per_sequence = masked.sum(axis=-1)
    else:
        raise ValueError(f"unknown aggregation mode {mode!r}; expected one of {AGG_MODES}")
    return (per_sequence * present).sum() / jnp.maximum(present.sum(), 1.0)


def _masked_mean(values: jax.Array, mask: jax.Array, row_weights: jax.Array | None = None) -> jax.Array:
    return aggregate(values.astype(jnp.float32), mask, "token-mean", row_weights)


@functools.partial(jax.jit, static_argnames=("dual_clip", "agg_mode"))
def ppo_loss(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    response_mask: jax.Array,
    *,
    clip_eps: float = 0.2,
    dual_clip: float | None = 3.0,
    agg_mode: str = "token-mean",
    entropy: jax.Array | None = None,
    row_weights: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """PPO clipped surrogate with dual clip; returns (loss, diagnostics).

    ratio = exp(logp − old_logp); per token pg1 = −A·ratio, pg2 = −A·clip(ratio, 1−ε, 1+ε),
    loss = max(pg1, pg2), and for A < 0 the dual clip caps it: min(max(pg1, pg2), c·|A|) (Ye et al.,
    "Mastering Complex Control in MOBA Games with Deep RL", 2020), so a huge ratio on a bad token
    cannot blow up the update. ``advantages`` is [B] (one per row, broadcast to its tokens) or
    [B, T]; it is treated as a constant. ``dual_clip=None`` disables the dual clip. ``row_weights``
    [B] counts each row that many times (``aggregate``). The per-token loss is positively homogeneous
    in A, so rows with the same tokens whose advantages share a sign are one row of their mean
    advantage weighted by their count (``training.credit.merge_identical``).

    Diagnostics (masked token means): ``pg_loss``, ``clip_fraction`` (tokens where the clipped
    term is active), ``dual_clip_fraction``, ``approx_kl`` (mean of old_logp − logp, the k1
    estimate of KL(π_old‖π)) and, when per-token ``entropy`` is given, ``entropy``.
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip}")
    advantages = jax.lax.stop_gradient(advantages.astype(jnp.float32))
    if advantages.ndim == logp.ndim - 1:
        advantages = advantages[..., None]
    log_ratio = logp.astype(jnp.float32) - old_logp.astype(jnp.float32)
    ratio = jnp.exp(log_ratio)
    pg1 = -advantages * ratio
    pg2 = -advantages * jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    clipped = jnp.maximum(pg1, pg2)
    if dual_clip is None:
        per_token = clipped
        dual_active = jnp.zeros_like(clipped, dtype=bool)
    else:
        cap = -advantages * dual_clip  # = c·|A| where A < 0
        dual_active = (advantages < 0) & (cap < clipped)
        per_token = jnp.where(advantages < 0, jnp.minimum(clipped, cap), clipped)
    loss = aggregate(per_token, response_mask, agg_mode, row_weights)
    metrics = {
        "pg_loss": loss,
        "clip_fraction": _masked_mean(pg2 > pg1, response_mask, row_weights),
        "dual_clip_fraction": _masked_mean(dual_active, response_mask, row_weights),
        "approx_kl": _masked_mean(-log_ratio, response_mask, row_weights),
    }
    if entropy is not None:
        metrics["entropy"] = _masked_mean(entropy, response_mask, row_weights)
    return loss, jax.tree.map(jax.lax.stop_gradient, metrics)


@functools.partial(jax.jit, static_argnames="kind")
def kl_penalty(logp: jax.Array, ref_logp: jax.Array, kind: str = "k3") -> jax.Array:
    """Per-token estimate of KL(π‖π_ref) from log-probs of tokens sampled from π.

    k1 ("kl"): logp − ref. k2 ("mse"): ½(logp − ref)². k3 ("low_var_kl", Schulman's unbiased
    low-variance estimator): exp(ref − logp) − (ref − logp) − 1, clamped to [−10, 10]; the log
    ratio is first clamped to [−20, 20] so exp never overflows (an overflow would give NaN
    gradients through the clamp).
    """
    if kind not in KL_KINDS:
        raise ValueError(f"unknown KL estimator {kind!r}; expected one of {sorted(KL_KINDS)}")
    kind = KL_KINDS[kind]
    diff = logp.astype(jnp.float32) - ref_logp.astype(jnp.float32)
    if kind == "k1":
        return diff
    if kind == "k2":
        return 0.5 * diff**2
    log_ratio = jnp.clip(-diff, -20.0, 20.0)
    return jnp.clip(jnp.exp(log_ratio) - log_ratio - 1.0, -10.0, 10.0)


def entropy_from_logits(logits: jax.Array) -> jax.Array:
    """Entropy of softmax(logits) over the last axis (float32)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -(jnp.exp(logp) * logp).sum(axis=-1)


@functools.partial(jax.jit, static_argnames=("chunk_size",))
def token_logprobs_and_entropy(
    hidden: jax.Array,
    head_weight: jax.Array,
    targets: jax.Array,
    *,
    chunk_size: int,
    temperature: float = 1.0,
    allowed: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Per-token log π(target) and entropy of the policy, chunked over T.

    hidden [B, T, H] (after the final norm), head_weight [H, V], targets int[B, T] → two float32
    [B, T]. Logits are hidden @ head_weight / temperature, computed in float32 for ``chunk_size``
    positions at a time under ``lax.map``, so neither the forward nor the backward pass ever holds
    [B, T, V] logits (Qwen3: V = 151,936). ``allowed`` bool[B, T, V] (constrained decoding) sets
    forbidden logits to a finite stand-in for −inf before the log-softmax; both outputs describe the
    constrained distribution. Differentiable in ``hidden`` and ``head_weight`` (the temperature is a
    constant of the objective).

    The gradient is written by hand (``_head_vjp``): the forward keeps only the per-position
    log-normaliser, the backward recomputes each chunk's logits once and forms the logit cotangent in
    one elementwise pass, ``g_logp·(onehot − p) − g_H·p·(log p + H)``. Differentiating through the
    rematerialised log-softmax, entropy and target gather instead costs several more passes over the
    [B, chunk, V] logits and a scatter; ``chunked_reference`` is that simple path, kept as the oracle.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    temperature = jnp.asarray(temperature, jnp.float32)
    return _head(hidden, head_weight, targets.astype(jnp.int32), allowed, temperature, chunk_size)


def _split(x: jax.Array, chunk_size: int) -> jax.Array:
    """[B, T, ...] → [num_chunks, B, chunk, ...], zero-padded at the end of T."""
    batch, length = x.shape[:2]
    num_chunks = -(-length // chunk_size)
    x = jnp.pad(x, [(0, 0), (0, num_chunks * chunk_size - length)] + [(0, 0)] * (x.ndim - 2))
    return jnp.moveaxis(x.reshape((batch, num_chunks, chunk_size) + x.shape[2:]), 1, 0)


def _merge(x: jax.Array, length: int) -> jax.Array:
    """[num_chunks, B, chunk] → [B, T]."""
    batch = x.shape[1]
    return jnp.moveaxis(x, 0, 1).reshape(batch, -1)[:, :length]


def _chunk_logits(h: jax.Array, w: jax.Array, a: jax.Array | None, temperature: jax.Array) -> jax.Array:
    logits = jnp.einsum("bch,hv->bcv", h, w, preferred_element_type=jnp.float32) / temperature
    return logits if a is None else jnp.where(a, logits, DISALLOWED_LOGIT)


def _head_forward(hidden, head_weight, targets, allowed, temperature, chunk_size):
    """(logp, entropy, log-normaliser), each [B, T] float32."""

    def chunk_fn(args):
        h, t, a = args
        logits = _chunk_logits(h, head_weight, a, temperature)
        lse = jax.nn.logsumexp(logits, axis=-1)
        logp_all = logits - lse[..., None]
        logp = jnp.take_along_axis(logp_all, t[..., None], axis=-1)[..., 0]
        entropy = -(jnp.exp(logp_all) * logp_all).sum(axis=-1)
        return logp, entropy, lse

    xs = (_split(hidden, chunk_size), _split(targets, chunk_size),
          None if allowed is None else _split(allowed, chunk_size))
    length = hidden.shape[1]
    return tuple(_merge(x, length) for x in jax.lax.map(chunk_fn, xs))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _head(hidden, head_weight, targets, allowed, temperature, chunk_size):
    logp, entropy, _ = _head_forward(hidden, head_weight, targets, allowed, temperature, chunk_size)
    return logp, entropy


def _head_fwd(hidden, head_weight, targets, allowed, temperature, chunk_size):
    logp, entropy, lse = _head_forward(hidden, head_weight, targets, allowed, temperature, chunk_size)
    return (logp, entropy), (hidden, head_weight, targets, allowed, temperature, entropy, lse)


def _head_vjp(chunk_size, residuals, cotangents):
    hidden, head_weight, targets, allowed, temperature, entropy, lse = residuals
    g_logp, g_entropy = cotangents
    vocab = head_weight.shape[1]

    def chunk_fn(d_weight, args):
        h, t, a, ent, norm, g_lp, g_ent = args
        logp_all = _chunk_logits(h, head_weight, a, temperature) - norm[..., None]
        p = jnp.exp(logp_all)
        onehot = t[..., None] == jnp.arange(vocab, dtype=t.dtype)
        d_logits = jnp.where(onehot, g_lp[..., None], 0.0) - p * (
            g_lp[..., None] + g_ent[..., None] * (logp_all + ent[..., None]))
        if a is not None:
            d_logits = jnp.where(a, d_logits, 0.0)
        d_logits = (d_logits / temperature).astype(head_weight.dtype)
        d_h = jnp.einsum("bcv,hv->bch", d_logits, head_weight, preferred_element_type=jnp.float32)
        d_weight = d_weight + jnp.einsum("bch,bcv->hv", h, d_logits, preferred_element_type=jnp.float32)
        return d_weight, d_h.astype(hidden.dtype)

    split = functools.partial(_split, chunk_size=chunk_size)
    xs = (split(hidden), split(targets), None if allowed is None else split(allowed), split(entropy),
          split(lse), split(g_logp.astype(jnp.float32)), split(g_entropy.astype(jnp.float32)))
    d_weight, d_hidden = jax.lax.scan(chunk_fn, jnp.zeros(head_weight.shape, jnp.float32), xs)
    batch, length, width = hidden.shape
    d_hidden = jnp.moveaxis(d_hidden, 0, 1).reshape(batch, -1, width)[:, :length]
    # The temperature is a constant of the objective: its cotangent is zero.
    return d_hidden, d_weight.astype(head_weight.dtype), None, None, jnp.zeros_like(temperature)


_head.defvjp(_head_fwd, _head_vjp)


@functools.partial(jax.jit, static_argnames=("chunk_size",))
def chunked_reference(
    hidden: jax.Array,
    head_weight: jax.Array,
    targets: jax.Array,
    *,
    chunk_size: int,
    temperature: float = 1.0,
    allowed: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The simple path ``token_logprobs_and_entropy`` must agree with: the same chunked forward under
    ``jax.checkpoint``, differentiated by autodiff."""

    @jax.checkpoint
    def chunk_fn(args):
        h, t, a = args
        logp_all = jax.nn.log_softmax(_chunk_logits(h, head_weight, a, temperature), axis=-1)
        logp = jnp.take_along_axis(logp_all, t[..., None], axis=-1)[..., 0]
        return logp, -(jnp.exp(logp_all) * logp_all).sum(axis=-1)

    xs = (_split(hidden, chunk_size), _split(targets.astype(jnp.int32), chunk_size),
          None if allowed is None else _split(allowed, chunk_size))
    logp, entropy = jax.lax.map(chunk_fn, xs)
    return _merge(logp, hidden.shape[1]), _merge(entropy, hidden.shape[1])
