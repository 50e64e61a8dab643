"""Pure-JAX credit assignment and losses of MAGE (docs/method.md §4-5).

``returns``: the row batch, meta-rewards d_n, row scores e and step returns G; ``advantages``: the
estimator registry (gigpo, grpo, rloo); ``losses``: PPO dual-clip loss, KL estimators, entropy and
chunked token log-probs.
"""

from mage_jax.algorithms.advantages import (
    AdvantageConfig,
    Credit,
    available_advantages,
    compute_advantages,
    credit,
    register_advantage,
)
from mage_jax.algorithms.losses import aggregate, kl_penalty, ppo_loss, token_logprobs_and_entropy
from mage_jax.algorithms.returns import (
    RowBatch,
    episode_rewards,
    meta_episode_returns,
    meta_rewards,
    row_penalties,
    row_scores,
    step_returns,
)

__all__ = [
    "AdvantageConfig",
    "Credit",
    "RowBatch",
    "aggregate",
    "available_advantages",
    "compute_advantages",
    "credit",
    "episode_rewards",
    "kl_penalty",
    "meta_episode_returns",
    "meta_rewards",
    "ppo_loss",
    "register_advantage",
    "row_penalties",
    "row_scores",
    "step_returns",
    "token_logprobs_and_entropy",
]
