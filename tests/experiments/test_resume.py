"""Resume semantics through the command line: what ``--resume`` may change, that a refused resume
rewrites nothing, and that the end of a run is idempotent (a finished run is reported finished; a kill
after the final records and before the run was marked finished duplicates no record)."""

from __future__ import annotations

import json
import shutil

import pytest

from experiments import evaluate, kuhn_poker
from experiments.common import parse_command_line
from mage_jax.logging import read_jsonl
from mage_jax.training.run import FINISHED_FILE
from tests.experiments.conftest import comparable


def records(run_dir) -> list[tuple[str, int]]:
    return [(r["split"], r["iteration"]) for r in read_jsonl(str(run_dir))]


def samples(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def finished(tmp_path_factory, request):
    """A finished 2-iteration smoke run with a checkpoint per iteration."""
    request.getfixturevalue("compilation_cache")
    from mage_jax.testing import smoke_args

    run_dir = tmp_path_factory.mktemp("resume") / "run"
    args = smoke_args({"train.iterations": 2, "checkpoint.every": 1, "checkpoint.keep": 2,
                        "logging.samples_every": 1})
    assert kuhn_poker.main([*args, "--run-dir", str(run_dir)]) == 0
    return run_dir


@pytest.fixture
def copy_of(tmp_path):
    def copy(run_dir):
        target = tmp_path / "copy"
        shutil.copytree(run_dir, target)
        return target
    return copy


def test_a_finished_run_is_marked_and_resuming_it_reruns_nothing(finished, copy_of, capsys):
    run_dir = copy_of(finished)
    assert json.loads((run_dir / FINISHED_FILE).read_text()) == {"iteration": 2}
    before = (run_dir / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert kuhn_poker.main(["--run-dir", str(run_dir), "--resume"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "finished at iteration 2" in err[0] and "nothing to resume" in err[0]
    assert (run_dir / "metrics.jsonl").read_text() == before


@pytest.mark.parametrize("override, key", [
    (["--rollout.group_size", "4"], "rollout.group_size"),
    (["--model.overrides", '{"num_layers": 2}'], "model.overrides"),
    (["--optim.lr", "0.5"], "optim.lr"),
])
def test_resume_refuses_a_change_of_the_runs_own_settings_in_one_line_and_rewrites_nothing(
        finished, copy_of, capsys, override, key):
    run_dir = copy_of(finished)
    (run_dir / FINISHED_FILE).unlink()
    files = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    assert kuhn_poker.main(["--run-dir", str(run_dir), "--resume", *override]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --resume cannot change {key}")
    assert "train.iterations" in err[0]  # names what may change
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == files


@pytest.mark.parametrize("key, value", [("optim.lr", 0.5), ("rollout.num_tasks", 3)])
def test_resuming_a_run_whose_config_was_edited_since_its_checkpoint_is_one_line_and_rewrites_nothing(
        finished, copy_of, capsys, key, value):
    """Editing the run's config.json by hand and resuming would continue silently as another run: the
    checkpoint's own record of the config tells, and the resume is refused before anything is written."""
    run_dir = copy_of(finished)
    config = json.loads((run_dir / "config.json").read_text())
    section, name = key.split(".")
    saved, config[section][name] = config[section][name], value
    (run_dir / "config.json").write_text(json.dumps(config))
    files = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    capsys.readouterr()
    assert kuhn_poker.main(["--run-dir", str(run_dir), "--resume", "--train.iterations", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"error: {run_dir}/config.json says {key}={value!r}, but its checkpoint of "
                             f"iteration 2 was trained with {saved!r}"), err
    assert f"put {key} back to resume" in err[0]
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == files


def test_resume_may_change_how_environments_are_stepped(finished):
    """Worker processes give the same results (docs/reliability.md), so a run stopped by a failing
    worker may go on in process, or with a longer reply deadline."""
    parsed = parse_command_line(["--run-dir", str(finished), "--resume", "--train.iterations", "3",
                                 "--env.workers", "0", "--env.reply_timeout", "900"],
                                experiment="kuhn_poker", presets=kuhn_poker.PRESETS, default_preset="tiny")
    cfg, options = parsed
    assert options.resume and cfg.env.workers == 0 and cfg.env.reply_timeout == 900.0


def test_samples_of_what_the_model_wrote_are_logged_per_evaluation_and_every_k_iterations(finished):
    logged = samples(finished)
    assert sorted({(s["split"], s["iteration"]) for s in logged}) == [
        ("eval", 2), ("heldout", 2), ("train", 1), ("train", 2), ("validation", 2)]
    for split, iteration in {(s["split"], s["iteration"]) for s in logged}:
        calls = [s for s in logged if (s["split"], s["iteration"]) == (split, iteration)]
        assert len({s["meta_episode"] for s in calls}) == 2  # logging.samples meta-episodes
    assert all(s["phase"] == "play" and s["prompt"] and s["response"] for s in logged)
    assert any("Kuhn" in s["prompt"] for s in logged) and all("<action>" in s["response"] for s in logged)


def test_a_kill_after_the_final_records_and_before_the_finish_mark_duplicates_nothing(finished, copy_of,
                                                                                       capsys):
    run_dir = copy_of(finished)
    # the state of a kill after the final evaluation's records and checkpoint, before summary and mark
    (run_dir / FINISHED_FILE).unlink()
    (run_dir / "summary.json").unlink()
    assert kuhn_poker.main(["--run-dir", str(run_dir), "--resume"]) == 0
    assert comparable(run_dir) == comparable(finished)
    assert samples(run_dir) == samples(finished)
    assert (run_dir / FINISHED_FILE).exists() and (run_dir / "summary.json").exists()
    assert "tokens generated" not in capsys.readouterr().err  # logging.progress false: no progress


def test_resume_may_train_a_finished_run_further_and_change_cadences(finished, copy_of, capsys, monkeypatch):
    monkeypatch.setenv("MAGE_PROGRESS_SECONDS", "0")  # a progress line for every change, not every 30 s
    run_dir = copy_of(finished)
    argv = ["--run-dir", str(run_dir), "--resume", "--train.iterations", "3", "--checkpoint.keep", "1",
            "--logging.progress", "true"]
    capsys.readouterr()
    assert kuhn_poker.main(argv) == 0
    out, err = capsys.readouterr()
    # stderr is no terminal here: plain lines, no bar redrawn with carriage returns
    assert "\r" not in err and "train: 2/3 iterations (66%)" in err
    assert "iteration 3: rollout, 4 turns, " in err and " tokens generated" in err  # inside the iteration
    assert "rollout_succ=" in err and "rollout_pay=" in err  # the bar's numbers name the training rollout
    # The bar ends on the state the table below measures, not on the last rollout's numbers.
    selected = json.loads((run_dir / "summary.json").read_text())["selected_iteration"]
    last_bar = err[err.rindex("final evaluation"):].splitlines()[0]
    assert f"measured iteration {selected} (best validated state): results below" in last_bar
    assert "rollout_" not in last_bar
    table = out.splitlines()
    header = next(line for line in table if line.startswith("opponent"))
    assert header.split()[:6] == ["opponent", "k", "success±se", "draw", "payoff±se", "valid"]
    assert table[table.index(header) + 1].split()[5] == "100%"  # constrained decoding: every action legal
    assert records(run_dir) == [("train", 1), ("train", 2), ("validation", 2), ("eval", 2), ("heldout", 2),
                                ("train", 3), ("validation", 3), ("eval", 3), ("heldout", 3)]
    assert json.loads((run_dir / FINISHED_FILE).read_text()) == {"iteration": 3}
    assert json.loads((run_dir / "config.json").read_text())["train"]["iterations"] == 3


def test_a_run_saved_in_the_other_block_layout_resumes_with_the_flag_its_error_names(finished, copy_of,
                                                                                     capsys):
    # The run trained unrolled; its config, as a preset that now scans would give it, asks for scanned
    # blocks. The refusal names the flag, which --resume accepts, and the run goes on with it.
    run_dir = copy_of(finished)
    config = json.loads((run_dir / "config.json").read_text())
    config["model"]["overrides"]["scan_layers"] = True
    (run_dir / "config.json").write_text(json.dumps(config))
    argv = ["--run-dir", str(run_dir), "--resume", "--train.iterations", "3"]
    capsys.readouterr()
    assert kuhn_poker.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "add --model.overrides.scan_layers false to the command" in err[0], err
    assert kuhn_poker.main([*argv, "--model.overrides.scan_layers", "false"]) == 0
    assert json.loads((run_dir / FINISHED_FILE).read_text()) == {"iteration": 3}
    assert json.loads((run_dir / "config.json").read_text())["model"]["overrides"]["scan_layers"] is False


def test_evaluating_a_step_the_run_does_not_have_is_one_line(finished, tmp_path, capsys):
    out = tmp_path / "eval"
    assert evaluate.main(["--run-dir", str(finished), "--step", "7", "--out-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "7" in err[0], err
    assert not out.exists()
