"""The evaluation of a parameter state over named splits, each with its reference numbers (docs/method.md §8).

Splits:

* ``eval`` — held-out instances of the training pool (or of ``EvalProtocol.eval_pool``: the
  opponent-pool ablation trains on a skewed pool and is measured on the balanced one);
* ``heldout`` — the held-out opponent of ``env.heldout_opponent`` in ``env.heldout_seat`` (Kuhn
  Poker's CFR in the second seat);
* ``EvalProtocol.extra_splits`` — further held-out sets, each with its own opponent, seat,
  environment options or size (Tic-Tac-Toe against MCTS-100 in the first seat, Sokoban with 1 or 3
  boxes, ALFWorld / WebShop held-out splits).

Held-out sets are evaluated only at the end of a run unless configured otherwise (they are not a
training signal). Every split is played with the evaluation sampling settings by ``parts.eval_runner``
(meta-episodes of ``train.eval_num_episodes`` episodes, which may be more than training plays, or
independent attempts for the single-episode baselines).

References, computed once per split on exactly the same meta-episodes: Kuhn Poker's exact oracle
(winnable ceiling, random, best fixed strategy, adaptive bound); for other environments, when the
protocol asks for it, a uniformly random legal-action policy.

The trainer receives an ``Evaluator`` in its constructor and calls ``evaluate`` at its cadence.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import jax
import numpy as np

from mage_jax import config as C
from mage_jax import host_random
from mage_jax.evaluation.metrics import compute_metrics
from mage_jax.evaluation.oracle import KuhnMetaEpisode, kuhn_oracle
from mage_jax.evaluation.samples import Sample, sample_rows
from mage_jax.progress import progress_bar
from mage_jax.rollout.config import RolloutConfig
from mage_jax.rollout.meta_episode import MetaEpisodeRunner, RolloutProgress, RolloutResult, RunnerConfig
from mage_jax.rollout.policy import Policy, RandomLegalPolicy
from mage_jax.rollout.rows import Row
from mage_jax.rollout.tasks import Task, TaskSampler

KUHN_POKER = "kuhn_poker"
EXTRA_SPLITS_STREAM = 7919
"""The evaluation key folded with this plus an extra split's index keys that split: extra splits draw apart
from the built-in ones (and from each other), so adding a split never changes another's numbers."""
SPLIT_STRIDE = 1000
"""Built-in split s keys its chunk c with the evaluation key folded with ``SPLIT_STRIDE * s + c``."""
VALIDATION_STREAM = 0x5A11D
"""The evaluation key folded with this keys the validation split."""
"""The one environment with an exact oracle (``mage_jax.evaluation.oracle``)."""


# ----------------------------------------------------------------------------------------------
# the protocol


