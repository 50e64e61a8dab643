"""The experiment configuration: typed frozen dataclasses and their validation.

One ``ExperimentConfig`` describes a whole run (environment, model, tokenizer, sampling, rollout,
algorithm, optimisation, loop, checkpoints, logging, device mesh). Defaults are the paper-scale
Kuhn Poker settings of docs/method.md (§2, §5, §8); experiment modules define presets as dotted
override maps on top of them (``{"optim.lr": 1e-3, ...}``).

Dotted-key overrides (``--optim.lr 1e-3``, ``--set optim.lr=1e-3``), their typed parsing, ``--list-keys``
introspection and the generic checks are ``mage_jax.configtools``; this module re-exports the functions
callers use, so they name one module. Every problem (unknown key, wrong type, impossible value) is one
``ConfigError`` with a one-line message naming the key; the entry points print it and exit non-zero
before writing anything.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Literal

from mage_jax import configtools
from mage_jax.algorithms import advantages
from mage_jax.algorithms.advantages import ANCHOR_MODES, NORM_MODES
from mage_jax.algorithms.losses import AGG_MODES, KL_KINDS
from mage_jax.algorithms.returns import REWARD_DESIGNS
from mage_jax.algorithms.schedules import LR_DECAYS
from mage_jax.configtools import (
    ConfigError,
    KeyInfo,
    apply_overrides,
    check,
    check_choices,
    check_finite,
    coerce,
    from_dict,
    get_key,
    one_of,
    parse_assignment,
    to_dict,
)
from mage_jax.models.config import DTYPES
from mage_jax.models.lora import LORA_TARGETS
from mage_jax.models.sharding import MeshConfig
from mage_jax.rollout.config import RolloutConfig, check_rollout
from mage_jax.rollout.tasks import GROUPINGS, SEAT_MODES

__all__ = [
    "CONFIG_FILE",
    "AlgorithmConfig",
    "CheckpointConfig",
    "ConfigError",
    "EnvConfig",
    "ExperimentConfig",
    "KeyInfo",
    "LoggingConfig",
    "ModelSection",
    "OptimConfig",
    "RolloutConfig",
    "SamplingConfig",
    "SamplingSection",
    "TokenizerConfig",
    "TrainConfig",
    "all_keys",
    "apply_overrides",
    "coerce",
    "describe_keys",
    "from_dict",
    "get_key",
    "load",
    "parse_assignment",
    "save",
    "to_dict",
    "validate",
]
"""The sections, their validation and files, and the generic functions of ``configtools`` that callers
use (re-exported, so that callers name one module)."""

# Choice types: the allowed values are defined once, by the module that uses the setting, and checked
# here for every field of a Literal type (when an override is parsed and again in ``validate``).
SeatMode = Literal[SEAT_MODES]
Grouping = Literal[GROUPINGS]
ActivationDtype = Literal[tuple(d for d in DTYPES if d != "float16")]
TokenizerKind = Literal["hf", "word_level"]
RewardDesign = Literal[REWARD_DESIGNS]
AnchorMode = Literal[ANCHOR_MODES]
NormMode = Literal[NORM_MODES]
LrDecay = Literal[LR_DECAYS]
KlKind = Literal[tuple(KL_KINDS)]
Aggregation = Literal[AGG_MODES]


# --------------------------------------------------------------------------------------------------
# sections


@dataclasses.dataclass(frozen=True)
class EnvConfig:
    """Environment, opponent pool, seats and grouping (docs/method.md §6)."""

    name: str = "kuhn_poker"
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Keyword arguments of ``make_env`` (e.g. ``max_turns``)."""
    data_dir: str | None = None
    """Local folder of the environment's data files (ALFWorld's game files, WebShop's official product
    and instruction files), given to the environment as its ``data_dir`` option; None: the
    environment's default (``$ALFWORLD_DATA``; WebShop's generated catalogue)."""
    opponents: tuple[str, ...] = ("conservative", "aggressive", "intermediate")
    opponent_ratios: tuple[float, ...] = (0.3, 0.3, 0.4)
    seats: SeatMode = "mixed"
    """``mixed`` (agent second in half the meta-episodes), ``first`` or ``second``."""
    grouping: Grouping = "stationary"
    """``stationary``: one opponent per group; ``mixed``: opponents mixed inside a group (ablation)."""
    eval_seed: int = 1_000_003
    """Seed of the held-out evaluation instances (disjoint from training seeds; independent of
    ``train.seed``, so runs with different seeds are evaluated on the same instances)."""
    heldout_opponent: str | None = "cfr"
    """Extra held-out evaluation opponent (None: none)."""
    heldout_seat: SeatMode = "second"
    workers: int | None = None
    """Worker processes that step and reset the environments (``mage_jax.envs.workers``) while the policy
    decodes; 0: in the main process. None: the environment's default, ``min(8, CPUs)`` for the slow
    ones (ALFWorld, WebShop) and 0 for the games. Results are the same for every value (actions,
    rewards, updates, parameters, summary) but for the diagnostics read from the sampler's own
    log-probabilities, ``entropy_play@k`` and ``entropy_reflect``: with workers, rows reach the rollout
    engine at other times, share a prefill with other prompts and sit at other cache offsets, so a
    token's sampling log-probability may differ in its last float32 bit (measured: one token in 48,
    6e-8; ``entropy_play@1`` by 3e-8). The updates recompute every log-probability and never read
    them. (In principle a draw within one rounding of a tie between two tokens could go the other way;
    no run has shown it.)"""
    reply_timeout: float | None = None
    """Seconds an environment worker may hold operations without answering before the run stops with one
    error line naming the environment, meta-episode and operation (a hung environment, a stopped
    process). None: the environment's default (``mage_jax.envs.workers.default_reply_timeout``: 600 for
    ALFWorld and WebShop, 120 for the games)."""


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """Which decoder: a named ``ModelConfig`` preset (random init) or a local HF folder (weights loaded)."""

    preset: str | None = "qwen3-4b"
    """A named ``ModelConfig`` preset (random init); None when ``path`` names the model."""
    path: str | None = None
    """Local Hugging Face folder (config.json + safetensors). When set, it replaces ``preset``: the
    resolved config names the model by its folder (``with_model_folder``)."""
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    """ModelConfig field overrides (e.g. ``{"num_layers": 2}``); ``model.overrides.KEY=VALUE`` sets one entry
    and keeps the others."""
    dtype: ActivationDtype = "float32"
    """Activation dtype (``float32`` or ``bfloat16``); parameters stay float32 for the optimiser."""
    init_seed: int | None = None
    """Seed of the random initialisation of a from-scratch model; None: ``train.seed``."""
    lora_rank: int = 0
    """LoRA adapters of this rank on ``lora_targets``; only they are trained (the base is frozen and the KL
    reference is the base without adapters). 0: full fine-tuning."""
    lora_alpha: float = 16.0
    """Adapter outputs are scaled by ``lora_alpha / lora_rank``."""
    lora_targets: tuple[str, ...] = LORA_TARGETS
    """Projections with adapters: any of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj."""


