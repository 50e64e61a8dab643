"""`ModelConfig`: the hyperparameters of a Qwen3 / Qwen2 / Llama decoder.

One frozen, hashable dataclass so it can be a static argument of `jax.jit`. It is built from a
named preset (`ModelConfig.preset("qwen3-0.6b")`) or from a local Hugging Face `config.json`
(`ModelConfig.from_hf_dir(path)`); anything the decoder cannot reproduce exactly (sliding-window
attention, mixture of experts, exotic RoPE variants, biases it does not carry) is refused with one
`ValueError` instead of silently producing a different model.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from mage_jax.models.attention import IMPLEMENTATIONS as ATTENTION_IMPLEMENTATIONS
from mage_jax.models.lora import LORA_TARGETS

ARCHITECTURES = ("qwen3", "qwen2", "llama")
DTYPES = ("float32", "bfloat16", "float16")
ROPE_TYPES = ("default", "linear", "llama3")
# Per-layer rematerialisation: what a decoder block keeps for the backward pass. "full" keeps only the
# block's input; the dots policies also keep matrix products (faster backward, more memory).
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}

_HF_ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama",
}
_HF_MODEL_TYPES = {"qwen3": "qwen3", "qwen2": "qwen2", "llama": "llama"}


def _freeze_rope_scaling(value: Any) -> tuple[tuple[str, Any], ...] | None:
    """RoPE scaling as a sorted tuple of items, so the config stays hashable."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        items = value.items()
    else:
        items = tuple(value)
    frozen = tuple(sorted((str(k), v) for k, v in items))
    kind = dict(frozen).get("rope_type", dict(frozen).get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(f"unsupported RoPE scaling type {kind!r}; supported: {', '.join(ROPE_TYPES)}")
    if kind == "default":
        return None
    return frozen


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Decoder hyperparameters; field names follow Hugging Face where they exist."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 1_000_000.0
    # None for plain RoPE, else sorted (key, value) items: (("factor", 8.0), ..., ("rope_type", "llama3")).
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    qk_norm: bool = True
    qkv_bias: bool = False
    max_position_embeddings: int = 40960
    architecture: str = "qwen3"
    param_dtype: str = "float32"
    dtype: str = "float32"
    remat: str = "none"
    """Per-layer rematerialisation policy, one of REMAT_POLICIES (True / False mean "full" / "none")."""
    attention: str = "auto"
    """Attention implementation (``mage_jax.models.attention``): auto, dense, blockwise, cudnn, splash."""
    attention_block_size: int = 512
    """Query and key block of the blockwise implementation."""
    attention_dense_max_len: int = 1024
    """``auto`` on CPU: dense attention up to this many tokens per row, blockwise beyond."""
    lora_rank: int = 0
    """Rank of the LoRA adapters on ``lora_targets`` (``mage_jax.models.lora``); 0: no adapters."""
    lora_alpha: float = 16.0
    """Adapter outputs are scaled by ``lora_alpha / lora_rank``."""
    lora_targets: tuple[str, ...] = LORA_TARGETS
    """Projections that get an adapter (a subset of ``LORA_TARGETS``: q/k/v/o and gate/up/down)."""
    scan_layers: bool = False
    """Run the blocks under one ``jax.lax.scan`` over stacked parameters (every block parameter gets a
    leading layer axis, the KV cache is one array per keys / values), so a program holds one copy of the
    block and its compile time does not grow with depth. Off: the blocks are unrolled (the reference
    path, one copy per layer). On for the pretrained presets and for folders read by ``from_hf_config``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "rope_scaling", _freeze_rope_scaling(self.rope_scaling))
        if self.architecture not in ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(ARCHITECTURES)}"
            )
        for name in ("param_dtype", "dtype"):
            value = getattr(self, name)
            if not isinstance(value, str):  # accept jnp.float32 / np.dtype and store the canonical name
                value = jnp.dtype(value).name
                object.__setattr__(self, name, value)
            if value not in DTYPES:
                raise ValueError(f"{name}={value!r} is not one of {', '.join(DTYPES)}")
        if isinstance(self.remat, bool):
            object.__setattr__(self, "remat", "full" if self.remat else "none")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"remat={self.remat!r} is not one of {', '.join(REMAT_POLICIES)}")
        if self.attention not in ATTENTION_IMPLEMENTATIONS:
            known = ", ".join(ATTENTION_IMPLEMENTATIONS)
            raise ValueError(f"attention={self.attention!r} is not one of {known}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings", "attention_block_size",
                     "attention_dense_max_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        object.__setattr__(self, "lora_targets", tuple(self.lora_targets))
        if not isinstance(self.lora_rank, int) or self.lora_rank < 0:
            raise ValueError(f"lora_rank must be an integer >= 0, got {self.lora_rank!r}")
        if self.lora_rank:
            if not self.lora_alpha > 0:
                raise ValueError(f"lora_alpha must be > 0, got {self.lora_alpha!r}")
            unknown = [t for t in self.lora_targets if t not in LORA_TARGETS]
            if unknown or not self.lora_targets:
                raise ValueError(f"lora_targets must be a non-empty subset of {', '.join(LORA_TARGETS)}, "
                                 f"got {', '.join(self.lora_targets) or 'none'}")
        if not isinstance(self.scan_layers, bool):
            raise ValueError(f"scan_layers must be true or false, got {self.scan_layers!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    # ------------------------------------------------------------------ derived
    @property
    def jnp_param_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.param_dtype)

    @property
    def jnp_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def remat_policy(self):
        """The `jax.checkpoint` policy of `remat` (None when remat is "none")."""
        return REMAT_POLICIES[self.remat]

    @property
    def lora_scale(self) -> float:
        """The factor of the adapters' output, ``lora_alpha / lora_rank`` (0 without adapters)."""
        return self.lora_alpha / self.lora_rank if self.lora_rank else 0.0

    def lora_targeted(self, name: str) -> bool:
        """Whether projection ``name`` carries a LoRA adapter."""
        return self.lora_rank > 0 and name in self.lora_targets

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        if self.qkv_bias:
            attn += d * (self.num_heads + 2 * self.num_kv_heads)
        if self.qk_norm:
            attn += 2 * d
        layer = attn + 3 * h * self.intermediate_size + 2 * h
        head = 0 if self.tie_word_embeddings else h * self.vocab_size
        return self.vocab_size * h + self.num_layers * layer + h + head

    # ------------------------------------------------------------------ presets
    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ModelConfig:
        """A named configuration; `overrides` replace fields (e.g. `vocab_size` for `tiny`)."""
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; known: {', '.join(sorted(PRESETS))}")
        return dataclasses.replace(PRESETS[name], **overrides)

    # ------------------------------------------------------------------ Hugging Face
    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike, **overrides: Any) -> ModelConfig:
        """Read `<path>/config.json` of a local Hugging Face checkpoint."""
        config_path = os.path.join(os.fspath(path), "config.json")
        if not os.path.isfile(config_path):
            raise ValueError(f"no config.json in {os.fspath(path)!r}")
        try:
            with open(config_path, encoding="utf-8") as f:
                hf = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{config_path} is not valid JSON: {e}") from None
        return cls.from_hf_config(hf, **overrides)

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any], **overrides: Any) -> ModelConfig:
        """Map a Hugging Face `config.json` dict (transformers 4.x or 5.x layout) onto our fields."""
        if not isinstance(hf, Mapping):
            raise ValueError(f"a Hugging Face config must be a JSON object, got {type(hf).__name__}")
        architecture = _hf_architecture(hf)
        _reject_unsupported(hf, architecture)

        def need(key: str) -> Any:
            if key not in hf:
                raise ValueError(f"Hugging Face config is missing {key!r}")
            return hf[key]

        num_heads = int(need("num_attention_heads"))
        hidden_size = int(need("hidden_size"))
        head_dim = hf.get("head_dim") or hidden_size // num_heads
        rope_theta, rope_scaling = _hf_rope(hf)
        fields: dict[str, Any] = dict(
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden_size,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", architecture != "llama")),
            qk_norm=architecture == "qwen3",
            qkv_bias=architecture == "qwen2",
            max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
            architecture=architecture,
            scan_layers=True,  # pretrained depths (24-36 layers): compile one block, not all of them
        )
        fields.update(overrides)
        return cls(**fields)

    def to_hf_config(self) -> dict[str, Any]:
        """The `config.json` that makes `transformers` build the same model."""
        model_type = self.architecture
        hf_arch = {v: k for k, v in _HF_ARCHITECTURES.items()}[model_type]
        rope_parameters: dict[str, Any] = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.rope_scaling is not None:
            rope_parameters.update(self.rope_scaling_dict or {})
            rope_parameters.pop("type", None)
        config: dict[str, Any] = {
            "architectures": [hf_arch],
            "model_type": model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            # Both layouts: transformers 5 reads rope_parameters, 4.x reads rope_theta / rope_scaling.
            "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_scaling is None else
            {k: v for k, v in rope_parameters.items() if k != "rope_theta"},
            "rope_parameters": rope_parameters,
            "torch_dtype": self.param_dtype,
            "dtype": self.param_dtype,
        }
        if model_type in ("qwen3", "llama"):
            config["attention_bias"] = False
        if model_type == "llama":
            config["mlp_bias"] = False
        if model_type in ("qwen3", "qwen2"):
            config["use_sliding_window"] = False
        return config


