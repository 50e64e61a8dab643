"""Reward-design ablation: ``python -m experiments.ablations.reward_design``.

Variants (docs/method.md §4): ``differential`` (MAGE, d_n = R_n − R_{n−1}: the final-episode
objective), ``cumulative`` (LaMer, d_n = R_n) and ``single_episode`` (d_n = R_n with no return
propagated across episodes, γ_traj = 0). Everything else is the MAGE preset of the environment.
The paper reports differential > cumulative > single-episode (ALFWorld 91.4 vs 89.8).

    python -m experiments.ablations.reward_design --seeds 0,1,2          # Kuhn Poker, tiny, CPU
    python -m experiments.ablations.reward_design --env tic_tac_toe --train.iterations 30
"""

from __future__ import annotations

import sys

from experiments.ablations.common import Ablation
from experiments.suite import Variant

DESIGNS = ("differential", "cumulative", "single_episode")

ABLATION = Ablation(
    name="reward_design",
    title="Reward design",
    variants=lambda env: [Variant(d, {"algorithm.reward": d}) for d in DESIGNS],
    variant_names=DESIGNS,
    paper={"differential": "0.914 (ALFWorld)", "cumulative": "0.898 (ALFWorld)"},
    paper_note="differential > cumulative > single-episode; ALFWorld 91.4 vs 89.8 (Qwen3-4B)",
    envs=("kuhn_poker", "tic_tac_toe", "sokoban", "minesweeper", "alfworld", "webshop"),
)

main = ABLATION.main

if __name__ == "__main__":
    sys.exit(main())
