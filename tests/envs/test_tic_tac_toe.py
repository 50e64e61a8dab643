"""Tic-Tac-Toe environment (docs/method.md §7.2): OpenSpiel's rules, the X-always board, parsing, restarts."""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest

from experiments.environments import environment
from mage_jax.envs.base import make_env
from mage_jax.envs.opponents.tic_tac_toe import PREFERRED_ORDERS
from mage_jax.envs.tic_tac_toe import (
    TIC_TAC_TOE_PROMPT_SPEC,
    TicTacToeEnv,
    parse_cell,
    tic_tac_toe_board,
    tic_tac_toe_winner,
)
from mage_jax.rollout.meta_episode import MetaEpisodeRunner
from mage_jax.rollout.policy import ScriptedPolicy
from mage_jax.rollout.tasks import TaskSampler, TaskSamplerConfig
from mage_jax.testing import runner_config
from tests.optional import require

DETERMINISTIC = (*PREFERRED_ORDERS,)
STOCHASTIC = ("random", "mcts-100")


def _outcome(moves: tuple[int, ...]) -> tuple[bool, tuple[float, float]]:
    winner = tic_tac_toe_winner(moves)
    if winner is not None:
        return True, ((1.0, -1.0) if winner == 0 else (-1.0, 1.0))
    return len(moves) == 9, (0.0, 0.0)


def test_every_reachable_position_has_openspiels_terminal_flag_returns_and_legal_moves():
    pyspiel = require("pyspiel")
    game = pyspiel.load_game("tic_tac_toe")
    seen: set[str] = set()
    stack = [((), game.new_initial_state())]
    while stack:
        moves, state = stack.pop()
        key = str(state)
        if key in seen:
            continue
        seen.add(key)
        terminal, returns = _outcome(moves)
        assert terminal == state.is_terminal(), moves
        if terminal:
            assert list(returns) == state.returns(), moves
            continue
        assert state.legal_actions() == [c for c in range(9) if c not in moves]
        for cell in state.legal_actions():
            stack.append(((*moves, cell), state.child(cell)))
    assert len(seen) == 5478  # all reachable positions of Tic-Tac-Toe


def test_enumerating_all_games_gives_the_known_outcome_counts():
    @functools.cache
    def counts(moves: frozenset, first: frozenset, n: int) -> np.ndarray:
        ordered = tuple(sorted(first)), tuple(sorted(moves - first))
        seq = [c for pair in itertools.zip_longest(*ordered) for c in pair if c is not None]
        terminal, returns = _outcome(tuple(seq))
        if terminal:
            return np.array([returns[0] > 0, returns[1] > 0, returns[0] == 0], dtype=np.int64)
        total = np.zeros(3, dtype=np.int64)
        for cell in set(range(9)) - moves:
            total += counts(moves | {cell}, first | ({cell} if n % 2 == 0 else set()), n + 1)
        return total

    # Only the sets of cells matter, so positions are memoised by (all cells, first mover's cells).
    first_wins, second_wins, draws = counts(frozenset(), frozenset(), 0)
    assert (first_wins, second_wins, draws) == (131184, 77904, 46080)


def test_environment_games_against_random_opponents_end_like_openspiel():
    pyspiel = require("pyspiel")
    game = pyspiel.load_game("tic_tac_toe")
    rng = np.random.default_rng(0)
    for seed in range(40):
        env = TicTacToeEnv(opponent="random", seat=seed % 2)
        env.reset(seed)
        while not env.done:
            result = env.step(f"<action>{rng.choice(env.legal_actions())}</action>")
        state = game.new_initial_state()
        for cell in env.moves:
            state.apply_action(cell)
        assert state.is_terminal()
        payoff = state.returns()[env.seat]
        assert result.reward == 10 * payoff and result.info.score == payoff
        assert result.info.won == (payoff > 0) and result.info.draw == (payoff == 0)


def test_agent_is_always_x_even_when_second():
    assert tic_tac_toe_board([4, 0], agent_first=True) == "O . .\n. X .\n. . ."
    assert tic_tac_toe_board([4, 0], agent_first=False) == "X . .\n. O .\n. . ."
    env = TicTacToeEnv(opponent="preferred-1", seat=1)
    assert env.reset(0) == ". . .\n. O .\n. . ."
    assert env.step("<action>(1, 1)</action>").observation == "X . O\n. O .\n. . ."


