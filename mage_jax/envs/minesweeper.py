"""MineSweeper (docs/method.md §7.4, after LaMer): 6x6 board, 3 mines, one reveal per turn, +10 when cleared.

Decisions (docs/method.md §7.4 leaves them open):

* The mines are fixed by the seed when the task is drawn; the first reveal is *not* protected, so
  ``restart()`` replays exactly the same board and what an earlier trial uncovered (including a mine
  it hit) stays true in the next one. That is what makes MineSweeper a meta-RL task: memory of
  earlier trials tells the agent where to look and where not to.
* Revealing a mine ends the episode as a loss with reward 0; the observation shows that mine as
  ``*`` (the other mines stay hidden). Clearing the board (every safe cell revealed) gives +10 and
  wins. Every other reveal gives 0.
* Revealing a cell with no neighbouring mine also reveals its neighbours, repeatedly (flood fill).
* Action ``<action>(row, col)</action>``, 1-based, first ``(int, int)`` pair in the tags. Off the
  board or an already revealed cell is an invalid turn (nothing changes).
* The turn limit (7) is enforced by the runner like every environment's ``max_turns``.

Observation: a header of column numbers, then one line per row: its number and one symbol per cell
(``?`` hidden, ``0``-``8`` the number of neighbouring mines, ``*`` an exploded mine).
"""

from __future__ import annotations

import dataclasses
import random
from functools import lru_cache
from typing import Any

from mage_jax.envs.base import PromptSpec, StepInfo, StepResult, TextEnv, register_env
from mage_jax.envs.parsing import extract_cell

__all__ = ["Board", "MineSweeperEnv", "generate_board", "minesweeper_prompt_spec", "render_board"]

CLEAR_REWARD = 10.0
HIDDEN, MINE = "?", "*"


class Board:
    """The hidden truth of one task instance: mine cells and the neighbour counts of every cell."""

    __slots__ = ("size", "mines", "counts", "seed")

    def __init__(self, size: int, mines: frozenset[int], seed: int) -> None:
        self.size, self.mines, self.seed = size, mines, seed
        self.counts = tuple(
            sum(n in mines for n in neighbours(cell, size)) for cell in range(size * size)
        )

    @property
    def safe_cells(self) -> int:
        return self.size * self.size - len(self.mines)


@lru_cache(maxsize=1024)
def _neighbours(cell: int, size: int) -> tuple[int, ...]:
    row, col = divmod(cell, size)
    return tuple(
        r * size + c
        for r in range(max(row - 1, 0), min(row + 2, size))
        for c in range(max(col - 1, 0), min(col + 2, size))
        if (r, c) != (row, col)
    )


def neighbours(cell: int, size: int) -> tuple[int, ...]:
    """The up to 8 cells around ``cell`` (row-major index) on a ``size`` x ``size`` board."""
    return _neighbours(cell, size)


@lru_cache(maxsize=8192)
def generate_board(seed: int, size: int = 6, num_mines: int = 3) -> Board:
    """The board of task instance ``seed``: ``num_mines`` distinct cells drawn uniformly, deterministic."""
    if size < 2 or not 1 <= num_mines < size * size:
        raise ValueError(f"MineSweeper needs size >= 2 and 1 <= mines < size^2, got {size}, {num_mines}")
    rng = random.Random(f"minesweeper/{size}/{num_mines}/{int(seed)}")
    return Board(size, frozenset(rng.sample(range(size * size), num_mines)), int(seed))


def reveal(board: Board, revealed: frozenset[int], cell: int) -> frozenset[int]:
    """``revealed`` plus ``cell`` and, from every zero cell reached, its neighbours (flood fill)."""
    out = set(revealed)
    stack = [cell]
    while stack:
        current = stack.pop()
        if current in out:
            continue
        out.add(current)
        if board.counts[current] == 0 and current not in board.mines:
            stack.extend(n for n in neighbours(current, board.size) if n not in out and n not in board.mines)
    return frozenset(out)


def render_board(board: Board, revealed: frozenset[int], exploded: int | None = None) -> str:
    """Column header, then ``"<row> "`` and the row's cells separated by spaces (1-based numbers)."""
    size = board.size
    lines = ["  " + " ".join(str(c + 1) for c in range(size))]
    for row in range(size):
        cells = []
        for col in range(size):
            cell = row * size + col
            if cell == exploded:
                cells.append(MINE)
            elif cell in revealed:
                cells.append(str(board.counts[cell]))
            else:
                cells.append(HIDDEN)
        lines.append(f"{row + 1} " + " ".join(cells))
    return "\n".join(lines)


def cell_text(cell: int, size: int) -> str:
    row, col = divmod(cell, size)
    return f"({row + 1}, {col + 1})"


