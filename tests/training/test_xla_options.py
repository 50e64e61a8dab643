"""The train step's XLA compile options: chosen per platform in one place, in effect in the step's
programs (the fused update and its halves), and numerically the default compile's result."""

from __future__ import annotations

import jax
import numpy as np

from mage_jax.training.train_step import TrainBatch
from mage_jax.training.xla_options import CPU_OPTIONS, train_step_compiler_options

from .test_train_step import batch, make_step, model  # noqa: F401  (model is a fixture)


def test_cpu_turns_library_fusions_off_and_other_platforms_keep_the_defaults():
    assert train_step_compiler_options("cpu") == {"xla_cpu_experimental_ynn_fusion_type": ""} == CPU_OPTIONS
    assert train_step_compiler_options("gpu") is None and train_step_compiler_options("tpu") is None


def test_step_programs_compile_with_the_options_and_equal_the_default_compile(model):  # noqa: F811
    _, mesh, _, params = model
    # test_train_step.py's settings: its update program is this process's (or the persistent cache's).
    step = make_step(model, kl_coef=0.1, constraint_len=4)
    b = batch()
    zeros = np.zeros_like(b["targets"], np.float32)
    b.update(old_logprobs=zeros, ref_logprobs=zeros, advantages=np.array([1.0, -1.0, 0.5, 0.0], np.float32))
    placed = step.place_batch(TrainBatch(**b))
    state = step.init_state(jax.device_put(params, may_alias=False))
    shardings = step.state_shardings(state)
    grads_program, _ = step.update_programs(shardings)
    default = jax.jit(step._grads_fn)  # the gradient half, compiled with XLA's defaults
    with jax.set_mesh(mesh):
        update = step.update_program(shardings).lower(state, placed, np.float32(1.0)).compile()
        ours = grads_program.lower(params, placed).compile()
        plain = default.lower(params, placed).compile()
        got, want = ours(params, placed), plain(params, placed)
    assert "ynn_fusion" in plain.as_text()
    assert "ynn_fusion" not in ours.as_text() and "ynn_fusion" not in update.as_text()
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-7)
