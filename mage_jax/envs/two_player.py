"""What the two-player game environments (Kuhn Poker, Tic-Tac-Toe) share: the task-instance checks of
``reset``, the turn budget that every agent turn uses up (invalid ones included), and the invalid turn.

A subclass keeps ``_player`` (its opponent, None before ``reset``), ``_turns`` and ``_timed_out``, and
implements ``done`` (game decided or timed out), ``_agent_move`` and ``_result``.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any

import numpy as np

from mage_jax.envs.base import StepResult, TextEnv


class TwoPlayerGameEnv(TextEnv):
    """One meta-episode of a game against one opponent, the agent in seat 0 (first) or 1 (second)."""

    default_opponent: str
    default_seat: int
    _player: Any = None
    _turns: int
    _timed_out: bool

    @property
    @abc.abstractmethod
    def done(self) -> bool:
        """The game is decided or ran out of turns."""

    @abc.abstractmethod
    def _agent_move(self, action: str) -> tuple[str | None, str]:
        """Apply the agent's action and the opponent's answer: (canonical action text, "") once applied,
        (None, reason) with nothing changed when the action is invalid."""

    @abc.abstractmethod
    def _result(self, *, valid: bool, action: str | None) -> StepResult:
        """The step result of the current state (the reward only when ``valid``)."""

    def _check_opponent(self, name: Any) -> None:
        """Raise ValueError for an unknown opponent name, before anything else is checked."""

    def _begin_task(self, seed: int, opponent: str | None, seat: int | None) -> str:
        """Resolve the defaults, check opponent, seat and seed, fix seed and seat; returns the opponent."""
        opponent = self.default_opponent if opponent is None else opponent
        seat = self.default_seat if seat is None else seat
        self._check_opponent(opponent)
        check_seat(seat)
        if not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        self._seed = int(seed)
        self._seat = int(seat)
        return opponent

    def step_action(self, action: str) -> StepResult:
        if self._player is None:
            raise RuntimeError("call reset(seed) before step()")
        if self.done:
            return self.invalid_step("the game is over")
        applied, reason = self._agent_move(action)
        if applied is None:
            return self.invalid_step(reason)
        self._use_turn()
        return self._result(valid=True, action=applied)

    def invalid_step(self, reason: str) -> StepResult:
        """Nothing changes but the turn is used up; the last allowed turn ends the game (reward 0)."""
        if self._player is not None and not self.done:
            self._use_turn()
        result = self._result(valid=False, action=None)
        info = dataclasses.replace(result.info, extra={**result.info.extra, "invalid_reason": reason})
        return StepResult(result.observation, 0.0, result.done, info, None)

    def _use_turn(self) -> None:
        """Count one agent turn; an undecided game that reaches ``max_turns`` ends (a timeout)."""
        self._turns += 1
        if not self.done and self._turns >= self.max_turns:
            self._timed_out = True

    @property
    def seat(self) -> int:
        return self._seat

    @property
    def turns(self) -> int:
        return self._turns


def check_seat(seat: Any) -> None:
    if seat not in (0, 1):
        raise ValueError(f"seat must be 0 (agent first) or 1 (agent second), got {seat!r}")


def preview(text: Any, limit: int = 40) -> str:
    """``repr`` of a model's text cut to ``limit`` characters, for error reasons."""
    text = repr(text)
    return text if len(text) <= limit else text[: limit - 3] + "..."
