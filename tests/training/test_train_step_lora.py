"""The train step under LoRA (``StepConfig.adapters_only``): only the adapters get gradients and
optimizer state, the frozen base leaves the step bit-identical, and the KL reference (adapters off)
is the base model."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from mage_jax import compile_report
from mage_jax.algorithms.schedules import learning_rate_schedule
from mage_jax.models import lora
from mage_jax.models import sharding as shd
from mage_jax.models.config import ModelConfig
from mage_jax.models.transformer import Transformer
from mage_jax.training.train_step import StepConfig, TrainBatch, make_optimizer, shared_train_step
from tests.training.test_train_step import V, batch

BASE = ModelConfig.preset("tiny", vocab_size=V, hidden_size=16, intermediate_size=32, num_layers=2,
                          num_heads=2, num_kv_heads=1, head_dim=8)
TARGETS = ("q_proj", "v_proj", "down_proj")


@pytest.fixture(scope="module", params=["none", "full"])
def model(request):
    """Without and with rematerialised blocks (a transform over the model's variables)."""
    config = dataclasses.replace(BASE, lora_rank=2, lora_alpha=4.0, lora_targets=TARGETS, remat=request.param)
    mesh = shd.make_mesh(shd.MeshConfig(data=1, fsdp=1, tensor=1))
    graphdef, params = shd.init_sharded(config, mesh, seed=0)
    return mesh, graphdef, params


def make_step(mesh, graphdef, **kwargs):
    """The process's shared step of these settings (its programs compile once)."""
    schedule = learning_rate_schedule(1e-2)
    tx = make_optimizer(schedule, b1=0.9, b2=0.999, weight_decay=0.1, grad_clip=1.0)
    return shared_train_step(graphdef, tx, schedule, StepConfig(chunk_size=5, **kwargs), mesh)


@pytest.fixture(scope="module")
def step(model):
    mesh, graphdef, _ = model
    return make_step(mesh, graphdef, kl_coef=0.1, adapters_only=True)


def flat(tree):
    return {shd.path_to_str(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def trained_state(step, params, updates=2, micro_batch_rows=0):
    state = step.init_state(jax.device_put(params, may_alias=False))
    b = batch()
    old = np.asarray(step.compute_logprobs(state.params, step.place_batch(TrainBatch(**b))))
    b.update(old_logprobs=old, ref_logprobs=old, advantages=np.array([1.0, 1.0, -1.0, 0.0], np.float32))
    for _ in range(updates):
        state, metrics = step.update(state, step.place_batch(TrainBatch(**b)))
        assert float(metrics["skipped"]) == 0.0
    return state


def test_a_step_changes_only_the_adapters_and_leaves_the_base_bit_identical(model, step):
    _, _, params = model
    before = flat(params)
    after = flat(trained_state(step, params).params)
    assert before.keys() == after.keys()
    changed = sorted(p for p in before if not np.array_equal(before[p], after[p]))
    # A (random) and B (zero) both move once B is non-zero; weight decay touches no base leaf.
    assert changed == sorted(p for p in before if "/lora/" in p)
    assert len(changed) == 2 * len(TARGETS) * BASE.num_layers


def test_micro_batched_gradients_also_touch_only_the_adapters(model):
    mesh, graphdef, params = model
    step = make_step(mesh, graphdef, adapters_only=True, micro_batch_rows=2)
    before, after = flat(params), flat(trained_state(step, params, updates=1).params)
    assert sorted(p for p in before if not np.array_equal(before[p], after[p])) == sorted(
        p for p in before if "/lora/" in p)


def test_the_optimizer_state_holds_only_adapter_leaves(model, step):
    _, _, params = model
    state = step.init_state(jax.device_put(params, may_alias=False))
    arrays = {p: x for p, x in flat(state.opt_state).items() if np.ndim(x) > 0}
    adapters = flat(lora.split_adapters(params)[0])
    # AdamW's two moments mirror exactly the adapters; no moment of any base matrix exists.
    assert len(arrays) == 2 * len(adapters)
    assert all("/lora/lora_" in p for p in arrays)
    assert sum(x.size for x in arrays.values()) == 2 * sum(x.size for x in adapters.values())
    full = make_step(*model[:2]).init_state(jax.device_put(params, may_alias=False))  # full fine-tuning
    assert sum(np.size(x) for x in jax.tree.leaves(full.opt_state)) > 10 * sum(
        x.size for x in arrays.values())


def test_reference_logprobs_with_adapters_off_are_the_base_models(model, step):
    mesh, graphdef, params = model
    state = trained_state(step, params, updates=3)
    placed = step.place_batch(TrainBatch(**batch(1)))
    policy = np.asarray(step.compute_logprobs(state.params, placed))
    counter = compile_report.counter()
    compiled_before = counter.snapshot()
    reference = np.asarray(step.compute_logprobs(state.params, placed, adapters=False))
    assert (counter.snapshot() - compiled_before).programs == 0  # the policy's program, adapters off
    # The base model: a graph without adapters, fed the trained state's base leaves.
    plain_graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(BASE, rngs=nnx.Rngs(0))))[0]
    plain = make_step(mesh, plain_graphdef)
    base = plain.compute_logprobs(lora.split_adapters(state.params)[1], placed)
    np.testing.assert_allclose(reference, np.asarray(base), atol=1e-6, rtol=0)
    # ... and the initial model (B = 0); the policy with its trained adapters differs.
    initial = np.asarray(step.compute_logprobs(params, placed))
    np.testing.assert_allclose(reference, initial, atol=1e-6, rtol=0)
    assert np.abs(policy - reference).max() > 1e-3


def test_adapters_only_without_adapters_is_refused(model):
    mesh, _, _ = model
    graphdef, params = shd.init_sharded(BASE, mesh, seed=0)
    with pytest.raises(ValueError, match="adapters_only needs a model with LoRA adapters"):
        make_step(mesh, graphdef, adapters_only=True).init_state(params)
