"""XLA settings of the test suite and of the processes the tests start.

The suite's programs are tiny and each runs for milliseconds, so compiling them is what the suite's
time goes into. ``tests/conftest.py`` therefore appends ``MAGE_TEST_XLA_FLAGS`` to ``XLA_FLAGS`` before
anything starts XLA: by default ``--xla_backend_optimization_level=0``, which skips LLVM's optimisation
of the generated CPU code (the HLO passes, fusion and buffer assignment still run, and matrix products
still call the same library kernels). On 2 cores it cuts compile-bound test files by about 40 %.
``MAGE_TEST_XLA_FLAGS=""`` compiles as a user's run does. Child processes inherit the flags; the ones
with fake devices add theirs with ``fake_devices_env``; the pretrained notebook's kernel, which runs a
135M-parameter model for minutes, drops them (``without_suite_flags``).
"""

from __future__ import annotations

import os

XLA_FLAGS_VAR = "MAGE_TEST_XLA_FLAGS"
DEFAULT_FLAGS = "--xla_backend_optimization_level=0"


def suite_flags() -> str:
    """The flags the suite adds to ``XLA_FLAGS`` (``MAGE_TEST_XLA_FLAGS``, default ``DEFAULT_FLAGS``)."""
    return os.environ.get(XLA_FLAGS_VAR, DEFAULT_FLAGS)


def with_flags(flags: str, base: str | None = None) -> str:
    """``base`` (default: this process's ``XLA_FLAGS``) with ``flags`` appended."""
    base = os.environ.get("XLA_FLAGS", "") if base is None else base
    return f"{base} {flags}".strip()


def without_suite_flags() -> str:
    """This process's ``XLA_FLAGS`` without the suite's own: for a child that runs a real model, whose
    elementwise work LLVM's optimisation speeds up more than compiling costs."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    for flag in suite_flags().split():
        if flag in flags:
            flags.remove(flag)
    return " ".join(flags)


def fake_devices_env(count: int, **extra: str) -> dict[str, str]:
    """This process's environment for a child JAX process with ``count`` fake CPU devices (and the suite's
    flags, inherited through ``XLA_FLAGS``)."""
    return {**os.environ, "XLA_FLAGS": with_flags(f"--xla_force_host_platform_device_count={count}"),
            "JAX_PLATFORMS": "cpu", **extra}
