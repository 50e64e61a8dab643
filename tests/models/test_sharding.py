"""Mesh, partition rules and sharded execution (8 fake CPU devices in a subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import jax
import optax
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, PartitionSpec

from mage_jax.models.config import ModelConfig
from mage_jax.models.sharding import (
    AXES,
    MeshConfig,
    batch_sharding,
    initialize_distributed,
    make_mesh,
    opt_state_shardings,
    param_shardings,
    partition_spec,
    path_to_str,
    tree_shardings,
)
from mage_jax.models.transformer import Transformer
from tests.xla_env import fake_devices_env

MESH_222 = AbstractMesh((2, 2, 2), AXES)


def _abstract_state(**overrides):
    config = ModelConfig.preset("tiny", vocab_size=128, **overrides)
    return nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))[1]


@pytest.mark.parametrize("overrides", [{}, {"architecture": "qwen2", "qkv_bias": True, "qk_norm": False,
                                            "tie_word_embeddings": False}])
def test_every_parameter_matches_a_rule_and_matrices_are_split_over_fsdp_and_tensor(overrides):
    state = _abstract_state(**overrides)
    specs = {path_to_str(p): partition_spec(path_to_str(p), leaf.shape, MESH_222)
             for p, leaf in jax.tree_util.tree_flatten_with_path(state)[0]}
    assert specs["embed/embedding"] == PartitionSpec("tensor", "fsdp")
    assert specs["layers/0/attn/q_proj/kernel"] == PartitionSpec("fsdp", "tensor")
    assert specs["layers/3/attn/o_proj/kernel"] == PartitionSpec("tensor", "fsdp")
    assert specs["layers/1/mlp/down_proj/kernel"] == PartitionSpec("tensor", "fsdp")
    assert specs["final_norm/scale"] == PartitionSpec(None)
    matrices = [path for path, spec in specs.items() if path.endswith(("kernel", "embedding"))]
    assert all(set(specs[p]) == {"fsdp", "tensor"} for p in matrices)
    if not overrides:
        assert specs["layers/0/attn/q_norm/scale"] == PartitionSpec(None)
    else:
        assert specs["lm_head/kernel"] == PartitionSpec("fsdp", "tensor")
        assert specs["layers/2/attn/v_proj/bias"] == PartitionSpec("tensor")


def test_axes_that_do_not_divide_a_dimension_fall_back_to_replication():
    assert partition_spec("embed/embedding", (97, 64), MESH_222) == PartitionSpec(None, "fsdp")


def test_unknown_parameters_are_refused_but_unknown_optimizer_leaves_are_replicated():
    with pytest.raises(ValueError, match="no partition rule for parameter 'layers/0/adapter/kernel'"):
        partition_spec("layers/0/adapter/kernel", (4, 4), MESH_222)
    assert partition_spec("0/count", (), MESH_222) == PartitionSpec()
    assert partition_spec("1/whatever", (8,), MESH_222, strict=False) == PartitionSpec()


def test_optimizer_moments_follow_their_parameters_and_step_counts_are_replicated():
    state = _abstract_state()
    opt_state = jax.eval_shape(optax.adamw(1e-3).init, state)
    mesh = make_mesh(MeshConfig(1, 1, 1))
    shardings = {path_to_str(p): s.spec for p, s in
                 jax.tree_util.tree_flatten_with_path(opt_state_shardings(opt_state, mesh))[0]}
    assert shardings["0/count"] == PartitionSpec()
    assert "0/mu/layers/0/mlp/up_proj/kernel" in shardings and "0/nu/embed/embedding" in shardings
    abstract = tree_shardings(opt_state, MESH_222, strict=False)
    flat = {path_to_str(p): s.spec for p, s in jax.tree_util.tree_flatten_with_path(abstract)[0]}
    assert flat["0/mu/layers/0/mlp/up_proj/kernel"] == PartitionSpec("fsdp", "tensor")
    assert flat["0/nu/embed/embedding"] == PartitionSpec("tensor", "fsdp")


def test_mesh_config_fills_one_axis_and_rejects_impossible_shapes():
    assert MeshConfig(data=2, fsdp=-1, tensor=2).resolve(8) == (2, 2, 2)
    assert MeshConfig(1, -1, 1).resolve(8) == (1, 8, 1)
    with pytest.raises(ValueError, match="needs 4 devices, found 8"):
        MeshConfig(2, 2, 1).resolve(8)
    with pytest.raises(ValueError, match="cannot be split"):
        MeshConfig(3, -1, 1).resolve(8)
    with pytest.raises(ValueError, match="one may be -1"):
        MeshConfig(-1, -1, 1).resolve(8)


def test_single_device_mesh_and_batch_sharding():
    mesh = make_mesh()
    assert mesh.axis_names == AXES and mesh.devices.size == len(jax.devices())
    assert batch_sharding(mesh).spec == PartitionSpec(("data", "fsdp"))
    assert all(s.spec == PartitionSpec(*([None] * len(s.spec)))
               for s in jax.tree.leaves(param_shardings(_abstract_state(), mesh)))
    assert initialize_distributed(False) is False


_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax, jax.numpy as jnp, numpy as np, optax
    from flax import nnx
    from mage_jax.models.config import ModelConfig
    from mage_jax.models.transformer import positions_from_mask
    from mage_jax.models.hf_loading import load_hf_params
    from mage_jax.models.sharding import (MeshConfig, batch_sharding, cache_sharding, init_sharded, make_mesh,
                                          opt_state_shardings, shard_state)

    path = sys.argv[1]
    assert len(jax.devices()) == 8
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 128, size=(8, 12)).astype(np.int32)
    tokens[::2, :3] = 0  # left padding on half of the rows
    mask = tokens != 0

    def logits(graphdef, state, tokens, mask):
        m = nnx.merge(graphdef, state)
        hidden, _ = m(tokens, positions_from_mask(mask), mask)
        return m.logits(hidden)

    unrolled = ModelConfig.from_hf_dir(path, scan_layers=False)  # tests/models/test_scan_layers.py: scanned
    config, graphdef, state = load_hf_params(path, unrolled)
    ref = np.asarray(jax.jit(logits, static_argnums=0)(graphdef, state, tokens, mask))
    out = {}
    for name, mesh_cfg in [("data2_fsdp2_tensor2", MeshConfig(2, 2, 2)), ("fsdp8", MeshConfig(1, 8, 1))]:
        mesh = make_mesh(mesh_cfg)
        _, _, sharded = load_hf_params(path, unrolled, mesh=mesh)
        rows = batch_sharding(mesh)
        got = jax.jit(logits, static_argnums=0)(graphdef, sharded, jax.device_put(tokens, rows),
                                                 jax.device_put(mask, rows))
        leaves = {"/".join(str(getattr(k, "key", k)) for k in p[:-1]): x
                  for p, x in jax.tree_util.tree_flatten_with_path(sharded)[0]}
        sizes = {k: [leaves[k].nbytes, max(s.data.nbytes for s in leaves[k].addressable_shards),
                     len({str(s.index) for s in leaves[k].addressable_shards})]
                 for k in ("embed/embedding", "layers/0/attn/q_proj/kernel", "layers/1/mlp/down_proj/kernel",
                           "lm_head/kernel", "final_norm/scale")}
        out[name] = {
            "max_abs_diff": float(np.abs(np.asarray(got) - ref)[mask].max()),
            "sizes": sizes,
            "cache_spec": [list(a) if isinstance(a, tuple) else a
                           for a in cache_sharding(config, mesh, 8).spec],
        }
        if name != "data2_fsdp2_tensor2":
            continue
        resharded = shard_state(state, mesh)
        out[name]["shard_state_matches_loading"] = all(
            a.sharding == b.sharding for a, b in zip(jax.tree.leaves(resharded), jax.tree.leaves(sharded)))
        tx = optax.adamw(1e-3)
        opt_shardings = opt_state_shardings(jax.eval_shape(tx.init, sharded), mesh)
        opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(sharded)
        mu = opt_state[0].mu["layers"][0]["mlp"]["up_proj"]["kernel"]
        out[name]["opt_mu_shard_bytes"] = [mu.nbytes, max(s.data.nbytes for s in mu.addressable_shards)]
        up = init_sharded(config, mesh)[1]["layers"][0]["mlp"]["up_proj"]["kernel"]
        out[name]["init_shard_bytes"] = [up.nbytes, max(s.data.nbytes for s in up.addressable_shards)]
    print("RESULT" + json.dumps(out))
    """
)


