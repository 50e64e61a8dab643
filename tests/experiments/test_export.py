"""``python -m experiments.export``: a trained run becomes a folder transformers loads and generates from."""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from experiments import export, kuhn_poker
from mage_jax import config as C
from mage_jax.models.config import ModelConfig
from mage_jax.models.hf_loading import load_hf_params
from mage_jax.training import trainer as trainer_module
from mage_jax.training.assemble import best_checkpoint_dir, build_parts, checkpoint_dir
from tests.models.conftest import jax_logits
from tests.optional import require

BEST, LATEST = 1, 2


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, request):
    """A 2-iteration smoke run of the main job (word-level tokenizer, model trained from scratch) whose
    best validated state is iteration 1 and latest checkpoint iteration 2: only iteration 1 is
    validated, so the two states differ whatever the tiny validation split measures."""
    request.getfixturevalue("compilation_cache")
    from mage_jax.testing import smoke_args

    run_dir = tmp_path_factory.mktemp("export") / "run"
    args = smoke_args({"checkpoint.every": 1, "train.iterations": LATEST, "train.validate_every": 1})
    original = trainer_module.Trainer._validate

    def validate_first_only(self, iteration):
        return original(self, iteration) if iteration == BEST else False

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(trainer_module.Trainer, "_validate", validate_first_only)
        assert kuhn_poker.main([*args, "--run-dir", str(run_dir)]) == 0
    assert json.loads((run_dir / "summary.json").read_text())["selected_iteration"] == BEST
    return run_dir


def _restored(run_dir, directory_of, step=None):
    cfg = C.load(str(run_dir))
    parts = build_parts(cfg, str(run_dir))
    params, meta = parts.restore_params(directory_of(cfg, str(run_dir)), step)
    return jax.tree.leaves(params), int(meta["iteration"])


def _exported(out):
    """The exported folder's weights in the unrolled layout the tiny run trained with (a folder's model
    scans its blocks by default: stacked [L, ...] leaves)."""
    return jax.tree.leaves(load_hf_params(out, ModelConfig.from_hf_dir(out, scan_layers=False))[2])


