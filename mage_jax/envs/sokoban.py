"""Sokoban (docs/method.md §7.3): 6x6 rooms made by reverse play, up to 3 moves per turn, dead-end detection.

A room is 6x6 cells including its outer wall, so the floor lies in the inner 4x4. Rooms are drawn
per ``(seed, num_boxes)`` in the manner of gym-sokoban: carve a floor by a random walk, put the
boxes on their targets, then play backwards (the player walks and may *pull* a box), which can only
reach solvable positions. A breadth-first solver over (player, boxes) states gives the optimal
solution length; rooms are kept when it lies in 5..21 moves.

Cells are indexed ``row * 6 + col``; box sets are bit masks, so a state is two small ints and the
solver stays fast in plain Python. A state from which no solution exists within 100 moves ends the
episode (dead end). That check runs only after a push (walking never changes solvability), first
tries the exact "dead square" test (a box off-target on a cell from which no box could ever reach a
target, even alone), then a depth-limited search that prunes such squares, cached per state.

Action rules (docs/method.md §7.3; details decided here): the text inside ``<action>`` is split on commas and
blank pieces are dropped. More than 3 pieces is an invalid turn. Each piece maps to the earliest
keyword among up/down/left/right/still found in it (case-insensitive, substring match: "go up" and
"upwards" are up); pieces without a keyword are skipped, and a turn with no move at all is invalid.
Moves apply in order; ``still`` and walking into a wall or an unpushable box are moves that change
nothing (−0.1 each). The turn's reward is the sum of its moves' rewards, and the episode ends the
moment the puzzle is solved or a dead end is reached (later moves of that turn are not applied).
"""

from __future__ import annotations

import dataclasses
import random
from functools import lru_cache
from typing import Any

from mage_jax.envs.base import PromptSpec, StepInfo, StepResult, TextEnv, register_env

__all__ = [
    "MOVE_KEYWORDS",
    "Room",
    "SokobanEnv",
    "dead_squares",
    "generate_room",
    "parse_moves",
    "render_room",
    "shortest_solution",
    "solve",
]

SIZE = 6
MOVE_KEYWORDS = ("up", "down", "left", "right", "still")
DIRECTIONS = ("up", "down", "left", "right")
_DELTA = {"up": -SIZE, "down": SIZE, "left": -1, "right": 1, "still": 0}
MAX_MOVES_PER_TURN = 3
MIN_SOLUTION, MAX_SOLUTION = 5, 21
DEAD_END_DEPTH = 100

STEP_PENALTY = -0.1
BOX_ON_TARGET = 1.0
BOX_OFF_TARGET = -1.0
SOLVED_BONUS = 10.0

_MAX_ATTEMPTS = 5000
_MIN_FLOOR = 8  # floor cells besides one per box: cramped rooms only make trivial puzzles
_WALKS, _WALK_STEPS = 4, 150  # reverse-play walks per carved room (approximates gym's search)
_CANDIDATES = 4  # most scrambled reverse-play positions tried per carved room
_SYMBOLS = {"wall": "#", "floor": "_", "target": "O", "box": "X", "box_on_target": "√",
            "player": "P", "player_on_target": "S"}


# ------------------------------------------------------------------------------------------------
# Rooms


