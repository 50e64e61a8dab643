"""The CPU recipes on a real pretrained model, SmolLM2-135M-Instruct (the ``smollm2_folder`` fixture), end
to end: the pretrained notebook (``notebooks/pretrained_zero_shot.ipynb``) run in its smoke setting without
a model folder of its own, then its outputs read through the public entry points. Zero-shot it uses
``small-cpu``, for training ``smollm2-cpu``, and it evaluates a LoRA adapter with ``experiments.evaluate``'s
adapter path: the shipped one (``experiments/adapters``) when there is one, else its own run's, exported
with ``experiments.export``'s adapter path.

Everything here runs the 30-layer model on the CPU, so the notebook runs **once** (a module fixture) and
the tests read what it left: its constrained zero-shot evaluations (Kuhn Poker and Tic-Tac-Toe), its one
MAGE + LoRA iteration (the adapters moved, the base did not), and that run's export
(``experiments.export``) reloaded with the trained logits. The command-line evaluation of a model
folder (``experiments.evaluate --model-path``) is the same ``method_config`` + ``evaluate`` path; its
command-line layer is tested on a tiny folder (``tests/experiments/test_baselines.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from flax import nnx

from experiments import export
from mage_jax import config as C
from mage_jax.models import lora
from mage_jax.models.config import ModelConfig
from mage_jax.models.hf_loading import load_hf_model, load_hf_params
from mage_jax.training.assemble import build_parts, checkpoint_dir
from tests.experiments.notebook_runs import execute, images, outputs
from tests.models.conftest import jax_logits
from tests.xla_env import without_suite_flags

pytestmark = pytest.mark.slow  # the file is scheduled first (tests/conftest.py)

PROMPT = "You hold the King. Your opponent bet. Do you call or fold?"
ADAPTER = (Path(__file__).resolve().parents[2] / "experiments" / "adapters"
           / "smollm2_kuhn_mage_lora_adapter.safetensors")


@dataclass(frozen=True)
class NotebookRun:
    text: str
    images: int
    executed: bool
    root: Path


@pytest.fixture(scope="module")
def notebook(smollm2_folder, compilation_cache, tmp_path_factory) -> NotebookRun:
    """The pretrained notebook, smoke setting, no ``MAGE_MODEL_PATH``: it finds the converted
    SmolLM2-135M-Instruct folder (built by the fixture in the same cache) and runs the small-cpu recipe."""
    workdir = tmp_path_factory.mktemp("pretrained_notebook")
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.delenv("MAGE_MODEL_PATH", raising=False)
        monkeypatch.setenv("XLA_FLAGS", without_suite_flags())  # a real model: run time, not compiling
        nb = execute("pretrained_zero_shot.ipynb", workdir, {}, monkeypatch)
    executed = all(c.execution_count is not None for c in nb.cells if c.cell_type == "code")
    return NotebookRun(outputs(nb), images(nb), executed, next((workdir / "runs").glob("zero-shot-*")))


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_the_notebook_runs_every_cell_on_smollm2_without_a_folder_of_its_own(notebook, smollm2_folder):
    assert notebook.executed
    assert f"model folder: {smollm2_folder}" in notebook.text
    assert "MCTS-100, agent first" in notebook.text  # the Tic-Tac-Toe zero-shot table
    assert "--- reflect row" in notebook.text or "--- play row" in notebook.text
    assert ">>> <action>" in notebook.text  # constrained actions: the play rows are legal actions
    assert f"--preset smollm2-cpu --model-path {smollm2_folder}" in notebook.text
    assert "MAGE on Kuhn Poker: 1 tasks x 2 meta-episodes, differential meta-reward, gigpo" in notebook.text
    assert "LoRA rank 8" in notebook.text
    assert {p.parent.name for p in notebook.root.glob("*/summary.json")} == {
        "kuhn_poker", "tic_tac_toe", "mage_kuhn_poker", "adapter_kuhn_poker"}  # the smoke setting trains too
    assert notebook.images >= 1


def test_an_adapter_is_evaluated_with_standard_errors_and_the_paired_gain(notebook):
    """The shipped adapter (the recipe's 100+ iterations) where there is one, else the notebook's own
    one-iteration run's, exported by the notebook."""
    summary = _summary(notebook.root / "adapter_kuhn_poker")
    if ADAPTER.is_file():
        assert Path(summary["adapter"]).name == ADAPTER.name and summary["iterations"] >= 100
    else:
        assert "no adapter shipped" in notebook.text
        assert summary["adapter"] == str(notebook.root / "mage_kuhn_poker_lora_adapter.safetensors")
        assert summary["iterations"] == 1
    metrics = summary["evaluation"]["eval"]["metrics"]
    assert metrics["num_meta_episodes"] == 2 and metrics["valid_action_ratio"] == 1.0
    assert "gain, all: payoff@2 - payoff@1 = " in notebook.text and "±" in notebook.text


@pytest.mark.parametrize("env", ["kuhn_poker", "tic_tac_toe"])
def test_the_zero_shot_evaluation_plays_only_valid_actions(notebook, env):
    summary = _summary(notebook.root / env)
    assert C.load(str(notebook.root / env)).rollout.constrained_actions
    for split in summary["evaluation"].values():
        metrics = split["metrics"]
        assert metrics["num_meta_episodes"] == 2 and len(metrics["curves"]["payoff"]) == 2
        assert metrics["valid_action_ratio"] == 1.0  # unconstrained, this model writes no <action> tag at all


@dataclass(frozen=True)
class Trained:
    run_dir: Path
    parts: Any
    params: Any
    iteration: int


@pytest.fixture(scope="module")
def trained(notebook) -> Trained:
    """The notebook's MAGE + LoRA run, restored from its checkpoint as ``experiments.evaluate`` does."""
    run_dir = notebook.root / "mage_kuhn_poker"
    cfg = C.load(str(run_dir))
    parts = build_parts(cfg, str(run_dir))
    params, meta = parts.restore_params(checkpoint_dir(cfg, str(run_dir)))
    return Trained(run_dir, parts, params, int(meta["iteration"]))


def test_one_lora_iteration_trains_only_the_adapters(trained, smollm2_folder):
    train = [r for r in map(json.loads, (trained.run_dir / "metrics.jsonl").read_text().splitlines())
             if r.get("split") == "train"]
    assert [r["iteration"] for r in train] == [1]
    assert trained.iteration == 1 and trained.parts.model_config.num_layers == 30
    assert trained.parts.cfg.model.lora_rank == 8
    adapters, base = lora.split_adapters(trained.params)
    folder = load_hf_params(smollm2_folder)[2]
    for want, got in zip(jax.tree.leaves(folder), jax.tree.leaves(base), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))  # the base never moves
    b_leaves = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(adapters) if "lora_b" in str(path)]
    assert b_leaves and any(np.abs(np.asarray(b)).max() > 0 for b in b_leaves)  # B starts at zero


def test_the_export_reloads_with_the_trained_logits(trained, tmp_path):
    out = tmp_path / "hf"
    assert export.main(["--run-dir", str(trained.run_dir), "--out", str(out)]) == 0
    parts, params = trained.parts, trained.params
    [ids] = parts.tokenizer.encode_prompts([PROMPT])
    tokens = np.asarray([ids], np.int32)
    mask = np.ones_like(tokens, bool)
    positions = np.arange(tokens.shape[1], dtype=np.int32)[None]
    logits = jax_logits(nnx.merge(parts.graphdef, params), tokens, mask, positions)
    exported = ModelConfig.from_hf_dir(out)
    assert (exported.architecture, exported.num_layers, exported.lora_rank) == ("llama", 30, 0)
    # Loaded with the run's adapters (zero): the three logits share one compiled program.
    reloaded = jax_logits(load_hf_model(out, parts.model_config), tokens, mask, positions)
    base = jax_logits(nnx.merge(parts.graphdef, lora.without_adapters(params)), tokens, mask, positions)
    np.testing.assert_allclose(reloaded, logits, atol=1e-3, rtol=0)  # merged in float32: measured 2.3e-4
    assert np.abs(base - logits).max() > 1e-2  # the merged adapters are in the exported weights
