"""Specification of the rollout engine (mage_jax.generate.engine, generate.slots): continuous
batching changes how generations are scheduled, never what a meta-episode sees. With greedy decoding the
engine gives the lockstep path's tokens, rows, row order, outcomes and metrics on every built-in
environment; identical prompts are prefilled once; nothing recompiles once warm."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import json
import subprocess
import sys
import textwrap
import types
from typing import Any

import jax
import numpy as np
import pytest
from flax import nnx

from experiments.environments import ENVIRONMENTS, environment
from mage_jax import compile_report
from mage_jax import config as C
from mage_jax.generate import engine as engine_module
from mage_jax.generate.constraints import automaton_from_completions, automaton_from_word_sequence
from mage_jax.generate.engine import EngineRequest, generate_all
from mage_jax.generate.sampler import Sampler
from mage_jax.generate.slots import compiled_engine
from mage_jax.generate.spec import ModelSpec, SlotPrograms, SlotState
from mage_jax.generate.step import SamplingParams
from mage_jax.models.config import ModelConfig
from mage_jax.models.transformer import Transformer
from mage_jax.testing import (
    PARITY_OVERRIDES,
    ParityModel,
    greedy_rollouts,
    parity_model,
    rollout_differences,
    write_tiny_alfworld_data,
)
from mage_jax.training.assemble import make_engine
from tests.generate.conftest import EOS, PAD, VOCAB, spec_of
from tests.optional import available, require
from tests.xla_env import fake_devices_env

ENGINE_ENVS = sorted(env for env in ENVIRONMENTS if env != "alfworld" or available("textworld"))
"""Every environment; ALFWorld where its TextWorld engine is installed."""


def tiny_config(env: str, data_dir: str | None = None, **rollout):
    """``env``'s ``tiny`` preset with the engine-parity overrides (``mage_jax.testing.PARITY_OVERRIDES``)."""
    overrides = {**PARITY_OVERRIDES, **({"env.data_dir": data_dir} if data_dir else {}),
                 **{f"rollout.{k}": v for k, v in rollout.items()}}
    return environment(env).config("tiny", overrides)


@pytest.fixture(scope="module")
def parity(tmp_path_factory) -> ParityModel:
    """One tokenizer, model, lockstep sampler and engine for every environment (ALFWorld on one tiny PDDL
    game in every split): their programs compile once for all of them (compiling dominates these tests on
    a CPU)."""
    data = None
    if "alfworld" in ENGINE_ENVS:
        data = write_tiny_alfworld_data(tmp_path_factory.mktemp("alfworld"),
                                        splits=("train", "valid_seen", "valid_unseen"))
    model = parity_model({env: tiny_config(env, data if env == "alfworld" else None) for env in ENGINE_ENVS})
    assert model.engine.num_slots == 3  # the engine is the default
    return model


@pytest.mark.parametrize("env", sorted(ENVIRONMENTS))
def test_greedy_engine_rollout_equals_the_lockstep_rollout_on_every_environment(env, parity):
    if env == "alfworld":
        require("textworld")
    lockstep, engine = greedy_rollouts(parity, env)
    assert rollout_differences(lockstep, engine) == []
    # The engine really interleaved turns: more rows than slots. (Slot moves need a slot freed below a
    # running one with nothing queued; these random-model workloads are nearly symmetric across
    # meta-episodes and rarely make one, so the engine-level equality tests assert the moves.)
    assert lockstep.stats["rows"] > parity.engine.num_slots


# ------------------------------------------------------------------------------------ the seam
def _dotted(node: ast.AST) -> str:
    """``a.b.c`` of an attribute chain."""
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return getattr(node, "id", "?")


def test_the_engine_sees_its_programs_and_their_slots_only_through_the_declared_protocols():
    """Every member the engine module reads of its slot programs (``programs.X``) is one ``SlotPrograms``
    declares, every field it reads of the slots one ``SlotState`` declares, and it imports neither the
    compiled programs nor the lockstep sampler: a member the engine starts to use is a change to the
    protocol, where the stand-in of the host benchmark sees it too."""
    tree = ast.parse(inspect.getsource(engine_module))
    read = {kind: {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                   and _dotted(n.value) in owners}
            for kind, owners in (("programs", ("programs", "self.programs", "self.engine.programs")),
                                 ("slots", ("self.slots",)))}
    declared = {kind: {n for n in (*vars(proto), *proto.__annotations__) if not n.startswith("_")}
                for kind, proto in (("programs", SlotPrograms), ("slots", SlotState))}
    for kind in ("programs", "slots"):
        assert read[kind] and read[kind] <= declared[kind], (kind, read[kind] - declared[kind])
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not imported & {"mage_jax.generate.slots", "mage_jax.generate.sampler"}


