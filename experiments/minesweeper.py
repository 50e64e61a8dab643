"""MAGE on MineSweeper (a LaMer task): ``python -m experiments.minesweeper``.

6x6 board with 3 mines, one cell revealed per turn, 7 turns, +10 for clearing the board (docs/method.md §7.4);
every episode of a meta-episode replays the same board, so earlier episodes reveal where the mines
are. LaMer reports 74.4% pass@3. Evaluation on held-out boards next to a uniformly random policy
over the hidden cells.

Examples::

    python -m experiments.minesweeper                                   # tiny, CPU
    python -m experiments.minesweeper --preset small --model-path /models/Qwen3-0.6B
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from experiments.presets import SINGLE_AGENT, EnvExperiment, scale_presets, tiny_overrides
from mage_jax import config as C
from mage_jax.evaluation.evaluator import EvalProtocol

EXPERIMENT = "minesweeper"

ENV = {
    **SINGLE_AGENT,
    "env.name": "minesweeper",
    "env.options": {"size": 6, "num_mines": 3},
    "algorithm.estimator": "gigpo",
    "algorithm.reward": "differential",
    "algorithm.anchor": "global",
}

TINY = tiny_overrides(max_prompt_tokens=1024, max_response_tokens=10, invalid_penalty=0.5,
                      eval_meta_episodes=128, heldout_meta_episodes=0)

PRESETS = scale_presets(ENV, TINY, "minesweeper")


def protocol(cfg: C.ExperimentConfig) -> EvalProtocol:
    return EvalProtocol()


SPEC = EnvExperiment(
    name=EXPERIMENT,
    presets=PRESETS,
    protocol=protocol,
    titles={"eval": "held-out boards"},
    description="MAGE on MineSweeper",
)


def main(argv: Sequence[str] | None = None) -> int:
    return SPEC.main(argv)


if __name__ == "__main__":
    sys.exit(main())
