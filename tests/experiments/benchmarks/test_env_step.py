"""The environment-step benchmark runs end to end and reports every configuration it was asked for."""

import json

from experiments.benchmarks.env_step import main


def test_benchmark_writes_json_with_timings(tmp_path):
    out = tmp_path / "bench.json"
    report = main(["--tasks", "2", "--group", "2", "--episodes", "2", "--only", "sokoban,minesweeper",
                   "--style", "compact", "--out", str(out)])
    assert json.loads(out.read_text()) == report
    assert [r["env"] for r in report["results"]] == ["sokoban", "minesweeper"]
    for result in report["results"]:
        assert result["meta_episodes"] == 4 and result["turns_measured"] >= 1
        assert result["ms_per_turn"] > 0 and result["step_ms_per_turn"] <= result["ms_per_turn"]
