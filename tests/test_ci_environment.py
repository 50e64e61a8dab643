"""What the two CI environments of ``.ci/run`` promise.

The default one (every optional test dependency, ``MAGE_TESTS_REQUIRE_OPTIONAL=1``) skips nothing for a
missing package. The current-stack one (Python 3.13, no torch, ``MAGE_CI_CONSTRAINTS`` naming the pins)
keeps the pinned JAX after a plain ``pip install -e .`` (mage-jax's bounds never downgrade a newer JAX
that we test) and renders a Qwen-style chat template without torch.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from mage_jax.testing import build_bpe_tokenizer
from mage_jax.tokenizer import Tokenizer
from tests.optional import REQUIRE_VAR

TESTS = Path(__file__).resolve().parent
OPTIONAL = ("torch", "pyspiel", "textworld", "alfworld", "bm25s", "wandb", "rlax", "nbclient", "nbformat")
CONSTRAINTS_VAR = "MAGE_CI_CONSTRAINTS"
current_stack = pytest.mark.skipif(not os.environ.get(CONSTRAINTS_VAR),
                                   reason="only in .ci/run's current-stack environment")


def _pins(path: str) -> dict[str, str]:
    pins = {}
    for line in Path(path).read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            requirement = Requirement(line)
            [spec] = requirement.specifier
            assert spec.operator == "==", f"{path}: {line!r} is not a pin"
            pins[requirement.name] = spec.version
    return pins


def test_optional_test_dependencies_are_imported_through_the_one_helper():
    direct = [str(p.relative_to(TESTS)) for p in TESTS.rglob("*.py")
              if p.name != "optional.py" and re.search(r"importorskip\(|^\s*(import|from) torch\b",
                                                       p.read_text(), re.M)]
    assert direct == [], "use tests.optional.require(...) so that the default CI cannot skip them"


@pytest.mark.skipif(os.environ.get(REQUIRE_VAR) != "1", reason=f"{REQUIRE_VAR} is not set")
def test_the_default_environment_has_every_optional_test_dependency():
    missing = [name for name in OPTIONAL if importlib.util.find_spec(name) is None]
    assert missing == []


def test_a_qwen_style_chat_template_renders_with_the_declared_dependencies(tmp_path):
    build_bpe_tokenizer(tmp_path, ["Your card is K. <action>BET</action>"] * 4, vocab_size=300)
    tok = Tokenizer.from_hf_dir(tmp_path, enable_thinking=False)
    assert tok.render_prompt("hi") == ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
                                       "<think>\n\n</think>\n\n")
    declared = tomllib.loads((TESTS.parent / "pyproject.toml").read_text())["project"]["dependencies"]
    assert "jinja2" in {Requirement(r).name.lower() for r in declared}  # transformers does not require it


@current_stack
def test_the_current_stack_has_no_torch():
    assert importlib.util.find_spec("torch") is None  # so the chat template above rendered without it


@current_stack
def test_pip_install_of_the_project_kept_every_pinned_release():
    """.ci/run installs the pins, then ``pip install -e .`` without them, as a user would: bounds that
    excluded a pinned release would have made pip replace it (a downgraded JAX)."""
    pins = _pins(os.environ[CONSTRAINTS_VAR])
    assert {"jax", "jaxlib", "flax", "transformers"} <= set(pins)
    installed = {name: importlib.metadata.version(name) for name in pins}
    assert installed == pins
    bounds = {Requirement(r).name.lower(): Requirement(r).specifier
              for r in importlib.metadata.requires("mage-jax") if "extra" not in r}
    for name, version in pins.items():
        if name in bounds:
            assert bounds[name].contains(version), f"{name} {version} is outside mage-jax's {bounds[name]}"
