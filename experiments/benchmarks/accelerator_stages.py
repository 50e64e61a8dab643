"""The stages of the accelerator check (``experiments.benchmarks.accelerator``): each takes the run's
``StageInput`` and returns its JSON-ready result, or raises.

PyTorch and ``transformers`` are imported by the stages that compare with them, when they run: a host
without them still runs the others. (Importing JAX does not start its GPU client; the first computation
does, after ``accelerator.main`` has set the allocator's environment.)"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from experiments.benchmarks import generation, rollout, train_step
from experiments.benchmarks.common import build_hf_checkpoint, build_random_hf_model, spread

QWEN3_0_6B = dict(
    # Qwen3-0.6B's shape (random weights): what the `small` presets train.
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
    tie_word_embeddings=True,
)
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
    rollout_args: tuple[str, ...]
    real_model_overrides: Mapping[str, Any]


DEFAULT = Sizes(
    matmul_size=8192, copy_mib=1024, timing_repeats=5,
    check_rows=8, check_length=128, greedy_tokens=16, attention_length=1024, attention_head_dim=128,
    train_model=QWEN3_0_6B, train_rows=4, train_length=2048, train_prompt_len=1024, train_repeats=4,
    decode_model=QWEN3_0_6B, decode_rows=64, decode_prompt_len=512, decode_new_tokens=256, decode_chunk=16,
    decode_repeats=2,
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


def _real_rows(length: int, rows: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Left-padded rows (the first one full): padding mask [rows, length] and positions."""
    mask = np.zeros((rows, length), bool)
    for r in range(rows):
        real = length if r == 0 else int(rng.integers(length // 2, length + 1))
        mask[r, length - real:] = True
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    return mask, positions


def _check(name: str, compared: int, diff: float, tolerance: float, **facts: Any) -> dict[str, Any]:
    """One comparison's record; it passes only if something was compared and the difference is finite
    and within ``tolerance``."""
    passed = bool(compared > 0 and math.isfinite(diff) and diff <= tolerance)
    return {"name": name, "values_compared": int(compared), "max_abs_diff": float(f"{diff:.4g}"),
            "tolerance": float(f"{tolerance:.4g}"), "pass": passed, **facts}


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


# ---------------------------------------------------------------------------- 2. correctness
def correctness(given: StageInput) -> dict[str, Any]:
    """Our decoder against Hugging Face PyTorch on the same device, every attention implementation this
    platform runs against the dense reference, and the engine's greedy rollout against lockstep."""
    backend = jax.default_backend()
    groups: list[tuple[str, Callable[[], Any]]] = [
        (f"decoder/{arch}", functools.partial(decoder_checks, given, arch)) for arch in ("qwen3", "llama")]
    groups += [(f"attention/{impl}/{case}/{dtype}",
                functools.partial(attention_check, given, impl, case, dtype))
               for impl, case, dtype in attention_plan(backend)]
    groups.append(("engine_greedy_equals_lockstep/kuhn_poker", functools.partial(engine_check, given)))
    checks: list[dict[str, Any]] = []
    for name, run in groups:
        try:  # one comparison that raises (a kernel missing on this device) fails alone
            result = run()
        except Exception as error:  # noqa: BLE001 - recorded as a failed check
            result = {"name": name, "values_compared": 0, "pass": False,
                      "error": f"{type(error).__name__}: {error}".splitlines()[0]}
        checks += result if isinstance(result, list) else [result]
    return {"checks": checks, "not_compared_here": attention_not_compared(backend),
            "all_pass": all(c["pass"] for c in checks)}


def decoder_checks(given: StageInput, arch: str) -> list[dict[str, Any]]:
    """Logits and greedy tokens of a random ``arch`` (``qwen3`` or ``llama``), float32 and bfloat16 (the
    same dtype on both sides). Float32 runs at the highest matmul precision on both sides (no TF32), so
    its tolerance is rounding; bfloat16 compares each side's own rounding."""
    import torch

    from mage_jax.models.config import ModelConfig
    from mage_jax.models.hf_loading import load_hf_params

    sizes = given.sizes
    device = torch_device()
    rng = np.random.default_rng(0)
    checks = []
    folder = os.path.join(given.scratch, f"check_{arch}")
    hf_model = build_random_hf_model(arch, folder)
    vocab = hf_model.config.vocab_size
    tokens = rng.integers(2, vocab, size=(sizes.check_rows, sizes.check_length)).astype(np.int32)
    mask, positions = _real_rows(sizes.check_length, sizes.check_rows, rng)
    tokens = np.where(mask, tokens, 0)
    for dtype, tolerance in (("float32", 1e-3), ("bfloat16", 5e-2)):
        precision = "highest" if dtype == "float32" else "default"
        torch.backends.cuda.matmul.allow_tf32 = False
        config = ModelConfig.from_hf_dir(folder, dtype=dtype, param_dtype=dtype)
        _, graphdef, state = load_hf_params(folder, config)
        model_t = hf_model.to(device=device, dtype=getattr(torch, dtype))
        with jax.default_matmul_precision(precision):
            ours = np.asarray(_our_logits(graphdef, state, tokens, positions, mask))
            ours_greedy = _our_greedy(graphdef, config, state, tokens, mask, sizes.greedy_tokens, vocab)
        theirs = _hf_logits(model_t, tokens, mask, positions, device)
        diff = float(np.max(np.abs(ours[mask] - theirs[mask])))
        scale = float(np.max(np.abs(theirs[mask])))
        checks.append(_check(f"decoder_logits/{arch}/{dtype}", ours[mask].size, diff, tolerance * scale,
                             logit_scale=round(scale, 3), device=device, jax_precision=precision))
        hf_greedy, step_logits = _hf_greedy(model_t, tokens, mask, sizes.greedy_tokens, device, eos=vocab - 1)
        compared, differing, ties = greedy_agreement(ours_greedy, hf_greedy, step_logits, tolerance * scale)
        checks.append(_check(f"decoder_greedy/{arch}/{dtype}", compared, float(differing), 0.0,
                             rows=len(hf_greedy), rows_differing=differing, near_ties=ties,
                             near_tie_margin=float(f"{tolerance * scale:.4g}"), device=device))
    return checks


@functools.partial(jax.jit, static_argnums=0)
def _our_logits(graphdef: Any, state: Any, tokens: Any, positions: Any, mask: Any) -> Any:
    from flax import nnx

    model = nnx.merge(graphdef, state)
    hidden, _ = model(tokens, positions, mask)
    return model.logits(hidden).astype("float32")


def _hf_logits(model: Any, tokens: np.ndarray, mask: np.ndarray, positions: np.ndarray, device: str):
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.tensor(tokens, dtype=torch.long, device=device),
                    attention_mask=torch.tensor(mask.astype(np.int64), device=device),
                    position_ids=torch.tensor(positions, dtype=torch.long, device=device))
    return out.logits.float().cpu().numpy()


def greedy_agreement(ours: Sequence[Sequence[int]], theirs: Sequence[Sequence[int]],
                     step_logits: Sequence[np.ndarray], margin: float) -> tuple[int, int, int]:
    """(tokens compared, rows that differ, rows that differ only at a near-tie). Rows are compared up to
    their first difference; a difference where the reference's logits of the two choices lie within
    ``margin`` (the logit tolerance) is a near-tie that rounding may flip, not a mismatch."""
    compared = differing = ties = 0
    for r, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        first = next((t for t, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if first is None:
            compared += min(len(a), len(b))
            differing += len(a) != len(b)
            continue
        compared += first + 1
        logits = step_logits[first][r]
        if logits[b[first]] - logits[a[first]] <= margin:
            ties += 1
        else:
            differing += 1
    return compared, differing, ties


def _hf_greedy(model: Any, tokens: np.ndarray, mask: np.ndarray, steps: int, device: str, eos: int
               ) -> tuple[list[list[int]], list[np.ndarray]]:
    """Greedy continuations by full forward passes without a cache (the plainest oracle), cut after EOS,
    and the last position's logits [rows, vocab] of every step."""
    out = [[] for _ in range(tokens.shape[0])]
    step_logits = []
    for _ in range(steps):
        positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
        logits = _hf_logits(model, tokens, mask, positions, device)
        step_logits.append(logits[:, -1])
        chosen = logits[:, -1].argmax(-1)
        for r, token in enumerate(chosen):
            if not out[r] or out[r][-1] != eos:
                out[r].append(int(token))
        tokens = np.concatenate([tokens, chosen[:, None].astype(np.int32)], axis=1)
        mask = np.concatenate([mask, np.ones((mask.shape[0], 1), bool)], axis=1)
    return [row[:row.index(eos) + 1] if eos in row else row for row in out], step_logits


def _our_greedy(graphdef: Any, config: Any, state: Any, tokens: np.ndarray, mask: np.ndarray, steps: int,
                vocab: int) -> list[list[int]]:
    """Greedy continuations by our sampler (prefill + cached decode)."""

    from mage_jax.sampling import Sampler, SamplingParams

    prompts = [row[m].tolist() for row, m in zip(tokens, mask, strict=True)]
    sampler = Sampler(graphdef, config, eos_ids=[vocab - 1], pad_id=0, prompt_buckets=(tokens.shape[1],),
                      batch_buckets=(len(prompts),))
    result = sampler.generate(state, prompts, SamplingParams(temperature=0.0, max_new_tokens=steps),
                              jax.random.key(0))
    return [[int(t) for t in row] for row in result.tokens]


ATTENTION_CASES = ("padding", "packed")


def _segments(case: str, rows: int, length: int) -> np.ndarray:
    """``padding``: a left-padded, a right-padded and a full row; ``packed``: rows holding two or three
    segments, one with trailing padding."""
    seg = np.ones((rows, length), np.int32)
    if case == "padding":
        seg[0, :length // 5] = 0
        seg[1, length - length // 4:] = 0
    else:
        seg[0, length // 3:] = 2
        seg[1, length // 4:] = 2
        seg[1, length // 2:] = 3
        seg[1, length - length // 8:] = 0
        seg[2, length // 2:] = 2
    return seg


def attention_plan(platform_name: str) -> list[tuple[str, str, str]]:
    """(implementation, case, dtype) compared against ``dense`` on this platform; what cannot run here is
    left out and named by ``attention_not_compared``."""
    plan = [(impl, case, "float32") for impl in ("blockwise", "prefix") for case in ATTENTION_CASES]
    if platform_name == "gpu":
        plan.append(("cudnn", "padding", "bfloat16"))
    if platform_name == "tpu":
        plan += [("splash", case, "bfloat16") for case in ATTENTION_CASES]
    return plan


def attention_not_compared(platform_name: str) -> list[dict[str, str]]:
    """The accelerator implementations not compared on this platform, and why."""
    skipped = [{"implementation": "cudnn", "case": "packed",
                "reason": "cuDNN takes per-row lengths: one run of real tokens per row (docs/attention.md)"}]
    if platform_name != "gpu":
        skipped.append({"implementation": "cudnn", "case": "padding",
                        "reason": f"needs an NVIDIA GPU, the platform is {platform_name}"})
    if platform_name != "tpu":
        skipped.append({"implementation": "splash", "case": "padding, packed",
                        "reason": f"needs a TPU, the platform is {platform_name}"})
    return skipped


def attention_check(given: StageInput, impl: str, case: str, dtype: str) -> dict[str, Any]:
    """Outputs (real query rows) and gradients of a random projection of ``impl`` against ``dense`` on
    the same inputs, grouped-query heads, causal."""
    import jax.numpy as jnp

    from mage_jax.models import attention as attn

    rows, length, dim = 3, given.sizes.attention_length, given.sizes.attention_head_dim
    rng = np.random.default_rng(1)
    seg = jnp.asarray(_segments(case, rows, length))
    q, k, v = (jnp.asarray(rng.normal(size=(rows, length, h, dim)), dtype) for h in (4, 2, 2))
    real = np.asarray(seg) != 0
    weight = jnp.asarray(rng.normal(size=q.shape) * real[:, :, None, None], dtype)

    def run(fn, q, k, v):
        loss = lambda q, k, v: jnp.sum((fn(q, k, v, seg) * weight).astype(jnp.float32))  # noqa: E731
        return fn(q, k, v, seg), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    def ours(q, k, v, seg):
        return attn.self_attention(q, k, v, seg, implementation=impl)

    with jax.default_matmul_precision("highest" if dtype == "float32" else "default"):
        got, got_grads = jax.jit(lambda q, k, v: run(ours, q, k, v))(q, k, v)
        want, want_grads = jax.jit(lambda q, k, v: run(attn.dense_attention, q, k, v))(q, k, v)
    tolerance = 1e-3 if dtype == "float32" else 2e-2
    pairs = [(np.asarray(got, np.float32)[real], np.asarray(want, np.float32)[real])]
    pairs += [(np.asarray(g, np.float32), np.asarray(w, np.float32))
              for g, w in zip(got_grads, want_grads, strict=True)]
    relative = max(float(np.max(np.abs(g - w))) / max(float(np.max(np.abs(w))), 1e-30) for g, w in pairs)
    return _check(f"attention/{impl}/{case}/{dtype}", sum(g.size for g, _ in pairs), relative, tolerance,
                  implementation=impl, reference="dense", case=case, dtype=dtype,
                  difference="max abs difference / max abs reference, outputs and dq, dk, dv")


def engine_check(given: StageInput) -> dict[str, Any]:
    """A greedy Kuhn Poker rollout (tiny random model, word-level tokenizer) through the rollout engine
    and through lockstep generation: every row's prompt and response tokens must be equal."""

    from experiments.environments import environment as experiment_environment
    from mage_jax.models.sharding import param_shardings
    from mage_jax.rollout.policy import LLMPolicy
    from mage_jax.sampling import SamplingParams
    from mage_jax.tokenizer import Tokenizer
    from mage_jax.training.assemble import (
        build_model,
        make_engine,
        make_mesh,
        make_runner,
        make_sampler,
        make_task_sampler,
        tokenizer_corpus,
    )

    overrides = {
        "rollout.num_tasks": 2, "rollout.group_size": 2, "rollout.num_episodes": 2, "rollout.max_turns": 3,
        "rollout.max_response_tokens": 12, "rollout.max_reflection_tokens": 6, "rollout.reflect": True,
        "rollout.memory_mode": "history_and_reflection", "tokenizer.corpus_meta_episodes": 4,
        "model.overrides": {"hidden_size": 32, "intermediate_size": 64, "num_layers": 1, "num_heads": 2,
                            "num_kv_heads": 1, "head_dim": 16},
        "rollout.engine_slots": 3, "rollout.engine_chunk": 2,
    }
    cfg = experiment_environment("kuhn_poker").config("tiny", overrides)
    tasks_of = make_task_sampler(cfg)
    tokenizer = Tokenizer.word_level(tokenizer_corpus(cfg, tasks_of))
    mesh = make_mesh(cfg)
    model_config, graphdef, params = build_model(cfg, tokenizer, mesh)
    sampler = make_sampler(cfg, mesh, model_config, graphdef, param_shardings(params, mesh),
                           eos_ids=tokenizer.eos_ids, pad_id=tokenizer.pad_id)
    engine = make_engine(cfg, sampler, mesh)
    if engine is None:
        raise RuntimeError("the kuhn_poker tiny config runs without the rollout engine")
    r = cfg.rollout
    longest = max(r.max_response_tokens, r.max_reflection_tokens)
    params_s = SamplingParams(temperature=0.0, max_new_tokens=longest)
    runner = make_runner(cfg, num_episodes=r.num_episodes)
    tasks = tasks_of.sample_train(0)
    results = {}
    for name, eng in (("lockstep", None), ("engine", engine)):
        policy = LLMPolicy(tokenizer, sampler, params, params_s, jax.random.key(0),
                           max_prompt_tokens=r.max_prompt_tokens, engine=eng)
        results[name] = runner.run(tasks, policy, training=True)
    a, b = results["lockstep"].rows, results["engine"].rows
    differing = abs(len(a) - len(b)) + sum(
        not (np.array_equal(x.prompt_ids, y.prompt_ids) and np.array_equal(x.response_ids, y.response_ids))
        for x, y in zip(a, b))
    compared = sum(len(x.response_ids) for x in a) if len(a) == len(b) else 0
    outcomes_equal = ([o.to_dict() for o in results["lockstep"].outcomes]
                      == [o.to_dict() for o in results["engine"].outcomes])
    return _check("engine_greedy_equals_lockstep/kuhn_poker", compared,
                  float(differing + (not outcomes_equal)), 0.0, rows=len(a), rows_differing=differing,
                  outcomes_equal=outcomes_equal, slots=engine.num_slots,
                  what="response tokens of every row (prompts and outcomes also equal)")


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

    from mage_jax.models.config import ModelConfig
    from mage_jax.models.hf_loading import load_hf_params
    from mage_jax.rollout.engine import EngineRequest, RolloutEngine, generate_all
    from mage_jax.sampling import Sampler, SamplingParams

    sizes = given.sizes
    shape = sizes.decode_model
    folder = given.checkpoint("decode_model", shape)
    rows, prompt_len, new = sizes.decode_rows, sizes.decode_prompt_len, sizes.decode_new_tokens
    eos = shape["vocab_size"] - 1
    prompts = np.random.default_rng(0).integers(2, eos, size=(rows, prompt_len)).tolist()
    config = ModelConfig.from_hf_dir(folder, dtype="bfloat16", param_dtype="bfloat16")
    config, graphdef, state = load_hf_params(folder, config)
    sampler = Sampler(graphdef, config, eos_ids=[eos], pad_id=0, prompt_buckets=(prompt_len,),
                      batch_buckets=(rows,))
    engine = RolloutEngine(sampler, slots=rows, max_new_tokens=new, chunk=sizes.decode_chunk)
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
        "payoff_by_episode": [r[f"payoff@{k}"] for k in range(_episodes(r))],
    } for r in records]
    return {"model_path": given.model_path, "argv": argv, "iterations": iterations,
            "seconds_per_iteration": round(statistics.median(i["seconds"] for i in iterations), 2),
            "wall_seconds": summary.get("wall_seconds")}


def _episodes(record: Mapping[str, Any]) -> int:
    n = 0
    while f"payoff@{n}" in record:
        n += 1
    return n


STAGES: dict[str, Callable[[StageInput], dict[str, Any]]] = {
    "environment": environment,
    "correctness": correctness,
    "train": train,
    "decode": decode,
    "rollout": rollout_stage,
    "real_model": real_model,
}
"""The stages in the order they run."""
