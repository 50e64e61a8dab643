"""Rollout engine against lockstep generation on a turn-heavy workload of uneven responses.

    python -m experiments.benchmarks.rollout [--rows 128 --group 8 --turns 4 --slots 64 --chunk 8]
        [--slot-levels 4] [--windows 1] [--median 24 --p90 120 --cap 320] [--model tiny] [--repeats 3]
        [--threads 0]
        [--out runs/benchmarks/rollout.json]

``--rows`` conversations (``--group`` copies per group share their first prompt) each run ``--turns``
turns. Response lengths are drawn per (row, turn) from a log-normal with the given median and 90th
percentile, capped at ``--cap`` (the paper's median 600 / p90 3000 / cap 8192, scaled down), and
enforced exactly: the EOS id is disallowed by a one-state token automaton, so every response runs to its
drawn length. The next prompt of a row is the tail of its conversation (group prompt, then per turn the
last 8 response tokens and 8 fresh observation tokens), at most 120 tokens.

* lockstep: one ``Sampler.generate`` per turn over all rows (the lockstep runner's schedule);
* engine: ``RolloutEngine`` with ``--slots`` slots and ``--chunk`` steps per host check; a row's next
  prompt is submitted as soon as its response is back (priority: earlier turns first). Running slots are
  packed into the front of the slot array and a chunk decodes the smallest of ``--slot-levels`` slot
  buckets (all slots, half, quarter, ...) that holds them, attending over the smallest of ``--windows``
  cache prefixes (the whole cache, half, quarter, ...: ``rollout.engine_windows``) that holds its
  furthest slot's next writes; ``engine_window_steps`` splits the decode steps by that prefix.

Both decode greedily with the same random model (``--model tiny``: the ``tiny`` preset, 4 layers,
hidden 128; ``qwen3-0.6b`` for an accelerator), so ``greedy_identical`` checks every token. Each path is
run once to warm up (compiles), then ``--repeats`` times interleaved. ``compiles_after_warmup`` counts
XLA backend compiles (``jax.monitoring``) during the measured repeats. ``useful_decode_fraction``: decode
row-steps that produced a kept token / decode row-steps computed (lockstep: every row of the batch
bucket for every step of a turn's longest row; engine: every row of the slot bucket a chunk's program
computed, for every step it ran; ``engine_bucket_steps`` splits the steps by those rows).
``prefill_tokens``: prompt tokens prefilled (real tokens, padding not counted). The group-copies workload
is the first turn alone: G identical prompts per group, prefilled once by the engine.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from typing import Any

import numpy as np

from experiments.benchmarks.common import load_average, spread, write_timed_report

OBS_TOKENS, TAIL_TOKENS, MAX_PROMPT = 8, 8, 120


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--median", type=float, default=24.0)
    parser.add_argument("--p90", type=float, default=120.0)
    parser.add_argument("--cap", type=int, default=320)
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=8)
    parser.add_argument("--slot-levels", type=int, default=4, help="slot buckets: all slots, 1/2, 1/4, ...")
    parser.add_argument("--windows", type=int, default=1, help="decode windows: whole cache, 1/2, 1/4, ...")
    parser.add_argument("--model", default="tiny", help="a ModelConfig preset (random weights)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="pin to this many CPUs (0: as started)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/benchmarks/rollout.json")
    args = parser.parse_args(argv)
    if min(args.rows, args.group, args.turns, args.cap, args.slots, args.chunk, args.repeats,
           args.slot_levels) < 1:
        parser.error("sizes and --repeats must be positive")
    if args.rows % args.group or not 0 < args.median < args.p90:
        parser.error("--group must divide --rows and 0 < --median < --p90")
    return args


class Workload:
    """The drawn lengths, group prompts and observations; prompts follow from the responses."""

    def __init__(self, args: argparse.Namespace, vocab: int):
        rng = np.random.default_rng(args.seed)
        sigma = math.log(args.p90 / args.median) / 1.2815515655446004  # z of the 90th percentile
        drawn = rng.lognormal(math.log(args.median), sigma, size=(args.rows, args.turns))
        self.lengths = np.clip(np.round(drawn), 1, args.cap).astype(np.int32)
        groups = args.rows // args.group
        starts = [rng.integers(4, vocab, size=int(rng.integers(24, 49))).tolist() for _ in range(groups)]
        self.first = [starts[r // args.group] for r in range(args.rows)]
        self.obs = rng.integers(4, vocab, size=(args.rows, args.turns, OBS_TOKENS)).tolist()
        self.rows, self.turns = args.rows, args.turns

    def prompt(self, row: int, turn: int, responses: dict[tuple[int, int], np.ndarray]) -> list[int]:
        conversation = list(self.first[row])
        for t in range(turn):
            conversation += [int(x) for x in responses[row, t][-TAIL_TOKENS:]] + self.obs[row][t + 1]
        return conversation[-MAX_PROMPT:]


def no_eos_automaton(vocab: int, eos: int):
    from mage_jax.generate.constraints import TokenAutomaton

    table = np.zeros((1, vocab), np.int32)
    table[0, eos] = -1
    return TokenAutomaton(table)


def run_lockstep(sampler, state, work: Workload, turns: int, params, automaton, key) -> dict[str, Any]:
    responses: dict[tuple[int, int], np.ndarray] = {}
    prefill = computed = kept = 0
    start = time.perf_counter()
    for turn in range(turns):
        prompts = [work.prompt(r, turn, responses) for r in range(work.rows)]
        out = sampler.generate(state, prompts, params, key, constraints=automaton,
                               max_new_tokens_per_row=work.lengths[:, turn])
        lengths = np.asarray([len(t) for t in out.tokens])
        chunk = sampler.batch_buckets[-1]
        for c, bucket in enumerate(out.batch_buckets):  # one while loop per batch chunk
            part = lengths[c * chunk:(c + 1) * chunk]
            computed += max(int(part.max()) - 1, 0) * bucket
        kept += int(np.maximum(lengths - 1, 0).sum())
        prefill += sum(len(p) for p in prompts)
        for r in range(work.rows):
            responses[r, turn] = out.tokens[r]
    seconds = time.perf_counter() - start
    return dict(seconds=seconds, responses=responses, prefill_tokens=prefill,
                useful_decode_fraction=kept / computed if computed else 1.0, decode_row_steps=computed)


def run_engine(engine, state, work: Workload, turns: int, params, automaton, key) -> dict[str, Any]:
    from mage_jax.generate.engine import EngineRequest

    responses: dict[tuple[int, int], np.ndarray] = {}
    start = time.perf_counter()
    session = engine.session(state, params, key)

    def submit(row: int, turn: int) -> None:
        session.submit(EngineRequest(
            tag=(row, turn), prompt_ids=tuple(work.prompt(row, turn, responses)),
            limit=int(work.lengths[row, turn]), automaton=automaton, key_path=(row, turn, 0),
            priority=(turn,),
        ))

    for r in range(work.rows):
        submit(r, 0)
    while session.busy:
        for result in session.step():
            row, turn = result.tag
            responses[row, turn] = result.tokens
            if turn + 1 < turns:
                submit(row, turn + 1)
    seconds = time.perf_counter() - start
    s = session.stats
    return dict(seconds=seconds, responses=responses, prefill_tokens=s.prefill_tokens,
                useful_decode_fraction=s.useful_decode_fraction, decode_row_steps=s.decode_row_steps,
                decode_steps=s.decode_steps, inserts=s.inserts, moves=s.moves,
                bucket_steps={str(rows): n for rows, n in sorted(s.bucket_steps.items())},
                window_steps={str(w): n for w, n in sorted(s.window_steps.items())})


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads > 0:
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:args.threads])
    started = time.perf_counter()
    load_before = load_average()

    import jax
    from flax import nnx

    from mage_jax.generate.sampler import Sampler
    from mage_jax.generate.slots import compiled_engine
    from mage_jax.generate.spec import ModelSpec
    from mage_jax.generate.step import SamplingParams
    from mage_jax.models.config import ModelConfig
    from mage_jax.models.transformer import Transformer

    compiles = [0]

    def count(name: str, *_: Any, **__: Any) -> None:
        compiles[0] += name == "/jax/core/compile/backend_compile_duration"

    jax.monitoring.register_event_duration_secs_listener(count)

    config = ModelConfig.preset(args.model, param_dtype=args.dtype, dtype=args.dtype)
    graphdef, state = nnx.split(Transformer(config, rngs=nnx.Rngs(args.seed)))
    eos, pad = 1, 0
    spec = ModelSpec(graphdef, config, eos_ids=(eos,), pad_id=pad, prompt_buckets=(64, 128))
    sampler = Sampler(spec, batch_buckets=(args.rows,))
    engine = compiled_engine(spec, slots=args.slots, max_new_tokens=args.cap, chunk=args.chunk,
                             slot_levels=args.slot_levels, window_levels=args.windows)
    work = Workload(args, config.vocab_size)
    params = SamplingParams(temperature=0.0, max_new_tokens=args.cap)
    automaton = no_eos_automaton(config.vocab_size, eos)
    key = jax.random.key(args.seed)

    def lockstep(turns=args.turns):
        return run_lockstep(sampler, state, work, turns, params, automaton, key)

    def engine_run(turns=args.turns):
        return run_engine(engine, state, work, turns, params, automaton, key)

    t0 = time.perf_counter()
    warm = {"lockstep": lockstep(), "engine": engine_run()}
    copies = {"lockstep": lockstep(1), "engine": engine_run(1)}
    warmup_s = time.perf_counter() - t0
    compiles_before = compiles[0]
    runs: dict[str, list[dict[str, Any]]] = {"lockstep": [], "engine": []}
    for i in range(args.repeats):
        order = ("lockstep", "engine") if i % 2 == 0 else ("engine", "lockstep")
        for name in order:
            runs[name].append(lockstep() if name == "lockstep" else engine_run())
    compiles_after = compiles[0] - compiles_before

    identical = all(
        np.array_equal(a["responses"][k], b["responses"][k])
        for a, b in [(runs["lockstep"][0], runs["engine"][0]), (warm["lockstep"], warm["engine"])]
        for k in a["responses"]
    ) and all(len(r["responses"]) == args.rows * args.turns for r in (*runs["lockstep"], *runs["engine"]))
    lock_s = [r["seconds"] for r in runs["lockstep"]]
    eng_s = [r["seconds"] for r in runs["engine"]]
    ratios = [a / b for a, b in zip(lock_s, eng_s)]
    lengths = work.lengths
    report = {
        "benchmark": "rollout",
        "command": "python -m experiments.benchmarks.rollout " + " ".join(argv or []),
        "device": str(jax.devices()[0].device_kind),
        "model": args.model,
        "workload": {
            "rows": args.rows, "group": args.group, "turns": args.turns, "median": args.median,
            "p90": args.p90, "cap": args.cap, "response_tokens": int(lengths.sum()),
            "response_length_mean": round(float(lengths.mean()), 2),
            "turns_with_a_row_at_the_cap": int((lengths.max(axis=0) == args.cap).sum()),
        },
        "slots": args.slots, "chunk": args.chunk, "slot_levels": args.slot_levels, "windows": args.windows,
        "repeats": args.repeats,
        "lockstep_seconds": round(float(np.median(lock_s)), 4),
        "engine_seconds": round(float(np.median(eng_s)), 4),
        "speedup": round(float(np.median(ratios)), 3),
        "speedup_per_repeat": [round(x, 3) for x in ratios],
        "lockstep_seconds_spread": spread(lock_s),
        "engine_seconds_spread": spread(eng_s),
        "useful_decode_fraction": {
            "lockstep": round(runs["lockstep"][0]["useful_decode_fraction"], 4),
            "engine": round(runs["engine"][0]["useful_decode_fraction"], 4),
        },
        "decode_row_steps": {name: runs[name][0]["decode_row_steps"] for name in runs},
        "prefill_tokens": {name: runs[name][0]["prefill_tokens"] for name in runs},
        "group_copies": {
            "prefill_tokens": {"lockstep": copies["lockstep"]["prefill_tokens"],
                               "engine": copies["engine"]["prefill_tokens"]},
            "ratio": round(copies["engine"]["prefill_tokens"] / copies["lockstep"]["prefill_tokens"], 4),
            "target": round(1 / args.group, 4),
        },
        "engine_inserts": runs["engine"][0]["inserts"],
        "engine_decode_steps": runs["engine"][0]["decode_steps"],
        "engine_bucket_steps": runs["engine"][0]["bucket_steps"],
        "engine_window_steps": runs["engine"][0]["window_steps"],
        "engine_moves": runs["engine"][0]["moves"],
        "compiles_after_warmup": compiles_after,
        "greedy_identical": bool(identical),
        "warmup_s": round(warmup_s, 2),
    }
    return write_timed_report(report, args.out, load_before=load_before, started=started)


if __name__ == "__main__":
    main()
