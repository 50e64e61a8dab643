"""Specification of mage_jax.aot: the programs a run executes, lowered ahead of time from abstract
parameters (nothing allocated), so a memory plan measures what the run compiles."""

import jax
from flax import nnx

from mage_jax import aot
from mage_jax.generate.sampler import Sampler
from mage_jax.generate.slots import CompiledSlotPrograms
from mage_jax.generate.spec import ModelSpec
from mage_jax.generate.step import SamplingParams
from mage_jax.models.config import ModelConfig
from mage_jax.models.transformer import Transformer


def test_the_rollout_lowers_the_engines_insert_and_decode_or_the_lockstep_program():
    config = ModelConfig.preset("tiny", vocab_size=64, num_layers=1, hidden_size=32, intermediate_size=64)
    graphdef, state = nnx.split(Transformer(config, rngs=nnx.Rngs(0)))
    params = jax.eval_shape(lambda: state)  # abstract: shapes and dtypes only
    spec = ModelSpec(graphdef, config, eos_ids=(3,), pad_id=0, prompt_buckets=(8, 16))
    sampler = Sampler(spec, batch_buckets=(4,))
    programs = CompiledSlotPrograms(spec, slots=4, max_new_tokens=6, chunk=2)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6)
    lowered = aot.lower_rollout(None, programs, params, sampling)
    assert set(lowered) == {"insert", "decode"}
    cache = programs.abstract_slots().cache
    cache_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(cache))
    assert cache.k[0].shape[0] == 4 and cache.max_len == 16 + 6  # slots x (longest prompt + response)
    for program in lowered.values():
        memory = program.compile().memory_analysis()
        assert memory.argument_size_in_bytes >= cache_bytes  # the slots' cache goes in
        assert memory.alias_size_in_bytes >= cache_bytes  # and is donated: written in place
    (name,) = aot.lower_rollout(sampler, None, params, sampling)  # rollout.engine=lockstep
    assert name == "lockstep"


def test_the_engine_builds_and_lowers_its_programs_without_device_work():
    """Nothing is put on a device while the programs are built and lowered: a compile-only TPU or GPU
    topology has no device to put it on (``experiments.plan --compiler target`` compiles there)."""
    config = ModelConfig.preset("tiny", vocab_size=64, num_layers=1, hidden_size=32, intermediate_size=64)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6)
    with jax.transfer_guard("disallow"):
        spec = ModelSpec(graphdef, config, eos_ids=(3,), pad_id=0, prompt_buckets=(8, 16))
        sampler = Sampler(spec, batch_buckets=(4,))
        programs = CompiledSlotPrograms(spec, slots=4, max_new_tokens=6, chunk=2)
        lowered = aot.lower_rollout(sampler, programs, state, sampling)
        lockstep = aot.lower_rollout(sampler, None, state, sampling)
    assert set(lowered) == {"insert", "decode"} and set(lockstep) == {"lockstep"}


def test_the_lowered_rollout_programs_take_the_largest_shapes_the_run_can_send():
    """The insert is lowered for prompts of the longest bucket (a shorter one would plan the memory of a
    smaller program than the run compiles) and the decode over every slot and the whole cache."""
    config = ModelConfig.preset("tiny", vocab_size=64, num_layers=1, hidden_size=32, intermediate_size=64)
    graphdef, state = nnx.split(Transformer(config, rngs=nnx.Rngs(0)))
    params = jax.eval_shape(lambda: state)
    spec = ModelSpec(graphdef, config, eos_ids=(3,), pad_id=0, prompt_buckets=(8, 16))
    programs = CompiledSlotPrograms(spec, slots=4, max_new_tokens=6, chunk=2)
    lowered = aot.lower_rollout(None, programs, params, SamplingParams(temperature=1.0, max_new_tokens=6))
    (_, slots, tokens, valid, *_), _ = lowered["insert"].args_info
    rows = programs.insert_rows * programs.ways
    assert tokens.shape == valid.shape == (rows, 16)  # the longest prompt bucket, not 8
    (_, decoded, *_), _ = lowered["decode"].args_info
    for program_slots in (slots, decoded):
        keys = jax.tree.leaves(program_slots)[0]
        assert keys.shape[0] == 4 and 16 + 6 in keys.shape  # every slot, the whole cache
    sampler = Sampler(spec, batch_buckets=(4,))
    (lockstep,) = aot.lower_rollout(sampler, None, params, SamplingParams(max_new_tokens=6)).values()
    (_, _, prompts, *_), _ = lockstep.args_info
    assert prompts.shape[-1] == 16
