"""The lockstep meta-episode runner (docs/method.md §2 and §3) with scripted policies."""

import re
import threading

import numpy as np
import pytest

from mage_jax.envs.anchors import local_anchor, play_anchor, reflection_anchor
from mage_jax.envs.base import PromptSpec, StepInfo, StepResult, TextEnv, register_env
from mage_jax.generate.constraints import WordSequence
from mage_jax.rollout.meta_episode import MetaEpisodeRunner, RolloutProgress
from mage_jax.rollout.policy import ScriptedPolicy
from mage_jax.rollout.stopping import Interrupted
from mage_jax.rollout.tasks import Task, TaskSampler, TaskSamplerConfig
from mage_jax.testing import runner_config


@register_env("rollout_test_guess")
class GuessEnv(TextEnv):
    """Guess the hidden letter of the task (``"ABC"[seed % 3]``): right +10 and won, wrong -1, D draws."""

    max_turns = 2
    reward_scale = 10.0
    prompt_spec = PromptSpec(
        preamble="Guess the hidden letter A, B or C (D gives up for a draw).",
        compact_preamble="guess letter",
        action_format="A",
        history_window=3,
    )

    def reset(self, seed, *, opponent=None, seat=None, copy=0):
        self.seed, self._opponent = seed, opponent
        return self.restart()

    def restart(self):
        self.guesses, self.finished = [], False
        return self.observation

    @property
    def observation(self):
        return f"task {self.seed} guesses: {','.join(self.guesses) or 'none'}"

    @property
    def opponent(self):
        return self._opponent

    @property
    def task_info(self):
        return {"task_type": "even" if self.seed % 2 == 0 else "odd"}

    def legal_actions(self):
        return [] if self.finished else ["A", "B", "C", "D"]

    def step_action(self, action):
        if action not in ("A", "B", "C", "D") or self.finished:
            return self.invalid_step(f"bad action {action!r}")
        self.guesses.append(action)
        won = action == "ABC"[self.seed % 3]
        draw = action == "D"
        self.finished = won or draw or len(self.guesses) >= self.max_turns
        reward = 10.0 if won else 0.0 if draw else -1.0
        info = StepInfo(won=won, draw=draw, valid=True, score=reward / 10, opponent=self._opponent)
        return StepResult(self.observation, reward, self.finished, info, action)


def tasks_for(seeds, opponent=None, group_size=1):
    out = []
    for b, seed in enumerate(seeds):
        for g in range(group_size):
            out.append(
                Task(seed=seed, opponent=opponent, seat=None, group=b, meta_episode=b * group_size + g)
            )
    return out


def seed_of(prompt):
    return int(re.search(r"task (\d+)", prompt).group(1))


def trial_of(prompt):
    match = re.search(r"Currently on trial #(\d+)", prompt) or re.search(r"on trial #(\d+)\. Review", prompt)
    return int(match.group(1))


def is_reflect(prompt):
    return "<remark>...</remark>" in prompt


def secret(seed):
    return "ABC"[seed % 3]


def wrong(seed):
    return "ABC"[(seed + 1) % 3]


def scripted(play, remark=lambda p: f"<remark>note-{seed_of(p)}-{trial_of(p)}</remark>"):
    return ScriptedPolicy(lambda p: remark(p) if is_reflect(p) else play(p))


def runner(**kw):
    return MetaEpisodeRunner("rollout_test_guess", {}, runner_config(**kw))


def wins_at(trials):
    """Play policy: seed s wins on trial ``trials[s]`` (1-based; never when missing), else guesses wrong."""

    def play(prompt):
        seed = seed_of(prompt)
        return f"<action>{secret(seed) if trials.get(seed) == trial_of(prompt) else wrong(seed)}</action>"

    return play


