"""Specification of mage_jax.progress: a bar in a terminal, plain periodic lines in a log."""

from __future__ import annotations

import io

import pytest
from tqdm.auto import tqdm

from mage_jax import progress
from mage_jax.progress import LineProgress, NoBar, progress_bar


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(progress.time, "monotonic", clock)
    return clock


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_lines_and_a_terminal_gets_a_bar(monkeypatch):
    monkeypatch.setattr(progress.sys, "stderr", io.StringIO())
    assert isinstance(progress_bar(total=3, desc="train", enabled=True), LineProgress)
    monkeypatch.setattr(progress.sys, "stderr", Terminal())
    bar = progress_bar(total=3, desc="train", enabled=True)
    assert isinstance(bar, tqdm)
    bar.close()
    assert isinstance(progress_bar(total=3, desc="train", enabled=False), NoBar)


def test_lines_come_at_each_tenth_and_carry_the_numbers_of_their_count(clock):
    out = io.StringIO()
    bar = LineProgress(total=20, desc="train", unit="iterations", stream=out, interval=30)
    for i in range(1, 21):
        clock.now += 1
        bar.update(1)
        bar.set_postfix({"iteration": i})
    bar.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    # the start, then every second iteration (a tenth of 20); the last state was already written
    assert len(lines) == 11
    assert lines[0] == "train: 0/20 iterations (0%), 0m00s elapsed"
    assert lines[1] == "train: 2/20 iterations (10%), 0m02s elapsed, ~0m18s left | iteration=2"
    assert lines[-1] == "train: 20/20 iterations (100%), 0m20s elapsed | iteration=20"


def test_between_tenths_a_line_comes_every_interval_while_the_text_moves(clock):
    out = io.StringIO()
    bar = LineProgress(total=100, desc="eval:eval", unit="meta-episodes", stream=out, interval=30)
    bar.set_postfix_str("0 turns")
    for turns in range(1, 100):  # one turn a second, no meta-episode finished: a batch still running
        clock.now += 1
        bar.set_postfix_str(f"{turns} turns")
    lines = out.getvalue().splitlines()
    assert [line.partition(" | ")[2] for line in lines] == ["", "30 turns", "60 turns", "90 turns"]
    assert lines[1] == "eval:eval: 0/100 meta-episodes (0%), 0m30s elapsed | 30 turns"
    bar.close()
    assert out.getvalue().splitlines()[-1].endswith("| 99 turns")


def test_close_writes_the_last_state_once(clock):
    out = io.StringIO()
    bar = LineProgress(total=4, desc="train", stream=out, interval=30)
    bar.set_description("final evaluation")
    bar.set_postfix_str("measuring iteration 3")
    bar.close()
    bar.close()
    assert out.getvalue().splitlines() == [
        "train: 0/4 it (0%), 0m00s elapsed",
        "final evaluation: 0/4 it (0%), 0m00s elapsed | measuring iteration 3"]


def test_the_interval_comes_from_the_environment(monkeypatch):
    monkeypatch.setattr(progress.sys, "stderr", io.StringIO())
    monkeypatch.setenv("MAGE_PROGRESS_SECONDS", "5")
    assert progress_bar(total=1, desc="x", enabled=True).interval == 5.0
    monkeypatch.setenv("MAGE_PROGRESS_SECONDS", "soon")
    assert progress_bar(total=1, desc="x", enabled=True).interval == progress.DEFAULT_INTERVAL
