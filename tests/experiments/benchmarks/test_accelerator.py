"""The accelerator check (``python -m experiments.benchmarks.accelerator``): every stage runs at toy
sizes on the CPU (a few stages per test, so that no test nears the suite's per-test limit on a loaded
machine) and every correctness comparison compares something real; a stage that fails leaves the stages
before it on disk; a bad command line is one error line and writes nothing. Not timed."""

import json
import math

import numpy as np
import pytest

from experiments.benchmarks import accelerator, accelerator_correctness
from experiments.benchmarks.accelerator import STAGES
from experiments.benchmarks.accelerator_correctness import comparison, greedy_agreement
from experiments.benchmarks.accelerator_stages import TINY, StageInput
from tests.optional import require

DECODER_CHECKS = {f"decoder_{what}/{arch}/{dtype}" for what in ("logits", "greedy")
                  for arch in ("qwen3", "llama") for dtype in ("float32", "bfloat16")}


def tiny_run(tmp_path, *argv: str) -> tuple[dict, str]:
    """``--tiny`` with ``argv``: the report (checked against its JSON file) and the markdown table."""
    out = tmp_path / "accelerator.json"
    report = accelerator.main(["--tiny", "--out", str(out), *argv])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report, default=str))
    stages = report["stages"]
    assert {name: s["status"] for name, s in stages.items()} == {name: "ok" for name in stages}, {
        name: s.get("error") for name, s in stages.items()}
    return stages, (tmp_path / "accelerator.md").read_text()


STAND_INS = {
    "environment": {"device_kind": "cpu", "backend": "cpu", "matmul_bf16_tflops": 0.1, "copy_gbps": 5.0},
    "correctness": {"all_pass": True, "checks": [{"name": "a", "pass": True}]},
    "train": {"ours": {"mfu": 0.1, "tokens_per_s": 10.0}, "torch": {"tokens_per_s": 11.0},
              "ratio_ours_over_torch": {"median": 0.9}},
    "decode": {"rows": 4, "fraction_of_copy_bandwidth": 0.1, "decode_ratio_ours_over_hf": 1.5,
               "ours": {"decode_tokens_per_s": {"median": 50.0}}},
    "rollout": {"speedup": 1.2, "useful_decode_fraction": {"engine": 0.5}, "compiles_after_warmup": 0,
                "greedy_identical": True},
    "decode_layout": {"scanned_over_unrolled": 0.5, "path": "engine", "layers": 2, "batch": 2,
                      "prompt_len": 8, "greedy_identical": True},
    "real_model": {"seconds_per_iteration": 1.0, "iterations": [{"payoff_by_episode": [0.0, 0.5]}]},
}
"""What each stage's stand-in returns: the fields the table reads."""


def test_a_tiny_run_of_every_stage_writes_each_in_order_with_its_table_row(tmp_path, monkeypatch):
    """The whole command, every stage in its fixed order, each stage replaced by a stand-in (the real
    ones run below, a few per test: together they took 480-570 s on a loaded machine, too close to the
    suite's per-test limit). Each stand-in sees the results of the stages before it."""
    assert set(STAND_INS) == set(STAGES)
    seen: list[tuple[str, list[str]]] = []
    for name in STAGES:
        def stand_in(given, name=name):
            seen.append((name, list(given.prior)))
            return dict(STAND_INS[name])
        monkeypatch.setitem(accelerator.STAGES, name, stand_in)
    (tmp_path / "config.json").write_text("{}")  # a model folder, as far as the command line checks
    stages, table = tiny_run(tmp_path, "--model-path", str(tmp_path))
    assert list(stages) == list(STAGES) and [name for name, _ in seen] == list(STAGES)
    assert all(prior == list(STAGES)[:i] for i, (_, prior) in enumerate(seen))
    assert all(f"| {name} |" in table for name in STAGES)


