"""Specification of the rollout engine (mage_jax.rollout.engine, mage_jax.slot_sampler): continuous
batching changes how generations are scheduled, never what a meta-episode sees. With greedy decoding the
engine gives the lockstep path's tokens, rows, row order, outcomes and metrics on every built-in
environment; identical prompts are prefilled once; nothing recompiles once warm."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from experiments.environments import ENVIRONMENTS, environment
from mage_jax.envs.alfworld import write_tiny_alfred_game
from mage_jax.rollout.policy import LLMPolicy
from mage_jax.sampling import SamplingParams
from mage_jax.training.assemble import build_parts
from tests.tiny_models import SMALLEST_DECODER

TIMING = {"rollout_seconds"}


@pytest.fixture(scope="module")
def alfworld_data(tmp_path_factory):
    """One tiny ALFWorld PDDL game in every split (the real TextWorld engine plays it)."""
    root = tmp_path_factory.mktemp("alfworld")
    for split in ("train", "valid_seen", "valid_unseen"):
        game = root / "json_2.1.1" / split / "pick_and_place_simple-Apple-None-Fridge-1" / "trial_T1"
        write_tiny_alfred_game(game)
    return str(root)


def tiny_config(env: str, data_dir: str | None = None, **rollout):
    overrides = {
        **({"env.data_dir": data_dir} if data_dir else {}),
        "rollout.num_tasks": 2, "rollout.group_size": 2, "rollout.num_episodes": 2, "rollout.max_turns": 3,
        "rollout.max_response_tokens": 12, "rollout.max_reflection_tokens": 10,
        "model.overrides": SMALLEST_DECODER, "tokenizer.corpus_meta_episodes": 8,
        "train.eval_meta_episodes": 4,
        "train.eval_heldout_meta_episodes": 4, "rollout.engine_slots": 3, "rollout.engine_chunk": 4,
        **{f"rollout.{k}": v for k, v in rollout.items()},
    }
    return environment(env).config("tiny", overrides)


def greedy_policy(parts, engine):
    r = parts.cfg.rollout
    longest = max(r.max_response_tokens, r.max_reflection_tokens)
    params = SamplingParams(temperature=0.0, max_new_tokens=longest)
    return LLMPolicy(parts.tokenizer, parts.sampler, parts.init_params, params, jax.random.key(0),
                     max_prompt_tokens=r.max_prompt_tokens, engine=engine)


def rollout(parts, engine):
    tasks = parts.task_sampler.sample_train(0)
    return parts.train_runner.run(tasks, greedy_policy(parts, engine), training=True)


def assert_same_rollout(a, b):
    assert len(a.rows) == len(b.rows) > 0
    for ra, rb in zip(a.rows, b.rows):
        for field in dataclasses.fields(ra):
            va, vb = getattr(ra, field.name), getattr(rb, field.name)
            if field.name == "logprobs":
                np.testing.assert_allclose(va, vb, atol=1e-5)
            elif isinstance(va, np.ndarray):
                np.testing.assert_array_equal(va, vb)
            elif field.name != "constraint":
                assert va == vb, field.name
    assert [o.to_dict() for o in a.outcomes] == [o.to_dict() for o in b.outcomes]
    stats_a = {k: v for k, v in a.stats.items() if k not in TIMING}
    stats_b = {k: v for k, v in b.stats.items() if k not in TIMING}
    assert stats_a == stats_b


@pytest.mark.parametrize("env", sorted(ENVIRONMENTS))
def test_greedy_engine_rollout_equals_the_lockstep_rollout_on_every_environment(env, tmp_path, request):
    data = request.getfixturevalue("alfworld_data") if env == "alfworld" else None
    parts = build_parts(tiny_config(env, data), str(tmp_path))
    assert parts.engine is not None  # the engine is the default
    lockstep = rollout(parts, None)
    engine = rollout(parts, parts.engine)
    assert_same_rollout(lockstep, engine)
    # Responses of different lengths finished out of order: the engine really interleaved turns.
    assert lockstep.stats["rows"] > parts.engine.num_slots
