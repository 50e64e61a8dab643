"""The main job end to end through ``experiments.kuhn_poker.main``: train, evaluate, checkpoint,
resume (bit-identical metrics on CPU), SIGTERM, evaluation-only entry point, clear config errors."""

from __future__ import annotations

import json
import os
import signal
import time
import types

import jax
import pytest

from experiments import evaluate, kuhn_poker
from experiments.common import EXIT_INTERRUPTED, EXIT_TRAINING_STOPPED
from mage_jax import config as C
from mage_jax.evaluation.report import results_table
from mage_jax.logging import read_jsonl
from mage_jax.rollout.meta_episode import MetaEpisodeRunner
from mage_jax.rollout.policy import LLMPolicy
from mage_jax.training import signals as signals_module
from mage_jax.training import trainer as trainer_module
from tests.experiments.conftest import comparable, sigterm_after_iteration
from tests.training.test_checkpoint import flip_bytes

RUN = {"train.iterations": 3, "checkpoint.every": 1, "checkpoint.keep": 2}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, request):
    """One uninterrupted 3-iteration smoke run of the main job (plots on)."""
    request.getfixturevalue("compilation_cache")
    from mage_jax.testing import smoke_args

    run_dir = tmp_path_factory.mktemp("kuhn") / "run"
    args = smoke_args({**RUN, "logging.plots": True})
    jax.clear_caches()  # the compile report counts this run's programs, not what earlier tests left in memory
    code = kuhn_poker.main([*args, "--run-dir", str(run_dir)])
    return code, run_dir, args


@pytest.mark.slow
def test_main_job_writes_a_complete_run_directory(finished_run, capsys):
    code, run_dir, _ = finished_run
    assert code == 0
    cfg = C.load(str(run_dir))
    assert cfg.rollout.memory_mode == "history_only" and cfg.rollout.reflect is False
    assert cfg.rollout.constrained_actions and cfg.tokenizer.kind == "word_level"
    assert os.path.isfile(run_dir / "tokenizer" / "tokenizer.json")
    records = read_jsonl(str(run_dir))
    assert [r["iteration"] for r in records if r["split"] == "train"] == [1, 2, 3]
    assert {r["split"] for r in records} == {"train", "validation", "eval", "heldout"}
    train = [r for r in records if r["split"] == "train"][-1]
    for key in ("policy_loss", "clip_fraction", "approx_kl", "kl_loss", "entropy", "grad_norm", "lr",
                "skipped", "success@1", "payoff@1", "success@2", "payoff@2", "entropy_play@1",
                "valid_action_ratio", "reward_mean"):
        assert key in train
    assert not {k for r in records for k in r if k.endswith("@0")}  # episodes count from 1 (N = 2: @1, @2)
    assert train["valid_action_ratio"] == 1.0  # constrained decoding: every action is legal
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["2", "3"]
    summary = json.loads((run_dir / "summary.json").read_text())
    ref = summary["evaluation"]["eval"]["reference"]
    assert 0 < ref["winnable"] <= 1 and len(ref["best_fixed_payoff"]) == 2
    assert summary["evaluation"]["heldout"]["metrics"]["by_opponent"].keys() == {"cfr"}
    assert summary["skipped_updates"] == sum(r["skipped"] for r in records if r["split"] == "train") == 0
    assert {"eval_success.png", "eval_payoff.png", "heldout_success.png", "training.png",
            "diagnostics.png"} <= set(
        os.listdir(run_dir / "plots"))
    table = results_table(summary, kuhn_poker.SPEC.titles)
    assert "held-out CFR opponent" in table and "ceiling" in table
    # The compile report: programs of each iteration in its record, the whole run's in the summary.
    compiled = summary["compile"]
    assert compiled["programs"] > 0 and compiled["seconds"] > 0 and 0 <= compiled["cache_hits"] <= compiled[
        "programs"]
    per_iteration = [r["compile/programs"] for r in records if r["split"] == "train"]
    assert 0 < sum(per_iteration) <= compiled["programs"]
    assert f"compiled {compiled['programs']} XLA programs" in table