def test_the_tiny_environment_stage_measures_the_ceilings_and_names_the_versions(tmp_path):
    stages, table = tiny_run(tmp_path, "--stages", "environment")
    env = stages["environment"]
    assert env["backend"] == "cpu" and env["matmul_bf16_tflops"] > 0 and env["copy_gbps"] > 0
    assert set(env["versions"]) >= {"jax", "jaxlib", "flax", "optax", "orbax", "transformers", "torch",
                                    "python"}
    assert "| environment | cpu (cpu): bf16 matmul " in table


def test_the_correctness_stage_runs_every_group_and_names_what_it_cannot_compare_here(tmp_path, monkeypatch):
    """The stage's 13 checks on a CPU: logits and greedy tokens of both decoders in both dtypes, blockwise
    and prefix attention with padding and packing, the engine's greedy rollout (each group runs for real
    in the test below); the GPU and TPU kernels are listed as not compared."""
    checks = accelerator_correctness
    monkeypatch.setattr(checks, "decoder_checks", lambda given, arch: [
        comparison(f"decoder_{what}/{arch}/{dtype}", 1, 0.0, 0.0)
        for what in ("logits", "greedy") for dtype in ("float32", "bfloat16")])
    monkeypatch.setattr(checks, "attention_check", lambda given, impl, case, dtype: comparison(
        f"attention/{impl}/{case}/{dtype}", 1, 0.0, 0.0))
    monkeypatch.setattr(checks, "engine_check", lambda given: comparison(
        "engine_greedy_equals_lockstep/kuhn_poker", 1, 0.0, 0.0))
    result = checks.correctness(StageInput(TINY, {}, None, str(tmp_path)))
    names = [c["name"] for c in result["checks"]]
    attention = {f"attention/{impl}/{case}/float32" for impl in ("blockwise", "prefix")
                 for case in ("padding", "packed")}
    assert len(names) == 13
    assert set(names) == DECODER_CHECKS | attention | {"engine_greedy_equals_lockstep/kuhn_poker"}
    skipped = {(s["implementation"], s["case"]) for s in result["not_compared_here"]}
    assert {("cudnn", "padding"), ("cudnn", "packed"), ("splash", "padding, packed")} == skipped
    assert result["all_pass"]


@pytest.mark.slow
@pytest.mark.parametrize("group", ["decoder/qwen3", "decoder/llama", "attention", "engine"])
def test_every_tiny_correctness_check_compares_something_real(tmp_path, group):
    """Each group of the correctness stage at toy sizes, one group per test (the whole stage took 245-320 s
    on a loaded machine): every comparison passes, compares values, and says what it compared."""
    checks = accelerator_correctness
    given = StageInput(TINY, {}, None, str(tmp_path))
    if group.startswith("decoder/"):
        require("torch")  # the decoders' oracle is the HF PyTorch model
        arch = group.split("/")[1]
        results = checks.decoder_checks(given, arch)
        assert {c["name"] for c in results} == {n for n in DECODER_CHECKS if f"/{arch}/" in n}
    elif group == "attention":
        results = [checks.attention_check(given, *plan) for plan in checks.attention_plan("cpu")]
        assert {c["implementation"] for c in results} == {"blockwise", "prefix"}
        assert all(c["reference"] == "dense" for c in results)  # the JSON names what ran against what
    else:
        results = [checks.engine_check(given)]
        assert results[0]["rows"] > results[0]["slots"]
    for check in results:
        assert check["pass"] and check["values_compared"] > 0, check
        assert math.isfinite(check["max_abs_diff"]) and check["max_abs_diff"] <= check["tolerance"], check


