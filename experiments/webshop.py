"""MAGE on WebShop: ``python -m experiments.webshop``.

Shopping for the product of an instruction in a text web store (docs/method.md §7.6): search and click
actions, the admissible actions listed in every prompt, reward 10 only for a purchase that scores
1.0, 12 turns. Training goals come from the ``train`` split; evaluation reports

* ``eval`` — held-out instances drawn from the training goals (the paper's Table 1 entry: MAGE 1.000);
* ``test_goals`` — the held-out ``test`` goals (the paper: 96.1% for MAGE, 68.8% for GiGPO).

The ``tiny`` preset only checks the pipeline end to end: a model trained from scratch on a CPU
cannot read product descriptions; use ``small`` or ``paper`` with a local model folder for results.
``tiny`` and ``small`` shop in the generated 100-product catalogue shipped with mage_jax. ``paper``
shops in the official data as the paper does: the 1000-product set with synthetic goals; put the
WebShop release files ``items_shuffle_1000.json`` and ``items_ins_v2_1000.json`` in a folder and pass
it with ``--env.data_dir DIR`` (without them the preset stops with one error line). Evaluation plays
5 episodes per meta-episode (the paper reports WebShop by the 5th).

Examples::

    python -m experiments.webshop --preset small --model-path /models/Qwen3-0.6B
    python -m experiments.webshop --preset paper --model-path /models/Qwen3-4B --env.data_dir /data/webshop
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Sequence

from experiments.presets import SINGLE_AGENT, EnvExperiment, scale_presets, tiny_overrides
from mage_jax import config as C
from mage_jax.envs.webshop.catalogue import OFFICIAL_FILES
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

OFFICIAL_SIZE = "small"
PAPER_DATA = {"env.options": {"split": "train", "size": OFFICIAL_SIZE, "human_goals": False}}
"""The paper's shop: the official 1000-product set with synthetic goals (as the reference code)."""


def official_data(cfg: C.ExperimentConfig) -> None:
    """The ``paper`` preset runs on the official data: one ConfigError naming the files and the flag."""
    files = OFFICIAL_FILES[OFFICIAL_SIZE]
    where = (f"put the official WebShop files {' and '.join(files)} (the WebShop release's data/ folder) "
             "in a folder and pass it with --env.data_dir DIR")
    if cfg.env.data_dir is None:
        raise C.ConfigError(f"preset 'paper' shops in the official 1000-product WebShop data: {where}")
    missing = [f for f in files if not os.path.isfile(os.path.join(os.path.expanduser(cfg.env.data_dir), f))]
    if missing:
        raise C.ConfigError(f"env.data_dir {cfg.env.data_dir!r} lacks {', '.join(missing)}: {where}")


_scales = scale_presets(ENV, TINY, "webshop")
PRESETS = {
    **_scales,
    "paper": dataclasses.replace(
        _scales["paper"], overrides={**_scales["paper"].overrides, **PAPER_DATA}, requires=official_data,
        description=_scales["paper"].description + "; the official 1000-product data from --env.data_dir"),
}


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
