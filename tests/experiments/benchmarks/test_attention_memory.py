"""The ``paper`` Kuhn Poker preset's programs compiled ahead of time on 8 fake CPU devices (abstract
parameters, fsdp mesh, the preset's blockwise attention, full remat and the train step's micro-batches):
per-device peak bytes, extrapolated from 3 and 4 layers to all 36 (peak(36) = peak(4) + 32 x
(peak(4) - peak(3))), stay under an H100's 80 GB at the preset's longest rows.

Run in a subprocess: the fake devices and XLA:CPU's memory-minimising schedule must be set before
JAX starts. See ``experiments.benchmarks.attention_memory`` for the full before/after table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

SCRIPT = textwrap.dedent("""
    import json, sys
    from experiments import plan
    from experiments.benchmarks import attention_memory as am
    plan.force_cpu_devices(8)
    out = []
    for program, length, prompt, rows in json.loads(sys.argv[1]):
        r = am.program_memory(program, [3, 4], length=length, rows=rows, attention="blockwise", remat=None,
                              prompt=prompt)
        out.append(r)
    print("RESULT " + json.dumps(out))
""")

# (program, tokens per row, prompt tokens, rows): the sampler at the paper's 16 x 8 rollout rows with
# 4096 prompt + 8192 new tokens; the train step's gradients for the preset's 64-row mini-batch at the
# longest bucket, 12288 tokens, accumulated over the preset's 8-row micro-batches (without them it
# needs ~161 GB per device: docs/attention.md).
PROGRAMS = [
    ("sampler", 12288, 4096, 128),
    ("train_grads", 12288, 0, 64),
]


@pytest.mark.slow
@pytest.mark.parametrize("program", PROGRAMS, ids=[p[0] for p in PROGRAMS])
def test_paper_preset_programs_fit_an_h100_per_device(program):
    """One program per test (together they took 220 s on a loaded machine)."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps([program])], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert [r["program"] for r in results] == [program[0]]
    for r in results:
        assert r["devices"] == 8 and r["rows_per_device"] == r["rows"] // 8
        assert r["attention"] == "blockwise" and r["remat"] == "full"
        assert r["micro_batch_rows"] == (8 if r["program"] == "train_grads" else 0)
        per_layer = r["per_layer"]["peak"]
        peak = r["measured"]["4"]["peak"] + (r["full_depth"] - 4) * per_layer
        assert peak < 80e9, f"{r['program']} at T={r['length']}: {peak / 1e9:.1f} GB per device"
