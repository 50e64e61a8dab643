"""Decoding with the blocks under a scan against unrolled blocks: same weights, same greedy tokens.

    python -m experiments.benchmarks.decode_layout [--model tiny] [--layers 8] [--vocab 0] [--batch 16]
        [--prompt-len 64] [--new-tokens 64] [--path sampler] [--repeats 3] [--threads 0]
        [--out runs/benchmarks/decode_layout.json]

``ModelConfig.scan_layers`` (the pretrained presets' default) stacks the blocks' parameters so that a pass
without a cache (training, the log-prob recompute) runs them under one ``lax.scan``. Generation runs the
blocks one after another from static slices of the stacked parameters over one cache array per layer,
as the unrolled layout does (a cache stacked over layers was read through a copy of each layer's slice:
0.3-0.5x the unrolled decode on the CPU and 0.455x on an H200 until then, docs/performance.md). This
measures the two layouts' decode against each other. A random model
(``--model`` preset, ``--layers`` deep, ``--vocab`` tokens) is built unrolled; the scanned layout gets
the same weights stacked (``stack_layers``). ``--path sampler`` (``Sampler.generate``, one position for
every row) or ``--path engine`` (a ``RolloutEngine`` with ``--batch`` slots, a position per row: the
rollouts' path) decodes ``--batch`` random prompts greedily, with the EOS token disallowed so every row
runs ``--new-tokens`` steps. Each layout is warmed
up first (compile seconds reported, never counted). Then, ``--repeats`` times and alternating the
layouts, each runs the full call and a prefill-only call (one new token). Decode tokens/s is
``batch * (new_tokens - 1) / (full - prefill)``, given as min / median / max per layout, with the
scanned / unrolled ratio per repeat (a repeat where noise swallowed either difference is left out)
and as a headline from each layout's fastest full and prefill calls; then whether the greedy tokens are
identical, and the load average before and after. Prints JSON and writes it to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from typing import Any

import numpy as np

from experiments.benchmarks.common import load_average, spread, write_timed_report

LAYOUTS = {"unrolled": False, "scanned": True}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="a ModelConfig preset (random weights)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=0, help="vocabulary size (0: the preset's)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--path", default="sampler", choices=("sampler", "engine"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=0, help="pin to this many CPUs (0: as started)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/benchmarks/decode_layout.json")
    args = parser.parse_args(argv)
    if min(args.layers, args.batch, args.prompt_len, args.repeats) < 1 or args.new_tokens < 2 \
            or args.threads < 0:
        parser.error("--layers, --batch, --prompt-len, --repeats must be positive, --new-tokens >= 2, "
                     "--threads >= 0")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads > 0:
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:args.threads])
    started = time.perf_counter()
    load_before = load_average()

    import jax
    from flax import nnx

    from experiments.benchmarks.rollout import no_eos_automaton
    from mage_jax.generate.engine import EngineRequest, generate_all
    from mage_jax.generate.sampler import Sampler
    from mage_jax.generate.slots import compiled_engine
    from mage_jax.generate.spec import ModelSpec
    from mage_jax.generate.step import SamplingParams
    from mage_jax.models.config import ModelConfig
    from mage_jax.models.transformer import Transformer, stack_layers

    config = ModelConfig.preset(args.model, num_layers=args.layers, param_dtype=args.dtype, dtype=args.dtype,
                                scan_layers=False)
    if args.vocab:
        config = dataclasses.replace(config, vocab_size=args.vocab)
    graphdef, state = nnx.split(Transformer(config, rngs=nnx.Rngs(args.seed)))
    eos = config.vocab_size - 1
    automaton = no_eos_automaton(config.vocab_size, eos)
    rng = np.random.default_rng(args.seed)
    prompts = rng.integers(1, eos, (args.batch, args.prompt_len)).tolist()
    key = jax.random.key(args.seed)

    def layout(scan: bool):
        """A function ``new_tokens -> (seconds, tokens)`` decoding with ``scan_layers=scan``."""
        cfg = dataclasses.replace(config, scan_layers=scan)
        gdef = nnx.graphdef(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))) if scan else graphdef
        weights = stack_layers(state) if scan else state
        spec = ModelSpec(gdef, cfg, eos_ids=(eos,), pad_id=0, prompt_buckets=(args.prompt_len,))
        sampler = Sampler(spec, batch_buckets=(args.batch,))
        engine = compiled_engine(spec, slots=args.batch, max_new_tokens=args.new_tokens)

        def run(new_tokens: int) -> tuple[float, list[list[int]]]:
            params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
            t0 = time.perf_counter()
            if args.path == "sampler":
                tokens = sampler.generate(weights, prompts, params, key, constraints=automaton).tokens
            else:
                done = generate_all(engine.session(weights, params, key), [
                    EngineRequest(row, tuple(prompt), new_tokens, automaton, (row, 0, 0))
                    for row, prompt in enumerate(prompts)])
                tokens = [done[row].tokens for row in range(len(prompts))]
            return time.perf_counter() - t0, [list(map(int, t)) for t in tokens]

        return run

    runs = {name: layout(scan) for name, scan in LAYOUTS.items()}
    warmup_s, tokens = {}, {}
    for name, run in runs.items():
        t0 = time.perf_counter()
        _, tokens[name] = run(args.new_tokens)
        run(1)
        warmup_s[name] = round(time.perf_counter() - t0, 2)
    full: dict[str, list[float]] = {name: [] for name in runs}
    prefill: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(args.repeats):
        for name in (LAYOUTS if i % 2 == 0 else reversed(LAYOUTS)):
            full[name].append(runs[name](args.new_tokens)[0])
            prefill[name].append(runs[name](1)[0])

    decoded = args.batch * (args.new_tokens - 1)

    def rate(full_s: float, prefill_s: float) -> float | None:
        """Decoded tokens per second of decode time; None where noise swallowed the difference."""
        return decoded / (full_s - prefill_s) if full_s > prefill_s else None

    per_repeat = {name: [rate(f, p) for f, p in zip(full[name], prefill[name], strict=True)] for name in runs}
    rates = {name: [r for r in per_repeat[name] if r is not None] for name in runs}
    # Ratios pair the two layouts within a repeat (alternated, so drift cancels) and skip a repeat
    # where either difference was lost in noise; the headline uses each layout's fastest calls, the
    # estimate least disturbed by a loaded machine.
    ratios = [s / u for s, u in zip(per_repeat["scanned"], per_repeat["unrolled"], strict=True)
              if s is not None and u is not None]
    best = {name: rate(min(full[name]), min(prefill[name])) for name in runs}
    headline = best["scanned"] / best["unrolled"] if best["scanned"] and best["unrolled"] else None
    report = {
        "benchmark": "decode_layout",
        "command": "python -m experiments.benchmarks.decode_layout " + " ".join(argv or []),
        "device": str(jax.devices()[0].device_kind),
        "model": args.model, "layers": args.layers, "vocab": config.vocab_size,
        "params": int(config.num_params()), "dtype": args.dtype,
        "path": args.path, "batch": args.batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "decode_tokens_per_s": {name: spread(r) if r else None for name, r in rates.items()},
        "prefill_s": {name: spread(p) for name, p in prefill.items()},
        "scanned_over_unrolled": round(headline, 3) if headline else None,
        "scanned_over_unrolled_per_repeat": [round(x, 3) for x in ratios],
        "greedy_identical": tokens["scanned"] == tokens["unrolled"]
        and all(len(t) == args.new_tokens for t in tokens["unrolled"]),
        "warmup_s": warmup_s,
    }
    return write_timed_report(report, args.out, load_before=load_before, started=started)


if __name__ == "__main__":
    main()
