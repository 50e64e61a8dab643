"""What an iteration runs through the model, and that the shortcuts change nothing: identical rows are
scored once and share their log-probs (the old and the KL reference tables alike, equal to scoring
every row); an update runs one row of each identical set whose advantages share a sign, weighted by its
count; the rows of the first update of a one-epoch iteration get no old log-probs (the update takes them
from its own forward pass). The updates equal the plain path: every row scored, every row updated with
its recomputed old log-probs."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.kuhn_poker import SPEC
from mage_jax.algorithms.schedules import lr_decay
from mage_jax.evaluation.evaluator import Evaluator
from mage_jax.testing import SMOKE
from mage_jax.training.assemble import build_parts, make_checkpointer, make_logger
from mage_jax.training.credit import credit, merge_identical
from mage_jax.training.train_step import fill_micro_batches, gather_rows
from mage_jax.training.trainer import Trainer

# Several mini-batches (old log-probs are recomputed) and a KL term (reference log-probs too).
NO_ROWS = np.zeros(0, np.int64)
OVERRIDES = {**SMOKE, "optim.mini_batch_rows": 4, "optim.micro_batch_rows": 2, "optim.kl_coef": 0.1,
             "train.validate_every": 0}


@pytest.fixture(scope="module")
def trainer_and_rows(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("recompute"))
    cfg = SPEC.config("tiny", {**OVERRIDES, "logging.run_dir": run_dir})
    parts = build_parts(cfg, run_dir)
    trainer = Trainer(parts, Evaluator(parts, SPEC.protocol(cfg), progress=False),
                      logger=make_logger(cfg, run_dir, resume=False),
                      checkpointer=make_checkpointer(cfg, run_dir))
    rows = trainer._collect(1).rows
    # Copies in other meta-episodes (identical inputs, identical log-probs): the first quarter of the
    # rows three times, the next quarter twice, the rest once.
    copies = [dataclasses.replace(r, meta_episode=r.meta_episode + 1000 * k)
              for k, part in ((1, rows[:len(rows) // 2]), (2, rows[:len(rows) // 4])) for r in part]
    yield trainer, rows + copies
    trainer.logger.close()
    trainer.checkpointer.close()


def counted_rows(trainer, monkeypatch, method: str) -> list[int]:
    """Counts the real rows each call of the train step's ``method`` runs through the model."""
    calls: list[int] = []
    call = getattr(trainer.step, method)

    def counting(first, batch, *args, **kw):
        calls.append(int(np.asarray(batch.response_mask).any(axis=1).sum()))
        return call(first, batch, *args, **kw)

    monkeypatch.setattr(trainer.step, method, counting)
    return calls


def credited_rows(trainer, rows):
    return credit(trainer.cfg, rows, length_buckets=trainer.length_buckets,
                  pad_id=trainer.parts.tokenizer.pad_id)


def credited_copies(trainer_and_rows):
    """The trainer, the fixture's rows credited, their count and ``identical_rows``."""
    trainer, rows = trainer_and_rows
    credited = credited_rows(trainer, rows)
    return trainer, credited, credited.packed.num_rows, credited.identical_rows()


def test_identical_rows_are_scored_once_and_share_the_log_probs_of_scoring_every_row(trainer_and_rows,
                                                                                       monkeypatch):
    trainer, credited, n, same = credited_copies(trainer_and_rows)
    distinct = np.unique(same).size
    assert distinct <= n - n // 3  # the copies

    calls = counted_rows(trainer, monkeypatch, "compute_logprobs")
    old, ref = trainer._recompute(credited, same, NO_ROWS)
    # Each distinct row once for the old and once for the reference table (the LoRA-free tiny model's
    # reference is a copy of the initial parameters, scored by the same program).
    assert sum(calls) == 2 * distinct

    every_old, every_ref = trainer._recompute(credited, np.arange(n), NO_ROWS)  # every row scored
    assert sum(calls) == 2 * distinct + 2 * n
    mask = credited.packed.response_mask[:n].astype(bool)
    # Every row was scored: each has a free decision (its forced tokens have log-prob 0).
    assert (np.where(mask, old[:n], 0).sum(axis=1) < 0).all()
    assert (np.where(mask, ref[:n], 0).sum(axis=1) < 0).all()
    np.testing.assert_allclose(old[:n][mask], every_old[:n][mask], rtol=0, atol=1e-5)
    np.testing.assert_allclose(ref[:n][mask], every_ref[:n][mask], rtol=0, atol=1e-5)


