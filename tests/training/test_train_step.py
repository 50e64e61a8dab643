"""The jitted update: log-probs, PPO step, NaN skip, constrained replay, length-grouped mini-batches."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mage_jax.models import sharding as shd
from mage_jax.models.config import ModelConfig
from mage_jax.sampling import automaton_from_completions
from mage_jax.training.train_step import (
    StepConfig,
    TrainStep,
    learning_rate_schedule,
    length_grouped_minibatches,
)

V, R, T = 24, 4, 12


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig.preset("tiny", vocab_size=V, hidden_size=16, intermediate_size=32, num_layers=1,
                             num_heads=2, num_kv_heads=1, head_dim=8)
    mesh = shd.make_mesh(shd.MeshConfig(data=1, fsdp=1, tensor=1))
    graphdef, params = shd.init_sharded(cfg, mesh, seed=0)
    return cfg, mesh, graphdef, params


@pytest.fixture(scope="module")
def step(model):
    """One step object for all tests, so its jitted programs compile once."""
    return make_step(model, kl_coef=0.1, constraint_len=4)


def make_step(model, **kwargs):
    import optax

    _, mesh, graphdef, _ = model
    schedule = learning_rate_schedule(1e-2)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.0))
    return TrainStep(graphdef, tx, schedule, StepConfig(chunk_size=5, **kwargs), mesh)


def batch(seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(4, V, (R, T)).astype(np.int32)
    lengths = np.array([12, 10, 9, 7])
    mask = np.arange(T)[None] < lengths[:, None]
    tokens = np.where(mask, tokens, 0)
    targets = np.where(np.arange(T)[None] < lengths[:, None] - 1, np.roll(tokens, -1, 1), 0)
    prompt = np.array([8, 6, 5, 4])
    response = (np.arange(T)[None] >= prompt[:, None] - 1) & (np.arange(T)[None] < lengths[:, None] - 1)
    return {"tokens": tokens, "positions": np.tile(np.arange(T, dtype=np.int32), (R, 1)), "token_mask": mask,
            "targets": targets.astype(np.int32), "response_mask": response,
            "prompt_lengths": prompt.astype(np.int32)}


def test_logprobs_match_a_plain_log_softmax_on_response_tokens(model, step):
    _, _, graphdef, params = model
    b = batch()
    got = np.asarray(step.compute_logprobs(params, step.place_batch(b)))
    m = nnx.merge(graphdef, params)
    hidden, _ = m(jnp.asarray(b["tokens"]), jnp.asarray(b["positions"]), jnp.asarray(b["token_mask"]))
    full = jax.nn.log_softmax(m.logits(hidden), axis=-1)
    want = np.take_along_axis(np.asarray(full), b["targets"][..., None], -1)[..., 0]
    np.testing.assert_allclose(got, np.where(b["response_mask"], want, 0.0), atol=1e-5)


def test_update_moves_probability_towards_positive_advantage(model, step):
    _, _, _, params = model
    state = step.init_state(jax.tree.map(jnp.copy, params))
    b = batch()
    old = np.asarray(step.compute_logprobs(state.params, step.place_batch(b)))
    b.update(old_logprobs=old, ref_logprobs=old, advantages=np.array([1.0, 1.0, -1.0, 0.0], np.float32))
    for _ in range(3):
        state, metrics = step.update(state, step.place_batch(b))
    assert float(metrics["lr"]) == pytest.approx(1e-2)
    frozen = jax.tree.map(np.asarray, state.params)
    state, _ = step.update(state, step.place_batch(b), lr_scale=0.0)  # a fully decayed learning rate
    for a, c in zip(jax.tree.leaves(frozen), jax.tree.leaves(state.params)):
        np.testing.assert_array_equal(a, np.asarray(c))
    new = np.asarray(step.compute_logprobs(state.params, step.place_batch(b)))
    assert float(metrics["skipped"]) == 0.0 and int(state.step) == 4
    assert (new - old)[0][b["response_mask"][0]].sum() > 0
    assert (new - old)[2][b["response_mask"][2]].sum() < 0
    for key in ("policy_loss", "clip_fraction", "approx_kl", "kl_loss", "entropy", "grad_norm", "lr"):
        assert np.isfinite(float(metrics[key]))


def test_non_finite_loss_skips_the_update_and_keeps_state(model, step):
    _, _, _, params = model
    state = step.init_state(jax.tree.map(jnp.copy, params))
    b = batch()
    old = np.asarray(step.compute_logprobs(state.params, step.place_batch(b)))
    b.update(old_logprobs=old, ref_logprobs=old, advantages=np.array([np.nan, 1.0, 1.0, 1.0], np.float32))
    before_params = jax.tree.map(np.asarray, state.params)
    before_opt = jax.tree.map(np.asarray, state.opt_state)
    state, metrics = step.update(state, step.place_batch(b))
    assert float(metrics["skipped"]) == 1.0
    assert int(state.step) == 0
    for a, c in zip(jax.tree.leaves(before_params), jax.tree.leaves(state.params)):
        np.testing.assert_array_equal(a, np.asarray(c))
    for a, c in zip(jax.tree.leaves(before_opt), jax.tree.leaves(state.opt_state)):
        np.testing.assert_array_equal(a, np.asarray(c))


def test_kl_term_is_zero_against_itself_and_positive_after_moving(model, step):
    _, _, _, params = model
    state = step.init_state(jax.tree.map(jnp.copy, params))
    ref = jax.tree.map(jnp.copy, state.params)
    b = batch()
    logp = np.asarray(step.compute_logprobs(ref, step.place_batch(b)))
    b.update(old_logprobs=logp, ref_logprobs=logp, advantages=np.ones(R, np.float32))
    state, m0 = step.update(state, step.place_batch(b))
    state, m1 = step.update(state, step.place_batch(b))
    assert abs(float(m0["kl_loss"])) < 1e-6
    assert float(m1["kl_loss"]) > 0


def test_constrained_rows_replay_the_automaton(model, step):
    """A forced response token has log-prob 0; a free choice between two tokens is a 2-way softmax."""
    _, _, _, params = model
    b = batch()
    # Row 0: response targets start at index 7 (prompt 8). Force tokens [5, {6|7}, 8] then EOS (3).
    automaton = automaton_from_completions([[5, 6, 8], [5, 7, 8]], V, 3)
    b["targets"][0, 7:11] = [5, 6, 8, 3]
    b["tokens"][0, 8:12] = [5, 6, 8, 3]
    b["response_mask"][0] = False
    b["response_mask"][0, 7:11] = True
    free = np.zeros((automaton.num_states, V), np.int32)
    b["transitions"] = np.stack([automaton.transitions] + [free] * (R - 1))
    logp = np.asarray(step.compute_logprobs(params, step.place_batch(b)))[0, 7:11]
    assert abs(logp[0]) < 1e-6 and abs(logp[2]) < 1e-6 and abs(logp[3]) < 1e-6
    assert -np.log(2) - 3 < logp[1] < 0
    unconstrained = np.asarray(step.compute_logprobs(params, step.place_batch(
        {k: v for k, v in b.items() if k != "transitions"})))[0, 7:11]
    assert (unconstrained < logp - 1e-6).all()


def test_length_grouped_minibatches_cover_every_row_once_with_similar_lengths():
    lengths = np.array([100, 300, 120, 310, 90, 305, 110, 295, 330])
    blocks = length_grouped_minibatches(lengths, 4, np.random.default_rng(0), buckets=(128, 320, 512))
    flat = np.concatenate(blocks)
    assert sorted(flat[flat >= 0].tolist()) == list(range(len(lengths)))
    assert all(len(b) == 4 for b in blocks)
    assert sorted(set((lengths[b[b >= 0]] > 128).tolist()) == {False, True} for b in blocks).count(True) <= 1


def test_lr_decay_runs_from_one_to_the_end_fraction():
    from mage_jax.training.train_step import lr_decay

    assert lr_decay("constant", 0.7) == 1.0
    assert lr_decay("linear", 0.0) == 1.0 and lr_decay("linear", 1.0, 0.1) == pytest.approx(0.1)
    assert lr_decay("cosine", 0.5) == pytest.approx(0.5)
    assert lr_decay("cosine", 1.0, 0.05) == pytest.approx(0.05)
    with pytest.raises(ValueError, match="unknown learning-rate decay"):
        lr_decay("step", 0.5)
