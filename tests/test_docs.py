"""The project's references stay inside the repository.

Code and docs cite the method description as ``docs/method.md §N``. Every tracked file must cite
only sections that docs/method.md has, never the external specification it replaced, and the
docs must not name paths of the machine they were written on. The LICENSE file is the one
pyproject.toml declares.
"""

from __future__ import annotations

import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
METHOD = ROOT / "docs" / "method.md"

NUMBER = r"\d+(?:\.\d+)*"
SECTION_REF = re.compile(rf"§({NUMBER})(?:-({NUMBER}))?")
METHOD_SECTION_REF = re.compile(rf"\bmethod sections? ({NUMBER})", re.IGNORECASE)
HEADING = re.compile(rf"^#{{2,3}} ({NUMBER}) ", re.MULTILINE)
EXTERNAL_SPEC = re.compile(
    "|".join([re.escape("MAGE_SPEC"), re.escape("../shared"), r"\bspec sections?\b", rf"\bspec {NUMBER}\b",
              r"\bspec's\b", r"\bthe spec\b"]),
    re.IGNORECASE,
)
MACHINE_PATH = re.compile(r"(?<![\w.~])/(?:work|root|home|tmp|Users)/")


def tracked_text_files() -> dict[str, str]:
    """Tracked text files by path, this one excepted (its examples must match the patterns); skips the
    test when this is not a git checkout."""
    try:
        listing = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files are unknown")
    files = {}
    for name in listing.stdout.decode().split("\0"):
        path = ROOT / name
        if not name or not path.is_file() or path == pathlib.Path(__file__).resolve():
            continue
        data = path.read_bytes()
        if b"\0" in data:
            continue
        try:
            files[name] = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
    return files


def method_sections(text: str) -> set[str]:
    """Section numbers of docs/method.md: its ``## N`` and ``### N.M`` headings."""
    return set(HEADING.findall(text))


def cited_sections(text: str) -> list[str]:
    """Every section number a text cites as ``§N``, ``§N-M`` (both ends) or "method section N"."""
    cited = [n for pair in SECTION_REF.findall(text) for n in pair if n]
    return cited + METHOD_SECTION_REF.findall(text)


def external_references(text: str) -> list[str]:
    return [m.group(0) for m in EXTERNAL_SPEC.finditer(text)]


def machine_paths(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if MACHINE_PATH.search(line)]


# --------------------------------------------------------------------------------------------------
# the detectors themselves


def test_cited_sections_reads_single_ranges_lists_and_words():
    text = "see docs/method.md §4-5 and §7.1, §9; method section 12"
    assert cited_sections(text) == ["4", "5", "7.1", "9", "12"]


def test_external_references_are_found_in_every_old_form():
    for text in ["MAGE_SPEC.md", "(spec section 5)", "Spec sections 2 and 3", "(spec 7.4)",
                 "the spec's example", "see ../shared/spec"]:
        assert external_references(text), text
    assert not external_references("PartitionSpec('data'); a bad spec is an error; PromptSpec")


def test_machine_paths_are_found_but_user_placeholders_are_not():
    assert machine_paths("measured in `/work/shared/notes/x.md`") != []
    assert machine_paths("see /tmp/run") != []
    assert machine_paths("cd ~/mage-jax; --model-path /mnt/shared/Qwen3-4B; runs/x/tmp/y") == []


# --------------------------------------------------------------------------------------------------
# the repository


def test_method_description_has_the_numbered_sections_the_code_cites():
    sections = method_sections(METHOD.read_text(encoding="utf-8"))
    expected = {str(n) for n in range(1, 12)} | {f"7.{n}" for n in range(1, 7)}
    assert expected <= sections


def test_no_tracked_file_cites_the_external_specification():
    found = {name: refs for name, text in tracked_text_files().items() if (refs := external_references(text))}
    assert found == {}


def test_every_section_reference_names_a_section_of_the_method_description():
    sections = method_sections(METHOD.read_text(encoding="utf-8"))
    missing = {}
    for name, text in tracked_text_files().items():
        cited = cited_sections(text)
        unknown = sorted({n for n in cited if n not in sections})
        if unknown:
            missing[name] = unknown
        elif cited and name != "docs/method.md" and "method.md" not in text:
            missing[name] = ["§ used without naming docs/method.md"]
    assert missing == {}


def test_docs_name_no_paths_of_the_build_machine():
    docs = {name: text for name, text in tracked_text_files().items()
            if name == "README.md" or re.fullmatch(r"docs/[^/]+\.md", name)}
    assert "docs/performance.md" in docs
    found = {name: lines for name, text in docs.items() if (lines := machine_paths(text))}
    assert found == {}


def test_license_is_the_apache_license_that_pyproject_declares():
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")  # no tomllib on Python 3.10
    assert re.search(r'^license = "Apache-2.0"$', pyproject, re.MULTILINE)
    assert re.search(r'^license-files = \["LICENSE"\]$', pyproject, re.MULTILINE)
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "END OF TERMS AND CONDITIONS" in text
    assert "Copyright 2026 The mage-jax authors" in text


TEST_REF = re.compile(r"`(?:([\w/]+\.py))?::(test_\w+)")


@pytest.mark.parametrize("doc", ["docs/reliability.md", "docs/preemption.md"])
def test_every_test_a_promise_names_exists(doc):
    """The reliability and preemption tables back each promise with a test (``path.py::name``, or
    ``::name`` for another test of the file named before it): each one is a test function of that file."""
    missing, file = [], None
    refs = TEST_REF.findall((ROOT / doc).read_text())
    assert refs
    for path, name in refs:
        file = path or file
        source = (ROOT / "tests" / file).read_text()
        if not re.search(rf"^def {name}\(", source, re.MULTILINE):
            missing.append(f"{file}::{name}")
    assert not missing, missing
