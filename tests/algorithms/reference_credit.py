"""A literal plain-Python reading of docs/method.md §4-5, used as an oracle for the JAX kernels,
and a generator of random but well-formed meta-episode batches."""

from __future__ import annotations

import statistics
from collections import defaultdict

import numpy as np

from mage_jax.algorithms.returns import RowBatch

BUCKET = 160  # fixed batch size for random batches: at most 132 rows + 25 padding rows, one compile

FIELDS = ("group", "meta_episode", "episode", "step", "is_reflect", "anchor", "env_reward", "invalid",
          "response_length")


def random_rows(seed: int, *, num_groups: int = 3, group_size: int = 4, max_episodes: int = 3,
                max_turns: int = 3, num_anchors: int = 4) -> list[dict]:
    """Rows of random meta-episodes: early stop on a win, reflections between episodes, colliding
    anchors, sparse non-dense ids and strictly increasing but gappy steps."""
    rng = np.random.default_rng(seed)
    rows = []
    for g in range(num_groups):
        group_id = 1000 + 7 * g
        reflect_anchor = 100 + g
        for m in range(group_size):
            meta_id = 50 - 3 * m
            step = int(rng.integers(-5, 5))
            for n in range(max_episodes):
                turns = int(rng.integers(1, max_turns + 1))
                won = False
                for t in range(turns):
                    last = t == turns - 1
                    choices = [-1.0, 0.0, 1.0, 2.0] if last else [0.0, 0.5]
                    reward = float(rng.choice(choices))
                    won = last and reward > 0 and rng.random() < 0.5
                    rows.append(dict(
                        group=group_id, meta_episode=meta_id, episode=n, step=step, is_reflect=False,
                        anchor=int(rng.integers(0, num_anchors)), env_reward=reward,
                        invalid=bool(rng.random() < 0.2), response_length=int(rng.integers(0, 120)),
                    ))
                    step += int(rng.integers(1, 4))
                if won or n == max_episodes - 1:
                    break
                rows.append(dict(group=group_id, meta_episode=meta_id, episode=n, step=step, is_reflect=True,
                                 anchor=reflect_anchor, env_reward=0.0, invalid=bool(rng.random() < 0.2),
                                 response_length=int(rng.integers(0, 120))))
                step += int(rng.integers(1, 4))
    order = rng.permutation(len(rows))
    return [rows[i] for i in order]


def to_batch(rows: list[dict], pad_to: int | None = None) -> RowBatch:
    batch = RowBatch.create(**{f: [r[f] for r in rows] for f in FIELDS})
    return batch if pad_to is None else batch.pad(pad_to)


def _meta_episodes(rows):
    metas = defaultdict(list)
    for i, r in enumerate(rows):
        metas[(r["group"], r["meta_episode"])].append(i)
    return {k: sorted(v, key=lambda i: rows[i]["step"]) for k, v in metas.items()}


def credit(rows, *, design="differential", gamma_step=0.95, gamma_traj=0.6, invalid_penalty=0.5,
           length_penalty=0.0, max_len=None, max_reflection_len=None):
    """Per-row d, penalty, e, G, and per-meta-episode Σd, all by the words of §4."""
    n = len(rows)
    d, G, pen = [0.0] * n, [0.0] * n, [0.0] * n
    meta_total = {}
    if design == "single_episode":
        gamma_traj = 0.0
    for key, idx in _meta_episodes(rows).items():
        episodes = sorted({rows[i]["episode"] for i in idx if not rows[i]["is_reflect"]})
        play = [i for i in idx if not rows[i]["is_reflect"]]
        R = {e: sum(rows[i]["env_reward"] for i in play if rows[i]["episode"] == e) for e in episodes}
        dn = {}
        for k, e in enumerate(episodes):
            dn[e] = R[e] - R[episodes[k - 1]] if design == "differential" and k > 0 else R[e]
        meta_total[key] = sum(dn.values())
        for i in idx:
            if not rows[i]["is_reflect"]:
                d[i] = dn[rows[i]["episode"]]
        running, prev_episode = 0.0, None
        for i in reversed(idx):
            r = rows[i]
            if r["is_reflect"]:
                G[i] = running
                continue
            last_of_episode = prev_episode != r["episode"]
            s = dn[r["episode"]] if last_of_episode else 0.0
            gamma = gamma_step if prev_episode == r["episode"] else gamma_traj
            running = s + gamma * running
            G[i] = running
            prev_episode = r["episode"]
    for i, r in enumerate(rows):
        p = invalid_penalty if r["invalid"] else 0.0
        # M is the row's own limit: the reflection limit for a reflect row (the play limit if none).
        m = max_len if not r["is_reflect"] or max_reflection_len is None else max_reflection_len
        if m is not None and r["response_length"] > m / 2:
            p += length_penalty * min(1.0, (r["response_length"] - m / 2) / (m / 2))
        pen[i] = p
    e = [d[i] - pen[i] for i in range(n)]
    return dict(d=d, G=G, e=e, penalty=pen, meta_total=meta_total)


def _centre(values, pools, std_norm, eps=1e-6):
    members = defaultdict(list)
    for i, p in enumerate(pools):
        members[p].append(values[i])
    out = []
    for i, p in enumerate(pools):
        pool = members[p]
        mean = sum(pool) / len(pool)
        std = statistics.stdev(pool) if len(pool) > 1 else 1.0
        out.append((values[i] - mean) / (std + eps) if std_norm else values[i] - mean)
    return out


def gigpo(rows, *, norm="mean_norm", anchor="global", omega=1.0, **credit_kwargs):
    c = credit(rows, **credit_kwargs)
    std_norm = norm == "mean_std_norm"
    a_ep = _centre(c["e"], [r["group"] for r in rows], std_norm)
    if anchor == "global":
        clusters = [(r["group"], r["anchor"]) for r in rows]
    else:
        clusters = [(r["group"], r["episode"], r["anchor"]) for r in rows]
    a_step = _centre(c["G"], clusters, std_norm)
    return [a + omega * b for a, b in zip(a_ep, a_step)]


def meta_scores(rows, **credit_kwargs):
    c = credit(rows, **credit_kwargs)
    score = dict(c["meta_total"])
    for i, r in enumerate(rows):
        score[(r["group"], r["meta_episode"])] -= c["penalty"][i]
    return score


def grpo(rows, **credit_kwargs):
    """GRPO: (score - group mean) / (group std + eps) over the meta-episodes of the group."""
    score = meta_scores(rows, **credit_kwargs)
    keys = sorted(score)
    values = _centre([score[k] for k in keys], [k[0] for k in keys], std_norm=True)
    centred = dict(zip(keys, values))
    return [centred[(r["group"], r["meta_episode"])] for r in rows]


def rloo(rows, **credit_kwargs):
    score = meta_scores(rows, **credit_kwargs)
    out = []
    for r in rows:
        key = (r["group"], r["meta_episode"])
        others = [v for k, v in score.items() if k[0] == r["group"] and k != key]
        out.append(score[key] - sum(others) / len(others) if others else 0.0)
    return out
