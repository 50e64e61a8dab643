"""The host-path rollout benchmark runs end to end at tiny sizes: every environment asked for, sane
shares and rates, the constraint bytes of the real engine's bank at Qwen's vocabulary, and a target list."""

import json
import time

import numpy as np

from experiments.benchmarks.rollout_host import main
from experiments.benchmarks.stand_in_device import (
    QWEN_VOCAB,
    DeviceCosts,
    StandInPrograms,
    measure_cpu_costs,
    stand_in_spec,
)
from mage_jax.generate.spec import SlotPrograms
from mage_jax.generate.step import KEY_PATH_LEN
from mage_jax.models.config import ModelConfig
from mage_jax.tokenizer import Tokenizer


def test_benchmark_writes_json_with_shares_rates_and_targets(tmp_path):
    out = tmp_path / "bench.json"
    # Sokoban stands in for the slow environments here (its workers start fast; WebShop's build an index)
    # set device costs (no calibration): a full decode chunk 180 ms, an insert 100 ms, a move 50 ms on the CPU
    costs = ["--cpu-chunk-ms", "180", "--cpu-insert-ms", "100", "--cpu-move-ms", "50"]
    report = main(["--envs", "kuhn_poker,sokoban", "--workers-envs", "sokoban", "--meta-episodes", "2",
                   "--speedup", "50", *costs, "--out", str(out)])
    assert json.loads(out.read_text()) == report
    assert report["load_average"]["before"] >= 0 and report["load_average"]["after"] >= 0
    kuhn, sokoban = report["results"]
    assert (kuhn["env"], kuhn["workers"]) == ("kuhn_poker", 0)
    assert (sokoban["env"], sokoban["workers"]) == ("sokoban", 2)
    for r in (kuhn, sokoban):
        assert r["rows"] >= r["meta_episodes"] == 2 and r["invalid_action_ratio"] == 0.0
        assert 0.0 <= r["host_share"] <= 1.0 and r["requests_per_s"] > 0
        # every program books its own device time (a decode chunk in proportion to the steps it ran, an
        # insert its bucket's), and the rollout waits for them all (a loaded machine oversleeps, never
        # undersleeps)
        costs, booked, programs = r["device_costs"], r["device_s_by_program"], r["programs"]
        assert set(costs["insert_ms_by_prompt_bucket"].values()) == {2.0}  # 100 ms / 50
        assert costs["decode_chunk_ms_by_slot_bucket"] == {"16": 3.6, "64": 3.6} and costs["move_ms"] == 1.0
        flags = {"--cpu-chunk-ms", "--cpu-insert-ms", "--cpu-move-ms"}
        assert set(r["cpu_costs"]["source"].values()) == flags
        assert programs["decode"] == r["decode_chunks"] >= 1
        assert 0 < booked["decode"] <= programs["decode"] * 3.6e-3 + 1e-6
        assert abs(booked["insert"] - programs["insert"] * 2e-3) < 1e-6 and programs["insert"] >= 1
        assert abs(booked["move"] - programs["move"] * 1e-3) < 1e-6
        assert sum(booked.values()) * 0.99 - 1e-3 <= r["device_s"] <= r["timed_rollout_s"]
        # the bytes are the engine's (EngineStats over its ConstraintBank at 151,936 tokens): the first
        # rollout uploads the bank (the token -> column map at full width, once), and every insert sends one
        # int32 automaton index per target row (8), not a full-vocabulary table per request; a warm bank
        # uploads nothing more
        assert r["inserts"] >= 1 and r["automata"] >= 2
        assert r["automata_cached"] == r["automata"] - 1  # the engine's, kept across rollouts
        assert r["constraint_index_bytes"] == r["inserts"] * 8 * 4
        assert r["constraint_upload_bytes"] >= QWEN_VOCAB * 4
        per_insert = (r["constraint_index_bytes"] + r["constraint_upload_bytes"]) / r["inserts"]
        assert r["constraint_bytes_per_insert"] == round(per_insert, 1)
        assert r["constraint_bytes_per_insert_warm"] == 8 * 4
        assert r["bytes_per_insert"] >= r["constraint_bytes_per_insert"]
    assert sokoban["env_s_in_process"] > 0 and sokoban["stepping_speedup"] > 0
    assert sokoban["env_hidden_fraction"] <= 1.0 and sokoban["workers_env_wait_s"] >= 0
    names = {(t["env"], t["target"].split()[0]) for t in report["targets"]}
    assert ("kuhn_poker", "host") in names and ("sokoban", "stepping") in names
    assert all(isinstance(t["met"], bool) for t in report["targets"])


def test_stand_in_programs_cost_their_own_time_on_one_device_timeline():
    """An insert costs its prompt bucket's time, a decode chunk its slot bucket's (in proportion to the
    steps it ran), a move its own; they queue on one device, dispatch does not wait, and reading a
    program's output waits until the device has run it (like a dispatched JAX array)."""
    tokenizer = Tokenizer.word_level(["a b c d e f"], vocab_size=64)
    spec = stand_in_spec(tokenizer, ModelConfig.preset("tiny", vocab_size=64))
    costs = DeviceCosts({1: 0.04, 4: 0.08}, {64: 0.12, 128: 0.24}, 0.02)
    programs = StandInPrograms(spec, slots=4, chunk=4, max_new_tokens=8, free_tokens=[5, 6, 7, 8, 9, 10],
                               costs=costs, slot_levels=2)
    assert isinstance(programs, SlotPrograms)  # what the engine sees of its programs
    assert programs.slot_buckets == (1, 4)
    slots = programs.empty()
    started = time.perf_counter()
    slots = programs.insert(None, slots, [[2] * 100], [0, 0], [0, 1], [6, 6], [0, 0],
                           np.zeros((2, KEY_PATH_LEN), np.int32), None, None)
    slots, steps = programs.decode(None, slots, None, None, None, 4)
    moved = programs.move(slots, [(1, 2)])
    assert time.perf_counter() - started < 0.2  # nothing waited (the insert alone costs 0.24 s)
    assert programs.device_s == {"insert": 0.24, "decode": 0.08, "move": 0.02}  # bucket 128, 4 steps of 4
    assert programs.prompt_buckets_seen == {128}
    assert int(steps) == 4 and time.perf_counter() - started >= 0.32
    assert np.asarray(moved.done).tolist() == [False, True, False, True]
    assert time.perf_counter() - started >= 0.34
    slots, steps = programs.decode(None, moved, None, None, None, 1)  # one slot left, 1 step of 4
    assert int(steps) == 1 and programs.device_s["decode"] == 0.08 + 0.04 / 4


def test_cpu_costs_are_measured_on_the_real_programs():
    """The default costs time the tiny model's insert at every prompt bucket, its decode chunk at every
    slot bucket and its move (compiled first), with the cache the engine would have."""
    costs, shapes = measure_cpu_costs([16, 32], slots=4, chunk=2, max_new_tokens=4, repeats=1)
    assert sorted(costs.insert_s) == [16, 32] and sorted(costs.decode_s) == [1, 4] == shapes["slot_buckets"]
    assert all(t > 0 for t in [*costs.insert_s.values(), *costs.decode_s.values(), costs.move_s])
    assert shapes["cache_len"] == 32 + 4 and shapes["insert_rows"] == 4
