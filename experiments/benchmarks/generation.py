"""Generation throughput: our jitted sampler against Hugging Face ``generate`` (PyTorch) on the same weights.

    python -m experiments.benchmarks.generation [--out runs/benchmarks/generation.json] [--repeats 3]

A random Qwen3-architecture model (about 25M parameters) is built with ``transformers``, saved as a
local safetensors folder and loaded into our decoder, so both sides run identical weights. Both
sample (temperature 1, no top-k / top-p) ``--new-tokens`` tokens for ``--batch`` prompts of
``--prompt-len`` tokens. Each side is warmed up first (our compile time is reported separately, never
counted), then timed ``--repeats`` times; the median wall time gives new tokens per second. PyTorch
runs under ``torch.inference_mode`` with as many threads as XLA uses (the CPU count). The EOS id is
one the prompts never use; rows that happen to sample it stop early on our side only, which makes our
count conservative. Prints JSON and writes it to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from typing import Any

import numpy as np

from experiments.benchmarks.common import write_report

MODEL = dict(
    vocab_size=16384,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)


def build_checkpoint(folder: str, seed: int) -> Any:
    """A random Qwen3 model saved to ``folder``; returns the torch model."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen3Config(**MODEL)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(folder, safe_serialization=True)
    return model


def time_it(fn, repeats: int) -> tuple[float, list[float]]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), times


def bench_ours(folder: str, prompts: list[list[int]], new_tokens: int, repeats: int, dtype: str, eos: int):
    import dataclasses

    import jax

    from mage_jax.models.config import ModelConfig
    from mage_jax.models.hf_loading import load_hf_params
    from mage_jax.sampling import Sampler, SamplingParams

    config = dataclasses.replace(ModelConfig.from_hf_dir(folder), param_dtype=dtype, dtype=dtype)
    config, graphdef, state = load_hf_params(folder, config)
    sampler = Sampler(
        graphdef,
        config,
        eos_ids=[eos],
        pad_id=0,
        prompt_buckets=(len(prompts[0]),),
        batch_buckets=(len(prompts),),
    )
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens)
    keys = iter(jax.random.split(jax.random.key(0), repeats + 1))
    counts: list[int] = []

    def run():
        out = sampler.generate(state, prompts, params, next(keys))
        counts.append(sum(len(t) for t in out.tokens))

    start = time.perf_counter()
    run()
    warmup = time.perf_counter() - start
    median, times = time_it(run, repeats)
    tokens = min(counts[1:])
    return {
        "tokens_per_s": tokens / median,
        "median_s": median,
        "times_s": times,
        "new_tokens": tokens,
        "warmup_incl_compile_s": warmup,
        "compile_count": sampler.compile_count,
        "dtype": dtype,
        "jax": jax.__version__,
        "backend": jax.default_backend(),
    }


def bench_hf(model: Any, prompts: list[list[int]], new_tokens: int, repeats: int, dtype: str, threads: int):
    import torch

    torch.set_num_threads(threads)
    model = model.to(getattr(torch, dtype))
    ids = torch.tensor(prompts, dtype=torch.long)
    mask = torch.ones_like(ids)

    def run():
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                pad_token_id=0,
                eos_token_id=None,
            )
        assert out.shape[1] == ids.shape[1] + new_tokens

    run()
    median, times = time_it(run, repeats)
    tokens = len(prompts) * new_tokens
    return {
        "tokens_per_s": tokens / median,
        "median_s": median,
        "times_s": times,
        "new_tokens": tokens,
        "dtype": dtype,
        "threads": threads,
        "torch": torch.__version__,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16"), help="our compute dtype"
    )
    parser.add_argument("--hf-dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/benchmarks/generation.json")
    args = parser.parse_args(argv)

    threads = os.cpu_count() or 1
    rng = np.random.default_rng(args.seed)
    eos = MODEL["vocab_size"] - 1
    prompts = rng.integers(1, eos, size=(args.batch, args.prompt_len)).tolist()
    with tempfile.TemporaryDirectory() as folder:
        hf_model = build_checkpoint(folder, args.seed)
        ours = bench_ours(folder, prompts, args.new_tokens, args.repeats, args.dtype, eos)
    hf = bench_hf(hf_model, prompts, args.new_tokens, args.repeats, args.hf_dtype, threads)
    n_params = sum(p.numel() for p in hf_model.parameters())
    result = {
        "benchmark": "generation",
        "model": {"architecture": "qwen3", "parameters": int(n_params), **MODEL},
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "sampling": {"temperature": 1.0, "top_k": 0, "top_p": 1.0},
        "ours": ours,
        "hf": hf,
        "ratio": ours["tokens_per_s"] / hf["tokens_per_s"],
        "cpu_count": threads,
        "machine": platform.processor() or platform.machine(),
        "load_avg_1m": os.getloadavg()[0],
    }
    return write_report(result, args.out)


if __name__ == "__main__":
    main()