@dataclasses.dataclass(frozen=True)
class EvalSplit:
    """One extra evaluation set: ``sample_eval`` tasks played with ``env_options`` merged in."""

    name: str
    opponent: str | None = None
    """None: the evaluation pool (or no opponent for single-agent tasks)."""
    seat: str | None = None
    """``first`` / ``second`` / ``mixed``; None: the config's ``env.seats``."""
    env_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Merged over ``env.options`` (e.g. ``{"num_boxes": 1}``, ``{"split": "valid_unseen"}``)."""
    meta_episodes: int | None = None
    """None: ``train.eval_meta_episodes``."""
    final_only: bool = True
    """Evaluate only at the end of the run (held-out sets are not a training signal)."""


@dataclasses.dataclass(frozen=True)
class EvalProtocol:
    """How a run is evaluated, besides its config (an experiment's choice, saved in ``experiment.json``)."""

    eval_mode: str = "meta"
    """``meta``: meta-episodes with memory; ``independent``: N one-episode attempts without memory."""
    eval_pool: Mapping[str, float] | None = None
    extra_splits: tuple[EvalSplit, ...] = ()
    random_reference: bool = True
    """Play a random legal-action policy on every split without an oracle (Kuhn Poker has one)."""
    headline_split: str = "eval"
    """The split whose final-episode success is the paper's table entry."""

    def __post_init__(self) -> None:
        if self.eval_mode not in ("meta", "independent"):
            raise C.ConfigError(f"eval_mode must be one of meta, independent (got {self.eval_mode!r})")
        names = [s.name for s in self.extra_splits]
        if len(set(names)) != len(names) or {"eval", "heldout"} & set(names):
            raise C.ConfigError(f"extra evaluation splits need distinct names besides eval/heldout: {names}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EvalProtocol:
        splits = tuple(EvalSplit(**s) for s in data.get("extra_splits", ()))
        return cls(**{**data, "extra_splits": splits})


@dataclasses.dataclass(frozen=True)
class SplitResult:
    """The evaluation of one split: ``compute_metrics`` output and the reference numbers (or None)."""

    metrics: dict[str, Any]
    reference: dict[str, Any] | None
    samples: tuple[Sample, ...] = ()
    """Decoded calls of the split's first ``logging.samples`` meta-episodes."""


class EvalParts(Protocol):
    """What the evaluator reads from the run parts (``mage_jax.training.assemble.RunParts``)."""

    cfg: C.ExperimentConfig
    task_sampler: TaskSampler
    eval_runner: Any

    def policy(self, params: Any, key: jax.Array, *, evaluation: bool) -> Policy: ...


# ----------------------------------------------------------------------------------------------
# references


def kuhn_reference(tasks: Sequence[Task], num_episodes: int) -> dict[str, Any]:
    """Oracle numbers (ceiling, random, best fixed, adaptive bound) on exactly these meta-episodes."""
    episodes = [KuhnMetaEpisode(seed=t.seed, seat=int(t.seat), opponent=t.opponent) for t in tasks]
    out = _reference_block(kuhn_oracle(episodes, num_episodes))
    out["by_opponent"] = {}
    for name in sorted({e.opponent for e in episodes}):
        subset = [e for e in episodes if e.opponent == name]
        out["by_opponent"][name] = _reference_block(kuhn_oracle(subset, num_episodes))
    return out


def _reference_block(report: Any) -> dict[str, Any]:
    return {
        "winnable": float(report.winnable),
        "random_success": report.random.success.tolist(),
        "random_payoff": report.random.payoff.tolist(),
        "best_fixed_success": report.best_fixed.success.tolist(),
        "best_fixed_payoff": report.best_fixed.payoff.tolist(),
        "best_fixed_by_success_success": report.best_fixed_by_success.success.tolist(),
        "best_fixed_by_success_payoff": report.best_fixed_by_success.payoff.tolist(),
        "adaptive_payoff_bound": report.adaptive_payoff_bound.tolist(),
    }


def random_reference(env_name: str, env_options: Mapping[str, Any], tasks: Sequence[Task], num_episodes: int,
                     *, seed: int = 0) -> dict[str, Any]:
    """success@k / draw@k / payoff@k of the random legal-action policy on exactly these meta-episodes."""
    runner = MetaEpisodeRunner(env_name, env_options, RunnerConfig(RolloutConfig(
        num_episodes=num_episodes, memory_mode="history_only", reflect=False, prompt_style="compact",
        constrained_actions=True)))
    metrics = compute_metrics(runner.run(list(tasks), RandomLegalPolicy(seed), training=False),
                              num_episodes=num_episodes)

    def block(m: Mapping[str, Any]) -> dict[str, Any]:
        return {f"random_{k}": m["curves"][k] for k in ("success", "draw", "payoff")}

    out = block(metrics)
    out["by_opponent"] = {name: block(sub) for name, sub in metrics.get("by_opponent", {}).items()}
    return out


# ----------------------------------------------------------------------------------------------
# the evaluator


class Evaluator:
    """Evaluates parameter states on the protocol's splits; references are computed once per split."""

    def __init__(self, parts: EvalParts, protocol: EvalProtocol | None = None, *, progress: bool = False):
        self.parts = parts
        self.protocol = protocol or EvalProtocol()
        self.progress = progress
        self._references: dict[str, dict[str, Any] | None] = {}
        self._pool_sampler = None
        if self.protocol.eval_pool:
            config = dataclasses.replace(parts.task_sampler.config, opponents=dict(self.protocol.eval_pool))
            self._pool_sampler = TaskSampler(config)

    @property
    def cfg(self) -> C.ExperimentConfig:
        return self.parts.cfg

    def _sampler(self) -> TaskSampler:
        return self._pool_sampler or self.parts.task_sampler

    def splits(self, *, heldout: bool) -> list[tuple[str, list[Task], Any]]:
        """(name, tasks, runner) of every split evaluated now (``heldout``: the final evaluation)."""
        cfg, runner = self.cfg, self.parts.eval_runner
        out = [("eval", self._sampler().sample_eval(cfg.train.eval_meta_episodes), runner)]
        if heldout and cfg.env.heldout_opponent and cfg.train.eval_heldout_meta_episodes > 0:
            out.append(("heldout", self.parts.task_sampler.sample_eval(
                cfg.train.eval_heldout_meta_episodes, opponent=cfg.env.heldout_opponent,
                seat=cfg.env.heldout_seat), runner))
        for split in self.protocol.extra_splits:
            if split.final_only and not heldout:
                continue
            tasks = self._sampler().sample_eval(split.meta_episodes or cfg.train.eval_meta_episodes,
                                                opponent=split.opponent, seat=split.seat)
            out.append((split.name, tasks, runner.with_env_options(split.env_options)
                        if split.env_options else runner))
        return out

    def reference(self, split: str, tasks: Sequence[Task], runner: Any) -> dict[str, Any] | None:
        """Kuhn Poker's oracle, else (when asked for) the random legal-action policy; None otherwise."""
        if split not in self._references:
            ref = None
            if self.cfg.env.name == KUHN_POKER and all(t.opponent is not None for t in tasks):
                ref = kuhn_reference(tasks, runner.config.num_episodes)
            elif self.protocol.random_reference:
                ref = random_reference(runner.env_name, runner.env_options, tasks, runner.config.num_episodes,
                                       seed=self.cfg.train.seed)
            self._references[split] = ref
        return self._references[split]

    def evaluate(self, params: Any, key: jax.Array, *, heldout: bool,
                 stop: threading.Event | None = None) -> dict[str, SplitResult]:
        """{split: SplitResult} of the parameter state ``params``; ``key`` seeds the sampling.

        Once ``stop`` is set, the next turn of the evaluation raises ``rollout.stopping.Interrupted``
        (the training loop then saves its state at once and evaluates again on resume).
        """
        out: dict[str, SplitResult] = {}
        extra = {s.name: i for i, s in enumerate(self.protocol.extra_splits)}
        for s_index, (name, tasks, runner) in enumerate(self.splits(heldout=heldout)):
            # Keys of the built-in splits and of the extra splits are separate streams, so adding a split
            # never changes the numbers of another.
            if name in extra:
                split_key, offset = host_random.fold_in(key, EXTRA_SPLITS_STREAM + extra[name]), 0
            else:
                split_key, offset = key, SPLIT_STRIDE * s_index
            out[name] = self._run_split(name, tasks, runner, params, split_key, offset, stop)
        return out

    def validate(self, params: Any, key: jax.Array) -> SplitResult:
        """The ``validation`` split: ``train.validation_meta_episodes`` instances of the validation seed
        stream (training pool and seats), played with the evaluation sampling; for checkpoint selection."""
        tasks = self._sampler().sample_validation(self.cfg.train.validation_meta_episodes)
        return self._run_split("validation", tasks, self.parts.eval_runner, params,
                               host_random.fold_in(key, VALIDATION_STREAM), 0, None)

    def _run_split(self, name: str, tasks: list[Task], runner: Any, params: Any, split_key: jax.Array,
                   offset: int, stop: threading.Event | None) -> SplitResult:
        # Meta-episodes are played in chunks of at least 128 at once (one batched rollout each); the bar
        # hears the rollout's running totals, so it moves per finished meta-episode inside a chunk.
        chunk = max(self.cfg.rollout.num_tasks * self.cfg.rollout.group_size, 128)
        outcomes, rows = [], []
        bar = _SplitBar(progress_bar(total=len(tasks), desc=f"eval:{name}", enabled=self.progress,
                                     leave=False, unit="meta-episodes"))
        for c_index, start in enumerate(range(0, len(tasks), chunk)):
            policy = self.parts.policy(params, host_random.fold_in(split_key, offset + c_index),
                                       evaluation=True)
            bar.start_chunk()
            result = runner.run(tasks[start:start + chunk], policy, training=False, stop=stop,
                                progress=bar.report if self.progress else None)
            outcomes += result.outcomes
            rows += result.rows
            if c_index == 0:
                samples = sample_rows(result.rows, getattr(self.parts, "tokenizer", None),
                                      self.cfg.logging.samples)
            bar.end_chunk(len(outcomes), success=float(np.mean([any(o.won) for o in outcomes])),
                          payoff=float(np.mean([o.payoff[-1] for o in outcomes])))
        bar.close()
        metrics = compute_metrics(outcomes, num_episodes=runner.config.num_episodes, rows=rows)
        return SplitResult(metrics, self.reference(name, tasks, runner), samples)


class _SplitBar:
    """The progress bar of one split: meta-episodes finished, and beside them the model turns and tokens
    generated so far (meta-episodes of a batch tend to finish together at its end; turns and tokens move
    all along, so slow and stuck look different)."""

    def __init__(self, bar: Any):
        self.bar = bar
        self.started = time.perf_counter()
        self.done = self.tokens = self.turns = 0
        self._base = (0, 0, 0)

    def start_chunk(self) -> None:
        self._base = (self.done, self.tokens, self.turns)

    def report(self, progress: RolloutProgress) -> None:
        self._move(self._base[0] + progress.finished)
        self.tokens = self._base[1] + progress.tokens
        self.turns = self._base[2] + progress.rows
        self.bar.set_postfix_str(self._rate())

    def end_chunk(self, done: int, *, success: float, payoff: float) -> None:
        self._move(done)
        self.bar.set_postfix_str(f"success={success:.3f}, payoff={payoff:.3f}, {self._rate()}")

    def close(self) -> None:
        self.bar.close()

    def _move(self, done: int) -> None:
        if done > self.done:
            self.bar.update(done - self.done)
            self.done = done

    def _rate(self) -> str:
        rate = self.tokens / max(time.perf_counter() - self.started, 1e-9)
        return f"{self.turns:,} turns, {self.tokens:,} tokens, {rate:,.1f} tok/s"


def transcripts(parts: EvalParts, params: Any, *, count: int = 4, opponent: str | None = None,
                seat: str | None = None, seed: int = 0) -> list[Row]:
    """Rows (prompt and response text kept) of ``count`` evaluation meta-episodes played by ``params``
    (notebooks, debugging)."""
    runner = parts.eval_runner
    base = getattr(runner, "base", runner)
    config = dataclasses.replace(base.config, keep_text=True).with_episodes(runner.config.num_episodes)
    text_runner = MetaEpisodeRunner(base.env_name, base.env_options, config)
    tasks = parts.task_sampler.sample_eval(count, opponent=opponent, seat=seat)
    policy = parts.policy(params, host_random.key(seed), evaluation=True)
    result: RolloutResult = text_runner.run(tasks, policy, training=False)
    return result.rows
