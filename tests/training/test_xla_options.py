"""The train step's XLA compile options: chosen per platform in one place, in effect in the step's
(fused update) program, and numerically the default compile's result."""

from __future__ import annotations

import jax
import numpy as np

from mage_jax.training.train_step import TrainBatch
from mage_jax.training.xla_options import CPU_OPTIONS, train_step_compiler_options

from .test_train_step import batch, make_step, model  # noqa: F401  (model is a fixture)


def test_cpu_turns_library_fusions_off_and_other_platforms_keep_the_defaults():
    assert train_step_compiler_options("cpu") == {"xla_cpu_experimental_ynn_fusion_type": ""} == CPU_OPTIONS
    assert train_step_compiler_options("gpu") is None and train_step_compiler_options("tpu") is None


def test_step_gradients_compile_with_the_options_and_equal_the_default_compile(model):  # noqa: F811
    _, mesh, _, params = model
    step = make_step(model)
    b = batch()
    b.update(old_logprobs=np.zeros_like(b["targets"], np.float32), advantages=np.array([1.0, -1.0, 0.5, 0.0],
                                                                                      np.float32))
    placed = step.place_batch(TrainBatch(**b))
    state = step.init_state(jax.device_put(params, may_alias=False))
    default = jax.jit(step._update_fn)  # the same update, compiled with XLA's defaults
    lr_scale = np.float32(1.0)
    with jax.set_mesh(mesh):
        ours = step.update_program(step.state_shardings(state)).lower(state, placed, lr_scale).compile()
        plain = default.lower(state, placed, lr_scale).compile()
        want = plain(state, placed, lr_scale)
        got = ours(state, placed, lr_scale)  # donates the state: last
    assert "ynn_fusion" in plain.as_text() and "ynn_fusion" not in ours.as_text()
    (got_state, got_metrics), (want_state, want_metrics) = got, want
    for name in want_metrics:  # loss, gradient norm, update size, ...
        np.testing.assert_allclose(float(got_metrics[name]), float(want_metrics[name]), rtol=1e-5,
                                   err_msg=name)
    # AdamW divides by the root of the second moment, which magnifies rounding in the step of an entry with
    # a near-zero gradient: parameters agree to a thousandth of the learning rate (1e-2).
    for g, w in zip(jax.tree.leaves(got_state), jax.tree.leaves(want_state), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
