"""Per-device memory of the ``paper`` Kuhn Poker preset's programs, by ahead-of-time compilation.

Builds exactly what the trainer builds for the preset (Qwen3-4B layout as read from a Hugging Face
config: float32 parameters, bfloat16 activations, mesh fsdp over every device) with *abstract*
parameters, lowers and compiles the train step's gradient program, the log-prob recompute and the
sampler (prefill + decode loop), and reads ``compiled.memory_analysis()``. Nothing is allocated, so
it runs on CPU; with ``--devices 8`` the 8 devices are fake CPU devices
(``--xla_force_host_platform_device_count``), set before JAX is imported, and XLA:CPU uses its
memory-minimising schedule (``CPU_MEMORY_FLAGS``).

Compiling 36 layers at 12k tokens is slow, so each program is compiled at ``--layers`` (default 3 and
4) and extrapolated linearly to the full depth: peak(L) = peak(4) + (L - 4) * (peak(4) - peak(3)). The
first blocks are not typical (depth 1 -> 2 grows more than any later step), hence 3 and 4.

    python -m experiments.benchmarks.attention_memory --devices 8 --out runs/bench/attention_memory.json

prints a Markdown table (before = dense attention without rematerialisation, as the code was; after =
the preset's attention and remat policy) and writes the JSON report.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

GB = 1e9
H100_BYTES = 80 * GB


# XLA:CPU's default schedule favours concurrency over memory: it runs rematerialised forward passes
# of every layer early and keeps all their activations alive, which the GPU and TPU schedulers never
# do. Memory analysis on CPU is meaningful only with the memory-minimising schedule.
CPU_MEMORY_FLAGS = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def force_cpu_devices(count: int) -> None:
    """``count`` fake CPU devices with the memory-minimising schedule; must run before JAX starts."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        flags = f"{flags} --xla_force_host_platform_device_count={count}"
    if "concurrency_optimized_scheduler" not in flags:
        flags = f"{flags} {CPU_MEMORY_FLAGS}"
    os.environ["XLA_FLAGS"] = flags.strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


@dataclasses.dataclass(frozen=True)
class Setup:
    """The paper preset's pieces with abstract parameters: config, model, mesh, train step, sampler."""

    cfg: Any
    model_config: Any
    mesh: Any
    graphdef: Any
    params: Any  # ShapeDtypeStructs carrying their shardings
    step: Any
    sampler: Any

    def params_shardings(self) -> Any:
        import jax

        return jax.tree.map(lambda a: a.sharding, self.params)


def paper_setup(num_layers: int, *, attention: str | None = None, remat: str | None = None,
                micro_batch_rows: int | None = None) -> Setup:
    """The Kuhn Poker ``paper`` preset at ``num_layers`` layers (attention / remat / the train step's
    micro-batch rows: the preset's unless given)."""
    import jax
    from flax import nnx

    from experiments.kuhn_poker import PRESETS
    from mage_jax import config as C
    from mage_jax.models import sharding as shd
    from mage_jax.models.config import ModelConfig
    from mage_jax.models.transformer import Transformer
    from mage_jax.sampling import Sampler
    from mage_jax.training.assemble import step_config
    from mage_jax.training.train_step import TrainStep, learning_rate_schedule, make_optimizer

    cfg = C.apply_overrides(C.ExperimentConfig(name="kuhn_poker"), PRESETS["paper"].overrides)
    if micro_batch_rows is not None:
        cfg = C.apply_overrides(cfg, {"optim.micro_batch_rows": micro_batch_rows})
    m = cfg.model
    # What build_model does with a local folder: the HF config (float32 parameters), then the preset's
    # activation dtype and model overrides.
    base = ModelConfig.from_hf_config(ModelConfig.preset(m.preset).to_hf_config())
    overrides = dict(m.overrides)
    if attention is not None:
        overrides["attention"] = attention
    if remat is not None:
        overrides["remat"] = remat
    model_config = dataclasses.replace(base, dtype=m.dtype, num_layers=num_layers, **overrides)
    mesh = shd.make_mesh(shd.MeshConfig(data=cfg.mesh.data, fsdp=cfg.mesh.fsdp, tensor=cfg.mesh.tensor))
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


