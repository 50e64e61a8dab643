"""The experiment configuration: typed frozen dataclasses, presets, overrides and validation.

One ``ExperimentConfig`` describes a whole run (environment, model, tokenizer, sampling, rollout,
algorithm, optimisation, loop, checkpoints, logging, device mesh). Defaults are the paper-scale
Kuhn Poker settings of the spec (sections 2, 5, 8); experiment modules define presets as dotted
override maps on top of them (``{"optim.lr": 1e-3, ...}``).

Overrides use dotted keys and are parsed against the field's declared type, so command lines and
JSON files go through the same checks:

    --set optim.lr=1e-3      --optim.lr 1e-3      --optim.lr=1e-3      --rollout.reflect false

Tuples take comma-separated values (``--env.opponents a,b``) or JSON lists, dicts take JSON
(``--env.options '{"max_turns": 6}'``), optional fields take ``none``. Every problem (unknown key,
wrong type, impossible value) is one ``ConfigError`` with a one-line message naming the key; the
entry points print it and exit non-zero before writing anything.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import math
import os
import re
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, Union

from mage_jax.algorithms import advantages
from mage_jax.algorithms.advantages import ANCHOR_MODES, NORM_MODES
from mage_jax.algorithms.losses import AGG_MODES, KL_KINDS
from mage_jax.algorithms.returns import REWARD_DESIGNS
from mage_jax.envs.prompts import MEMORY_MODES, STYLES
from mage_jax.models.config import DTYPES
from mage_jax.models.lora import LORA_TARGETS
from mage_jax.models.sharding import MeshConfig
from mage_jax.rollout.tasks import GROUPINGS, SEAT_MODES
from mage_jax.tokenizer import WORD_PATTERN
from mage_jax.training.train_step import LR_DECAYS


class ConfigError(ValueError):
    """A bad configuration; the message is one line that names the offending key."""


# Choice types: the allowed values are defined once, by the module that uses the setting, and checked
# here for every field of a Literal type (when an override is parsed and again in ``validate``).
SeatMode = Literal[SEAT_MODES]
Grouping = Literal[GROUPINGS]
ActivationDtype = Literal[tuple(d for d in DTYPES if d != "float16")]
TokenizerKind = Literal["hf", "word_level"]
MemoryMode = Literal[MEMORY_MODES]
PromptStyle = Literal[STYLES]
RolloutScheduling = Literal["continuous", "lockstep"]
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
    """Environment, opponent pool, seats and grouping (spec section 6)."""

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


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """Which decoder: a named ``ModelConfig`` preset (random init) or a local HF folder (weights loaded)."""

    preset: str = "qwen3-4b"
    path: str | None = None
    """Local Hugging Face folder (config.json + safetensors). When set, it wins over ``preset``."""
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    """ModelConfig field overrides for from-scratch models (e.g. ``{"num_layers": 2}``)."""
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
    """Training samples at temperature 1 with no truncation; evaluation as the paper (spec section 8)."""

    train: SamplingSection = SamplingSection()
    eval: SamplingSection = SamplingSection(temperature=0.7, top_p=0.8, top_k=20)


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Meta-episode shape (spec section 2) and prompt options (section 3)."""

    num_tasks: int = 16
    """B: task instances per iteration."""
    group_size: int = 8
    """G: meta-episodes per task instance (one group)."""
    batch_size: int | None = None
    """Meta-episodes per iteration; optional, must equal num_tasks * group_size when given."""
    num_episodes: int = 3
    """N."""
    memory_mode: MemoryMode = "reflection_only"
    """``none``: every episode's prompt carries no memory (a no-memory control; needs ``reflect=false``)."""
    reflect: bool = True
    """Run the reflect phase between episodes (off: memory comes from trajectories only)."""
    reflection_words: tuple[str, ...] = ()
    """Constrained reflections (word-level tokenizer): each reflection is ``<remark>`` + 1 to
    ``reflection_max_words`` of these words + ``</remark>``, decoded under a token automaton and replayed
    in the log-prob recompute like constrained actions. Empty: free reflections."""
    reflection_max_words: int = 3
    prompt_style: PromptStyle = "full"
    constrained_actions: bool = False
    """Constrain play responses to the legal ``<action>...</action>`` strings (and the log-prob recompute)."""
    max_prompt_tokens: int = 4096
    max_response_tokens: int = 8192
    """Play-row generation limit."""
    max_reflection_tokens: int | None = None
    """Reflect-row generation limit; None: same as max_response_tokens."""
    max_turns: int | None = None
    """Per-episode turn limit; None: the environment's own."""
    max_decode_rows: int = 0
    """Most rows the sampler decodes at once (a larger rollout or evaluation is decoded in chunks of this
    many rows, each with its own KV cache); 0: the whole batch at once. Bounds the KV cache per device."""
    length_buckets: tuple[int, ...] = ()
    """Token-length buckets of prompts (sampler) and of prompt + response rows (training); each bucket
    compiles once. Empty: 64, 96, 128, 192, ... up to the limits."""
    privileged_reflection: bool = True
    """Training reflect prompts show the environment's privileged text (Kuhn's both-cards quirk, spec 7.1)."""
    engine: RolloutScheduling = "continuous"
    """How the LLM calls of a rollout (training, evaluation, zero-shot baselines) are scheduled:
    ``continuous`` (the rollout engine: decode slots, a meta-episode's next prompt starts as soon as its
    response is back, identical prompts prefilled once) or ``lockstep`` (one batched call per turn)."""
    engine_slots: int = 0
    """Concurrent decode slots of the engine; 0: the largest rollout capped at ``max_decode_rows``, at
    most 64; always rounded up to the mesh's batch ways."""
    engine_chunk: int = 8
    """Decode steps between the engine's host checks (a finished row waits at most this many steps)."""


