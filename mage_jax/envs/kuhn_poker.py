"""Kuhn Poker (docs/method.md §7.1): the agent against one scripted or CFR opponent, in either seat.

Rules and payoffs are OpenSpiel's ``kuhn_poker``: deck Jack < Queen < King, both players ante 1,
player 0 acts first, PASS (0) checks or folds, BET (1) bets or calls. A bet followed by a pass
wins the pot for the bettor; pass-pass and bet-bet go to showdown (higher card wins 1 or 2 chips).
Histories are written as OpenSpiel writes them (``p`` / ``b`` per action, e.g. ``"pb"``).

A task instance is a deal: ``kuhn_deal(seed)`` maps a seed to (agent card, opponent card)
independently of the seat, so the same seed gives the agent the same card in either seat. The
agent's reward is 5 x its payoff at the terminal step and 0 otherwise. Every agent turn counts,
invalid ones included; after ``max_turns`` (6) turns an unfinished game ends with reward 0
(``info.extra["timeout"]``).
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

import numpy as np

from mage_jax.envs.base import PromptSpec, StepInfo, StepResult, register_env
from mage_jax.envs.opponents.kuhn import (
    ACTION_LETTERS,
    BET,
    CARD_NAMES,
    KUHN_HELD_OUT_OPPONENTS,
    KUHN_OPPONENTS,
    KUHN_TRAINING_POOL,
    PASS,
    KuhnPlayer,
    make_kuhn_opponent,
)
from mage_jax.envs.two_player import TwoPlayerGameEnv, check_seat, preview

__all__ = [
    "KUHN_HELD_OUT_OPPONENTS",
    "KUHN_PROMPT_SPEC",
    "KUHN_TRIAL_HINT_PROMPT_SPEC",
    "KUHN_TRAINING_POOL",
    "KuhnPokerEnv",
    "kuhn_current_player",
    "kuhn_deal",
    "kuhn_is_terminal",
    "kuhn_observation",
    "kuhn_prompt_spec",
    "kuhn_returns",
]

ACTION_TEXTS = ("PASS", "BET")
REWARD_PER_CHIP = 5.0
TERMINAL_HISTORIES = frozenset({"pp", "bp", "bb", "pbp", "pbb"})

_TRIAL_HINT = (
    " Every trial replays the same deal (your card and the opponent's card) against the same "
    "opponent, whose habits you can learn."
)
_COMPACT_TRIAL_HINT = "Same deal and opponent every trial. "


def kuhn_prompt_spec(*, trial_hint: bool = False) -> PromptSpec:
    """The Kuhn Poker prompt text; ``trial_hint`` adds the sentence that every trial replays the same
    deal against the same opponent (not in the reference prompt; see ``KuhnPokerEnv``)."""
    return PromptSpec(
        preamble=(
            "You are playing Kuhn Poker against an opponent.\n"
            "Rules: the deck has three cards, Jack < Queen < King. Each player puts 1 chip in the pot and "
            "gets one card; you never see the opponent's card. Player 0 acts first, then the players "
            "alternate. On your turn you choose PASS or BET. With no bet on the table, PASS checks and BET "
            "adds 1 chip. Facing a bet, PASS folds (the bettor takes the pot) and BET calls by adding "
            "1 chip. If both players check, or a bet is called, the higher card wins the pot. The winner "
            "of a game takes 1 or 2 chips from the loser.\n"
            "You may be Player 0 or Player 1: on your turn you are Player 0 if an even number of actions "
            f"has been taken, otherwise Player 1.{_TRIAL_HINT if trial_hint else ''}\n"
            "Goal: win the game, that is finish with a positive number of chips, and win as many chips "
            "as possible.\n"
            "Action format: <action>PASS</action> or <action>BET</action>."
        ),
        compact_preamble=(
            "Kuhn poker. Cards Jack < Queen < King. You see only your card. Player 0 acts first. "
            "PASS checks or folds. BET bets or calls. Higher card wins a showdown. "
            f"{_COMPACT_TRIAL_HINT if trial_hint else ''}"
            "Win chips. Answer <action>PASS</action> or <action>BET</action>."
        ),
        action_format="<action>PASS</action> or <action>BET</action>",
        history_window=7,
    )


KUHN_PROMPT_SPEC = kuhn_prompt_spec()
"""The reference's information: rules, seat, goal and format, nothing about how trials relate."""
KUHN_TRIAL_HINT_PROMPT_SPEC = kuhn_prompt_spec(trial_hint=True)