def test_won_meta_episodes_stop_early_and_lost_ones_retry():
    result = runner(num_episodes=3).run(
        tasks_for([0, 1, 2, 3]), scripted(wins_at({0: 1, 1: 2})), training=True
    )
    by_seed = {o.seed: o for o in result.outcomes}
    assert by_seed[0].won == [True] and by_seed[0].rewards == [10.0]
    assert by_seed[1].won == [False, True] and by_seed[1].rewards == [-2.0, 10.0]
    assert by_seed[2].won == [False] * 3 and by_seed[2].episodes_run == 3
    assert by_seed[1].payoff == [-0.2, 1.0]  # reward / env.reward_scale
    assert not [r for r in result.rows if r.meta_episode == 0 and (r.episode > 0 or r.phase == "reflect")]


def test_reflection_rows_come_only_after_lost_episodes_that_have_a_next_episode():
    result = runner(num_episodes=3).run(tasks_for([0, 1, 2]), scripted(wins_at({0: 1, 1: 2})), training=True)
    reflects = sorted((r.meta_episode, r.episode) for r in result.rows if r.phase == "reflect")
    assert reflects == [(1, 0), (2, 0), (2, 1)]
    assert result.stats["reflect_rows"] == 3
    assert result.outcomes[2].reflections == ["note-2-1", "note-2-2"]


def test_the_progress_callback_hears_rows_tokens_and_finished_meta_episodes_after_every_round():
    policy, heard = scripted(wins_at({0: 1, 3: 1})), []
    result = runner(num_episodes=2).run(tasks_for([0, 1, 2, 3], group_size=2), policy, training=True,
                                        progress=heard.append)
    calls = np.cumsum([len(call) for call in policy.calls])
    assert [p.rows for p in heard] == list(calls)  # one report per batched generate call (lockstep)
    assert heard[-1] == RolloutProgress(rows=len(result.rows), finished=8,
                                        tokens=sum(len(r.response_ids) for r in result.rows))
    finished = [p.finished for p in heard]
    # the winners of episode 0's first turn (seeds 0 and 3: 4 copies) finish long before the others
    assert finished == sorted(finished) and 0 < finished[1] < 8 == finished[-1]


class _ScriptedStream:
    """A continuous-batching stream over a scripted policy: each collect answers every pending request."""

    def __init__(self, policy):
        self.policy, self.pending = policy, []

    @property
    def busy(self):
        return bool(self.pending)

    def submit(self, tag, request, key_path, priority=()):
        self.pending.append((tag, request))

    def collect(self):
        batch, self.pending = self.pending, []
        return list(zip([tag for tag, _ in batch], self.policy.generate([r for _, r in batch])))


def test_the_streaming_schedule_reports_the_same_running_totals():
    policy, heard = scripted(wins_at({0: 1, 3: 1})), []
    policy.open_stream = lambda: _ScriptedStream(policy)
    result = runner(num_episodes=2).run(tasks_for([0, 1, 2, 3], group_size=2), policy, training=True,
                                        progress=heard.append)
    assert heard[-1] == RolloutProgress(rows=len(result.rows), finished=8,
                                        tokens=sum(len(r.response_ids) for r in result.rows))
    assert [p.finished for p in heard] == sorted(p.finished for p in heard) and heard[0].finished < 8


def test_every_turn_is_one_batched_generate_call_over_all_active_meta_episodes():
    policy = scripted(wins_at({0: 1, 3: 1}))
    result = runner(num_episodes=2).run(tasks_for([0, 1, 2, 3], group_size=2), policy, training=True)
    kinds = [{is_reflect(r.prompt) for r in call} for call in policy.calls]
    assert all(len(k) == 1 for k in kinds)  # a call is all play or all reflect
    sizes = [(len(call), is_reflect(call[0].prompt)) for call in policy.calls]
    # episode 0: two turns for the 4 losing copies, one for the winners; then 4 reflections; episode 1.
    assert sizes == [(8, False), (4, False), (4, True), (4, False), (4, False)]
    assert result.stats["generate_calls"] == 5
    # one request per row, and one row per (meta-episode, episode, turn, phase): nothing generated twice
    assert sum(len(call) for call in policy.calls) == len(result.rows)
    keys = [(r.meta_episode, r.episode, r.turn, r.phase) for r in result.rows]
    assert len(set(keys)) == len(keys)


