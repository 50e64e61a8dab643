"""The ablation modules: their variants, and one tiny end-to-end run of each (one seed, one iteration)."""

from __future__ import annotations

import importlib

import pytest

from experiments.ablations import ABLATIONS
from experiments.ablations.opponent_pool import skewed_pool
from experiments.ablations.opponent_pool import variants as pool_variants
from experiments.environments import environment
from experiments.presets import EnvExperiment
from experiments.suite import variant_config
from mage_jax.envs.workers import EnvWorkerError
from mage_jax.training.health import TrainingStopped

VARIANTS = {
    "reward_design": ("differential", "cumulative", "single_episode"),
    "anchors": ("global", "local"),
    "grouping": ("stationary", "mixed"),
    "opponent_pool": ("balanced", "pattern_skewed", "single_fixed"),
    "memory_channel": ("none", "reflection_only", "history_only", "history_and_reflection"),
}


def _module(name):
    return importlib.import_module(f"experiments.ablations.{name}")


@pytest.mark.parametrize("name", ABLATIONS)
def test_every_ablation_defines_its_paper_variants(name):
    ablation = _module(name).ABLATION
    assert ablation.variant_names == VARIANTS[name]
    assert [v.name for v in ablation.variants("kuhn_poker")] == list(VARIANTS[name])


@pytest.mark.parametrize(
    "name, key",
    [("reward_design", "algorithm.reward"), ("anchors", "algorithm.anchor"), ("grouping", "env.grouping")],
)
def test_variants_change_only_the_ablated_setting(name, key, tmp_path):
    env = environment("kuhn_poker")
    configs = {
        v.name: variant_config(env, v, "tiny", 0, str(tmp_path), {})
        for v in _module(name).ABLATION.variants("kuhn_poker")
    }
    section, field = key.split(".")
    assert {n: getattr(getattr(c, section), field) for n, c in configs.items()} == {n: n for n in configs}
    dicts = [
        {
            k: v
            for k, v in __import__("mage_jax.config", fromlist=["to_dict"]).to_dict(c).items()
            if k not in (section, "name")
        }
        for c in configs.values()
    ]
    assert all(d == dicts[0] for d in dicts)


@pytest.mark.parametrize("env", ["kuhn_poker", "tic_tac_toe"])
def test_pool_variants_train_on_their_pool_and_are_all_evaluated_on_the_balanced_pool(env, tmp_path):
    spec = environment(env)
    balanced = dict(zip(spec.config("tiny").env.opponents, spec.config("tiny").env.opponent_ratios))
    pools = {}
    for v in pool_variants(env):
        cfg = variant_config(spec, v, "tiny", 0, str(tmp_path), {})
        pools[v.name] = dict(zip(cfg.env.opponents, cfg.env.opponent_ratios))
        assert dict(v.protocol["eval_pool"]) == balanced
    assert pools["balanced"] == balanced
    assert len(pools["single_fixed"]) == 1
    assert abs(sum(pools["pattern_skewed"].values()) - 1) < 1e-9
    assert pools["pattern_skewed"] != balanced and set(pools["pattern_skewed"]) <= set(balanced)


def test_tic_tac_toe_skewed_pool_shrinks_mcts_to_a_tenth():
    pool = skewed_pool("tic_tac_toe")
    assert pool["mcts-100"] == pytest.approx(0.1) and pool["random"] == pytest.approx(0.9 / 7)


@pytest.mark.slow
@pytest.mark.parametrize("name", [a for a in ABLATIONS if a != "memory_channel"])  # test_memory_channel.py
def test_ablation_runs_end_to_end_and_writes_a_table_and_a_plot(
    name, tmp_path, compilation_cache, smoke_args
):
    """The arms other than MAGE's (the first, the main job's config, run by its own tests)."""
    out = tmp_path / name
    arms = ["--seeds", "0", "--out-dir", str(out), "--variants", ",".join(VARIANTS[name][1:])]
    assert _module(name).main([*arms, *smoke_args()]) == 0
    table = (out / "table.md").read_text()
    for variant in VARIANTS[name][1:]:
        assert f"| {variant} | 1 |" in table
        assert (out / variant / "seed0" / "summary.json").is_file()
    assert f"| {VARIANTS[name][0]} |" not in table
    assert "*random policy (same meta-episodes)*" in table and "winnable share" in table
    assert (out / "plot.png").read_bytes()[:4] == b"\x89PNG"
    assert "not finished" not in table
    # Finished runs are collected, not run again: the same table from the same summaries.
    assert _module(name).main([*arms, "--collect-only", *smoke_args()]) == 0
    assert (out / "table.md").read_text() == table


def test_collect_only_reports_runs_that_are_not_finished(tmp_path):
    out = tmp_path / "grouping"
    assert _module("grouping").main(["--seeds", "0", "--out-dir", str(out), "--collect-only"]) == 0
    assert "not finished: stationary/seed0, mixed/seed0" in (out / "table.md").read_text()


def test_ablation_at_paper_scale_without_a_model_folder_is_one_error_line(capsys, tmp_path):
    assert _module("reward_design").main(["--preset", "paper", "--out-dir", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: preset 'paper' loads a pretrained model") and "\n" not in err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("failure, code, line", [
    (EnvWorkerError("environment 'kuhn_poker': worker process 0 (pid 1) was killed by SIGKILL"), 4,
     "error: environment 'kuhn_poker': worker process 0 (pid 1) was killed by SIGKILL"),
    (TrainingStopped("every one of the 8 rows of iteration 1 is invalid"), 3,
     "error: every one of the 8 rows of iteration 1 is invalid"),
    (KeyboardInterrupt(), 130, "interrupted: stopped at once; finished runs are kept"),
])
def test_a_run_of_an_ablation_that_fails_is_one_line_and_its_exit_status(capsys, tmp_path, monkeypatch,
                                                                         failure, code, line):
    """A suite of runs fails like one run (docs/reliability.md): the run's failure is one line."""
    def run(self, cfg, **kwargs):
        raise failure

    monkeypatch.setattr(EnvExperiment, "run", run)
    capsys.readouterr()
    assert _module("grouping").main(["--seeds", "0", "--out-dir", str(tmp_path / "g")]) == code
    assert [x for x in capsys.readouterr().err.splitlines() if x.strip() and not x.startswith("[suite]")] == [
        line]
