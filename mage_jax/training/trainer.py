"""The MAGE training loop: collect -> credit -> recompute -> update epochs, with evaluation, checkpoint
and logging cadences (docs/method.md §2).

One iteration ``i`` (1-based):

    TaskSampler.sample_train(i - 1) -> train runner (LLM policy with the current parameters)
    -> pack_rows -> advantages (registry: gigpo / grpo / rloo with the configured reward design)
    -> old log-probs (and reference log-probs when the KL term is on), recomputed by the training
       model on the device one mini-batch at a time and copied into [rows, tokens] tables on the host
    -> PPO epochs over mini-batches (``TrainBatch`` -> ``TrainStep.update``) -> metrics log

The parts (``training.assemble.RunParts``), the evaluator (``evaluation.evaluator.Evaluator``), the
metrics logger and the two checkpointers are collaborators given to the constructor; an iteration's
record is ``evaluation.training_metrics.iteration_metrics``; the trainer calls the evaluator every
``train.eval_every`` iterations and at the end, and returns the final evaluation. Building the
collaborators and writing ``summary.json``, plots and tables is the caller's job (``training.run``).

Reproducibility: every random choice of iteration i (tasks, sampling, mini-batch order) is a pure
function of (seed, i), so a run resumed from the checkpoint of iteration k writes exactly the metrics
an uninterrupted run writes (on CPU).

Stopping. SIGTERM and SIGINT (Ctrl-C) ask the loop to stop; a second SIGINT exits at once. The request
is honoured at the next safe point, and the run ends with status ``interrupted``:

* between turns of the training rollout, between the mini-batches of the log-prob recompute and between
  the PPO updates the iteration is abandoned: the last completed iteration's state is saved (unless
  already on disk) and a resumed run replays the abandoned iteration exactly. The updates donate the
  state they change, so the trainer keeps the state an iteration starts from: its first update runs
  without donation and the starting state lives on beside the updated one until the iteration ends
  (one more copy of parameters and optimizer state on the device, during the updates only). No copy
  is kept when that state is on disk already (a checkpoint of the previous iteration, e.g.
  ``checkpoint.every=1``), and none with ``checkpoint.stop_during_updates=false``, where a request
  during the updates waits for them to end instead. (A host copy would spend a device-to-host
  transfer of the whole state on every iteration to save that memory; the option is the cheaper
  way out where device memory is short.)
* between turns of an evaluation the evaluation is abandoned: the state after the iteration's updates
  is saved at once, marked ``pending_evaluation``, and a resumed run evaluates it first (once: records
  of the abandoned evaluation were never written).

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
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from mage_jax import compile_report, host_random
from mage_jax import config as C
from mage_jax.algorithms import compute_advantages
from mage_jax.algorithms.schedules import lr_decay
from mage_jax.envs import env_class
from mage_jax.evaluation.evaluator import Evaluator, SplitResult
from mage_jax.evaluation.report import log_evaluation
from mage_jax.evaluation.samples import render_markdown, sample_rows
from mage_jax.evaluation.training_metrics import IterationTimings, iteration_metrics
from mage_jax.logging import MetricsLogger
from mage_jax.models.sharding import to_host
from mage_jax.progress import NoBar, progress_bar
from mage_jax.rollout.meta_episode import RolloutProgress
from mage_jax.rollout.rows import length_grouped_minibatches, minibatch_indices, pack_rows, pick_bucket
from mage_jax.rollout.stopping import Interrupted
from mage_jax.training.assemble import RunParts, advantage_config, evaluation_key, row_length_buckets
from mage_jax.training.checkpoint import Checkpointer, key_from_json, key_to_json
from mage_jax.training.signals import install_stop_signals
from mage_jax.training.train_step import TrainBatch, all_finite, fill_micro_batches, gather_rows

ADVANTAGE_ROWS = 512
"""The smallest row count the advantage estimator runs at (padding rows are masked)."""


class TrainingStopped(RuntimeError):
    """The run cannot make progress (updates keep being skipped, or an iteration has no valid row); the
    message is one line, and nothing after the last good checkpoint was saved."""


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
        self.adv_cfg = advantage_config(cfg)
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
            self._check_same_run(meta)
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

    def _check_same_run(self, meta: dict[str, Any]) -> None:
        """A resumed run goes on as the run its checkpoint was trained as: a ``config.json`` edited since
        (outside ``config.RESUMABLE_KEYS``) would silently continue as another run, so it is one
        ConfigError before anything is rewritten."""
        if not meta.get("config"):
            return
        try:
            changed = C.resume_changes(meta["config"], self.cfg)
        except (C.ConfigError, TypeError, ValueError):  # a meta of another version: nothing to compare
            return
        if not changed:
            return
        key, before, after = changed[0]
        more = f" (and {len(changed) - 1} more keys)" if len(changed) > 1 else ""
        raise C.ConfigError(
            f"{self.run_dir}/{C.CONFIG_FILE} says {key}={after!r}, but its checkpoint of iteration "
            f"{meta.get('iteration')} was trained with {before!r}{more}: the config was edited after the run "
            f"started; put {key} back to resume (a resumed run may change only "
            f"{', '.join(k.rstrip('.') for k in C.RESUMABLE_KEYS)}), or start a new run with another "
            "--run-dir")

    # -- one iteration ---------------------------------------------------------------------------------
    def train_iteration(self, iteration: int) -> dict[str, float]:
        """Rollout + credit + PPO updates for training iteration ``iteration`` (1-based)."""
        cfg, parts = self.cfg, self.parts
        t0 = time.perf_counter()
        compiled_before = compile_report.counter().snapshot()
        tasks = parts.task_sampler.sample_train(iteration - 1)
        key = host_random.fold_in(self.base_key, iteration)
        policy = parts.policy(self.state.params, host_random.fold_in(key, 0), evaluation=False)
        result = parts.train_runner.run(tasks, policy, training=True, progress=self._rows_progress(iteration),
                                        stop=self._stop)
        t_rollout = time.perf_counter() - t0
        every = cfg.logging.samples_every
        # An iteration that stops the run logs its samples first: they show what the model wrote.
        if every > 0 and (iteration % every == 0 or self._all_invalid(result.rows)):
            samples = sample_rows(result.rows, parts.tokenizer, cfg.logging.samples)
            self.logger.log_samples(iteration, samples, split="train", text=render_markdown(samples))
        self._check_rows(iteration, result.rows)

        mb, buckets = cfg.optim.mini_batch_rows, self.length_buckets
        packed = pack_rows(result.rows, row_bucket=mb, length_buckets=buckets, pad_id=parts.tokenizer.pad_id)
        n = packed.num_rows
        row_lengths = (packed.prompt_lengths + packed.response_lengths)[:n]
        if n and int(packed.response_lengths[:n].max()) > cfg.rollout.max_new_tokens:  # the head span
            raise ValueError("a response is longer than rollout.max_new_tokens")

        def batch(idx: np.ndarray, advantages: np.ndarray | None = None) -> TrainBatch:
            """Rows ``idx`` cut to the token length bucket the longest of them needs."""
            real = idx[idx >= 0]
            length = pick_bucket(max(int(row_lengths[real].max()) if len(real) else 1, 1), buckets)
            return TrainBatch.from_packed(packed, idx, length=length, advantages=advantages,
                                          constrained=packed.constraint_table is not None)

        # One compile per power of two, at least ADVANTAGE_ROWS: the estimator's cost is negligible at
        # that size, and a run whose row count wanders (the main job: 256 to 512) compiles it once.
        rows_bucket = max(ADVANTAGE_ROWS, 1 << max(len(packed.mask) - 1, 0).bit_length())
        advantages = np.asarray(compute_advantages(cfg.algorithm.estimator, packed.row_batch(rows_bucket),
                                                   self.adv_cfg))[:len(packed.mask)]

        # Old (and reference) log-probs of every real row, before any update of this iteration; they stay
        # on the host (tens of GB at the paper's lengths) and each mini-batch takes its rows from them.
        t1 = time.perf_counter()
        # One epoch of one mini-batch: its update starts from the state the rows would be recomputed with,
        # so it takes log pi_old from its own forward pass instead of a recompute (the same values).
        single_update = cfg.optim.epochs == 1 and n <= mb
        old = None if single_update else np.zeros(packed.tokens.shape, np.float32)
        ref = np.zeros(packed.tokens.shape, np.float32) if self.use_reference else None
        micro = cfg.optim.micro_batch_rows
        for idx in minibatch_indices(n, mb, permutation=np.argsort(row_lengths, kind="stable")):
            if self._stop.is_set():  # a safe point: the parameters are still the last iteration's
                raise Interrupted
            idx = fill_micro_batches(idx, micro)  # padding-only micro-batches are skipped
            placed = self.step.place_batch(batch(idx))
            real = idx >= 0
            if old is not None:
                old[idx[real], :placed.length] = to_host(
                    self.step.compute_logprobs(self.state.params, placed))[real]
            if ref is not None:
                ref[idx[real], :placed.length] = to_host(self._reference_logprobs(placed))[real]

        # PPO epochs over shuffled mini-batches, a safe point between any two: the state the iteration
        # started from is kept (its first update does not donate it) unless it is on disk already.
        start_on_disk = iteration - 1 in self.checkpointer.all_steps()
        keep_start = cfg.checkpoint.stop_during_updates and not start_on_disk
        stoppable = keep_start or start_on_disk
        start_state = self.state
        in_flight = None
        step_metrics: list[dict[str, Any]] = []
        progress = (iteration - 1) / max(cfg.train.iterations - 1, 1)
        lr_scale = lr_decay(cfg.optim.lr_decay, progress, cfg.optim.lr_end_fraction)
        for epoch in range(cfg.optim.epochs):
            rng = np.random.default_rng([cfg.train.seed, iteration, epoch])
            if cfg.optim.group_by_length:
                blocks = length_grouped_minibatches(row_lengths, mb, rng, buckets)
            else:
                blocks = minibatch_indices(n, mb, permutation=rng.permutation(n))
            for idx in blocks:
                if stoppable and self._stop.is_set():
                    self._abandon_updates(start_state if keep_start else None)
                idx = fill_micro_batches(idx, micro)
                rows = batch(idx, advantages)
                placed = self.step.place_batch(rows.replace(
                    old_logprobs=None if old is None else gather_rows(old, idx, rows.length),
                    ref_logprobs=None if ref is None else gather_rows(ref, idx, rows.length),
                ))
                self.state, metrics = self.step.update(self.state, placed, lr_scale,
                                                       donate=not (keep_start and not step_metrics))
                step_metrics.append(metrics)
                if stoppable and in_flight is not None:  # one update in flight: a stop is seen within one
                    jax.block_until_ready(in_flight)
                in_flight = metrics
        start_state = None
        step_metrics = [{k: float(v) for k, v in m.items()} for m in jax.device_get(step_metrics)]
        t_update = time.perf_counter() - t1

        longest = self.consecutive_skips
        for m in step_metrics:
            self.consecutive_skips = self.consecutive_skips + 1 if m["skipped"] else 0
            longest = max(longest, self.consecutive_skips)
        timings = IterationTimings(rollout_seconds=t_rollout, update_seconds=t_update,
                                   iteration_seconds=time.perf_counter() - t0)
        out = iteration_metrics(result, step_metrics, num_episodes=cfg.rollout.num_episodes,
                                advantages=advantages[:n], row_lengths=row_lengths,
                                consecutive_skips_max=longest, timings=timings,
                                compiled=compile_report.counter().snapshot() - compiled_before,
                                split_private=env_class(cfg.env.name).split_private)
        self.skipped_updates += int(out["skipped"])
        return out

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

    def _check_rows(self, iteration: int, rows: Sequence[Any]) -> None:
        """Stop when no row of the iteration is valid: every advantage would be the same penalty and
        the run would train on nothing."""
        if any(not np.isfinite(row.logprobs).all() for row in rows):
            raise TrainingStopped(
                f"sampling iteration {iteration} gave non-finite log-probabilities: the parameters diverged "
                f"(lower optim.lr); {self._last_checkpoint_note()}")
        if not self._all_invalid(rows):
            return
        truncated = sum(row.truncated for row in rows)
        overflow = sum(row.overflow for row in rows)
        r = self.cfg.rollout
        hints = [] if r.constrained_actions else ["--rollout.constrained_actions true"]
        hints.append(f"a longer --rollout.max_response_tokens (now {r.max_response_tokens})")
        samples = (f"; what the model wrote is in {self.logger.samples_path}"
                   if self.cfg.logging.samples_every > 0 and self.logger.writes else "")
        raise TrainingStopped(
            f"every one of the {len(rows)} rows of iteration {iteration} is invalid ({truncated} truncated "
            f"at rollout.max_response_tokens={r.max_response_tokens}, {overflow} over "
            f"rollout.max_prompt_tokens={r.max_prompt_tokens}, the rest unparsable): nothing to train on; "
            f"try {' or '.join(hints)}{samples}; {self._last_checkpoint_note()}")

    def _all_invalid(self, rows: Sequence[Any]) -> bool:
        """The iteration has rows, none valid, and the run is set to stop on that."""
        return bool(rows) and self.cfg.train.stop_when_all_invalid and not any(row.valid for row in rows)

    def _check_skips(self, iteration: int, longest: int) -> None:
        limit = self.cfg.optim.max_skipped_updates
        if limit > 0 and longest >= limit:
            raise TrainingStopped(
                f"{longest} consecutive updates were skipped by iteration {iteration} (non-finite loss, "
                f"gradients or parameters, or larger than optim.max_update_ratio="
                f"{self.cfg.optim.max_update_ratio:g} times the parameters; optim.max_skipped_updates="
                f"{limit}): lower optim.lr or check the inputs; {self._last_checkpoint_note()}")

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
        """The stop request: set by SIGTERM / SIGINT (while ``run`` runs) or ``request_stop``."""
        return self._stop

    def request_stop(self) -> None:
        """Stop at the next safe point, save a checkpoint and return (what SIGTERM and SIGINT do)."""
        self._stop.set()

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
                self._check_skips(iteration, int(metrics["consecutive_skips_max"]))
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