def _hf_architecture(hf: Mapping[str, Any]) -> str:
    archs = hf.get("architectures") or []
    if isinstance(archs, list) and archs:
        name = archs[0]
        if name not in _HF_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {name!r}; supported: {', '.join(sorted(_HF_ARCHITECTURES))}"
            )
        return _HF_ARCHITECTURES[name]
    model_type = hf.get("model_type")
    if model_type not in _HF_MODEL_TYPES:
        raise ValueError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(sorted(_HF_MODEL_TYPES))}"
        )
    return _HF_MODEL_TYPES[model_type]


def _reject_unsupported(hf: Mapping[str, Any], architecture: str) -> None:
    """One clear error for every option whose model we would not reproduce exactly."""
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {hf.get('hidden_act')!r}; only 'silu' is implemented")
    if hf.get("use_sliding_window"):
        raise ValueError("sliding-window attention (use_sliding_window=true) is not supported")
    layer_types = hf.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        kinds = sorted(set(layer_types))
        raise ValueError(f"only full attention is supported, config has layer_types {kinds}")
    if any(hf.get(k) for k in ("num_experts", "num_local_experts", "n_routed_experts")):
        raise ValueError("mixture-of-experts models are not supported")
    if architecture in ("qwen3", "llama") and hf.get("attention_bias"):
        raise ValueError("attention_bias=true is not supported for qwen3 / llama")
    if hf.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported")
    if hf.get("pretraining_tp", 1) not in (None, 1):
        raise ValueError("pretraining_tp != 1 is not supported")
    rope_parameters = hf.get("rope_parameters") or {}
    partial = rope_parameters.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError("partial rotary embeddings (partial_rotary_factor < 1) are not supported")


