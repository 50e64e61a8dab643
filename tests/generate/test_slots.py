"""Specification of mage_jax.generate.slots, the engine's device programs: ``insert`` prefills prompts
(once per distinct prompt, or copied from a donor slot) and draws each slot's first token, ``decode``
runs a chunk of steps of the slots still decoding, ``move`` carries a slot (cache row and every per-slot
field) to another slot. Driven by hand here; the scheduling is the engine's (test_engine.py)."""

from __future__ import annotations

import dataclasses
import types

import jax
import numpy as np
import pytest
from flax import nnx

from mage_jax.generate.sampler import Sampler
from mage_jax.generate.slots import CompiledSlotPrograms
from mage_jax.generate.spec import Donor, ModelSpec, SlotPrograms
from mage_jax.generate.step import SamplingParams
from mage_jax.models.config import ModelConfig
from mage_jax.models.transformer import Transformer
from tests.generate.conftest import EOS, PAD, VOCAB, spec_of

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [20, 21, 22, 23, 24]]


@pytest.fixture(scope="module")
def tiny(tiny_model):
    spec = spec_of(tiny_model, (16,))
    programs = CompiledSlotPrograms(spec, slots=4, max_new_tokens=6, chunk=6)
    assert isinstance(programs, SlotPrograms)  # what the engine sees of them
    state = tiny_model[2]
    reference = Sampler(spec, batch_buckets=(4,)).generate(state, PROMPTS, GREEDY, jax.random.key(0))
    return spec, programs, state, reference


def insert(programs, state, slots, prompts, source, targets, donors=None):
    t = len(targets)
    return programs.insert(state, slots, prompts, source, targets, [6] * t, [0] * t,  # accept-all automata
                          np.asarray([[i, 0, 0] for i in range(t)], np.int32), GREEDY, jax.random.key(0),
                          donors)


def response(slots, s):
    n = int(slots.length[s])
    return np.asarray(slots.tokens[s, :n]).tolist()


def test_insert_then_decode_gives_the_lockstep_samplers_greedy_tokens(tiny):
    _, programs, state, reference = tiny
    # Three prompts, the first one twice (prefilled once, copied into two slots).
    slots = insert(programs, state, programs.empty(), PROMPTS, [0, 1, 2, 0], [0, 1, 2, 3])
    assert np.asarray(slots.length).tolist() == [1, 1, 1, 1]  # the first token comes from the prefill
    slots, steps = programs.decode(state, slots, GREEDY, jax.random.key(0))
    assert int(steps) <= 6 and bool(np.asarray(slots.done).all())
    for s, p in enumerate([0, 1, 2, 0]):
        assert response(slots, s) == reference.tokens[p].tolist()
        np.testing.assert_allclose(np.asarray(slots.logprobs[s, :len(reference.logprobs[p])]),
                                   reference.logprobs[p], atol=1e-5)


def test_a_prompt_copied_from_a_donor_slot_decodes_like_a_prefilled_one(tiny):
    _, programs, state, reference = tiny
    slots = insert(programs, state, programs.empty(), [PROMPTS[1]], [0], [2])
    # Slot 2 holds prompt 1 at positions bucket - length .. bucket - 1: slot 0 copies it, no prefill.
    donor = Donor(slot=2, bucket=16, length=len(PROMPTS[1]))
    slots = insert(programs, state, slots, [], [0], [0], donors=[donor])
    slots, _ = programs.decode(state, slots, GREEDY, jax.random.key(0))
    assert response(slots, 0) == response(slots, 2) == reference.tokens[1].tolist()


def test_slot_0_as_a_donor_gives_its_prompt_like_any_other_slot(tiny):
    """The donor index 0 is a slot like the others (the insert marks "no donor" with -1, not 0)."""
    _, programs, state, reference = tiny
    slots = insert(programs, state, programs.empty(), [PROMPTS[2]], [0], [0])
    donor = Donor(slot=0, bucket=16, length=len(PROMPTS[2]))
    slots = insert(programs, state, slots, [], [0, 0], [3, 1], donors=[donor, donor])
    slots, _ = programs.decode(state, slots, GREEDY, jax.random.key(0))
    for s in (0, 1, 3):
        assert response(slots, s) == reference.tokens[2].tolist(), s


def test_engines_of_one_model_with_other_prompt_buckets_do_not_share_programs(tiny, tiny_model):
    """``CompiledSlotPrograms.shared`` gives one instance per model graph and shapes: the prompt buckets set
    the insert's shapes and the cache length, so specs that differ only in them get their own."""
    spec, _, _, _ = tiny
    shape = {"slots": 4, "max_new_tokens": 6, "chunk": 2}
    first = CompiledSlotPrograms.shared(spec, **shape)
    assert CompiledSlotPrograms.shared(spec_of(tiny_model, (16,)), **shape) is first
    other = CompiledSlotPrograms.shared(spec_of(tiny_model, (8, 32)), **shape)
    assert other is not first and other.max_len == 32 + 6 and first.max_len == 16 + 6


def test_a_moved_slot_carries_its_cache_row_and_every_field_and_decodes_on(tiny):
    _, programs, state, reference = tiny
    slots = insert(programs, state, programs.empty(), PROMPTS[:2], [0, 1], [1, 3])
    before = jax.tree.map(np.asarray, slots)
    moved = programs.move(slots, [(3, 0)])
    after = jax.tree.map(np.asarray, moved)
    for name in ("last", "write", "position", "kv_start", "length", "limit", "finished", "auto", "key_path",
                 "tokens", "logprobs", "prompt_hidden", "rule"):
        np.testing.assert_array_equal(getattr(after, name)[0], getattr(before, name)[3], err_msg=name)
    for k_after, k_before in zip(after.cache.k + after.cache.v, before.cache.k + before.cache.v):
        np.testing.assert_array_equal(k_after[0], k_before[3])
    assert bool(after.done[3]) and not bool(after.done[0])  # the source is free, the target runs
    np.testing.assert_array_equal(after.tokens[1], before.tokens[1])  # other slots untouched
    moved, _ = programs.decode(state, moved, GREEDY, jax.random.key(0))
    assert response(moved, 0) == reference.tokens[1].tolist()
    assert response(moved, 1) == reference.tokens[0].tolist()


