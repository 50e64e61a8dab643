"""Environment stepping and prompt rendering cost per lockstep turn of 128 parallel meta-episodes.

    python -m experiments.benchmarks.env_step [--out runs/benchmarks/env_step.json] [--budget-s 12]

For every environment and opponent it plays meta-episodes as the runner does (16 task instances x
8 copies, 3 episodes, reflections in between), choosing uniformly random legal actions wrapped in
``<action>`` tags and stepping through ``env.step`` (so parsing is included). A turn is one lockstep
step of all active meta-episodes: render every play prompt (by default full style with history and
reflection memory, the costliest mode), then step every environment (the opponent answers inside the step).
Slow opponents (MCTS-1000) stop after ``--budget-s`` seconds of measured turns. Prints JSON and
writes it to ``--out``.
"""

from __future__ import annotations

import random
import time
from typing import Any

from experiments.benchmarks.common import (
    batch_parser,
    mean,
    parse_batch_args,
    restart_all,
    step_all,
    write_batch_report,
)
from mage_jax.envs.base import TextEnv, make_env, registered_envs
from mage_jax.envs.prompts import (
    MEMORY_MODES,
    STYLES,
    EpisodeRecord,
    Move,
    render_play_prompt,
    render_reflect_prompt,
)

CONFIGS: list[tuple[str, str | None, str]] = [
    ("kuhn_poker", "conservative", "mixed"),
    ("kuhn_poker", "aggressive", "mixed"),
    ("kuhn_poker", "intermediate", "mixed"),
    ("kuhn_poker", "cfr", "second"),
    ("tic_tac_toe", "mcts-100", "mixed"),
    ("tic_tac_toe", "mcts-1000", "first"),
    ("tic_tac_toe", "preferred-1", "mixed"),
    ("tic_tac_toe", "random", "mixed"),
    ("sokoban", None, "none"),
    ("minesweeper", None, "none"),
]
REFLECTION = "I lost because I moved too early. Next time I will check the opponent's habits first."


def _seat(mode: str, group: int) -> int | None:
    return {"none": None, "first": 0, "second": 1}.get(mode, group % 2)


def _random_legal(env: TextEnv, rng: random.Random) -> str:
    legal = env.legal_actions()
    return rng.choice(legal) if legal else "none"


def bench_config(env_name: str, opponent: str | None, seats: str, *, tasks: int, group: int,
                 episodes: int, budget_s: float, seed: int, style: str = "full",
                 memory_mode: str = "history_and_reflection") -> dict[str, Any]:
    """Play ``tasks * group`` meta-episodes in lockstep; time reset, per-turn render + step, reflect."""
    rng = random.Random(seed)
    n = tasks * group
    envs = [make_env(env_name) for _ in range(n)]
    start = time.perf_counter()
    initial = []
    for i, env in enumerate(envs):
        kwargs = {} if opponent is None else {"opponent": opponent, "seat": _seat(seats, i // group)}
        initial.append(env.reset(1000 + i // group, **kwargs))
    reset_ms = (time.perf_counter() - start) * 1e3
    spec = envs[0].prompt_spec
    memory: list[list[EpisodeRecord]] = [[] for _ in range(n)]
    finished = [False] * n
    turn_ms, render_ms, step_ms, active_counts, reflect_ms, restart_ms = [], [], [], [], [], []
    measured = 0.0
    out_of_budget = False
    for episode in range(episodes):
        active = [i for i in range(n) if not finished[i]]
        if not active or out_of_budget:
            break
        if episode > 0:
            restart_ms.append(restart_all(envs, active, initial))
        moves: dict[int, list[Move]] = {i: [] for i in active}
        playing = list(active)
        last_won = dict.fromkeys(active, False)
        for _ in range(max(env.max_turns for env in envs)):
            playing = [i for i in playing if len(moves[i]) < envs[i].max_turns]
            if not playing:
                break
            t0 = time.perf_counter()
            for i in playing:
                render_play_prompt(spec, initial[i], memory[i], episode, moves[i],
                                   memory_mode=memory_mode, style=style)
            t1 = time.perf_counter()
            still = step_all(envs, playing, lambda env: _random_legal(env, rng), moves, last_won)
            t2 = time.perf_counter()
            render_ms.append((t1 - t0) * 1e3)
            step_ms.append((t2 - t1) * 1e3)
            turn_ms.append((t2 - t0) * 1e3)
            active_counts.append(len(playing))
            measured += t2 - t0
            playing = still
            if measured > budget_s:
                out_of_budget = True
                break
        records = {
            i: EpisodeRecord(tuple(moves[i]), sum(m.reward for m in moves[i]), last_won[i], REFLECTION)
            for i in active
        }
        t0 = time.perf_counter()
        for i in active:
            if records[i].won:
                finished[i] = True
            elif episode < episodes - 1:
                hidden = envs[i].privileged_observation()
                render_reflect_prompt(spec, initial[i], records[i], episode, style=style, privileged=hidden)
        reflect_ms.append((time.perf_counter() - t0) * 1e3)
        for i in active:
            memory[i].append(records[i])

    return {
        "env": env_name,
        "opponent": opponent,
        "seats": seats,
        "meta_episodes": n,
        "turns_measured": len(turn_ms),
        "mean_active_per_turn": mean([float(c) for c in active_counts]),
        "ms_per_turn": mean(turn_ms),
        "step_ms_per_turn": mean(step_ms),
        "render_ms_per_turn": mean(render_ms),
        "max_ms_per_turn": round(max(turn_ms), 3) if turn_ms else None,
        "ms_per_env_step": round(sum(step_ms) / max(sum(active_counts), 1), 4),
        "reset_ms": round(reset_ms, 3),
        "restart_ms": mean(restart_ms),
        "reflect_render_ms": mean(reflect_ms),
        "stopped_by_budget": out_of_budget,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = batch_parser(__doc__, out="runs/benchmarks/env_step.json", tasks=16, budget_s=12.0,
                          budget_help="measured seconds per configuration")
    parser.add_argument("--only", default=None, help="comma-separated environment names")
    parser.add_argument("--style", choices=STYLES, default="full")
    parser.add_argument("--memory-mode", choices=MEMORY_MODES, default="history_and_reflection")
    args = parse_batch_args(parser, argv)
    only = None if args.only is None else set(args.only.split(","))
    known = set(registered_envs())
    results, skipped = [], []
    start = time.perf_counter()
    for env_name, opponent, seats in CONFIGS:
        if only is not None and env_name not in only:
            continue
        if env_name not in known:
            skipped.append({"env": env_name, "opponent": opponent, "reason": "not registered"})
            continue
        try:
            results.append(
                bench_config(env_name, opponent, seats, tasks=args.tasks, group=args.group,
                             episodes=args.episodes, budget_s=args.budget_s, seed=args.seed,
                             style=args.style, memory_mode=args.memory_mode)
            )
        except ImportError as error:  # e.g. MCTS without OpenSpiel
            skipped.append({"env": env_name, "opponent": opponent, "reason": str(error)})
    return write_batch_report("env_step", args, started=start, results=results, skipped=skipped,
                              prompt={"style": args.style, "memory_mode": args.memory_mode})


if __name__ == "__main__":
    main()
