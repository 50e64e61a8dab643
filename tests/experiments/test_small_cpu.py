"""The ``small-cpu`` recipe on a real pretrained model, SmolLM2-135M-Instruct (the ``smollm2_folder``
fixture), through the public entry points: a constrained zero-shot evaluation (``experiments.evaluate``),
one LoRA training iteration (``experiments.kuhn_poker``) and its export (``experiments.export``) reloaded
with the trained model's logits.

The lengths are cut further than the recipe's (two episodes, 640-token prompts in two buckets, two engine
slots, 8-token reflections) and the evaluation and the training share every rollout program through the
compilation cache, so the three tests cost a few 30-layer compiles.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from flax import nnx

from experiments import evaluate, export, kuhn_poker
from mage_jax import config as C
from mage_jax.models import lora
from mage_jax.models.hf_loading import load_hf_model, load_hf_params
from mage_jax.training.assemble import build_parts, checkpoint_dir
from tests.models.conftest import jax_logits

SHORT = {
    "rollout.num_episodes": 2,
    "train.eval_num_episodes": 2,
    "rollout.max_prompt_tokens": 640,
    "rollout.length_buckets": [512],
    "rollout.max_response_tokens": 16,
    "rollout.max_reflection_tokens": 8,
    "rollout.engine_slots": 2,
    "train.eval_meta_episodes": 2,
    "logging.progress": False,
    "logging.plots": False,
}
"""The recipe at test size; the same sampler shapes in every test of this file."""

PROMPT = "You hold the King. Your opponent bet. Do you call or fold?"


def _sets(overrides: dict) -> list[str]:
    """``--set KEY=VALUE`` arguments (values as JSON)."""
    return [a for key, value in overrides.items() for a in ("--set", f"{key}={json.dumps(value)}")]


def _summary(run_dir) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_a_zero_shot_evaluation_plays_only_valid_actions(smollm2_folder, compilation_cache, tmp_path, capsys):
    out = tmp_path / "eval"
    argv = ["--model-path", smollm2_folder, "--env", "kuhn_poker", "--method", "reflexion",
            "--preset", "small-cpu", "--out-dir", str(out), *_sets(SHORT)]
    assert evaluate.main(argv) == 0
    assert "training pool" in capsys.readouterr().out
    metrics = _summary(out)["evaluation"]["eval"]["metrics"]
    assert metrics["num_meta_episodes"] == 2 and len(metrics["curves"]["payoff"]) == 2
    assert metrics["valid_action_ratio"] == 1.0  # unconstrained, this model writes no <action> tag at all
    assert all(-2.0 <= p <= 2.0 for p in metrics["curves"]["payoff"])


@pytest.fixture(scope="module")
def lora_run(smollm2_folder, tmp_path_factory, request):
    """One MAGE iteration of the recipe (1 task x 2 meta-episodes) with a large learning rate, so that the
    adapters visibly move the logits."""
    request.getfixturevalue("compilation_cache")
    run_dir = tmp_path_factory.mktemp("small_cpu") / "run"
    overrides = {**SHORT, "rollout.num_tasks": 1, "rollout.group_size": 2, "train.iterations": 1,
                 "optim.lr": 1e-3, "checkpoint.every": 0}
    argv = ["--preset", "small-cpu", "--model-path", smollm2_folder, "--run-dir", str(run_dir),
            *_sets(overrides)]
    assert kuhn_poker.main(argv) == 0
    return run_dir


def _trained(run_dir):
    cfg = C.load(str(run_dir))
    parts = build_parts(cfg, str(run_dir))
    params, meta = parts.restore_params(checkpoint_dir(cfg, str(run_dir)))
    return parts, params, int(meta["iteration"])


def test_one_lora_iteration_trains_only_the_adapters(lora_run, smollm2_folder):
    metrics = [json.loads(line) for line in (lora_run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in metrics if r.get("split") == "train"]
    assert [r["iteration"] for r in train] == [1]
    parts, params, iteration = _trained(lora_run)
    assert iteration == 1 and parts.model_config.num_layers == 30
    adapters, base = lora.split_adapters(params)
    folder = load_hf_params(smollm2_folder)[2]
    for want, got in zip(jax.tree.leaves(folder), jax.tree.leaves(base), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))  # the base never moves
    b_leaves = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(adapters) if "lora_b" in str(path)]
    assert b_leaves and any(np.abs(np.asarray(b)).max() > 0 for b in b_leaves)  # B starts at zero


def test_the_export_reloads_with_the_trained_logits(lora_run, tmp_path):
    out = tmp_path / "hf"
    assert export.main(["--run-dir", str(lora_run), "--out", str(out)]) == 0
    parts, params, _ = _trained(lora_run)
    [ids] = parts.tokenizer.encode_prompts([PROMPT])
    tokens = np.asarray([ids], np.int32)
    mask = np.ones_like(tokens, bool)
    positions = np.arange(tokens.shape[1], dtype=np.int32)[None]
    trained = jax_logits(nnx.merge(parts.graphdef, params), tokens, mask, positions)
    reloaded = jax_logits(load_hf_model(out), tokens, mask, positions)
    base = jax_logits(nnx.merge(parts.graphdef, lora.without_adapters(params)), tokens, mask, positions)
    np.testing.assert_allclose(reloaded, trained, atol=2e-4, rtol=0)
    assert np.abs(base - trained).max() > 1e-2  # the merged adapters are in the exported weights