@dataclasses.dataclass(frozen=True)
class TokenizerConfig:
    kind: TokenizerKind = "hf"
    """``hf``: a local folder's HF tokenizer; ``word_level``: the built-in one for from-scratch models."""
    path: str | None = None
    """HF tokenizer folder; defaults to ``model.path``."""
    enable_thinking: bool = True
    corpus_meta_episodes: int = 256
    """Word-level only: scripted meta-episodes whose rendered prompts form the vocabulary corpus."""


@dataclasses.dataclass(frozen=True)
class SamplingSection:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0: off."""


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Training samples at temperature 1 with no truncation; evaluation as the paper (docs/method.md §8)."""

    train: SamplingSection = SamplingSection()
    eval: SamplingSection = SamplingSection(temperature=0.7, top_p=0.8, top_k=20)


@dataclasses.dataclass(frozen=True)
class AlgorithmConfig:
    """Credit assignment: reward design, returns, advantage estimator (docs/method.md §4 and §5).

    MAGE = ``differential`` + ``gigpo``; LaMer = ``cumulative`` + ``gigpo``; the single-episode RL
    baselines use ``num_episodes=1`` with ``grpo`` or ``gigpo``.
    """

    estimator: str = "gigpo"
    """A name of the advantages registry (``algorithms.advantages``; custom estimators may register)."""
    reward: RewardDesign = "differential"
    anchor: AnchorMode = "global"
    """``global`` (pool identical states across episodes) or ``local`` (ablation)."""
    gamma_step: float = 0.95
    gamma_traj: float = 0.6
    step_weight: float = 1.0
    """omega: weight of GiGPO's step term."""
    norm: NormMode = "mean_norm"
    """``mean_norm`` or ``mean_std_norm``."""
    invalid_penalty: float = 2.0
    """c_invalid: subtracted from the row score of an invalid action or a missing ``<remark>``. The one
    place the penalties' defaults are set (the paper's Kuhn Poker column, docs/method.md §8; the method's
    general c_invalid is 0.5, which the other environments' presets set); ``algorithms`` applies
    none unless given."""
    length_penalty: float = 2.0
    """c_len; 0 disables the overlong-response penalty."""


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW + PPO-style loss (docs/method.md §5)."""

    lr: float = 1e-6
    b1: float = 0.9
    b2: float = 0.999
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    warmup_steps: int = 0
    lr_decay: LrDecay = "constant"
    """Decay of the learning rate over the iterations: ``constant`` (the paper), ``linear`` or ``cosine``."""
    lr_end_fraction: float = 0.0
    """Learning rate at the last iteration, as a fraction of ``lr`` (linear / cosine decay)."""
    mini_batch_rows: int = 64
    micro_batch_rows: int = 0
    """Rows per forward/backward pass of an update, accumulated into one optimizer step (must divide
    ``mini_batch_rows``); 0: the whole mini-batch at once."""
    epochs: int = 1
    clip_eps: float = 0.2
    dual_clip: float = 3.0
    entropy_coef: float = 0.001
    kl_coef: float = 0.1
    """0 disables the KL term (and the frozen reference model)."""
    kl_kind: KlKind = "k3"
    """KL estimator (k3 is clamped to [-10, 10] by ``losses.kl_penalty``)."""
    aggregation: Aggregation = "token-mean"
    group_by_length: bool = True
    """Mini-batches of rows of similar length (shuffled blocks): each needs only its own length bucket."""
    logprob_chunk: int = 512
    """Tokens per chunk in the log-prob computation (bounds the [chunk, vocab] logits buffer)."""
    max_skipped_updates: int = 10
    """Consecutive skipped updates (non-finite loss, gradients or updated parameters, or an update over
    ``max_update_ratio``) after which the run stops with one error line and saves nothing more; 0 never
    stops."""
    max_update_ratio: float = 1.0
    """Skip an update whose size exceeds this multiple of the parameters' (global norms: ||delta|| /
    ||params||), e.g. from a learning rate far too large; 0: never. Normal runs measure below ~0.05."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    iterations: int = 150
    eval_every: int = 10
    """Evaluate every k iterations (0: only at the end)."""
    eval_meta_episodes: int = 128
    eval_num_episodes: int = 3
    eval_heldout_meta_episodes: int = 128
    """Meta-episodes against the held-out opponent (0: skip)."""
    eval_final_only_heldout: bool = True
    """Held-out evaluation only at the end (it is not a training signal)."""
    seed: int = 0
    validate_every: int = 0
    """Play ``validation_meta_episodes`` held-out meta-episodes every k iterations (and after the last)
    and keep the parameters with the best final-episode payoff (0: off). Validation instances come from
    their own seed stream, never the evaluation's; the final evaluation then measures the kept
    parameters, so selection never looks at the evaluation meta-episodes."""
    validation_meta_episodes: int = 256
    stop_when_all_invalid: bool = True
    """Stop with one error line when no row of an iteration is valid (nothing to train on). Off only
    where that is expected, e.g. a smoke run of a random model."""


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    dir: str | None = None
    """None: ``<run_dir>/checkpoints``."""
    every: int = 10
    """Save every k iterations (and at the end, and on SIGTERM); 0: only at the end."""
    keep: int = 2
    """Keep the last k checkpoints."""
    stop_during_updates: bool = True
    """Honour SIGTERM / Ctrl-C between the PPO updates of an iteration (saving the state it started
    from) by keeping that state beside the updated one: one more copy of parameters and optimizer state
    on the device during the updates, unless the previous iteration is on disk. False: no copy, and a
    stop request during the updates waits for them to end."""


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    run_dir: str | None = None
    """None: ``runs/<experiment>/<timestamp>``."""
    tensorboard: bool = False
    wandb: bool = False
    wandb_project: str = "mage-jax"
    progress: bool = True
    """tqdm progress bars during training and evaluation (and inside a long rollout: rows generated)."""
    plots: bool = True
    samples: int = 2
    """Meta-episodes per evaluation split whose prompts, responses and reflections are written to
    ``samples.jsonl`` (and TensorBoard text when on); 0: none."""
    samples_every: int = 10
    """Also write the samples of the training rollout every k iterations; 0: never."""


