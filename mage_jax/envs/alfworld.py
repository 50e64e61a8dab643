"""ALFWorld (docs/method.md §7.5): household text tasks on the TextWorld engine, from the user's local data.

Data: the ALFWorld game files under ``$ALFWORLD_DATA/json_2.1.1/<folder>/<task>-<object>-...-<scene>/
<trial>/`` (``traj_data.json`` and ``game.tw-pddl``, written by ``alfworld-download``); the folder is
the ``data_dir`` option, else ``$ALFWORLD_DATA``, else ``~/.cache/alfworld`` (alfworld's default).
Games are collected as ALFWorld's own loader does: trials with "movable" or "Sliced" in their path
are skipped, and so are PDDL games not marked solvable. A trial folder may instead hold a compiled
TextWorld game (``game.z8`` / ``game.ulx`` with its ``.json``): tests and demos use games made
locally in that layout.

Splits (``split``; ``task_types`` overrides the task types, ``data_folder`` the folder):

=============== ================ =========================================================
name            folder           task types
=============== ================ =========================================================
train           train            all six
valid_seen      valid_seen       all six (in-domain evaluation)
valid_unseen    valid_unseen     all six (held-out evaluation: unseen rooms)
lamer_train     train            pick, look, clean, heat (LaMer's training types)
lamer_heldout   train            cool, pick_two (LaMer's held-out types; never trained on)
=============== ================ =========================================================

A seed picks one game of the split uniformly (``random.Random(seed)``, so even and odd seed streams
both cover every game); ``restart()`` replays that game from its initial state. The action text is
sent to the engine verbatim (ALFWorld answers "Nothing happens." to a command that is not
admissible; such a turn is valid, as in the reference, and ``extra["admissible"]`` records whether it
was listed); an empty or multi-line action is invalid. Reward 10 × won; max 10 turns. The
observation is the engine's text with TextWorld's banners and prompt lines removed; the admissible
list drops ``help`` and is fitted to ``admissible_chars`` (``mage_jax.envs.admissible``: interactions
first, then ``go to``, then examine / look / inventory).

The engine is behind a three-method adapter (``GameEngine``: reset, step, close) so the environment
logic is the same for ALFWorld's PDDL games, compiled TextWorld games and test doubles; ``alfworld``
and ``textworld`` (extra ``alfworld``) are imported only when a real engine starts.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import os
import random
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar, Protocol

from mage_jax.envs.admissible import fit_admissible
from mage_jax.envs.base import PromptSpec, StepInfo, StepResult, TextEnv, register_env

__all__ = [
    "ALFWorldEnv",
    "GameEngine",
    "GameEntry",
    "GameState",
    "HELD_OUT_SPLITS",
    "IN_DOMAIN_SPLITS",
    "LAMER_HELDOUT_TYPES",
    "LAMER_TRAIN_TYPES",
    "SPLITS",
    "TASK_TYPES",
    "TextWorldEngine",
    "alfworld_prompt_spec",
    "clean_feedback",
    "discover_games",
    "resolve_data_dir",
    "write_tiny_alfred_game",
]

# ALFWorld's task types, in its own order (task type ids 1..6), with the short names we report.
TASK_TYPES = {
    "pick_and_place_simple": "pick",
    "look_at_obj_in_light": "look",
    "pick_clean_then_place_in_recep": "clean",
    "pick_heat_then_place_in_recep": "heat",
    "pick_cool_then_place_in_recep": "cool",
    "pick_two_obj_and_place": "pick_two",
}
_ALL_TYPES = tuple(TASK_TYPES)
LAMER_TRAIN_TYPES = _ALL_TYPES[:4]
LAMER_HELDOUT_TYPES = _ALL_TYPES[4:]
SPLITS: dict[str, tuple[str, tuple[str, ...]]] = {
    "train": ("train", _ALL_TYPES),
    "valid_seen": ("valid_seen", _ALL_TYPES),
    "valid_unseen": ("valid_unseen", _ALL_TYPES),
    "lamer_train": ("train", LAMER_TRAIN_TYPES),
    "lamer_heldout": ("train", LAMER_HELDOUT_TYPES),
}
IN_DOMAIN_SPLITS = ("valid_seen",)
HELD_OUT_SPLITS = ("valid_unseen", "lamer_heldout")

WON_REWARD = 10.0
GAME_FILES = ("game.tw-pddl", "game.z8", "game.ulx")
MAX_ACTION_CHARS = 200
_ALFRED_WELCOME = re.compile(r"^\s*-= Welcome to TextWorld, ALFRED! =-\s*$", re.MULTILINE)
_SOLVABLE = re.compile(r'"solvable"\s*:\s*(true|false)')
_TASK = re.compile(r"Your task is to:\s*(.+)")


# ------------------------------------------------------------------------------------------------
# Data


def resolve_data_dir(data_dir: str | os.PathLike | None = None) -> Path:
    """``data_dir``, else ``$ALFWORLD_DATA``, else ``~/.cache/alfworld`` (where alfworld-download writes)."""
    if data_dir is None:
        data_dir = os.environ.get("ALFWORLD_DATA") or "~/.cache/alfworld"
    return Path(data_dir).expanduser()


def _missing_data_error(root: Path, folder: str, detail: str) -> FileNotFoundError:
    return FileNotFoundError(
        f"ALFWorld data not found: {detail}. Install the extra (pip install 'mage-jax[alfworld]') and run "
        "`alfworld-download`, which writes the ALFWorld game files (json_2.1.1/{train,valid_seen,"
        "valid_unseen}/.../traj_data.json and game.tw-pddl) and the PDDL / grammar logic files into "
        f"$ALFWORLD_DATA (default ~/.cache/alfworld); then set ALFWORLD_DATA or pass data_dir= to the "
        f"folder that contains json_2.1.1 (looked in {root} for split folder {folder!r})."
    )


@dataclasses.dataclass(frozen=True)
class GameEntry:
    """One playable game: its file, its ALFWorld task type and its trial folder relative to the split."""

    path: str
    task_type: str
    name: str


def _task_type_of(trial: Path) -> str | None:
    prefix = trial.parent.name.split("-", 1)[0]
    if prefix in TASK_TYPES:
        return prefix
    try:
        with open(trial / "traj_data.json", encoding="utf-8") as f:
            kind = json.load(f).get("task_type")
    except (OSError, ValueError, AttributeError):
        return None
    return kind if kind in TASK_TYPES else None


def _solvable(game_file: Path) -> bool:
    """PDDL games carry ALFWorld's solvability flag; compiled TextWorld games are playable as they are."""
    if game_file.suffix != ".tw-pddl":
        return True
    try:
        with open(game_file, "rb") as f:  # the flag is written last: try the tail before the whole file
            size = f.seek(0, os.SEEK_END)
            f.seek(max(size - 4096, 0))
            match = _SOLVABLE.search(f.read().decode("utf-8", "replace"))
            if match is None and size > 4096:
                f.seek(0)
                match = _SOLVABLE.search(f.read().decode("utf-8", "replace"))
    except OSError:
        return False
    return match is not None and match.group(1) == "true"


