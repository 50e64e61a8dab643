"""Where the time of one train step goes: our compiled programs per HLO instruction, PyTorch per operator.

    python -m experiments.benchmarks.train_step_profile [--threads 1] [--steps 2]
        [--out runs/benchmarks/train_step_profile.json]

Same model, batch and steps as ``experiments.benchmarks.train_step``. Ours: ``jax.profiler`` traces
``--steps`` warm updates with XLA's per-thunk trace events switched on
(``--xla_cpu_enable_xprof_traceme``); each event names the HLO instruction it ran, and the
instruction's line in the optimised HLO gives its kind (a library dot fusion, a loop fusion, a copy,
...). PyTorch: ``torch.profiler`` over the same number of steps, self CPU time per operator. Both are
grouped into coarse categories (matrix products, attention softmax, elementwise / reductions, copies and
transposes, optimizer) so the two sides can be compared line by line; the top instructions / operators
are listed as they are. Prints JSON and writes it to ``--out``.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import tempfile
from typing import Any

from experiments.benchmarks.common import (
    QWEN3_SHAPES,
    build_hf_checkpoint,
    load_average,
    model_parser,
    pinned_threads,
    write_model_report,
)
from experiments.benchmarks.train_step import build_ours, build_torch, make_batch

_TRACE_FLAG = "--xla_cpu_enable_xprof_traceme=true"


def _hlo_lines(compiled_texts: list[str]) -> dict[str, str]:
    """HLO instruction name -> its line in the optimised module text."""
    lines = {}
    for text in compiled_texts:
        for line in text.splitlines():
            match = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=", line)
            if match:
                lines.setdefault(match.group(1), line.strip())
    return lines


def _category(line: str) -> str:
    """A coarse kind of an HLO instruction from its optimised line: its opcode, else the JAX operation
    it came from (the last part of its ``op_name``; a library fusion can hold a dot or a reduction)."""
    opcode = re.search(r"=\s*\S+\s+([\w\-]+)\(", line)
    opcode = opcode.group(1) if opcode else ""
    source = re.search(r'op_name="([^"]*)"', line)
    source = source.group(1).rsplit("/", 1)[-1] if source else ""
    if opcode in ("dot", "convolution") or "dot_general" in source:
        return "matrix products"
    if opcode in ("copy", "transpose") or source in ("transpose", "copy"):
        return "copies and transposes"
    if re.search(r"exp|log|softmax", source):
        return "exp / log (softmax, log-softmax, entropy)"
    if re.search(r"reduce|argmax|max|min|sum", source):
        return "reductions"
    if re.search(r"scatter|gather|slice|dynamic|pad|concatenate", source + opcode):
        return "gather / scatter / slices / pads"
    return "other elementwise"


_OPTIMIZER_FUNCTIONS = ("TrainStep._apply_fn", "global_norm", "all_finite")
"""Where the optimizer half of the fused update is traced (optax's own frames are not recorded: their
ops carry the frame of ``_apply_fn``, which calls the optimizer)."""


def _optimizer_ops(text: str) -> set[str]:
    """Names of the instructions of one optimised HLO module whose innermost stack frame (the module's
    ``StackFrames`` / ``FileLocations`` / ``FunctionNames`` tables) lies in the optimizer half of the
    update."""
    tables: dict[str, dict[int, str]] = {}
    current = None
    for line in text.splitlines():
        if re.fullmatch(r"[A-Z][A-Za-z]+\s*", line):
            current = tables.setdefault(line.strip(), {})
        elif current is not None and (row := re.match(r"(\d+) (.*)", line)):
            current[int(row.group(1))] = row.group(2)

    def ids(table: str, field: str) -> dict[int, int]:
        return {k: int(m.group(1)) for k, v in tables.get(table, {}).items()
                if (m := re.search(field + r"=(\d+)", v))}

    functions = {k: v.strip('"') for k, v in tables.get("FunctionNames", {}).items()}
    locations, frames = ids("FileLocations", "function_name_id"), ids("StackFrames", "file_location_id")
    ops = set()
    for found in re.finditer(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*stack_frame_id=(\d+)", text, re.M):
        function = functions.get(locations.get(frames.get(int(found.group(2)), -1), -1), "")
        if function.startswith(_OPTIMIZER_FUNCTIONS):
            ops.add(found.group(1))
    return ops


def _part(op: str, line: str, vocab: int, length: int, optimizer_ops: set[str]) -> str:
    """Which part of the step an instruction belongs to, from where it was traced and its output shape:
    the optimizer step (``optimizer_ops``), the output head (a vocabulary-sized dimension), attention
    (a [.., queries, keys] score-shaped array), or the rest of the layers (projections, MLP, norms,
    rotary, residuals)."""
    if op in optimizer_ops:
        return "optimizer step (clip + AdamW + skip)"
    shape = re.search(r"=\s*\w+\[([\d,]*)\]", line)
    dims = [int(d) for d in shape.group(1).split(",") if d] if shape else []
    if vocab in dims:
        return "output head (log-probs, entropy, their gradient)"
    if len(dims) >= 4 and dims[-1] == length and dims[-2] >= length:
        return "attention scores / probabilities"
    return "layers: projections, MLP, norms, rotary, attention outputs"


def profile_ours(run, steps: int, folder: str) -> list[dict[str, Any]]:
    import jax

    with jax.profiler.trace(folder, create_perfetto_trace=True):
        for _ in range(steps):
            run()
    path = glob.glob(os.path.join(folder, "**", "perfetto_trace.json.gz"), recursive=True)[0]
    with gzip.open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    per_op: dict[tuple[str, str], float] = collections.Counter()
    for event in events:
        args = event.get("args") or {}
        if event.get("ph") == "X" and "hlo_op" in args:
            per_op[(args.get("hlo_module", ""), args["hlo_op"])] += event.get("dur", 0.0) / 1e6 / steps
    return [{"module": m, "op": o, "seconds": s} for (m, o), s in per_op.items()]


def profile_torch(run, steps: int) -> list[dict[str, Any]]:
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            run()
    rows = []
    for item in prof.key_averages():
        rows.append({"op": item.key, "seconds": item.self_cpu_time_total / 1e6 / steps,
                     "calls": item.count // steps})
    return rows


def _torch_category(op: str) -> str:
    if re.search(r"mm|matmul|linear|addmm|bmm|_mkl|dot", op):
        return "matrix products"
    if re.search(r"attention|sdpa|flash", op):
        return "attention kernels"
    if re.search(r"exp|log|softmax", op):
        return "exp / log (softmax, log-softmax, entropy)"
    if re.search(r"copy|clone|contiguous|transpose|permute|cat|_to_copy", op):
        return "copies and transposes"
    if re.search(r"adam|foreach|lerp|addcmul|addcdiv|sqrt|norm", op):
        return "optimizer and norms"
    if re.search(r"sum|mean|max|min|reduce", op):
        return "reductions"
    if re.search(r"gather|scatter|index|embedding|slice", op):
        return "gather / scatter / slices"
    return "other elementwise"


def _group(rows: list[dict[str, Any]], key) -> dict[str, float]:
    groups: dict[str, float] = collections.Counter()
    for row in rows:
        groups[key(row)] += row["seconds"]
    return {k: float(f"{v:.4g}") for k, v in sorted(groups.items(), key=lambda kv: -kv[1])}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = model_parser(__doc__, out="runs/benchmarks/train_step_profile.json")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.rows < 1 or not 1 < args.prompt_len < args.length:
        parser.error("--steps and --rows must be positive and 1 < --prompt-len < --length")
    shape = QWEN3_SHAPES[args.shape]
    load_before = load_average()
    with tempfile.TemporaryDirectory() as folder:
        dump = os.path.join(folder, "hlo")
        dump_flags = (f"--xla_dump_to={dump} --xla_dump_hlo_as_text "
                      "--xla_dump_hlo_module_re=.*update_fn.*")
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_TRACE_FLAG} {dump_flags}".strip()
        report = _profile(args, shape, folder, dump)
    return write_model_report("train_step_profile", report, args.out, load_before=load_before)


def _profile(args: argparse.Namespace, shape: dict[str, Any], folder: str, dump: str) -> dict[str, Any]:
    with pinned_threads(args.threads) as threads:
        hf_model = build_hf_checkpoint(folder, shape, args.seed)
        batch = make_batch(args.rows, args.length, args.prompt_len, shape["vocab_size"], args.seed)
        ours, old_logprobs, _ = build_ours(folder, batch)
        theirs, _ = build_torch(hf_model, batch, old_logprobs)
        ours()
        ours()
        theirs()
        our_rows = profile_ours(ours, args.steps, os.path.join(folder, "trace"))
        torch_rows = profile_torch(theirs, args.steps)
    texts = []
    for path in glob.glob(os.path.join(dump, "*after_optimizations.txt")):
        with open(path, encoding="utf-8") as f:
            texts.append(f.read())
    lines = _hlo_lines(texts)
    optimizer_ops = set().union(*(_optimizer_ops(text) for text in texts))
    for row in our_rows:
        row["hlo"] = lines.get(row["op"], "")[:400]
        row["category"] = _category(row["hlo"])
        row["part"] = _part(row["op"], row["hlo"], shape["vocab_size"], args.length, optimizer_ops)
    our_rows.sort(key=lambda r: -r["seconds"])
    torch_rows.sort(key=lambda r: -r["seconds"])
    report = {
        "model": {"architecture": "qwen3", **shape},
        "batch": {"rows": args.rows, "length": args.length, "prompt_len": args.prompt_len},
        "steps": args.steps,
        "threads": threads,
        "ours": {
            "seconds_per_step": round(sum(r["seconds"] for r in our_rows), 3),
            "by_program": _group(our_rows, lambda r: r["module"]),
            "by_category": _group(our_rows, lambda r: r["category"]),
            "by_part": _group(our_rows, lambda r: r["part"]),
            "top": [{**r, "seconds": round(r["seconds"], 4)} for r in our_rows[:args.top]],
        },
        "torch": {
            "seconds_per_step": round(sum(r["seconds"] for r in torch_rows), 3),
            "by_category": _group(torch_rows, lambda r: _torch_category(r["op"])),
            "top": [{**r, "seconds": round(r["seconds"], 4)} for r in torch_rows[:args.top]],
        },
    }
    return report


if __name__ == "__main__":
    main()
