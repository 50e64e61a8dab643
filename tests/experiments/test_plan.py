"""``python -m experiments.plan``: a preset's programs compiled ahead of time on fake CPU devices, the
bytes per device they need beside the resident state, and a verdict per hardware.

The end-to-end run plans the tiny preset (2 layers: compiled at full depth, nothing extrapolated) and
checks its KV cache against the closed form. ``test_every_pretrained_preset_fits_its_named_hardware``
plans every ``small``, ``small-lora`` and ``paper`` preset at full width and length (the pretrained
presets scan their blocks: each program compiled at the model's full depth); it takes about 8 minutes
on two cores, so it runs when ``MAGE_PLAN_PRESETS=1`` is set (docs/scaling.md has its table).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from experiments import plan
from experiments.environments import ENVIRONMENTS
from experiments.presets import PAPER_HARDWARE, SMALL_HARDWARE
from mage_jax.generate.slots import DEFAULT_INSERT_ROWS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop(plan.CHILD_ENV, None)
    return subprocess.run([sys.executable, "-m", "experiments.plan", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args, message", [
    (["--env", "chess", "--preset", "paper"], "unknown environment 'chess'"),
    (["--env", "kuhn_poker", "--preset", "huge"], "unknown preset 'huge'"),
    (["--env", "kuhn_poker", "--preset", "paper", "--hardware", "tpu-v9"], "unknown hardware 'tpu-v9'"),
    (["--env", "kuhn_poker", "--preset", "paper", "--mesh", "fsdp=two"], "--mesh fsdp must be an integer"),
    (["--env", "kuhn_poker", "--preset", "paper", "--mesh", "pipeline=2"], "--mesh takes data=N"),
    (["--env", "kuhn_poker", "--preset", "paper", "--devices", "6", "--mesh", "data=1,fsdp=4,tensor=1",
      "--compiler", "cpu"], "needs 4 devices, found 6"),  # (with libtpu, auto plans the v5p on its own chips)
    (["--env", "kuhn_poker", "--preset", "paper", "--devices", "0"], "--devices must be >= 1"),
    (["--env", "kuhn_poker", "--preset", "paper", "--layers", "4", "3"], "--layers takes two depths"),
    (["--env", "kuhn_poker"], "the following arguments are required: --preset"),
    (["--env", "kuhn_poker", "--preset", "paper", "--set", "optim.micro_batch_rows=7"],
     "optim.micro_batch_rows must be 0 or divide"),
    (["--env", "kuhn_poker", "--preset", "tiny", "--topology", "v7x:2x2"], "--topology takes FAMILY:AxB[xC]"),
    (["--env", "kuhn_poker", "--preset", "tiny", "--compiler", "gcc"], "argument --compiler: invalid choice"),
])
def test_bad_arguments_are_one_error_line_and_exit_2(capsys, args, message):
    assert plan.main(args) == plan.EXIT_CONFIG_ERROR
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


@pytest.mark.skipif(plan.targets.compiler_installed("tpu"), reason="the TPU compiler is installed here")
def test_a_target_compiler_that_is_not_installed_is_one_error_line_saying_how_to_get_it(capsys):
    args = ["--env", "kuhn_poker", "--preset", "tiny", "--hardware", "tpu-v5e-1", "--compiler", "target"]
    assert plan.main(args) == plan.EXIT_CONFIG_ERROR
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: tpu-v5e-1 needs the TPU compiler") and 'pip install "jax[tpu]"' in line


def test_every_pretrained_preset_names_hardware_of_the_table():
    assert set(SMALL_HARDWARE) | set(PAPER_HARDWARE) <= set(plan.HARDWARE)
    for spec in ENVIRONMENTS.values():
        assert spec.presets["small"].hardware == ("l4-24gb",), spec.name
        assert spec.presets["paper"].hardware == ("h100-80gb", "tpu-v5p"), spec.name
        assert plan.named_hardware(spec.name, "paper") == PAPER_HARDWARE


def test_extrapolation_is_linear_in_layers():
    lo, hi = (3, {"peak": 10.0, "temp": 4.0}), (4, {"peak": 12.5, "temp": 4.5})
    assert plan.extrapolate(lo, hi, 36) == {"peak": 12.5 + 32 * 2.5, "temp": 4.5 + 32 * 0.5}
    assert plan.extrapolate(hi, hi, 2) == {"peak": 12.5, "temp": 4.5}  # compiled at full depth


def test_a_scanned_model_is_compiled_at_full_depth_and_an_unrolled_one_extrapolated():
    from mage_jax.models.config import ModelConfig

    assert plan.compiled_depths(ModelConfig.preset("qwen3-0.6b")) == [28]  # pretrained presets scan
    assert plan.compiled_depths(ModelConfig.preset("tiny", num_layers=9)) == [3, 6]
    assert plan.compiled_depths(ModelConfig.preset("qwen3-0.6b"), (3, 6)) == [3, 6]  # --layers 3 6
    assert plan.compiled_depths(ModelConfig.preset("tiny", num_layers=4)) == [3, 4]


def test_with_layers_given_a_scanned_model_trains_at_full_depth_and_only_its_engine_extrapolates():
    from mage_jax.models.config import ModelConfig

    scanned, unrolled = ModelConfig.preset("qwen3-0.6b"), ModelConfig.preset("qwen3-0.6b", scan_layers=False)
    for name in ("train_grads", "train_apply", "logprobs"):
        assert plan.program_depths(scanned, name, [1, 2]) == [28]
        assert plan.program_depths(unrolled, name, [1, 2]) == [1, 2]
    for name in plan.ROLLOUT_PROGRAMS:  # generation runs the blocks one by one in either layout
        assert plan.program_depths(scanned, name, [1, 2]) == [1, 2]


def test_an_engine_that_reads_a_generation_copy_of_the_parameters_is_planned_beside_the_state():
    # float32 master weights computed in bfloat16 are generated from a bfloat16 copy (ModelSpec.place_state)
    # that lives beside the training state; a float32 model generates from the state's own arrays.
    same = plan.make_setup(plan.preset_config("kuhn_poker", "tiny"), 1)
    copy = plan.make_setup(plan.preset_config("kuhn_poker", "tiny", {"model.dtype": "bfloat16"}), 1)
    assert not plan.generation_copies(same) and plan.generation_copies(copy)
    assert plan.compute_param_bytes(copy) * 2 == plan.compute_param_bytes(same)  # read as bfloat16


def test_the_full_depth_compile_of_a_scanned_model_agrees_with_the_extrapolation():
    # The tiny preset at 9 scanned layers, one device: each program's bytes compiled at 9 layers against
    # the 3 + 6 layer extrapolation (docs/scaling.md records the same comparison for Kuhn Poker small).
    cfg = plan.preset_config("kuhn_poker", "tiny", {
        "model.overrides": {"num_layers": 9, "scan_layers": True, "remat": "full"}})
    rows, length = cfg.optim.mini_batch_rows, 64
    measured = {}
    for depth in (3, 6, 9):
        setup = plan.make_setup(cfg, 1, num_layers=depth)
        assert setup.model_config.scan_layers
        measured[depth] = {  # the largest program of a training iteration (activations of every block)
            "train_grads": plan.ProgramMeasure.of(plan.compile_train_grads(setup, rows, length),
                                                  "cpu").as_dict(),
        }
    for name in measured[3]:
        guess = plan.extrapolate((3, measured[3][name]), (6, measured[6][name]), 9)
        full = measured[9][name]
        assert full["argument"] > measured[3][name]["argument"]  # the depth is really there
        for key in ("argument", "output", "peak"):
            assert guess[key] == pytest.approx(full[key], rel=0.05), (name, key, guess, full)


def test_the_update_a_run_executes_needs_no_more_than_the_larger_of_the_two_halves_the_plan_sizes():
    # The plan compiles the loss-and-gradient program and the optimizer step apart (each part's need is
    # visible); the run fuses them (TrainStep.update_program). The fused program's need beyond the
    # resident state is the larger half's, so the plan's peak is the run's.
    from mage_jax import aot

    cfg = plan.preset_config("kuhn_poker", "tiny", {"model.overrides": {"num_layers": 2}})
    setup = plan.make_setup(cfg, 1, num_layers=2)
    rows, length = cfg.optim.mini_batch_rows, 64
    params, opt = plan.device_bytes(setup.params), plan.device_bytes(setup.opt_state)
    grads = plan.ProgramMeasure.of(plan.compile_train_grads(setup, rows, length), "cpu").peak - params
    apply = plan.ProgramMeasure.of(plan.compile_train_apply(setup), "cpu").peak - params - opt
    fused = plan.ProgramMeasure.of(aot.lower_train_update(setup.step, setup.params, setup.opt_state, rows,
                                                          length).compile(), "cpu")
    assert fused.flops > 0 and fused.alias >= params + opt - 1024  # the state is donated: updated in place
    assert max(grads, apply) * 0.9 <= fused.peak - params - opt <= max(grads, apply) * 1.02, (grads, apply,
                                                                                            fused)


def _synthetic_plan(*, state: float, extra: dict[str, float], devices: int = 8) -> dict:
    """A plan as ``plan_devices`` returns it, with ``extra`` bytes per program beyond the resident state
    (an engine's decode comes with its insert, which needs nothing more here)."""
    if "decode" in extra:
        extra = {"insert": 0.0, **extra}
    programs = {name: {"rows": 64, "length": 12288, "new_tokens": 256, "flops": 1e15, "model_flops": 8e14,
                       "bytes_accessed": 1e12, "ideal_bytes": 8e11, "extra": e, "need": state + e}
                for name, e in extra.items()}
    largest = max(programs, key=lambda n: programs[n]["need"])
    return {"devices": devices, "kv_cache": 30e9, "largest": largest, "peak": programs[largest]["need"],
            "state": {"total": state}, "programs": programs, "compiler": {"platform": "cpu"}}


def test_verdict_compares_the_peak_with_usable_memory_and_says_what_to_change():
    cfg = plan.preset_config("kuhn_poker", "paper")
    h100 = plan.HARDWARE["h100-80gb"]
    fits = plan.verdict(_synthetic_plan(state=8e9, extra={"train_grads": 60e9, "train_apply": 1e9,
                                                           "logprobs": 5e9, "decode": 40e9}), h100, cfg)
    assert fits["fits"] and fits["advice"] == [] and fits["headroom"] == pytest.approx(72e9 - 68e9)
    assert fits["seconds_at_peak"]["train_grads"] == pytest.approx(1e15 / 989e12)
    # The roofline: 1 PFLOP at 989 TFLOP/s against 1 TB at 3.35 TB/s: compute-bound.
    assert fits["roofline_seconds"]["train_grads"] == pytest.approx(1e15 / 989e12)
    assert fits["bound"]["train_grads"] == "compute" and fits["compiler"] == "cpu"
    assert fits["goals"]["decode_bytes_ratio"]["value"] == pytest.approx(1.25)
    assert fits["goals"]["decode_bytes_ratio"]["met"] and fits["goals"]["train_flops_ratio"]["met"]
    rollout = plan.verdict(_synthetic_plan(state=8e9, extra={"train_grads": 30e9, "train_apply": 1e9,
                                                              "logprobs": 5e9, "decode": 70e9}), h100, cfg)
    assert not rollout["fits"] and "rollout.engine_slots to 32" in rollout["advice"][0]
    assert "more devices (over by 6.0 GB per device)" in rollout["advice"][-1]
    lockstep = plan.verdict(_synthetic_plan(state=8e9, extra={"train_grads": 30e9, "train_apply": 1e9,
                                                               "logprobs": 5e9, "lockstep": 70e9}), h100, cfg)
    assert not lockstep["fits"] and "rollout.max_decode_rows to 32" in lockstep["advice"][0]
    grads = plan.verdict(_synthetic_plan(state=50e9, extra={"train_grads": 30e9, "train_apply": 1e9,
                                                             "logprobs": 5e9, "decode": 20e9}, devices=4),
                         h100, cfg)
    assert not grads["fits"] and "LoRA" in grads["advice"][0]
    assert any("optim.micro_batch_rows 4 (now 8)" in a for a in grads["advice"])  # 2 rows per device now
    one_row = plan.verdict(_synthetic_plan(state=50e9, extra={"train_grads": 30e9, "train_apply": 1e9,
                                                               "logprobs": 5e9, "decode": 20e9}), h100, cfg)
    assert not any("micro_batch_rows" in a for a in one_row["advice"])  # already 1 row per device


def test_plan_of_the_tiny_preset_end_to_end():
    proc = _run("--env", "kuhn_poker", "--preset", "tiny", "--devices", "2", "--hardware", "t4-16gb",
                "--hardware", "l4-24gb", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "compiling train_grads on 2 cpu devices" in proc.stderr  # progress while compiling
    out = json.loads(proc.stdout)
    assert out["env"] == "kuhn_poker" and out["preset"] == "tiny"
    assert (out["model"]["name"], out["model"]["family"]) == ("tiny", "qwen3")  # a folder: its own name
    assert out["layers_compiled"] == [2] and out["full_depth"] == 2
    (p,) = out["plans"]
    assert p["devices"] == 2 and p["mesh"] == {"data": 2, "fsdp": 1, "tensor": 1}
    assert set(p["programs"]) == set(plan.PROGRAMS)
    assert p["compiler"]["platform"] == "cpu" and p["hardware"] == ["t4-16gb", "l4-24gb"]
    for q in p["programs"].values():
        assert q["peak"] == q["argument"] + q["output"] - q["alias"] + q["temp"]
        assert q["need"] == p["state"]["total"] + q["peak"] - q["state_arguments"] and q["flops"] > 0
        assert q["bytes_accessed"] > 0 and isinstance(q["kernels"], dict)
    assert p["programs"]["decode"]["ideal_bytes"] >= p["kv_cache"]
    assert p["peak"] == max(q["need"] for q in p["programs"].values())
    # KV cache: 2 (keys, values) x layers x rows per device x kv heads x head dim x slots x 4 bytes
    # (float32 activations); the tiny preset: 2 layers, 2 kv heads of 16, rows over the 2 devices.
    # The rollout is the engine's (the default): its slots' cache, as many rows as the engine has slots.
    r = p["programs"]["decode"]
    assert r["rows"] == 64  # min(the largest rollout, 64) slots
    # An insert prefills the rows of its one program: DEFAULT_INSERT_ROWS targets per device block.
    assert p["programs"]["insert"]["rows"] == DEFAULT_INSERT_ROWS * 2
    assert p["kv_cache"] == 2 * 2 * (r["rows"] // 2) * 2 * 16 * (r["prompt"] + r["new_tokens"]) * 4
    for name in ("insert", "decode"):  # the slots' cache is an argument of both engine programs
        assert p["programs"][name]["argument"] >= p["kv_cache"]
    params = out["model"]["params"]
    assert p["state"]["params"] == params * 4  # float32, replicated over the data axis
    assert p["state"]["opt_state"] >= 2 * p["state"]["params"]  # AdamW's two moments
    assert [(v["hardware"], v["fits"]) for v in out["verdicts"]] == [("t4-16gb", True), ("l4-24gb", True)]
    for v in out["verdicts"]:  # predictions: rooflines of the compiler's figures at the hardware's rates
        hw = plan.HARDWARE[v["hardware"]]
        for name, q in p["programs"].items():
            roofline = max(q["flops"] / hw.bf16_flops, q["bytes_accessed"] / hw.bandwidth)
            assert v["roofline_seconds"][name] == roofline
        assert v["iteration_seconds"] == sum(v["iteration_counts"][n] * v["roofline_seconds"][n]
                                             for n in p["programs"])
        assert set(v["goals"]) == set(plan.GOALS) and v["goals"]["train_flops_ratio"]["value"] > 0


PRETRAINED = ("small", "small-lora", "paper")
SWEEP = textwrap.dedent("""
    import json, sys
    from experiments import plan
    plan.force_cpu_devices(8)
    pairs = [(env, preset) for env in json.loads(sys.argv[1]) for preset in json.loads(sys.argv[2])]
    plans = plan.plan_presets(pairs, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(plan.summary_table(plans), file=sys.stderr)
    print("RESULT " + json.dumps(plans))
""")


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("MAGE_PLAN_PRESETS") != "1",
                    reason="tens of minutes of compiles; set MAGE_PLAN_PRESETS=1")
def test_every_pretrained_preset_fits_its_named_hardware():
    env = dict(os.environ, PYTHONPATH=ROOT)
    args = [json.dumps(sorted(ENVIRONMENTS)), json.dumps(PRETRAINED)]
    proc = subprocess.run([sys.executable, "-c", SWEEP, *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=4 * 3600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plans = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert len(plans) == len(PRETRAINED) * len(ENVIRONMENTS)
    for p in plans:
        named = plan.named_hardware(p["env"], p["preset"])
        assert [v["hardware"] for v in p["verdicts"]] == list(named)
        for v in p["verdicts"]:
            assert v["fits"], (p["env"], p["preset"], v)