def test_sharded_model_on_8_devices_matches_one_device_and_really_splits_parameters(hf_checkpoint):
    folder, _ = hf_checkpoint("qwen3", False, vocab=128)
    env = fake_devices_env(8)
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, folder], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT", 1)[1])

    for name, fsdp, tensor in [("data2_fsdp2_tensor2", 2, 2), ("fsdp8", 8, 1)]:
        r = result[name]
        assert r["max_abs_diff"] < 1e-4, r
        for key in ("embed/embedding", "layers/0/attn/q_proj/kernel", "layers/1/mlp/down_proj/kernel",
                    "lm_head/kernel"):
            total, per_device, distinct = r["sizes"][key]
            assert per_device * fsdp * tensor == total, (name, key, r["sizes"][key])
            assert distinct == fsdp * tensor
        assert r["sizes"]["final_norm/scale"][1] == r["sizes"]["final_norm/scale"][0]  # replicated
        assert r["cache_spec"] == [["data", "fsdp"], "tensor", None, None]  # per layer [B,Hkv,...]

    r = result["data2_fsdp2_tensor2"]
    assert r["shard_state_matches_loading"]
    mu_total, mu_shard = r["opt_mu_shard_bytes"]
    assert mu_shard * 4 == mu_total
    init_total, init_shard = r["init_shard_bytes"]
    assert init_shard * 4 == init_total