# ------------------------------------------------------------------------------------ engine alone
@pytest.fixture(scope="module")
def tiny_sampler(tiny_model):
    """The lockstep sampler of the shared model (prompt buckets 8 and 16) and its state."""
    return Sampler(spec_of(tiny_model, (8, 16)), batch_buckets=(8,)), tiny_model[2]


@pytest.fixture(scope="module")
def engines(tiny_sampler):
    """``engines(slots, chunk)``: one engine per shape for the whole module. Synchronous (no overlap):
    these tests follow the slots step by step, and with overlap a request joins one chunk later."""
    sampler, _ = tiny_sampler
    return functools.cache(lambda slots, chunk: compiled_engine(sampler.spec, slots=slots, max_new_tokens=12,
                                                                chunk=chunk, overlap=False))


def requests_of(prompts, limits, automata):
    return [EngineRequest(i, tuple(p), limits[i], automata[i], (i, 7, 1)) for i, p in enumerate(prompts)]


def mixed_batch():
    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, VOCAB, size=int(rng.integers(1, 16))).tolist() for _ in range(8)]
    prompts[3] = prompts[1]  # enters with its twin: prefilled once
    prompts[7] = prompts[0]  # enters after its twin started: copied from its slot
    limits = [11, 6, 4, 8, 0, 3, 3, 9]
    auto = automaton_from_completions([[10, 11], [12]], VOCAB, EOS)
    automata = [None, auto, None, auto, None, None, auto, None]
    return prompts, limits, automata


def test_greedy_engine_gives_the_lockstep_samplers_tokens_and_logprobs(tiny_sampler, engines):
    sampler, state = tiny_sampler
    prompts, limits, automata = mixed_batch()
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    ref = sampler.generate(state, prompts, params, jax.random.key(0), constraints=automata,
                           max_new_tokens_per_row=np.asarray(limits))
    session = engines(3, 3).session(state, params, jax.random.key(0))
    out = generate_all(session, requests_of(prompts, limits, automata))
    for i in range(len(prompts)):
        np.testing.assert_array_equal(out[i].tokens, ref.tokens[i])
        np.testing.assert_allclose(out[i].logprobs, ref.logprobs[i], atol=1e-5)
        assert out[i].finished == ref.finished[i]
    assert all(len(out[i].tokens) > 0 for i in (1, 3, 6)) and out[4].tokens.size == 0
    # 8 requests, 6 distinct prompts: the twins of prompts 1 and 0 were not prefilled again.
    assert session.stats.requests == 8 and session.stats.prefill_rows == 6
    assert session.stats.prefill_tokens == sum(len(p) for i, p in enumerate(prompts) if i not in (3, 7))
    assert 0 < session.stats.useful_decode_fraction <= 1
    # Running slots moved down into freed ones, and chunks ran over fewer than all slots.
    assert session.stats.moves > 0 and min(session.stats.bucket_steps) < 3
    assert session.stats.decode_row_steps == sum(rows * n for rows, n in session.stats.bucket_steps.items())


