"""Specification of the sampled transcripts: the calls of the first meta-episodes, decoded, written to
``samples.jsonl`` and TensorBoard text, and dropped past the checkpoint on resume like the metrics."""

from __future__ import annotations

import json

import numpy as np

import mage_jax.logging as logging_module
from mage_jax.evaluation.samples import render_markdown, sample_rows
from mage_jax.logging import MetricsLogger
from mage_jax.rollout.rows import Row


class WordTokenizer:
    words = ["<pad>", "play", "Kuhn", "<action>BET</action>", "<remark>plan</remark>"]

    def decode(self, ids, *, skip_special_tokens=True):
        return " ".join(self.words[i] for i in ids)


def row(meta_episode: int, turn: int, phase: str = "play", valid: bool = True) -> Row:
    return Row(prompt_ids=np.array([1, 2]), response_ids=np.array([4 if phase == "reflect" else 3]),
               logprobs=np.zeros(1), group=0, meta_episode=meta_episode, episode=0, turn=turn, step=turn,
               phase=phase, anchor="", opponent="cfr", env_reward=1.0, valid=valid)


def test_samples_are_the_decoded_calls_of_the_first_meta_episodes_in_order():
    rows = [row(3, 0), row(1, 0), row(1, 1, "reflect"), row(2, 0, valid=False), row(5, 0)]
    samples = sample_rows(rows, WordTokenizer(), meta_episodes=2)
    assert [(s.meta_episode, s.turn, s.phase) for s in samples] == [(1, 0, "play"), (1, 1, "reflect"),
                                                                     (2, 0, "play")]
    assert {s.episode for s in samples} == {1}  # row episode index 0: the first episode, counted from 1
    assert samples[0].prompt == "play Kuhn" and samples[1].response == "<remark>plan</remark>"
    assert not samples[2].valid
    assert sample_rows(rows, WordTokenizer(), meta_episodes=0) == ()
    text = render_markdown(samples)
    assert "reflect" in text and "INVALID" in text and "<action>BET</action>" in text
    assert "**meta-episode 1, episode 1, turn 0, play**" in text


def test_samples_go_to_jsonl_and_tensorboard_text_and_are_truncated_on_resume(tmp_path, monkeypatch):
    texts = []

    class Writer:
        def add_text(self, tag, text, step):
            texts.append((tag, step, text))

        def add_scalar(self, *args): ...
        def flush(self): ...
        def close(self): ...

    monkeypatch.setattr(logging_module, "_open_tensorboard", lambda run_dir: Writer())
    samples = sample_rows([row(0, 0), row(0, 1)], WordTokenizer(), meta_episodes=1)
    with MetricsLogger(str(tmp_path), tensorboard=True) as logger:
        for iteration in (1, 2):
            logger.log_samples(iteration, samples, split="eval", text=render_markdown(samples))
    records = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [(r["split"], r["iteration"], r["turn"]) for r in records] == [
        ("eval", 1, 0), ("eval", 1, 1), ("eval", 2, 0), ("eval", 2, 1)]
    assert [(tag, step) for tag, step, _ in texts] == [("eval/samples", 1), ("eval/samples", 2)]
    with MetricsLogger(str(tmp_path), resume_iteration=1):
        pass
    kept = [json.loads(x)["iteration"] for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert kept == [1, 1]
