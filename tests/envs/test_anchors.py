"""Anchor strings (docs/method.md §1, §5, §6): the opponent is part of every anchor of a game."""

from mage_jax.envs.anchors import local_anchor, play_anchor, reflection_anchor


def test_play_anchor_is_the_observation_plus_the_opponent_name():
    assert play_anchor("Your Card: Queen | Actions: No actions yet", "aggressive") == (
        "Your Card: Queen | Actions: No actions yet || opponent: aggressive"
    )
    assert play_anchor("obs", "aggressive") != play_anchor("obs", "conservative")
    assert play_anchor("obs", None) == "obs"


def test_reflection_anchor_is_shared_per_opponent_only():
    assert reflection_anchor("mcts-100") == "reflection || opponent: mcts-100"
    assert reflection_anchor("mcts-100") != reflection_anchor("random")
    assert reflection_anchor(None) == "reflection"


def test_local_anchor_adds_the_episode():
    assert local_anchor(play_anchor("obs", "cfr"), 2) == "episode 2 || obs || opponent: cfr"