@dataclasses.dataclass(frozen=True)
class AlgorithmConfig:
    """Credit assignment: reward design, returns, advantage estimator (spec sections 4 and 5).

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
    length_penalty: float = 2.0
    """c_len; 0 disables the overlong-response penalty."""


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW + PPO-style loss (spec section 5)."""

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
# typed parsing of values


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_optional(tp: Any) -> tuple[bool, Any]:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return True, args[0]
    return False, tp


_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _type_name(tp: Any) -> str:
    optional, inner = _is_optional(tp)
    if optional:
        return f"{_type_name(inner)} or none"
    if typing.get_origin(tp) is tuple:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(map(str, typing.get_args(tp)))
    if typing.get_origin(tp) is dict or tp is dict:
        return "a JSON object"
    return getattr(tp, "__name__", str(tp))


def coerce(key: str, tp: Any, value: Any) -> Any:
    """Convert ``value`` (a CLI string or a JSON value) to the field type ``tp`` or raise ConfigError."""
    optional, inner = _is_optional(tp)
    if optional:
        if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null")):
            return None
        return coerce(key, inner, value)
    bad = ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    if typing.get_origin(tp) is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{key} must be one of {', '.join(map(str, choices))} (got {value!r})")
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        raise bad
    if tp is int:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                try:
                    f = float(value.strip())
                except ValueError:
                    raise bad from None
                if f.is_integer():
                    return int(f)
        raise bad
    if tp is float:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value.strip())
            except ValueError:
                raise bad from None
        raise bad
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad
    if typing.get_origin(tp) is tuple:
        (elem,) = typing.get_args(tp)[:1]
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                try:
                    value = json.loads(text)
                except json.JSONDecodeError:
                    raise bad from None
            else:
                value = [v.strip() for v in text.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise bad
        return tuple(coerce(key, elem, v) for v in value)
    if typing.get_origin(tp) is dict or tp is dict:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                raise bad from None
        if not isinstance(value, Mapping):
            raise bad
        return dict(value)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if isinstance(value, Mapping):
            return from_dict(tp, value, prefix=key + ".")
        raise bad
    raise ConfigError(f"{key}: unsupported field type {tp!r}")


# --------------------------------------------------------------------------------------------------
# dict <-> config, overrides


def to_dict(cfg: Any) -> dict[str, Any]:
    """A JSON-ready nested dict (tuples become lists)."""

    def conv(v: Any) -> Any:
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return {f.name: conv(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (list, tuple)):
            return [conv(x) for x in v]
        if isinstance(v, Mapping):
            return {str(k): conv(x) for k, x in v.items()}
        return v

    return conv(cfg)


def from_dict(cls: type, data: Mapping[str, Any], *, prefix: str = "") -> Any:
    """Build a (section) config from a nested dict; unknown keys and wrong types are ConfigErrors."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a JSON object, got {data!r}")
    hints = _hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            known = ", ".join(sorted(names))
            raise ConfigError(f"unknown config key {prefix + key!r}; known in this section: {known}")
        kwargs[key] = coerce(prefix + key, hints[key], value)
    return cls(**kwargs)


def _all_keys(cls: type, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(cls):
        tp = _hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            keys += _all_keys(tp, prefix + f.name + ".")
        else:
            keys.append(prefix + f.name)
    return keys


def all_keys() -> list[str]:
    """Every dotted key an override may set."""
    return _all_keys(ExperimentConfig)


@dataclasses.dataclass(frozen=True)
class KeyInfo:
    """One config key as ``--list-keys`` shows it."""

    key: str
    type_name: str
    default: Any
    doc: str


def _field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings (the string literal under a field) of a dataclass, by field name."""
    try:
        body = ast.parse(inspect.getsource(cls)).body[0].body
    except (OSError, TypeError, IndexError, AttributeError):
        return {}
    docs: dict[str, str] = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _key_infos(cls: type, default: Any, prefix: str) -> list[KeyInfo]:
    out: list[KeyInfo] = []
    hints, docs = _hints(cls), _field_docs(cls)
    for f in dataclasses.fields(cls):
        tp, value = hints[f.name], getattr(default, f.name)
        if dataclasses.is_dataclass(tp):
            out += _key_infos(tp, value, prefix + f.name + ".")
        else:
            shown = to_dict(value) if dataclasses.is_dataclass(value) else value
            out.append(KeyInfo(prefix + f.name, _type_name(tp), shown, docs.get(f.name, "")))
    return out


def describe_keys() -> list[KeyInfo]:
    """Every key with its type, its default in ``ExperimentConfig()`` and its field docstring."""
    return _key_infos(ExperimentConfig, ExperimentConfig(), "")


def get_key(cfg: Any, key: str) -> Any:
    """The value of dotted ``key`` in ``cfg``."""
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _set(cfg: Any, parts: list[str], value: Any, full: str) -> Any:
    cls = type(cfg)
    names = {f.name for f in dataclasses.fields(cls)}
    head = parts[0]
    if head not in names:
        known = ", ".join(sorted(names))
        raise ConfigError(f"unknown config key {full!r} ({head!r} is not one of: {known})")
    tp = _hints(cls)[head]
    if len(parts) == 1:
        if dataclasses.is_dataclass(tp) and not isinstance(value, Mapping):
            example = f"{full}.{dataclasses.fields(tp)[0].name}"
            raise ConfigError(f"{full} is a section; set one of its keys (e.g. {example})")
        return dataclasses.replace(cfg, **{head: coerce(full, tp, value)})
    child = getattr(cfg, head)
    if not dataclasses.is_dataclass(child):
        raise ConfigError(f"unknown config key {full!r} ({'.'.join(full.split('.')[:-1])} is not a section)")
    return dataclasses.replace(cfg, **{head: _set(child, parts[1:], value, full)})


def apply_overrides(cfg: ExperimentConfig, overrides: Mapping[str, Any]) -> ExperimentConfig:
    """Apply dotted-key overrides in order (values may be CLI strings or typed values)."""
    for key, value in overrides.items():
        if not isinstance(key, str) or not key or any(not p for p in key.split(".")):
            raise ConfigError(f"bad config key {key!r}")
        cfg = _set(cfg, key.split("."), value, key)
    return cfg


def parse_assignment(text: str) -> tuple[str, str]:
    """``"optim.lr=1e-3"`` -> ``("optim.lr", "1e-3")``."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"bad override {text!r}; expected KEY=VALUE such as optim.lr=1e-3")
    return key.strip(), value


# --------------------------------------------------------------------------------------------------
# validation


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _one_of(key: str, value: Any, allowed: typing.Iterable[Any]) -> None:
    allowed = tuple(allowed)
    _check(value in allowed, f"{key} must be one of {', '.join(map(str, allowed))} (got {value!r})")


def _check_choices(section: Any, prefix: str = "") -> None:
    """Every field of a ``Literal`` type holds one of its values (nested sections included)."""
    hints = _hints(type(section))
    for f in dataclasses.fields(section):
        value, tp = getattr(section, f.name), hints[f.name]
        if dataclasses.is_dataclass(value):
            _check_choices(value, f"{prefix}{f.name}.")
        elif typing.get_origin(tp) is Literal:
            _one_of(prefix + f.name, value, typing.get_args(tp))


def _check_finite(section: Any, prefix: str = "") -> None:
    """Every float field (and every float in a tuple field) is a finite number: ``inf`` / ``nan``
    pass the range checks below (``inf > 0``) but turn the first update into NaN."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            _check_finite(value, f"{prefix}{f.name}.")
            continue
        values = value if isinstance(value, tuple) else (value,)
        for v in values:
            if isinstance(v, float):
                _check(math.isfinite(v), f"{prefix}{f.name} must be a finite number (got {value!r})")


def validate(cfg: ExperimentConfig, *, check_paths: bool = True) -> ExperimentConfig:
    """Raise ConfigError (one line) for the first impossible setting; return ``cfg`` when sound."""
    e, r, a, o, t = cfg.env, cfg.rollout, cfg.algorithm, cfg.optim, cfg.train
    _check_choices(cfg)
    _check_finite(cfg)
    # environment
    _check(bool(e.name), "env.name must not be empty")
    _check(len(e.opponents) == len(e.opponent_ratios),
           f"env.opponents ({len(e.opponents)}) and env.opponent_ratios ({len(e.opponent_ratios)}) "
           "differ in length")
    _check(all(x >= 0 for x in e.opponent_ratios), "env.opponent_ratios must be non-negative")
    if e.opponent_ratios:
        _check(abs(sum(e.opponent_ratios) - 1.0) < 1e-6,
               f"env.opponent_ratios must sum to 1 (got {sum(e.opponent_ratios):g})")
    _check(e.eval_seed >= 0, "env.eval_seed must be >= 0")
    # model / tokenizer
    _check(bool(cfg.model.preset) or cfg.model.path is not None, "model.preset or model.path must be set")
    if check_paths and cfg.model.path is not None:
        _check(os.path.isdir(cfg.model.path),
               f"model.path {cfg.model.path!r} is not a folder; pass a local Hugging Face model folder "
               "(config.json + *.safetensors) with --model.path DIR")
        _check(os.path.isfile(os.path.join(cfg.model.path, "config.json")),
               f"model.path {cfg.model.path!r} has no config.json; it must be a local Hugging Face "
               "model folder")
    if cfg.tokenizer.kind == "hf":
        tok_path = cfg.tokenizer.path or cfg.model.path
        _check(tok_path is not None,
               "tokenizer.kind=hf needs tokenizer.path or model.path (a local Hugging Face folder)")
        if check_paths:
            _check(os.path.isdir(tok_path), f"tokenizer folder {tok_path!r} does not exist")
    lo = cfg.model
    _check(lo.lora_rank >= 0, f"model.lora_rank must be >= 0 (got {lo.lora_rank})")
    _check(lo.lora_alpha > 0, f"model.lora_alpha must be > 0 (got {lo.lora_alpha})")
    bad = [t for t in lo.lora_targets if t not in LORA_TARGETS]
    _check(bool(lo.lora_targets) and not bad,
           f"model.lora_targets must be a non-empty list of {', '.join(LORA_TARGETS)} "
           f"(got {', '.join(lo.lora_targets) or 'none'})")
    _check(cfg.tokenizer.corpus_meta_episodes > 0, "tokenizer.corpus_meta_episodes must be > 0")
    # sampling
    for split in ("train", "eval"):
        s = getattr(cfg.sampling, split)
        _check(s.temperature > 0, f"sampling.{split}.temperature must be > 0 (got {s.temperature})")
        _check(0 < s.top_p <= 1, f"sampling.{split}.top_p must be in (0, 1] (got {s.top_p})")
        _check(s.top_k >= 0, f"sampling.{split}.top_k must be >= 0 (got {s.top_k})")
    # rollout
    _check(r.num_tasks >= 1, f"rollout.num_tasks must be >= 1 (got {r.num_tasks})")
    _check(r.group_size >= 1, f"rollout.group_size must be >= 1 (got {r.group_size})")
    if r.batch_size is not None:
        _check(r.batch_size >= 1, f"rollout.batch_size must be >= 1 (got {r.batch_size})")
        _check(r.batch_size % r.group_size == 0,
               f"rollout.group_size {r.group_size} does not divide rollout.batch_size {r.batch_size}")
        _check(r.batch_size == r.num_tasks * r.group_size,
               f"rollout.batch_size {r.batch_size} != rollout.num_tasks * rollout.group_size "
               f"({r.num_tasks} * {r.group_size} = {r.num_tasks * r.group_size})")
    _check(r.num_episodes >= 1, f"rollout.num_episodes must be >= 1 (got {r.num_episodes})")
    _check(not (r.memory_mode not in ("history_only", "none") and not r.reflect and r.num_episodes > 1),
           f"rollout.memory_mode={r.memory_mode} needs reflections; set rollout.reflect=true or "
           "rollout.memory_mode=history_only")
    _check(not (r.memory_mode == "none" and r.reflect and r.num_episodes > 1),
           "rollout.memory_mode=none shows no reflections; set rollout.reflect=false")
    _check_reflection_words(cfg)
    _check(r.max_prompt_tokens >= 1, f"rollout.max_prompt_tokens must be >= 1 (got {r.max_prompt_tokens})")
    _check(r.max_response_tokens >= 1,
           f"rollout.max_response_tokens must be >= 1 (got {r.max_response_tokens})")
    _check(r.max_decode_rows >= 0, f"rollout.max_decode_rows must be >= 0 (got {r.max_decode_rows})")
    if r.max_reflection_tokens is not None:
        _check(r.max_reflection_tokens >= 1, "rollout.max_reflection_tokens must be >= 1")
    if r.max_turns is not None:
        _check(r.max_turns >= 1, f"rollout.max_turns must be >= 1 (got {r.max_turns})")
    _check(all(b >= 1 for b in r.length_buckets), "rollout.length_buckets must be positive")
    _check(r.engine_slots >= 0, f"rollout.engine_slots must be >= 0 (got {r.engine_slots})")
    _check(r.engine_chunk >= 1, f"rollout.engine_chunk must be >= 1 (got {r.engine_chunk})")
    # algorithm
    _one_of("algorithm.estimator", a.estimator, advantages.available_advantages())
    _check(0 <= a.gamma_step <= 1, f"algorithm.gamma_step must be in [0, 1] (got {a.gamma_step})")
    _check(0 <= a.gamma_traj <= 1, f"algorithm.gamma_traj must be in [0, 1] (got {a.gamma_traj})")
    _check(a.step_weight >= 0, "algorithm.step_weight must be >= 0")
    _check(a.invalid_penalty >= 0, "algorithm.invalid_penalty must be >= 0")
    _check(a.length_penalty >= 0, "algorithm.length_penalty must be >= 0")
    # optimisation
    _check(o.lr > 0, f"optim.lr must be > 0 (got {o.lr})")
    _check(0 <= o.b1 < 1 and 0 <= o.b2 < 1, f"optim.b1 and optim.b2 must be in [0, 1) (got {o.b1}, {o.b2})")
    _check(o.weight_decay >= 0, f"optim.weight_decay must be >= 0 (got {o.weight_decay})")
    _check(o.grad_clip > 0, f"optim.grad_clip must be > 0 (got {o.grad_clip})")
    _check(o.warmup_steps >= 0, "optim.warmup_steps must be >= 0")
    _check(0 <= o.lr_end_fraction <= 1, f"optim.lr_end_fraction must be in [0, 1] (got {o.lr_end_fraction})")
    _check(o.mini_batch_rows >= 1, f"optim.mini_batch_rows must be >= 1 (got {o.mini_batch_rows})")
    micro = o.micro_batch_rows
    _check(micro == 0 or (micro >= 1 and o.mini_batch_rows % micro == 0),
           f"optim.micro_batch_rows must be 0 or divide optim.mini_batch_rows {o.mini_batch_rows} "
           f"(got {o.micro_batch_rows})")
    _check(o.epochs >= 1, f"optim.epochs must be >= 1 (got {o.epochs})")
    _check(0 < o.clip_eps < 1, f"optim.clip_eps must be in (0, 1) (got {o.clip_eps})")
    _check(o.dual_clip > 1, f"optim.dual_clip must be > 1 (got {o.dual_clip})")
    _check(o.entropy_coef >= 0, f"optim.entropy_coef must be >= 0 (got {o.entropy_coef})")
    _check(o.kl_coef >= 0, f"optim.kl_coef must be >= 0 (got {o.kl_coef})")
    _check(o.logprob_chunk >= 1, "optim.logprob_chunk must be >= 1")
    _check(o.max_update_ratio >= 0, f"optim.max_update_ratio must be >= 0 (got {o.max_update_ratio})")
    _check(o.max_skipped_updates >= 0,
           f"optim.max_skipped_updates must be >= 0 (got {o.max_skipped_updates})")
    # loop
    _check(t.iterations >= 0, f"train.iterations must be >= 0 (got {t.iterations})")
    _check(t.eval_every >= 0, "train.eval_every must be >= 0")
    _check(t.eval_meta_episodes >= 1, f"train.eval_meta_episodes must be >= 1 (got {t.eval_meta_episodes})")
    _check(t.eval_num_episodes >= 1, f"train.eval_num_episodes must be >= 1 (got {t.eval_num_episodes})")
    _check(t.eval_heldout_meta_episodes >= 0, "train.eval_heldout_meta_episodes must be >= 0")
    _check(t.validate_every >= 0, f"train.validate_every must be >= 0 (got {t.validate_every})")
    _check(t.validation_meta_episodes >= 1,
           f"train.validation_meta_episodes must be >= 1 (got {t.validation_meta_episodes})")
    # checkpoints, mesh
    _check(cfg.checkpoint.every >= 0, "checkpoint.every must be >= 0")
    _check(cfg.checkpoint.keep >= 1, f"checkpoint.keep must be >= 1 (got {cfg.checkpoint.keep})")
    m = cfg.mesh
    sizes = (m.data, m.fsdp, m.tensor)
    _check(all(s == -1 or s >= 1 for s in sizes), f"mesh sizes must be >= 1 or -1 (got {sizes})")
    _check(sum(s == -1 for s in sizes) <= 1, "at most one mesh axis may be -1")
    return cfg


def _check_reflection_words(cfg: ExperimentConfig) -> None:
    """Constrained reflections: a list of distinct single word-level tokens, room for the longest one."""
    r = cfg.rollout
    _check(r.reflection_max_words >= 1,
           f"rollout.reflection_max_words must be >= 1 (got {r.reflection_max_words})")
    if not r.reflection_words:
        return
    _check(r.reflect, "rollout.reflection_words constrain reflections; set rollout.reflect=true")
    _check(cfg.tokenizer.kind == "word_level",
           "rollout.reflection_words needs tokenizer.kind=word_level (each word must be one token)")
    bad = [w for w in r.reflection_words
           if not re.fullmatch(r"\w+", w) or re.findall(WORD_PATTERN, w) != [w]]
    _check(not bad, f"rollout.reflection_words must be single words of letters or digits, one token each "
                    f"(got {', '.join(map(repr, bad))})")
    _check(len(set(r.reflection_words)) == len(r.reflection_words),
           f"rollout.reflection_words must be distinct (got {', '.join(r.reflection_words)})")
    limit = r.max_reflection_tokens or r.max_response_tokens
    _check(limit >= r.reflection_max_words + 3,
           f"rollout.max_reflection_tokens {limit} is too short for <remark>, {r.reflection_max_words} "
           f"words, </remark> and the end token; set it to >= {r.reflection_max_words + 3}")


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
