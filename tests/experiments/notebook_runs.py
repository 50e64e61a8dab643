"""Running a notebook of ``notebooks/`` in its smoke setting (``MAGE_SMOKE=1``) and reading its output."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.optional import require

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"

nbformat = require("nbformat")
nbclient = require("nbclient")


def execute(name: str, workdir: Path, env: dict[str, str], monkeypatch: pytest.MonkeyPatch):
    """Runs ``notebooks/NAME`` top to bottom in a fresh kernel, with ``env`` (and ``MAGE_SMOKE=1``,
    ``MAGE_RUN_DIR=workdir/runs``) set for it; returns the executed notebook."""
    for key, value in {"MAGE_SMOKE": "1", "MAGE_RUN_DIR": str(workdir / "runs"), **env}.items():
        monkeypatch.setenv(key, value)
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(workdir)}}
    )
    client.execute()
    return nb


def outputs(nb) -> str:
    """Everything the cells printed or displayed as text."""
    text = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            text.append(out.get("text", "") or "".join(out.get("data", {}).get("text/plain", "")))
    return "\n".join(text)


def images(nb) -> int:
    return sum("image/png" in out.get("data", {}) for cell in nb.cells for out in cell.get("outputs", []))
