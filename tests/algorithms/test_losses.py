"""PPO dual-clip loss, aggregation, KL estimators, entropy, chunked token log-probs (docs/method.md §5)."""

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

from mage_jax.algorithms.losses import (
    aggregate,
    chunked_reference,
    entropy_from_logits,
    kl_penalty,
    ppo_loss,
    token_logprobs_and_entropy,
)
from tests.optional import require

EPS_CLIP, DUAL = 0.2, 3.0


def random_policy_batch(seed, batch=5, length=12):
    rng = np.random.default_rng(seed)
    old = -rng.uniform(0.1, 4.0, (batch, length))
    logp = old + 1.5 * rng.normal(size=(batch, length))  # ratios well outside [0.8, 1.2], some above 3
    adv = rng.normal(size=(batch, length)) * 2.0
    mask = rng.uniform(size=(batch, length)) < 0.7
    mask[-1] = False  # the last row is padding
    return tuple(jnp.asarray(x, jnp.float32 if x.dtype != bool else bool) for x in (logp, old, adv, mask))


def test_ppo_without_dual_clip_equals_rlax_clipped_surrogate_and_its_gradient():
    rlax = require("rlax")
    logp, old, adv, _ = random_policy_batch(0)
    full = jnp.ones_like(logp, dtype=bool)

    def ours(lp):
        return ppo_loss(lp, old, adv, full, clip_eps=EPS_CLIP, dual_clip=None, agg_mode="token-mean")[0]

    def theirs(lp):
        return rlax.clipped_surrogate_pg_loss(jnp.exp(lp - old).ravel(), adv.ravel(), EPS_CLIP)

    both = jax.jit(lambda lp: (ours(lp), theirs(lp), jax.grad(ours)(lp), jax.grad(theirs)(lp)))
    loss, loss_rlax, grad, grad_rlax = both(logp)
    np.testing.assert_allclose(loss, loss_rlax, rtol=1e-6)
    np.testing.assert_allclose(grad, grad_rlax, rtol=1e-5, atol=1e-7)
    assert np.any(np.asarray(grad) == 0) and np.any(np.asarray(grad) != 0)  # clipped and unclipped tokens


def rlax_per_token(logp, old, adv):
    rlax = require("rlax")
    per_token = jax.vmap(lambda r, a: rlax.clipped_surrogate_pg_loss(r[None], a[None], EPS_CLIP))
    return jax.jit(per_token)(jnp.exp(logp - old).ravel(), adv.ravel()).reshape(logp.shape)


@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_dual_clip_caps_rlax_loss_at_c_times_abs_advantage_for_negative_advantages(agg_mode):
    logp, old, adv, mask = random_policy_batch(1)
    reference = rlax_per_token(logp, old, adv)
    reference = np.where(adv < 0, np.minimum(reference, DUAL * np.abs(adv)), reference)
    m = np.asarray(mask, np.float64)
    if agg_mode == "token-mean":
        expected = (reference * m).sum() / m.sum()
    else:
        per_seq = (reference * m).sum(1)
        if agg_mode == "seq-mean-token-mean":
            per_seq = per_seq / np.maximum(m.sum(1), 1)
        expected = per_seq[m.sum(1) > 0].mean()  # the padding row does not count
    loss, metrics = ppo_loss(logp, old, adv, mask, clip_eps=EPS_CLIP, dual_clip=DUAL, agg_mode=agg_mode)
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    assert float(metrics["dual_clip_fraction"]) > 0  # the random batch does exercise the dual clip


def test_dual_clip_and_clip_fraction_by_hand():
    ratio = jnp.array([[1.0, 1.5, 0.5, 1.5, 5.0]])
    adv = jnp.array([[1.0, 1.0, 1.0, -1.0, -1.0]])
    mask = jnp.ones_like(ratio, dtype=bool)
    per_token = [-1.0, -1.2, -0.5, 1.5, 3.0]  # clipped gain, unclipped in the favourable directions, capped
    loss, metrics = ppo_loss(jnp.log(ratio), jnp.zeros_like(ratio), adv, mask)
    np.testing.assert_allclose(loss, np.mean(per_token), rtol=1e-6)
    np.testing.assert_allclose(metrics["clip_fraction"], 1 / 5)
    np.testing.assert_allclose(metrics["dual_clip_fraction"], 1 / 5)
    np.testing.assert_allclose(metrics["approx_kl"], -np.mean(np.log(ratio)), rtol=1e-6)


