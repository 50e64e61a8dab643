"""Every experiment module and preset parses and builds its configuration; pretrained presets need a
local model folder and say so in one line."""

from __future__ import annotations

import importlib
import json

import pytest

from experiments import presets
from experiments.common import parse_command_line
from experiments.environments import ENVIRONMENTS, environment
from mage_jax import config as C
from mage_jax.training.assemble import env_options, make_task_sampler

ENVS = tuple(ENVIRONMENTS)
MODULES = (
    "experiments.kuhn_poker",
    "experiments.tic_tac_toe",
    "experiments.sokoban",
    "experiments.minesweeper",
    "experiments.alfworld",
    "experiments.webshop",
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A folder that passes the config's path checks (config.json); no weights are loaded here."""
    path = tmp_path_factory.mktemp("fake_model")
    (path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    return str(path)


def test_a_model_folder_replaces_the_presets_model_name_in_the_resolved_config(model_dir):
    cfg = environment("kuhn_poker").config("small", {"model.path": model_dir})
    assert cfg.model.preset is None and cfg.model.path == model_dir
    assert C.to_dict(cfg)["model"]["preset"] is None  # config.json no longer says qwen3-0.6b
    assert environment("kuhn_poker").config("tiny").model.preset == "tiny"


@pytest.mark.parametrize("env", ENVS)
def test_every_environment_has_the_three_scales(env):
    assert set(environment(env).presets) >= {"tiny", "small", "paper"}


@pytest.mark.parametrize("env", ENVS)
def test_tiny_preset_is_a_from_scratch_cpu_config(env):
    cfg = environment(env).config("tiny")
    assert cfg.env.name == env
    assert cfg.model.path is None and cfg.tokenizer.kind == "word_level"
    assert cfg.algorithm.reward == "differential" and cfg.algorithm.estimator == "gigpo"
    assert cfg.rollout.num_episodes == 3


@pytest.mark.parametrize("env", ENVS)
def test_every_environment_has_a_lora_variant_of_small_for_one_16gb_gpu(env, model_dir):
    cfg = environment(env).config("small-lora", {"model.path": model_dir})
    small = environment(env).config("small", {"model.path": model_dir})
    assert (cfg.model.lora_rank, cfg.model.preset, cfg.model.dtype) == (16, small.model.preset, "bfloat16")
    assert cfg.model.overrides["param_dtype"] == "bfloat16" and cfg.model.overrides["remat"] == "full"
    assert cfg.rollout.num_tasks * cfg.rollout.group_size < small.rollout.num_tasks * small.rollout.group_size
    assert "t4-16gb" in presets.small_lora_overrides.__doc__


@pytest.mark.parametrize("env", ENVS)
def test_every_environment_has_a_cpu_recipe_for_small_real_models(env, model_dir):
    """``small-cpu``: every play row a legal action, no thinking, short reflections and prompts in few
    buckets, a few engine slots, float32 LoRA, 32 evaluation meta-episodes (docs/results.md measures it)."""
    cfg = environment(env).config("small-cpu", {"model.path": model_dir})
    r = cfg.rollout
    assert r.constrained_actions and not cfg.tokenizer.enable_thinking
    assert r.max_prompt_tokens + r.max_new_tokens <= 1024 and r.reflection_tokens <= 64
    assert len(r.length_buckets) <= 2 and 0 < r.engine_slots <= 8
    assert cfg.model.lora_rank > 0 and (cfg.model.dtype, cfg.model.overrides["remat"]) == ("float32", "full")
    assert cfg.optim.micro_batch_rows <= 2  # the update's activations of 792-token rows
    assert (cfg.train.eval_meta_episodes, cfg.train.eval_heldout_meta_episodes) == (32, 0)
    small = environment(env).config("small", {"model.path": model_dir})
    assert (r.num_episodes, r.memory_mode, r.max_turns) == (
        small.rollout.num_episodes, small.rollout.memory_mode, small.rollout.max_turns)


def test_the_kuhn_poker_cpu_training_recipe_can_show_adaptation_and_keeps_the_method(model_dir):
    """``smollm2-cpu`` (docs/results.md): every opponent trained against, a memory that shows the earlier
    trials, groups of several copies, the decision token's loss not averaged away, evaluation sampled
    from the policy itself; the method stays MAGE's (differential reward, GiGPO, PPO with KL)."""
    cfg = environment("kuhn_poker").config("smollm2-cpu", {"model.path": model_dir})
    r, o, a = cfg.rollout, cfg.optim, cfg.algorithm
    sampler = make_task_sampler(cfg)
    met = {t.opponent for i in range(sampler.rotation_period) for t in sampler.sample_train(i)}
    assert met == set(cfg.env.opponents)
    assert r.memory_mode in ("history_only", "history_and_reflection") and r.num_episodes == 3
    assert r.group_size >= 4 and r.constrained_actions and cfg.env.options["trial_hint"]
    assert o.aggregation == "seq-mean-token-sum"  # one free token per play row carries the row's loss
    assert (cfg.sampling.eval.top_p, cfg.sampling.eval.top_k) == (1.0, 0)  # no cut after the action mask
    assert (a.reward, a.estimator, a.anchor) == ("differential", "gigpo", "global") and o.kl_coef > 0
    assert (o.clip_eps, o.dual_clip, o.epochs) == (0.2, 3.0, 1) and cfg.model.lora_rank > 0
    assert cfg.train.iterations >= 100 and r.max_prompt_tokens + r.max_new_tokens <= 512


@pytest.mark.parametrize("env", ENVS)
@pytest.mark.parametrize("preset", ["small", "small-lora", "small-cpu", "paper"])
def test_pretrained_presets_without_a_model_folder_fail_with_one_line(env, preset):
    with pytest.raises(C.ConfigError) as err:
        environment(env).config(preset)
    assert "--model-path" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("env", ENVS)
def test_pretrained_presets_with_a_missing_folder_name_the_folder(env, tmp_path):
    with pytest.raises(C.ConfigError, match="is not a folder"):
        environment(env).config("paper", {"model.path": str(tmp_path / "absent")})


# docs/method.md §8, copied by hand: tasks x group, iterations, max turns, prompt / response tokens, KL 0.1,
# length penalty (0 = off), invalid penalty, gamma_traj; and the paper's evaluation episodes (ALFWorld up to
# the 10th attempt, WebShop by the 5th, the games 3).
SPEC_SECTION_8 = {
    "kuhn_poker": ((16, 8), 150, 6, (4096, 8192), True, 2.0, 2.0, 0.6, 3),
    "tic_tac_toe": ((16, 8), 150, 8, (4096, 3072), True, 2.0, 0.5, 0.6, 3),
    "alfworld": ((8, 8), 150, 10, (4096, 1024), False, 0.0, 0.5, 0.6, 10),
    "sokoban": ((16, 8), 300, 7, (4096, 4096), False, 1.0, 0.5, 0.9, 3),
    "webshop": ((8, 8), 150, 12, (8192, 1024), False, 0.0, 0.5, 0.6, 5),
}


@pytest.fixture(scope="module")
def webshop_data(tmp_path_factory):
    """A folder holding the names of the official 1000-product WebShop files (content is not read here)."""
    path = tmp_path_factory.mktemp("webshop_data")
    for name in ("items_shuffle_1000.json", "items_ins_v2_1000.json"):
        (path / name).write_text("[]")
    return str(path)


def paper_overrides(env, model_dir, webshop_data):
    return {"model.path": model_dir, **({"env.data_dir": webshop_data} if env == "webshop" else {})}


@pytest.mark.parametrize("env", sorted(SPEC_SECTION_8))
def test_paper_preset_resolves_to_the_spec_settings_table(env, model_dir, webshop_data):
    cfg = environment(env).config("paper", paper_overrides(env, model_dir, webshop_data))
    tasks_group, iterations, turns, tokens, kl, length, invalid, gamma_traj, eval_eps = SPEC_SECTION_8[env]
    r, a, s = cfg.rollout, cfg.algorithm, cfg.sampling
    assert (r.num_tasks, r.group_size) == tasks_group and cfg.train.iterations == iterations
    assert r.max_turns == turns and (r.max_prompt_tokens, r.max_response_tokens) == tokens
    assert cfg.optim.kl_coef == (0.1 if kl else 0.0) and cfg.optim.lr == 1e-6
    assert (a.length_penalty, a.invalid_penalty, a.gamma_traj) == (length, invalid, gamma_traj)
    assert cfg.train.eval_num_episodes == eval_eps and r.num_episodes == 3
    assert (s.train.temperature, s.train.top_p, s.train.top_k) == (1.0, 1.0, 0)
    assert (s.eval.temperature, s.eval.top_p, s.eval.top_k) == (0.7, 0.8, 20)
    assert cfg.tokenizer.kind == "hf" and cfg.rollout.reflect and cfg.rollout.memory_mode == "reflection_only"
    assert cfg.mesh.fsdp == -1 and cfg.model.dtype == "bfloat16"


def test_every_paper_environment_is_in_the_spec_table_but_minesweeper():
    assert set(ENVS) - set(SPEC_SECTION_8) == {"minesweeper"}  # a LaMer task: no column in the paper


def test_webshop_paper_preset_shops_in_the_official_data_or_stops_with_one_line(model_dir, webshop_data,
                                                                                tmp_path):
    web = environment("webshop")
    with pytest.raises(C.ConfigError) as err:
        web.config("paper", {"model.path": model_dir})
    message = str(err.value)
    assert "\n" not in message and "--env.data_dir" in message
    assert "items_shuffle_1000.json" in message and "items_ins_v2_1000.json" in message
    (tmp_path / "items_shuffle_1000.json").write_text("[]")
    with pytest.raises(C.ConfigError, match=r"lacks items_ins_v2_1000.json"):
        web.config("paper", {"model.path": model_dir, "env.data_dir": str(tmp_path)})
    cfg = web.config("paper", {"model.path": model_dir, "env.data_dir": webshop_data})
    assert cfg.env.options == {"split": "train", "size": "small", "human_goals": False}
    assert env_options(cfg)["data_dir"] == webshop_data  # what the environment is built with
    for preset in ("tiny", "small"):  # the generated catalogue stays for the other scales
        small = web.config(preset, {"model.path": model_dir} if preset == "small" else {})
        assert small.env.data_dir is None and "data_dir" not in env_options(small)


def test_webshop_paper_preset_without_data_on_the_command_line_writes_nothing(model_dir, tmp_path, capsys):
    from experiments import webshop

    argv = ["--preset", "paper", "--model-path", model_dir, "--run-dir", str(tmp_path / "r")]
    assert webshop.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: preset 'paper' shops in the official") and "\n" not in err
    assert not (tmp_path / "r").exists()


def test_paper_sokoban_propagates_across_episodes_with_gamma_09(model_dir):
    assert environment("sokoban").config("paper", {"model.path": model_dir}).algorithm.gamma_traj == 0.9


@pytest.mark.parametrize("module", MODULES)
@pytest.mark.parametrize("preset", ["tiny", "small", "small-lora", "paper"])
def test_command_line_of_every_module_and_preset_builds_the_config(module, preset, model_dir, webshop_data,
                                                                   tmp_path):
    mod = importlib.import_module(module)
    argv = ["--preset", preset, "--run-dir", str(tmp_path / "run"), "--train.iterations", "3"]
    if preset != "tiny":
        argv += ["--model-path", model_dir]
    if preset == "paper" and module == "experiments.webshop":
        argv += ["--env.data_dir", webshop_data]
    cfg, options = parse_command_line(
        argv, experiment=mod.EXPERIMENT, presets=mod.PRESETS, default_preset="tiny"
    )
    assert cfg.train.iterations == 3 and options.run_dir == str(tmp_path / "run")
    assert cfg.env.name == mod.SPEC.name


@pytest.mark.parametrize("module", MODULES)
def test_missing_model_folder_on_the_command_line_is_one_error_line(module, capsys, tmp_path):
    mod = importlib.import_module(module)
    assert mod.main(["--preset", "paper", "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: preset 'paper' loads a pretrained model") and "\n" not in err
    assert not (tmp_path / "r").exists()


def test_tic_tac_toe_reports_mcts100_first_as_table_entry_and_mcts1000_held_out():
    spec = environment("tic_tac_toe")
    cfg = spec.config("tiny")
    opts = spec.protocol(cfg)
    assert cfg.env.heldout_opponent == "mcts-1000" and cfg.env.heldout_seat == "first"
    assert opts.headline_split == "mcts100_first"
    (split,) = opts.extra_splits
    assert (split.opponent, split.seat) == ("mcts-100", "first")
    assert abs(sum(cfg.env.opponent_ratios) - 1) < 1e-9 and cfg.env.opponent_ratios[0] == 0.5


def test_sokoban_evaluates_one_and_three_boxes_held_out():
    spec = environment("sokoban")
    cfg = spec.config("tiny")
    assert cfg.env.options == {"num_boxes": 2} and cfg.env.opponents == ()
    assert {s.name: dict(s.env_options) for s in spec.protocol(cfg).extra_splits} == {
        "boxes_1": {"num_boxes": 1},
        "boxes_3": {"num_boxes": 3},
    }


def test_alfworld_and_webshop_evaluate_their_held_out_splits():
    alf = environment("alfworld")
    splits = {s.name: dict(s.env_options) for s in alf.protocol(alf.config("tiny")).extra_splits}
    assert splits == {"valid_seen": {"split": "valid_seen"}, "valid_unseen": {"split": "valid_unseen"}}
    lamer = alf.config("tiny", {"env.options": {"split": "lamer_train"}})
    assert [s.name for s in alf.protocol(lamer).extra_splits][-1] == "lamer_heldout"
    web = environment("webshop")
    assert [dict(s.env_options) for s in web.protocol(web.config("tiny")).extra_splits] == [{"split": "test"}]


def test_unknown_environment_and_preset_are_config_errors():
    with pytest.raises(C.ConfigError, match="unknown environment"):
        environment("chess")
    with pytest.raises(C.ConfigError, match="unknown preset"):
        environment("sokoban").config("huge")
