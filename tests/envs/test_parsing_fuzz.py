"""Parsers and environments never raise on model output, and bad output is an invalid turn that changes
nothing (docs/method.md §3): unicode, huge strings, nested / unclosed / repeated tags, think blocks."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mage_jax.envs.base import make_env, registered_envs
from mage_jax.envs.parsing import (
    MAX_REFLECTION_CHARS,
    extract_action,
    extract_cell,
    extract_reflection,
    extract_tagged,
)
from mage_jax.envs.sokoban import parse_moves

FRAGMENTS = [
    "<action>", "</action>", "<remark>", "</remark>", "<think>", "</think>", "<action><action>",
    "</action></action>", "<", ">", "/", "(", ")", ",", " ", "\n", "(1, 2)", "(3,3)", "(-1, 99)",
    "up", "LEFT", "down,", "right", "still", "PASS", "BET", "bet", "√", "\x00", "😀", "٣", "(٣, ٣)",
]
# Tag soup: model-like text built from tags, actions and arbitrary unicode.
model_output = st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=12), max_size=40).map("".join)
# A plausible answer wrapped in arbitrary text, so that valid turns are exercised too.
tagged_answer = st.builds(
    lambda before, answer, after: f"{before}<action>{answer}</action>{after}",
    st.text(max_size=8),
    st.sampled_from(["up", "left, up", "down, down, right", "(1, 2)", "(2,2)", "(6, 6)", "PASS", "BET", "x"]),
    st.text(max_size=8),
)
FAST = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(st.one_of(st.text(), model_output))
def test_extractors_never_raise_and_respect_their_contracts(text):
    action = extract_action(text)
    if action is not None:
        assert "</action>" not in action and action == action.strip()
        assert "<action>" in text and "</action>" in text
    reflection, valid = extract_reflection(text)
    assert len(reflection) <= MAX_REFLECTION_CHARS and (valid or reflection == "")
    assert extract_tagged(text, "think") is None or "<think>" in text
    cell = extract_cell(text)
    assert cell is None or all(isinstance(v, int) for v in cell)
    moves, reason = parse_moves(text)
    assert (moves is None) == bool(reason)
    assert moves is None or 1 <= len(moves) <= 3


@pytest.mark.parametrize(
    "text",
    [
        "<action>" * 200_000,
        "<action>" + "x" * 3_000_000,
        "<action>" + "(" * 500_000 + "</action>",
        "<action>" + "(1" + "1" * 100_000 + ", 2)</action>",
        "<action>" + ",".join(["up"] * 300_000) + "</action>",
        "<think>" + "<action>up</action>" * 50_000,
        "<remark>" + "é" * 1_000_000 + "</remark>",
        "\ud800<action>\udfff</action>",  # lone surrogates
    ],
    ids=["opens", "unclosed", "parens", "long-number", "many-moves", "many-tags", "long-remark", "surrogate"],
)
def test_huge_and_odd_inputs_are_handled(text):
    extract_action(text)
    reflection, _ = extract_reflection(text)
    assert len(reflection) <= MAX_REFLECTION_CHARS
    extract_cell(text)
    parse_moves(text)


def test_non_text_inputs_are_none():
    assert extract_action(None) is None and extract_cell(b"(1, 2)") is None
    assert extract_reflection(123) == ("", False)
    assert parse_moves(None)[0] is None


ENV_OPTIONS = {
    "sokoban": ({}, {}),
    "minesweeper": ({}, {}),
    "kuhn_poker": ({}, {"opponent": "intermediate", "seat": 0}),
    "tic_tac_toe": ({}, {"opponent": "preferred-1", "seat": 1}),
}
ENVS = ["sokoban", "minesweeper", "kuhn_poker", "tic_tac_toe"]


def _require(name):
    if name not in registered_envs():
        pytest.skip(f"{name} is not registered")


@pytest.mark.parametrize("name", ENVS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    responses=st.lists(st.one_of(model_output, st.text(max_size=40), tagged_answer), min_size=1, max_size=4),
    seed=st.integers(0, 50),
)
def test_env_step_never_raises_and_invalid_output_changes_nothing(name, responses, seed):
    _require(name)
    options, reset_kwargs = ENV_OPTIONS[name]
    env = make_env(name, **options)
    env.reset(seed, **reset_kwargs)
    done = False
    for response in responses:
        before_obs, before_legal = env.observation, env.legal_actions()
        result = env.step(response)
        assert isinstance(result.observation, str) and result.observation == env.observation
        if not result.info.valid:  # nothing changes: an unfinished episode stays unfinished
            assert result.reward == 0 and result.action is None and result.done == done
            assert env.observation == before_obs and env.legal_actions() == before_legal
        elif name != "sokoban":
            assert result.action in before_legal
        done = result.done


@pytest.mark.parametrize("name", ENVS)
def test_every_legal_action_in_tags_is_valid(name):
    _require(name)
    options, reset_kwargs = ENV_OPTIONS[name]
    env = make_env(name, **options)
    env.reset(3, **reset_kwargs)
    for action in env.legal_actions():
        env.restart()
        result = env.step(f"<think>considering options</think>\n<action>{action}</action>")
        assert result.info.valid, (action, result.info.extra)
