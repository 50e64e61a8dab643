"""Held-out Kuhn Poker opponent: argmax of the average policy of 1000 CFR iterations (docs/method.md §7.1).

The policy is computed once with OpenSpiel and cached as JSON inside the package, so the
environment works without OpenSpiel. Regenerate with ``python -m mage_jax.envs.opponents.cfr``.
Information states are OpenSpiel's ``kuhn_poker`` strings: the player's card (0 = Jack, 1 = Queen,
2 = King) followed by the public history (``p`` / ``b``), e.g. ``"1pb"``.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

CFR_ITERATIONS = 1000
CFR_POLICY_PATH = Path(__file__).parent / "data" / "kuhn_cfr_1000.json"


def compute_cfr_policy(iterations: int = CFR_ITERATIONS) -> dict[str, Any]:
    """Run OpenSpiel's CFR on ``kuhn_poker``; return the average policy and its argmax actions."""
    try:
        import numpy as np
        import pyspiel
        from open_spiel.python.algorithms import cfr
    except ImportError as err:  # pragma: no cover - depends on the installation
        raise ImportError("computing the CFR policy needs OpenSpiel: pip install mage-jax[games]") from err

    solver = cfr.CFRSolver(pyspiel.load_game("kuhn_poker"))
    for _ in range(iterations):
        solver.evaluate_and_update_policy()
    average = solver.average_policy()
    probabilities = {
        key: [float(p) for p in average.action_probability_array[index]]
        for key, index in sorted(average.state_lookup.items())
    }
    return {
        "game": "kuhn_poker",
        "algorithm": "open_spiel.python.algorithms.cfr.CFRSolver average policy",
        "iterations": iterations,
        "actions": ["PASS", "BET"],
        "average_policy": probabilities,
        "action": {key: int(np.argmax(p)) for key, p in probabilities.items()},
    }


def write_cfr_policy(path: Path = CFR_POLICY_PATH, iterations: int = CFR_ITERATIONS) -> dict[str, Any]:
    policy = compute_cfr_policy(iterations)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(policy, indent=1, sort_keys=True) + "\n")
    return policy


@functools.lru_cache(maxsize=1)
def load_cfr_policy() -> dict[str, Any]:
    """The cached policy shipped with the package."""
    if not CFR_POLICY_PATH.exists():
        raise FileNotFoundError(
            f"the cached CFR policy {CFR_POLICY_PATH} is missing; regenerate it with "
            "`python -m mage_jax.envs.opponents.cfr` (needs OpenSpiel)"
        )
    return json.loads(CFR_POLICY_PATH.read_text())


if __name__ == "__main__":
    result = write_cfr_policy()
    print(f"wrote {CFR_POLICY_PATH}: {result['action']}")
