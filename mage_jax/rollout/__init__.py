"""Rollout: task sampling, the meta-episode runner and its policies, row records and their packing."""

from mage_jax.rollout.meta_episode import MetaEpisodeOutcome, MetaEpisodeRunner, RolloutResult, RunnerConfig
from mage_jax.rollout.policy import Generation, GenerationRequest, LLMPolicy, Policy, ScriptedPolicy
from mage_jax.rollout.rows import PackedBatch, Row, minibatch_indices, pack_rows
from mage_jax.rollout.tasks import Task, TaskSampler, TaskSamplerConfig

__all__ = [
    "Generation",
    "GenerationRequest",
    "LLMPolicy",
    "MetaEpisodeOutcome",
    "MetaEpisodeRunner",
    "PackedBatch",
    "Policy",
    "RolloutResult",
    "Row",
    "RunnerConfig",
    "ScriptedPolicy",
    "Task",
    "TaskSampler",
    "TaskSamplerConfig",
    "minibatch_indices",
    "pack_rows",
]