def kuhn_deal(seed: int) -> tuple[int, int]:
    """(agent card, opponent card) of task instance ``seed``; cards are 0 = Jack, 1 = Queen, 2 = King."""
    first, second = np.random.default_rng(seed).permutation(3)[:2]
    return int(first), int(second)


def kuhn_current_player(history: str) -> int:
    return len(history) % 2


def kuhn_is_terminal(history: str) -> bool:
    return history in TERMINAL_HISTORIES


def kuhn_returns(cards: tuple[int, int], history: str) -> tuple[int, int]:
    """Chips won by (player 0, player 1) at a terminal history; ``cards`` are (player 0's, player 1's)."""
    if not kuhn_is_terminal(history):
        raise ValueError(f"history {history!r} is not terminal")
    if history.endswith("bp"):
        winner, amount = 1 - kuhn_current_player(history[:-1]), 1  # the folder's opponent
    else:
        winner, amount = (0 if cards[0] > cards[1] else 1), (2 if "b" in history else 1)
    return (amount, -amount) if winner == 0 else (-amount, amount)


_OBSERVATION = re.compile(r"Your Card: (?P<card>\w+) \| Actions: (?P<actions>[^|]*?)\s*(?:\||$)")


def kuhn_observation(card: int, history: str) -> str:
    """``Your Card: Queen | Actions: Player 0: Pass -> Player 1: Bet`` (never the opponent's card)."""
    if history:
        moves = " -> ".join(
            f"Player {i % 2}: {'Bet' if letter == 'b' else 'Pass'}" for i, letter in enumerate(history)
        )
    else:
        moves = "No actions yet"
    return f"Your Card: {CARD_NAMES[card]} | Actions: {moves}"


def _result_text(payoff: int) -> str:
    chips = f"{abs(payoff)} chip{'s' if abs(payoff) != 1 else ''}"
    return f"Result: You won {chips}" if payoff > 0 else f"Result: You lost {chips}"


