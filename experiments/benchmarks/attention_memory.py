"""Per-device memory of the ``paper`` Kuhn Poker preset's programs, by ahead-of-time compilation.

Builds exactly what the trainer builds for the preset (Qwen3-4B layout as read from a Hugging Face
config: float32 parameters, bfloat16 activations, mesh fsdp over every device) with *abstract*
parameters, lowers and compiles the train step's gradient program, the log-prob recompute and the
sampler (prefill + decode loop), and reads ``compiled.memory_analysis()``. Nothing is allocated, so
it runs on CPU; with ``--devices 8`` the 8 devices are fake CPU devices
(``--xla_force_host_platform_device_count``), set before JAX is imported, and XLA:CPU uses its
memory-minimising schedule (``experiments.plan.CPU_MEMORY_FLAGS``). The programs are built by
``experiments.plan`` (the preset's scale plan for every hardware); this benchmark varies attention,
remat and micro-batches around them.

Compiling 36 layers at 12k tokens is slow, so each program is compiled at ``--layers`` (default 3 and
4) and extrapolated linearly to the full depth: peak(L) = peak(4) + (L - 4) * (peak(4) - peak(3)). The
first blocks are not typical (depth 1 -> 2 grows more than any later step), hence 3 and 4.

    python -m experiments.benchmarks.attention_memory --devices 8 --out runs/bench/attention_memory.json

prints a Markdown table (before = dense attention without rematerialisation, as the code was; after =
the preset's attention and remat policy) and writes the JSON report.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence
from typing import Any

from experiments import plan

GB = 1e9
H100_BYTES = 80 * GB


def paper_setup(num_layers: int, devices: int, *, attention: str | None = None, remat: str | None = None,
                micro_batch_rows: int | None = None) -> plan.Setup:
    """The Kuhn Poker ``paper`` preset at ``num_layers`` layers as the plan builds it (attention / remat /
    the train step's micro-batch rows: the preset's unless given)."""
    overrides: dict[str, Any] = {}
    if micro_batch_rows is not None:
        overrides["optim.micro_batch_rows"] = micro_batch_rows
    model = dict(plan.preset_config("kuhn_poker", "paper").model.overrides)
    if attention is not None:
        model["attention"] = attention
    if remat is not None:
        model["remat"] = remat
    overrides["model.overrides"] = model
    cfg = plan.preset_config("kuhn_poker", "paper", overrides)
    return plan.make_setup(cfg, devices, num_layers=num_layers)


def program_memory(program: str, layers: Sequence[int], *, length: int, rows: int, attention: str | None,
                   remat: str | None, prompt: int = 0, micro_batch_rows: int | None = None,
                   devices: int = 8) -> dict[str, Any]:
    """Compile ``program`` at each depth in ``layers`` and extrapolate its per-device bytes to full depth."""
    from mage_jax.models.attention import choose_implementation
    from mage_jax.models.config import ModelConfig

    full_depth = ModelConfig.preset("qwen3-4b").num_layers
    measured = {}
    started = time.perf_counter()
    setup = None
    for n in layers:
        setup = paper_setup(n, devices, attention=attention, remat=remat, micro_batch_rows=micro_batch_rows)
        if program == "train_grads":
            compiled = plan.compile_train_grads(setup, rows, length)
        elif program == "logprobs":
            compiled = plan.compile_logprobs(setup, rows, length)
        elif program == "sampler":
            sampling = dataclasses.replace(plan.rollout_sampling(setup), max_new_tokens=length - prompt)
            compiled = setup.sampler.lower(setup.params, sampling, rows=rows, prompt_len=prompt).compile()
        else:
            raise ValueError(f"unknown program {program!r}")
        measure = plan.ProgramMeasure.of(compiled, "cpu").as_dict()
        measured[n] = {k: v for k, v in measure.items() if isinstance(v, (int, float))}  # bytes and FLOPs
    lo, hi = min(layers), max(layers)
    per_layer = {k: (measured[hi][k] - measured[lo][k]) / max(hi - lo, 1) for k in measured[lo]}
    extrapolated = {k: measured[hi][k] + (full_depth - hi) * per_layer[k] for k in measured[hi]}
    devices = setup.mesh.size
    mc = setup.model_config
    query_len = prompt if program == "sampler" else length  # the sampler's self-attention is its prefill
    chosen = choose_implementation(mc.attention, query_len, mc.jnp_dtype,
                                   dense_max_len=mc.attention_dense_max_len, platform="cpu")
    return {
        "program": program, "attention": chosen, "remat": mc.remat,
        "micro_batch_rows": setup.step.config.micro_batch_rows if program == "train_grads" else 0,
        "length": length, "prompt": prompt, "rows": rows, "rows_per_device": rows // devices,
        "devices": devices, "layers_compiled": list(layers), "full_depth": full_depth,
        "measured": {str(n): v for n, v in measured.items()}, "per_layer": per_layer,
        "extrapolated": extrapolated, "compile_s": round(time.perf_counter() - started, 1),
    }


def _table(results: list[dict[str, Any]]) -> str:
    lines = ["| program | variant | T | rows (per device) | peak / device, 36 layers | per layer | temp "
             "| fits 80 GB |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        peak = r["extrapolated"]["peak"]
        micro = f", micro-batch {r['micro_batch_rows']}" if r["micro_batch_rows"] else ""
        lines.append(
            f"| {r['program']} | {r['variant']} ({r['attention']}, remat {r['remat']}{micro}) | "
            f"{r['length']} | {r['rows']} ({r['rows_per_device']}) | {peak / GB:,.1f} GB | "
            f"{r['per_layer']['peak'] / GB:,.2f} GB | {r['extrapolated']['temp'] / GB:,.1f} GB | "
            f"{'yes' if peak < H100_BYTES else 'no'} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/bench/attention_memory.json")
    parser.add_argument("--devices", type=int, default=8, help="fake CPU devices (the mesh's fsdp axis)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 12288])
    parser.add_argument("--layers", type=int, nargs="+", default=[3, 4],
                        help="depths compiled; the first block differs, so extrapolate from the last two")
    parser.add_argument("--programs", nargs="+", default=["train_grads", "logprobs", "sampler"])
    parser.add_argument("--train-rows", type=int, default=64, help="optim.mini_batch_rows of the preset")
    parser.add_argument("--sampler-rows", type=int, default=128, help="num_tasks x group_size of the preset")
    parser.add_argument("--variants", nargs="+", default=["before", "whole", "after"],
                        choices=["before", "whole", "after"])
    args = parser.parse_args(argv)
    plan.force_cpu_devices(args.devices)

    from experiments.benchmarks.common import machine, write_report

    # before: dense attention, no remat, whole mini-batch (the code as it was); whole: the preset's
    # attention and remat on the whole mini-batch; after: the preset's settings, micro-batches included.
    variants = {"before": ("dense", "none", 0), "whole": (None, None, 0), "after": (None, None, None)}
    results = []
    for program in args.programs:
        for length in args.lengths:
            for variant in args.variants:
                attention, remat, micro = variants[variant]
                rows = args.sampler_rows if program == "sampler" else args.train_rows
                prompt = length // 3 if program == "sampler" else 0  # the paper's 4096 : 8192 split
                r = program_memory(program, args.layers, length=length, rows=rows, attention=attention,
                                   remat=remat, prompt=prompt, micro_batch_rows=micro, devices=args.devices)
                r["variant"] = variant
                results.append(r)
                print(f"{program} T={length} {variant}: {r['extrapolated']['peak'] / GB:,.1f} GB per device "
                      f"({r['compile_s']} s)", file=sys.stderr, flush=True)
    print(_table(results), file=sys.stderr)
    command = "python -m experiments.benchmarks.attention_memory " + " ".join(argv or sys.argv[1:])
    write_report({"benchmark": "attention_memory", "command": command.strip(), "results": results,
                  "table": _table(results), "machine": machine()}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
