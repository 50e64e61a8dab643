"""Stand-in slot programs for ``experiments.benchmarks.rollout_host``: the real engine host code over
programs that only book time.

``StandInPrograms`` implements ``generate.spec.SlotPrograms`` (what the engine sees of its programs): an
insert does the real insert's host work and plans each response as a walk through the request's automaton
in the constraint bank the engine sends (so the environments see legal moves); a decode chunk or a
packing move advances the slots it planned. Every program books its cost (``DeviceCosts``: measured on
this CPU's real programs by ``measure_cpu_costs``, divided by a speedup) on one device timeline after the
programs before it, and its outputs (``DeviceArray``) wait for it when the host reads them, as JAX's
asynchronous dispatch does. ``stand_in_engine`` is the real ``RolloutEngine`` over them (at Qwen's
vocabulary, ``stand_in_spec``), and ``stand_in_policy`` the real ``LLMPolicy`` over that engine.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import random
import time
import types
from collections.abc import Sequence
from typing import Any

import numpy as np

from mage_jax.generate import shapes
from mage_jax.generate.bank import Bank
from mage_jax.generate.engine import RolloutEngine
from mage_jax.generate.slots import DEFAULT_INSERT_ROWS, DEFAULT_SLOT_LEVELS
from mage_jax.generate.spec import Donor, ModelSpec
from mage_jax.generate.step import KEY_PATH_LEN, SamplingParams
from mage_jax.models.config import ModelConfig
from mage_jax.rollout.policy import LLMPolicy
from mage_jax.tokenizer import Tokenizer

QWEN_VOCAB = ModelConfig.preset("qwen3-0.6b").vocab_size
"""The stand-in model's vocabulary width: Qwen's, so automata and the constraint bank are built at it."""


@dataclasses.dataclass(frozen=True)
class DeviceCosts:
    """Seconds each device program costs: a full decode chunk (``chunk`` steps) by slot bucket, an insert
    by prompt bucket, a move. ``source``: how each was obtained (measured on this CPU, or a flag)."""

    decode_s: dict[int, float]
    insert_s: dict[int, float]
    move_s: float
    source: dict[str, str] = dataclasses.field(default_factory=dict)

    def scaled(self, factor: float) -> DeviceCosts:
        return DeviceCosts({b: t * factor for b, t in self.decode_s.items()},
                           {b: t * factor for b, t in self.insert_s.items()}, self.move_s * factor,
                           self.source)

    def insert(self, prompt_bucket: int) -> float:
        return self.insert_s[shapes.bucket(prompt_bucket, sorted(self.insert_s))]

    def decode(self, slot_bucket: int) -> float:
        return self.decode_s[shapes.bucket(slot_bucket, sorted(self.decode_s))]

    def as_ms(self) -> dict[str, Any]:
        def ms(by: dict[int, float]) -> dict[str, float]:
            return {str(b): round(t * 1e3, 3) for b, t in sorted(by.items())}

        return {
            "decode_chunk_ms_by_slot_bucket": ms(self.decode_s),
            "insert_ms_by_prompt_bucket": ms(self.insert_s),
            "move_ms": round(self.move_s * 1e3, 3),
            "source": self.source,
        }


FREE = DeviceCosts({1: 0.0}, {1: 0.0}, 0.0)


def measure_cpu_costs(prompt_buckets: Sequence[int], *, slots: int, chunk: int, max_new_tokens: int,
                      repeats: int = 5, model: str = "tiny") -> tuple[DeviceCosts, dict[str, Any]]:
    """Time the real slot programs (``CompiledSlotPrograms``) of the ``model`` preset (random weights) on
    this CPU at the benchmark's shapes: an insert of ``insert_rows`` prompts at each of ``prompt_buckets``,
    a decode chunk of ``chunk`` steps at each slot bucket with every slot decoding (the cache holds the
    largest bucket plus ``max_new_tokens``, as the engine's would), a move of a block's slots. Median of
    ``repeats`` runs after one that compiles. Returns the costs and the shapes measured."""
    import jax
    from flax import nnx

    from mage_jax.generate.slots import CompiledSlotPrograms
    from mage_jax.models.transformer import Transformer

    config = ModelConfig.preset(model)
    graphdef, state = nnx.split(Transformer(config, rngs=nnx.Rngs(0)))
    buckets = tuple(sorted(set(prompt_buckets)))
    spec = ModelSpec(graphdef, config, eos_ids=(1,), pad_id=0, prompt_buckets=buckets)
    programs = CompiledSlotPrograms(spec, slots=slots, max_new_tokens=max_new_tokens, chunk=chunk)
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens)
    key, rng, rows = jax.random.key(0), np.random.default_rng(0), programs.insert_rows

    def timed(run: Any, *args: Any) -> tuple[Any, float]:
        started = time.perf_counter()
        out = jax.block_until_ready(run(*args))
        return out, time.perf_counter() - started

    def insert(slot_state: Any, first: int, p_bucket: int) -> tuple[Any, float]:
        targets = list(range(first, min(first + rows, slots)))
        prompts = [rng.integers(2, config.vocab_size, p_bucket).tolist() for _ in targets]
        return timed(programs.insert, state, slot_state, prompts, list(range(len(targets))), targets,
                     [max_new_tokens] * len(targets), [0] * len(targets),
                     np.zeros((len(targets), KEY_PATH_LEN), np.int32), params, key)

    def full(p_bucket: int) -> Any:  # every slot decoding from a prompt of ``p_bucket`` tokens
        slot_state = programs.empty()
        for first in range(0, slots, rows):
            slot_state, _ = insert(slot_state, first, p_bucket)
        return slot_state

    median = lambda xs: float(np.median(xs))  # noqa: E731
    insert_s = {}
    slot_state = programs.empty()
    for b in buckets:
        times = []
        for _ in range(repeats + 1):
            slot_state, t = insert(slot_state, 0, b)
            times.append(t)
        insert_s[b] = median(times[1:])
    decode_s = {}
    for bucket in programs.slot_buckets:
        times = []
        slot_state, left = full(buckets[-1]), max_new_tokens // chunk - 1
        for _ in range(repeats + 1):
            if left == 0:
                slot_state, left = full(buckets[-1]), max_new_tokens // chunk - 1
            (slot_state, steps), t = timed(programs.decode, state, slot_state, params, key, None, bucket)
            times.append(t * chunk / max(int(steps), 1))
            left -= 1
        decode_s[bucket] = median(times[1:])
    moves = [(slots - 1 - i, i) for i in range(min(rows, slots // 2))]
    times = []
    for _ in range(repeats + 1):
        slot_state, t = timed(programs.move, slot_state, moves)
        times.append(t)
    shapes_measured = {"model": model, "slots": slots, "slot_buckets": list(programs.slot_buckets),
                       "chunk": chunk, "insert_rows": rows, "prompt_buckets": list(buckets),
                       "cache_len": programs.max_len, "repeats": repeats, "moves_per_program": len(moves)}
    return DeviceCosts(decode_s, insert_s, median(times[1:])), shapes_measured


class DeviceArray:
    """A stand-in program's output as the host reads it (``np.asarray`` or ``int``, as the engine's
    ``to_host`` and a chunk's step count): reading waits until the stand-in device has run the program,
    like reading a dispatched JAX array."""

    def __init__(self, value: Any, ready_at: float):
        self.value, self.ready_at = value, ready_at

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        wait = self.ready_at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        value = np.asarray(self.value)
        return value if dtype is None else value.astype(dtype)

    def __int__(self) -> int:
        return int(self.__array__())


@dataclasses.dataclass
class StandInSlots:
    """The slot fields the engine reads back (``spec.SlotState``), as a program left them (each read
    waits for that program)."""

    done: DeviceArray
    finished: DeviceArray
    length: DeviceArray
    tokens: DeviceArray
    logprobs: DeviceArray


SLOT_FIELDS = ("done", "finished", "length", "tokens", "logprobs")
MOVED_FIELDS = (*SLOT_FIELDS, "limit", "write")
"""What a move copies: the fields read back, and the response limit and write position of each slot."""


class StandInPrograms:
    """``generate.spec.SlotPrograms`` with device programs that cost a set time.

    The real engine's host code runs unchanged over it: queue, priorities, targets, prefix donors, packing
    moves, slot buckets, the constraint bank (its automaton indices and uploads), overlap. ``insert`` does
    the real insert's host work (left-padded prompt block and per-target fields, whose bytes are
    ``last_insert_bytes``) and plans each target's response: a walk through its automaton in the bank the
    engine sends (the index the insert sent; EOS as soon as it is allowed, otherwise a token chosen from
    the key path, as the engine's sampling would be), ``free_tokens`` for unconstrained rows. ``decode``
    advances every decoding slot of its slot bucket by up to ``chunk`` tokens.

    Every program books its cost (``costs``: an insert by its prompt bucket, a decode chunk by its slot
    bucket and the steps it ran, a move) on one device timeline, after the programs before it, without
    waiting: the host waits only when it reads a program's output (``DeviceArray``), so
    host work done meanwhile overlaps as it does with JAX's asynchronous dispatch."""

    def __init__(self, spec: ModelSpec, *, slots: int, chunk: int, max_new_tokens: int,
                 free_tokens: Sequence[int], costs: DeviceCosts = FREE,
                 insert_rows: int = DEFAULT_INSERT_ROWS, slot_levels: int = DEFAULT_SLOT_LEVELS):
        self.spec = spec
        self.num_slots, self.ways, self.local_slots = slots, 1, slots
        self.insert_rows = min(insert_rows, slots)
        self.chunk, self.max_new_tokens = chunk, max_new_tokens
        self.max_len = spec.prompt_buckets[-1] + max_new_tokens
        self.slot_buckets = tuple(sorted({-(-slots // 4**k) for k in range(slot_levels)}))  # the real ones'
        self.free_tokens = np.asarray(free_tokens, np.int32)
        self.eos_ids = frozenset(spec.eos_ids)
        self.compile_count = 0
        self.last_insert_bytes = (0, 0)
        self.prompt_buckets_seen: set[int] = set()  # of every insert since the engine was built
        self._bank: tuple[Any, ...] | None = None  # the engine's latest bank and its host arrays
        self.reset(costs)

    def reset(self, costs: DeviceCosts) -> None:
        """Device costs of the next rollout; the counters start from zero."""
        self.costs = costs
        self.device_free_at = 0.0  # when the stand-in device finishes its queued programs
        self.device_s = {"insert": 0.0, "decode": 0.0, "move": 0.0}
        self.runs = {"insert": 0, "decode": 0, "move": 0}  # programs run, by kind
        self.stand_in_s = 0.0  # host time of the stand-in's own bookkeeping (device work in a real run)

    @property
    def chunks(self) -> int:
        return self.runs["decode"]

    def _book(self, kind: str, seconds: float) -> float:
        """Queue a program of ``seconds`` on the device timeline; when it ends."""
        start = max(time.perf_counter(), self.device_free_at)
        self.device_free_at = start + seconds
        self.device_s[kind] += seconds
        self.runs[kind] += 1
        return self.device_free_at

    def _output(self, ready_at: float) -> StandInSlots:
        s = self._s
        return StandInSlots(*(DeviceArray(getattr(s, name).copy(), ready_at) for name in SLOT_FIELDS))

    def empty(self) -> StandInSlots:
        s, n = self.num_slots, self.max_new_tokens
        zeros = functools.partial(np.zeros, s, np.int32)
        self._s = types.SimpleNamespace(
            done=np.ones(s, bool), finished=np.zeros(s, bool), length=zeros(), limit=zeros(), write=zeros(),
            tokens=np.zeros((s, n), np.int32), logprobs=np.zeros((s, n), np.float32),
            plan=[self.free_tokens] * s)
        return self._output(0.0)

    def bank_sharding(self) -> None:
        return None

    def slot_bucket(self, highest_local: int) -> int:
        return shapes.bucket(highest_local + 1, self.slot_buckets)

    def window(self, furthest_write: int) -> int:
        return self.max_len

    def prompt_bucket(self, prompts: Sequence[Sequence[int]], donors: Sequence[Donor | None]) -> int:
        longest = max([len(p) for p in prompts] + [d.bucket for d in donors if d is not None])
        return shapes.bucket(longest, self.spec.prompt_buckets)

    def _host_bank(self, bank: Bank) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(columns [V], tables [A, Q, C], the tokens with a column of their own) of the engine's bank on
        the host, read again only when the engine sent a new one (new automata)."""
        if self._bank is None or self._bank[0] is not bank:
            columns, tables = np.asarray(bank.columns), np.asarray(bank.tables)
            self._bank = (bank, columns, tables, np.flatnonzero(columns > 0))
        return self._bank[1:]

    def _plan(self, bank: Bank, rule: int, key_path: np.ndarray, limit: int) -> np.ndarray:
        """The response the stand-in "samples": free tokens, or a walk through automaton ``rule`` of
        ``bank`` (``tables[rule, state, columns[token]]``, as the real programs mask)."""
        if rule == 0:
            return self.free_tokens[:limit]
        columns, tables, special = self._host_bank(bank)
        rng = random.Random(int.from_bytes(hashlib.blake2b(key_path.tobytes(), digest_size=8).digest(),
                                           "little"))
        state, out = 0, []
        while len(out) < limit and state >= 0:
            row = tables[rule, state]
            if row[0] >= 0:
                raise ValueError("the stand-in walks legal-action automata (no default transition)")
            allowed = special[row[columns[special]] >= 0]
            ends = [int(t) for t in allowed if int(t) in self.eos_ids]
            token = ends[0] if ends else int(allowed[rng.randrange(len(allowed))])
            out.append(token)
            if ends:
                break
            state = int(row[columns[token]])
        return np.asarray(out, np.int32)

    def insert(self, state: Any, slots: StandInSlots, prompts: Sequence[Sequence[int]], source: Sequence[int],
               targets: Sequence[int], limits: Sequence[int], rules: Sequence[int], key_paths: np.ndarray,
               params: Any, key: Any, donors: Sequence[Donor | None] | None = None, *,
               bank: Bank | None = None) -> StandInSlots:
        # the host side of CompiledSlotPrograms.insert: one left-padded prompt block and per-target fields
        donors = list(donors) if donors is not None else [None] * len(targets)
        p_bucket = self.prompt_bucket(prompts, donors)
        self.prompt_buckets_seen.add(p_bucket)
        rows = self.insert_rows
        tokens, valid = shapes.left_padded(prompts, rows, p_bucket, pad_id=self.spec.pad_id,
                                           vocab_size=self.spec.vocab_size)
        fields = np.zeros((8, 1, rows), np.int32)  # src, donor, base, lens, dst, limit, rule, (spare)
        paths = np.zeros((1, rows, KEY_PATH_LEN), np.int32)
        for j, (slot, limit, rule, d) in enumerate(zip(targets, limits, rules, donors)):
            lens = len(prompts[source[j]]) if d is None else d.length
            fields[:, 0, j] = (source[j], -1 if d is None else d.slot, p_bucket, lens, slot,
                               min(limit, self.max_new_tokens), rule, 0)
            paths[0, j] = key_paths[j]
        rule_bytes = fields[6].nbytes
        self.last_insert_bytes = (tokens.nbytes + valid.nbytes + fields[:7].nbytes + paths.nbytes,
                                  rule_bytes)
        started = time.perf_counter()
        s = self._s
        for j, slot in enumerate(targets):
            limit = min(int(limits[j]), self.max_new_tokens)
            plan = self._plan(bank, int(rules[j]), key_paths[j], limit)
            s.plan[slot] = plan
            s.limit[slot] = len(plan)
            s.length[slot] = min(1, len(plan))  # the first token comes from the prefill
            s.tokens[slot, : len(plan)] = plan
            s.logprobs[slot] = 0.0
            s.finished[slot] = False
            s.done[slot] = len(plan) == 0
            self._settle(slot)
        # the insert program has one shape per prompt bucket: it prefills ``insert_rows`` rows (dummy ones
        # when every target copies a donor) at the same cost
        out = self._output(self._book("insert", self.costs.insert(p_bucket)))
        self.stand_in_s += time.perf_counter() - started
        return out

    def _settle(self, slot: int) -> None:
        s = self._s
        if s.length[slot] >= s.limit[slot]:
            s.done[slot] = True
            plan = s.plan[slot]
            s.finished[slot] = len(plan) > 0 and int(plan[-1]) in self.eos_ids

    def decode(self, state: Any, slots: StandInSlots, params: Any, key: Any, window: int | None = None,
               bucket: int | None = None, *, bank: Any = None) -> tuple[StandInSlots, DeviceArray]:
        started = time.perf_counter()
        s = self._s
        bucket = self.num_slots if bucket is None else bucket
        active = np.flatnonzero(~s.done[:bucket])
        steps = int((s.limit[active] - s.length[active]).max(initial=0))
        steps = min(self.chunk, steps)
        for slot in active:
            s.length[slot] = min(s.limit[slot], s.length[slot] + steps)
            self._settle(int(slot))
        ready_at = self._book("decode", self.costs.decode(bucket) * steps / self.chunk)
        out = self._output(ready_at)
        self.stand_in_s += time.perf_counter() - started
        return out, DeviceArray(steps, ready_at)

    def move(self, slots: StandInSlots, moves: Sequence[tuple[int, int]]) -> StandInSlots:
        started = time.perf_counter()
        s = self._s
        for src, dst in moves:
            for name in MOVED_FIELDS:
                getattr(s, name)[dst] = getattr(s, name)[src]
            s.plan[dst] = s.plan[src]
            s.done[src] = True
        out = self._output(self._book("move", self.costs.move_s))
        self.stand_in_s += time.perf_counter() - started
        return out


def stand_in_spec(tokenizer: Tokenizer, config: ModelConfig | None = None) -> ModelSpec:
    """The stand-in model: the tokenizer's special ids and the real sampler's prompt buckets, the vocabulary
    of ``config`` (default: Qwen3-0.6B's, so that automata and the constraint bank are built at the width
    the targets name); no graph (nothing runs)."""
    return ModelSpec(None, config or ModelConfig.preset("qwen3-0.6b"), eos_ids=tuple(tokenizer.eos_ids),
                     pad_id=tokenizer.pad_id)


def stand_in_engine(tokenizer: Tokenizer, *, slots: int, chunk: int, max_new_tokens: int) -> RolloutEngine:
    """The run's engine (one per run, as in training: its bank and automata outlive a rollout) over
    ``StandInPrograms``."""
    spec = stand_in_spec(tokenizer)
    free = [*tokenizer.encode("<remark> ok </remark>"), spec.eos_ids[0]]
    programs = StandInPrograms(spec, slots=slots, chunk=chunk, max_new_tokens=max_new_tokens,
                               free_tokens=free)
    return RolloutEngine(spec, programs=programs)


def stand_in_policy(tokenizer: Tokenizer, engine: RolloutEngine, costs: DeviceCosts) -> LLMPolicy:
    """The real ``LLMPolicy`` (tokenization, automata, decoding, ``EngineStream``) over the real engine
    host code with stand-in programs costing ``costs`` (a policy per rollout, as in training); the
    stand-in's counters start from zero."""
    import jax

    programs = engine.programs
    assert isinstance(programs, StandInPrograms)
    programs.reset(costs)
    params = SamplingParams(max_new_tokens=programs.max_new_tokens)
    return LLMPolicy(tokenizer, engine, None, params, jax.random.key(0))
