"""JAX's persistent compilation cache, on by default for runs.

Compiling is a large part of a run's start (tens of XLA programs, seconds each on a CPU, and more for a
deep model); every process compiles them again unless the executables are kept on disk. With the cache
a second run of the same shapes loads them instead. One folder per user, outside any run directory,
since the programs depend only on the shapes, the model and the JAX version, never on a run's data.

Where: the config key ``compile.cache_dir`` if set, else the environment variable
``MAGE_COMPILATION_CACHE``, else a folder JAX was already given (``JAX_COMPILATION_CACHE_DIR``),
else ``$XDG_CACHE_HOME/mage-jax/jax`` (``~/.cache/mage-jax/jax``). ``off`` (key or variable) turns it off.

A folder that cannot be used (the path is a file, a parent is a file, no write permission) costs
only speed: one ``warning:`` line names it and the reason, and the run compiles without the cache. (JAX
would otherwise raise, or warn once for every program it fails to write.)
"""

from __future__ import annotations

import os
import sys
import tempfile

import jax

ENV_VAR = "MAGE_COMPILATION_CACHE"
OFF = "off"


def default_dir() -> str:
    """The per-user folder: ``$XDG_CACHE_HOME/mage-jax/jax``, or ``~/.cache/mage-jax/jax``."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "mage-jax", "jax")


def resolve(setting: str | None) -> str | None:
    """The cache folder for the config value ``setting`` (None: not set), or None when it is off."""
    for value in (setting, os.environ.get(ENV_VAR)):
        if value:
            return None if value.strip().lower() == OFF else os.path.abspath(os.path.expanduser(value))
    return jax.config.jax_compilation_cache_dir or default_dir()


def unusable(folder: str) -> str | None:
    """Why ``folder`` cannot hold the cache (None: it can): it is created when missing and a file is
    written in it and removed, as JAX will."""
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".mage-write-check-"):
            pass
    except OSError as err:
        return err.strerror or type(err).__name__
    return None


def enable(setting: str | None) -> str | None:
    """Point JAX's persistent cache at ``resolve(setting)`` (caching every program, however quick to
    compile: on a CPU most take well under JAX's default one-second threshold) and return the folder;
    when the cache is off, or its folder cannot be used (one ``warning:`` line), turn JAX's off too (also
    one named by ``JAX_COMPILATION_CACHE_DIR``) and return None. Call it before the first compile."""
    from jax.experimental.compilation_cache import compilation_cache

    folder = resolve(setting)
    if folder is not None:
        problem = unusable(folder)
        if problem is not None:
            print(f"warning: the compilation cache {folder!r} cannot be used ({problem}); compiling without "
                  f"it (set compile.cache_dir or {ENV_VAR} to a writable folder, or 'off')", file=sys.stderr)
            folder = None
    if folder is not None:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update("jax_compilation_cache_dir", folder)
    compilation_cache.reset_cache()  # a cache JAX set up earlier in this process would keep the old folder
    return folder