@dataclasses.dataclass(frozen=True)
class CompileConfig:
    cache_dir: str | None = None
    """JAX's persistent compilation cache folder (a later run of the same shapes loads its compiled
    programs instead of compiling them again); None: ``$MAGE_COMPILATION_CACHE`` if set, else
    ``~/.cache/mage-jax/jax``; "off": no cache (``mage_jax.compilation_cache``)."""


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    name: str = "kuhn_poker"
    env: EnvConfig = EnvConfig()
    model: ModelSection = ModelSection()
    tokenizer: TokenizerConfig = TokenizerConfig()
    sampling: SamplingConfig = SamplingConfig()
    rollout: RolloutConfig = RolloutConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    optim: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    logging: LoggingConfig = LoggingConfig()
    compile: CompileConfig = CompileConfig()
    mesh: MeshConfig = MeshConfig(data=-1, fsdp=1, tensor=1)
    """The device mesh (``models.sharding.MeshConfig``); by default rows over all devices (data
    parallel), the ``paper`` presets shard parameters over all devices instead (``fsdp=-1``)."""


# --------------------------------------------------------------------------------------------------
# keys of the experiment config (the generic machinery is ``mage_jax.configtools``)


def all_keys() -> list[str]:
    """Every dotted key an override of ``ExperimentConfig`` may set."""
    return configtools.all_keys(ExperimentConfig)


