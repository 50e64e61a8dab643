"""The stages of the accelerator check (``experiments.benchmarks.accelerator``) other than correctness
(``accelerator_correctness``), their sizes and their input: each takes the run's ``StageInput`` and
returns its JSON-ready result, or raises.

PyTorch and ``transformers`` are imported by the stages that compare with them, when they run: a host
without them still runs the others. (Importing JAX does not start its GPU client; the first computation
does, after ``accelerator.main`` has set the allocator's environment.)"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from experiments.benchmarks import decode_layout, generation, rollout, train_step
from experiments.benchmarks.common import build_hf_checkpoint, spread
from mage_jax.evaluation.metrics import episode_key
from mage_jax.models.config import ModelConfig

SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings")
QWEN3_0_6B = {k: v for k, v in ModelConfig.preset("qwen3-0.6b").to_hf_config().items() if k in SHAPE_KEYS}
"""Qwen3-0.6B's shape (the ``qwen3-0.6b`` preset, random weights): what the `small` presets train."""
TOY = dict(
    # The --tiny stand-in: a few layers, a small vocabulary.
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=True,
)
SMALL_REMAT = "full"
"""The remat of the `small` presets (``experiments.presets._pretrained``; docs/attention.md)."""


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Every size the stages use: ``DEFAULT`` fits about five minutes on one H100, ``TINY`` a CPU test."""

    matmul_size: int
    copy_mib: int
    timing_repeats: int
    check_rows: int
    check_length: int
    greedy_tokens: int
    attention_length: int
    attention_head_dim: int
    train_model: Mapping[str, Any]
    train_rows: int
    train_length: int
    train_prompt_len: int
    train_repeats: int
    decode_model: Mapping[str, Any]
    decode_rows: int
    decode_prompt_len: int
    decode_new_tokens: int
    decode_chunk: int
    decode_repeats: int
    layout_args: tuple[str, ...]
    rollout_args: tuple[str, ...]
    real_model_overrides: Mapping[str, Any]


DEFAULT = Sizes(
    matmul_size=8192, copy_mib=1024, timing_repeats=5,
    check_rows=8, check_length=128, greedy_tokens=16, attention_length=1024, attention_head_dim=128,
    train_model=QWEN3_0_6B, train_rows=4, train_length=2048, train_prompt_len=1024, train_repeats=4,
    decode_model=QWEN3_0_6B, decode_rows=64, decode_prompt_len=512, decode_new_tokens=256, decode_chunk=16,
    decode_repeats=2,
    layout_args=("--path", "engine", "--model", "qwen3-0.6b", "--layers", "8", "--dtype", "bfloat16",
                 "--batch", "64", "--prompt-len", "2048", "--new-tokens", "64", "--repeats", "2"),
    rollout_args=("--model", "qwen3-0.6b", "--dtype", "bfloat16", "--rows", "128", "--group", "8",
                  "--turns", "3", "--median", "48", "--p90", "240", "--cap", "768", "--slots", "64",
                  "--chunk", "16", "--repeats", "1"),
    real_model_overrides={
        "train.iterations": 2, "rollout.num_tasks": 4, "rollout.group_size": 4, "train.eval_every": 0,
        "train.validate_every": 0, "train.eval_meta_episodes": 8, "train.eval_heldout_meta_episodes": 8,
        "checkpoint.every": 0, "logging.plots": False, "logging.progress": False,
        "train.stop_when_all_invalid": False,  # the stage times iterations; it does not judge the model
    },
)
TINY = Sizes(
    matmul_size=256, copy_mib=4, timing_repeats=2,
    check_rows=3, check_length=16, greedy_tokens=4, attention_length=48, attention_head_dim=16,
    train_model=TOY, train_rows=2, train_length=16, train_prompt_len=8, train_repeats=2,
    decode_model=TOY, decode_rows=4, decode_prompt_len=8, decode_new_tokens=6, decode_chunk=4,
    decode_repeats=1,
    layout_args=("--path", "engine", "--layers", "2", "--vocab", "64", "--batch", "2", "--prompt-len", "8",
                 "--new-tokens", "12", "--repeats", "2"),
    rollout_args=("--model", "tiny", "--rows", "4", "--group", "2", "--turns", "2", "--median", "3",
                  "--p90", "6", "--cap", "8", "--slots", "4", "--chunk", "4", "--slot-levels", "1",
                  "--repeats", "1"),
    real_model_overrides={
        "train.iterations": 1, "rollout.num_tasks": 2, "rollout.group_size": 2, "rollout.num_episodes": 2,
        "train.eval_num_episodes": 2, "train.eval_every": 0, "train.validate_every": 0,
        "train.eval_meta_episodes": 2,
        "rollout.max_response_tokens": 8, "rollout.max_reflection_tokens": 8, "rollout.max_turns": 2,
        "rollout.max_prompt_tokens": 1024, "checkpoint.every": 0, "logging.plots": False,
        "logging.progress": False, "train.stop_when_all_invalid": False,  # a random model writes no valid row
        "rollout.length_buckets": [1024], "train.eval_heldout_meta_episodes": 0,  # fewer programs to compile
    },
)


@dataclasses.dataclass
class StageInput:
    """What a stage gets: the sizes, the results of the stages before it (by name), the model folder of
    ``real_model`` and a scratch folder the run deletes at its end."""

    sizes: Sizes
    prior: dict[str, Any]
    model_path: str | None
    scratch: str
    folders: dict[str, str] = dataclasses.field(default_factory=dict)

    def checkpoint(self, name: str, shape: Mapping[str, Any]) -> str:
        """A random Qwen3 of ``shape`` saved once per run under ``scratch`` (train and decode share it)."""
        if name not in self.folders:
            folder = os.path.join(self.scratch, name)
            build_hf_checkpoint(folder, dict(shape), seed=0)
            self.folders[name] = folder
        return self.folders[name]

    def measured(self, field: str) -> float | None:
        """A ceiling measured by the environment stage (None when that stage did not run or failed)."""
        return self.prior.get("environment", {}).get(field)


# ---------------------------------------------------------------------------- helpers
def torch_device() -> str:
    """The device PyTorch compares on: the GPU JAX runs on, else the CPU."""
    import torch

    return "cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available() else "cpu"


def peer_device() -> str | None:
    """Where the PyTorch peer of a speed stage runs: the device JAX runs on (a GPU, or the CPU when JAX
    runs on the CPU). None where PyTorch cannot run there (a TPU, or a CPU-only PyTorch beside a GPU):
    a ratio against PyTorch on another device would measure the devices, not the code."""
    import torch

    backend = jax.default_backend()
    if backend == "cpu":
        return "cpu"
    return "cuda" if backend == "gpu" and torch.cuda.is_available() else None


def _no_peer() -> dict[str, str]:
    return {"skipped": f"PyTorch has no device on this {jax.default_backend()} host; "
                       "the peer runs only on the device JAX runs on"}


def best_seconds(fn: Callable[[], Any], repeats: int) -> float:
    """Best wall time of ``repeats`` calls of ``fn`` (which waits for its result), after one warm-up."""
    fn()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


# ---------------------------------------------------------------------------- 1. environment
VERSIONED = {"jax": "jax", "jaxlib": "jaxlib", "jax_cuda12_plugin": "jax-cuda12-plugin",
             "jax_cuda13_plugin": "jax-cuda13-plugin", "flax": "flax",
             "optax": "optax", "orbax": "orbax-checkpoint", "chex": "chex", "transformers": "transformers",
             "torch": "torch", "numpy": "numpy"}


def environment(given: StageInput) -> dict[str, Any]:
    """Devices, versions, and the two ceilings later figures are divided by: the bf16 matmul rate of a
    square product and the copy bandwidth of an elementwise pass over a large array (read + write)."""
    import jax.numpy as jnp

    sizes = given.sizes
    n = sizes.matmul_size
    keys = jax.random.split(jax.random.key(0))
    a, b = (jax.random.normal(k, (n, n), jnp.bfloat16) for k in keys)
    product = jax.jit(jnp.matmul)
    inner = 10  # products per timed call, so that dispatch does not count on a fast chip

    def products() -> None:
        outs = [product(a, b) for _ in range(inner)]
        jax.block_until_ready(outs)

    matmul_s = best_seconds(products, sizes.timing_repeats) / inner
    elements = sizes.copy_mib * 2**20 // 2
    x = jnp.ones((elements,), jnp.bfloat16)
    copy = jax.jit(lambda v: v + 1)  # reads and writes every element once (x + 0 may fold to a no-op)
    copy_s = best_seconds(lambda: copy(x).block_until_ready(), sizes.timing_repeats)
    versions = {name: _version(dist) for name, dist in VERSIONED.items()}
    versions["python"] = platform.python_version()
    devices = jax.devices()
    return {
        "backend": jax.default_backend(),
        "device_kind": devices[0].device_kind,
        "devices": [str(d) for d in devices],
        "versions": versions,
        "xla_python_client_preallocate": os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE"),
        "matmul_size": n,
        "matmul_bf16_tflops": float(f"{2.0 * n**3 / matmul_s / 1e12:.4g}"),
        "copy_bytes": 2 * elements * 2,
        "copy_gbps": float(f"{2 * elements * 2 / copy_s / 1e9:.4g}"),
    }


# ---------------------------------------------------------------------------- 3. train
def train(given: StageInput) -> dict[str, Any]:
    """Our train step (bf16 compute, the `small` presets' remat) against the same PyTorch step (bf16
    autocast, SDPA) on the same device and weights, interleaved; MFU by ``6 N tokens`` against the
    measured bf16 matmul rate."""
    import torch
    import transformers

    sizes = given.sizes
    shape = sizes.train_model
    folder = given.checkpoint("train_model", shape)
    batch = train_step.make_batch(sizes.train_rows, sizes.train_length, sizes.train_prompt_len,
                                  shape["vocab_size"], seed=0)
    ours, old_logprobs, our_facts = train_step.build_ours(folder, batch, dtype="bfloat16", remat=SMALL_REMAT)
    device = peer_device()
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa")
    n_params = sum(p.numel() for p in hf_model.parameters())
    sides = {"ours": ours}
    if device is not None:
        sides["torch"], torch_facts = train_step.build_torch(hf_model, batch, old_logprobs, device=device,
                                                             autocast="bfloat16")
    first = train_step.timed(ours)
    warm = train_step.timed(ours)
    torch_first = train_step.timed(sides["torch"]) if device is not None else None
    times = train_step.measure(sides, sizes.train_repeats, "interleaved")
    del hf_model, sides
    if device == "cuda":
        torch.cuda.empty_cache()
    tokens = batch.rows * batch.length
    flops = 6.0 * n_params * tokens
    peak = given.measured("matmul_bf16_tflops")
    ratios = [t / o for o, t in zip(times["ours"], times.get("torch", []), strict=False)]

    def side(ts: list[float]) -> dict[str, Any]:
        median = statistics.median(ts)
        return {"seconds": spread(ts), "tokens_per_s": round(tokens / median, 1),
                "tflops": float(f"{flops / median / 1e12:.4g}"),
                "mfu": float(f"{flops / median / 1e12 / peak:.4g}") if peak else None}

    return {
        "model": {"parameters": int(n_params), **shape},
        "batch": {"rows": batch.rows, "length": batch.length, "prompt_len": batch.prompt_len},
        "tokens_per_step": tokens, "flops_per_step": flops, "flops_rule": "6 * parameters * tokens",
        "matmul_bf16_tflops_measured": peak,
        "ours": {**side(times["ours"]), "compile_s": round(first - warm, 2), **our_facts},
        "torch": ({**side(times["torch"]), "first_call_s": round(torch_first, 2), **torch_facts}
                  if device is not None else _no_peer()),
        "ratio_ours_over_torch": spread(ratios) if ratios else None,
        "ratio_per_repeat": [round(r, 3) for r in ratios],
    }


# ---------------------------------------------------------------------------- 4. decode
def decode(given: StageInput) -> dict[str, Any]:
    """The rollout engine's decode rate at ``decode_rows`` rows (every slot busy, lengths forced by a
    no-EOS automaton), its bytes per step against the measured copy bandwidth, and Hugging Face
    ``generate`` on the same device, rows and lengths. Decode tokens/s = rows x (new - 1) / (full call -
    one-token call) on both sides."""
    import torch
    import transformers

    from mage_jax.generate.engine import EngineRequest, generate_all
    from mage_jax.generate.slots import compiled_engine
    from mage_jax.generate.spec import ModelSpec
    from mage_jax.generate.step import SamplingParams
    from mage_jax.models.hf_loading import load_hf_params

    sizes = given.sizes
    shape = sizes.decode_model
    folder = given.checkpoint("decode_model", shape)
    rows, prompt_len, new = sizes.decode_rows, sizes.decode_prompt_len, sizes.decode_new_tokens
    eos = shape["vocab_size"] - 1
    prompts = np.random.default_rng(0).integers(2, eos, size=(rows, prompt_len)).tolist()
    config = ModelConfig.from_hf_dir(folder, dtype="bfloat16", param_dtype="bfloat16")
    config, graphdef, state = load_hf_params(folder, config)
    spec = ModelSpec(graphdef, config, eos_ids=(eos,), pad_id=0, prompt_buckets=(prompt_len,))
    engine = compiled_engine(spec, slots=rows, max_new_tokens=new, chunk=sizes.decode_chunk)
    automaton = rollout.no_eos_automaton(config.vocab_size, eos)
    params = SamplingParams(temperature=1.0, max_new_tokens=new)
    stats = {}

    def ours(limit: int) -> int:
        session = engine.session(state, params, jax.random.key(limit))
        out = generate_all(session, [EngineRequest(i, tuple(p), limit, automaton, (i, 0, 0))
                                     for i, p in enumerate(prompts)])
        stats[limit] = session.stats
        return sum(len(r.tokens) for r in out.values())

    device = peer_device()
    sides: dict[str, Callable[[int], int]] = {"ours": ours}
    hf_facts: dict[str, Any] = {}
    if device is not None:
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa")
        sides["hf"], hf_facts = generation.build_hf(hf_model, prompts, "bfloat16", device=device)
        del hf_model  # build_hf's closure keeps the model it moved to the device
    start = time.perf_counter()
    ours(new), ours(1)
    warmup = time.perf_counter() - start
    if device is not None:
        sides["hf"](new), sides["hf"](1)
    runs: dict[str, dict[str, list]] = {side: {"full": [], "prefill": [], "counts": []} for side in sides}
    for _ in range(sizes.decode_repeats):
        for name, fn in sides.items():
            seconds, count = generation.timed(fn, new)
            runs[name]["full"].append(seconds)
            runs[name]["counts"].append(count)
            runs[name]["prefill"].append(generation.timed(fn, 1)[0])
    del sides
    if device == "cuda":
        torch.cuda.empty_cache()
    summary = {name: generation.summarize(r["full"], r["prefill"], r["counts"], rows, new)
               for name, r in runs.items()}
    ours_rate = (summary["ours"]["decode_tokens_per_s"] or {}).get("median")
    hf_rate = (summary["hf"]["decode_tokens_per_s"] or {}).get("median") if "hf" in summary else None
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
    kv_per_token = config.num_layers * 2 * config.num_kv_heads * config.head_dim * 2  # bf16 K and V
    mean_context = prompt_len + new / 2
    bytes_per_step = param_bytes + rows * kv_per_token * mean_context
    copy_gbps = given.measured("copy_gbps")
    steps_per_s = ours_rate / rows if ours_rate else None
    return {
        "model": {"parameters": int(config.num_params()), **shape},
        "rows": rows, "prompt_len": prompt_len, "new_tokens": new, "chunk": sizes.decode_chunk,
        "ours": {**summary["ours"], "path": "RolloutEngine (slots = rows), bf16 parameters and KV cache",
                 "warmup_incl_compile_s": round(warmup, 2),
                 "decode_steps": stats[new].decode_steps, "decode_tokens": stats[new].decode_tokens},
        "hf": ({**summary["hf"], "path": "transformers generate (sampling, min_new_tokens forced)",
                **hf_facts} if "hf" in summary else _no_peer()),
        "decode_ratio_ours_over_hf": round(ours_rate / hf_rate, 3) if ours_rate and hf_rate else None,
        "bytes_per_step": int(bytes_per_step),
        "bytes_rule": "parameters + rows x KV bytes per token x (prompt + new / 2): the least a step reads",
        "achieved_gbps": float(f"{bytes_per_step * steps_per_s / 1e9:.4g}") if steps_per_s else None,
        "copy_gbps_measured": copy_gbps,
        "fraction_of_copy_bandwidth": (float(f"{bytes_per_step * steps_per_s / 1e9 / copy_gbps:.4g}")
                                       if steps_per_s and copy_gbps else None),
    }


# ---------------------------------------------------------------------------- 5. rollout
def decode_layout_stage(given: StageInput) -> dict[str, Any]:
    """The decode-layout benchmark (``experiments.benchmarks.decode_layout``) at the sizes of
    ``layout_args``: the engine's decode rate with the blocks scanned (the pretrained presets' default)
    against unrolled, same weights."""
    out = os.path.join(given.scratch, "decode_layout.json")
    report = decode_layout.main([*given.sizes.layout_args, "--out", out])
    keep = ("path", "model", "layers", "params", "dtype", "batch", "prompt_len", "new_tokens",
            "decode_tokens_per_s", "scanned_over_unrolled", "scanned_over_unrolled_per_repeat",
            "greedy_identical", "warmup_s", "device")
    return {"args": list(given.sizes.layout_args), **{k: report[k] for k in keep}}


def rollout_stage(given: StageInput) -> dict[str, Any]:
    """The rollout benchmark (``experiments.benchmarks.rollout``) at the sizes of ``rollout_args``."""
    out = os.path.join(given.scratch, "rollout.json")
    report = rollout.main([*given.sizes.rollout_args, "--out", out])
    keep = ("model", "workload", "slots", "chunk", "slot_levels", "repeats", "lockstep_seconds",
            "engine_seconds", "speedup", "speedup_per_repeat", "useful_decode_fraction", "decode_row_steps",
            "prefill_tokens", "compiles_after_warmup", "greedy_identical", "warmup_s", "device")
    return {"args": list(given.sizes.rollout_args), **{k: report[k] for k in keep}}


# ---------------------------------------------------------------------------- 6. real model
def real_model(given: StageInput) -> dict[str, Any]:
    """A few MAGE iterations of Kuhn Poker on the ``--model-path`` folder through the experiment's own
    entry point (``experiments.kuhn_poker``, preset ``small``): seconds per iteration, payoff by episode."""
    from experiments import kuhn_poker
    from mage_jax.logging import read_jsonl

    if given.model_path is None:
        raise ValueError("real_model needs --model-path DIR (a local Hugging Face folder)")
    run_dir = os.path.join(given.scratch, "real_model_run")
    argv = ["--preset", "small", "--model-path", given.model_path, "--run-dir", run_dir]
    for key, value in given.sizes.real_model_overrides.items():
        argv += ["--set", f"{key}={json.dumps(value) if not isinstance(value, str) else value}"]
    code = kuhn_poker.main(argv)
    if code != 0:
        raise RuntimeError(f"experiments.kuhn_poker exited with status {code}")
    records = [r for r in read_jsonl(run_dir) if "iteration_seconds" in r]
    if not records:
        raise RuntimeError("the run wrote no iteration to metrics.jsonl")
    summary = json.loads(Path(run_dir, "summary.json").read_text())
    iterations = [{
        "iteration": r.get("iteration"),
        "seconds": round(r["iteration_seconds"], 2),
        "rollout_seconds": round(r["rollout_seconds"], 2),
        "update_seconds": round(r["update_seconds"], 2),
        "payoff_by_episode": [r[episode_key("payoff", k)] for k in range(_episodes(r))],
    } for r in records]
    return {"model_path": given.model_path, "argv": argv, "iterations": iterations,
            "seconds_per_iteration": round(statistics.median(i["seconds"] for i in iterations), 2),
            "wall_seconds": summary.get("wall_seconds")}


def _episodes(record: Mapping[str, Any]) -> int:
    n = 0
    while episode_key("payoff", n) in record:
        n += 1
    return n