def test_resumed_run_reproduces_the_uninterrupted_metrics(finished_run, tmp_path, monkeypatch):
    _, reference_dir, args = finished_run
    run_dir = tmp_path / "run"
    sigterm_after_iteration(monkeypatch, 2)
    assert kuhn_poker.main([*args, "--run-dir", str(run_dir)]) == EXIT_INTERRUPTED
    assert not (run_dir / "summary.json").exists()
    assert [r["iteration"] for r in read_jsonl(str(run_dir))] == [1, 2]
    monkeypatch.undo()
    assert kuhn_poker.main(["--run-dir", str(run_dir), "--resume"]) == 0
    assert comparable(run_dir) == comparable(reference_dir)



def test_resume_falls_back_past_a_damaged_newest_checkpoint_and_finishes_identically(
        finished_run, tmp_path, monkeypatch, capsys):
    """64 flipped bytes in the newest step's parameter data: resume warns in one line, restores the
    older step, retrains from there and ends with the uninterrupted run's metrics."""
    _, reference_dir, args = finished_run
    run_dir = tmp_path / "run"
    sigterm_after_iteration(monkeypatch, 2)
    assert kuhn_poker.main([*args, "--run-dir", str(run_dir)]) == EXIT_INTERRUPTED
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["1", "2"]
    flip_bytes(run_dir / "checkpoints" / "2")
    monkeypatch.undo()
    capsys.readouterr()
    assert kuhn_poker.main(["--run-dir", str(run_dir), "--resume"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "step 2" in warnings[0] and "restored step 1" in warnings[0]
    assert comparable(run_dir) == comparable(reference_dir)

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_a_rollout_saves_promptly_exits_75_and_resumes_identically(
        finished_run, tmp_path, monkeypatch, capsys, sig):
    """SIGTERM or Ctrl-C as iteration 2's rollout starts: no further turn is generated (the smoke
    rollout is one turn, so the signal lands just before it), iteration 1's state is saved
    (checkpoint.every=0: nothing was on disk), the resume command is printed, the exit status is 75;
    the resumed run writes the uninterrupted run's metrics."""
    _, reference_dir, args = finished_run
    run_dir = tmp_path / "run"
    original_iteration, original_generate = trainer_module.Trainer.train_iteration, LLMPolicy.generate
    seen = {"sent": None, "turns_after": 0}

    def train_iteration(self, iteration):
        if iteration == 2:
            seen["sent"] = time.perf_counter()
            os.kill(os.getpid(), sig)
        return original_iteration(self, iteration)

    def generate(self, requests):
        if seen["sent"] is not None:
            seen["turns_after"] += 1
        return original_generate(self, requests)

    monkeypatch.setattr(trainer_module.Trainer, "train_iteration", train_iteration)
    monkeypatch.setattr(LLMPolicy, "generate", generate)
    capsys.readouterr()
    argv = [*args, "--set", "checkpoint.every=0", "--run-dir", str(run_dir)]
    assert kuhn_poker.main(argv) == EXIT_INTERRUPTED
    seconds = time.perf_counter() - seen["sent"]
    assert seen["turns_after"] == 0, seen  # the rollout stopped at the next turn
    assert seconds < 20, seconds  # the rest of iteration 2 (a whole rollout and update) is not waited for
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["1"]
    assert [r["iteration"] for r in read_jsonl(str(run_dir))] == [1]
    err = capsys.readouterr().err
    assert f"python -m experiments.kuhn_poker --run-dir {run_dir} --resume" in err
    monkeypatch.undo()
    assert kuhn_poker.main(["--run-dir", str(run_dir), "--resume"]) == 0
    assert comparable(run_dir) == comparable(reference_dir)


def test_a_second_ctrl_c_exits_at_once_without_saving(monkeypatch, capsys):
    exits = []
    monkeypatch.setattr(signals_module.os, "_exit", exits.append)
    trainer = types.SimpleNamespace(_stop=trainer_module.threading.Event())
    before = signal.getsignal(signal.SIGINT)
    restore = trainer_module.Trainer._install_signals(trainer)
    try:
        signal.raise_signal(signal.SIGINT)
        assert trainer._stop.is_set() and exits == []
        signal.raise_signal(signal.SIGINT)
    finally:
        restore()
    assert exits == [signals_module.EXIT_SECOND_INTERRUPT] == [130]
    assert "exiting now without saving" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGINT) is before  # the handler the run found is back


def test_updates_that_keep_being_skipped_stop_the_run_with_one_line_and_save_nothing(tmp_path, capsys,
                                                                                     smoke_args):
    """lr=1e30: every update is ~1e31 times the parameters' size, far over optim.max_update_ratio, so
    none is applied (the parameters stay finite and sampleable); two skips in a row stop the run (exit 3)
    before any checkpoint is written."""
    run_dir = tmp_path / "run"
    argv = [*smoke_args({**RUN, "optim.lr": 1e30, "optim.epochs": 3, "optim.max_skipped_updates": 2}),
            "--run-dir", str(run_dir)]
    capsys.readouterr()
    assert kuhn_poker.main(argv) == EXIT_TRAINING_STOPPED
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: 3 consecutive updates were skipped by iteration 1 (non-finite loss, gradients or "
                   "parameters, or larger than optim.max_update_ratio=1 times the parameters; optim."
                   "max_skipped_updates=2): lower optim.lr or check the inputs; no checkpoint was saved"]
    records = read_jsonl(str(run_dir))
    assert [(r["iteration"], r["updates"], r["skipped"]) for r in records] == [(1, 3, 3)]
    assert records[0]["update_ratio"] > 1e25
    assert not os.listdir(run_dir / "checkpoints") and not (run_dir / "summary.json").exists()


@pytest.mark.parametrize(
    "overrides, code, message",
    [
        ({"rollout.max_response_tokens": 1}, EXIT_TRAINING_STOPPED,
         "error: every one of the 48 rows of iteration 1 is invalid (48 truncated at "
         "rollout.max_response_tokens=1, 0 over rollout.max_prompt_tokens=512"),
        ({"rollout.max_response_tokens": 1, "rollout.constrained_actions": False}, EXIT_TRAINING_STOPPED,
         "error: every one of the 48 rows of iteration 1 is invalid ("),  # some rows end at once, untruncated
        ({"rollout.max_prompt_tokens": 16}, 2,
         "error: every prompt is longer than rollout.max_prompt_tokens=16 even without memory"),
    ],
)
def test_a_run_that_would_train_on_nothing_is_refused_or_stopped_with_one_line(tmp_path, capsys, smoke_args,
                                                                                overrides, code, message):
    capsys.readouterr()
    run_dir = tmp_path / "run"
    assert kuhn_poker.main([*smoke_args(overrides), "--run-dir", str(run_dir)]) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(message), err
    if code == EXIT_TRAINING_STOPPED:  # the stop suggests the fixes and shows what the model wrote first
        samples_file = run_dir / "samples.jsonl"
        constrained = "try " if overrides.get("rollout.constrained_actions", True) else (
            "try --rollout.constrained_actions true or ")
        assert (f"the rest unparsable): nothing to train on; {constrained}a longer "
                f"--rollout.max_response_tokens (now 1); what the model wrote is in {samples_file}; "
                "no checkpoint was saved") in err[0]
        samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
        assert samples and {(s["split"], s["iteration"]) for s in samples} == {("train", 1)}


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_stops_an_evaluation_at_its_next_turn_with_one_line_and_no_traceback(
        finished_run, tmp_path, monkeypatch, capsys, sig):
    """The signal lands as the evaluation's first rollout starts: it stops there (exit 75), says what the
    output folder holds in one line, writes no results and puts the handlers it found back."""
    _, run_dir, _ = finished_run
    out = tmp_path / "eval"
    original_run, rollouts = MetaEpisodeRunner.run, []

    def run(self, tasks, policy, **kwargs):
        rollouts.append(len(tasks))
        os.kill(os.getpid(), sig)
        return original_run(self, tasks, policy, **kwargs)

    monkeypatch.setattr(MetaEpisodeRunner, "run", run)
    before = signal.getsignal(signal.SIGINT)
    capsys.readouterr()
    argv = ["--checkpoint", str(run_dir), "--out", str(out), "--set", "logging.plots=false"]
    assert evaluate.main(argv) == EXIT_INTERRUPTED
    assert len(rollouts) == 1  # no later split or chunk was started
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"interrupted: the evaluation stopped before it finished; {out} holds its config.json and "
                   "experiment.json but no results (run the command again to evaluate)"]
    assert {"config.json", "experiment.json"} <= set(os.listdir(out))
    assert not (out / "summary.json").exists() and not (out / "metrics.jsonl").exists()
    assert signal.getsignal(signal.SIGINT) is before  # the handlers the command found are back


