"""Tic-Tac-Toe opponents (docs/method.md §7.2): MCTS, six preferred-order players and a random player.

A player sees the game as the list of cells played so far (0-based ``row * 3 + col``, in move
order, starting with whoever moved first) and returns the cell it plays. Names: ``mcts-<N>`` (UCT
c = 1.4, N simulations, random-rollout evaluator, solve = True: OpenSpiel's ``MCTSBot``),
``preferred-1`` .. ``preferred-6`` and ``random``. Stochastic players draw from their own seeded
generator, so a (name, seed) pair always plays the same way given the same moves.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence

import numpy as np

CELLS = 9

PREFERRED_ORDERS: Mapping[str, tuple[tuple[int, int], ...]] = {
    "preferred-1": ((1, 1), (0, 0), (0, 2), (2, 0), (2, 2), (0, 1), (1, 0), (1, 2), (2, 1)),
    "preferred-2": ((0, 0), (0, 2), (2, 0), (2, 2), (1, 1), (0, 1), (1, 0), (1, 2), (2, 1)),
    "preferred-3": ((0, 1), (1, 0), (1, 2), (2, 1), (1, 1), (0, 0), (0, 2), (2, 0), (2, 2)),
    "preferred-4": ((0, 0), (1, 1), (2, 2), (0, 2), (2, 0), (0, 1), (1, 0), (1, 2), (2, 1)),
    "preferred-5": ((0, 2), (1, 1), (2, 0), (0, 0), (2, 2), (0, 1), (1, 0), (1, 2), (2, 1)),
    "preferred-6": ((2, 2), (2, 0), (0, 2), (0, 0), (1, 1), (2, 1), (1, 2), (1, 0), (0, 1)),
}
"""The fixed players of docs/method.md §7.2: play the first empty cell of the list ((row, col), 0-based)."""

MCTS_UCT_C = 1.4
MCTS_ROLLOUTS = 1

TIC_TAC_TOE_TRAINING_POOL: Mapping[str, float] = {
    "mcts-100": 8 / 16,
    **{name: 1 / 16 for name in PREFERRED_ORDERS},
    "random": 2 / 16,
}
"""The balanced pool of the reference: in 16 groups, 8 meet MCTS-100, one each of the six
preferred-order players and 2 the random player."""

TIC_TAC_TOE_HELD_OUT_OPPONENTS: tuple[str, ...] = ("mcts-1000",)

_MCTS_NAME = re.compile(r"mcts-([1-9][0-9]*)")
_OPENSPIEL_HINT = "MCTS opponents need OpenSpiel: pip install mage-jax[games]"


def empty_cells(moves: Sequence[int]) -> list[int]:
    taken = set(moves)
    return [cell for cell in range(CELLS) if cell not in taken]


class TicTacToePlayer:
    """Base class: ``act(moves)`` returns the cell to play (always an empty one)."""

    name: str = "player"
    stochastic: bool = False

    def act(self, moves: Sequence[int]) -> int:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class PreferredOrderPlayer(TicTacToePlayer):
    def __init__(self, name: str, order: Sequence[tuple[int, int]]):
        self.name = name
        self.order = tuple(3 * row + col for row, col in order)

    def act(self, moves: Sequence[int]) -> int:
        taken = set(moves)
        return next(cell for cell in self.order if cell not in taken)


class RandomPlayer(TicTacToePlayer):
    """Uniform over the empty cells."""

    stochastic = True

    def __init__(self, seed: int):
        self.name = "random"
        self._rng = np.random.default_rng(seed)

    def act(self, moves: Sequence[int]) -> int:
        cells = empty_cells(moves)
        return cells[int(self._rng.integers(len(cells)))]


@functools.lru_cache(maxsize=1)
def _openspiel_game():
    try:
        import pyspiel
    except ImportError as err:
        raise ImportError(_OPENSPIEL_HINT) from err
    return pyspiel.load_game("tic_tac_toe")


class MCTSPlayer(TicTacToePlayer):
    """OpenSpiel's MCTSBot (UCT c = 1.4, random rollouts, solve = True); the C++ bot when available."""

    stochastic = True

    def __init__(self, simulations: int, seed: int):
        self.name = f"mcts-{simulations}"
        self.simulations = simulations
        game = _openspiel_game()
        import pyspiel

        seed = int(seed) % (2**31 - 1)
        if hasattr(pyspiel, "MCTSBot") and hasattr(pyspiel, "RandomRolloutEvaluator"):
            evaluator = pyspiel.RandomRolloutEvaluator(MCTS_ROLLOUTS, seed + 1)
            self._bot = pyspiel.MCTSBot(game, evaluator, MCTS_UCT_C, simulations, 1000, True, seed, False)
            self._keepalive = evaluator
        else:  # pragma: no cover - older OpenSpiel builds without the C++ bot bindings
            from open_spiel.python.algorithms import mcts

            rng = np.random.RandomState(seed)
            evaluator = mcts.RandomRolloutEvaluator(n_rollouts=MCTS_ROLLOUTS, random_state=rng)
            self._bot = mcts.MCTSBot(game, MCTS_UCT_C, simulations, evaluator, solve=True, random_state=rng)
        self._game = game

    def act(self, moves: Sequence[int]) -> int:
        state = self._game.new_initial_state()
        for cell in moves:
            state.apply_action(int(cell))
        return int(self._bot.step(state))


def tic_tac_toe_opponent_names() -> list[str]:
    return ["mcts-<N>", *PREFERRED_ORDERS, "random"]


def make_tic_tac_toe_opponent(name: str, seed: int = 0) -> TicTacToePlayer:
    """The player called ``name``; ``seed`` fixes the randomness of stochastic players."""
    if name in PREFERRED_ORDERS:
        return PreferredOrderPlayer(name, PREFERRED_ORDERS[name])
    if name == "random":
        return RandomPlayer(seed)
    match = _MCTS_NAME.fullmatch(name) if isinstance(name, str) else None
    if match:
        return MCTSPlayer(int(match.group(1)), seed)
    known = ", ".join(tic_tac_toe_opponent_names())
    raise ValueError(f"unknown Tic-Tac-Toe opponent {name!r}; known: {known}")
