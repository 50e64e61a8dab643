"""MAGE on ALFWorld: ``python -m experiments.alfworld``.

Household text tasks (docs/method.md §7.5): the TextWorld observation, the admissible commands listed in every
prompt, reward 10 for completing the task, 10 turns. Training games come from the ``train`` split;
evaluation reports

* ``valid_seen`` — in-domain games (the paper's Table 1 entry: MAGE 0.914), per task type;
* ``valid_unseen`` — held-out games (the paper: 78.9%).

ALFWorld's game files are read from a local folder (``$ALFWORLD_DATA`` or
``--env.options '{"split": "train", "data_dir": "/data/alfworld"}'``; evaluation splits inherit the
other options). LaMer's split trains on four task types and holds out Cool and Pick-Two:
``--env.options '{"split": "lamer_train"}'`` adds the ``lamer_heldout`` evaluation.

The ``paper`` preset evaluates meta-episodes of 10 episodes (the paper reports ALFWorld up to the 10th
attempt); training plays 3. The ``tiny`` preset only checks the pipeline end to end: a model trained
from scratch on a CPU cannot read household instructions; use ``small`` or ``paper`` with a local
model folder for results.

Examples::

    python -m experiments.alfworld --preset small --model-path /models/Qwen3-0.6B
    python -m experiments.alfworld --preset paper --model-path /models/Qwen3-4B
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from experiments.presets import SINGLE_AGENT, EnvExperiment, scale_presets, tiny_overrides
from mage_jax import config as C
from mage_jax.evaluation.evaluator import EvalProtocol, EvalSplit

EXPERIMENT = "alfworld"
IN_DOMAIN_SPLIT = "valid_seen"
HELD_OUT_SPLIT = "valid_unseen"
LAMER_TRAIN, LAMER_HELD_OUT = "lamer_train", "lamer_heldout"

ENV = {
    **SINGLE_AGENT,
    "env.name": "alfworld",
    "env.options": {"split": "train"},
    "algorithm.estimator": "gigpo",
    "algorithm.reward": "differential",
    "algorithm.anchor": "global",
}

TINY = tiny_overrides(max_prompt_tokens=2048, max_response_tokens=24, invalid_penalty=0.5,
                      eval_meta_episodes=32, heldout_meta_episodes=32, num_tasks=8, group_size=8,
                      iterations=20)

PRESETS = scale_presets(ENV, TINY, "alfworld")


def protocol(cfg: C.ExperimentConfig) -> EvalProtocol:
    n = cfg.train.eval_heldout_meta_episodes or cfg.train.eval_meta_episodes
    splits = [EvalSplit(IN_DOMAIN_SPLIT, env_options={"split": IN_DOMAIN_SPLIT}, meta_episodes=n),
              EvalSplit(HELD_OUT_SPLIT, env_options={"split": HELD_OUT_SPLIT}, meta_episodes=n)]
    if cfg.env.options.get("split") == LAMER_TRAIN:
        splits.append(EvalSplit(LAMER_HELD_OUT, env_options={"split": LAMER_HELD_OUT}, meta_episodes=n))
    return EvalProtocol(
        extra_splits=tuple(splits),
        random_reference=False,
        headline_split=IN_DOMAIN_SPLIT,
    )


SPEC = EnvExperiment(
    name=EXPERIMENT,
    presets=PRESETS,
    protocol=protocol,
    titles={"eval": "training games, held-out instances", IN_DOMAIN_SPLIT: "valid_seen (in-domain, Table 1)",
            HELD_OUT_SPLIT: "valid_unseen (held-out)", LAMER_HELD_OUT: "LaMer's held-out task types"},
    description="MAGE on ALFWorld",
)


def main(argv: Sequence[str] | None = None) -> int:
    return SPEC.main(argv)


if __name__ == "__main__":
    sys.exit(main())
