"""Runs keep their compiled programs in a persistent cache, on by default: where it is (config key, then
``MAGE_COMPILATION_CACHE``, then the per-user folder), that a run writes it and the next process loads
from it, and that ``off`` writes nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mage_jax import compilation_cache

ROOT = Path(__file__).resolve().parents[1]

# A "run" through the command-line entry point of every experiment (run_cli, which sets the cache up
# from the parsed config), whose body compiles one program and reports the cache hits it saw.
CHILD = """
import json, sys
import jax, jax.numpy as jnp
from jax import monitoring
from experiments import kuhn_poker
from experiments.common import run_cli

hits = []
monitoring.register_event_listener(lambda name, **kw: hits.append(name)
                                   if name == "/jax/compilation_cache/cache_hits" else None)

def run(cfg, options):
    jax.jit(lambda x: jnp.tanh(x @ x.T).sum())(jnp.ones((8, 8))).block_until_ready()
    print(json.dumps({"hits": len(hits), "folder": jax.config.jax_compilation_cache_dir}))
    return 0

sys.exit(run_cli(sys.argv[1:], run, experiment="kuhn_poker", presets=kuhn_poker.SPEC.presets,
                 default_preset=kuhn_poker.SPEC.default_preset))
"""


def _process(tmp_path: Path, *args: str, env: dict[str, str], prefix: tuple[str, ...] = ()
             ) -> subprocess.CompletedProcess:
    child_env = {k: v for k, v in os.environ.items()
                 if k != compilation_cache.ENV_VAR and (not k.startswith("JAX_") or k == "JAX_PLATFORMS")}
    # (not the suite's cache; the platform kept: with libtpu installed JAX would first try a TPU)
    child_env.update(XDG_CACHE_HOME=str(tmp_path / "xdg"), **env)
    return subprocess.run([*prefix, sys.executable, "-c", CHILD, "--run-dir", str(tmp_path / "run"), *args],
                          cwd=ROOT, env=child_env, capture_output=True, text=True, timeout=300)


def _run(tmp_path: Path, *args: str, env: dict[str, str]) -> dict:
    done = _process(tmp_path, *args, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file()] if folder.exists() else []


def test_a_run_writes_the_per_user_cache_by_default_and_the_next_process_loads_from_it(tmp_path):
    default = tmp_path / "xdg" / "mage-jax" / "jax"
    first = _run(tmp_path, env={})
    assert first == {"hits": 0, "folder": str(default)} and _files(default)
    second = _run(tmp_path, env={})
    assert second["hits"] >= 1  # the program came from the cache, not from the compiler


def test_the_environment_variable_moves_the_cache_and_the_config_key_wins_over_it(tmp_path):
    moved, keyed = tmp_path / "moved", tmp_path / "keyed"
    assert _run(tmp_path, env={"MAGE_COMPILATION_CACHE": str(moved)})["folder"] == str(moved)
    assert _files(moved)
    out = _run(tmp_path, "--compile.cache_dir", str(keyed), env={"MAGE_COMPILATION_CACHE": str(moved)})
    assert out["folder"] == str(keyed) and _files(keyed)


@pytest.mark.parametrize("how", ["variable", "key"])
def test_off_writes_nothing_anywhere(tmp_path, how):
    args, env = ((), {"MAGE_COMPILATION_CACHE": "off"}) if how == "variable" else (
        ("--compile.cache_dir", "off"), {})
    out = _run(tmp_path, *args, env={**env, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax-own")})
    assert out == {"hits": 0, "folder": None}
    assert _files(tmp_path) == []  # neither the per-user folder nor the one JAX was given


def test_resolution_order(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(compilation_cache.ENV_VAR, raising=False)
    assert compilation_cache.default_dir() == str(tmp_path / "mage-jax" / "jax")
    monkeypatch.setenv(compilation_cache.ENV_VAR, "~/elsewhere")
    assert compilation_cache.resolve(None) == os.path.expanduser("~/elsewhere")
    assert compilation_cache.resolve(str(tmp_path / "k")) == str(tmp_path / "k")
    assert compilation_cache.resolve("OFF") is None


def _without_root_override() -> tuple[str, ...]:
    """A command prefix under which a read-only folder is read-only: nothing for a normal user; for root
    (who writes anywhere) ``setpriv`` without the capabilities that override file permissions."""
    if os.geteuid() != 0:
        return ()
    return ("setpriv", "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search")


@pytest.mark.parametrize("problem", ["a file", "under a file", "in a read-only folder"])
def test_a_cache_folder_that_cannot_be_used_is_one_warning_and_the_run_compiles_without_it(tmp_path, problem):
    """The cache only saves time: a folder that cannot hold it is one warning line (not a traceback, not
    one JAX warning per program), and the run goes on without the cache and exits 0."""
    prefix: tuple[str, ...] = ()
    if problem == "a file":
        folder = tmp_path / "cache"
        folder.write_text("not a folder")
    elif problem == "under a file":
        (tmp_path / "file").write_text("not a folder")
        folder = tmp_path / "file" / "cache"
    else:
        locked = tmp_path / "locked"
        locked.mkdir()
        folder = locked / "cache"
        folder.mkdir()
        (tmp_path / "run").mkdir()
        os.chmod(folder, 0o555)
        prefix = _without_root_override()
    done = _process(tmp_path, "--compile.cache_dir", str(folder), env={}, prefix=prefix)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"hits": 0, "folder": None}
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(
        f"warning: the compilation cache {str(folder)!r} cannot be used ("), done.stderr
    assert "compiling without it" in lines[0]
