"""MAGE on WebShop: ``python -m experiments.webshop``.

Shopping for the product of an instruction in a text web store (spec 7.6): search and click
actions, the admissible actions listed in every prompt, reward 10 only for a purchase that scores
1.0, 12 turns. Training goals come from the ``train`` split; evaluation reports

* ``eval`` — held-out instances drawn from the training goals (the paper's Table 1 entry: MAGE 1.000);
* ``test_goals`` — the held-out ``test`` goals (the paper: 96.1% for MAGE, 68.8% for GiGPO).

The ``tiny`` preset only checks the pipeline end to end: a model trained from scratch on a CPU
cannot read product descriptions; use ``small`` or ``paper`` with a local model folder for results.

Examples::

    python -m experiments.webshop --preset small --model-path /models/Qwen3-0.6B
    python -m experiments.webshop --preset paper --model-path /models/Qwen3-4B
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from experiments.presets import SINGLE_AGENT, EnvExperiment, scale_presets, tiny_overrides
from mage_jax import config as C
from mage_jax.evaluation.evaluator import EvalProtocol, EvalSplit

EXPERIMENT = "webshop"
HELD_OUT_SPLIT = "test"

ENV = {
    **SINGLE_AGENT,
    "env.name": "webshop",
    "env.options": {"split": "train"},
    "algorithm.estimator": "gigpo",
    "algorithm.reward": "differential",
    "algorithm.anchor": "global",
}

TINY = {
    **tiny_overrides(max_prompt_tokens=2048, max_response_tokens=24, invalid_penalty=0.5,
                     eval_meta_episodes=32, heldout_meta_episodes=32, num_tasks=8, group_size=8,
                     iterations=20),
    "rollout.num_episodes": 3,
}

PRESETS = scale_presets(ENV, TINY, "webshop")


def protocol(cfg: C.ExperimentConfig) -> EvalProtocol:
    n = cfg.train.eval_heldout_meta_episodes or cfg.train.eval_meta_episodes
    return EvalProtocol(
        extra_splits=(EvalSplit("test_goals", env_options={"split": HELD_OUT_SPLIT}, meta_episodes=n),),
        random_reference=False,  # a random click walk almost never buys the right product
    )


SPEC = EnvExperiment(
    name=EXPERIMENT,
    presets=PRESETS,
    protocol=protocol,
    titles={"eval": "training goals, held-out instances (Table 1)", "test_goals": "held-out test goals"},
    description="MAGE on WebShop",
)


def main(argv: Sequence[str] | None = None) -> int:
    return SPEC.main(argv)


if __name__ == "__main__":
    sys.exit(main())
