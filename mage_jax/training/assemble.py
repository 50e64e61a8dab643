"""From an ``ExperimentConfig`` to the parts of a run: the one reader of the config's library sections.

``build_parts(cfg, run_dir)`` builds, once per run: the device mesh, the task sampler, the tokenizer
(a local HF folder, or the word-level vocabulary of random-policy meta-episodes, saved in the run
directory and loaded from there on resume), the model (random init or HF weights) and its sampler,
and the training and evaluation runners. ``RunParts`` then makes the per-rollout objects (policies)
and the train step. The trainer, the evaluator and the experiment entry points receive these parts;
none of them translates config sections itself.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import jax

from mage_jax import config as C
from mage_jax import host_random
from mage_jax.algorithms.advantages import AdvantageConfig
from mage_jax.algorithms.schedules import learning_rate_schedule
from mage_jax.envs.base import make_env
from mage_jax.envs.two_player import TwoPlayerGameEnv
from mage_jax.envs.workers import default_workers
from mage_jax.generate.engine import RolloutEngine
from mage_jax.generate.sampler import Sampler
from mage_jax.generate.slots import compiled_engine
from mage_jax.generate.spec import ModelSpec
from mage_jax.generate.step import SamplingParams
from mage_jax.logging import MetricsLogger
from mage_jax.models import sharding as shd
from mage_jax.models.config import ModelConfig
from mage_jax.models.hf_loading import load_hf_params
from mage_jax.rollout.attempts import IndependentAttemptsRunner
from mage_jax.rollout.meta_episode import MetaEpisodeRunner, RunnerConfig
from mage_jax.rollout.policy import LLMPolicy, Policy, RandomLegalPolicy
from mage_jax.rollout.tasks import TaskSampler, TaskSamplerConfig
from mage_jax.tokenizer import Tokenizer, TokenizerError
from mage_jax.training.checkpoint import Checkpointer
from mage_jax.training.train_step import StepConfig, TrainStep, make_optimizer, shared_train_step

TOKENIZER_DIR = "tokenizer"
ROLLOUT_STREAM, EVALUATION_STREAM = 0, 1
"""Iteration i's key (the run's key folded with i) folded with these: the training rollout's sampling
key and the evaluation's (``evaluation_key``)."""
EVAL_MODES = ("meta", "independent")


# ----------------------------------------------------------------------------------------------
# config sections -> library configs


def length_buckets(limit: int, configured: Sequence[int] = ()) -> tuple[int, ...]:
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


def row_length_buckets(cfg: C.ExperimentConfig) -> tuple[int, ...]:
    """Buckets of prompt + response rows in the train step."""
    r = cfg.rollout
    return length_buckets(r.max_prompt_tokens + r.max_new_tokens, r.length_buckets)


def advantage_config(cfg: C.ExperimentConfig) -> AdvantageConfig:
    a = cfg.algorithm
    return AdvantageConfig(
        reward_design=a.reward,
        gamma_step=a.gamma_step,
        gamma_traj=a.gamma_traj,
        omega=a.step_weight,
        norm=a.norm,
        anchor=a.anchor,
        invalid_penalty=a.invalid_penalty,
        length_penalty=a.length_penalty,
        max_response_length=cfg.rollout.max_response_tokens if a.length_penalty > 0 else None,
        # A reflect row is measured against the limit it was generated under (docs/method.md §4).
        max_reflection_length=cfg.rollout.reflection_tokens if a.length_penalty > 0 else None,
    )


def step_config(cfg: C.ExperimentConfig) -> StepConfig:
    o = cfg.optim
    return StepConfig(
        clip_eps=o.clip_eps, dual_clip=o.dual_clip, entropy_coef=o.entropy_coef, kl_coef=o.kl_coef,
        kl_kind=o.kl_kind, aggregation=o.aggregation, chunk_size=o.logprob_chunk,
        constraint_len=constraint_length(cfg), response_len=cfg.rollout.max_new_tokens,
        micro_batch_rows=o.micro_batch_rows, adapters_only=cfg.model.lora_rank > 0,
        max_update_ratio=o.max_update_ratio,
    )


