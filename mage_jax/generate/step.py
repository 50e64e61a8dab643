"""The per-token step every generation program runs, and the prefill that precedes it.

Both device paths (the lockstep ``sampler.Sampler`` and the engine's slot programs in ``slots``) draw a
token the same way: mask the logits with the row's automaton state, choose (``choose_tokens``), advance
the automaton, detect the end of the sequence, and mark rows done. ``token_step`` is that step, written
once; ``prefill`` is the prompt pass before it.

Which distribution is what
--------------------------
Tokens are drawn from ``softmax(masked_logits / temperature)`` restricted to the top-k / top-p set
(greedy / temperature 0: argmax of the masked logits). The returned log-prob of a token is always
``log_softmax(masked_logits)[token]`` at temperature 1 *without* top-k / top-p truncation, where
``masked_logits`` sets the tokens disallowed by the row's constraint automaton to -inf (no constraint:
the raw logits). That is exactly what the trainer recomputes with ``temperature=1`` and
``allowed=constraint_masks(...)``, so sampler and trainer log-probs agree at temperature 1.

Randomness: the lockstep sampler draws a step's tokens with one key for the whole batch; the engine
gives every row its own key (``row_keys``: the request's *key path*, then the token index), so a
response does not depend on the slot it ran in or on the requests beside it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mage_jax.generate.bank import Bank, bank_rows
from mage_jax.generate.constraints import allowed_tokens
from mage_jax.models.transformer import positions_from_mask

KEY_PATH_LEN = 3
_NEG_INF = -jnp.inf


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. ``temperature=0`` or ``greedy=True`` is argmax; ``top_k=0`` / ``top_p=1`` are off.

    Every field but ``max_new_tokens`` (which sizes the KV cache) is a runtime value of the programs
    (``Sampling``): training's and evaluation's settings run the same compiled programs.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    greedy: bool = False

    def __post_init__(self) -> None:
        if not (isinstance(self.max_new_tokens, int) and self.max_new_tokens > 0):
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0


TOP_K_CAP = 64
"""Top-k up to this many tokens draws from ``lax.top_k(logits, TOP_K_CAP)`` (about one pass over the
vocabulary per row); a larger k, and top-p without top-k, sort the whole vocabulary per row and step
(their cost: docs/performance.md, "Fewer programs")."""

# How a step draws (``Sampling.mode``), chosen on the host from ``SamplingParams``; a ``lax.switch`` in
# the program runs only the chosen branch.
GREEDY, PLAIN, TOP_K, SORTED = 0, 1, 2, 3


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Sampling:
    """``SamplingParams`` as program arguments (scalars): one compiled program serves every setting."""

    mode: Any  # int32: GREEDY, PLAIN (softmax of all tokens), TOP_K (k <= TOP_K_CAP), SORTED (the rest)
    temperature: Any  # float32 (1 when greedy)
    top_k: Any  # int32 (0: off)
    top_p: Any  # float32 (1: off)

    @classmethod
    def of(cls, params: SamplingParams, vocab_size: int) -> Sampling:
        top_k = min(params.top_k, vocab_size)
        if params.is_greedy:
            mode = GREEDY
        elif 0 < top_k <= min(TOP_K_CAP, vocab_size):
            mode = TOP_K
        elif top_k > 0 or params.top_p < 1.0:
            mode = SORTED
        else:
            mode = PLAIN
        temperature = params.temperature if params.temperature > 0 else 1.0
        return cls(np.int32(mode), np.float32(temperature), np.int32(top_k), np.float32(params.top_p))


# --------------------------------------------------------------------------------- token choice
def choose_tokens(logits: jax.Array, allowed: jax.Array | None, key: jax.Array,
                  sampling: Sampling) -> tuple[jax.Array, jax.Array]:
    """Draw one token per row; return (token int32[B], log-prob float32[B] at temperature 1, masked).

    ``key``: one key for the batch (scalar) or one key per row ([B]); row b's uniform is then drawn
    from its own key alone, so a row's token does not depend on the rows beside it."""
    logits = logits.astype(jnp.float32)
    if allowed is not None:
        logits = jnp.where(allowed, logits, _NEG_INF)
    logp_all = jax.nn.log_softmax(logits, axis=-1)
    rows, vocab = logits.shape
    if key.ndim == 0:
        u = jax.random.uniform(key, (rows, 1), jnp.float32)
    else:
        u = jax.vmap(lambda k: jax.random.uniform(k, (1,), jnp.float32))(key)
    top_k, top_p = sampling.top_k, sampling.top_p
    cap = min(TOP_K_CAP, vocab)

    def greedy():
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def scaled():  # inside the branches: greedy skips it
        return logits / sampling.temperature

    def plain():
        return _draw(u, scaled())

    def truncated(vals, idx):  # descending vals [B, n] with their token ids: top-k, then top-p
        vals = jnp.where(jnp.arange(vals.shape[-1])[None, :] < top_k, vals, _NEG_INF)
        vals = jnp.where(top_p < 1.0, _top_p_filter_sorted(vals, top_p), vals)
        return jnp.take_along_axis(idx, _draw(u, vals)[:, None], axis=1)[:, 0].astype(jnp.int32)

    def top_k_capped():
        return truncated(*jax.lax.top_k(scaled(), cap))

    def sorted_all():
        scaled_ = scaled()
        iota = jnp.broadcast_to(jnp.arange(vocab, dtype=jnp.int32), scaled_.shape)
        neg, idx = jax.lax.sort_key_val(-scaled_, iota, dimension=-1, is_stable=True)
        vals = -neg

        def nucleus():  # top-p alone: the smallest kept logit is the threshold; ties at it are all kept
            kept = _top_p_filter_sorted(vals, top_p)
            threshold = jnp.min(jnp.where(jnp.isfinite(kept), kept, jnp.inf), axis=-1, keepdims=True)
            return _draw(u, jnp.where(scaled_ >= threshold, scaled_, _NEG_INF))

        return jax.lax.cond(top_k > 0, lambda: truncated(vals, idx), nucleus)

    token = jax.lax.switch(sampling.mode, (greedy, plain, top_k_capped, sorted_all))
    logp = jnp.take_along_axis(logp_all, token[:, None], axis=1)[:, 0]
    return token, logp