def test_evaluation_entry_point_scores_a_checkpoint(finished_run, tmp_path):
    _, run_dir, _ = finished_run
    out = tmp_path / "eval"
    argv = ["--checkpoint", str(run_dir), "--out", str(out), "--set", "logging.plots=false"]
    assert evaluate.main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    final = json.loads((run_dir / "summary.json").read_text())
    assert summary["iterations"] == 3
    # the same parameters, instances and sampling key: the numbers of the run's final evaluation
    curves = summary["evaluation"]["eval"]["metrics"]["curves"]
    assert curves == final["evaluation"]["eval"]["metrics"]["curves"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--optim.lr", "-1"], "error: optim.lr must be > 0 (got -1.0)"),
        (["--optim.lr", "inf"], "error: optim.lr must be a finite number (got inf)"),
        (["--set", "rollout.batch_size=30"],
         "error: rollout.group_size 4 does not divide rollout.batch_size 30"),
        (["--optim.lrr", "1"], "error: unknown config key 'optim.lrr'"),
        (["--train.seed", "-1"], "error: train.seed must be an integer in [0, 2**32) (got -1)"),
        (["--train.seed", str(2**32)], "error: train.seed must be an integer in [0, 2**32)"),  # JAX: seed 0
        (["--checkpoint.dir", "/dev/null/ckpt"],
         "error: checkpoint.dir '/dev/null/ckpt' cannot be created: '/dev/null' is a file"),
        (["--checkpoint.dir", "/dev/null"], "error: checkpoint.dir '/dev/null' is a file, not a folder"),
        (["--checkpoint.dir", "/proc/ckpt"], "error: checkpoint.dir '/proc/ckpt' cannot be"),  # used, written
        (["--preset", "small"], "error: preset 'small' loads a pretrained model"),
        (["--preset", "paper", "--model-path", "/nonexistent/qwen"], "error: model.path '/nonexistent/qwen'"),
    ],
)
def test_bad_config_is_one_error_line_nonzero_exit_and_nothing_written(tmp_path, capsys, argv, message):
    run_dir = tmp_path / "run"
    assert kuhn_poker.main([*argv, "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(message)
    assert not run_dir.exists()


def test_a_key_in_the_wrong_section_is_one_line_naming_the_right_one(tmp_path, capsys):
    assert kuhn_poker.main(["--set", "train.lr=1e-3", "--run-dir", str(tmp_path / "run")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: unknown config key 'train.lr'")
    assert line.endswith("did you mean 'optim.lr'?")
    assert not (tmp_path / "run").exists()


def test_a_model_folder_with_nan_weights_is_one_error_line_naming_the_tensor(tiny_hf_model, tmp_path, capsys,
                                                                            smoke_args):
    import shutil

    from safetensors.numpy import load_file, save_file

    folder = tmp_path / "nan_model"
    shutil.copytree(tiny_hf_model, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.layers.0.mlp.up_proj.weight"][0, 0] = float("nan")
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    argv = [*smoke_args(), "--preset", "small", "--model-path", str(folder),
            "--run-dir", str(tmp_path / "run")]
    assert kuhn_poker.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("error: model: tensor 'model.layers.0.mlp.up_proj.weight'")
    assert "non-finite" in err[0]
