"""Training and evaluation of one experiment run with the paper's evaluation protocols.

The trainer (``mage_jax.training.trainer``) trains a configured run and evaluates it on the held-out
instances of the training pool and against one held-out opponent. The paper's tables need a few
more evaluation protocols, which this module adds without changing what a run trains on:

* ``eval_mode="independent"``: the single-episode RL baselines (GRPO, GiGPO) and ReAct are evaluated
  over N *independent* attempts (no memory, no reflection between them; spec section 8). Each
  attempt is an ordinary one-episode meta-episode of the same task; the attempts are then scored
  like the episodes of a meta-episode (stop at the first win), so success@k means the same thing
  for every method. Stochastic opponents are re-seeded for every attempt (each attempt resets the
  task), where a meta-episode's restart keeps drawing from the opponent's stream.
* ``eval_pool``: evaluate on another opponent pool than the training pool (the opponent-pool
  ablation trains on a skewed or single-opponent pool and is always measured on the balanced one).
* ``extra_splits``: further held-out evaluations, each with its own opponent, seat, environment
  options or size: Tic-Tac-Toe against MCTS-100 with the agent first (the paper's in-domain number),
  Sokoban with 1 and 3 boxes, ALFWorld / WebShop held-out splits.
* ``random_reference``: for environments without an exact oracle, a uniformly random legal-action
  policy is played on exactly the same evaluation meta-episodes and reported next to the model
  (Kuhn Poker has the exact oracle of ``mage_jax.evaluation.oracle`` instead).

``run_experiment`` trains (or resumes) and evaluates; ``evaluate_only`` evaluates the initial model
(zero-shot baselines: ReAct, Reflexion) without writing a checkpoint of unchanged weights.
Both write ``summary.json`` in the trainer's format plus ``experiment.json`` (these options).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from mage_jax import config as C

EXPERIMENT_FILE = "experiment.json"
EVAL_MODES = ("meta", "independent")


# ----------------------------------------------------------------------------------------------
# options


@dataclasses.dataclass(frozen=True)
class EvalSplit:
    """One extra evaluation set: ``sample_eval`` tasks played by a runner with ``env_options`` merged in."""

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
class ExperimentOptions:
    """How a run is evaluated, besides its config."""

    eval_mode: str = "meta"
    eval_pool: Mapping[str, float] | None = None
    extra_splits: tuple[EvalSplit, ...] = ()
    random_reference: bool = True
    headline_split: str = "eval"
    """The split whose final-episode success is the paper's table entry."""

    def __post_init__(self) -> None:
        if self.eval_mode not in EVAL_MODES:
            raise C.ConfigError(f"eval_mode must be one of {', '.join(EVAL_MODES)} (got {self.eval_mode!r})")
        names = [s.name for s in self.extra_splits]
        if len(set(names)) != len(names) or {"eval", "heldout"} & set(names):
            raise C.ConfigError(f"extra evaluation splits need distinct names besides eval/heldout: {names}")

    def to_dict(self) -> dict[str, Any]:
        return C.to_dict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ExperimentOptions:
        splits = tuple(EvalSplit(**s) for s in data.get("extra_splits", ()))
        return cls(**{**data, "extra_splits": splits})


def save_options(options: ExperimentOptions, run_dir: str) -> None:
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, EXPERIMENT_FILE)
    with open(path + ".tmp", "w") as f:
        json.dump(options.to_dict(), f, indent=1)
    os.replace(path + ".tmp", path)


# ----------------------------------------------------------------------------------------------
# independent attempts


class IndependentAttemptsRunner:
    """N independent one-episode attempts of every task, scored like one meta-episode of N episodes.

    ``base`` is a runner configured for one episode. All attempts of all tasks are played in one
    lockstep call (attempt a of task i is meta-episode ``a * len(tasks) + i``); the attempts of a
    task are then joined in order, stopping after the first win, as the early stop of a meta-episode.
    """

    def __init__(self, base: Any, num_attempts: int):
        if base.config.num_episodes != 1:
            raise ValueError(f"the base runner must play one episode, got {base.config.num_episodes}")
        if num_attempts < 1:
            raise ValueError(f"num_attempts must be >= 1, got {num_attempts}")
        self.base = base
        self.config = dataclasses.replace(base.config, num_episodes=int(num_attempts))

    def run(self, tasks: Sequence[Any], policy: Any, *, training: bool = False):
        from mage_jax.rollout.meta_episode import MetaEpisodeOutcome, RolloutResult

        n, attempts = len(tasks), self.config.num_episodes
        copies = [
            dataclasses.replace(t, meta_episode=a * n + i, group=a * n + i)
            for a in range(attempts) for i, t in enumerate(tasks)
        ]
        result = self.base.run(copies, policy, training=training)
        by_id = {o.meta_episode: o for o in result.outcomes}
        outcomes, kept = [], set()
        for i, task in enumerate(tasks):
            first = by_id[i]
            joined = MetaEpisodeOutcome(
                meta_episode=task.meta_episode, group=task.group, seed=task.seed, opponent=task.opponent,
                seat=task.seat, task_info=dict(first.task_info),
            )
            for a in range(attempts):
                o = by_id[a * n + i]
                kept.add(a * n + i)
                for name in ("rewards", "won", "draw", "score", "payoff", "turns"):
                    getattr(joined, name).extend(getattr(o, name)[:1])
                joined.valid_actions += o.valid_actions
                joined.invalid_actions += o.invalid_actions
                joined.rows += o.rows
                if o.won and o.won[0]:
                    break
            outcomes.append(joined)
        rows = [r for r in result.rows if r.meta_episode in kept]
        return RolloutResult(rows=rows, outcomes=outcomes, stats=dict(result.stats))


