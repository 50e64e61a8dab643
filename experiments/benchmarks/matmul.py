"""XLA:CPU against PyTorch on the exact matrix products of the train-step benchmark's model and batch.

    python -m experiments.benchmarks.matmul [--threads 1] [--repeats 5] [--xla-flags "..."]
        [--out runs/benchmarks/matmul.json]

The train step is mostly matrix products. This benchmark times each distinct product of one
``experiments.benchmarks.train_step`` step on its own (``--shape 27m``, ``--rows`` x ``--length`` tokens)
in both runtimes, in the three layouts a step uses: the forward product ``x @ W``, the input gradient
``dy @ W.T`` and the weight gradient ``x.T @ dy`` (a contraction over all tokens), plus the batched
attention products (``q @ k.T`` and ``p @ v`` over rows x heads). Ours is a jitted ``jnp.einsum``
(the layouts the model's ``einsum`` and its autodiff produce), PyTorch is ``torch.matmul`` on
(transposed) views, which hand the transposes to MKL / oneDNN without a copy.

Each product is warmed up once per side, then the sides alternate ``--repeats`` times; reported per
product: best and median GFLOP/s of each side, their ratio, and how many times one step runs it. The
``step`` section weighs the products by those counts: seconds of matrix products per step at each
side's median rate, which is the floor under each side's step time and says how much of a gap between
the two steps the products alone explain. ``--xla-flags`` is appended to ``XLA_FLAGS`` before XLA
starts (compare e.g. ``--xla_cpu_experimental_ynn_fusion_type=dot`` with the default in two runs).
Prints JSON and writes it to ``--out``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import statistics
import time
from typing import Any

import numpy as np

from experiments.benchmarks.common import (
    QWEN3_SHAPES,
    load_average,
    model_parser,
    pinned_threads,
    write_model_report,
)


@dataclasses.dataclass(frozen=True)
class Product:
    """One matrix product of the step: ``einsum(spec, a[a_shape], b[b_shape])``, run ``count`` times."""

    name: str
    spec: str
    a_shape: tuple[int, ...]
    b_shape: tuple[int, ...]
    flops: float
    count: int


def step_products(shape: dict[str, Any], rows: int, length: int) -> list[Product]:
    """The products of one train step (forward, input gradient, weight gradient) on this model and batch.

    Counts are per step as our step runs them: the output head's forward product runs twice (the
    forward pass and the recomputation in its hand-written gradient), attention scores are dense.
    """
    m = rows * length
    hidden, inter, vocab = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    heads, kv_heads, dim = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    layers = shape["num_hidden_layers"]
    linear = {  # name: (in, out, per step count of each layout)
        "q_proj/o_proj": (hidden, heads * dim, 2 * layers),
        "k_proj/v_proj": (hidden, kv_heads * dim, 2 * layers),
        "gate_proj/up_proj": (hidden, inter, 2 * layers),
        "down_proj": (inter, hidden, layers),
        "lm_head": (hidden, vocab, 1),
    }
    products = []
    for name, (k, n, count) in linear.items():
        flops = 2.0 * m * k * n
        forward = count * 2 if name == "lm_head" else count
        products += [
            Product(f"{name} forward x@W", "mk,kn->mn", (m, k), (k, n), flops, forward),
            Product(f"{name} input grad dy@W.T", "mn,kn->mk", (m, n), (k, n), flops, count),
            Product(f"{name} weight grad x.T@dy", "mk,mn->kn", (m, k), (m, n), flops, count),
        ]
    # Attention as the dense path computes it: the G = heads / kv_heads query heads that share a kv
    # head are stacked along the rows, so each product is batched over rows x kv heads.
    bh, group = rows * kv_heads, heads // kv_heads
    attn = 2.0 * bh * group * length * length * dim
    tq = group * length
    products += [
        Product("attention scores q@k.T", "btd,bsd->bts", (bh, tq, dim), (bh, length, dim), attn,
                2 * layers),  # forward scores and the backward's dP = dy @ v.T
        Product("attention output p@v", "bts,bsd->btd", (bh, tq, length), (bh, length, dim), attn,
                2 * layers),  # forward output and the backward's dq = dS @ k
        Product("attention grads p.T@dy", "bts,btd->bsd", (bh, tq, length), (bh, tq, dim), attn,
                2 * layers),  # dv = p.T @ dy and dk = dS.T @ q
    ]
    return products


def _torch_fn(spec: str):
    """The PyTorch call of an einsum spec: matmul on (transposed) views, no copies."""
    import torch

    return {
        "mk,kn->mn": lambda a, b: torch.mm(a, b),
        "mn,kn->mk": lambda a, b: torch.mm(a, b.t()),
        "mk,mn->kn": lambda a, b: torch.mm(a.t(), b),
        "btd,bsd->bts": lambda a, b: torch.bmm(a, b.transpose(1, 2)),
        "bts,bsd->btd": lambda a, b: torch.bmm(a, b),
        "bts,btd->bsd": lambda a, b: torch.bmm(a.transpose(1, 2), b),
    }[spec]


def time_product(
    product: Product, repeats: int, rng: np.random.Generator, alt_options: dict[str, str] | None = None
) -> dict[str, Any]:
    """Interleaved seconds of one product in both runtimes (and, with ``alt_options``, ours compiled
    again with those XLA options as a third side ``ours_alt``)."""
    import jax
    import jax.numpy as jnp
    import torch

    a = rng.standard_normal(product.a_shape, dtype=np.float32)
    b = rng.standard_normal(product.b_shape, dtype=np.float32)
    ja, jb = jnp.asarray(a), jnp.asarray(b)
    lowered = jax.jit(lambda x, y: jnp.einsum(product.spec, x, y)).lower(ja, jb)
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    theirs = _torch_fn(product.spec)
    compiled = {"ours": lowered.compile()}
    if alt_options:
        compiled["ours_alt"] = lowered.compile(alt_options)
    reference = theirs(ta, tb).numpy()
    errors = {}
    for side, program in compiled.items():
        # Warm-up, and a check that both sides compute the same product (the layouts map one to one).
        mine = np.asarray(program(ja, jb))
        errors[side] = float(np.linalg.norm(mine - reference) / np.linalg.norm(reference))
        if not errors[side] < 1e-4:
            raise RuntimeError(f"{product.name}: the two products differ (relative error {errors[side]:.2e})")
    sides = {side: functools.partial(_run_jax, program, ja, jb) for side, program in compiled.items()}
    sides["torch"] = lambda: theirs(ta, tb)
    times: dict[str, list[float]] = {side: [] for side in sides}
    for _ in range(repeats):
        for side, fn in sides.items():
            start = time.perf_counter()
            fn()
            times[side].append(time.perf_counter() - start)
    rate = {side: [product.flops / t / 1e9 for t in ts] for side, ts in times.items()}
    alt = {}
    if alt_options:
        alt = {"ours_alt_gflops": _rates(rate["ours_alt"]),
               "alt_over_ours_median": round(statistics.median(rate["ours_alt"])
                                             / statistics.median(rate["ours"]), 3)}
    error = max(errors.values())
    return {
        "name": product.name,
        "einsum": product.spec,
        "shapes": [list(product.a_shape), list(product.b_shape)],
        "gflop": round(product.flops / 1e9, 3),
        "per_step": product.count,
        "ours_gflops": _rates(rate["ours"]),
        "torch_gflops": _rates(rate["torch"]),
        "ratio_median": round(statistics.median(rate["ours"]) / statistics.median(rate["torch"]), 3),
        "ratio_best": round(max(rate["ours"]) / max(rate["torch"]), 3),
        "relative_difference": float(f"{error:.2e}"),
        **alt,
    }


def _rates(rates: list[float]) -> dict[str, float]:
    """Best and median GFLOP/s, four significant digits (a tiny product's rate never rounds to 0)."""
    return {"best": float(f"{max(rates):.4g}"), "median": float(f"{statistics.median(rates):.4g}")}


def _run_jax(program: Any, a: Any, b: Any) -> None:
    program(a, b).block_until_ready()


def step_summary(products: list[Product], results: list[dict[str, Any]]) -> dict[str, Any]:
    """Seconds of products per step at each side's median rate, with our counts on both sides."""
    seconds = {"ours": 0.0, "torch": 0.0}
    best = {"ours": 0.0, "torch": 0.0}
    flops = 0.0
    for product, result in zip(products, results, strict=True):
        flops += product.count * product.flops
        for side in seconds:
            seconds[side] += product.count * product.flops / (result[f"{side}_gflops"]["median"] * 1e9)
            best[side] += product.count * product.flops / (result[f"{side}_gflops"]["best"] * 1e9)
    return {
        "gflop_per_step": round(flops / 1e9, 1),
        "ours_seconds_median_rates": round(seconds["ours"], 3),
        "torch_seconds_median_rates": round(seconds["torch"], 3),
        "ours_seconds_best_rates": round(best["ours"], 3),
        "torch_seconds_best_rates": round(best["torch"], 3),
        "ours_over_torch_time": round(seconds["ours"] / seconds["torch"], 3),
        "ours_gflops_weighted": round(flops / seconds["ours"] / 1e9, 2),
        "torch_gflops_weighted": round(flops / seconds["torch"] / 1e9, 2),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = model_parser(__doc__, out="runs/benchmarks/matmul.json")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--xla-flags", default="", help="appended to XLA_FLAGS before XLA starts")
    parser.add_argument("--alt-option", action="append", default=[], metavar="NAME=VALUE",
                        help="XLA debug option of a third side, ours compiled again with it (repeatable), "
                             "e.g. xla_cpu_experimental_ynn_fusion_type= (library dots off: XLA's own)")
    parser.add_argument("--only", default="", help="run only products whose name contains this text")
    args = parser.parse_args(argv)
    if args.rows < 1 or args.length < 1 or args.repeats < 1 or args.threads < 0:
        parser.error("--rows, --length and --repeats must be positive and --threads >= 0")
    if args.xla_flags:
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {args.xla_flags}".strip()

    shape = QWEN3_SHAPES[args.shape]
    products = [p for p in step_products(shape, args.rows, args.length) if args.only in p.name]
    if not products:
        parser.error(f"--only {args.only!r} matches no product")
    alt_options = {}
    for option in args.alt_option:
        name, sep, value = option.partition("=")
        if not sep or not name:
            parser.error(f"--alt-option takes NAME=VALUE, got {option!r}")
        alt_options[name.lstrip("-")] = value
    rng = np.random.default_rng(args.seed)
    load_before = load_average()
    with pinned_threads(args.threads) as threads:
        results = [time_product(p, args.repeats, rng, alt_options) for p in products]
    report = {
        "model": {"architecture": "qwen3", **shape},
        "batch": {"rows": args.rows, "length": args.length, "tokens": args.rows * args.length},
        "repeats": args.repeats,
        "threads": threads,
        "alt_options": alt_options,
        "products": results,
        "step": step_summary(products, results),
    }
    return write_model_report("matmul", report, args.out, load_before=load_before)


if __name__ == "__main__":
    main()