def test_row_advantages_broadcast_to_tokens_and_masked_tokens_do_not_count():
    logp, old, adv, mask = random_policy_batch(2)
    row_adv = adv[:, 0]
    loss_rows, m_rows = ppo_loss(logp, old, row_adv, mask, entropy=-logp)
    loss_tokens, _ = ppo_loss(logp, old, jnp.broadcast_to(row_adv[:, None], logp.shape), mask)
    np.testing.assert_allclose(loss_rows, loss_tokens, rtol=1e-6)
    garbage = jnp.where(mask, logp, 1e3)  # huge ratios on masked tokens
    np.testing.assert_allclose(ppo_loss(garbage, old, row_adv, mask)[0], loss_rows, rtol=1e-6)
    np.testing.assert_allclose(m_rows["entropy"], (-logp * mask).sum() / mask.sum(), rtol=1e-6)


def test_advantages_are_constants_of_the_loss():
    logp, old, adv, mask = random_policy_batch(3)
    grad = jax.grad(lambda a: ppo_loss(logp, old, a, mask)[0])(adv)
    assert np.all(np.asarray(grad) == 0)


def test_aggregation_modes_by_hand():
    values = jnp.array([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    mask = jnp.array([[1, 1, 1], [1, 0, 0], [0, 0, 0]], bool)
    assert float(aggregate(values, mask, "token-mean")) == pytest.approx(10 / 4)
    assert float(aggregate(values, mask, "seq-mean-token-mean")) == pytest.approx((2 + 4) / 2)
    assert float(aggregate(values, mask, "seq-mean-token-sum")) == pytest.approx((6 + 4) / 2)
    assert float(aggregate(values, jnp.zeros_like(mask), "token-mean")) == 0.0
    with pytest.raises(ValueError, match="unknown aggregation mode"):
        aggregate(values, mask, "token-sum")
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        ppo_loss(values, values, values, mask, dual_clip=0.5)


@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_a_row_of_weight_k_is_k_copies_and_copies_with_advantages_of_one_sign_are_one_row_of_their_mean(
        agg_mode):
    logp, old, _, mask = random_policy_batch(3, batch=4)
    adv = jnp.array([1.5, -2.0, 0.7, 1.0])  # per row; row 3 is padding
    repeat = np.array([3, 1, 2, 1])
    copies = [jnp.repeat(x, repeat, axis=0) for x in (logp, old, mask)]
    # Row 0 three times with advantages 1, 1.5 and 2 (mean 1.5), row 2 twice with 0.2 and 1.2 (mean 0.7).
    copy_adv = jnp.array([1.0, 1.5, 2.0, -2.0, 0.2, 1.2, 1.0])
    weights = jnp.asarray(repeat, jnp.float32)
    kw = dict(clip_eps=EPS_CLIP, dual_clip=DUAL, agg_mode=agg_mode)

    def loss_and_metrics(lp, o, a, m, w=None):
        return ppo_loss(lp, o, a, m, entropy=-lp, row_weights=w, **kw)

    (merged, merged_metrics), grad = jax.value_and_grad(loss_and_metrics, has_aux=True)(
        logp, old, adv, mask, weights)
    (every, every_metrics), every_grad = jax.value_and_grad(loss_and_metrics, has_aux=True)(
        copies[0], copies[1], copy_adv, copies[2])
    assert float(merged) == pytest.approx(float(every), rel=1e-6)
    for key in every_metrics:
        assert float(merged_metrics[key]) == pytest.approx(float(every_metrics[key]), rel=1e-6), key
    summed = jax.ops.segment_sum(every_grad, jnp.repeat(jnp.arange(4), repeat), num_segments=4)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(summed), rtol=1e-5, atol=1e-7)
    values = -logp
    assert float(aggregate(values, mask, agg_mode, weights)) == pytest.approx(
        float(aggregate(jnp.repeat(values, repeat, axis=0), copies[2], agg_mode)), rel=1e-6)
    unweighted = float(aggregate(values, mask, agg_mode))
    assert float(aggregate(values, mask, agg_mode, weights)) != pytest.approx(unweighted)


def test_kl_estimators_follow_their_formulas():
    logp = jnp.array([-1.0, -2.0, -0.5, -30.0])
    ref = jnp.array([-1.5, -1.0, -0.5, -1.0])
    d = np.asarray(logp - ref, np.float64)
    np.testing.assert_allclose(kl_penalty(logp, ref, "k1"), d, rtol=1e-6)
    np.testing.assert_allclose(kl_penalty(logp, ref, "mse"), 0.5 * d**2, rtol=1e-6)
    k3 = np.clip(np.exp(-d) - (-d) - 1, -10, 10)
    np.testing.assert_allclose(kl_penalty(logp, ref, "k3"), k3, rtol=1e-6)
    assert float(kl_penalty(logp, ref, "low_var_kl")[-1]) == 10.0  # clamped
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_penalty(logp, ref, "k4")


def test_k3_has_finite_gradients_even_for_huge_log_ratios():
    grad = jax.grad(lambda lp: kl_penalty(lp, jnp.zeros(3), "k3").sum())(jnp.array([-500.0, 500.0, 0.1]))
    assert np.all(np.isfinite(grad))


def test_kl_estimators_match_the_closed_form_kl_in_expectation():
    rng = np.random.default_rng(4)
    p = jax.nn.log_softmax(jnp.asarray(rng.normal(size=11) * 0.5, jnp.float32))
    q = jax.nn.log_softmax(jnp.asarray(rng.normal(size=11) * 0.5, jnp.float32))  # no k3 clamping
    prob = np.exp(np.asarray(p, np.float64))
    exact = float(np.sum(prob * (np.asarray(p, np.float64) - np.asarray(q, np.float64))))  # KL(π‖π_ref)
    # Exact expectation under π over all outcomes: k1 and k3 are unbiased.
    assert float(jnp.sum(jnp.exp(p) * kl_penalty(p, q, "k1"))) == pytest.approx(exact, rel=1e-5)
    assert float(jnp.sum(jnp.exp(p) * kl_penalty(p, q, "k3"))) == pytest.approx(exact, rel=1e-5)
    # k2 agrees to second order for nearby policies.
    near = jax.nn.log_softmax(p + 0.05 * jnp.asarray(rng.normal(size=11), jnp.float32))
    exact_near = float(jnp.sum(jnp.exp(p) * (p - near)))
    assert float(jnp.sum(jnp.exp(p) * kl_penalty(p, near, "k2"))) == pytest.approx(exact_near, rel=0.05)


# ------------------------------------------------------------------------------------------------
# Chunked log-probs

B, T, H, V, CHUNK = 2, 11, 8, 64, 4  # T is not a multiple of the chunk


def lm_inputs(seed, constrained=False):
    rng = np.random.default_rng(seed)
    hidden = rng.normal(size=(B, T, H)).astype(np.float32)
    weight = (rng.normal(size=(H, V)) * 0.5).astype(np.float32)
    targets = rng.integers(0, V, (B, T)).astype(np.int32)
    allowed = None
    if constrained:
        allowed = rng.uniform(size=(B, T, V)) < 0.3
        np.put_along_axis(allowed, targets[..., None], True, axis=-1)
        allowed = jnp.asarray(allowed)
    return jnp.asarray(hidden), jnp.asarray(weight), jnp.asarray(targets), allowed


@jax.jit
def dense_reference(hidden, weight, targets, temperature=1.0, allowed=None):
    """The whole [B, T, V] logits at once, with true −inf for forbidden tokens."""
    logits = hidden @ weight / temperature
    if allowed is None:
        allowed = jnp.ones(logits.shape, bool)
    logp_all = jax.nn.log_softmax(jnp.where(allowed, logits, -jnp.inf), axis=-1)
    logp = jnp.take_along_axis(logp_all, targets[..., None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp_all) * jnp.where(allowed, logp_all, 0.0), axis=-1)
    return logp, entropy


@pytest.mark.parametrize("constrained", [False, True])
def test_chunked_logprobs_and_entropy_equal_the_dense_log_softmax(constrained):
    hidden, weight, targets, allowed = lm_inputs(5, constrained)
    logp, entropy = token_logprobs_and_entropy(hidden, weight, targets, chunk_size=CHUNK, temperature=0.7,
                                               allowed=allowed)
    ref_logp, ref_entropy = dense_reference(hidden, weight, targets, 0.7, allowed)
    np.testing.assert_allclose(logp, ref_logp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(entropy, ref_entropy, rtol=1e-5, atol=1e-5)
    if not constrained:
        dense_entropy = jax.jit(entropy_from_logits)(hidden @ weight / 0.7)
        np.testing.assert_allclose(entropy, dense_entropy, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("constrained", [False, True])
def test_chunked_logprobs_have_the_dense_gradients(constrained):
    hidden, weight, targets, allowed = lm_inputs(6, constrained)
    k = jax.random.normal(jax.random.key(7), (2, B, T))

    def objective(fn):
        def f(h, w):
            logp, entropy = fn(h, w)
            return jnp.sum(k[0] * logp) + jnp.sum(k[1] * entropy)
        return jax.jit(jax.grad(f, argnums=(0, 1)))

    chunked = objective(
        lambda h, w: token_logprobs_and_entropy(h, w, targets, chunk_size=CHUNK, allowed=allowed))
    dense = objective(lambda h, w: dense_reference(h, w, targets, 1.0, allowed))
    for got, want in zip(chunked(hidden, weight), dense(hidden, weight)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("constrained", [False, True])
def test_hand_written_head_gradient_equals_autodiff_of_the_checkpointed_chunks(constrained):
    """The fast path (one elementwise pass for the logit cotangent) against the simple one (autodiff
    through the rematerialised log-softmax, entropy and gather), at a temperature != 1 and with a
    padded last chunk."""
    hidden, weight, targets, allowed = lm_inputs(10, constrained)
    k = jax.random.normal(jax.random.key(11), (2, B, T))

    def value_and_grads(fn):
        def f(h, w):
            logp, entropy = fn(h, w, targets, chunk_size=CHUNK, temperature=0.7, allowed=allowed)
            return jnp.sum(k[0] * logp) + jnp.sum(k[1] * entropy)
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(hidden, weight)

    (fast_value, fast_grads), (ref_value, ref_grads) = (value_and_grads(token_logprobs_and_entropy),
                                                        value_and_grads(chunked_reference))
    np.testing.assert_allclose(fast_value, ref_value, rtol=1e-5)
    for got, want in zip(fast_grads, ref_grads):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def _largest_float_intermediate(jaxpr) -> int:
    largest = 0
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            aval = var.aval
            if hasattr(aval, "shape") and jnp.issubdtype(aval.dtype, jnp.floating):
                largest = max(largest, int(np.prod(aval.shape)))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):  # jax.core's was removed in jax 0.11
            largest = max(largest, _largest_float_intermediate(sub))
    return largest


def test_full_logits_never_exist_forward_or_backward():
    hidden, weight, targets, allowed = lm_inputs(8, constrained=True)

    def loss(h, w):
        logp, entropy = token_logprobs_and_entropy(h, w, targets, chunk_size=CHUNK, allowed=allowed)
        return logp.sum() + entropy.sum()

    forward = jax.make_jaxpr(loss)(hidden, weight).jaxpr
    backward = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(hidden, weight).jaxpr
    chunk_logits = B * CHUNK * V
    assert _largest_float_intermediate(forward) == chunk_logits
    assert _largest_float_intermediate(backward) == chunk_logits < B * T * V


def test_a_position_with_no_allowed_token_stays_finite():
    hidden, weight, targets, allowed = lm_inputs(9, constrained=True)
    allowed = allowed.at[0, 3].set(False)  # e.g. a padding position of a finished automaton


    def total(h):
        logp, entropy = token_logprobs_and_entropy(h, weight, targets, chunk_size=CHUNK, allowed=allowed)
        return (logp + entropy).sum(), (logp, entropy)

    grads, (logp, entropy) = jax.jit(jax.grad(total, has_aux=True))(hidden)
    assert np.all(np.isfinite(logp)) and np.all(np.isfinite(entropy)) and np.all(np.isfinite(grads))