@pytest.mark.slow
def test_the_tiny_train_and_decode_stages_measure_against_their_peers(tmp_path):
    require("torch")  # the peers of both stages are PyTorch's
    stages, _ = tiny_run(tmp_path, "--stages", "environment,train,decode")
    train = stages["train"]
    for side in ("ours", "torch"):
        assert train[side]["tokens_per_s"] > 0 and train[side]["mfu"] > 0
    assert train["ours"]["dtype"] == "bfloat16" and train["ours"]["remat"] == "full"
    assert train["torch"]["autocast"] == "bfloat16" and train["torch"]["attention"] == "sdpa"
    assert len(train["ratio_per_repeat"]) == TINY.train_repeats
    assert train["tokens_per_step"] == TINY.train_rows * TINY.train_length

    decode = stages["decode"]
    assert decode["rows"] == TINY.decode_rows
    assert decode["ours"]["decode_tokens"] == TINY.decode_rows * (TINY.decode_new_tokens - 1)
    assert decode["hf"]["new_tokens"] == TINY.decode_rows * TINY.decode_new_tokens
    assert decode["bytes_per_step"] > 0 and decode["copy_gbps_measured"] == stages["environment"]["copy_gbps"]


@pytest.mark.slow
def test_the_tiny_rollout_stage_gives_the_lockstep_greedy_tokens(tmp_path):
    stages, _ = tiny_run(tmp_path, "--stages", "rollout")
    roll = stages["rollout"]
    assert roll["greedy_identical"] and roll["speedup"] > 0
    assert 0 < roll["useful_decode_fraction"]["engine"] <= 1


@pytest.mark.slow
def test_the_tiny_decode_layout_stage_gives_the_unrolled_greedy_tokens(tmp_path):
    stages, _ = tiny_run(tmp_path, "--stages", "decode_layout")
    layout = stages["decode_layout"]
    assert layout["path"] == "engine" and layout["greedy_identical"] and layout["scanned_over_unrolled"] > 0


@pytest.mark.slow
def test_the_tiny_real_model_stage_trains_an_iteration_of_the_folder(tmp_path, tiny_hf_model):
    stages, _ = tiny_run(tmp_path, "--stages", "real_model", "--model-path", tiny_hf_model)
    real = stages["real_model"]
    assert real["model_path"] == tiny_hf_model and len(real["iterations"]) == 1
    assert len(real["iterations"][0]["payoff_by_episode"]) == 2 and real["seconds_per_iteration"] > 0


def test_a_comparison_of_nothing_or_of_nan_never_passes():
    assert comparison("x", 10, 0.5, 1.0)["pass"]
    assert not comparison("x", 0, 0.0, 1.0)["pass"]  # nothing compared: a skipped comparison fails
    assert not comparison("x", 10, float("nan"), 1.0)["pass"]
    assert not comparison("x", 10, 1.5, 1.0)["pass"]


