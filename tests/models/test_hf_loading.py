"""Hugging Face folder <-> parameter state: round trips, sharded checkpoints and clear errors."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from mage_jax.models.config import ModelConfig
from mage_jax.models.hf_loading import export_hf, hf_name_map, load_hf_model, load_hf_params
from tests.optional import require

from .conftest import hf_logits, jax_logits


def _copy(folder: str, tmp_path, name: str = "ckpt") -> str:
    dst = tmp_path / name
    shutil.copytree(folder, dst)
    return str(dst)


def _rewrite(folder: str, edit) -> None:
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _edit_config(folder: str, **changes) -> None:
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(changes)
    with open(path, "w") as f:
        json.dump(config, f)


@pytest.mark.parametrize(("arch", "tie"), [("qwen3", False), ("llama", True)])
def test_export_then_transformers_from_pretrained_gives_the_same_logits(
    hf_checkpoint, left_padded_batch, tmp_path, arch, tie
):
    import transformers

    folder, hf_model = hf_checkpoint(arch, tie)
    tokens, mask, positions = left_padded_batch
    config, _, state = load_hf_params(folder)
    export_hf(state, config, tmp_path / "export")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    assert type(reloaded) is type(hf_model)
    ref = hf_logits(hf_model, tokens, mask, positions)
    np.testing.assert_allclose(hf_logits(reloaded, tokens, mask, positions)[mask], ref[mask], atol=1e-6)


def test_sharded_checkpoint_with_index_loads_the_same_parameters(hf_checkpoint, tmp_path):
    folder, _ = hf_checkpoint("qwen3", False)
    config, _, state = load_hf_params(folder)
    export_hf(state, config, tmp_path / "sharded", max_shard_bytes=40_000)
    files = sorted(os.listdir(tmp_path / "sharded"))
    assert "model.safetensors.index.json" in files
    assert sum(f.endswith(".safetensors") for f in files) > 2
    _, _, again = load_hf_params(tmp_path / "sharded")
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(again)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("max_shard_bytes", [None, 40_000])
def test_exported_files_have_the_mode_of_new_files(hf_checkpoint, tmp_path, max_shard_bytes):
    """Weights are as readable as the config beside them: 0644 under umask 022 (safetensors alone gives
    its temporary file's 0600), 0640 under umask 027."""
    folder, _ = hf_checkpoint("qwen3", False)
    config, _, state = load_hf_params(folder)
    shards = {} if max_shard_bytes is None else {"max_shard_bytes": max_shard_bytes}
    for umask, mode in ((0o022, 0o644), (0o027, 0o640)):
        out = tmp_path / f"export-{umask:o}"
        previous = os.umask(umask)
        try:
            export_hf(state, config, out, **shards)
        finally:
            os.umask(previous)
        modes = {f: os.stat(out / f).st_mode & 0o777 for f in os.listdir(out)}
        weights = sum(f.endswith(".safetensors") for f in modes)
        assert weights == (1 if max_shard_bytes is None else len(modes) - 2)
        assert modes == dict.fromkeys(modes, mode), modes


def test_bfloat16_checkpoint_loads_into_float32_and_bfloat16(hf_checkpoint, left_padded_batch, tmp_path):
    torch = require("torch")
    from safetensors import safe_open

    _, hf_model = hf_checkpoint("qwen2", False)
    tokens, mask, positions = left_padded_batch
    bf16_weights = {k: v.to(torch.bfloat16) for k, v in hf_model.state_dict().items()}
    rounded = type(hf_model)(hf_model.config).eval()  # float32 model holding the bf16-rounded weights
    rounded.load_state_dict({k: v.float() for k, v in bf16_weights.items()})
    rounded.save_pretrained(tmp_path / "bf16", state_dict=bf16_weights, safe_serialization=True)
    with safe_open(tmp_path / "bf16" / "model.safetensors", framework="numpy") as f:
        assert f.get_tensor("model.norm.weight").dtype == jnp.bfloat16

    model = load_hf_model(tmp_path / "bf16", dtype="float32")
    assert model.config.param_dtype == "float32"
    ours = jax_logits(model, tokens, mask, positions)
    ref = hf_logits(rounded, tokens, mask, positions)
    np.testing.assert_allclose(ours[mask], ref[mask], atol=1e-4, rtol=1e-4)
    as_bf16 = load_hf_model(tmp_path / "bf16", dtype="bfloat16")
    assert as_bf16.config.param_dtype == "bfloat16"
    assert as_bf16.embed.embedding.value.dtype == jnp.bfloat16


def test_every_parameter_has_exactly_one_hugging_face_name(hf_checkpoint):
    folder, hf_model = hf_checkpoint("qwen2", False)
    config, _, state = load_hf_params(folder, ModelConfig.from_hf_dir(folder, scan_layers=False))
    names = hf_name_map(config)
    assert len({n for n, _ in names.values()}) == len(names) == len(jax.tree.leaves(state))
    assert {n for n, _ in names.values()} == set(hf_model.state_dict())
    # Scanned: each stacked block parameter [L, ...] stands for the L names of its layers.
    config, _, stacked = load_hf_params(folder)
    assert config.scan_layers
    assert sum(leaf.shape[0] if path[0].key == "layers" else 1
               for path, leaf in jax.tree_util.tree_flatten_with_path(stacked)[0]) == len(names)


def test_missing_tensor_is_named(hf_checkpoint, tmp_path):
    folder = _copy(hf_checkpoint("qwen3", False)[0], tmp_path)
    _rewrite(folder, lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.self_attn\.k_norm\.weight'"):
        load_hf_params(folder)


def test_wrong_shape_is_named(hf_checkpoint, tmp_path):
    folder = _copy(hf_checkpoint("qwen3", False)[0], tmp_path)

    def widen(t):
        t["model.layers.0.mlp.up_proj.weight"] = np.zeros((129, 64), np.float32)

    _rewrite(folder, widen)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.up_proj\.weight' has shape \(129, 64\), "
                                         r"expected \(128, 64\)"):
        load_hf_params(folder)


def test_unexpected_tensor_is_named(hf_checkpoint, tmp_path):
    folder = _copy(hf_checkpoint("llama", False)[0], tmp_path)

    def add(t):
        t["model.layers.2.mlp.up_proj.weight"] = np.zeros((128, 64), np.float32)

    _rewrite(folder, add)
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.2\.mlp\.up_proj\.weight'"):
        load_hf_params(folder)



# -- an untrusted folder: damaged files, escaping index entries, non-finite weights ---------------------


def test_truncated_safetensors_file_is_one_error_naming_the_file(hf_checkpoint, tmp_path):
    folder = _copy(hf_checkpoint("qwen3", False)[0], tmp_path)
    path = os.path.join(folder, "model.safetensors")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(ValueError, match=r"safetensors file '.*model\.safetensors' is damaged") as info:
        load_hf_params(folder)
    assert "\n" not in str(info.value)


def test_oversized_safetensors_header_is_one_error_naming_the_file(hf_checkpoint, tmp_path):
    folder = _copy(hf_checkpoint("qwen3", False)[0], tmp_path)
    path = os.path.join(folder, "model.safetensors")
    with open(path, "r+b") as f:
        f.write(struct.pack("<Q", 10**12))  # the header length field: far beyond the file
    damaged = r"safetensors file '.*model\.safetensors' is damaged.*header too large"
    with pytest.raises(ValueError, match=damaged):
        load_hf_params(folder)


def test_a_damaged_shard_of_an_indexed_checkpoint_is_named(hf_checkpoint, tmp_path):
    folder, _ = hf_checkpoint("qwen3", False)
    config, _, state = load_hf_params(folder)
    export_hf(state, config, tmp_path / "sharded", max_shard_bytes=40_000)
    shard = sorted(f for f in os.listdir(tmp_path / "sharded") if f.endswith(".safetensors"))[1]
    path = tmp_path / "sharded" / shard
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ValueError, match=f"safetensors file '.*{shard}' is damaged"):
        load_hf_params(tmp_path / "sharded")


