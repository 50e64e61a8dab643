"""Train-step throughput: our jitted update against the equivalent PyTorch step on the same weights.

    python -m experiments.benchmarks.train_step [--threads 1] [--repeats 3] [--order interleaved]
        [--out runs/benchmarks/train_step.json]

A random Qwen3 (``--shape 27m``: 27.3M parameters, vocab 16384, hidden 512, 6 layers, 8 / 4 heads,
head_dim 64, tied) is built with ``transformers``, saved and loaded into our decoder, so both sides
start from identical f32 weights. The batch is ``--rows`` rows of ``--length`` tokens: ``--prompt-len``
prompt tokens, the rest response targets, one random advantage per row, no padding.

* Ours is the step as the trainer runs it: ``make_optimizer`` (clip 1.0 + AdamW) and ``TrainStep`` with
  the default ``StepConfig`` (chunked log-probs, PPO clip / dual clip, entropy bonus, token-mean) on a
  1x1x1 mesh; ``TrainStep.update`` runs its two jitted programs and the result is waited for.
* PyTorch runs ``Qwen3ForCausalLM`` (SDPA attention) in train mode with the same loss: log-softmax over
  the vocabulary, target log-probs, the same PPO clip / dual clip and entropy bonus, token-mean, then
  ``clip_grad_norm_(1.0)`` and ``torch.optim.AdamW`` with the same hyper-parameters.

Both sides run on the same ``--threads`` CPUs (see ``common.pinned_threads``; for a fair ratio on a shared
machine also start the process under ``taskset -c 0``). Each side is warmed up once (our first call
includes compilation: reported as ``compile_s``, never counted), then the sides alternate ``--repeats``
times (``--order blocked`` runs all of ours first). Reported: min / median / max seconds per step, tokens
per second, GFLOP/s by ``6 * N * tokens`` and its fraction of the f32 matmul peak measured in the same
run, with the load average before and after. Prints JSON and writes it to ``--out``.
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from experiments.benchmarks.common import (
    QWEN3_SHAPES,
    build_hf_checkpoint,
    load_average,
    matmul_peak,
    model_parser,
    pinned_threads,
    spread,
    write_model_report,
)

OPTIM = dict(lr=1e-6, b1=0.9, b2=0.999, weight_decay=0.01, grad_clip=1.0)


@dataclasses.dataclass(frozen=True)
class Batch:
    """Host arrays of the benchmark batch, in our ``PackedBatch`` layout (targets shifted by one)."""

    tokens: np.ndarray
    targets: np.ndarray
    response_mask: np.ndarray
    advantages: np.ndarray
    prompt_len: int

    @property
    def rows(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def length(self) -> int:
        return int(self.tokens.shape[1])


def make_batch(rows: int, length: int, prompt_len: int, vocab: int, seed: int) -> Batch:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, vocab, size=(rows, length)).astype(np.int32)
    targets = np.zeros_like(tokens)
    targets[:, :-1] = tokens[:, 1:]
    response = np.zeros((rows, length), bool)
    response[:, prompt_len - 1:length - 1] = True  # targets that are response tokens
    advantages = rng.standard_normal(rows).astype(np.float32)
    return Batch(tokens, targets, response, advantages, prompt_len)


def our_batch_arrays(batch: Batch) -> Any:
    """The ``TrainBatch`` ``TrainStep`` takes (what ``TrainBatch.from_packed`` builds from a packed batch)."""
    from mage_jax.training.train_step import TrainBatch

    rows, length = batch.tokens.shape
    return TrainBatch(
        tokens=batch.tokens,
        positions=np.broadcast_to(np.arange(length, dtype=np.int32), (rows, length)).copy(),
        token_mask=np.ones((rows, length), bool),
        targets=batch.targets,
        response_mask=batch.response_mask,
        prompt_lengths=np.full(rows, batch.prompt_len, np.int32),
        advantages=batch.advantages,
    )


def build_ours(
    folder: str, batch: Batch, attention: str = "auto", **overrides: Any
) -> tuple[Callable[[], Any], np.ndarray, dict[str, Any]]:
    """Our step as a closure (each call one update, waited for), the old log-probs it uses, and facts.

    ``attention`` is the model's attention implementation (``auto``: what the trainer runs);
    ``overrides`` replace further ``ModelConfig`` fields (e.g. ``dtype``, ``remat``)."""
    import jax
    import jax.numpy as jnp

    from mage_jax.algorithms.schedules import learning_rate_schedule
    from mage_jax.models import sharding as shd
    from mage_jax.models.config import ModelConfig
    from mage_jax.models.hf_loading import load_hf_params
    from mage_jax.training.train_step import StepConfig, TrainStep, make_optimizer

    config = dataclasses.replace(ModelConfig.from_hf_dir(folder), attention=attention, **overrides)
    model_config, graphdef, params = load_hf_params(folder, config)
    schedule = learning_rate_schedule(OPTIM["lr"])
    optimizer = make_optimizer(schedule, b1=OPTIM["b1"], b2=OPTIM["b2"], weight_decay=OPTIM["weight_decay"],
                               grad_clip=OPTIM["grad_clip"])
    step_config = StepConfig()
    step = TrainStep(graphdef, optimizer, schedule, step_config, shd.make_mesh(shd.MeshConfig()))
    state = step.init_state(params)
    arrays = step.place_batch(our_batch_arrays(batch))
    old = step.compute_logprobs(state.params, arrays)
    arrays = arrays.replace(old_logprobs=old)
    holder = {"state": state}

    def run() -> Any:
        new_state, metrics = step.update(holder["state"], arrays)
        jax.block_until_ready(new_state)
        holder["state"] = new_state
        if float(metrics["skipped"]):
            raise RuntimeError("our train step skipped its update (non-finite loss or gradient)")
        return metrics

    facts = {"jax": jax.__version__, "backend": jax.default_backend(),
             "step_config": dataclasses.asdict(step_config), "devices": len(jax.devices()),
             "attention": attention, "attention_runs": _attention_runs(model_config, batch.length),
             "param_dtype": str(jnp.result_type(jax.tree.leaves(params)[0])), "dtype": model_config.dtype,
             "remat": model_config.remat}
    return run, np.asarray(old), facts


def _attention_runs(config: Any, length: int) -> str:
    """The attention implementation our model runs at this length (``auto`` resolved)."""
    from mage_jax.models.attention import choose_implementation

    return choose_implementation(config.attention, length, config.jnp_dtype,
                                 dense_max_len=config.attention_dense_max_len)


def build_torch(
    model: Any, batch: Batch, old_logprobs: np.ndarray, *, device: str = "cpu", autocast: str | None = None
) -> tuple[Callable[[], Any], dict[str, Any]]:
    """The PyTorch step with the same loss and optimizer, as a closure, on ``device``; ``autocast``
    (e.g. ``bfloat16``) runs the forward and backward in that dtype over float32 parameters, as our
    ``dtype`` does."""
    import torch

    cfg = StepConfigLike()
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=OPTIM["lr"], betas=(OPTIM["b1"], OPTIM["b2"]),
                                  weight_decay=OPTIM["weight_decay"])
    tokens = torch.from_numpy(batch.tokens.astype(np.int64)).to(device)
    targets = torch.from_numpy(batch.targets.astype(np.int64)).to(device)
    mask = torch.from_numpy(batch.response_mask).float().to(device)
    old = torch.from_numpy(np.array(old_logprobs, np.float32)).to(device)
    adv = torch.from_numpy(batch.advantages)[:, None].to(device)
    device_type = torch.device(device).type

    def forward() -> Any:
        if autocast is None:
            return model(input_ids=tokens).logits
        with torch.autocast(device_type, dtype=getattr(torch, autocast)):
            return model(input_ids=tokens).logits

    def run() -> float:
        optimizer.zero_grad(set_to_none=True)
        logits = forward().float()
        logp_all = torch.log_softmax(logits, dim=-1)
        logp = logp_all.gather(-1, targets[..., None])[..., 0]
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        ratio = torch.exp(logp - old)
        pg1 = -adv * ratio
        pg2 = -adv * ratio.clamp(1 - cfg.clip_eps, 1 + cfg.clip_eps)
        clipped = torch.maximum(pg1, pg2)
        per_token = torch.where(adv < 0, torch.minimum(clipped, -adv * cfg.dual_clip), clipped)
        count = mask.sum().clamp_min(1.0)
        loss = (per_token * mask).sum() / count - cfg.entropy_coef * (entropy * mask).sum() / count
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM["grad_clip"])
        optimizer.step()
        return float(loss.detach())

    return run, {"torch": torch.__version__, "threads": torch.get_num_threads(),
                 "attention": model.config._attn_implementation, "device": device, "autocast": autocast}


@dataclasses.dataclass(frozen=True)
class StepConfigLike:
    """The loss settings of our default ``StepConfig``, mirrored on the PyTorch side."""

    clip_eps: float = 0.2
    dual_clip: float = 3.0
    entropy_coef: float = 0.001


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(sides: dict[str, Callable[[], Any]], repeats: int, order: str) -> dict[str, list[float]]:
    """Seconds per call of each side: alternating A B A B (``interleaved``) or all of A then all of B."""
    times: dict[str, list[float]] = {name: [] for name in sides}
    if order == "interleaved":
        for _ in range(repeats):
            for name, fn in sides.items():
                times[name].append(timed(fn))
    else:
        for name, fn in sides.items():
            times[name] = [timed(fn) for _ in range(repeats)]
    return times


def side_report(times: list[float], tokens: int, flops: float, peak: float) -> dict[str, Any]:
    rates = [tokens / t for t in times]
    gflops = [flops / t / 1e9 for t in times]
    return {
        "seconds": spread(times),
        "times_s": [round(t, 4) for t in times],
        "tokens_per_s": spread(rates),
        "gflops": spread(gflops),
        "fraction_of_peak": float(f"{statistics.median(gflops) / peak:.4g}"),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = model_parser(__doc__, out="runs/benchmarks/train_step.json")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--order", default="interleaved", choices=("interleaved", "blocked"))
    parser.add_argument("--peak-size", type=int, default=2048, help="side of the f32 matmul peak probe")
    args = parser.parse_args(argv)
    if args.rows < 1 or args.repeats < 1 or args.threads < 0 or not 1 < args.prompt_len < args.length:
        parser.error("--rows and --repeats must be positive, --threads >= 0 and 1 < --prompt-len < --length")

    shape = QWEN3_SHAPES[args.shape]
    load_before = load_average()
    with pinned_threads(args.threads) as threads, tempfile.TemporaryDirectory() as folder:
        peak = matmul_peak(args.peak_size)
        hf_model = build_hf_checkpoint(folder, shape, args.seed)
        batch = make_batch(args.rows, args.length, args.prompt_len, shape["vocab_size"], args.seed)
        ours, old_logprobs, our_facts = build_ours(folder, batch)
        theirs, torch_facts = build_torch(hf_model, batch, old_logprobs)
        compile_s = timed(ours)  # first call: traces and compiles both programs
        warm_ours = timed(ours)
        warm_torch = timed(theirs)
        times = measure({"ours": ours, "torch": theirs}, args.repeats, args.order)
    n_params = sum(p.numel() for p in hf_model.parameters())
    tokens = args.rows * args.length
    flops = 6.0 * n_params * tokens
    report_ours = side_report(times["ours"], tokens, flops, peak["jax_gflops"])
    report_torch = side_report(times["torch"], tokens, flops, peak["torch_gflops"])
    ratios = [t / o for o, t in zip(times["ours"], times["torch"], strict=True)]
    report = {
        "model": {"architecture": "qwen3", "parameters": int(n_params), **shape},
        "batch": {"rows": args.rows, "length": args.length, "prompt_len": args.prompt_len,
                  "response_targets_per_row": int(batch.response_mask[0].sum())},
        "tokens_per_step": tokens,
        "flops_per_step": flops,
        "optimizer": OPTIM,
        "order": args.order,
        "repeats": args.repeats,
        "threads": threads,
        "matmul_peak": peak,
        "ours": {**report_ours, "compile_s": round(compile_s - warm_ours, 2),
                 "first_call_s": round(compile_s, 2), **our_facts},
        "torch": {**report_torch, "first_call_s": round(warm_torch, 2), **torch_facts},
        "speedup_ours_over_torch": spread(ratios),
    }
    return write_model_report("train_step", report, args.out, load_before=load_before)


if __name__ == "__main__":
    main()
