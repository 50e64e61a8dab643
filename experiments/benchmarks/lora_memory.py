"""Device memory of a ``small-lora`` run (one 16 GB GPU, e.g. a Colab T4), by ahead-of-time compilation.

Builds what the trainer builds for the preset (Qwen3-0.6B layout read from a Hugging Face config,
frozen bfloat16 base, float32 LoRA adapters, one device) with *abstract* parameters
(``jax.eval_shape``: nothing is allocated and no weights are needed), lowers and compiles the train
step's gradient program and its optimizer step, the log-prob recompute and the sampler at the
largest shapes the preset produces, and reads ``compiled.memory_analysis()``. The device's peak is
the largest program peak plus what stays resident outside that program (the train state's
parameters and optimizer state are arguments of the update programs; while sampling, the optimizer
state stays resident beside the sampler's arguments).

    python -m experiments.benchmarks.lora_memory [--env kuhn_poker] [--layers 28] \
        --out runs/bench/lora_memory.json

On a CPU, ``--layers 3 4`` compiles two depths and extrapolates linearly to the model's depth (as
``attention_memory`` does); on a GPU the full depth compiles in seconds. Prints a table and writes the
JSON report (per-program bytes, the resident train state, the verdict against ``--budget-gb``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence
from typing import Any

from experiments.benchmarks.attention_memory import GB, Setup, _memory, _rows_spec, _train_batch

T4_BUDGET_GB = 15.0
"""What one 16 GB T4 leaves to XLA (with ``XLA_PYTHON_CLIENT_MEM_FRACTION=.95``; the default is .75)."""


def small_lora_setup(env: str, num_layers: int | None) -> Setup:
    """The ``small-lora`` preset of ``env`` at ``num_layers`` layers (default: the model's depth)."""
    import jax
    from flax import nnx

    from experiments.environments import environment
    from mage_jax import config as C
    from mage_jax.models import sharding as shd
    from mage_jax.models.config import ModelConfig
    from mage_jax.models.transformer import Transformer
    from mage_jax.sampling import Sampler
    from mage_jax.training.assemble import step_config
    from mage_jax.training.train_step import TrainStep, learning_rate_schedule, make_optimizer

    cfg = C.apply_overrides(C.ExperimentConfig(name=env), environment(env).presets["small-lora"].overrides)
    m = cfg.model
    # What build_model does with a local folder: the HF config, the preset's dtype, LoRA and overrides.
    base = ModelConfig.from_hf_config(ModelConfig.preset(m.preset).to_hf_config())
    depth = {} if num_layers is None else {"num_layers": num_layers}
    model_config = dataclasses.replace(base, dtype=m.dtype, lora_rank=m.lora_rank, lora_alpha=m.lora_alpha,
                                       lora_targets=m.lora_targets, **{**m.overrides, **depth})
    mesh = shd.make_mesh(shd.MeshConfig(data=1, fsdp=1, tensor=1), jax.devices()[:1])
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(model_config, rngs=nnx.Rngs(0))))
    shardings = shd.param_shardings(abstract, mesh)
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          abstract, shardings)
    o = cfg.optim
    schedule = learning_rate_schedule(o.lr, o.warmup_steps)
    optimizer = make_optimizer(schedule, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay, grad_clip=o.grad_clip)
    step = TrainStep(graphdef, optimizer, schedule, step_config(cfg), mesh)
    sampler = Sampler(graphdef, model_config, eos_ids=[1], pad_id=0, mesh=mesh, state_shardings=shardings)
    return Setup(cfg, model_config, mesh, graphdef, params, step, sampler)


def _abstract_state(setup: Setup) -> Any:
    """The abstract ``TrainState`` of the preset: full parameters, optimizer state of the adapters."""
    import jax

    return jax.eval_shape(lambda p: _init(setup, p), setup.params)


def _init(setup: Setup, params: Any) -> Any:
    import jax.numpy as jnp

    from mage_jax.training.train_step import TrainState

    return TrainState(params=params, opt_state=setup.step.optimizer.init(setup.step._trainable(params)[0]),
                      step=jnp.zeros((), jnp.int32))