# ----------------------------------------------------------------------------------------------
# the random legal-action reference


class RandomLegalPolicy:
    """Uniform over the allowed completions (legal actions) of each row; an empty remark otherwise."""

    def __init__(self, seed: int):
        self._rng = np.random.default_rng(seed)

    def prompt_lengths(self, prompts: Sequence[str]) -> list[int]:
        return [len(p.split()) for p in prompts]

    def generate(self, requests):
        from mage_jax.rollout.policy import Generation

        out = []
        for req in requests:
            allowed = req.allowed_completions
            text = allowed[int(self._rng.integers(len(allowed)))] if allowed else "<remark></remark>"
            out.append(Generation(text=text, prompt_ids=(0,), response_ids=(0,), logprobs=(0.0,)))
        return out


def random_reference(env_name: str, env_options: Mapping[str, Any], tasks: Sequence[Any], num_episodes: int,
                     *, seed: int = 0) -> dict[str, Any]:
    """success@k / draw@k / payoff@k of the random legal-action policy on exactly these meta-episodes."""
    from mage_jax.evaluation.metrics import compute_metrics
    from mage_jax.rollout.meta_episode import MetaEpisodeRunner, RunnerConfig

    runner = MetaEpisodeRunner(env_name, env_options, RunnerConfig(
        num_episodes=num_episodes, memory_mode="history_only", reflect=False, prompt_style="compact",
        constrained_actions=True))
    metrics = compute_metrics(runner.run(list(tasks), RandomLegalPolicy(seed), training=False),
                              num_episodes=num_episodes)
    block = lambda m: {f"random_{k}": m["curves"][k] for k in ("success", "draw", "payoff")}  # noqa: E731
    out = block(metrics)
    out["by_opponent"] = {name: block(sub) for name, sub in metrics.get("by_opponent", {}).items()}
    return out


# ----------------------------------------------------------------------------------------------
# evaluation