def constraint_length(cfg: C.ExperimentConfig) -> int:
    """Response tokens the train step replays constraint automata over: the play limit when actions are
    constrained, the reflection limit too when reflections are; 0 when nothing is constrained."""
    r = cfg.rollout
    lengths = [r.max_response_tokens if r.constrained_actions else 0,
               r.reflection_tokens if r.reflection_words else 0]
    return max(lengths)


def runner_config(cfg: C.ExperimentConfig, *, num_episodes: int, privileged_reflection: bool | None = None,
                  keep_text: bool = False) -> RunnerConfig:
    """The runner of ``cfg``'s rollout section with ``num_episodes`` episodes per meta-episode."""
    runner = RunnerConfig(cfg.rollout, anchor=cfg.algorithm.anchor, keep_text=keep_text)
    return runner.with_episodes(num_episodes, privileged_reflection=privileged_reflection)


def env_options(cfg: C.ExperimentConfig) -> dict[str, Any]:
    """Keyword arguments of ``make_env``: ``env.options`` with ``env.data_dir`` when it is set."""
    extra = {"data_dir": cfg.env.data_dir} if cfg.env.data_dir is not None else {}
    return {**cfg.env.options, **extra}


def _env_runner(cfg: C.ExperimentConfig, config: RunnerConfig) -> MetaEpisodeRunner:
    """A runner of ``cfg``'s environment; bad environment options or missing data are one ConfigError."""
    try:
        workers = default_workers(cfg.env.name) if cfg.env.workers is None else cfg.env.workers
        return MetaEpisodeRunner(cfg.env.name, env_options(cfg), config, workers=workers,
                                 reply_timeout=cfg.env.reply_timeout)
    except (ValueError, TypeError, FileNotFoundError, ImportError) as err:  # ImportError: an optional package
        raise C.ConfigError(f"env {cfg.env.name}: {err}") from None


def check_environment(cfg: C.ExperimentConfig) -> None:
    """One ConfigError unless ``cfg``'s environment accepts its options and every opponent name (the
    pool's and the held-out one): checked before a run builds or writes anything."""
    e = cfg.env
    names = [*e.opponents, *([e.heldout_opponent] if e.heldout_opponent else [])]
    try:
        env = make_env(e.name, **env_options(cfg))
        if names and not isinstance(env, TwoPlayerGameEnv):
            raise C.ConfigError(
                f"env {e.name} has no opponents, but env.opponents={','.join(e.opponents) or 'none'} and "
                f"env.heldout_opponent={e.heldout_opponent}; set --env.opponents '' "
                "--env.opponent_ratios '' --env.heldout_opponent none")
        for name in names:
            make_env(e.name, **{**env_options(cfg), "opponent": name})
    except (ValueError, TypeError, FileNotFoundError, NotADirectoryError, ImportError) as err:
        if isinstance(err, C.ConfigError):
            raise
        raise C.ConfigError(f"env {e.name}: {err}") from None


def make_runner(cfg: C.ExperimentConfig, *, num_episodes: int, keep_text: bool = False) -> MetaEpisodeRunner:
    return _env_runner(cfg, runner_config(cfg, num_episodes=num_episodes, keep_text=keep_text))


def make_eval_runner(cfg: C.ExperimentConfig,
                     eval_mode: str = "meta") -> MetaEpisodeRunner | IndependentAttemptsRunner:
    """``meta``: meta-episodes of ``train.eval_num_episodes`` episodes; ``independent``: that many
    one-episode attempts without memory (the single-episode baselines and ReAct, docs/method.md §8)."""
    if eval_mode not in EVAL_MODES:
        raise C.ConfigError(f"eval_mode must be one of {', '.join(EVAL_MODES)} (got {eval_mode!r})")
    n = cfg.train.eval_num_episodes
    if eval_mode == "independent":
        base = _env_runner(cfg, runner_config(cfg, num_episodes=1, privileged_reflection=False))
        return IndependentAttemptsRunner(base, n)
    return make_runner(cfg, num_episodes=n)


