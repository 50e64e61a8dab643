"""Device mesh, partition rules and shardings for parameters, optimizer state, batches and KV caches.

One mesh with axes ('data', 'fsdp', 'tensor') serves every scale: a laptop is (1, 1, 1), a TPU
pod slice is e.g. (1, 32, 4). Batch rows are split over ('data', 'fsdp'); weight matrices are split
over 'fsdp' on one dimension (ZeRO-3 style, gathered by XLA just in time) and over 'tensor' on the
other (Megatron style: q/k/v/gate/up by output, o/down by input, embedding and head by vocabulary).

Rules are regular expressions on the '/'-joined parameter path (`layers/3/attn/q_proj/kernel`) and
are searched, not anchored at the start, so the same rules shard optimizer state whose leaves
mirror the parameters under a prefix (`0/mu/layers/3/attn/q_proj/kernel`). A dimension that the
mesh axis does not divide is replicated instead, so odd sizes (tiny vocabularies) still work.
A scanned model's stacked block parameters (`layers/attn/q_proj/kernel` [L, in, out]) take the same
rule on the dimensions after the layer axis, which is never split.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from mage_jax.models.config import ModelConfig
from mage_jax.models.mesh_axes import AXES, BATCH_AXES
from mage_jax.models.transformer import Transformer

# (path regex, mesh axis per array dimension). Order matters: the first match wins.
PARTITION_RULES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"(^|/)embed/embedding$", ("tensor", "fsdp")),
    (r"(^|/)attn/(q_proj|k_proj|v_proj)/kernel$", ("fsdp", "tensor")),
    (r"(^|/)attn/(q_proj|k_proj|v_proj)/bias$", ("tensor",)),
    (r"(^|/)attn/o_proj/kernel$", ("tensor", "fsdp")),
    (r"(^|/)mlp/(gate_proj|up_proj)/kernel$", ("fsdp", "tensor")),
    (r"(^|/)mlp/down_proj/kernel$", ("tensor", "fsdp")),
    (r"(^|/)lm_head/kernel$", ("fsdp", "tensor")),
    (r"(^|/)(input_norm|post_attn_norm|final_norm|q_norm|k_norm)/scale$", (None,)),
    # LoRA adapters ([in, r] and [r, out], mage_jax.models.lora): small, replicated.
    (r"(^|/)lora/lora_(a|b)$", (None, None)),
)
# A scanned model's block parameters (`layers/attn/q_proj/kernel`, no layer number): the rule's axes
# apply to the dimensions after the leading layer axis, which stays whole (every device runs every layer).
STACKED_LAYERS = r"(^|/)layers/[^/0-9]"


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh axis sizes; at most one may be -1, meaning "all remaining devices"."""

    data: int = 1
    fsdp: int = -1
    tensor: int = 1

    def resolve(self, num_devices: int) -> tuple[int, int, int]:
        sizes = [self.data, self.fsdp, self.tensor]
        if any(s == 0 or s < -1 for s in sizes) or sizes.count(-1) > 1:
            raise ValueError(f"mesh sizes must be positive (one may be -1), got {self}")
        known = math.prod(s for s in sizes if s != -1)
        if -1 in sizes:
            if num_devices % known:
                raise ValueError(f"{num_devices} devices cannot be split into mesh {self}")
            sizes[sizes.index(-1)] = num_devices // known
        if math.prod(sizes) != num_devices:
            raise ValueError(
                f"mesh data={sizes[0]} x fsdp={sizes[1]} x tensor={sizes[2]} needs {math.prod(sizes)} "
                f"devices, found {num_devices}"
            )
        return sizes[0], sizes[1], sizes[2]


