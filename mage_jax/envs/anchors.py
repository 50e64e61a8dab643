"""Anchor strings: the one place that defines GiGPO's step-level grouping keys (docs/method.md §1, §5, §6)."""

from __future__ import annotations


def play_anchor(observation: str, opponent: str | None) -> str:
    """Anchor of a play row: the raw observation plus the opponent name (games)."""
    return observation if opponent is None else f"{observation} || opponent: {opponent}"


def reflection_anchor(opponent: str | None) -> str:
    """All reflection rows of a group share this anchor."""
    return "reflection" if opponent is None else f"reflection || opponent: {opponent}"


def local_anchor(anchor: str, episode: int) -> str:
    """The 'local anchor' ablation: the same state in different episodes is not pooled."""
    return f"episode {episode} || {anchor}"
