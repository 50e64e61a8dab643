"""Kuhn Poker opponents (docs/method.md §7.1): three scripted training players and the held-out CFR player.

A player sees its own card and the public betting history, written as OpenSpiel writes it: one
letter per action, ``p`` for PASS (check or fold) and ``b`` for BET (bet or call). "Facing a bet"
means a bet is in the history. All players here are deterministic, which is what makes the
winnability oracle (``mage_jax.evaluation.oracle``) exact.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

JACK, QUEEN, KING = 0, 1, 2
CARD_NAMES = ("Jack", "Queen", "King")
PASS, BET = 0, 1
ACTION_LETTERS = ("p", "b")

KUHN_TRAINING_POOL: Mapping[str, float] = {"conservative": 0.3, "aggressive": 0.3, "intermediate": 0.4}
"""Training opponents and their share of the groups (docs/method.md §7.1)."""

KUHN_HELD_OUT_OPPONENTS: tuple[str, ...] = ("cfr",)
"""Evaluation-only opponents (the agent sits second against them)."""


def facing_bet(history: str) -> bool:
    return "b" in history


class KuhnPlayer:
    """A deterministic Kuhn Poker player: (own card, public history) -> PASS or BET."""

    def __init__(self, name: str, decide: Callable[[int, str], int]):
        self.name = name
        self._decide = decide

    def act(self, card: int, history: str) -> int:
        return self._decide(card, history)

    def __repr__(self) -> str:
        return f"KuhnPlayer({self.name!r})"


def _conservative(card: int, history: str) -> int:
    """Bet or call only with the King; otherwise check or fold."""
    return BET if card == KING else PASS


def _aggressive(card: int, history: str) -> int:
    """Bet whenever no bet was made; facing a bet, fold the Jack and call otherwise."""
    if not facing_bet(history):
        return BET
    return PASS if card == JACK else BET


def _intermediate(card: int, history: str) -> int:
    """King bets / calls, Jack checks / folds, Queen bets when no bet was made and folds to a bet."""
    if card == KING:
        return BET
    if card == JACK:
        return PASS
    return PASS if facing_bet(history) else BET


def _cfr() -> Callable[[int, str], int]:
    from mage_jax.envs.opponents.cfr import load_cfr_policy

    actions = load_cfr_policy()["action"]

    def decide(card: int, history: str) -> int:
        return int(actions[f"{card}{history}"])

    return decide


_FACTORIES: dict[str, Callable[[], Callable[[int, str], int]]] = {
    "conservative": lambda: _conservative,
    "aggressive": lambda: _aggressive,
    "intermediate": lambda: _intermediate,
    "cfr": _cfr,
}

KUHN_OPPONENTS: tuple[str, ...] = tuple(_FACTORIES)


def make_kuhn_opponent(name: str) -> KuhnPlayer:
    """The Kuhn Poker player called ``name``; unknown names get one clear error."""
    if name not in _FACTORIES:
        raise ValueError(f"unknown Kuhn Poker opponent {name!r}; known: {', '.join(KUHN_OPPONENTS)}")
    return KuhnPlayer(name, _FACTORIES[name]())