def test_action_is_the_first_int_pair_one_based():
    assert parse_cell("(1, 1)") == (0, "")
    assert parse_cell(" ( 3 ,2 ) ")[0] == 7
    assert parse_cell("I pick (2, 3) not (1, 1)")[0] == 5
    for bad in ("2, 3", "(0, 1)", "(4, 1)", "(1, -1)", "(1.5, 2)", "(" + "9" * 5000 + ", 1)", "center"):
        cell, reason = parse_cell(bad)
        assert cell is None and reason


def test_illegal_or_unparseable_actions_change_nothing_and_the_opponent_waits():
    env = TicTacToeEnv(opponent="preferred-2", seat=0)
    env.reset(0)
    env.step("<action>(2, 2)</action>")  # preferred-2 answers in the corner (1, 1)
    board, moves = env.observation, env.moves
    for text in ("<action>(1, 1)</action>", "<action>(2, 2)</action>", "<action>(0, 3)</action>", "hi"):
        result = env.step(text)
        assert not result.info.valid and result.reward == 0 and not result.done
        assert result.observation == board and env.moves == moves
    assert env.turns == 5


def test_turn_limit_ends_an_unfinished_game_with_no_reward():
    env = TicTacToeEnv(opponent="preferred-1")
    env.reset(0)
    for _ in range(env.max_turns - 1):
        assert not env.step("<action>(9, 9)</action>").done
    result = env.step("<action>(1, 1)</action>")  # valid, but the eighth turn
    assert result.done and result.reward == 0 and result.info.extra["timeout"]
    assert env.legal_actions() == [] and not result.info.won and not result.info.draw


def test_rewards_win_loss_draw():
    env = TicTacToeEnv(opponent="preferred-3", seat=0)  # plays edges first: (1,2), (2,1), (2,3) ...
    env.reset(0)
    for action in ("(1, 1)", "(2, 2)"):
        assert env.step(f"<action>{action}</action>").reward == 0
    result = env.step("<action>(3, 3)</action>")
    assert (result.reward, result.done, result.info.won, result.info.score) == (10.0, True, True, 1.0)

    env = TicTacToeEnv(opponent="preferred-1", seat=1)  # O centre, then corners (1,1), (1,3), (3,1)
    env.reset(0)
    for action in ("(1, 2)", "(2, 1)"):
        assert env.step(f"<action>{action}</action>").reward == 0
    result = env.step("<action>(3, 3)</action>")  # O completes the anti-diagonal
    assert (result.reward, result.done, result.info.won, result.info.score) == (-10.0, True, False, -1.0)

    env = TicTacToeEnv(opponent="preferred-1", seat=0)
    env.reset(0)
    for action in ("(1, 1)", "(1, 2)", "(3, 1)", "(2, 3)"):
        assert not env.step(f"<action>{action}</action>").done
    result = env.step("<action>(3, 2)</action>")
    assert (result.reward, result.done, result.info.draw, result.info.score) == (0.0, True, True, 0.0)
    assert "." not in result.observation


def test_mcts_never_loses_against_a_random_player():
    require("pyspiel")
    rng = np.random.default_rng(1)
    for game in range(30):
        env = TicTacToeEnv(opponent="mcts-100", seat=game % 2)
        env.reset(game)
        while not env.done:
            result = env.step(f"<action>{rng.choice(env.legal_actions())}</action>")
        assert not result.info.won


@pytest.mark.parametrize("opponent", [*DETERMINISTIC, *STOCHASTIC])
@pytest.mark.parametrize("seat", [0, 1])
def test_restart_restores_the_initial_position_including_the_opening_move(opponent, seat):
    if opponent.startswith("mcts"):
        require("pyspiel")
    env = TicTacToeEnv(opponent=opponent, seat=seat)
    first = env.reset(5)
    info, moves = dict(env.task_info), env.moves
    for _ in range(3):
        env.step("<action>(7, 7)</action>")
        while not env.done:
            env.step(f"<action>{env.legal_actions()[0]}</action>")
        assert env.restart() == first and env.moves == moves and env.turns == 0
        assert env.task_info == info and not env.done
    assert info == {"seed": 5, "seat": seat, "opponent": opponent}


def _replay(env: TicTacToeEnv, episodes: int = 6) -> list[tuple[int, ...]]:
    games = []
    for _ in range(episodes):
        while not env.done:
            env.step(f"<action>{env.legal_actions()[-1]}</action>")
        games.append(env.moves)
        env.restart()
    return games


