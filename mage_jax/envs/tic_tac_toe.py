"""Tic-Tac-Toe (docs/method.md §7.2): the agent is always X, also when the opponent (O) moves first.

Cells are numbered as OpenSpiel numbers them, ``row * 3 + col`` (0-based); a game is the list of
cells played, starting with whoever moves first (seat 0: the agent, seat 1: the opponent). The
action is ``<action>(row, col)</action>`` with 1-based coordinates; the first ``(int, int)`` pair
inside the tags counts. Reward +10 for a win, -10 for a loss, 0 for a draw, at the final step;
``info.score`` is reward / 10. Every agent turn counts, invalid ones included; after
``max_turns`` (8) turns an unfinished game ends with reward 0 (``info.extra["timeout"]``).

The opponent's opening move, when it moves first, is part of the task instance: a stochastic
opponent (MCTS, random) draws it from a generator seeded by the task seed alone, so every copy of a
group starts from the same position, and ``restart`` restores it. Its later moves come from a
generator seeded by (task seed, copy index): the G copies of a group meet independent opponent
noise, as in the reference, and each copy is still reproducible. They keep drawing from that
generator across restarts unless the environment is built with ``replayable_restarts=True``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from mage_jax.envs.base import PromptSpec, StepInfo, StepResult, register_env
from mage_jax.envs.opponents.tic_tac_toe import (
    TIC_TAC_TOE_HELD_OUT_OPPONENTS,
    TIC_TAC_TOE_TRAINING_POOL,
    TicTacToePlayer,
    make_tic_tac_toe_opponent,
)
from mage_jax.envs.parsing import extract_cell
from mage_jax.envs.two_player import TwoPlayerGameEnv, check_seat, preview

__all__ = [
    "TIC_TAC_TOE_HELD_OUT_OPPONENTS",
    "TIC_TAC_TOE_PROMPT_SPEC",
    "TIC_TAC_TOE_TRAINING_POOL",
    "TIC_TAC_TOE_TRIAL_HINT_PROMPT_SPEC",
    "TicTacToeEnv",
    "parse_cell",
    "tic_tac_toe_board",
    "tic_tac_toe_prompt_spec",
    "tic_tac_toe_winner",
]

WIN_REWARD = 10.0
LINES = ((0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6))
"""Rows, columns and diagonals."""

_TRIAL_HINT = (
    " Every trial starts from the same position against the same opponent, whose habits you can learn."
)
_COMPACT_TRIAL_HINT = "Same start and opponent every trial. "


def tic_tac_toe_prompt_spec(*, trial_hint: bool = False) -> PromptSpec:
    """The Tic-Tac-Toe prompt text; ``trial_hint`` adds the sentence that every trial starts from the
    same position against the same opponent (not in the reference prompt; see ``TicTacToeEnv``)."""
    return PromptSpec(
        preamble=(
            "You are playing Tic-Tac-Toe as X against an opponent who plays O.\n"
            "Rules: the board has 3 rows and 3 columns, shown as three lines where '.' is an empty cell. "
            "The players take turns marking one empty cell. Three of your marks in a row, a column or a "
            "diagonal win the game; a full board without such a line is a draw. You may move first or "
            f"second; you are X either way.{_TRIAL_HINT if trial_hint else ''}\n"
            "Goal: win the game; a draw is better than a loss.\n"
            "Action format: <action>(row, col)</action> with row and col from 1 to 3 counted from the top "
            "left, for example <action>(2, 2)</action> for the centre. The cell must be empty."
        ),
        compact_preamble=(
            "Tic tac toe. You are X, opponent is O, . is empty. Three in a line wins, full board draws. "
            f"{_COMPACT_TRIAL_HINT if trial_hint else ''}"
            "Answer <action>(row, col)</action>, row and col 1 to 3."
        ),
        action_format="<action>(row, col)</action> with row and col from 1 to 3",
        history_window=7,
    )


TIC_TAC_TOE_PROMPT_SPEC = tic_tac_toe_prompt_spec()
"""The reference's information: rules, marks, goal and format, nothing about how trials relate."""
TIC_TAC_TOE_TRIAL_HINT_PROMPT_SPEC = tic_tac_toe_prompt_spec(trial_hint=True)


def tic_tac_toe_winner(moves: Sequence[int]) -> int | None:
    """0 if the first mover has three in a line, 1 if the second mover has, else None."""
    for player in (0, 1):
        cells = set(moves[player::2])
        if any(a in cells and b in cells and c in cells for a, b, c in LINES):
            return player
    return None


def tic_tac_toe_board(moves: Sequence[int], agent_first: bool) -> str:
    """Three lines of ``.`` / ``X`` / ``O``, cells separated by spaces; the agent's marks are X."""
    cells = ["."] * 9
    for index, cell in enumerate(moves):
        cells[cell] = "X" if (index % 2 == 0) == agent_first else "O"
    return "\n".join(" ".join(cells[3 * row : 3 * row + 3]) for row in range(3))


def parse_cell(text: str) -> tuple[int | None, str]:
    """(cell index, "") for the first ``(row, col)`` pair of ``text``; (None, reason) when there is none."""
    pair = extract_cell(text)
    if pair is None:
        return None, f"expected (row, col), got {preview(text)}"
    row, col = pair
    if not (1 <= row <= 3 and 1 <= col <= 3):
        return None, f"({row}, {col}) is off the board (rows and columns are 1 to 3)"
    return 3 * (row - 1) + (col - 1), ""


