"""Kuhn Poker environment (docs/method.md §7.1): OpenSpiel's rules, observations, rewards, restarts."""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest

from experiments.environments import environment
from mage_jax.envs.base import make_env
from mage_jax.envs.kuhn_poker import (
    KUHN_PROMPT_SPEC,
    KuhnPokerEnv,
    kuhn_current_player,
    kuhn_deal,
    kuhn_is_terminal,
    kuhn_observation,
    kuhn_returns,
)
from mage_jax.envs.opponents.cfr import load_cfr_policy
from mage_jax.envs.opponents.kuhn import KUHN_OPPONENTS, make_kuhn_opponent
from tests.optional import require

DEALS = list(itertools.permutations(range(3), 2))


def deal_seeds() -> dict[tuple[int, int], int]:
    seeds: dict[tuple[int, int], int] = {}
    seed = 0
    while len(seeds) < 6:
        seeds.setdefault(kuhn_deal(seed), seed)
        seed += 1
    return seeds


def all_histories(prefix: str = ""):
    yield prefix
    if not kuhn_is_terminal(prefix):
        for letter in "pb":
            yield from all_histories(prefix + letter)


def test_rules_equal_openspiel_for_every_deal_and_action_sequence():
    pyspiel = require("pyspiel")
    game = pyspiel.load_game("kuhn_poker")
    checked_terminals = 0
    for cards in DEALS:
        for history in all_histories():
            state = game.new_initial_state()
            for action in (*cards, *("pb".index(letter) for letter in history)):
                state.apply_action(action)
            assert kuhn_is_terminal(history) == state.is_terminal(), (cards, history)
            if state.is_terminal():
                assert list(kuhn_returns(cards, history)) == state.returns(), (cards, history)
                checked_terminals += 1
            else:
                assert state.legal_actions() == [0, 1]
                assert kuhn_current_player(history) == state.current_player()
    assert checked_terminals == 6 * 5


def test_environment_plays_every_line_like_openspiel_in_both_seats_against_every_opponent():
    pyspiel = require("pyspiel")
    game = pyspiel.load_game("kuhn_poker")
    env = KuhnPokerEnv()
    for (agent_card, opponent_card), seed in deal_seeds().items():
        for seat, opponent in itertools.product((0, 1), KUHN_OPPONENTS):
            player = make_kuhn_opponent(opponent)
            for line in itertools.product(("PASS", "BET"), repeat=2):
                env.reset(seed, opponent=opponent, seat=seat)
                result = None
                for action in line:
                    if env.done:
                        break
                    assert env.legal_actions() == ["PASS", "BET"]
                    result = env.step(f"<action>{action}</action>")
                    assert result.info.valid and result.action == action
                state = game.new_initial_state()
                cards = (agent_card, opponent_card) if seat == 0 else (opponent_card, agent_card)
                for card in cards:
                    state.apply_action(card)
                for index, letter in enumerate(env.history):
                    if index % 2 != seat:  # the opponent's decisions follow its script
                        assert "pb".index(letter) == player.act(opponent_card, env.history[:index])
                    state.apply_action("pb".index(letter))
                assert state.is_terminal() and result.done and env.legal_actions() == []
                payoff = state.returns()[seat]
                assert result.reward == 5 * payoff
                assert result.info.won == (payoff > 0) and result.info.score == payoff
                assert result.info.opponent == opponent and not result.info.draw


def test_payoffs_are_zero_sum():
    for cards in DEALS:
        for history in all_histories():
            if kuhn_is_terminal(history):
                assert sum(kuhn_returns(cards, history)) == 0


def _game_value(policy0, policy1) -> Fraction:
    """Exact value for player 0; policy(card, history) -> probability of BET."""

    def value(cards, history, probability):
        if kuhn_is_terminal(history):
            return probability * kuhn_returns(cards, history)[0]
        player = kuhn_current_player(history)
        bet = probability * (policy0 if player == 0 else policy1)(cards[player], history)
        return value(cards, history + "b", bet) + value(cards, history + "p", probability - bet)

    return sum(value(cards, "", Fraction(1, 6)) for cards in DEALS)


