"""The method registry of Table 1: what each method changes, how it is evaluated, and one tiny run of
a single-episode RL baseline and of a zero-shot baseline."""

from __future__ import annotations

import json

import pytest

from experiments import baselines, evaluate
from experiments.baselines import METHODS, PAPER_TABLE1, method_config
from mage_jax import config as C


def test_registry_holds_the_six_methods_of_table1():
    assert list(METHODS) == ["mage", "lamer", "gigpo", "grpo", "react", "reflexion"]
    assert set(PAPER_TABLE1) == set(METHODS)
    assert PAPER_TABLE1["mage"]["tic_tac_toe"] == 0.672 and PAPER_TABLE1["lamer"]["kuhn_poker"] == 0.594


@pytest.mark.parametrize("env", ["kuhn_poker", "tic_tac_toe", "sokoban"])
def test_mage_and_lamer_differ_only_in_the_meta_reward(env):
    mage, lamer = method_config(env, "mage"), method_config(env, "lamer")
    assert (mage.algorithm.reward, lamer.algorithm.reward) == ("differential", "cumulative")
    assert mage.algorithm.estimator == lamer.algorithm.estimator == "gigpo"
    strip = lambda c: {k: v for k, v in C.to_dict(c).items() if k not in ("algorithm", "name")}  # noqa: E731
    assert strip(mage) == strip(lamer)


@pytest.mark.parametrize("name, estimator", [("gigpo", "gigpo"), ("grpo", "grpo")])
def test_single_episode_rl_baselines_train_one_episode_with_group_24_and_attempt_independently(
    name, estimator
):
    cfg = method_config("tic_tac_toe", name)
    assert cfg.rollout.num_episodes == 1 and cfg.rollout.group_size == 24
    assert cfg.algorithm.estimator == estimator and cfg.algorithm.reward == "single_episode"
    assert cfg.train.eval_num_episodes == 3
    assert METHODS[name].eval_mode == "independent" and METHODS[name].trains


def test_react_and_reflexion_only_evaluate_the_initial_model():
    for name, mode in (("react", "independent"), ("reflexion", "meta")):
        assert not METHODS[name].trains and METHODS[name].eval_mode == mode
        assert method_config("kuhn_poker", name).train.iterations == 0


def test_command_line_overrides_come_after_the_method(tmp_path):
    cfg = method_config("kuhn_poker", "grpo", "tiny", {"rollout.group_size": 4})
    assert cfg.rollout.group_size == 4 and cfg.rollout.num_episodes == 1


def test_unknown_method_or_environment_is_one_error_line(capsys):
    assert baselines.main(["--method", "ppo"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: unknown method 'ppo'; known: mage, lamer, gigpo, grpo, react, reflexion"
    )
    assert baselines.main(["--env", "go"]) == 2
    assert capsys.readouterr().err.startswith("error: unknown environment 'go'")


def test_pretrained_baseline_without_a_model_folder_is_one_error_line(capsys):
    assert baselines.main(["--env", "alfworld", "--method", "reflexion", "--preset", "paper"]) == 2
    assert "--model-path" in capsys.readouterr().err


def test_grpo_baseline_trains_and_is_evaluated_over_independent_attempts(
    tmp_path, compilation_cache, smoke_args
):
    run_dir = tmp_path / "grpo"
    argv = ["--env", "kuhn_poker", "--method", "grpo", "--run-dir", str(run_dir)]
    argv += smoke_args({"rollout.num_episodes": 1})
    assert baselines.main(argv) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert json.loads((run_dir / "experiment.json").read_text())["eval_mode"] == "independent"
    config = json.loads((run_dir / "config.json").read_text())
    assert config["rollout"]["num_episodes"] == 1 and config["algorithm"]["estimator"] == "grpo"
    metrics = summary["evaluation"]["eval"]["metrics"]
    assert metrics["num_episodes"] == 2 and summary["iterations"] == 1
    assert summary["evaluation"]["eval"]["reference"]["winnable"] >= 0


def test_react_baseline_evaluates_without_training_or_checkpoint(tmp_path, compilation_cache, smoke_args):
    run_dir = tmp_path / "react"
    argv = ["--env", "kuhn_poker", "--method", "react", "--run-dir", str(run_dir), *smoke_args()]
    assert baselines.main(argv) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["iterations"] == 0 and set(summary["evaluation"]) == {"eval", "heldout"}
    assert not (run_dir / "checkpoints").exists()


def test_a_model_folder_is_evaluated_zero_shot_from_the_command_line_with_the_small_cpu_recipe(
    tiny_hf_model, compilation_cache, tmp_path, capsys
):
    """``experiments.evaluate --model-path``: the recipe's command (docs/results.md) on a tiny random folder;
    the real model's zero-shot evaluation runs in ``test_small_cpu.py`` (through the notebook)."""
    out = tmp_path / "eval"
    argv = ["--model-path", tiny_hf_model, "--env", "kuhn_poker", "--method", "reflexion",
            "--preset", "small-cpu", "--out-dir", str(out)]
    for setting in ("train.eval_meta_episodes=2", "train.eval_num_episodes=2", "logging.progress=false",
                    "logging.plots=false"):
        argv += ["--set", setting]
    assert evaluate.main(argv) == 0
    assert "training pool" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["model"]["path"] == tiny_hf_model and config["rollout"]["constrained_actions"]
    metrics = json.loads((out / "summary.json").read_text())["evaluation"]["eval"]["metrics"]
    assert metrics["num_meta_episodes"] == 2 and metrics["valid_action_ratio"] == 1.0
