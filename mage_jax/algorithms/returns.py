"""Rewards and returns of meta-episodes over flat per-row arrays (docs/method.md §4).

One row is one LLM call. Rows of a training batch arrive flat and in any order; the structure
(group → meta-episode → episode → time step) lives in integer id columns. Every function here is
pure and jit-compiled, loops over no data, and ignores padding rows (``mask == False``) entirely:
their ids, rewards and flags may hold anything and never change a result; their outputs are 0.

Shapes and ids (the jit-friendly design): the only static size is R, the number of rows. Ids may be
any integers (not necessarily dense or small); they are turned into dense segment ids by sorting,
and every segment reduction uses R + 1 segments (there are never more distinct groups, meta-episodes,
episodes or anchors than rows; segment R collects the padding). So nothing but R needs to be known
at trace time, and a batch padded to a fixed R compiles once.

Id semantics:
  * ``group``: the group (uid) of G meta-episodes sharing task and opponent; unique in the batch.
  * ``meta_episode``: unique inside its group (a batch-global id works too).
  * ``episode``: episode index n inside the meta-episode. For a reflect row any consistent
    convention works (the episode it reflects on or the one it precedes): it is used only to build
    local anchors.
  * ``step``: time order inside the meta-episode; any strictly increasing integers.
  * ``anchor``: global anchor id (equal observation + opponent ⇒ equal id); clusters are formed
    inside a group, and local anchors combine it with ``episode``.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

REWARD_DESIGNS = ("differential", "cumulative", "single_episode")


@flax.struct.dataclass
class RowBatch:
    """One training batch of rows as a pytree of [R] arrays (see the module docstring)."""

    group: jax.Array  # int32[R]
    meta_episode: jax.Array  # int32[R]
    episode: jax.Array  # int32[R]
    step: jax.Array  # int32[R]
    is_reflect: jax.Array  # bool[R]
    anchor: jax.Array  # int32[R]
    env_reward: jax.Array  # float32[R]
    invalid: jax.Array  # bool[R]: invalid action (play) or missing <remark> (reflect)
    response_length: jax.Array  # int32[R]: response tokens
    mask: jax.Array  # bool[R]: False for padding rows

    @classmethod
    def create(
        cls,
        *,
        group,
        meta_episode,
        episode,
        step,
        is_reflect,
        anchor,
        env_reward,
        invalid=None,
        response_length=None,
        mask=None,
    ) -> RowBatch:
        """Build a batch from host sequences, checking shapes and dtypes with one clear error."""
        columns = dict(
            group=group, meta_episode=meta_episode, episode=episode, step=step, is_reflect=is_reflect,
            anchor=anchor, env_reward=env_reward,
        )
        arrays = {name: np.asarray(value) for name, value in columns.items()}
        sizes = {name: a.shape for name, a in arrays.items()}
        if any(a.ndim != 1 for a in arrays.values()) or len({a.shape for a in arrays.values()}) != 1:
            raise ValueError(f"RowBatch columns must be 1-D and of equal length, got shapes {sizes}")
        (num_rows,) = arrays["group"].shape
        optional = dict(invalid=(invalid, False), response_length=(response_length, 0), mask=(mask, True))
        for name, (value, default) in optional.items():
            a = np.full(num_rows, default) if value is None else np.asarray(value)
            if a.shape != (num_rows,):
                raise ValueError(f"RowBatch column {name!r} has shape {a.shape}, expected ({num_rows},)")
            arrays[name] = a
        for name in ("group", "meta_episode", "episode", "step", "anchor", "response_length"):
            a = arrays[name]
            if a.size and not (np.issubdtype(a.dtype, np.integer) or np.all(np.mod(a, 1) == 0)):
                raise ValueError(f"RowBatch column {name!r} must hold integers, got dtype {a.dtype}")
            arrays[name] = a.astype(np.int32)
        for name in ("is_reflect", "invalid", "mask"):
            arrays[name] = arrays[name].astype(bool)
        arrays["env_reward"] = arrays["env_reward"].astype(np.float32)
        return cls(**jax.device_put(arrays))  # device_put: no per-shape compilation, unlike jnp.asarray

    @property
    def num_rows(self) -> int:
        return self.mask.shape[0]

    def pad(self, num_rows: int) -> RowBatch:
        """Append masked padding rows up to ``num_rows`` (a fixed bucket size).

        Host-side (numpy), like ``create``: padding to ever new sizes compiles nothing.
        """
        extra = num_rows - self.num_rows
        if extra < 0:
            raise ValueError(f"cannot pad {self.num_rows} rows down to {num_rows}")
        grow = lambda a: np.concatenate([np.asarray(a), np.zeros((extra,), np.asarray(a).dtype)])
        return jax.device_put(jax.tree.map(grow, self))


# ------------------------------------------------------------------------------------------------
# Grouping helpers (shared with advantages.py)


def dense_ids(*keys: jax.Array, mask: jax.Array) -> jax.Array:
    """Dense ids 0..K-1 of the distinct key tuples among valid rows; padding rows get id R.

    Sorting-based, so keys may be arbitrary integers. Ids follow the lexicographic order of the
    key tuples: consecutive ids with an equal leading key are consecutive values of the next key.
    """
    num_rows = mask.shape[0]
    order = jnp.lexsort(tuple(reversed(keys)) + ((~mask).astype(jnp.int32),))
    changed = jnp.arange(num_rows) == 0
    for key in keys:  # a loop over the (few) key columns, not over data
        k = key[order]
        changed = changed | (k != jnp.roll(k, 1))
    sorted_ids = jnp.cumsum(changed.astype(jnp.int32)) - 1
    ids = jnp.zeros((num_rows,), jnp.int32).at[order].set(sorted_ids)
    return jnp.where(mask, ids, num_rows)


def segment_count(ids: jax.Array, weight: jax.Array) -> jax.Array:
    """Number of rows with ``weight`` set per segment (R + 1 segments)."""
    return jax.ops.segment_sum(weight.astype(jnp.float32), ids, ids.shape[0] + 1)


# ------------------------------------------------------------------------------------------------
# Episodes and the meta-reward d_n


@flax.struct.dataclass
class _Episodes:
    play: jax.Array  # bool[R] valid play rows
    meta_id: jax.Array  # int32[R] dense (group, meta_episode) id, R for padding
    episode_id: jax.Array  # int32[R] dense (group, meta_episode, episode) id of play rows, R otherwise
    reward: jax.Array  # float32[R+1] R_n per episode id
    meta_reward: jax.Array  # float32[R+1] d_n per episode id
    exists: jax.Array  # bool[R+1] episode id holds at least one play row
    meta_of_episode: jax.Array  # int32[R+1] meta id of each episode id (R where none)


def _is_differential(reward_design: str) -> bool:
    if reward_design not in REWARD_DESIGNS:
        raise ValueError(f"unknown reward design {reward_design!r}; expected one of {REWARD_DESIGNS}")
    return reward_design == "differential"


def _episodes(rows: RowBatch, differential: jax.Array) -> _Episodes:
    num_rows = rows.num_rows
    nseg = num_rows + 1
    play = rows.mask & ~rows.is_reflect
    meta_id = dense_ids(rows.group, rows.meta_episode, mask=rows.mask)
    episode_id = dense_ids(rows.group, rows.meta_episode, rows.episode, mask=play)
    reward = jax.ops.segment_sum(jnp.where(play, rows.env_reward, 0.0), episode_id, nseg)
    exists = segment_count(episode_id, play) > 0
    meta_of_episode = jax.ops.segment_max(jnp.where(play, meta_id, -1), episode_id, nseg)
    meta_of_episode = jnp.where(exists, meta_of_episode, num_rows)
    # Episode ids are sorted by (group, meta-episode, episode): id k-1 is the previous episode that
    # ran in the same meta-episode whenever both map to the same meta id.
    has_previous = exists & (jnp.roll(meta_of_episode, 1) == meta_of_episode) & (jnp.arange(nseg) > 0)
    previous = jnp.where(has_previous & differential, jnp.roll(reward, 1), 0.0)
    meta_reward = jnp.where(exists, reward - previous, 0.0)
    return _Episodes(play, meta_id, episode_id, reward, meta_reward, exists, meta_of_episode)


# The reward design, gammas and penalties enter the kernels as traced values (the public wrappers
# check and convert them), so one kernel compiles once per batch size R whatever the settings.


@jax.jit
def episode_rewards(rows: RowBatch) -> jax.Array:
    """R_n of each play row's episode (sum of its play rows' env rewards); 0 on other rows."""
    ep = _episodes(rows, jnp.bool_(False))
    return jnp.where(ep.play, ep.reward[ep.episode_id], 0.0)


@jax.jit
def _meta_rewards(rows: RowBatch, differential: jax.Array) -> jax.Array:
    ep = _episodes(rows, differential)
    return jnp.where(ep.play, ep.meta_reward[ep.episode_id], 0.0)


def meta_rewards(rows: RowBatch, reward_design: str = "differential") -> jax.Array:
    """d_n of each play row's episode under the reward design; 0 on reflect and padding rows.

    differential (MAGE): d_0 = R_0, d_n = R_n - R_{n-1}; cumulative (LaMer) and single_episode:
    d_n = R_n. Only episodes that ran count (a meta-episode won at episode 0 has d_0 only).
    """
    return _meta_rewards(rows, _is_differential(reward_design))


@jax.jit
def _meta_episode_returns(rows: RowBatch, differential: jax.Array) -> jax.Array:
    ep = _episodes(rows, differential)
    total = jax.ops.segment_sum(ep.meta_reward, ep.meta_of_episode, rows.num_rows + 1)
    return jnp.where(rows.mask, total[ep.meta_id], 0.0)


def meta_episode_returns(rows: RowBatch, reward_design: str = "differential") -> jax.Array:
    """Σ_n d_n of each row's meta-episode, broadcast to all its rows (0 on padding).

    Differential: the final episode's reward R_{N-1} (the sum telescopes); cumulative and
    single_episode: Σ_n R_n. This is the trajectory-level score of GRPO and RLOO.
    """
    return _meta_episode_returns(rows, _is_differential(reward_design))


# ------------------------------------------------------------------------------------------------
# Penalties, row scores e and step returns G


def _length_limit(max_response_length: int | None) -> int:
    if max_response_length is None:
        return 0
    if max_response_length <= 0:
        raise ValueError(f"max_response_length must be positive or None, got {max_response_length}")
    return max_response_length


@jax.jit
def _row_penalties(rows: RowBatch, invalid_penalty, length_penalty, max_response_length,
                   max_reflection_length) -> jax.Array:
    penalty = jnp.where(rows.invalid, jnp.asarray(invalid_penalty, jnp.float32), 0.0)
    # Each row against its own limit M: play rows the play limit, reflect rows the reflection limit.
    limit = jnp.where(rows.is_reflect, jnp.asarray(max_reflection_length, jnp.float32),
                      jnp.asarray(max_response_length, jnp.float32))
    half = jnp.maximum(limit, 1.0) / 2.0
    excess = jnp.clip((rows.response_length.astype(jnp.float32) - half) / half, 0.0, 1.0)
    penalty = penalty + jnp.where(limit > 0, length_penalty * excess, 0.0)
    return jnp.where(rows.mask, penalty, 0.0)


def row_penalties(
    rows: RowBatch,
    *,
    invalid_penalty: float = 0.0,
    length_penalty: float = 0.0,
    max_response_length: int | None = None,
    max_reflection_length: int | None = None,
) -> jax.Array:
    """Training-only penalty p ≥ 0 of each row (subtracted from the row score e, never from G).

    Invalid action or missing ``<remark>``: c_invalid. Response length L above half of the row's own
    maximum M: c_len · min(1, (L - M/2) / (M/2)), where M is ``max_response_length`` for play rows and
    ``max_reflection_length`` (default: the play limit) for reflect rows, the limits they were
    generated under. ``max_response_length=None`` disables the length term. Both coefficients default
    to 0 (no penalty): a run's values are set once, by ``mage_jax.config.AlgorithmConfig``.
    """
    play = _length_limit(max_response_length)
    reflect = play if max_reflection_length is None or not play else _length_limit(max_reflection_length)
    return _row_penalties(rows, invalid_penalty, length_penalty, play, reflect)


def row_scores(
    rows: RowBatch,
    reward_design: str = "differential",
    *,
    invalid_penalty: float = 0.0,
    length_penalty: float = 0.0,
    max_response_length: int | None = None,
    max_reflection_length: int | None = None,
) -> jax.Array:
    """Episode-level row score e: d_n on play rows of episode n, 0 on reflect rows, minus penalties."""
    penalty = row_penalties(
        rows, invalid_penalty=invalid_penalty, length_penalty=length_penalty,
        max_response_length=max_response_length, max_reflection_length=max_reflection_length,
    )
    return meta_rewards(rows, reward_design) - penalty


@jax.jit
def step_returns(
    rows: RowBatch, meta_reward: jax.Array, *, gamma_step: float = 0.95, gamma_traj: float = 0.6
) -> jax.Array:
    """Step return G of every row (docs/method.md §4), given the per-row d_n from ``meta_rewards``.

    Backward walk of each meta-episode in time order: only the last play row of episode n carries
    s = d_n; a play row discounts the running value with γ_step when the next play row is of the
    same episode and with γ_traj when an episode boundary is crossed; a reflect row takes the
    current value. Written as the linear recurrence G_i = s_i + g_i·G_{i+1} over rows sorted by
    (meta-episode, step) and solved by one ``lax.scan`` over the sorted rows (a scalar carry: cheap
    next to any LLM step, and it compiles in a fraction of the time a parallel associative scan
    takes); g = 0 on the last row of each meta-episode keeps meta-episodes apart.
    (Single-episode design: pass gamma_traj = 0.)
    """
    num_rows = rows.num_rows
    if num_rows == 0:
        return jnp.zeros((0,), jnp.float32)
    play = rows.mask & ~rows.is_reflect
    meta_id = dense_ids(rows.group, rows.meta_episode, mask=rows.mask)
    order = jnp.lexsort((rows.step, meta_id))  # padding rows (meta id R) sort last
    meta = meta_id[order]
    episode = rows.episode[order]
    is_play = play[order]
    reward = jnp.where(is_play, meta_reward[order], 0.0)

    position = jnp.arange(num_rows)
    play_position = jnp.where(is_play, position, num_rows)
    later_play = jnp.concatenate([play_position[1:], jnp.array([num_rows])])
    next_play = jax.lax.cummin(later_play, reverse=True)  # next play row strictly later (R: none)
    next_index = jnp.minimum(next_play, num_rows - 1)
    has_next_play = (next_play < num_rows) & (meta[next_index] == meta)
    same_episode_next = has_next_play & (episode[next_index] == episode)

    s = jnp.where(is_play & ~same_episode_next, reward, 0.0)
    g = jnp.where(is_play, jnp.where(same_episode_next, gamma_step, gamma_traj), 1.0)
    next_row_same_meta = jnp.concatenate([meta[1:] == meta[:-1], jnp.array([False])])
    g = jnp.where(next_row_same_meta, g, 0.0).astype(jnp.float32)

    def backward(running, step):  # one row, latest first
        s_i, g_i = step
        value = s_i + g_i * running
        return value, value

    _, returns_sorted = jax.lax.scan(backward, jnp.float32(0.0), (s, g), reverse=True, unroll=8)
    returns = jnp.zeros((num_rows,), jnp.float32).at[order].set(returns_sorted)
    return jnp.where(rows.mask, returns, 0.0)
