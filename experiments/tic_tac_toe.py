"""MAGE on Tic-Tac-Toe: ``python -m experiments.tic_tac_toe``.

Training pool (docs/method.md §7.2): MCTS-100 (half of the groups) and the six preferred-order players plus a
uniformly random player (the other half), one opponent per group, mixed seats, the agent always X.
Evaluation:

* ``eval`` — held-out instances of the training pool, mixed seats (per-opponent curves);
* ``mcts100_first`` — MCTS-100 with the agent moving first: the paper's in-domain number (Table 1);
* ``heldout`` — MCTS-1000 with the agent first, held out: the paper reports the draw rate
  (81.2% in the first episode, 100% in the final one).

Each split is reported next to a uniformly random legal-move policy on the same meta-episodes.

Examples::

    python -m experiments.tic_tac_toe                                   # tiny, CPU
    python -m experiments.tic_tac_toe --train.iterations 20 --run-dir runs/ttt1
    python -m experiments.tic_tac_toe --preset paper --model-path /models/Qwen3-4B

Every flag of ``experiments.common`` applies (``--set KEY=VALUE``, ``--KEY VALUE``, ``--list-keys``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from experiments.presets import EnvExperiment, scale_presets, tiny_overrides
from mage_jax import config as C
from mage_jax.envs.opponents.tic_tac_toe import TIC_TAC_TOE_TRAINING_POOL
from mage_jax.evaluation.evaluator import EvalProtocol, EvalSplit

EXPERIMENT = "tic_tac_toe"

ENV = {
    "env.name": "tic_tac_toe",
    "env.opponents": list(TIC_TAC_TOE_TRAINING_POOL),
    "env.opponent_ratios": list(TIC_TAC_TOE_TRAINING_POOL.values()),
    "env.seats": "mixed",
    "env.grouping": "stationary",
    "env.heldout_opponent": "mcts-1000",
    "env.heldout_seat": "first",
    "algorithm.estimator": "gigpo",
    "algorithm.reward": "differential",
    "algorithm.anchor": "global",
}

# The tiny model is told that every trial starts alike (``trial_hint``); the reference prompt is not.
TINY = {**tiny_overrides(max_prompt_tokens=1024, max_response_tokens=10, invalid_penalty=0.5,
                         eval_meta_episodes=256, heldout_meta_episodes=128),
        "env.options": {"trial_hint": True}}

PRESETS = scale_presets(ENV, TINY, "tic_tac_toe")


def protocol(cfg: C.ExperimentConfig) -> EvalProtocol:
    n = cfg.train.eval_heldout_meta_episodes or cfg.train.eval_meta_episodes
    return EvalProtocol(
        extra_splits=(EvalSplit("mcts100_first", opponent="mcts-100", seat="first", meta_episodes=n),),
        headline_split="mcts100_first",
    )


SPEC = EnvExperiment(
    name=EXPERIMENT,
    presets=PRESETS,
    protocol=protocol,
    titles={"eval": "training pool (held-out instances, mixed seats)",
            "mcts100_first": "MCTS-100, agent first (in-domain, Table 1)",
            "heldout": "held-out MCTS-1000, agent first (report the draw rate)"},
    description="MAGE on Tic-Tac-Toe",
)


def main(argv: Sequence[str] | None = None) -> int:
    return SPEC.main(argv)


if __name__ == "__main__":
    sys.exit(main())
