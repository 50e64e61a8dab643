"""Environments in worker processes: the runner's environment operations, here or in a pool.

Why: ALFWorld (234 ms a step, 3.6 s a reset) and WebShop (90 ms a search) are plain Python; stepped one
after another in the main process, 128 of them leave the accelerator waiting for seconds each turn.

One path for one thing: every operation the meta-episode runner asks of an environment is an ``EnvOp``
(``Reset``, ``Restart``, ``Step``, ``InvalidStep``), applied to a ``TextEnv`` by ``apply_op`` and answered
by an ``EnvReply`` (the step's result and everything the runner reads afterwards: observation, legal
actions, privileged observation, task facts). ``EnvPool`` with ``workers=0`` applies it at once in this
process; with ``workers=n`` it sends it to the worker process that holds that environment (slot ``i``
lives in worker ``i % n`` for the pool's lifetime) and the reply comes back later, so the runner can
decode while environments step. Each environment's operations run in order in one process, so the
results (observations, rewards, legal actions) are those of in-process stepping for any ``n``.

Workers are ``python -c`` subprocesses, not multiprocessing's fork (unsafe: JAX runs threads) or spawn
(it re-imports the parent's main module, i.e. the experiment and JAX): a worker imports
``mage_jax.envs`` and the environment's own module only (no JAX), so starting one costs an interpreter
start and the environment's imports. Messages are pickled over a socket pair
(``multiprocessing.connection``).

Signals and shutdown (docs/preemption.md): a worker runs in its own session, so Ctrl-C at the terminal
and a SIGTERM to the process group reach only the main process, whose handler turns them into a stop
request; a worker exits when its socket closes (``close()``, garbage collection, interpreter exit, or the
main process's death, even by SIGKILL), so none outlives the run and none delays its exit. A worker that
dies (or an environment that raises inside one) is one ``EnvWorkerError`` naming the environment, the
task and the exit status.

Deadline: a worker that holds unanswered operations and sends nothing for ``reply_timeout`` seconds (an
environment looping forever, a stopped or swapped-out process) is one ``EnvWorkerError`` naming the
environment, the meta-episode and the operation, and its workers are killed: a run never waits on a
worker forever. The clock restarts with every message of the worker (it answers each slow operation as
it finishes), so the deadline bounds one operation, not a turn's queue. The default scales with the
environment (``default_reply_timeout``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
import traceback
import weakref
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

from mage_jax.envs.base import StepResult, TextEnv, env_class, make_env

__all__ = [
    "EnvOp",
    "EnvPool",
    "EnvReply",
    "EnvWorkerError",
    "InvalidStep",
    "Reset",
    "Restart",
    "Step",
    "apply_op",
    "default_reply_timeout",
    "default_workers",
    "serve",
]

_CLOSE_TIMEOUT_S = 5.0
REPLY_TIMEOUT_S = 120.0
"""The reply deadline of the games (``default_reply_timeout``): a step costs microseconds, so this leaves a
loaded machine a factor of millions."""
SLOW_REPLY_TIMEOUT_S = 600.0
"""The reply deadline of the environments whose class says they are slow (ALFWorld: a reset takes seconds;
WebShop: a search can take seconds on a large catalogue)."""
_REPLY_EVERY_S = 0.005
"""A worker answers a batch of operations in one message, or every 5 ms when they are slow."""


class EnvWorkerError(RuntimeError):
    """A worker process died, or an environment raised inside one: a one-line message naming the
    environment, the meta-episode and the operation; ``worker_traceback`` holds the environment's
    traceback (when it raised)."""

    def __init__(self, message: str, worker_traceback: str | None = None):
        super().__init__(message)
        self.worker_traceback = worker_traceback


# -- operations ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Reset:
    """``env.reset(seed, opponent=, seat=, copy=)``: draw the task instance."""

    seed: int
    opponent: str | None = None
    seat: int | None = None
    copy: int = 0
    legal: bool = False


@dataclasses.dataclass(frozen=True)
class Restart:
    """``env.restart()``: the identical initial state for the next episode."""

    legal: bool = False


@dataclasses.dataclass(frozen=True)
class Step:
    """``env.step(response)``: parse one raw model response and apply its action."""

    response: str
    legal: bool = False


@dataclasses.dataclass(frozen=True)
class InvalidStep:
    """``env.invalid_step(reason)``: a turn used up without an action (the prompt did not fit)."""

    reason: str
    legal: bool = False


EnvOp = Reset | Restart | Step | InvalidStep


@dataclasses.dataclass(frozen=True)
class EnvReply:
    """What the runner needs after one operation. ``first_observation``: the return value of reset /
    restart; ``result``: the step's (None for reset / restart); ``legal_actions``: None unless the
    operation asked (``legal``); ``task_info``: after a reset only."""

    observation: str
    first_observation: str | None = None
    result: StepResult | None = None
    legal_actions: tuple[str, ...] | None = None
    privileged_observation: str | None = None
    task_info: dict[str, Any] | None = None


def apply_op(env: TextEnv, op: EnvOp) -> EnvReply:
    """Apply ``op`` to ``env`` (in whichever process holds it) and read what the runner needs next."""
    first, result, info = None, None, None
    if isinstance(op, Reset):
        first = env.reset(op.seed, opponent=op.opponent, seat=op.seat, copy=op.copy)
        info = dict(env.task_info)
    elif isinstance(op, Restart):
        first = env.restart()
    elif isinstance(op, Step):
        result = env.step(op.response)
    elif isinstance(op, InvalidStep):
        result = env.invalid_step(op.reason)
    else:
        raise TypeError(f"unknown environment operation {op!r}")
    return EnvReply(
        observation=env.observation,
        first_observation=first,
        result=result,
        legal_actions=tuple(env.legal_actions()) if op.legal else None,
        privileged_observation=env.privileged_observation(),
        task_info=info,
    )


def _describe(op: EnvOp) -> str:
    if isinstance(op, Reset):
        return f"reset(seed={op.seed}, opponent={op.opponent!r}, seat={op.seat!r}, copy={op.copy})"
    if isinstance(op, Step):
        return f"step({op.response[:60]!r})"
    return type(op).__name__.lower()


def default_reply_timeout(env_name: str) -> float:
    """Seconds a worker may hold operations without answering when ``env.reply_timeout`` is not set:
    ``SLOW_REPLY_TIMEOUT_S`` for the slow environments (``TextEnv.slow_steps``), ``REPLY_TIMEOUT_S`` for
    the games."""
    return SLOW_REPLY_TIMEOUT_S if getattr(env_class(env_name), "slow_steps", False) else REPLY_TIMEOUT_S


def default_workers(env_name: str) -> int:
    """Worker processes an environment gets when ``env.workers`` is not set: ``min(8, CPUs)`` for the
    environments whose class says they are slow (``TextEnv.slow_steps``: ALFWorld, WebShop), 0 (in
    process) for the games, whose steps cost less than sending them to another process."""
    if not getattr(env_class(env_name), "slow_steps", False):
        return 0
    return max(1, min(8, os.cpu_count() or 1))


# -- the pool --------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Pending:
    slot: int
    op: EnvOp
    task: str


class EnvPool:
    """The environments of one runner, slot ``i`` for the ``i``-th meta-episode of a rollout.

    ``submit`` returns the reply at once in process (``workers == 0``) and None with workers (the reply
    comes from ``replies``). Environments are built on their first operation and reused across rollouts.
    ``reply_timeout``: seconds a worker may hold operations without answering (None:
    ``default_reply_timeout``; see the module docstring).
    """

    def __init__(self, env_name: str, env_options: Mapping[str, Any] | None = None, workers: int = 0,
                 reply_timeout: float | None = None):
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 0:
            raise ValueError(f"env.workers must be a non-negative integer, got {workers!r}")
        if reply_timeout is not None and not reply_timeout > 0:
            raise ValueError(f"env.reply_timeout must be > 0 seconds, got {reply_timeout!r}")
        self.env_name = env_name
        self.env_options = dict(env_options or {})
        self.workers = workers
        self.reply_timeout = float(reply_timeout if reply_timeout is not None
                                   else default_reply_timeout(env_name))
        self._envs: dict[int, TextEnv] = {}
        self._procs: list[subprocess.Popen] = []
        self._conns: list[Connection] = []
        self._pending: dict[int, _Pending] = {}
        self._outbox: dict[int, list[tuple[int, int, EnvOp]]] = {}
        self._next_id = 0
        self._heard: dict[int, float] = {}
        """Per worker holding operations: when it last sent a message (or was sent work while idle)."""
        self._finalizer: weakref.finalize | None = None

    @property
    def synchronous(self) -> bool:
        return self.workers == 0

    @property
    def pending(self) -> int:
        """Operations sent to workers whose replies have not been returned by ``replies`` yet."""
        return len(self._pending)

    # -- in process ---------------------------------------------------------------------------------
    def _env(self, slot: int) -> TextEnv:
        if slot not in self._envs:
            self._envs[slot] = make_env(self.env_name, **self.env_options)
        return self._envs[slot]

    # -- operations ---------------------------------------------------------------------------------
    def submit(self, slot: int, op: EnvOp, task: str = "") -> EnvReply | None:
        """Run ``op`` on environment ``slot``; ``task`` names the meta-episode in error messages."""
        if self.synchronous:
            return apply_op(self._env(slot), op)
        self._start()
        op_id = self._next_id
        self._next_id += 1
        self._pending[op_id] = _Pending(slot, op, task)
        self._outbox.setdefault(slot % self.workers, []).append((op_id, slot, op))
        return None

    def _flush(self) -> None:
        """Send each worker the operations submitted since the last flush, in one message."""
        outbox, self._outbox = self._outbox, {}
        now = time.monotonic()
        for worker, ops in outbox.items():
            self._heard.setdefault(worker, now)  # an idle worker's clock starts now; a busy one's runs on
            try:
                self._conns[worker].send(ops)
            except (BrokenPipeError, ConnectionError, EOFError, OSError):
                self._died(worker)

    def replies(self, timeout: float | None = 0.0) -> list[tuple[int, EnvReply]]:
        """(slot, reply) of the operations finished so far, waiting up to ``timeout`` seconds (None: until
        one arrives) when none is ready. Operations submitted since the last call are sent first, one
        message per worker. Raises ``EnvWorkerError`` when a worker died, an environment raised, or a
        worker holding operations sent nothing for ``reply_timeout`` seconds (its workers are then
        killed)."""
        if not self._pending:
            return []
        self._flush()
        while True:
            out = self._receive(wait(self._conns, self._wait_limit(timeout)))
            self._check_deadline()
            if out or timeout == 0.0 or not self._pending:
                return out
            if timeout is not None:  # waited the whole timeout
                return out

    def _wait_limit(self, timeout: float | None) -> float | None:
        """How long a wait may block: ``timeout``, but never past the earliest worker's deadline."""
        if not self._heard:
            return timeout
        left = max(0.0, min(self._heard.values()) + self.reply_timeout - time.monotonic())
        return left if timeout is None else min(timeout, left)

    def _receive(self, ready: list[Any]) -> list[tuple[int, EnvReply]]:
        """Read every message that is ready (and those that arrive meanwhile) into (slot, reply) pairs."""
        out: list[tuple[int, EnvReply]] = []
        while ready:
            for conn in ready:
                worker = self._conns.index(conn)
                try:
                    messages = conn.recv()
                except (EOFError, OSError):
                    self._died(worker)
                self._heard[worker] = time.monotonic()
                for op_id, reply in messages:
                    pending = self._pending.pop(op_id, None)
                    if pending is None:  # an operation of an abandoned rollout
                        continue
                    if isinstance(reply, _Failure):
                        raise EnvWorkerError(
                            f"environment {self.env_name!r}, {pending.task or f'slot {pending.slot}'}: "
                            f"{_describe(pending.op)} raised {reply.kind}: {reply.message} (in worker "
                            f"process {worker})", reply.traceback)
                    out.append((pending.slot, reply))
            ready = wait(self._conns, 0) if self._pending else []
        busy = {p.slot % self.workers for p in self._pending.values()}
        self._heard = {w: t for w, t in self._heard.items() if w in busy}
        return out

    def _check_deadline(self) -> None:
        """Kill the workers and raise when one holding operations has been silent past ``reply_timeout``."""
        now = time.monotonic()
        for worker, heard in sorted(self._heard.items()):
            if now - heard < self.reply_timeout:
                continue
            proc = self._procs[worker]
            ops = [i for i, p in self._pending.items() if p.slot % self.workers == worker]
            waiting = self._pending[min(ops)]  # a worker answers in order: its earliest is running
            proc.kill()  # stopped or looping: it would not answer a polite close either
            self.close()
            raise EnvWorkerError(
                f"environment {self.env_name!r}: worker process {worker} (pid {proc.pid}) sent nothing for "
                f"{now - heard:.0f} s while running {_describe(waiting.op)} of "
                f"{waiting.task or f'slot {waiting.slot}'} (env.reply_timeout={self.reply_timeout:g} s); "
                "the environment hangs, or its operations take longer: raise env.reply_timeout")

    def abandon(self) -> None:
        """Forget the operations in flight (a rollout that stopped): their replies are dropped on arrival."""
        self._pending.clear()
        self._outbox.clear()
        self._heard.clear()

    def _died(self, worker: int) -> None:
        proc = self._procs[worker]
        try:
            code = proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            code = None
        lost = [p for p in self._pending.values() if p.slot % self.workers == worker]
        doing = (f" while running {_describe(lost[0].op)} of {lost[0].task or f'slot {lost[0].slot}'}"
                 if lost else "")
        self.close()
        raise EnvWorkerError(
            f"environment {self.env_name!r}: worker process {worker} (pid {proc.pid}) {_exit_text(code)}"
            f"{doing}; "
            "its environments are lost (set env.workers=0 to step them in the main process)")

    # -- processes ----------------------------------------------------------------------------------
    def _start(self) -> None:
        if self._procs:
            return
        modules = sorted({env_class(self.env_name).__module__})
        try:
            setup = pickle.dumps((self.env_name, self.env_options, modules))
        except Exception as err:  # a lambda or an open file among the options
            raise EnvWorkerError(
                f"environment {self.env_name!r}: its options cannot be sent to a worker process "
                f"({type(err).__name__}: {err}); set env.workers=0") from None
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(_import_path())
        for _ in range(self.workers):
            parent, child = socket.socketpair()
            try:
                proc = subprocess.Popen(
                    [sys.executable, "-c", "from mage_jax.envs.workers import serve; serve()",
                     str(child.fileno())],
                    pass_fds=(child.fileno(),), env=env, start_new_session=True, stdin=subprocess.DEVNULL,
                )
            finally:
                child.close()
            conn = Connection(parent.detach())
            self._procs.append(proc)
            self._conns.append(conn)
            conn.send_bytes(setup)
        self._finalizer = weakref.finalize(self, _shutdown, list(self._procs), list(self._conns))

    def close(self) -> None:
        """Stop the workers (a no-op in process and when already closed); the pool starts them again on
        its next operation."""
        if self._finalizer is not None:
            self._finalizer()
        self._finalizer = None
        self._procs, self._conns, self._pending, self._outbox, self._heard = [], [], {}, {}, {}

    @property
    def pids(self) -> list[int]:
        """Process ids of the running workers (tests and diagnostics)."""
        return [p.pid for p in self._procs]


