"""The registry of environment experiments: ``environment(name)`` -> its ``EnvExperiment``.

Every environment module defines its experiment as ``SPEC``; this module imports them all (it is the
only module that does), so the registry has no import cycle and no special case.
"""

from __future__ import annotations

from experiments import alfworld, kuhn_poker, minesweeper, sokoban, tic_tac_toe, webshop
from experiments.presets import EnvExperiment
from mage_jax import config as C

ENVIRONMENTS: dict[str, EnvExperiment] = {
    module.SPEC.name: module.SPEC
    for module in (kuhn_poker, tic_tac_toe, sokoban, minesweeper, alfworld, webshop)
}


def environment(name: str) -> EnvExperiment:
    """The ``EnvExperiment`` of an environment; an unknown name is a one-line ConfigError."""
    if name not in ENVIRONMENTS:
        raise C.ConfigError(f"unknown environment {name!r}; known: {', '.join(ENVIRONMENTS)}")
    return ENVIRONMENTS[name]
