"""The training loop (``Trainer.run``) with fake collaborators: a scripted iteration that adds 1 to a
one-number model, an evaluator whose validation score is a table of that number, an in-memory logger
and in-memory checkpointers. It specifies the cadences and the bookkeeping, not the iteration's maths
(``evaluation/test_training_metrics.py`` and the end-to-end experiment tests do that)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import pytest

from mage_jax import config as C
from mage_jax.evaluation.evaluator import SplitResult
from mage_jax.training.train_step import TrainState
from mage_jax.training.trainer import Trainer


class FakeStep:
    config = None

    def init_state(self, params: Any) -> TrainState:
        return TrainState(params=params, opt_state=(), step=jnp.int32(0))


class FakeTasks:
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Any) -> None:
        pass


@dataclasses.dataclass
class FakeParts:
    cfg: C.ExperimentConfig
    init_params: Any = dataclasses.field(default_factory=lambda: {"w": jnp.float32(0.0)})
    task_sampler: FakeTasks = dataclasses.field(default_factory=FakeTasks)

    def train_step(self) -> FakeStep:
        return FakeStep()


def split(payoff: float) -> SplitResult:
    return SplitResult(metrics={"curves": {"payoff": [payoff]}, "num_meta_episodes": 1}, reference=None)


class FakeEvaluator:
    """Validation payoff: ``scores[w]`` of the model's number ``w``; records what it measured."""

    def __init__(self, scores: dict[int, float]):
        self.scores, self.validated, self.evaluated = scores, [], []

    def validate(self, params: Any, key: Any) -> SplitResult:
        self.validated.append(int(params["w"]))
        return split(self.scores[int(params["w"])])

    def evaluate(self, params: Any, key: Any, *, heldout: bool, stop: Any) -> dict[str, SplitResult]:
        self.evaluated.append(int(params["w"]))
        return {"eval": split(float(params["w"]))}


class FakeLogger:
    def __init__(self):
        self.records: list[tuple[str, int]] = []
        self.rewound: tuple[int, bool] | None = None
        self.closed = False

    def log(self, iteration: int, metrics: Any, *, split: str = "train") -> None:
        self.records.append((split, iteration))

    def log_samples(self, *args: Any, **kwargs: Any) -> None:
        pass

    def rewind(self, iteration: int, *, keep_evaluations: bool = True) -> None:
        self.rewound = (iteration, keep_evaluations)

    def close(self) -> None:
        self.closed = True

    def iterations(self, split: str) -> list[int]:
        return [i for s, i in self.records if s == split]


class FakeCheckpointer:
    """In memory; like ``Checkpointer`` an existing step is kept as it is."""

    directory = "memory"

    def __init__(self, every: int = 0):
        self.every, self.saved, self.closed = every, {}, False

    def latest_step(self) -> int | None:
        return max(self.saved, default=None)

    def all_steps(self) -> list[int]:
        return sorted(self.saved)

    def should_save(self, iteration: int) -> bool:
        return self.every > 0 and iteration % self.every == 0

    def save(self, iteration: int, state: Any, meta: Any) -> bool:
        if iteration in self.saved:
            return False
        self.saved[iteration] = (state, dict(meta))
        return True

    def restore(self, template: Any, step: int | None = None) -> tuple[Any, dict[str, Any]]:
        return self.saved[self.latest_step() if step is None else step]

    def delete(self, step: int) -> None:
        del self.saved[step]

    def close(self) -> None:
        self.closed = True


class ScriptedTrainer(Trainer):
    def train_iteration(self, iteration: int) -> dict[str, float]:
        self.state = self.state.replace(params={"w": self.state.params["w"] + 1.0})
        return {"consecutive_skips_max": 0.0, "success@last": 0.0, "payoff@last": 0.0, "entropy": 0.0,
                "approx_kl": 0.0}


def make(tmp_path, *, iterations: int, validate_every: int = 0, eval_every: int = 0, every: int = 0,
         scores: dict[int, float] | None = None, resume: bool = False, checkpointer=None):
    cfg = C.apply_overrides(C.ExperimentConfig(), {
        "logging.run_dir": str(tmp_path), "logging.progress": False, "optim.kl_coef": 0.0,
        "train.iterations": iterations, "train.validate_every": validate_every,
        "train.eval_every": eval_every, "checkpoint.every": every})
    logger, evaluator = FakeLogger(), FakeEvaluator(scores or {})
    checkpointer = checkpointer or FakeCheckpointer(every)
    best = FakeCheckpointer() if validate_every else None
    trainer = ScriptedTrainer(FakeParts(cfg), evaluator, logger=logger, checkpointer=checkpointer,
                              best_checkpointer=best, resume=resume)
    return trainer, logger, evaluator, checkpointer, best


def test_validation_keeps_the_best_state_and_the_final_evaluation_measures_it(tmp_path):
    trainer, logger, evaluator, checkpointer, best = make(
        tmp_path, iterations=6, validate_every=2, every=3, scores={2: 0.1, 4: 0.5, 6: 0.3})
    result = trainer.run()
    assert (result.status, result.iteration, result.selected_iteration) == ("finished", 6, 4)
    assert logger.iterations("train") == [1, 2, 3, 4, 5, 6]  # one record per iteration
    assert evaluator.validated == [2, 4, 6] and logger.iterations("validation") == [2, 4, 6]
    assert best.all_steps() == [2, 4] and int(best.saved[4][0].params["w"]) == 4
    assert evaluator.evaluated == [4] and logger.iterations("eval") == [6]  # the kept state, logged at 6
    # The cadence (3, 6) and every improvement (2, 4): a resumed run always finds its best state on disk.
    assert checkpointer.all_steps() == [2, 3, 4, 6]
    assert checkpointer.saved[4][1]["best"] == [4, 0.5]
    assert logger.closed and checkpointer.closed and best.closed


def test_evaluation_runs_every_k_iterations_and_once_at_the_end(tmp_path):
    trainer, logger, evaluator, checkpointer, _ = make(tmp_path, iterations=5, eval_every=2)
    result = trainer.run()
    assert result.selected_iteration is None and result.final["eval"].metrics["curves"]["payoff"] == [5.0]
    assert evaluator.evaluated == [2, 4, 5] and logger.iterations("eval") == [2, 4, 5]
    assert checkpointer.all_steps() == [5]  # checkpoint.every=0: only at the end


def test_a_resumed_run_continues_after_the_checkpoint_and_rewinds_the_log(tmp_path):
    first, _, _, checkpointer, _ = make(tmp_path, iterations=3, every=1)
    first.run()
    trainer, logger, evaluator, _, _ = make(tmp_path, iterations=5, every=1, resume=True,
                                            checkpointer=checkpointer)
    assert trainer.start_iteration == 3 and logger.rewound == (3, True)
    trainer.run()
    assert logger.iterations("train") == [4, 5] and evaluator.evaluated == [5]


def test_validation_and_the_best_state_checkpointer_come_together(tmp_path):
    with pytest.raises(ValueError, match="best-state checkpointer"):
        cfg = C.apply_overrides(C.ExperimentConfig(), {"logging.run_dir": str(tmp_path),
                                                       "train.validate_every": 2})
        ScriptedTrainer(FakeParts(cfg), FakeEvaluator({}), logger=FakeLogger(),
                        checkpointer=FakeCheckpointer())
