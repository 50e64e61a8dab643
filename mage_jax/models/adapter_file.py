"""LoRA adapters alone in one ``.safetensors`` file: what a LoRA run ships (a few MB, not the base model).

The tensors are the adapter matrices (``lora_a`` [in, r], ``lora_b`` [r, out], float32) named by their
path in the *unrolled* layout (``layers/<i>/.../lora/lora_a``), whatever layout the run used, so a
scanned and an unrolled model read the same file. The file's metadata (strings, as safetensors keeps
them) records the format, the adapter shape (rank, alpha, targets), the base model's architecture and
sizes, and whatever the writer adds (``experiments.export`` adds the run's config, iteration and
evaluation key, so that ``experiments.evaluate --adapter`` replays the run's own evaluation).

``apply_adapters`` puts a file's matrices into a model state that has adapters of the same shape (built
from the base folder with the file's rank, alpha and targets). A file that is not one of these, or that
does not fit the model, is a ``ValueError`` with one line that says what differs.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from mage_jax.models.config import ModelConfig
from mage_jax.models.lora import split_adapters
from mage_jax.models.sharding import path_to_str
from mage_jax.models.transformer import stack_layers, unstack_layers

FORMAT = "mage-jax-lora-adapter/1"
SHAPE_KEYS = ("architecture", "num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
              "head_dim", "vocab_size")
"""Base-model sizes recorded in the file and checked against the model the adapters are put into."""


@dataclasses.dataclass(frozen=True)
class AdapterFile:
    """The contents of an adapter file: tensors by unrolled path, the adapter shape, the free metadata."""

    tensors: dict[str, np.ndarray]
    lora_rank: int
    lora_alpha: float
    lora_targets: tuple[str, ...]
    base: dict[str, Any]
    """The base model's ``SHAPE_KEYS`` as the writer's model had them."""
    metadata: dict[str, str]
    """Everything else the writer recorded (e.g. ``config``, ``iteration``: JSON strings)."""

    def model_overrides(self) -> dict[str, Any]:
        """The ``model.*`` config keys a run needs for these adapters."""
        return {"model.lora_rank": self.lora_rank, "model.lora_alpha": self.lora_alpha,
                "model.lora_targets": list(self.lora_targets)}


def _adapter_arrays(params: Any) -> dict[str, np.ndarray]:
    adapters, _ = split_adapters(params)
    unrolled = unstack_layers(adapters)
    return {path_to_str(path): np.asarray(leaf, np.float32)
            for path, leaf in nnx.to_flat_state(unrolled)}


def save_adapters(path: str | os.PathLike, params: Any, model_config: ModelConfig, *,
                  metadata: Mapping[str, str] | None = None) -> dict[str, np.ndarray]:
    """Write the LoRA adapters of ``params`` (only them) to ``path`` atomically; returns the tensors."""
    if model_config.lora_rank <= 0:
        raise ValueError("the model has no LoRA adapters (model.lora_rank is 0): nothing to write")
    tensors = {name: np.ascontiguousarray(array) for name, array in _adapter_arrays(params).items()}
    if not tensors:
        raise ValueError("the parameter state holds no LoRA adapters")
    header = {"format": FORMAT, "lora_rank": str(model_config.lora_rank),
              "lora_alpha": repr(float(model_config.lora_alpha)),
              "lora_targets": json.dumps(list(model_config.lora_targets)),
              "base": json.dumps({k: getattr(model_config, k) for k in SHAPE_KEYS})}
    extra = dict(metadata or {})
    clash = sorted(set(extra) & set(header))
    if clash:
        raise ValueError(f"metadata key {clash[0]!r} is reserved")
    path = os.fspath(path)
    tmp = path + ".tmp"
    save_file(tensors, tmp, metadata={**header, **{k: str(v) for k, v in extra.items()}})
    os.replace(tmp, path)
    return tensors


def read_adapters(path: str | os.PathLike) -> AdapterFile:
    """Read an adapter file; a missing, malformed or foreign file is one ``ValueError`` line."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"adapter file {path!r} does not exist")
    try:
        with safe_open(path, framework="numpy") as f:
            metadata = dict(f.metadata() or {})
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (a safe_open handle, no dict)
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(f"adapter file {path!r} is not a readable safetensors file: {err}") from None
    if metadata.get("format") != FORMAT:
        raise ValueError(f"{path!r} is not a mage-jax LoRA adapter file (its metadata names format "
                         f"{metadata.get('format')!r}, not {FORMAT!r})")
    try:
        rank, alpha = int(metadata.pop("lora_rank")), float(metadata.pop("lora_alpha"))
        targets = tuple(json.loads(metadata.pop("lora_targets")))
        base = json.loads(metadata.pop("base"))
    except (KeyError, ValueError, TypeError) as err:
        raise ValueError(f"adapter file {path!r} has damaged metadata ({err})") from None
    metadata.pop("format")
    return AdapterFile(tensors, rank, alpha, targets, base, metadata)


def apply_adapters(params: Any, model_config: ModelConfig, adapters: AdapterFile) -> Any:
    """``params`` with its adapter matrices replaced by the file's (cast and placed like the ones they
    replace). The model must have adapters of the file's rank on the same projections of the same base."""
    differs = [k for k in SHAPE_KEYS if adapters.base.get(k) != getattr(model_config, k)]
    if differs:
        k = differs[0]
        raise ValueError(f"the adapters were trained on a base model with {k} {adapters.base.get(k)!r}; "
                         f"this model has {getattr(model_config, k)!r}")
    mine = (model_config.lora_rank, tuple(model_config.lora_targets))
    if mine != (adapters.lora_rank, adapters.lora_targets):
        raise ValueError(f"the model's adapters (rank {model_config.lora_rank}, targets "
                         f"{','.join(model_config.lora_targets)}) differ from the file's (rank "
                         f"{adapters.lora_rank}, targets {','.join(adapters.lora_targets)})")
    current, base = split_adapters(params)
    scanned = model_config.scan_layers
    unrolled = dict(nnx.to_flat_state(unstack_layers(current) if scanned else current))
    names = {path_to_str(p): p for p in unrolled}
    missing = sorted(set(names) - set(adapters.tensors))
    extra = sorted(set(adapters.tensors) - set(names))
    if missing or extra:
        what = (f"lacks {missing[0]!r}" if missing
                else f"holds {extra[0]!r}, which this model has no place for")
        raise ValueError(f"the adapter file does not fit this model: it {what}")
    for name, path in names.items():
        variable, array = unrolled[path], adapters.tensors[name]
        if tuple(array.shape) != tuple(np.shape(variable.get_value())):
            raise ValueError(f"adapter {name!r} has shape {tuple(array.shape)} in the file and "
                             f"{tuple(np.shape(variable.get_value()))} in this model")
        unrolled[path] = variable.replace(np.asarray(array, dtype=variable.get_value().dtype))
    loaded = nnx.from_flat_state(list(unrolled.items()))
    if scanned:
        loaded = stack_layers(loaded)
    # Placed like the adapters they replace.
    loaded = jax.tree.map(lambda new, old: jax.device_put(new, old.sharding), loaded, current)
    return nnx.merge_state(base, loaded)
