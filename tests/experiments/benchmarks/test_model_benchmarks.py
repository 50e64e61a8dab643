"""The model benchmarks (ours against PyTorch) run end to end on a tiny Qwen3 and report every figure a
fair comparison needs; the thread pin applies to both runtimes and is undone afterwards. Not timed."""

import json
import os
import subprocess
import sys

from experiments.benchmarks import generation, matmul, train_step
from experiments.benchmarks.common import QWEN3_SHAPES, pinned_threads
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


def test_matmul_products_are_the_steps_flops():
    """Every weight matrix appears in its three layouts: the products' flops are 6 x matrix parameters x
    tokens, plus the output head's forward product once more (recomputed in its gradient)."""
    shape = QWEN3_SHAPES["27m"]
    rows, length = 16, 512
    tokens = rows * length
    h, v, i = shape["hidden_size"], shape["vocab_size"], shape["intermediate_size"]
    q, kv = shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]
    matrices = shape["num_hidden_layers"] * (2 * h * q + 2 * h * kv + 3 * h * i) + h * v
    products = matmul.step_products(shape, rows, length)
    linear = sum(p.count * p.flops for p in products if not p.name.startswith("attention"))
    assert linear == 6 * matrices * tokens + 2 * tokens * h * v
    attention = sum(p.count * p.flops for p in products if p.name.startswith("attention"))
    heads, dim = shape["num_attention_heads"], shape["head_dim"]
    assert attention == 6 * shape["num_hidden_layers"] * 2 * rows * heads * length**2 * dim


def test_matmul_benchmark_times_both_sides_on_the_same_products(tmp_path):
    out = tmp_path / "matmul.json"
    report = matmul.main(["--shape", "tiny", "--rows", "2", "--length", "16", "--repeats", "2",
                          "--threads", "0", "--out", str(out)])
    assert json.loads(out.read_text()) == report
    assert len(report["products"]) == 18
    for product in report["products"]:
        assert product["relative_difference"] < 1e-4
        assert product["ours_gflops"]["best"] > 0 and product["torch_gflops"]["best"] > 0
    assert report["step"]["ours_seconds_median_rates"] > 0 and report["step"]["ours_over_torch_time"] > 0


def test_train_step_profile_splits_both_steps_into_categories(tmp_path):
    """In a fresh process: XLA reads its trace and dump flags when its backend starts."""
    out = tmp_path / "profile.json"
    subprocess.run([sys.executable, "-m", "experiments.benchmarks.train_step_profile", "--shape", "tiny",
                    "--rows", "2", "--length", "16", "--prompt-len", "8", "--steps", "1", "--threads", "0",
                    "--out", str(out)], check=True, capture_output=True, timeout=600)
    report = json.loads(out.read_text())
    ours, torch_side = report["ours"], report["torch"]
    assert "jit__update_fn" in ours["by_program"]  # gradients and optimizer step: one program
    assert ours["by_category"]["matrix products"] > 0 and torch_side["by_category"]["matrix products"] > 0
    assert all(row["hlo"] for row in ours["top"])  # every traced instruction found in the optimised HLO
    assert {"output head (log-probs, entropy, their gradient)", "optimizer step (clip + AdamW + skip)",
            "attention scores / probabilities"} <= set(ours["by_part"])
