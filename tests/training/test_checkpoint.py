"""Orbax checkpoints: round trip, keep-last-k, an unfinished save never counts; the JSONL logger."""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mage_jax.logging import MetricsLogger, read_jsonl
from mage_jax.training.checkpoint import Checkpointer, key_from_json, key_to_json
from mage_jax.training.train_step import TrainState


def state(value: float) -> TrainState:
    params = {"w": jnp.full((3, 4), value), "b": jnp.arange(4.0)}
    return TrainState(params=params, opt_state=optax.adamw(1e-3).init(params), step=jnp.int32(int(value)))


def test_round_trip_restores_arrays_structure_and_metadata(tmp_path):
    key = jax.random.key(7)
    with Checkpointer(str(tmp_path / "ckpt"), keep=2) as ckpt:
        ckpt.save(5, state(5.0), {"iteration": 5, "rng": key_to_json(key), "sampler": {"seed": 1}})
    with Checkpointer(str(tmp_path / "ckpt"), keep=2) as ckpt:
        restored, meta = ckpt.restore(state(0.0))
    assert isinstance(restored, TrainState)
    assert jax.tree.structure(restored) == jax.tree.structure(state(0.0))
    np.testing.assert_array_equal(np.asarray(restored.params["w"]), np.full((3, 4), 5.0))
    assert int(restored.step) == 5
    assert meta["iteration"] == 5 and meta["sampler"] == {"seed": 1}
    np.testing.assert_array_equal(jax.random.key_data(key_from_json(meta["rng"])), jax.random.key_data(key))


def test_only_the_last_k_checkpoints_are_kept(tmp_path):
    with Checkpointer(str(tmp_path), keep=2, every=2) as ckpt:
        assert [i for i in range(1, 7) if ckpt.should_save(i)] == [2, 4, 6]
        for i in (2, 4, 6):
            ckpt.save(i, state(float(i)), {"iteration": i})
        assert ckpt.all_steps() == [4, 6]
        assert ckpt.latest_step() == 6


def test_an_unfinished_save_is_ignored_and_the_last_complete_one_restores(tmp_path):
    """Orbax writes a step into '<step>.orbax-checkpoint-tmp-*' and renames it when complete; a run
    killed mid-save leaves such a folder, which must never be taken for a checkpoint."""
    root = tmp_path / "ckpt"
    with Checkpointer(str(root), keep=3) as ckpt:
        ckpt.save(1, state(1.0), {"iteration": 1})
        ckpt.save(2, state(2.0), {"iteration": 2})
    partial = root / "3.orbax-checkpoint-tmp-1234567"
    shutil.copytree(root / "2", partial)
    shutil.rmtree(partial / "state")  # the array data never made it to disk
    with Checkpointer(str(root), keep=3) as ckpt:
        assert ckpt.latest_step() == 2
        restored, meta = ckpt.restore(state(0.0))
    assert meta["iteration"] == 2
    np.testing.assert_array_equal(np.asarray(restored.params["w"]), np.full((3, 4), 2.0))
    assert not partial.exists()  # cleaned up at start


def test_logger_writes_plain_json_and_truncates_on_resume(tmp_path):
    with MetricsLogger(str(tmp_path)) as log:
        for i in range(1, 5):
            log.log(i, {"loss": np.float32(i), "nan": float("nan"), "ok": jnp.asarray(True)})
        log.log(4, {"success@0": 0.5}, split="eval")
    records = read_jsonl(str(tmp_path))
    assert [r["iteration"] for r in records] == [1, 2, 3, 4, 4]
    assert records[0]["loss"] == 1.0 and records[0]["nan"] is None and records[0]["ok"] is True
    with MetricsLogger(str(tmp_path), resume_iteration=2) as log:
        log.log(3, {"loss": 30.0})
    assert [(r["iteration"], r["loss"]) for r in read_jsonl(str(tmp_path))] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    with open(os.path.join(tmp_path, "metrics.jsonl")) as f:
        assert all(json.loads(line) for line in f)
