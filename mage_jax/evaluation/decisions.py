"""What a rollout's decisions depend on: the training diagnostics behind a collapsed or an adaptive run.

A run that ends in a fixed, non-adaptive strategy shows it here before it shows in the payoff:

* ``entropy[k]`` — the mean of ``-log pi(response)`` over the play rows of list index ``k`` (episode
  k + 1; logged as ``entropy_play@<episode>``), in nats: a Monte-Carlo estimate of the policy's
  entropy over whole responses at the sampling temperature. Near 0, the policy no longer explores in
  that episode.
* ``private_dependence`` — in the first episode (no memory yet), for each public situation (Kuhn: the
  betting so far), the largest total-variation distance between the empirical response distributions
  given two values of the private information (Kuhn: the card), averaged over situations weighted by
  rows. 0: the decisions ignore the card; 1: the card decides them completely.
* ``dependent_share`` — the share of first-episode decisions taken in situations whose distance is at
  least one half (the "card-dependent decisions").

The private / public split comes from the environment (``TextEnv.split_private``); environments
without one get only the entropies.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from itertools import combinations
from typing import Any

import numpy as np

from mage_jax.evaluation.metrics import episode_key

DEPENDENT = 0.5
"""Total-variation distance from which a situation counts as decided by the private information."""


@dataclasses.dataclass(frozen=True)
class DecisionStats:
    entropy: tuple[float, ...]
    """Per episode index: mean ``-log pi(response)`` of its play rows (nan: no row)."""
    reflect_entropy: float | None
    """The same over reflect rows (None: no reflect row)."""
    private_dependence: float | None
    """First-episode dependence of responses on the private information (None: no split)."""
    dependent_share: float | None
    """Share of first-episode decisions in situations with dependence >= ``DEPENDENT``."""

    def metrics(self) -> dict[str, float]:
        """Flat metrics for the training log: ``entropy_play@k`` (episode k, from 1), ``entropy_reflect``,
        ``private_*``."""
        out = {episode_key("entropy_play", k): v for k, v in enumerate(self.entropy)}
        if self.reflect_entropy is not None:
            out["entropy_reflect"] = self.reflect_entropy
        if self.private_dependence is not None:
            out["private_dependence"] = self.private_dependence
            out["dependent_share"] = float(self.dependent_share)
        return out


def total_variation(a: Counter, b: Counter) -> float:
    """Total-variation distance between the empirical distributions of two response counters."""
    na, nb = sum(a.values()), sum(b.values())
    return 0.5 * sum(abs(a[k] / na - b[k] / nb) for k in set(a) | set(b))


def decision_stats(rows: Sequence[Any], num_episodes: int,
                   split_private: Callable[[str], tuple[str, str] | None] | None = None) -> DecisionStats:
    """Diagnostics of ``rows`` (``mage_jax.rollout.rows.Row``); see the module docstring."""
    nll: dict[int, list[float]] = defaultdict(list)
    reflect: list[float] = []
    cells: dict[str, dict[str, Counter]] = defaultdict(lambda: defaultdict(Counter))
    for row in rows:
        value = -float(np.sum(row.logprobs))
        if row.is_reflect:
            reflect.append(value)
            continue
        nll[row.episode].append(value)
        parts = split_private(row.anchor) if split_private is not None and row.episode == 0 else None
        if parts is not None:
            private, public = parts
            cells[public][private][tuple(int(t) for t in row.response_ids)] += 1
    entropy = tuple(float(np.mean(nll[k])) if nll[k] else float("nan") for k in range(num_episodes))
    if not cells:
        return DecisionStats(entropy, float(np.mean(reflect)) if reflect else None, None, None)
    weights, distances = [], []
    for by_private in cells.values():
        pairs = [total_variation(a, b) for a, b in combinations(by_private.values(), 2)]
        weights.append(sum(sum(c.values()) for c in by_private.values()))
        distances.append(max(pairs, default=0.0))
    w, d = np.asarray(weights, float), np.asarray(distances)
    return DecisionStats(entropy, float(np.mean(reflect)) if reflect else None,
                         float(np.sum(w * d) / np.sum(w)), float(np.sum(w * (d >= DEPENDENT)) / np.sum(w)))
