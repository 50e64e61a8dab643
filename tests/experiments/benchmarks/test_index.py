"""The benchmark index (``python -m experiments.benchmarks``) names every module of the package once: each
benchmark with its kind (tool or study), what it measures and the doc that quotes it, then the support
modules; a new script that is not listed fails here."""

import importlib
import subprocess
import sys
from pathlib import Path

from experiments.benchmarks.__main__ import BENCHMARKS, SUPPORT

ROOT = Path(__file__).resolve().parents[3]
PACKAGE = ROOT / "experiments" / "benchmarks"


def test_every_module_is_a_listed_benchmark_or_support_module():
    modules = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__", "__main__"}
    names = [b.name for b in BENCHMARKS]
    assert len(names) == len(set(names)) and not set(names) & set(SUPPORT)
    assert modules == set(names) | set(SUPPORT)
    for b in BENCHMARKS:
        assert b.kind in ("tool", "study") and b.what and (ROOT / b.doc).is_file(), b
        assert callable(importlib.import_module(f"experiments.benchmarks.{b.name}").main), b.name
        assert f"experiments.benchmarks.{b.name}" in (ROOT / b.doc).read_text(), (b.name, b.doc)


def test_the_index_prints_one_line_per_benchmark_and_the_readme_points_to_it():
    out = subprocess.run([sys.executable, "-m", "experiments.benchmarks"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    for b in BENCHMARKS:
        assert sum(line.split()[:2] == [b.name, b.kind] for line in out.splitlines()) == 1, b.name
    assert all(name in out for name in SUPPORT)
    assert "python -m experiments.benchmarks`" in (ROOT / "README.md").read_text()