def test_export_loads_in_transformers_with_the_same_tokens_logits_and_stop_ids(trained_run, tmp_path, capsys):
    torch = require("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "hf"
    assert export.main(["--run-dir", str(trained_run), "--step", "1", "--out", str(out)]) == 0
    assert "exported iteration 1" in capsys.readouterr().out
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    hf_tok = AutoTokenizer.from_pretrained(out, local_files_only=True)

    cfg = C.load(str(trained_run))
    parts = build_parts(cfg, str(trained_run))
    params, _ = parts.restore_params(checkpoint_dir(cfg, str(trained_run)), 1)
    ours = parts.tokenizer
    prompt = "Your Card: K | Actions: Player 0: BET"
    [ids] = ours.encode_prompts([prompt])
    assert hf_tok(prompt)["input_ids"] == ids
    assert (model.config.bos_token_id, model.config.pad_token_id) == (ours.bos_id, ours.pad_id)
    assert model.generation_config.eos_token_id == ours.eos_ids[0]

    tokens = np.asarray([ids], np.int32)
    mask = np.ones_like(tokens, bool)
    positions = np.arange(tokens.shape[1], dtype=np.int32)[None]
    want = jax_logits(nnx.merge(parts.graphdef, params), tokens, mask, positions)
    with torch.no_grad():
        got = model(input_ids=torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=2e-4)

    with torch.no_grad():
        generated = model.generate(torch.tensor(tokens, dtype=torch.long), max_new_tokens=6, do_sample=False)
    new = generated[0, tokens.shape[1]:].tolist()
    # Greedy decoding of the same logits: the first new token is our model's argmax.
    assert new[0] == int(np.argmax(want[0, -1]))
    assert isinstance(hf_tok.decode(new, skip_special_tokens=True), str)


def test_export_of_the_latest_step_writes_a_complete_folder(trained_run, tmp_path, capsys):
    out = tmp_path / "hf"
    assert export.main(["--run-dir", str(trained_run), "--out", str(out)]) == 0
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= files
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3" and {"eos_token_id", "pad_token_id", "bos_token_id"} <= set(config)
    # The latest state, and a pointer to the state summary.json measured.
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith(f"exported iteration {LATEST} ")
    assert printed[1] == ("note: the run's final evaluation (summary.json) measured its best validated "
                          f"state, iteration {BEST}; export that one with --best")
    latest, iteration = _restored(trained_run, checkpoint_dir)
    assert iteration == LATEST
    for a, b in zip(latest, _exported(out), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)


def test_export_best_writes_the_state_that_summary_json_measured(trained_run, tmp_path, capsys):
    out = tmp_path / "hf"
    assert export.main(["--run-dir", str(trained_run), "--best", "--out", str(out)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"exported the best validated state, iteration {BEST} ({_num_params(out):,} parameters) of "
        f"{trained_run} to {out}"]
    best, iteration = _restored(trained_run, best_checkpoint_dir)
    latest, _ = _restored(trained_run, checkpoint_dir)
    assert iteration == BEST
    exported = _exported(out)
    for a, b in zip(best, exported, strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)
    assert any(not np.array_equal(np.asarray(a), b) for a, b in zip(latest, exported, strict=True))


def test_exported_files_are_as_readable_as_new_files(trained_run, tmp_path):
    import os

    out = tmp_path / "hf"
    previous = os.umask(0o022)
    try:
        assert export.main(["--run-dir", str(trained_run), "--best", "--out", str(out)]) == 0
    finally:
        os.umask(previous)
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert modes["model.safetensors"] == 0o644 and set(modes.values()) == {0o644}, modes


def _num_params(out):
    return sum(int(np.prod(np.shape(x))) for x in _exported(out))


@pytest.mark.parametrize("case, message", [
    ("missing_run", "error: --run-dir '{run}' holds no config.json"),
    ("missing_step", "error: no checkpoint of step 7 in"),
    ("occupied_out", "error: --out-dir '{out}' already exists and is not an empty folder"),
    ("no_best", "error: --best: '{run}' has no best validated state ('{run}/checkpoints_best' holds no "
                "checkpoint; a run keeps one when train.validate_every > 0)"),
    ("best_and_step", "error: argument --step: not allowed with argument --best"),
])
def test_export_problems_are_one_error_line(trained_run, tmp_path, capsys, case, message):
    run = str(tmp_path / "nowhere") if case == "missing_run" else str(trained_run)
    if case == "no_best":  # a run trained without validation
        run = str(shutil.copytree(trained_run, tmp_path / "unvalidated"))
        shutil.rmtree(f"{run}/checkpoints_best")
    out = tmp_path / "hf"
    if case == "occupied_out":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    extra = {"missing_step": ["--step", "7"], "no_best": ["--best"],
             "best_and_step": ["--best", "--step", "1"]}
    argv = ["--run-dir", run, "--out", str(out)] + extra.get(case, [])
    assert export.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(message.format(run=run, out=out)), err
    assert case == "occupied_out" or not out.exists()


def test_a_checkpoint_in_the_other_block_layout_names_the_override_that_exports_it(trained_run, tmp_path,
                                                                                    capsys):
    # The run trained unrolled; its config, as a preset that now scans would give it, asks for scanned
    # blocks: the error line names the flag, and with it the export runs.
    run = shutil.copytree(trained_run, tmp_path / "run")
    config = json.loads((run / "config.json").read_text())
    config["model"]["overrides"]["scan_layers"] = True
    (run / "config.json").write_text(json.dumps(config))
    out = tmp_path / "hf"
    assert export.main(["--run-dir", str(run), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "add --model.overrides.scan_layers false to the command" in err[0], err
    assert not out.exists()
    flag = ["--model.overrides.scan_layers", "false"]
    assert export.main(["--run-dir", str(run), "--out", str(out), *flag]) == 0
    latest, _ = _restored(trained_run, checkpoint_dir)
    for a, b in zip(latest, _exported(out), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)

