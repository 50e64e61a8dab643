"""ModelConfig: presets, Hugging Face config.json import/export and refusal of unsupported options."""

from __future__ import annotations

import dataclasses
import json

import jax
import pytest

from mage_jax.models.config import ModelConfig, ModelName

QWEN3_0_6B_CONFIG_JSON = {  # the published Qwen/Qwen3-0.6B config.json (transformers 4.x layout)
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
    "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}


@pytest.mark.parametrize(
    ("name", "hidden", "intermediate", "layers", "heads", "tied", "billions"),
    [("qwen3-0.6b", 1024, 3072, 28, 16, True, 0.6), ("qwen3-1.7b", 2048, 6144, 28, 16, True, 1.7),
     ("qwen3-4b", 2560, 9728, 36, 32, True, 4.0), ("qwen3-8b", 4096, 12288, 36, 32, False, 8.2)],
)
def test_qwen3_presets_carry_the_published_hyperparameters(
    name, hidden, intermediate, layers, heads, tied, billions
):
    c = ModelConfig.preset(name)
    assert (c.hidden_size, c.intermediate_size, c.num_layers) == (hidden, intermediate, layers)
    assert c.num_heads == heads
    assert (c.num_kv_heads, c.head_dim, c.vocab_size, c.rope_theta) == (8, 128, 151936, 1e6)
    assert c.tie_word_embeddings is tied and c.qk_norm and not c.qkv_bias and c.architecture == "qwen3"
    assert abs(c.num_params() / 1e9 - billions) / billions < 0.1


def test_published_qwen3_config_json_maps_onto_the_preset():
    imported = ModelConfig.from_hf_config(QWEN3_0_6B_CONFIG_JSON)
    assert imported == ModelConfig.preset("qwen3-0.6b", param_dtype="float32", dtype="float32")


def test_tiny_preset_is_a_small_qwen3_whose_vocabulary_the_caller_sets():
    tiny = ModelConfig.preset("tiny", vocab_size=321)
    assert tiny.architecture == "qwen3" and tiny.vocab_size == 321 and tiny.num_params() < 2_000_000
    assert dataclasses.replace(tiny, vocab_size=7).vocab_size == 7


def test_config_is_hashable_so_it_can_be_a_static_jit_argument():
    llama = ModelConfig.from_hf_config({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    })
    assert hash(llama) == hash(dataclasses.replace(llama))
    assert jax.jit(lambda x, c: x * c.num_layers, static_argnums=1)(2, llama) == 2


@pytest.mark.parametrize("name", ["tiny", "qwen3-8b"])
def test_hf_config_export_round_trips(name):
    config = ModelConfig.preset(name, vocab_size=1000)
    # dtypes and the layer layout are this project's choices, not fields of an HF config
    assert ModelConfig.from_hf_config(config.to_hf_config(), param_dtype=config.param_dtype,
                                      dtype=config.dtype, scan_layers=config.scan_layers) == config


def test_llama_and_qwen2_switches_follow_the_architecture():
    base = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 1}
    qwen2 = ModelConfig.from_hf_config({**base, "architectures": ["Qwen2ForCausalLM"]})
    assert qwen2.qkv_bias and not qwen2.qk_norm and qwen2.head_dim == 4
    llama = ModelConfig.from_hf_config({**base, "model_type": "llama",
                                        "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}})
    assert not llama.qkv_bias and not llama.qk_norm and llama.rope_theta == 5e5 and llama.rope_scaling is None
    assert not llama.tie_word_embeddings


@pytest.mark.parametrize(
    ("change", "message"),
    [({"architectures": ["Qwen3MoeForCausalLM"]}, "unsupported architecture 'Qwen3MoeForCausalLM'"),
     ({"use_sliding_window": True}, "sliding-window"),
     ({"layer_types": ["sliding_attention"]}, "only full attention"),
     ({"num_experts": 8}, "mixture-of-experts"),
     ({"attention_bias": True}, "attention_bias"),
     ({"hidden_act": "gelu"}, "hidden_act"),
     ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported RoPE scaling type 'yarn'"),
     ({"num_key_value_heads": 3}, "not a multiple of num_kv_heads")],
)
def test_unsupported_options_raise_one_clear_error(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_config({**QWEN3_0_6B_CONFIG_JSON, **change})


def test_bad_field_values_and_unknown_presets_are_refused():
    with pytest.raises(ValueError, match="unknown model preset 'qwen9'"):
        ModelConfig.preset("qwen9")
    with pytest.raises(ValueError, match="param_dtype='int8'"):
        ModelConfig.preset("tiny", param_dtype="int8")
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        ModelConfig.preset("tiny", architecture="gpt2")
    with pytest.raises(ValueError, match="missing 'vocab_size'"):
        ModelConfig.from_hf_config({"architectures": ["Qwen3ForCausalLM"], "hidden_size": 8,
                                    "num_attention_heads": 2})


def test_a_folder_names_its_model_by_its_own_name_and_family(tmp_path):
    folder = tmp_path / "smollm2-135m-instruct"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert ModelName.of_folder(folder) == ModelName("smollm2-135m-instruct", "llama")
    assert str(ModelName.of_folder(folder)) == "smollm2-135m-instruct (llama)"
    hub = {"model_type": "qwen3", "_name_or_path": "Qwen/Qwen3-0.6B"}
    (folder / "config.json").write_text(json.dumps(hub))
    assert ModelName.of_folder(folder) == ModelName("Qwen3-0.6B", "qwen3")
    assert ModelName.of_preset("qwen3-0.6b") == ModelName("qwen3-0.6b", "qwen3")
