"""Ahead-of-time lowering of the programs a run executes, for memory plans (``experiments/plan.py``).

Every function takes the pieces the trainer builds (``training.assemble``: the train step, the sampler,
the rollout engine) and *abstract* parameters (``jax.ShapeDtypeStruct`` leaves carrying their
shardings), and returns a ``jax.stages.Lowered`` of the very program the run jits; ``.compile()`` then
gives XLA's memory and cost analysis per device without allocating anything:

* ``lower_train_update``: the update ``TrainStep.update`` runs: loss, gradients and the optimizer step
  of one mini-batch in one program (state donated);
* ``lower_train_grads`` and ``lower_train_apply``: its two halves as programs of their own, the
  loss-and-gradient program and the optimizer step (state donated). The memory plan sizes these: each
  part's need is visible, and the fused program needs no more than the larger (a test checks it);
* ``lower_logprobs``: the old / reference log-prob recompute (``TrainStep.compute_logprobs``);
* ``lower_rollout``: the rollout's generation programs: the engine's ``insert`` (prefill of every slot
  at the longest prompt bucket) and ``decode`` (one chunk of every slot over the whole cache), or with
  ``rollout.engine=lockstep`` the lockstep sampler's program for its largest call.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from mage_jax.generate.sampler import Sampler
from mage_jax.generate.slots import CompiledSlotPrograms
from mage_jax.generate.step import SamplingParams
from mage_jax.models.sharding import replicated, rows_sharding
from mage_jax.training.train_step import TrainBatch, TrainState, TrainStep


def abstract_rows(mesh: Any, shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
    """An abstract array placed as ``TrainStep.place_batch`` places rows: over the batch axes when they
    divide them, else replicated."""
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=rows_sharding(mesh, shape[0], len(shape)))


def abstract_train_batch(step: TrainStep, rows: int, length: int, *, update: bool) -> TrainBatch:
    """``TrainBatch.abstract`` of ``rows`` x ``length`` placed as ``TrainStep.place_batch`` places rows
    (``update``: as ``update`` receives it, with the reference log-probs when the KL term is on)."""
    return TrainBatch.abstract(rows, length, update=update, reference=step.config.kl_coef > 0,
                               sharding=lambda shape: abstract_rows(step.mesh, shape, jnp.int32).sharding)


def _update_programs(step: TrainStep, params: Any, opt_state: Any) -> tuple[Any, Any]:
    return step.update_programs(step.state_shardings(TrainState(params, opt_state, None)))


def lower_train_update(step: TrainStep, params: Any, opt_state: Any, rows: int,
                       length: int) -> jax.stages.Lowered:
    """The update program of a mini-batch of ``rows`` x ``length`` (``TrainStep.update_program``): what
    a training step runs."""
    state = TrainState(params, opt_state, jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated(step.mesh)))
    program = step.update_program(step.state_shardings(state))
    with jax.set_mesh(step.mesh):
        return program.lower(state, abstract_train_batch(step, rows, length, update=True),
                             jax.ShapeDtypeStruct((), jnp.float32))


def lower_train_grads(step: TrainStep, params: Any, opt_state: Any, rows: int,
                      length: int) -> jax.stages.Lowered:
    """The loss-and-gradient program of a mini-batch of ``rows`` x ``length``: the update's first half."""
    grads, _ = _update_programs(step, params, opt_state)
    with jax.set_mesh(step.mesh):
        return grads.lower(params, abstract_train_batch(step, rows, length, update=True))


def lower_train_apply(step: TrainStep, params: Any, opt_state: Any, rows: int) -> jax.stages.Lowered:
    """The optimizer step (the state donated): the update's second half."""
    grads_program, apply = _update_programs(step, params, opt_state)
    one = replicated(step.mesh)
    state = TrainState(params, opt_state, jax.ShapeDtypeStruct((), jnp.int32, sharding=one))
    with jax.set_mesh(step.mesh):
        grads, metrics = jax.eval_shape(grads_program, params,
                                        abstract_train_batch(step, rows, 8, update=True))
    trainable = step.trainable(params)[0]  # every parameter, or the LoRA adapters only
    grads = jax.tree.map(lambda g, p: jax.ShapeDtypeStruct(g.shape, g.dtype, sharding=p.sharding), grads,
                         trainable)
    metrics = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one), metrics)
    return apply.lower(state, grads, metrics, jax.ShapeDtypeStruct((), jnp.float32))


def lower_logprobs(step: TrainStep, params: Any, rows: int, length: int) -> jax.stages.Lowered:
    """The old / reference log-prob recompute of ``rows`` x ``length``, as ``compute_logprobs`` runs it."""
    with jax.set_mesh(step.mesh):
        return step.logprobs_program().lower(params, abstract_train_batch(step, rows, length, update=False),
                                             True)


def lower_rollout(sampler: Sampler | None, programs: CompiledSlotPrograms | None, params: Any,
                  sampling: SamplingParams) -> dict[str, jax.stages.Lowered]:
    """The rollout's generation programs at their largest shapes, by name: the engine's slot programs'
    ``insert`` (its one shape, ``insert_rows`` slots per device prefilled from prompts of the longest
    prompt bucket) and ``decode`` (a chunk of every slot over the whole cache); without them the
    ``lockstep`` sampler's largest call."""
    if programs is not None:
        return {
            "insert": programs.lower_insert(params, sampling, prompt_len=programs.spec.prompt_buckets[-1]),
            "decode": programs.lower_decode(params, sampling),
        }
    if sampler is None:
        raise ValueError("lower_rollout needs the engine's slot programs or the lockstep sampler")
    rows, prompt = sampler.batch_buckets[-1], sampler.spec.prompt_buckets[-1]
    return {"lockstep": sampler.lower(params, sampling, rows=rows, prompt_len=prompt)}
