"""Static shapes of the generation programs: buckets, powers of two, left-padded prompt blocks.

A jitted program compiles once per input shape, so every size that varies at run time (a prompt's
length, a batch's rows, the requests of an insert, the states of an automaton) is rounded up to a
*bucket* from a short list; the programs then compile a bounded number of times.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def bucket(n: int, buckets: Sequence[int]) -> int:
    """The smallest of the ascending ``buckets`` that holds ``n`` (the largest when none does)."""
    for b in buckets:
        if b >= n:
            return b
    return buckets[-1]


def pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (``n`` >= 1)."""
    return 1 << (n - 1).bit_length()


def pow2_buckets(limit: int) -> tuple[int, ...]:
    """1, 2, 4, ... below ``limit``, then ``limit`` itself."""
    out, b = [], 1
    while b < limit:
        out.append(b)
        b *= 2
    return (*out, limit)


def sorted_buckets(buckets: Sequence[int], name: str) -> tuple[int, ...]:
    """``buckets`` ascending without repeats; one clear error unless they are positive integers."""
    out = tuple(sorted({int(b) for b in buckets}))
    if not out or out[0] <= 0:
        raise ValueError(f"{name} must be non-empty positive integers, got {tuple(buckets)!r}")
    return out


def left_padded(prompts: Sequence[Sequence[int]], rows: int, length: int, *, pad_id: int,
                vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, valid) int32 / bool [rows, length]: each prompt right-aligned (left padding, so every
    row's next token is at the same column); rows past ``len(prompts)`` are all padding."""
    tokens = np.full((rows, length), pad_id, np.int32)
    valid = np.zeros((rows, length), bool)
    for row, prompt in enumerate(prompts):
        ids = np.asarray(prompt, np.int64)
        if ids.min() < 0 or ids.max() >= vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
        tokens[row, length - len(ids):] = ids
        valid[row, length - len(ids):] = True
    return tokens, valid
