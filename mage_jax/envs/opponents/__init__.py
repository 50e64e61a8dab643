"""Opponents of the two-player games: scripted Kuhn players, CFR, MCTS and fixed Tic-Tac-Toe players.

Opponents are plain Python objects chosen by name. They see only what their seat may see (their
own card and the public history in Kuhn Poker, the move list in Tic-Tac-Toe). Importing this
package never imports OpenSpiel; only the MCTS players and the CFR recompute need it.
"""
