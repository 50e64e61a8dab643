"""The host-path rollout benchmark runs end to end at tiny sizes: every environment asked for, sane
shares and rates, the constraint bytes of the real engine's bank at Qwen's vocabulary, and a target list."""

import json

from experiments.benchmarks.rollout_host import QWEN_VOCAB, main


def test_benchmark_writes_json_with_shares_rates_and_targets(tmp_path):
    out = tmp_path / "bench.json"
    # Sokoban stands in for the slow environments here (its workers start fast; WebShop's build an index)
    report = main(["--envs", "kuhn_poker,sokoban", "--workers-envs", "sokoban", "--meta-episodes", "2",
                   "--speedup", "50", "--out", str(out)])
    assert json.loads(out.read_text()) == report
    assert report["load_average_before"] >= 0 and report["load_average_after"] >= 0
    kuhn, sokoban = report["results"]
    assert (kuhn["env"], kuhn["workers"]) == ("kuhn_poker", 0)
    assert (sokoban["env"], sokoban["workers"]) == ("sokoban", 2)
    for r in (kuhn, sokoban):
        assert r["rows"] >= r["meta_episodes"] == 2 and r["invalid_action_ratio"] == 0.0
        assert 0.0 <= r["host_share"] <= 1.0 and r["requests_per_s"] > 0
        # every chunk sleeps its device time (a loaded machine oversleeps, never undersleeps)
        assert r["decode_chunks"] * r["chunk_ms"] / 1e3 * 0.99 <= r["device_s"] <= r["timed_rollout_s"]
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
