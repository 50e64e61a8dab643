"""Environments in worker processes (``mage_jax.envs.workers``): the same meta-episodes as in-process
stepping on every installed environment, one clear error when a worker dies or an environment raises in
one, no hang on close, stop requests honoured while environments step, workers that import no JAX and
do not outlive their parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from mage_jax import config as C
from mage_jax.envs.workers import (
    REPLY_TIMEOUT_S,
    SLOW_REPLY_TIMEOUT_S,
    EnvPool,
    EnvWorkerError,
    Reset,
    Step,
    default_reply_timeout,
    default_workers,
)
from mage_jax.rollout.meta_episode import MetaEpisodeRunner
from mage_jax.rollout.policy import BatchStream, RandomLegalPolicy
from mage_jax.rollout.stopping import Interrupted
from mage_jax.rollout.tasks import TaskSampler, TaskSamplerConfig
from mage_jax.testing import runner_config, write_tiny_alfworld_data
from mage_jax.training.assemble import make_runner
from tests.envs import slow_envs  # noqa: F401  (registers slow_kuhn_poker)
from tests.optional import require

ROOT = Path(__file__).resolve().parents[2]


class OneAtATime:
    """A continuous-batching stream (``lockstep = False``) that answers one request per collect, so
    environments step while other requests are still "decoding"."""

    lockstep = False

    def __init__(self, policy: RandomLegalPolicy):
        self.policy, self.pending = policy, []

    @property
    def busy(self) -> bool:
        return bool(self.pending)

    def submit(self, tag, request, key_path, priority=()):
        self.pending.append((tag, request, key_path))

    def collect(self):
        tag, request, key_path = self.pending.pop(0)
        # the answer depends on the request's key path only (like the engine), not on the schedule
        seeded = RandomLegalPolicy(hash(tuple(key_path)) % 2**31)
        return [(tag, seeded.generate([request])[0])]


class Continuous:
    def __init__(self):
        self.policy = RandomLegalPolicy(0)

    def stream(self):
        return OneAtATime(self.policy)

    def prompt_lengths(self, prompts):
        return [len(p.split()) for p in prompts]


def kuhn_tasks(n=4, group=2, seats="mixed"):
    return TaskSampler(TaskSamplerConfig(num_tasks=n, group_size=group, seats=seats,
                                         opponents={"conservative": 1, "aggressive": 1})).sample_train(0)


def single_tasks(n=3, group=2):
    return TaskSampler(TaskSamplerConfig(num_tasks=n, group_size=group)).sample_train(0)


def rollout_facts(result):
    rows = [(r.meta_episode, r.episode, r.turn, r.phase, r.prompt_ids.tobytes(), r.response_ids.tobytes(),
             r.env_reward, r.valid) for r in result.rows]
    return rows, [o.to_dict() for o in result.outcomes]


@pytest.fixture(scope="module")
def alfred_data(tmp_path_factory) -> Path:
    require("alfworld")
    require("textworld")
    root = tmp_path_factory.mktemp("alfworld_workers")
    write_tiny_alfworld_data(root, splits=("valid_unseen",), trials=2)
    return root


def environments(alfred_data_dir: Path | None):
    """(name, options, tasks) of every installed environment."""
    yield "kuhn_poker", {}, kuhn_tasks()
    yield "tic_tac_toe", {}, TaskSampler(TaskSamplerConfig(
        num_tasks=2, group_size=2, seats="mixed", opponents={"random": 1})).sample_train(0)
    yield "sokoban", {}, single_tasks()
    yield "minesweeper", {}, single_tasks()
    yield "webshop", {}, single_tasks(2, 2)
    if alfred_data_dir is not None:
        yield "alfworld", {"split": "valid_unseen", "data_dir": str(alfred_data_dir)}, single_tasks(2, 1)


@pytest.mark.parametrize("name", ["kuhn_poker", "tic_tac_toe", "sokoban", "minesweeper", "webshop",
                                  "alfworld"])
def test_meta_episodes_in_workers_equal_in_process_stepping(name, request):
    """Same tasks and policy with 0 and 2 workers: the same rows (prompts, responses, rewards) and outcomes,
    under the lockstep schedule and the continuous one (environments step while others decode)."""
    data = request.getfixturevalue("alfred_data") if name == "alfworld" else None
    [(_, options, tasks)] = [e for e in environments(data) if e[0] == name]
    config = runner_config(num_episodes=2, constrained_actions=True, memory_mode="history_only",
                           reflect=False)
    slow = name in ("webshop", "alfworld")  # seconds per rollout here: the continuous schedule only
    for policy in (Continuous,) if slow else (lambda: RandomLegalPolicy(3), Continuous):
        facts = []
        for workers in (0, 2):
            runner = MetaEpisodeRunner(name, options, config, workers=workers)
            try:
                facts.append(rollout_facts(runner.run(tasks, policy(), training=True)))
                if workers and not slow:  # environments are reused by the next rollout, in their workers
                    pids = runner._envs.pids
                    assert rollout_facts(runner.run(tasks, policy(), training=True)) == facts[-1]
                    assert runner._envs.pids == pids
            finally:
                runner.close()
        assert facts[0] == facts[1]
        assert len(facts[0][0]) >= len(tasks)


class KillingPolicy(RandomLegalPolicy):
    """Kills the first environment worker of ``runner`` (SIGKILL) while the first turn is generated."""

    def __init__(self, runner, sig=signal.SIGKILL, stop=None):
        super().__init__(0)
        self.runner, self.sig, self.stop = runner, sig, stop

    def stream(self):
        return BatchStream(self.generate)

    def generate(self, requests):
        if self.sig is not None:
            pid = self.runner._envs.pids[0]
            os.kill(pid, self.sig)
            self.sig = None
            if self.stop is not None:
                self.stop.set()
        return super().generate(requests)


def test_a_killed_worker_is_one_error_naming_the_environment_and_the_task():
    runner = MetaEpisodeRunner("kuhn_poker", {}, runner_config(num_episodes=2, constrained_actions=True),
                               workers=1)
    started = time.perf_counter()
    with pytest.raises(EnvWorkerError) as err:
        runner.run(kuhn_tasks(), KillingPolicy(runner), training=True)
    message = str(err.value)
    assert "environment 'kuhn_poker'" in message and "killed by SIGKILL" in message
    assert "step(" in message and "meta-episode 0 (task seed" in message and "\n" not in message
    assert time.perf_counter() - started < 20
    # the runner starts fresh workers for its next rollout and plays it as in process
    again = runner.run(kuhn_tasks(), RandomLegalPolicy(1), training=True)
    runner.close()
    assert rollout_facts(again) == rollout_facts(MetaEpisodeRunner(
        "kuhn_poker", {}, runner_config(num_episodes=2, constrained_actions=True)).run(
        kuhn_tasks(), RandomLegalPolicy(1), training=True))


def test_an_environment_that_raises_in_a_worker_is_one_error_naming_the_operation():
    pool = EnvPool("kuhn_poker", {}, workers=1)
    try:
        assert pool.submit(0, Reset(2, opponent="nobody", seat=0), "meta-episode 7") is None
        expected = (r"environment 'kuhn_poker', meta-episode 7: reset\(seed=2, opponent='nobody'.*"
                    r"raised ValueError")
        with pytest.raises(EnvWorkerError, match=expected) as err:
            pool.replies(timeout=None)
        assert "\n" not in str(err.value) and "Traceback" in err.value.worker_traceback
    finally:
        pool.close()


def _deal(pool: EnvPool, slots: int) -> None:
    for slot in range(slots):
        pool.submit(slot, Reset(slot, opponent="conservative", seat=0))
    got = []
    while len(got) < slots:
        got += pool.replies(timeout=None)


def _error_of_waiting(pool: EnvPool, limit: float) -> BaseException:
    """What ``pool.replies(timeout=None)``, called until it raises, raises (a thread: a wait that never
    ends fails the test after ``limit`` seconds instead of hanging it)."""
    raised: list[BaseException] = []

    def wait_forever():
        try:
            while True:
                pool.replies(timeout=None)
        except BaseException as err:  # noqa: BLE001  (the test inspects it)
            raised.append(err)

    thread = threading.Thread(target=wait_forever, daemon=True)
    thread.start()
    thread.join(limit)
    assert raised, f"replies(timeout=None) still waiting after {limit} s"
    return raised[0]


def _gone(pid: int, seconds: float = 10) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


@pytest.mark.parametrize("fault", ["stopped process", "environment loops"])
def test_a_worker_that_stops_answering_is_one_error_after_the_reply_timeout(fault):
    """A worker stopped by SIGSTOP, or an environment whose step never returns: the pool waits at most
    ``reply_timeout`` for it (``replies(timeout=None)`` included), then raises one line naming the
    environment, the meta-episode and the operation, and no worker is left behind."""
    options = {"hang_on": "<action>PASS</action>"} if fault == "environment loops" else {}
    pool = EnvPool("slow_kuhn_poker", options, workers=2, reply_timeout=120)
    try:
        _deal(pool, 2)  # the workers start (seconds on a loaded machine) and answer
        pool.reply_timeout = 3.0
        stuck, pids = pool.pids[1], pool.pids
        if fault == "stopped process":
            os.kill(stuck, signal.SIGSTOP)
        pool.submit(0, Step("<action>BET</action>"), "meta-episode 4 (task seed 0)")
        pool.submit(1, Step("<action>PASS</action>"), "meta-episode 5 (task seed 1)")
        started = time.monotonic()
        error = _error_of_waiting(pool, limit=20)
        waited = time.monotonic() - started
    finally:
        pool.close()
    assert isinstance(error, EnvWorkerError), error
    message = str(error)
    assert message.startswith(f"environment 'slow_kuhn_poker': worker process 1 (pid {stuck}) sent nothing "
                              "for "), message
    assert "while running step('<action>PASS</action>') of meta-episode 5 (task seed 1)" in message
    assert "env.reply_timeout=3 s" in message and "\n" not in message
    assert 3 <= waited < 20, waited
    assert all(_gone(pid) for pid in pids)


def test_slow_operations_that_keep_answering_never_hit_the_reply_timeout():
    """The deadline bounds one operation, not a worker's queue: four 1.5 s steps queued on one worker
    (6 s in all) under a 4 s timeout are answered one by one, and all arrive."""
    pool = EnvPool("slow_kuhn_poker", {"step_seconds": 1.5}, workers=1, reply_timeout=120)
    try:
        _deal(pool, 4)  # the worker starts (seconds on a loaded machine) and answers
        pool.reply_timeout = 4.0
        for slot in range(4):
            pool.submit(slot, Step("<action>PASS</action>"))
        got = []
        while len(got) < 4:
            got += pool.replies(timeout=None)
    finally:
        pool.close()
    assert sorted(slot for slot, _ in got) == list(range(4))


def test_the_reply_timeout_defaults_by_environment_and_is_a_config_key():
    assert default_reply_timeout("webshop") == default_reply_timeout("alfworld") == SLOW_REPLY_TIMEOUT_S
    assert default_reply_timeout("kuhn_poker") == REPLY_TIMEOUT_S < SLOW_REPLY_TIMEOUT_S
    assert EnvPool("webshop", {}, workers=1).reply_timeout == SLOW_REPLY_TIMEOUT_S
    cfg = C.apply_overrides(C.ExperimentConfig(), {"env.workers": "1", "env.reply_timeout": "7"})
    runner = make_runner(cfg, num_episodes=1)
    assert runner._envs.reply_timeout == 7.0
    assert runner.with_env_options({"max_turns": 4})._envs.reply_timeout == 7.0
    with pytest.raises(C.ConfigError, match="env.reply_timeout must be > 0"):
        C.validate(C.apply_overrides(cfg, {"env.reply_timeout": "0"}), check_paths=False)
    with pytest.raises(ValueError, match="env.reply_timeout must be > 0"):
        EnvPool("kuhn_poker", {}, workers=1, reply_timeout=-1)


def test_a_stop_request_while_environments_step_is_interrupted_and_the_runner_plays_on():
    """The stop event is honoured while the runner waits for workers; the next rollout is unaffected
    (replies of the stopped one are dropped)."""
    stop = threading.Event()
    runner = MetaEpisodeRunner("kuhn_poker", {}, runner_config(num_episodes=2, constrained_actions=True),
                               workers=2)

    class Stopper(RandomLegalPolicy):
        def stream(self):
            return BatchStream(self.generate)

        def generate(self, requests):
            stop.set()
            return super().generate(requests)

    try:
        with pytest.raises(Interrupted):
            runner.run(kuhn_tasks(), Stopper(0), training=True, stop=stop)
        again = runner.run(kuhn_tasks(), RandomLegalPolicy(1), training=True, stop=threading.Event())
    finally:
        runner.close()
    reference = MetaEpisodeRunner("kuhn_poker", {}, runner_config(num_episodes=2, constrained_actions=True))
    assert rollout_facts(again) == rollout_facts(reference.run(kuhn_tasks(), RandomLegalPolicy(1),
                                                               training=True))


def test_a_worker_killed_by_the_signal_that_stopped_the_run_is_the_stop_not_an_error():
    """A SIGTERM sent to every process of the job (a scheduler's preemption) can end a worker too: after
    a stop request that is the stop (``Interrupted``), not an ``EnvWorkerError``."""
    stop = threading.Event()
    runner = MetaEpisodeRunner("kuhn_poker", {}, runner_config(num_episodes=2, constrained_actions=True),
                               workers=1)
    try:
        with pytest.raises(Interrupted):
            runner.run(kuhn_tasks(), KillingPolicy(runner, signal.SIGTERM, stop), training=True, stop=stop)
    finally:
        runner.close()


def test_workers_run_in_their_own_session_and_close_without_hanging():
    """Ctrl-C at the terminal (SIGINT to the foreground process group) reaches the main process only;
    ``close`` ends every worker at once."""
    pool = EnvPool("sokoban", {}, workers=2)
    pool.submit(0, Reset(0))
    pool.submit(1, Reset(2))
    got = []
    while len(got) < 2:
        got += pool.replies(timeout=None)
    assert sorted(slot for slot, _ in got) == [0, 1]
    pids = pool.pids
    assert all(os.getsid(pid) == pid != os.getsid(0) for pid in pids)
    started = time.perf_counter()
    pool.close()
    assert time.perf_counter() - started < 5
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_workers_import_no_jax_and_exit_when_their_parent_is_killed(tmp_path):
    """A worker imports the environments only (no JAX: cheap to start) and exits when its parent dies,
    even by SIGKILL (no orphans)."""
    script = textwrap.dedent("""
        import os, signal, sys
        from mage_jax.envs.workers import EnvPool, Reset
        pool = EnvPool("kuhn_poker", {}, workers=1)
        pool.submit(0, Reset(0, opponent="conservative", seat=0))
        pool.replies(timeout=None)
        pid = pool.pids[0]
        print(pid, flush=True)
        maps = open(f"/proc/{pid}/maps").read() if os.path.exists(f"/proc/{pid}/maps") else ""
        print("jaxlib" in maps, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == -signal.SIGKILL, out.stderr
    pid_line, jax_line = out.stdout.split()
    assert jax_line == "False"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(int(pid_line), 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail("the worker outlived its killed parent")


def test_the_config_key_defaults_to_workers_for_the_slow_environments_only():
    assert default_workers("webshop") >= 1 and default_workers("alfworld") >= 1
    assert {default_workers(n) for n in ("kuhn_poker", "tic_tac_toe", "sokoban", "minesweeper")} == {0}
    cfg = C.ExperimentConfig()
    assert cfg.env.workers is None and make_runner(cfg, num_episodes=1).workers == 0
    assert make_runner(C.apply_overrides(cfg, {"env.workers": "2"}), num_episodes=1).workers == 2
    with pytest.raises(C.ConfigError, match="env.workers must be >= 0"):
        C.validate(C.apply_overrides(cfg, {"env.workers": "-1"}), check_paths=False)
    runner = MetaEpisodeRunner("kuhn_poker", {}, workers=2)
    assert runner.with_env_options({"max_turns": 4}).workers == 2


def test_bad_worker_counts_and_options_that_cannot_be_sent_are_clear_errors():
    with pytest.raises(ValueError, match="env.workers must be a non-negative integer"):
        EnvPool("kuhn_poker", {}, workers=-1)
    pool = EnvPool("sokoban", {"num_boxes": 1, "unpicklable": lambda: 0}, workers=1)
    with pytest.raises(EnvWorkerError, match="cannot be sent to a worker process.*env.workers=0"):
        pool.submit(0, Step("<action>up</action>"))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_to_the_process_group_stops_the_rollout_and_leaves_no_worker(sig):
    """The trainer's stop signals (``install_stop_signals``) sent to the whole process group mid-rollout, as
    a terminal's Ctrl-C or a scheduler's SIGTERM would: the rollout raises ``Interrupted`` at its next safe
    point, the process exits normally, and its workers are gone."""
    script = textwrap.dedent(f"""
        import os, signal, threading
        from mage_jax.rollout.meta_episode import MetaEpisodeRunner
        from mage_jax.rollout.policy import RandomLegalPolicy
        from mage_jax.rollout.stopping import Interrupted
        from mage_jax.testing import runner_config
        from mage_jax.rollout.tasks import TaskSampler, TaskSamplerConfig
        from mage_jax.training.signals import install_stop_signals

        stop = threading.Event()
        install_stop_signals(stop)
        runner = MetaEpisodeRunner("sokoban", {{}}, runner_config(num_episodes=3, constrained_actions=True),
                                   workers=2)

        class Signalling(RandomLegalPolicy):
            calls = 0
            def generate(self, requests):
                Signalling.calls += 1
                if Signalling.calls == 2:
                    os.killpg(os.getpgid(0), {int(sig)})
                return super().generate(requests)

        tasks = TaskSampler(TaskSamplerConfig(num_tasks=4, group_size=2)).sample_train(0)
        try:
            runner.run(tasks, Signalling(0), training=True, stop=stop)
            print("finished")
        except Interrupted:
            print("interrupted", *runner._envs.pids)
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True)
    assert out.returncode == 0, out.stderr
    word, *pids = out.stdout.split()
    assert word == "interrupted" and len(pids) == 2 and "Traceback" not in out.stderr
    deadline = time.monotonic() + 10
    while any(_alive(int(pid)) for pid in pids):
        assert time.monotonic() < deadline, "a worker outlived its run"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