def make_task_sampler(cfg: C.ExperimentConfig) -> TaskSampler:
    e, r = cfg.env, cfg.rollout
    opponents = dict(zip(e.opponents, e.opponent_ratios)) if e.opponents else None
    try:
        return TaskSampler(TaskSamplerConfig(
            num_tasks=r.num_tasks, group_size=r.group_size, opponents=opponents, grouping=e.grouping,
            seats=e.seats if opponents else "first", seed=cfg.train.seed,
            eval_seed=e.eval_seed,
        ))
    except ValueError as err:
        raise C.ConfigError(f"env.opponents / env.opponent_ratios: {err}") from None


def make_mesh(cfg: C.ExperimentConfig, devices: Sequence[Any] | None = None):
    """The mesh of ``cfg.mesh`` over all devices (or ``devices``); a bad shape is one ConfigError."""
    try:
        return shd.make_mesh(cfg.mesh, devices)
    except ValueError as err:
        raise C.ConfigError(f"mesh: {err}") from None


def checkpoint_dir(cfg: C.ExperimentConfig, run_dir: str | None = None) -> str:
    """Where the run of ``cfg`` keeps its checkpoints."""
    return cfg.checkpoint.dir or os.path.join(run_dir or cfg.logging.run_dir or ".", "checkpoints")


def best_checkpoint_dir(cfg: C.ExperimentConfig, run_dir: str | None = None) -> str:
    """Where a run with validation keeps its best validated state (``train.validate_every``)."""
    return checkpoint_dir(cfg, run_dir).rstrip(os.sep) + "_best"


def make_checkpointer(cfg: C.ExperimentConfig, run_dir: str) -> Checkpointer:
    """The run's checkpoints (``checkpoint.dir``, ``checkpoint.keep``, saved every ``checkpoint.every``)."""
    return Checkpointer(checkpoint_dir(cfg, run_dir), keep=cfg.checkpoint.keep, every=cfg.checkpoint.every)


def make_best_checkpointer(cfg: C.ExperimentConfig, run_dir: str) -> Checkpointer | None:
    """The best validated state's checkpoint (one kept); None without validation."""
    return Checkpointer(best_checkpoint_dir(cfg, run_dir), keep=1) if cfg.train.validate_every > 0 else None


def make_logger(cfg: C.ExperimentConfig, run_dir: str, *, resume: bool) -> MetricsLogger:
    """The run's metrics log (``metrics.jsonl``, ``samples.jsonl``, TensorBoard / W&B when on). A fresh run
    starts the files anew; a resumed one keeps them for the trainer to rewind to its checkpoint."""
    lc = cfg.logging
    return MetricsLogger(run_dir, tensorboard=lc.tensorboard, wandb=lc.wandb, wandb_project=lc.wandb_project,
                         config=C.to_dict(cfg), keep_existing=resume)


# ----------------------------------------------------------------------------------------------
# tokenizer and model


