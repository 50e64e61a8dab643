"""The correctness stage of the accelerator check (``experiments.benchmarks.accelerator``): every fast
path on the device against its reference. Our decoder against Hugging Face PyTorch (random Qwen3 and
Llama, float32 and bfloat16: logits, greedy tokens), each attention implementation the platform runs
against ``dense`` (outputs and gradients, padding and packed segments), and the engine's greedy Kuhn
Poker rollout against lockstep. Each comparison records what it compared and how much; one that compares
nothing never passes."""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from experiments.benchmarks.accelerator_stages import StageInput, torch_device
from experiments.benchmarks.common import build_random_hf_model


def _real_rows(length: int, rows: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Left-padded rows (the first one full): padding mask [rows, length] and positions."""
    mask = np.zeros((rows, length), bool)
    for r in range(rows):
        real = length if r == 0 else int(rng.integers(length // 2, length + 1))
        mask[r, length - real:] = True
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    return mask, positions


def comparison(name: str, compared: int, diff: float, tolerance: float, **facts: Any) -> dict[str, Any]:
    """One comparison's record; it passes only if something was compared and the difference is finite
    and within ``tolerance``."""
    passed = bool(compared > 0 and math.isfinite(diff) and diff <= tolerance)
    return {"name": name, "values_compared": int(compared), "max_abs_diff": float(f"{diff:.4g}"),
            "tolerance": float(f"{tolerance:.4g}"), "pass": passed, **facts}


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
        checks.append(comparison(f"decoder_logits/{arch}/{dtype}", ours[mask].size, diff, tolerance * scale,
                             logit_scale=round(scale, 3), device=device, jax_precision=precision))
        hf_greedy, step_logits = _hf_greedy(model_t, tokens, mask, sizes.greedy_tokens, device, eos=vocab - 1)
        compared, differing, ties = greedy_agreement(ours_greedy, hf_greedy, step_logits, tolerance * scale)
        checks.append(comparison(f"decoder_greedy/{arch}/{dtype}", compared, float(differing), 0.0,
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

    from mage_jax.generate.sampler import Sampler
    from mage_jax.generate.spec import ModelSpec
    from mage_jax.generate.step import SamplingParams

    prompts = [row[m].tolist() for row, m in zip(tokens, mask, strict=True)]
    spec = ModelSpec(graphdef, config, eos_ids=(vocab - 1,), pad_id=0, prompt_buckets=(tokens.shape[1],))
    sampler = Sampler(spec, batch_buckets=(len(prompts),))
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
    return comparison(f"attention/{impl}/{case}/{dtype}", sum(g.size for g, _ in pairs), relative, tolerance,
                  implementation=impl, reference="dense", case=case, dtype=dtype,
                  difference="max abs difference / max abs reference, outputs and dq, dk, dv")


def engine_check(given: StageInput) -> dict[str, Any]:
    """A greedy Kuhn Poker rollout (tiny random model, word-level tokenizer) through the rollout engine
    and through lockstep generation (``mage_jax.testing``'s engine-parity harness, as the test suite runs
    it on every environment): every row, outcome and rollout count must be equal, log-probs within 1e-2
    (the device's default float32 matmul precision)."""
    from experiments.environments import environment as experiment_environment
    from mage_jax.testing import PARITY_OVERRIDES, greedy_rollouts, parity_model, rollout_differences

    cfg = experiment_environment("kuhn_poker").config("tiny", PARITY_OVERRIDES)
    model = parity_model({"kuhn_poker": cfg})
    lockstep, engine = greedy_rollouts(model, "kuhn_poker")
    differences = rollout_differences(lockstep, engine, logprob_atol=1e-2)
    rows_differing = len({d.split(":")[0] for d in differences if d.startswith("row ")})
    same_rows = len(lockstep.rows) == len(engine.rows)
    compared = sum(len(r.response_ids) for r in lockstep.rows) if same_rows else 0
    return comparison("engine_greedy_equals_lockstep/kuhn_poker", compared, float(len(differences)), 0.0,
                      rows=len(lockstep.rows), rows_differing=rows_differing,
                      outcomes_equal="outcomes" not in differences, slots=model.engine.num_slots,
                      differences=differences[:10],
                      what="every field of every row, the outcomes and the rollout counts")