def sample_categorical(key: jax.Array, logits: jax.Array, *, block: int = 256) -> jax.Array:
    """One draw per row from softmax(logits) [B,V] by inverting the CDF with one uniform per row.

    The same distribution as ``jax.random.categorical`` (Gumbel-max), but with B random numbers
    instead of B*V and a two-level CDF (block sums, then the one chosen block) instead of a prefix
    sum over V: on CPU the Gumbel noise of a large vocabulary costs more than the model's decode step.
    Tokens of probability 0 (-inf logits) are never drawn.
    """
    return _draw(jax.random.uniform(key, (logits.shape[0], 1), jnp.float32), logits, block=block)


def _draw(u: jax.Array, logits: jax.Array, *, block: int = 256) -> jax.Array:
    """``sample_categorical`` with the uniforms ``u`` [B, 1] in [0, 1) given."""
    rows, vocab = logits.shape
    logits = logits.astype(jnp.float32)
    block = min(block, vocab)
    blocks = -(-vocab // block)
    shifted = logits - jnp.max(logits, axis=-1, keepdims=True)
    shifted = jnp.pad(shifted, ((0, 0), (0, blocks * block - vocab)), constant_values=-jnp.inf)
    weights = jnp.exp(shifted.reshape(rows, blocks, block))  # unnormalised probabilities
    mass = weights.sum(axis=-1)  # [B, blocks]
    cdf = jnp.cumsum(mass, axis=-1)
    u = u * cdf[:, -1:]
    chosen = _first_above(cdf, u, mass)
    inner = jnp.take_along_axis(weights, chosen[:, None, None], axis=1)[:, 0]  # [B, block]
    below = jnp.take_along_axis(cdf - mass, chosen[:, None], axis=1)
    offset = _first_above(jnp.cumsum(inner, axis=-1), u - below, inner)
    return (chosen * block + offset).astype(jnp.int32)


def _first_above(cdf: jax.Array, u: jax.Array, mass: jax.Array) -> jax.Array:
    """Index of the first cdf entry above u; rounding past the end falls back to the last entry with mass."""
    index = jnp.sum(cdf <= u, axis=-1)
    last = mass.shape[-1] - 1 - jnp.argmax((mass > 0)[:, ::-1], axis=-1)
    return jnp.minimum(index, last)


def _top_p_filter_sorted(sorted_logits: jax.Array, top_p: jax.Array) -> jax.Array:
    """Keep the smallest prefix of descending logits whose probability mass reaches top_p (at least one)."""
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = mass_before < top_p
    keep = keep.at[:, 0].set(True)
    return jnp.where(keep, sorted_logits, _NEG_INF)


def row_keys(key: jax.Array, key_path: jax.Array, step: jax.Array) -> jax.Array:
    """One PRNG key per row: ``key`` folded with the row's key path, then with the token index."""

    def one(path, i):
        k = key
        for j in range(KEY_PATH_LEN):
            k = jax.random.fold_in(k, path[j])
        return jax.random.fold_in(k, i)

    return jax.vmap(one)(key_path, step)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Drawn:
    """One step's outcome per row: the token (pad where the row was done), its log-prob (0 there), the
    automaton state after it, and whether it is an end-of-sequence token."""

    token: jax.Array
    logp: jax.Array
    auto: jax.Array
    eos: jax.Array


def token_step(logits: jax.Array, transitions: jax.Array | tuple[Bank, jax.Array] | None, auto: jax.Array,
               key: jax.Array, done: jax.Array, sampling: Sampling, *, eos_ids: jax.Array,
               pad_id: int) -> Drawn:
    """Mask ``logits`` [B, V] with each row's automaton state (``transitions`` [B, Q, V], or a bank and
    each row's automaton in it, ``generate.bank``; None: unconstrained), choose a token, advance the
    automaton and detect EOS. Rows already ``done`` draw ``pad_id`` with log-prob 0 and keep their state.
    ``key``: one key for the batch, or one per row."""
    allowed = nxt = None
    if isinstance(transitions, tuple):
        allowed, nxt = bank_rows(*transitions, auto)
    elif transitions is not None:
        allowed, nxt = allowed_tokens(transitions, auto)
    token, logp = choose_tokens(logits, allowed, key, sampling)
    token = jnp.where(done, pad_id, token)
    logp = jnp.where(done, 0.0, logp)
    if nxt is not None:
        auto = jnp.where(done, auto, jnp.take_along_axis(nxt, token[:, None], axis=1)[:, 0])
    eos = (token[:, None] == eos_ids[None, :]).any(axis=-1) & ~done
    return Drawn(token, logp, auto, eos)


def count_token(drawn: Drawn, length: jax.Array, done: jax.Array, finished: jax.Array,
                limit: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The per-row tail of every step after ``token_step`` (both programs, the first token and every
    decoded one): a row that was not ``done`` counts its token in ``length``; it is done once it drew an
    end of sequence or holds ``limit`` tokens, and ``finished`` when it drew the end of sequence.
    Returns (length, done, finished)."""
    length = length + (~done).astype(jnp.int32)
    return length, done | drawn.eos | (length >= limit), finished | drawn.eos


def prefill(model: Any, tokens: jax.Array, valid: jax.Array, cache: Any) -> tuple[jax.Array, Any]:
    """The prompt pass: left-padded ``tokens`` [B, P] (``valid`` marks the real ones) attend causally
    among the real tokens only; their keys and values fill cache positions 0..P-1. Returns the hidden
    states [B, P, H] and the cache."""
    return model(tokens, positions_from_mask(valid), valid, cache, jnp.int32(0))
