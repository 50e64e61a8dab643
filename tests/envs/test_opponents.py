"""Opponents (docs/method.md §6, §7.1, §7.2): scripted Kuhn players, CFR, preferred-order, random, MCTS."""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from mage_jax.envs.opponents.cfr import CFR_POLICY_PATH, compute_cfr_policy
from mage_jax.envs.opponents.kuhn import KUHN_TRAINING_POOL, make_kuhn_opponent
from mage_jax.envs.opponents.tic_tac_toe import (
    PREFERRED_ORDERS,
    TIC_TAC_TOE_TRAINING_POOL,
    make_tic_tac_toe_opponent,
)
from mage_jax.rollout.tasks import TaskSampler, TaskSamplerConfig
from tests.optional import require

P, B = 0, 1
J, Q, K = 0, 1, 2
# Every information state of the player to act: (card, public history). "p" / "pb" are the first
# player's spots, "p" / "b" the second player's; "facing a bet" means a bet is in the history.
EXPECTED = {
    "conservative": {
        (J, ""): P, (Q, ""): P, (K, ""): B,
        (J, "p"): P, (Q, "p"): P, (K, "p"): B,
        (J, "b"): P, (Q, "b"): P, (K, "b"): B,
        (J, "pb"): P, (Q, "pb"): P, (K, "pb"): B,
    },
    "aggressive": {
        (J, ""): B, (Q, ""): B, (K, ""): B,
        (J, "p"): B, (Q, "p"): B, (K, "p"): B,
        (J, "b"): P, (Q, "b"): B, (K, "b"): B,
        (J, "pb"): P, (Q, "pb"): B, (K, "pb"): B,
    },
    "intermediate": {
        (J, ""): P, (Q, ""): B, (K, ""): B,
        (J, "p"): P, (Q, "p"): B, (K, "p"): B,
        (J, "b"): P, (Q, "b"): P, (K, "b"): B,
        (J, "pb"): P, (Q, "pb"): P, (K, "pb"): B,
    },
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_scripted_kuhn_opponent_acts_as_specified_on_every_information_state(name):
    player = make_kuhn_opponent(name)
    for (card, history), action in EXPECTED[name].items():
        assert player.act(card, history) == action, (name, card, history)


def test_kuhn_training_pool_ratio():
    assert dict(KUHN_TRAINING_POOL) == {"conservative": 0.3, "aggressive": 0.3, "intermediate": 0.4}


def test_cfr_opponent_plays_the_argmax_of_the_cached_average_policy():
    cached = json.loads(CFR_POLICY_PATH.read_text())
    player = make_kuhn_opponent("cfr")
    assert cached["iterations"] == 1000 and len(cached["action"]) == 12
    for state, probabilities in cached["average_policy"].items():
        assert player.act(int(state[0]), state[1:]) == int(np.argmax(probabilities))


def test_cached_cfr_policy_matches_a_fresh_openspiel_recompute():
    require("pyspiel")
    fresh = compute_cfr_policy()  # 1000 iterations, about a second
    cached = json.loads(CFR_POLICY_PATH.read_text())
    assert fresh["action"] == cached["action"]
    for state, probabilities in fresh["average_policy"].items():
        np.testing.assert_allclose(probabilities, cached["average_policy"][state], atol=1e-9)


def test_unknown_opponents_get_one_clear_error():
    with pytest.raises(ValueError, match="unknown Kuhn Poker opponent"):
        make_kuhn_opponent("gto")
    with pytest.raises(ValueError, match="unknown Tic-Tac-Toe opponent"):
        make_tic_tac_toe_opponent("mcts-0")
    with pytest.raises(ValueError, match="unknown Tic-Tac-Toe opponent"):
        make_tic_tac_toe_opponent("preferred-7")


def test_preferred_order_players_play_the_first_empty_cell_of_their_list():
    rng = np.random.default_rng(0)
    for name, order in PREFERRED_ORDERS.items():
        player = make_tic_tac_toe_opponent(name)
        cells = [3 * r + c for r, c in order]
        assert sorted(cells) == list(range(9))
        for _ in range(200):
            moves = list(rng.permutation(9)[: rng.integers(0, 9)])
            expected = next(cell for cell in cells if cell not in moves)
            assert player.act(moves) == expected


SPEC_ORDERS = (  # docs/method.md §7.2, (row, col) 0-based, written as "rc"
    "11 00 02 20 22 01 10 12 21",
    "00 02 20 22 11 01 10 12 21",
    "01 10 12 21 11 00 02 20 22",
    "00 11 22 02 20 01 10 12 21",
    "02 11 20 00 22 01 10 12 21",
    "22 20 02 00 11 21 12 10 01",
)


def test_preferred_orders_are_the_spec_lists():
    expected = {
        f"preferred-{i + 1}": tuple((int(rc[0]), int(rc[1])) for rc in order.split())
        for i, order in enumerate(SPEC_ORDERS)
    }
    assert dict(PREFERRED_ORDERS) == expected


def test_random_player_is_uniform_over_empty_cells_and_seeded():
    moves = [4, 0, 8]
    draws = [make_tic_tac_toe_opponent("random", 7).act(moves) for _ in range(3)]
    assert len(set(draws)) == 1  # same seed, same first draw
    player = make_tic_tac_toe_opponent("random", 1)
    counts = np.bincount([player.act(moves) for _ in range(3000)], minlength=9)
    assert counts[moves].sum() == 0
    empty = [c for c in range(9) if c not in moves]
    assert np.all(np.abs(counts[empty] / 3000 - 1 / 6) < 0.03)


def test_balanced_tic_tac_toe_pool_matches_the_reference_16_groups():
    """8 MCTS-100, one group per preferred-order player, 2 random: the reference's group of 16."""
    sampler = TaskSampler(TaskSamplerConfig(num_tasks=16, group_size=1, opponents=TIC_TAC_TOE_TRAINING_POOL))
    counts = collections.Counter(sampler.group_opponents())
    assert counts == {"mcts-100": 8, **{name: 1 for name in PREFERRED_ORDERS}, "random": 2}
    assert sum(TIC_TAC_TOE_TRAINING_POOL.values()) == pytest.approx(1.0)


def test_mcts_takes_a_win_blocks_a_loss_and_is_reproducible_with_its_seed():
    require("pyspiel")
    # First mover X on 0 and 1, O on 3 and 4: X to move wins at 2.
    assert make_tic_tac_toe_opponent("mcts-100", 3).act([0, 3, 1, 4]) == 2
    # X on 0 and 1, O on 4: O to move must block at 2.
    assert make_tic_tac_toe_opponent("mcts-100", 3).act([0, 4, 1]) == 2
    first = [make_tic_tac_toe_opponent("mcts-100", 11).act([]) for _ in range(2)]
    assert first[0] == first[1]


def test_environments_work_without_openspiel_and_mcts_names_the_install_extra():
    script = textwrap.dedent(
        """
        import sys
        sys.modules["pyspiel"] = None  # as if OpenSpiel were not installed
        sys.modules["open_spiel"] = None
        from mage_jax.envs.base import make_env
        env = make_env("kuhn_poker", opponent="cfr", seat=1)
        env.reset(3)
        assert env.step("<action>BET</action>").done
        env = make_env("tic_tac_toe", opponent="preferred-2")
        env.reset(0)
        env.step("<action>(2, 2)</action>")
        try:
            make_env("tic_tac_toe", opponent="mcts-100")
        except ImportError as err:
            assert "pip install mage-jax[games]" in str(err), err
        else:
            raise AssertionError("MCTS without OpenSpiel must fail")
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
