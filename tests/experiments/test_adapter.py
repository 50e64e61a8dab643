"""A LoRA run's adapters alone: ``experiments.export --adapter FILE`` writes them (a few MB, one
``.safetensors`` file) and ``experiments.evaluate --model-path BASE --adapter FILE`` replays the run's
own evaluation from them on the base folder, with ``--set`` still applying (docs/results.md).

The run is the small-cpu recipe at smoke sizes on a tiny random Hugging Face folder (the real model's
recipe is the same path; ``tests/experiments/test_small_cpu.py`` runs it on SmolLM2)."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from experiments import compare, evaluate, export, kuhn_poker
from mage_jax import config as C
from mage_jax.models import lora
from mage_jax.models.adapter_file import FORMAT, apply_adapters, read_adapters
from mage_jax.testing import smoke_args
from mage_jax.training.assemble import build_parts, checkpoint_dir

ADAPTER = "kuhn_lora_adapter.safetensors"


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def lora_run(tiny_hf_model, tmp_path_factory, compilation_cache) -> Path:
    run_dir = tmp_path_factory.mktemp("lora") / "run"
    argv = ["--preset", "small-cpu", "--model-path", tiny_hf_model, "--run-dir", str(run_dir),
            *smoke_args({"model.overrides": {"max_position_embeddings": 40960}, "rollout.engine_slots": 4,
                          "train.eval_heldout_meta_episodes": 0, "optim.lr": 1e-2})]
    assert kuhn_poker.main(argv) == 0
    return run_dir


@pytest.fixture(scope="module")
def adapter(lora_run, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("export") / ADAPTER
    assert export.main(["--run-dir", str(lora_run), "--adapter", str(path)]) == 0
    return path


def test_the_adapter_file_holds_the_lora_matrices_only_with_the_runs_config(adapter, lora_run):
    tensors = load_file(str(adapter))
    assert tensors and all(name.split("/")[-1] in ("lora_a", "lora_b") for name in tensors)
    assert any(np.abs(t).max() > 0 for name, t in tensors.items() if name.endswith("lora_b"))  # trained
    file = read_adapters(adapter)
    assert file.lora_rank == 8 and file.metadata["iteration"] == "1"
    assert json.loads(file.metadata["config"]) == json.loads((lora_run / "config.json").read_text())
    assert adapter.stat().st_size < 2 * sum(t.nbytes for t in tensors.values()) + 65536  # no base weights


def test_evaluating_the_adapter_on_the_base_folder_replays_the_runs_evaluation(
        adapter, lora_run, tiny_hf_model, tmp_path, capsys, compilation_cache):
    out = tmp_path / "replay"
    argv = ["--model-path", tiny_hf_model, "--adapter", str(adapter), "--out-dir", str(out)]
    assert evaluate.main(argv) == 0
    assert "training pool" in capsys.readouterr().out
    replay, run = _summary(out), _summary(lora_run)
    assert replay["adapter"] == str(adapter) and replay["iterations"] == 1
    assert replay["evaluation"]["eval"]["metrics"] == run["evaluation"]["eval"]["metrics"]

    other = tmp_path / "seed7"  # --set applies on top of the recorded config: other held-out deals
    assert evaluate.main([*argv[:4], "--out-dir", str(other), "--set", "env.eval_seed=7",
                          "--set", "train.eval_meta_episodes=2"]) == 0
    assert json.loads((other / "config.json").read_text())["env"]["eval_seed"] == 7
    assert _summary(other)["evaluation"]["eval"]["metrics"]["num_meta_episodes"] == 2


def test_the_adapters_put_on_the_base_folder_are_the_runs_trained_ones(adapter, lora_run):
    cfg = C.load(str(lora_run))
    parts = build_parts(cfg, str(lora_run))
    trained, _ = parts.restore_params(checkpoint_dir(cfg, str(lora_run)))
    loaded = apply_adapters(parts.init_params, parts.model_config, read_adapters(adapter))
    for want, got in zip(jax.tree.leaves(trained), jax.tree.leaves(loaded), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert any(np.abs(np.asarray(b)).max() > 0 for b in jax.tree.leaves(lora.split_adapters(loaded)[0]))


@pytest.mark.parametrize("case, message", [
    ("no model path", "--model-path is required"),
    ("not a file", "does not exist"),
    ("not an adapter file", "is not a mage-jax LoRA adapter file"),
    ("another base", "does not fit this model"),
    ("a preset", "--adapter carries its run's config: --preset"),
])
def test_a_bad_adapter_is_one_error_line_and_writes_nothing(case, message, adapter, tiny_hf_model, tmp_path,
                                                           capsys):
    path = adapter
    if case == "not a file":
        path = tmp_path / "missing_lora.safetensors"
    elif case == "not an adapter file":
        path = tmp_path / "plain_lora.safetensors"
        save_file({"w": np.zeros(3, np.float32)}, str(path))
    elif case == "another base":
        tensors, file = load_file(str(adapter)), read_adapters(adapter)
        tensors.pop(sorted(tensors)[0])
        path = tmp_path / "cut_lora.safetensors"
        meta = {"format": FORMAT, "lora_rank": "8", "lora_alpha": "16.0",
                "lora_targets": json.dumps(list(file.lora_targets)), "base": json.dumps(file.base),
                **file.metadata}
        save_file(tensors, str(path), metadata=meta)
    out = tmp_path / "out"
    argv = ["--adapter", str(path), "--out-dir", str(out)]
    if case != "no model path":
        argv = ["--model-path", tiny_hf_model, *argv]
    if case == "a preset":
        argv += ["--preset", "small-cpu"]
    assert evaluate.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
    assert not out.exists()


@pytest.mark.parametrize("name, message", [
    ("model.safetensors", "must end in .safetensors and contain adapter"),
    ("kuhn_lora_adapter.bin", "must end in .safetensors"),
])
def test_an_adapter_file_name_must_say_what_it_is(name, message, lora_run, tmp_path, capsys):
    assert export.main(["--run-dir", str(lora_run), "--adapter", str(tmp_path / name)]) == 2
    err = capsys.readouterr().err
    assert message in err and not list(tmp_path.iterdir())


def test_compare_tables_each_evaluations_paired_gain_and_draws_the_runs(adapter, lora_run, tiny_hf_model,
                                                                        tmp_path, capsys):
    """``experiments.compare``: the results table of an experiment (the run's own evaluation beside its
    adapter's on other deals), its numbers as JSON, and the figure of the run's training records."""
    other = tmp_path / "seed7"
    assert evaluate.main(["--model-path", tiny_hf_model, "--adapter", str(adapter), "--out-dir", str(other),
                          "--set", "env.eval_seed=7", "--set", "train.eval_meta_episodes=3"]) == 0
    capsys.readouterr()
    figure, table = tmp_path / "fig" / "adaptation.png", tmp_path / "table.json"
    argv = ["--eval", f"trained run={lora_run}", "--eval", f"adapter, seed 7={other}",
            "--run", f"trained run={lora_run}", "--figure", str(figure), "--json", str(table)]
    assert compare.main(argv) == 0
    out = capsys.readouterr().out
    rows = json.loads(table.read_text())
    assert [r["label"] for r in rows] == ["trained run", "adapter, seed 7"]
    for row, folder in zip(rows, (lora_run, other)):
        metrics = _summary(folder)["evaluation"]["eval"]["metrics"]
        gain, payoff = metrics["payoff_gain"], metrics["curves"]["payoff"]
        assert row["num_meta_episodes"] == metrics["num_meta_episodes"] and row["iterations"] == 1
        assert row["gain"] == [gain["mean"], gain["standard_error"]]
        assert [p[0] for p in row["payoff"]] == payoff
        last = row["num_episodes"]
        line = next(line for line in out.splitlines() if line.startswith(f"| {row['label']} |"))
        assert f"| {payoff[0]:+.3f} ± " in line and f"| {payoff[last - 1]:+.3f} ± " in line
        assert f"**{gain['mean']:+.3f} ± {gain['standard_error']:.3f}**" in line
    assert rows[1]["num_meta_episodes"] == 3
    assert figure.stat().st_size > 10_000 and f"figure: {figure}" in out


@pytest.mark.parametrize("case, message", [
    ("no label", "write it as LABEL=PATH"),
    ("no summary", "no summary.json there"),
    ("no split", "has no 'validation' evaluation"),
    ("no records", "no training records"),
])
def test_compare_with_a_folder_that_lacks_what_it_needs_is_one_error_line(case, message, lora_run, tmp_path,
                                                                        capsys):
    figure = tmp_path / "adaptation.png"
    argv = {"no label": ["--eval", str(lora_run)],
            "no summary": ["--eval", f"run={tmp_path}"],
            "no split": ["--eval", f"run={lora_run}", "--split", "validation"],
            "no records": ["--eval", f"run={lora_run}", "--run", f"empty={tmp_path}"]}[case]
    assert compare.main([*argv, "--figure", str(figure)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
    assert not figure.exists()
