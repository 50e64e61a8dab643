"""``python -m experiments.plan --compiler target``: the presets' programs compiled by the TPU's and the
GPU's own compilers on a CPU-only machine, from the devices of a TPU topology or a GPU target
description (``experiments.targets``).

The TPU tests need the ``libtpu`` wheel (``pip install "jax[tpu]"``) and skip without it: the default
environment has not got it; ``.ci/run``'s current environment installs it (pinned in
``.ci/constraints-current.txt``) and fails them if it is missing (``MAGE_TESTS_REQUIRE_TPU=1``). The
GPU test needs the CUDA plugin and its libraries (several GB) and runs only with ``MAGE_TARGET_GPU=1``
(docs/scaling.md has the smallest package set and a recorded run: 133 CPU-seconds, 215 s wall at load
average 9).

CI runs ``tiny``'s two TPU tests (a v5p-8, and a 64-chip v5p:4x4x4 slice with fewer rows than
devices): about 2 minutes of CPU together (136 s wall, 132 s user, load average 4.6-6.0 on 2 cores).
``small``'s and ``paper``'s run only with ``MAGE_TARGET_TPU_PRESETS=1``: even reduced, ``small``'s plan
took over 7 minutes of CPU (stopped there, load average 4-5), too much for the CI budget; run them
before changing attention, sharding or the training programs.

``small`` and ``paper`` are compiled at 1 and 2 layers and extrapolated (``--layers 1 2``), with rows
of 1,024 prompt + 512 response tokens (``REDUCED``; the presets' own 4,096 + 1,024 and 4,096 + 8,192 are
what ``docs/scaling.md`` records): their training programs scan their blocks and cost the same to
compile at any depth, but generation runs the blocks one after another and its programs compile in time
growing with depth, and the TPU compiler takes minutes of CPU per program at the full lengths. What
failed before (splash outside ``shard_map`` with ``small``'s 1-row micro-batches on 4 chips, device work
while building the engine), the kernels, the sharding and the micro-batches do not depend on the depth
or the lengths.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from experiments import plan, targets

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REQUIRE_TPU = "MAGE_TESTS_REQUIRE_TPU"
"""Set where the TPU compiler must be installed (``.ci/run``'s current environment): a missing one fails
the TPU tests instead of skipping them."""
TPU = pytest.mark.skipif(not targets.compiler_installed("tpu") and os.environ.get(REQUIRE_TPU) != "1",
                         reason='the TPU compiler is not installed (pip install "jax[tpu]")')
GPU = pytest.mark.skipif(os.environ.get("MAGE_TARGET_GPU") != "1" or not targets.compiler_installed("gpu"),
                         reason="set MAGE_TARGET_GPU=1 with the CUDA plugin installed (docs/scaling.md)")
PRESETS = pytest.mark.skipif(os.environ.get("MAGE_TARGET_TPU_PRESETS") != "1",
                             reason="set MAGE_TARGET_TPU_PRESETS=1: minutes of CPU per preset")
REDUCED = ("--layers", "1", "2", "--set", "rollout.max_prompt_tokens=1024", "--set",
           "rollout.max_response_tokens=512")
SPLASH = ("tpu_custom_call:splash_mha_fwd", "tpu_custom_call:splash_mha_dq", "tpu_custom_call:splash_mha_dkv")


def _plan(*args: str, timeout: float = 1500) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop(plan.CHILD_ENV, None)
    proc = subprocess.run([sys.executable, "-m", "experiments.plan", "--compiler", "target", "--json", *args],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def _has(program: dict, prefix: str) -> bool:
    return any(k.startswith(prefix) for k in program["kernels"])


def _check_keys(out: dict) -> None:
    for p in out["plans"]:
        assert set(p["compiler"]) == {"platform", "target", "version"} and p["compiler"]["platform"] != "cpu"
        for q in p["programs"].values():
            assert {"kernels", "flops", "bytes_accessed", "argument", "temp", "peak", "need"} <= set(q)
            assert q["bytes_accessed"] > 0
    for v in out["verdicts"]:
        assert set(v["roofline_seconds"]) == set(out["plans"][0]["programs"])
        assert v["iteration_seconds"] > 0 and set(v["goals"]) == set(plan.GOALS)


@TPU
def test_the_tiny_preset_compiles_for_a_tpu_v5p_8_with_splash_in_the_prefill():
    out = _plan("--env", "kuhn_poker", "--preset", "tiny", "--hardware", "tpu-v5p")
    _check_keys(out)
    (p,) = out["plans"]
    assert p["devices"] == 4 and p["compiler"]["target"] == "v5p:2x2x1"
    assert set(p["programs"]) == set(plan.PROGRAMS)
    assert _has(p["programs"]["insert"], "tpu_custom_call:splash_mha_fwd")  # 512-token prompts
    assert [(v["hardware"], v["compiler"], v["fits"]) for v in out["verdicts"]] == [("tpu-v5p", "tpu", True)]


@TPU
@PRESETS
@pytest.mark.parametrize("preset", ["small", "paper"])
def test_a_pretrained_preset_trains_with_splash_under_shard_map_on_a_v5p_8_and_fits(preset):
    # ``small``'s one-row micro-batches do not divide over the 4 chips: its gradient program failed to
    # compile ("Mosaic kernels cannot be automatically partitioned") until splash ran under shard_map
    # whatever the rows per device.
    out = _plan("--env", "kuhn_poker", "--preset", preset, "--hardware", "tpu-v5p", *REDUCED)
    _check_keys(out)
    (p,) = out["plans"]
    grads = p["programs"]["train_grads"]
    assert all(_has(grads, k) for k in SPLASH), grads["kernels"]  # forward and both backward kernels
    assert _has(p["programs"]["logprobs"], "tpu_custom_call:splash_mha_fwd")
    (v,) = out["verdicts"]
    assert v["fits"], v


@TPU
def test_any_topology_by_name_multi_host_included_whatever_the_rows_per_device():
    # A 64-chip, 16-host v5p slice: tiny's 16-row mini-batch does not divide over its 64 devices, so the
    # training and log-prob programs take their rows replicated (the log-prob program's output was fixed
    # to the batch sharding and failed to lower); the engine's 64 slots divide and stay split.
    out = _plan("--env", "kuhn_poker", "--preset", "tiny", "--topology", "v5p:4x4x4")
    _check_keys(out)
    (p,) = out["plans"]
    assert p["devices"] == 64 and p["hardware"] == ["tpu-v5p:4x4x4"]
    assert p["compiler"]["target"] == "v5p:4x4x4"
    assert set(p["programs"]) == set(plan.PROGRAMS)
    assert p["programs"]["logprobs"]["rows"] == p["programs"]["train_grads"]["rows"] == 16
    assert out["verdicts"][0]["fits"]


@GPU
def test_the_gpu_targets_compile_with_cudnn_flash_attention_where_the_gpu_has_it():
    out = _plan("--env", "kuhn_poker", "--preset", "tiny", "--hardware", "h100-80gb", "--hardware", "t4-16gb",
                "--set", "model.dtype=bfloat16")
    _check_keys(out)
    h100, t4 = out["plans"]
    assert h100["devices"] == 8 and h100["compiler"]["platform"] == "gpu"
    grads = h100["programs"]["train_grads"]
    assert _has(grads, "__cudnn$fmhaSoftmax") and _has(grads, "__cudnn$fmhaSoftmaxBackward"), grads["kernels"]
    for q in t4["programs"].values():  # a T4 (compute capability 7.5) has no cuDNN flash attention
        assert not _has(q, "__cudnn$fmha"), q["kernels"]
    assert all(v["fits"] for v in out["verdicts"])
