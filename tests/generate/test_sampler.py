"""Specification of mage_jax.generate.sampler, the lockstep program: jitted generation that matches the
training forward and Hugging Face greedy decoding, compiles once per bucket, honours limits, and obeys
token automata."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mage_jax.generate.constraints import (
    TokenAutomaton,
    automaton_from_completions,
    constraint_masks,
    stack_automata,
)
from mage_jax.generate.sampler import Sampler
from mage_jax.generate.spec import ModelSpec
from mage_jax.generate.step import SamplingParams
from mage_jax.models.transformer import positions_from_mask
from mage_jax.testing import random_causal_lm
from tests.generate.conftest import EOS, PAD, VOCAB, spec_of
from tests.optional import require
from tests.xla_env import fake_devices_env

MAX_NEW = 8
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [20, 21, 22, 23, 24]]


@pytest.fixture(scope="module")
def tiny(tiny_model):
    """The shared random model and one sampler for the tests, so compiled programs are reused."""
    _, graphdef, state = tiny_model
    return nnx.merge(graphdef, state), state, Sampler(spec_of(tiny_model, (8, 16)), batch_buckets=(2, 4))


@functools.partial(jax.jit, static_argnums=0)
def _forward_logp(graphdef, state, seq):
    model = nnx.merge(graphdef, state)
    mask = jnp.ones_like(seq, bool)
    hidden, _ = model(seq, positions_from_mask(mask), mask)
    return model.logits(hidden)[0]


def forward_logprobs(model, prompt, response, allowed=None):
    """log p(response | prompt) per token from one uncached forward over prompt + response."""
    graphdef, state = nnx.split(model)
    seq = list(prompt) + list(response)
    padded = np.asarray([seq + [PAD] * (32 - len(seq))], np.int32)  # one shape: one compile
    logits = np.asarray(_forward_logp(graphdef, state, padded))[len(prompt) - 1 : len(seq) - 1]
    if allowed is not None:
        logits = np.where(np.asarray(allowed), logits, -np.inf)
    logp = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))
    return logp[np.arange(len(response)), np.asarray(response)]


# ------------------------------------------------------------------------------ log-probs and limits
def test_sampled_logprobs_equal_the_training_forward_at_temperature_one(tiny):
    model, state, sampler = tiny
    out = sampler.generate(state, PROMPTS, SamplingParams(max_new_tokens=MAX_NEW), jax.random.key(0))
    assert len(out.tokens) == len(PROMPTS) and out.prompt_bucket == 16 and out.batch_buckets == (4,)
    for prompt, tokens, logprobs, finished in zip(PROMPTS, out.tokens, out.logprobs, out.finished):
        assert 1 <= len(tokens) <= MAX_NEW and len(logprobs) == len(tokens)
        assert finished == (tokens[-1] == EOS) and (EOS not in tokens[:-1])
        np.testing.assert_allclose(logprobs, forward_logprobs(model, prompt, tokens), atol=2e-5)


def test_logprobs_ignore_temperature_and_describe_the_temperature_one_distribution(tiny):
    model, state, sampler = tiny
    out = sampler.generate(
        state, PROMPTS, SamplingParams(temperature=3.0, max_new_tokens=MAX_NEW), jax.random.key(1)
    )
    for prompt, tokens, logprobs in zip(PROMPTS, out.tokens, out.logprobs):
        np.testing.assert_allclose(logprobs, forward_logprobs(model, prompt, tokens), atol=2e-5)


def test_rows_stop_at_their_own_token_limits(tiny):
    _, state, sampler = tiny
    limits = [0, 2, MAX_NEW + 5]
    out = sampler.generate(
        state,
        PROMPTS,
        SamplingParams(max_new_tokens=MAX_NEW),
        jax.random.key(2),
        max_new_tokens_per_row=limits,
    )
    assert len(out.tokens[0]) == 0 and not out.finished[0]
    assert 1 <= len(out.tokens[1]) <= 2 and len(out.tokens[2]) <= MAX_NEW  # capped at max_new_tokens
    assert out.finished[1] == (out.tokens[1][-1] == EOS)


def test_same_rng_same_tokens_and_different_rng_different_tokens(tiny):
    _, state, sampler = tiny
    params = SamplingParams(max_new_tokens=MAX_NEW)
    a = sampler.generate(state, PROMPTS, params, jax.random.key(7))
    b = sampler.generate(state, PROMPTS, params, jax.random.key(7))
    c = sampler.generate(state, PROMPTS, params, jax.random.key(8))
    assert all(np.array_equal(x, y) for x, y in zip(a.tokens, b.tokens))
    assert not all(np.array_equal(x, y) for x, y in zip(a.tokens, c.tokens))


# ------------------------------------------------------------------------------------ compile counts
def test_same_bucket_compiles_once_and_a_new_bucket_once_more(tiny):
    _, state, sampler = tiny
    params = SamplingParams(max_new_tokens=MAX_NEW)
    first = sampler.generate(state, PROMPTS, params, jax.random.key(3)).compile_count
    # Same buckets (prompt 16, batch 4), other lengths, temperature, top-p value and limits: no compile.
    again = sampler.generate(
        state,
        [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [9], [4, 4]],
        SamplingParams(temperature=0.5, max_new_tokens=MAX_NEW),
        jax.random.key(4),
        max_new_tokens_per_row=[1, 2, 3],
    )
    assert again.compile_count == first
    short = sampler.generate(state, [[5, 6], [7, 8, 9]], params, jax.random.key(5))  # prompt 8, batch 2
    assert short.compile_count == first + 1 and short.prompt_bucket == 8 and short.batch_buckets == (2,)
    assert sampler.generate(state, [[5, 6], [7]], params, jax.random.key(6)).compile_count == first + 1


def test_a_batch_larger_than_the_largest_bucket_runs_in_chunks_in_order(tiny):
    model, state, sampler = tiny
    prompts = [[5 + i, 6 + i, 7] for i in range(6)]
    out = sampler.generate(state, prompts, SamplingParams(max_new_tokens=MAX_NEW), jax.random.key(0))
    assert out.batch_buckets == (4, 2) and len(out.tokens) == len(out.finished) == 6
    for prompt, tokens, logprobs in zip(prompts, out.tokens, out.logprobs):  # each row answers its prompt
        np.testing.assert_allclose(logprobs, forward_logprobs(model, prompt, tokens), atol=2e-5)


# -------------------------------------------------------------------------------------- bad input
def test_a_prompt_longer_than_the_largest_bucket_is_one_clear_error(tiny):
    _, state, sampler = tiny
    with pytest.raises(ValueError, match=r"prompt 1 has 17 tokens.*largest prompt bucket \(16\)"):
        sampler.generate(
            state, [[1, 2], list(range(1, 18))], SamplingParams(max_new_tokens=MAX_NEW), jax.random.key(0)
        )


def test_empty_prompts_and_out_of_vocabulary_ids_are_clear_errors(tiny):
    _, state, sampler = tiny
    params = SamplingParams(max_new_tokens=MAX_NEW)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        sampler.generate(state, [[]], params, jax.random.key(0))
    with pytest.raises(ValueError, match="token ids must be in"):
        sampler.generate(state, [[VOCAB + 1]], params, jax.random.key(0))
    assert sampler.generate(state, [], params, jax.random.key(0)).tokens == []


# ------------------------------------------------------------------------------ constrained decoding
def test_constrained_generation_only_produces_allowed_completions(tiny):
    model, state, sampler = tiny
    completions = [[30, 31], [32], [30, 33, 34]]
    automaton = automaton_from_completions(completions, VOCAB, EOS)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[0]]
    out = sampler.generate(
        state,
        prompts,
        SamplingParams(max_new_tokens=MAX_NEW),
        jax.random.key(9),
        constraints=[automaton, automaton, None, automaton],
    )
    allowed = {tuple(c) + (EOS,) for c in completions}
    for row in (0, 1, 3):
        assert tuple(out.tokens[row].tolist()) in allowed and out.finished[row]
    # The trainer's replay gives the masks the sampler drew with: log-probs agree under them.
    transitions = stack_automata([automaton, automaton, None, automaton], VOCAB)
    for row, (prompt, tokens) in enumerate(zip(prompts, out.tokens)):
        masks = constraint_masks(transitions[row : row + 1], np.asarray([tokens], np.int32))[0]
        expected = forward_logprobs(model, prompt, tokens, allowed=masks)
        np.testing.assert_allclose(out.logprobs[row], expected, atol=2e-5)
    many = sampler.generate(
        state,
        [PROMPTS[1]] * 4,
        SamplingParams(max_new_tokens=MAX_NEW),
        jax.random.key(10),
        constraints=automaton,
    )
    assert all(tuple(t.tolist()) in allowed for t in many.tokens)


def test_automata_must_match_the_model_vocabulary(tiny):
    _, state, sampler = tiny
    with pytest.raises(ValueError, match="vocabulary"):
        sampler.generate(
            state,
            [[5]],
            SamplingParams(max_new_tokens=MAX_NEW),
            jax.random.key(0),
            constraints=TokenAutomaton.accept_all(VOCAB + 1),
        )


# ------------------------------------------------------------------------------ Hugging Face parity
def build_hf_checkpoint(arch: str, folder):
    hf_config = dict(
        model_type=arch,
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=arch == "qwen3",
    )
    require("torch")
    return random_causal_lm(hf_config, folder, weight_std=0.2)


def hf_greedy(model, prompts, max_new: int):
    """HF generate on a left-padded batch; responses cut after the first EOS."""
    torch = require("torch")

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=EOS,
            pad_token_id=PAD,
        )
    responses = []
    for row in out[:, width:].numpy():
        row = row.tolist()
        responses.append(row[: row.index(EOS) + 1] if EOS in row else row)
    return responses


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_greedy_generation_matches_hugging_face_generate(arch, tmp_path):
    from mage_jax.models.hf_loading import load_hf_params

    hf_model = build_hf_checkpoint(arch, tmp_path)
    config, graphdef, state = load_hf_params(tmp_path)
    sampler = Sampler(ModelSpec(graphdef, config, eos_ids=(EOS,), pad_id=PAD, prompt_buckets=(16,)),
                      batch_buckets=(4,))
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [40, 41, 42], [17, 18, 19, 20, 21]]
    out = sampler.generate(state, prompts, SamplingParams(greedy=True, max_new_tokens=32), jax.random.key(0))
    expected = hf_greedy(hf_model, prompts, 32)
    assert [t.tolist() for t in out.tokens] == expected
    assert max(len(t) for t in expected) > 8  # the comparison covers long continuations
    assert out.finished.tolist() == [r[-1] == EOS for r in expected]


# ------------------------------------------------------------------------------------------ sharding
_MESH_SCRIPT = """
import json, jax, numpy as np
from flax import nnx
from mage_jax.models.config import ModelConfig
from mage_jax.models.sharding import MeshConfig, make_mesh
from mage_jax.models.transformer import Transformer
from mage_jax.generate.sampler import Sampler
from mage_jax.generate.spec import ModelSpec
from mage_jax.generate.step import SamplingParams
config = ModelConfig.preset("tiny", vocab_size=64, num_layers=1, hidden_size=64, intermediate_size=128)
graphdef, state = nnx.split(Transformer(config, rngs=nnx.Rngs(0)))
prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
params = SamplingParams(greedy=True, max_new_tokens=6)
out = {}
meshes = (("single", None), ("fsdp", make_mesh(MeshConfig(data=1, fsdp=2, tensor=1))),
          ("tensor", make_mesh(MeshConfig(data=1, fsdp=1, tensor=2))))
for name, mesh in meshes:
    spec = ModelSpec(graphdef, config, eos_ids=(3,), pad_id=0, prompt_buckets=(8,), mesh=mesh)
    result = Sampler(spec, batch_buckets=(4,)).generate(state, prompts, params, jax.random.key(0))
    out[name] = [t.tolist() for t in result.tokens]
    if mesh is not None:  # placed by the partition rules for generation: the fsdp split gathered
        leaves = jax.tree.leaves(spec.place_state(state))
        out[name + "_split_leaves"] = sum(any(axis is not None for axis in x.sharding.spec) for x in leaves)
print(json.dumps(out))
"""


def test_generation_on_a_two_device_mesh_matches_a_single_device():
    import json
    import subprocess
    import sys

    env = fake_devices_env(2)
    proc = subprocess.run(
        [sys.executable, "-c", _MESH_SCRIPT], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["fsdp_split_leaves"] == 0  # generation reads the parameters gathered once, not per step
    assert out["tensor_split_leaves"] > 0  # a tensor split stays
    assert out["fsdp"] == out["tensor"] == out["single"]
