"""What the test extras and the two CI environments of ``.ci/run`` promise.

The ``test`` extra (the README's test command) installs from wheels alone and holds no nightly or
pre-release, so a user needs no C++ toolchain and gets the same environment tomorrow; tests/optional.py
names, for each optional package, the extra of pyproject.toml that holds it. The default CI environment
(every optional test dependency, ``MAGE_TESTS_REQUIRE_OPTIONAL=1``) skips nothing for a missing package
and holds exactly the releases pinned in ``.ci/constraints-default.txt`` (``MAGE_CI_DEFAULT_CONSTRAINTS``).
The current-stack one (Python 3.13, no torch, ``MAGE_CI_CONSTRAINTS`` naming the pins) keeps the pinned JAX
after a plain ``pip install -e .`` (mage-jax's bounds never downgrade a newer JAX that we test) and renders
a Qwen-style chat template without torch.
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
from packaging.utils import canonicalize_name
from packaging.version import Version

from mage_jax.testing import build_bpe_tokenizer
from mage_jax.tokenizer import Tokenizer
from tests.optional import EXTRAS, REQUIRE_VAR

TESTS = Path(__file__).resolve().parent
PYPROJECT = tomllib.loads((TESTS.parent / "pyproject.toml").read_text())
CONSTRAINTS_VAR = "MAGE_CI_CONSTRAINTS"
DEFAULT_CONSTRAINTS_VAR = "MAGE_CI_DEFAULT_CONSTRAINTS"
current_stack = pytest.mark.skipif(not os.environ.get(CONSTRAINTS_VAR),
                                   reason="only in .ci/run's current-stack environment")


def _pins(path: str) -> dict[str, str]:
    """``name==version`` lines of a constraints file (names canonical, e.g. ``open-spiel``)."""
    pins = {}
    for line in Path(path).read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            requirement = Requirement(line)
            [spec] = requirement.specifier
            assert spec.operator == "==", f"{path}: {line!r} is not a pin"
            pins[canonicalize_name(requirement.name)] = spec.version
    return pins


def _extra(name: str) -> list[Requirement]:
    """An extra's requirements, with ``mage-jax[other]`` entries expanded."""
    out = []
    for line in PYPROJECT["project"]["optional-dependencies"][name]:
        requirement = Requirement(line)
        if canonicalize_name(requirement.name) == "mage-jax":
            out += [r for other in sorted(requirement.extras) for r in _extra(other)]
        else:
            out.append(requirement)
    return out


def _closure(requirements: list[Requirement]) -> dict[str, importlib.metadata.Distribution]:
    """Every installed distribution the requirements pull in (markers evaluated here, no extras of
    dependencies); requirements not installed are left out."""
    found: dict[str, importlib.metadata.Distribution] = {}
    todo = [r for r in requirements if r.marker is None or r.marker.evaluate()]
    while todo:
        name = canonicalize_name(todo.pop().name)
        if name in found:
            continue
        try:
            found[name] = dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        for line in dist.requires or ():
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement)
    return found


def test_every_optional_test_dependency_is_in_the_extra_tests_optional_names():
    for module, (distribution, extra) in EXTRAS.items():
        names = {canonicalize_name(r.name) for r in _extra(extra)}
        assert canonicalize_name(distribution) in names, f"{module}: {distribution} is not in .[{extra}]"


def test_the_test_extra_leaves_the_opt_in_extras_out():
    names = {canonicalize_name(r.name) for r in _extra("test")}
    for opt_in in ("oracle", "alfworld"):
        assert not names & {canonicalize_name(r.name) for r in _extra(opt_in)}, opt_in


def test_the_test_extra_pulls_in_no_nightly():
    """Nothing ``.[test]`` pulls in here is a nightly (a dev release or a ``*-nightly`` package), which
    would change from one day to the next. (Pre-releases that a dependency pins exactly, like wandb's
    OpenTelemetry betas, do not move.) That it installs from wheels alone, with no C++ toolchain, .ci/run
    checks by resolving it from scratch with ``--only-binary=:all:``."""
    closure = _closure(_extra("test"))
    if os.environ.get(REQUIRE_VAR) == "1":
        assert {"pytest", "open-spiel", "gguf", "wandb"} <= set(closure)
    elif "pytest-xdist" not in closure:
        pytest.skip("the test extra is not installed here")
    nightly = sorted(f"{name} {dist.version}" for name, dist in closure.items()
                     if Version(dist.version).is_devrelease or name.endswith("-nightly"))
    assert nightly == [], f"nightly in the test extra: {nightly}"


@pytest.mark.skipif(not os.environ.get(DEFAULT_CONSTRAINTS_VAR),
                    reason="only in .ci/run's default environment")
def test_the_default_environment_holds_exactly_its_pinned_releases():
    """.ci/run installs the default environment under .ci/constraints-default.txt (every release it
    resolved when the pins were written, .ci/pin-default): nothing in it moves on a release day."""
    pins = _pins(os.environ[DEFAULT_CONSTRAINTS_VAR])
    assert {"jax", "flax", "torch", "transformers", "rlax", "textworld", "open-spiel"} <= set(pins)
    installed = {}
    for name in pins:
        try:
            installed[name] = Version(importlib.metadata.version(name)).public  # torch 2.13.0+cpu: 2.13.0
        except importlib.metadata.PackageNotFoundError:
            installed[name] = None
    assert installed == pins


def test_optional_test_dependencies_are_imported_through_the_one_helper():
    direct = [str(p.relative_to(TESTS)) for p in TESTS.rglob("*.py")
              if p.name != "optional.py" and re.search(r"importorskip\(|^\s*(import|from) torch\b",
                                                       p.read_text(), re.M)]
    assert direct == [], "use tests.optional.require(...) so that the default CI cannot skip them"


@pytest.mark.skipif(os.environ.get(REQUIRE_VAR) != "1", reason=f"{REQUIRE_VAR} is not set")
def test_the_default_environment_has_every_optional_test_dependency():
    missing = [name for name in EXTRAS if importlib.util.find_spec(name) is None]
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
