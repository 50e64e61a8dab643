"""Sokoban (docs/method.md §7.3 and the §11 reward fix): rooms, solver, dead ends, moves and rewards."""

import math
import random
import time
from collections import deque

import pytest

from mage_jax.envs.base import make_env
from mage_jax.envs.sokoban import (
    Room,
    SokobanEnv,
    dead_squares,
    generate_room,
    is_dead_end,
    parse_moves,
    render_room,
    shortest_solution,
    solve,
)

# Player left of a box, target two cells right of the box: "right, right" solves it.
CORRIDOR = """
0:######
1:#PX_O#
2:#____#
3:#____#
4:#____#
5:######
"""


def _env(text: str) -> SokobanEnv:
    room = Room.from_text(text)
    env = SokobanEnv(num_boxes=room.num_boxes)
    env.reset_to_room(room)
    return env


def _independent_bfs(text: str, max_depth: int = 60) -> int | None:
    """Reference solver on (row, col) tuples, no pruning: shortest move count or None."""
    grid = [line.split(":", 1)[1] for line in text.strip().splitlines()]
    walls = {(r, c) for r, line in enumerate(grid) for c, s in enumerate(line) if s == "#"}
    targets = frozenset((r, c) for r, line in enumerate(grid) for c, s in enumerate(line) if s in "O√S")
    boxes = frozenset((r, c) for r, line in enumerate(grid) for c, s in enumerate(line) if s in "X√")
    player = next((r, c) for r, line in enumerate(grid) for c, s in enumerate(line) if s in "PS")
    start = (player, boxes)
    depth = {start: 0}
    queue = deque([start])
    while queue:
        state = queue.popleft()
        (pr, pc), bx = state
        if bx == targets:
            return depth[state]
        if depth[state] >= max_depth:
            continue
        for dr, dc in ((-1, 0), (1, 0), (0, -1), (0, 1)):
            nxt = (pr + dr, pc + dc)
            if nxt in walls:
                continue
            nbx = bx
            if nxt in bx:
                beyond = (nxt[0] + dr, nxt[1] + dc)
                if beyond in walls or beyond in bx:
                    continue
                nbx = (bx - {nxt}) | {beyond}
            new = (nxt, nbx)
            if new not in depth:
                depth[new] = depth[state] + 1
                queue.append(new)
    return None


# -- rooms ------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_boxes", [1, 2, 3])
def test_rooms_are_seed_deterministic_with_optimal_length_5_to_21(num_boxes):
    lengths = set()
    for seed in range(20):
        room = generate_room(seed, num_boxes)
        assert 5 <= room.optimal_length <= 21
        assert room.boxes.bit_count() == room.targets.bit_count() == num_boxes
        assert room.boxes != room.targets
        text = render_room(room.walls, room.targets, room.boxes, room.player)
        again = generate_room.__wrapped__(seed, num_boxes)
        assert render_room(again.walls, again.targets, again.boxes, again.player) == text
        lengths.add(room.optimal_length)
    assert len(lengths) > 2  # not one trivial puzzle shape


def test_generator_optimum_matches_an_independent_solver():
    for seed in range(12):
        room = generate_room(seed, 2)
        text = render_room(room.walls, room.targets, room.boxes, room.player)
        assert _independent_bfs(text) == room.optimal_length
        assert len(shortest_solution(room)) == room.optimal_length


def test_128_rooms_generate_in_a_few_seconds():
    start = time.perf_counter()
    for seed in range(50_000, 50_128):
        generate_room.__wrapped__(seed, 2)
    assert time.perf_counter() - start < 5.0


def test_render_uses_spec_symbols_one_row_per_line():
    text = render_room(*(lambda r: (r.walls, r.targets, r.boxes, r.player))(Room.from_text(CORRIDOR)))
    assert text == CORRIDOR.strip()
    lines = text.splitlines()
    assert [line.split(":")[0] for line in lines] == [str(i) for i in range(6)]
    on_target = Room.from_text(CORRIDOR.replace("#PX_O#", "#S√__#").replace("2:#____#", "2:#X___#"))
    assert render_room(on_target.walls, on_target.targets, on_target.boxes, on_target.player).startswith(
        "0:######\n1:#S√__#"
    )


def test_room_text_errors_are_clear():
    with pytest.raises(ValueError, match="rows"):
        Room.from_text("0:###")
    with pytest.raises(ValueError, match="one player"):
        Room.from_text(CORRIDOR.replace("P", "_"))


# -- solver and dead ends ---------------------------------------------------------------------


def test_solver_finds_the_shortest_solution_of_a_hand_made_room():
    room = Room.from_text(CORRIDOR)
    assert room.optimal_length == 2 == _independent_bfs(CORRIDOR)
    assert shortest_solution(room) == ["right", "right"]


def test_box_in_a_corner_off_target_is_a_dead_end():
    text = CORRIDOR.replace("1:#PX_O#", "1:#X_PO#")
    room = Room.from_text(text)
    assert room.dead >> 7 & 1  # (1, 1) is a dead square
    assert is_dead_end(room, room.boxes, room.player)
    assert solve(room.walls, room.targets, room.boxes, room.player, dead=0) is None


