"""Safe points of a rollout: a policy wrapper that ends the rollout at its next turn once a stop was
requested (SIGTERM / Ctrl-C), before anything of the abandoned work reaches the training state."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

from mage_jax.rollout.policy import Generation, GenerationRequest, Policy


class Interrupted(Exception):
    """Raised at a safe point after a stop request: the work in progress (a training iteration or an
    evaluation) is abandoned, and the caller saves the last complete state."""


@dataclasses.dataclass
class StoppablePolicy:
    """``policy`` whose next turn raises ``Interrupted`` once ``stop`` is set (a safe point between the
    turns of the training rollout and of an evaluation)."""

    policy: Policy
    stop: threading.Event

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        if self.stop.is_set():
            raise Interrupted
        return self.policy.generate(requests)

    def prompt_lengths(self, prompts: Sequence[str]) -> list[int]:
        return self.policy.prompt_lengths(prompts)
