"""The suite's XLA flags (tests/xla_env.py) reach this process and the processes the tests start."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.xla_env import (
    DEFAULT_FLAGS,
    XLA_FLAGS_VAR,
    fake_devices_env,
    suite_flags,
    with_flags,
    without_suite_flags,
)


def test_the_suite_flags_are_in_xla_flags_before_xla_starts():
    assert suite_flags() == os.environ.get(XLA_FLAGS_VAR, DEFAULT_FLAGS)
    assert os.environ["XLA_FLAGS"].endswith(suite_flags())


def test_a_child_with_fake_devices_keeps_the_suite_flags_and_sees_its_devices():
    env = fake_devices_env(3)
    assert env["XLA_FLAGS"] == with_flags("--xla_force_host_platform_device_count=3")
    assert suite_flags() in env["XLA_FLAGS"]
    code = "import jax, os; print(len(jax.devices()), os.environ['XLA_FLAGS'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    count, flags = out.stdout.strip().split(" ", 1)
    assert count == "3" and suite_flags() in flags  # XLA accepted every flag (an unknown one is fatal)


def test_a_real_model_child_gets_the_flags_without_the_suites(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", f"--xla_cpu_multi_thread_eigen=false {DEFAULT_FLAGS}")
    monkeypatch.setenv(XLA_FLAGS_VAR, DEFAULT_FLAGS)
    assert without_suite_flags() == "--xla_cpu_multi_thread_eigen=false"