def minesweeper_prompt_spec(size: int, num_mines: int, max_turns: int) -> PromptSpec:
    return PromptSpec(
        preamble=(
            f"You are playing MineSweeper on a {size}x{size} board with {num_mines} hidden mines.\n"
            f"The board is shown with column numbers on top and row numbers on the left, both 1 to {size}. "
            "Symbols: ? hidden cell, a digit 0 to 8 a revealed safe cell showing how many of its (up to "
            "8) neighbouring cells hold a mine, * a mine that exploded.\n"
            "Each turn you reveal one hidden cell. Revealing a mine loses the trial immediately. "
            "Revealing a cell with no neighbouring mine (0) also reveals all its neighbours, and so on.\n"
            f"Goal: reveal every safe cell within {max_turns} turns; that clears the board and gives a "
            "reward of +10 (nothing else gives a reward). Every trial uses the same board with the mines "
            "in the same places, so what you learned in earlier trials stays true.\n"
            f"Action format: <action>(row, col)</action> with row and col from 1 to {size}, for example "
            "<action>(3, 4)</action>; the cell must still be hidden."
        ),
        compact_preamble=(
            f"minesweeper {size} x {size} , {num_mines} mines . ? hidden , digit = mines around , "
            "* mine hit . reveal one cell per turn . 0 opens neighbours . mine = lose . "
            "clear all safe cells = +10 . same mines every trial"
        ),
        action_format=f"<action>(row, col)</action> with row and col from 1 to {size}",
        history_window=7,
    )


@register_env("minesweeper")
class MineSweeperEnv(TextEnv):
    """One meta-episode of MineSweeper on the board of one seed (single agent)."""

    max_turns: int = 7

    def __init__(self, size: int = 6, num_mines: int = 3, max_turns: int = 7) -> None:
        if int(size) < 2 or not 1 <= int(num_mines) < int(size) ** 2:
            raise ValueError(
                f"MineSweeper needs size >= 2 and 1 <= num_mines < size^2, got {size}, {num_mines}"
            )
        if int(max_turns) < 1:
            raise ValueError(f"max_turns must be positive, got {max_turns!r}")
        self.size, self.num_mines, self.max_turns = int(size), int(num_mines), int(max_turns)
        self.prompt_spec = minesweeper_prompt_spec(self.size, self.num_mines, self.max_turns)
        self._board: Board | None = None
        self._revealed: frozenset[int] = frozenset()
        self._exploded: int | None = None
        self._done = False

    # -- protocol -------------------------------------------------------------------------------
    def reset(self, seed: int, *, opponent: str | None = None, seat: int | None = None,
              copy: int = 0) -> str:
        if opponent is not None:
            raise ValueError(f"MineSweeper is a single-agent task; got opponent {opponent!r}")
        if seat not in (None, 0):
            raise ValueError(f"MineSweeper is a single-agent task; got seat {seat!r}")
        self._board = generate_board(int(seed), self.size, self.num_mines)
        return self.restart()

    def restart(self) -> str:
        self._require_board()
        self._revealed, self._exploded, self._done = frozenset(), None, False
        return self.observation

    def step_action(self, action: str) -> StepResult:
        board = self._require_board()
        if self._done:
            return self.invalid_step("the episode is over")
        cell_rc = extract_cell(action)
        if cell_rc is None:
            return self.invalid_step("expected (row, col)")
        row, col = cell_rc
        if not (1 <= row <= board.size and 1 <= col <= board.size):
            return self.invalid_step(f"({row}, {col}) is off the board")
        cell = (row - 1) * board.size + (col - 1)
        if cell in self._revealed:
            return self.invalid_step(f"({row}, {col}) is already revealed")
        before = len(self._revealed)
        won = False
        if cell in board.mines:
            self._exploded, self._done = cell, True
        else:
            self._revealed = reveal(board, self._revealed, cell)
            won = len(self._revealed) == board.safe_cells
            self._done = won
        return StepResult(
            observation=self.observation,
            reward=CLEAR_REWARD if won else 0.0,
            done=self._done,
            info=StepInfo(
                won=won,
                valid=True,
                score=1.0 if won else 0.0,
                extra={
                    "mine_hit": self._exploded is not None,
                    "newly_revealed": len(self._revealed) - before,
                    "revealed": len(self._revealed),
                },
            ),
            action=f"({row}, {col})",
        )

    def invalid_step(self, reason: str) -> StepResult:
        """Nothing changes, reward 0; a finished episode stays finished (``done`` as before)."""
        result = super().invalid_step(reason)
        return dataclasses.replace(result, done=self._done)

    def legal_actions(self) -> list[str]:
        """Every hidden cell as ``"(row, col)"``, row-major."""
        if self._done or self._board is None:
            return []
        n = self._board.size
        return [cell_text(c, n) for c in range(n * n) if c not in self._revealed]

    @property
    def observation(self) -> str:
        return render_board(self._require_board(), self._revealed, self._exploded)

    @property
    def task_info(self) -> dict[str, Any]:
        board = self._board
        return {
            "seed": None if board is None else board.seed,
            "num_mines": self.num_mines,
            "size": self.size,
        }

    # -- extras ---------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self._done

    @property
    def board(self) -> Board:
        return self._require_board()

    @property
    def revealed(self) -> frozenset[int]:
        return self._revealed

    def _require_board(self) -> Board:
        if self._board is None:
            raise RuntimeError("call reset(seed) before using the MineSweeper environment")
        return self._board
