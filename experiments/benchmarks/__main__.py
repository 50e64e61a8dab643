"""The benchmarks and what each is for: ``python -m experiments.benchmarks`` prints this index.

Every benchmark is a script that prints JSON and writes it to ``--out`` (``python -m
experiments.benchmarks.NAME --help``); none is a timed test (``tests/experiments/benchmarks/`` runs each
entry point at a tiny size). A *tool* is run again whenever its part of the code changes, and its numbers
are the ones the docs and the README quote; a *study* answered one question, its doc records the answer,
and it is kept to reproduce those numbers. Finished studies whose answer has landed are retired (the
docs say where their history is).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Benchmark:
    name: str
    kind: str  # "tool" or "study"
    what: str
    doc: str


BENCHMARKS = (
    Benchmark("accelerator", "tool", "correctness and speed of the accelerator paths on one GPU or TPU in "
              "about five minutes (train step, decode, rollout, real model)", "docs/performance.md"),
    Benchmark("train_step", "tool", "our jitted update against the equivalent PyTorch step on the same "
              "weights (CPU)", "docs/performance.md"),
    Benchmark("generation", "tool", "our sampler against Hugging Face generate, prefill and decode apart "
              "(CPU)", "docs/performance.md"),
    Benchmark("rollout", "tool", "the rollout engine against lockstep generation on uneven multi-turn "
              "responses", "docs/rollout_engine.md"),
    Benchmark("rollout_host", "tool", "the host side of a rollout (runner, tokenization, automata, engine "
              "scheduling) over stand-in device programs", "docs/rollout_engine.md"),
    Benchmark("iteration", "tool", "one training iteration of a preset on a real model folder, phase by "
              "phase (rollout, log-prob passes, updates): wall, CPU and compile seconds", "docs/results.md"),
    Benchmark("decode_layout", "tool", "decoding with the blocks under a scan against unrolled blocks",
              "docs/performance.md"),
    Benchmark("startup", "tool", "the main job cold and warm: wall seconds, programs compiled, cache hits",
              "docs/performance.md"),
    Benchmark("env_step", "tool", "stepping and prompt rendering per lockstep turn of 128 meta-episodes, "
              "every environment and opponent", "docs/performance.md"),
    Benchmark("single_agent_step", "tool", "WebShop and ALFWorld: per-turn step and render cost of 64 "
              "meta-episodes, and stepping in worker processes against in process", "docs/performance.md"),
    Benchmark("attention_memory", "study", "per-device memory of the paper preset's programs by attention "
              "implementation, remat and micro-batches (ahead-of-time compiles)", "docs/attention.md"),
    Benchmark("compile_depth", "study", "compile time of the generation programs against depth, scanned "
              "and unrolled blocks", "docs/performance.md"),
)
"""Every runnable benchmark of this package."""

SUPPORT = {
    "common": "the command lines, machine description and JSON reports every benchmark shares",
    "accelerator_stages": "the accelerator check's stages other than correctness",
    "accelerator_correctness": "the accelerator check's correctness stage",
    "stand_in_device": "slot programs that book time instead of running (rollout_host's device)",
}
"""The modules that are not benchmarks themselves."""


def index() -> str:
    """The index as text: one line per benchmark, then the support modules."""
    width = max(len(name) for name in [*(b.name for b in BENCHMARKS), *SUPPORT])
    lines = ["python -m experiments.benchmarks.NAME --help   (JSON to --out; tool: rerun on changes, "
             "study: reproduces its doc's numbers)", ""]
    lines += [f"  {b.name:<{width}}  {b.kind:<5}  {b.what} ({b.doc})" for b in BENCHMARKS]
    lines += ["", "support modules:"] + [f"  {name:<{width}}  {what}" for name, what in SUPPORT.items()]
    return "\n".join(lines)


if __name__ == "__main__":
    print(index())