def watch_dispatches(session, monkeypatch) -> list[int]:
    """Checks every decode chunk ``session`` dispatches against the device: the host's bound of each
    running slot's write position is the device's for a slot still decoding (at least it for one that
    finished in its prefill, unread yet), the chunk's window holds the next writes of every slot still
    decoding, and choosing it reads nothing from the device (``to_host``, and on an accelerator a
    transfer guard: a read would wait for the inserts just dispatched). Returns the window of each
    chunk, filled as the session runs."""
    programs, windows, dispatching = session.programs, [], [False]
    to_host, dispatch, decode = engine_module.to_host, session._dispatch, programs.decode

    def guarded_to_host(x):
        assert not dispatching[0], "a dispatch read the device"
        return to_host(x)

    def guarded_dispatch(done):
        dispatching[0] = True
        try:
            with jax.transfer_guard_device_to_host("disallow"):
                dispatch(done)
        finally:
            dispatching[0] = False

    def checked_decode(state, slots, params, key, window, bucket, **kw):
        with jax.transfer_guard_device_to_host("allow"):  # the test's own reads may wait
            write, done = np.asarray(slots.write), np.asarray(slots.done)
        for s in session.running:
            bound = session.write_bound[s]
            assert bound >= write[s] if done[s] else bound == write[s], (s, bound, write[s])
            assert done[s] or (window or programs.max_len) >= write[s] + programs.chunk
        windows.append(window)
        return decode(state, slots, params, key, window, bucket, **kw)

    monkeypatch.setattr(engine_module, "to_host", guarded_to_host)
    monkeypatch.setattr(session, "_dispatch", guarded_dispatch)
    monkeypatch.setattr(programs, "decode", checked_decode)
    return windows


@pytest.mark.parametrize("overlap, chunk", [(False, 3), (True, 3), (False, 7)])
def test_decode_windows_read_only_the_cache_prefix_the_slots_need_and_give_the_same_tokens(
        tiny_sampler, monkeypatch, overlap, chunk):
    """``window_levels=3``: a chunk attends over the smallest of the whole cache (16 + 12 positions), its
    half and its quarter that holds its furthest slot's next writes. Prompts of the 8-token bucket start
    decoding at position 8, so with chunks of 3 their first chunks read 14 positions; the same greedy
    tokens and log-probs as the lockstep sampler, with and without overlap. A chunk of 7 from position 8
    writes up to position 14, one past the half window: it must read the whole cache (a window one
    position short drops the chunk's last write). The window comes from the host's bound of each slot's
    write position: at every dispatch it is at least the device's, and choosing it reads nothing back
    from the device (so a dispatch never waits for the inserts before it)."""
    sampler, state = tiny_sampler
    prompts, limits, automata = mixed_batch()
    prompts = [p[:8] for p in prompts]  # the 8-token bucket (the twins stay twins)
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    ref = sampler.generate(state, prompts, params, jax.random.key(0), constraints=automata,
                           max_new_tokens_per_row=np.asarray(limits))
    engine = compiled_engine(sampler.spec, slots=3, max_new_tokens=12, chunk=chunk, window_levels=3,
                             overlap=overlap)
    programs = engine.programs
    assert programs.windows == (7, 14, 28)
    session = engine.session(state, params, jax.random.key(0))

    windows_used = watch_dispatches(session, monkeypatch)
    out = generate_all(session, requests_of(prompts, limits, automata))
    for i in range(len(prompts)):
        np.testing.assert_array_equal(out[i].tokens, ref.tokens[i])
        np.testing.assert_allclose(out[i].logprobs, ref.logprobs[i], atol=1e-5)
    windows = session.stats.window_steps
    assert windows.get(28, 0) > 0, windows  # the long responses
    if chunk == 3:
        assert windows.get(14, 0) > 0, windows  # the short ones first
    assert sum(windows.values()) == session.stats.decode_steps and len(windows_used) > 2


@pytest.mark.parametrize("chunk, levels", [(3, 3), (7, 3), (2, 4), (5, 1)])
def test_a_chunks_window_is_the_smallest_that_holds_its_writes_at_every_write_position(tiny_sampler, chunk,
                                                                                         levels):
    """``CompiledSlotPrograms.window`` at every position a slot can write from: the window holds the
    chunk's writes (positions ``w .. w + chunk - 1``, so ``w + chunk`` of them, the cache at most), and no
    smaller window does."""
    sampler, _ = tiny_sampler
    programs = compiled_engine(sampler.spec, slots=3, max_new_tokens=12, chunk=chunk,
                               window_levels=levels).programs
    for write in range(programs.max_len):
        window = programs.window(write)
        need = min(write + chunk, programs.max_len)
        assert window in programs.windows and window >= need, (write, window)
        assert all(w < need for w in programs.windows if w < window), (write, window)