def _evaluator_class():
    from mage_jax.training.trainer import Evaluator

    class ExperimentEvaluator(Evaluator):
        """The trainer's evaluator with an evaluation pool, independent attempts and extra splits."""

        def __init__(self, parts: Any, options: ExperimentOptions, *, progress: bool = True):
            super().__init__(parts, progress=progress)
            self.options = options
            if options.eval_mode == "independent":
                parts.eval_runner = independent_runner(parts.cfg, parts.eval_runner.config.num_episodes)
            self._pool_sampler = None
            if options.eval_pool:
                from mage_jax.rollout.tasks import TaskSampler

                config = dataclasses.replace(parts.task_sampler.config, opponents=dict(options.eval_pool))
                self._pool_sampler = TaskSampler(config)

        def task_sets(self, *, heldout: bool) -> dict[str, list[Any]]:
            sets = super().task_sets(heldout=heldout)
            if self._pool_sampler is not None:
                sets["eval"] = self._pool_sampler.sample_eval(self.parts.cfg.train.eval_meta_episodes)
            return sets

        def reference(self, split: str, tasks: Sequence[Any], runner: Any = None) -> dict[str, Any] | None:
            ref = super().reference(split, tasks)
            if ref is None and self.options.random_reference:
                key = f"random:{split}"
                if key not in self._references:
                    runner = runner or self.parts.eval_runner
                    self._references[key] = random_reference(
                        getattr(runner, "base", runner).env_name, getattr(runner, "base", runner).env_options,
                        tasks, runner.config.num_episodes, seed=self.parts.cfg.train.seed)
                ref = self._references[key]
            return ref

        def evaluate(self, params: Any, key: jax.Array, *, heldout: bool, runner: Any = None,
                     description: str = "eval") -> dict[str, Any]:
            out = super().evaluate(params, key, heldout=heldout, runner=runner, description=description)
            if runner is not None:
                return out
            for index, split in enumerate(self.options.extra_splits):
                if split.final_only and not heldout:
                    continue
                out[split.name] = self.evaluate_split(params, jax.random.fold_in(key, 7919 + index), split)
            return out

        def split_tasks(self, split: EvalSplit) -> list[Any]:
            cfg = self.parts.cfg
            sampler = self._pool_sampler or self.parts.task_sampler
            n = split.meta_episodes or cfg.train.eval_meta_episodes
            return sampler.sample_eval(n, opponent=split.opponent, seat=split.seat)

        def split_runner(self, split: EvalSplit) -> Any:
            cfg = self.parts.cfg
            if not split.env_options:
                return self.parts.eval_runner
            from mage_jax.rollout.meta_episode import MetaEpisodeRunner

            base = self.parts.eval_runner
            inner = getattr(base, "base", base)
            options = {**cfg.env.options, **split.env_options}
            runner = MetaEpisodeRunner(cfg.env.name, options, inner.config)
            if isinstance(base, IndependentAttemptsRunner):
                runner = IndependentAttemptsRunner(runner, base.config.num_episodes)
            return runner

        def evaluate_split(self, params: Any, key: jax.Array, split: EvalSplit) -> dict[str, Any]:
            from mage_jax.evaluation.metrics import compute_metrics
            from mage_jax.training.trainer import make_policy

            tasks, runner = self.split_tasks(split), self.split_runner(split)
            chunk = max(self.parts.cfg.rollout.num_tasks * self.parts.cfg.rollout.group_size, 128)
            outcomes, rows = [], []
            for c_index, start in enumerate(range(0, len(tasks), chunk)):
                policy = make_policy(self.parts, params, jax.random.fold_in(key, c_index), evaluation=True)
                result = runner.run(tasks[start:start + chunk], policy, training=False)
                outcomes += result.outcomes
                rows += result.rows
            metrics = compute_metrics(outcomes, num_episodes=runner.config.num_episodes, rows=rows)
            return {"metrics": metrics, "reference": self.reference(split.name, tasks, runner)}

    return ExperimentEvaluator


def independent_runner(cfg: C.ExperimentConfig, num_attempts: int) -> IndependentAttemptsRunner:
    """One-episode attempts with the evaluation prompt settings of ``cfg``."""
    from mage_jax.rollout.meta_episode import MetaEpisodeRunner, RunnerConfig

    r = cfg.rollout
    runner_cfg = RunnerConfig(
        num_episodes=1, memory_mode=r.memory_mode, reflect=r.reflect, prompt_style=r.prompt_style,
        constrained_actions=r.constrained_actions, privileged_reflection=False,
        anchor_mode=cfg.algorithm.anchor, max_prompt_tokens=r.max_prompt_tokens, max_turns=r.max_turns,
        max_play_tokens=r.max_response_tokens,
        max_reflection_tokens=r.max_reflection_tokens or r.max_response_tokens,
    )
    base = MetaEpisodeRunner(cfg.env.name, cfg.env.options, runner_cfg)
    return IndependentAttemptsRunner(base, num_attempts)


def make_evaluator(parts: Any, options: ExperimentOptions, *, progress: bool = True):
    return _evaluator_class()(parts, options, progress=progress)


# ----------------------------------------------------------------------------------------------
# runs


def run_experiment(cfg: C.ExperimentConfig, options: ExperimentOptions, *, resume: bool = False,
                   experiment: str | None = None):
    """Train (or resume) ``cfg`` and evaluate it with ``options``; returns the trainer's ``TrainResult``.

    The returned object also carries the trainer as ``.trainer`` (parameters, parts) for notebooks.
    """
    from mage_jax.training.trainer import Trainer

    class ExperimentTrainer(Trainer):
        def _setup(self) -> None:
            super()._setup()
            self.evaluator = make_evaluator(self.parts, options, progress=self.cfg.logging.progress)

    save_options(options, cfg.logging.run_dir)
    trainer = ExperimentTrainer(cfg, resume=resume, experiment=experiment)
    result = trainer.run()
    result.trainer = trainer  # type: ignore[attr-defined]
    return result


