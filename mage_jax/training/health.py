"""When a run cannot make progress: the checks that stop it with one line (``TrainingStopped``).

A run stops (exit 3, docs/preemption.md) when sampling gave non-finite log-probs (the parameters
diverged), when every row of an iteration is invalid (every advantage would be the same penalty: nothing
to train on) or after ``optim.max_skipped_updates`` consecutive skipped updates. Each message names the
settings to change and the last checkpoint (``last_checkpoint``: a callable, read only when stopping).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from mage_jax import config as C
from mage_jax.rollout.rows import Row


class TrainingStopped(RuntimeError):
    """The run cannot make progress (updates keep being skipped, or an iteration has no valid row); the
    message is one line, and nothing after the last good checkpoint was saved."""


def all_invalid(cfg: C.ExperimentConfig, rows: Sequence[Row]) -> bool:
    """The iteration has rows, none valid, and the run is set to stop on that."""
    return bool(rows) and cfg.train.stop_when_all_invalid and not any(row.valid for row in rows)


def check_rows(cfg: C.ExperimentConfig, iteration: int, rows: Sequence[Row], *, samples_path: str | None,
               last_checkpoint: Callable[[], str]) -> None:
    """Stop on non-finite sampling log-probs, or when no row of the iteration is valid
    (``samples_path``: where the iteration's samples were written, None: nowhere)."""
    if any(not np.isfinite(row.logprobs).all() for row in rows):
        raise TrainingStopped(
            f"sampling iteration {iteration} gave non-finite log-probabilities: the parameters diverged "
            f"(lower optim.lr); {last_checkpoint()}")
    if not all_invalid(cfg, rows):
        return
    truncated = sum(row.truncated for row in rows)
    overflow = sum(row.overflow for row in rows)
    r = cfg.rollout
    hints = [] if r.constrained_actions else ["--rollout.constrained_actions true"]
    hints.append(f"a longer --rollout.max_response_tokens (now {r.max_response_tokens})")
    samples = f"; what the model wrote is in {samples_path}" if samples_path else ""
    raise TrainingStopped(
        f"every one of the {len(rows)} rows of iteration {iteration} is invalid ({truncated} truncated "
        f"at rollout.max_response_tokens={r.max_response_tokens}, {overflow} over "
        f"rollout.max_prompt_tokens={r.max_prompt_tokens}, the rest unparsable): nothing to train on; "
        f"try {' or '.join(hints)}{samples}; {last_checkpoint()}")


def check_skips(cfg: C.ExperimentConfig, iteration: int, longest: int, *,
                last_checkpoint: Callable[[], str]) -> None:
    """Stop after ``optim.max_skipped_updates`` consecutive skipped updates (``longest`` so far)."""
    limit = cfg.optim.max_skipped_updates
    if limit > 0 and longest >= limit:
        raise TrainingStopped(
            f"{longest} consecutive updates were skipped by iteration {iteration} (non-finite loss, "
            f"gradients or parameters, or larger than optim.max_update_ratio="
            f"{cfg.optim.max_update_ratio:g} times the parameters; optim.max_skipped_updates="
            f"{limit}): lower optim.lr or check the inputs; {last_checkpoint()}")
