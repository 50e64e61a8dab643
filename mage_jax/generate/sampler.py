"""Batched generation under ``jax.jit``: prefill, then a ``lax.while_loop`` decode over a KV cache.

One call generates a response for every prompt of a lockstep turn. Shapes are fixed at the jit
boundary so a training run compiles a bounded number of times:

* prompts are left-padded to the smallest *prompt bucket* that holds the longest one (a longer prompt
  is one clear ``ValueError``);
* the batch is padded to the smallest *batch bucket* with masked dummy rows (finished before the first
  step, never duplicated, discarded); a batch larger than the largest bucket runs in several calls;
* the cache holds ``prompt_bucket + max_new_tokens`` slots; it is preallocated outside the jitted
  function, donated to it and written in place (prefill fills slots ``0..P-1``, decode step ``i``
  writes slot ``P+i``); the loop exits as soon as every row is finished.

How tokens are chosen (and which log-prob comes back) is ``generate.step``, shared with the
engine's slot programs.

Stop strings are not checked on device: generation stops on EOS ids only.

Constrained decoding: each row may carry a ``generate.constraints.TokenAutomaton`` (the trie of its
legal action strings); the sampler masks every draw with the row's current state, and the train step
replays the same automaton (``constraints.constraint_masks``) in the log-prob recompute.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mage_jax.generate.constraints import TokenAutomaton, stack_automata
from mage_jax.generate.shapes import bucket, left_padded, pow2, sorted_buckets
from mage_jax.generate.spec import ModelSpec
from mage_jax.generate.step import Sampling, SamplingParams, count_token, prefill, token_step
from mage_jax.models.sharding import to_host

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclasses.dataclass
class GenerationResult:
    """Per prompt, in input order: response ids (EOS included when produced) and their log-probs."""

    tokens: list[np.ndarray]
    logprobs: list[np.ndarray]
    finished: np.ndarray  # bool[B]: the row produced an EOS (or, after truncation, a stop string)
    compile_count: int
    prompt_bucket: int = 0
    batch_buckets: tuple[int, ...] = ()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Lockstep:
    """The state of the lockstep decode loop (arrays lead with the batch's rows, as ``slots.Slots``)."""

    step: Any  # int32: the response index of the token drawn next
    cache: Any  # KVCache: the prompts' and the responses' keys and values so far
    last: Any  # int32[B]: the last drawn token, fed at the next step
    tokens: Any  # int32[B, N]: response tokens (pad where a row was done)
    logprobs: Any  # float32[B, N]: their log-probs (0 where a row was done)
    auto: Any  # int32[B]: automaton state
    done: Any  # bool[B]: EOS, limit reached, or a dummy row
    finished: Any  # bool[B]: the response ended with EOS
    length: Any  # int32[B]: response tokens drawn so far


# -------------------------------------------------------------------------------------- sampler
@dataclasses.dataclass(frozen=True)
class Program:
    """Everything that selects a compiled lockstep program besides array shapes (the sampling settings
    are runtime values, ``step.Sampling``)."""

    constrained: bool


class Sampler:
    """Jitted batched generation for the model of ``spec`` (``generate.spec.ModelSpec``: graph, special
    ids, prompt buckets, mesh); see the module docstring. A batch is padded to the smallest of
    ``batch_buckets`` that holds it (a larger one runs in chunks of the largest)."""

    def __init__(self, spec: ModelSpec, *, batch_buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS):
        self.spec = spec
        self.batch_buckets = sorted_buckets(batch_buckets, "batch_buckets")
        self.compile_count = 0
        self._compiled: dict[Program, Callable] = {}
        self._init_cache_fns: dict[tuple[int, int], Callable] = {}

    # ----------------------------------------------------------------------------- public entry
    def generate(
        self,
        state: Any,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        rng: jax.Array,
        *,
        constraints: TokenAutomaton | Sequence[TokenAutomaton | None] | None = None,
        max_new_tokens_per_row: Sequence[int] | np.ndarray | None = None,
    ) -> GenerationResult:
        """Generate one response per prompt (token ids, already chat-formatted).

        ``constraints``: one automaton for every row, or one per row (None = unconstrained row).
        ``max_new_tokens_per_row``: per-row limits, capped at ``params.max_new_tokens``.
        """
        n = len(prompts)
        lengths = [len(p) for p in prompts]
        spec = self.spec
        state = spec.place_state(state)
        if n == 0:
            return GenerationResult([], [], np.zeros(0, bool), self.compile_count)
        if min(lengths) == 0:
            raise ValueError(f"prompt {lengths.index(0)} is empty; every prompt needs at least one token")
        longest = max(lengths)
        if longest > spec.prompt_buckets[-1]:
            row = lengths.index(longest)
            raise ValueError(
                f"prompt {row} has {longest} tokens, longer than the largest prompt bucket "
                f"({spec.prompt_buckets[-1]}); shorten the prompt or add a larger bucket"
            )
        prompt_bucket = bucket(longest, spec.prompt_buckets)
        limits = self._row_limits(max_new_tokens_per_row, n, params.max_new_tokens)
        automata = self._row_automata(constraints, n)

        tokens_out: list[np.ndarray] = []
        logprobs_out: list[np.ndarray] = []
        finished_out: list[np.ndarray] = []
        used_buckets: list[int] = []
        chunk = self.batch_buckets[-1]
        keys = jax.random.split(rng, (n + chunk - 1) // chunk)
        for c, start in enumerate(range(0, n, chunk)):
            rows = slice(start, min(start + chunk, n))
            toks, lps, fin, bb = self._generate_chunk(
                state,
                prompts[rows],
                limits[rows],
                None if automata is None else automata[rows],
                prompt_bucket,
                params,
                keys[c],
            )
            tokens_out += toks
            logprobs_out += lps
            finished_out.append(fin)
            used_buckets.append(bb)
        return GenerationResult(
            tokens=tokens_out,
            logprobs=logprobs_out,
            finished=np.concatenate(finished_out),
            compile_count=self.compile_count,
            prompt_bucket=prompt_bucket,
            batch_buckets=tuple(used_buckets),
        )

    # ---------------------------------------------------------------------------------- helpers
    def _row_limits(self, per_row, n: int, max_new: int) -> np.ndarray:
        if per_row is None:
            return np.full(n, max_new, np.int32)
        limits = np.asarray(per_row)
        if limits.shape != (n,) or not np.issubdtype(limits.dtype, np.integer):
            raise ValueError(f"max_new_tokens_per_row must be {n} integers, got shape {limits.shape}")
        if (limits < 0).any():
            raise ValueError("max_new_tokens_per_row must be >= 0")
        return np.minimum(limits, max_new).astype(np.int32)

    def _row_automata(self, constraints, n: int) -> list[TokenAutomaton | None] | None:
        if constraints is None:
            return None
        if isinstance(constraints, TokenAutomaton):
            return [constraints] * n
        automata = list(constraints)
        if len(automata) != n:
            raise ValueError(f"got {len(automata)} constraints for {n} prompts")
        if all(a is None for a in automata):
            return None
        return automata

    def _generate_chunk(self, state, prompts, limits, automata, prompt_bucket, params, key):
        n = len(prompts)
        batch = bucket(n, self.batch_buckets)
        spec = self.spec
        tokens, valid = left_padded(prompts, batch, prompt_bucket, pad_id=spec.pad_id,
                                    vocab_size=spec.vocab_size)
        row_limits = np.zeros(batch, np.int32)  # dummy rows: limit 0, finished before the first step
        row_limits[:n] = limits
        transitions = None
        if automata is not None:
            states = max(1 if a is None else a.num_states for a in automata)
            transitions = stack_automata(
                list(automata) + [None] * (batch - n), spec.vocab_size, num_states=pow2(states)
            )
        fn = self._program(Program(constrained=transitions is not None))
        cache = self._init_cache(batch, prompt_bucket + params.max_new_tokens)
        with spec.mesh_context():
            out_tokens, out_logps, lengths, finished = fn(
                state,
                cache,
                *self._place_batch(tokens, valid, row_limits, transitions),
                key,
                Sampling.of(params, spec.vocab_size),
            )
        out_tokens, out_logps, lengths, finished = (to_host(a) for a in (out_tokens, out_logps, lengths,
                                                                          finished))
        toks = [out_tokens[r, : lengths[r]].copy() for r in range(n)]
        lps = [out_logps[r, : lengths[r]].copy() for r in range(n)]
        return toks, lps, finished[:n].copy(), batch

    def _program(self, program: Program) -> Callable:
        fn = self._compiled.get(program)
        if fn is None:
            fn = self._compiled[program] = self._build(program)
        return fn

    def lower(self, state: Any, params: SamplingParams, *, rows: int, prompt_len: int) -> jax.stages.Lowered:
        """The lockstep program of ``rows`` unconstrained prompts of ``prompt_len`` tokens and
        ``params.max_new_tokens`` new ones, lowered ahead of time for ``state`` (arrays or
        ``ShapeDtypeStruct`` leaves with their shardings) with its KV cache; nothing is allocated."""
        from mage_jax.models.transformer import init_cache

        spec = self.spec
        cache = jax.eval_shape(lambda: init_cache(spec.config, rows, prompt_len + params.max_new_tokens,
                                                  spec.cache_dtype))
        if spec.mesh is not None:
            from mage_jax.models.sharding import cache_sharding

            sharding = cache_sharding(spec.config, spec.mesh, rows)
            cache = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), cache)
        batch = [jax.ShapeDtypeStruct(shape, dtype, sharding=self._row_sharding(rows)) for shape, dtype in
                 (((rows, prompt_len), jnp.int32), ((rows, prompt_len), jnp.bool_), ((rows,), jnp.int32))]
        fn = self._program(Program(constrained=False))
        with spec.mesh_context():
            sampling = Sampling.of(params, spec.vocab_size)
            key = jax.eval_shape(jax.random.key, 0)
            return fn.lower(spec.abstract_placed(state), cache, *batch, None, key, sampling)

    def _init_cache(self, batch: int, max_len: int):
        """A zero cache (mesh: cache sharding), donated to the jitted loop and written in place."""
        fn = self._init_cache_fns.get((batch, max_len))
        if fn is None:
            from mage_jax.models.transformer import init_cache

            sharding = None
            spec = self.spec
            if spec.mesh is not None:
                from mage_jax.models.sharding import cache_sharding

                sharding = cache_sharding(spec.config, spec.mesh, batch)
            args = (spec.config, batch, max_len, spec.cache_dtype)
            fn = jax.jit(functools.partial(init_cache, *args), out_shardings=sharding)
            self._init_cache_fns[(batch, max_len)] = fn
        return fn()

    def _row_sharding(self, rows: int) -> Any:
        """Rows over the mesh's batch axes (replicated when ``rows`` does not divide them); None: no mesh."""
        mesh = self.spec.mesh
        if mesh is None:
            return None
        from mage_jax.models.sharding import batch_sharding, replicated

        rows_sharding = batch_sharding(mesh)
        divisor = math.prod(mesh.shape[a] for a in rows_sharding.spec[0])
        return rows_sharding if rows % divisor == 0 else replicated(mesh)

    def _place_batch(self, *arrays):
        """Every array placed with ``_row_sharding`` of its rows (None stays None)."""
        if self.spec.mesh is None:
            return arrays
        return [None if a is None else jax.device_put(a, self._row_sharding(a.shape[0])) for a in arrays]

    def _build(self, program: Program) -> Callable:
        graphdef = self.spec.generation_graphdef
        eos_ids = np.asarray(self.spec.eos_ids, np.int32)  # a constant of the program: no device work
        pad_id = self.spec.pad_id

        def run(state, cache, tokens, valid, limits, transitions, key, sampling):
            self.compile_count += 1  # runs once per trace, i.e. once per compiled program
            model = nnx.merge(graphdef, state)
            batch, prompt_len = tokens.shape
            max_len = cache.max_len
            table = transitions if program.constrained else None

            def pick(step, logits, auto_state, done):
                """Choose token `step` for every row (one key for the batch)."""
                return token_step(logits, table, auto_state, jax.random.fold_in(key, step), done,
                                  sampling, eos_ids=eos_ids, pad_id=pad_id)

            hidden, cache = prefill(model, tokens, valid, cache)
            logits = model.logits(hidden[:, -1:, :])[:, 0]
            prompt_lens = valid.sum(axis=-1).astype(jnp.int32)
            kv_start = (prompt_len - prompt_lens).astype(jnp.int32)  # each row's first real slot

            n = max_len - prompt_len
            zeros = jnp.zeros((batch,), jnp.int32)
            drawn = pick(jnp.int32(0), logits, zeros, limits <= 0)
            length, done, finished = count_token(drawn, zeros, limits <= 0, jnp.zeros((batch,), bool), limits)
            init = _Lockstep(
                step=jnp.int32(1), cache=cache, last=drawn.token,
                tokens=jnp.full((batch, n), pad_id, jnp.int32).at[:, 0].set(drawn.token),
                logprobs=jnp.zeros((batch, n), jnp.float32).at[:, 0].set(drawn.logp),
                auto=drawn.auto, done=done, finished=finished, length=length)

            def cond(s: _Lockstep):
                return (s.step < n) & ~s.done.all()

            def body(s: _Lockstep) -> _Lockstep:
                slot = prompt_len + s.step - 1  # the previous token goes into this cache slot
                pos = (prompt_lens + s.step - 1)[:, None]
                hidden, cache = model(s.last[:, None], pos, cache=s.cache, cache_index=slot,
                                      kv_start=kv_start)
                drawn = pick(s.step, model.logits(hidden)[:, 0], s.auto, s.done)
                length, done, finished = count_token(drawn, s.length, s.done, s.finished, limits)
                return _Lockstep(
                    step=s.step + 1, cache=cache, last=drawn.token,
                    tokens=jax.lax.dynamic_update_slice(s.tokens, drawn.token[:, None], (0, s.step)),
                    logprobs=jax.lax.dynamic_update_slice(s.logprobs, drawn.logp[:, None], (0, s.step)),
                    auto=drawn.auto, done=done, finished=finished, length=length)

            out = jax.lax.while_loop(cond, body, init)
            return out.tokens, out.logprobs, out.length, out.finished, out.cache

        jitted = jax.jit(run, donate_argnums=(1,))

        def call(state, cache, tokens, valid, limits, transitions, key, sampling):
            out_tokens, out_logps, lengths, finished, _ = jitted(
                state, cache, tokens, valid, limits, transitions, key, sampling
            )
            return out_tokens, out_logps, lengths, finished

        call.lower = jitted.lower  # ahead-of-time lowering: ``lower``
        return call
