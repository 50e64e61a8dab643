"""Local Hugging Face checkpoint folder <-> our parameter state, through safetensors only.

Loading reads `config.json` and one or many `*.safetensors` files (sharded checkpoints through
`model.safetensors.index.json`). Each parameter is read lazily slice by slice with
`safetensors.safe_open(..., framework="numpy")` inside `jax.make_array_from_callback`, so every
device receives only its own shard and no host or device ever holds a second full copy. Pickle
files and remote code are never touched.

A folder is untrusted input: a truncated or malformed safetensors file (e.g. an oversized header) is
one ``ValueError`` naming the file, an index may only name files inside the folder, and every loaded
block is checked to be finite (NaN or inf weights would otherwise train silently into NaN).

Hugging Face stores linear weights as [out, in]; we store kernels as [in, out], so those are
transposed on the way in and out. A scanned model (`ModelConfig.scan_layers`) keeps every block
parameter stacked over a leading layer axis: its `layers/attn/q_proj/kernel` [L, in, out] is read from
`model.layers.<i>.self_attn.q_proj.weight` of every layer i (each device reading its block of each) and
written back as those L tensors. LoRA adapters are not in a Hugging Face folder: loading a config
with `lora_rank > 0` initialises them fresh, and export folds them into the kernels.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding
from safetensors import safe_open

from mage_jax.models.config import ModelConfig
from mage_jax.models.lora import has_adapters, merge_adapters, split_adapters
from mage_jax.models.sharding import param_shardings, path_to_str
from mage_jax.models.transformer import Transformer, unstack_layers

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Buffers some exporters leave in checkpoints; they are recomputed, never loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def hf_name_map(config: ModelConfig) -> dict[str, tuple[str, bool]]:
    """Our parameter path in the unrolled layout (`layers/<i>/...`) -> (Hugging Face tensor name, stored
    transposed?). A scanned model's stacked `layers/...` holds `layers/<i>/...` of every layer i."""
    names: dict[str, tuple[str, bool]] = {"embed/embedding": ("model.embed_tokens.weight", False)}
    for i in range(config.num_layers):
        ours, theirs = f"layers/{i}", f"model.layers.{i}"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            names[f"{ours}/attn/{proj}/kernel"] = (f"{theirs}.self_attn.{proj}.weight", True)
        if config.qkv_bias:
            for proj in ("q_proj", "k_proj", "v_proj"):
                names[f"{ours}/attn/{proj}/bias"] = (f"{theirs}.self_attn.{proj}.bias", False)
        if config.qk_norm:
            names[f"{ours}/attn/q_norm/scale"] = (f"{theirs}.self_attn.q_norm.weight", False)
            names[f"{ours}/attn/k_norm/scale"] = (f"{theirs}.self_attn.k_norm.weight", False)
        for proj in ("gate_proj", "up_proj", "down_proj"):
            names[f"{ours}/mlp/{proj}/kernel"] = (f"{theirs}.mlp.{proj}.weight", True)
        names[f"{ours}/input_norm/scale"] = (f"{theirs}.input_layernorm.weight", False)
        names[f"{ours}/post_attn_norm/scale"] = (f"{theirs}.post_attention_layernorm.weight", False)
    names["final_norm/scale"] = ("model.norm.weight", False)
    if not config.tie_word_embeddings:
        names["lm_head/kernel"] = ("lm_head.weight", True)
    return names


def _tensor_files(path: str) -> dict[str, str]:
    """Tensor name -> safetensors file, from the index or by listing the file(s)."""
    index_path = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index_path):
        try:
            with open(index_path, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index_path} is not a valid safetensors index: {e!r}") from None
        if not isinstance(weight_map, Mapping):
            raise ValueError(f"{index_path} is not a valid safetensors index: weight_map is not an object")
        for file in sorted(set(map(str, weight_map.values()))):
            if not _inside_folder(file):
                raise ValueError(f"{index_path} points outside the model folder: {file!r}")
        files = {name: os.path.join(path, file) for name, file in weight_map.items()}
        for file in sorted(set(files.values())):
            if not os.path.isfile(file):
                raise ValueError(f"{index_path} refers to missing file {os.path.basename(file)!r}")
        return files
    shards = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not shards:
        raise ValueError(f"no *.safetensors files in {path!r} (pickled .bin checkpoints are not loaded)")
    files: dict[str, str] = {}
    for shard in shards:
        with _open_safetensors(os.path.join(path, shard)) as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                files[name] = os.path.join(path, shard)
    return files


def _inside_folder(file: str) -> bool:
    """Whether an index entry names a file under the model folder: relative, no ``..`` step.

    Checked on the name, not the resolved path: Hugging Face cache snapshots are symlinks into a
    sibling ``blobs`` folder, and a folder's own symlinks are the user's choice.
    """
    norm = os.path.normpath(file)
    return bool(file) and not os.path.isabs(file) and norm != ".." and not norm.startswith(".." + os.sep)