def _memory(compiled) -> dict[str, float]:
    """Per-device bytes of a compiled program; ``peak`` is arguments + outputs - aliased + temporaries."""
    mem = compiled.memory_analysis()
    out = {
        "argument": mem.argument_size_in_bytes,
        "output": mem.output_size_in_bytes,
        "alias": mem.alias_size_in_bytes,
        "temp": mem.temp_size_in_bytes,
    }
    out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    return out


def _rows_spec(setup: Setup, shape: Sequence[int], dtype) -> Any:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from mage_jax.models.sharding import BATCH_AXES

    spec = PartitionSpec(BATCH_AXES, *([None] * (len(shape) - 1)))
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=NamedSharding(setup.mesh, spec))


def _train_batch(setup: Setup, rows: int, length: int) -> Any:
    import jax.numpy as jnp

    from mage_jax.training.train_step import TrainBatch

    batch = {name: _rows_spec(setup, (rows, length), dtype) for name, dtype in (
        ("tokens", jnp.int32), ("positions", jnp.int32), ("token_mask", jnp.bool_), ("targets", jnp.int32),
        ("response_mask", jnp.bool_), ("old_logprobs", jnp.float32))}
    batch["prompt_lengths"] = _rows_spec(setup, (rows,), jnp.int32)
    batch["advantages"] = _rows_spec(setup, (rows,), jnp.float32)
    if setup.step.config.kl_coef > 0:
        batch["ref_logprobs"] = _rows_spec(setup, (rows, length), jnp.float32)
    return TrainBatch(**batch)


def compile_train_grads(setup: Setup, rows: int, length: int):
    """The train step's loss-and-gradient program, exactly as ``TrainStep.update`` jits it."""
    import jax

    step = setup.step
    fn = jax.jit(step._grads_fn, out_shardings=(setup.params_shardings(), step._replicated))
    with jax.set_mesh(setup.mesh):
        return fn.lower(setup.params, _train_batch(setup, rows, length)).compile()


def compile_logprobs(setup: Setup, rows: int, length: int):
    """The log-prob recompute (old and reference log-probs), as ``TrainStep.compute_logprobs`` jits it."""
    import jax
    import jax.numpy as jnp

    step = setup.step

    def fn(params, batch):
        logp, _ = step._token_logprobs(params, batch)
        return jnp.where(batch.response_mask, logp, 0.0)

    jitted = jax.jit(fn, out_shardings=step._batch_sharding)
    with jax.set_mesh(setup.mesh):
        return jitted.lower(setup.params, _train_batch(setup, rows, length)).compile()


