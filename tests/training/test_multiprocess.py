"""The multi-host path on one machine: two JAX processes (CPU backend, a local coordinator, 4 fake
devices each) build the global 8-device mesh and train one iteration of the tiny Kuhn Poker preset;
the result is the one process with 8 devices gets (``tests/training/multiprocess_iteration.py``)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from tests._multiprocess import Group, run_groups

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multiprocess_iteration.py")
COMPARED = ("loss", "policy_loss", "entropy", "grad_norm", "approx_kl", "clip_fraction", "response_tokens",
            "rows", "reward_mean", "advantage_abs_mean", "success@last", "payoff@last", "skipped", "updates")


def _results(procs) -> list[dict]:
    out = []
    for p in procs:
        assert p.returncode == 0, p.stderr[-4000:]
        out.append(json.loads(p.stdout.split("RESULT ", 1)[1]))
    return out


@pytest.mark.slow
def test_two_processes_train_like_one_process_with_eight_devices(tmp_path):
    # The reference and the two-process run start together (three interpreters, not one after the other).
    reference, group = run_groups([Group(SCRIPT, n=1, devices_per_process=8, args=(str(tmp_path / "one"),)),
                                   Group(SCRIPT, n=2, devices_per_process=4, args=(str(tmp_path / "two"),))],
                                  timeout=1800)  # both runs together: the two 900 s limits they had apart
    (one,), two = _results(reference), _results(group)
    assert (one["processes"], one["devices"]) == (1, 8)
    assert [(r["process"], r["processes"], r["devices"]) for r in two] == [(0, 2, 8), (1, 2, 8)]
    assert one["metrics"]["advantage_abs_mean"] > 0 and one["metrics"]["grad_norm"] > 0  # a real update
    for r in two:
        for name in COMPARED:
            assert r["metrics"][name] == pytest.approx(one["metrics"][name], rel=1e-5, abs=1e-7), name
        assert r["params"].keys() == one["params"].keys()
        for path, sums in one["params"].items():
            np.testing.assert_allclose(r["params"][path], sums, rtol=1e-5, atol=1e-6, err_msg=path)
    # Process 0 alone writes the logs; both wrote their shards of the checkpoint.
    with open(tmp_path / "two" / "metrics.jsonl") as f:
        assert len(f.readlines()) == 1
    assert (tmp_path / "two" / "checkpoints" / "1").is_dir()
