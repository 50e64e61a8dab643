"""The MAGE training loop: collect -> credit -> recompute -> update epochs, with evaluation, checkpoint
and logging cadences (docs/method.md §2).

One iteration ``i`` (1-based) is four phases, each a method: ``_collect`` (the training rollout of the
current parameters: ``TaskSampler.sample_train(i - 1)`` through the train runner), ``credit``
(``training.credit``: the rows packed, one advantage per row), ``_recompute`` (old and, with
the KL term, reference log-probs on the device one mini-batch at a time, kept in [rows, tokens] tables
on the host) and ``_update_epochs`` (PPO epochs over mini-batches, ``TrainBatch`` ->
``TrainStep.update``); then the metrics log. The parts (``training.assemble.RunParts``), the evaluator,
the metrics logger and the two checkpointers are given to the constructor; building them and writing
``summary.json``, plots and tables is the caller's (``training.run``).

Reproducibility: every random choice of iteration i (tasks, sampling, mini-batch order) is a pure
function of (seed, i), so a run resumed from the checkpoint of iteration k writes exactly the metrics
an uninterrupted run writes (on CPU).

Stopping. SIGTERM and SIGINT (Ctrl-C) ask the loop to stop at the next safe point, at the edges of the
phases: between turns of a rollout, mini-batches of the recompute or updates (the iteration is
abandoned and the last completed one saved; the updates keep the state the iteration started from
unless it is on disk) and turns of an evaluation (the updated state is saved, ``pending_evaluation``).
What each phase saves and why: docs/preemption.md.

Safety. Updates whose loss, gradients or new state are non-finite, or whose size exceeds
``optim.max_update_ratio`` times the parameters', are skipped inside the jitted step and counted
(``skipped`` per iteration, ``skipped_updates`` in total); ``optim.max_skipped_updates`` consecutive
skips, or an iteration in which every row is invalid (nothing to learn from), stop the run with one
``TrainingStopped`` line, saving nothing more. A state that is not finite is never saved.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from mage_jax import compile_report, host_random
from mage_jax import config as C
from mage_jax.algorithms.schedules import lr_decay
from mage_jax.envs.base import env_class
from mage_jax.evaluation.evaluator import Evaluator, SplitResult
from mage_jax.evaluation.report import log_evaluation
from mage_jax.evaluation.samples import render_markdown, sample_rows
from mage_jax.evaluation.training_metrics import IterationTimings, iteration_metrics
from mage_jax.logging import MetricsLogger
from mage_jax.models.sharding import to_host
from mage_jax.progress import NoBar, progress_bar
from mage_jax.rollout.meta_episode import RolloutProgress, RolloutResult
from mage_jax.rollout.rows import length_grouped_minibatches, minibatch_indices
from mage_jax.rollout.stopping import Interrupted
from mage_jax.training.assemble import ROLLOUT_STREAM, RunParts, evaluation_key, row_length_buckets
from mage_jax.training.checkpoint import Checkpointer, key_from_json, key_to_json
from mage_jax.training.credit import Credited, credit, merge_identical
from mage_jax.training.health import TrainingStopped, all_invalid, check_rows, check_skips
from mage_jax.training.signals import install_stop_signals
from mage_jax.training.train_step import TrainBatch, all_finite, fill_micro_batches, gather_rows


@dataclasses.dataclass
class TrainResult:
    status: str
    """``finished`` or ``interrupted`` (SIGTERM / SIGINT; a checkpoint was saved)."""
    iteration: int
    final: dict[str, SplitResult] | None
    """The final evaluation (None when interrupted)."""
    skipped_updates: int = 0
    """Updates skipped over the whole run (non-finite loss, gradients or new state)."""
    selected_iteration: int | None = None
    """The iteration whose parameters the final evaluation measured (validation on); None: the last."""


class Trainer:
    """Trains (or resumes) the run of ``parts.cfg``, evaluating with ``evaluator``.

    Collaborators come in built (``training.run.train`` builds them with ``assemble.make_logger`` /
    ``make_checkpointer`` / ``make_best_checkpointer``): ``logger`` receives one ``train`` record per
    iteration and the evaluation and validation records; ``checkpointer`` keeps the run's states at
    ``checkpoint.every``; ``best_checkpointer`` (required exactly when ``train.validate_every > 0``)
    keeps the best validated state. With ``resume`` the newest checkpoint is restored and ``logger``
    (opened with ``keep_existing=True``) is rewound to it. The trainer closes all three when its run ends.
    """

    def __init__(self, parts: RunParts, evaluator: Evaluator, *, logger: MetricsLogger,
                 checkpointer: Checkpointer, best_checkpointer: Checkpointer | None = None,
                 resume: bool = False):
        cfg = parts.cfg
        if cfg.logging.run_dir is None:
            raise C.ConfigError("logging.run_dir must be set before training")
        if (best_checkpointer is not None) != (cfg.train.validate_every > 0):
            raise ValueError("a best-state checkpointer is needed exactly when train.validate_every > 0")
        self.cfg, self.parts, self.evaluator = cfg, parts, evaluator
        self.run_dir = cfg.logging.run_dir
        self._stop = threading.Event()
        self._bar: Any = NoBar()
        self.step = parts.train_step()
        self.state = self.step.init_state(parts.init_params)
        # The frozen reference for the KL term is the initial model: a copy (the train state is donated),
        # or under LoRA the frozen base with the adapters off (computed from the train state, no copy).
        self.use_reference = cfg.optim.kl_coef > 0
        self.ref_params = (jax.device_put(self.state.params, may_alias=False)
                           if self.use_reference and not self.step.config.adapters_only else None)
        self.length_buckets = row_length_buckets(cfg)
        self.base_key = host_random.key(cfg.train.seed)
        self.checkpointer = checkpointer
        self.best_checkpointer = best_checkpointer
        self.best: tuple[int, float] | None = None
        """(iteration, validation payoff) of the best validated state (kept by ``best_checkpointer``)."""
        self.start_iteration = 0
        self.skipped_updates = 0
        self.consecutive_skips = 0
        self.pending_evaluation = False
        """The evaluation of the current iteration was abandoned by a stop request (saved in the meta)."""
        self._state_saved_only = False
        """``self.state`` was left mid-update by a stop request; the iteration's start is on disk."""
        if resume and self.checkpointer.latest_step() is not None:
            self.state, meta = self.checkpointer.restore(self.state)
            C.check_resumed(meta, self.cfg, self.run_dir)
            self.start_iteration = int(meta["iteration"])
            self.base_key = key_from_json(meta["rng"])
            self.skipped_updates = int(meta.get("skipped_updates", 0))
            self.consecutive_skips = int(meta.get("consecutive_skips", 0))
            self.pending_evaluation = bool(meta.get("pending_evaluation", False))
            best = meta.get("best")
            if best is not None and self.best_checkpointer is not None:
                self.best = (int(best[0]), float(best[1]))
            try:
                parts.task_sampler.load_state_dict(meta.get("task_sampler", {}))
            except ValueError as err:
                raise C.ConfigError(str(err)) from None
        if self.best_checkpointer is not None:
            self._reconcile_best()
        self.logger = logger
        if resume:
            # The final evaluation, or an abandoned one, reruns: its records of this iteration go.
            reruns_evaluation = self.start_iteration >= cfg.train.iterations or self.pending_evaluation
            logger.rewind(self.start_iteration, keep_evaluations=not reruns_evaluation)

    # -- one iteration: collect -> credit -> recompute log-probs -> update epochs -------------------------
    def train_iteration(self, iteration: int) -> dict[str, float]:
        """Training iteration ``iteration`` (1-based), phase by phase; a stop request between turns of
        the rollout, mini-batches of the recompute or updates abandons it (``Interrupted``)."""
        t0 = time.perf_counter()
        compiled_before = compile_report.counter().snapshot()
        result = self._collect(iteration)
        t_rollout = time.perf_counter() - t0
        credited = credit(self.cfg, result.rows, length_buckets=self.length_buckets,
                          pad_id=self.parts.tokenizer.pad_id)
        t1 = time.perf_counter()
        same = credited.identical_rows()
        old, ref = self._recompute(credited, same, self._first_update_rows(iteration, credited))
        step_metrics = self._update_epochs(iteration, credited, same, old, ref)
        t_update = time.perf_counter() - t1
        longest = self.consecutive_skips
        for m in step_metrics:
            self.consecutive_skips = self.consecutive_skips + 1 if m["skipped"] else 0
            longest = max(longest, self.consecutive_skips)
        timings = IterationTimings(rollout_seconds=t_rollout, update_seconds=t_update,
                                   iteration_seconds=time.perf_counter() - t0)
        compiled = compile_report.counter().snapshot() - compiled_before
        out = iteration_metrics(result, step_metrics, num_episodes=self.cfg.rollout.num_episodes,
                                advantages=credited.advantages[:credited.packed.num_rows],
                                row_lengths=credited.row_lengths, consecutive_skips_max=longest,
                                timings=timings, compiled=compiled,
                                split_private=env_class(self.cfg.env.name).split_private)
        out["distinct_rows"] = float(np.unique(same).size)
        self.skipped_updates += int(out["skipped"])
        return out

    def _collect(self, iteration: int) -> RolloutResult:
        """The training rollout of ``iteration``: B·G tasks played by the policy of the current parameters
        (its samples logged at ``logging.samples_every``); an iteration with no valid row stops the run."""
        cfg, parts = self.cfg, self.parts
        tasks = parts.task_sampler.sample_train(iteration - 1)
        key = host_random.fold_in(self.base_key, iteration)
        policy = parts.policy(self.state.params, host_random.fold_in(key, ROLLOUT_STREAM), evaluation=False)
        result = parts.train_runner.run(tasks, policy, training=True, progress=self._rows_progress(iteration),
                                        stop=self._stop)
        every = cfg.logging.samples_every
        # An iteration that stops the run logs its samples first: they show what the model wrote.
        if every > 0 and (iteration % every == 0 or all_invalid(cfg, result.rows)):
            samples = sample_rows(result.rows, parts.tokenizer, cfg.logging.samples)
            self.logger.log_samples(iteration, samples, split="train", text=render_markdown(samples))
        check_rows(cfg, iteration, result.rows, last_checkpoint=self._last_checkpoint_note,
                   samples_path=self.logger.samples_path if every > 0 and self.logger.writes else None)
        return result

    def _recompute(self, credited: Credited, same: np.ndarray,
                   first_update: np.ndarray) -> tuple[np.ndarray | None, np.ndarray | None]:
        """Old (and reference) log-probs of every real row, before any update of this iteration: computed
        on the device one mini-batch at a time and kept on the host (tens of GB at the paper's lengths),
        where each update's mini-batch takes its rows from them. The rows of the iteration's first update
        (``first_update``, empty unless one epoch) need no old log-probs: that update starts from the
        state they would come from and takes them from its own forward pass (None when it is the only
        update). Identical rows (``same``: ``Credited.identical_rows``) are scored once. A stop request is
        honoured between mini-batches (the parameters are still the last iteration's)."""
        shape, lengths = credited.packed.tokens.shape, credited.row_lengths
        mb, micro = self.cfg.optim.mini_batch_rows, self.cfg.optim.micro_batch_rows
        later = np.setdiff1d(np.arange(len(same)), first_update)
        old = np.zeros(shape, np.float32) if len(later) else None
        ref = np.zeros(shape, np.float32) if self.use_reference else None
        scored = np.flatnonzero(same == np.arange(len(same)))
        with_old = np.isin(scored, same[later]) if old is not None else np.zeros(len(scored), bool)
        for tables, rows in (((old, ref), scored[with_old]), ((None, ref), scored[~with_old])):
            if all(t is None for t in tables) or not len(rows):
                continue
            order = np.argsort(lengths[rows], kind="stable")
            for block in minibatch_indices(len(rows), mb, permutation=order):
                if self._stop.is_set():
                    raise Interrupted
                idx = fill_micro_batches(np.where(block >= 0, rows[np.maximum(block, 0)], -1), micro)
                placed = self.step.place_batch(credited.batch(idx, with_advantages=False))
                real = idx >= 0
                if tables[0] is not None:
                    tables[0][idx[real], :placed.length] = to_host(
                        self.step.compute_logprobs(self.state.params, placed))[real]
                if tables[1] is not None:
                    tables[1][idx[real], :placed.length] = to_host(self._reference_logprobs(placed))[real]
        for table in (old, ref):
            if table is not None:
                table[:len(same)] = table[same]
        return old, ref

    def _epoch_blocks(self, iteration: int, epoch: int, lengths: np.ndarray) -> list[np.ndarray]:
        """The mini-batches (row indices, ``-1`` padding) of ``epoch`` of ``iteration``, a pure function of
        (seed, iteration, epoch)."""
        cfg, size = self.cfg, self.cfg.optim.mini_batch_rows
        rng = np.random.default_rng([cfg.train.seed, iteration, epoch])
        if cfg.optim.group_by_length:
            return length_grouped_minibatches(lengths, size, rng, self.length_buckets)
        return minibatch_indices(len(lengths), size, permutation=rng.permutation(len(lengths)))

    def _first_update_rows(self, iteration: int, credited: Credited) -> np.ndarray:
        """The rows of the iteration's first update when it has one epoch (it needs no old log-probs)."""
        if self.cfg.optim.epochs != 1:
            return np.zeros(0, np.int64)
        first = self._epoch_blocks(iteration, 0, credited.row_lengths)[0]
        return first[first >= 0]

    def _update_epochs(self, iteration: int, credited: Credited, same: np.ndarray, old: np.ndarray | None,
                       ref: np.ndarray | None) -> list[dict[str, float]]:
        """PPO epochs over shuffled mini-batches, identical rows of a mini-batch run once
        (``merge_identical``); the step metrics of every update. A stop request is
        honoured between any two updates when the state the iteration started from survives them: kept
        (its first update does not donate it) unless it is on disk already (docs/preemption.md)."""
        cfg = self.cfg
        start_on_disk = iteration - 1 in self.checkpointer.all_steps()
        keep_start = cfg.checkpoint.stop_during_updates and not start_on_disk
        stoppable = keep_start or start_on_disk
        start_state, in_flight = self.state, None
        step_metrics: list[dict[str, Any]] = []
        lr_scale = lr_decay(cfg.optim.lr_decay, (iteration - 1) / max(cfg.train.iterations - 1, 1),
                            cfg.optim.lr_end_fraction)
        for epoch in range(cfg.optim.epochs):
            for idx in self._epoch_blocks(iteration, epoch, credited.row_lengths):
                if stoppable and self._stop.is_set():
                    self._abandon_updates(start_state if keep_start else None)
                merged = merge_identical(idx, same, credited.advantages)
                idx = fill_micro_batches(merged.index, cfg.optim.micro_batch_rows)
                rows = credited.batch(idx, with_advantages=True, merged=merged)
                own_old = old is None or (cfg.optim.epochs == 1 and not step_metrics)  # the first update's
                placed = self.step.place_batch(rows.replace(
                    old_logprobs=None if own_old else gather_rows(old, idx, rows.length),
                    ref_logprobs=None if ref is None else gather_rows(ref, idx, rows.length),
                ))
                self.state, metrics = self.step.update(self.state, placed, lr_scale,
                                                       donate=not (keep_start and not step_metrics))
                step_metrics.append(metrics)
                if stoppable and in_flight is not None:  # one update in flight: a stop is seen within one
                    jax.block_until_ready(in_flight)
                in_flight = metrics
        return [{k: float(v) for k, v in m.items()} for m in jax.device_get(step_metrics)]

    def _reference_logprobs(self, batch: TrainBatch) -> jax.Array:
        """Log-probs of the KL reference: the initial model's copy, or the LoRA base (adapters off)."""
        if self.ref_params is None:
            return self.step.compute_logprobs(self.state.params, batch, adapters=False)
        return self.step.compute_logprobs(self.ref_params, batch)

    def _abandon_updates(self, start_state: Any) -> None:
        """Leave the updates of an iteration at a stop request: back to the state it started from, or
        (None: that state is on disk) mark the half-updated state as never to be saved."""
        if start_state is None:
            self._state_saved_only = True
        else:
            self.state = start_state
        raise Interrupted

    def _rows_progress(self, iteration: int) -> Callable[[RolloutProgress], None] | None:
        """Progress inside the rollout of ``iteration`` on the bar: model turns (play turns and reflections)
        and tokens generated so far, units that move while meta-episodes are still unfinished."""
        if not self.cfg.logging.progress:
            return None

        def report(progress: RolloutProgress) -> None:
            self._bar.set_postfix_str(f"iteration {iteration}: rollout, {progress.rows} turns, "
                                      f"{progress.tokens:,} tokens generated")

        return report

    def _last_checkpoint_note(self) -> str:
        step = self.checkpointer.latest_step()
        return "no checkpoint was saved" if step is None else f"the last checkpoint is step {step}"

    # -- cadences ----------------------------------------------------------------------------------------
    def _checkpoint(self, iteration: int) -> None:
        if self._state_saved_only:  # abandoned mid-update; the iteration's starting state is on disk
            return
        if not bool(jax.jit(all_finite)(self.state)):  # cannot happen past the step's check; never save it
            raise TrainingStopped(f"the state of iteration {iteration} is not finite; it was not saved; "
                                  f"{self._last_checkpoint_note()}")
        self.checkpointer.save(iteration, self.state, self._meta(iteration))

    def _meta(self, iteration: int) -> dict[str, Any]:
        return {
            "iteration": iteration,
            "rng": key_to_json(self.base_key),
            "task_sampler": self.parts.task_sampler.state_dict(),
            "config": C.to_dict(self.cfg),
            "skipped_updates": self.skipped_updates,
            "consecutive_skips": self.consecutive_skips,
            "pending_evaluation": self.pending_evaluation,
            "best": None if self.best is None else list(self.best),
        }

    def _reconcile_best(self) -> None:
        """Best states saved after the iteration this run starts from belong to an abandoned future."""
        for step in self.best_checkpointer.all_steps():
            if step > self.start_iteration:
                self.best_checkpointer.delete(step)
        if self.best is not None and self.best[0] not in self.best_checkpointer.all_steps():
            print(f"warning: the best validated state (iteration {self.best[0]}) is missing from "
                  f"{self.best_checkpointer.directory}; selection starts again", file=sys.stderr)
            self.best = None

    def _validate(self, iteration: int) -> bool:
        """Play the validation split; keep the state on disk when its final-episode payoff is the best so
        far (ties keep the earlier one). True when it was kept: the caller then checkpoints the run too,
        so the checkpoint a run resumes from always names a best state that is on disk."""
        result = self.evaluator.validate(self.state.params, evaluation_key(self.base_key, iteration))
        log_evaluation(self.logger, iteration, {"validation": result})
        score = float(result.metrics["curves"]["payoff"][-1])
        if self.best is None or score > self.best[1]:
            self.best = (iteration, score)
            self.best_checkpointer.save(iteration, self.state, self._meta(iteration))
            return True
        return False

    def _selected(self, iteration: int) -> tuple[Any, int]:
        """(params, iteration) the final evaluation measures: the best validated state, else the current
        one. The evaluation key is that iteration's, so ``experiments.evaluate --best`` reproduces it."""
        if self.best is None:
            return self.state.params, iteration
        state, _ = self.best_checkpointer.restore(self.state, self.best[0])
        return state.params, self.best[0]

    def _evaluate(self, iteration: int, *, final: bool) -> dict[str, SplitResult]:
        heldout = final or not self.cfg.train.eval_final_only_heldout
        params, selected = self._selected(iteration) if final else (self.state.params, iteration)
        results = self.evaluator.evaluate(params, evaluation_key(self.base_key, selected),
                                          heldout=heldout, stop=self._stop)
        log_evaluation(self.logger, iteration, results)
        return results

    def _evaluate_or_stop(self, iteration: int, last: dict[str, SplitResult] | None = None
                          ) -> tuple[str, dict[str, SplitResult] | None]:
        """(status, results) of the evaluation of ``iteration`` inside the loop; a stop request during it
        marks it pending (saved with the checkpoint) and gives status ``interrupted``."""
        try:
            results = self._evaluate(iteration, final=False)
        except Interrupted:
            self.pending_evaluation = True
            return "interrupted", last
        self.pending_evaluation = False
        return "finished", results

    def _install_signals(self) -> Callable[[], None]:
        """SIGTERM and SIGINT request a stop at the next safe point; a second SIGINT exits at once."""
        return install_stop_signals(self._stop)

    @property
    def stop_event(self) -> threading.Event:
        """The stop request, set by SIGTERM / SIGINT while ``run`` runs (``training.run`` keeps it
        installed until the report is written)."""
        return self._stop

    # -- the loop ----------------------------------------------------------------------------------------
    def run(self) -> TrainResult:
        """Iterate up to ``train.iterations`` (from the resumed checkpoint), then evaluate and save."""
        cfg = self.cfg
        total = cfg.train.iterations
        restore_signal = self._install_signals()
        bar = self._bar = progress_bar(total=total, desc="train", enabled=cfg.logging.progress,
                                       initial=self.start_iteration, unit="iterations")
        last_eval: dict[str, SplitResult] | None = None
        iteration = self.start_iteration
        status = "finished"
        start_time = time.perf_counter()
        try:
            if self.pending_evaluation and iteration < total:  # abandoned by a stop request: rerun it
                status, last_eval = self._evaluate_or_stop(iteration)
            while iteration < total and status == "finished":
                if self._stop.is_set():
                    status = "interrupted"
                    break
                try:
                    metrics = self.train_iteration(iteration + 1)
                except Interrupted:  # abandoned at a safe point: the state is the last iteration's
                    status = "interrupted"
                    break
                iteration += 1
                metrics["wall_seconds"] = time.perf_counter() - start_time
                self.logger.log(iteration, metrics, split="train")
                check_skips(cfg, iteration, int(metrics["consecutive_skips_max"]),
                            last_checkpoint=self._last_checkpoint_note)
                every = cfg.train.validate_every
                validate = every > 0 and (iteration % every == 0 or iteration == total)
                improved = validate and self._validate(iteration)
                bar.update(1)
                # rollout_*: this iteration's training rollout (final episode), not an evaluation
                postfix = {"rollout_succ": f"{metrics['success@last']:.2f}",
                           "rollout_pay": f"{metrics['payoff@last']:+.2f}",
                           "ent": f"{metrics['entropy']:.3f}", "kl": f"{metrics['approx_kl']:+.3f}"}
                if self.skipped_updates:
                    postfix["skipped"] = str(self.skipped_updates)
                if self.best is not None:
                    postfix["best_val_pay"] = f"{self.best[1]:+.3f}@{self.best[0]}"
                if last_eval is not None:
                    postfix["eval_pay"] = f"{last_eval['eval'].metrics['curves']['payoff'][-1]:+.3f}"
                bar.set_postfix(postfix)
                if cfg.train.eval_every > 0 and iteration % cfg.train.eval_every == 0 and iteration < total:
                    status, last_eval = self._evaluate_or_stop(iteration, last_eval)
                    if status != "finished":
                        break
                if self.checkpointer.should_save(iteration) or improved:
                    self._checkpoint(iteration)
            final = None
            if status == "finished":
                # The table printed next measures this state, not the last rollout: the bar says so
                # instead of keeping the rollout's numbers beside it.
                measured = (f"iteration {iteration} (last state)" if self.best is None
                            else f"iteration {self.best[0]} (best validated state)")
                bar.set_postfix_str(f"measuring {measured}", refresh=False)
            bar.set_description("final evaluation" if status == "finished" else "saving")
            if status == "finished":
                try:
                    final = self._evaluate(iteration, final=True)
                except Interrupted:  # the resumed run evaluates again (its final records are dropped)
                    status = "interrupted"
                else:
                    bar.set_postfix_str(f"measured {measured}: results below")
            self._checkpoint(iteration)
            if self.skipped_updates:
                print(f"warning: {self.skipped_updates} updates were skipped (non-finite loss, gradients or "
                      "parameters, or over optim.max_update_ratio); see 'skipped' in metrics.jsonl",
                      file=sys.stderr)
            return TrainResult(status, iteration, final, self.skipped_updates,
                               None if self.best is None else self.best[0])
        finally:
            bar.close()
            restore_signal()
            self.logger.close()
            self.checkpointer.close()
            if self.best_checkpointer is not None:
                self.best_checkpointer.close()
