"""The model benchmarks (ours against PyTorch) run end to end on a tiny Qwen3 and report every figure a
fair comparison needs; the thread pin applies to both runtimes and is undone afterwards. Not timed."""

import json
import os

from experiments.benchmarks import generation, train_step
from experiments.benchmarks.common import pinned_threads
from tests.optional import require

torch = require("torch")  # the PyTorch side of every benchmark


def test_train_step_benchmark_reports_both_sides(tmp_path):
    out = tmp_path / "train.json"
    report = train_step.main(["--shape", "tiny", "--rows", "2", "--length", "16", "--prompt-len", "8",
                              "--repeats", "3", "--threads", "0", "--peak-size", "256", "--out", str(out)])
    assert json.loads(out.read_text()) == report
    assert report["tokens_per_step"] == 32 and report["batch"]["response_targets_per_row"] == 8
    assert report["flops_per_step"] == 6 * report["model"]["parameters"] * 32
    for side in ("ours", "torch"):
        assert len(report[side]["times_s"]) == 3
        assert set(report[side]["seconds"]) == {"min", "median", "max"}
        assert report[side]["tokens_per_s"]["median"] > 0 and report[side]["fraction_of_peak"] > 0
    assert report["ours"]["compile_s"] >= 0 and report["matmul_peak"]["jax_gflops"] > 0
    assert report["speedup_ours_over_torch"]["min"] <= report["speedup_ours_over_torch"]["max"]
    assert set(report["load_average"]) == {"before", "after"} and report["threads"]["threads"] == 0


def test_generation_benchmark_reports_prefill_and_decode(tmp_path):
    out = tmp_path / "gen.json"
    report = generation.main(["--shape", "tiny", "--batch", "2", "--prompt-len", "8", "--new-tokens", "3",
                              "--repeats", "2", "--threads", "0", "--out", str(out)])
    assert json.loads(out.read_text()) == report
    for side in ("ours", "hf"):
        assert len(report[side]["times_s"]["full"]) == len(report[side]["times_s"]["prefill"]) == 2
        assert report[side]["prefill_s"]["median"] > 0
        assert report[side]["end_to_end_tokens_per_s"]["median"] > 0
    assert report["hf"]["new_tokens"] == 2 * 3
    assert set(report["ratio_ours_over_hf"]) == {"end_to_end", "prefill", "decode"}
    assert report["order"] == "interleaved" and set(report["load_average"]) == {"before", "after"}


def test_pinned_threads_binds_both_runtimes_and_restores():
    before = (os.sched_getaffinity(0), os.environ.get("XLA_FLAGS"), torch.get_num_threads())
    with pinned_threads(1) as info:
        assert len(os.sched_getaffinity(0)) == 1 and info["cpus"] == sorted(os.sched_getaffinity(0))
        assert torch.get_num_threads() == 1 == info["torch_threads"]
        assert "--xla_cpu_multi_thread_eigen=false" in os.environ["XLA_FLAGS"]
    assert (os.sched_getaffinity(0), os.environ.get("XLA_FLAGS"), torch.get_num_threads()) == before