def test_the_rows_of_the_first_update_get_no_old_log_probs_unless_a_later_update_has_a_copy(
        trainer_and_rows, monkeypatch):
    trainer, credited, n, same = credited_copies(trainer_and_rows)
    first = trainer._first_update_rows(1, credited)
    assert 0 < len(first) < n
    later = np.setdiff1d(np.arange(n), first)
    calls = counted_rows(trainer, monkeypatch, "compute_logprobs")
    old, ref = trainer._recompute(credited, same, first)
    assert sum(calls) == np.unique(same).size + np.unique(same[later]).size  # reference + old
    every_old, _ = trainer._recompute(credited, np.arange(n), NO_ROWS)
    mask = credited.packed.response_mask[:n].astype(bool)
    needed = np.isin(same, same[later])  # a later update's row or a copy of one
    assert not needed.all()
    scored = needed[:, None] & mask
    np.testing.assert_allclose(old[:n][scored], every_old[:n][scored], rtol=0, atol=1e-5)
    assert (old[:n][~needed] == 0).all()


def test_rows_that_differ_in_any_scored_token_or_the_prompt_split_are_not_identical(trainer_and_rows):
    trainer, rows = trainer_and_rows
    half = len(rows) // 2
    first = rows[:half]
    credited = credited_rows(trainer, first + first)
    same = credited.identical_rows()
    assert all(same[i] <= i for i in range(len(same)))  # the first of each set represents it
    assert np.unique(same).size < len(same)
    # The same tokens with the prompt / response boundary moved by one are another row: the scored
    # targets differ.
    moved = [dataclasses.replace(r, prompt_ids=r.prompt_ids[:-1],
                                 response_ids=np.concatenate([r.prompt_ids[-1:], r.response_ids]),
                                 logprobs=np.concatenate([[0.0], r.logprobs])) for r in first]
    mixed = credited_rows(trainer, first + moved)
    assert np.unique(mixed.identical_rows()).size == np.unique(same[:half]).size * 2


def test_an_update_runs_identical_rows_once_and_moves_the_parameters_as_the_update_of_every_row(
        trainer_and_rows, monkeypatch):
    trainer, credited, n, same = credited_copies(trainer_and_rows)
    old, ref = trainer._recompute(credited, same, trainer._first_update_rows(1, credited))
    every_old, every_ref = trainer._recompute(credited, np.arange(n), NO_ROWS)  # for the plain path
    start = jax.tree.map(jnp.copy, trainer.state)

    calls = counted_rows(trainer, monkeypatch, "update")
    merged_metrics = trainer._update_epochs(1, credited, same, old, ref)
    merged_params = jax.tree.map(np.asarray, trainer.state.params)
    assert sum(calls) < n  # the copies of one mini-batch ran once

    # The plain path: every row scored, every mini-batch updated row by row with its recomputed old
    # log-probs.
    trainer.state, every_metrics = start, []
    for idx in trainer._epoch_blocks(1, 0, credited.row_lengths):
        idx = fill_micro_batches(idx, trainer.cfg.optim.micro_batch_rows)
        batch = credited.batch(idx, with_advantages=True)
        batch = batch.replace(old_logprobs=gather_rows(every_old, idx, batch.length),
                              ref_logprobs=gather_rows(every_ref, idx, batch.length))
        lr_scale = lr_decay(trainer.cfg.optim.lr_decay, 0.0, trainer.cfg.optim.lr_end_fraction)
        trainer.state, metrics = trainer.step.update(trainer.state, trainer.step.place_batch(batch), lr_scale,
                                                     donate=False)
        every_metrics.append({k: float(v) for k, v in jax.device_get(metrics).items()})
    assert len(merged_metrics) == len(every_metrics) > 1
    for merged, every in zip(merged_metrics, every_metrics):
        assert merged.keys() == every.keys()
        for key in merged:
            assert merged[key] == pytest.approx(every[key], rel=1e-4, abs=1e-6), key
    for a, b in zip(jax.tree.leaves(merged_params), jax.tree.leaves(trainer.state.params)):
        np.testing.assert_allclose(a, np.asarray(b), rtol=1e-4, atol=1e-6)
    moved = [np.abs(np.asarray(a) - np.asarray(b)).max()
             for a, b in zip(jax.tree.leaves(merged_params), jax.tree.leaves(start.params))]
    assert max(moved) > 1e-4  # the updates did move the parameters


def test_only_identical_rows_whose_advantages_share_a_sign_merge():
    same = np.array([0, 0, 0, 0, 4, 4])
    advantages = np.array([1.0, 3.0, -2.0, 0.0, 0.0, 0.0], np.float32)
    merged = merge_identical(np.array([3, 0, 1, 2, 4, 5, -1, -1]), same, advantages)
    assert merged.index.tolist() == [3, 0, 2, 4, -1, -1, -1, -1]
    assert merged.weights[[3, 0, 2, 4]].tolist() == [1, 2, 1, 2]
    assert merged.advantages[[3, 0, 2, 4]].tolist() == [0.0, 2.0, -2.0, 0.0]