def test_nash_equilibrium_family_has_value_minus_one_eighteenth_under_our_rules():
    def player1(card, history):  # the equilibrium answer of the second player
        if history == "b":
            return Fraction([0, 1, 1][card]) if card != 1 else Fraction(1, 3)
        return Fraction([1, 0, 1][card]) if card != 0 else Fraction(1, 3)

    for alpha in (Fraction(0), Fraction(1, 6), Fraction(1, 3)):

        def player0(card, history, alpha=alpha):
            if history == "":
                return [alpha, Fraction(0), 3 * alpha][card]
            return [Fraction(0), alpha + Fraction(1, 3), Fraction(1)][card]  # facing check-bet

        assert _game_value(player0, player1) == Fraction(-1, 18)


def test_cached_cfr_average_policy_reaches_the_nash_value_under_our_rules():
    average = load_cfr_policy()["average_policy"]

    def policy(card, history):
        return Fraction(average[f"{card}{history}"][1])

    assert float(_game_value(policy, policy)) == pytest.approx(-1 / 18, abs=5e-3)


def test_seed_maps_to_the_same_deal_every_time_and_covers_all_six_deals():
    assert [kuhn_deal(s) for s in range(50)] == [kuhn_deal(s) for s in range(50)]
    assert set(deal_seeds()) == set(DEALS)
    env = KuhnPokerEnv()
    env.reset(11, seat=0)
    first = env.task_info["agent_card"]
    env.reset(11, seat=1)
    assert env.task_info["agent_card"] == first  # the deal does not depend on the seat


def test_observation_shows_own_card_and_public_actions_only():
    assert kuhn_observation(1, "") == "Your Card: Queen | Actions: No actions yet"
    assert kuhn_observation(1, "pb") == "Your Card: Queen | Actions: Player 0: Pass -> Player 1: Bet"
    env = KuhnPokerEnv()
    for seed, seat, opponent in itertools.product(range(12), (0, 1), KUHN_OPPONENTS):
        env.reset(seed, opponent=opponent, seat=seat)
        hidden = ("Jack", "Queen", "King")[env.task_info["opponent_card"]]
        assert hidden not in env.observation
        result = env.step("<action>BET</action>")
        assert hidden not in result.observation
        assert hidden in env.privileged_observation()


def test_first_seat_starts_empty_and_second_seat_sees_the_opponent_opening():
    env = KuhnPokerEnv(opponent="aggressive")
    assert env.reset(0, seat=0).endswith("No actions yet")
    assert env.reset(0, seat=1).endswith("Actions: Player 0: Bet")


def test_actions_must_be_exactly_pass_or_bet_after_stripping():
    env = KuhnPokerEnv()
    env.reset(0)
    for text in ("pass", "Bet", "PASS BET", "CALL", "", "BET."):
        result = env.step_action(text)
        assert not result.info.valid and result.reward == 0 and result.action is None
    env.reset(0)
    assert env.step("<action>  PASS \n</action>").info.valid


def test_terminal_observation_states_the_result():
    env = KuhnPokerEnv(opponent="conservative")
    seed = deal_seeds()[(2, 0)]  # agent King, opponent Jack
    env.reset(seed, seat=0)
    result = env.step("<action>BET</action>")  # the conservative Jack folds
    expected = "Your Card: King | Actions: Player 0: Bet -> Player 1: Pass | Result: You won 1 chip"
    assert result.observation == expected
    assert result.reward == 5.0 and result.done and result.info.won


def test_invalid_actions_change_nothing_and_the_last_turn_ends_the_game_without_reward():
    env = KuhnPokerEnv(opponent="intermediate")
    initial = env.reset(3, seat=1)
    for turn in range(1, env.max_turns):
        result = env.step("no tags here")
        assert (result.observation, result.reward, result.done) == (initial, 0.0, False)
        assert env.history and env.observation == initial and env.turns == turn
    result = env.step("<action>FOLD</action>")
    assert result.done and result.reward == 0 and not result.info.won and result.info.extra["timeout"]
    assert env.legal_actions() == []
    assert not env.step("<action>BET</action>").info.valid  # nothing moves after the end


