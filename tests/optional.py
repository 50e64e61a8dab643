"""Optional test dependencies (torch as the PyTorch oracle, OpenSpiel, TextWorld / ALFWorld, bm25s,
wandb, the notebook runner): one import helper for all of them.

The default CI environment installs every one (``pip install -e ".[test]"``), and ``.ci/run`` sets
``MAGE_TESTS_REQUIRE_OPTIONAL=1`` there, so a missing one fails the tests that need it instead of
skipping them silently. Elsewhere (the current-stack CI environment has no torch, a user's
``test-core`` install) the tests that need a missing one skip, and the rest run.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType

import pytest

REQUIRE_VAR = "MAGE_TESTS_REQUIRE_OPTIONAL"


def require(module: str) -> ModuleType:
    """``module`` imported; the calling test skips when it is missing, or fails where every optional
    dependency is required (``MAGE_TESTS_REQUIRE_OPTIONAL=1``)."""
    if os.environ.get(REQUIRE_VAR) == "1":
        return importlib.import_module(module)
    return pytest.importorskip(module, reason=f"optional test dependency {module!r} is not installed")


def available(module: str) -> bool:
    """Whether a test may plan on ``module`` (always, where every optional dependency is required: the
    test then fails on its ``require``)."""
    return os.environ.get(REQUIRE_VAR) == "1" or importlib.util.find_spec(module) is not None
