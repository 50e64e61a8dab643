"""MAGE on Sokoban: ``python -m experiments.sokoban``.

6x6 rooms with 2 boxes made by reverse play (docs/method.md §7.3), up to 3 moves per turn, 7 turns, a dead end
ends the episode. Evaluation: ``eval`` on held-out 2-box rooms (the paper's Table 1 entry, 0.773 for
MAGE) and the held-out generalisation sets ``boxes_1`` and ``boxes_3`` (the paper: 91.4% and 46.1%),
each next to a uniformly random legal-move policy on the same rooms. γ_traj = 0.9 at paper scale
(the reference Sokoban script), 0.6 elsewhere.

Examples::

    python -m experiments.sokoban                                       # tiny, CPU
    python -m experiments.sokoban --preset paper --model-path /models/Qwen3-4B
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from experiments.presets import SINGLE_AGENT, EnvExperiment, scale_presets, tiny_overrides
from mage_jax import config as C
from mage_jax.evaluation.evaluator import EvalProtocol, EvalSplit

EXPERIMENT = "sokoban"

ENV = {
    **SINGLE_AGENT,
    "env.name": "sokoban",
    "env.options": {"num_boxes": 2},
    "algorithm.estimator": "gigpo",
    "algorithm.reward": "differential",
    "algorithm.anchor": "global",
}

TINY = tiny_overrides(max_prompt_tokens=1024, max_response_tokens=10, invalid_penalty=0.5,
                      eval_meta_episodes=128, heldout_meta_episodes=128)

PRESETS = scale_presets(ENV, TINY, "sokoban")


def protocol(cfg: C.ExperimentConfig) -> EvalProtocol:
    n = cfg.train.eval_heldout_meta_episodes or cfg.train.eval_meta_episodes
    return EvalProtocol(extra_splits=(
        EvalSplit("boxes_1", env_options={"num_boxes": 1}, meta_episodes=n),
        EvalSplit("boxes_3", env_options={"num_boxes": 3}, meta_episodes=n),
    ))


SPEC = EnvExperiment(
    name=EXPERIMENT,
    presets=PRESETS,
    protocol=protocol,
    titles={"eval": "held-out 2-box rooms (Table 1)", "boxes_1": "held-out 1-box rooms",
            "boxes_3": "held-out 3-box rooms"},
    description="MAGE on Sokoban",
)


def main(argv: Sequence[str] | None = None) -> int:
    return SPEC.main(argv)


if __name__ == "__main__":
    sys.exit(main())
