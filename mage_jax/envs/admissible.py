"""Fitting a long admissible-action list into a prompt budget (ALFWorld, WebShop).

The runner lists ``env.legal_actions()`` in play prompts (docs/method.md §3, item 5) and shortens only
memory and history when a prompt is too long; the admissible list itself must therefore arrive
already bounded. Policy: an environment gives its list a character budget (``admissible_chars``,
about four characters per token) and a rank per action (lower = more useful now). Actions are
taken greedily in (rank, original position) order, each one kept if the list, joined by ", ", still
fits the budget with it (a long action that does not fit is skipped and shorter ones after it may
still fit); the kept ones are listed in their original order. The first-ranked action is always
kept, so the list is never empty while something is legal. Dropped actions are still accepted when
the model writes them; they are only not shown (nor offered to constrained decoding, which uses the
same list).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["SEPARATOR", "fit_admissible", "listed_chars"]

SEPARATOR = ", "


def listed_chars(actions: Sequence[str]) -> int:
    """Characters the list takes in a prompt (actions joined by ``SEPARATOR``)."""
    return sum(len(a) for a in actions) + len(SEPARATOR) * max(len(actions) - 1, 0)


def fit_admissible(actions: Sequence[str], max_chars: int | None,
                   rank: Callable[[str], int] | None = None) -> list[str]:
    """The sub-list of ``actions`` that fits ``max_chars`` by the module's policy (None: no limit)."""
    actions = list(actions)
    if max_chars is None or listed_chars(actions) <= max_chars:
        return actions
    order = sorted(range(len(actions)), key=lambda i: ((rank(actions[i]) if rank else 0), i))
    kept: set[int] = set()
    used = 0
    for i in order:
        cost = len(actions[i]) + (len(SEPARATOR) if kept else 0)
        if kept and used + cost > max_chars:
            continue
        kept.add(i)
        used += cost
    return [a for i, a in enumerate(actions) if i in kept]
