"""Checkpoints written and restored by two JAX processes (4 CPU devices each, one array sharded over
all 8): per-process checksums, and a newest step damaged in the data only process 1 reads falls back
to the same older step on both processes, moved aside once, without a deadlock."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tests._multiprocess import run_processes

CODE = """
import json, os
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from mage_jax.models.sharding import initialize_from_environment
from mage_jax.training.checkpoint import Checkpointer, state_digests

initialize_from_environment()

ROOT, PHASE = {root!r}, {phase!r}
mesh = Mesh(np.array(jax.devices()), ("x",))

def state(v):
    w = np.arange(4096 * 64, dtype=np.float32).reshape(4096, 64) + v  # rows split over the 8 devices
    b = np.arange(4, dtype=np.float32) + v  # replicated
    return {{"w": jax.make_array_from_callback(w.shape, NamedSharding(mesh, P("x")), lambda i: w[i]),
            "b": jax.make_array_from_callback(b.shape, NamedSharding(mesh, P()), lambda i: b[i])}}

def report(restored, meta, ckpt):
    intact = state_digests(restored) == state_digests(state(float(meta["iteration"])))
    print("RESULT " + json.dumps({{"iteration": meta["iteration"], "intact": intact,
                                  "steps": ckpt.all_steps()}}), flush=True)

with Checkpointer(ROOT, keep=3) as ckpt:
    if PHASE == "save":
        ckpt.save(1, state(1.0), {{"iteration": 1}})
        ckpt.save(2, state(2.0), {{"iteration": 2}})
    else:
        restored, meta = ckpt.restore(state(0.0))
        report(restored, meta, ckpt)
        ckpt.save(2, state(2.0), {{"iteration": 2}})  # the resumed run saves the damaged step again
        restored, meta = ckpt.restore(state(0.0))
        report(restored, meta, ckpt)
"""


def results(run):
    lines = run.stdout.splitlines()
    return [json.loads(line.split(" ", 1)[1]) for line in lines if line.startswith("RESULT ")]


def process_1_data(step_dir):
    """The largest data file written by process 1 (its shards of ``w``; process 0 never reads it)."""
    folder = step_dir / "state" / "ocdbt.process_1" / "d"
    return max((folder / name for name in os.listdir(folder)), key=os.path.getsize)


def flip_bytes(path):
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 64] = bytes(b ^ 0xFF for b in data[mid:mid + 64])
    path.write_bytes(data)


def truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Steps 1 and 2 saved by two processes; each array's checksum lists both processes' digests."""
    root = tmp_path_factory.mktemp("multihost") / "ckpt"
    run_processes(CODE.format(root=str(root), phase="save"), n=2, devices_per_process=4, timeout=150)
    checksums = json.loads((root / "2" / "checksums" / "metadata").read_text())["arrays"]
    assert len(checksums["['w']"]) == 2 and checksums["['w']"][0] != checksums["['w']"][1]
    assert checksums["['b']"][0] == checksums["['b']"][1]  # replicated: the same bytes on both
    return root


@pytest.mark.parametrize("damage, reason_on_1", [
    (flip_bytes, "array ['w'] does not match its checksum, on process 1"),
    (truncate, "unreadable: "),
])
def test_damage_seen_by_one_process_falls_back_identically_on_both(saved, tmp_path, damage, reason_on_1):
    root = tmp_path / "ckpt"
    shutil.copytree(saved, root)
    damage(process_1_data(root / "2"))
    code = CODE.format(root=str(root), phase="restore")
    runs = run_processes(code, n=2, devices_per_process=4, timeout=150)
    for run in runs:
        # step 1 restored intact on both; then step 2 saved again and restored
        assert results(run) == [{"iteration": 1, "intact": True, "steps": [1]},
                                {"iteration": 2, "intact": True, "steps": [1, 2]}], run.stderr[-2000:]
    warnings = [[line for line in run.stderr.splitlines() if line.startswith("warning:")] for run in runs]
    assert [len(w) for w in warnings] == [1, 1]
    assert "step 2 (damaged as another process reads it)" in warnings[0][0]
    assert reason_on_1 in warnings[1][0] and warnings[1][0].endswith("restored step 1")
    assert sorted(os.listdir(root)) == ["1", "2", "2.damaged"]  # renamed once, by process 0
