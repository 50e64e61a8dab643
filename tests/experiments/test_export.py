"""``python -m experiments.export``: a trained run becomes a folder transformers loads and generates from."""

from __future__ import annotations

import json

import numpy as np
import pytest
from flax import nnx

from experiments import export, kuhn_poker
from mage_jax import config as C
from mage_jax.training.assemble import build_parts, checkpoint_dir
from tests.models.conftest import jax_logits
from tests.optional import require


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, request):
    """A 1-iteration smoke run of the main job (word-level tokenizer, model trained from scratch)."""
    request.getfixturevalue("compilation_cache")
    from tests.experiments.conftest import _smoke_args

    run_dir = tmp_path_factory.mktemp("export") / "run"
    args = _smoke_args({"checkpoint.every": 1})
    assert kuhn_poker.main([*args, "--run-dir", str(run_dir)]) == 0
    return run_dir


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


def test_export_of_the_latest_step_writes_a_complete_folder(trained_run, tmp_path):
    out = tmp_path / "hf"
    assert export.main(["--run-dir", str(trained_run), "--out", str(out)]) == 0
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= files
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3" and {"eos_token_id", "pad_token_id", "bos_token_id"} <= set(config)


@pytest.mark.parametrize("case, message", [
    ("missing_run", "error: --run-dir '{run}' holds no config.json"),
    ("missing_step", "error: no checkpoint of step 7 in"),
    ("occupied_out", "error: --out-dir '{out}' already exists and is not an empty folder"),
])
def test_export_problems_are_one_error_line(trained_run, tmp_path, capsys, case, message):
    run = str(tmp_path / "nowhere") if case == "missing_run" else str(trained_run)
    out = tmp_path / "hf"
    if case == "occupied_out":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    argv = ["--run-dir", run, "--out", str(out)] + (["--step", "7"] if case == "missing_step" else [])
    assert export.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(message.format(run=run, out=out)), err
    assert case == "occupied_out" or not out.exists()
