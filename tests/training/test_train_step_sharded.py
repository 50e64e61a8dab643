"""The update on an 8-device (2 x 2 x 2) CPU mesh gives the single-device result, also over micro-batches
with one of padding rows only (skipped under a ``lax.cond``), and for a mini-batch whose rows do not divide
the mesh's batch axes (6 rows over 4 ways: replicated, as 16 rows on a 64-chip slice); run in a
subprocess: the fake device count must be set before JAX starts."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from tests.xla_env import fake_devices_env

SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np, optax
    from mage_jax.models import sharding as shd
    from mage_jax.models.config import ModelConfig
    from mage_jax.algorithms.schedules import learning_rate_schedule
    from mage_jax.training.train_step import StepConfig, TrainBatch, TrainStep, make_optimizer

    assert len(jax.devices()) == 8
    cfg = ModelConfig.preset("tiny", vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1,
                             num_heads=2, num_kv_heads=2, head_dim=8)
    T = 10
    for R, micro_rows in ((8, 4), (6, 3)):  # rows that divide the 4 batch ways, rows that do not
        rng = np.random.default_rng(0)
        tokens = rng.integers(1, 32, (R, T)).astype(np.int32)
        batch = {"tokens": tokens, "positions": np.tile(np.arange(T, dtype=np.int32), (R, 1)),
                 "token_mask": np.ones((R, T), bool), "targets": np.roll(tokens, -1, 1),
                 "response_mask": np.arange(T)[None].repeat(R, 0) >= 6,
                 "prompt_lengths": np.full(R, 7, np.int32),
                 "advantages": rng.normal(size=R).astype(np.float32)}
        batch["response_mask"][1::2] = False  # padding: of the micro-batches (rows j, j + 2, ...), one
        results = []
        for shape, devices, micro in (((1, 1, 1), jax.devices()[:1], 0), ((2, 2, 2), jax.devices(), 0),
                                      ((2, 2, 2), jax.devices(), micro_rows)):
            mesh = shd.make_mesh(shd.MeshConfig(*shape), devices)
            _, params = shd.init_sharded(cfg, mesh, seed=0)
            graphdef = shd.init_sharded(cfg, mesh, seed=0)[0]
            schedule = learning_rate_schedule(1e-2)
            tx = make_optimizer(schedule, b1=0.9, b2=0.999, weight_decay=0.0, grad_clip=1.0)
            step = TrainStep(graphdef, tx, schedule, StepConfig(chunk_size=4, micro_batch_rows=micro), mesh)
            state = step.init_state(params)
            b = dict(batch)
            logprobs = step.compute_logprobs(state.params, step.place_batch(TrainBatch(**b)))
            b["old_logprobs"] = np.asarray(logprobs)
            for _ in range(2):
                state, metrics = step.update(state, step.place_batch(TrainBatch(**b)))
            leaf = state.params["layers"][0]["attn"]["q_proj"]["kernel"]
            leaf = leaf.value if hasattr(leaf, "value") else leaf
            devices_used = len(leaf.sharding.device_set)
            results.append((float(metrics["loss"]), np.asarray(jax.device_get(leaf)), devices_used,
                            b["old_logprobs"], logprobs.sharding.spec))
        (l1, w1, _, p1, _), *sharded = results
        for l8, w8, n8, p8, spec in sharded:
            assert n8 > 1, "the sharded parameters should live on several devices"
            # The log-probs are placed like the rows: split over the batch axes when they divide them.
            lead = (*spec, None)[0]
            assert lead == (shd.BATCH_AXES if R % 4 == 0 else None), spec
            np.testing.assert_allclose(p1, p8, rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(l1, l8, rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(w1, w8, rtol=1e-4, atol=1e-5)
    print("OK")
""")


def test_update_on_a_2x2x2_mesh_matches_one_device():
    env = fake_devices_env(8)
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]
