"""A Kuhn Poker environment whose steps take a set time or never end, registered as ``slow_kuhn_poker``
for the reply-deadline tests of ``mage_jax.envs.workers`` (a worker imports this module by name)."""

from __future__ import annotations

import time

from mage_jax.envs.base import StepResult, register_env
from mage_jax.envs.kuhn_poker import KuhnPokerEnv


@register_env("slow_kuhn_poker")
class SlowKuhnPokerEnv(KuhnPokerEnv):
    """``step_seconds``: each step sleeps that long first; ``hang_on``: a step of this response never
    returns."""

    def __init__(self, step_seconds: float = 0.0, hang_on: str | None = None, **options):
        super().__init__(**options)
        self.step_seconds, self.hang_on = float(step_seconds), hang_on

    def step(self, response: str) -> StepResult:
        while response == self.hang_on:
            time.sleep(0.05)
        time.sleep(self.step_seconds)
        return super().step(response)
