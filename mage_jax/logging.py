"""Run logging: JSONL metrics always; TensorBoard and Weights & Biases when installed and asked for.

The JSONL file (``<run_dir>/metrics.jsonl``) is the source of truth: one record per training
iteration (``split="train"``) or evaluation (``split="eval"``, ``"heldout"``), with the iteration
number and plain floats. A resumed run first drops the records written after its checkpoint, so the
file of a resumed run reads exactly like the file of an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
WANDB_ID_FILE = "wandb_id.txt"


def to_jsonable(value: Any) -> Any:
    """Plain JSON values: numpy / JAX scalars become floats or ints, non-finite floats become None."""
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        v = float(value)
        return v if math.isfinite(v) else None
    if hasattr(value, "shape") and hasattr(value, "dtype"):  # 0-d array (numpy or JAX)
        arr = np.asarray(value)
        if arr.ndim == 0:
            return to_jsonable(arr.item())
        return to_jsonable(arr.tolist())
    return value


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """All records of a JSONL file (a torn last line from a killed run is ignored)."""
    if os.path.isdir(path):
        path = os.path.join(path, METRICS_FILE)
    records = []
    if not os.path.exists(path):
        return records
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


ITERATION_SPLITS = ("train", "validation")
"""Splits logged inside an iteration, before its checkpoint (evaluations come after it)."""


def truncate_after(path: str, iteration: int, *, keep_evaluations: bool = True) -> None:
    """Keep only the records with ``iteration <= iteration`` (used when resuming from a checkpoint);
    ``keep_evaluations=False`` also drops the evaluation records of ``iteration`` itself (the resumed
    run evaluates it again: its final evaluation, when a kill came before the run was marked done). Its
    training and validation records stay: the checkpoint was saved after both."""
    if not os.path.exists(path):
        return
    def kept_record(r: dict) -> bool:
        at = int(r.get("iteration", 0))
        return at < iteration or (at == iteration and (keep_evaluations or r["split"] in ITERATION_SPLITS))

    kept = [r for r in read_jsonl(path) if kept_record(r)]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        for r in kept:
            f.write(json.dumps(r) + "\n")
    os.replace(tmp, path)


class MetricsLogger:
    """Writes metric records to JSONL and, optionally, to TensorBoard and W&B."""

    def __init__(
        self,
        run_dir: str,
        *,
        tensorboard: bool = False,
        wandb: bool = False,
        wandb_project: str = "mage-jax",
        config: Mapping[str, Any] | None = None,
        resume_iteration: int | None = None,
        keep_evaluations: bool = True,
        writes: bool | None = None,
        keep_existing: bool = False,
    ):
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, METRICS_FILE)
        self.samples_path = os.path.join(run_dir, SAMPLES_FILE)
        # Several processes of one run log the same records: only process 0 writes them.
        self.writes = jax.process_index() == 0 if writes is None else writes
        self._file: Any = None
        self._tb = self._wandb = None
        if not self.writes:
            return
        os.makedirs(run_dir, exist_ok=True)
        for path in (self.path, self.samples_path):
            if resume_iteration is not None:
                truncate_after(path, resume_iteration, keep_evaluations=keep_evaluations)
            elif os.path.exists(path) and not keep_existing:
                os.remove(path)
        self._file = open(self.path, "a")  # noqa: SIM115 (open for the logger's lifetime)
        self._tb = _open_tensorboard(run_dir) if tensorboard else None
        self._wandb = _open_wandb(run_dir, wandb_project, config) if wandb else None

    def rewind(self, iteration: int, *, keep_evaluations: bool = True) -> None:
        """Drop the records after ``iteration`` (``truncate_after``): a run resumed from the checkpoint
        of ``iteration`` writes them again. For a logger opened with ``keep_existing=True`` before the
        resume point was known (the trainer learns it from its checkpoint)."""
        if not self.writes:
            return
        self._file.close()
        for path in (self.path, self.samples_path):
            truncate_after(path, iteration, keep_evaluations=keep_evaluations)
        self._file = open(self.path, "a")  # noqa: SIM115 (open for the logger's lifetime)

    def log(self, iteration: int, metrics: Mapping[str, Any], *, split: str = "train") -> dict[str, Any]:
        record = {"split": split, "iteration": int(iteration), "time": round(time.time(), 3)}
        record.update(to_jsonable(dict(metrics)))
        if not self.writes:
            return record
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        scalars = {k: v for k, v in record.items() if k not in ("split", "iteration", "time")
                   and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(f"{split}/{key}", value, int(iteration))
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({f"{split}/{k}": v for k, v in scalars.items()}, step=int(iteration))
        return record

    def log_samples(self, iteration: int, samples: Sequence[Any], *, split: str, text: str) -> None:
        """Append sampled model calls (dataclasses, ``evaluation.samples.Sample``) to ``samples.jsonl``,
        one record each, and ``text`` (their markdown) to TensorBoard when on."""
        if not self.writes:
            return
        with open(self.samples_path, "a") as f:
            for s in samples:
                record = {"split": split, "iteration": int(iteration), **dataclasses.asdict(s)}
                f.write(json.dumps(to_jsonable(record)) + "\n")
        if self._tb is not None:
            self._tb.add_text(f"{split}/samples", text, int(iteration))
            self._tb.flush()

    def close(self) -> None:
        if self._file is not None and not self._file.closed:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def _open_tensorboard(run_dir: str):
    logdir = os.path.join(run_dir, "tensorboard")
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            _warn("TensorBoard logging asked for but neither tensorboardX nor tensorboard is installed "
                  "(pip install 'mage-jax[logging]'); logging to JSONL only")
            return None
    return SummaryWriter(logdir)


def _open_wandb(run_dir: str, project: str, config: Mapping[str, Any] | None):
    """A W&B run of this run directory, through wandb's public API only.

    The run id is kept in ``<run_dir>/wandb_id.txt`` so a resumed run continues the same W&B run.
    ``WANDB_MODE=offline`` writes under ``<run_dir>/wandb`` without a network. A W&B problem (not
    logged in, no network in online mode) is one warning line; the JSONL log goes on regardless.
    """
    try:
        import wandb
    except ImportError:
        _warn("W&B logging asked for but wandb is not installed (pip install 'mage-jax[logging]'); "
              "logging to JSONL only")
        return None
    id_file = os.path.join(run_dir, WANDB_ID_FILE)
    if os.path.exists(id_file):
        with open(id_file) as f:
            run_id = f.read().strip()
    else:
        run_id = uuid.uuid4().hex[:12]  # W&B ids: lowercase letters and digits
        with open(id_file, "w") as f:
            f.write(run_id)
    try:
        return wandb.init(project=project, dir=run_dir, id=run_id, resume="allow",
                          config=dict(config) if config else None)
    except Exception as err:  # wandb raises its own error types (not logged in, network, ...)
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        _warn(f"W&B logging could not start ({reason}); logging to JSONL only "
              "(set WANDB_MODE=offline to log without an account)")
        return None