def test_dead_end_check_agrees_with_unpruned_search_on_random_play():
    rng = random.Random(7)
    checked = 0
    for seed in range(8):
        room = generate_room(seed, 2)
        env = SokobanEnv(num_boxes=2)
        env.reset(seed)
        for _ in range(15):
            env.step_action(rng.choice(("up", "down", "left", "right")))
            boxes, player = env._boxes, env._player
            unpruned = solve(room.walls, room.targets, boxes, player, max_depth=100, dead=0)
            assert is_dead_end(room, boxes, player) == (unpruned is None)
            checked += 1
            if env.done:
                break
    assert checked > 40


def test_dead_squares_never_include_targets():
    for seed in range(10):
        room = generate_room(seed, 3)
        assert dead_squares(room.walls, room.targets) & room.targets == 0


# -- actions ----------------------------------------------------------------------------------


def test_move_parsing_rules():
    assert parse_moves("up, left, down") == (["up", "left", "down"], "")
    assert parse_moves("Go UP!") == (["up"], "")
    assert parse_moves("upright")[0] == ["up"]  # earliest keyword in the piece
    assert parse_moves("move right then up")[0] == ["right"]
    assert parse_moves("foo, left, ,")[0] == ["left"]  # keyword-less and blank pieces are skipped
    assert parse_moves("still")[0] == ["still"]
    assert parse_moves("up, up, up, up")[0] is None  # more than 3 pieces
    assert parse_moves("nothing here")[0] is None
    assert parse_moves("")[0] is None


def test_legal_actions_are_all_one_to_three_move_sequences():
    env = make_env("sokoban")
    env.reset(0)
    legal = env.legal_actions()
    assert len(legal) == 4 + 16 + 64 == len(set(legal))
    assert "up" in legal and "up, left, down" in legal
    assert all(parse_moves(a)[0] == a.split(", ") for a in legal)


def test_combo_equals_its_moves_one_turn_at_a_time():
    for action in ("left, up, right", "down, down", "right, up, up"):
        one, many = SokobanEnv(), SokobanEnv()
        one.reset(11)
        many.reset(11)
        combo = one.step_action(action)
        total = 0.0
        for move in action.split(", "):
            result = many.step_action(move)
            total += result.reward
            if result.done:
                break
        assert combo.observation == many.observation
        assert math.isclose(combo.reward, total, abs_tol=1e-9)


# -- rewards and episode end ------------------------------------------------------------------


def test_turn_reward_is_the_sum_of_its_moves_and_solving_ends_the_episode_mid_turn():
    env = _env(CORRIDOR)
    result = env.step_action("right, right, down")
    assert result.info.valid and result.done and result.info.won
    assert result.reward == pytest.approx(-0.1 * 2 + 1 + 10)
    assert result.action == "right, right"
    assert result.info.extra["skipped_moves"] == 1
    assert env.legal_actions() == []
    again = env.step("<action>left</action>")
    assert not again.info.valid and again.observation == result.observation


def test_box_off_target_costs_one_and_walls_cost_a_step():
    text = """
0:######
1:#P√_O#
2:#____#
3:#_X__#
4:#____#
5:######
"""
    env = _env(text)
    off = env.step_action("right")  # pushes the box off its target
    assert off.reward == pytest.approx(-0.1 - 1)
    assert env.observation.splitlines()[1] == "1:#_SXO#"  # the player stands on the target
    bump = env.step_action("up")  # into the wall: nothing moves
    assert bump.reward == pytest.approx(-0.1) and bump.observation == off.observation


def test_following_the_optimal_solution_wins_with_the_expected_total_reward():
    for seed in range(6):
        env = SokobanEnv(num_boxes=2)
        env.reset(seed)
        room = env.room
        path = shortest_solution(room)
        total, turns = 0.0, 0
        for i in range(0, len(path), 3):
            result = env.step(f"<think>plan</think><action>{', '.join(path[i:i + 3])}</action>")
            total += result.reward
            turns += 1
        assert result.done and result.info.won and result.info.score == 1.0
        assert turns == math.ceil(len(path) / 3)
        gained = 2 - (room.boxes & room.targets).bit_count()
        assert total == pytest.approx(-0.1 * len(path) + gained + 10)


def test_a_dead_end_ends_the_episode_without_a_win():
    text = CORRIDOR.replace("1:#PX_O#", "1:#_XPO#")
    env = _env(text)
    result = env.step_action("left, right")
    assert result.done and not result.info.won and result.info.extra["dead_end"]
    assert result.action == "left"  # the turn stops at the dead end
    assert result.reward == pytest.approx(-0.1)


def test_invalid_turns_change_nothing_and_restart_is_identical():
    env = SokobanEnv()
    first = env.reset(5)
    env.step_action("up, left")
    moved = env.observation
    for text in ("no tags", "<action>jump</action>", "<action>up,up,up,up</action>", "<action>"):
        result = env.step(text)
        assert not result.info.valid and result.reward == 0 and not result.done and result.action is None
        assert env.observation == moved
    assert env.restart() == first == env.observation


def test_task_info_and_single_agent_protocol():
    env = make_env("sokoban", num_boxes=3)
    env.reset(4)
    assert env.task_info == {"seed": 4, "num_boxes": 3, "optimal_length": env.room.optimal_length}
    assert env.opponent is None and env.max_turns == 7 and env.prompt_spec.history_window == 7
    with pytest.raises(ValueError, match="single-agent"):
        env.reset(4, opponent="random")
    with pytest.raises(ValueError, match="num_boxes"):
        SokobanEnv(num_boxes=4)
    with pytest.raises(RuntimeError, match="reset"):
        _ = SokobanEnv().observation