@functools.lru_cache(maxsize=16)
def discover_games(root: str, folder: str) -> tuple[GameEntry, ...]:
    """Every playable game of ``<root>/json_2.1.1/<folder>`` in path order (cached per process)."""
    base = Path(root) / "json_2.1.1" / folder
    if not base.is_dir():
        raise _missing_data_error(Path(root), folder, f"no folder {base}")
    games = []
    for dirpath, _dirs, files in sorted(os.walk(base)):
        if "traj_data.json" not in files or "movable" in dirpath or "Sliced" in dirpath:
            continue
        trial = Path(dirpath)
        game_file = next((trial / n for n in GAME_FILES if n in files), None)
        kind = _task_type_of(trial)
        if game_file is None or kind is None or not _solvable(game_file):
            continue
        games.append(GameEntry(str(game_file), kind, str(trial.relative_to(base))))
    if not games:
        raise _missing_data_error(Path(root), folder, f"no playable games under {base}")
    return tuple(games)


def _resolve_types(task_types: str | Sequence[str] | None, default: tuple[str, ...]) -> tuple[str, ...]:
    if task_types is None:
        return default
    named = {"all": _ALL_TYPES, "lamer_train": LAMER_TRAIN_TYPES, "lamer_heldout": LAMER_HELDOUT_TYPES}
    if isinstance(task_types, str):
        if task_types in named:
            return named[task_types]
        task_types = [t.strip() for t in task_types.split(",") if t.strip()]
    short = {v: k for k, v in TASK_TYPES.items()}
    out = []
    for t in task_types:
        full = t if t in TASK_TYPES else short.get(t)
        if full is None:
            known = ", ".join([*TASK_TYPES, *short, *named])
            raise ValueError(f"unknown ALFWorld task type {t!r}; known: {known}")
        out.append(full)
    return tuple(dict.fromkeys(out))


# ------------------------------------------------------------------------------------------------
# Engines