def tokenizer_corpus(cfg: C.ExperimentConfig, task_sampler: TaskSampler) -> list[str]:
    """Rendered prompts and responses of random-policy meta-episodes: the word-level vocabulary source.

    Covers training and evaluation prompts (the held-out opponent included), so every word the model
    will read is in the vocabulary.
    """
    texts: list[str] = []
    n = cfg.tokenizer.corpus_meta_episodes
    batches = [task_sampler.sample_train(i) for i in range(max(1, -(-n // task_sampler.config.batch_size)))]
    tasks = [t for b in batches for t in b][:n]
    episodes = max(cfg.rollout.num_episodes, cfg.train.eval_num_episodes)
    runner = make_runner(cfg, num_episodes=episodes, keep_text=True)
    jobs = [(tasks, True), (task_sampler.sample_eval(min(n, 64)), False)]
    if cfg.env.heldout_opponent:
        jobs.append((task_sampler.sample_eval(min(n, 64), opponent=cfg.env.heldout_opponent,
                                              seat=cfg.env.heldout_seat), False))
    for i, (job, training) in enumerate(jobs):
        policy = RandomLegalPolicy(cfg.train.seed + i, reflection="<remark> plan </remark>", otherwise="")
        result = runner.run(job, policy, training=training)
        if training and result.rows and all(row.overflow for row in result.rows):
            raise C.ConfigError(
                f"every prompt is longer than rollout.max_prompt_tokens={cfg.rollout.max_prompt_tokens} "
                "even without memory: nothing would be trained on; raise rollout.max_prompt_tokens")
        for row in result.rows:
            texts.append(row.prompt_text or "")
            texts.append(row.response_text or "")
    if cfg.rollout.reflection_words:  # every word, even one the random reflections never drew
        texts.append(" ".join(cfg.rollout.reflection_words))
    return texts


def build_tokenizer(cfg: C.ExperimentConfig, run_dir: str | None, task_sampler: TaskSampler) -> Tokenizer:
    """The run's tokenizer: HF from a folder, or word-level built from rendered prompts (saved in the run
    dir, and loaded from there on resume)."""
    try:
        if cfg.tokenizer.kind == "hf":
            return Tokenizer.from_hf_dir(cfg.tokenizer.path or cfg.model.path,
                                         enable_thinking=cfg.tokenizer.enable_thinking)
        saved = os.path.join(run_dir, TOKENIZER_DIR) if run_dir else None
        if saved and os.path.isdir(saved):
            return _with_reflection_words(Tokenizer.load(saved), cfg)
        tok = _with_reflection_words(Tokenizer.word_level(tokenizer_corpus(cfg, task_sampler)), cfg)
        if saved and shd.is_main_process():  # every process built the same one
            tok.save(saved)
        return tok
    except TokenizerError as err:
        raise C.ConfigError(str(err)) from None


def _with_reflection_words(tok: Tokenizer, cfg: C.ExperimentConfig) -> Tokenizer:
    """``tok`` when every constrained reflection word is one known token of it (one ConfigError otherwise:
    e.g. a resumed run whose saved vocabulary predates a changed word list)."""
    unknown = [w for w in cfg.rollout.reflection_words if tok.single_token_id(w) is None]
    if unknown:
        raise C.ConfigError(f"rollout.reflection_words {', '.join(unknown)} are not single tokens of the "
                            "word-level vocabulary (a resumed run keeps the vocabulary it was built with)")
    return tok


def model_config_of(cfg: C.ExperimentConfig, *, hf_config: ModelConfig | None = None,
                    vocab_size: int = 0) -> ModelConfig:
    """The run's ``ModelConfig``: a folder's HF config (``hf_config``) or the named preset sized to the
    tokenizer's ``vocab_size`` (rounded up to a multiple of 8), with the activation dtype, the LoRA
    adapters and the overrides."""
    m = cfg.model
    fields = dict(dtype=m.dtype, lora_rank=m.lora_rank, lora_alpha=m.lora_alpha, lora_targets=m.lora_targets,
                  **m.overrides)
    if hf_config is not None:
        return dataclasses.replace(hf_config, **fields)
    vocab = -(-vocab_size // 8) * 8
    return ModelConfig.preset(m.preset, vocab_size=vocab, **fields)


def build_model(cfg: C.ExperimentConfig, tokenizer: Tokenizer, mesh: Any) -> tuple[ModelConfig, Any, Any]:
    """(ModelConfig, graphdef, params): random init from a preset, or weights of a local HF folder."""
    m = cfg.model
    try:
        seed = cfg.train.seed if m.init_seed is None else m.init_seed
        if m.path is not None:
            model_config = model_config_of(cfg, hf_config=ModelConfig.from_hf_dir(m.path))
            model_config, graphdef, params = load_hf_params(m.path, model_config, mesh=mesh, lora_seed=seed)
        else:
            model_config = model_config_of(cfg, vocab_size=tokenizer.vocab_size)
            graphdef, params = shd.init_sharded(model_config, mesh, seed=seed)
    except (ValueError, TypeError) as err:
        raise C.ConfigError(f"model: {err}") from None
    if tokenizer.vocab_size > model_config.vocab_size:
        raise C.ConfigError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only "
                            f"{model_config.vocab_size}")
    return model_config, graphdef, params


def make_train_step(cfg: C.ExperimentConfig, graphdef: Any, mesh: Any) -> TrainStep:
    """The jitted train step of ``cfg.optim`` (AdamW + clipping on its learning-rate schedule), shared by
    every run of this process with the same model graph, settings and mesh (its programs compile once)."""
    o = cfg.optim
    schedule = learning_rate_schedule(o.lr, o.warmup_steps)
    optimizer = make_optimizer(schedule, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay, grad_clip=o.grad_clip)
    return shared_train_step(graphdef, optimizer, schedule, step_config(cfg), mesh)


def sampler_batch_buckets(cfg: C.ExperimentConfig, mesh: Any) -> tuple[int, ...]:
    """Row buckets of the sampler: 8, 32, 128, 512 (those the batch axes divide) below the largest
    rollout (training or evaluation), then that rollout rounded up to the batch axes; all capped at
    ``rollout.max_decode_rows`` (a larger rollout is decoded in chunks of that many rows)."""
    r = cfg.rollout
    batch_axis = mesh.shape["data"] * mesh.shape["fsdp"]
    largest = max(r.num_tasks * r.group_size, cfg.train.eval_meta_episodes,
                  cfg.train.eval_heldout_meta_episodes)
    if r.max_decode_rows:
        largest = min(largest, r.max_decode_rows)
    return tuple(b for b in (8, 32, 128, 512) if b % batch_axis == 0 and b < largest) + (
        -(-largest // batch_axis) * batch_axis,)


def make_spec(cfg: C.ExperimentConfig, mesh: Any, model_config: ModelConfig, graphdef: Any,
              state_shardings: Any, *, eos_ids: Sequence[int], pad_id: int) -> ModelSpec:
    """What the run's generation programs need of its model (prompt buckets, shardings of the mesh)."""
    return ModelSpec(graphdef, model_config, eos_ids=tuple(eos_ids), pad_id=pad_id,
                     prompt_buckets=length_buckets(cfg.rollout.max_prompt_tokens, cfg.rollout.length_buckets),
                     mesh=mesh, state_shardings=state_shardings)


def make_sampler(cfg: C.ExperimentConfig, spec: ModelSpec, mesh: Any) -> Sampler:
    """The lockstep sampler of ``cfg`` (row buckets of the mesh)."""
    return Sampler(spec, batch_buckets=sampler_batch_buckets(cfg, mesh))


# ----------------------------------------------------------------------------------------------
# the parts of a run


@dataclasses.dataclass
class RunParts:
    """Everything built once per run from the config."""

    cfg: C.ExperimentConfig
    mesh: Any
    tokenizer: Tokenizer
    model_config: ModelConfig
    graphdef: Any
    spec: ModelSpec
    task_sampler: TaskSampler
    train_runner: MetaEpisodeRunner
    eval_runner: MetaEpisodeRunner | IndependentAttemptsRunner
    init_params: Any
    engine: RolloutEngine | None = None
    """The continuous-batching engine every policy of the run streams through; None: lockstep."""
    sampler: Sampler | None = None
    """The lockstep sampler (``rollout.engine=lockstep``); None with the engine."""

    def policy(self, params: Any, key: jax.Array, *, evaluation: bool) -> Policy:
        """The LLM policy of ``params`` with the training or the evaluation sampling settings."""
        s = self.cfg.sampling.eval if evaluation else self.cfg.sampling.train
        r = self.cfg.rollout
        sampling = SamplingParams(
            temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
            max_new_tokens=r.max_new_tokens,
        )
        generator = self.engine or self.sampler
        assert generator is not None, "a run has the engine or the lockstep sampler"
        return LLMPolicy(self.tokenizer, generator, params, sampling, key,
                         max_prompt_tokens=r.max_prompt_tokens)

    def train_step(self) -> TrainStep:
        """The jitted train step of ``cfg.optim`` (AdamW + clipping on its learning-rate schedule)."""
        return make_train_step(self.cfg, self.graphdef, self.mesh)

    def restore_params(self, directory: str, step: int | None = None) -> tuple[Any, dict[str, Any]]:
        """The trained parameters (and metadata) of a checkpoint, placed like ``init_params``."""
        template = self.train_step().init_state(self.init_params)
        with Checkpointer(directory) as ckpt:
            if ckpt.latest_step() is None:
                raise C.ConfigError(f"no complete checkpoint in {directory!r}")
            state, meta = ckpt.restore(template, step)
        return state.params, meta


@dataclasses.dataclass(frozen=True)
class GenerationParts:
    """The model of a run and what generates with it: built by ``build_generation``."""

    model_config: ModelConfig
    graphdef: Any
    params: Any
    spec: ModelSpec
    engine: RolloutEngine | None
    """The rollout engine; None: ``rollout.engine=lockstep``."""
    sampler: Sampler | None
    """The lockstep sampler: built for ``rollout.engine=lockstep`` only (None with the engine)."""


def build_generation(cfg: C.ExperimentConfig, tokenizer: Tokenizer, mesh: Any, *,
                     lockstep: bool = False) -> GenerationParts:
    """The model of ``cfg`` (random or a folder's weights, on ``mesh``), its spec and what generates with
    it: the rollout engine, or with ``rollout.engine=lockstep`` the lockstep sampler (``lockstep``: that
    sampler too, beside an engine: the engine-parity harness of ``mage_jax.testing``). The one place a
    run's generation is built."""
    model_config, graphdef, params = build_model(cfg, tokenizer, mesh)
    spec = make_spec(cfg, mesh, model_config, graphdef, shd.param_shardings(params, mesh),
                     eos_ids=tokenizer.eos_ids, pad_id=tokenizer.pad_id)
    engine = make_engine(cfg, spec, mesh)
    sampler = make_sampler(cfg, spec, mesh) if engine is None or lockstep else None
    return GenerationParts(model_config, graphdef, params, spec, engine, sampler)


def build_parts(cfg: C.ExperimentConfig, run_dir: str | None, *, eval_mode: str = "meta") -> RunParts:
    """Build every part of the run of ``cfg`` (the tokenizer is kept in, or read from, ``run_dir``)."""
    check_environment(cfg)
    mesh = make_mesh(cfg)
    task_sampler = make_task_sampler(cfg)
    eval_runner = make_eval_runner(cfg, eval_mode)
    tokenizer = build_tokenizer(cfg, run_dir, task_sampler)
    gen = build_generation(cfg, tokenizer, mesh)
    return RunParts(
        cfg=cfg, mesh=mesh, tokenizer=tokenizer, model_config=gen.model_config, graphdef=gen.graphdef,
        spec=gen.spec, task_sampler=task_sampler,
        train_runner=make_runner(cfg, num_episodes=cfg.rollout.num_episodes), eval_runner=eval_runner,
        init_params=gen.params, engine=gen.engine, sampler=gen.sampler,
    )


def make_engine(cfg: C.ExperimentConfig, spec: ModelSpec, mesh: Any) -> RolloutEngine | None:
    """The rollout engine of ``cfg`` over the compiled slot programs (None for ``rollout.engine=lockstep``).
    Slots: ``rollout.engine_slots``, or the sampler's largest row bucket (the largest rollout, capped at
    ``rollout.max_decode_rows``) and at most 64; always a multiple of the mesh's batch ways so they shard
    with the rows."""
    r = cfg.rollout
    if r.engine == "lockstep":
        return None
    batch_axis = mesh.shape["data"] * mesh.shape["fsdp"]
    slots = r.engine_slots or min(sampler_batch_buckets(cfg, mesh)[-1], 64)
    slots = -(-slots // batch_axis) * batch_axis
    return compiled_engine(spec, slots=slots, chunk=r.engine_chunk, window_levels=r.engine_windows,
                           max_new_tokens=r.max_new_tokens)


def evaluation_key(base_key: jax.Array, iteration: int) -> jax.Array:
    """The sampling key of the evaluation after ``iteration``: re-evaluating a checkpoint reproduces it."""
    return host_random.fold_in(host_random.fold_in(base_key, iteration), EVALUATION_STREAM)
