"""Stop requests inside an iteration's PPO updates and inside an evaluation, through the main job's
command line: the last complete state is saved at once, the run exits 75, and ``--resume`` ends with the
metrics of a run that was never interrupted (on CPU, bit-identical)."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from experiments import kuhn_poker
from experiments.common import EXIT_INTERRUPTED
from mage_jax.evaluation.evaluator import Evaluator
from mage_jax.logging import read_jsonl
from mage_jax.rollout.policy import LLMPolicy
from mage_jax.training import trainer as trainer_module
from mage_jax.training.train_step import TrainStep
from tests.experiments.conftest import comparable

RUN = {"train.iterations": 3, "train.eval_every": 2, "checkpoint.every": 0, "optim.mini_batch_rows": 1}
"""One-row mini-batches (an update per row: four or more per iteration), an evaluation after iteration 2."""


@pytest.fixture(scope="module")
def reference(tmp_path_factory, request):
    """One uninterrupted run of ``RUN``: (run directory, its command-line arguments)."""
    request.getfixturevalue("compilation_cache")
    from mage_jax.testing import smoke_args

    run_dir = tmp_path_factory.mktemp("preemption") / "run"
    args = smoke_args(RUN)
    assert kuhn_poker.main([*args, "--run-dir", str(run_dir)]) == 0
    records = read_jsonl(str(run_dir))
    splits = [(r["iteration"], r["split"]) for r in records]
    assert splits == [(1, "train"), (2, "train"), (2, "eval"), (3, "train"), (3, "validation"), (3, "eval"),
                      (3, "heldout")]
    assert all(r["updates"] >= 3 for r in records if r["split"] == "train")
    return run_dir, args


def checkpoint_meta(run_dir, step):
    return json.loads((run_dir / "checkpoints" / str(step) / "meta" / "metadata").read_text())


def sigterm_after_second_update_of_iteration_2(monkeypatch) -> dict:
    """Hook the trainer so that SIGTERM is sent right after iteration 2's second PPO update; returns what
    the hooks see: ``updates`` (each update's ``donate`` flag in iteration 2) and ``sent`` (when)."""
    original_iteration, original_update = trainer_module.Trainer.train_iteration, TrainStep.update
    seen = {"iteration": 0, "updates": [], "sent": None}

    def train_iteration(self, iteration):
        seen["iteration"] = iteration
        return original_iteration(self, iteration)

    def update(self, state, batch, lr_scale=1.0, *, donate=True):
        if seen["iteration"] == 2:
            seen["updates"].append(donate)
        out = original_update(self, state, batch, lr_scale, donate=donate)
        if seen["iteration"] == 2 and len(seen["updates"]) == 2:
            seen["sent"] = time.perf_counter()
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    monkeypatch.setattr(trainer_module.Trainer, "train_iteration", train_iteration)
    monkeypatch.setattr(TrainStep, "update", update)
    return seen


@pytest.mark.parametrize("every", [0, 1])
def test_a_signal_during_the_updates_saves_the_iteration_start_exits_75_and_resumes_identically(
        reference, tmp_path, monkeypatch, capsys, every):
    """SIGTERM right after iteration 2's second update: its third is never run, iteration 1's state (not
    the half-updated one) is on disk, the exit status is 75 and the resumed run ends as the reference.

    checkpoint.every=0: iteration 1 is not on disk, so iteration 2's first update keeps the state it
    started from (no donation) and that state is saved. checkpoint.every=1: it is on disk, every update
    donates, and nothing more is saved."""
    reference_dir, args = reference
    run_dir = tmp_path / "run"
    seen = sigterm_after_second_update_of_iteration_2(monkeypatch)
    argv = [*args, "--set", f"checkpoint.every={every}", "--run-dir", str(run_dir)]
    assert kuhn_poker.main(argv) == EXIT_INTERRUPTED
    seconds = time.perf_counter() - seen["sent"]
    assert seen["updates"] == ([False, True] if every == 0 else [True, True])  # the third never ran
    assert seconds < 20, seconds
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["1"]
    assert checkpoint_meta(run_dir, 1)["iteration"] == 1
    assert [r["iteration"] for r in read_jsonl(str(run_dir))] == [1]
    assert f"--run-dir {run_dir} --resume" in capsys.readouterr().err
    monkeypatch.undo()
    assert kuhn_poker.main(["--run-dir", str(run_dir), "--resume"]) == 0
    assert comparable(run_dir) == comparable(reference_dir)


def test_without_stop_during_updates_no_copy_is_kept_and_the_updates_finish_first(reference, tmp_path,
                                                                                 monkeypatch):
    """checkpoint.stop_during_updates=false: every update donates (no second state in memory), so the
    same signal is honoured only after iteration 2's updates, at its evaluation's first turn."""
    reference_dir, args = reference
    run_dir = tmp_path / "run"
    seen = sigterm_after_second_update_of_iteration_2(monkeypatch)
    argv = [*args, "--set", "checkpoint.stop_during_updates=false", "--run-dir", str(run_dir)]
    assert kuhn_poker.main(argv) == EXIT_INTERRUPTED
    records = read_jsonl(str(run_dir))
    assert all(seen["updates"]) and len(seen["updates"]) == records[-1]["updates"] > 2
    assert [(r["iteration"], r["split"]) for r in records] == [(1, "train"), (2, "train")]
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["2"]
    assert checkpoint_meta(run_dir, 2)["pending_evaluation"] is True
    monkeypatch.undo()
    assert kuhn_poker.main(["--run-dir", str(run_dir), "--resume"]) == 0
    assert comparable(run_dir) == comparable(reference_dir)


@pytest.mark.parametrize("which", ["iteration 2", "final"])
def test_a_signal_during_an_evaluation_saves_the_updated_state_exits_75_and_evaluates_once_on_resume(
        reference, tmp_path, monkeypatch, capsys, which):
    """SIGTERM as the evaluation after iteration 2 (or the final one) starts: no turn of it is played,
    that iteration's updated state is saved at once and the exit status is 75; the resumed run plays
    the abandoned evaluation (its records appear once) and ends as the reference."""
    reference_dir, args = reference
    run_dir = tmp_path / "run"
    original_evaluate, original_stream = Evaluator.evaluate, LLMPolicy.stream
    seen = {"evaluations": 0, "sent": None, "turns_before": 0, "turns_after": 0}
    target = 1 if which == "iteration 2" else 2

    def evaluate(self, *a, **kw):
        seen["evaluations"] += 1
        if seen["evaluations"] == target:
            seen["sent"] = time.perf_counter()
            os.kill(os.getpid(), signal.SIGTERM)
        return original_evaluate(self, *a, **kw)

    def stream(self):
        """Every request of every rollout goes through a stream's ``submit`` (engine or lockstep)."""
        policy_stream = original_stream(self)
        submit = policy_stream.submit

        def counted_submit(*a, **kw):
            seen["turns_before" if seen["sent"] is None else "turns_after"] += 1
            return submit(*a, **kw)

        policy_stream.submit = counted_submit
        return policy_stream

    monkeypatch.setattr(Evaluator, "evaluate", evaluate)
    monkeypatch.setattr(LLMPolicy, "stream", stream)
    assert kuhn_poker.main([*args, "--run-dir", str(run_dir)]) == EXIT_INTERRUPTED
    seconds = time.perf_counter() - seen["sent"]
    assert seen["turns_before"] > 0, "the turn counter saw no request: it no longer hooks the rollout"
    assert seen["turns_after"] == 0 and seconds < 20, (seen, seconds)
    step = 2 if which == "iteration 2" else 3
    assert sorted(os.listdir(run_dir / "checkpoints")) == [str(step)]
    assert checkpoint_meta(run_dir, step)["pending_evaluation"] == (which == "iteration 2")
    later = [(2, "eval"), (3, "train"), (3, "validation")]
    expected = [(1, "train"), (2, "train")] + ([] if step == 2 else later)
    assert [(r["iteration"], r["split"]) for r in read_jsonl(str(run_dir))] == expected
    assert f"--run-dir {run_dir} --resume" in capsys.readouterr().err
    monkeypatch.undo()
    assert kuhn_poker.main(["--run-dir", str(run_dir), "--resume"]) == 0
    assert comparable(run_dir) == comparable(reference_dir)
