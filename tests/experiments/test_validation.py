"""Checkpoint selection on a validation split (``train.validate_every``): which state is kept, that the
final evaluation measures it, and that a resumed run selects the same one."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from experiments import evaluate, kuhn_poker
from experiments.common import EXIT_INTERRUPTED
from mage_jax.logging import read_jsonl
from mage_jax.rollout.tasks import TaskSampler
from mage_jax.training.assemble import build_parts
from tests.experiments.conftest import comparable, sigterm_after_iteration

RUN = {"train.iterations": 3, "train.validate_every": 1, "train.validation_meta_episodes": 6,
       "checkpoint.every": 0}
@pytest.fixture(scope="module")
def validated_run(tmp_path_factory, request):
    request.getfixturevalue("compilation_cache")
    from mage_jax.testing import smoke_args

    run_dir = tmp_path_factory.mktemp("validated") / "run"
    args = smoke_args(RUN)
    assert kuhn_poker.main([*args, "--run-dir", str(run_dir)]) == 0
    return run_dir, args


def test_the_best_validated_state_is_kept_and_the_final_evaluation_measures_it(validated_run, tmp_path):
    run_dir, _ = validated_run
    records = read_jsonl(str(run_dir))
    validation = [r for r in records if r["split"] == "validation"]
    assert [r["iteration"] for r in validation] == [1, 2, 3]
    payoffs = [r["payoff@2"] for r in validation]  # final episode of N = 2 (episodes count from 1)
    best = 1 + int(np.argmax(payoffs))  # the first of equal payoffs
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["selected_iteration"] == best
    assert os.listdir(run_dir / "checkpoints_best") == [str(best)]
    # The same parameters and key through the evaluation entry point: the run's final numbers.
    assert evaluate.main(["--checkpoint", str(run_dir), "--best", "--out", str(tmp_path / "e"),
                          "--set", "logging.plots=false"]) == 0
    again = json.loads((tmp_path / "e" / "summary.json").read_text())
    assert again["iterations"] == best
    assert again["evaluation"]["eval"]["metrics"] == summary["evaluation"]["eval"]["metrics"]


def test_validation_instances_are_never_evaluation_instances(validated_run):
    run_dir, _ = validated_run
    from mage_jax import config as C

    parts = build_parts(C.load(str(run_dir)), str(run_dir))
    sampler: TaskSampler = parts.task_sampler
    validation = {t.seed for t in sampler.sample_validation(512)}
    assert len(validation) == 512 and not validation & {t.seed for t in sampler.sample_eval(512)}
    assert all(seed % 2 == 1 for seed in validation)  # never a training seed


def test_a_resumed_run_selects_what_the_uninterrupted_run_selected(validated_run, tmp_path, monkeypatch):
    reference_dir, args = validated_run
    run_dir = tmp_path / "run"
    sigterm_after_iteration(monkeypatch, 2)
    assert kuhn_poker.main([*args, "--run-dir", str(run_dir)]) == EXIT_INTERRUPTED
    monkeypatch.undo()
    assert kuhn_poker.main(["--run-dir", str(run_dir), "--resume"]) == 0
    assert comparable(run_dir) == comparable(reference_dir)
    selected = json.loads((run_dir / "summary.json").read_text())["selected_iteration"]
    assert selected == json.loads((reference_dir / "summary.json").read_text())["selected_iteration"]