def test_a_prompt_copied_after_its_slot_moved_comes_from_the_moved_slot(tiny_sampler, engines, monkeypatch):
    """The donor of a prompt follows its slot when the slot moves. 3 slots, chunk 2: C (prompt P, its
    response constrained) is moved from slot 2 to slot 0; slot 2 is reused by another prompt; then E
    arrives with prompt P and copies P's keys and values. Copied from the old slot index it would get the
    other prompt's, and its greedy tokens would leave the lockstep sampler's; so would C's after the move
    if its position, cache row, automaton state or tag stayed behind; the host's bound of its write
    position moves with it too (``watch_dispatches``)."""
    sampler, state = tiny_sampler
    rng = np.random.default_rng(1)
    x, y, p, q, q2 = (tuple(rng.integers(4, VOCAB, size=n).tolist()) for n in (5, 9, 7, 6, 11))
    words = automaton_from_word_sequence([10], list(range(20, 40)), [11], 9, VOCAB, [EOS])
    requests = {  # tag: (prompt, limit, automaton), submitted at the step given by ``arrivals``
        "A": (x, 1, None), "B": (y, 3, None), "C": (p, 12, words),
        "D": (q, 12, None), "D2": (q2, 2, None), "E": (p, 12, None),
    }
    arrivals = {0: ["A", "B", "C"], 2: ["D", "D2", "E"]}
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    session = engines(3, 2).session(state, params, jax.random.key(0))
    watch_dispatches(session, monkeypatch)
    out, held_by = {}, []  # held_by: the tag in each slot after every step
    for step in range(40):
        for tag in arrivals.get(step, []):
            prompt, limit, automaton = requests[tag]
            session.submit(EngineRequest(tag, prompt, limit, automaton, (len(held_by), step, 0)))
        out.update((r.tag, r) for r in session.step())
        held_by.append({slot: r.tag for slot, r in session.running.items()})
        if not session.busy:
            break
    # The order the issue describes took place: C moved 2 -> 0, D2 reused slot 2, E entered while C ran.
    assert held_by[0] == {2: "C"} and held_by[1] == {0: "C"}
    assert held_by[2] == {0: "C", 1: "D"} and "D2" in out  # D2 ran in slot 2 and finished
    assert held_by[3] == {0: "C", 1: "D", 2: "E"}
    assert session.stats.prefill_rows == 5  # E's prompt was copied, not prefilled
    assert session.stats.moves >= 2  # E moved down as well once C and D finished
    tags = list(requests)
    ref = sampler.generate(state, [requests[t][0] for t in tags], params, jax.random.key(0),
                           constraints=[requests[t][2] for t in tags],
                           max_new_tokens_per_row=np.asarray([requests[t][1] for t in tags]))
    for i, tag in enumerate(tags):
        np.testing.assert_array_equal(out[tag].tokens, ref.tokens[i], err_msg=tag)
        np.testing.assert_allclose(out[tag].logprobs, ref.logprobs[i], atol=1e-5, err_msg=tag)
        assert out[tag].finished == ref.finished[i], tag
    assert len(out["C"].tokens) > 5  # C decoded in slot 0 after its move


@pytest.mark.slow
def test_sampled_responses_do_not_depend_on_slots_order_or_company(tiny_sampler, engines):
    _, state = tiny_sampler
    prompts, limits, automata = mixed_batch()
    params = SamplingParams(temperature=1.0, max_new_tokens=12)
    requests = requests_of(prompts, limits, automata)
    runs, moves = [], []
    for slots, order in ((3, requests), (8, requests[::-1]), (3, requests[2:5])):
        session = engines(slots, 3).session(state, params, jax.random.key(5))
        runs.append(generate_all(session, order))
        moves.append(session.stats.moves)
    for tag, result in runs[2].items():
        for other in runs[:2]:
            np.testing.assert_array_equal(other[tag].tokens, result.tokens)
            np.testing.assert_allclose(other[tag].logprobs, result.logprobs, atol=1e-5)
    assert moves[0] > 0 and moves[1] > 0  # responses moved between slots and stayed the same
    # Another key, other tokens: the draws are random, not fixed.
    again = generate_all(engines(3, 3).session(state, params, jax.random.key(6)), requests)
    assert any(not np.array_equal(again[t].tokens, runs[0][t].tokens) for t in again)