@dataclasses.dataclass(frozen=True)
class GameState:
    """What the environment needs from one engine answer."""

    feedback: str
    admissible: tuple[str, ...]
    won: bool = False
    lost: bool = False
    done: bool = False


class GameEngine(Protocol):
    """A loaded game: ``reset`` (re)starts it from its initial state, ``step`` applies one command."""

    def reset(self) -> GameState: ...

    def step(self, command: str) -> GameState: ...

    def close(self) -> None: ...


def _require(module: str, what: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(
            f"ALFWorld needs the {what} package: pip install 'mage-jax[alfworld]' (alfworld and textworld)"
        ) from None


class TextWorldEngine:
    """The adapter over ``textworld.start``: ALFWorld PDDL games get ALFWorld's name demangler
    (objects read "apple 1", as in the reference) and compiled TextWorld games play as they are.

    A PDDL game answers any text itself ("Nothing happens." unless admissible). A compiled game runs
    on a Z-machine interpreter, where meta commands ("quit", "restart", "undo") derail the game and
    control characters can hang it, so only admissible commands reach it; any other text gets the
    PDDL answer "Nothing happens." and changes nothing.
    """

    def __init__(self, game_file: str) -> None:
        textworld = _require("textworld", "textworld")
        wrappers: list[Any] = []
        self._pddl = str(game_file).endswith(".tw-pddl")
        if self._pddl:
            alfred = _require("alfworld.agents.environment.alfred_tw_env", "alfworld")
            wrappers = [alfred.AlfredDemangler(shuffle=False), alfred.AlfredInfos]
        infos = textworld.EnvInfos(admissible_commands=True, won=True, lost=True)
        self._env = textworld.start(str(game_file), request_infos=infos, wrappers=wrappers)
        self._last: GameState | None = None

    @staticmethod
    def _state(game_state: Any, done: bool) -> GameState:
        return GameState(
            feedback=str(game_state.feedback or ""),
            admissible=tuple(game_state.get("admissible_commands") or ()),
            won=bool(game_state.get("won")),
            lost=bool(game_state.get("lost")),
            done=bool(done),
        )

    def reset(self) -> GameState:
        self._last = self._state(self._env.reset(), False)
        return self._last

    def step(self, command: str) -> GameState:
        if not self._pddl and self._last is not None and command not in self._last.admissible:
            return dataclasses.replace(self._last, feedback="Nothing happens.")
        game_state, _score, done = self._env.step(command)
        self._last = self._state(game_state, done)
        return self._last

    def close(self) -> None:
        self._env.close()


def clean_feedback(text: str) -> str:
    """Engine text without TextWorld's decorations: ALFRED's welcome line, ASCII-art banners (lines
    with no letter or digit) and the ``>`` prompt / status lines; blank runs collapsed."""
    text = _ALFRED_WELCOME.sub("", str(text))
    lines = [
        line.rstrip()
        for line in text.splitlines()
        if not line.strip() or (any(ch.isalnum() for ch in line) and not line.lstrip().startswith(">"))
    ]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


# ------------------------------------------------------------------------------------------------
# Environment


def alfworld_prompt_spec(max_turns: int) -> PromptSpec:
    return PromptSpec(
        preamble=(
            "You are an expert agent operating in the ALFRED embodied household environment, a text "
            "game. The initial observation describes the room and ends with your task.\n"
            "Each turn, send one command; the admissible commands of the current situation are listed "
            "(for example go to <place>, open / close <receptacle>, take <object> from <receptacle>, "
            "move <object> to <receptacle>, heat / cool / clean <object> with <appliance>, use "
            "<lamp>, examine, look, inventory). Write the command exactly as listed; any other text "
            "does nothing.\n"
            f"Completing the task gives reward 10 and ends the trial; you have {max_turns} commands. "
            "Every trial starts from the same room with the same task.\n"
            "Action format: <action>go to countertop 1</action>"
        ),
        compact_preamble=(
            "alfworld . household task in text . one admissible command per turn . "
            "task done gives reward 10"
        ),
        action_format=(
            "one admissible command in <action>...</action>, e.g. <action>go to countertop 1</action>"
        ),
        history_window=15,
    )


def _rank(command: str) -> int:
    if command.startswith(("examine", "look", "inventory")):
        return 2
    if command.startswith("go to"):
        return 1
    return 0


@register_env("alfworld")
class ALFWorldEnv(TextEnv):
    """One meta-episode on one ALFWorld game (single agent: no opponent, no seat).

    Options: ``split`` (module docstring), ``data_dir``, ``task_types`` (names, short names or
    "all" / "lamer_train" / "lamer_heldout"), ``data_folder``, ``max_turns`` (10),
    ``admissible_chars`` (None: no limit), ``engine_factory`` (game file -> ``GameEngine``;
    default ``TextWorldEngine``).
    """

    max_turns: int = 10
    show_admissible: ClassVar[bool] = True
    slow_steps: ClassVar[bool] = True

    def __init__(self, split: str = "train", data_dir: str | os.PathLike | None = None,
                 task_types: str | Sequence[str] | None = None, data_folder: str | None = None,
                 max_turns: int = 10, admissible_chars: int | None = 3000,
                 engine_factory: Callable[[str], GameEngine] | None = None) -> None:
        if split not in SPLITS:
            raise ValueError(f"unknown ALFWorld split {split!r}; known: {', '.join(SPLITS)}")
        if int(max_turns) < 1:
            raise ValueError(f"max_turns must be positive, got {max_turns!r}")
        folder, default_types = SPLITS[split]
        self.split = split
        self.data_folder = data_folder or folder
        self.task_types = _resolve_types(task_types, default_types)
        self.data_dir = resolve_data_dir(data_dir)
        games = discover_games(str(self.data_dir), self.data_folder)
        self.games = tuple(g for g in games if g.task_type in self.task_types)
        if not self.games:
            names = ", ".join(TASK_TYPES[t] for t in self.task_types)
            where = self.data_dir / "json_2.1.1" / self.data_folder
            raise ValueError(f"no ALFWorld games of types {names} in {where}")
        if engine_factory is None:  # after the data: a missing folder is the first thing to report
            _require("textworld", "textworld")
            engine_factory = TextWorldEngine
        self._engine_factory = engine_factory
        self.max_turns = int(max_turns)
        self.admissible_chars = None if admissible_chars is None else int(admissible_chars)
        self.prompt_spec = alfworld_prompt_spec(self.max_turns)
        self._seed: int | None = None
        self._game: GameEntry | None = None
        self._engine: GameEngine | None = None
        self._engine_path: str | None = None
        self._state: GameState | None = None
        self._admissible: tuple[str, ...] = ()
        self._observation = ""
        self._initial = ""

    # -- protocol -------------------------------------------------------------------------------
    def reset(self, seed: int, *, opponent: str | None = None, seat: int | None = None,
              copy: int = 0) -> str:
        if opponent is not None or seat not in (None, 0):
            raise ValueError(f"ALFWorld is a single-agent task; got opponent {opponent!r}, seat {seat!r}")
        self._seed = int(seed)
        return self.reset_to_game(self.games[random.Random(self._seed).randrange(len(self.games))])

    def restart(self) -> str:
        if self._engine is None or self._game is None:
            raise RuntimeError("call reset(seed) before using the ALFWorld environment")
        self._apply(self._engine.reset())
        self._initial = self._observation
        return self._observation

    def step_action(self, action: str) -> StepResult:
        if self._state is None or self._engine is None:
            raise RuntimeError("call reset(seed) before using the ALFWorld environment")
        if self.done:
            return self.invalid_step("the episode is over")
        if not action or "\n" in action or len(action) > MAX_ACTION_CHARS:
            return self.invalid_step(f"the action must be one command of 1 to {MAX_ACTION_CHARS} characters")
        listed = action in self._admissible
        try:
            state = self._engine.step(action)
        except Exception as e:  # an engine must never end a run on model output
            return self.invalid_step(f"the game engine rejected the command ({type(e).__name__}: {e})")
        self._apply(state)
        won = state.won
        return StepResult(
            observation=self._observation,
            reward=WON_REWARD if won else 0.0,
            done=self.done,
            info=StepInfo(won=won, valid=True, score=1.0 if won else 0.0, extra={"admissible": listed}),
            action=action,
        )

    def legal_actions(self) -> list[str]:
        """The engine's admissible commands without ``help``, fitted to ``admissible_chars``."""
        if self._state is None or self.done:
            return []
        return fit_admissible(self._admissible, self.admissible_chars, _rank)

    @property
    def observation(self) -> str:
        return self._observation

    @property
    def task_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"seed": self._seed, "split": self.split}
        if self._game is not None:
            match = _TASK.search(self._initial)
            info.update(
                task_type=TASK_TYPES[self._game.task_type],
                alfworld_task_type=self._game.task_type,
                game=self._game.name,
                goal=match.group(1).strip() if match else None,
            )
        return info

    # -- extras ---------------------------------------------------------------------------------
    def reset_to_game(self, game: GameEntry) -> str:
        """Play a given game (tests, demos); the engine is reused while the game file is the same."""
        if self._engine is None or self._engine_path != game.path:
            self.close()
            self._engine = self._engine_factory(game.path)
            self._engine_path = game.path
        self._game = game
        return self.restart()

    @property
    def done(self) -> bool:
        return self._state is not None and (self._state.won or self._state.lost or self._state.done)

    def all_admissible(self) -> list[str]:
        """Every admissible command (``help`` excepted), before the prompt budget."""
        return list(self._admissible)

    def close(self) -> None:
        if self._engine is not None:
            try:
                self._engine.close()
            finally:
                self._engine, self._engine_path = None, None

    def _apply(self, state: GameState) -> None:
        self._state = state
        self._admissible = tuple(c for c in state.admissible if c != "help")
        self._observation = clean_feedback(state.feedback)


