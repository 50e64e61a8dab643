"""A model named as on the Hugging Face Hub (``Qwen/Qwen3-4B``) resolved to a local folder.

Runs read weights from a local folder (``hf_loading``). A Hub name is looked up in the local Hugging
Face cache (``HF_HUB_CACHE`` / ``HF_HOME``, where ``hf download`` and ``transformers`` put
models); only when the environment allows it (``HF_HUB_OFFLINE`` unset) does ``huggingface_hub``
fetch what the cache lacks. A name that is neither a folder nor found is one ``ConfigError``.
"""

from __future__ import annotations

import os
import re

from mage_jax.configtools import ConfigError

HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
"""``owner/name``, the shape of a Hub model id."""

MODEL_FILES = ["config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
               "tokenizer*", "vocab.json", "merges.txt", "special_tokens_map.json", "*.jinja"]
"""What a run reads from a model folder: downloading a name fetches only these."""


def _offline() -> bool:
    from huggingface_hub import constants

    flags = (os.environ.get("HF_HUB_OFFLINE"), os.environ.get("TRANSFORMERS_OFFLINE"))
    return constants.HF_HUB_OFFLINE or any((v or "").strip().upper() in ("1", "ON", "YES", "TRUE")
                                           for v in flags)


def resolve_model_path(path: str) -> str:
    """``path`` itself when it is a folder (or not shaped like a Hub name: the caller's folder checks
    report it), else the local snapshot folder of the Hub model ``path``."""
    if os.path.isdir(path) or not HUB_NAME.match(path):
        return path
    from huggingface_hub import snapshot_download

    offline = _offline()
    cache = os.environ.get("HF_HUB_CACHE") or None  # read now: huggingface_hub reads it once, at import
    try:
        return snapshot_download(path, allow_patterns=MODEL_FILES, cache_dir=cache, local_files_only=offline)
    except Exception as err:  # not cached, offline, no network, unknown or gated repository
        where = cache or "the Hugging Face cache"
        how = ("HF_HUB_OFFLINE is set, so nothing is downloaded" if offline
               else f"fetching it failed ({type(err).__name__})")
        raise ConfigError(
            f"model path {path!r} is neither a local folder nor a model in {where} ({how}); download it "
            f"first (hf download {path} --local-dir DIR) and pass --model-path DIR") from None
