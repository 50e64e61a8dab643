"""Specification of mage_jax.generate.shapes: the buckets that bound how often a program compiles."""

import numpy as np
import pytest

from mage_jax.generate.shapes import bucket, left_padded, pow2, pow2_buckets, sorted_buckets


def test_a_size_goes_to_the_smallest_bucket_that_holds_it_and_past_them_to_the_largest():
    buckets = (8, 16, 64)
    assert [bucket(n, buckets) for n in (1, 8, 9, 16, 17, 64, 65)] == [8, 8, 16, 16, 64, 64, 64]


def test_powers_of_two():
    assert [pow2(n) for n in (1, 2, 3, 4, 5, 17)] == [1, 2, 4, 4, 8, 32]
    assert pow2_buckets(1) == (1,) and pow2_buckets(8) == (1, 2, 4, 8)
    assert pow2_buckets(12) == (1, 2, 4, 8, 12)


def test_buckets_are_sorted_without_repeats_and_positive():
    assert sorted_buckets([64, 8, 8, 16], "b") == (8, 16, 64)
    with pytest.raises(ValueError, match="prompt_buckets must be non-empty positive"):
        sorted_buckets([0, 8], "prompt_buckets")
    with pytest.raises(ValueError, match="non-empty"):
        sorted_buckets([], "b")


def test_prompts_are_right_aligned_behind_left_padding():
    tokens, valid = left_padded([[5, 6], [7]], 3, 4, pad_id=0, vocab_size=10)
    assert tokens.tolist() == [[0, 0, 5, 6], [0, 0, 0, 7], [0, 0, 0, 0]]
    assert valid.tolist() == [[False, False, True, True], [False, False, False, True], [False] * 4]
    assert tokens.dtype == np.int32
    with pytest.raises(ValueError, match=r"\[0, 10\)"):
        left_padded([[5, 10]], 1, 4, pad_id=0, vocab_size=10)