def test_restart_restores_the_initial_state_for_every_opponent_and_seat():
    env = KuhnPokerEnv()
    for opponent, seat, seed in itertools.product(KUHN_OPPONENTS, (0, 1), range(6)):
        first = env.reset(seed, opponent=opponent, seat=seat)
        info = dict(env.task_info)
        outcomes = []
        for _ in range(3):
            env.step("<action>garbage</action>")
            while not env.done:
                result = env.step("<action>BET</action>")
            outcomes.append((result.observation, result.reward))
            assert env.restart() == first
            assert env.task_info == info and env.turns == 0 and env.opponent == opponent
        assert len(set(outcomes)) == 1  # deterministic opponents replay exactly


def test_task_info_and_registry():
    env = make_env("kuhn_poker", opponent="cfr", seat=1)
    env.reset(4)
    info = env.task_info
    assert info["seat"] == 1 and info["opponent"] == "cfr" and info["seed"] == 4
    assert info["cards"] == tuple(("Jack", "Queen", "King")[c] for c in kuhn_deal(4))
    assert env.max_turns == 6 and env.prompt_spec is KUHN_PROMPT_SPEC
    assert KuhnPokerEnv.opponent_pool == {"conservative": 0.3, "aggressive": 0.3, "intermediate": 0.4}


def test_prompt_spec_names_the_action_format_in_both_styles():
    for text in (KUHN_PROMPT_SPEC.preamble, KUHN_PROMPT_SPEC.compact_preamble):
        assert "<action>PASS</action>" in text and "<action>BET</action>" in text
    assert len(KUHN_PROMPT_SPEC.compact_preamble.split()) < len(KUHN_PROMPT_SPEC.preamble.split()) / 2
    assert KUHN_PROMPT_SPEC.history_window == 7


def test_bad_configuration_gets_one_clear_error():
    with pytest.raises(ValueError, match="unknown Kuhn Poker opponent"):
        KuhnPokerEnv(opponent="bluffer")
    env = KuhnPokerEnv()
    with pytest.raises(ValueError, match="seat"):
        env.reset(0, seat=2)
    with pytest.raises(ValueError, match="seed"):
        env.reset(-1)
    with pytest.raises(RuntimeError, match="reset"):
        env.step("<action>BET</action>")


def test_the_reference_prompt_is_the_default_and_the_trial_hint_an_option():
    """The reference prompt does not say that trials replay one deal and opponent; the tiny preset
    (a from-scratch model) opts into that sentence, the pretrained presets do not."""
    hint = "Every trial replays the same deal"
    assert hint not in KuhnPokerEnv().prompt_spec.preamble
    assert "Same deal" not in KuhnPokerEnv().prompt_spec.compact_preamble
    hinted = make_env("kuhn_poker", trial_hint=True).prompt_spec
    assert hint in hinted.preamble and "Same deal and opponent every trial" in hinted.compact_preamble
    kuhn = environment("kuhn_poker")
    assert kuhn.config("tiny", check_paths=False).env.options == {"trial_hint": True}
    for preset in ("small", "paper"):
        cfg = kuhn.config(preset, {"model.path": "/models/qwen3"}, check_paths=False)
        assert not cfg.env.options.get("trial_hint", False)


def test_a_thinking_response_plays_its_final_answer_not_the_tags_it_considered():
    env = KuhnPokerEnv(opponent="conservative", seat=0)
    env.reset(5)
    result = env.step("<think>Bet? <action>BET</action> is risky.</think>\n<action>PASS</action>")
    assert result.action == "PASS" and env.history.startswith("p")


def test_split_private_separates_the_card_from_the_betting_in_every_observation_and_anchor():
    env = make_env("kuhn_poker")
    seen = set()
    for seed, opponent, seat in itertools.product(range(12), ("aggressive", "conservative"), (0, 1)):
        obs = env.reset(seed, opponent=opponent, seat=seat)
        card = env.task_info["cards"][0]
        while True:
            private, public = env.split_private(obs)
            assert private == card and not {"Jack", "Queen", "King"} & set(public.split())
            seen.add(public)
            if env.done:
                break
            obs = env.step_action("PASS").observation
    assert {"No actions yet", "Player 0: Pass", "Player 0: Bet"} <= seen
    anchored = env.split_private("episode 2 || Your Card: King | Actions: Player 0: Bet || opponent: cfr")
    assert anchored == ("King", "Player 0: Bet")
    assert env.split_private("unrelated text") is None
