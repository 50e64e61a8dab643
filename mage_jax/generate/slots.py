"""The rollout engine's slot programs (``CompiledSlotPrograms``: the ``spec.SlotPrograms`` it runs,
compiled by XLA): a fixed set of decode slots over one static KV cache.

``generate.sampler.Sampler`` runs one batch from prefill to its longest row; the engine
(``generate.engine``) instead keeps ``S`` decode *slots* alive for a whole rollout and moves
rows in and out of them between short decode chunks. This module holds the device programs and the
slot state they share; scheduling (which request goes where, prefix sharing, packing) is the engine's.

* ``insert``: prefill ``U`` distinct prompts (left-padded to a prompt bucket ``P``, causal attention
  among the prompt tokens only, exactly the sampler's prefill), copy their keys and values into ``T``
  target slots (``U <= T``: the G copies of a group are prefilled once and copied G times) at cache
  positions ``0..P-1``, and draw each target's first token from the prefill logits. The prompt rows
  shard over the batch axes; the targets arrive by device block and each device copies keys and values
  into its own slots only (``_on_blocks``, a ``shard_map``), so a donor slot must lie on its target's
  device (copies at global slot indices would make XLA hold every target's keys and values on every
  device; docs/scaling.md). The copies happen layer by layer inside the prefill (a
  ``models.transformer.KVSink``), so no temporary cache of every layer of the prompt rows is held.
* ``decode``: up to ``chunk`` decode steps of every slot at once, leaving the loop early when every slot
  is done. Each slot writes at its own cache position and attends over its own span
  ``kv_start .. write`` (per-row ``cache_index`` of ``models.transformer``), so a slot that holds a
  short prompt of its second turn decodes next to one deep in a long first response. A decode program
  computes a *slot bucket*: the first ``b`` slots of every device's block (``slot_buckets``: all, 1/4,
  1/16, ... of a block), so when few slots are left a chunk computes few rows.
* ``move``: copy slots into other slots of the same device's block (cache row and every per-slot field)
  and free the sources; the engine packs the running slots into the front of each block with it.

Slots shard over the mesh's batch axes in contiguous blocks of ``local_slots``; viewed as
``[ways, local_slots, ...]`` an insert's copies, a slot bucket and a move stay on each device (no cache
row crosses devices).

Static shapes: the slot count ``S``, the cache length ``L = largest prompt bucket + max_new_tokens``,
the response buffer ``N = max_new_tokens``, the automaton states ``Q``. The set of programs is small and
fixed: an insert takes ``insert_rows`` targets per device block and prefills its distinct prompts in a
*prompt-row bucket* (``prompt_row_buckets``: ``ways`` x 1, 2, 4, ... up to ``insert_rows``, so three
distinct prompts of a block of eight prefill four rows, not eight), so it compiles once per prompt
bucket ``P`` and prompt-row bucket; a decode once per slot bucket (two by default: all slots, a quarter) over
the whole cache; a move once. The engine splits larger inserts. After warm-up nothing recompiles
(``compile_count`` counts traces), and ``CompiledSlotPrograms.shared`` gives every engine of a process
with the same model graph and shapes the same programs: a second run, or an evaluation after training (other
sampling settings are runtime values, ``step.Sampling``), compiles no new engine program.

Randomness: a slot's token ``i`` is drawn with ``fold_in(fold_in(fold_in(fold_in(key, a), b), c), i)``
where ``(a, b, c)`` is the request's *key path* (the runner uses meta-episode, episode, phase/turn), so
a response does not depend on which slot ran it or what ran beside it. Token choice, masking, the
automaton and the end of sequence are ``generate.step.token_step`` (the lockstep sampler's), with one
key per row.

Constraints: the run's automata live on the device, factorised (``generate.bank``: a token -> column map
and small [Q, C] tables, uploaded once and when a new automaton arrives); every slot carries the index of
its automaton in that bank (an unconstrained request gets the accept-all automaton, which leaves the
logits unchanged), masked exactly like the sampler's dense tables. An insert sends that index, not a
table (``insert_bytes``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mage_jax.generate import shapes
from mage_jax.generate.bank import MIN_AUTOMATA, MIN_COLUMNS, MIN_STATES, Bank, ConstraintBank
from mage_jax.generate.engine import RolloutEngine
from mage_jax.generate.spec import Donor, ModelSpec
from mage_jax.generate.step import KEY_PATH_LEN, Sampling, SamplingParams, count_token, row_keys, token_step
from mage_jax.models.transformer import KVCache, KVSink, init_cache, positions_from_mask, update_layer

_NOWHERE = 2**30  # a cache position past any cache: the write is dropped
DEFAULT_CHUNK = 8  # decode steps between the engine's host checks
DEFAULT_SLOT_LEVELS = 2  # slot buckets: all slots, 1/4 (then 1/16, ...)
DEFAULT_INSERT_ROWS = 8  # targets (and prompts) per insert program and device block
_SHARED: dict[tuple, CompiledSlotPrograms] = {}  # CompiledSlotPrograms.shared: this process's programs


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Slots:
    """Device state of ``S`` decode slots (arrays lead with the slot axis, sharded like cache rows)."""

    cache: KVCache
    last: jax.Array  # int32[S]: the last drawn token, fed at the next step
    write: jax.Array  # int32[S]: the cache position where ``last`` is written
    position: jax.Array  # int32[S]: the rotary position of ``last``
    kv_start: jax.Array  # int32[S]: the slot's first real cache position (left padding before it)
    length: jax.Array  # int32[S]: response tokens drawn so far
    limit: jax.Array  # int32[S]: the request's token limit
    done: jax.Array  # bool[S]: EOS, limit reached, or free
    finished: jax.Array  # bool[S]: the response ended with EOS
    auto: jax.Array  # int32[S]: automaton state
    rule: jax.Array  # int32[S]: the slot's automaton in the bank
    key_path: jax.Array  # int32[S, KEY_PATH_LEN]
    tokens: jax.Array  # int32[S, N]
    logprobs: jax.Array  # float32[S, N]
    prompt_hidden: jax.Array  # [S, H]: the final hidden state of the slot's last prompt token

    @property
    def num_slots(self) -> int:
        return self.last.shape[0]



class CompiledSlotPrograms:
    """The insert, decode and move programs of ``S`` slots for the model of ``spec`` (its graph, special
    ids, prompt buckets, mesh and parameter shardings), compiled by XLA: the ``spec.SlotPrograms`` the
    rollout engine runs; see the module docstring."""

    def __init__(self, spec: ModelSpec, *, slots: int, max_new_tokens: int, chunk: int = DEFAULT_CHUNK,
                 slot_levels: int = DEFAULT_SLOT_LEVELS, insert_rows: int = DEFAULT_INSERT_ROWS,
                 window_levels: int = 1):
        if min(slots, chunk, max_new_tokens, slot_levels, insert_rows, window_levels) < 1:
            raise ValueError(f"slots, chunk, max_new_tokens, slot_levels, insert_rows and window_levels must "
                             f"be positive, got {slots}, {chunk}, {max_new_tokens}, {slot_levels}, "
                             f"{insert_rows}, {window_levels}")
        mesh = spec.mesh
        ways = 1 if mesh is None else mesh.shape["data"] * mesh.shape["fsdp"]
        if slots % ways:
            raise ValueError(f"engine slots ({slots}) must be a multiple of the mesh's data x fsdp "
                             f"ways ({ways}) so that slots shard with the rows")
        self.spec = spec
        self.num_slots = int(slots)
        self.ways = ways
        self.local_slots = self.num_slots // ways
        # Slot buckets (per device): the whole block, its quarter, ... (slot_levels of them).
        self.slot_buckets = tuple(sorted({-(-self.local_slots // 4**k) for k in range(slot_levels)}))
        self.insert_rows = min(int(insert_rows), self.local_slots)
        # Prompt rows an insert prefills (all devices together): ways x 1, 2, 4, ... and the whole insert.
        self.prompt_row_buckets = tuple(sorted({ways * min(2**k, self.insert_rows)
                                                for k in range(self.insert_rows.bit_length() + 1)}))
        self.max_new_tokens = int(max_new_tokens)
        self.chunk = int(chunk)
        self.max_len = spec.prompt_buckets[-1] + self.max_new_tokens
        # Decode windows: the whole cache, its half, ... (window_levels of them, none under a chunk).
        self.windows = tuple(sorted({max(-(-self.max_len // 2**k), self.chunk)
                                     for k in range(window_levels)}))
        self.compile_count = 0
        self._insert: Callable | None = None
        self._decodes: dict[tuple[int, int], Callable] = {}
        self._moves: Callable | None = None
        self._empty: Callable | None = None
        self._accept_all: Bank | None = None
        self.last_insert_bytes = (0, 0)
        """(all, automaton indices): host -> device bytes of the latest insert's arguments."""
        self._specs: Any = None

    @classmethod
    def shared(cls, spec: ModelSpec, *, slots: int, max_new_tokens: int, chunk: int = DEFAULT_CHUNK,
               slot_levels: int = DEFAULT_SLOT_LEVELS, insert_rows: int = DEFAULT_INSERT_ROWS,
               window_levels: int = 1) -> CompiledSlotPrograms:
        """The programs of ``spec``'s model and these shapes, built once per process: every engine with
        the same graph, special ids, prompt buckets, cache dtype, mesh and shapes gets one instance (and
        so no new compile). Unhashable parts (an exotic mesh or dtype) fall back to a new one."""
        shape = dict(slots=slots, max_new_tokens=max_new_tokens, chunk=chunk, slot_levels=slot_levels,
                     insert_rows=insert_rows, window_levels=window_levels)
        key = (spec.program_key, tuple(sorted(shape.items())))
        try:
            found = _SHARED.get(key)
        except TypeError:
            return cls(spec, **shape)
        if found is None:
            found = _SHARED[key] = cls(spec, **shape)
        return found

    # ------------------------------------------------------------------------------------ state
    def _shardings(self) -> Any:
        mesh = self.spec.mesh
        if mesh is None:
            return None
        from mage_jax.models.sharding import batch_sharding, cache_sharding

        rows = batch_sharding(mesh)
        cache = cache_sharding(self.spec.config, mesh, self.num_slots)
        example = jax.eval_shape(self._zeros)
        return dataclasses.replace(
            jax.tree.map(lambda _: rows, example),
            cache=jax.tree.map(lambda _: cache, example.cache),
        )

    def _zeros(self) -> Slots:
        s, n = self.num_slots, self.max_new_tokens
        spec = self.spec
        zeros = functools.partial(jnp.zeros, (s,), jnp.int32)
        return Slots(
            cache=init_cache(spec.config, s, self.max_len, spec.cache_dtype),
            last=zeros(), write=zeros(), position=zeros(), kv_start=zeros(), length=zeros(),
            limit=zeros(), done=jnp.ones((s,), bool), finished=jnp.zeros((s,), bool), auto=zeros(),
            rule=zeros(),
            key_path=jnp.zeros((s, KEY_PATH_LEN), jnp.int32),
            tokens=jnp.full((s, n), spec.pad_id, jnp.int32),
            logprobs=jnp.zeros((s, n), jnp.float32),
            prompt_hidden=jnp.zeros((s, spec.config.hidden_size), spec.config.jnp_dtype),
        )

    def abstract_slots(self) -> Slots:
        """The shapes, dtypes and shardings of ``empty()`` without allocating them."""
        shapes_ = jax.eval_shape(self._zeros)
        shardings = self._shardings()
        if shardings is None:
            return shapes_
        return jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), shapes_,
                            shardings)

    def abstract_bank(self, shape: tuple[int, int, int] | None = None) -> Bank:
        """The shapes of a constraint bank of ``shape`` (A, Q, C; default: the smallest), replicated."""
        a, q, c = shape or (MIN_AUTOMATA, MIN_STATES, MIN_COLUMNS)
        sharding = self.bank_sharding()
        return Bank(jax.ShapeDtypeStruct((self.spec.vocab_size,), jnp.int32, sharding=sharding),
                    jax.ShapeDtypeStruct((a, q, c), jnp.int32, sharding=sharding))

    def bank_sharding(self) -> Any:
        """Where a constraint bank lives: replicated over the mesh (None without one)."""
        if self.spec.mesh is None:
            return None
        from mage_jax.models.sharding import replicated

        return replicated(self.spec.mesh)

    def accept_all_bank(self) -> Bank:
        """The bank of unconstrained requests only (index 0), for callers without automata."""
        if self._accept_all is None:
            self._accept_all = ConstraintBank(self.spec.vocab_size).device(self.bank_sharding())
        return self._accept_all

    def empty(self) -> Slots:
        """``S`` free slots (every slot done), sharded over the mesh's batch axes with the rows."""
        if self._empty is None:
            self._empty = jax.jit(self._zeros, out_shardings=self._shardings())
        return self._empty()

    # ----------------------------------------------------------------------------------- insert
    def insert(self, state: Any, slots: Slots, prompts: Sequence[Sequence[int]], source: Sequence[int],
               targets: Sequence[int], limits: Sequence[int], rules: Sequence[int],
               key_paths: np.ndarray, params: SamplingParams, key: jax.Array,
               donors: Sequence[Donor | None] | None = None, *, bank: Bank | None = None) -> Slots:
        """Prefill the distinct ``prompts`` once and start request t in slot ``targets[t]`` from prompt
        ``source[t]`` (``limits[t]`` new tokens, automaton ``rules[t]`` of ``bank`` (None: the accept-all
        bank), key path ``key_paths[t]``).

        ``donors[t]``, when given, is a slot that already holds request t's prompt (same tokens): its
        keys and values are copied instead (``source[t]`` is then ignored, and ``prompts`` may be empty)."""
        spec = self.spec
        donors = list(donors) if donors is not None else [None] * len(targets)
        u, t = len(prompts), len(targets)
        if not (0 <= u <= t <= self.num_slots and t > 0 and len(donors) == t):
            raise ValueError(f"an insert needs 0 <= prompts ({u}) <= targets ({t}) <= slots, one donor each")
        if any(d is None for d in donors) and u == 0:
            raise ValueError("a target without a donor needs a prompt to prefill")
        lengths = [len(p) for p in prompts]
        if u and (max(lengths) > spec.prompt_buckets[-1] or min(lengths) == 0):
            raise ValueError(f"prompts must have 1..{spec.prompt_buckets[-1]} tokens")
        p_bucket = self.prompt_bucket(prompts, donors)
        local, ways = self.local_slots, self.ways
        per_block: list[list[int]] = [[] for _ in range(ways)]  # request indices by their target's device
        for i, (slot, d) in enumerate(zip(targets, donors)):
            if d is not None and d.slot // local != slot // local:
                raise ValueError(f"donor slot {d.slot} and target slot {slot} lie on different devices")
            per_block[slot // local].append(i)
        if max(len(b) for b in per_block) > self.insert_rows:
            raise ValueError(f"an insert takes at most {self.insert_rows} targets per device block "
                             f"(insert_rows); split it")
        t_bucket = self.insert_rows
        u_bucket = shapes.bucket(max(u, 1), self.prompt_row_buckets)
        tokens, valid = shapes.left_padded(prompts, u_bucket, p_bucket, pad_id=spec.pad_id,
                                           vocab_size=spec.vocab_size)
        valid[u:, -1] = True  # dummy prompts: one real token, so their (discarded) prefill stays finite
        shape = (ways, t_bucket)
        src = np.zeros(shape, np.int32)
        donor = np.full(shape, -1, np.int32)  # -1: from the prefill; else the donor's index in the block
        base = np.full(shape, p_bucket, np.int32)  # the cache position of the first decode step
        lens = np.ones(shape, np.int32)
        dst = np.full(shape, local, np.int32)  # out of the block: dropped by the scatters
        lim = np.zeros(shape, np.int32)
        rule = np.zeros(shape, np.int32)
        paths = np.zeros(shape + (KEY_PATH_LEN,), np.int32)
        for w, block in enumerate(per_block):
            for j, i in enumerate(block):
                d = donors[i]
                if d is None:
                    src[w, j] = source[i]
                    lens[w, j] = len(prompts[source[i]])
                else:
                    donor[w, j], base[w, j], lens[w, j] = d.slot % local, d.bucket, d.length
                dst[w, j] = targets[i] % local
                lim[w, j] = min(limits[i], self.max_new_tokens)
                rule[w, j] = rules[i]
                paths[w, j] = key_paths[i]
        sent = (tokens, valid, src, donor, base, lens, dst, lim, rule, paths)
        self.last_insert_bytes = (sum(a.nbytes for a in sent), rule.nbytes)
        with self.spec.mesh_context():
            return self._insert_program()(state, slots, tokens, valid, src, donor, base, lens, dst, lim,
                                          rule, paths, key, self._sampling(params),
                                          bank or self.accept_all_bank())

    def _sampling(self, params: SamplingParams) -> Sampling:
        return Sampling.of(params, self.spec.vocab_size)

    def _insert_program(self) -> Callable:
        if self._insert is None:
            self._insert = self._build_insert()
        return self._insert

    def lower_insert(self, state: Any, params: SamplingParams, *, prompt_len: int,
                     bank_shape: tuple[int, int, int] | None = None) -> jax.stages.Lowered:
        """The insert program for the prompt bucket ``prompt_len`` (its largest shape: ``insert_rows`` targets
        per device block and as many prompt rows), lowered ahead of time for ``state`` (arrays or
        ``ShapeDtypeStruct`` leaves with their shardings) and a bank of ``bank_shape``; nothing is
        allocated."""
        i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
        block = (self.ways, self.insert_rows)
        rows = self.insert_rows * self.ways
        args = (self.spec.abstract_placed(state), self.abstract_slots(), i32((rows, prompt_len)),
                jax.ShapeDtypeStruct((rows, prompt_len), jnp.bool_), *(i32(block) for _ in range(6)),
                i32(block), i32(block + (KEY_PATH_LEN,)),
                jax.eval_shape(jax.random.key, 0), self._sampling(params), self.abstract_bank(bank_shape))
        with self.spec.mesh_context():
            return self._insert_program().lower(*args)

    def prompt_bucket(self, prompts: Sequence[Sequence[int]], donors: Sequence[Donor | None]) -> int:
        """The prompt bucket of an insert: it holds the longest prompt and every donor's bucket."""
        longest = max([len(p) for p in prompts] + [d.bucket for d in donors if d is not None])
        return shapes.bucket(longest, self.spec.prompt_buckets)

    def _build_insert(self) -> Callable:
        spec = self.spec
        graphdef, pad_id = spec.generation_graphdef, spec.pad_id
        eos_ids = np.asarray(spec.eos_ids, np.int32)  # a constant of the program: no device work

        def run(state, slots: Slots, tokens, valid, src, donor, base, prompt_lens, dst, limits, rule, paths,
                key, sampling, bank) -> Slots:
            # Targets arrive by device block ([ways, t]: ``dst`` and ``donor`` index slots inside the block),
            # so every gather and scatter into the slots stays on the device that holds them; the prefill's
            # prompt rows shard over the batch axes (each device prefills rows / ways prompts) and each
            # layer's keys and values are gathered from them where a block copies them.
            self.compile_count += 1  # runs once per trace
            model = nnx.merge(graphdef, state)
            specs = self._leaf_specs(slots)
            rows, p = tokens.shape
            if rows % self.ways == 0:
                tokens, valid = self._constrain(tokens, specs.last), self._constrain(valid, specs.last)
            copied = donor >= 0
            from_slot = jnp.maximum(donor, 0)
            gather = (dst, from_slot, copied, src)

            def copy_keys(block, d, f, c, s, x):  # keys [local, Hkv, D, L]: the donor's first P positions
                return block.at[d, :, :, :p].set(jnp.where(c[:, None, None, None], block[f, :, :, :p], x[s]),
                                                 mode="drop")

            def copy_values(block, d, f, c, s, x):  # values [local, Hkv, L, D]
                return block.at[d, :, :p, :].set(jnp.where(c[:, None, None, None], block[f, :, :p, :], x[s]),
                                                 mode="drop")

            def sink(cache: KVCache, layer, k, v) -> KVCache:
                # Layer ``layer``'s prompt keys [rows, Hkv, D, P] and values [rows, Hkv, P, D] go straight
                # into the targets' slots (or a donor's are copied), one layer at a time inside the
                # prefill: no cache of every layer of the prompt rows is ever held.
                k, v = k.astype(cache.k[0].dtype), v.astype(cache.v[0].dtype)
                return update_layer(lambda ck, cv: (
                    self._on_blocks(copy_keys, ck, specs.cache.k[0], gather, k),
                    self._on_blocks(copy_values, cv, specs.cache.v[0], gather, v)), cache, layer)

            # The sampler's prefill (``step.prefill``) with its keys and values sunk into the slots.
            hidden, cache = model(tokens, positions_from_mask(valid), valid, sink=KVSink(sink, slots.cache))

            held = self._blocks(slots.prompt_hidden, specs.prompt_hidden)
            prompt_hidden = jax.vmap(lambda h, f: h[f])(held, from_slot)
            last_hidden = jnp.where(copied[..., None], prompt_hidden, hidden[:, -1, :][src])  # [ways, t, H]
            flat = functools.partial(self._flat_rows, spec=specs.last)
            logits = model.logits(flat(last_hidden)[:, None, :])[:, 0]  # [ways * t, V]
            zeros = jnp.zeros(src.size, jnp.int32)
            done0 = flat(limits <= 0)
            keys = row_keys(key, flat(paths), zeros)
            drawn = token_step(logits, (bank, flat(rule)), zeros, keys, done0, sampling, eos_ids=eos_ids,
                               pad_id=pad_id)
            token, logp, auto = drawn.token, drawn.logp, drawn.auto
            length, done, finished = count_token(drawn, zeros, done0, jnp.zeros_like(done0), flat(limits))
            n = slots.tokens.shape[1]
            row_tokens = jnp.full((src.size, n), pad_id, jnp.int32).at[:, 0].set(token)
            row_logps = jnp.zeros((src.size, n), jnp.float32).at[:, 0].set(logp)

            def put(array, value, spec):
                value = value.reshape(src.shape + value.shape[1:])
                return self._on_blocks(lambda b, d, v: b.at[d].set(v, mode="drop"), array, spec, (dst, value))

            return Slots(
                cache=cache,
                last=put(slots.last, token, specs.last),
                write=put(slots.write, flat(base), specs.write),
                position=put(slots.position, flat(prompt_lens), specs.position),
                kv_start=put(slots.kv_start, flat(base - prompt_lens), specs.kv_start),
                length=put(slots.length, length, specs.length),
                limit=put(slots.limit, flat(limits), specs.limit),
                done=put(slots.done, done, specs.done),
                finished=put(slots.finished, finished, specs.finished),
                auto=put(slots.auto, auto, specs.auto),
                rule=put(slots.rule, flat(rule), specs.rule),
                key_path=put(slots.key_path, flat(paths), specs.key_path),
                tokens=put(slots.tokens, row_tokens, specs.tokens),
                logprobs=put(slots.logprobs, row_logps, specs.logprobs),
                prompt_hidden=put(slots.prompt_hidden, flat(last_hidden), specs.prompt_hidden),
            )

        return jax.jit(run, donate_argnums=(1,))

    # ------------------------------------------------------------------------- blocks of slots
    # Slot g lives on device g // local_slots of the batch axes (rows shard in contiguous blocks). Viewed
    # as [ways, local_slots, ...], the first b slots of every block are one array sharded like the rows,
    # so a decode over them and a move inside a block need no communication between devices.
    def _leaf_specs(self, slots: Slots) -> Slots:
        """A ``PartitionSpec`` per leaf of ``slots`` (None leaves without a mesh)."""
        if self.spec.mesh is None:
            return jax.tree.map(lambda _: None, slots)
        if self._specs is None:
            self._specs = jax.tree.map(lambda sh: sh.spec, self._shardings())
        return self._specs

    def _blocks(self, x: jax.Array, spec: Any) -> jax.Array:
        """[S, ...] -> [ways, local_slots, ...], the ways axis sharded as the slot axis was."""
        view = x.reshape((self.ways, self.local_slots) + x.shape[1:])
        return self._constrain(view, None if spec is None else P(spec[0], None, *spec[1:]))

    def _unblocks(self, x: jax.Array, spec: Any) -> jax.Array:
        """[ways, b, ...] -> [ways * b, ...], sharded like slot rows."""
        return self._constrain(x.reshape((-1,) + x.shape[2:]), spec)

    def _on_blocks(self, fn: Callable, x: jax.Array, spec: Any, targets: Sequence[jax.Array],
                   shared: jax.Array | None = None) -> jax.Array:
        """``fn(block, *targets[, shared])`` on every device's own block of slot array ``x`` [S, ...]:
        ``targets`` are [ways, t, ...] arrays (one row per block), ``shared`` [U, ...] the same rows on
        every device (its other axes sharded like ``x``'s). A ``shard_map``, so that gathers and scatters
        at per-block indices never move a block off its device."""
        extra = () if shared is None else (shared,)
        if spec is None:
            return fn(x, *(a[0] for a in targets), *extra)

        def local(block, *args):
            n = len(targets)
            return fn(block, *(a[0] for a in args[:n]), *args[n:])

        in_specs = (spec, *(P(spec[0], *([None] * (a.ndim - 1))) for a in targets),
                    *(P(None, *spec[1:]) for _ in extra))
        return jax.shard_map(local, in_specs=in_specs, out_specs=spec)(x, *targets, *extra)

    def _flat_rows(self, x: jax.Array, spec: Any) -> jax.Array:
        """[ways, t, ...] (targets by block) -> [ways * t, ...], sharded like slot rows."""
        return self._unblocks(x, None if spec is None else P(spec[0], *([None] * (x.ndim - 2))))

    def _constrain(self, x: jax.Array, spec: Any) -> jax.Array:
        if spec is None:
            return x
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.spec.mesh, spec))

    def slot_bucket(self, highest_local: int) -> int:
        """The smallest slot bucket (per device) that holds local slot index ``highest_local``."""
        return shapes.bucket(highest_local + 1, self.slot_buckets)

    # ------------------------------------------------------------------------------------ moves
    def move(self, slots: Slots, moves: Sequence[tuple[int, int]]) -> Slots:
        """Move slot ``src`` to slot ``dst`` for each (src, dst) of ``moves``: its cache row and every
        per-slot field are copied, and ``src`` is marked done (free). Both slots of a move must lie on
        the same device's block, sources and destinations must be distinct slots."""
        if not moves:
            return slots
        local, ways = self.local_slots, self.ways
        per_block: list[list[tuple[int, int]]] = [[] for _ in range(ways)]
        for src, dst in moves:
            if src // local != dst // local:
                raise ValueError(f"slot {src} and slot {dst} lie on different devices")
            per_block[src // local].append((src % local, dst % local))
        m = local  # one program: every move of a block fits
        src_ix = np.full((ways, m), local, np.int32)  # out of range: padding moves are dropped
        dst_ix = np.full((ways, m), local, np.int32)
        for d, block in enumerate(per_block):
            for i, (a, b) in enumerate(block):
                src_ix[d, i], dst_ix[d, i] = a, b
        if self._moves is None:
            self._moves = self._build_move()
        with self.spec.mesh_context():
            return self._moves(slots, src_ix, dst_ix)

    def _build_move(self) -> Callable:
        def run(slots: Slots, src, dst) -> Slots:
            self.compile_count += 1
            specs = self._leaf_specs(slots)

            def one(block, s, t):  # [local, ...]: rows s copied to rows t
                return block.at[t].set(block[jnp.minimum(s, self.local_slots - 1)], mode="drop")

            def moved(x, spec):
                out = jax.vmap(one)(self._blocks(x, spec), src, dst)
                return self._constrain(out.reshape(x.shape), spec)

            out = jax.tree.map(moved, slots, specs)
            done = jax.vmap(lambda block, s: block.at[s].set(True, mode="drop"))(
                self._blocks(out.done, specs.done), src)
            return dataclasses.replace(out, done=self._constrain(done.reshape(-1), specs.done))

        return jax.jit(run, donate_argnums=(0,))

    # ----------------------------------------------------------------------------------- decode
    def window(self, furthest_write: int) -> int:
        """The cache prefix a decode chunk attends over: the smallest of ``windows`` that holds
        ``furthest_write + chunk`` positions. By default (``window_levels=1``) the only window is the whole
        cache: decode attention costs in proportion to the window, but every window is one more program
        per slot bucket to compile (``decode(window=...)`` still takes any)."""
        return shapes.bucket(furthest_write + self.chunk, self.windows)

    def decode(self, state: Any, slots: Slots, params: SamplingParams, key: jax.Array,
               window: int | None = None, bucket: int | None = None, *,
               bank: Bank | None = None) -> tuple[Slots, jax.Array]:
        """Up to ``chunk`` steps of the decoded slots (fewer when all are done); returns (slots, steps).

        ``window``: attend over the first ``window`` cache positions only (``window(furthest write)``);
        every active slot's writes of this chunk must fall inside it. None: the whole cache.
        ``bucket``: decode the first ``bucket`` slots of every device's block only (a ``slot_buckets``
        entry; ``ways * bucket`` rows computed per step); every active slot must lie among them.
        None: every slot."""
        with self.spec.mesh_context():
            return self._decode_program(window, bucket)(state, slots, key, self._sampling(params),
                                                        bank or self.accept_all_bank())

    def _decode_program(self, window: int | None, bucket: int | None) -> Callable:
        window = self.max_len if window is None else int(window)
        bucket = self.local_slots if bucket is None else int(bucket)
        if bucket not in self.slot_buckets:
            raise ValueError(f"slot bucket {bucket} is not one of {self.slot_buckets}")
        fn = self._decodes.get((window, bucket))
        if fn is None:
            fn = self._decodes[window, bucket] = self._build_decode(window, bucket)
        return fn

    def lower_decode(self, state: Any, params: SamplingParams, *, window: int | None = None,
                     bucket: int | None = None, bank_shape: tuple[int, int, int] | None = None
                     ) -> jax.stages.Lowered:
        """The decode program of one chunk (``window`` / ``bucket`` as in ``decode``; None: the whole cache,
        every slot), lowered ahead of time for ``state`` like ``lower_insert``."""
        with self.spec.mesh_context():
            return self._decode_program(window, bucket).lower(
                self.spec.abstract_placed(state), self.abstract_slots(), jax.eval_shape(jax.random.key, 0),
                self._sampling(params), self.abstract_bank(bank_shape))

    def _build_decode(self, window: int, bucket: int) -> Callable:
        spec = self.spec
        graphdef, pad_id, chunk = spec.generation_graphdef, spec.pad_id, self.chunk
        eos_ids = np.asarray(spec.eos_ids, np.int32)  # a constant of the program: no device work
        whole = bucket == self.local_slots and window == self.max_len

        def run(state, slots: Slots, key, sampling, bank):
            self.compile_count += 1
            model = nnx.merge(graphdef, state)
            n = slots.tokens.shape[1]
            rows = jnp.arange(self.ways * bucket)

            def cond(carry):
                step, s = carry
                return (step < chunk) & ~s.done.all()

            def body(carry):
                step, s = carry
                # Finished and free slots write past the cache (dropped): a slot that holds a prompt
                # other requests copy stays intact, and any window is safe for them.
                write = jnp.where(s.done, _NOWHERE, s.write)
                hidden, cache = model(s.last[:, None], s.position[:, None], cache=s.cache,
                                      cache_index=write, kv_start=s.kv_start)
                active = ~s.done
                drawn = token_step(model.logits(hidden)[:, 0], (bank, s.rule), s.auto,
                                   row_keys(key, s.key_path, s.length), s.done, sampling,
                                   eos_ids=eos_ids, pad_id=pad_id)
                column = jnp.where(active, s.length, n)  # done slots write out of range: dropped
                length, done, finished = count_token(drawn, s.length, s.done, s.finished, s.limit)
                step_up = active.astype(jnp.int32)
                s = dataclasses.replace(
                    s, cache=cache, last=jnp.where(active, drawn.token, s.last), write=s.write + step_up,
                    position=s.position + step_up, length=length, done=done, finished=finished,
                    auto=drawn.auto, tokens=s.tokens.at[rows, column].set(drawn.token, mode="drop"),
                    logprobs=s.logprobs.at[rows, column].set(drawn.logp, mode="drop"),
                )
                return step + 1, s

            if whole:
                steps, out = jax.lax.while_loop(cond, body, (jnp.int32(0), slots))
                return out, steps
            # The first ``bucket`` slots of every block and the first ``window`` cache positions are
            # copied in, decoded, and written back after the chunk.
            specs = self._leaf_specs(slots)
            # The window axis of each cache leaf: keys [S, H, D, L], values [S, H, L, D].
            axes = dataclasses.replace(jax.tree.map(lambda _: None, slots), cache=KVCache(
                k=tuple(3 for _ in slots.cache.k), v=tuple(2 for _ in slots.cache.v)))

            def take(x, spec, axis):
                part = self._blocks(x, spec)[:, :bucket]
                if axis is not None:  # the window axis of a cache leaf, shifted by the block axis
                    part = jax.lax.slice_in_dim(part, 0, window, axis=axis + 1)
                return self._unblocks(part, spec)

            def give(x, part, spec):
                block = part.reshape((self.ways, bucket) + part.shape[1:])
                full = jax.lax.dynamic_update_slice(self._blocks(x, spec), block, (0,) * block.ndim)
                return self._constrain(full.reshape(x.shape), spec)

            sub = jax.tree.map(take, slots, specs, axes)
            steps, sub = jax.lax.while_loop(cond, body, (jnp.int32(0), sub))
            out = jax.tree.map(give, slots, sub, specs)
            return out, steps

        return jax.jit(run, donate_argnums=(1,))


def compiled_engine(spec: ModelSpec, *, slots: int, max_new_tokens: int, chunk: int = DEFAULT_CHUNK,
                    slot_levels: int = DEFAULT_SLOT_LEVELS, insert_rows: int = DEFAULT_INSERT_ROWS,
                    window_levels: int = 1, overlap: bool = True) -> RolloutEngine:
    """The rollout engine of ``spec`` over the process's compiled slot programs of these shapes
    (``CompiledSlotPrograms.shared``: another engine of the same model and shapes, in this run or the next
    one of the process, reuses them).

    ``slots``: concurrent rows (a multiple of the mesh's data x fsdp ways); ``max_new_tokens``: the longest
    response; ``chunk``: decode steps between host checks; ``slot_levels``: slot buckets (all slots, 1/4,
    ...); ``insert_rows``: requests one insert starts per device block (more are split);
    ``window_levels``: the cache prefixes a chunk may attend over, the whole cache, its half, its quarter,
    ... (one decode program each per slot bucket); a chunk takes the smallest that holds its furthest
    slot's next writes, from the host's bound of every slot's write position (its insert's bucket plus
    the steps of its chunks), so choosing one reads nothing back and waits for no insert. 1: always the
    whole cache. ``overlap``: ``RolloutEngine``'s."""
    programs = CompiledSlotPrograms.shared(spec, slots=slots, max_new_tokens=max_new_tokens, chunk=chunk,
                                           slot_levels=slot_levels, insert_rows=insert_rows,
                                           window_levels=window_levels)
    return RolloutEngine(spec, programs=programs, overlap=overlap)
