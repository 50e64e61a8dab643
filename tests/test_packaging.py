"""What a user installs: the wheel of the checkout holds every file of the two packages, not only their
Python modules (the GPU target descriptions ``experiments.plan`` compiles for, the shipped LoRA adapters
``experiments.evaluate --adapter`` reads, the opponents' and catalogues' data)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("mage_jax/", "experiments/")


def _tracked() -> list[str]:
    done = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    return [name for name in done.stdout.decode().split("\0") if name and (ROOT / name).is_file()]


def test_the_wheel_holds_every_file_of_the_packages(tmp_path):
    source = tmp_path / "source"  # the working tree's tracked files alone: no build/ left by an earlier one
    files = _tracked()
    for name in files:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "--no-index", "-q", "-w", str(tmp_path / "dist"), str(source)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    [wheel] = (tmp_path / "dist").glob("mage_jax-*.whl")
    packed = set(zipfile.ZipFile(wheel).namelist())
    wanted = {name for name in files if name.startswith(PACKAGES)}
    assert any(not name.endswith(".py") for name in wanted)  # data files are among them
    assert sorted(wanted - packed) == []
