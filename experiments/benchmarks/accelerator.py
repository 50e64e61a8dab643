"""Accelerator check: one command that shows, in about five minutes on one GPU, whether the accelerator
paths are right and fast, and leaves its numbers behind even when it is cut off.

    python -m experiments.benchmarks.accelerator [--out runs/benchmarks/accelerator.json]
        [--stages environment,correctness,train,decode,rollout,decode_layout,real_model] [--tiny]
        [--model-path DIR]

Stages, in this order (``experiments.benchmarks.accelerator_stages``; the correctness stage in
``accelerator_correctness``):

1. ``environment``: devices, versions, the measured bf16 matmul rate and copy bandwidth (the ceilings the
   later figures are divided by);
2. ``correctness``: our decoder against Hugging Face PyTorch on the same device (random Qwen3 and Llama,
   float32 and bfloat16: logits, greedy tokens), every attention implementation this platform runs
   (cuDNN on a GPU, splash on a TPU, blockwise and prefix everywhere) against dense with padding and
   packed segments, and the engine's greedy Kuhn Poker rollout against lockstep;
3. ``train``: a Qwen3-0.6B-shaped step (bf16, remat as the ``small`` presets) against the same PyTorch
   step, interleaved; MFU against the measured matmul rate;
4. ``decode``: the rollout engine's decode rate at 64 rows, its bytes per step against the measured copy
   bandwidth, Hugging Face ``generate`` as the peer;
5. ``rollout``: engine against lockstep at uneven lengths (``experiments.benchmarks.rollout``, scaled up);
6. ``decode_layout``: the engine's decode with the blocks scanned (the pretrained presets' default)
   against unrolled, 8 layers of Qwen3-0.6B at 2048-token prompts (``experiments.benchmarks.decode_layout``;
   on the CPU the scanned one decodes at 0.4-0.5x, docs/performance.md);
7. ``real_model`` (only with ``--model-path``): a few MAGE iterations of Kuhn Poker on that folder.

After every stage the whole report is rewritten atomically to ``--out`` (JSON) and beside it (``.md``,
the table of targets), so a run killed by a time limit keeps every finished stage; a stage that raises
records its error and the run goes on. ``--tiny`` runs every stage at toy sizes (a CPU test). Targets are
recorded as met or not, never asserted. Exit status: 0 when every stage finished, 1 when one recorded an
error, 2 for a bad command line (one ``error:`` line, nothing written).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from experiments import targets
from experiments.benchmarks import accelerator_stages as stages
from experiments.benchmarks.accelerator_correctness import correctness
from experiments.benchmarks.accelerator_stages import DEFAULT, TINY, StageInput
from experiments.targets import Hardware

STAGES: dict[str, Callable[[StageInput], dict[str, Any]]] = {
    "environment": stages.environment,
    "correctness": correctness,
    "train": stages.train,
    "decode": stages.decode,
    "rollout": stages.rollout_stage,
    "decode_layout": stages.decode_layout_stage,
    "real_model": stages.real_model,
}
"""The stages in the order they run."""

EXIT_BAD_COMMAND = 2


class CommandError(ValueError):
    """A bad command line: one ``error:`` line, exit status 2, nothing written."""


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/benchmarks/accelerator.json",
                        help="the JSON report (the markdown table goes beside it, .md)")
    parser.add_argument("--stages", default=None,
                        help="comma-separated subset, run in the fixed order (default: all; real_model only "
                             "with --model-path)")
    parser.add_argument("--tiny", action="store_true", help="toy sizes for every stage (a CPU test)")
    parser.add_argument("--model-path", default=None, help="a local Hugging Face folder for real_model")
    args = parser.parse_args(argv)
    args.stages = select_stages(args.stages, args.model_path)
    if args.model_path is not None and not Path(args.model_path, "config.json").is_file():
        raise CommandError(f"--model-path {args.model_path!r} holds no config.json")
    return args


def select_stages(text: str | None, model_path: str | None) -> list[str]:
    """The stages named by ``--stages`` in their fixed order; unknown names are a ``CommandError``."""
    if text is None:
        return [name for name in STAGES if name != "real_model" or model_path is not None]
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in STAGES]
    if unknown or not names:
        raise CommandError(f"unknown stage(s) {', '.join(map(repr, unknown)) or '(none given)'} in --stages; "
                           f"known: {', '.join(STAGES)}")
    if "real_model" in names and model_path is None:
        raise CommandError("stage real_model needs --model-path DIR (a local Hugging Face folder)")
    return [name for name in STAGES if name in names]


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` by ``text`` in one step (a reader or a kill never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def table_path(out: Path) -> Path:
    return out.with_suffix(".md")


def run_stages(names: Sequence[str], given: StageInput, out: Path, header: Mapping[str, Any],
               stages: Mapping[str, Callable[[StageInput], dict[str, Any]]] = STAGES) -> dict[str, Any]:
    """Run ``names`` in order; after each, rewrite the whole report (JSON at ``out``, table beside it).
    A stage that raises is recorded with its error and the next one runs."""
    report: dict[str, Any] = {**header, "stages": {}}
    for name in names:
        start = time.perf_counter()
        try:
            entry = {"status": "ok", **stages[name](given)}
        except Exception as error:  # noqa: BLE001 - recorded, and the run goes on
            entry = {"status": "error", "error": f"{type(error).__name__}: {error}".splitlines()[0],
                     "traceback": traceback.format_exc().splitlines()[-12:]}
        entry["seconds"] = round(time.perf_counter() - start, 2)
        report["stages"][name] = entry
        given.prior[name] = entry
        write_atomic(out, json.dumps(report, indent=2, default=str) + "\n")
        write_atomic(table_path(out), markdown(report))
        print(f"[accelerator] {name}: {entry['status']} in {entry['seconds']} s", file=sys.stderr, flush=True)
    return report


# ---------------------------------------------------------------------------- targets and the table
@dataclasses.dataclass(frozen=True)
class TargetRow:
    """One line of the table: what was measured and, where the issue sets one, the target and whether
    it is met (None: no target, or not measured)."""

    stage: str
    measured: str
    target: str = ""
    met: bool | None = None
    predicted: str = ""
    """The roofline of the same work at the device's data-sheet rates (``predict_train``,
    ``predict_decode``): what the first run on a device compares its measurement with."""


def _fmt(value: float | None, spec: str = ".3g", suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def _at_least(value: float | None, goal: float) -> bool | None:
    return None if value is None else value >= goal


REMAT_RECOMPUTE = {"full": 2.0}
"""Per remat policy: the FLOPs per parameter and token its backward pass recomputes (a full remat runs
the forward again: 2 N beside the 6 N of forward and backward)."""


def device_hardware(stages: Mapping[str, Mapping[str, Any]]) -> Hardware | None:
    """The data sheet of the device the environment stage found (None: a CPU or an unknown device)."""
    kind = stages.get("environment", {}).get("device_kind")
    return targets.hardware_for_device_kind(kind) if kind else None


def predict_train(stage: Mapping[str, Any], hardware: Hardware) -> dict[str, float] | None:
    """The train step's roofline on ``hardware``: its FLOPs (6 N per token and the remat's recomputation)
    at the dense bf16 peak. The MFU bound is 6 N over what the step computes (0.75 under full remat)."""
    if "flops_per_step" not in stage or "tokens_per_step" not in stage:
        return None
    params = stage["flops_per_step"] / (6.0 * stage["tokens_per_step"])
    remat = stage.get("ours", {}).get("remat")
    flops = stage["flops_per_step"] + REMAT_RECOMPUTE.get(remat, 0.0) * params * stage["tokens_per_step"]
    seconds = flops / hardware.bf16_flops
    return {"seconds": seconds, "tokens_per_s": stage["tokens_per_step"] / seconds,
            "mfu": stage["flops_per_step"] / flops}


def predict_decode(stage: Mapping[str, Any], hardware: Hardware) -> dict[str, float] | None:
    """The decode step's roofline on ``hardware``: the least bytes a step reads (parameters and the live
    KV cache) at the memory bandwidth; tokens per second are the rows over that time."""
    if "bytes_per_step" not in stage:
        return None
    seconds = stage["bytes_per_step"] / hardware.bandwidth
    return {"seconds": seconds, "tokens_per_s": stage["rows"] / seconds}


def _measured_share(measured: float | None, predicted: float) -> str:
    return "" if measured is None else f"; measured {measured / predicted:.2f} of it"


def target_rows(stages: Mapping[str, Mapping[str, Any]]) -> list[TargetRow]:
    """The table's lines, from the stages' results (stages that failed give their error), each with the
    roofline prediction of its device's data sheet where one applies."""
    rows = []
    hardware = device_hardware(stages)
    for name, s in stages.items():
        if s.get("status") != "ok":
            rows.append(TargetRow(name, f"error: {s.get('error', '?')}", "finishes", False))
        elif name == "environment":
            sheet = ("" if hardware is None else f"data sheet ({hardware.name}): "
                     f"{hardware.bf16_flops / 1e12:,.0f} TFLOP/s dense bf16, "
                     f"{hardware.bandwidth / 1e9:,.0f} GB/s")
            rows.append(TargetRow(name, f"{s['device_kind']} ({s['backend']}): bf16 matmul "
                                        f"{_fmt(s['matmul_bf16_tflops'])} TFLOP/s, copy "
                                        f"{_fmt(s['copy_gbps'])} GB/s", predicted=sheet))
        elif name == "correctness":
            passed = sum(c["pass"] for c in s["checks"])
            failed = [c["name"] for c in s["checks"] if not c["pass"]]
            text = f"{passed} / {len(s['checks'])} checks pass"
            text += f" (failed: {', '.join(failed)})" if failed else ""
            rows.append(TargetRow(name, text, "all pass", bool(s["all_pass"])))
        elif name == "train":
            mfu, ratio = s["ours"]["mfu"], (s["ratio_ours_over_torch"] or {}).get("median")
            roof = None if hardware is None else predict_train(s, hardware)
            predicted = "" if roof is None else (
                f"{roof['seconds']:.3g} s / step, {roof['tokens_per_s']:,.0f} tok/s, MFU {roof['mfu']:.2f}"
                + _measured_share(s["ours"].get("tokens_per_s"), roof["tokens_per_s"]))
            rows.append(TargetRow(name, f"MFU {_fmt(mfu)} of measured bf16 matmul "
                                        f"({_fmt(s['ours']['tokens_per_s'], '.0f')} tok/s)", "MFU >= 0.45",
                                  _at_least(mfu, 0.45), predicted))
            rows.append(TargetRow(name, f"{_fmt(ratio)}x PyTorch tok/s "
                                        f"({_fmt(s['torch'].get('tokens_per_s'), '.0f')} tok/s)", ">= 1.0x",
                                  _at_least(ratio, 1.0)))
        elif name == "decode":
            fraction, ratio = s["fraction_of_copy_bandwidth"], s["decode_ratio_ours_over_hf"]
            rate = (s["ours"]["decode_tokens_per_s"] or {}).get("median")
            roof = None if hardware is None else predict_decode(s, hardware)
            predicted = "" if roof is None else (
                f"{roof['seconds'] * 1e3:.3g} ms / step, {roof['tokens_per_s']:,.0f} tok/s"
                + _measured_share(rate, roof["tokens_per_s"]))
            rows.append(TargetRow(name, f"{_fmt(fraction)} of copy bandwidth at {s['rows']} rows "
                                        f"({_fmt(rate, '.0f')} tok/s)", ">= 0.6 at 64 rows",
                                  _at_least(fraction, 0.6) if s["rows"] == 64 else None, predicted))
            rows.append(TargetRow(name, f"{_fmt(ratio)}x HF generate decode tok/s", ">= 2x",
                                  _at_least(ratio, 2.0)))
        elif name == "decode_layout":
            ratio = _fmt(s["scanned_over_unrolled"])
            rows.append(TargetRow(name, f"scanned blocks decode at {ratio}x the unrolled rate ({s['path']}, "
                                        f"{s['layers']} layers, {s['batch']} rows, {s['prompt_len']}-token "
                                        f"prompts), greedy identical {s['greedy_identical']}"))
        elif name == "rollout":
            useful = s["useful_decode_fraction"]["engine"]
            met = _at_least(s["speedup"], 3.0) and _at_least(useful, 0.8)
            rows.append(TargetRow(name, f"engine {_fmt(s['speedup'])}x lockstep, useful decode "
                                        f"{_fmt(useful)}, {s['compiles_after_warmup']} compiles after "
                                        f"warm-up, greedy identical {s['greedy_identical']}",
                                  ">= 3x with >= 0.8 useful", met))
        elif name == "real_model":
            last = s["iterations"][-1]["payoff_by_episode"]
            rows.append(TargetRow(name, f"{s['seconds_per_iteration']} s / iteration; payoff by episode "
                                        f"(last iteration) {[round(p, 3) for p in last]}"))
    return rows