def test_a_decode_over_a_slot_bucket_leaves_the_other_slots_alone(tiny):
    _, programs, state, reference = tiny
    assert programs.slot_buckets == (1, 4)  # all slots, a quarter
    slots = insert(programs, state, programs.empty(), PROMPTS[:2], [0, 1], [0, 3])
    before = jax.tree.map(np.asarray, slots)
    slots, _ = programs.decode(state, slots, GREEDY, jax.random.key(0), bucket=1)
    assert response(slots, 0) == reference.tokens[0].tolist()
    np.testing.assert_array_equal(np.asarray(slots.tokens[3]), before.tokens[3])  # outside the bucket
    assert int(slots.length[3]) == 1
    with pytest.raises(ValueError, match="slot bucket 3"):
        programs.decode(state, slots, GREEDY, jax.random.key(0), bucket=3)


def test_a_scanned_models_insert_holds_one_layers_prompt_keys_and_values_at_a_time():
    # The prefill hands each layer's keys and values straight to the slots (a KV sink): six more layers
    # add no prompt keys and values to the insert's temporaries. (A prefill into a temporary cache of
    # every layer, copied afterwards, added 1.5 times the slots' cache growth here.) XLA:CPU slices every
    # block's weights out of the stacked parameters up front (0.35 times the cache growth here).
    temp, cache = [], []
    for layers in (2, 8):
        config = ModelConfig.preset("tiny", vocab_size=VOCAB, num_layers=layers, hidden_size=64,
                                    intermediate_size=128, scan_layers=True)
        graphdef, state = nnx.split(nnx.eval_shape(lambda c=config: Transformer(c, rngs=nnx.Rngs(0))))
        spec = ModelSpec(graphdef, config, eos_ids=(EOS,), pad_id=PAD, prompt_buckets=(256,))
        programs = CompiledSlotPrograms(spec, slots=4, max_new_tokens=16, chunk=2)
        insert = programs.lower_insert(state, GREEDY, prompt_len=256).compile()
        temp.append(insert.memory_analysis().temp_size_in_bytes)
        cache.append(sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(programs.abstract_slots().cache)))
    assert temp[1] - temp[0] < (cache[1] - cache[0]) / 2, (temp, cache)


def test_an_insert_prefills_its_distinct_prompts_in_the_smallest_prompt_row_bucket(tiny):
    """One distinct prompt for two slots prefills one prompt row, not ``insert_rows`` (four here), and
    draws what the insert of the whole row bucket draws: the lockstep sampler's greedy tokens."""
    spec, programs, state, reference = tiny
    assert programs.prompt_row_buckets == (1, 2, 4)
    whole = CompiledSlotPrograms(spec, slots=4, max_new_tokens=6, chunk=6)
    whole.prompt_row_buckets = (4,)  # the reference path: every insert prefills insert_rows prompt rows
    sent = []
    for progs in (programs, whole):
        slots = insert(progs, state, progs.empty(), [PROMPTS[1]], [0, 0], [0, 1])
        sent.append(progs.last_insert_bytes[0])
        slots, _ = progs.decode(state, slots, GREEDY, jax.random.key(0))
        for s in (0, 1):
            assert response(slots, s) == reference.tokens[1].tolist()
            np.testing.assert_allclose(np.asarray(slots.logprobs[s, :len(reference.logprobs[1])]),
                                       reference.logprobs[1], atol=1e-5)
    assert sent[1] - sent[0] == 3 * 16 * (4 + 1)  # three fewer rows of 16 int32 tokens and bool flags


def test_bad_inserts_are_one_clear_error(tiny):
    _, programs, state, _ = tiny
    with pytest.raises(ValueError, match="needs a prompt to prefill"):
        insert(programs, state, programs.empty(), [], [0], [0])
    with pytest.raises(ValueError, match="prompts must have"):
        insert(programs, state, programs.empty(), [list(range(4, 21))], [0], [0])
    with pytest.raises(ValueError, match="multiple of the mesh"):
        CompiledSlotPrograms(on_a_mesh(programs.spec), slots=3, max_new_tokens=4, chunk=2)
    four = CompiledSlotPrograms(on_a_mesh(programs.spec), slots=4, max_new_tokens=4, chunk=2)  # 1 / device
    with pytest.raises(ValueError, match="lie on different devices"):  # a donor's cache row stays put
        insert(four, state, None, [], [0], [1], donors=[Donor(slot=0, bucket=16, length=3)])
    with pytest.raises(ValueError, match="at most 2 targets per device block"):  # the engine splits
        two_rows = CompiledSlotPrograms(programs.spec, slots=4, max_new_tokens=4, chunk=2, insert_rows=2)
        insert(two_rows, state, None, PROMPTS, [0, 1, 2], [0, 1, 2])


def on_a_mesh(spec):
    """``spec`` as the slot programs see it on a mesh of 2 x 2 batch ways (they read the axis sizes)."""
    return dataclasses.replace(spec, mesh=types.SimpleNamespace(shape={"data": 2, "fsdp": 2}))