def test_overlapped_decoding_gives_the_synchronous_responses(tiny_sampler, engines):
    """With overlap the next chunk is dispatched before the finished requests go back to the caller, so
    the schedule differs; the responses (greedy and sampled) do not."""
    sampler, state = tiny_sampler
    prompts, limits, automata = mixed_batch()
    overlapped = compiled_engine(sampler.spec, slots=3, max_new_tokens=12, chunk=3)
    assert overlapped.overlap and overlapped.programs is engines(3, 3).programs
    for params in (SamplingParams(temperature=0.0, max_new_tokens=12),
                   SamplingParams(temperature=1.0, top_k=8, max_new_tokens=12)):
        runs = []
        for engine in (engines(3, 3), overlapped):
            session = engine.session(state, params, jax.random.key(4))
            out = {}
            pending = requests_of(prompts, limits, automata)
            session.submit(pending.pop(0))
            while session.busy or pending:  # a request arrives after every step, as from a runner
                out.update((r.tag, r) for r in session.step())
                if pending:
                    session.submit(pending.pop(0))
            runs.append(out)
        for tag in runs[0]:
            np.testing.assert_array_equal(runs[1][tag].tokens, runs[0][tag].tokens)
            np.testing.assert_allclose(runs[1][tag].logprobs, runs[0][tag].logprobs, atol=1e-5)
            assert runs[1][tag].finished == runs[0][tag].finished
        assert len(runs[0]) == len(prompts)


def test_overlapped_engine_never_waits_for_an_insert(tiny_sampler, monkeypatch):
    """With overlap the host reads a finished chunk's slots before it dispatches the next inserts, so an
    insert's prefill runs behind the caller's host work: once a chunk is in flight, no host read touches
    an insert's output (an insert donates the slots it gets, so reading the chunk's afterwards would fail
    too). Only a step entered with nothing running (so nothing in flight) reads the inserted slots' flags."""
    sampler, state = tiny_sampler
    prompts, limits, automata = mixed_batch()
    engine = compiled_engine(sampler.spec, slots=3, max_new_tokens=12, chunk=3)
    inserted: dict[int, Any] = {}  # id -> the array (held, so that no id is reused)
    reads = []
    insert, to_host = engine.programs.insert, engine_module.to_host

    def recording_insert(*args, **kwargs):
        out = insert(*args, **kwargs)
        inserted.update((id(a), a) for a in (out.done, out.length, out.finished, out.tokens, out.logprobs))
        return out

    def recording_to_host(x):
        reads.append(id(x) in inserted)
        return to_host(x)

    monkeypatch.setattr(engine.programs, "insert", recording_insert)
    monkeypatch.setattr(engine_module, "to_host", recording_to_host)
    session = engine.session(state, SamplingParams(temperature=0.0, max_new_tokens=12), jax.random.key(4))
    pending = requests_of(prompts, limits, automata)
    session.submit(pending.pop(0))
    out, in_flight_inserts = {}, 0
    while session.busy or pending:
        idle, before, start = not session.running, len(inserted), len(reads)
        out.update((r.tag, r) for r in session.step())
        if not idle:
            assert not any(reads[start:])
            in_flight_inserts += len(inserted) > before
        if pending:
            session.submit(pending.pop(0))
    assert len(out) == len(prompts) and in_flight_inserts >= 3 and any(reads)


def test_nothing_recompiles_once_warm(tiny_sampler, engines):
    _, state = tiny_sampler
    prompts, limits, automata = mixed_batch()
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    engine = engines(3, 3)
    generate_all(engine.session(state, params, jax.random.key(0)), requests_of(prompts, limits, automata))
    warm = engine.compile_count
    assert warm > 0
    generate_all(engine.session(state, params, jax.random.key(1)), requests_of(prompts, limits, automata))
    assert engine.compile_count == warm


