"""The startup benchmark runs the main job cold and warm in fresh processes and reports each run's wall
time and compile report next to issue 28's targets; the warm run loads its programs from the cache."""

import json

from experiments.benchmarks.startup import TARGETS, main


def test_the_warm_run_loads_every_program_the_cold_run_compiled(tmp_path):
    out = tmp_path / "startup.json"
    report = main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text()) == report
    cold, warm = report["cold"], report["warm"]
    for run in (cold, warm):
        assert run.keys() == {"wall_s", "run_wall_s", "programs", "compile_s", "cache_hits",
                              "training_programs", "load_average"}
        assert 0 < run["run_wall_s"] <= run["wall_s"] and 0 < run["training_programs"] < run["programs"]
    assert cold["cache_hits"] == 0 and warm["cache_hits"] > 0
    assert warm["cache_hits"] == warm["programs"] == cold["programs"]  # same shapes: nothing compiled again
    assert report["targets_apply"] is False  # smoke sizes, not the main job the targets are for
    assert report["targets"]["programs"] == {"value": cold["programs"], "target": TARGETS["programs"],
                                             "met": cold["programs"] <= TARGETS["programs"]}
    assert report["targets"]["warm_wall_s"]["value"] == warm["wall_s"]
    assert set(report["load_average"]) == {"before", "after"}