# ------------------------------------------------------------------------------------------------
# A tiny ALFWorld-format game (tests, demos, benchmarks without the real data)

_TINY_PROBLEM = """(define (problem tiny_kitchen)
(:domain alfred)
(:objects
agent1 - agent
AppleType - otype
FridgeType - rtype
CounterTopType - rtype
Apple_bar__plus_01_dot_00 - object
Fridge_bar__plus_02_dot_00 - receptacle
CounterTop_bar__plus_03_dot_00 - receptacle
loc_bar_start - location
loc_bar_fridge - location
loc_bar_counter - location
)
(:init
(atLocation agent1 loc_bar_start)
(receptacleType Fridge_bar__plus_02_dot_00 FridgeType)
(receptacleType CounterTop_bar__plus_03_dot_00 CounterTopType)
(objectType Apple_bar__plus_01_dot_00 AppleType)
(openable Fridge_bar__plus_02_dot_00)
(canContain FridgeType AppleType)
(canContain CounterTopType AppleType)
(pickupable Apple_bar__plus_01_dot_00)
(coolable Apple_bar__plus_01_dot_00)
(receptacleAtLocation Fridge_bar__plus_02_dot_00 loc_bar_fridge)
(receptacleAtLocation CounterTop_bar__plus_03_dot_00 loc_bar_counter)
(objectAtLocation Apple_bar__plus_01_dot_00 loc_bar_counter)
(inReceptacle Apple_bar__plus_01_dot_00 CounterTop_bar__plus_03_dot_00)
)
(:goal (and (exists (?r - receptacle) (exists (?o - object) (and (objectType ?o AppleType) {goal})))))
)
"""
_TINY_TASKS = {
    "pick_and_place_simple": (
        "put some apple in fridge",
        "(receptacleType ?r FridgeType) (inReceptacle ?o ?r)",
    ),
    "pick_cool_then_place_in_recep": (
        "cool some apple and put it in countertop",
        "(isCool ?o) (receptacleType ?r CounterTopType) (inReceptacle ?o ?r)",
    ),
}