def _exit_text(code: int | None) -> str:
    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _import_path() -> list[str]:
    """The worker's PYTHONPATH: the folder of this ``mage_jax`` first (a worktree, not an installed copy),
    then this process's path, so environments registered by other modules import there too."""
    import mage_jax

    root = os.path.dirname(os.path.dirname(os.path.abspath(mage_jax.__file__)))
    paths = [root, *(os.path.abspath(p or os.curdir) for p in sys.path)]
    extra = os.environ.get("PYTHONPATH", "")
    paths += [p for p in extra.split(os.pathsep) if p]
    return [p for p in dict.fromkeys(paths) if os.path.isdir(p)]


def _shutdown(procs: Sequence[subprocess.Popen], conns: Sequence[Connection]) -> None:
    """Ask every worker to exit, then kill whichever has not within a few seconds."""
    for conn in conns:
        with contextlib.suppress(OSError, EOFError):
            conn.send(None)
        conn.close()
    deadline = time.monotonic() + _CLOSE_TIMEOUT_S
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -- the worker process ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Failure:
    """An exception raised by an environment inside a worker, as text (it may not pickle)."""

    kind: str
    message: str
    traceback: str


def serve(fd: int | None = None) -> None:
    """A worker's main loop (``python -c "...serve()" FD``): build environments on first use, apply the
    operations in the order they arrive, answer each; exit when the socket closes or on ``None``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process decides when to stop
    conn = Connection(int(sys.argv[1]) if fd is None else fd)
    try:
        name, options, modules = pickle.loads(conn.recv_bytes())
        for module in modules:
            importlib.import_module(module)
        envs: dict[int, TextEnv] = {}
        while True:
            batch = conn.recv()
            if batch is None:
                return
            done: list[tuple[int, EnvReply | _Failure]] = []
            sent = time.perf_counter()
            for op_id, slot, op in batch:
                try:
                    if slot not in envs:
                        envs[slot] = make_env(name, **options)
                    reply: EnvReply | _Failure = apply_op(envs[slot], op)
                except Exception as err:
                    reply = _Failure(type(err).__name__, str(err), traceback.format_exc())
                done.append((op_id, reply))
                if time.perf_counter() - sent > _REPLY_EVERY_S:  # slow operations: answer as they finish
                    conn.send(done)
                    done, sent = [], time.perf_counter()
            if done:
                conn.send(done)
    except (EOFError, BrokenPipeError, ConnectionError):
        return  # the main process closed the socket or died
