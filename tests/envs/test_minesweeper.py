"""MineSweeper (docs/method.md §7.4): seeded boards, flood fill, win / loss, invalid turns, restarts."""

import pytest

from mage_jax.envs.base import make_env
from mage_jax.envs.minesweeper import Board, MineSweeperEnv, generate_board, render_board, reveal


def _cell(row, col):
    """1-based (row, col) -> index on the 6x6 board."""
    return (row - 1) * 6 + (col - 1)


def _env_with_mines(*cells_1based, seed=0):
    env = MineSweeperEnv()
    env.reset(seed)
    env._board = Board(6, frozenset(_cell(r, c) for r, c in cells_1based), seed)  # a hand-made board
    env.restart()
    return env


def test_boards_are_seed_deterministic_with_three_distinct_mines():
    boards = [generate_board.__wrapped__(seed) for seed in range(50)]
    assert all(len(b.mines) == 3 and all(0 <= m < 36 for m in b.mines) for b in boards)
    assert all(generate_board.__wrapped__(seed).mines == boards[seed].mines for seed in range(50))
    assert len({b.mines for b in boards}) > 40


def test_neighbour_counts():
    board = Board(6, frozenset({_cell(1, 1), _cell(1, 3), _cell(3, 3)}), 0)
    assert board.counts[_cell(1, 2)] == 2
    assert board.counts[_cell(2, 2)] == 3
    assert board.counts[_cell(6, 6)] == 0
    assert board.counts[_cell(4, 4)] == 1


def test_observation_shows_hidden_cells_and_coordinates():
    env = make_env("minesweeper")
    text = env.reset(3)
    lines = text.splitlines()
    assert lines[0].split() == ["1", "2", "3", "4", "5", "6"]
    assert lines[1] == "1 ? ? ? ? ? ?" and len(lines) == 7


def test_revealing_a_zero_floods_to_the_numbered_border():
    env = _env_with_mines((1, 2), (2, 1), (2, 2))  # (1, 1) is walled in by mines
    result = env.step_action("(6, 6)")
    assert result.info.valid and not result.done and result.reward == 0
    assert set(range(36)) - env.revealed == {_cell(1, 1), _cell(1, 2), _cell(2, 1), _cell(2, 2)}
    assert env.observation.splitlines()[1:4] == ["1 ? ? 2 0 0 0", "2 ? ? 2 0 0 0", "3 2 2 1 0 0 0"]
    final = env.step_action("(1, 1)")
    assert final.done and final.info.won and final.reward == 10.0


def test_revealing_a_number_reveals_only_that_cell():
    env = _env_with_mines((3, 3), (3, 4), (4, 3))
    result = env.step_action("(2, 3)")
    assert result.info.extra["newly_revealed"] == 1
    assert env.observation.splitlines()[2] == "2 ? ? 2 ? ? ?"


def test_clearing_the_board_wins_ten():
    env = _env_with_mines((1, 1), (1, 2), (3, 5))
    total, turns = 0.0, 0
    while not env.done:
        hidden_safe = [c for c in range(36) if c not in env.revealed and c not in env.board.mines]
        # a zero cell if one is hidden, else any safe cell
        cell = next((c for c in hidden_safe if env.board.counts[c] == 0), hidden_safe[0])
        result = env.step(f"<action>({cell // 6 + 1}, {cell % 6 + 1})</action>")
        total += result.reward
        turns += 1
    assert result.info.won and result.info.score == 1.0 and total == 10.0
    assert turns <= 7
    assert env.legal_actions() == []


def test_revealing_a_mine_loses_with_reward_zero_and_shows_it():
    env = _env_with_mines((2, 2), (5, 5), (6, 1))
    result = env.step_action("(2, 2)")
    assert result.done and not result.info.won and result.reward == 0.0
    assert result.info.extra["mine_hit"]
    assert env.observation.splitlines()[2] == "2 ? * ? ? ? ?"
    assert "*" not in env.observation.splitlines()[5]  # other mines stay hidden
    assert not env.step_action("(1, 1)").info.valid


def test_restart_replays_the_same_board_from_scratch():
    env = MineSweeperEnv()
    first = env.reset(9)
    mines = env.board.mines
    for action in env.legal_actions()[:3]:
        env.step_action(action)
    assert env.restart() == first and env.board.mines == mines and env.revealed == frozenset()
    other = MineSweeperEnv()
    assert other.reset(9) == first and other.board.mines == mines


BAD_CELLS = ["(0, 1)", "(7, 2)", "(1, -3)", "(" + "9" * 5000 + ", 1)", "row 1", "", "(1, 3)"]


@pytest.mark.parametrize("text", BAD_CELLS)
def test_bad_cells_are_invalid_and_change_nothing(text):
    env = _env_with_mines((1, 2), (2, 1), (2, 2))
    env.step_action("(1, 3)")
    before = env.observation
    result = env.step_action(text)
    assert not result.info.valid and result.reward == 0 and not result.done and result.action is None
    assert env.observation == before


def test_an_already_revealed_cell_is_invalid():
    env = _env_with_mines((1, 2), (2, 1), (2, 2))
    env.step_action("(6, 6)")
    result = env.step_action("(5, 5)")
    assert not result.info.valid and "already revealed" in result.info.extra["invalid_reason"]


def test_legal_actions_are_the_hidden_cells_and_all_are_accepted():
    env = MineSweeperEnv()
    env.reset(4)
    legal = env.legal_actions()
    assert len(legal) == 36 and legal[0] == "(1, 1)" and legal[-1] == "(6, 6)"
    for action in legal:
        probe = MineSweeperEnv()
        probe.reset(4)
        result = probe.step(f"<action>{action}</action>")
        assert result.info.valid and result.action == action


def test_reveal_is_a_pure_flood_fill():
    board = Board(6, frozenset({_cell(1, 1)}), 0)
    revealed = reveal(board, frozenset(), _cell(6, 6))
    assert revealed == frozenset(range(36)) - {_cell(1, 1)}
    assert render_board(board, revealed).splitlines()[1] == "1 ? 1 0 0 0 0"


def test_task_info_and_single_agent_protocol():
    env = make_env("minesweeper")
    env.reset(12)
    assert env.task_info == {"seed": 12, "num_mines": 3, "size": 6}
    assert env.max_turns == 7 and env.opponent is None and env.prompt_spec.history_window == 7
    with pytest.raises(ValueError, match="single-agent"):
        env.reset(1, opponent="mcts")
    with pytest.raises(ValueError, match="num_mines"):
        MineSweeperEnv(num_mines=36)