@pytest.mark.parametrize("target", ["../outside.safetensors", "/etc/outside.safetensors",
                                    "sub/../../outside.safetensors"])
def test_an_index_may_not_point_outside_the_model_folder(hf_checkpoint, tmp_path, target):
    folder, _ = hf_checkpoint("qwen3", False)
    config, _, state = load_hf_params(folder)
    export_hf(state, config, tmp_path / "sharded", max_shard_bytes=40_000)
    index_path = tmp_path / "sharded" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first = sorted(index["weight_map"])[0]
    shutil.copy(tmp_path / "sharded" / index["weight_map"][first], tmp_path / "outside.safetensors")
    index["weight_map"][first] = target
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"points outside the model folder: '{re.escape(target)}'"):
        load_hf_params(tmp_path / "sharded")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_weights_are_one_error_naming_the_tensor(hf_checkpoint, tmp_path, bad):
    folder = _copy(hf_checkpoint("qwen3", False)[0], tmp_path)

    def poison(t):
        t["model.layers.1.mlp.down_proj.weight"][3, 5] = bad

    _rewrite(folder, poison)
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.1\.mlp\.down_proj\.weight' in .* "
                                         r"holds non-finite values"):
        load_hf_params(folder)


def test_weights_that_overflow_the_target_dtype_are_refused(hf_checkpoint, tmp_path):
    folder = _copy(hf_checkpoint("qwen3", False)[0], tmp_path)

    def huge(t):
        t["model.norm.weight"][0] = 1e6  # finite in float32, inf in float16

    _rewrite(folder, huge)
    load_hf_params(folder)  # float32: fine
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' .* non-finite values .* as float16"):
        load_hf_params(folder, dtype="float16")

def test_unknown_architecture_and_unsupported_options_are_refused(hf_checkpoint, tmp_path):
    folder = _copy(hf_checkpoint("qwen3", False)[0], tmp_path)
    _edit_config(folder, architectures=["MistralForCausalLM"], model_type="mistral")
    with pytest.raises(ValueError, match="unsupported architecture 'MistralForCausalLM'"):
        load_hf_params(folder)
    _edit_config(folder, architectures=["Qwen3ForCausalLM"], model_type="qwen3", use_sliding_window=True)
    with pytest.raises(ValueError, match="sliding-window"):
        load_hf_params(folder)


def test_folders_without_safetensors_or_config_are_refused(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_hf_params(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        load_hf_params(tmp_path / "empty")
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "pytorch_model.bin").write_bytes(b"not loaded")
    (pickled / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2, "head_dim": 4,
    }))
    with pytest.raises(ValueError, match=r"no \*\.safetensors files"):
        load_hf_params(pickled)


def test_export_accepts_a_module_and_refuses_foreign_state(hf_checkpoint, tmp_path):
    model = load_hf_model(hf_checkpoint("qwen3", True)[0])
    export_hf(model, model.config, tmp_path / "module")
    assert (tmp_path / "module" / "config.json").exists()
    state = nnx.state(model)
    state["extra"] = nnx.Param(jnp.zeros(3))
    with pytest.raises(ValueError, match="parameter 'extra' has no Hugging Face name"):
        export_hf(state, model.config, tmp_path / "bad")