def _open_safetensors(file: str) -> Any:
    """``safe_open`` of one file; a truncated or malformed file is one ValueError naming it."""
    try:
        return safe_open(file, framework="numpy")
    except Exception as err:  # SafetensorError (header too large, incomplete file, bad JSON), OSError
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"safetensors file {file!r} is damaged or not safetensors: {reason}") from None


def _check_names(expected: Mapping[str, str], present: set[str], config: ModelConfig, path: str) -> None:
    wanted = set(expected.values())
    missing = sorted(wanted - present)
    if missing:
        raise ValueError(
            f"checkpoint {path!r} is missing tensor {missing[0]!r}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    allowed = {"lm_head.weight"} if config.tie_word_embeddings else set()
    unexpected = sorted(
        n for n in present - wanted - allowed if not n.endswith(_IGNORED_SUFFIXES)
    )
    if unexpected:
        raise ValueError(
            f"checkpoint {path!r} has unexpected tensor {unexpected[0]!r}"
            + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else "")
            + f" for a {config.architecture} model of {config.num_layers} layers"
        )


def load_hf_params(
    path: str | os.PathLike,
    config: ModelConfig | None = None,
    *,
    dtype: Any = None,
    shardings: Any = None,
    mesh: Mesh | None = None,
    lora_seed: int = 0,
) -> tuple[ModelConfig, nnx.GraphDef, nnx.State]:
    """Load a local Hugging Face checkpoint folder -> (config, graphdef, state).

    `config` defaults to the folder's `config.json` (pass one to change `param_dtype`, `dtype`,
    `remat` or add LoRA adapters); `dtype` overrides the parameter dtype. Placement: explicit
    `shardings` (a pytree matching the state), else the partition rules on `mesh`, else the default
    device. With `config.lora_rank > 0` the adapters are initialised from `lora_seed` (B = 0).
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"checkpoint folder {path!r} does not exist")
    hf_config = ModelConfig.from_hf_dir(path)
    if config is None:
        config = hf_config
    if dtype is not None:
        config = dataclasses.replace(config, param_dtype=dtype)
    param_dtype = config.jnp_param_dtype

    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(lora_seed)))
    graphdef, abstract_state = nnx.split(abstract)
    if shardings is None and mesh is not None:
        shardings = param_shardings(abstract_state, mesh)
    if shardings is None:
        device = SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: device, abstract_state)
    adapter_shardings, shardings = split_adapters(shardings)
    abstract_state = split_adapters(abstract_state)[1]

    names = hf_name_map(config)
    files = _tensor_files(path)
    _check_names({k: v[0] for k, v in names.items()}, set(files), config, path)

    with contextlib.ExitStack() as stack:
        handles: dict[str, Any] = {}

        def reader(name: str):
            file = files[name]
            if file not in handles:
                handles[file] = stack.enter_context(_open_safetensors(file))
            return handles[file].get_slice(name)

        def one(ours: str, shape: tuple[int, ...]) -> Callable[[Any], np.ndarray]:
            if ours not in names:
                raise ValueError(f"no Hugging Face tensor is mapped to parameter {ours!r}")
            name, transposed = names[ours]
            tensor = reader(name)
            have = tuple(tensor.get_shape())
            want = shape[::-1] if transposed else shape
            if have != want:
                raise ValueError(f"tensor {name!r} has shape {have}, expected {want}")
            return _slice_reader(tensor, transposed, param_dtype, name, files[name])

        def load(key_path, leaf, sharding):
            ours, shape = path_to_str(key_path), tuple(leaf.shape)
            if not (config.scan_layers and ours.startswith("layers/")):
                return jax.make_array_from_callback(shape, sharding, one(ours, shape))
            rest = ours.removeprefix("layers/")
            layers = [one(f"layers/{i}/{rest}", shape[1:]) for i in range(shape[0])]

            def read(index: tuple[slice, ...]) -> np.ndarray:  # this device's block of every layer it holds
                return np.stack([layers[i](index[1:]) for i in range(shape[0])[index[0]]])

            return jax.make_array_from_callback(shape, sharding, read)

        state = jax.tree_util.tree_map_with_path(load, abstract_state, shardings)
    if config.lora_rank:  # fresh adapters (B = 0: the loaded model's outputs are unchanged)
        def init_adapters():
            return split_adapters(nnx.split(Transformer(config, rngs=nnx.Rngs(lora_seed)))[1])[0]

        state = nnx.merge_state(state, jax.jit(init_adapters, out_shardings=adapter_shardings)())
    return config, graphdef, state


def _slice_reader(tensor: Any, transposed: bool, dtype: Any, name: str,
                  file: str) -> Callable[[Any], np.ndarray]:
    """Reads one device's block of a tensor, cast to ``dtype``; refuses NaN / inf values."""

    def read(index: tuple[slice, ...]) -> np.ndarray:
        if transposed:
            block = tensor[index[1], index[0]].T
        else:
            block = tensor[index]
        block = np.ascontiguousarray(block.astype(dtype))
        if not np.isfinite(block).all():
            raise ValueError(f"tensor {name!r} in {file!r} holds non-finite values (NaN or inf) "
                             f"as {np.dtype(dtype).name}")
        return block

    return read


