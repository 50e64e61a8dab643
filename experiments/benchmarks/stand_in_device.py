"""Stand-in device programs for ``experiments.benchmarks.rollout_host``: the real engine host code over
programs that only book time.

``SleepKernels`` has ``SlotSampler``'s interface: an insert does the real insert's host work and plans each
response as a walk through the request's automaton in the constraint bank (so the environments see legal
moves); a decode chunk or a packing move advances the slots it planned. Every program books its cost
(``DeviceCosts``: measured on this CPU's real programs by ``measure_cpu_costs``, divided by a speedup) on
one device timeline after the programs before it, and its outputs (``DeviceArray``) wait for it when the
host reads them, as JAX's asynchronous dispatch does. ``StandInEngine`` is the real ``RolloutEngine`` over
them, and ``stand_in_policy`` the real ``LLMPolicy`` over that engine.
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
from mage_jax.generate.bank import ConstraintBank
from mage_jax.generate.engine import AutomatonCache, RolloutEngine
from mage_jax.generate.sampler import DEFAULT_PROMPT_BUCKETS
from mage_jax.generate.slots import DEFAULT_INSERT_ROWS, DEFAULT_SLOT_LEVELS
from mage_jax.generate.step import KEY_PATH_LEN, SamplingParams
from mage_jax.rollout.policy import LLMPolicy
from mage_jax.tokenizer import Tokenizer

QWEN_VOCAB = 151_936
"""The sampler's vocabulary width: Qwen's, so automata and the constraint bank are built at that width."""


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
    """Time the real engine programs (``SlotSampler``) of the ``model`` preset (random weights) on this CPU at
    the benchmark's shapes: an insert of ``insert_rows`` prompts at each of ``prompt_buckets``, a decode
    chunk of ``chunk`` steps at each slot bucket with every slot decoding (the cache holds the largest
    bucket plus ``max_new_tokens``, as the engine's would), a move of a block's slots. Median of
    ``repeats`` runs after one that compiles. Returns the costs and the shapes measured."""
    import jax
    from flax import nnx

    from mage_jax.generate.sampler import Sampler
    from mage_jax.generate.slots import SlotSampler
    from mage_jax.models.config import ModelConfig
    from mage_jax.models.transformer import Transformer

    config = ModelConfig.preset(model)
    graphdef, state = nnx.split(Transformer(config, rngs=nnx.Rngs(0)))
    buckets = tuple(sorted(set(prompt_buckets)))
    sampler = Sampler(graphdef, config, eos_ids=[1], pad_id=0, prompt_buckets=buckets, batch_buckets=(slots,))
    kernels = SlotSampler(sampler, slots=slots, max_new_tokens=max_new_tokens, chunk=chunk)
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens)
    key, rng, rows = jax.random.key(0), np.random.default_rng(0), kernels.insert_rows

    def timed(run: Any, *args: Any) -> tuple[Any, float]:
        started = time.perf_counter()
        out = jax.block_until_ready(run(*args))
        return out, time.perf_counter() - started

    def insert(slot_state: Any, first: int, p_bucket: int) -> tuple[Any, float]:
        targets = list(range(first, min(first + rows, slots)))
        prompts = [rng.integers(2, config.vocab_size, p_bucket).tolist() for _ in targets]
        return timed(kernels.insert, state, slot_state, prompts, list(range(len(targets))), targets,
                     [max_new_tokens] * len(targets), [0] * len(targets),
                     np.zeros((len(targets), KEY_PATH_LEN), np.int32), params, key)

    def full(p_bucket: int) -> Any:  # every slot decoding from a prompt of ``p_bucket`` tokens
        slot_state = kernels.empty()
        for first in range(0, slots, rows):
            slot_state, _ = insert(slot_state, first, p_bucket)
        return slot_state

    median = lambda xs: float(np.median(xs))  # noqa: E731
    insert_s = {}
    slot_state = kernels.empty()
    for b in buckets:
        times = []
        for _ in range(repeats + 1):
            slot_state, t = insert(slot_state, 0, b)
            times.append(t)
        insert_s[b] = median(times[1:])
    decode_s = {}
    for bucket in kernels.slot_buckets:
        times = []
        slot_state, left = full(buckets[-1]), max_new_tokens // chunk - 1
        for _ in range(repeats + 1):
            if left == 0:
                slot_state, left = full(buckets[-1]), max_new_tokens // chunk - 1
            (slot_state, steps), t = timed(kernels.decode, state, slot_state, params, key, None, bucket)
            times.append(t * chunk / max(int(steps), 1))
            left -= 1
        decode_s[bucket] = median(times[1:])
    moves = [(slots - 1 - i, i) for i in range(min(rows, slots // 2))]
    times = []
    for _ in range(repeats + 1):
        slot_state, t = timed(kernels.move, slot_state, moves)
        times.append(t)
    shapes_measured = {"model": model, "slots": slots, "slot_buckets": list(kernels.slot_buckets),
                       "chunk": chunk, "insert_rows": rows, "prompt_buckets": list(buckets),
                       "cache_len": kernels.max_len, "repeats": repeats, "moves_per_program": len(moves)}
    return DeviceCosts(decode_s, insert_s, median(times[1:])), shapes_measured


class DeviceArray:
    """A stand-in program's output as the host reads it (``np.asarray``, the engine's ``to_host``): reading
    waits until the stand-in device has run the program, like reading a dispatched JAX array."""

    def __init__(self, value: np.ndarray, ready_at: float):
        self.value, self.ready_at = value, ready_at

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        wait = self.ready_at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        return self.value if dtype is None else self.value.astype(dtype)


@dataclasses.dataclass
class SleepSlots:
    """The slot fields the engine reads back, as a program left them (each read waits for that program)."""

    done: DeviceArray
    finished: DeviceArray
    length: DeviceArray
    limit: DeviceArray
    write: DeviceArray
    tokens: DeviceArray
    logprobs: DeviceArray


class DeviceSteps:
    """A decode chunk's step count as the engine reads it (``int(steps)``): reading it waits until the
    stand-in device timeline reaches the chunk's end, like reading a dispatched JAX array."""

    def __init__(self, steps: int, ready_at: float):
        self.steps, self.ready_at = steps, ready_at

    def __int__(self) -> int:
        wait = self.ready_at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        return self.steps


