"""Orbax checkpoints: round trip, keep-last-k, an unfinished save never counts; the JSONL logger."""

from __future__ import annotations

import gc
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from mage_jax.config import ConfigError
from mage_jax.logging import MetricsLogger, read_jsonl
from mage_jax.training.checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointMismatch,
    key_from_json,
    key_to_json,
)
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


def test_a_logger_kept_open_for_a_resume_is_rewound_to_the_checkpoint(tmp_path):
    """The trainer opens its logger before it knows where its checkpoint is (``keep_existing``), then
    rewinds it: records after the checkpoint go, and those of the final evaluation too when it reruns."""
    with MetricsLogger(str(tmp_path)) as log:
        for i in (1, 2, 3):
            log.log(i, {"loss": float(i)})
        log.log(2, {"success@0": 0.5}, split="eval")
    with MetricsLogger(str(tmp_path), keep_existing=True) as log:
        assert len(read_jsonl(str(tmp_path))) == 4  # nothing is dropped before the rewind
        log.rewind(2, keep_evaluations=False)
        log.log(3, {"loss": 30.0})
    assert [(r["split"], r["iteration"]) for r in read_jsonl(str(tmp_path))] == [
        ("train", 1), ("train", 2), ("train", 3)]
    assert read_jsonl(str(tmp_path))[-1]["loss"] == 30.0


# -- integrity: a damaged newest step falls back to the newest intact one ------------------------------


def big_state(value: float) -> TrainState:
    """A state with a parameter large enough to fill its own data file (the one the damage hits)."""
    rng = np.random.default_rng(int(value))
    params = {"w": jnp.asarray(rng.standard_normal((64, 256)), jnp.float32) + value, "b": jnp.arange(4.0)}
    return TrainState(params=params, opt_state=optax.adamw(1e-3).init(params), step=jnp.int32(int(value)))


def largest_file(step_dir) -> str:
    files = [os.path.join(d, f) for d, _, fs in os.walk(step_dir / "state") for f in fs]
    return max(files, key=os.path.getsize)


def truncate(step_dir) -> None:
    path = largest_file(step_dir)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def flip_bytes(step_dir) -> None:
    """64 bytes inverted in the middle of the parameter data (the issue's silent-corruption case)."""
    path = largest_file(step_dir)
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        mid = len(data) // 2
        data[mid:mid + 64] = bytes(b ^ 0xFF for b in data[mid:mid + 64])
        f.seek(0)
        f.write(data)


def delete_file(step_dir) -> None:
    os.remove(largest_file(step_dir))


def edit_meta_iteration(step_dir) -> None:
    path = step_dir / "meta" / "metadata"
    meta = json.loads(path.read_text())
    meta["iteration"] += 1
    path.write_text(json.dumps(meta))


def save_two_steps(root) -> None:
    with Checkpointer(str(root), keep=3) as ckpt:
        ckpt.save(4, big_state(4.0), {"iteration": 4, "note": "older"})
        ckpt.save(6, big_state(6.0), {"iteration": 6, "note": "newest"})


def delete_manifest(step_dir) -> None:
    """Every array becomes unreadable at once (orbax then leaves its reads behind half-done)."""
    os.remove(step_dir / "state" / "manifest.ocdbt")


def delete_checksums(step_dir) -> None:
    shutil.rmtree(step_dir / "checksums")


DAMAGE = {"truncate": truncate, "flip_bytes": flip_bytes, "delete_file": delete_file,
          "edit_meta_iteration": edit_meta_iteration, "delete_manifest": delete_manifest,
          "delete_checksums": delete_checksums}


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_newest_step_falls_back_to_the_older_one_with_one_warning(tmp_path, capsys, damage):
    root = tmp_path / "ckpt"
    save_two_steps(root)
    DAMAGE[damage](root / "6")
    capsys.readouterr()
    with Checkpointer(str(root), keep=3) as ckpt:
        restored, meta = ckpt.restore(big_state(0.0))
        assert ckpt.latest_step() == 4  # the damaged step is moved aside: the run can save step 6 again
        assert ckpt.save(6, big_state(6.0), {"iteration": 6})
    expected = big_state(4.0)
    assert meta == {"iteration": 4, "note": "older"}
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    gc.collect()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err  # no orbax traceback, now or at a later garbage collection
    assert err[0].startswith("warning: skipped damaged checkpoint step 6 (")
    assert err[0].endswith("restored step 4")
    assert (root / "6.damaged").is_dir()


def test_flipped_parameter_values_are_caught_by_the_array_checksum(tmp_path):
    """Bytes changed so that every file still parses: only the per-array checksum can notice."""
    root = tmp_path / "ckpt"
    with Checkpointer(str(root), keep=3) as ckpt:
        ckpt.save(4, big_state(4.0), {"iteration": 4})
        ckpt.save(6, big_state(6.0), {"iteration": 6})
    path = root / "6" / "checksums" / "metadata"
    sums = json.loads(path.read_text())
    sums["arrays"][".params['w']"] = "0" * 8  # as if the stored values no longer matched
    path.write_text(json.dumps(sums))
    damaged = r"step 6 .*array \.params\['w'\] does not match its checksum"
    with Checkpointer(str(root), keep=3) as ckpt, pytest.raises(CheckpointError, match=damaged):
        ckpt.restore(big_state(0.0), step=6)