def evaluate_only(cfg: C.ExperimentConfig, options: ExperimentOptions, *, experiment: str | None = None,
                  parts: Any = None) -> dict[str, Any]:
    """Evaluate the initial model (random init or a local HF folder) and write ``summary.json``."""
    from mage_jax.logging import MetricsLogger, to_jsonable
    from mage_jax.training.trainer import SUMMARY_FILE, build_parts, flat_eval

    start = time.perf_counter()
    run_dir = cfg.logging.run_dir
    if run_dir is None:
        raise C.ConfigError("logging.run_dir must be set before evaluating")
    os.makedirs(run_dir, exist_ok=True)
    C.save(cfg, run_dir)
    save_options(options, run_dir)
    parts = parts or build_parts(cfg, run_dir)
    evaluator = make_evaluator(parts, options, progress=cfg.logging.progress)
    results = evaluator.evaluate(parts.init_params, jax.random.key(cfg.train.seed), heldout=True)
    with MetricsLogger(run_dir, config=C.to_dict(cfg)) as logger:
        for split, flat in flat_eval(results).items():
            logger.log(0, flat, split=split)
    summary = {
        "experiment": experiment or cfg.name,
        "status": "finished",
        "iterations": 0,
        "wall_seconds": time.perf_counter() - start,
        "run_dir": os.path.abspath(run_dir),
        "model": {"num_params": int(parts.model_config.num_params()),
                  "vocab_size": int(parts.model_config.vocab_size)},
        "evaluation": {split: {"metrics": b["metrics"], "reference": b["reference"]}
                       for split, b in results.items()},
    }
    path = os.path.join(run_dir, SUMMARY_FILE)
    with open(path + ".tmp", "w") as f:
        json.dump(to_jsonable(summary), f, indent=1)
    os.replace(path + ".tmp", path)
    summary["parts"] = parts
    return summary


# ----------------------------------------------------------------------------------------------
# transcripts (notebooks, debugging)


def transcripts(parts: Any, params: Any, *, count: int = 4, opponent: str | None = None,
                seat: str | None = None, seed: int = 0) -> list[Any]:
    """Rows (prompt and response text kept) of ``count`` evaluation meta-episodes played by ``params``."""
    from mage_jax.rollout.meta_episode import MetaEpisodeRunner
    from mage_jax.training.trainer import make_policy

    base = getattr(parts.eval_runner, "base", parts.eval_runner)
    config = dataclasses.replace(base.config, keep_text=True)
    if isinstance(parts.eval_runner, IndependentAttemptsRunner):
        config = dataclasses.replace(config, num_episodes=parts.eval_runner.config.num_episodes)
    runner = MetaEpisodeRunner(base.env_name, base.env_options, config)
    tasks = parts.task_sampler.sample_eval(count, opponent=opponent, seat=seat)
    policy = make_policy(parts, params, jax.random.key(seed), evaluation=True)
    return runner.run(tasks, policy, training=False).rows


# ----------------------------------------------------------------------------------------------
# tables


def _fmt(x: Any, signed: bool = False) -> str:
    if x is None:
        return "-"
    return f"{x:+.3f}" if signed else f"{x:.3f}"


def results_table(summary: Mapping[str, Any], titles: Mapping[str, str] | None = None) -> str:
    """success@k, draw@k and payoff@k per split and opponent, next to the reference policies."""
    lines: list[str] = []
    titles = titles or {}
    for split, block in summary.get("evaluation", {}).items():
        metrics, ref = block["metrics"], block.get("reference") or {}
        K = metrics["num_episodes"]
        lines.append(f"== {titles.get(split, split)}: {metrics['num_meta_episodes']} meta-episodes ==")
        groups = [("all", metrics, ref)]
        if len(metrics.get("by_opponent", {})) > 1:
            for name, sub in metrics["by_opponent"].items():
                groups.append((name, sub, (ref.get("by_opponent") or {}).get(name) or {}))
        lines.append(f"{'opponent':<14}{'k':>2}  {'success':>8}{'draw':>8}{'payoff':>9}   |  reference: "
                     f"{'rnd succ':>8}{'rnd pay':>9}{'best fix':>9}{'ceiling':>8}")
        for name, sub, r in groups:
            curves = sub["curves"]
            for k in range(K):
                def at(key: str, k: int = k, r: Mapping[str, Any] = r) -> Any:
                    v = r.get(key)
                    return None if v is None else (v[k] if isinstance(v, (list, tuple)) else v)

                lines.append(
                    f"{name:<14}{k:>2}  {_fmt(curves['success'][k]):>8}{_fmt(curves['draw'][k]):>8}"
                    f"{_fmt(curves['payoff'][k], True):>9}   |  {'':>11}"
                    f"{_fmt(at('random_success')):>8}{_fmt(at('random_payoff'), True):>9}"
                    f"{_fmt(at('best_fixed_payoff'), True):>9}{_fmt(at('winnable')):>8}")
    if "wall_seconds" in summary:
        lines.append(f"wall time {summary['wall_seconds']:.0f} s, {summary.get('iterations')} iterations, "
                     f"run dir {summary.get('run_dir')}")
    return "\n".join(lines)
