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

import contextlib
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
from mage_jax.generate.step import Sampling, SamplingParams, prefill, token_step
from mage_jax.models.sharding import to_host

DEFAULT_PROMPT_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
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


# -------------------------------------------------------------------------------------- sampler
@dataclasses.dataclass(frozen=True)
class Program:
    """Everything that selects a compiled lockstep program besides array shapes (the sampling settings
    are runtime values, ``step.Sampling``)."""

    constrained: bool


class Sampler:
    """Jitted batched generation for one model graph; see the module docstring.

    ``graphdef`` comes from ``nnx.split(model)``; ``config`` is its ``ModelConfig``. ``eos_ids`` stop a
    row; ``pad_id`` fills left padding and the unused tail of responses. With a ``mesh`` (axes
    'data', 'fsdp', 'tensor' of ``mage_jax.models.sharding``) the state is placed with
    ``state_shardings`` (default: the partition rules), rows of the batch and the KV cache over
    ('data', 'fsdp') and kv heads over 'tensor'. Without a mesh everything stays where it is.
    """

    def __init__(
        self,
        graphdef: Any,
        config: Any,
        *,
        eos_ids: Sequence[int],
        pad_id: int,
        prompt_buckets: Sequence[int] = DEFAULT_PROMPT_BUCKETS,
        batch_buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS,
        cache_dtype: Any = None,
        mesh: jax.sharding.Mesh | None = None,
        state_shardings: Any = None,
    ):
        if not eos_ids:
            raise ValueError("the sampler needs at least one EOS id")
        self.graphdef = graphdef
        self.config = config
        self.vocab_size = int(config.vocab_size)
        self.eos_ids = tuple(int(i) for i in eos_ids)
        self.pad_id = int(pad_id)
        for tid in (*self.eos_ids, self.pad_id):
            if not 0 <= tid < self.vocab_size:
                raise ValueError(
                    f"special token id {tid} is outside the model vocabulary [0, {self.vocab_size})"
                )
        self.prompt_buckets = sorted_buckets(prompt_buckets, "prompt_buckets")
        self.batch_buckets = sorted_buckets(batch_buckets, "batch_buckets")
        self.cache_dtype = cache_dtype
        self.mesh = mesh
        self.state_shardings = state_shardings
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
        state = self.place_state(state)
        if n == 0:
            return GenerationResult([], [], np.zeros(0, bool), self.compile_count)
        if min(lengths) == 0:
            raise ValueError(f"prompt {lengths.index(0)} is empty; every prompt needs at least one token")
        longest = max(lengths)
        if longest > self.prompt_buckets[-1]:
            row = lengths.index(longest)
            raise ValueError(
                f"prompt {row} has {longest} tokens, longer than the largest prompt bucket "
                f"({self.prompt_buckets[-1]}); shorten the prompt or add a larger bucket"
            )
        prompt_bucket = bucket(longest, self.prompt_buckets)
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
        tokens, valid = left_padded(prompts, batch, prompt_bucket, pad_id=self.pad_id,
                                    vocab_size=self.vocab_size)
        row_limits = np.zeros(batch, np.int32)  # dummy rows: limit 0, finished before the first step
        row_limits[:n] = limits
        transitions = None
        if automata is not None:
            states = max(1 if a is None else a.num_states for a in automata)
            transitions = stack_automata(
                list(automata) + [None] * (batch - n), self.vocab_size, num_states=pow2(states)
            )
        fn = self._program(Program(constrained=transitions is not None))
        cache = self._init_cache(batch, prompt_bucket + params.max_new_tokens)
        with jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
            out_tokens, out_logps, lengths, finished = fn(
                state,
                cache,
                *self._place_batch(tokens, valid, row_limits, transitions),
                key,
                Sampling.of(params, self.vocab_size),
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

        cache = jax.eval_shape(lambda: init_cache(self.config, rows, prompt_len + params.max_new_tokens,
                                                  self.cache_dtype))
        if self.mesh is not None:
            from mage_jax.models.sharding import cache_sharding

            sharding = cache_sharding(self.config, self.mesh, rows)
            cache = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), cache)
        batch = [jax.ShapeDtypeStruct(shape, dtype, sharding=self._row_sharding(rows)) for shape, dtype in
                 (((rows, prompt_len), jnp.int32), ((rows, prompt_len), jnp.bool_), ((rows,), jnp.int32))]
        fn = self._program(Program(constrained=False))
        with jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
            sampling = Sampling.of(params, self.vocab_size)
            return fn.lower(state, cache, *batch, None, jax.eval_shape(jax.random.key, 0), sampling)

    def _init_cache(self, batch: int, max_len: int):
        """A zero cache (mesh: cache sharding), donated to the jitted loop and written in place."""
        fn = self._init_cache_fns.get((batch, max_len))
        if fn is None:
            from mage_jax.models.transformer import init_cache

            sharding = None
            if self.mesh is not None:
                from mage_jax.models.sharding import cache_sharding

                sharding = cache_sharding(self.config, self.mesh, batch)
            args = (self.config, batch, max_len, self.cache_dtype)
            fn = jax.jit(functools.partial(init_cache, *args), out_shardings=sharding)
            self._init_cache_fns[(batch, max_len)] = fn
        return fn()

    def place_state(self, state: Any) -> Any:
        """``state`` placed with the sampler's parameter shardings (as it is without a mesh)."""
        if self.mesh is None and self.state_shardings is None:
            return state
        if self.state_shardings is None:
            from mage_jax.models.sharding import param_shardings

            self.state_shardings = param_shardings(state, self.mesh)
        return jax.device_put(state, self.state_shardings)

    def _row_sharding(self, rows: int) -> Any:
        """Rows over the mesh's batch axes (replicated when ``rows`` does not divide them); None: no mesh."""
        if self.mesh is None:
            return None
        from mage_jax.models.sharding import batch_sharding, replicated

        rows_sharding = batch_sharding(self.mesh)
        divisor = math.prod(self.mesh.shape[a] for a in rows_sharding.spec[0])
        return rows_sharding if rows % divisor == 0 else replicated(self.mesh)

    def _place_batch(self, *arrays):
        """Every array placed with ``_row_sharding`` of its rows (None stays None)."""
        if self.mesh is None:
            return arrays
        return [None if a is None else jax.device_put(a, self._row_sharding(a.shape[0])) for a in arrays]

    def _build(self, program: Program) -> Callable:
        graphdef = self.graphdef
        eos_ids = np.asarray(self.eos_ids, np.int32)  # a constant of the program: no device work
        pad_id = self.pad_id

        def run(state, cache, tokens, valid, limits, transitions, key, sampling):
            self.compile_count += 1  # runs once per trace, i.e. once per compiled program
            model = nnx.merge(graphdef, state)
            batch, prompt_len = tokens.shape
            max_len = cache.max_len
            max_new = max_len - prompt_len
            table = transitions if program.constrained else None

            def pick(step, logits, auto_state, done):
                """Choose token `step` for every row (one key for the batch)."""
                return token_step(logits, table, auto_state, jax.random.fold_in(key, step), done,
                                  sampling, eos_ids=eos_ids, pad_id=pad_id)

            hidden, cache = prefill(model, tokens, valid, cache)
            logits = model.logits(hidden[:, -1:, :])[:, 0]
            prompt_lens = valid.sum(axis=-1).astype(jnp.int32)
            kv_start = (prompt_len - prompt_lens).astype(jnp.int32)  # each row's first real slot

            done0 = limits <= 0
            out_tokens = jnp.full((batch, max_new), pad_id, jnp.int32)
            out_logps = jnp.zeros((batch, max_new), jnp.float32)
            drawn = pick(jnp.int32(0), logits, jnp.zeros((batch,), jnp.int32), done0)
            lengths = jnp.where(done0, 0, 1).astype(jnp.int32)
            carry = (
                jnp.int32(1),
                cache,
                drawn.token,
                out_tokens.at[:, 0].set(drawn.token),
                out_logps.at[:, 0].set(drawn.logp),
                drawn.auto,
                done0 | drawn.eos | (lengths >= limits),
                drawn.eos,
                lengths,
            )

            def cond(carry):
                step, done = carry[0], carry[6]
                return (step < max_new) & ~done.all()

            def body(carry):
                step, cache, prev, out_tokens, out_logps, auto_state, done, finished, lengths = carry
                slot = prompt_len + step - 1  # the previous token goes into this cache slot
                pos = (prompt_lens + step - 1)[:, None]
                hidden, cache = model(prev[:, None], pos, cache=cache, cache_index=slot, kv_start=kv_start)
                drawn = pick(step, model.logits(hidden)[:, 0], auto_state, done)
                lengths = lengths + (~done).astype(jnp.int32)
                finished = finished | drawn.eos
                done = done | drawn.eos | (lengths >= limits)
                out_tokens = jax.lax.dynamic_update_slice(out_tokens, drawn.token[:, None], (0, step))
                out_logps = jax.lax.dynamic_update_slice(out_logps, drawn.logp[:, None], (0, step))
                return (step + 1, cache, drawn.token, out_tokens, out_logps, drawn.auto, done, finished,
                        lengths)

            carry = jax.lax.while_loop(cond, body, carry)
            _, cache, _, out_tokens, out_logps, _, _, finished, lengths = carry
            return out_tokens, out_logps, lengths, finished, cache

        jitted = jax.jit(run, donate_argnums=(1,))

        def call(state, cache, tokens, valid, limits, transitions, key, sampling):
            out_tokens, out_logps, lengths, finished, _ = jitted(
                state, cache, tokens, valid, limits, transitions, key, sampling
            )
            return out_tokens, out_logps, lengths, finished

        call.lower = jitted.lower  # ahead-of-time lowering: ``lower``
        return call