def compile_sampler(setup: Setup, rows: int, prompt: int, new_tokens: int):
    """The sampler's jitted prefill + decode loop for ``rows`` prompts of ``prompt`` tokens."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from mage_jax.models.sharding import cache_sharding
    from mage_jax.models.transformer import init_cache
    from mage_jax.sampling import _Static

    sampler = setup.sampler
    fn = sampler._build(_Static(greedy=False, top_k=0, use_top_p=False, constrained=False))
    sharding = cache_sharding(setup.model_config, setup.mesh, rows)
    cache = jax.eval_shape(lambda: init_cache(setup.model_config, rows, prompt + new_tokens))
    cache = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), cache)
    args = (setup.params, cache, _rows_spec(setup, (rows, prompt), jnp.int32),
            _rows_spec(setup, (rows, prompt), jnp.bool_), _rows_spec(setup, (rows,), jnp.int32), None,
            jax.random.key(0), np.float32(1.0), np.float32(1.0))
    with jax.set_mesh(setup.mesh):
        return fn.lower(*args).compile()


def program_memory(program: str, layers: Sequence[int], *, length: int, rows: int, attention: str | None,
                   remat: str | None, prompt: int = 0, micro_batch_rows: int | None = None) -> dict[str, Any]:
    """Compile ``program`` at each depth in ``layers`` and extrapolate its per-device bytes to full depth."""
    from mage_jax.models.attention import choose_implementation
    from mage_jax.models.config import ModelConfig

    full_depth = ModelConfig.preset("qwen3-4b").num_layers
    measured = {}
    started = time.perf_counter()
    setup = None
    for n in layers:
        setup = paper_setup(n, attention=attention, remat=remat, micro_batch_rows=micro_batch_rows)
        if program == "train_grads":
            compiled = compile_train_grads(setup, rows, length)
        elif program == "logprobs":
            compiled = compile_logprobs(setup, rows, length)
        elif program == "sampler":
            compiled = compile_sampler(setup, rows, prompt, length - prompt)
        else:
            raise ValueError(f"unknown program {program!r}")
        measured[n] = _memory(compiled)
    lo, hi = min(layers), max(layers)
    per_layer = {k: (measured[hi][k] - measured[lo][k]) / max(hi - lo, 1) for k in measured[lo]}
    extrapolated = {k: measured[hi][k] + (full_depth - hi) * per_layer[k] for k in measured[hi]}
    devices = setup.mesh.size
    mc = setup.model_config
    query_len = prompt if program == "sampler" else length  # the sampler's self-attention is its prefill
    chosen = choose_implementation(mc.attention, query_len, mc.jnp_dtype,
                                   dense_max_len=mc.attention_dense_max_len, platform="cpu")
    return {
        "program": program, "attention": chosen, "remat": mc.remat,
        "micro_batch_rows": setup.step.config.micro_batch_rows if program == "train_grads" else 0,
        "length": length, "prompt": prompt, "rows": rows, "rows_per_device": rows // devices,
        "devices": devices, "layers_compiled": list(layers), "full_depth": full_depth,
        "measured": {str(n): v for n, v in measured.items()}, "per_layer": per_layer,
        "extrapolated": extrapolated, "compile_s": round(time.perf_counter() - started, 1),
    }


def _table(results: list[dict[str, Any]]) -> str:
    lines = ["| program | variant | T | rows (per device) | peak / device, 36 layers | per layer | temp "
             "| fits 80 GB |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        peak = r["extrapolated"]["peak"]
        micro = f", micro-batch {r['micro_batch_rows']}" if r["micro_batch_rows"] else ""
        lines.append(
            f"| {r['program']} | {r['variant']} ({r['attention']}, remat {r['remat']}{micro}) | "
            f"{r['length']} | {r['rows']} ({r['rows_per_device']}) | {peak / GB:,.1f} GB | "
            f"{r['per_layer']['peak'] / GB:,.2f} GB | {r['extrapolated']['temp'] / GB:,.1f} GB | "
            f"{'yes' if peak < H100_BYTES else 'no'} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/bench/attention_memory.json")
    parser.add_argument("--devices", type=int, default=8, help="fake CPU devices (the mesh's fsdp axis)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 12288])
    parser.add_argument("--layers", type=int, nargs="+", default=[3, 4],
                        help="depths compiled; the first block differs, so extrapolate from the last two")
    parser.add_argument("--programs", nargs="+", default=["train_grads", "logprobs", "sampler"])
    parser.add_argument("--train-rows", type=int, default=64, help="optim.mini_batch_rows of the preset")
    parser.add_argument("--sampler-rows", type=int, default=128, help="num_tasks x group_size of the preset")
    parser.add_argument("--variants", nargs="+", default=["before", "whole", "after"],
                        choices=["before", "whole", "after"])
    args = parser.parse_args(argv)
    force_cpu_devices(args.devices)

    from experiments.benchmarks.common import machine, write_report

    # before: dense attention, no remat, whole mini-batch (the code as it was); whole: the preset's
    # attention and remat on the whole mini-batch; after: the preset's settings, micro-batches included.
    variants = {"before": ("dense", "none", 0), "whole": (None, None, 0), "after": (None, None, None)}
    results = []
    for program in args.programs:
        for length in args.lengths:
            for variant in args.variants:
                attention, remat, micro = variants[variant]
                rows = args.sampler_rows if program == "sampler" else args.train_rows
                prompt = length // 3 if program == "sampler" else 0  # the paper's 4096 : 8192 split
                r = program_memory(program, args.layers, length=length, rows=rows, attention=attention,
                                   remat=remat, prompt=prompt, micro_batch_rows=micro)
                r["variant"] = variant
                results.append(r)
                print(f"{program} T={length} {variant}: {r['extrapolated']['peak'] / GB:,.1f} GB per device "
                      f"({r['compile_s']} s)", file=sys.stderr, flush=True)
    print(_table(results), file=sys.stderr)
    command = "python -m experiments.benchmarks.attention_memory " + " ".join(argv or sys.argv[1:])
    write_report({"benchmark": "attention_memory", "command": command.strip(), "results": results,
                  "table": _table(results), "machine": machine()}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
