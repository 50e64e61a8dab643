"""Opponents of the two-player games: scripted Kuhn players, CFR, MCTS and fixed Tic-Tac-Toe players.

Opponents are plain Python objects chosen by name. They see only what their seat may see (their
own card and the public history in Kuhn Poker, the move list in Tic-Tac-Toe). Importing this
package never imports OpenSpiel; only the MCTS players and the CFR recompute need it.
"""

from mage_jax.envs.opponents.kuhn import (
    KUHN_HELD_OUT_OPPONENTS,
    KUHN_OPPONENTS,
    KUHN_TRAINING_POOL,
    KuhnPlayer,
    make_kuhn_opponent,
)
from mage_jax.envs.opponents.tic_tac_toe import (
    PREFERRED_ORDERS,
    TIC_TAC_TOE_HELD_OUT_OPPONENTS,
    TIC_TAC_TOE_TRAINING_POOL,
    TicTacToePlayer,
    make_tic_tac_toe_opponent,
)

__all__ = [
    "KUHN_HELD_OUT_OPPONENTS",
    "KUHN_OPPONENTS",
    "KUHN_TRAINING_POOL",
    "PREFERRED_ORDERS",
    "TIC_TAC_TOE_HELD_OUT_OPPONENTS",
    "TIC_TAC_TOE_TRAINING_POOL",
    "KuhnPlayer",
    "TicTacToePlayer",
    "make_kuhn_opponent",
    "make_tic_tac_toe_opponent",
]