def test_every_step_damaged_is_one_clear_error(tmp_path):
    root = tmp_path / "ckpt"
    save_two_steps(root)
    flip_bytes(root / "6")
    edit_meta_iteration(root / "4")
    with Checkpointer(str(root), keep=3) as ckpt, pytest.raises(CheckpointError) as info:
        ckpt.restore(big_state(0.0))
    message = str(info.value)
    assert "\n" not in message and "no intact checkpoint" in message
    assert "step 6" in message and "step 4 (meta does not match its checksum)" in message
    assert isinstance(info.value, ConfigError)  # the command lines print it as one error: line
    assert (root / "6").is_dir() and (root / "4").is_dir()  # nothing is moved when nothing restores


def test_restoring_a_missing_step_is_one_clear_error(tmp_path):
    root = tmp_path / "ckpt"
    save_two_steps(root)
    missing = "no checkpoint of step 5"
    with Checkpointer(str(root), keep=3) as ckpt, pytest.raises(CheckpointError, match=missing):
        ckpt.restore(big_state(0.0), step=5)


def test_a_state_of_other_shapes_is_a_config_mismatch_not_damage(tmp_path):
    """Resuming with a config that changes shapes or dtypes names the first difference and moves nothing."""
    root = tmp_path / "ckpt"
    save_two_steps(root)
    wider = big_state(0.0)
    wider.params["b"] = jnp.arange(5.0)
    with Checkpointer(str(root), keep=3) as ckpt, pytest.raises(CheckpointMismatch) as info:
        ckpt.restore(wider)
    message = str(info.value)
    assert "step 6" in message and ".params['b'] is [4] float32 there but [5] float32 here" in message
    assert isinstance(info.value, ConfigError) and "\n" not in message
    half = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x, big_state(0.0))
    with Checkpointer(str(root), keep=3) as ckpt, pytest.raises(CheckpointMismatch, match="float32 there"):
        ckpt.restore(half)
    assert sorted(os.listdir(root)) == ["4", "6"]


def test_a_directory_written_before_checksums_restores_unverified_with_one_warning(tmp_path, capsys):
    """Runs started by an earlier version (state + meta, no checksums in any step) still resume."""
    import orbax.checkpoint as ocp

    root = tmp_path / "ckpt"
    options = ocp.CheckpointManagerOptions(max_to_keep=3, create=True, enable_async_checkpointing=False)
    with ocp.CheckpointManager(str(root), options=options, item_names=("state", "meta")) as legacy:
        legacy.save(4, args=ocp.args.Composite(state=ocp.args.StandardSave(big_state(4.0)),
                                                meta=ocp.args.JsonSave({"iteration": 4})))
        legacy.wait_until_finished()
    capsys.readouterr()
    with Checkpointer(str(root), keep=3) as ckpt:
        restored, meta = ckpt.restore(big_state(0.0))
        ckpt.save(5, big_state(5.0), {"iteration": 5})  # new steps carry checksums
        ckpt.save(6, big_state(6.0), {"iteration": 6})
    assert meta == {"iteration": 4}
    np.testing.assert_array_equal(np.asarray(restored.params["w"]), np.asarray(big_state(4.0).params["w"]))
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"warning: checkpoint step 4 in {root} predates checksums; restored it unverified"]
    shutil.rmtree(root / "6" / "checksums")  # beside steps with them: damage, not an old format
    with Checkpointer(str(root), keep=3) as ckpt:
        _, meta = ckpt.restore(big_state(0.0))
    assert meta == {"iteration": 5}
    assert "skipped damaged checkpoint step 6 (its checksums are missing" in capsys.readouterr().err


def test_a_scanned_models_stacked_state_round_trips_and_the_other_layout_says_how_to_resume(tmp_path):
    import dataclasses

    from flax import nnx

    from mage_jax.models.config import ModelConfig
    from mage_jax.models.transformer import Transformer

    def model_state(scan: bool, seed: int) -> TrainState:
        config = ModelConfig.preset("tiny", vocab_size=16, hidden_size=16, intermediate_size=32, num_layers=2,
                                    num_heads=2, num_kv_heads=1, head_dim=8)
        params = nnx.state(Transformer(dataclasses.replace(config, scan_layers=scan), rngs=nnx.Rngs(seed)))
        return TrainState(params=params, opt_state=optax.adamw(1e-3).init(params), step=jnp.int32(seed))

    saved = model_state(True, 1)
    with Checkpointer(str(tmp_path / "scanned"), keep=1) as ckpt:
        ckpt.save(1, saved, {"iteration": 1})
    with Checkpointer(str(tmp_path / "scanned"), keep=1) as ckpt:
        restored, _ = ckpt.restore(model_state(True, 0))
    assert restored.params["layers"]["attn"]["q_proj"]["kernel"].shape == (2, 16, 16)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(saved)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with Checkpointer(str(tmp_path / "scanned"), keep=1) as ckpt, pytest.raises(CheckpointMismatch) as info:
        ckpt.restore(model_state(False, 0))
    hint = "(its decoder blocks are scanned, this run's are unrolled: ModelConfig.scan_layers differs"
    assert hint in str(info.value) and "\n" not in str(info.value)
    assert "add --model.overrides.scan_layers true to the command)" in str(info.value)  # the saved layout
    # A run saved before its preset scanned (unrolled) resumes in a scanned run's place with the other flag.
    with Checkpointer(str(tmp_path / "unrolled"), keep=1) as ckpt:
        ckpt.save(1, model_state(False, 1), {"iteration": 1})
    with Checkpointer(str(tmp_path / "unrolled"), keep=1) as ckpt, pytest.raises(CheckpointMismatch) as info:
        ckpt.restore(model_state(True, 0))
    assert "blocks are unrolled, this run's are scanned" in str(info.value)
    assert "add --model.overrides.scan_layers false to the command)" in str(info.value)
