"""Learning-rate schedules: the optimizer's warm-up schedule and the trainer's per-iteration decay."""

from __future__ import annotations

import pytest

from mage_jax.algorithms.schedules import LR_DECAYS, learning_rate_schedule, lr_decay


def test_the_schedule_is_constant_without_warm_up():
    schedule = learning_rate_schedule(1e-3)
    assert float(schedule(0)) == pytest.approx(1e-3) and float(schedule(1000)) == pytest.approx(1e-3)


def test_the_warm_up_rises_linearly_from_zero_then_holds():
    schedule = learning_rate_schedule(1e-3, warmup_steps=4)
    assert float(schedule(0)) == 0.0
    assert float(schedule(2)) == pytest.approx(5e-4)
    assert float(schedule(4)) == pytest.approx(1e-3) and float(schedule(100)) == pytest.approx(1e-3)


def test_lr_decay_runs_from_one_to_the_end_fraction():
    assert LR_DECAYS == ("constant", "linear", "cosine")
    assert lr_decay("constant", 0.7) == 1.0
    assert lr_decay("linear", 0.0) == 1.0 and lr_decay("linear", 1.0, 0.1) == pytest.approx(0.1)
    assert lr_decay("cosine", 0.5) == pytest.approx(0.5)
    assert lr_decay("cosine", 1.0, 0.05) == pytest.approx(0.05)
    with pytest.raises(ValueError, match="unknown learning-rate decay"):
        lr_decay("step", 0.5)