def markdown(report: Mapping[str, Any]) -> str:
    env = report["stages"].get("environment", {})
    device = env.get("device_kind", "device not recorded")
    lines = [f"Accelerator check ({report['sizes']} sizes) on {device}, {report['started']}"]
    if env.get("versions"):
        lines.append(", ".join(f"{name} {version}" for name, version in env["versions"].items() if version))
    lines += ["", "| stage | measured | predicted | target | met |", "|---|---|---|---|---|"]
    for row in target_rows(report["stages"]):
        met = {True: "yes", False: "no", None: ""}[row.met]
        lines.append(f"| {row.stage} | {row.measured} | {row.predicted} | {row.target} | {met} |")
    hardware = device_hardware(report["stages"])
    lines.append("" if hardware is None else
                 f"\nPredicted: rooflines at the {hardware.name} data sheet's dense bf16 rate and memory "
                 "bandwidth (experiments/targets.py), not measurements.")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    try:
        args = parse_args(argv)
    except CommandError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_COMMAND) from None
    # JAX and PyTorch share the GPU: JAX allocates on demand instead of taking 75 % up front. Read when
    # JAX starts its GPU client (the first stage), so setting it here is in time.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    header = {"benchmark": "accelerator",
              "command": " ".join(["python -m experiments.benchmarks.accelerator", *(argv or sys.argv[1:])]),
              "sizes": "tiny" if args.tiny else "default",
              "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "sizes_used": dataclasses.asdict(TINY if args.tiny else DEFAULT)}
    out = Path(args.out)
    with tempfile.TemporaryDirectory(prefix="accelerator_") as scratch:
        given = StageInput(TINY if args.tiny else DEFAULT, {}, args.model_path, scratch)
        report = run_stages(args.stages, given, out, header)
    print(markdown(report))
    print(f"JSON: {out}  table: {table_path(out)}")
    return report


def exit_status(report: Mapping[str, Any]) -> int:
    """0 when every stage finished, 1 when one recorded an error."""
    return 0 if all(s["status"] == "ok" for s in report["stages"].values()) else 1


if __name__ == "__main__":
    sys.exit(exit_status(main()))