def test_a_new_runs_engine_and_an_evaluation_after_training_compile_no_engine_program(tiny_sampler):
    """Engine programs are the process's: a second engine of the same model and shapes (the next run, or
    the evaluation after training) reuses them, and evaluation's sampling settings are runtime values."""
    sampler, state = tiny_sampler
    prompts, limits, automata = mixed_batch()
    keys = [jax.random.key(i) for i in range(3)]
    training = SamplingParams(temperature=1.0, max_new_tokens=12)
    evaluation = SamplingParams(temperature=0.7, top_k=20, top_p=0.8, max_new_tokens=12)
    first = compiled_engine(sampler.spec, slots=4, max_new_tokens=12, chunk=3)
    generate_all(first.session(state, training, keys[0]), requests_of(prompts, limits, automata))
    counter = compile_report.counter()
    before = counter.snapshot()
    assert before.programs is not None
    generate_all(first.session(state, evaluation, keys[1]), requests_of(prompts, limits, automata))
    spec = sampler.spec
    next_run = ModelSpec(spec.graphdef, spec.config, eos_ids=spec.eos_ids, pad_id=spec.pad_id,
                         prompt_buckets=spec.prompt_buckets)
    second = compiled_engine(next_run, slots=4, max_new_tokens=12, chunk=3)
    assert second.programs is first.programs
    out = generate_all(second.session(state, evaluation, keys[2]), requests_of(prompts, limits, automata))
    assert len(out) == len(prompts)
    assert (counter.snapshot() - before).programs == 0


def test_an_insert_sends_automaton_indices_not_tables_at_qwens_vocabulary():
    """At a 151,936-token vocabulary an insert's arguments stay under 64 KB with constrained requests
    (a dense table was 39 MB per automaton state and request); the bank's map and tables go up once."""
    vocab = 151_936
    config = ModelConfig.preset("tiny", vocab_size=vocab, num_layers=1, hidden_size=16, intermediate_size=32)
    graphdef, state = nnx.split(Transformer(config, rngs=nnx.Rngs(0)))
    spec = ModelSpec(graphdef, config, eos_ids=(EOS,), pad_id=PAD, prompt_buckets=(8,))
    engine = compiled_engine(spec, slots=4, max_new_tokens=4, chunk=4)
    actions = automaton_from_completions([[1000, 2000], [1001], [150_000, 7]], vocab, EOS)
    requests = [EngineRequest(i, (5, 6, 7 + i), 4, actions if i % 2 else None, (i, 0, 0)) for i in range(6)]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=4)
    stats = []
    for key in (0, 1):
        session = engine.session(state, greedy, jax.random.key(key))
        out = generate_all(session, requests)
        for i in (1, 3, 5):  # the constrained responses are legal actions
            assert out[i].tokens.tolist() in ([1000, 2000, EOS], [1001, EOS], [150_000, 7, EOS])
        stats.append(session.stats)
    for s in stats:
        assert s.inserts >= 2 and s.insert_bytes / s.inserts <= 64 * 1024
        assert s.index_bytes / s.inserts <= 64
    assert stats[0].upload_bytes >= vocab * 4  # the token -> column map and the tables, once
    assert stats[1].upload_bytes == 0  # the second rollout's automata were on the device already


def test_bad_requests_are_one_clear_error(tiny_sampler):
    sampler, state = tiny_sampler
    engine = compiled_engine(sampler.spec, slots=2, max_new_tokens=4)
    session = engine.session(state, SamplingParams(max_new_tokens=4), jax.random.key(0))
    with pytest.raises(ValueError, match="at least one prompt token"):
        session.submit(EngineRequest(0, (), 4, None, (0, 0, 0)))
    with pytest.raises(ValueError, match="key_path"):
        session.submit(EngineRequest(0, (5,), 4, None, (0, -1, 0)))
    with pytest.raises(ValueError, match="exceeds"):
        engine.session(state, SamplingParams(max_new_tokens=5), jax.random.key(0))


