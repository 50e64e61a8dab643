"""Anchor ablation: ``python -m experiments.ablations.anchors``.

GiGPO's step-level groups pool rows with equal anchors. ``global`` (MAGE) anchors carry no episode
index, so equal states of episodes 0, 1, 2 of a group share one baseline; ``local`` prefixes the
episode index, so each episode's states are compared only among themselves (docs/method.md §5).
The paper: Kuhn Poker 65.6 (global) vs 33.6 (local).

    python -m experiments.ablations.anchors --seeds 0,1,2               # Kuhn Poker, tiny, CPU
"""

from __future__ import annotations

import sys

from experiments.ablations.common import Ablation
from experiments.suite import Variant

ABLATION = Ablation(
    name="anchors",
    title="Anchors",
    variants=lambda env: [Variant(a, {"algorithm.anchor": a}) for a in ("global", "local")],
    variant_names=("global", "local"),
    paper={"global": "0.656 (Kuhn)", "local": "0.336 (Kuhn)"},
    paper_note="global vs local anchor on Kuhn Poker 65.6 vs 33.6 (Qwen3-4B)",
)

main = ABLATION.main

if __name__ == "__main__":
    sys.exit(main())
