"""The experiment config: typed overrides, validation with one clear line, JSON round trip, CLI."""

from __future__ import annotations

import dataclasses
import json
import os
import re

import pytest

from experiments.common import Preset, parse_command_line, run_cli, split_dotted
from mage_jax import config as C


def cfg_with(**overrides):
    return C.apply_overrides(C.ExperimentConfig(), {k.replace("__", "."): v for k, v in overrides.items()})


def test_defaults_are_the_paper_kuhn_settings():
    cfg = C.ExperimentConfig()
    assert (cfg.rollout.num_tasks, cfg.rollout.group_size, cfg.rollout.num_episodes) == (16, 8, 3)
    train = cfg.sampling.train
    assert (train.temperature, train.top_p, train.top_k) == (1.0, 1.0, 0)
    assert (cfg.sampling.eval.temperature, cfg.sampling.eval.top_p, cfg.sampling.eval.top_k) == (0.7, 0.8, 20)
    assert (cfg.optim.grad_clip, cfg.optim.mini_batch_rows, cfg.optim.epochs) == (1.0, 64, 1)
    assert (cfg.optim.clip_eps, cfg.optim.dual_clip, cfg.optim.entropy_coef) == (0.2, 3.0, 0.001)
    assert cfg.env.opponent_ratios == (0.3, 0.3, 0.4)
    assert (cfg.algorithm.invalid_penalty, cfg.algorithm.length_penalty) == (2.0, 2.0)


def test_the_reflection_limit_falls_back_to_the_play_limit_and_the_longer_bounds_generation():
    assert (cfg_with(rollout__max_response_tokens=40).rollout.reflection_tokens,
            cfg_with(rollout__max_response_tokens=40).rollout.max_new_tokens) == (40, 40)
    longer = cfg_with(rollout__max_response_tokens=40, rollout__max_reflection_tokens=100).rollout
    shorter = cfg_with(rollout__max_response_tokens=40, rollout__max_reflection_tokens=10).rollout
    assert (longer.reflection_tokens, longer.max_new_tokens) == (100, 100)
    assert (shorter.reflection_tokens, shorter.max_new_tokens) == (10, 40)


def test_string_overrides_are_parsed_by_field_type():
    cfg = cfg_with(optim__lr="1e-3", rollout__reflect="false", rollout__batch_size="none",
                   env__opponents="a,b", env__opponent_ratios="[0.5, 0.5]",
                   model__overrides='{"num_layers": 2}', train__iterations="7")
    assert cfg.optim.lr == 1e-3 and isinstance(cfg.optim.lr, float)
    assert cfg.rollout.reflect is False
    assert cfg.rollout.batch_size is None
    assert cfg.env.opponents == ("a", "b") and cfg.env.opponent_ratios == (0.5, 0.5)
    assert cfg.model.overrides == {"num_layers": 2}
    assert cfg.train.iterations == 7