# ------------------------------------------------------------------------------------ sharded slots
_SHARDED = textwrap.dedent(
    """
    import dataclasses, json
    import jax, numpy as np
    from flax import nnx
    from mage_jax.models.config import ModelConfig
    from mage_jax.models.sharding import MeshConfig, make_mesh, shard_state
    from mage_jax.models.transformer import Transformer, stack_layers
    from mage_jax.generate.engine import EngineRequest, generate_all
    from mage_jax.generate.slots import compiled_engine
    from mage_jax.generate.spec import ModelSpec
    from mage_jax.generate.step import SamplingParams

    config = ModelConfig.preset("tiny", vocab_size=64, num_layers=2, hidden_size=64, intermediate_size=128)
    graphdef, state = nnx.split(Transformer(config, rngs=nnx.Rngs(0)))
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    # Uneven limits free slots in the middle of the blocks: running slots move to the front of theirs.
    requests = [EngineRequest(i, tuple(range(4 + i % 9, 14 + i % 7)), 1 + (5 * i) % 6, None, (i, 0, 0))
                for i in range(24)]
    # Copies of one prompt, later on: some land on the device of a slot that holds it (copied), others
    # on devices that do not (prefilled again there: no cache row crosses devices).
    requests += [EngineRequest(i, tuple(range(4, 14)), 6, None, (i, 0, 0)) for i in range(24, 40)]
    out = {}
    # The scanned layout (the pretrained presets' default) on the mesh too: its stacked parameters keep a
    # per-layer cache, and its slot programs must shard and move it like the unrolled layout's.
    scanned = dataclasses.replace(config, scan_layers=True)
    layouts = {False: (config, graphdef, state),
               True: (scanned, nnx.graphdef(nnx.eval_shape(lambda: Transformer(scanned, rngs=nnx.Rngs(0)))),
                      stack_layers(state))}
    data2_fsdp4 = make_mesh(MeshConfig(data=2, fsdp=4, tensor=1))
    for name, mesh, scan in (("one", None, False), ("data2_fsdp4", data2_fsdp4, False),
                             ("data2_fsdp4_scanned", data2_fsdp4, True)):
        cfg, gdef, weights = layouts[scan]
        placed = weights if mesh is None else shard_state(weights, mesh)
        spec = ModelSpec(gdef, cfg, eos_ids=(3,), pad_id=0, prompt_buckets=(16,), mesh=mesh)
        engine = compiled_engine(spec, slots=16, max_new_tokens=6, chunk=2)
        session = engine.session(placed, params, jax.random.key(0))
        results = generate_all(session, requests)
        k = session.slots.cache.k[0]
        out[name] = {
            "tokens": [results[i].tokens.tolist() for i in range(40)],
            "prefill_rows": session.stats.prefill_rows,
            "moves": session.stats.moves, "bucket_steps": session.stats.bucket_steps,
            "compiles": engine.compile_count,
            "cache_bytes": [k.nbytes, max(s.data.nbytes for s in k.addressable_shards)],
            "cache_devices": len({s.device for s in k.addressable_shards}),
            "cache_layers": [len(session.slots.cache.k), len(session.slots.cache.v)],
            "slot_bytes": [session.slots.tokens.nbytes,
                           max(s.data.nbytes for s in session.slots.tokens.addressable_shards)],
        }
    # The insert of every slot from its own 512-token prompt at 2 and 4 layers: per device temporaries
    # and the slots' KV cache (bytes over all devices).
    mesh = make_mesh(MeshConfig(data=2, fsdp=4, tensor=1))
    out["insert_memory"] = []
    for layers in (2, 4):
        deeper = ModelConfig.preset("tiny", vocab_size=64, num_layers=layers, hidden_size=64,
                                    intermediate_size=128)
        g, s = nnx.split(Transformer(deeper, rngs=nnx.Rngs(0)))
        spec = ModelSpec(g, deeper, eos_ids=(3,), pad_id=0, prompt_buckets=(512,), mesh=mesh)
        programs = compiled_engine(spec, slots=16, max_new_tokens=64, chunk=2).programs
        insert = programs.lower_insert(shard_state(s, mesh), params, prompt_len=512)
        out["insert_memory"].append([insert.compile().memory_analysis().temp_size_in_bytes,
                                     sum(c.size * c.dtype.itemsize for c in jax.tree.leaves(
                                         programs.abstract_slots().cache))])
    print("RESULT" + json.dumps(out))
    """
)


