"""What the model wrote: the prompts, responses and reflections of a few meta-episodes, decoded from
their rows, for ``samples.jsonl`` in the run directory and TensorBoard's text tab.

Metrics alone hide a model that writes nothing usable (a model with no valid action can look fine on
payoff when unfinished episodes score 0); a few transcripts per evaluation show it at once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from mage_jax.rollout.rows import Row


@dataclasses.dataclass(frozen=True)
class Sample:
    """One LLM call of a sampled meta-episode."""

    meta_episode: int
    episode: int
    """Counted from 1 (the first attempt), as in the log keys and tables."""
    turn: int
    phase: str
    """``play`` or ``reflect``."""
    opponent: str | None
    valid: bool
    env_reward: float
    prompt: str
    response: str


def sample_rows(rows: Sequence[Row], tokenizer: Any, meta_episodes: int) -> tuple[Sample, ...]:
    """The calls of the first ``meta_episodes`` meta-episodes of ``rows``, in play order, decoded."""
    if meta_episodes <= 0 or tokenizer is None:
        return ()
    kept = set(sorted({r.meta_episode for r in rows})[:meta_episodes])
    return tuple(
        Sample(meta_episode=int(r.meta_episode), episode=int(r.episode) + 1, turn=int(r.turn), phase=r.phase,
               opponent=r.opponent, valid=bool(r.valid), env_reward=float(r.env_reward),
               prompt=tokenizer.decode(list(r.prompt_ids), skip_special_tokens=False),
               response=tokenizer.decode(list(r.response_ids), skip_special_tokens=False))
        for r in rows if r.meta_episode in kept)


def render_markdown(samples: Sequence[Sample]) -> str:
    """The samples as one markdown text (TensorBoard text summaries render markdown)."""
    parts = []
    for s in samples:
        head = (f"**meta-episode {s.meta_episode}, episode {s.episode}, turn {s.turn}, {s.phase}** "
                f"(opponent {s.opponent}, {'valid' if s.valid else 'INVALID'}, reward {s.env_reward:+g})")
        parts.append(f"{head}\n\n```\n{s.prompt}\n```\n\n-> `{s.response}`")
    return "\n\n---\n\n".join(parts)
