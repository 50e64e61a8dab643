"""The text-environment protocol every MAGE environment implements.

Environments are plain Python: they speak text, know nothing of JAX or tokens, and are driven in
lockstep by the meta-episode runner. One environment object plays one meta-episode: ``reset`` draws
a task instance (deal, board, puzzle, goal) together with its opponent and seat, ``restart``
replays that identical instance for the next episode, and ``step`` parses one raw model response
and applies it.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar

from mage_jax.envs.parsing import extract_action


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """What the runner records about one step besides the reward."""

    won: bool = False
    draw: bool = False
    valid: bool = True
    score: float = 0.0
    opponent: str | None = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class StepResult:
    """Outcome of one agent turn (the opponent's answer, if any, already applied)."""

    observation: str
    reward: float
    done: bool
    info: StepInfo
    action: str | None = None
    """The parsed action text as applied (canonical form), or None when the turn was invalid."""


@dataclasses.dataclass(frozen=True)
class PromptSpec:
    """Environment-specific text the prompt renderer (``mage_jax.envs.prompts``) assembles.

    ``preamble`` is for pretrained LLMs (role, rules, goal, action format); ``compact_preamble`` is
    the same information in few words for small from-scratch models with a word-level vocabulary.
    ``history_window`` is W of docs/method.md §3 (moves shown from the current episode).
    """

    preamble: str
    compact_preamble: str
    action_format: str
    history_window: int = 7
    recent_full_observations: int = 2


class TextEnv(abc.ABC):
    """One meta-episode's environment.

    Subclasses set ``name``, ``max_turns`` and ``prompt_spec`` and implement the abstract methods.
    ``step`` must never raise on any model output: an unparseable or illegal action is an invalid
    turn (state unchanged, reward 0, not done, the opponent does not move, the turn is used up).
    """

    name: ClassVar[str] = "base"
    max_turns: int = 1
    reward_scale: ClassVar[float] = 1.0
    """Environment reward per unit of the game's payoff (Kuhn: 5 per chip); payoff = reward / scale."""
    slow_steps: ClassVar[bool] = False
    """Steps and resets cost tens of milliseconds or more (ALFWorld, WebShop): by default the runner steps
    these environments in worker processes (``env.workers``, ``mage_jax.envs.workers``)."""
    show_admissible: ClassVar[bool] = False
    """Play prompts list the legal actions (ALFWorld, WebShop: a long list, fitted to the prompt budget by
    ``envs.admissible``); the games leave them to the rules in the preamble."""
    prompt_spec: PromptSpec

    @abc.abstractmethod
    def reset(self, seed: int, *, opponent: str | None = None, seat: int | None = None, copy: int = 0) -> str:
        """Draw the task instance of ``seed`` (and fix its opponent and seat); return the first observation.

        When the opponent moves first, its opening move is already applied in the returned observation.
        ``copy`` is the meta-episode's index inside its group: the initial state never depends on it;
        a stochastic opponent draws its later moves from a stream seeded by (seed, copy).
        """

    @abc.abstractmethod
    def restart(self) -> str:
        """Restore the identical initial state of the current task instance; return the first observation.

        Stochastic opponents keep consuming their random stream across restarts (as the reference
        does) unless the environment was built with ``replayable_restarts=True``.
        """

    @abc.abstractmethod
    def step_action(self, action: str) -> StepResult:
        """Apply the text found inside the ``<action>`` tags (already extracted, not yet validated)."""

    @abc.abstractmethod
    def legal_actions(self) -> list[str]:
        """Canonical action texts that are legal now (the admissible list; used for constrained decoding)."""

    @property
    @abc.abstractmethod
    def observation(self) -> str:
        """The current raw observation (no history): the anchor text of a play row."""

    @property
    def opponent(self) -> str | None:
        """Name of the opponent of this meta-episode (None for single-agent tasks)."""
        return None

    @property
    def task_info(self) -> dict[str, Any]:
        """Descriptive facts of the task instance (seed, seat, opponent, task type) for metrics."""
        return {}

    def privileged_observation(self) -> str | None:
        """Extra text for training reflect prompts (Kuhn's both-cards quirk); None for most envs."""
        return None

    @staticmethod
    def split_private(observation: str) -> tuple[str, str] | None:
        """``(private, public)`` parts of a raw observation (Kuhn: the agent's card, the betting so far).

        Used by the training diagnostics to measure whether decisions depend on what only the agent
        sees (``mage_jax.evaluation.decisions``); None where an environment has no such split.
        """
        return None

    def step(self, response: str) -> StepResult:
        """Parse one raw model response (``<think>`` blocks included) and apply its action."""
        action = extract_action(response)
        if action is None:
            return self.invalid_step("no <action>...</action> found")
        return self.step_action(action)

    def invalid_step(self, reason: str) -> StepResult:
        """The result of an invalid turn: nothing changes, reward 0, not done."""
        return StepResult(
            observation=self.observation,
            reward=0.0,
            done=False,
            info=StepInfo(valid=False, opponent=self.opponent, extra={"invalid_reason": reason}),
            action=None,
        )


_REGISTRY: dict[str, type[TextEnv]] = {}


def register_env(name: str):
    """Class decorator: make an environment constructible by name from configs."""

    def wrap(cls: type[TextEnv]) -> type[TextEnv]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"environment {name!r} is registered twice")
        _REGISTRY[name] = cls
        cls.name = name
        return cls

    return wrap


def make_env(name: str, **options: Any) -> TextEnv:
    """Build a registered environment; unknown names get one clear error listing the known ones."""
    import mage_jax.envs.builtin  # noqa: F401  (registers the built-in environments)

    return env_class(name)(**options)


def env_class(name: str) -> type[TextEnv]:
    """The registered class of environment ``name`` (its static views, without building one)."""
    import mage_jax.envs.builtin  # noqa: F401

    if name not in _REGISTRY:
        raise ValueError(f"unknown environment {name!r}; known: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def registered_envs() -> list[str]:
    import mage_jax.envs.builtin  # noqa: F401

    return sorted(_REGISTRY)