def test_a_stop_request_ends_the_rollout_at_its_next_collect():
    """Once ``stop`` is set (SIGTERM / Ctrl-C in the trainer) the runner raises ``Interrupted`` before it
    collects anything more: the turn in which the stop came is the last one generated."""
    stop = threading.Event()
    turns = []

    def play(prompt):
        turns.append(prompt)
        if len(turns) == 8:  # the last request of the first turn
            stop.set()
        return wins_at({})(prompt)

    policy = scripted(play)
    with pytest.raises(Interrupted):
        runner(num_episodes=2).run(tasks_for([0, 1, 2, 3], group_size=2), policy, training=True, stop=stop)
    assert len(policy.calls) == 1 and len(turns) == 8
    # Without a stop the same rollout plays on.
    assert len(runner(num_episodes=2).run(tasks_for([0, 1, 2, 3], group_size=2), scripted(wins_at({})),
                                         training=True, stop=threading.Event()).rows) > 8


@pytest.mark.parametrize(
    "mode, shows_reflection, shows_trajectory",
    [("reflection_only", True, False), ("history_only", False, True), ("history_and_reflection", True, True)],
)
def test_memory_of_earlier_episodes_follows_the_memory_mode(mode, shows_reflection, shows_trajectory):
    result = runner(num_episodes=3, memory_mode=mode, keep_text=True).run(
        tasks_for([4]), scripted(wins_at({})), training=True
    )
    plays = {r.episode: r.prompt_text for r in result.rows if r.phase == "play" and r.turn == 0}
    assert "note-4-1" not in plays[0] and "Trial #1" not in plays[0]
    third = plays[2]
    assert ("note-4-1" in third and "note-4-2" in third) == shows_reflection
    assert third.index("note-4-1") < third.index("note-4-2") if shows_reflection else True
    assert ("Trial #1, turn by turn" in third and "Trial #2, turn by turn" in third) == shows_trajectory


def test_reflect_false_writes_no_reflections_and_needs_history_memory():
    result = runner(num_episodes=3, memory_mode="history_only", reflect=False, keep_text=True).run(
        tasks_for([4]), scripted(wins_at({})), training=True
    )
    assert {r.phase for r in result.rows} == {"play"}
    assert "Trial #2, turn by turn" in [r.prompt_text for r in result.rows if r.episode == 2][0]
    with pytest.raises(ValueError, match="history_only"):
        runner_config(num_episodes=3, reflect=False)


def test_no_memory_plays_every_episode_with_a_prompt_that_shows_no_earlier_one():
    result = runner(num_episodes=3, memory_mode="none", reflect=False, keep_text=True).run(
        tasks_for([4]), scripted(wins_at({})), training=True
    )
    assert {r.phase for r in result.rows} == {"play"} and result.outcomes[0].episodes_run == 3
    plays = {r.episode: r.prompt_text for r in result.rows if r.phase == "play" and r.turn == 0}
    assert plays[2] == plays[0].replace("trial #1", "trial #3")  # the same prompt but for its number
    assert "memory" not in plays[2] and "Trial #1" not in plays[2]
    with pytest.raises(ValueError, match="set rollout.reflect=false"):
        runner_config(num_episodes=3, memory_mode="none")


