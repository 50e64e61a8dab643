"""Learning-rate schedules of the optimisation (docs/method.md §5): the per-step warm-up schedule the
optimizer follows and the per-iteration decay multiplier the trainer applies on top of it.

They live with the algorithms (not with the jitted step) so that ``mage_jax.config`` can name the
allowed decays without importing the training stack.
"""

from __future__ import annotations

import functools

import numpy as np
import optax

LR_DECAYS = ("constant", "linear", "cosine")


@functools.cache
def learning_rate_schedule(lr: float, warmup_steps: int = 0) -> optax.Schedule:
    """Constant ``lr`` (the paper), after an optional linear warm-up. One function object per setting
    (cached): the train step's programs are shared by identity of their schedule
    (``training.train_step.shared_train_step``)."""
    if warmup_steps <= 0:
        return optax.constant_schedule(lr)
    return optax.join_schedules(
        [optax.linear_schedule(0.0, lr, warmup_steps), optax.constant_schedule(lr)], [warmup_steps]
    )


def lr_decay(kind: str, progress: float, end_fraction: float = 0.0) -> float:
    """Multiplier of the learning rate at ``progress`` in [0, 1] of the run: constant, linear or cosine
    decay from 1 to ``end_fraction``."""
    progress = min(max(float(progress), 0.0), 1.0)
    if kind == "constant":
        return 1.0
    if kind == "linear":
        shape = 1.0 - progress
    elif kind == "cosine":
        shape = 0.5 * (1.0 + float(np.cos(np.pi * progress)))
    else:
        raise ValueError(f"unknown learning-rate decay {kind!r}; expected constant, linear or cosine")
    return end_fraction + (1.0 - end_fraction) * shape
