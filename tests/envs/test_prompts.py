"""Play / reflect prompt rendering and memory (docs/method.md §3)."""

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mage_jax.envs.base import PromptSpec
from mage_jax.envs.prompts import (
    MEMORY_MODES,
    EpisodeRecord,
    Move,
    compact_text,
    format_reward,
    render_memory,
    render_play_prompt,
    render_reflect_prompt,
)

SPEC = PromptSpec(
    preamble="You play a test game.",
    compact_preamble="test game . act A or B",
    action_format="A or B",
    history_window=3,
)


def _moves(n, tag="m"):
    return tuple(Move(f"go {i + 1}", f"{tag} state {i + 1}", reward=-0.1) for i in range(n))


def _record(n=2, reflection="Try B first.", reward=-0.2):
    return EpisodeRecord(moves=_moves(n, "old"), reward=reward, won=False, reflection=reflection)


@pytest.mark.parametrize("style", ["full", "compact"])
def test_play_prompt_sections_appear_in_spec_order(style):
    text = render_play_prompt(SPEC, "the start", [_record()], 1, _moves(1), admissible=["go 9"], style=style)
    if style == "full":
        order = ["You play a test game.", "the start", "Try B first.", "on trial #2", "go 1", "go 9"]
    else:
        order = ["test game . act A or B", "the start", "Try B first .", "trial 2 now", "go 1", "go 9"]
    order.append("<action>")
    positions = [text.index(piece) for piece in order]
    assert positions == sorted(positions)


def test_reflection_only_memory_uses_the_spec_sentence():
    text = render_play_prompt(SPEC, "INITIAL", [_record(reflection="Go left.")], 1, [])
    assert "On trial #1 the task was NOT successfully completed. Your reflection: Go left." in text
    assert "Currently on trial #2" in text
    assert "old state 1" not in text  # reflection_only carries no trajectory


@pytest.mark.parametrize("style", ["full", "compact"])
def test_history_memory_shows_every_action_observation_and_the_outcome(style):
    record = EpisodeRecord(moves=_moves(5, "old"), reward=-7.5, won=False, reflection="R")
    text = render_memory([record], memory_mode="history_only", style=style)
    for i in range(1, 6):
        assert f"go {i}" in text and f"old state {i}" in text
    assert "-7.5" in text
    assert ("fail" if style == "compact" else "NOT successfully completed") in text
    assert "reflection" not in text.lower()


def test_history_and_reflection_memory_has_both():
    text = render_memory([_record(reflection="Plan X.")], memory_mode="history_and_reflection")
    assert "old state 2" in text and "Plan X." in text


def test_memory_is_empty_text_before_the_first_reflection():
    for mode in MEMORY_MODES:
        assert render_memory([], memory_mode=mode) == ""


def test_play_prompt_shows_last_window_moves_and_observations_of_the_two_most_recent():
    text = render_play_prompt(SPEC, "INITIAL", [], 0, _moves(5, "cur"))
    assert "Turn 1:" not in text and "Turn 2:" not in text  # W = 3
    assert 'Turn 3: action "go 3"' in text and "cur state 3" not in text
    assert "cur state 4" in text and "cur state 5" in text
    assert "your last 3 of 5 turns" in text
    assert "Observation after it (the current state):\ncur state 5" in text


def test_reflect_prompt_shows_all_window_moves_with_observations_and_asks_for_a_remark():
    record = EpisodeRecord(moves=_moves(4, "ep"), reward=-0.4, won=False, reflection=None)
    text = render_reflect_prompt(SPEC, "INITIAL", record, 0)
    assert "ep state 1" not in text  # outside W = 3
    assert all(f"ep state {i}" in text for i in (2, 3, 4))
    assert "NOT successfully completed" in text and "<remark>" in text and "mistakes" in text


def test_privileged_text_only_when_given():
    record = _record()
    assert "King" in render_reflect_prompt(SPEC, "I", record, 0, privileged="Opponent card: King")
    assert "Revealed" not in render_reflect_prompt(SPEC, "I", record, 0)


