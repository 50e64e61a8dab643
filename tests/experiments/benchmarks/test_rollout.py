"""The rollout benchmark runs the engine against lockstep generation on the same greedy workload and
reports where the engine's decode steps went (slot buckets, decode windows)."""

import json

from experiments.benchmarks import rollout


def test_the_engine_with_decode_windows_gives_the_lockstep_tokens_and_books_every_step(tmp_path):
    out = tmp_path / "rollout.json"
    report = rollout.main(["--model", "tiny", "--rows", "4", "--group", "2", "--turns", "2", "--median", "3",
                           "--p90", "6", "--cap", "40", "--slots", "4", "--chunk", "4", "--slot-levels", "1",
                           "--windows", "3", "--repeats", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == report
    assert report["greedy_identical"] and report["windows"] == 3
    windows = {int(w): n for w, n in report["engine_window_steps"].items()}
    assert sum(windows.values()) == report["engine_decode_steps"] > 0
    # Prompts of the 64-token bucket with short responses read the half window of 128 + 40 positions.
    assert set(windows) <= {42, 84, 168} and windows.get(84, 0) > 0, windows