SLOT_FIELDS = ("done", "finished", "length", "limit", "write", "tokens", "logprobs")


class SleepKernels:
    """``SlotSampler``'s interface (what ``EngineSession`` calls) with device programs that cost a set time.

    The real engine's host code runs unchanged over it: queue, priorities, targets, prefix donors, packing
    moves, slot buckets, the constraint bank (its automaton indices and uploads), overlap. ``insert`` does
    the real insert's host work (left-padded prompt block and per-target fields, whose bytes are
    ``last_insert_bytes``) and plans each target's response: a walk through its automaton *in the bank*
    (the index the insert sent; EOS as soon as it is allowed, otherwise a token chosen from the key path,
    as the engine's sampling would be), ``free_tokens`` for unconstrained rows. ``decode`` advances every
    decoding slot of its slot bucket by up to ``chunk`` tokens.

    Every program books its cost (``costs``: an insert by its prompt bucket, a decode chunk by its slot
    bucket and the steps it ran, a move) on one device timeline, after the programs before it, without
    waiting: the host waits only when it reads a program's output (``DeviceArray``, ``DeviceSteps``), so
    host work done meanwhile overlaps as it does with JAX's asynchronous dispatch."""

    def __init__(self, sampler: Any, bank: ConstraintBank, *, slots: int, chunk: int, max_new_tokens: int,
                 free_tokens: Sequence[int], costs: DeviceCosts = FREE,
                 insert_rows: int = DEFAULT_INSERT_ROWS, slot_levels: int = DEFAULT_SLOT_LEVELS):
        self.sampler, self.bank = sampler, bank
        self.num_slots, self.ways, self.local_slots = slots, 1, slots
        self.insert_rows = min(insert_rows, slots)
        self.chunk, self.max_new_tokens = chunk, max_new_tokens
        self.max_len = sampler.prompt_buckets[-1] + max_new_tokens
        self.windows = (self.max_len,)
        self.slot_buckets = tuple(sorted({-(-slots // 4**k) for k in range(slot_levels)}))  # SlotSampler's
        self.free_tokens = np.asarray(free_tokens, np.int32)
        self.eos_ids = frozenset(sampler.eos_ids)
        self.compile_count = 0
        self.last_insert_bytes = (0, 0)
        self.prompt_buckets_seen: set[int] = set()  # of every insert since the engine was built
        self.reset(costs)

    def reset(self, costs: DeviceCosts) -> None:
        """Device costs of the next rollout; the counters start from zero."""
        self.costs = costs
        self.device_free_at = 0.0  # when the stand-in device finishes its queued programs
        self.device_s = {"insert": 0.0, "decode": 0.0, "move": 0.0}
        self.programs = {"insert": 0, "decode": 0, "move": 0}
        self.stand_in_s = 0.0  # host time of the stand-in's own bookkeeping (device work in a real run)

    @property
    def chunks(self) -> int:
        return self.programs["decode"]

    def _book(self, kind: str, seconds: float) -> float:
        """Queue a program of ``seconds`` on the device timeline; when it ends."""
        start = max(time.perf_counter(), self.device_free_at)
        self.device_free_at = start + seconds
        self.device_s[kind] += seconds
        self.programs[kind] += 1
        return self.device_free_at

    def _output(self, ready_at: float) -> SleepSlots:
        s = self._s
        return SleepSlots(*(DeviceArray(getattr(s, name).copy(), ready_at) for name in SLOT_FIELDS))

    def empty(self) -> SleepSlots:
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

    def prompt_bucket(self, prompts: Sequence[Sequence[int]], donors: Sequence[Any]) -> int:
        longest = max([len(p) for p in prompts] + [d.bucket for d in donors if d is not None])
        return shapes.bucket(longest, self.sampler.prompt_buckets)

    def _plan(self, rule: int, key_path: np.ndarray, limit: int) -> np.ndarray:
        """The response the stand-in "samples": free tokens, or a walk through bank automaton ``rule``."""
        if rule == 0:
            return self.free_tokens[:limit]
        f = self.bank._factored[rule]
        rng = random.Random(int.from_bytes(hashlib.blake2b(key_path.tobytes(), digest_size=8).digest(),
                                           "little"))
        state, out = 0, []
        while len(out) < limit and state >= 0:
            if f.default[state] >= 0:
                raise ValueError("the stand-in walks legal-action automata (no default transition)")
            allowed = f.tokens[f.table[state] >= 0]
            ends = [int(t) for t in allowed if int(t) in self.eos_ids]
            token = ends[0] if ends else int(allowed[rng.randrange(len(allowed))])
            out.append(token)
            if ends:
                break
            state = int(f.table[state, int(np.searchsorted(f.tokens, token))])
        return np.asarray(out, np.int32)

    def insert(self, state: Any, slots: SleepSlots, prompts: Sequence[Sequence[int]], source: Sequence[int],
               targets: Sequence[int], limits: Sequence[int], rules: Sequence[int], key_paths: np.ndarray,
               params: Any, key: Any, donors: Sequence[Any] | None = None, *, bank: Any = None
               ) -> SleepSlots:
        # the host side of SlotSampler.insert: one left-padded prompt block and per-target fields
        donors = list(donors) if donors is not None else [None] * len(targets)
        p_bucket = self.prompt_bucket(prompts, donors)
        self.prompt_buckets_seen.add(p_bucket)
        rows = self.insert_rows
        tokens, valid = shapes.left_padded(prompts, rows, p_bucket, pad_id=self.sampler.pad_id,
                                           vocab_size=self.sampler.vocab_size)
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
            plan = self._plan(int(rules[j]), key_paths[j], limit)
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

    def decode(self, state: Any, slots: SleepSlots, params: Any, key: Any, window: int | None = None,
               bucket: int | None = None, *, bank: Any = None) -> tuple[SleepSlots, DeviceSteps]:
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
        return out, DeviceSteps(steps, ready_at)

    def move(self, slots: SleepSlots, moves: Sequence[tuple[int, int]]) -> SleepSlots:
        started = time.perf_counter()
        s = self._s
        for src, dst in moves:
            for name in SLOT_FIELDS:
                getattr(s, name)[dst] = getattr(s, name)[src]
            s.plan[dst] = s.plan[src]
            s.done[src] = True
        out = self._output(self._book("move", self.costs.move_s))
        self.stand_in_s += time.perf_counter() - started
        return out


class StandInSampler:
    """What ``LLMPolicy`` and ``RolloutEngine`` read of a sampler: Qwen's vocabulary width (so automata
    and the constraint bank are built at the width the targets name), special ids, prompt buckets."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int = QWEN_VOCAB):
        self.vocab_size = vocab_size
        self.eos_ids = tuple(tokenizer.eos_ids)
        self.pad_id = tokenizer.pad_id
        self.prompt_buckets = DEFAULT_PROMPT_BUCKETS  # the real sampler's

    def place_state(self, state: Any) -> Any:
        return state


class StandInEngine(RolloutEngine):
    """The real ``RolloutEngine`` (its sessions, queue, constraint bank and overlap) over ``SleepKernels``."""

    def __init__(self, sampler: StandInSampler, *, overlap: bool = True, **kernel_options: Any):
        self.sampler, self.overlap = sampler, overlap
        self.bank = ConstraintBank(sampler.vocab_size)
        self.automata = AutomatonCache()
        self.kernels = SleepKernels(sampler, self.bank, **kernel_options)
        self.last_stats = None


def stand_in_engine(tokenizer: Tokenizer, *, slots: int, chunk: int, max_new_tokens: int) -> StandInEngine:
    """The run's engine (one per run, as in training: its bank and automata outlive a rollout)."""
    sampler = StandInSampler(tokenizer)
    return StandInEngine(
        sampler, slots=slots, chunk=chunk, max_new_tokens=max_new_tokens,
        free_tokens=[*tokenizer.encode("<remark> ok </remark>"), sampler.eos_ids[0]],
    )


def stand_in_policy(tokenizer: Tokenizer, engine: StandInEngine, costs: DeviceCosts) -> LLMPolicy:
    """The real ``LLMPolicy`` (tokenization, automata, decoding, ``EngineStream``) over the real engine
    host code with stand-in device programs costing ``costs`` (a policy per rollout,
    as in training); the stand-in's counters start from zero."""
    import jax

    kernels = engine.kernels
    kernels.reset(costs)
    params = SamplingParams(max_new_tokens=kernels.max_new_tokens)
    return LLMPolicy(tokenizer, engine.sampler, None, params, jax.random.key(0), engine=engine)
