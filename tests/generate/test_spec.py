"""``ModelSpec.place_state``: the parameters a generation session reads, placed once per session. Float32
master weights of a bfloat16 model are read as bfloat16 (the model casts every parameter to its compute
dtype before use, so the logits are bit for bit the same) and a split over ``fsdp`` is gathered (a decode
step would otherwise all-gather every parameter); a float32 model on one device is used as it is."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

from mage_jax.generate.spec import ModelSpec
from mage_jax.models.config import ModelConfig
from mage_jax.models.mesh_axes import AXES
from mage_jax.models.sharding import generation_sharding, param_shardings
from mage_jax.models.transformer import Transformer, positions_from_mask

SMALL = dict(vocab_size=64, num_layers=2, hidden_size=32, intermediate_size=64)


def _model(**overrides):
    config = ModelConfig.preset("tiny", **SMALL, **overrides)
    graphdef, state = nnx.split(Transformer(config, rngs=nnx.Rngs(0)))
    if config.lora_rank:  # adapters that do something (LoRA's B starts at zero)
        rank = config.lora_rank
        state = jax.tree.map(lambda x: x + 0.05 if x.ndim == 2 and x.shape[0] == rank else x, state)
    return config, graphdef, state


def _logits(graphdef, state, tokens):
    mask = np.ones(tokens.shape, bool)
    model = nnx.merge(graphdef, state)
    hidden, _ = model(tokens, positions_from_mask(mask), mask)
    return model.logits(hidden)


@pytest.mark.parametrize("lora_rank", [0, 2])
def test_float32_master_weights_of_a_bfloat16_model_are_read_as_bfloat16_with_the_same_logits(lora_rank):
    config, graphdef, state = _model(dtype="bfloat16", param_dtype="float32", lora_rank=lora_rank)
    spec = ModelSpec(graphdef, config, eos_ids=(3,), pad_id=0)
    placed = spec.place_state(state)
    dtypes = {x.dtype for x in jax.tree.leaves(placed) if jnp.issubdtype(x.dtype, jnp.floating)}
    assert dtypes == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(state)} == {jnp.dtype(jnp.float32)}  # the training copy stays
    tokens = np.random.default_rng(0).integers(1, 64, size=(2, 7)).astype(np.int32)
    run = jax.jit(_logits, static_argnums=0)
    np.testing.assert_array_equal(np.asarray(run(graphdef, placed, tokens)),
                                  np.asarray(run(graphdef, state, tokens)))
    abstract = spec.abstract_placed(jax.eval_shape(lambda: state))  # what a plan lowers
    assert [a.dtype for a in jax.tree.leaves(abstract)] == [x.dtype for x in jax.tree.leaves(placed)]


def test_a_float32_model_on_one_device_is_generated_from_as_it_is():
    config, graphdef, state = _model()
    spec = ModelSpec(graphdef, config, eos_ids=(3,), pad_id=0)
    assert spec.place_state(state) is state


def test_generation_gathers_the_fsdp_split_and_keeps_the_tensor_split():
    mesh = AbstractMesh((2, 2, 2), AXES)
    config, _, _ = _model()
    abstract = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))[1]
    shardings = {"/".join(str(getattr(k, "key", k)) for k in p): s
                 for p, s in jax.tree_util.tree_flatten_with_path(param_shardings(abstract, mesh))[0]}
    q = shardings["layers/0/attn/q_proj/kernel/.value"]
    assert q.spec == PartitionSpec("fsdp", "tensor")
    assert generation_sharding(q).spec == PartitionSpec(None, "tensor")
    both = NamedSharding(mesh, PartitionSpec(("data", "fsdp"), None))
    assert generation_sharding(both).spec == PartitionSpec("data", None)
    one = AbstractMesh((2, 1, 4), AXES)  # nothing split over fsdp: the same placement
    kept = NamedSharding(one, PartitionSpec("data", "tensor"))
    assert generation_sharding(kept) is kept


def test_a_scanned_model_is_generated_from_its_blocks_unstacked_once_per_session():
    # Generation runs the blocks one by one; from the stacked parameters every decode step sliced each
    # block's weights out (a copy written and read again: 2.3x the ideal decode bytes on 8 x H100).
    config, graphdef, state = _model(scan_layers=True)
    spec = ModelSpec(graphdef, config, eos_ids=(3,), pad_id=0)
    placed = spec.place_state(state)
    paths = {path[:2] for path, _ in nnx.to_flat_state(placed) if path[0] == "layers"}
    assert paths == {("layers", 0), ("layers", 1)}
    assert spec.copies_state(state) and not spec.copies_state(placed)
    unrolled = nnx.merge(spec.generation_graphdef, placed)
    assert not unrolled.config.scan_layers
    tokens = np.random.default_rng(1).integers(1, 64, size=(2, 6)).astype(np.int32)
    np.testing.assert_allclose(np.asarray(_logits(spec.generation_graphdef, placed, tokens)),
                               np.asarray(_logits(graphdef, state, tokens)), rtol=1e-5, atol=1e-5)
    abstract = spec.abstract_placed(jax.eval_shape(lambda: state))
    assert jax.tree.structure(abstract) == jax.tree.structure(placed)
