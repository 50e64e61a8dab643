"""The one path of every run: config -> parts -> evaluator -> trainer -> report.

``train`` trains (or resumes) a run and reports it; ``evaluate`` evaluates a parameter state (the
initial model for the zero-shot baselines, or a checkpoint's parameters) without training. Both
write ``config.json``, ``experiment.json`` (the evaluation protocol), ``metrics.jsonl`` and
``summary.json`` in ``cfg.logging.run_dir`` and return a ``RunOutcome`` whose summary is exactly what
``summary.json`` holds; the live objects (parts, trainer) travel beside it, never inside it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import jax

from mage_jax import compile_report, host_random
from mage_jax import config as C
from mage_jax.evaluation.evaluator import EvalProtocol, Evaluator
from mage_jax.evaluation.plots import Selection
from mage_jax.evaluation.report import build_summary, log_evaluation, write_plots, write_summary
from mage_jax.logging import MetricsLogger
from mage_jax.models.sharding import is_main_process
from mage_jax.rollout.stopping import Interrupted
from mage_jax.training.assemble import (
    RunParts,
    build_parts,
    checkpoint_dir,
    make_best_checkpointer,
    make_checkpointer,
    make_logger,
)
from mage_jax.training.checkpoint import Checkpointer
from mage_jax.training.signals import StopRequested, install_stop_signals
from mage_jax.training.trainer import Trainer

PROTOCOL_FILE = "experiment.json"
class EvaluationInterrupted(Exception):
    """SIGTERM / Ctrl-C stopped an evaluation-only run at its next turn; the message (one line) says
    what its directory holds."""


FINISHED_FILE = "finished.json"
"""Written atomically after a run's final records and summary: the run is complete, and ``--resume``
of it reruns nothing."""


@dataclasses.dataclass
class RunOutcome:
    """A finished (or interrupted) run: its JSON summary and the live parts that produced it."""

    summary: dict[str, Any]
    parts: RunParts
    trainer: Trainer | None = None
    """None for evaluation-only runs."""

    @property
    def status(self) -> str:
        return self.summary["status"]


def _run_dir(cfg: C.ExperimentConfig) -> str:
    if cfg.logging.run_dir is None:
        raise C.ConfigError("logging.run_dir must be set before a run")
    return cfg.logging.run_dir


@contextlib.contextmanager
def _nothing_left_on_error(run_dir: str) -> Iterator[None]:
    """Remove what a failed build created in ``run_dir``, so that a bad config leaves nothing behind
    and the corrected command is not refused as a second run in the same directory."""
    existed = os.path.isdir(run_dir)
    before = set(os.listdir(run_dir)) if existed else set()
    try:
        yield
    except BaseException:
        if not existed:
            shutil.rmtree(run_dir, ignore_errors=True)
        elif os.path.isdir(run_dir):
            for name in set(os.listdir(run_dir)) - before:
                path = os.path.join(run_dir, name)
                shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)
        raise


def _write_run_files(cfg: C.ExperimentConfig, protocol: EvalProtocol, run_dir: str) -> None:
    """``config.json`` and ``experiment.json``: written once the run is built (and restored), by process
    0 of a multi-process run (as every file of the run directory but the checkpoints)."""
    if not is_main_process():
        return
    C.save(cfg, run_dir)
    path = os.path.join(run_dir, PROTOCOL_FILE)
    with open(path + ".tmp", "w") as f:
        json.dump(C.to_dict(protocol), f, indent=1)
    os.replace(path + ".tmp", path)


def finished_iteration(run_dir: str) -> int | None:
    """The final iteration of a completed run in ``run_dir`` (None: not completed)."""
    try:
        with open(os.path.join(run_dir, FINISHED_FILE)) as f:
            return int(json.load(f)["iteration"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _mark_finished(run_dir: str, iteration: int) -> None:
    if not is_main_process():
        return
    path = os.path.join(run_dir, FINISHED_FILE)
    with open(path + ".tmp", "w") as f:
        json.dump({"iteration": iteration}, f)
    os.replace(path + ".tmp", path)


def _checkpointers(cfg: C.ExperimentConfig, run_dir: str) -> tuple[Checkpointer, Checkpointer | None]:
    """The run's checkpointer and best-state checkpointer; a folder the checks before the run could not
    rule out (a path the file system refuses, e.g. under /proc) is one ConfigError."""
    made: list[Checkpointer] = []
    try:
        made.append(make_checkpointer(cfg, run_dir))
        return made[0], make_best_checkpointer(cfg, run_dir)
    except OSError as err:
        for checkpointer in made:
            checkpointer.close()
        raise C.ConfigError(f"checkpoint.dir {checkpoint_dir(cfg, run_dir)!r} cannot be used: "
                            f"{err.strerror or err}") from None


def train(cfg: C.ExperimentConfig, protocol: EvalProtocol | None = None, *, resume: bool = False,
          experiment: str | None = None) -> RunOutcome:
    """Train (or resume) the run of ``cfg``, evaluate it with ``protocol`` and report it."""
    start = time.perf_counter()
    compiled_before = compile_report.counter().snapshot()
    protocol = protocol or EvalProtocol()
    run_dir = _run_dir(cfg)
    with _nothing_left_on_error(run_dir):
        parts = build_parts(cfg, run_dir, eval_mode=protocol.eval_mode)
        checkpointer, best_checkpointer = _checkpointers(cfg, run_dir)
        logger = make_logger(cfg, run_dir, resume=resume)
        try:
            trainer = Trainer(parts, Evaluator(parts, protocol, progress=cfg.logging.progress), logger=logger,
                              checkpointer=checkpointer, best_checkpointer=best_checkpointer, resume=resume)
        except BaseException:  # e.g. a checkpoint of another config: nothing stays open
            for part in (logger, checkpointer, best_checkpointer):
                if part is not None:
                    part.close()
            raise
    _write_run_files(cfg, protocol, run_dir)
    if is_main_process():
        with contextlib.suppress(FileNotFoundError):  # a finished run trained further
            os.remove(os.path.join(run_dir, FINISHED_FILE))
    setup_seconds = time.perf_counter() - start
    stop = trainer.stop_event
    restore_signals = install_stop_signals(stop)  # from the trainer's end to the report's: finish promptly
    try:
        result = trainer.run()
        if result.final is None:
            return RunOutcome({"status": result.status, "iteration": result.iteration}, parts, trainer)
        # The results first (milliseconds), the plots last (seconds, more on a loaded machine): a stop
        # request from here on never costs a result, and one during the plots abandons them at once.
        summary = build_summary(
            experiment=experiment or cfg.name, iterations=result.iteration, run_dir=run_dir,
            model_config=parts.model_config, results=result.final, wall_seconds=time.perf_counter() - start,
            setup_seconds=setup_seconds, compiled=compile_report.counter().snapshot() - compiled_before,
            skipped_updates=result.skipped_updates, selected_iteration=result.selected_iteration,
        )
        if is_main_process():
            write_summary(run_dir, summary)
        _mark_finished(run_dir, result.iteration)
        if cfg.logging.plots and is_main_process():
            selection = (None if result.selected_iteration is None
                         else Selection(logged_at=result.iteration, state_of=result.selected_iteration))
            if not _plots_unless_stopped(stop, run_dir, result.final, selection):
                print(f"stopped while drawing the plots: the run is finished ({run_dir}/summary.json is "
                      "written), its plots were not all drawn", file=sys.stderr)
        return RunOutcome(summary, parts, trainer)
    finally:
        restore_signals()


def _plots_unless_stopped(stop: threading.Event, run_dir: str, results: Any, selection: Selection | None
                          ) -> bool:
    """Draw the run's plots unless a stop request came (before or while they are drawn: a signal then
    abandons them at once); whether they were all drawn."""
    restore = install_stop_signals(stop, interrupt=True)
    try:
        if stop.is_set():
            return False
        write_plots(run_dir, results, selection=selection)
        return True
    except StopRequested:
        return False
    finally:
        restore()


def evaluate(cfg: C.ExperimentConfig, protocol: EvalProtocol | None = None, *, experiment: str | None = None,
             parts: RunParts | None = None, params: Any = None, key: jax.Array | None = None,
             iteration: int = 0, **summary_fields: Any) -> RunOutcome:
    """Evaluate ``params`` (default: the initial model) on every split of ``protocol`` and report it.

    ``parts`` defaults to the parts of ``cfg`` (its tokenizer kept in ``cfg.logging.run_dir``); ``key``
    to ``jax.random.key(train.seed)``. ``summary_fields`` go into the summary as they are.
    """
    start = time.perf_counter()
    compiled_before = compile_report.counter().snapshot()
    protocol = protocol or EvalProtocol()
    run_dir = _run_dir(cfg)
    with _nothing_left_on_error(run_dir):
        parts = parts or build_parts(cfg, run_dir, eval_mode=protocol.eval_mode)
    _write_run_files(cfg, protocol, run_dir)
    evaluator = Evaluator(parts, protocol, progress=cfg.logging.progress)
    stop = threading.Event()  # SIGTERM / Ctrl-C: stop at the next turn, as training does
    restore_signals = install_stop_signals(stop)
    try:
        try:
            results = evaluator.evaluate(parts.init_params if params is None else params,
                                         host_random.key(cfg.train.seed) if key is None else key,
                                         heldout=True, stop=stop)
        except Interrupted:
            raise EvaluationInterrupted(
                f"interrupted: the evaluation stopped before it finished; {run_dir} holds its config.json "
                "and experiment.json but no results (run the command again to evaluate)") from None
        # Finished: a stop request from here on waits for the records and the summary (milliseconds).
        with MetricsLogger(run_dir, config=C.to_dict(cfg)) as logger:
            log_evaluation(logger, iteration, results)
        summary = build_summary(
            experiment=experiment or cfg.name, iterations=iteration, run_dir=run_dir,
            model_config=parts.model_config, results=results, wall_seconds=time.perf_counter() - start,
            compiled=compile_report.counter().snapshot() - compiled_before, **summary_fields,
        )
        if is_main_process():
            write_summary(run_dir, summary)
    finally:
        restore_signals()
    return RunOutcome(summary, parts)