def test_reflection_words_constrain_reflect_rows_to_a_word_sequence():
    policy = scripted(wins_at({}), remark=lambda p: "<remark>free text</remark>")
    result = runner(num_episodes=3, memory_mode="reflection_only", reflection_words=("bets", "King"),
                    reflection_max_words=2, keep_text=True).run(tasks_for([4]), policy, training=True)
    reflect = [r for call in policy.calls for r in call if is_reflect(r.prompt)]
    play = [r for call in policy.calls for r in call if not is_reflect(r.prompt)]
    assert len(reflect) == 2
    assert {r.allowed_completions for r in reflect} == {WordSequence(("bets", "King"), 2)}
    assert {r.allowed_completions for r in play} == {None}
    # The scripted answer is not a word sequence: the constraint forces the first word, which memory shows.
    assert result.outcomes[0].reflections == ["bets", "bets"]
    third = [r.prompt_text for r in result.rows if r.phase == "play" and r.episode == 2][0]
    assert "Your reflection: bets" in third
    with pytest.raises(ValueError, match="set rollout.reflect=true"):
        runner_config(num_episodes=3, memory_mode="history_only", reflect=False, reflection_words=("a",))
    with pytest.raises(ValueError, match="distinct"):
        runner_config(num_episodes=3, reflection_words=("a", "a"))


def test_a_missing_remark_is_an_empty_reflection_and_an_invalid_row():
    policy = scripted(wins_at({}), remark=lambda p: "I will do better")
    result = runner(num_episodes=2, keep_text=True).run(tasks_for([5]), policy, training=True)
    reflect = [r for r in result.rows if r.phase == "reflect"]
    assert len(reflect) == 1 and not reflect[0].valid
    assert result.outcomes[0].reflections == [""]
    assert result.stats["missing_remark"] == 1
    assert "Your reflection: (none)" in [r.prompt_text for r in result.rows if r.episode == 1][0]


def test_an_invalid_action_uses_up_the_turn_and_changes_nothing():
    result = runner(num_episodes=1, keep_text=True).run(
        tasks_for([0]), scripted(lambda p: "no idea"), training=True
    )
    assert [r.valid for r in result.rows] == [False, False]
    assert [r.env_reward for r in result.rows] == [0.0, 0.0]
    assert result.outcomes[0].invalid_actions == 2 and result.outcomes[0].turns == [2]
    assert result.stats["invalid_action_ratio"] == 1.0


def test_rows_carry_ids_order_anchors_and_opponent():
    tasks = tasks_for([1, 2], opponent="bot", group_size=2)
    result = runner(num_episodes=2).run(tasks, scripted(wins_at({})), training=True)
    for me in range(4):
        rows = sorted((r for r in result.rows if r.meta_episode == me), key=lambda r: r.step)
        assert [r.step for r in rows] == list(range(5))
        assert [(r.phase, r.episode, r.turn) for r in rows] == [
            ("play", 0, 0),
            ("play", 0, 1),
            ("reflect", 0, 0),
            ("play", 1, 0),
            ("play", 1, 1),
        ]
        seed = tasks[me].seed
        assert rows[0].anchor == play_anchor(f"task {seed} guesses: none", "bot")
        assert rows[1].anchor == play_anchor(f"task {seed} guesses: {wrong(seed)}", "bot")
        assert rows[2].anchor == reflection_anchor("bot")
        assert {(r.group, r.opponent) for r in rows} == {(tasks[me].group, "bot")}
    local = runner(num_episodes=2, anchor="local").run(tasks, scripted(wins_at({})), training=True)
    assert [r.anchor for r in local.rows if r.meta_episode == 0][3] == local_anchor(
        play_anchor("task 1 guesses: none", "bot"), 1
    )


def test_constrained_actions_pass_the_legal_action_strings_to_the_policy():
    policy = scripted(lambda p: "anything")
    runner(num_episodes=2, constrained_actions=True).run(
        tasks_for([1]), policy, training=True
    )  # forced A: wrong
    play = [r for call in policy.calls for r in call if not is_reflect(r.prompt)]
    assert {r.allowed_completions for r in play} == {tuple(f"<action>{a}</action>" for a in "ABCD")}
    assert {r.allowed_completions for call in policy.calls for r in call if is_reflect(r.prompt)} == {None}