def test_one_entry_of_model_overrides_is_set_and_the_others_kept():
    """``model.overrides.KEY=VALUE`` changes one entry (a preset's ``remat`` survives turning the scan
    off); ``model.overrides={...}`` still replaces the whole dict."""
    cfg = C.apply_overrides(C.ExperimentConfig(), {"model.overrides": '{"remat": "full", "num_layers": 2}'})
    cfg = C.apply_overrides(cfg, {"model.overrides.scan_layers": "false", "model.overrides.num_layers": "4",
                                  "model.overrides.attention": "blockwise"})
    assert cfg.model.overrides == {"remat": "full", "num_layers": 4, "scan_layers": False,
                                   "attention": "blockwise"}
    whole = C.apply_overrides(cfg, {"model.overrides": '{"num_layers": 3}'})
    assert whole.model.overrides == {"num_layers": 3}
    with pytest.raises(C.ConfigError, match=r"unknown config key 'model\.lora_rank\.x'"):
        C.apply_overrides(cfg, {"model.lora_rank.x": "1"})  # not a dict: still no such key


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        ({"optim.lrr": "1"}, "unknown config key 'optim.lrr'"),
        ({"nope.lr": "1"}, "unknown config key 'nope.lr'"),
        ({"optim.lr": "fast"}, "optim.lr: expected float"),
        ({"train.iterations": "2.5"}, "train.iterations: expected int"),
        ({"rollout.reflect": "maybe"}, "rollout.reflect: expected bool"),
        ({"optim": "1"}, "optim is a section"),
        ({"rollout.memory_mode": "everything"}, "rollout.memory_mode must be one of reflection_only, "),
        ({"optim.kl_kind": "k9"}, "optim.kl_kind must be one of k1, kl, k2, mse, k3, low_var_kl (got 'k9')"),
    ],
)
def test_bad_override_is_one_clear_error(overrides, fragment):
    with pytest.raises(C.ConfigError) as err:
        C.apply_overrides(C.ExperimentConfig(), overrides)
    assert fragment in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        ({"optim.lr": -1e-3}, "optim.lr must be > 0"),
        ({"rollout.batch_size": 100}, "rollout.group_size 8 does not divide rollout.batch_size 100"),
        ({"rollout.batch_size": 64}, "rollout.batch_size 64 != rollout.num_tasks * rollout.group_size"),
        ({"env.opponent_ratios": [0.5, 0.6, 0.1]}, "must sum to 1"),
        ({"env.opponent_ratios": [0.5, 0.5]}, "differ in length"),
        ({"rollout.reflect": False}, "needs reflections"),
        ({"rollout.memory_mode": "none"}, "rollout.memory_mode=none shows no reflections"),
        ({"rollout.reflection_words": "bets,King", "rollout.memory_mode": "history_only",
          "rollout.reflect": False},
         "rollout.reflection_words constrain reflections; set rollout.reflect=true"),
        ({"rollout.reflection_words": "bets,King", "tokenizer.kind": "hf", "tokenizer.path": "/tmp"},
         "rollout.reflection_words needs tokenizer.kind=word_level"),
        ({"rollout.reflection_words": "bets,don't,<remark>,1a"},
         "single words of letters or digits, one token each (got \"don't\", '<remark>', '1a')"),
        ({"rollout.reflection_words": "bets,bets"}, "rollout.reflection_words must be distinct"),
        ({"rollout.reflection_words": "bets", "rollout.reflection_max_words": 0},
         "rollout.reflection_max_words must be >= 1"),
        ({"rollout.reflection_words": "bets", "rollout.max_reflection_tokens": 5},
         "rollout.max_reflection_tokens 5 is too short"),
        ({"algorithm.estimator": "ppo2"}, "algorithm.estimator must be one of"),
        ({"optim.dual_clip": 0.5}, "optim.dual_clip must be > 1"),
        ({"sampling.eval.top_p": 0.0}, "sampling.eval.top_p"),
        ({"checkpoint.keep": 0}, "checkpoint.keep must be >= 1"),
        ({"model.path": "/does/not/exist"}, "model.path '/does/not/exist' is not a folder"),
        ({"model.lora_rank": -2}, "model.lora_rank must be >= 0 (got -2)"),
        ({"model.lora_rank": 8, "model.lora_alpha": 0.0}, "model.lora_alpha must be > 0"),
        ({"model.lora_rank": 8, "model.lora_targets": "q_proj,lm_head"},
         "model.lora_targets must be a non-empty list of q_proj, k_proj"),
        ({"model.lora_rank": 8, "model.lora_targets": ""}, "model.lora_targets must be a non-empty list"),
    ],
)
def test_impossible_values_fail_validation(overrides, fragment):
    base = {"tokenizer.kind": "word_level"}
    cfg = C.apply_overrides(C.ExperimentConfig(), {**base, **overrides})
    with pytest.raises(C.ConfigError) as err:
        C.validate(cfg)
    assert fragment in str(err.value)
    assert "\n" not in str(err.value)