def _nbytes(tree: Any) -> int:
    import jax

    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def compile_programs(setup: Setup) -> dict[str, Any]:
    """Compile every program of an iteration at the preset's largest shapes -> memory per program."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from mage_jax.models.sharding import cache_sharding
    from mage_jax.models.transformer import init_cache
    from mage_jax.sampling import _Static
    from mage_jax.training.assemble import length_buckets, row_length_buckets

    cfg, step = setup.cfg, setup.step
    length = row_length_buckets(cfg)[-1]
    rows = cfg.optim.mini_batch_rows
    batch = _train_batch(setup, rows, length)
    state = _abstract_state(setup)
    state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=step._replicated), state)
    state = state.replace(params=setup.params)
    grads_shardings = step._trainable(setup.params_shardings())[0]
    out: dict[str, Any] = {}
    with jax.set_mesh(setup.mesh):
        grads = jax.jit(step._grads_fn, out_shardings=(grads_shardings, step._replicated))
        out["train_grads"] = grads.lower(setup.params, batch).compile()
        abstract_grads, metrics = jax.eval_shape(step._grads_fn, setup.params, batch)
        grads = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                             abstract_grads, grads_shardings)
        apply = jax.jit(step._apply_fn, donate_argnums=(0,))
        out["optimizer_step"] = apply.lower(state, grads, metrics, jnp.float32(1.0)).compile()

        def logprobs(params, batch):
            logp, _ = step._token_logprobs(params, batch)
            return jnp.where(batch.response_mask, logp, 0.0)

        out["logprobs"] = jax.jit(logprobs, out_shardings=step._batch_sharding).lower(
            setup.params, batch).compile()
        r = cfg.rollout
        prompt = length_buckets(r.max_prompt_tokens, r.length_buckets)[-1]
        new_tokens = max(r.max_response_tokens, r.max_reflection_tokens or 0)
        sampler_rows = max(r.num_tasks * r.group_size, cfg.train.eval_meta_episodes,
                           cfg.train.eval_heldout_meta_episodes)
        fn = setup.sampler._build(_Static(greedy=False, top_k=0, use_top_p=False, constrained=False))
        sharding = cache_sharding(setup.model_config, setup.mesh, sampler_rows)
        cache = jax.eval_shape(lambda: init_cache(setup.model_config, sampler_rows, prompt + new_tokens))
        cache = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), cache)
        args = (setup.params, cache, _rows_spec(setup, (sampler_rows, prompt), jnp.int32),
                _rows_spec(setup, (sampler_rows, prompt), jnp.bool_),
                _rows_spec(setup, (sampler_rows,), jnp.int32), None, jax.random.key(0), np.float32(1.0),
                np.float32(1.0))
        out["sampler"] = fn.lower(*args).compile()
    shapes = {"train_rows": rows, "train_length": length, "micro_batch_rows": cfg.optim.micro_batch_rows,
              "sampler_rows": sampler_rows, "prompt": prompt, "new_tokens": new_tokens,
              "kv_cache_bytes": _nbytes(cache)}
    resident = {"params": _nbytes(setup.params), "opt_state": _nbytes(state.opt_state),
                "adapters": _nbytes(step._trainable(setup.params)[0])}
    return {"memory": {name: _memory(c) for name, c in out.items()}, "shapes": shapes, "resident": resident}


def measure(env: str, layers: Sequence[int]) -> dict[str, Any]:
    """Memory of each program, extrapolated to the full depth when two depths are compiled."""
    from mage_jax.models.config import ModelConfig

    started = time.perf_counter()
    measured = {n: compile_programs(small_lora_setup(env, n)) for n in layers}
    full = ModelConfig.preset("qwen3-0.6b").num_layers
    hi = max(layers)
    if len(layers) == 1:
        if hi != full:
            raise SystemExit(f"--layers {hi}: compile the full depth ({full}) or two depths to extrapolate")
        extrapolated = measured[hi]
    else:
        lo = min(layers)

        def line(a: float, b: float) -> float:
            return b + (full - hi) * (b - a) / (hi - lo)

        extrapolated = {
            "memory": {p: {k: line(measured[lo]["memory"][p][k], v) for k, v in m.items()}
                       for p, m in measured[hi]["memory"].items()},
            "shapes": {**measured[hi]["shapes"], "kv_cache_bytes": line(
                measured[lo]["shapes"]["kv_cache_bytes"], measured[hi]["shapes"]["kv_cache_bytes"])},
            "resident": {k: line(measured[lo]["resident"][k], v)
                         for k, v in measured[hi]["resident"].items()},
        }
    mem, resident = extrapolated["memory"], extrapolated["resident"]
    # Programs whose arguments include the train state see it in their peak; the others run beside it.
    beside = {"train_grads": resident["opt_state"], "optimizer_step": 0.0, "logprobs": resident["opt_state"],
              "sampler": resident["opt_state"]}
    device_peak = {p: mem[p]["peak"] + beside[p] for p in mem}
    return {"env": env, "layers_compiled": list(layers), "full_depth": full, "measured": {
        str(n): v for n, v in measured.items()}, "extrapolated": extrapolated, "device_peak": device_peak,
        "peak": max(device_peak.values()), "compile_s": round(time.perf_counter() - started, 1)}


def _table(result: dict[str, Any], budget: float) -> str:
    mem, peak = result["extrapolated"]["memory"], result["device_peak"]
    lines = ["| program | arguments | outputs | temporaries | device peak |", "|---|---|---|---|---|"]
    for p in mem:
        m = mem[p]
        lines.append(f"| {p} | {m['argument'] / GB:.2f} GB | {m['output'] / GB:.2f} GB "
                     f"| {m['temp'] / GB:.2f} GB | {peak[p] / GB:.2f} GB |")
    verdict = "fits" if result["peak"] <= budget * GB else "does not fit"
    lines.append(f"\npeak {result['peak'] / GB:.2f} GB per device: {verdict} in {budget:g} GB")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", default="kuhn_poker")
    parser.add_argument("--layers", type=int, nargs="+", default=[28],
                        help="depth(s) compiled: the full depth, or two depths to extrapolate from")
    parser.add_argument("--budget-gb", type=float, default=T4_BUDGET_GB)
    parser.add_argument("--out", default="runs/bench/lora_memory.json")
    args = parser.parse_args(argv)

    from experiments.benchmarks.common import machine, write_report

    result = measure(args.env, args.layers)
    table = _table(result, args.budget_gb)
    print(table, file=sys.stderr)
    command = "python -m experiments.benchmarks.lora_memory " + " ".join(argv or sys.argv[1:])
    write_report({"benchmark": "lora_memory", "command": command.strip(), "budget_gb": args.budget_gb,
                  "fits": result["peak"] <= args.budget_gb * GB, **result, "table": table,
                  "machine": machine()}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
