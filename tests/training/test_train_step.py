"""The jitted update: log-probs, PPO step, NaN skip, constrained replay, length-grouped mini-batches."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mage_jax import compile_report
from mage_jax.algorithms.schedules import learning_rate_schedule
from mage_jax.generate.constraints import automaton_from_completions
from mage_jax.models import sharding as shd
from mage_jax.models.config import ModelConfig
from mage_jax.training.train_step import (
    StepConfig,
    TrainBatch,
    fill_micro_batches,
    gather_rows,
    global_norm,
    make_optimizer,
    shared_train_step,
    split_micro_batches,
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
    """The process's shared step of these settings (``shared_train_step``): tests, and other test
    files of the same model, reuse its compiled programs."""
    _, mesh, graphdef, _ = model
    schedule = learning_rate_schedule(1e-2)
    tx = make_optimizer(schedule, b1=0.9, b2=0.999, weight_decay=0.0, grad_clip=1.0)
    return shared_train_step(graphdef, tx, schedule, StepConfig(chunk_size=5, **kwargs), mesh)


@functools.cache
def sgd(lr: float):
    """Plain SGD on a constant ``lr`` (one object per rate, so steps built on it are shared)."""
    import optax

    schedule = learning_rate_schedule(lr)
    return optax.sgd(schedule), schedule


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
    got = np.asarray(step.compute_logprobs(params, step.place_batch(TrainBatch(**b))))
    m = nnx.merge(graphdef, params)
    hidden, _ = m(jnp.asarray(b["tokens"]), jnp.asarray(b["positions"]), jnp.asarray(b["token_mask"]))
    full = jax.nn.log_softmax(m.logits(hidden), axis=-1)
    want = np.take_along_axis(np.asarray(full), b["targets"][..., None], -1)[..., 0]
    np.testing.assert_allclose(got, np.where(b["response_mask"], want, 0.0), atol=1e-5)


def test_update_moves_probability_towards_positive_advantage(model, step):
    _, _, _, params = model
    state = step.init_state(jax.device_put(params, may_alias=False))
    b = batch()
    old = np.asarray(step.compute_logprobs(state.params, step.place_batch(TrainBatch(**b))))
    b.update(old_logprobs=old, ref_logprobs=old, advantages=np.array([1.0, 1.0, -1.0, 0.0], np.float32))
    for _ in range(3):
        state, metrics = step.update(state, step.place_batch(TrainBatch(**b)))
    assert float(metrics["lr"]) == pytest.approx(1e-2)
    frozen = jax.tree.map(np.asarray, state.params)
    # a fully decayed learning rate
    state, _ = step.update(state, step.place_batch(TrainBatch(**b)), lr_scale=0.0)
    for a, c in zip(jax.tree.leaves(frozen), jax.tree.leaves(state.params)):
        np.testing.assert_array_equal(a, np.asarray(c))
    new = np.asarray(step.compute_logprobs(state.params, step.place_batch(TrainBatch(**b))))
    assert float(metrics["skipped"]) == 0.0 and int(state.step) == 4
    assert (new - old)[0][b["response_mask"][0]].sum() > 0
    assert (new - old)[2][b["response_mask"][2]].sum() < 0
    for key in ("policy_loss", "clip_fraction", "approx_kl", "kl_loss", "entropy", "grad_norm", "lr"):
        assert np.isfinite(float(metrics[key]))


def test_non_finite_loss_skips_the_update_and_keeps_state(model, step):
    _, _, _, params = model
    state = step.init_state(jax.device_put(params, may_alias=False))
    b = batch()
    old = np.asarray(step.compute_logprobs(state.params, step.place_batch(TrainBatch(**b))))
    b.update(old_logprobs=old, ref_logprobs=old, advantages=np.array([np.nan, 1.0, 1.0, 1.0], np.float32))
    before_params = jax.tree.map(np.asarray, state.params)
    before_opt = jax.tree.map(np.asarray, state.opt_state)
    state, metrics = step.update(state, step.place_batch(TrainBatch(**b)))
    assert float(metrics["skipped"]) == 1.0
    assert int(state.step) == 0
    for a, c in zip(jax.tree.leaves(before_params), jax.tree.leaves(state.params)):
        np.testing.assert_array_equal(a, np.asarray(c))
    for a, c in zip(jax.tree.leaves(before_opt), jax.tree.leaves(state.opt_state)):
        np.testing.assert_array_equal(a, np.asarray(c))


def test_an_update_that_makes_parameters_non_finite_is_skipped(model, step):
    """Finite loss and gradients, but a step that overflows (an infinite learning-rate scale): the
    all-finite flag of the updated state keeps the old parameters and counts the update skipped."""
    _, _, _, params = model
    state = step.init_state(jax.device_put(params, may_alias=False))
    b = batch()
    old = np.asarray(step.compute_logprobs(state.params, step.place_batch(TrainBatch(**b))))
    b.update(old_logprobs=old, ref_logprobs=old, advantages=np.array([1.0, 1.0, -1.0, 0.0], np.float32))
    before = jax.tree.map(np.asarray, state.params)
    state, metrics = step.update(state, step.place_batch(TrainBatch(**b)), lr_scale=float("inf"))
    assert np.isfinite(float(metrics["loss"])) and np.isfinite(float(metrics["grad_norm"]))
    assert float(metrics["skipped"]) == 1.0 and int(state.step) == 0
    for a, c in zip(jax.tree.leaves(before), jax.tree.leaves(state.params)):
        np.testing.assert_array_equal(a, np.asarray(c))


def advantage_batch(step, state):
    b = batch()
    old = np.asarray(step.compute_logprobs(state.params, step.place_batch(TrainBatch(**b))))
    b.update(old_logprobs=old, ref_logprobs=old, advantages=np.array([1.0, 1.0, -1.0, 0.0], np.float32))
    return step.place_batch(TrainBatch(**b))


def test_update_ratio_is_the_size_of_the_parameter_change_relative_to_the_parameters(model, step):
    _, _, _, params = model
    state = step.init_state(jax.device_put(params, may_alias=False))
    before = [np.asarray(x, np.float64) for x in jax.tree.leaves(state.params)]
    state, metrics = step.update(state, advantage_batch(step, state))
    after = [np.asarray(x, np.float64) for x in jax.tree.leaves(state.params)]
    change = np.sqrt(sum(((a - b) ** 2).sum() for a, b in zip(after, before)))
    size = np.sqrt(sum((b ** 2).sum() for b in before))
    assert float(metrics["skipped"]) == 0.0
    assert float(metrics["update_ratio"]) == pytest.approx(change / size, rel=1e-3)
    assert 0 < float(metrics["update_ratio"]) < StepConfig().max_update_ratio


def test_a_finite_update_larger_than_max_update_ratio_is_skipped(model, step):
    """A learning rate scaled by 1e28 keeps every number finite (the non-finite check passes), but the
    update is ~1e26 times the parameters: skipped and the state kept; with the check off it is applied."""
    _, _, _, params = model
    state = step.init_state(jax.device_put(params, may_alias=False))
    placed = advantage_batch(step, state)
    before = jax.tree.map(np.asarray, state.params)
    state, metrics = step.update(state, placed, lr_scale=1e28)
    assert float(metrics["skipped"]) == 1.0 and int(state.step) == 0
    assert 1e20 < float(metrics["update_ratio"]) < np.inf
    for a, c in zip(jax.tree.leaves(before), jax.tree.leaves(state.params)):
        np.testing.assert_array_equal(a, np.asarray(c))
    unchecked = make_step(model, kl_coef=0.1, constraint_len=4, max_update_ratio=0.0)
    state, metrics = unchecked.update(state, placed, lr_scale=1e28)
    assert float(metrics["skipped"]) == 0.0 and int(state.step) == 1
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state.params))


def test_global_norm_of_a_huge_tree_does_not_overflow():
    tree = {"a": jnp.full((4,), 1e30, jnp.float32), "b": jnp.zeros((2, 3), jnp.bfloat16)}
    assert float(global_norm(tree)) == pytest.approx(2e30, rel=1e-6)
    assert float(global_norm({"a": jnp.array([3.0, 4.0])})) == pytest.approx(5.0)


def test_an_update_without_donation_leaves_the_old_state_intact_computes_the_same_and_compiles_once(
        model, step):
    _, _, _, params = model
    state = step.init_state(jax.device_put(params, may_alias=False))
    placed = advantage_batch(step, state)
    before = jax.tree.map(np.asarray, state)
    step.update(jax.device_put(state, may_alias=False), placed)  # the donating program, compiled
    counter = compile_report.counter()
    compiled_before = counter.snapshot()
    kept, _ = step.update(state, placed, donate=False)
    # Nothing is compiled a second time: the kept update donates a copy of the state.
    assert (counter.snapshot() - compiled_before).programs == 0
    for a, c in zip(jax.tree.leaves(before), jax.tree.leaves(state)):  # still readable, unchanged
        np.testing.assert_array_equal(a, np.asarray(c))
    donated, _ = step.update(state, placed)
    for a, c in zip(jax.tree.leaves(kept), jax.tree.leaves(donated)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))


def test_the_fused_update_is_the_gradient_program_then_the_optimizer_program(model, step):
    """``update`` runs gradients and the optimizer step as one program; the two halves run as programs
    of their own (the path the fused one replaced) give the same state and metrics."""
    _, _, _, params = model
    state = step.init_state(jax.device_put(params, may_alias=False))
    placed = advantage_batch(step, state)
    grads_program, apply_program = step.update_programs(step.state_shardings(state))
    with jax.set_mesh(step.mesh):
        grads, metrics = grads_program(state.params, placed)
    split_state, split_metrics = apply_program(jax.device_put(state, may_alias=False), grads, metrics,
                                               np.float32(0.5))
    fused_state, fused_metrics = step.update(state, placed, lr_scale=0.5)
    assert int(fused_state.step) == int(split_state.step) == 1
    assert fused_metrics.keys() == split_metrics.keys()
    for name in fused_metrics:
        np.testing.assert_allclose(float(fused_metrics[name]), float(split_metrics[name]), rtol=1e-6,
                                   err_msg=name)
    for a, b in zip(jax.tree.leaves(fused_state), jax.tree.leaves(split_state), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    moved = 0
    for p0, a in zip(jax.tree.leaves(params), jax.tree.leaves(fused_state.params)):
        moved += int(not np.array_equal(np.asarray(p0), np.asarray(a)))
    assert moved > 0


def test_kl_term_is_zero_against_itself_and_positive_after_moving(model, step):
    _, _, _, params = model
    state = step.init_state(jax.device_put(params, may_alias=False))
    ref = jax.device_put(state.params, may_alias=False)
    b = batch()
    logp = np.asarray(step.compute_logprobs(ref, step.place_batch(TrainBatch(**b))))
    b.update(old_logprobs=logp, ref_logprobs=logp, advantages=np.ones(R, np.float32))
    state, m0 = step.update(state, step.place_batch(TrainBatch(**b)))
    state, m1 = step.update(state, step.place_batch(TrainBatch(**b)))
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
    logp = np.asarray(step.compute_logprobs(params, step.place_batch(TrainBatch(**b))))[0, 7:11]
    assert abs(logp[0]) < 1e-6 and abs(logp[2]) < 1e-6 and abs(logp[3]) < 1e-6
    assert -np.log(2) - 3 < logp[1] < 0
    unconstrained = np.asarray(step.compute_logprobs(params, step.place_batch(
        TrainBatch(**{k: v for k, v in b.items() if k != "transitions"}))))[0, 7:11]
    assert (unconstrained < logp - 1e-6).all()


def test_train_batches_hold_every_real_row_once_and_mask_the_padding():
    from mage_jax.rollout.rows import Row, minibatch_indices, pack_rows

    rows = [Row(group=0, meta_episode=i, episode=0, turn=0, step=0, phase="play", anchor="a", opponent=None,
                seat=0, prompt_ids=np.array([1, 2], np.int32), response_ids=np.array([3], np.int32),
                logprobs=np.zeros(1, np.float32), env_reward=float(i), valid=True) for i in range(10)]
    packed = pack_rows(rows, row_bucket=8, length_buckets=(4,), pad_id=0)
    advantages = np.arange(16, dtype=np.float32)
    blocks = minibatch_indices(10, 4, permutation=np.random.default_rng(0).permutation(10))
    minis = [TrainBatch.from_packed(packed, idx, advantages=advantages, length=3) for idx in blocks]
    assert [m.tokens.shape for m in minis] == [(4, 3)] * 3
    seen = np.concatenate([m.advantages[idx >= 0] for m, idx in zip(minis, blocks)])
    assert sorted(seen.tolist()) == [float(i) for i in range(10)]
    last = minis[-1]
    assert not last.response_mask[2:].any() and (last.tokens[2:] == 0).all()
    assert (last.advantages[2:] == 0).all()
    table = jnp.arange(16 * 4, dtype=jnp.float32).reshape(16, 4)
    gathered = np.asarray(gather_rows(table, blocks[-1], 3))
    np.testing.assert_array_equal(gathered[:2], np.asarray(table)[blocks[-1][:2], :3])
    assert (gathered[2:] == 0).all()


def test_an_abstract_train_batch_has_the_shapes_and_dtypes_of_a_real_one():
    """``TrainBatch.abstract`` (ahead-of-time lowering) describes what ``from_packed`` and the trainer's
    old / reference log-probs and row weights make: leaf by leaf, shape and dtype."""
    from mage_jax.rollout.rows import Row, pack_rows

    rows = [Row(group=0, meta_episode=i, episode=0, turn=0, step=0, phase="play", anchor="a", opponent=None,
                seat=0, prompt_ids=np.array([1, 2], np.int32), response_ids=np.array([3], np.int32),
                logprobs=np.zeros(1, np.float32), env_reward=float(i), valid=True) for i in range(3)]
    packed = pack_rows(rows, row_bucket=4, length_buckets=(4,), pad_id=0)
    idx = np.array([0, 1, 2, -1])
    recompute = TrainBatch.from_packed(packed, idx, length=3)
    update = TrainBatch.from_packed(packed, idx, length=3, advantages=np.zeros(4, np.float32)).replace(
        old_logprobs=np.zeros((4, 3), np.float32), ref_logprobs=np.zeros((4, 3), np.float32),
        row_weights=np.ones(4, np.float32))  # the weights of merged identical rows (Credited.batch)

    def described(batch):
        return jax.tree.map(lambda a: (a.shape, np.dtype(a.dtype)), batch)

    assert described(TrainBatch.abstract(4, 3, update=False)) == described(recompute)
    assert described(TrainBatch.abstract(4, 3, update=True, reference=True)) == described(update)
    assert TrainBatch.abstract(4, 3, update=True).ref_logprobs is None


def test_the_entropy_bonus_is_subtracted_from_the_loss(model, step):
    """With zero advantages, before the policy moves from the KL reference, the loss the update
    descends is exactly -entropy_coef x entropy: a bonus (a flipped sign would punish entropy)."""
    _, _, _, params = model
    state = step.init_state(jax.device_put(params, may_alias=False))
    b = TrainBatch(**batch())
    old = np.asarray(step.compute_logprobs(state.params, step.place_batch(b)))
    b = b.replace(old_logprobs=old, ref_logprobs=old, advantages=np.zeros(R, np.float32))
    _, metrics = step.update(state, step.place_batch(b))
    assert float(metrics["policy_loss"]) == 0.0 and float(metrics["kl_loss"]) == 0.0
    assert float(metrics["entropy"]) > 0.1
    assert step.config.entropy_coef == 0.001
    assert float(metrics["loss"]) == pytest.approx(-0.001 * float(metrics["entropy"]), rel=1e-5)


def micro_batch_rows_batch(seed=0):
    """8 rows of different response lengths: 6 real, rows 3 and 7 padding (fully masked), so with 2-row
    micro-batches (rows j, j + 4) one micro-batch holds padding only and the others' shares of response
    tokens (5, 8, 5 of 18) differ from their shares of rows (2 of 6 each)."""
    rng = np.random.default_rng(seed)
    b = {k: np.concatenate([v, batch(seed + 1)[k]]) for k, v in batch(seed).items()}
    for name in ("token_mask", "response_mask"):
        b[name][[3, 7]] = False
    b["tokens"][[3, 7]] = 0
    b["targets"][[3, 7]] = 0
    b["prompt_lengths"][[3, 7]] = 0
    b["response_mask"][4, 8:] = False  # 1 response token instead of 4: micro-batches of 5, 8, 5, 0 tokens
    b["response_mask"][6, 5:] = False
    for name in ("old_logprobs", "ref_logprobs"):
        noisy = -3.0 + rng.normal(0, 0.5, (2 * R, T))
        b[name] = np.where(b["response_mask"], noisy, 0).astype(np.float32)
    b["advantages"] = np.array([1.5, -2.0, 0.7, 0.0, -0.4, 2.2, -1.1, 0.0], np.float32)
    return b


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_micro_batches_give_the_whole_mini_batch_gradients_and_metrics(model, aggregation):
    """Gradient accumulation over 2-row micro-batches gives the gradients and metrics of one pass over
    the 8 rows, leaf by leaf (the update's gradient half, ``update_programs``: the optimizer step after
    it is the fused update's, checked against the halves above)."""
    _, mesh, graphdef, params = model

    def run(micro_batch_rows):
        config = StepConfig(chunk_size=5, kl_coef=0.1, entropy_coef=0.01, aggregation=aggregation,
                            micro_batch_rows=micro_batch_rows)
        step = shared_train_step(graphdef, *sgd(1.0), config, mesh)
        state = step.init_state(jax.device_put(params, may_alias=False))
        grads_program, _ = step.update_programs(step.state_shardings(state))
        placed = step.place_batch(TrainBatch(**micro_batch_rows_batch()))
        with jax.set_mesh(mesh):
            grads, metrics = grads_program(state.params, placed)
        return jax.tree.map(np.asarray, grads), {k: float(v) for k, v in metrics.items()}

    whole_grads, whole = run(0)
    micro_grads, micro = run(2)
    assert whole["clip_fraction"] > 0 and whole["kl_loss"] > 0 and whole["entropy"] > 0
    assert whole.keys() == micro.keys()
    for name in whole:
        assert micro[name] == pytest.approx(whole[name], rel=1e-5, abs=1e-6), name
    leaves = list(zip(jax.tree.leaves(whole_grads), jax.tree.leaves(micro_grads), strict=True))
    assert any(np.abs(a).max() > 0 for a, _ in leaves)
    for a, c in leaves:
        np.testing.assert_allclose(c, a, rtol=1e-5, atol=1e-6)


def _gradients_of(model, config: StepConfig):
    """(step, state, run): ``run(arrays)`` gives the gradients and metrics of the batch ``arrays``
    (a dict of ``TrainBatch`` fields) from the step's gradient program, as numpy and floats."""
    _, mesh, graphdef, params = model
    step = shared_train_step(graphdef, *sgd(1.0), config, mesh)
    state = step.init_state(jax.device_put(params, may_alias=False))
    grads_program, _ = step.update_programs(step.state_shardings(state))

    def run(arrays):
        with jax.set_mesh(mesh):
            grads, metrics = grads_program(state.params, step.place_batch(TrainBatch(**arrays)))
        return jax.tree.map(np.asarray, grads), {k: float(v) for k, v in metrics.items()}

    return step, state, run


def test_a_micro_batch_of_padding_rows_only_is_skipped(model):
    """The padded tail of a short mini-batch is not run through the model: with non-finite values in
    the padding-only micro-batch (rows 3 and 7), which would make its zero-weighted loss NaN, the
    gradients and metrics are those of the same batch with finite padding."""
    _, _, run = _gradients_of(model, StepConfig(chunk_size=5, kl_coef=0.1, entropy_coef=0.01,
                                                micro_batch_rows=2))
    poisoned = micro_batch_rows_batch()
    for name in ("old_logprobs", "ref_logprobs", "advantages"):
        poisoned[name][[3, 7]] = np.nan
    clean_grads, clean = run(micro_batch_rows_batch())
    grads, metrics = run(poisoned)
    assert metrics == clean and all(np.isfinite(v) for v in metrics.values())
    for a, b in zip(jax.tree.leaves(clean_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_array_equal(b, a)


@pytest.mark.parametrize("remat", ["none", "full"])
def test_logprob_recompute_over_micro_batches_is_the_whole_batch_recompute(model, remat):
    """``compute_logprobs`` runs ``micro_batch_rows`` rows at a time (strided, like the update) and puts
    every row back in its place, with or without rematerialised blocks."""
    config, mesh, _, _ = model
    graphdef, params = shd.init_sharded(dataclasses.replace(config, remat=remat), mesh, seed=0)

    def logprobs(micro_batch_rows):
        config = StepConfig(chunk_size=5, micro_batch_rows=micro_batch_rows)
        step = shared_train_step(graphdef, *sgd(1e-3), config, mesh)
        batch = step.place_batch(TrainBatch(**micro_batch_rows_batch()))
        return np.asarray(step.compute_logprobs(params, batch))

    whole = logprobs(0)
    assert (whole[0] != whole[1]).any() and (whole[3] == 0).all()
    np.testing.assert_allclose(logprobs(2), whole, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(logprobs(4), whole, rtol=1e-6, atol=1e-6)


def test_micro_batch_rows_must_divide_the_mini_batch(model):
    from mage_jax import config as C

    valid = {"tokenizer.kind": "word_level", "optim.mini_batch_rows": 64}
    cfg = C.apply_overrides(C.ExperimentConfig(), {**valid, "optim.micro_batch_rows": 24})
    with pytest.raises(C.ConfigError) as err:
        C.validate(cfg, check_paths=False)
    assert str(err.value) == "optim.micro_batch_rows must be 0 or divide optim.mini_batch_rows 64 (got 24)"
    ok = C.apply_overrides(C.ExperimentConfig(), {**valid, "optim.micro_batch_rows": 16})
    assert C.validate(ok, check_paths=False).optim.micro_batch_rows == 16
    step = make_step(model, micro_batch_rows=3)
    state = step.init_state(jax.device_put(model[3], may_alias=False))
    with pytest.raises(ValueError, match="micro_batch_rows 3 does not divide the mini-batch's 8 rows"):
        step.update(state, step.place_batch(TrainBatch(**micro_batch_rows_batch())))


@pytest.mark.parametrize("constrained", [False, True])
def test_the_head_over_the_response_span_only_is_the_whole_row_head(model, constrained):
    """``response_len``: logits at each row's response positions only (at most 4 here, span 5 of 12)
    give the log-probs, gradients and metrics of the head over every position, constrained rows too."""
    _, mesh, graphdef, params = model
    b = micro_batch_rows_batch()
    if constrained:  # row 0 forced through [5, {6|7}, 8] then EOS, as in the constrained test above
        automaton = automaton_from_completions([[5, 6, 8], [5, 7, 8]], V, 3)
        b["targets"][0, 7:11] = [5, 6, 8, 3]
        b["tokens"][0, 8:12] = [5, 6, 8, 3]
        free = np.zeros((automaton.num_states, V), np.int32)
        b["transitions"] = np.stack([automaton.transitions] + [free] * (2 * R - 1))

    def run(response_len):
        config = StepConfig(chunk_size=5, kl_coef=0.1, entropy_coef=0.01, constraint_len=4,
                            response_len=response_len)
        step = shared_train_step(graphdef, *sgd(1.0), config, mesh)
        state = step.init_state(jax.device_put(params, may_alias=False))
        placed = step.place_batch(TrainBatch(**b))
        logp = np.asarray(step.compute_logprobs(state.params, placed))
        grads_program, _ = step.update_programs(step.state_shardings(state))
        with jax.set_mesh(mesh):
            grads, metrics = grads_program(state.params, placed)
        return logp, jax.tree.map(np.asarray, grads), {k: float(v) for k, v in metrics.items()}

    whole_logp, whole_grads, whole = run(0)
    span_logp, span_grads, span = run(5)
    assert (span_logp[~b["response_mask"]] == 0).all()
    np.testing.assert_allclose(span_logp, whole_logp, atol=1e-5)
    for name in whole:
        assert span[name] == pytest.approx(whole[name], rel=1e-5, abs=1e-6), name
    for a, c in zip(jax.tree.leaves(whole_grads), jax.tree.leaves(span_grads), strict=True):
        np.testing.assert_allclose(c, a, rtol=1e-4, atol=1e-6)


def test_real_rows_fill_the_first_micro_batches_and_padding_the_last():
    # 8 rows, 3 real: in 2-row micro-batches (rows j, j + 4) they take micro-batches 0 and 1, and
    # micro-batches 2 and 3 hold padding only, which the update and the recompute skip.
    index = fill_micro_batches(np.array([5, 2, 7, -1, -1, -1, -1, -1]), 2)
    parts = np.asarray(split_micro_batches(TrainBatch(*([jnp.asarray(index)] * 6)), 2).tokens)
    assert parts.tolist() == [[5, 2], [7, -1], [-1, -1], [-1, -1]]
    assert sorted(index.tolist()) == sorted([5, 2, 7, -1, -1, -1, -1, -1])
    assert fill_micro_batches(np.array([1, 0, -1]), 0).tolist() == [1, 0, -1]  # no micro-batches: as given


def test_an_update_without_old_logprobs_uses_its_own_forward_pass_as_the_recompute(model):
    """An iteration's only update: log pi_old taken from the update's forward pass (held constant) gives
    the gradients and metrics of the update given the recomputed old log-probs."""
    b = micro_batch_rows_batch()
    step, state, run = _gradients_of(model, StepConfig(chunk_size=5, kl_coef=0.1, entropy_coef=0.01,
                                                       response_len=5))
    b.pop("old_logprobs")
    fused_grads, fused = run(b)
    recomputed = np.asarray(step.compute_logprobs(state.params, step.place_batch(TrainBatch(**b))))
    given_grads, given = run({**b, "old_logprobs": recomputed})
    assert fused["approx_kl"] == 0.0 and fused["clip_fraction"] == 0.0
    for name in given:
        assert fused[name] == pytest.approx(given[name], rel=1e-5, abs=1e-6), name
    for a, c in zip(jax.tree.leaves(given_grads), jax.tree.leaves(fused_grads), strict=True):
        np.testing.assert_allclose(c, a, rtol=1e-4, atol=1e-6)
    assert any(np.abs(a).max() > 0 for a in jax.tree.leaves(fused_grads))