def test_matching_batch_size_is_accepted():
    C.validate(cfg_with(rollout__batch_size=128, tokenizer__kind="word_level"))


def test_saved_config_loads_back_equal(tmp_path):
    cfg = cfg_with(optim__lr=3e-4, env__opponents=["x"], env__opponent_ratios=[1.0],
                   model__overrides={"hidden_size": 32})
    path = C.save(cfg, str(tmp_path))
    with open(path) as f:
        assert json.load(f)["optim"]["lr"] == 3e-4
    assert C.load(str(tmp_path)) == cfg


def test_loading_a_config_with_an_unknown_key_fails(tmp_path):
    data = C.to_dict(C.ExperimentConfig())
    data["optim"]["learning_rate"] = 1.0
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(C.ConfigError, match="unknown config key 'optim.learning_rate'"):
        C.load(str(tmp_path))


PRESETS = {"p": Preset({"tokenizer.kind": "word_level", "optim.lr": 1e-3}, "test"),
           "needs": Preset({"tokenizer.kind": "hf"}, "pretrained", needs_model_path=True)}


def parse(argv, tmp_path):
    return parse_command_line(["--run-dir", str(tmp_path / "run"), *argv], experiment="x", presets=PRESETS,
                              default_preset="p")


def test_cli_accepts_set_and_dotted_flags_in_both_forms(tmp_path):
    cfg, opts = parse(["--set", "optim.lr=2e-3", "--train.iterations", "4", "--optim.b1=0.8"], tmp_path)
    assert (cfg.optim.lr, cfg.train.iterations, cfg.optim.b1) == (2e-3, 4, 0.8)
    assert cfg.logging.run_dir == opts.run_dir == str(tmp_path / "run")
    assert split_dotted(["--a.b", "-1", "--resume"]) == ([("a.b", "-1")], ["--resume"])


def test_cli_preset_needing_a_model_folder_says_so(tmp_path):
    with pytest.raises(C.ConfigError, match="--model-path"):
        parse(["--preset", "needs"], tmp_path)


def test_cli_bad_config_prints_one_line_exits_nonzero_and_writes_nothing(tmp_path, capsys):
    def never(cfg, options):
        raise AssertionError("must not run")

    code = run_cli(["--run-dir", str(tmp_path / "run"), "--optim.lr", "-0.1"], never, experiment="x",
                   presets=PRESETS, default_preset="p")
    err = capsys.readouterr().err.strip()
    assert code != 0
    assert err == "error: optim.lr must be > 0 (got -0.1)"
    assert not os.path.exists(tmp_path / "run")


def test_cli_refuses_to_overwrite_a_run_without_resume(tmp_path):
    os.makedirs(tmp_path / "run")
    C.save(C.ExperimentConfig(), str(tmp_path / "run"))
    with pytest.raises(C.ConfigError, match="--resume"):
        parse([], tmp_path)


def test_a_choice_set_without_parsing_still_fails_validation():
    """Choice fields are Literal types: ``validate`` checks them even when code bypasses the parser."""
    cfg = C.apply_overrides(C.ExperimentConfig(), {"tokenizer.kind": "word_level"})
    bad = dataclasses.replace(cfg, env=dataclasses.replace(cfg.env, seats="both"))
    message = r"^env.seats must be one of first, second, mixed \(got 'both'\)$"
    with pytest.raises(C.ConfigError, match=message):
        C.validate(bad)


@pytest.mark.parametrize("key, hint", [
    ("train.lr", "optim.lr"),  # the name exists in one other section
    ("train.top_p", "sampling.train.top_p"),  # in two: the closer one
    ("eval.top_p", "sampling.eval.top_p"),
    ("optim.lrr", "optim.lr"),  # a misspelling
])
def test_an_unknown_key_names_the_known_key_it_most_likely_meant(key, hint):
    with pytest.raises(C.ConfigError, match=rf"; did you mean '{re.escape(hint)}'\?$"):
        C.apply_overrides(C.ExperimentConfig(name="kuhn_poker"), {key: "0.5"})
