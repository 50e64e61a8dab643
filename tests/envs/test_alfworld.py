"""ALFWorld: data discovery and splits, clear failures, the engine adapter (a test double, a compiled
TextWorld game made with TextWorld's GameMaker, and an ALFWorld PDDL game), win detection, restart."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mage_jax.envs.alfworld import (
    HELD_OUT_SPLITS,
    IN_DOMAIN_SPLITS,
    ALFWorldEnv,
    GameState,
    clean_feedback,
    write_tiny_alfred_game,
)
from mage_jax.envs.base import make_env
from tests.optional import require

TYPE_DIRS = {
    "pick": "pick_and_place_simple-Apple-None-Fridge-1",
    "look": "look_at_obj_in_light-Book-None-DeskLamp-2",
    "clean": "pick_clean_then_place_in_recep-Cloth-None-Bathtub-3",
    "heat": "pick_heat_then_place_in_recep-Egg-None-Plate-4",
    "cool": "pick_cool_then_place_in_recep-Apple-None-CounterTop-5",
    "pick_two": "pick_two_obj_and_place-Pen-None-Drawer-6",
}


def _trial(root: Path, folder: str, task_dir: str, trial: str = "trial_T1", *,
           game: str | None = "game.tw-pddl", solvable: bool | None = True) -> Path:
    path = root / "json_2.1.1" / folder / task_dir / trial
    path.mkdir(parents=True)
    (path / "traj_data.json").write_text(json.dumps({"task_type": task_dir.split("-")[0]}))
    if game is not None:
        content = {} if solvable is None else {"solvable": solvable}
        (path / game).write_text(json.dumps(content))
    return path


@pytest.fixture
def data(tmp_path: Path) -> Path:
    for task_dir in TYPE_DIRS.values():
        _trial(tmp_path, "train", task_dir)
    _trial(tmp_path, "train", "pick_and_place_with_movable_recep-Pen-Mug-Desk-1")
    _trial(tmp_path, "train", "pick_and_place_simple-AppleSliced-None-Fridge-7")
    _trial(tmp_path, "train", TYPE_DIRS["pick"], "trial_unsolvable", solvable=False)
    _trial(tmp_path, "train", TYPE_DIRS["pick"], "trial_unchecked", solvable=None)
    _trial(tmp_path, "train", TYPE_DIRS["pick"], "trial_without_game", game=None)
    _trial(tmp_path, "valid_seen", TYPE_DIRS["pick"])
    _trial(tmp_path, "valid_seen", TYPE_DIRS["cool"])
    _trial(tmp_path, "valid_unseen", TYPE_DIRS["look"])
    _trial(tmp_path, "valid_unseen", TYPE_DIRS["pick_two"])
    return tmp_path


class FakeEngine:
    """A scripted game honouring ``GameEngine``: take the key, then open the door."""

    INTRO = ("-= Welcome to TextWorld, ALFRED! =-\n\nYou are in a hall. You see a key 1 and a door 1.\n\n"
             "Your task is to: open the door 1.")
    created: list[FakeEngine] = []

    def __init__(self, path: str, extra_commands: int = 0) -> None:
        self.path, self.commands, self.resets, self.closed = path, [], 0, False
        self.extra = tuple(f"examine thing {i}" for i in range(extra_commands))
        FakeEngine.created.append(self)

    def _admissible(self) -> tuple[str, ...]:
        base = ("go to door 1", "help", "inventory", "look")
        return base + (("open door 1",) if self.has_key else ("take key 1 from floor",)) + self.extra

    def reset(self) -> GameState:
        self.resets += 1
        self.has_key = False
        return GameState(self.INTRO, self._admissible())

    def step(self, command: str) -> GameState:
        self.commands.append(command)
        if command == "explode":
            raise RuntimeError("engine failure")
        if command == "take key 1 from floor" and not self.has_key:
            self.has_key = True
            return GameState("You pick up the key 1 from the floor.", self._admissible())
        if command == "open door 1" and self.has_key:
            return GameState("You open the door 1.", self._admissible(), won=True, done=True)
        return GameState("Nothing happens.", self._admissible())

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def fake(data: Path) -> ALFWorldEnv:
    FakeEngine.created.clear()
    env = ALFWorldEnv(split="valid_seen", data_dir=data, engine_factory=FakeEngine)
    env.reset_to_game(env.games[0])
    return env


def _act(env: ALFWorldEnv, command: str):
    return env.step(f"<think>plan</think><action>{command}</action>")


# ------------------------------------------------------------------------------------------------
# Data and splits


def _types(env: ALFWorldEnv) -> list[str]:
    return sorted({g.task_type for g in env.games})


def test_splits_pick_their_folder_and_task_types(data):
    def env(**kw):
        return ALFWorldEnv(data_dir=data, engine_factory=FakeEngine, **kw)

    train = env(split="train")
    assert len(train.games) == 6  # movable, sliced, unsolvable, unchecked and game-less trials skipped
    assert [g.name for g in train.games if g.task_type == "pick_and_place_simple"] == [
        f"{TYPE_DIRS['pick']}/trial_T1"
    ]
    assert _types(env(split="lamer_train")) == sorted(
        ["pick_and_place_simple", "look_at_obj_in_light", "pick_clean_then_place_in_recep",
         "pick_heat_then_place_in_recep"]
    )
    assert _types(env(split="lamer_heldout")) == ["pick_cool_then_place_in_recep", "pick_two_obj_and_place"]
    assert _types(env(split="valid_seen")) == ["pick_and_place_simple", "pick_cool_then_place_in_recep"]
    assert _types(env(split="valid_unseen")) == ["look_at_obj_in_light", "pick_two_obj_and_place"]
    assert _types(env(split="valid_unseen", task_types="lamer_heldout")) == ["pick_two_obj_and_place"]
    assert _types(env(split="train", task_types=["cool", "pick_and_place_simple"])) == [
        "pick_and_place_simple", "pick_cool_then_place_in_recep"
    ]
    assert _types(env(split="train", task_types="look,heat")) == [
        "look_at_obj_in_light", "pick_heat_then_place_in_recep"
    ]
    assert "valid_unseen" in HELD_OUT_SPLITS and "lamer_heldout" in HELD_OUT_SPLITS
    assert IN_DOMAIN_SPLITS == ("valid_seen",)


def test_bad_split_or_task_type_is_a_clear_error(data):
    with pytest.raises(ValueError, match="unknown ALFWorld split 'test'; known: train"):
        ALFWorldEnv(split="test", data_dir=data, engine_factory=FakeEngine)
    with pytest.raises(ValueError, match="unknown ALFWorld task type 'slice'"):
        ALFWorldEnv(data_dir=data, task_types=["slice"], engine_factory=FakeEngine)
    with pytest.raises(ValueError, match="no ALFWorld games of types heat"):
        ALFWorldEnv(split="valid_seen", data_dir=data, task_types="heat", engine_factory=FakeEngine)


def test_seeds_of_both_parities_reach_every_game(data):
    env = ALFWorldEnv(split="train", data_dir=data, engine_factory=FakeEngine)
    for parity in (0, 1):
        seen = set()
        for k in range(200):
            env.reset(2 * k + parity)
            seen.add(env.task_info["game"])
        assert len(seen) == 6
    first = env.reset(12345) and env.task_info["game"]
    assert env.reset(12345) and env.task_info["game"] == first


def test_missing_data_names_what_to_download(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match=r"alfworld-download.*json_2\.1\.1.*game\.tw-pddl"):
        ALFWorldEnv(data_dir=tmp_path, engine_factory=FakeEngine)
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path / "elsewhere"))
    with pytest.raises(FileNotFoundError, match="elsewhere"):
        ALFWorldEnv(engine_factory=FakeEngine)
    (tmp_path / "json_2.1.1" / "train").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="no playable games"):
        ALFWorldEnv(data_dir=tmp_path, engine_factory=FakeEngine)


def test_missing_packages_name_the_extra(data, monkeypatch):
    monkeypatch.setitem(sys.modules, "textworld", None)
    monkeypatch.setitem(sys.modules, "alfworld", None)
    with pytest.raises(ImportError, match=r"pip install 'mage-jax\[alfworld\]'"):
        ALFWorldEnv(data_dir=data)
    with pytest.raises(ImportError, match=r"mage-jax\[alfworld\]"):
        write_tiny_alfred_game(data / "x")


def test_importing_the_environments_needs_neither_alfworld_nor_textworld():
    code = (
        "import sys; from mage_jax.envs.base import registered_envs; assert 'alfworld' in registered_envs(); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('alfworld', 'textworld')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_clean_feedback_drops_banners_and_prompt_lines():
    text = ("\n   ____  __\n  |    \\|  \\\n \\$$$$$$\n\nYou are now playing a game.\n\n-= Kitchen =-\n"
            "A kitchen.\n\n\n\n>   -= Kitchen =-0/1")
    assert clean_feedback(text) == "You are now playing a game.\n\n-= Kitchen =-\nA kitchen."
    assert clean_feedback(FakeEngine.INTRO).startswith("You are in a hall.")


# ------------------------------------------------------------------------------------------------
# The environment over a test double of the engine


def test_reset_shows_the_cleaned_intro_and_admissible_commands(fake):
    assert fake.observation == ("You are in a hall. You see a key 1 and a door 1.\n\n"
                                "Your task is to: open the door 1.")
    assert fake.legal_actions() == ["go to door 1", "inventory", "look", "take key 1 from floor"]
    info = fake.task_info
    assert (info["task_type"], info["goal"], info["split"]) == ("pick", "open the door 1.", "valid_seen")
    assert fake.max_turns == 10 and fake.prompt_spec.history_window == 15 and fake.show_admissible


def test_actions_are_sent_verbatim_and_win_gives_ten(fake):
    engine = FakeEngine.created[-1]
    miss = _act(fake, "Take key 1 from floor")
    assert engine.commands == ["Take key 1 from floor"]
    assert miss.info.valid and miss.observation == "Nothing happens."
    assert miss.info.extra["admissible"] is False
    took = _act(fake, "take key 1 from floor")
    assert took.reward == 0.0 and not took.done and took.info.extra["admissible"] is True
    assert "open door 1" in fake.legal_actions()
    won = _act(fake, "open door 1")
    assert won.reward == 10.0 and won.done and won.info.won and won.info.score == 1.0
    assert won.action == "open door 1" and fake.legal_actions() == []
    assert not _act(fake, "look").info.valid  # the episode is over
    assert len(engine.commands) == 3


@pytest.mark.parametrize("action", ["", "go to door 1\nopen door 1", "x" * 201])
def test_empty_or_multiline_actions_are_invalid_and_never_reach_the_engine(fake, action):
    before = (fake.observation, fake.legal_actions())
    result = fake.step_action(action)
    assert not result.info.valid and result.reward == 0.0 and not result.done
    assert (fake.observation, fake.legal_actions()) == before and FakeEngine.created[-1].commands == []


def test_missing_tags_and_engine_failures_are_invalid_turns(fake):
    before = fake.observation
    assert not fake.step("open door 1").info.valid
    result = _act(fake, "explode")
    assert not result.info.valid and "engine failure" in result.info.extra["invalid_reason"]
    assert fake.observation == before


def test_restart_replays_the_same_game_on_the_same_engine(fake):
    initial = fake.observation
    _act(fake, "take key 1 from floor")
    _act(fake, "open door 1")
    assert fake.restart() == initial and not fake.done
    assert "take key 1 from floor" in fake.legal_actions()
    assert len(FakeEngine.created) == 1 and FakeEngine.created[0].resets == 2
    fake.reset_to_game(fake.games[1])  # another game file: a fresh engine, the old one closed
    assert len(FakeEngine.created) == 2 and FakeEngine.created[0].closed


def test_long_admissible_lists_are_fitted_interactions_first(data):
    env = ALFWorldEnv(split="valid_seen", data_dir=data, admissible_chars=120,
                      engine_factory=lambda path: FakeEngine(path, extra_commands=100))
    env.reset(0)
    listed = env.legal_actions()
    assert len(env.all_admissible()) == 104
    assert "take key 1 from floor" in listed and "go to door 1" in listed
    assert len(", ".join(listed)) <= 120
    assert _act(env, "examine thing 99").info.extra["admissible"] is True  # unlisted commands still work


# ------------------------------------------------------------------------------------------------
# Real engines: a TextWorld game made locally, and an ALFWorld PDDL game


@pytest.fixture(scope="module")
def textworld_data(tmp_path_factory) -> Path:
    textworld = require("textworld")
    from textworld.generator.game import Event, Quest

    root = tmp_path_factory.mktemp("alfworld_tw")
    trial = root / "json_2.1.1" / "train" / TYPE_DIRS["pick"] / "trial_T1"
    trial.mkdir(parents=True)
    maker = textworld.GameMaker()
    kitchen, pantry = maker.new_room("kitchen"), maker.new_room("pantry")
    maker.connect(kitchen.east, pantry.west)
    maker.set_player(kitchen)
    apple = maker.new(type="o", name="apple")
    pantry.add(apple)
    won = Event(conditions={maker.new_fact("in", apple, maker.inventory)})
    maker.quests = [Quest(win_events=[won], desc="Go east and take the apple.")]
    options = textworld.GameOptions()
    options.path = str(trial / "game.z8")
    textworld.generator.compile_game(maker.build(), options)
    (trial / "traj_data.json").write_text(json.dumps({"task_type": "pick_and_place_simple"}))
    return root


@pytest.mark.filterwarnings("ignore:Game .* is not fully supported")  # jericho on TextWorld-made games
def test_textworld_game_reset_step_win_and_restart(textworld_data):
    env = make_env("alfworld", data_dir=str(textworld_data))
    initial = env.reset(0)
    assert "Kitchen" in initial and "Go east and take the apple." in initial
    assert "$$" not in initial and not initial.rstrip().endswith("0/1")
    assert "go east" in env.legal_actions()
    for meta in ("quit", "restart", "undo"):  # would derail the Z-machine: answered without it
        result = _act(env, meta)
        assert result.info.valid and result.observation == "Nothing happens." and not result.done
    moved = _act(env, "go east")
    assert moved.info.valid and "Pantry" in moved.observation and "take apple" in env.legal_actions()
    won = _act(env, "take apple")
    assert won.info.won and won.reward == 10.0 and won.done
    assert env.restart() == initial and "go east" in env.legal_actions() and not env.done
    assert _act(env, "go east").reward == 0.0 and _act(env, "take apple").info.won
    env.close()


@pytest.fixture(scope="module")
def alfred_data(tmp_path_factory) -> Path:
    require("alfworld")
    require("textworld")
    root = tmp_path_factory.mktemp("alfworld_pddl")
    write_tiny_alfred_game(root / "json_2.1.1" / "valid_unseen" / TYPE_DIRS["pick"] / "trial_T1")
    return root


def test_alfworld_pddl_game_through_the_alfred_wrappers(alfred_data):
    env = make_env("alfworld", split="valid_unseen", data_dir=str(alfred_data))
    initial = env.reset(1)
    assert initial == ("You are in the middle of a room. Looking quickly around you, you see a countertop 1, "
                       "and a fridge 1.\n\nYour task is to: put some apple in fridge.")
    assert env.legal_actions() == ["go to countertop 1", "go to fridge 1", "inventory", "look"]
    assert env.task_info["task_type"] == "pick" and env.task_info["goal"] == "put some apple in fridge."
    nothing = _act(env, "Go to countertop 1")
    assert nothing.info.valid and nothing.observation == "Nothing happens."
    assert not nothing.info.extra["admissible"]
    plan = ["go to countertop 1", "take apple 1 from countertop 1", "go to fridge 1", "open fridge 1"]
    for command in plan:
        result = _act(env, command)
        assert result.info.valid and result.reward == 0.0 and not result.done, command
    assert "move apple 1 to fridge 1" in env.legal_actions()
    won = _act(env, "move apple 1 to fridge 1")
    assert won.info.won and won.reward == 10.0 and won.done
    assert env.restart() == initial
    assert env.legal_actions() == ["go to countertop 1", "go to fridge 1", "inventory", "look"]
    env.close()


def test_solvable_flag_is_found_anywhere_in_a_large_game_file(tmp_path):
    trial = _trial(tmp_path, "train", TYPE_DIRS["pick"])
    (trial / "game.tw-pddl").write_text(json.dumps({"solvable": True, "pddl_problem": "x" * 20000}))
    _trial(tmp_path, "train", TYPE_DIRS["look"]).joinpath("game.tw-pddl").write_text(
        json.dumps({"pddl_problem": "x" * 20000, "solvable": False})
    )
    env = ALFWorldEnv(data_dir=tmp_path, engine_factory=FakeEngine)
    assert [g.task_type for g in env.games] == ["pick_and_place_simple"]


def test_compact_prompt_lists_the_admissible_commands(fake):
    from mage_jax.envs.prompts import render_play_prompt

    admissible = fake.legal_actions()
    prompt = render_play_prompt(fake.prompt_spec, fake.observation, [], 0, [], admissible=admissible,
                                style="compact")
    assert "admissible : go to door 1 | inventory | look | take key 1 from floor" in prompt
