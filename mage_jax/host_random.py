"""JAX's default random keys (threefry2x32, partitionable) derived on the host with numpy.

``jax.random.key``, ``fold_in`` and ``split`` are each an XLA program of their own, compiled on first use
in every process: five of a run's programs (the seed, the fold-in, the split and the conversions around
them) did nothing but derive a handful of keys per iteration. These functions give the very same keys
(``tests/test_host_random.py`` checks them against ``jax.random``) from numpy arithmetic, and wrap the two
words as a typed key with ``jax.random.wrap_key_data``, which compiles nothing. Only the default
implementation (``jax_default_prng_impl=threefry2x32`` with ``jax_threefry_partitionable``) is
reproduced; under any other the functions fall back to ``jax.random``.
"""

from __future__ import annotations

import jax
import numpy as np

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = np.uint32(0x1BD11BDA)


def _rotate_left(x: np.ndarray, r: int) -> np.ndarray:
    return (x << np.uint32(r)) | (x >> np.uint32(32 - r))


def threefry2x32(k0: np.uint32, k1: np.uint32, x0: np.ndarray,
                 x1: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The Threefry-2x32 block cipher (20 rounds) of counters ``(x0, x1)`` under key ``(k0, k1)``."""
    ks = (np.uint32(k0), np.uint32(k1), np.uint32(k0) ^ np.uint32(k1) ^ _PARITY)
    x = [np.asarray(x0, np.uint32) + ks[0], np.asarray(x1, np.uint32) + ks[1]]
    with np.errstate(over="ignore"):
        for block in range(5):
            for r in _ROTATIONS[block % 2]:
                x[0] = x[0] + x[1]
                x[1] = _rotate_left(x[1], r) ^ x[0]
            x[0] = x[0] + ks[(block + 1) % 3]
            x[1] = x[1] + ks[(block + 2) % 3] + np.uint32(block + 1)
    return x[0], x[1]


def _default_impl() -> bool:
    return (str(jax.config.jax_default_prng_impl) == "threefry2x32"
            and bool(jax.config.jax_threefry_partitionable))


def _wrap(words: np.ndarray) -> jax.Array:
    return jax.random.wrap_key_data(np.asarray(words, np.uint32))


def _words(key: jax.Array) -> np.ndarray:
    return np.asarray(jax.random.key_data(key), np.uint32)


def key(seed: int) -> jax.Array:
    """``jax.random.key(seed)`` for a 32-bit integer seed."""
    seed = int(seed)
    if not _default_impl() or not -(2**31) <= seed < 2**32:
        return jax.random.key(seed)
    return _wrap(np.array([0, seed & 0xFFFFFFFF], np.uint32))


def fold_in(key: jax.Array, data: int) -> jax.Array:
    """``jax.random.fold_in(key, data)`` for one (unbatched) key."""
    if not _default_impl() or np.shape(key) != ():
        return jax.random.fold_in(key, data)
    k = _words(key)
    y0, y1 = threefry2x32(k[0], k[1], np.zeros(1, np.uint32), np.array([int(data) & 0xFFFFFFFF], np.uint32))
    return _wrap(np.array([y0[0], y1[0]], np.uint32))


def split(key: jax.Array, num: int = 2) -> list[jax.Array]:
    """The keys of ``jax.random.split(key, num)`` for one (unbatched) key, as a list of ``num`` keys
    (indexing a key array would compile a program per index)."""
    if not _default_impl() or np.shape(key) != ():
        keys = jax.random.split(key, num)
        return [keys[i] for i in range(num)]
    k = _words(key)
    y0, y1 = threefry2x32(k[0], k[1], np.zeros(num, np.uint32), np.arange(num, dtype=np.uint32))
    return [_wrap(np.array([a, b], np.uint32)) for a, b in zip(y0, y1, strict=True)]
