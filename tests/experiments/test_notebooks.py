"""The Colab notebooks execute top to bottom in their smoke setting (MAGE_SMOKE=1)."""

from __future__ import annotations

import os
import tomllib

import pytest
from packaging.requirements import Requirement

from tests.experiments.notebook_runs import NOTEBOOKS, execute, images, nbclient, nbformat, outputs

PYPROJECT = tomllib.loads((NOTEBOOKS.parent / "pyproject.toml").read_text())
BOUNDS = {Requirement(r).name: str(Requirement(r).specifier) for r in PYPROJECT["project"]["dependencies"]}


def test_notebooks_have_a_parameters_cell_that_reads_mage_smoke():
    for name in ("quickstart.ipynb", "pretrained_zero_shot.ipynb"):
        nb = nbformat.read(NOTEBOOKS / name, as_version=4)
        tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
        assert len(tagged) == 1 and "MAGE_SMOKE" in tagged[0].source, name
        assert not any(c.get("outputs") for c in nb.cells if c.cell_type == "code"), (
            f"{name} is committed with outputs"
        )


def test_quickstart_trains_plots_per_opponent_and_shows_transcripts(tmp_path, monkeypatch, compilation_cache):
    nb = execute("quickstart.ipynb", tmp_path, {}, monkeypatch)
    text = outputs(nb)
    assert "training pool" in text and "held-out CFR opponent" in text
    assert "--- meta-episode" in text and ">>> <action>" in text
    assert images(nb) >= 2  # per-opponent success/payoff figure and training curves
    runs = list((tmp_path / "runs").glob("quickstart-*/summary.json"))
    assert len(runs) == 1
    assert all(c.execution_count is not None for c in nb.cells if c.cell_type == "code")
    for name in ("jax", "flax"):  # the check cell compares the installed releases with pyproject's bounds
        assert f"{name} " in text and f"(mage-jax needs {BOUNDS[name]}): ok" in text


def test_pretrained_notebook_stops_with_a_clear_message_without_a_model_folder(tmp_path, monkeypatch):
    missing = str(tmp_path / "no-model")
    with pytest.raises(nbclient.exceptions.CellExecutionError, match="not a local Hugging Face model folder"):
        execute("pretrained_zero_shot.ipynb", tmp_path, {"MAGE_MODEL_PATH": missing}, monkeypatch)
    assert os.path.isdir(NOTEBOOKS)


# -- the install cell: a local checkout, else the repository URL named in one place -------------------


def _install_cell(name: str) -> str:
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    [cell] = [c for c in nb.cells if c.cell_type == "code" and "REPO_URL =" in c.source]
    return cell.source


def _run_install_cell(monkeypatch, *, pip_ok=(True,)):
    """Executes the install cell as if mage_jax were not installed; returns the pip commands it ran."""
    import importlib.util
    import subprocess

    commands, results = [], list(pip_ok)
    real_find_spec = importlib.util.find_spec

    def run(cmd, **kwargs):
        commands.append(cmd[cmd.index("install") + 2:])
        return subprocess.CompletedProcess(cmd, 0 if results.pop(0) else 1)

    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "mage_jax" else real_find_spec(name, *a))
    monkeypatch.setattr(subprocess, "run", run)
    exec(compile(_install_cell("quickstart.ipynb"), "install_cell", "exec"), {})
    return commands


def test_both_notebooks_share_one_install_cell():
    assert _install_cell("quickstart.ipynb") == _install_cell("pretrained_zero_shot.ipynb")


def test_install_cell_installs_a_local_checkout_keeping_the_runtime_jax(monkeypatch):
    import importlib.metadata

    monkeypatch.chdir(NOTEBOOKS)  # a notebook opened inside a clone: the checkout is ".."
    monkeypatch.delenv("MAGE_REPO_URL", raising=False)
    [command] = _run_install_cell(monkeypatch)
    checkout = str(NOTEBOOKS.parent)
    assert command[0] == f"{checkout}[games]"
    assert f"jax=={importlib.metadata.version('jax')}" in command[1:]
    assert f"jaxlib=={importlib.metadata.version('jaxlib')}" in command[1:]


def test_install_cell_installs_from_the_repository_url_and_lets_pip_choose_jax_when_it_must(
        monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)  # no checkout anywhere near
    monkeypatch.setenv("MAGE_REPO_URL", "https://example.org/me/mage-jax@v1")
    first, second = _run_install_cell(monkeypatch, pip_ok=(False, True))
    assert [first[0]] == second == ["mage-jax[games] @ git+https://example.org/me/mage-jax@v1"]
    assert any(arg.startswith("jax==") for arg in first)
    assert "outside mage-jax's bounds" in capsys.readouterr().out


def test_install_cell_without_checkout_installs_the_projects_repository(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MAGE_REPO_URL", raising=False)
    first, *_ = _run_install_cell(monkeypatch)
    assert first[0] == f"mage-jax[games] @ git+{PYPROJECT['project']['urls']['Repository']}"


def test_install_cell_with_an_empty_url_and_no_checkout_says_what_to_set(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MAGE_REPO_URL", "")
    with pytest.raises(RuntimeError, match="MAGE_REPO_URL is empty"):
        _run_install_cell(monkeypatch)


def test_the_readme_opens_both_notebooks_in_colab_from_the_projects_repository():
    repository = PYPROJECT["project"]["urls"]["Repository"].removeprefix("https://github.com/")
    readme = (NOTEBOOKS.parent / "README.md").read_text()
    for name in ("quickstart.ipynb", "pretrained_zero_shot.ipynb"):
        assert f"https://colab.research.google.com/github/{repository}/blob/main/notebooks/{name}" in readme


def test_the_install_target_of_a_checkout_is_one_pip_accepts(monkeypatch):
    import subprocess
    import sys

    target = f"{NOTEBOOKS.parent}[games]"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps",
                           "--no-build-isolation", "--no-index", "-q", target],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
