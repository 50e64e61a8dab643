"""Generation throughput: our jitted sampler against Hugging Face ``generate`` (PyTorch) on the same weights.

    python -m experiments.benchmarks.generation [--threads 1] [--repeats 3]
        [--out runs/benchmarks/generation.json]

A random Qwen3 (``--shape 27m``: 27.3M parameters) is built with ``transformers``, saved as a local
safetensors folder and loaded into our decoder, so both sides run identical weights. Both sample
(temperature 1, no top-k / top-p) for ``--batch`` prompts of ``--prompt-len`` random tokens, no padding.

Fairness: both runtimes run on the same ``--threads`` CPUs (``common.pinned_threads``; on a shared
machine also start the process under ``taskset``), since PyTorch's OpenMP degrades far more than XLA
when its threads compete with other processes. Each side is warmed up first (our compile time is
reported separately, never counted). Then, ``--repeats`` times and alternating between the sides, each
runs the full call (``--new-tokens`` tokens, HF forced by ``min_new_tokens``) and the prefill call (one
new token). Decode tokens/s is ``batch * (new_tokens - 1) / (full - prefill)``. Each quantity is given as
min / median / max, the ratio per repeat, with the load average before and after. The EOS id is one the
prompts never use; rows that happen to sample it stop early on our side only (our count is the smaller).
Prints JSON and writes it to ``--out``.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from experiments.benchmarks.common import (
    QWEN3_SHAPES,
    build_hf_checkpoint,
    load_average,
    model_parser,
    pinned_threads,
    spread,
    write_model_report,
)


def build_ours(folder: str, prompts: list[list[int]], dtype: str, eos: int, seed: int):
    """A function ``new_tokens -> tokens generated`` running our sampler, and facts for the report."""
    import jax

    from mage_jax.generate.sampler import Sampler
    from mage_jax.generate.spec import ModelSpec
    from mage_jax.generate.step import SamplingParams
    from mage_jax.models.config import ModelConfig
    from mage_jax.models.hf_loading import load_hf_params

    config = dataclasses.replace(ModelConfig.from_hf_dir(folder), param_dtype=dtype, dtype=dtype)
    config, graphdef, state = load_hf_params(folder, config)
    spec = ModelSpec(graphdef, config, eos_ids=(eos,), pad_id=0, prompt_buckets=(len(prompts[0]),))
    sampler = Sampler(spec, batch_buckets=(len(prompts),))
    keys = [jax.random.key(seed)]

    def run(new_tokens: int) -> int:
        keys[0], key = jax.random.split(keys[0])
        params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens)
        out = sampler.generate(state, prompts, params, key)
        return sum(len(t) for t in out.tokens)

    facts = {"dtype": dtype, "jax": jax.__version__, "backend": jax.default_backend()}
    return run, sampler, facts


def build_hf(model: Any, prompts: list[list[int]], dtype: str, device: str = "cpu"):
    import torch

    model = model.to(device=device, dtype=getattr(torch, dtype)).eval()
    ids = torch.tensor(prompts, dtype=torch.long, device=device)
    mask = torch.ones_like(ids)

    def run(new_tokens: int) -> int:
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_k=0,
                                 top_p=1.0, pad_token_id=0, eos_token_id=None)
        assert out.shape[1] == ids.shape[1] + new_tokens
        return len(prompts) * new_tokens

    facts = {"dtype": dtype, "torch": torch.__version__, "threads": torch.get_num_threads(), "device": device}
    return run, facts


def timed(fn: Callable[[int], int], new_tokens: int) -> tuple[float, int]:
    start = time.perf_counter()
    count = fn(new_tokens)
    return time.perf_counter() - start, count


def summarize(full: list[float], prefill: list[float], counts: list[int], batch: int, new_tokens: int):
    decode_s = [f - p for f, p in zip(full, prefill, strict=True) if f > p]  # noise can invert tiny runs
    return {
        "end_to_end_s": spread(full),
        "end_to_end_tokens_per_s": spread([c / f for c, f in zip(counts, full, strict=True)]),
        "prefill_s": spread(prefill),
        "decode_tokens_per_s": spread([batch * (new_tokens - 1) / d for d in decode_s]) if decode_s else None,
        "new_tokens": min(counts),
        "times_s": {"full": [round(t, 4) for t in full], "prefill": [round(t, 4) for t in prefill]},
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = model_parser(__doc__, out="runs/benchmarks/generation.json")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="our compute dtype")
    parser.add_argument("--hf-dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args(argv)
    if min(args.batch, args.prompt_len, args.repeats) < 1 or args.new_tokens < 2 or args.threads < 0:
        parser.error("--batch, --prompt-len, --repeats must be positive, --new-tokens >= 2, --threads >= 0")

    shape = QWEN3_SHAPES[args.shape]
    eos = shape["vocab_size"] - 1
    prompts = np.random.default_rng(args.seed).integers(1, eos, size=(args.batch, args.prompt_len)).tolist()
    load_before = load_average()
    with pinned_threads(args.threads) as threads, tempfile.TemporaryDirectory() as folder:
        hf_model = build_hf_checkpoint(folder, shape, args.seed)
        ours, sampler, our_facts = build_ours(folder, prompts, args.dtype, eos, args.seed)
        hf, hf_facts = build_hf(hf_model, prompts, args.hf_dtype)
        start = time.perf_counter()
        ours(args.new_tokens)
        ours(1)
        warmup = time.perf_counter() - start
        hf(args.new_tokens)
        hf(1)
        runs: dict[str, dict[str, list]] = {
            side: {"full": [], "prefill": [], "counts": []} for side in ("ours", "hf")
        }
        for _ in range(args.repeats):
            for side, fn in (("ours", ours), ("hf", hf)):
                seconds, count = timed(fn, args.new_tokens)
                runs[side]["full"].append(seconds)
                runs[side]["counts"].append(count)
                runs[side]["prefill"].append(timed(fn, 1)[0])
    summary = {side: summarize(r["full"], r["prefill"], r["counts"], args.batch, args.new_tokens)
               for side, r in runs.items()}
    ours_r, hf_r = runs["ours"], runs["hf"]

    def ratio(ours_rate: Callable[[int], float], hf_rate: Callable[[int], float]) -> dict[str, float] | None:
        values = [ours_rate(i) / hf_rate(i) for i in range(args.repeats)]
        values = [v for v in values if 0 < v < float("inf")]
        return spread(values) if values else None

    def decode(r: dict[str, list]) -> Callable[[int], float]:
        return lambda i: 1.0 / d if (d := r["full"][i] - r["prefill"][i]) > 0 else float("inf")

    report = {
        "model": {"architecture": "qwen3", "parameters": int(sum(p.numel() for p in hf_model.parameters())),
                  **shape},
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "sampling": {"temperature": 1.0, "top_k": 0, "top_p": 1.0},
        "repeats": args.repeats,
        "order": "interleaved",
        "threads": threads,
        "ours": {**summary["ours"], "warmup_incl_compile_s": round(warmup, 2),
                 "compile_count": sampler.compile_count, **our_facts},
        "hf": {**summary["hf"], **hf_facts},
        "ratio_ours_over_hf": {
            "end_to_end": ratio(lambda i: ours_r["counts"][i] / ours_r["full"][i],
                                lambda i: hf_r["counts"][i] / hf_r["full"][i]),
            "prefill": ratio(lambda i: 1.0 / ours_r["prefill"][i], lambda i: 1.0 / hf_r["prefill"][i]),
            "decode": ratio(decode(ours_r), decode(hf_r)),
        },
    }
    return write_model_report("generation", report, args.out, load_before=load_before)


if __name__ == "__main__":
    main()
