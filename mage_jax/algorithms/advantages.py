"""Advantage estimators over flat per-row arrays, in a registry by name (docs/method.md §5).

``compute_advantages(name, rows, cfg)`` returns one float32 advantage per row (0 on padding rows);
the trainer broadcasts it to every response token of the row. ``AdvantageConfig`` is the checked,
user-facing settings; estimators receive it as ``AdvantageParams`` (traced scalars), so each
estimator compiles once per batch size R whatever the settings.

Registered estimators:
  * ``gigpo`` (MAGE, LaMer, GiGPO): A = A_ep + ω·A_step with A_ep = e − mean(e over all rows of the
    group) and A_step = G − mean(G over rows of the group with the same anchor). With
    ``reward_design="cumulative"`` this is LaMer; with ``"single_episode"`` it is GiGPO on single
    episodes (γ_traj is forced to 0).
  * ``grpo``: the meta-episode score Σ_n d_n − Σ_rows penalties, minus the mean and divided by
    (std + ε) of the scores of the group's meta-episodes (GRPO's definition, whatever ``norm`` says),
    broadcast to the meta-episode's rows.
  * ``rloo``: the same score minus the leave-one-out mean of the other meta-episodes of the group.

Normalisation (``norm``): ``mean_norm`` subtracts the pool mean; ``mean_std_norm`` also divides by
(std + ε), std being the unbiased (n − 1) sample standard deviation as in the reference, and
std := 1 for a pool of one. It applies to gigpo (both terms); grpo always divides by the std and
rloo never does. A pool whose values are all equal gives exactly 0 in both modes (its float32 mean
can land one ulp off the common value, which ``mean_std_norm`` would blow up by 1 / (std + ε)).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from mage_jax.algorithms.returns import (
    REWARD_DESIGNS,
    RowBatch,
    _meta_episode_returns,
    _meta_rewards,
    _row_penalties,
    dense_ids,
    segment_count,
    step_returns,
)

NORM_MODES = ("mean_norm", "mean_std_norm")
ANCHOR_MODES = ("global", "local")


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
    """Credit-assignment settings (defaults: MAGE, docs/method.md §4-5)."""

    reward_design: str = "differential"
    gamma_step: float = 0.95
    gamma_traj: float = 0.6
    omega: float = 1.0
    norm: str = "mean_norm"
    anchor: str = "global"
    invalid_penalty: float = 0.0
    """c_invalid. The penalties default to 0 (none) here: a run's values are set once, by
    ``mage_jax.config.AlgorithmConfig`` (its defaults: the paper's Kuhn Poker column, docs/method.md §8)."""
    length_penalty: float = 0.0
    """c_len (needs ``max_response_length``, M)."""
    max_response_length: int | None = None
    """M of play rows."""
    max_reflection_length: int | None = None
    """M of reflect rows (their own generation limit); None: ``max_response_length``."""
    epsilon: float = 1e-6

    def __post_init__(self):
        if self.reward_design not in REWARD_DESIGNS:
            raise ValueError(f"reward_design must be one of {REWARD_DESIGNS}, got {self.reward_design!r}")
        if self.norm not in NORM_MODES:
            raise ValueError(f"norm must be one of {NORM_MODES}, got {self.norm!r}")
        if self.anchor not in ANCHOR_MODES:
            raise ValueError(f"anchor must be one of {ANCHOR_MODES}, got {self.anchor!r}")
        for name in ("gamma_step", "gamma_traj"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must lie in [0, 1], got {getattr(self, name)}")
        for name in ("invalid_penalty", "length_penalty", "epsilon"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be non-negative, got {getattr(self, name)}")
        if self.length_penalty > 0 and (self.max_response_length is None or self.max_response_length <= 0):
            raise ValueError("length_penalty > 0 needs a positive max_response_length (M)")
        if self.max_reflection_length is not None and self.max_reflection_length <= 0:
            raise ValueError(
                f"max_reflection_length must be positive or None, got {self.max_reflection_length}")

    @property
    def effective_gamma_traj(self) -> float:
        """γ_traj, forced to 0 by the single-episode design (no propagation across episodes)."""
        return 0.0 if self.reward_design == "single_episode" else self.gamma_traj

    def params(self) -> AdvantageParams:
        """The config as a pytree of scalars: what the jitted estimators receive. Host (numpy) scalars:
        device scalars would each cost a conversion program on first use."""
        f32 = lambda x: np.asarray(x, np.float32)
        return AdvantageParams(
            differential=np.asarray(self.reward_design == "differential"),
            gamma_step=f32(self.gamma_step),
            gamma_traj=f32(self.effective_gamma_traj),
            omega=f32(self.omega),
            std_norm=np.asarray(self.norm == "mean_std_norm"),
            local_anchor=np.asarray(self.anchor == "local"),
            invalid_penalty=f32(self.invalid_penalty),
            length_penalty=f32(self.length_penalty),
            max_response_length=f32(self.max_response_length if self.length_penalty > 0 else 0),
            max_reflection_length=f32((self.max_reflection_length or self.max_response_length)
                                      if self.length_penalty > 0 else 0),
            epsilon=f32(self.epsilon),
        )


@flax.struct.dataclass
class AdvantageParams:
    """An ``AdvantageConfig`` as traced scalars, so that changing any setting (ablations in one
    process) reuses the compiled estimator: one compilation per estimator and batch size R."""

    differential: jax.Array  # bool: differential reward design
    gamma_step: jax.Array
    gamma_traj: jax.Array  # already 0 for the single-episode design
    omega: jax.Array
    std_norm: jax.Array  # bool: mean_std_norm
    local_anchor: jax.Array  # bool: anchors are (anchor, episode)
    invalid_penalty: jax.Array
    length_penalty: jax.Array
    max_response_length: jax.Array  # M of play rows; 0: no length penalty
    max_reflection_length: jax.Array  # M of reflect rows; 0: no length penalty
    epsilon: jax.Array


@flax.struct.dataclass
class Credit:
    """Per-row credit for logging and for the estimators: d_n, penalty, score e and step return G."""

    meta_reward: jax.Array  # d_n on play rows, 0 on reflect rows
    penalty: jax.Array  # training-only penalties (≥ 0)
    score: jax.Array  # e = d_n - penalty (reflect rows: -penalty)
    step_return: jax.Array  # G


def _penalties(rows: RowBatch, p: AdvantageParams) -> jax.Array:
    return _row_penalties(rows, p.invalid_penalty, p.length_penalty, p.max_response_length,
                          p.max_reflection_length)


@jax.jit
def _credit(rows: RowBatch, p: AdvantageParams) -> Credit:
    d = _meta_rewards(rows, p.differential)
    penalty = _penalties(rows, p)
    g = step_returns(rows, d, gamma_step=p.gamma_step, gamma_traj=p.gamma_traj)
    return Credit(meta_reward=d, penalty=penalty, score=d - penalty, step_return=g)


def credit(rows: RowBatch, cfg: AdvantageConfig | None = None) -> Credit:
    """Per-row d_n, penalty, row score e and step return G (for logging and custom estimators)."""
    return _credit(rows, (cfg or AdvantageConfig()).params())


def centre(x: jax.Array, pool: jax.Array, weight: jax.Array, *, std_norm, epsilon) -> jax.Array:
    """x minus the mean of its pool (rows with equal ``pool`` id and ``weight`` set).

    With ``std_norm`` (may be traced) the result is divided by (std + ε): unbiased std, std := 1 for
    a pool of one. A pool of equal values (a pool of one included) gives exactly 0. Rows without
    ``weight`` get their pool's statistics too.
    """
    nseg = x.shape[0] + 1
    w = weight.astype(jnp.float32)
    count = segment_count(pool, weight)
    mean = jax.ops.segment_sum(x * w, pool, nseg) / jnp.maximum(count, 1.0)
    highest = jax.ops.segment_max(jnp.where(weight, x, -jnp.inf), pool, nseg)
    lowest = jax.ops.segment_min(jnp.where(weight, x, jnp.inf), pool, nseg)
    constant = highest == lowest  # every weighted value of the pool is the same number
    deviation = jnp.where(constant[pool], 0.0, x - mean[pool])
    square = jax.ops.segment_sum(deviation**2 * w, pool, nseg)
    std = jnp.where(count > 1, jnp.sqrt(square / jnp.maximum(count - 1.0, 1.0)), 1.0)
    return jnp.where(std_norm, deviation / (std[pool] + epsilon), deviation)


# ------------------------------------------------------------------------------------------------
# Registry

AdvantageFn = Callable[[RowBatch, AdvantageParams], jax.Array]
_REGISTRY: dict[str, AdvantageFn] = {}


def register_advantage(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Register ``fn(rows, params: AdvantageParams) -> float32[R]`` under ``name`` (jitted here)."""

    def decorator(fn: AdvantageFn) -> AdvantageFn:
        if name in _REGISTRY:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        _REGISTRY[name] = jax.jit(fn)
        return fn

    return decorator


def available_advantages() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def advantage_fn(name: str) -> AdvantageFn:
    """The jitted estimator registered under ``name``: ``fn(rows, cfg.params())``."""
    if name not in _REGISTRY:
        known = ", ".join(available_advantages())
        raise ValueError(f"unknown advantage estimator {name!r}; available: {known}")
    return _REGISTRY[name]


def compute_advantages(name: str, rows: RowBatch, cfg: AdvantageConfig | None = None) -> jax.Array:
    """Per-row advantages of the estimator ``name`` (float32[R], 0 on padding rows)."""
    return advantage_fn(name)(rows, (cfg or AdvantageConfig()).params())


# ------------------------------------------------------------------------------------------------
# Estimators


@register_advantage("gigpo")
def gigpo(rows: RowBatch, p: AdvantageParams) -> jax.Array:
    """A = A_ep + ω·A_step; episode pool = all rows of the group, step pool = anchor cluster."""
    c = _credit(rows, p)
    group = dense_ids(rows.group, mask=rows.mask)
    episode_key = jnp.where(p.local_anchor, rows.episode, 0)
    cluster = dense_ids(rows.group, rows.anchor, episode_key, mask=rows.mask)
    a_episode = centre(c.score, group, rows.mask, std_norm=p.std_norm, epsilon=p.epsilon)
    a_step = centre(c.step_return, cluster, rows.mask, std_norm=p.std_norm, epsilon=p.epsilon)
    return jnp.where(rows.mask, a_episode + p.omega * a_step, 0.0)


def _meta_episode_scores(rows: RowBatch, p: AdvantageParams):
    """Per-row score of its meta-episode (Σ d − Σ penalties), group ids, one representative row each."""
    num_rows = rows.num_rows
    meta = dense_ids(rows.group, rows.meta_episode, mask=rows.mask)
    group = dense_ids(rows.group, mask=rows.mask)
    penalty_sum = jax.ops.segment_sum(_penalties(rows, p), meta, num_rows + 1)[meta]
    score = _meta_episode_returns(rows, p.differential) - penalty_sum
    # One representative row per meta-episode, so each meta-episode counts once in its group's pool.
    position = jnp.arange(num_rows)
    first = jax.ops.segment_min(position, meta, num_rows + 1)
    representative = rows.mask & (first[meta] == position)
    return score, group, representative


@register_advantage("grpo")
def grpo(rows: RowBatch, p: AdvantageParams) -> jax.Array:
    """(score − group mean) / (group std + ε) of the meta-episode, broadcast to its rows."""
    score, group, representative = _meta_episode_scores(rows, p)
    a = centre(score, group, representative, std_norm=True, epsilon=p.epsilon)
    return jnp.where(rows.mask, a, 0.0)


@register_advantage("rloo")
def rloo(rows: RowBatch, p: AdvantageParams) -> jax.Array:
    """Score minus the mean score of the other meta-episodes of the group (0 for a group of one)."""
    score, group, representative = _meta_episode_scores(rows, p)
    nseg = rows.num_rows + 1
    count = segment_count(group, representative)[group]
    total = jax.ops.segment_sum(jnp.where(representative, score, 0.0), group, nseg)[group]
    others = (total - score) / jnp.maximum(count - 1.0, 1.0)
    a = jnp.where(count > 1, score - others, 0.0)
    return jnp.where(rows.mask, a, 0.0)