def test_invalid_moves_render_as_invalid_without_an_action():
    moves = (Move(action=None, observation="same", reward=0.0, valid=False),)
    assert "invalid action" in render_play_prompt(SPEC, "I", [], 0, moves)
    assert "turn 1 : invalid" in render_play_prompt(SPEC, "I", [], 0, moves, style="compact")


def test_compact_text_separates_numbers_and_symbols_and_is_idempotent():
    assert compact_text("0:#_OX√", board=True) == "0 : # _ O X √"
    assert compact_text("BET") == "BET" and compact_text("Opponent's card") == "Opponent's card"
    assert compact_text("(1, 2) reward -0.1 row-1") == "( 1 , 2 ) reward -0.1 row - 1"
    once = compact_text("Your Card: Queen | Player 0: Pass -> Bet\n\n1 ? 2\nX.O", board=True)
    assert compact_text(once, board=True) == once and once.endswith("\nX . O")


def test_compact_prompt_has_no_decorative_sentences():
    text = render_play_prompt(SPEC, "0:#_OX", [_record()], 1, _moves(2), style="compact")
    assert "0 : # _ O X" in text
    assert "Think" not in text and "Currently" not in text
    assert all(len(token) <= 12 for token in text.split()), text


def test_reward_text_is_short_and_stable():
    assert [format_reward(x) for x in (-0.1, 10.9, 10.0, 0.0, -0.0, -0.30000000000000004)] == [
        "-0.1", "10.9", "10", "0", "0", "-0.3",
    ]


def test_unknown_memory_mode_or_style_is_one_clear_error():
    with pytest.raises(ValueError, match="memory_mode"):
        render_play_prompt(SPEC, "I", [], 0, [], memory_mode="everything")
    with pytest.raises(ValueError, match="style"):
        render_reflect_prompt(SPEC, "I", _record(), 0, style="tiny")


# -- golden snapshots ---------------------------------------------------------------------------
# One play prompt per environment, memory mode and style, and one reflect prompt per environment and
# style, rendered from a scripted meta-episode (episode 0 finished and reflected on, episode 1 under
# way) and compared exactly with tests/envs/golden/*.txt. After an intended change, regenerate with
#     UPDATE_GOLDEN=1 python -m pytest tests/envs/test_prompts.py
# and read the diff of the .txt files before committing them.

GOLDEN_DIR = Path(__file__).parent / "golden"
GOLDEN_ENVS = ["kuhn_poker", "tic_tac_toe", "sokoban", "minesweeper"]
REFLECTION = "I moved without a plan. Next time: check the board first, then take the safest move."


def _script(name: str, env) -> tuple[list[str], list[str]]:
    """Responses of episode 0 and of episode 1 so far (raw model text, some invalid on purpose)."""
    if name == "kuhn_poker":
        bet = "<think>A Queen is worth a bet.</think><action>BET</action>"
        return [bet], ["I pass.", "<action>PASS</action>"]
    if name == "tic_tac_toe":
        return (
            ["<action>(1, 2)</action>", "<action>(3, 2)</action>", "<action>(2, 2)</action>",
             "<action>(1, 3)</action>", "<action>(2, 1)</action>"],
            ["<action>(1, 1)</action>", "(3, 3)", "<action>(3, 3)</action>"],
        )
    if name == "sokoban":
        return (
            ["<action>up, left</action>", "<action>jump</action>", "<action>down, down, right</action>",
             "<action>left, up, up</action>", "<action>right</action>", "<action>up, up</action>",
             "<action>left, left, down</action>"],
            ["<action>left</action>", "<action>Up, Right</action>", "no tags"],
        )
    mine = min(env.board.mines)
    return (
        ["<action>(1, 1)</action>", "<action>(6, 6)</action>", "<action>(9, 9)</action>",
         f"<action>({mine // 6 + 1}, {mine % 6 + 1})</action>"],
        ["<action>(6, 6)</action>", "<action>(6, 6)</action>", "<action>(1, 1)</action>"],
    )


# Compact prompts are the tiny presets' (the games' trial hint on); full prompts are the pretrained
# presets' (the reference wording, no hint).
GOLDEN_ENV_OPTIONS = {("kuhn_poker", "compact"): {"trial_hint": True},
                      ("tic_tac_toe", "compact"): {"trial_hint": True}}


