"""Safe points of a rollout: a policy wrapper that ends the rollout at its next turn once a stop was
requested (SIGTERM / Ctrl-C), before anything of the abandoned work reaches the training state."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

from mage_jax.rollout.policy import Generation, GenerationRequest, Policy, PolicyStream


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

    def open_stream(self) -> StoppableStream | None:
        """The policy's continuous-batching stream, ending at its next collect once a stop was requested."""
        opener = getattr(self.policy, "open_stream", None)
        stream = opener() if opener is not None else None
        return None if stream is None else StoppableStream(stream, self.stop)


@dataclasses.dataclass
class StoppableStream:
    """A continuous-batching ``stream`` whose next collect raises ``Interrupted`` once ``stop`` is set."""

    stream: PolicyStream
    stop: threading.Event

    @property
    def busy(self) -> bool:
        return self.stream.busy

    def submit(self, tag: Any, request: GenerationRequest, key_path: tuple[int, ...],
               priority: tuple[int, ...] = ()) -> None:
        self.stream.submit(tag, request, key_path, priority)

    def collect(self) -> list[tuple[Any, Generation]]:
        if self.stop.is_set():
            raise Interrupted
        return self.stream.collect()
