"""The recompute phase of an iteration: identical rows are scored once and share their log-probs, which
equal what scoring every row gives (the old and the KL reference tables alike)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from experiments.kuhn_poker import SPEC
from mage_jax.evaluation.evaluator import Evaluator
from mage_jax.testing import SMOKE
from mage_jax.training.assemble import build_parts, make_checkpointer, make_logger
from mage_jax.training.credit import credit
from mage_jax.training.trainer import Trainer

# Several mini-batches (old log-probs are recomputed) and a KL term (reference log-probs too).
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
    # Every row twice, the second copy in another meta-episode: identical inputs, identical log-probs.
    copies = [dataclasses.replace(r, meta_episode=r.meta_episode + 1000) for r in rows]
    yield trainer, rows + copies
    trainer.logger.close()
    trainer.checkpointer.close()


def scored_rows(trainer, monkeypatch) -> list[int]:
    """Counts the real rows each ``compute_logprobs`` call scores."""
    calls: list[int] = []
    compute = trainer.step.compute_logprobs

    def counting(params, batch, **kw):
        calls.append(int(np.asarray(batch.response_mask).any(axis=1).sum()))
        return compute(params, batch, **kw)

    monkeypatch.setattr(trainer.step, "compute_logprobs", counting)
    return calls


def test_identical_rows_are_scored_once_and_share_the_log_probs_of_scoring_every_row(trainer_and_rows,
                                                                                       monkeypatch):
    trainer, rows = trainer_and_rows
    credited = credit(trainer.cfg, rows, length_buckets=trainer.length_buckets,
                      pad_id=trainer.parts.tokenizer.pad_id)
    n = credited.packed.num_rows
    same = credited.identical_rows()
    distinct = np.unique(same).size
    assert distinct <= n // 2  # each row has its copy

    calls = scored_rows(trainer, monkeypatch)
    old, ref = trainer._recompute(credited, same)
    # Each distinct row once for the old and once for the reference table (the LoRA-free tiny model's
    # reference is a copy of the initial parameters, scored by the same program).
    assert sum(calls) == 2 * distinct

    every_old, every_ref = trainer._recompute(credited, np.arange(n))  # the path that scores every row
    assert sum(calls) == 2 * distinct + 2 * n
    mask = credited.packed.response_mask[:n].astype(bool)
    # Every row was scored: each has a free decision (its forced tokens have log-prob 0).
    assert (np.where(mask, old[:n], 0).sum(axis=1) < 0).all()
    assert (np.where(mask, ref[:n], 0).sum(axis=1) < 0).all()
    np.testing.assert_allclose(old[:n][mask], every_old[:n][mask], rtol=0, atol=1e-5)
    np.testing.assert_allclose(ref[:n][mask], every_ref[:n][mask], rtol=0, atol=1e-5)


def test_rows_that_differ_in_any_scored_token_or_the_prompt_split_are_not_identical(trainer_and_rows):
    trainer, rows = trainer_and_rows
    half = len(rows) // 2
    first = rows[:half]
    credited = credit(trainer.cfg, first + first, length_buckets=trainer.length_buckets,
                      pad_id=trainer.parts.tokenizer.pad_id)
    same = credited.identical_rows()
    assert all(same[i] <= i for i in range(len(same)))  # the first of each set represents it
    assert np.unique(same).size < len(same)
    # The same tokens with the prompt / response boundary moved by one are another row: the scored
    # targets differ.
    moved = [dataclasses.replace(r, prompt_ids=r.prompt_ids[:-1],
                                 response_ids=np.concatenate([r.prompt_ids[-1:], r.response_ids]),
                                 logprobs=np.concatenate([[0.0], r.logprobs])) for r in first]
    mixed = credit(trainer.cfg, first + moved, length_buckets=trainer.length_buckets,
                   pad_id=trainer.parts.tokenizer.pad_id)
    assert np.unique(mixed.identical_rows()).size == np.unique(same[:half]).size * 2
