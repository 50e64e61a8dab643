"""Keys derived on the host are exactly JAX's keys, and deriving them compiles nothing."""

import jax
import numpy as np
import pytest

from mage_jax import compile_report, host_random


def words(key) -> np.ndarray:
    return np.asarray(jax.random.key_data(key))


@pytest.mark.parametrize("seed", [0, 1, 7, 12345, 2**31 - 1, -1, -5])
def test_keys_equal_jax_random(seed):
    base = jax.random.key(seed)
    np.testing.assert_array_equal(words(host_random.key(seed)), words(base))
    for data in (0, 1, 2, 7919, 0x5A11D, 2**31 - 1):
        np.testing.assert_array_equal(words(host_random.fold_in(base, data)),
                                      words(jax.random.fold_in(base, data)))
    for num in (1, 2, 3, 5):
        got = np.stack([words(k) for k in host_random.split(base, num)])
        np.testing.assert_array_equal(got, words(jax.random.split(base, num)))


def test_deriving_keys_compiles_nothing():
    counter = compile_report.counter()
    before = counter.snapshot()
    key = host_random.fold_in(host_random.key(3), 11)
    first, second = host_random.split(key)
    host_random.fold_in(second, 4)
    assert (counter.snapshot() - before).programs == 0

