"""The iteration benchmark trains a few iterations of a preset on a model folder and reports each phase
of each iteration (rollout, old and reference log-probs, updates) in wall, CPU and compile seconds."""

import json

from experiments.benchmarks.iteration import PHASES, main
from mage_jax.testing import SMOKE


def test_every_iteration_reports_its_phases_and_the_first_one_compiles(tiny_hf_model, tmp_path,
                                                                        compilation_cache):
    out = tmp_path / "iteration.json"
    sets = {"model.overrides": {**SMOKE["model.overrides"], "max_position_embeddings": 40960},
            "rollout.num_tasks": 1, "rollout.group_size": 2, "rollout.num_episodes": 2,
            "rollout.engine_slots": 2, "rollout.length_buckets": [4096], "optim.lr": 1e-3}  # one bucket
    argv = ["--preset", "smollm2-cpu", "--model-path", tiny_hf_model, "--iterations", "2", "--out", str(out)]
    for key, value in sets.items():
        argv += ["--set", f"{key}={json.dumps(value)}"]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    first, second = report["iterations"]
    assert [first["iteration"], second["iteration"]] == [1, 2]
    for it in (first, second):
        assert {"rollout", "updates"} <= set(it["phases"]) <= set(PHASES)
        assert it["rows"] > 0 and it["prompt_tokens"] > it["rows"] and it["updates"] >= 1
        inside = sum(p["wall_s"] for p in it["phases"].values())
        assert 0 < inside <= it["wall_s"] + 0.5 and it["cpu_s"] > 0
    assert "reference_logprobs" in first["phases"]  # KL to the base: the adapters-off pass
    assert report["steady_state"]["cpu_s"] > 0 and report["matmul_peak_gflops"] > 0
    assert set(report["load_average"]) == {"before", "after"}
