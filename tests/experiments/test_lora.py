"""LoRA end to end through the command line on the tiny Hugging Face model: ``--model.lora_rank 4``
trains (only the adapters), checkpoints, resumes, and exports merged weights that transformers loads
with our logits."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from flax import nnx

from experiments import export, kuhn_poker
from mage_jax import config as C
from mage_jax.models import lora
from mage_jax.models.hf_loading import load_hf_params
from mage_jax.training.assemble import build_parts, checkpoint_dir
from mage_jax.training.checkpoint import Checkpointer
from tests.models.conftest import jax_logits
from tests.optional import require

SHORT = {"rollout.max_prompt_tokens": 1024, "rollout.max_response_tokens": 12,
         "rollout.max_reflection_tokens": 12, "rollout.max_turns": 2, "checkpoint.every": 1,
         "optim.lr": 1e-2, "train.stop_when_all_invalid": False,  # a random model writes no valid answer
         "model.dtype": "float32",  # float32 activations: the export is compared with transformers' logits
         "train.eval_heldout_meta_episodes": 0}  # the final evaluation of the held-out pool is not under test


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, request):
    """One iteration of the ``small`` preset with rank-4 adapters, then a resume for a second one."""
    request.getfixturevalue("compilation_cache")
    model_path = request.getfixturevalue("tiny_hf_model")
    from mage_jax.testing import smoke_args

    run_dir = tmp_path_factory.mktemp("lora") / "run"
    argv = [*smoke_args(SHORT), "--preset", "small", "--model-path", model_path, "--model.lora_rank", "4",
            "--run-dir", str(run_dir)]
    assert kuhn_poker.main(argv) == 0
    assert kuhn_poker.main(["--run-dir", str(run_dir), "--resume", "--set", "train.iterations=2"]) == 0
    return run_dir, model_path


def restored(run_dir, *steps):
    """The run's parts (built once) and its parameters at each checkpoint of ``steps``."""
    cfg = C.load(str(run_dir))
    parts = build_parts(cfg, str(run_dir))
    return parts, [parts.restore_params(checkpoint_dir(cfg, str(run_dir)), step)[0] for step in steps]


@pytest.mark.slow
def test_a_lora_run_trains_only_the_adapters_and_resumes(lora_run):
    run_dir, model_path = lora_run
    cfg = C.load(str(run_dir))
    assert (cfg.model.lora_rank, cfg.model.path, cfg.optim.kl_coef > 0) == (4, model_path, True)
    with Checkpointer(checkpoint_dir(cfg, str(run_dir))) as ckpt:
        assert ckpt.latest_step() == 2
    folder = load_hf_params(model_path)[2]
    _, (first, second) = restored(run_dir, 1, 2)
    (adapters_1, base_1), (adapters_2, base_2) = lora.split_adapters(first), lora.split_adapters(second)
    for want, a, b in zip(jax.tree.leaves(folder), jax.tree.leaves(base_1), jax.tree.leaves(base_2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(want))  # the base never moves
        np.testing.assert_array_equal(np.asarray(b), np.asarray(want))
    moved = [not np.array_equal(np.asarray(a), np.asarray(b))
             for a, b in zip(jax.tree.leaves(adapters_1), jax.tree.leaves(adapters_2))]
    assert len(moved) == 2 * len(lora.LORA_TARGETS) and all(moved)  # the resumed iteration trained
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in metrics if r.get("split") == "train"] == [1, 2]


def test_the_export_of_a_lora_run_is_the_merged_model_in_transformers(lora_run, tmp_path):
    torch = require("torch")
    from transformers import AutoModelForCausalLM

    run_dir, _ = lora_run
    out = tmp_path / "hf"
    assert export.main(["--run-dir", str(run_dir), "--out", str(out)]) == 0
    names = json.loads((out / "config.json").read_text())
    assert "lora_rank" not in names
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    parts, (params,) = restored(run_dir, 2)
    [ids] = parts.tokenizer.encode_prompts(["Your Card: K | Actions: Player 0: BET"])
    tokens = np.asarray([ids], np.int32)
    want = jax_logits(nnx.merge(parts.graphdef, params), tokens, np.ones_like(tokens, bool),
                      np.arange(tokens.shape[1], dtype=np.int32)[None])
    with torch.no_grad():
        got = model(input_ids=torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=2e-4)
    base = jax_logits(nnx.merge(parts.graphdef, lora.without_adapters(params)), tokens,
                      np.ones_like(tokens, bool), np.arange(tokens.shape[1], dtype=np.int32)[None])
    assert np.abs(base - want).max() > 1e-4  # the trained adapters are in the exported weights
