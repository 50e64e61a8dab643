"""Specification of mage_jax.logging's Weights & Biases path: it starts with current wandb (public API
only), logs every scalar under its split, and a resumed run continues the same W&B run (offline mode)."""

from __future__ import annotations

import glob
import os

import pytest

from mage_jax import config as C
from mage_jax.logging import WANDB_ID_FILE, MetricsLogger, read_jsonl
from tests.optional import require

wandb = require("wandb")  # in the ``test`` and ``logging`` extras


@pytest.fixture
def offline(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb_cache"))


def test_wandb_logging_starts_logs_scalars_and_resumes_the_same_run(offline, tmp_path):
    run_dir = str(tmp_path / "run")
    config = C.to_dict(C.ExperimentConfig())  # what the trainer passes
    with MetricsLogger(run_dir, wandb=True, wandb_project="mage-test", config=config) as log:
        assert log._wandb is not None
        run_id = log._wandb.id
        assert log._wandb.config["optim"]["lr"] == config["optim"]["lr"]
        log.log(1, {"loss": 0.5, "skipped": 0})
        log.log(1, {"success@0": 0.25}, split="eval")
        log.log(2, {"loss": 0.25, "skipped": 1})
        summary = dict(log._wandb.summary)  # W&B commits a step once the next one starts
    assert summary["train/loss"] == 0.5 and summary["eval/success@0"] == 0.25
    with open(os.path.join(run_dir, WANDB_ID_FILE)) as f:
        assert f.read().strip() == run_id
    assert glob.glob(os.path.join(run_dir, "wandb", f"offline-run-*-{run_id}", f"run-{run_id}.wandb"))

    with MetricsLogger(run_dir, wandb=True, config=config, resume_iteration=2) as log:
        assert log._wandb.id == run_id
        log.log(3, {"loss": 0.125})
    assert [r["iteration"] for r in read_jsonl(run_dir)] == [1, 1, 2, 3]


def test_a_wandb_that_cannot_start_is_one_warning_and_jsonl_goes_on(offline, tmp_path, monkeypatch, capsys):
    def refuse(**kwargs):
        raise wandb.errors.UsageError("api_key not configured (no-tty). call wandb.login(key=[your_api_key])")

    monkeypatch.setattr(wandb, "init", refuse)
    with MetricsLogger(str(tmp_path), wandb=True) as log:
        log.log(1, {"loss": 1.0})
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: W&B logging could not start (api_key not configured")
    assert read_jsonl(str(tmp_path))[0]["loss"] == 1.0