def test_an_over_long_prompt_drops_the_oldest_memory_first():
    base = runner(num_episodes=3, keep_text=True).run(tasks_for([4]), scripted(wins_at({})), training=True)
    third = [r for r in base.rows if r.episode == 2 and r.turn == 0][0]
    limit = third.prompt_length - 5  # too long with both reflections, fits with one
    result = runner(num_episodes=3, keep_text=True, max_prompt_tokens=limit).run(
        tasks_for([4]), scripted(wins_at({})), training=True
    )
    shortened = [r for r in result.rows if r.episode == 2 and r.turn == 0][0]
    assert shortened.valid and not shortened.overflow and shortened.prompt_length <= limit
    assert "note-4-1" not in shortened.prompt_text and "note-4-2" in shortened.prompt_text
    assert result.stats["overflow_memory_dropped"] >= 1
    assert result.stats["overflow_prompts"] >= result.stats["overflow_memory_dropped"]
    assert result.stats["overflow_invalid"] == 0
    assert all(r.prompt_length <= limit for r in result.rows)


def test_a_prompt_that_cannot_fit_becomes_an_invalid_row_and_never_crashes():
    policy = scripted(wins_at({4: 1}))
    result = runner(num_episodes=2, max_prompt_tokens=10).run(tasks_for([4, 5]), policy, training=True)
    assert policy.calls == []
    assert result.rows and all(r.overflow and not r.valid and r.response_length == 0 for r in result.rows)
    assert result.stats["overflow_invalid"] == len(result.rows) == 10  # 2 x (2 turns + reflect + 2 turns)
    assert [o.episodes_run for o in result.outcomes] == [2, 2]


def test_outcomes_report_draws_scores_and_task_info():
    result = runner(num_episodes=2).run(
        tasks_for([2]), scripted(lambda p: "<action>D</action>"), training=False
    )
    (outcome,) = result.outcomes
    assert outcome.draw == [True, True] and outcome.won == [False, False]
    assert outcome.score == [0.0, 0.0] and outcome.task_info["task_type"] == "even"


def test_bad_runner_configs_get_one_clear_error():
    for kw, match in [
        (dict(num_episodes=0), "num_episodes"),
        (dict(memory_mode="everything"), "memory_mode"),
        (dict(anchor="far"), "anchor"),
        (dict(max_prompt_tokens=0), "max_prompt_tokens"),
    ]:
        with pytest.raises(ValueError, match=match):
            runner_config(**kw)
    with pytest.raises(ValueError, match="unknown environment"):
        MetaEpisodeRunner("no_such_env", {}, runner_config())


# ------------------------------------------------------------------------------- Kuhn Poker


def kuhn_tasks(seats="mixed", num_tasks=6, group_size=2):
    config = TaskSamplerConfig(
        num_tasks=num_tasks,
        group_size=group_size,
        opponents={"conservative": 0.3, "aggressive": 0.3, "intermediate": 0.4},
        seats=seats,
        seed=1,
    )
    return TaskSampler(config).sample_train(0)


def test_kuhn_meta_episodes_record_payoff_in_chips_and_the_seat():
    tasks = kuhn_tasks()
    policy = ScriptedPolicy(
        lambda p: "<remark>bet more</remark>" if "<remark>" in p else "<action>BET</action>"
    )
    result = MetaEpisodeRunner("kuhn_poker", {}, runner_config(num_episodes=3)).run(
        tasks, policy, training=True
    )
    assert len(result.outcomes) == len(tasks)
    for task, outcome in zip(tasks, result.outcomes):
        assert (outcome.seed, outcome.opponent, outcome.seat) == (task.seed, task.opponent, task.seat)
        assert outcome.payoff == [r / 5.0 for r in outcome.rewards]
        assert all(p in (-2, -1, 1, 2) for p in outcome.payoff)
        assert outcome.won == [p > 0 for p in outcome.payoff]
        assert outcome.task_info["agent_card"] in (0, 1, 2)
    # a deterministic policy against deterministic opponents repeats itself after a loss
    for outcome in result.outcomes:
        assert len(set(outcome.payoff)) == 1


