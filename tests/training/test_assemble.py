"""Config -> run parts: environment options reach the environment, and bad ones are one error line."""

from __future__ import annotations

import numpy as np
import pytest

from mage_jax import config as C
from mage_jax.algorithms.advantages import credit
from mage_jax.algorithms.returns import RowBatch
from mage_jax.rollout.attempts import IndependentAttemptsRunner
from mage_jax.testing import SMALLEST_DECODER
from mage_jax.tokenizer import Tokenizer
from mage_jax.training.assemble import (
    advantage_config,
    build_generation,
    build_tokenizer,
    constraint_length,
    env_options,
    make_eval_runner,
    make_mesh,
    make_runner,
    make_task_sampler,
    runner_config,
)

WORD_LEVEL = {"tokenizer.kind": "word_level"}


def test_env_data_dir_is_passed_to_the_environment_with_its_options():
    cfg = C.apply_overrides(C.ExperimentConfig(), {**WORD_LEVEL, "env.name": "webshop",
                                                   "env.options": {"split": "test"}, "env.data_dir": "/d"})
    assert env_options(cfg) == {"split": "test", "data_dir": "/d"}
    plain = C.apply_overrides(C.ExperimentConfig(), WORD_LEVEL)
    assert env_options(plain) == {}


def test_missing_environment_data_is_one_config_error_line(tmp_path):
    cfg = C.apply_overrides(C.ExperimentConfig(), {**WORD_LEVEL, "env.name": "webshop", "env.opponents": [],
                                                   "env.opponent_ratios": [], "env.data_dir": str(tmp_path)})
    message = r"^env webshop: WebShop data not found: items_shuffle_1000.json"
    with pytest.raises(C.ConfigError, match=message) as err:
        make_runner(cfg, num_episodes=1)
    assert "\n" not in str(err.value)
    with pytest.raises(C.ConfigError, match="WebShop data not found"):
        make_eval_runner(cfg, "independent")


def test_evaluation_runner_plays_the_evaluation_episodes_in_either_mode():
    cfg = C.apply_overrides(C.ExperimentConfig(), {**WORD_LEVEL, "rollout.num_episodes": 2,
                                                   "train.eval_num_episodes": 4})
    assert make_eval_runner(cfg).config.num_episodes == 4
    attempts = make_eval_runner(cfg, "independent")
    assert isinstance(attempts, IndependentAttemptsRunner) and attempts.config.num_episodes == 4
    assert attempts.base.config.rollout.privileged_reflection is False
    with pytest.raises(C.ConfigError, match="eval_mode"):
        make_eval_runner(cfg, "sometimes")


def test_constrained_reflection_words_join_the_vocabulary_and_a_resumed_one_must_hold_them(tmp_path):
    words = {**WORD_LEVEL, "rollout.prompt_style": "compact", "rollout.constrained_actions": True,
             "rollout.max_response_tokens": 8, "tokenizer.corpus_meta_episodes": 8,
             "rollout.reflection_words": ["bets", "zebra"], "rollout.reflection_max_words": 2}
    cfg = C.validate(C.apply_overrides(C.ExperimentConfig(), words))
    tok = build_tokenizer(cfg, str(tmp_path), make_task_sampler(cfg))
    assert tok.single_token_id("zebra") is not None  # a word no prompt holds
    assert runner_config(cfg, num_episodes=3).rollout.reflection_words == ("bets", "zebra")
    assert constraint_length(cfg) == 8
    assert constraint_length(C.apply_overrides(cfg, {"rollout.max_reflection_tokens": 12})) == 12
    assert constraint_length(C.apply_overrides(cfg, {"rollout.reflection_words": [],
                                                     "rollout.constrained_actions": False})) == 0
    grown = C.apply_overrides(cfg, {"rollout.reflection_words": ["bets", "zebra", "giraffe"]})
    with pytest.raises(C.ConfigError, match="rollout.reflection_words giraffe are not single tokens") as err:
        build_tokenizer(grown, str(tmp_path), make_task_sampler(grown))  # the saved vocabulary is loaded
    assert "\n" not in str(err.value)


def test_a_run_builds_the_engine_or_the_lockstep_sampler_over_one_model_spec():
    """The engine's model spec is a ``ModelSpec``: an engine run builds no lockstep sampler it would never
    run, and a lockstep run no engine; the harness of ``mage_jax.testing`` asks for both."""
    overrides = {**WORD_LEVEL, "model.preset": "tiny", "model.overrides": SMALLEST_DECODER,
                 "rollout.max_prompt_tokens": 64, "rollout.max_response_tokens": 8}
    tokenizer = Tokenizer.word_level(["a b c"])
    engine_run = C.apply_overrides(C.ExperimentConfig(), overrides)
    gen = build_generation(engine_run, tokenizer, make_mesh(engine_run))
    assert gen.engine is not None and gen.sampler is None and gen.engine.spec is gen.spec
    assert gen.spec.prompt_buckets == (64,) and gen.spec.eos_ids == tuple(tokenizer.eos_ids)
    both = build_generation(engine_run, tokenizer, make_mesh(engine_run), lockstep=True)
    assert both.engine is not None and both.sampler is not None and both.sampler.spec is both.spec
    lockstep_run = C.apply_overrides(engine_run, {"rollout.engine": "lockstep"})
    gen = build_generation(lockstep_run, tokenizer, make_mesh(lockstep_run))
    assert gen.engine is None and gen.sampler is not None


def test_a_run_measures_each_rows_length_penalty_against_the_limit_it_was_generated_under():
    # small-cpu's shape: play rows up to 24 tokens, reflections up to 48, c_len 2. A 40-token reflection
    # is 16 / 24 past its M/2; measured against the play limit it would pay the whole c_len.
    cfg = C.apply_overrides(C.ExperimentConfig(), {**WORD_LEVEL, "rollout.max_response_tokens": 24,
                                                   "rollout.max_reflection_tokens": 48,
                                                   "algorithm.length_penalty": 2.0})
    rows = RowBatch.create(group=[0, 0], meta_episode=[0, 0], episode=[0, 0], step=[0, 1],
                           is_reflect=[False, True], anchor=[0, 1], env_reward=[-5.0, 0.0],
                           response_length=[9, 40])
    np.testing.assert_allclose(np.asarray(credit(rows, advantage_config(cfg)).penalty), [0.0, 2.0 * 16 / 24],
                               rtol=1e-6)
