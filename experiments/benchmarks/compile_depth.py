"""Compile time of the generation programs against model depth, scanned and unrolled blocks.

    python -m experiments.benchmarks.compile_depth [--env kuhn_poker] [--preset small]
        [--depths 4 28] [--layouts scanned unrolled] [--out runs/benchmarks/compile_depth.json]

Builds the preset's rollout programs exactly as the trainer and the scale plan build them
(``experiments.plan.make_setup``: the engine's ``insert`` and ``decode``, or ``lockstep``) with abstract
parameters of the preset's shapes (``small``: Qwen3-0.6B, hidden 1024, vocabulary 151936) at each
depth, once with the blocks under a scan (``ModelConfig.scan_layers``, the pretrained presets' default)
and once unrolled, on this process's first device. Each program is lowered and then compiled
(``jax.jit(...).lower(...).compile()``); the persistent compilation cache is switched off so every
compile is a real one. Issue 28's target: a scanned program at the deepest depth compiles within 2x of
the shallowest. Prints JSON and writes it to ``--out``: per layout and depth, each program's lower and
compile seconds and the seconds to build the abstract model (``nnx.eval_shape`` of the decoder, how a
checkpoint's model is built), and per layout the deepest / shallowest compile ratio per program with
the target met or not, with the 1-minute load average before and after.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

from experiments.benchmarks.common import load_average, write_timed_report

LAYOUTS = {"scanned": True, "unrolled": False}
TARGET_RATIO = 2.0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env", default="kuhn_poker")
    p.add_argument("--preset", default="small")
    p.add_argument("--depths", type=int, nargs="+", default=[4, 28])
    p.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override (e.g. model.overrides={\"hidden_size\": 256} for a narrower model)")
    p.add_argument("--out", default="runs/benchmarks/compile_depth.json")
    return p


def measure(env: str, preset: str, depth: int, scan: bool, overrides: dict[str, Any]) -> dict[str, Any]:
    """Lower and compile seconds of each rollout program of ``preset`` at ``depth`` layers."""
    from flax import nnx

    from experiments import plan
    from mage_jax import aot
    from mage_jax import config as C
    from mage_jax.models.transformer import Transformer

    cfg = plan.preset_config(env, preset, overrides)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(
        cfg.model, overrides={**cfg.model.overrides, "scan_layers": scan}))
    setup = plan.make_setup(cfg, 1, num_layers=depth)
    if setup.model_config.scan_layers != scan:
        raise C.ConfigError("the model layout override did not reach the model config")
    started = time.perf_counter()  # the abstract model, as a checkpoint's model is built
    nnx.eval_shape(lambda: Transformer(setup.model_config, rngs=nnx.Rngs(0)))
    build_s = time.perf_counter() - started
    started = time.perf_counter()
    programs = None if setup.engine is None else setup.engine.programs
    lowered = aot.lower_rollout(setup.sampler, programs, setup.params, plan.rollout_sampling(setup))
    lower_s = time.perf_counter() - started
    programs = {}
    for name, program in lowered.items():
        started = time.perf_counter()
        program.compile()
        programs[name] = round(time.perf_counter() - started, 2)
    rows, prompt, new_tokens = plan.rollout_shape(setup)
    return {"depth": depth, "build_s": round(build_s, 2), "lower_s_all_programs": round(lower_s, 2),
            "compile_s": programs,
            "params": int(setup.model_config.num_params()), "rows": rows, "prompt": prompt,
            "new_tokens": new_tokens}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parser().parse_args(argv)
    import jax

    from mage_jax import config as C

    jax.config.update("jax_enable_compilation_cache", False)  # every compile a real one
    overrides: dict[str, Any] = dict(C.parse_assignment(item) for item in args.set)
    depths = sorted(set(args.depths))
    load_before = load_average()
    started = time.perf_counter()
    results: dict[str, list[dict[str, Any]]] = {}
    ratios: dict[str, dict[str, float]] = {}
    for layout in args.layouts:
        results[layout] = [measure(args.env, args.preset, d, LAYOUTS[layout], overrides) for d in depths]
        shallow, deep = results[layout][0]["compile_s"], results[layout][-1]["compile_s"]
        ratios[layout] = {name: round(deep[name] / shallow[name], 2) for name in deep}
    target = {name: ratio <= TARGET_RATIO for name, ratio in ratios.get("scanned", {}).items()}
    report = {
        "benchmark": "compile_depth",
        "command": "python -m experiments.benchmarks.compile_depth",
        "env": args.env, "preset": args.preset, "overrides": overrides, "depths": depths,
        "device": str(jax.devices()[0].platform),
        "results": results,
        "deep_over_shallow": ratios,
        "target": {"scanned_deep_within_2x_of_shallow": target},
    }
    return write_timed_report(report, args.out, load_before=load_before, started=started)


if __name__ == "__main__":
    main()
