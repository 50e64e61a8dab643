"""N independent one-episode attempts of every task, scored like one meta-episode of N episodes.

The single-episode RL baselines (GRPO, GiGPO) and ReAct are evaluated over N *independent* attempts:
no memory and no reflection between them (docs/method.md §8). Each attempt is an ordinary one-episode
meta-episode of the same task; the attempts of a task are then joined in order, stopping after the
first win (the early stop of a meta-episode), so success@k means the same thing for every method.
Stochastic opponents are re-seeded for every attempt (each attempt resets the task), where a
meta-episode's restart keeps drawing from the opponent's stream.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from mage_jax.rollout.meta_episode import (
    MetaEpisodeOutcome,
    MetaEpisodeRunner,
    RolloutProgress,
    RolloutResult,
)
from mage_jax.rollout.policy import Policy
from mage_jax.rollout.tasks import Task

_PER_EPISODE = ("rewards", "won", "draw", "score", "payoff", "turns")


class IndependentAttemptsRunner:
    """A runner with the ``MetaEpisodeRunner`` interface over ``num_attempts`` one-episode attempts.

    ``base`` plays one episode. All attempts of all tasks are played in one lockstep call (attempt a of
    task i is meta-episode ``a * len(tasks) + i``).
    """

    def __init__(self, base: MetaEpisodeRunner, num_attempts: int):
        if base.config.num_episodes != 1:
            raise ValueError(f"the base runner must play one episode, got {base.config.num_episodes}")
        if num_attempts < 1:
            raise ValueError(f"num_attempts must be >= 1, got {num_attempts}")
        self.base = base
        self.config = base.config.with_episodes(int(num_attempts))

    @property
    def env_name(self) -> str:
        return self.base.env_name

    @property
    def env_options(self) -> dict[str, Any]:
        return self.base.env_options

    @property
    def workers(self) -> int:
        """Environment worker processes of the base runner (0: in process)."""
        return self.base.workers

    def close(self) -> None:
        """Stop the base runner's environment workers."""
        self.base.close()

    def with_env_options(self, extra: Mapping[str, Any]) -> IndependentAttemptsRunner:
        """The same attempts on an environment with ``extra`` merged into its options."""
        return IndependentAttemptsRunner(self.base.with_env_options(extra), self.config.num_episodes)

    def run(self, tasks: Sequence[Task], policy: Policy, *, training: bool = False,
            progress: Callable[[RolloutProgress], None] | None = None,
            stop: threading.Event | None = None) -> RolloutResult:
        n, attempts = len(tasks), self.config.num_episodes
        copies = [
            dataclasses.replace(t, meta_episode=a * n + i, group=a * n + i)
            for a in range(attempts) for i, t in enumerate(tasks)
        ]

        def per_task(p: RolloutProgress) -> None:  # finished attempts in tasks' worth: the share done
            progress(dataclasses.replace(p, finished=p.finished // attempts))

        result = self.base.run(copies, policy, training=training,
                               progress=None if progress is None else per_task, stop=stop)
        by_id = {o.meta_episode: o for o in result.outcomes}
        outcomes, kept = [], set()
        for i, task in enumerate(tasks):
            first = by_id[i]
            joined = MetaEpisodeOutcome(
                meta_episode=task.meta_episode, group=task.group, seed=task.seed, opponent=task.opponent,
                seat=task.seat, task_info=dict(first.task_info),
            )
            for a in range(attempts):
                o = by_id[a * n + i]
                kept.add(a * n + i)
                for name in _PER_EPISODE:
                    getattr(joined, name).extend(getattr(o, name)[:1])
                joined.valid_actions += o.valid_actions
                joined.invalid_actions += o.invalid_actions
                joined.rows += o.rows
                if o.won and o.won[0]:
                    break
            outcomes.append(joined)
        rows = [r for r in result.rows if r.meta_episode in kept]
        return RolloutResult(rows=rows, outcomes=outcomes, stats=dict(result.stats))