def _hf_rope(hf: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """RoPE base and scaling from either `rope_parameters` (transformers 5) or `rope_theta`/`rope_scaling`."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
    merged = {**scaling, **params}
    kind = merged.get("rope_type", merged.get("type", "default"))
    if kind == "default":
        return float(theta), None
    merged.pop("type", None)
    merged["rope_type"] = kind
    if kind == "llama3":
        for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if key not in merged:
                raise ValueError(f"llama3 rope scaling is missing {key!r}")
    if kind == "linear" and "factor" not in merged:
        raise ValueError("linear rope scaling is missing 'factor'")
    return float(theta), merged


def _qwen3(hidden: int, intermediate: int, layers: int, heads: int, tie: bool) -> ModelConfig:
    return ModelConfig(
        vocab_size=151936, hidden_size=hidden, intermediate_size=intermediate, num_layers=layers,
        num_heads=heads, num_kv_heads=8, head_dim=128, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=tie, qk_norm=True, qkv_bias=False, max_position_embeddings=40960,
        architecture="qwen3", param_dtype="bfloat16", dtype="bfloat16", scan_layers=True,
    )


PRESETS: dict[str, ModelConfig] = {
    # A from-scratch CPU model with the Qwen3 layout; the caller sets vocab_size from its tokenizer.
    "tiny": ModelConfig(
        vocab_size=256, hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4,
        num_kv_heads=2, head_dim=32, rope_theta=10_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        qk_norm=True, qkv_bias=False, max_position_embeddings=4096, architecture="qwen3",
    ),
    # Published Qwen3 hyperparameters (config.json of Qwen/Qwen3-*).
    "qwen3-0.6b": _qwen3(hidden=1024, intermediate=3072, layers=28, heads=16, tie=True),
    "qwen3-1.7b": _qwen3(hidden=2048, intermediate=6144, layers=28, heads=16, tie=True),
    "qwen3-4b": _qwen3(hidden=2560, intermediate=9728, layers=36, heads=32, tie=True),
    "qwen3-8b": _qwen3(hidden=4096, intermediate=12288, layers=36, heads=32, tie=False),
}


@dataclasses.dataclass(frozen=True)
class ModelName:
    """How runs and plans name their model: a preset by its name, a local folder by its own name.

    A folder's name is its config.json's ``_name_or_path`` (last path part) when set, else the folder's
    name; its family is the config's ``model_type`` (``llama``, ``qwen3``, ...).
    """

    name: str
    family: str

    def __str__(self) -> str:
        return f"{self.name} ({self.family})"

    @classmethod
    def of_folder(cls, path: str | os.PathLike) -> ModelName:
        folder = os.path.abspath(os.fspath(path))
        try:
            with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
                hf = json.load(f)
        except (OSError, json.JSONDecodeError):
            hf = {}
        hf = hf if isinstance(hf, Mapping) else {}
        given = hf.get("_name_or_path")
        name = os.path.basename(os.path.normpath(given)) if isinstance(given, str) and given.strip() else ""
        return cls(name=name or os.path.basename(folder), family=str(hf.get("model_type") or "unknown"))

    @classmethod
    def of_preset(cls, preset: str) -> ModelName:
        return cls(name=preset, family=ModelConfig.preset(preset).architecture)
