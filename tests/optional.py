"""Optional test dependencies: one import helper for all of them, and the extra that installs each.

The README's test command installs the ``test`` extra (wheels only, no nightly): OpenSpiel, bm25s, wandb,
gguf and the notebook runner. Two extras are opt-in: ``oracle`` (PyTorch, the oracle of the model tests,
and rlax, the PPO surrogate's) and ``alfworld`` (TextWorld / ALFWorld, which compile C++ and stop at
Python 3.12). Where one is missing, the tests that need it skip, naming the extra. The default CI
environment installs every one, and ``.ci/run`` sets ``MAGE_TESTS_REQUIRE_OPTIONAL=1`` there, so a
missing one fails the tests that need it instead of skipping them silently.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType

import pytest

REQUIRE_VAR = "MAGE_TESTS_REQUIRE_OPTIONAL"

EXTRAS: dict[str, tuple[str, str]] = {
    "torch": ("torch", "oracle"),
    "rlax": ("rlax", "oracle"),
    "textworld": ("textworld", "alfworld"),
    "alfworld": ("alfworld", "alfworld"),
    "pyspiel": ("open_spiel", "test"),
    "bm25s": ("bm25s", "test"),
    "wandb": ("wandb", "test"),
    "gguf": ("gguf", "test"),
    "nbclient": ("nbclient", "test"),
    "nbformat": ("nbformat", "test"),
}
"""Import name -> (distribution, the pyproject.toml extra that installs it), for every optional one."""


def _reason(module: str) -> str:
    _, extra = EXTRAS[module]
    return f"optional test dependency {module!r} is not installed (pip install -e \".[{extra}]\")"


def require(module: str) -> ModuleType:
    """``module`` imported; the calling test skips when it is missing, or fails where every optional
    dependency is required (``MAGE_TESTS_REQUIRE_OPTIONAL=1``)."""
    if module not in EXTRAS:
        raise KeyError(f"{module!r} is not an optional test dependency of tests/optional.py")
    if os.environ.get(REQUIRE_VAR) == "1":
        return importlib.import_module(module)
    return pytest.importorskip(module, reason=_reason(module))


def available(module: str) -> bool:
    """Whether a test may plan on ``module`` (always, where every optional dependency is required: the
    test then fails on its ``require``)."""
    if module not in EXTRAS:
        raise KeyError(f"{module!r} is not an optional test dependency of tests/optional.py")
    return os.environ.get(REQUIRE_VAR) == "1" or importlib.util.find_spec(module) is not None