def test_a_failing_stage_leaves_the_finished_stages_on_disk_and_the_run_goes_on(tmp_path):
    out = tmp_path / "report.json"
    seen = {}

    def fine(given):
        return {"value": 1}

    def broken(given):
        raise RuntimeError("device lost")

    def later(given):
        seen.update(json.loads(out.read_text())["stages"])  # what a kill at this moment would leave
        return {"value": 3}

    given = StageInput(TINY, {}, None, str(tmp_path))
    stages = {"first": fine, "second": broken, "third": later}
    report = accelerator.run_stages(list(stages), given, out, {"sizes": "tiny", "started": "now"}, stages)
    assert seen["first"]["status"] == "ok" and seen["first"]["value"] == 1
    assert seen["second"] == report["stages"]["second"]
    assert report["stages"]["second"]["status"] == "error"
    assert report["stages"]["second"]["error"] == "RuntimeError: device lost"
    assert report["stages"]["third"]["value"] == 3 and given.prior["first"]["value"] == 1
    assert json.loads(out.read_text()) == report
    table = (tmp_path / "report.md").read_text()
    assert "| second | error: RuntimeError: device lost |  | finishes | no |" in table  # nothing predicted
    assert accelerator.exit_status(report) == 1
    assert accelerator.exit_status({"stages": {"first": report["stages"]["first"]}}) == 0
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("argv, message", [
    (["--stages", "environment,bogus"], "error: unknown stage(s) 'bogus' in --stages; known: environment,"),
    (["--stages", "real_model"], "error: stage real_model needs --model-path DIR"),
    (["--model-path", "/nonexistent/model"], "error: --model-path '/nonexistent/model' holds no config.json"),
])
def test_a_bad_command_line_is_one_error_line_and_nothing_written(tmp_path, capsys, argv, message):
    out = tmp_path / "r" / "report.json"
    with pytest.raises(SystemExit) as exit_info:
        accelerator.main([*argv, "--out", str(out)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(message), err
    assert not (tmp_path / "r").exists()


def test_stages_run_in_their_fixed_order_and_real_model_only_with_a_folder():
    assert accelerator.select_stages(None, None) == [s for s in STAGES if s != "real_model"]
    assert accelerator.select_stages(None, "/m") == list(STAGES)
    assert accelerator.select_stages("rollout, environment", None) == ["environment", "rollout"]


def test_the_table_states_each_target_and_whether_it_is_met():
    stages = {
        "correctness": {"status": "ok", "all_pass": False,
                        "checks": [{"name": "a", "pass": True}, {"name": "b", "pass": False}]},
        "train": {"status": "ok", "ours": {"mfu": 0.5, "tokens_per_s": 1000.0},
                  "torch": {"tokens_per_s": 1100.0}, "ratio_ours_over_torch": {"median": 0.9}},
        "decode": {"status": "ok", "rows": 64, "fraction_of_copy_bandwidth": 0.7,
                   "decode_ratio_ours_over_hf": 2.5, "ours": {"decode_tokens_per_s": {"median": 5000.0}}},
        "rollout": {"status": "ok", "speedup": 3.5, "useful_decode_fraction": {"engine": 0.7},
                    "compiles_after_warmup": 0, "greedy_identical": True},
    }
    rows = [(r.stage, r.target, r.met) for r in accelerator.target_rows(stages)]
    assert rows == [
        ("correctness", "all pass", False),
        ("train", "MFU >= 0.45", True), ("train", ">= 1.0x", False),
        ("decode", ">= 0.6 at 64 rows", True), ("decode", ">= 2x", True),
        ("rollout", ">= 3x with >= 0.8 useful", False),
    ]
    assert "failed: b" in accelerator.target_rows(stages)[0].measured


def test_a_comparison_that_raises_fails_alone_and_the_others_still_run(tmp_path, monkeypatch):
    """cuDNN on a CPU raises: that check is recorded as failed with its error, the next one runs."""
    checks = accelerator_correctness
    monkeypatch.setattr(checks, "decoder_checks", lambda given, arch: [])
    monkeypatch.setattr(checks, "engine_check", lambda given: comparison("engine", 1, 0.0, 0.0))
    monkeypatch.setattr(checks, "attention_plan", lambda platform: [("cudnn", "padding", "bfloat16"),
                                                                   ("blockwise", "packed", "float32")])
    result = checks.correctness(StageInput(TINY, {}, None, str(tmp_path)))
    cudnn, blockwise, engine = result["checks"]
    assert cudnn["name"] == "attention/cudnn/padding/bfloat16" and not cudnn["pass"]
    assert cudnn["values_compared"] == 0 and cudnn["error"]  # e.g. "RuntimeError: cuDNN is not detected."
    assert blockwise["pass"] and blockwise["values_compared"] > 0 and engine["pass"]
    assert not result["all_pass"]


def test_greedy_tokens_differ_only_at_near_ties_of_the_reference():


    logits = [np.array([[0.0, 5.0, 4.99], [0.0, 5.0, 1.0]])] * 3  # step 0..2, rows 0..1, vocab 3
    same = greedy_agreement([[1, 1, 2], [1, 1]], [[1, 1, 2], [1, 1]], logits, margin=0.05)
    assert same == (5, 0, 0)
    # Row 0 first differs where the reference's two choices lie 0.01 apart: a near-tie, not a mismatch.
    # Row 1 first differs by 4.0: a mismatch; both rows count the tokens up to their first difference.
    assert greedy_agreement([[1, 2, 2], [2]], [[1, 1, 2], [1, 1]], logits, margin=0.05) == (3, 1, 1)
    assert greedy_agreement([[1, 1, 2]], [[1, 1]], logits, margin=0.05) == (2, 1, 0)  # one row ran on


def test_the_default_sizes_are_valid_inputs_of_the_entry_points_they_drive(tiny_hf_model):
    """What only a GPU runs is still checked here: the rollout benchmark accepts the default arguments and
    the Kuhn Poker `small` preset accepts the default overrides of real_model."""
    from experiments.benchmarks import decode_layout, rollout
    from experiments.benchmarks.accelerator_stages import DEFAULT
    from experiments.environments import environment

    args = rollout.parse_args(list(DEFAULT.rollout_args))
    assert (args.model, args.dtype, args.rows, args.slots) == ("qwen3-0.6b", "bfloat16", 128, 64)
    layout = decode_layout.parse_args(list(DEFAULT.layout_args))
    assert (layout.path, layout.model, layout.layers, layout.batch) == ("engine", "qwen3-0.6b", 8, 64)
    overrides = {"model.path": tiny_hf_model, **DEFAULT.real_model_overrides}
    cfg = environment("kuhn_poker").config("small", overrides)
    assert (cfg.train.iterations, cfg.rollout.num_tasks, cfg.rollout.group_size) == (2, 4, 4)
    assert DEFAULT.decode_rows == 64 and DEFAULT.train_model["num_hidden_layers"] == 28


def test_the_predicted_column_is_the_roofline_of_the_device_data_sheet():
    """On an H200 (989 TFLOP/s dense bf16, 4.8 TB/s): a full-remat train step computes 8 N per token, so
    its MFU bound is 6 / 8; a decode step reads its bytes once at the bandwidth. A CPU has no data sheet:
    nothing is predicted."""
    n, tokens = 0.6e9, 4 * 2048
    train = {"status": "ok", "tokens_per_step": tokens, "flops_per_step": 6 * n * tokens,
             "ours": {"mfu": 0.3, "tokens_per_s": 60_000.0, "remat": "full"}, "torch": {"tokens_per_s": 1.0},
             "ratio_ours_over_torch": {"median": 1.8}}
    decode = {"status": "ok", "rows": 64, "bytes_per_step": 4.8e9, "fraction_of_copy_bandwidth": 0.3,
              "decode_ratio_ours_over_hf": 3.0, "ours": {"decode_tokens_per_s": {"median": 6_400.0}}}
    env = {"status": "ok", "device_kind": "NVIDIA H200", "backend": "gpu", "matmul_bf16_tflops": 780.0,
           "copy_gbps": 2500.0}
    rows = accelerator.target_rows({"environment": env, "train": train, "decode": decode})
    step = 8 * n * tokens / 989e12
    assert rows[0].predicted == "data sheet (h200-141gb): 989 TFLOP/s dense bf16, 4,800 GB/s"
    assert rows[1].predicted == (f"{step:.3g} s / step, {tokens / step:,.0f} tok/s, MFU 0.75; "
                                 f"measured {60_000 * step / tokens:.2f} of it")
    assert rows[2].predicted == "" and rows[4].predicted == ""  # the PyTorch and HF ratios: no roofline
    assert rows[3].predicted == "1 ms / step, 64,000 tok/s; measured 0.10 of it"  # 4.8 GB at 4.8 TB/s
    no_remat = accelerator.predict_train({**train, "ours": {**train["ours"], "remat": "none"}},
                                         accelerator.device_hardware({"environment": env}))
    assert no_remat["mfu"] == 1.0
    cpu = {**env, "device_kind": "cpu"}
    assert all(r.predicted == "" for r in accelerator.target_rows({"environment": cpu, "train": train}))
    report = {"sizes": "default", "started": "now", "stages": {"environment": env, "train": train}}
    table = accelerator.markdown(report)
    assert "| stage | measured | predicted | target | met |" in table and "not measurements" in table