@pytest.mark.parametrize("opponent", STOCHASTIC)
def test_stochastic_opponents_keep_their_randomness_across_restarts_unless_replayable(opponent):
    if opponent.startswith("mcts"):
        require("pyspiel")
    env = TicTacToeEnv(opponent=opponent, seat=1)
    env.reset(2)
    continuing = _replay(env)
    assert len({g[0] for g in continuing}) == 1  # the opening move is part of the task instance
    assert len(set(continuing)) > 1
    replayable = TicTacToeEnv(opponent=opponent, seat=1, replayable_restarts=True)
    replayable.reset(2)
    games = _replay(replayable)
    assert len(set(games)) == 1 and games[0] == continuing[0]  # same seed, same first episode


@pytest.mark.parametrize("opponent", STOCHASTIC)
def test_copies_of_a_task_share_the_opening_but_meet_independent_opponent_noise(opponent):
    """The G copies of a group: same initial state (the opening included), own opponent stream."""
    if opponent.startswith("mcts"):
        require("pyspiel")
    openings, games = set(), set()
    for copy in range(8):
        env = TicTacToeEnv(opponent=opponent, seat=1)
        openings.add(env.reset(3, copy=copy))
        games.add(tuple(_replay(env, 2)))
        again = TicTacToeEnv(opponent=opponent, seat=1)
        again.reset(3, copy=copy)
        assert tuple(_replay(again, 2)) in games  # one copy index always plays the same way
    assert len(openings) == 1
    assert len(games) > 1


def test_the_copies_of_a_training_group_start_alike_and_then_meet_different_moves():
    """Through the runner: a group of 8 copies against the random player moving first, the agent
    always taking the first legal cell. The first state is shared; the games are not."""
    sampler = TaskSampler(TaskSamplerConfig(num_tasks=1, group_size=8, opponents={"random": 1.0},
                                            seats="second"))
    tasks = sampler.sample_train(0)
    assert [t.copy for t in tasks] == list(range(8))
    assert all(t.copy == 0 for t in sampler.sample_eval(3))
    runner = MetaEpisodeRunner("tic_tac_toe", config=runner_config(num_episodes=1, reflect=False,
                                                                  constrained_actions=True))
    rows = runner.run(tasks, ScriptedPolicy(lambda prompt: ""), training=True).rows
    games: dict[int, list[str]] = {}
    for row in sorted(rows, key=lambda r: (r.meta_episode, r.step)):
        games.setdefault(row.meta_episode, []).append(row.anchor)
    assert len({game[0] for game in games.values()}) == 1
    assert len({tuple(game) for game in games.values()}) > 1


def test_registry_prompt_spec_and_bad_configuration():
    env = make_env("tic_tac_toe", opponent="preferred-4")
    assert env.max_turns == 8 and env.prompt_spec is TIC_TAC_TOE_PROMPT_SPEC
    assert env.reset(0) == ". . .\n. . .\n. . ."
    assert len(env.legal_actions()) == 9 and env.legal_actions()[0] == "(1, 1)"
    for text in (TIC_TAC_TOE_PROMPT_SPEC.preamble, TIC_TAC_TOE_PROMPT_SPEC.compact_preamble):
        assert "<action>(row, col)</action>" in text
    with pytest.raises(ValueError, match="unknown Tic-Tac-Toe opponent"):
        TicTacToeEnv(opponent="minimax")
    with pytest.raises(ValueError, match="seat"):
        TicTacToeEnv(seat=3)


def test_the_reference_prompt_is_the_default_and_the_trial_hint_an_option():
    hint = "Every trial starts from the same position"
    assert hint not in TicTacToeEnv().prompt_spec.preamble
    assert "Same start" not in TicTacToeEnv().prompt_spec.compact_preamble
    hinted = make_env("tic_tac_toe", trial_hint=True).prompt_spec
    assert hint in hinted.preamble and "Same start and opponent every trial" in hinted.compact_preamble
    ttt = environment("tic_tac_toe")
    assert ttt.config("tiny", check_paths=False).env.options == {"trial_hint": True}
    for preset in ("small", "paper"):
        cfg = ttt.config(preset, {"model.path": "/models/qwen3"}, check_paths=False)
        assert not cfg.env.options.get("trial_hint", False)
