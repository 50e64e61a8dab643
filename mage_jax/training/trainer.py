"""The MAGE training loop: rollouts, credit assignment, PPO updates, evaluation, checkpoints, logs.

One iteration (spec section 2):

    TaskSampler.sample_train(i) -> MetaEpisodeRunner.run (LLMPolicy with the current parameters)
    -> pack_rows -> advantages (registry: gigpo / grpo / rloo with the configured reward design)
    -> old log-probs (and reference log-probs when the KL term is on), recomputed by the training model
    -> PPO mini-batch updates (train_step) -> JSONL / TensorBoard / W&B

Every k iterations and at the end the current policy is evaluated on held-out instances with the
evaluation sampling settings (group size 1, no penalties): success@k, draw@k, success_or_draw@k,
score@k and payoff@k per episode index and per opponent; for Kuhn Poker the oracle's ceiling, random
and best-fixed reference numbers on the *same* meta-episodes; at the end also against the held-out
opponent (CFR, agent in the second seat).

Reproducibility: every random choice of iteration i (tasks, sampling, mini-batch order) is a pure
function of (seed, i), so a run resumed from the checkpoint of iteration k writes exactly the metrics
an uninterrupted run writes (on CPU). SIGTERM finishes the current iteration, saves and exits cleanly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mage_jax import config as C
from mage_jax.logging import MetricsLogger, to_jsonable

SUMMARY_FILE = "summary.json"
TOKENIZER_DIR = "tokenizer"


# ----------------------------------------------------------------------------------------------
# building the parts of a run


def _length_buckets(limit: int, configured: Sequence[int] = ()) -> tuple[int, ...]:
    """Token-length buckets up to ``limit``: the configured ones (plus ``limit`` itself when they stop
    short of it), else 64, 96, 128, 192, 256, ... (powers of two and 1.5x)."""
    if configured:
        kept = sorted({int(b) for b in configured if b < limit})
        return (*kept, int(limit))
    out, b = [], 64
    while True:
        for v in (b, b * 3 // 2):
            out.append(v)
            if v >= limit:
                return tuple(out)
        b *= 2


def advantage_config(cfg: C.ExperimentConfig):
    from mage_jax.algorithms import AdvantageConfig

    a = cfg.algorithm
    length_penalty = a.length_penalty
    return AdvantageConfig(
        reward_design=a.reward,
        gamma_step=a.gamma_step,
        gamma_traj=a.gamma_traj,
        omega=a.step_weight,
        norm=a.norm,
        anchor=a.anchor,
        invalid_penalty=a.invalid_penalty,
        length_penalty=length_penalty,
        max_response_length=cfg.rollout.max_response_tokens if length_penalty > 0 else None,
    )


def corpus_policy(seed: int):
    """A random policy for the word-level corpus: a random allowed completion (or a format example)."""
    from mage_jax.rollout.policy import Generation

    rng = np.random.default_rng(seed)

    class _CorpusPolicy:
        def prompt_lengths(self, prompts: Sequence[str]) -> list[int]:
            return [len(p.split()) for p in prompts]

        def generate(self, requests):
            out = []
            for req in requests:
                if req.allowed_completions:
                    text = req.allowed_completions[int(rng.integers(len(req.allowed_completions)))]
                elif "<remark>" in req.prompt:
                    text = "<remark> plan </remark>"
                else:
                    text = ""
                out.append(Generation(text=text, prompt_ids=(1,), response_ids=(1,), logprobs=(0.0,)))
            return out

    return _CorpusPolicy()


def tokenizer_corpus(cfg: C.ExperimentConfig, task_sampler, runner_factory: Callable[..., Any]) -> list[str]:
    """Rendered prompts and responses of random-policy meta-episodes: the word-level vocabulary source.

    Covers training and evaluation prompts (the held-out opponent included), so every word the model
    will read is in the vocabulary.
    """
    texts: list[str] = []
    n = cfg.tokenizer.corpus_meta_episodes
    batches = [task_sampler.sample_train(i) for i in range(max(1, -(-n // task_sampler.config.batch_size)))]
    tasks = [t for b in batches for t in b][:n]
    episodes = max(cfg.rollout.num_episodes, cfg.train.eval_num_episodes)
    runner = runner_factory(keep_text=True, num_episodes=episodes)
    jobs = [(tasks, True)]
    eval_tasks = task_sampler.sample_eval(min(n, 64))
    jobs.append((eval_tasks, False))
    if cfg.env.heldout_opponent:
        jobs.append((task_sampler.sample_eval(min(n, 64), opponent=cfg.env.heldout_opponent,
                                              seat=cfg.env.heldout_seat), False))
    for i, (job, training) in enumerate(jobs):
        result = runner.run(job, corpus_policy(cfg.train.seed + i), training=training)
        for row in result.rows:
            texts.append(row.prompt_text or "")
            texts.append(row.response_text or "")
    return texts


@dataclasses.dataclass
class RunParts:
    """Everything built once per run from the config."""

    cfg: C.ExperimentConfig
    mesh: Any
    tokenizer: Any
    model_config: Any
    graphdef: Any
    sampler: Any
    task_sampler: Any
    train_runner: Any
    eval_runner: Any
    init_params: Any


def _runner(cfg: C.ExperimentConfig, *, training: bool, num_episodes: int | None = None,
            keep_text: bool = False):
    from mage_jax.rollout.meta_episode import MetaEpisodeRunner, RunnerConfig

    r = cfg.rollout
    runner_cfg = RunnerConfig(
        num_episodes=num_episodes or (r.num_episodes if training else cfg.train.eval_num_episodes),
        memory_mode=r.memory_mode,
        reflect=r.reflect,
        prompt_style=r.prompt_style,
        constrained_actions=r.constrained_actions,
        privileged_reflection=r.privileged_reflection,
        anchor_mode=cfg.algorithm.anchor,
        max_prompt_tokens=r.max_prompt_tokens,
        max_turns=r.max_turns,
        max_play_tokens=r.max_response_tokens,
        max_reflection_tokens=r.max_reflection_tokens or r.max_response_tokens,
        keep_text=keep_text,
    )
    return MetaEpisodeRunner(cfg.env.name, cfg.env.options, runner_cfg)


def make_task_sampler(cfg: C.ExperimentConfig):
    from mage_jax.rollout.tasks import TaskSampler, TaskSamplerConfig

    e, r = cfg.env, cfg.rollout
    opponents = dict(zip(e.opponents, e.opponent_ratios)) if e.opponents else None
    return TaskSampler(TaskSamplerConfig(
        num_tasks=r.num_tasks, group_size=r.group_size, opponents=opponents, grouping=e.grouping,
        seats=e.seats if opponents else "first", seed=cfg.train.seed,
        eval_seed=e.eval_seed,
    ))


def build_tokenizer(cfg: C.ExperimentConfig, run_dir: str | None, task_sampler):
    """The run's tokenizer: HF from a folder, or word-level built from rendered prompts (saved in the run
    dir, and loaded from there on resume)."""
    from mage_jax.tokenizer import Tokenizer, TokenizerError

    try:
        if cfg.tokenizer.kind == "hf":
            return Tokenizer.from_hf_dir(cfg.tokenizer.path or cfg.model.path,
                                         enable_thinking=cfg.tokenizer.enable_thinking)
        saved = os.path.join(run_dir, TOKENIZER_DIR) if run_dir else None
        if saved and os.path.isdir(saved):
            return Tokenizer.load(saved)
        corpus = tokenizer_corpus(cfg, task_sampler,
                                  lambda **kw: _runner(cfg, training=True, **kw))
        tok = Tokenizer.word_level(corpus)
        if saved:
            tok.save(saved)
        return tok
    except TokenizerError as err:
        raise C.ConfigError(str(err)) from None


def build_model(cfg: C.ExperimentConfig, tokenizer, mesh):
    """(ModelConfig, graphdef, params): random init from a preset, or weights of a local HF folder."""
    from mage_jax.models import sharding as shd
    from mage_jax.models.config import ModelConfig

    m = cfg.model
    try:
        if m.path is not None:
            from mage_jax.models.hf_loading import load_hf_params

            base = ModelConfig.from_hf_dir(m.path)
            model_config = dataclasses.replace(base, dtype=m.dtype, **m.overrides)
            model_config, graphdef, params = load_hf_params(m.path, model_config, mesh=mesh)
        else:
            vocab = -(-tokenizer.vocab_size // 8) * 8
            model_config = ModelConfig.preset(m.preset, vocab_size=vocab, dtype=m.dtype, **m.overrides)
            seed = cfg.train.seed if m.init_seed is None else m.init_seed
            graphdef, params = shd.init_sharded(model_config, mesh, seed=seed)
    except (ValueError, TypeError) as err:
        raise C.ConfigError(f"model: {err}") from None
    if tokenizer.vocab_size > model_config.vocab_size:
        raise C.ConfigError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only "
                            f"{model_config.vocab_size}")
    return model_config, graphdef, params


def build_parts(cfg: C.ExperimentConfig, run_dir: str | None) -> RunParts:
    from mage_jax.models import sharding as shd
    from mage_jax.sampling import Sampler

    try:
        mesh = shd.make_mesh(shd.MeshConfig(data=cfg.mesh.data, fsdp=cfg.mesh.fsdp, tensor=cfg.mesh.tensor))
    except ValueError as err:
        raise C.ConfigError(f"mesh: {err}") from None
    task_sampler = make_task_sampler(cfg)
    tokenizer = build_tokenizer(cfg, run_dir, task_sampler)
    model_config, graphdef, params = build_model(cfg, tokenizer, mesh)
    r = cfg.rollout
    batch_axis = mesh.shape["data"] * mesh.shape["fsdp"]
    largest = max(r.num_tasks * r.group_size, cfg.train.eval_meta_episodes,
                  cfg.train.eval_heldout_meta_episodes)
    batch_buckets = tuple(b for b in (8, 32, 128, 512) if b % batch_axis == 0 and b < largest) + (
        -(-largest // batch_axis) * batch_axis,)
    sampler = Sampler(
        graphdef, model_config, eos_ids=tokenizer.eos_ids, pad_id=tokenizer.pad_id,
        prompt_buckets=_length_buckets(r.max_prompt_tokens, r.length_buckets), batch_buckets=batch_buckets,
        mesh=mesh, state_shardings=shd.param_shardings(params, mesh),
    )
    return RunParts(
        cfg=cfg, mesh=mesh, tokenizer=tokenizer, model_config=model_config, graphdef=graphdef,
        sampler=sampler, task_sampler=task_sampler, train_runner=_runner(cfg, training=True),
        eval_runner=_runner(cfg, training=False), init_params=params,
    )


def evaluation_key(base_key: jax.Array, iteration: int) -> jax.Array:
    """The sampling key of the evaluation after ``iteration``: re-evaluating a checkpoint reproduces it."""
    return jax.random.fold_in(jax.random.fold_in(base_key, iteration), 1)


def checkpoint_dir(cfg: C.ExperimentConfig, run_dir: str | None = None) -> str:
    """Where the run of ``cfg`` keeps its checkpoints."""
    return cfg.checkpoint.dir or os.path.join(run_dir or cfg.logging.run_dir or ".", "checkpoints")


def make_train_step(parts: RunParts, step_config: Any = None):
    """The jitted train step of ``parts.cfg.optim`` (AdamW + clipping on its learning-rate schedule)."""
    from mage_jax.training.train_step import StepConfig, TrainStep, learning_rate_schedule, make_optimizer

    o = parts.cfg.optim
    schedule = learning_rate_schedule(o.lr, o.warmup_steps)
    optimizer = make_optimizer(schedule, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay, grad_clip=o.grad_clip)
    return TrainStep(parts.graphdef, optimizer, schedule, step_config or StepConfig(), parts.mesh)


def restore_params(parts: RunParts, directory: str, step: int | None = None) -> tuple[Any, dict[str, Any]]:
    """The trained parameters (and metadata) of a checkpoint, placed like ``parts.init_params``."""
    from mage_jax.training.checkpoint import Checkpointer

    template = make_train_step(parts).init_state(parts.init_params)
    with Checkpointer(directory) as ckpt:
        if ckpt.latest_step() is None:
            raise C.ConfigError(f"no complete checkpoint in {directory!r}")
        state, meta = ckpt.restore(template, step)
    return state.params, meta


def make_policy(parts: RunParts, params: Any, key: jax.Array, *, evaluation: bool):
    from mage_jax.rollout.policy import LLMPolicy
    from mage_jax.sampling import SamplingParams

    cfg = parts.cfg
    s = cfg.sampling.eval if evaluation else cfg.sampling.train
    r = cfg.rollout
    params_s = SamplingParams(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
        max_new_tokens=max(r.max_response_tokens, r.max_reflection_tokens or 0),
    )
    return LLMPolicy(parts.tokenizer, parts.sampler, params, params_s, key,
                     max_prompt_tokens=r.max_prompt_tokens)


# ----------------------------------------------------------------------------------------------
# evaluation


def kuhn_reference(tasks: Sequence[Any], num_episodes: int) -> dict[str, Any] | None:
    """Oracle numbers (ceiling, random, best fixed, adaptive bound) on exactly these meta-episodes."""
    from mage_jax.evaluation.oracle import KuhnMetaEpisode, kuhn_oracle

    episodes = [KuhnMetaEpisode(seed=t.seed, seat=int(t.seat), opponent=t.opponent) for t in tasks]
    out = _reference_block(kuhn_oracle(episodes, num_episodes))
    out["by_opponent"] = {}
    for name in sorted({e.opponent for e in episodes}):
        subset = [e for e in episodes if e.opponent == name]
        out["by_opponent"][name] = _reference_block(kuhn_oracle(subset, num_episodes))
    return out


def _reference_block(report) -> dict[str, Any]:
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


class Evaluator:
    """Held-out evaluation of a parameter state; reference numbers are computed once per task set."""

    def __init__(self, parts: RunParts, *, progress: bool = True):
        self.parts = parts
        self.progress = progress
        self._references: dict[str, Any] = {}

    def task_sets(self, *, heldout: bool) -> dict[str, list[Any]]:
        cfg, ts = self.parts.cfg, self.parts.task_sampler
        sets = {"eval": ts.sample_eval(cfg.train.eval_meta_episodes)}
        if heldout and cfg.env.heldout_opponent and cfg.train.eval_heldout_meta_episodes > 0:
            sets["heldout"] = ts.sample_eval(cfg.train.eval_heldout_meta_episodes,
                                             opponent=cfg.env.heldout_opponent, seat=cfg.env.heldout_seat)
        return sets

    def reference(self, split: str, tasks: Sequence[Any]) -> dict[str, Any] | None:
        if split not in self._references:
            cfg = self.parts.cfg
            ref = None
            if cfg.env.name == "kuhn_poker" and all(t.opponent is not None for t in tasks):
                ref = kuhn_reference(tasks, cfg.train.eval_num_episodes)
            self._references[split] = ref
        return self._references[split]

    def evaluate(self, params: Any, key: jax.Array, *, heldout: bool, runner=None,
                 description: str = "eval") -> dict[str, Any]:
        """{split: {"metrics": compute_metrics(...), "reference": oracle numbers or None}}."""
        from mage_jax.evaluation.metrics import compute_metrics

        runner = runner or self.parts.eval_runner
        chunk = max(self.parts.cfg.rollout.num_tasks * self.parts.cfg.rollout.group_size, 128)
        out: dict[str, Any] = {}
        for s_index, (split, tasks) in enumerate(self.task_sets(heldout=heldout).items()):
            outcomes, rows = [], []
            bar = _bar(total=len(tasks), desc=f"{description}:{split}", enabled=self.progress, leave=False)
            for c_index, start in enumerate(range(0, len(tasks), chunk)):
                policy = make_policy(self.parts, params, jax.random.fold_in(key, 1000 * s_index + c_index),
                                     evaluation=True)
                result = runner.run(tasks[start:start + chunk], policy, training=False)
                outcomes += result.outcomes
                rows += result.rows
                bar.update(len(result.outcomes))
                last = [o.payoff[-1] for o in outcomes]
                won = [any(o.won) for o in outcomes]
                bar.set_postfix(success=f"{np.mean(won):.3f}", payoff=f"{np.mean(last):.3f}")
            bar.close()
            metrics = compute_metrics(outcomes, num_episodes=runner.config.num_episodes, rows=rows)
            out[split] = {"metrics": metrics, "reference": self.reference(split, tasks)}
        return out


def flat_eval(results: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    from mage_jax.evaluation.metrics import flatten_metrics

    return {split: flatten_metrics(block["metrics"]) for split, block in results.items()}


# ----------------------------------------------------------------------------------------------
# progress bars


class _NoBar:
    def update(self, n: int = 1) -> None: ...
    def set_postfix(self, *args: Any, **kwargs: Any) -> None: ...
    def set_description(self, *args: Any, **kwargs: Any) -> None: ...
    def write(self, text: str) -> None:
        print(text, file=sys.stderr)
    def close(self) -> None: ...


def _bar(*, total: int, desc: str, enabled: bool, initial: int = 0, leave: bool = True):
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, initial=initial, leave=leave, dynamic_ncols=True, file=sys.stderr)


# ----------------------------------------------------------------------------------------------
# the trainer


@dataclasses.dataclass
class TrainResult:
    run_dir: str
    status: str
    """``finished`` or ``interrupted`` (SIGTERM; a checkpoint was saved)."""
    iteration: int
    summary: dict[str, Any]


class Trainer:
    """Runs (or resumes) one training run described by an ``ExperimentConfig``."""

    def __init__(self, cfg: C.ExperimentConfig, *, resume: bool = False, experiment: str | None = None):
        if cfg.logging.run_dir is None:
            raise C.ConfigError("logging.run_dir must be set before training")
        self.cfg = cfg
        self.run_dir = cfg.logging.run_dir
        self.resume = resume
        self.experiment = experiment or cfg.name
        self._stop = threading.Event()

    # -- setup -------------------------------------------------------------------------------------
    def _setup(self) -> None:
        from mage_jax.training.checkpoint import Checkpointer
        from mage_jax.training.train_step import StepConfig

        cfg = self.cfg
        os.makedirs(self.run_dir, exist_ok=True)
        C.save(cfg, self.run_dir)
        self.parts = build_parts(cfg, self.run_dir)
        o = cfg.optim
        constraint_len = cfg.rollout.max_response_tokens if cfg.rollout.constrained_actions else 0
        step_cfg = StepConfig(
            clip_eps=o.clip_eps, dual_clip=o.dual_clip, entropy_coef=o.entropy_coef, kl_coef=o.kl_coef,
            kl_kind=o.kl_kind, aggregation=o.aggregation, chunk_size=o.logprob_chunk,
            constraint_len=constraint_len,
        )
        self.step = make_train_step(self.parts, step_cfg)
        self.state = self.step.init_state(self.parts.init_params)
        # The frozen reference for the KL term is the initial model (a copy: the train state is donated).
        self.ref_params = jax.tree.map(jnp.copy, self.state.params) if o.kl_coef > 0 else None
        self.adv_cfg = advantage_config(cfg)
        self.base_key = jax.random.key(cfg.train.seed)
        ckpt_dir = checkpoint_dir(cfg, self.run_dir)
        self.checkpointer = Checkpointer(ckpt_dir, keep=cfg.checkpoint.keep, every=cfg.checkpoint.every)
        self.start_iteration = 0
        if self.resume and self.checkpointer.latest_step() is not None:
            from mage_jax.training.checkpoint import key_from_json

            state, meta = self.checkpointer.restore(self.state)
            self.state = state
            self.start_iteration = int(meta["iteration"])
            self.base_key = key_from_json(meta["rng"])
            try:
                self.parts.task_sampler.load_state_dict(meta.get("task_sampler", {}))
            except ValueError as err:
                raise C.ConfigError(str(err)) from None
        self.logger = MetricsLogger(
            self.run_dir, tensorboard=cfg.logging.tensorboard, wandb=cfg.logging.wandb,
            wandb_project=cfg.logging.wandb_project, config=C.to_dict(cfg),
            resume_iteration=self.start_iteration if self.resume else None,
        )
        self.evaluator = Evaluator(self.parts, progress=cfg.logging.progress)

    # -- one iteration ---------------------------------------------------------------------------------
    def train_iteration(self, iteration: int) -> dict[str, float]:
        """Rollout + credit + PPO updates for training iteration ``iteration`` (1-based)."""
        from mage_jax.algorithms import compute_advantages
        from mage_jax.evaluation.metrics import compute_metrics
        from mage_jax.rollout.rows import minibatch_indices, pack_rows, pick_bucket
        from mage_jax.training.train_step import length_grouped_minibatches, lr_decay, minibatch_arrays

        cfg, parts = self.cfg, self.parts
        t0 = time.perf_counter()
        tasks = parts.task_sampler.sample_train(iteration - 1)
        key = jax.random.fold_in(self.base_key, iteration)
        policy = make_policy(parts, self.state.params, jax.random.fold_in(key, 0), evaluation=False)
        result = parts.train_runner.run(tasks, policy, training=True)
        t_rollout = time.perf_counter() - t0

        mb = cfg.optim.mini_batch_rows
        limit = cfg.rollout.max_prompt_tokens + max(cfg.rollout.max_response_tokens,
                                                    cfg.rollout.max_reflection_tokens or 0)
        buckets = _length_buckets(limit, cfg.rollout.length_buckets)
        packed = pack_rows(result.rows, row_bucket=mb, length_buckets=buckets, pad_id=parts.tokenizer.pad_id)
        row_lengths = (packed.prompt_lengths + packed.response_lengths)[: packed.num_rows]

        def bucket_of(idx: np.ndarray) -> int:  # the token length a mini-batch of rows ``idx`` needs
            real = idx[idx >= 0]
            return pick_bucket(max(int(row_lengths[real].max()) if len(real) else 1, 1), buckets)

        advantages = np.asarray(compute_advantages(cfg.algorithm.estimator, packed.row_batch(), self.adv_cfg))
        constrained = packed.constraint_table is not None
        n = packed.num_rows

        # Old (and reference) log-probs of every real row, before any update of this iteration.
        t1 = time.perf_counter()
        R, T = packed.tokens.shape
        old = np.zeros((R, T), np.float32)
        ref = np.zeros((R, T), np.float32) if self.ref_params is not None else None
        order = np.argsort(row_lengths, kind="stable")
        for idx in minibatch_indices(n, mb, permutation=order):
            length = bucket_of(idx)
            arrays = self.step.place_batch(
                minibatch_arrays(packed, idx, constrained=constrained, length=length))
            real = idx[idx >= 0]
            logp = self.step.compute_logprobs(self.state.params, arrays)
            old[real, :length] = np.asarray(logp)[: len(real)]
            if ref is not None:
                ref_logp = self.step.compute_logprobs(self.ref_params, arrays)
                ref[real, :length] = np.asarray(ref_logp)[: len(real)]

        # PPO epochs over shuffled mini-batches.
        step_metrics: list[dict[str, float]] = []
        progress = (iteration - 1) / max(cfg.train.iterations - 1, 1)
        lr_scale = lr_decay(cfg.optim.lr_decay, progress, cfg.optim.lr_end_fraction)
        for epoch in range(cfg.optim.epochs):
            rng = np.random.default_rng([cfg.train.seed, iteration, epoch])
            if cfg.optim.group_by_length:
                blocks = length_grouped_minibatches(row_lengths, mb, rng, buckets)
            else:
                blocks = minibatch_indices(n, mb, permutation=rng.permutation(n))
            for idx in blocks:
                safe = np.where(idx < 0, 0, idx)
                pad = (idx < 0)[:, None]
                batch = minibatch_arrays(
                    packed, idx, advantages=advantages,
                    old_logprobs=np.where(pad, 0.0, old[safe]),
                    ref_logprobs=None if ref is None else np.where(pad, 0.0, ref[safe]),
                    constrained=constrained, length=bucket_of(idx),
                )
                self.state, metrics = self.step.update(self.state, self.step.place_batch(batch), lr_scale)
                step_metrics.append(metrics)
        step_metrics = [{k: float(v) for k, v in m.items()} for m in jax.device_get(step_metrics)]
        t_update = time.perf_counter() - t1

        out: dict[str, float] = {}
        for name in step_metrics[0]:
            values = [m[name] for m in step_metrics]
            summed = name in ("skipped", "response_tokens")
            out[name] = float(np.sum(values)) if summed else float(np.mean(values))
        out["updates"] = float(len(step_metrics))
        train_metrics = compute_metrics(result, num_episodes=cfg.rollout.num_episodes)
        last = cfg.rollout.num_episodes - 1
        curves = train_metrics["curves"]
        for k in range(cfg.rollout.num_episodes):
            out[f"success@{k}"] = curves["success"][k]
            out[f"payoff@{k}"] = curves["payoff"][k]
        out["valid_action_ratio"] = train_metrics["valid_action_ratio"] or 0.0
        out["rows_per_meta_episode"] = train_metrics["rows_per_meta_episode"]
        episode_rewards = [r for o in result.outcomes for r in o.rewards]
        out["reward_mean"] = float(np.mean(episode_rewards))
        out["reward_min"] = float(np.min(episode_rewards))
        out["reward_max"] = float(np.max(episode_rewards))
        out["advantage_abs_mean"] = float(np.abs(advantages[:n]).mean()) if n else 0.0
        for name in ("rows", "invalid_ratio", "response_length_mean", "response_length_max",
                     "episodes_run_mean", "truncated_responses", "overflow_invalid"):
            if name in result.stats:
                out[name] = float(result.stats[name])
        out["row_tokens_max"] = float(row_lengths.max()) if n else 0.0
        out["row_tokens_mean"] = float(row_lengths.mean()) if n else 0.0
        out["rollout_seconds"] = t_rollout
        out["update_seconds"] = t_update
        out["iteration_seconds"] = time.perf_counter() - t0
        out["rows_per_second"] = n / max(out["iteration_seconds"], 1e-9)
        out["success@last"] = curves["success"][last]
        out["payoff@last"] = curves["payoff"][last]
        return out

    # -- the loop ----------------------------------------------------------------------------------------
    def _checkpoint(self, iteration: int) -> None:
        from mage_jax.training.checkpoint import key_to_json

        meta = {
            "iteration": iteration,
            "rng": key_to_json(self.base_key),
            "task_sampler": self.parts.task_sampler.state_dict(),
            "config": C.to_dict(self.cfg),
        }
        self.checkpointer.save(iteration, self.state, meta)

    def _evaluate(self, iteration: int, *, final: bool) -> dict[str, Any]:
        heldout = final or not self.cfg.train.eval_final_only_heldout
        key = evaluation_key(self.base_key, iteration)
        results = self.evaluator.evaluate(self.state.params, key, heldout=heldout)
        for split, flat in flat_eval(results).items():
            self.logger.log(iteration, flat, split=split)
        return results

    def _install_sigterm(self) -> Callable[[], None]:
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        previous = signal.getsignal(signal.SIGTERM)

        def handler(signum, frame):
            self._stop.set()

        signal.signal(signal.SIGTERM, handler)
        return lambda: signal.signal(signal.SIGTERM, previous)

    def request_stop(self) -> None:
        """Finish the current iteration, save a checkpoint and return (what SIGTERM does)."""
        self._stop.set()

    def run(self) -> TrainResult:
        start_time = time.perf_counter()
        restore_signal = self._install_sigterm()
        # One bar for the whole run: it shows "setup" while the tokenizer and model are built.
        bar = _bar(total=self.cfg.train.iterations, desc="setup", enabled=self.cfg.logging.progress)
        try:
            self._setup()
            return self._loop(start_time, bar)
        finally:
            bar.close()
            restore_signal()
            if hasattr(self, "logger"):
                self.logger.close()
            if hasattr(self, "checkpointer"):
                self.checkpointer.close()

    def _loop(self, start_time: float, bar: Any) -> TrainResult:
        cfg = self.cfg
        total = cfg.train.iterations
        setup_seconds = time.perf_counter() - start_time
        bar.update(self.start_iteration)
        bar.set_description("train")
        last_eval: dict[str, Any] | None = None
        iteration = self.start_iteration
        status = "finished"
        try:
            while iteration < total:
                if self._stop.is_set():
                    status = "interrupted"
                    break
                iteration += 1
                metrics = self.train_iteration(iteration)
                metrics["wall_seconds"] = time.perf_counter() - start_time
                self.logger.log(iteration, metrics, split="train")
                bar.update(1)
                postfix = {"succ": f"{metrics['success@last']:.2f}", "pay": f"{metrics['payoff@last']:+.2f}",
                           "ent": f"{metrics['entropy']:.3f}", "kl": f"{metrics['approx_kl']:+.3f}"}
                if last_eval is not None:
                    ev = last_eval["eval"]["metrics"]["curves"]
                    postfix["eval_pay"] = f"{ev['payoff'][-1]:+.3f}"
                bar.set_postfix(postfix)
                if cfg.train.eval_every > 0 and iteration % cfg.train.eval_every == 0 and iteration < total:
                    last_eval = self._evaluate(iteration, final=False)
                if self.checkpointer.should_save(iteration):
                    self._checkpoint(iteration)
        finally:
            bar.set_description("final evaluation" if status == "finished" else "saving")
        if status == "interrupted":
            self._checkpoint(iteration)
            return TrainResult(self.run_dir, status, iteration, {"status": status, "iteration": iteration})
        final = self._evaluate(iteration, final=True)
        self._checkpoint(iteration)
        self._plots(final)
        summary = self._summary(iteration, final, time.perf_counter() - start_time, setup_seconds)
        return TrainResult(self.run_dir, status, iteration, summary)

    def _summary(self, iteration: int, final: Mapping[str, Any], wall: float,
                 setup_seconds: float) -> dict[str, Any]:
        summary = {
            "experiment": self.experiment,
            "status": "finished",
            "iterations": iteration,
            "wall_seconds": wall,
            "setup_seconds": setup_seconds,
            "run_dir": os.path.abspath(self.run_dir),
            "model": {"num_params": int(self.parts.model_config.num_params()),
                      "vocab_size": int(self.parts.model_config.vocab_size),
                      "num_layers": int(self.parts.model_config.num_layers),
                      "hidden_size": int(self.parts.model_config.hidden_size)},
            "evaluation": {split: {"metrics": block["metrics"], "reference": block["reference"]}
                           for split, block in final.items()},
        }
        path = os.path.join(self.run_dir, SUMMARY_FILE)
        with open(path + ".tmp", "w") as f:
            json.dump(to_jsonable(summary), f, indent=1)
        os.replace(path + ".tmp", path)
        return summary

    def _plots(self, final: Mapping[str, Any]) -> None:
        """PNGs in ``<run_dir>/plots``: success@k and payoff@k per opponent (with the reference lines)
        for every evaluation split, and the training curves."""
        if not self.cfg.logging.plots:
            return
        write_plots(self.run_dir, final)


TRAINING_PLOT_KEYS = ("success@last", "payoff@last", "reward_mean", "policy_loss", "entropy", "approx_kl",
                      "grad_norm", "clip_fraction", "iteration_seconds")


def write_plots(run_dir: str, final: Mapping[str, Any]) -> list[str]:
    from mage_jax.evaluation import plots
    from mage_jax.logging import METRICS_FILE

    out = os.path.join(run_dir, "plots")
    os.makedirs(out, exist_ok=True)
    written = []
    for split, block in final.items():
        ref = block.get("reference") or {}
        lines: dict[str, dict[str, Any]] = {"success": {}, "payoff": {}}
        if "winnable" in ref:
            lines["success"]["winnable (ceiling)"] = ref["winnable"]
        for metric in ("success", "payoff"):
            for name, label in (("random", "random"), ("best_fixed", "best fixed")):
                if f"{name}_{metric}" in ref:
                    lines[metric][label] = ref[f"{name}_{metric}"]
        if "adaptive_payoff_bound" in ref:
            lines["payoff"]["adaptive bound"] = ref["adaptive_payoff_bound"]
        written += [str(p) for p in plots.plot_success_and_payoff(block["metrics"], out, reference=lines,
                                                                  prefix=f"{split}_")]
    with contextlib.suppress(ValueError):  # no training record (zero iterations)
        written.append(str(plots.plot_training_curves(os.path.join(run_dir, METRICS_FILE),
                                                      os.path.join(out, "training.png"),
                                                      keys=TRAINING_PLOT_KEYS)))
    return written


def train(cfg: C.ExperimentConfig, *, resume: bool = False, experiment: str | None = None) -> TrainResult:
    """Train (or resume) the run of ``cfg``; the run directory is ``cfg.logging.run_dir``."""
    return Trainer(cfg, resume=resume, experiment=experiment).run()