def _scenario(name: str, style: str = "full"):
    from mage_jax.envs.base import make_env, registered_envs

    if name not in registered_envs():
        pytest.skip(f"{name} is not registered")
    reset_kwargs = {
        "kuhn_poker": {"opponent": "intermediate", "seat": 0},  # seed 5: Queen against King
        "tic_tac_toe": {"opponent": "preferred-1", "seat": 0},
    }.get(name, {})
    env = make_env(name, **GOLDEN_ENV_OPTIONS.get((name, style), {}))
    initial = env.reset(5, **reset_kwargs)
    first, second = _script(name, env)
    moves = []
    for response in first:
        result = env.step(response)
        moves.append(Move(result.action, result.observation, result.reward, result.info.valid))
        if result.done:
            break
    record = EpisodeRecord(tuple(moves), sum(m.reward for m in moves), bool(result.info.won), REFLECTION)
    privileged = env.privileged_observation()
    assert env.restart() == initial
    current = []
    for response in second:
        result = env.step(response)
        current.append(Move(result.action, result.observation, result.reward, result.info.valid))
    return env.prompt_spec, initial, record, current, privileged


def _check_golden(filename: str, text: str) -> None:
    path = GOLDEN_DIR / filename
    if os.environ.get("UPDATE_GOLDEN"):
        GOLDEN_DIR.mkdir(exist_ok=True)
        path.write_text(text + "\n", encoding="utf-8")
        return
    assert path.exists(), f"missing {path}; create it with UPDATE_GOLDEN=1 python -m pytest {__file__}"
    assert text + "\n" == path.read_text(encoding="utf-8"), (
        f"{filename} changed; if intended, regenerate with UPDATE_GOLDEN=1 and review the diff"
    )


@pytest.mark.parametrize("style", ["full", "compact"])
@pytest.mark.parametrize("name", GOLDEN_ENVS)
def test_golden_prompts(name, style):
    spec, initial, record, current, privileged = _scenario(name, style)
    for mode in MEMORY_MODES:
        text = render_play_prompt(spec, initial, [record], 1, current, memory_mode=mode, style=style)
        _check_golden(f"{name}__play__{mode}__{style}.txt", text)
    text = render_reflect_prompt(spec, initial, record, 0, style=style, privileged=privileged)
    _check_golden(f"{name}__reflect__{style}.txt", text)


@settings(max_examples=60, deadline=None)
@given(
    observation=st.text(max_size=60),
    action=st.none() | st.text(max_size=20),
    reflection=st.none() | st.text(max_size=60),
    reward=st.floats(-20, 20, allow_nan=False),
    style=st.sampled_from(["full", "compact"]),
)
def test_rendering_never_raises_on_arbitrary_text(observation, action, reflection, reward, style):
    move = Move(action, observation, reward, action is not None)
    record = EpisodeRecord((move, move), reward, False, reflection)
    for mode in MEMORY_MODES:
        text = render_play_prompt(SPEC, observation, [record], 1, [move] * 3, memory_mode=mode, style=style)
        assert text.startswith(SPEC.preamble if style == "full" else "test game")
    reflect = render_reflect_prompt(SPEC, observation, record, 0, style=style, privileged=observation)
    if style == "compact":
        assert "  " not in reflect


def test_trimmed_memory_keeps_its_trial_numbers():
    """Dropping the oldest memory entries (prompt overflow) must not renumber the remaining trials."""
    from mage_jax.envs.prompts import EpisodeRecord, render_memory

    kept = EpisodeRecord(moves=(), reward=-5.0, won=False, reflection="bet less", episode=1)
    text = render_memory([kept], memory_mode="reflection_only")
    assert "trial #2" in text and "trial #1" not in text


def test_no_memory_renders_nothing_whatever_the_records_hold():
    record = EpisodeRecord(moves=(Move("BET", "obs", -1.0),), reward=-1.0, won=False, reflection="bets King")
    for style in ("full", "compact"):
        assert render_memory([record, record], memory_mode="none", style=style) == ""
