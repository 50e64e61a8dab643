"""Suites of runs: aggregation over seeds (mean ± standard error), markdown tables, plots, arguments."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from experiments.environments import environment
from experiments.suite import (
    RunRecord,
    Variant,
    aggregate,
    load_summary,
    markdown_table,
    parse_suite_args,
    plot_aggregates,
    run_dir_of,
    run_suite,
    variant_config,
)
from mage_jax import config as C


def _summary(success, payoff, *, opp_payoff=0.5, reference=None):
    curves = {"success": success, "payoff": payoff, "draw": [0.0] * len(success)}
    sub = {"curves": {**curves, "payoff": [opp_payoff] * len(success)}, "num_meta_episodes": 2}
    return {
        "status": "finished",
        "iterations": 7,
        "wall_seconds": 10.0,
        "evaluation": {
            "eval": {
                "metrics": {
                    "curves": curves,
                    "num_meta_episodes": 4,
                    "num_episodes": len(success),
                    "by_opponent": {"aggressive": sub},
                },
                "reference": reference,
            }
        },
    }


def test_aggregate_gives_mean_and_standard_error_over_seeds():
    records = [
        RunRecord("a", s, "", _summary([0.1 * s, 0.2 * s], [s, 2.0 * s], opp_payoff=s), "ran")
        for s in (1, 2, 3)
    ]
    agg = aggregate(records, "eval")["a"]
    np.testing.assert_allclose(agg.success, [0.2, 0.4])
    np.testing.assert_allclose(agg.payoff, [2.0, 4.0])
    np.testing.assert_allclose(agg.payoff_se, [1 / math.sqrt(3), 2 / math.sqrt(3)])
    assert agg.by_opponent_payoff["aggressive"] == pytest.approx((2.0, 1 / math.sqrt(3)))
    assert agg.seeds == [1, 2, 3] and agg.iterations == 7


def test_one_seed_has_no_standard_error_and_missing_runs_are_skipped():
    records = [RunRecord("a", 0, "", _summary([0.5], [1.0]), "ran"), RunRecord("b", 0, "", None, "missing")]
    aggs = aggregate(records, "eval")
    assert list(aggs) == ["a"] and aggs["a"].success_se is None


def test_markdown_table_has_a_row_per_variant_the_paper_column_and_the_references():
    ref = {
        "random_success": [0.3, 0.5],
        "random_payoff": [-0.5, -0.2],
        "best_fixed_success": [0.6, 0.6],
        "best_fixed_payoff": [0.1, 0.1],
        "adaptive_payoff_bound": [0.1, 0.4],
        "winnable": 0.6,
    }
    records = [
        RunRecord(v, s, "", _summary([0.5, 0.6 + s / 10], [0.1, 0.2], reference=ref), "ran")
        for v in ("differential", "cumulative")
        for s in (0, 1)
    ]
    text = markdown_table(aggregate(records, "eval"), paper={"differential": "0.914"}, title="T")
    assert "| differential | 2 | 0.500 ± 0.000 | 0.650 ± 0.050 |" in text
    assert "0.914" in text and "| cumulative |" in text
    assert "*random policy (same meta-episodes)*" in text and "*adaptive bound (oracle)*" in text
    assert "winnable share" in text and "final-episode payoff by opponent" in text


def test_markdown_table_lists_every_seed_so_bimodal_runs_show():
    records = [RunRecord("differential", 0, "", _summary([0.5, 0.6], [0.0, 0.4]), "ran"),
               RunRecord("differential", 3, "", _summary([0.4, 0.47], [0.06, 0.06]), "ran"),
               RunRecord("cumulative", 0, "", _summary([0.5, 0.55], [0.1, 0.3]), "ran")]
    text = markdown_table(aggregate(records, "eval"))
    assert "| variant | seed 0 | seed 3 |" in text
    assert "| differential | 0.600, +0.000 → +0.400 | 0.470, +0.060 → +0.060 |" in text
    assert "| cumulative | 0.550, +0.100 → +0.300 | – |" in text


def test_one_seed_has_no_per_seed_table():
    records = [RunRecord("a", 0, "", _summary([0.5], [1.0]), "ran")]
    assert "per seed" not in markdown_table(aggregate(records, "eval"))


def test_plot_is_written_as_a_small_png(tmp_path):
    records = [RunRecord("a", s, "", _summary([0.1, 0.2], [0.0, 0.3]), "ran") for s in (0, 1)]
    path = plot_aggregates(aggregate(records, "eval"), str(tmp_path / "fig" / "p.png"), title="t")
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b"\x89PNG" and len(data) < 200_000


def test_run_suite_collects_finished_runs_without_running_them(tmp_path):
    env = environment("kuhn_poker")
    run_dir = run_dir_of(str(tmp_path), "a", 3)
    import os

    os.makedirs(run_dir)
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(_summary([0.5], [0.1]), f)
    records = run_suite(
        env, [Variant("a"), Variant("b")], preset="tiny", seeds=[3], out_dir=str(tmp_path), collect_only=True
    )
    assert [(r.variant, r.status) for r in records] == [("a", "collected"), ("b", "missing")]
    assert load_summary(run_dir)["iterations"] == 7


def test_variant_config_applies_preset_variant_overrides_then_seed(tmp_path):
    cfg = variant_config(
        environment("kuhn_poker"),
        Variant("local", {"algorithm.anchor": "local"}),
        "tiny",
        5,
        str(tmp_path),
        {"train.iterations": 2},
    )
    assert cfg.algorithm.anchor == "local" and cfg.train.iterations == 2
    assert cfg.train.seed == 5 and cfg.model.init_seed == 5 and cfg.logging.run_dir == str(tmp_path)


def test_suite_arguments_default_to_three_seeds_at_tiny_scale_and_check_variants():
    kw = dict(
        name="ablations.x",
        description="",
        variants=("a", "b"),
        envs=("kuhn_poker",),
        default_env="kuhn_poker",
    )
    args = parse_suite_args(["--optim.lr", "0.01", "--set", "train.iterations=2"], **kw)
    assert args.seeds == [0, 1, 2] and args.variants == ["a", "b"]
    assert args.overrides == {"train.iterations": "2", "optim.lr": "0.01"}
    assert parse_suite_args(["--preset", "paper"], **kw).seeds == [0]
    with pytest.raises(C.ConfigError, match="--variants"):
        parse_suite_args(["--variants", "c"], **kw)
    with pytest.raises(C.ConfigError, match="--seeds"):
        parse_suite_args(["--seeds", "x"], **kw)
    with pytest.raises(C.ConfigError):
        parse_suite_args(["--env", "chess"], **kw)
