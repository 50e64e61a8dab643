"""Per-turn step and prompt-render cost of 64 parallel WebShop and ALFWorld meta-episodes.

    python -m experiments.benchmarks.single_agent_step [--out runs/benchmarks/single_agent_step.json]
        [--tasks 8] [--group 8] [--episodes 3] [--budget-s 20] [--only webshop,alfworld]
        [--alfworld-data DIR] [--workers 2]

Plays ``tasks x group`` meta-episodes per environment in lockstep as the runner does (N episodes,
restart between them, reflect prompts rendered for the lost ones). Each turn renders every play
prompt (full style, history-and-reflection memory, the admissible list: the costliest layout) and
then steps every environment with a uniformly random admissible action (on WebShop's search page, a
query of three words of the instruction) wrapped in ``<action>`` tags, so parsing is included.

WebShop runs on the generated catalogue. ALFWorld runs on ``--alfworld-data`` when given (the real
ALFWorld games), else on small ALFWorld-format PDDL games written to a temporary folder
(``mage_jax.testing.write_tiny_alfworld_data``; needs the ``alfworld`` extra), else on a TextWorld game
made with ``textworld.GameMaker``; without those packages it is skipped. ``reset_ms`` includes starting one
game engine per environment. Prints JSON and writes it to ``--out``.

With ``--workers N`` each environment's result also holds ``workers``: resetting and stepping the
meta-episodes in lockstep (no model, ``agent_action``) through ``--workers`` worker processes against in
process (``mage_jax.envs.workers``), as ``stepping_speedup`` (``rollout_host`` reports the same for its
slow environments, and on WebShop ``search_step_ms``, the median search step).
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from experiments.benchmarks.common import (
    batch_parser,
    mean,
    parse_batch_args,
    restart_all,
    step_all,
    write_batch_report,
)
from mage_jax.envs import workers as env_workers
from mage_jax.envs.base import TextEnv, make_env
from mage_jax.envs.prompts import EpisodeRecord, Move, render_play_prompt, render_reflect_prompt
from mage_jax.envs.webshop.catalogue import Catalogue
from mage_jax.envs.webshop.env import SEARCH_TEMPLATE as WEBSHOP_SEARCH
from mage_jax.envs.webshop.env import SEP as WEBSHOP_SEP
from mage_jax.envs.webshop.generate import generate_catalogue
from mage_jax.envs.workers import EnvPool, Reset, Restart, Step
from mage_jax.rollout.tasks import TaskSampler, TaskSamplerConfig
from mage_jax.testing import write_tiny_alfworld_data

REFLECTION = "I searched too broadly. Next time I will use the exact product type and check the options."


def _random_action(env: TextEnv, rng: random.Random) -> str:
    legal = env.legal_actions()
    if legal == ["search[<your query>]"]:
        words = env.goal.instruction.split(", and price")[0].split()  # type: ignore[attr-defined]
        return f"search[{' '.join(rng.sample(words, min(3, len(words))))}]"
    return rng.choice(legal) if legal else "look"


def bench(name: str, make: Callable[[], TextEnv], *, tasks: int, group: int, episodes: int,
          budget_s: float, seed: int) -> dict[str, Any]:
    """Play ``tasks * group`` meta-episodes in lockstep; time reset, render + step per turn, restart."""
    rng = random.Random(seed)
    n = tasks * group
    envs = [make() for _ in range(n)]
    start = time.perf_counter()
    initial = [env.reset(1000 + i // group) for i, env in enumerate(envs)]
    reset_ms = (time.perf_counter() - start) * 1e3
    spec = envs[0].prompt_spec
    memory: list[list[EpisodeRecord]] = [[] for _ in range(n)]
    finished = [False] * n
    render_ms, step_ms, active, restart_ms, reflect_ms, prompt_chars = [], [], [], [], [], []
    measured, wins = 0.0, 0
    for episode in range(episodes):
        live = [i for i in range(n) if not finished[i]]
        if not live or measured > budget_s:
            break
        if episode > 0:
            restart_ms.append(restart_all(envs, live, initial))
        moves: dict[int, list[Move]] = {i: [] for i in live}
        won = dict.fromkeys(live, False)
        playing = list(live)
        for _turn in range(envs[0].max_turns):
            if not playing or measured > budget_s:
                break
            t0 = time.perf_counter()
            for i in playing:
                prompt = render_play_prompt(spec, initial[i], memory[i], episode, moves[i],
                                            memory_mode="history_and_reflection",
                                            admissible=envs[i].legal_actions())
                prompt_chars.append(len(prompt))
            t1 = time.perf_counter()
            still = step_all(envs, playing, lambda env: _random_action(env, rng), moves, won)
            t2 = time.perf_counter()
            render_ms.append((t1 - t0) * 1e3)
            step_ms.append((t2 - t1) * 1e3)
            active.append(len(playing))
            measured += t2 - t0
            playing = still
        t0 = time.perf_counter()
        for i in live:
            record = EpisodeRecord(tuple(moves[i]), sum(m.reward for m in moves[i]), won[i], REFLECTION)
            memory[i].append(record)
            if won[i]:
                finished[i] = True
                wins += 1
            elif episode < episodes - 1:
                render_reflect_prompt(spec, initial[i], record, episode)
        reflect_ms.append((time.perf_counter() - t0) * 1e3)
    if not restart_ms and episodes > 1:  # the budget ended the first episode: still time one restart
        t0 = time.perf_counter()
        for env in envs:
            env.restart()
        restart_ms.append((time.perf_counter() - t0) * 1e3)
    for env in envs:
        getattr(env, "close", lambda: None)()

    return {
        "env": name,
        "meta_episodes": n,
        "turns_measured": len(step_ms),
        "mean_active_per_turn": mean([float(a) for a in active]),
        "ms_per_turn": mean([r + s for r, s in zip(render_ms, step_ms)]),
        "step_ms_per_turn": mean(step_ms),
        "render_ms_per_turn": mean(render_ms),
        "ms_per_env_step": round(sum(step_ms) / max(sum(active), 1), 4),
        "ms_per_prompt_render": round(sum(render_ms) / max(sum(active), 1), 4),
        "mean_prompt_chars": mean([float(c) for c in prompt_chars]),
        "max_prompt_chars": max(prompt_chars) if prompt_chars else None,
        "reset_ms": round(reset_ms, 3),
        "reset_ms_per_env": round(reset_ms / n, 3),
        "restart_ms": mean(restart_ms),
        "reflect_render_ms": mean(reflect_ms),
        "random_policy_wins": wins,
        "stopped_by_budget": measured > budget_s,
    }


# ------------------------------------------------------------------ stepping in worker processes
def agent_action(reply: Any, rng: random.Random) -> str:
    """A random legal action, except on WebShop's search page, whose one legal action is the template
    ``search[<your query>]``: there an agent types a query, so this searches for the goal's instruction
    (the template's words match no product, and a search that finds nothing costs almost nothing)."""
    legal = reply.legal_actions or ("none",)
    if legal == (WEBSHOP_SEARCH,):
        head, instruction = reply.observation.split(WEBSHOP_SEP)[1:3]
        assert head == "Instruction:", reply.observation
        return f"search[{instruction}]"
    return rng.choice(legal)


class GeneratedCatalogue(Catalogue):
    """WebShop's generated catalogue at a chosen size; a worker process regenerates it from its seed and
    size (the same products) instead of receiving every product by message."""

    def __init__(self, seed: int, num_products: int):
        made = generate_catalogue(seed, num_products=num_products)
        super().__init__(made.name, made.products, made.goals, made.splits)
        self.seed, self.num_products = seed, num_products

    def __reduce__(self) -> tuple[Any, ...]:
        return generate_catalogue, (self.seed, self.num_products)


def stepping(name: str, options: dict[str, Any], tasks: list[Any], workers: int, turns: int = 3) -> float:
    """Seconds to reset every task's environment and step it ``turns`` times (``agent_action``) in lockstep
    through an ``EnvPool`` (no model); measured on a second pass, after the workers started and the
    environments were built and used once."""
    pool = EnvPool(name, options, workers)
    rng = random.Random(0)

    def run_all(ops: list[Any]) -> list[Any]:
        replies: dict[int, Any] = {}
        for slot, op in enumerate(ops):
            reply = pool.submit(slot, op, f"meta-episode {slot}")
            if reply is not None:
                replies[slot] = reply
        while len(replies) < len(ops):
            replies.update(pool.replies(timeout=None))
        return [replies[i] for i in range(len(ops))]

    def resets() -> list[Any]:
        return [Reset(t.seed, opponent=t.opponent, seat=t.seat, copy=t.copy, legal=True) for t in tasks]

    def play() -> float:
        started = time.perf_counter()
        replies = run_all(resets())
        for _ in range(turns):
            replies = run_all([Step(f"<action>{agent_action(r, rng)}</action>", legal=True) for r in replies])
        return time.perf_counter() - started

    try:
        play()  # start the workers, build the environments and whatever they load on first use (indexes)
        return play()
    finally:
        pool.close()


def search_step_ms(options: dict[str, Any], tasks: list[Any], count: int = 32) -> float:
    """Median milliseconds of one WebShop search step (``agent_action``'s query), index built."""
    env, rng, times = make_env("webshop", **options), random.Random(0), []
    for task in tasks[:count]:
        env.reset(task.seed)
        action = agent_action(env_workers.apply_op(env, Restart(legal=True)), rng)
        started = time.perf_counter()
        env.step(f"<action>{action}</action>")
        times.append(time.perf_counter() - started)
    return round(float(np.median(times[1:] or times)) * 1e3, 3)


def stepping_report(name: str, options: dict[str, Any], tasks: list[Any], *, workers: int, repeats: int = 1
                    ) -> dict[str, Any]:
    """Lockstep stepping in process and with ``workers`` worker processes, ``repeats`` times each
    (interleaved; the speedup of the medians)."""
    t0, tw = [], []
    for _ in range(repeats):
        t0.append(stepping(name, options, tasks, 0))
        tw.append(stepping(name, options, tasks, workers))
    out: dict[str, Any] = {
        "stepping_s_in_process": round(float(np.median(t0)), 3),
        f"stepping_s_{workers}_workers": round(float(np.median(tw)), 3),
        "stepping_speedup": round(float(np.median(t0) / np.median(tw)), 3),
        "stepping_runs_s": {"in_process": [round(t, 3) for t in t0], "workers": [round(t, 3) for t in tw]},
    }
    if name == "webshop":
        out["search_step_ms"] = search_step_ms(options, tasks)
    return out



def _alfworld_source(data: str | None, workdir: Path, games: int) -> tuple[dict[str, Any], str]:
    """Options for ``make_env("alfworld", ...)`` and a description of the games."""
    if data is not None:
        return {"data_dir": data, "split": "train"}, f"ALFWorld data at {data} (train)"
    root = workdir / "alfworld"
    try:
        return ({"data_dir": write_tiny_alfworld_data(root, games=games), "split": "train"},
                f"{games} tiny ALFWorld-format PDDL games")
    except ImportError:
        pass
    import textworld  # raises ImportError when absent: ALFWorld is skipped
    from textworld.generator.game import Event, Quest

    trial = root / "json_2.1.1" / "train" / "pick_and_place_simple-Apple-None-Pantry-1" / "trial_T1"
    trial.mkdir(parents=True)
    maker = textworld.GameMaker()
    kitchen, pantry = maker.new_room("kitchen"), maker.new_room("pantry")
    maker.connect(kitchen.east, pantry.west)
    maker.set_player(kitchen)
    apple = maker.new(type="o", name="apple")
    pantry.add(apple)
    maker.quests = [Quest(win_events=[Event(conditions={maker.new_fact("in", apple, maker.inventory)})])]
    options = textworld.GameOptions()
    options.path = str(trial / "game.z8")
    textworld.generator.compile_game(maker.build(), options)
    (trial / "traj_data.json").write_text(json.dumps({"task_type": "pick_and_place_simple"}))
    return {"data_dir": str(root), "split": "train"}, "one TextWorld GameMaker game"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = batch_parser(__doc__, out="runs/benchmarks/single_agent_step.json", tasks=8, budget_s=20.0,
                          budget_help="measured seconds per environment")
    parser.add_argument("--only", default="webshop,alfworld", help="comma-separated: webshop, alfworld")
    parser.add_argument("--alfworld-data", default=None, help="real ALFWorld data folder (else local games)")
    parser.add_argument("--workers", type=int, default=0,
                        help="also time resetting and stepping in this many worker processes against in "
                             "process (stepping_speedup; 0: not measured)")
    args = parse_batch_args(parser, argv)
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    if not only <= {"webshop", "alfworld"}:
        parser.error("--only takes webshop and / or alfworld")
    common = {"tasks": args.tasks, "group": args.group, "episodes": args.episodes,
              "budget_s": args.budget_s, "seed": args.seed}
    results, skipped, sources = [], [], {}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        tasks = TaskSampler(TaskSamplerConfig(num_tasks=args.tasks, group_size=args.group)).sample_train(0)
        for name in ("webshop", "alfworld"):
            if name not in only:
                continue
            try:
                if name == "webshop":
                    options, sources[name] = {}, "generated catalogue (100 products, 200 goals)"
                else:
                    options, sources[name] = _alfworld_source(args.alfworld_data, Path(tmp), args.tasks)
                results.append(bench(name, lambda: make_env(name, **options), **common))  # noqa: B023
            except ImportError as error:
                skipped.append({"env": name, "reason": str(error)})
                continue
            if args.workers > 0:
                results[-1]["workers"] = stepping_report(name, options, tasks, workers=args.workers)
    prompt = {"style": "full", "memory_mode": "history_and_reflection", "admissible": True}
    return write_batch_report("single_agent_step", args, started=start, results=results, skipped=skipped,
                              prompt=prompt, sources=sources)


if __name__ == "__main__":
    main()