def _stream_seed(*entropy: int) -> int:
    """A well-mixed 32-bit seed of a task seed (and a copy index)."""
    return int(np.random.SeedSequence(list(entropy)).generate_state(1)[0])


def cell_text(cell: int) -> str:
    return f"({cell // 3 + 1}, {cell % 3 + 1})"


@register_env("tic_tac_toe")
class TicTacToeEnv(TwoPlayerGameEnv):
    """One meta-episode of Tic-Tac-Toe against a fixed opponent and seat.

    ``trial_hint=True`` tells the agent in the preamble that every trial starts from the same position
    against the same opponent. The reference prompt does not say so, and a pretrained model acts
    differently when told, so it is off by default (the ``small`` and ``paper`` presets); the ``tiny``
    preset turns it on for its from-scratch model.
    """

    max_turns: int = 8
    prompt_spec: PromptSpec = TIC_TAC_TOE_PROMPT_SPEC
    opponent_pool: ClassVar[dict[str, float]] = dict(TIC_TAC_TOE_TRAINING_POOL)
    held_out_opponents: ClassVar[tuple[str, ...]] = TIC_TAC_TOE_HELD_OUT_OPPONENTS

    def __init__(
        self,
        *,
        opponent: str = "mcts-100",
        seat: int = 0,
        max_turns: int = 8,
        replayable_restarts: bool = False,
        trial_hint: bool = False,
    ):
        check_seat(seat)
        make_tic_tac_toe_opponent(opponent, 0)  # fail early on an unknown name or missing OpenSpiel
        if int(max_turns) < 5:
            raise ValueError(f"max_turns must be at least 5 (all agent's moves of a game), got {max_turns}")
        self.max_turns = int(max_turns)
        self.default_opponent = opponent
        self.default_seat = seat
        self.replayable_restarts = replayable_restarts
        self.prompt_spec = TIC_TAC_TOE_TRIAL_HINT_PROMPT_SPEC if trial_hint else TIC_TAC_TOE_PROMPT_SPEC
        self._player: TicTacToePlayer | None = None

    # ----------------------------------------------------------------------------- task instance
    def reset(self, seed: int, *, opponent: str | None = None, seat: int | None = None,
              copy: int = 0) -> str:
        self._opponent_name = self._begin_task(seed, opponent, seat)
        if not isinstance(copy, (int, np.integer)) or copy < 0:
            raise ValueError(f"copy must be a non-negative integer, got {copy!r}")
        self._player_seed = _stream_seed(self._seed, int(copy))
        self._player = make_tic_tac_toe_opponent(self._opponent_name, self._player_seed)
        self._opening = None
        if self._seat == 1:
            opener = self._player
            if opener.stochastic:  # the opening belongs to the task: drawn from the task seed alone
                opener = make_tic_tac_toe_opponent(self._opponent_name, _stream_seed(self._seed))
            self._opening = opener.act([])
        return self._restore()

    def restart(self) -> str:
        if self._player is None:
            raise RuntimeError("call reset(seed) before restart()")
        if self.replayable_restarts and self._player.stochastic:
            self._player = make_tic_tac_toe_opponent(self._opponent_name, self._player_seed)
        return self._restore()

    def _restore(self) -> str:
        self._moves: list[int] = [] if self._opening is None else [self._opening]
        self._turns = 0
        self._outcome: float | None = None  # agent payoff in {+1, 0, -1} once the game is over
        self._timed_out = False
        return self.observation

    # ----------------------------------------------------------------------------- playing
    def _agent_move(self, action: str) -> tuple[str | None, str]:
        cell, reason = parse_cell(action)
        if cell is None:
            return None, reason
        if cell in self._moves:
            return None, f"{cell_text(cell)} is already taken"
        self._play(cell)
        if self._outcome is None:
            self._play(self._player.act(list(self._moves)))
        return cell_text(cell), ""

    def legal_actions(self) -> list[str]:
        if self._player is None or self.done:
            return []
        return [cell_text(cell) for cell in range(9) if cell not in self._moves]

    # ----------------------------------------------------------------------------- views
    @property
    def done(self) -> bool:
        return self._outcome is not None or self._timed_out

    @property
    def observation(self) -> str:
        if self._player is None:
            raise RuntimeError("call reset(seed) before reading the observation")
        return tic_tac_toe_board(self._moves, agent_first=self._seat == 0)

    @property
    def opponent(self) -> str | None:
        return None if self._player is None else self._opponent_name

    @property
    def moves(self) -> tuple[int, ...]:
        """Cells played so far (0-based ``row * 3 + col``), the first mover's first."""
        return tuple(self._moves)

    @property
    def task_info(self) -> dict[str, Any]:
        if self._player is None:
            return {}
        return {"seed": self._seed, "seat": self._seat, "opponent": self._opponent_name}

    # ----------------------------------------------------------------------------- internals
    def _play(self, cell: int) -> None:
        self._moves.append(int(cell))
        winner = tic_tac_toe_winner(self._moves)
        if winner is not None:
            self._outcome = 1.0 if winner == self._seat else -1.0
        elif len(self._moves) == 9:
            self._outcome = 0.0

    def _result(self, *, valid: bool, action: str | None) -> StepResult:
        outcome = self._outcome
        reward = WIN_REWARD * outcome if (valid and outcome is not None) else 0.0
        info = StepInfo(
            won=outcome == 1.0,
            draw=outcome == 0.0,
            valid=valid,
            score=reward / WIN_REWARD,
            opponent=self._opponent_name,
            extra={"timeout": self._timed_out, "turn": self._turns},
        )
        return StepResult(self.observation, float(reward), self.done, info, action)
