"""The meta-episode runner (docs/method.md §2): lockstep or continuous-batching schedules.

``MetaEpisodeRunner.run`` plays one meta-episode per task. Each meta-episode is a coroutine
(``_meta_episode``) that yields the LLM calls it needs, one at a time, and receives their responses:
for episode n = 0..N-1 it plays turns until its environment is done, then (if it did not win and an
episode is left) writes one reflection. A won meta-episode stops: it neither reflects nor plays again.
Every LLM call becomes a ``Row``. Its prompts depend on its own history only, so how the calls of
different meta-episodes are scheduled changes nothing they see:

One driver (``_drive``) feeds the policy's stream (``policy.stream()``) under the stream's scheduling
rule:

* lockstep (``stream.lockstep``; a ``BatchStream``): the meta-episodes waiting on the earliest
  (episode, phase, turn) are admitted together and answered by *one* batched call, and the next turn is
  admitted once all are back: every turn renders the play prompts of all environments still playing,
  and after the play phase one batched call serves all reflections (the schedule of docs/method.md §2);
* continuous batching (``LLMPolicy`` with a ``generate.engine.RolloutEngine``): a meta-episode's next
  prompt is submitted as soon as its previous response is back and its environment stepped, so no
  meta-episode waits for the slowest response of a turn. Sampling keys derive from (meta-episode,
  episode, phase/turn), not from the schedule.

Environments: every reset, restart and step is an operation (``mage_jax.envs.workers``) the
meta-episode yields like an LLM call. In process (``workers=0``) it is answered at once; with worker
processes it is answered when its reply arrives, and the runner meanwhile keeps collecting the stream, so
environments step while other meta-episodes decode (lockstep still admits a turn whole).

Rows come back in completion order and are put back in the lockstep order (episode, play turns then
reflection, turn, task), so the training batch, the outcomes and the statistics do not depend on the
rule (greedy decoding: the same tokens; ``tests/generate/test_engine.py``). With a ``stop`` event the
rollout raises ``Interrupted`` before its next submission or collect once the event is set (a safe
point: nothing more is asked of the model).

Memory: after episode n the runner keeps an ``EpisodeRecord`` (moves, reward, won, reflection) and
the play prompts of later episodes show the records per ``memory_mode`` (rendered by
``mage_jax.envs.prompts``, the only place that renders memory). With ``reflect=False`` no reflection
rows are generated at all and records carry no reflection; this is only meaningful with
``memory_mode="history_only"`` (models trained from scratch that cannot yet write reflections) or
``"none"`` (no memory at all), and any other combination is a config error (as is ``"none"`` with
reflections, which no prompt would show). With ``reflection_words`` a reflect response is constrained
to ``<remark>`` + 1..``reflection_max_words`` of those words + ``</remark>`` (a ``WordSequence``), the
way ``constrained_actions`` constrains play rows: a model trained from scratch can write it.

Prompt overflow: when ``max_prompt_tokens`` is set and a rendered prompt is longer, the runner drops
the oldest memory entries first, then shortens the window W of shown moves; each fix is counted in
the stats. A prompt that still does not fit is not sent to the model: the row is recorded as an
invalid turn (empty response, ``overflow=True``; a play turn is used up, a reflection is empty).

Payoff: an episode's payoff is its reward in the game's own unit, R_n / ``env.reward_scale`` (Kuhn
Poker: chips, reward / 5; every other environment: scale 1, payoff = reward).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any

import numpy as np

from mage_jax.algorithms.advantages import ANCHOR_MODES
from mage_jax.envs.anchors import local_anchor, play_anchor, reflection_anchor
from mage_jax.envs.base import StepResult, TextEnv, make_env
from mage_jax.envs.parsing import extract_reflection
from mage_jax.envs.prompts import (
    EpisodeRecord,
    Move,
    render_play_prompt,
    render_reflect_prompt,
)
from mage_jax.envs.workers import EnvOp, EnvPool, EnvReply, EnvWorkerError, InvalidStep, Reset, Restart, Step
from mage_jax.generate.constraints import WordSequence
from mage_jax.rollout.config import RolloutConfig, check_rollout
from mage_jax.rollout.policy import Generation, GenerationRequest, Policy, PolicyStream
from mage_jax.rollout.rows import Row
from mage_jax.rollout.stopping import Interrupted
from mage_jax.rollout.tasks import Task

_EMPTY_IDS = np.zeros(0, dtype=np.int32)
_PHASE_STRIDE = 1 << 16  # key path of a request: (meta-episode, episode, phase * stride + turn)
_EMPTY_LOGPROBS = np.zeros(0, dtype=np.float32)


@dataclasses.dataclass(frozen=True)
class RunnerConfig:
    """How meta-episodes are played (docs/method.md §2 and §3): the run's ``rollout`` section and what it
    does not say.

    From ``rollout``: ``num_episodes`` is the runner's N (an evaluation runner gets the section with
    ``train.eval_num_episodes``); play rows are decoded under ``<action>X</action>`` for X in
    ``env.legal_actions()`` when ``constrained_actions``; training reflect prompts show
    ``env.privileged_observation()`` when ``privileged_reflection`` (Kuhn's both-cards quirk; never at
    evaluation); ``max_response_tokens`` / ``reflection_tokens`` are the per-row generation limits passed
    to the policy; with ``reflection_words`` reflect rows are constrained to ``<remark>`` + 1 to
    ``reflection_max_words`` of them + ``</remark>``; prompts over ``max_prompt_tokens`` are shortened
    (``max_turns`` None: the environment's own). Play prompts list the legal actions when the
    environment's ``show_admissible`` says so.
    ``anchor``: how rows are anchored for the step-level advantage (``algorithm.anchor``);
    ``keep_text``: rows keep their prompt and response text (debugging; costs memory).
    """

    rollout: RolloutConfig = RolloutConfig()
    anchor: str = "global"
    keep_text: bool = False

    def __post_init__(self) -> None:
        check_rollout(self.rollout)
        if self.anchor not in ANCHOR_MODES:
            raise ValueError(f"anchor must be one of {ANCHOR_MODES}, got {self.anchor!r}")

    @property
    def num_episodes(self) -> int:
        """N, the episodes of each meta-episode (``rollout.num_episodes``)."""
        return self.rollout.num_episodes

    def with_episodes(self, num_episodes: int, *, privileged_reflection: bool | None = None) -> RunnerConfig:
        """This configuration with ``num_episodes`` episodes (and ``privileged_reflection`` when given)."""
        r = self.rollout
        privileged = r.privileged_reflection if privileged_reflection is None else privileged_reflection
        return dataclasses.replace(self, rollout=dataclasses.replace(
            r, num_episodes=num_episodes, privileged_reflection=privileged))


@dataclasses.dataclass
class MetaEpisodeOutcome:
    """What happened in one meta-episode, per episode that ran (lists of length ``episodes_run``).

    ``rewards``: R_n, the summed environment reward of episode n. ``payoff``: R_n / reward scale.
    ``score``: the environment's ``StepInfo.score`` at the episode's last step. ``won`` / ``draw``:
    the last step's outcome flags. ``turns``: play turns used.
    """

    meta_episode: int
    group: int
    seed: int
    opponent: str | None
    seat: int | None
    rewards: list[float] = dataclasses.field(default_factory=list)
    won: list[bool] = dataclasses.field(default_factory=list)
    draw: list[bool] = dataclasses.field(default_factory=list)
    score: list[float] = dataclasses.field(default_factory=list)
    payoff: list[float] = dataclasses.field(default_factory=list)
    turns: list[int] = dataclasses.field(default_factory=list)
    reflections: list[str] = dataclasses.field(default_factory=list)
    valid_actions: int = 0
    invalid_actions: int = 0
    rows: int = 0
    task_info: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def episodes_run(self) -> int:
        return len(self.rewards)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["episodes_run"] = self.episodes_run
        return out


@dataclasses.dataclass
class RolloutResult:
    """All rows of a rollout (in generation order), the per-meta-episode outcomes, and counters."""

    rows: list[Row]
    outcomes: list[MetaEpisodeOutcome]
    stats: dict[str, float]


@dataclasses.dataclass
class _MetaState:
    """Mutable bookkeeping of one meta-episode while it runs."""

    task: Task
    outcome: MetaEpisodeOutcome
    reward_scale: float
    env: EnvReply | None = None
    """The environment as the last operation left it (observation, legal actions, ...)."""
    initial_observation: str = ""
    memory: list[EpisodeRecord] = dataclasses.field(default_factory=list)
    moves: list[Move] = dataclasses.field(default_factory=list)
    episode_reward: float = 0.0
    last_result: StepResult | None = None
    done: bool = False
    finished: bool = False
    step: int = 0
    index: int = 0  # position in the rollout's task list (the lockstep row order)


@dataclasses.dataclass(frozen=True)
class _Call:
    """One LLM call a meta-episode waits on. ``key`` (episode, phase 0 play / 1 reflect, turn) orders the
    lockstep schedule; ``prompt`` is None when it could not be made to fit (no generation)."""

    key: tuple[int, int, int]
    prompt: str | None
    allowed: tuple[str, ...] | WordSequence | None
    max_new_tokens: int | None


_Play = Generator["_Call | EnvOp", "Generation | EnvReply | None", Any]


def _advance(play: _Play, value: Generation | EnvReply | None) -> _Call | EnvOp | None:
    """Resume a meta-episode with the answer to its last call (a response, or the reply of an environment
    operation); its next call, or None when it ended."""
    try:
        return play.send(value)
    except StopIteration:
        return None


@dataclasses.dataclass(frozen=True)
class RolloutProgress:
    """Running totals of one ``MetaEpisodeRunner.run``, reported after every round of generations:
    rows generated, their response tokens, meta-episodes finished."""

    rows: int = 0
    tokens: int = 0
    finished: int = 0


class MetaEpisodeRunner:
    """Plays meta-episodes of one environment type; environments are reused across runs.

    ``workers``: environment worker processes (``mage_jax.envs.workers``; 0: step them in this process);
    ``reply_timeout``: seconds a worker may hold operations without answering (None: the environment's
    default, ``envs.workers.default_reply_timeout``).
    With workers, environments step while the policy decodes, and the results are those of in-process
    stepping. ``close()`` stops the workers (they also stop with the runner or the process).
    """

    def __init__(
        self, env_name: str, env_options: Mapping[str, Any] | None = None, config: RunnerConfig | None = None,
        *, workers: int = 0, reply_timeout: float | None = None,
    ):
        self.env_name = env_name
        self.env_options = dict(env_options or {})
        self.config = config or RunnerConfig()
        self._progress: Callable[[RolloutProgress], None] | None = None
        self._totals = RolloutProgress()
        # Built here to fail early and clearly on a bad name or options; its static facts (prompt spec,
        # turn limit, reward scale) are those of every environment of the runner.
        self._template: TextEnv = make_env(env_name, **self.env_options)
        self._envs = EnvPool(env_name, self.env_options, workers, reply_timeout)

    @property
    def workers(self) -> int:
        return self._envs.workers

    def with_env_options(self, extra: Mapping[str, Any]) -> MetaEpisodeRunner:
        """A runner of the same configuration on an environment with ``extra`` merged into its options
        (an evaluation split such as ``{"split": "valid_unseen"}`` or ``{"num_boxes": 1}``)."""
        return MetaEpisodeRunner(self.env_name, {**self.env_options, **extra}, self.config,
                                 workers=self.workers, reply_timeout=self._envs.reply_timeout)

    def close(self) -> None:
        """Stop the environment workers (none in process); a later ``run`` starts them again."""
        self._envs.close()

    # -- public --------------------------------------------------------------------------------
    def run(self, tasks: Sequence[Task], policy: Policy, *, training: bool,
            progress: Callable[[RolloutProgress], None] | None = None,
            stop: threading.Event | None = None) -> RolloutResult:
        """Play one meta-episode per task; returns every row and every outcome. ``progress`` hears the
        running totals (``RolloutProgress``) after every round of generations (progress inside long work).
        Once ``stop`` is set the rollout raises ``stopping.Interrupted`` before it submits or collects
        again."""
        self._progress = progress
        self._totals = RolloutProgress()
        start = time.perf_counter()
        self._rows: list[Row] = []
        self._row_keys: list[tuple[int, int, int, int]] = []
        self._call_keys: set[tuple[int, int, int]] = set()
        self._stats = {
            "generate_calls": 0,
            "overflow_prompts": 0,
            "overflow_memory_dropped": 0,
            "overflow_window_truncated": 0,
            "overflow_invalid": 0,
            "missing_remark": 0,
            "truncated_responses": 0,
        }
        self._training = training
        scale = float(getattr(self._template, "reward_scale", 1.0))
        states = [
            _MetaState(
                task=task,
                outcome=MetaEpisodeOutcome(
                    meta_episode=task.meta_episode, group=task.group, seed=task.seed, opponent=task.opponent,
                    seat=task.seat,
                ),
                reward_scale=scale,
                index=index,
            )
            for index, task in enumerate(tasks)
        ]
        self._states = states
        plays = [self._meta_episode(s, policy) for s in states]
        try:
            self._drive(plays, policy.stream(), stop)
        except BaseException:
            self._envs.abandon()  # a stopped rollout: replies still on their way are dropped
            raise
        # Completion order depends on the schedule; the training batch keeps the lockstep order.
        order = sorted(range(len(self._rows)), key=self._row_keys.__getitem__)
        self._rows = [self._rows[i] for i in order]
        self._stats["generate_calls"] = len(self._call_keys)
        return RolloutResult(
            rows=self._rows, outcomes=[s.outcome for s in states], stats=self._final_stats(states, start)
        )

    # -- scheduling ----------------------------------------------------------------------------
    def _drive(self, plays: list[_Play], stream: PolicyStream, stop: threading.Event | None) -> None:
        """Answer every meta-episode's calls through ``stream`` under its rule (see the module docstring).
        A call whose prompt did not fit is answered at once with None (an invalid turn, no generation)."""
        waiting: dict[int, _Call] = {}  # in the order the calls were made
        in_flight = 0
        meta_episodes = [s.task.meta_episode % 2**31 for s in self._states]
        envs = self._envs

        def advance(i: int, value: Generation | EnvReply | None) -> None:
            """Run meta-episode ``i`` up to its next LLM call, or up to an environment operation sent
            to a worker (it resumes when the reply comes)."""
            while True:
                call = _advance(plays[i], value)
                if isinstance(call, (Reset, Restart, Step, InvalidStep)):
                    value = envs.submit(i, call, self._task_name(i))
                    if value is None:
                        return
                elif call is not None and call.prompt is None:
                    value = None
                else:
                    break
            if call is None:
                self._count(finished=1)
            else:
                waiting[i] = call

        def stepped(timeout: float) -> bool:
            """Resume the meta-episodes whose environment replies arrived (waiting up to ``timeout`` for
            the first); whether any did. A worker that died after a stop request is the stop (the same
            signal may have reached it), not an error."""
            try:
                replies = envs.replies(timeout)
            except EnvWorkerError:
                if stop is not None and stop.is_set():
                    raise Interrupted from None
                raise
            for i, reply in replies:
                advance(i, reply)
            return bool(replies)

        def wait_for_envs() -> None:
            """Block until some environment reply arrived, checking for a stop request meanwhile."""
            while True:
                if stop is not None and stop.is_set():
                    raise Interrupted
                if stepped(0.05):
                    return

        for i in range(len(plays)):
            advance(i, None)
        while True:
            stepped(0.0)
            if not (waiting or in_flight or envs.pending):
                break
            if stop is not None and stop.is_set():  # before submitting: a stopped rollout asks for nothing
                raise Interrupted
            if stream.lockstep and envs.pending and not in_flight:
                # a turn is admitted whole: wait for the environments still stepping
                wait_for_envs()
                continue
            if not stream.lockstep:
                admit = list(waiting)
            elif in_flight:
                admit = []
            else:  # the earliest turn, in task order
                first = min(c.key for c in waiting.values())
                admit = sorted(i for i, c in waiting.items() if c.key == first)
            for i in admit:
                call = waiting.pop(i)
                self._call_keys.add(call.key)
                episode, phase, turn = call.key
                request = GenerationRequest(prompt=call.prompt, allowed_completions=call.allowed,
                                            max_new_tokens=call.max_new_tokens)
                stream.submit(i, request, (meta_episodes[i], episode, phase * _PHASE_STRIDE + turn),
                              priority=call.key)
                in_flight += 1
            if stop is not None and stop.is_set():
                raise Interrupted
            if envs.pending and not stream.busy:  # nothing to decode: only environments are working
                wait_for_envs()
                continue
            done = stream.collect()
            in_flight -= len(done)
            self._count(generations=[gen for _, gen in done])
            for i, gen in done:
                if gen.skipped:
                    self._stats["overflow_invalid"] += 1
                    gen = None
                advance(i, gen)
            if done:
                self._report()

    def _task_name(self, i: int) -> str:
        t = self._states[i].task
        who = f", opponent {t.opponent}, seat {t.seat}" if t.opponent is not None else ""
        return f"meta-episode {t.meta_episode} (task seed {t.seed}{who})"

    def _count(self, *, generations: Sequence[Generation | None] = (), finished: int = 0) -> None:
        t = self._totals
        tokens = sum(len(g.response_ids) for g in generations if g is not None)
        self._totals = RolloutProgress(t.rows + len(generations), t.tokens + tokens, t.finished + finished)

    def _report(self) -> None:
        if self._progress is not None:
            self._progress(self._totals)

    # -- one meta-episode ----------------------------------------------------------------------
    def _meta_episode(self, s: _MetaState, policy: Policy) -> _Play:
        """Meta-episode ``s`` as a coroutine: it yields each LLM call it needs and receives the response
        (None: the prompt did not fit), and each environment operation (``envs.workers``) and receives its
        reply. Its prompts depend on its own history only, so any schedule that answers its calls in order
        plays it identically."""
        r, t = self.config.rollout, s.task
        legal = self._wants_legal()
        s.env = yield Reset(t.seed, opponent=t.opponent, seat=t.seat, copy=t.copy, legal=legal)
        s.initial_observation = s.env.first_observation
        info = s.env.task_info or {}
        s.outcome.task_info = {"seed": t.seed, "opponent": t.opponent, "seat": t.seat, **info}
        for episode in range(r.num_episodes):
            if s.finished:
                return
            if episode > 0:
                s.env = yield Restart(legal=legal)
                s.initial_observation = s.env.first_observation
            s.moves, s.episode_reward, s.last_result, s.done = [], 0.0, None, False
            yield from self._play_episode(s, episode, policy)
            record = self._end_episode(s)
            if r.reflect and not s.outcome.won[-1] and episode < r.num_episodes - 1:
                reflection = yield from self._reflect(s, record, episode, policy)
                record = dataclasses.replace(record, reflection=reflection)
                s.outcome.reflections.append(reflection)
            s.memory.append(record)
            if s.outcome.won[-1]:
                s.finished = True

    def _max_turns(self) -> int:
        return self.config.rollout.max_turns or int(self._template.max_turns)

    def _shows_admissible(self) -> bool:
        return self._template.show_admissible

    def _wants_legal(self) -> bool:
        """Whether play turns read the legal actions (constrained decoding or prompts that list them)."""
        return self.config.rollout.constrained_actions or self._shows_admissible()

    def _play_episode(self, s: _MetaState, episode: int, policy: Policy) -> _Play:
        r = self.config.rollout
        show = self._shows_admissible()
        for turn in range(self._max_turns()):
            if s.done:
                return
            legal = list(s.env.legal_actions or ()) if self._wants_legal() else None

            def render(memory: list[EpisodeRecord], spec, admissible=(legal if show else None)) -> str:
                return render_play_prompt(
                    spec,
                    s.initial_observation,
                    memory,
                    episode,
                    s.moves,
                    memory_mode=r.memory_mode,
                    admissible=admissible,
                    style=r.prompt_style,
                )

            prompt = self._fit_prompts([render], [s.memory], [self._template], policy)[0]
            allowed = (
                tuple(f"<action>{a}</action>" for a in legal) if r.constrained_actions and legal else None
            )
            anchor = play_anchor(s.env.observation, s.task.opponent)
            gen = yield _Call((episode, 0, turn), prompt, allowed, r.max_response_tokens)
            if gen is None:  # the prompt could not be made to fit
                s.env = yield InvalidStep("prompt longer than max_prompt_tokens", legal=self._wants_legal())
            else:
                s.env = yield Step(gen.text, legal=self._wants_legal())
            result = s.env.result
            s.moves.append(
                Move(result.action, result.observation, float(result.reward), bool(result.info.valid))
            )
            s.episode_reward += float(result.reward)
            s.last_result = result
            s.done = bool(result.done)
            if result.info.valid:
                s.outcome.valid_actions += 1
            else:
                s.outcome.invalid_actions += 1
            self._record(s, episode, turn, "play", prompt, gen, anchor, float(result.reward),
                         bool(result.info.valid))

    def _end_episode(self, s: _MetaState) -> EpisodeRecord:
        result = s.last_result
        info = result.info if result is not None else None
        won = bool(info is not None and info.won)
        out = s.outcome
        out.rewards.append(s.episode_reward)
        out.won.append(won)
        out.draw.append(bool(info is not None and info.draw))
        out.score.append(float(info.score) if info is not None else 0.0)
        out.payoff.append(s.episode_reward / s.reward_scale)
        out.turns.append(len(s.moves))
        return EpisodeRecord(
            moves=tuple(s.moves), reward=s.episode_reward, won=won, reflection=None,
            episode=len(out.rewards) - 1,
        )

    def _reflect(self, s: _MetaState, record: EpisodeRecord, episode: int, policy: Policy):
        """The reflection after ``episode`` (a coroutine step like ``_play_episode``); returns its text."""
        r = self.config.rollout
        privileged = (
            s.env.privileged_observation if (r.privileged_reflection and self._training) else None
        )

        def render(memory: list[EpisodeRecord], spec) -> str:
            return render_reflect_prompt(spec, s.initial_observation, record, episode, style=r.prompt_style,
                                         privileged=privileged)

        prompt = self._fit_prompts([render], [[]], [self._template], policy)[0]
        words = (WordSequence(tuple(r.reflection_words), r.reflection_max_words) if r.reflection_words
                 else None)
        gen = yield _Call((episode, 1, 0), prompt, words, r.reflection_tokens)
        text, valid = extract_reflection(gen.text) if gen is not None else ("", False)
        if not valid:
            self._stats["missing_remark"] += 1
        self._record(s, episode, 0, "reflect", prompt, gen, reflection_anchor(s.task.opponent), 0.0, valid)
        return text

    # -- prompts and generation ----------------------------------------------------------------
    def _fit_prompts(
        self,
        renderers: list[Callable[[list[EpisodeRecord], Any], str]],
        memories: list[list[EpisodeRecord]],
        envs: list[TextEnv],
        policy: Policy,
    ) -> list[str | None]:
        """Render every prompt; shorten the over-long ones (oldest memory first, then the window).

        Returns None for a prompt that cannot be made to fit ``max_prompt_tokens``.
        """
        limit = self.config.rollout.max_prompt_tokens
        prompts: list[str | None] = [r(list(m), e.prompt_spec) for r, m, e in zip(renderers, memories, envs)]
        if limit is None:
            return prompts
        lengths = policy.prompt_lengths(prompts)  # type: ignore[arg-type]
        for i, length in enumerate(lengths):
            if length <= limit:
                continue
            self._stats["overflow_prompts"] += 1
            render, memory, spec = renderers[i], list(memories[i]), envs[i].prompt_spec
            fitted = None
            dropped = 0
            while memory and fitted is None:
                memory = memory[1:]
                dropped += 1
                candidate = render(memory, spec)
                if policy.prompt_lengths([candidate])[0] <= limit:
                    fitted = candidate
            if dropped:
                self._stats["overflow_memory_dropped"] += 1
            window = int(spec.history_window)
            truncated = False
            while fitted is None and window > 0:
                window -= 1
                truncated = True
                candidate = render(memory, dataclasses.replace(spec, history_window=window))
                if policy.prompt_lengths([candidate])[0] <= limit:
                    fitted = candidate
            if truncated:
                self._stats["overflow_window_truncated"] += 1
            if fitted is None:
                self._stats["overflow_invalid"] += 1
            prompts[i] = fitted
        return prompts

    # -- rows ----------------------------------------------------------------------------------
    def _record(
        self,
        s: _MetaState,
        episode: int,
        turn: int,
        phase: str,
        prompt: str | None,
        gen: Generation | None,
        anchor: str,
        reward: float,
        valid: bool,
    ) -> None:
        if self.config.anchor == "local":
            anchor = local_anchor(anchor, episode)
        keep = self.config.keep_text
        if gen is not None and gen.truncated:
            self._stats["truncated_responses"] += 1
        self._rows.append(
            Row(
                prompt_ids=np.asarray(gen.prompt_ids, dtype=np.int32) if gen is not None else _EMPTY_IDS,
                response_ids=np.asarray(gen.response_ids, dtype=np.int32) if gen is not None else _EMPTY_IDS,
                logprobs=np.asarray(gen.logprobs, dtype=np.float32) if gen is not None else _EMPTY_LOGPROBS,
                group=s.task.group,
                meta_episode=s.task.meta_episode,
                episode=episode,
                turn=turn,
                step=s.step,
                phase=phase,
                anchor=anchor,
                opponent=s.task.opponent,
                env_reward=reward,
                valid=valid and gen is not None,
                truncated=bool(gen.truncated) if gen is not None else False,
                overflow=gen is None,
                seat=s.task.seat,
                constraint=gen.constraint if gen is not None else None,
                prompt_text=prompt if keep else None,
                response_text=(gen.text if gen is not None else "") if keep else None,
            )
        )
        self._row_keys.append((episode, 0 if phase == "play" else 1, turn, s.index))
        s.step += 1
        s.outcome.rows += 1

    def _final_stats(self, states: list[_MetaState], start: float) -> dict[str, float]:
        rows = self._rows
        lengths = np.asarray([r.response_length for r in rows], dtype=np.float64)
        play = [r for r in rows if r.phase == "play"]
        stats: dict[str, float] = {
            "meta_episodes": float(len(states)),
            "rows": float(len(rows)),
            "play_rows": float(len(play)),
            "reflect_rows": float(len(rows) - len(play)),
            "invalid_ratio": float(np.mean([not r.valid for r in rows])) if rows else 0.0,
            "invalid_action_ratio": float(np.mean([not r.valid for r in play])) if play else 0.0,
            "response_length_mean": float(lengths.mean()) if rows else 0.0,
            "response_length_max": float(lengths.max()) if rows else 0.0,
            "response_length_min": float(lengths.min()) if rows else 0.0,
            "episodes_run_mean": float(np.mean([s.outcome.episodes_run for s in states])) if states else 0.0,
            "rollout_seconds": time.perf_counter() - start,
        }
        stats.update({k: float(v) for k, v in self._stats.items()})
        return stats