def make_mesh(cfg: MeshConfig | None = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ('data', 'fsdp', 'tensor') mesh over all (or the given) devices."""
    cfg = cfg or MeshConfig()
    devices = list(jax.devices() if devices is None else devices)
    shape = cfg.resolve(len(devices))
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


# ---------------------------------------------------------------------------- paths and specs
def path_to_str(path: Sequence[Any]) -> str:
    """A pytree key path as 'a/b/0/c' (the trailing Variable '.value' is dropped)."""
    parts = []
    for key in path:
        if isinstance(key, jax.tree_util.DictKey):
            parts.append(str(key.key))
        elif isinstance(key, jax.tree_util.SequenceKey):
            parts.append(str(key.idx))
        elif isinstance(key, jax.tree_util.GetAttrKey):
            parts.append(key.name)
        elif isinstance(key, jax.tree_util.FlattenedIndexKey):
            parts.append(str(key.key))
        else:
            parts.append(str(key))
    if parts and parts[-1] in ("value", "raw_value"):
        parts.pop()
    return "/".join(parts)


def _fit(axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh) -> PartitionSpec:
    """Drop mesh axes that do not divide their dimension (or are trivial)."""
    spec = []
    for axis, dim in zip(axes, shape):
        if axis is None or mesh.shape[axis] == 1 or dim % mesh.shape[axis]:
            spec.append(None)
        else:
            spec.append(axis)
    return PartitionSpec(*spec)


def partition_spec(path: str, shape: Sequence[int], mesh: Mesh, *, strict: bool = True) -> PartitionSpec:
    """PartitionSpec of one array from the rules; unknown paths raise when `strict`, else replicate."""
    if len(shape) == 0:
        return PartitionSpec()
    for pattern, axes in PARTITION_RULES:
        if re.search(pattern, path):
            if re.search(STACKED_LAYERS, path):  # a scanned model's [L, ...] block parameter
                axes = (None, *axes)
            if len(axes) != len(shape):  # e.g. factored optimizer statistics: keep them whole
                return PartitionSpec()
            return _fit(axes, shape, mesh)
    if strict:
        raise ValueError(f"no partition rule for parameter {path!r} with shape {tuple(shape)}")
    return PartitionSpec()


def tree_shardings(tree: Any, mesh: Mesh, *, strict: bool = True) -> Any:
    """NamedShardings for every array leaf of `tree` (an nnx.State, a dict, an optax state)."""

    def one(path, leaf):
        shape = getattr(leaf, "shape", ())
        return NamedSharding(mesh, partition_spec(path_to_str(path), shape, mesh, strict=strict))

    return jax.tree_util.tree_map_with_path(one, tree)


def param_shardings(state: Any, mesh: Mesh) -> Any:
    """Shardings for a parameter state; every parameter must match a rule."""
    return tree_shardings(state, mesh, strict=True)


def opt_state_shardings(opt_state: Any, mesh: Mesh) -> Any:
    """Shardings for an optax state: leaves mirroring parameters follow the parameter rules,
    everything else (step counts, scalars, unknown statistics) is replicated."""
    return tree_shardings(opt_state, mesh, strict=False)


def shard_state(state: Any, mesh: Mesh) -> Any:
    """Place a parameter state on the mesh according to the rules."""
    return jax.device_put(state, param_shardings(state, mesh))


def generation_sharding(sharding: Any) -> Any:
    """A parameter's placement for generation: its ``fsdp`` split gathered, its ``tensor`` split kept.
    A decode step reads every parameter; sharded over ``fsdp`` each step would all-gather it, writing and
    reading a full copy (on 8 x H100 a ``paper`` decode step read 2x the parameters it computes with).
    The price: while a rollout runs, a copy of the parameters (per ``tensor`` shard) beside the training
    state (``experiments.plan`` counts it in the engine's programs)."""
    if not isinstance(sharding, NamedSharding) or sharding.mesh.shape.get("fsdp", 1) == 1:
        return sharding

    def drop(axis: Any) -> Any:
        if axis == "fsdp":
            return None
        if isinstance(axis, tuple):
            kept = tuple(a for a in axis if a != "fsdp")
            return kept[0] if len(kept) == 1 else (kept or None)
        return axis

    return NamedSharding(sharding.mesh, PartitionSpec(*(drop(a) for a in sharding.spec)))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Rows (leading dimension) split over ('data', 'fsdp'); other dimensions replicated."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES))


def rows_sharding(mesh: Mesh, rows: int, ndim: int = 1) -> NamedSharding:
    """An array of ``rows`` leading rows: split over ('data', 'fsdp') when they divide them, else
    replicated, so that a mini-batch of fewer rows than the slice has devices (16 rows on a 64-chip
    slice) still runs, every device computing every row."""
    lead = BATCH_AXES if rows % (mesh.shape["data"] * mesh.shape["fsdp"]) == 0 else None
    return NamedSharding(mesh, PartitionSpec(lead, *([None] * (ndim - 1))))


def to_host(x: jax.Array) -> Any:
    """The whole of a (possibly multi-process) array as numpy on this host. With several processes a
    row-sharded array has rows on other hosts: they are gathered (every process must call this)."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def cache_sharding(config: ModelConfig, mesh: Mesh, batch: int) -> NamedSharding:
    """KV cache: rows over ('data','fsdp'), kv heads over 'tensor' when they divide.

    One sharding for every leaf of the `KVCache`: per-layer keys [B,Hkv,D,S] and values [B,Hkv,S,D]
    both lead with rows and kv heads.
    """
    rows = BATCH_AXES if batch % (mesh.shape["data"] * mesh.shape["fsdp"]) == 0 else None
    heads = "tensor" if config.num_kv_heads % mesh.shape["tensor"] == 0 else None
    return NamedSharding(mesh, PartitionSpec(rows, heads, None, None))


def abstract_sharded(config: ModelConfig, mesh: Mesh, seed: int = 0) -> tuple[nnx.GraphDef, Any]:
    """The graph and the parameter state of ``config`` as ``ShapeDtypeStruct`` leaves carrying their
    shardings: what ``init_sharded`` would place, without allocating anything (ahead-of-time plans)."""
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(seed)))
    graphdef, abstract_state = nnx.split(abstract)
    shardings = param_shardings(abstract_state, mesh)
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_state,
                         shardings)
    return graphdef, state


def init_sharded(config: ModelConfig, mesh: Mesh, seed: int = 0) -> tuple[nnx.GraphDef, Any]:
    """Initialise a fresh model directly into its shardings (no full copy on one device)."""
    graphdef, abstract_state = abstract_sharded(config, mesh, seed)
    shardings = jax.tree.map(lambda a: a.sharding, abstract_state)

    def init():
        return nnx.split(Transformer(config, rngs=nnx.Rngs(seed)))[1]

    state = jax.jit(init, out_shardings=shardings)()
    return graphdef, state


def initialize_distributed(enabled: bool, **kwargs: Any) -> bool:
    """Multi-host start-up (`jax.distributed.initialize`) behind a flag; returns whether it ran.

    On Cloud TPU and SLURM the coordinator is discovered automatically; elsewhere pass
    `coordinator_address`, `num_processes` and `process_id`. Must run before any other JAX call.
    """
    if not enabled:
        return False
    if jax.distributed.is_initialized():
        return True
    jax.distributed.initialize(**kwargs)
    return True


DISTRIBUTED_ENV = "MAGE_DISTRIBUTED"


def initialize_from_environment(environ: Mapping[str, str] | None = None) -> bool:
    """Join a multi-process run when ``MAGE_DISTRIBUTED=1`` is set (docs/scaling.md); returns whether it did.

    ``JAX_COORDINATOR_ADDRESS`` (host:port of process 0), ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``
    are passed on when set (a GPU cluster without SLURM); on a Cloud TPU pod slice or under SLURM
    ``jax.distributed`` discovers them itself. Every process then sees the devices of all processes
    (``jax.devices()``) and the mesh spans them; each runs the same program.
    """
    env = os.environ if environ is None else environ
    if env.get(DISTRIBUTED_ENV, "0").strip().lower() in ("", "0", "false", "no"):
        return False
    kwargs: dict[str, Any] = {}
    if env.get("JAX_COORDINATOR_ADDRESS"):
        kwargs["coordinator_address"] = env["JAX_COORDINATOR_ADDRESS"]
    if env.get("JAX_NUM_PROCESSES"):
        kwargs["num_processes"] = int(env["JAX_NUM_PROCESSES"])
    if env.get("JAX_PROCESS_ID"):
        kwargs["process_id"] = int(env["JAX_PROCESS_ID"])
    return initialize_distributed(True, **kwargs)


def is_main_process() -> bool:
    """Process 0 of a multi-process run (always True in a single process): the one that writes logs."""
    return jax.process_index() == 0