class Room:
    """An immutable puzzle: walls and targets (bit masks), the initial boxes and player, its optimum."""

    __slots__ = ("walls", "targets", "boxes", "player", "optimal_length", "seed", "num_boxes", "dead")

    def __init__(self, walls: int, targets: int, boxes: int, player: int, optimal_length: int,
                 seed: int, num_boxes: int) -> None:
        self.walls, self.targets, self.boxes, self.player = walls, targets, boxes, player
        self.optimal_length, self.seed, self.num_boxes = optimal_length, seed, num_boxes
        self.dead = dead_squares(walls, targets)

    @classmethod
    def from_text(cls, text: str) -> Room:
        """Parse a room drawn as ``render_room`` draws it (for hand-made rooms); optimum solved here."""
        lines = [line.split(":", 1)[-1] for line in text.strip().splitlines()]
        if len(lines) != SIZE or any(len(line) != SIZE for line in lines):
            raise ValueError(f"a Sokoban room is {SIZE} rows of {SIZE} symbols, got {lines!r}")
        walls = targets = boxes = 0
        players = []
        for row, line in enumerate(lines):
            for col, symbol in enumerate(line):
                cell, bit = row * SIZE + col, 1 << (row * SIZE + col)
                if symbol not in _SYMBOLS.values():
                    raise ValueError(f"unknown Sokoban symbol {symbol!r}")
                walls |= bit if symbol == "#" else 0
                targets |= bit if symbol in "O√S" else 0
                boxes |= bit if symbol in "X√" else 0
                if symbol in "PS":
                    players.append(cell)
        border = [c for c in range(SIZE * SIZE) if c // SIZE in (0, SIZE - 1) or c % SIZE in (0, SIZE - 1)]
        if len(players) != 1 or boxes.bit_count() != targets.bit_count() or not boxes:
            raise ValueError("a Sokoban room needs one player and as many boxes as targets (at least one)")
        if any(not walls >> c & 1 for c in border):
            raise ValueError("a Sokoban room must be enclosed by walls")
        length = solve(walls, targets, boxes, players[0])
        return cls(walls, targets, boxes, players[0], -1 if length is None else length, -1, boxes.bit_count())

    def __repr__(self) -> str:
        return f"Room(seed={self.seed}, num_boxes={self.num_boxes}, optimal_length={self.optimal_length})"


def _bits(mask: int):
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def render_room(walls: int, targets: int, boxes: int, player: int) -> str:
    """One line per row, ``"<i>:"`` (0-based) then one symbol per cell (docs/method.md §7.3)."""
    lines = []
    for row in range(SIZE):
        cells = []
        for col in range(SIZE):
            bit = 1 << (row * SIZE + col)
            target = bool(targets & bit)
            if walls & bit:
                cells.append(_SYMBOLS["wall"])
            elif boxes & bit:
                cells.append(_SYMBOLS["box_on_target" if target else "box"])
            elif row * SIZE + col == player:
                cells.append(_SYMBOLS["player_on_target" if target else "player"])
            else:
                cells.append(_SYMBOLS["target" if target else "floor"])
        lines.append(f"{row}:" + "".join(cells))
    return "\n".join(lines)


@lru_cache(maxsize=4096)
def dead_squares(walls: int, targets: int) -> int:
    """Floor cells from which a box can never reach any target, even with no other box in the room.

    A box can reach a target iff it can be *pulled* there from the target; a pull toward ``d`` needs
    the cell the box enters and the cell behind it (where the player steps) to be free of walls.
    """
    live = targets
    frontier = list(_bits(targets))
    while frontier:
        cell = frontier.pop()
        for delta in _DELTA.values():
            if not delta:
                continue
            into, behind = cell + delta, cell + 2 * delta
            if not (0 <= behind < SIZE * SIZE):
                continue
            if (walls >> into) & 1 or (walls >> behind) & 1 or (live >> into) & 1:
                continue
            live |= 1 << into
            frontier.append(into)
    floor = ~walls & ((1 << (SIZE * SIZE)) - 1)
    return floor & ~live


def _step(walls: int, boxes: int, player: int, delta: int) -> tuple[int, int, bool]:
    """(boxes, player, pushed) after one move; blocked moves change nothing."""
    if not delta:
        return boxes, player, False
    nxt = player + delta
    bit = 1 << nxt
    if walls & bit:
        return boxes, player, False
    if boxes & bit:
        beyond = 1 << (nxt + delta)
        if (walls | boxes) & beyond:
            return boxes, player, False
        return (boxes ^ bit) | beyond, nxt, True
    return boxes, nxt, False


def solve(walls: int, targets: int, boxes: int, player: int, max_depth: int = DEAD_END_DEPTH,
          dead: int | None = None) -> int | None:
    """Length of the shortest solution (moves, pushes and walks alike), or None if none within ``max_depth``.

    Breadth-first over (player, boxes); a push onto a dead square is pruned (it can never be undone,
    and such a box can never reach a target, so pruning never changes the answer).
    """
    if boxes == targets:
        return 0
    if dead is None:
        dead = dead_squares(walls, targets)
    if boxes & dead:
        return None
    deltas = (-SIZE, SIZE, -1, 1)
    seen = {(player, boxes)}
    frontier = [(player, boxes)]
    depth = 0
    while frontier and depth < max_depth:
        depth += 1
        nxt_frontier = []
        for pos, bx in frontier:
            for delta in deltas:
                nxt = pos + delta
                bit = 1 << nxt
                if walls & bit:
                    continue
                if bx & bit:
                    beyond = 1 << (nxt + delta)
                    if (walls | bx) & beyond or dead & beyond:
                        continue
                    nbx = (bx ^ bit) | beyond
                    if nbx == targets:
                        return depth
                else:
                    nbx = bx
                state = (nxt, nbx)
                if state not in seen:
                    seen.add(state)
                    nxt_frontier.append(state)
        frontier = nxt_frontier
    return None


def shortest_solution(room: Room) -> list[str] | None:
    """One optimal move list for ``room`` from its initial state (an oracle for tests and baselines)."""
    start = (room.player, room.boxes)
    parent: dict[tuple[int, int], tuple[tuple[int, int], str] | None] = {start: None}
    frontier = [start]
    goal = start if room.boxes == room.targets else None
    while frontier and goal is None:
        nxt_frontier = []
        for state in frontier:
            for name in DIRECTIONS:
                boxes, player, _ = _step(room.walls, state[1], state[0], _DELTA[name])
                new = (player, boxes)
                if new in parent or boxes & room.dead:
                    continue
                parent[new] = (state, name)
                if boxes == room.targets:
                    goal = new
                    break
                nxt_frontier.append(new)
            if goal is not None:
                break
        frontier = nxt_frontier
    if goal is None:
        return None
    moves: list[str] = []
    while parent[goal] is not None:
        goal, name = parent[goal]
        moves.append(name)
    return moves[::-1]


_SOLVABLE: dict[tuple[int, int, int, int], bool] = {}
_SOLVABLE_MAX = 200_000


def is_dead_end(room: Room, boxes: int, player: int, max_depth: int = DEAD_END_DEPTH) -> bool:
    """No solution within ``max_depth`` moves from (boxes, player) in ``room``; cached per state."""
    if boxes == room.targets:
        return False
    if boxes & room.dead:
        return True
    key = (room.walls, room.targets, boxes, player)
    solvable = _SOLVABLE.get(key)
    if solvable is None:
        solvable = solve(room.walls, room.targets, boxes, player, max_depth, room.dead) is not None
        if len(_SOLVABLE) >= _SOLVABLE_MAX:
            _SOLVABLE.clear()
        _SOLVABLE[key] = solvable
    return not solvable


def _carve_floor(rng: random.Random) -> list[int]:
    """Inner cells opened by a random walk that sometimes widens sideways (gym-sokoban's topology idea)."""
    row, col = rng.randint(1, SIZE - 2), rng.randint(1, SIZE - 2)
    steps = [(-1, 0), (1, 0), (0, -1), (0, 1)]
    direction = rng.choice(steps)
    floor = {(row, col)}
    for _ in range(int(1.7 * (SIZE + SIZE))):
        if rng.random() < 0.35:
            direction = rng.choice(steps)
        row = min(max(row + direction[0], 1), SIZE - 2)
        col = min(max(col + direction[1], 1), SIZE - 2)
        floor.add((row, col))
        if rng.random() < 0.6:
            dr, dc = rng.choice(steps)
            r2, c2 = row + dr, col + dc
            if 1 <= r2 <= SIZE - 2 and 1 <= c2 <= SIZE - 2:
                floor.add((r2, c2))
    return sorted(r * SIZE + c for r, c in floor)


def _reverse_play(rng: random.Random, walls: int, targets: int, player: int,
                  steps: int) -> list[tuple[int, int, int]]:
    """Walk backwards from the solved room: each step the player moves and may pull the box behind it.

    Returns the visited positions as (score, boxes, player), scored as gym-sokoban does: the number
    of switches between pulled boxes times the summed distance of the boxes from their targets, so
    the most scrambled positions come first when sorted.
    """
    origin = {cell: cell for cell in _bits(targets)}  # box position -> the target it started on
    boxes, swaps, last = targets, 0, -1
    deltas = list(_DELTA.values())[:4]
    visited: dict[tuple[int, int], int] = {}
    for _ in range(steps):
        delta = rng.choice(deltas)
        nxt = player + delta
        if (walls | boxes) >> nxt & 1:
            continue
        behind = player - delta
        if boxes >> behind & 1 and rng.random() < 0.8:
            boxes = (boxes ^ (1 << behind)) | (1 << player)
            start = origin.pop(behind)
            origin[player] = start
            if start != last:
                swaps, last = swaps + 1, start
        player = nxt
        if boxes != targets:
            distance = sum(abs(p // SIZE - t // SIZE) + abs(p % SIZE - t % SIZE) for p, t in origin.items())
            visited[(boxes, player)] = swaps * distance
    return sorted(((score, bx, pl) for (bx, pl), score in visited.items()), reverse=True)


@lru_cache(maxsize=8192)
def generate_room(seed: int, num_boxes: int = 2) -> Room:
    """The room of task instance ``seed``: deterministic, solvable, optimal length in 5..21 moves."""
    if num_boxes not in (1, 2, 3):
        raise ValueError(f"Sokoban supports 1, 2 or 3 boxes, got {num_boxes!r}")
    rng = random.Random(f"sokoban/{num_boxes}/{int(seed)}")
    full = (1 << (SIZE * SIZE)) - 1
    for _ in range(_MAX_ATTEMPTS):
        floor = _carve_floor(rng)
        if len(floor) < _MIN_FLOOR + num_boxes:
            continue
        walls = full
        for cell in floor:
            walls &= ~(1 << cell)
        picks = rng.sample(floor, num_boxes + 1)
        targets = sum(1 << c for c in picks[:num_boxes])
        candidates = sorted(
            (c for _ in range(_WALKS) for c in _reverse_play(rng, walls, targets, picks[-1], _WALK_STEPS)),
            reverse=True,
        )
        for _, boxes, player in candidates[:_CANDIDATES]:
            length = solve(walls, targets, boxes, player, MAX_SOLUTION)
            if length is not None and length >= MIN_SOLUTION:
                return Room(walls, targets, boxes, player, length, int(seed), num_boxes)
    raise RuntimeError(f"no Sokoban room found for seed {seed} with {num_boxes} boxes")  # pragma: no cover


# ------------------------------------------------------------------------------------------------
# Actions


def parse_moves(text: str) -> tuple[list[str] | None, str]:
    """(moves, "") from the text inside ``<action>``; (None, reason) for an invalid turn (rules above)."""
    if not isinstance(text, str):
        return None, "action is not text"
    pieces = [piece for piece in text.lower().split(",") if piece.strip()]
    if len(pieces) > MAX_MOVES_PER_TURN:
        return None, f"at most {MAX_MOVES_PER_TURN} moves per turn, got {len(pieces)} comma-separated pieces"
    moves = []
    for piece in pieces:
        found = [(piece.find(word), word) for word in MOVE_KEYWORDS]
        found = [(at, word) for at, word in found if at >= 0]
        if found:
            moves.append(min(found)[1])
    if not moves:
        return None, "no move among up/down/left/right/still"
    return moves, ""


def _all_move_combos() -> tuple[str, ...]:
    combos: list[str] = []
    layer: list[tuple[str, ...]] = [()]
    for _ in range(MAX_MOVES_PER_TURN):
        layer = [seq + (d,) for seq in layer for d in DIRECTIONS]
        combos.extend(", ".join(seq) for seq in layer)
    return tuple(combos)


MOVE_COMBOS = _all_move_combos()
"""The canonical actions: every sequence of 1 to 3 directions, e.g. ``"up"``, ``"up, left, down"`` (84)."""


# ------------------------------------------------------------------------------------------------
# Environment


def sokoban_prompt_spec(num_boxes: int, max_turns: int) -> PromptSpec:
    boxes = "one box" if num_boxes == 1 else f"{num_boxes} boxes"
    return PromptSpec(
        preamble=(
            f"You are solving a Sokoban puzzle: push {boxes} onto the targets in a 6x6 room.\n"
            "The room is shown one row per line, row 0 at the top, each line starting with its row "
            "number. Symbols: # wall, _ floor, O empty target, X box, √ box on a target, P you, "
            "S you standing on a target.\n"
            "Moves: up, down, left, right (still waits). Walking into a box pushes it one cell if the "
            "cell behind it is free; you cannot pull boxes, push two boxes at once, or walk through "
            "walls. A box pushed into a corner can never be moved out, so plan before you push.\n"
            "Rewards: -0.1 per move, +1 for pushing a box onto a target, -1 for pushing one off, and "
            "+10 when every box is on a target, which solves the puzzle and ends the trial. The trial "
            "also ends when the puzzle can no longer be solved.\n"
            f"Each turn you may make 1 to 3 moves, applied in order; you have {max_turns} turns. Every "
            "trial starts from the same room.\n"
            "Action format: <action>up, left, down</action> (one to three moves separated by commas)."
        ),
        compact_preamble=(
            f"sokoban . push all {num_boxes} X onto O . # wall _ floor O target X box √ box on target "
            "P you S you on target . moves up down left right . -0.1 per move , +1 box on target , "
            "-1 box off target , +10 solved . 1 to 3 moves per turn"
        ),
        action_format="<action>up, left, down</action> with one to three moves",
        history_window=7,
    )


@register_env("sokoban")
class SokobanEnv(TextEnv):
    """One meta-episode of Sokoban on the room of one seed (single agent: no opponent, no seat)."""

    max_turns: int = 7

    def __init__(self, num_boxes: int = 2, max_turns: int = 7, dead_end_depth: int = DEAD_END_DEPTH) -> None:
        if num_boxes not in (1, 2, 3):
            raise ValueError(f"Sokoban supports num_boxes 1, 2 or 3, got {num_boxes!r}")
        if int(max_turns) < 1:
            raise ValueError(f"max_turns must be positive, got {max_turns!r}")
        self.num_boxes = num_boxes
        self.max_turns = int(max_turns)
        self.dead_end_depth = int(dead_end_depth)
        self.prompt_spec = sokoban_prompt_spec(num_boxes, self.max_turns)
        self._room: Room | None = None
        self._boxes = 0
        self._player = 0
        self._done = False
        self._seed: int | None = None

    # -- protocol -------------------------------------------------------------------------------
    def reset(self, seed: int, *, opponent: str | None = None, seat: int | None = None,
              copy: int = 0) -> str:
        if opponent is not None:
            raise ValueError(f"Sokoban is a single-agent task; got opponent {opponent!r}")
        if seat not in (None, 0):
            raise ValueError(f"Sokoban is a single-agent task; got seat {seat!r}")
        self._seed = int(seed)
        self._room = generate_room(self._seed, self.num_boxes)
        return self.restart()

    def restart(self) -> str:
        room = self._require_room()
        self._boxes, self._player, self._done = room.boxes, room.player, False
        return self.observation

    def step_action(self, action: str) -> StepResult:
        room = self._require_room()
        if self._done:
            return self.invalid_step("the episode is over")
        moves, reason = parse_moves(action)
        if moves is None:
            return self.invalid_step(reason)
        reward, applied, solved, dead_end = 0.0, [], False, False
        for move in moves:
            before = (self._boxes & room.targets).bit_count()
            self._boxes, self._player, pushed = _step(room.walls, self._boxes, self._player, _DELTA[move])
            after = (self._boxes & room.targets).bit_count()
            reward += STEP_PENALTY + (after - before) * BOX_ON_TARGET
            applied.append(move)
            if self._boxes == room.targets:
                reward += SOLVED_BONUS
                solved = True
                break
            if pushed and is_dead_end(room, self._boxes, self._player, self.dead_end_depth):
                dead_end = True
                break
        self._done = solved or dead_end
        return StepResult(
            observation=self.observation,
            reward=round(reward, 6),
            done=self._done,
            info=StepInfo(
                won=solved,
                valid=True,
                score=1.0 if solved else 0.0,
                extra={
                    "moves": applied,
                    "skipped_moves": len(moves) - len(applied),
                    "dead_end": dead_end,
                    "boxes_on_target": (self._boxes & room.targets).bit_count(),
                },
            ),
            action=", ".join(applied),
        )

    def invalid_step(self, reason: str) -> StepResult:
        """Nothing changes, reward 0; a finished episode stays finished (``done`` as before)."""
        result = super().invalid_step(reason)
        return dataclasses.replace(result, done=self._done)

    def legal_actions(self) -> list[str]:
        """Every sequence of 1 to 3 directions (84 texts; ``still`` is accepted but never needed)."""
        return [] if self._done or self._room is None else list(MOVE_COMBOS)

    @property
    def observation(self) -> str:
        room = self._require_room()
        return render_room(room.walls, room.targets, self._boxes, self._player)

    @property
    def task_info(self) -> dict[str, Any]:
        room = self._room
        info: dict[str, Any] = {"seed": self._seed, "num_boxes": self.num_boxes}
        if room is not None:
            info["optimal_length"] = room.optimal_length
        return info

    # -- extras ---------------------------------------------------------------------------------
    def reset_to_room(self, room: Room) -> str:
        """Play a given room (hand-made rooms in tests and curricula) instead of a seed's room."""
        if room.num_boxes != self.num_boxes:
            raise ValueError(f"room has {room.num_boxes} boxes, the environment {self.num_boxes}")
        self._seed, self._room = room.seed, room
        return self.restart()

    @property
    def done(self) -> bool:
        return self._done

    @property
    def room(self) -> Room:
        return self._require_room()

    def _require_room(self) -> Room:
        if self._room is None:
            raise RuntimeError("call reset(seed) before using the Sokoban environment")
        return self._room