def test_kuhn_privileged_reflection_shows_the_opponent_card_only_in_training():
    tasks = kuhn_tasks(num_tasks=3, group_size=1)
    policy = ScriptedPolicy(lambda p: "<remark>r</remark>" if "<remark>" in p else "<action>PASS</action>")
    cfg = runner_config(num_episodes=2, privileged_reflection=True, keep_text=True)
    train = MetaEpisodeRunner("kuhn_poker", {}, cfg).run(tasks, policy, training=True)
    evaluation = MetaEpisodeRunner("kuhn_poker", {}, cfg).run(tasks, policy, training=False)
    lost = [o.meta_episode for o in train.outcomes if not o.won[0]]
    assert lost, "the scripted PASS policy should lose some deals"
    train_reflect = [r.prompt_text for r in train.rows if r.phase == "reflect"]
    eval_reflect = [r.prompt_text for r in evaluation.rows if r.phase == "reflect"]
    assert len(train_reflect) == len(lost) and all("Opponent's Card" in p for p in train_reflect)
    assert eval_reflect and not any("Opponent's Card" in p for p in eval_reflect)
    assert not any("Opponent's Card" in r.prompt_text for r in train.rows if r.phase == "play")


@pytest.mark.parametrize("env_name", ["kuhn_poker", "tic_tac_toe", "sokoban", "minesweeper"])
def test_the_runner_drives_every_built_in_game_with_consistent_rows_and_outcomes(env_name):
    from mage_jax.envs.base import make_env

    pool = getattr(make_env(env_name), "opponent_pool", None)
    config = TaskSamplerConfig(num_tasks=3, group_size=2, opponents=pool, seats="mixed" if pool else "first")
    tasks = TaskSampler(config).sample_train(0)
    policy = ScriptedPolicy(lambda p: "<remark>x</remark>" if "<remark>" in p else "forced by the constraint")
    result = MetaEpisodeRunner(env_name, {}, runner_config(num_episodes=3, constrained_actions=True)).run(
        tasks, policy, training=True
    )
    assert result.stats["invalid_action_ratio"] == 0.0
    for outcome in result.outcomes:
        rows = [r for r in result.rows if r.meta_episode == outcome.meta_episode]
        assert sum(r.phase == "play" for r in rows) == sum(outcome.turns)
        assert sum(r.phase == "reflect" for r in rows) == outcome.episodes_run - 1
        assert outcome.episodes_run == 3 or outcome.won[-1]
        assert not any(outcome.won[:-1])


def test_play_and_reflection_anchors_name_the_opponent():
    """Agent-specific normalisation (docs/method.md §6): equal states met by different opponents are
    never pooled, in play rows and in reflection rows."""
    tasks = [Task(seed=4, opponent=name, seat=None, group=g, meta_episode=g)
             for g, name in enumerate(("bot", "rival"))]
    result = runner(num_episodes=2).run(tasks, scripted(wins_at({})), training=True)
    first_play = {r.opponent: r.anchor for r in result.rows if r.phase == "play" and r.step == 0}
    reflection = {r.opponent: r.anchor for r in result.rows if r.phase == "reflect"}
    for anchors in (first_play, reflection):
        assert anchors["bot"] != anchors["rival"]
        assert "bot" in anchors["bot"] and "rival" in anchors["rival"]


def test_a_stored_reflection_is_capped_at_2000_characters():
    policy = scripted(wins_at({}), remark=lambda p: "<remark>" + "x" * 5000 + "</remark>")
    result = runner(num_episodes=2).run(tasks_for([5]), policy, training=True)
    assert result.outcomes[0].reflections == ["x" * 2000]