@register_env("kuhn_poker")
class KuhnPokerEnv(TwoPlayerGameEnv):
    """One meta-episode of Kuhn Poker against a fixed opponent and seat.

    The observation after the game ends also states the result (chips won or lost), which the
    trajectory shown in reflect prompts needs; it still never reveals the opponent's card.

    ``trial_hint=True`` tells the agent in the preamble that every trial replays the same deal against
    the same opponent. The reference prompt does not say so, and a pretrained model acts differently
    when told, so it is off by default (the ``small`` and ``paper`` presets). The ``tiny`` preset
    turns it on: its from-scratch model reads the same compact prompt it was designed with.
    """

    reward_scale: ClassVar[float] = REWARD_PER_CHIP
    max_turns: int = 6
    prompt_spec: PromptSpec = KUHN_PROMPT_SPEC
    opponent_pool: ClassVar[dict[str, float]] = dict(KUHN_TRAINING_POOL)
    held_out_opponents: ClassVar[tuple[str, ...]] = KUHN_HELD_OUT_OPPONENTS
    opponent_names: ClassVar[tuple[str, ...]] = KUHN_OPPONENTS

    def __init__(
        self,
        *,
        opponent: str = "intermediate",
        seat: int = 0,
        max_turns: int = 6,
        replayable_restarts: bool = False,
        trial_hint: bool = False,
    ):
        self._check_opponent(opponent)
        check_seat(seat)
        if int(max_turns) < 2:
            raise ValueError(f"max_turns must be at least 2 (two agent decisions), got {max_turns}")
        self.max_turns = int(max_turns)
        self.default_opponent = opponent
        self.default_seat = seat
        self.prompt_spec = KUHN_TRIAL_HINT_PROMPT_SPEC if trial_hint else KUHN_PROMPT_SPEC
        # Every Kuhn opponent is deterministic, so restarts are always replayable; the option exists
        # for a uniform environment interface.
        self.replayable_restarts = replayable_restarts
        self._seed: int | None = None
        self._player: KuhnPlayer | None = None

    # ----------------------------------------------------------------------------- task instance
    def reset(self, seed: int, *, opponent: str | None = None, seat: int | None = None,
              copy: int = 0) -> str:
        opponent = self._begin_task(seed, opponent, seat)
        self._agent_card, self._opponent_card = kuhn_deal(self._seed)
        self._player = make_kuhn_opponent(opponent)
        return self.restart()

    def restart(self) -> str:
        if self._player is None:
            raise RuntimeError("call reset(seed) before restart()")
        self._history = ""
        self._turns = 0
        self._payoff: int | None = None
        self._timed_out = False
        self._opponent_moves()
        return self.observation

    # ----------------------------------------------------------------------------- playing
    def _agent_move(self, action: str) -> tuple[str | None, str]:
        text = action.strip() if isinstance(action, str) else ""
        if text not in ACTION_TEXTS:
            return None, f"expected PASS or BET, got {preview(action)}"
        self._history += ACTION_LETTERS[PASS if text == "PASS" else BET]
        self._opponent_moves()
        return text, ""

    def legal_actions(self) -> list[str]:
        return [] if self._player is None or self.done else list(ACTION_TEXTS)

    # ----------------------------------------------------------------------------- views
    @property
    def done(self) -> bool:
        return self._payoff is not None or self._timed_out

    @property
    def observation(self) -> str:
        if self._player is None:
            raise RuntimeError("call reset(seed) before reading the observation")
        text = kuhn_observation(self._agent_card, self._history)
        return text if self._payoff is None else f"{text} | {_result_text(self._payoff)}"

    @property
    def opponent(self) -> str | None:
        return None if self._player is None else self._player.name

    @property
    def history(self) -> str:
        """The public betting history in OpenSpiel's letters (``p`` / ``b``)."""
        return self._history

    @property
    def task_info(self) -> dict[str, Any]:
        if self._player is None:
            return {}
        return {
            "seed": self._seed,
            "seat": self._seat,
            "opponent": self._player.name,
            "cards": (CARD_NAMES[self._agent_card], CARD_NAMES[self._opponent_card]),
            "agent_card": self._agent_card,
            "opponent_card": self._opponent_card,
        }

    @staticmethod
    def split_private(observation: str) -> tuple[str, str] | None:
        """(``Queen``, ``No actions yet``) of ``Your Card: Queen | Actions: No actions yet``."""
        match = _OBSERVATION.search(observation)
        return None if match is None else (match["card"], match["actions"])

    def privileged_observation(self) -> str | None:
        """Both cards, for training reflect prompts only (the reference's privileged reflection)."""
        if self._player is None:
            return None
        agent, opponent = CARD_NAMES[self._agent_card], CARD_NAMES[self._opponent_card]
        return f"Your Card: {agent} | Opponent's Card: {opponent}"

    # ----------------------------------------------------------------------------- internals
    def _check_opponent(self, name: Any) -> None:
        if name not in KUHN_OPPONENTS:
            raise ValueError(f"unknown Kuhn Poker opponent {name!r}; known: {', '.join(KUHN_OPPONENTS)}")

    def _cards_by_player(self) -> tuple[int, int]:
        if self._seat == 0:
            return self._agent_card, self._opponent_card
        return self._opponent_card, self._agent_card

    def _opponent_moves(self) -> None:
        """Let the opponent act while it is its turn, then settle a finished game."""
        while not kuhn_is_terminal(self._history) and kuhn_current_player(self._history) != self._seat:
            self._history += ACTION_LETTERS[self._player.act(self._opponent_card, self._history)]
        if kuhn_is_terminal(self._history):
            self._payoff = kuhn_returns(self._cards_by_player(), self._history)[self._seat]

    def _result(self, *, valid: bool, action: str | None) -> StepResult:
        payoff = self._payoff
        reward = REWARD_PER_CHIP * payoff if (valid and payoff is not None) else 0.0
        info = StepInfo(
            won=payoff is not None and payoff > 0,
            draw=False,
            valid=valid,
            score=float(payoff) if payoff is not None else 0.0,
            opponent=self._player.name,
            extra={"payoff": payoff, "timeout": self._timed_out, "turn": self._turns},
        )
        return StepResult(self.observation, float(reward), self.done, info, action)
