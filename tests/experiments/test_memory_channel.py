"""The memory-channel ablation: its arms differ only in memory and reflections, and one tiny
end-to-end run lists what the learned reflections say."""

from __future__ import annotations

import re

import pytest

from experiments.ablations import memory_channel
from experiments.ablations.memory_channel import WORDS
from experiments.environments import environment
from experiments.suite import variant_config
from mage_jax import config as C


def test_memory_channel_arms_differ_only_in_memory_and_constrained_reflections(tmp_path):
    env = environment("kuhn_poker")
    arms = {v.name: variant_config(env, v, "tiny", 0, str(tmp_path), {})
            for v in memory_channel.variants("kuhn_poker")}
    r = {name: cfg.rollout for name, cfg in arms.items()}
    assert {n: (x.memory_mode, x.reflect, bool(x.reflection_words)) for n, x in r.items()} == {
        "none": ("none", False, False), "reflection_only": ("reflection_only", True, True),
        "history_only": ("history_only", False, False),
        "history_and_reflection": ("history_and_reflection", True, True)}
    tiny = env.config("tiny", {"logging.run_dir": str(tmp_path), "train.seed": 0, "model.init_seed": 0})
    assert C.to_dict(arms["history_only"])["rollout"] == C.to_dict(tiny)["rollout"]  # the tiny preset
    keep = ("memory_mode", "reflect", "reflection_words")
    others = [{k: v for k, v in C.to_dict(c)["rollout"].items() if k not in keep} for c in arms.values()]
    assert all(o == others[0] for o in others)
    assert r["reflection_only"].reflection_max_words == 3 and len(r["reflection_only"].reflection_words) == 12


@pytest.mark.slow
def test_memory_channel_runs_its_arms_and_lists_the_learned_reflections(
    tmp_path, compilation_cache, smoke_args
):
    """Every arm but ``history_only`` (the tiny preset itself, the main job's config)."""
    out = tmp_path / "memory_channel"
    arms = ("none", "reflection_only", "history_and_reflection")
    # One prompt bucket for every arm: their prompts differ in length, their compiled programs do not.
    one_bucket = {"rollout.max_prompt_tokens": 256, "rollout.length_buckets": [256]}
    argv = ["--seeds", "0", "--out-dir", str(out), "--variants", ",".join(arms)]
    assert memory_channel.main([*argv, *smoke_args(one_bucket)]) == 0
    table = (out / "table.md").read_text()
    for arm in arms:
        assert f"| {arm} | 1 |" in table  # the common table and the adaptation table
        assert (out / arm / "seed0" / "summary.json").is_file()
    assert "payoff@K − best fixed" in table and "not finished" not in table
    for arm in ("reflection_only", "history_and_reflection"):
        listing = table.split(f"most frequent reflections, {arm}")[1].split("\n\n", 2)[1]
        rows = [line for line in listing.splitlines() if line.startswith("| ") and "seat |" not in line]
        assert rows and all("`" in line and "%" in line for line in rows)
        # every listed text is 1..3 words of the vocabulary
        for text in re.findall(r"`([^`]*)`", listing):
            assert 1 <= len(text.split()) <= 3 and set(text.split()) <= set(WORDS)
    assert "most frequent reflections, none" not in table