def describe_keys() -> list[KeyInfo]:
    """Every key with its type, its default in ``ExperimentConfig()`` and its field docstring."""
    return configtools.describe_keys(ExperimentConfig)


# --------------------------------------------------------------------------------------------------
# validation


def _check_context_length(cfg: ExperimentConfig) -> None:
    """The longest row (prompt + response) must fit the pretrained model's context,
    ``max_position_embeddings`` of its config.json: beyond it the model was never trained. (A
    from-scratch model's preset field bounds nothing: its positions are all untrained alike.)"""
    try:
        with open(os.path.join(cfg.model.path, "config.json"), encoding="utf-8") as f:
            limit = json.load(f).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return  # an unreadable config.json is reported by the loader
    r = cfg.rollout
    need = r.max_prompt_tokens + r.max_new_tokens
    if isinstance(limit, int) and need > limit:
        raise ConfigError(
            f"rollout.max_prompt_tokens ({r.max_prompt_tokens}) + the longest response ({r.max_new_tokens}, "
            f"rollout.max_response_tokens / max_reflection_tokens) = {need} tokens exceed the model's "
            f"max_position_embeddings ({limit}) in {cfg.model.path!r}; lower them")


def with_model_folder(cfg: ExperimentConfig) -> ExperimentConfig:
    """``cfg`` with no model preset when a folder gives the model: the preset (e.g. ``qwen3-0.6b`` of the
    ``small`` presets) would otherwise name a model the run does not use."""
    if cfg.model.path is None or cfg.model.preset is None:
        return cfg
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, preset=None))


SEED_LIMIT = 2**32
"""Seeds (``train.seed``, ``model.init_seed``) are integers in ``[0, SEED_LIMIT)``: numpy's generators
refuse negative ones, and JAX's keys hold 32 bits."""