@pytest.mark.slow
def test_slots_and_their_cache_shard_over_the_mesh_batch_axes_on_8_devices():
    env = fake_devices_env(8)
    proc = subprocess.run([sys.executable, "-c", _SHARDED], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT", 1)[1])
    one, sharded, scanned = result["one"], result["data2_fsdp4"], result["data2_fsdp4_scanned"]
    assert sharded["tokens"] == one["tokens"] == scanned["tokens"]
    assert all(t == one["tokens"][24] for t in one["tokens"][25:])  # greedy copies of one prompt
    # Copies of a prompt held on another device are prefilled there instead of copied across devices.
    assert sharded["prefill_rows"] > one["prefill_rows"]
    # An insert of every slot copies each device's slots on that device: two more layers add less to a
    # device's temporaries than their share of the slots' cache (copies of every slot's prompt keys and
    # values on every device added three times the whole cache's growth).
    (temp2, cache2), (temp4, cache4) = result["insert_memory"]
    assert temp4 - temp2 < (cache4 - cache2) / 8, result["insert_memory"]
    # Slots moved within their device's block, and chunks ran over one slot per device (8 rows).
    assert sharded["moves"] > 0 and sharded["bucket_steps"].get("8", 0) > 0
    assert set(sharded["bucket_steps"]) <= {"8", "16"}
    total, per_device = sharded["cache_bytes"]
    assert total == one["cache_bytes"][0] and per_device * 8 == total  # 16 slots, two per device
    assert sharded["cache_devices"] == scanned["cache_devices"] == 8
    # The scanned layout keeps one key and one value array per layer too (a layer's attention reads its
    # own array, not a slice of a stacked one), split over the devices like the unrolled layout's.
    assert scanned["cache_layers"] == sharded["cache_layers"] == [2, 2]
    assert scanned["cache_bytes"] == sharded["cache_bytes"]
    assert scanned["moves"] == sharded["moves"]
    assert sharded["slot_bytes"][1] * 8 == sharded["slot_bytes"][0]
    assert one["cache_bytes"][1] == one["cache_bytes"][0]


# ------------------------------------------------------------------------------------ the switch
def mesh_of(**axes: int) -> types.SimpleNamespace:
    """What ``make_engine`` reads of a mesh: its axis sizes."""
    return types.SimpleNamespace(shape={"data": 1, "fsdp": 1, "tensor": 1, **axes})


def test_engine_is_the_default_and_lockstep_is_a_switch(tiny_sampler):
    sampler, _ = tiny_sampler
    default = environment("kuhn_poker").config("tiny")
    assert default.rollout.engine == "continuous" and default.rollout.engine_slots == 0
    engine = make_engine(default, sampler.spec, mesh_of(data=1, fsdp=8))
    assert engine is not None and engine.num_slots == 64  # min(largest rollout, 64)
    capped = dataclasses.replace(default, rollout=dataclasses.replace(default.rollout, max_decode_rows=12))
    assert make_engine(capped, sampler.spec, mesh_of(data=2, fsdp=2)).num_slots == 12  # the sampler's cap
    fixed = make_engine(tiny_config("kuhn_poker", engine_slots=5), sampler.spec, mesh_of(data=1, fsdp=4))
    assert fixed.num_slots == 8  # a multiple of the batch ways
    lockstep = tiny_config("kuhn_poker", engine="lockstep")
    assert make_engine(lockstep, sampler.spec, mesh_of(data=1, fsdp=1)) is None
    with pytest.raises(C.ConfigError, match="rollout.engine"):
        tiny_config("kuhn_poker", engine="fast")
    with pytest.raises(C.ConfigError, match="rollout.engine_chunk"):
        tiny_config("kuhn_poker", engine_chunk=0)
    assert len(engine.programs.windows) == 1  # the whole cache only, by default
    windowed = make_engine(tiny_config("kuhn_poker", engine_windows=3), sampler.spec, mesh_of(data=1, fsdp=1))
    whole = windowed.programs.max_len
    assert windowed.programs.windows == (-(-whole // 4), -(-whole // 2), whole)
    with pytest.raises(C.ConfigError, match="rollout.engine_windows must be >= 1"):
        tiny_config("kuhn_poker", engine_windows=0)


def test_automaton_cache_keeps_the_recently_used_automata_within_its_bytes():
    from mage_jax.generate.constraints import automaton_from_completions
    from mage_jax.generate.engine import AutomatonCache

    a, b, c = (automaton_from_completions([[t]], 16, 0) for t in (1, 2, 3))  # 3 states x 16 int32 each
    cache = AutomatonCache(max_bytes=2 * a.transitions.nbytes)
    cache.put("a", a)
    cache.put("b", b)
    assert cache.get("a") is a  # "a" used last: "b" is the oldest now
    cache.put("c", c)
    assert len(cache) == 2 and cache.get("b") is None and cache.get("a") is a and cache.get("c") is c
