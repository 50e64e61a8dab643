"""Programs are built once per process (``train_step.shared_train_step``): a second run of the main job
with the same model and sizes compiles none of the training programs again."""

from __future__ import annotations

import logging
import re

import jax
import pytest

from experiments import kuhn_poker
from mage_jax.testing import SMOKE, smoke_args

TRAINING_PROGRAMS = {"_update_fn", "_grads_fn", "_apply_fn", "logprobs", "init_fn", "gigpo", "all_finite"}
"""The jit names of the train step, the optimizer's initialisation, the advantage estimator and the
checkpoint's finiteness check."""


def compiled(caplog) -> list[str]:
    """The jit names JAX logged as lowered or compiled (a persistent-cache hit is logged too)."""
    pattern = re.compile(r"(?:Compiling|Finished XLA compilation of) jit\(([^)]*)\)")
    return [m.group(1) for r in caplog.records for m in [pattern.search(r.getMessage())] if m]


@pytest.mark.slow
def test_a_second_run_in_the_process_compiles_no_training_program(tmp_path, caplog):
    # A model size of its own, so no earlier test of this process compiled these programs already.
    args = smoke_args({"model.overrides": {**SMOKE["model.overrides"], "intermediate_size": 48}})
    with jax.log_compiles(True), caplog.at_level(logging.WARNING):
        assert kuhn_poker.main([*args, "--run-dir", str(tmp_path / "first")]) == 0
        first = compiled(caplog)
        caplog.clear()
        assert kuhn_poker.main([*args, "--run-dir", str(tmp_path / "second")]) == 0
        second = compiled(caplog)
    assert [n for n in second if n in TRAINING_PROGRAMS] == []
    # The first run compiled them (the advantage estimator's shape is not the model's: another test
    # may have compiled it first; the smoke run's one update of one mini-batch recomputes no log-probs).
    assert {"_update_fn", "init_fn", "all_finite"} <= set(first)
