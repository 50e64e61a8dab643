"""How the main job fails, through ``experiments.kuhn_poker.main``: an environment worker that dies or stops
answering is one ``error:`` line and exit status 4 (never a hang, never a traceback); a second SIGTERM
is the same stop request (the checkpoint is still saved); a stop request while the plots are drawn
abandons them at once and keeps every result; worker processes change no result but the sampler's own
log-probabilities, in their last bit (docs/reliability.md)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import time

import pytest

from experiments import kuhn_poker
from experiments.common import EXIT_ENVIRONMENT_FAILED, EXIT_INTERRUPTED
from mage_jax import config as C
from mage_jax import testing
from mage_jax.envs.workers import EnvPool
from mage_jax.evaluation import plots
from mage_jax.training import signals
from mage_jax.training import trainer as trainer_module
from mage_jax.training.run import FINISHED_FILE
from tests.experiments.conftest import TIMING, comparable

SAMPLING_LOGPROB_DIAGNOSTICS = ("entropy_play@", "entropy_reflect")
"""The metrics computed from the sampler's own log-probabilities (``Row.logprobs``): the only ones that
``env.workers`` may change, in the last float32 bit (the ``env.workers`` docstring)."""


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, request):
    """A one-iteration smoke run in process (env.workers=0) whose plots were interrupted by SIGTERM: the
    drawing loops until a stop request abandons it."""
    request.getfixturevalue("compilation_cache")
    run_dir = tmp_path_factory.mktemp("failures") / "run"
    args = testing.smoke_args({"logging.plots": True, "env.workers": 0})
    patch = pytest.MonkeyPatch()
    seen: dict[str, float] = {}

    def slow_plot(*_, **__):
        seen["sent"] = time.monotonic()
        os.kill(os.getpid(), signal.SIGTERM)
        while time.monotonic() - seen["sent"] < 60:  # drawing, with no safe point of its own
            sum(range(1000))
        seen["finished"] = time.monotonic()
        return []

    patch.setattr(plots, "plot_success_and_payoff", slow_plot)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            code = kuhn_poker.main([*args, "--run-dir", str(run_dir)])
    finally:
        patch.undo()
    return code, run_dir, args, seen, err.getvalue()


def test_a_stop_request_while_the_plots_are_drawn_abandons_them_keeps_every_result_and_says_so(
        reference_run):
    code, run_dir, _, seen, err = reference_run
    assert code == 0  # the run had finished: its results and summary were written before the plots
    assert "finished" not in seen  # the drawing was abandoned at once, not waited for
    assert [line for line in err.splitlines() if line.strip()] == [
        f"stopped while drawing the plots: the run is finished ({run_dir}/summary.json is written), its "
        "plots were not all drawn"]
    assert json.loads((run_dir / FINISHED_FILE).read_text()) == {"iteration": 1}
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and set(summary["evaluation"]) == {"eval", "heldout"}


@pytest.mark.parametrize("fault", ["killed", "stopped"])
def test_an_environment_worker_that_dies_or_stops_answering_is_one_error_line_and_exit_4(
        tmp_path, capsys, smoke_args, monkeypatch, fault):
    """env.workers=1: the worker is killed (SIGKILL) or stopped (SIGSTOP, with a 2 s reply deadline) as the
    first rollout starts. One line names the environment, the worker and what it was doing, and how to
    continue; exit status 4, no traceback, no worker left."""
    original, original_iteration = EnvPool.replies, trainer_module.Trainer.train_iteration
    pids: list[int] = []
    armed: list[int] = []

    def train_iteration(self, iteration):  # the training rollout, not the tokenizer's corpus before it
        armed.append(iteration)
        return original_iteration(self, iteration)

    def replies(self, timeout=0.0):
        if armed and self.pids and not pids:
            pids.extend(self.pids)
            os.kill(pids[0], signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
        return original(self, timeout)

    monkeypatch.setattr(EnvPool, "replies", replies)
    monkeypatch.setattr(trainer_module.Trainer, "train_iteration", train_iteration)
    run_dir = tmp_path / "run"
    argv = [*smoke_args({"env.workers": 1, "env.reply_timeout": 2}), "--run-dir", str(run_dir)]
    capsys.readouterr()
    started = time.monotonic()
    assert kuhn_poker.main(argv) == EXIT_ENVIRONMENT_FAILED == 4
    assert time.monotonic() - started < 120
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1, err
    what = "was killed by SIGKILL" if fault == "killed" else "sent nothing for"
    assert err[0].startswith(f"error: environment 'kuhn_poker': worker process 0 (pid {pids[0]}) {what}"), err
    assert "meta-episode" in err[0]
    assert err[0].endswith("nothing after the last checkpoint was saved; continue with: python -m "
                           f"experiments.kuhn_poker --run-dir {run_dir} --resume")
    with pytest.raises(ProcessLookupError):
        os.kill(pids[0], 0)


def test_a_second_sigterm_is_the_same_request_and_the_checkpoint_is_still_saved(tmp_path, capsys, smoke_args,
                                                                               monkeypatch):
    """A scheduler may send SIGTERM more than once within its grace period: only a Ctrl-C after a stop
    request exits at once (docs/preemption.md); two SIGTERMs save iteration 1 and exit 75."""
    exits: list[int] = []
    monkeypatch.setattr(signals.os, "_exit", exits.append)
    original = trainer_module.Trainer.train_iteration

    def train_iteration(self, iteration):
        if iteration == 2:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
        return original(self, iteration)

    monkeypatch.setattr(trainer_module.Trainer, "train_iteration", train_iteration)
    run_dir = tmp_path / "run"
    capsys.readouterr()
    argv = [*smoke_args({"train.iterations": 2}), "--run-dir", str(run_dir)]
    assert kuhn_poker.main(argv) == EXIT_INTERRUPTED
    assert exits == []
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["1"]
    assert "--resume" in capsys.readouterr().err


def test_environment_workers_change_no_result_but_the_sampling_log_prob_diagnostics(reference_run, tmp_path):
    """The same run with env.workers=2: every record, the summary's evaluation and the final parameters'
    effect on it are those of the in-process run, except the diagnostics read from the sampler's own
    log-probabilities, which may differ by float32 rounding (rows reach the engine at other times, share an
    insert with other prompts, and sit at other cache offsets); the docstring of env.workers says so."""
    _, reference_dir, args, _, _ = reference_run
    run_dir = tmp_path / "run"
    argv = [*args, "--set", "env.workers=2", "--set", "logging.plots=false", "--run-dir", str(run_dir)]
    assert kuhn_poker.main(argv) == 0
    ours, theirs = comparable(run_dir), comparable(reference_dir)
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert a.keys() == b.keys()
        for key in a:
            if key.startswith(SAMPLING_LOGPROB_DIAGNOSTICS):
                assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-7), key
            else:
                assert a[key] == b[key], key
    summary, reference = (json.loads((d / "summary.json").read_text()) for d in (run_dir, reference_dir))
    assert summary["evaluation"] == reference["evaluation"]
    doc = next(info.doc for info in C.describe_keys() if info.key == "env.workers")
    assert all(name.rstrip("@") in doc for name in SAMPLING_LOGPROB_DIAGNOSTICS), doc
    assert not TIMING & set(ours[0])


@pytest.mark.parametrize("command", ["kuhn_poker", "evaluate"])
def test_ctrl_c_while_the_run_is_built_is_one_line_exit_130_and_leaves_nothing(tmp_path, capsys, smoke_args,
                                                                              monkeypatch, command):
    """Ctrl-C while the model and tokenizer are built (before the run's own handlers exist): one line, exit
    130, and what the build wrote is removed (the same command can simply run again)."""
    from experiments import evaluate
    from mage_jax.training import run as run_module

    def build_parts(cfg, run_dir, **kwargs):
        os.makedirs(os.path.join(run_dir, "tokenizer"), exist_ok=True)  # something written already
        raise KeyboardInterrupt

    monkeypatch.setattr(run_module, "build_parts", build_parts)
    out = tmp_path / "run"
    capsys.readouterr()
    if command == "kuhn_poker":
        code = kuhn_poker.main([*smoke_args(), "--run-dir", str(out)])
        line = "interrupted before the run started: nothing was saved"
    else:
        monkeypatch.setattr(evaluate, "build_parts", build_parts)
        code = evaluate.main(["--checkpoint", str(_a_run_folder(tmp_path)), "--out", str(out)])
        line = "interrupted before the evaluation started: nothing was evaluated or kept"
    assert code == signals.EXIT_SECOND_INTERRUPT == 130
    assert [x for x in capsys.readouterr().err.splitlines() if x.strip()] == [line]
    assert not out.exists()


def _a_run_folder(tmp_path):
    """A folder with the config.json of a smoke run (all ``evaluate --checkpoint`` reads before building)."""
    folder = tmp_path / "trained"
    C.save(kuhn_poker.SPEC.config("tiny", testing.SMOKE), str(folder))
    return folder
