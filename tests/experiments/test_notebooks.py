"""The Colab notebooks execute top to bottom in their smoke setting (MAGE_SMOKE=1)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")


def _execute(name: str, workdir: Path, env: dict[str, str], monkeypatch) -> nbformat.NotebookNode:
    for key, value in {"MAGE_SMOKE": "1", "MAGE_RUN_DIR": str(workdir / "runs"), **env}.items():
        monkeypatch.setenv(key, value)
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(workdir)}}
    )
    client.execute()
    return nb


def _outputs(nb) -> str:
    text = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            text.append(out.get("text", "") or "".join(out.get("data", {}).get("text/plain", "")))
    return "\n".join(text)


def _images(nb) -> int:
    return sum("image/png" in out.get("data", {}) for cell in nb.cells for out in cell.get("outputs", []))


def test_notebooks_have_a_parameters_cell_that_reads_mage_smoke():
    for name in ("quickstart.ipynb", "pretrained_zero_shot.ipynb"):
        nb = nbformat.read(NOTEBOOKS / name, as_version=4)
        tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
        assert len(tagged) == 1 and "MAGE_SMOKE" in tagged[0].source, name
        assert not any(c.get("outputs") for c in nb.cells if c.cell_type == "code"), (
            f"{name} is committed with outputs"
        )


def test_quickstart_trains_plots_per_opponent_and_shows_transcripts(tmp_path, monkeypatch, compilation_cache):
    nb = _execute("quickstart.ipynb", tmp_path, {}, monkeypatch)
    text = _outputs(nb)
    assert "training pool" in text and "held-out CFR opponent" in text
    assert "--- meta-episode" in text and ">>> <action>" in text
    assert _images(nb) >= 2  # per-opponent success/payoff figure and training curves
    runs = list((tmp_path / "runs").glob("quickstart-*/summary.json"))
    assert len(runs) == 1


def test_pretrained_notebook_evaluates_zero_shot_with_reflections_and_starts_training(
    tmp_path, monkeypatch, compilation_cache, tiny_hf_model
):
    nb = _execute("pretrained_zero_shot.ipynb", tmp_path, {"MAGE_MODEL_PATH": tiny_hf_model}, monkeypatch)
    text = _outputs(nb)
    assert "MCTS-100, agent first" in text  # the Tic-Tac-Toe zero-shot table
    assert "--- reflect row" in text or "--- play row" in text
    assert f"--model-path {tiny_hf_model}" in text
    assert "MAGE on Kuhn Poker: 2 tasks x 2 meta-episodes, differential meta-reward, gigpo" in text
    root = next((tmp_path / "runs").glob("zero-shot-*"))
    assert {p.parent.name for p in root.glob("*/summary.json")} == {"kuhn_poker", "tic_tac_toe"}
    assert _images(nb) >= 1


def test_pretrained_notebook_stops_with_a_clear_message_without_a_model_folder(tmp_path, monkeypatch):
    missing = str(tmp_path / "no-model")
    with pytest.raises(nbclient.exceptions.CellExecutionError, match="not a local Hugging Face model folder"):
        _execute("pretrained_zero_shot.ipynb", tmp_path, {"MAGE_MODEL_PATH": missing}, monkeypatch)
    assert os.path.isdir(NOTEBOOKS)
