"""The continuous-batching rollout engine: decode slots that never wait for the slowest row.

A lockstep turn (``generate.sampler.Sampler.generate``) runs until its longest row finishes, and every row
that finished earlier idles until then; every prompt is prefilled from scratch. The engine keeps a
fixed set of decode slots busy for a whole rollout instead, through its slot programs
(``generate.spec.SlotPrograms``, its only view of them: ``generate.slots.CompiledSlotPrograms`` on the
device, or a stand-in):

* requests queue up (``submit``) and enter free slots in arrival order;
* ``step`` fills every free slot (one insert program), runs one decode chunk of ``chunk`` steps, and
  returns the requests that finished; the caller (the meta-episode runner) steps their environments
  and submits their next prompts right away, while the other slots keep their place mid-response;
* identical prompts entering together (the G copies of a group share their first prompt) are
  prefilled once and their keys and values copied into each copy's slot;
* the running slots are kept packed at the front of every device's block of slots (the highest
  decoding slot moves into the lowest free one) and a chunk decodes the smallest slot bucket that holds
  them: at the tail of a rollout, when a few long responses are left, few rows are computed.

Why a chunk of a few steps between host checks: a decode step of all slots is one small program; the
host needs the finished flags to retire slots, and a round trip per token would cost more than the
token on an accelerator. With ``chunk`` steps a finished slot idles at most ``chunk - 1`` steps.

Each request carries a *key path* from which its sampling keys derive (``generate.step.row_keys``), so
its response does not depend on the slot it ran in or the requests beside it. With greedy decoding
the tokens equal the lockstep sampler's.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from mage_jax.generate.bank import ConstraintBank
from mage_jax.generate.constraints import TokenAutomaton
from mage_jax.generate.spec import Donor, ModelSpec, SlotPrograms, SlotState
from mage_jax.generate.step import KEY_PATH_LEN, SamplingParams
from mage_jax.models.sharding import to_host

AUTOMATA_CACHE_BYTES = 256 * 2**20  # AutomatonCache's bound: a few hundred states at Qwen's vocabulary


class AutomatonCache:
    """The run's automata by key (the policy's: its tokenizer and allowed completions), kept across the
    rollouts of one engine. A policy is built per rollout; without this every rollout would build each
    automaton again at full vocabulary width (600 KB per state at Qwen's 151,936 tokens) and the bank would
    factorise it again (a new object is a new id to it). Least recently used entries go first once the
    dense tables held exceed ``max_bytes``."""

    def __init__(self, max_bytes: int = AUTOMATA_CACHE_BYTES):
        self.max_bytes = max_bytes
        self._entries: dict[Any, TokenAutomaton] = {}
        self._bytes = 0

    def get(self, key: Any) -> TokenAutomaton | None:
        found = self._entries.pop(key, None)
        if found is not None:
            self._entries[key] = found  # most recently used last
        return found

    def put(self, key: Any, automaton: TokenAutomaton) -> None:
        if key in self._entries:
            return
        self._entries[key] = automaton
        self._bytes += automaton.transitions.nbytes
        while self._bytes > self.max_bytes and len(self._entries) > 1:
            oldest = next(iter(self._entries))
            self._bytes -= self._entries.pop(oldest).transitions.nbytes

    def __len__(self) -> int:
        return len(self._entries)


@dataclasses.dataclass(frozen=True)
class EngineRequest:
    """One response to generate. ``tag``: the caller's handle; ``key_path``: KEY_PATH_LEN integers in
    [0, 2**31) that name the request (the runner: meta-episode, episode, phase and turn); ``priority``:
    waiting requests start smallest first, then in arrival order (the runner passes its lockstep order
    (episode, phase, turn), so meta-episodes that fell behind catch up and the last one to finish is not
    left decoding alone)."""

    tag: Any
    prompt_ids: tuple[int, ...]
    limit: int
    automaton: TokenAutomaton | None
    key_path: tuple[int, ...]
    priority: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class EngineResult:
    """A finished request: response ids (EOS included when drawn), their log-probs, EOS reached."""

    tag: Any
    tokens: np.ndarray
    logprobs: np.ndarray
    finished: bool


@dataclasses.dataclass
class EngineStats:
    """Work counters. ``decode_row_steps`` counts every row of the program each decode step ran (its
    slot bucket times the mesh's batch ways: what was computed, active or not);
    ``decode_tokens`` the tokens decode steps drew and a response kept (its first token comes from the
    prefill)."""

    requests: int = 0
    inserts: int = 0
    prefill_tokens: int = 0
    prefill_rows: int = 0
    decode_steps: int = 0
    decode_row_steps: int = 0
    decode_tokens: int = 0
    bucket_steps: dict[int, int] = dataclasses.field(default_factory=dict)
    """Decode steps by the rows their program computed (a slot bucket times the mesh's batch ways)."""
    window_steps: dict[int, int] = dataclasses.field(default_factory=dict)
    """Decode steps by the cache positions their attention read (``window_levels``)."""
    moves: int = 0
    """Slots moved to pack the running ones into the front of their device's block."""
    insert_bytes: int = 0
    """Bytes of the inserts' arguments sent to the device (prompts, per-target fields, automaton indices)."""
    index_bytes: int = 0
    """The automaton indices among ``insert_bytes`` (what an insert sends for constraints)."""
    upload_bytes: int = 0
    """Bytes of the constraint bank's uploads (token -> column map, tables) when new automata arrived."""

    @property
    def useful_decode_fraction(self) -> float:
        return self.decode_tokens / self.decode_row_steps if self.decode_row_steps else 1.0

    @property
    def bytes_per_insert(self) -> float:
        """Host -> device bytes per insert: its arguments and its share of the bank's uploads."""
        return (self.insert_bytes + self.upload_bytes) / self.inserts if self.inserts else 0.0

    @property
    def constraint_bytes_per_insert(self) -> float:
        """Constraint bytes per insert: automaton indices and the bank's uploads, amortised."""
        return (self.index_bytes + self.upload_bytes) / self.inserts if self.inserts else 0.0


class RolloutEngine:
    """Built once per run; ``session`` per rollout. ``spec`` is the model's (``generate.spec.ModelSpec``:
    parameter placement, vocabulary); ``programs`` the slot programs it schedules (``spec.SlotPrograms``:
    ``slots.CompiledSlotPrograms.shared(spec, ...)``, whose compiled programs every engine of the process
    with the same model and shapes reuses); ``overlap``: dispatch the next decode chunk before the
    caller's host work (``EngineSession.step``). The engine keeps the run's constraint automata on the
    device (``bank``) and, across rollouts, the policies' automata (``automata``)."""

    def __init__(self, spec: ModelSpec, *, programs: SlotPrograms, overlap: bool = True):
        self.spec = spec
        self.programs = programs
        self.overlap = overlap
        self.bank = ConstraintBank(spec.vocab_size)  # the run's automata on the device
        self.automata = AutomatonCache()  # the policies' automata, kept across rollouts
        self.last_stats: EngineStats | None = None  # the counters of the latest session

    @property
    def num_slots(self) -> int:
        return self.programs.num_slots

    @property
    def compile_count(self) -> int:
        return self.programs.compile_count

    def session(self, state: Any, params: SamplingParams, key: jax.Array) -> EngineSession:
        """A fresh set of free slots generating with the model ``state`` and ``params``."""
        if params.max_new_tokens > self.programs.max_new_tokens:
            raise ValueError(f"max_new_tokens {params.max_new_tokens} exceeds the engine's "
                             f"{self.programs.max_new_tokens}")
        return EngineSession(self, self.spec.place_state(state), params, key)


class EngineSession:
    """The queue and slots of one rollout; see the module docstring."""

    def __init__(self, engine: RolloutEngine, state: Any, params: SamplingParams, key: jax.Array):
        self.engine = engine
        self.programs = engine.programs
        self.state = state
        self.params = params
        self.key = key
        self.slots: SlotState = self.programs.empty()
        self.queue: list[tuple[tuple[int, ...], int, EngineRequest]] = []  # a heap
        self._arrivals = itertools.count()
        self.running: dict[int, EngineRequest] = {}
        self.free: set[int] = set(range(self.programs.num_slots))
        self.prefixes: dict[tuple[int, ...], Donor] = {}  # prompts held by some slot's cache
        self.slot_prompt: dict[int, tuple[int, ...]] = {}
        self.stats = EngineStats()
        # A dispatched chunk: (steps, rows, window, its decoding slots).
        self._pending: tuple[jax.Array, int, int, list[int]] | None = None
        # Per slot, an upper bound of its cache write position, kept on the host: its insert's bucket plus
        # the steps of every chunk since (a slot that finished early advanced less). Windows are chosen
        # from it, so a dispatch never waits to read positions back.
        self.write_bound = np.zeros(self.programs.num_slots, np.int64)
        engine.last_stats = self.stats

    @property
    def busy(self) -> bool:
        return bool(self.queue or self.running)

    def submit(self, request: EngineRequest) -> None:
        if not request.prompt_ids:
            raise ValueError("an engine request needs at least one prompt token")
        if len(request.key_path) != KEY_PATH_LEN or not all(0 <= k < 2**31 for k in request.key_path):
            raise ValueError(f"key_path must be {KEY_PATH_LEN} integers in [0, 2**31), "
                             f"got {request.key_path}")
        heapq.heappush(self.queue, (request.priority, next(self._arrivals), request))

    def step(self) -> list[EngineResult]:
        """Fill the free slots, pack the decoding ones, run one decode chunk when some slot is still
        decoding, and return the requests that finished (in slot order).

        With ``overlap`` (the engine's default) the next inserts and decode chunk are dispatched before this
        returns, so the device prefills and decodes while the caller steps environments, tokenizes and
        submits (JAX dispatch is asynchronous); requests submitted meanwhile are inserted after the chunk
        in flight and join the chunk after it. The host reads only the finished chunk's slots, before the
        next insert is dispatched, so it never waits for an insert (an insert donates the slots it gets).
        Responses do not depend on that schedule (each row's keys are its own)."""
        if self._pending is None:
            self._fill()
            if not self.running:
                return []
            self._dispatch(to_host(self.slots.done))
        done = self._wait()
        out = self._retire(done)
        if self.engine.overlap:
            self._fill()
            # Every running slot is decoding as far as the host knows: the ones just inserted have not
            # been read back (one finished by its prefill is a no-op row of the chunk, retired after it).
            self._dispatch(np.zeros_like(done))
        return out

    def _retire(self, done: np.ndarray) -> list[EngineResult]:
        """Free the running slots that ``done`` (the finished chunk's flags) marks and return their
        results, read from the chunk's slots."""
        ended = sorted(s for s in self.running if done[s])
        if not ended:
            return []
        # Whole arrays come back (one shape, no gather program per count of finished slots); with several
        # processes every one gathers the slots of the others (to_host), so all take the same decisions.
        lengths, finished = to_host(self.slots.length), to_host(self.slots.finished)
        tokens, logprobs = to_host(self.slots.tokens), to_host(self.slots.logprobs)
        out = []
        for s in ended:
            request = self.running.pop(s)
            n = int(lengths[s])
            self.stats.decode_tokens += max(n - 1, 0)
            out.append(EngineResult(request.tag, tokens[s, :n].copy(), logprobs[s, :n].copy(),
                                    bool(finished[s])))
        self.free.update(ended)
        return out

    def _dispatch(self, done: np.ndarray) -> None:
        """Pack the slots still decoding (``done``: the host's view of every slot) and dispatch one decode
        chunk of them without waiting for it (``_wait`` does)."""
        decoding = [s for s in self.running if not done[s]]
        if not decoding:
            return
        decoding = self._compact(decoding)
        programs = self.programs
        bucket = programs.slot_bucket(max(s % programs.local_slots for s in decoding))
        window = programs.window(int(self.write_bound[decoding].max()))
        self.slots, steps = programs.decode(self.state, self.slots, self.params, self.key, window, bucket,
                                            bank=self._bank())
        self._pending = (steps, bucket * programs.ways, window, decoding)

    def _wait(self) -> np.ndarray:
        """Finish the dispatched chunk (its counters) and return every slot's done flag."""
        if self._pending is not None:
            steps, rows, window, decoding = self._pending
            self._pending = None
            steps = int(steps)
            self.write_bound[decoding] += steps
            self.stats.decode_steps += steps
            self.stats.decode_row_steps += steps * rows
            self.stats.bucket_steps[rows] = self.stats.bucket_steps.get(rows, 0) + steps
            self.stats.window_steps[window] = self.stats.window_steps.get(window, 0) + steps
        return to_host(self.slots.done)

    def _bank(self) -> Any:
        """The engine's constraint bank on the device (uploaded again only when it grew)."""
        return self.engine.bank.device(self.programs.bank_sharding())

    def _compact(self, decoding: list[int]) -> list[int]:
        """Pack every device's running slots into the front of its block: the highest decoding slot
        moves into the lowest free one below the block's running count, so a decode chunk computes a
        small slot bucket once few slots are left. Returns the decoding slots after the moves."""
        local = self.programs.local_slots
        active = set(decoding)
        moves: list[tuple[int, int]] = []
        for first in range(0, self.programs.num_slots, local):
            block = range(first, first + local)
            running = [s for s in block if s in self.running]
            holes = [s for s in block[:len(running)] if s in self.free]
            movers = [s for s in reversed(running) if s >= first + len(running) and s in active]
            moves += zip(movers, holes)
        if not moves:
            return decoding
        self.slots = self.programs.move(self.slots, moves)
        for src, dst in moves:
            self.write_bound[dst] = self.write_bound[src]
            self.running[dst] = self.running.pop(src)
            self.free.discard(dst)
            self.free.add(src)
            self._forget_prompt(dst)
            prompt = self.slot_prompt.pop(src)
            self.slot_prompt[dst] = prompt
            held = self.prefixes.get(prompt)
            if held is not None and held.slot == src:
                self.prefixes[prompt] = dataclasses.replace(held, slot=dst)
            active.discard(src)
            active.add(dst)
        self.stats.moves += len(moves)
        return sorted(active)

    def _forget_prompt(self, slot: int) -> None:
        """``slot`` is about to be overwritten: the prompt it holds can no longer be copied from it."""
        old = self.slot_prompt.pop(slot, None)
        held = self.prefixes.get(old) if old is not None else None
        if held is not None and held.slot == slot:
            del self.prefixes[old]

    def _targets(self, count: int) -> list[int]:
        """Free slots for up to ``count`` new requests (at most ``insert_rows`` per device: one insert
        program): each on the device with the fewest running slots (ties: the first), the lowest free slot
        there (one device: the lowest free slots)."""
        local, cap = self.programs.local_slots, self.programs.insert_rows
        load = [0] * self.programs.ways
        for s in self.running:
            load[s // local] += 1
        free = [sorted(s for s in self.free if s // local == d) for d in range(self.programs.ways)]
        taken = [0] * self.programs.ways
        out = []
        for _ in range(count):
            open_ = [d for d in range(len(free)) if free[d] and taken[d] < cap]
            if not open_:
                break
            d = min(open_, key=lambda d: (load[d], d))
            out.append(free[d].pop(0))
            load[d] += 1
            taken[d] += 1
        self.free.difference_update(out)
        return out

    def _fill(self) -> None:
        """Start queued requests in free slots, ``insert_rows`` per device block and insert; identical
        prompts are prefilled once (a later insert copies them from the slot of an earlier one)."""
        while self.queue and self.free:
            self._insert_some()

    def _insert_some(self) -> None:
        targets = self._targets(len(self.queue))
        take = [heapq.heappop(self.queue)[2] for _ in targets]
        # A prompt some slot of the target's device already holds is copied from it (no cache row crosses
        # devices); the others are prefilled, each once.
        local = self.programs.local_slots
        unique: dict[tuple[int, ...], int] = {}
        donors = [d if d is not None and d.slot // local == slot // local else None
                  for d, slot in zip((self.prefixes.get(r.prompt_ids) for r in take), targets)]
        source = [0 if d is not None else unique.setdefault(r.prompt_ids, len(unique))
                  for r, d in zip(take, donors)]
        prompts = list(unique)
        bucket = self.programs.prompt_bucket(prompts, donors)
        bank = self.engine.bank
        uploaded = bank.uploaded_bytes
        rules = [bank.index(r.automaton) for r in take]
        paths = np.asarray([r.key_path for r in take], np.int32)
        self.slots = self.programs.insert(
            self.state, self.slots, prompts, source, targets, [r.limit for r in take], rules, paths,
            self.params, self.key, donors, bank=self._bank(),
        )
        total, indices = self.programs.last_insert_bytes
        self.stats.insert_bytes += total
        self.stats.index_bytes += indices
        self.stats.upload_bytes += bank.uploaded_bytes - uploaded
        for slot in targets:  # their old prompts are overwritten now
            self._forget_prompt(slot)
        for slot, request, donor in zip(targets, take, donors):
            self.running[slot] = request
            self.slot_prompt[slot] = request.prompt_ids
            base = donor.bucket if donor is not None else bucket  # where its decode writes start
            self.prefixes[request.prompt_ids] = Donor(slot, base, len(request.prompt_ids))
            self.write_bound[slot] = base
        self.stats.requests += len(take)
        self.stats.inserts += 1
        self.stats.prefill_rows += len(prompts)
        self.stats.prefill_tokens += sum(len(p) for p in prompts)


def generate_all(session: EngineSession, requests: Sequence[EngineRequest]) -> dict[Any, EngineResult]:
    """Submit ``requests`` and step until all finished (no follow-up prompts): results by tag."""
    for r in requests:
        session.submit(r)
    out: dict[Any, EngineResult] = {}
    while session.busy:
        for result in session.step():
            out[result.tag] = result
    return out