def write_tiny_alfred_game(trial_dir: str | os.PathLike, task_type: str = "pick_and_place_simple") -> Path:
    """Write a one-room ALFWorld PDDL game (an apple, a countertop, a fridge) as a trial folder
    (``traj_data.json`` + ``game.tw-pddl``) using the domain and grammar shipped with ``alfworld``.

    ``pick_and_place_simple`` is won by: go to countertop 1, take apple 1 from countertop 1, go to
    fridge 1, open fridge 1, move apple 1 to fridge 1. ``pick_cool_then_place_in_recep``: take the
    apple, go to fridge 1, cool apple 1 with fridge 1, go to countertop 1, move apple 1 to countertop 1.
    """
    if task_type not in _TINY_TASKS:
        raise ValueError(f"tiny games exist for {', '.join(_TINY_TASKS)}; got {task_type!r}")
    alfworld = _require("alfworld", "alfworld")
    logic = Path(alfworld.__file__).parent / "data"
    text, goal = _TINY_TASKS[task_type]
    game = {
        "pddl_domain": (logic / "alfred.pddl").read_text(encoding="utf-8"),
        "grammar": (logic / "alfred.twl2").read_text(encoding="utf-8").replace("UNKNOWN GOAL", text),
        "pddl_problem": _TINY_PROBLEM.format(goal=goal),
        "solvable": True,
    }
    trial = Path(trial_dir)
    trial.mkdir(parents=True, exist_ok=True)
    (trial / "traj_data.json").write_text(json.dumps({"task_type": task_type}), encoding="utf-8")
    path = trial / "game.tw-pddl"
    path.write_text(json.dumps(game), encoding="utf-8")
    return path