def load_hf_model(path: str | os.PathLike, config: ModelConfig | None = None, **kwargs: Any) -> Transformer:
    """Convenience: the loaded state merged back into a `Transformer` module."""
    _, graphdef, state = load_hf_params(path, config, **kwargs)
    return nnx.merge(graphdef, state)


# ---------------------------------------------------------------------------- export
def export_hf(
    state: Any,
    config: ModelConfig,
    out_dir: str | os.PathLike,
    *,
    max_shard_bytes: int = 4 << 30,
    eos_token_ids: Sequence[int] = (),
    pad_token_id: int | None = None,
    bos_token_id: int | None = None,
) -> None:
    """Write `config.json` + safetensors (sharded with an index above `max_shard_bytes`) that
    `transformers.AutoModelForCausalLM.from_pretrained(out_dir)` loads as the same model.

    Token ids given here go into `config.json` and `generation_config.json`, so `generate` stops at
    every end-of-turn token (the first of `eos_token_ids` is the main one) and pads with `pad_token_id`.

    `state` is a parameter state or a `Transformer`. In a multi-host run every process must call
    this (arrays are gathered); only process 0 writes.
    """
    if isinstance(state, Transformer):
        state = nnx.state(state, nnx.Param)
    if has_adapters(state):  # LoRA: export W + (alpha / r) A B, a plain model of the base architecture
        state = merge_adapters(state, config.lora_scale)
    if config.scan_layers:  # one tensor per layer, as Hugging Face names them
        state = unstack_layers(state)
    out_dir = os.fspath(out_dir)
    names = hf_name_map(config)
    tensors: dict[str, np.ndarray] = {}
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    for key_path, leaf in leaves:
        ours = path_to_str(key_path)
        if ours not in names:
            raise ValueError(f"parameter {ours!r} has no Hugging Face name for a {config.architecture} model")
        name, transposed = names[ours]
        array = _to_host(leaf)
        tensors[name] = np.ascontiguousarray(array.T if transposed else array)
    missing = sorted({n for n, _ in names.values()} - set(tensors))
    if missing:
        raise ValueError(f"state lacks the parameter for {missing[0]!r}")
    if jax.process_index() != 0:
        return

    os.makedirs(out_dir, exist_ok=True)
    write_safetensors({name: tensors[name].nbytes for name in tensors}, tensors.__getitem__, out_dir,
                      max_shard_bytes=max_shard_bytes)
    write_hf_config(config, out_dir, eos_token_ids=eos_token_ids, pad_token_id=pad_token_id,
                    bos_token_id=bos_token_id)


def write_hf_config(config: ModelConfig, out_dir: str, *, eos_token_ids: Sequence[int] = (),
                    pad_token_id: int | None = None, bos_token_id: int | None = None) -> None:
    """`config.json` for `config` with the token ids, and `generation_config.json` with the ids alone."""
    ids: dict[str, Any] = {}
    if eos_token_ids:
        eos = [int(i) for i in eos_token_ids]
        ids["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    if pad_token_id is not None:
        ids["pad_token_id"] = int(pad_token_id)
    if bos_token_id is not None:
        ids["bos_token_id"] = int(bos_token_id)
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump({**config.to_hf_config(), **ids}, f, indent=2)
    if ids:
        with open(os.path.join(out_dir, "generation_config.json"), "w", encoding="utf-8") as f:
            json.dump(ids, f, indent=2)


def write_safetensors(sizes: Mapping[str, int], read: Callable[[str], np.ndarray], out_dir: str, *,
                      max_shard_bytes: int = 4 << 30) -> None:
    """Write the tensors named in `sizes` (bytes each) into `out_dir` as one ``model.safetensors`` or as
    shards of at most `max_shard_bytes` with an index. Each shard's tensors are asked of `read` just
    before it is written, so a converter that builds tensors on demand holds one shard at a time."""
    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(sizes):
        if shards[-1] and size + sizes[name] > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += sizes[name]
    metadata = {"format": "pt"}
    if len(shards) == 1:
        _save_tensors({name: read(name) for name in shards[0]}, os.path.join(out_dir, SINGLE_FILE), metadata)
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _save_tensors({name: read(name) for name in shard}, os.path.join(out_dir, file), metadata)
        weight_map.update({name: file for name in shard})
    index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
    with open(os.path.join(out_dir, INDEX_FILE), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2)


def _save_tensors(tensors: dict[str, np.ndarray], path: str, metadata: dict[str, str]) -> None:
    """``safetensors.numpy.save_file`` with the mode of any new file (0644 under umask 022): the
    library writes through a private temporary file and leaves it 0600, unreadable to the group that
    reads the rest of the exported folder."""
    from safetensors.numpy import save_file

    save_file(tensors, path, metadata=metadata)
    os.chmod(path, 0o666 & ~_umask())


def _umask() -> int:
    """The process's file-mode creation mask (reading it means setting it; it is set back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _to_host(leaf: Any) -> np.ndarray:
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
    return np.asarray(jax.device_get(leaf))