def _check_seed(key: str, value: int | None) -> None:
    check(value is None or 0 <= value < SEED_LIMIT,
          f"{key} must be an integer in [0, 2**32) (got {value})")


def _check_writable_folder(key: str, path: str) -> None:
    """One ConfigError unless ``path`` is, or can be made, a folder this process can write."""
    check(not os.path.exists(path) or os.path.isdir(path), f"{key} {path!r} is a file, not a folder")
    parent = os.path.abspath(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    check(os.path.isdir(parent), f"{key} {path!r} cannot be created: {parent!r} is a file")
    check(os.access(parent, os.W_OK | os.X_OK),
          f"{key} {path!r} cannot be written: no write permission in {parent!r}")


def validate(cfg: ExperimentConfig, *, check_paths: bool = True) -> ExperimentConfig:
    """Raise ConfigError (one line) for the first impossible setting; return ``cfg`` when sound."""
    e, r, a, o, t = cfg.env, cfg.rollout, cfg.algorithm, cfg.optim, cfg.train
    check_choices(cfg)
    check_finite(cfg)
    # environment
    check(bool(e.name), "env.name must not be empty")
    check(len(e.opponents) == len(e.opponent_ratios),
           f"env.opponents ({len(e.opponents)}) and env.opponent_ratios ({len(e.opponent_ratios)}) "
           "differ in length")
    check(all(x >= 0 for x in e.opponent_ratios), "env.opponent_ratios must be non-negative")
    if e.opponent_ratios:
        check(abs(sum(e.opponent_ratios) - 1.0) < 1e-6,
               f"env.opponent_ratios must sum to 1 (got {sum(e.opponent_ratios):g})")
    check(e.eval_seed >= 0, "env.eval_seed must be >= 0")
    check(e.workers is None or e.workers >= 0,
          f"env.workers must be >= 0 (0: step environments in the main process) or none (got {e.workers})")
    check(e.reply_timeout is None or e.reply_timeout > 0,
          f"env.reply_timeout must be > 0 seconds or none (got {e.reply_timeout})")
    # model / tokenizer
    check(bool(cfg.model.preset) or cfg.model.path is not None, "model.preset or model.path must be set")
    if check_paths and cfg.model.path is not None:
        check(os.path.isdir(cfg.model.path),
               f"model.path {cfg.model.path!r} is not a folder; pass a local Hugging Face model folder "
               "(config.json + *.safetensors) with --model.path DIR")
        check(os.path.isfile(os.path.join(cfg.model.path, "config.json")),
               f"model.path {cfg.model.path!r} has no config.json; it must be a local Hugging Face "
               "model folder")
        _check_context_length(cfg)
    if cfg.tokenizer.kind == "hf":
        tok_path = cfg.tokenizer.path or cfg.model.path
        check(tok_path is not None,
               "tokenizer.kind=hf needs tokenizer.path or model.path (a local Hugging Face folder)")
        if check_paths:
            check(os.path.isdir(tok_path), f"tokenizer folder {tok_path!r} does not exist")
    lo = cfg.model
    check(lo.lora_rank >= 0, f"model.lora_rank must be >= 0 (got {lo.lora_rank})")
    check(lo.lora_alpha > 0, f"model.lora_alpha must be > 0 (got {lo.lora_alpha})")
    bad = [t for t in lo.lora_targets if t not in LORA_TARGETS]
    check(bool(lo.lora_targets) and not bad,
           f"model.lora_targets must be a non-empty list of {', '.join(LORA_TARGETS)} "
           f"(got {', '.join(lo.lora_targets) or 'none'})")
    check(cfg.tokenizer.corpus_meta_episodes > 0, "tokenizer.corpus_meta_episodes must be > 0")
    # sampling
    for split in ("train", "eval"):
        s = getattr(cfg.sampling, split)
        check(s.temperature > 0, f"sampling.{split}.temperature must be > 0 (got {s.temperature})")
        check(0 < s.top_p <= 1, f"sampling.{split}.top_p must be in (0, 1] (got {s.top_p})")
        check(s.top_k >= 0, f"sampling.{split}.top_k must be >= 0 (got {s.top_k})")
    # rollout
    check_rollout(r)
    if r.reflection_words:
        check(cfg.tokenizer.kind == "word_level",
              "rollout.reflection_words needs tokenizer.kind=word_level (each word must be one token)")
    # algorithm
    one_of("algorithm.estimator", a.estimator, advantages.available_advantages())
    check(0 <= a.gamma_step <= 1, f"algorithm.gamma_step must be in [0, 1] (got {a.gamma_step})")
    check(0 <= a.gamma_traj <= 1, f"algorithm.gamma_traj must be in [0, 1] (got {a.gamma_traj})")
    check(a.step_weight >= 0, "algorithm.step_weight must be >= 0")
    check(a.invalid_penalty >= 0, "algorithm.invalid_penalty must be >= 0")
    check(a.length_penalty >= 0, "algorithm.length_penalty must be >= 0")
    # optimisation
    check(o.lr > 0, f"optim.lr must be > 0 (got {o.lr})")
    check(0 <= o.b1 < 1 and 0 <= o.b2 < 1, f"optim.b1 and optim.b2 must be in [0, 1) (got {o.b1}, {o.b2})")
    check(o.weight_decay >= 0, f"optim.weight_decay must be >= 0 (got {o.weight_decay})")
    check(o.grad_clip > 0, f"optim.grad_clip must be > 0 (got {o.grad_clip})")
    check(o.warmup_steps >= 0, "optim.warmup_steps must be >= 0")
    check(0 <= o.lr_end_fraction <= 1, f"optim.lr_end_fraction must be in [0, 1] (got {o.lr_end_fraction})")
    check(o.mini_batch_rows >= 1, f"optim.mini_batch_rows must be >= 1 (got {o.mini_batch_rows})")
    micro = o.micro_batch_rows
    check(micro == 0 or (micro >= 1 and o.mini_batch_rows % micro == 0),
           f"optim.micro_batch_rows must be 0 or divide optim.mini_batch_rows {o.mini_batch_rows} "
           f"(got {o.micro_batch_rows})")
    check(o.epochs >= 1, f"optim.epochs must be >= 1 (got {o.epochs})")
    check(0 < o.clip_eps < 1, f"optim.clip_eps must be in (0, 1) (got {o.clip_eps})")
    check(o.dual_clip > 1, f"optim.dual_clip must be > 1 (got {o.dual_clip})")
    check(o.entropy_coef >= 0, f"optim.entropy_coef must be >= 0 (got {o.entropy_coef})")
    check(o.kl_coef >= 0, f"optim.kl_coef must be >= 0 (got {o.kl_coef})")
    check(o.logprob_chunk >= 1, "optim.logprob_chunk must be >= 1")
    check(o.max_update_ratio >= 0, f"optim.max_update_ratio must be >= 0 (got {o.max_update_ratio})")
    check(o.max_skipped_updates >= 0,
           f"optim.max_skipped_updates must be >= 0 (got {o.max_skipped_updates})")
    # loop
    check(t.iterations >= 0, f"train.iterations must be >= 0 (got {t.iterations})")
    check(t.eval_every >= 0, "train.eval_every must be >= 0")
    check(t.eval_meta_episodes >= 1, f"train.eval_meta_episodes must be >= 1 (got {t.eval_meta_episodes})")
    check(t.eval_num_episodes >= 1, f"train.eval_num_episodes must be >= 1 (got {t.eval_num_episodes})")
    check(t.eval_heldout_meta_episodes >= 0, "train.eval_heldout_meta_episodes must be >= 0")
    check(t.validate_every >= 0, f"train.validate_every must be >= 0 (got {t.validate_every})")
    check(t.validation_meta_episodes >= 1,
           f"train.validation_meta_episodes must be >= 1 (got {t.validation_meta_episodes})")
    _check_seed("train.seed", t.seed)
    _check_seed("model.init_seed", cfg.model.init_seed)
    # checkpoints, mesh
    check(cfg.checkpoint.every >= 0, "checkpoint.every must be >= 0")
    check(cfg.checkpoint.keep >= 1, f"checkpoint.keep must be >= 1 (got {cfg.checkpoint.keep})")
    if check_paths and cfg.checkpoint.dir is not None:
        _check_writable_folder("checkpoint.dir", cfg.checkpoint.dir)
    m = cfg.mesh
    sizes = (m.data, m.fsdp, m.tensor)
    check(all(s == -1 or s >= 1 for s in sizes), f"mesh sizes must be >= 1 or -1 (got {sizes})")
    check(sum(s == -1 for s in sizes) <= 1, "at most one mesh axis may be -1")
    return cfg


# --------------------------------------------------------------------------------------------------
# resume


RESUMABLE_KEYS = ("train.iterations", "train.eval_every", "checkpoint.every", "checkpoint.keep",
                  "checkpoint.stop_during_updates", "logging.", "compile.", "model.overrides.scan_layers",
                  "env.workers", "env.reply_timeout")
"""What a resumed run may change: how long the run goes on, its evaluation and checkpoint cadences, its
logging, where compiled programs are cached, how its environments are stepped (worker processes give
the same results), and the decoder blocks' layout (the checkpoint restores only in the layout it was
saved in, so this can only name that one: a run saved before its preset scanned its blocks resumes with
``--model.overrides.scan_layers false``). Everything else (shapes, data, algorithm) is the run's and
stays as saved."""


def resume_changes(saved: dict[str, Any], cfg: ExperimentConfig) -> list[tuple[str, Any, Any]]:
    """(key, saved value, value of ``cfg``) for every key outside ``RESUMABLE_KEYS`` on which ``cfg``
    differs from the config dict ``saved`` (``to_dict`` of the run's config when it was saved; keys it
    lacks count as their defaults)."""
    before = _entries(to_dict(from_dict(ExperimentConfig, saved)))
    after = _entries(to_dict(cfg))
    return [(key, before.get(key), after.get(key))
            for key in [*after, *(k for k in before if k not in after)]
            if key != "logging.run_dir" and before.get(key) != after.get(key)
            and not key.startswith(RESUMABLE_KEYS)]


def check_resumed(meta: dict[str, Any], cfg: ExperimentConfig, run_dir: str) -> None:
    """A resumed run goes on as the run its checkpoint (``meta``: the checkpoint's metadata) was trained
    as: a ``config.json`` edited since (outside ``RESUMABLE_KEYS``) would silently continue as another
    run, so it is one ConfigError before anything is rewritten."""
    if not meta.get("config"):
        return
    try:
        changed = resume_changes(meta["config"], cfg)
    except (ConfigError, TypeError, ValueError):  # a meta of another version: nothing to compare
        return
    if not changed:
        return
    key, before, after = changed[0]
    more = f" (and {len(changed) - 1} more keys)" if len(changed) > 1 else ""
    raise ConfigError(
        f"{run_dir}/{CONFIG_FILE} says {key}={after!r}, but its checkpoint of iteration "
        f"{meta.get('iteration')} was trained with {before!r}{more}: the config was edited after the run "
        f"started; put {key} back to resume (a resumed run may change only "
        f"{', '.join(k.rstrip('.') for k in RESUMABLE_KEYS)}), or start a new run with another "
        "--run-dir")


def _entries(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flat ``key: value`` entries of a config dict, each entry of a dict-valued key
    (``model.overrides``) a key of its own."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_entries(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


# --------------------------------------------------------------------------------------------------
# files


CONFIG_FILE = "config.json"


def save(cfg: ExperimentConfig, run_dir: str) -> str:
    """Write the resolved config to ``<run_dir>/config.json`` (atomically) and return the path."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, CONFIG_FILE)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(to_dict(cfg), f, indent=2, sort_keys=False)
        f.write("\n")
    os.replace(tmp, path)
    return path


def load(path: str) -> ExperimentConfig:
    """Read a config JSON (a run dir or the file itself); problems are ConfigErrors."""
    if os.path.isdir(path):
        path = os.path.join(path, CONFIG_FILE)
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path!r} does not exist") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"config file {path!r} is not valid JSON: {err}") from None
    return from_dict(ExperimentConfig, data)
