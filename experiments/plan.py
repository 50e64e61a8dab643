"""Scale plan: will a preset fit the hardware, before anything is launched.

    python -m experiments.plan --env kuhn_poker --preset paper [--devices N]
        [--mesh data=1,fsdp=8,tensor=1] [--hardware h100-80gb] [--hardware tpu-v5p] [--json]

builds the preset's programs exactly as the trainer builds them (``training.assemble``: mesh, model
config, train step, sampler, rollout engine) with *abstract* parameters (no weights, nothing
allocated), lowers them with ``mage_jax.aot`` and compiles them ahead of time on fake CPU devices, and
reads XLA's per-device memory analysis:

* ``train_grads``: the loss-and-gradient program of one mini-batch (``optim.mini_batch_rows`` rows at
  the longest row bucket, its micro-batches, the reference log-probs when the KL term is on);
* ``train_apply``: the optimizer step (AdamW on the float32 gradients, the non-finite skip). A run
  executes both as one program (``TrainStep.update_program``, ``aot.lower_train_update``), which needs
  no more than the larger of the two (``tests/experiments/test_plan.py`` compiles all three);
* ``logprobs``: the old / reference log-prob recompute of one mini-batch;
* ``insert`` and ``decode``: the rollout engine's programs at the preset's slots (``rollout.engine_slots``
  or ``training.assemble.make_engine``'s default): ``insert`` prefills every slot from its own prompt of
  the longest prompt bucket, ``decode`` runs one chunk of every slot over the whole cache; the slots'
  KV cache (largest prompt bucket + longest response per slot) is an argument of both;
* ``lockstep`` instead of those two with ``rollout.engine=lockstep``: the lockstep sampler's prefill +
  decode loop for its largest row bucket with the longest prompt bucket and the longest response.

Between programs the run keeps its *resident state* on the devices: parameters, AdamW moments and,
with the KL term, the frozen reference parameters. A program needs the resident state plus what it
adds beyond its state arguments (peak - state arguments); the plan's ``peak`` is the largest of these.
A preset fits a device when that peak is below ``USABLE_FRACTION`` of its memory.

A model that scans its blocks (``ModelConfig.scan_layers``: the pretrained presets and every model read
from a folder) holds one block per program whatever its depth, so each program is compiled at the
model's full depth and nothing is extrapolated. An unrolled model (or ``--layers LO HI``) is compiled at
two depths (default 3 and 6) and extrapolated linearly to the model's depth,
bytes(L) = bytes(6) + (L - 6) x (bytes(6) - bytes(3)) / 3: every decoder block adds the same
parameters, optimizer state, KV cache and (one block at a time under remat) activations. Single steps of
depth are not XLA's linear regime (its memory schedule moves by a block's worth from one depth to the
next), so the slope is taken over three blocks; on Kuhn Poker ``small`` the unrolled extrapolation
equals a full 28-layer compile for every program (docs/scaling.md; ``--set model.overrides.KEY=VALUE``
sets one entry and keeps the preset's others, its ``remat`` included; ``--set model.overrides={...}``
replaces them all).
XLA:CPU computes bfloat16 products in float32
and has no flash-attention kernel, so the numbers are an upper bound of what a GPU or TPU compile
reports. FLOPs are XLA's cost analysis per device; a ``while`` loop body (a decode step) is counted
once. A from-scratch model (``tiny``) is planned with a 256-token vocabulary (its word-level
tokenizer is built at run time); the rollout is planned with one automaton state per slot (constrained
decoding's tables are small).

JSON keys (``--json``), all bytes per device:
  env, preset, layers_compiled, full_depth, model (name, params: parameter count, param_dtype, dtype,
  remat, attention), usable_fraction;
  plans: one per device count, each with devices, mesh {data, fsdp, tensor},
    state {params, opt_state, ref_params, start_copy, total}: the resident state,
    kv_cache: the rollout's KV cache,
    programs {train_grads, train_apply, logprobs, insert, decode (or lockstep)}: each {rows, length,
      prompt, new_tokens,
      argument, output, alias, temp, peak (= argument + output - alias + temp), state_arguments,
      extra (= peak - state_arguments), need (= state.total + extra), flops},
    peak: the largest need, largest: the program that needs it;
  verdicts: one per hardware, each {hardware, devices, hbm, usable, peak, fits, headroom (usable - peak),
    seconds_at_peak {program: flops / bf16 peak}, advice [what to change when it does not fit]}.

Exit status: 0 planned (fits or not), 2 bad arguments or config (one ``error:`` line).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from mage_jax import config as C

GB = 1e9
EXIT_CONFIG_ERROR = 2
USABLE_FRACTION = 0.9
"""Share of a device's memory a plan may use: the rest is the runtime's (CUDA context, fragmentation).
On GPUs JAX preallocates 75% unless ``XLA_PYTHON_CLIENT_MEM_FRACTION`` is raised (docs/scaling.md)."""
DEFAULT_LAYERS = (3, 6)
CHILD_ENV = "MAGE_PLAN_FAKE_DEVICES"


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One accelerator kind: memory per device, devices of the named host / slice, bf16 dense peak."""

    name: str
    hbm: float
    """Bytes of memory per device (GPU or TPU chip)."""
    devices: int
    """Devices JAX sees on the named host or slice."""
    bf16_flops: float
    """Dense bfloat16 (float16 on a T4) peak FLOP/s of one device."""


# Sources: vendor data sheets / Cloud TPU system architecture pages.
HARDWARE: dict[str, Hardware] = {h.name: h for h in (
    # NVIDIA H100 SXM5: 80 GB HBM3, 989 TFLOP/s dense BF16; an HGX / DGX host has 8.
    Hardware("h100-80gb", 80e9, 8, 989e12),
    # NVIDIA A100 40 GB (Colab's A100): 312 TFLOP/s dense BF16; one device.
    Hardware("a100-40gb", 40e9, 1, 312e12),
    # NVIDIA L4: 24 GB GDDR6, 121 TFLOP/s dense BF16 (242 with sparsity); one device (Colab, g2 VMs).
    Hardware("l4-24gb", 24e9, 1, 121e12),
    # NVIDIA T4: 16 GB GDDR6, 65 TFLOP/s FP16 tensor cores (no bfloat16 units); one device (Colab).
    Hardware("t4-16gb", 16e9, 1, 65e12),
    # TPU v4: 32 GiB HBM per chip, 275 TFLOP/s bf16; v4-8 = 4 chips.
    Hardware("tpu-v4", 32 * 2**30, 4, 275e12),
    # TPU v5e: 16 GiB HBM per chip, 197 TFLOP/s bf16; v5litepod-8 = 8 chips.
    Hardware("tpu-v5e", 16 * 2**30, 8, 197e12),
    # TPU v5p: 95 GiB HBM per chip, 459 TFLOP/s bf16; v5p-8 = 4 chips.
    Hardware("tpu-v5p", 95 * 2**30, 4, 459e12),
    # TPU v6e (Trillium): 32 GiB HBM per chip, 918 TFLOP/s bf16; v6e-8 = 8 chips.
    Hardware("tpu-v6e", 32 * 2**30, 8, 918e12),
)}

PROGRAMS = ("train_grads", "train_apply", "logprobs", "insert", "decode")
"""The programs of a run with the rollout engine (the default)."""
LOCKSTEP_PROGRAMS = ("train_grads", "train_apply", "logprobs", "lockstep")
"""The programs of a run with ``rollout.engine=lockstep``."""
ROLLOUT_PROGRAMS = ("insert", "decode", "lockstep")


def programs_of(cfg: C.ExperimentConfig) -> tuple[str, ...]:
    """The programs ``cfg``'s run executes."""
    return LOCKSTEP_PROGRAMS if cfg.rollout.engine == "lockstep" else PROGRAMS

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
    os.environ["JAX_PLATFORMS"] = "cpu"


# ----------------------------------------------------------------------------------------------
# the programs, built as the trainer builds them


@dataclasses.dataclass(frozen=True)
class Setup:
    """A config's run pieces with abstract parameters: model config, mesh, train step, sampler, engine."""

    cfg: C.ExperimentConfig
    model_config: Any
    mesh: Any
    graphdef: Any
    params: Any
    """``ShapeDtypeStruct`` leaves carrying their shardings."""
    opt_state: Any
    step: Any
    sampler: Any
    engine: Any
    """The rollout engine (None with ``rollout.engine=lockstep``)."""

    def state_shardings(self) -> Any:
        from mage_jax.training.train_step import TrainState

        return self.step.state_shardings(TrainState(self.params, self.opt_state, None))


def base_model_config(cfg: C.ExperimentConfig, model_path: str | None = None) -> Any:
    """The HF config a pretrained preset loads (from ``model_path``, else the named ``model.preset``'s
    published config read back as a folder's would be: float32 parameters), or None for a from-scratch
    model."""
    from mage_jax.models.config import ModelConfig

    path = model_path or cfg.model.path
    if path is not None:
        return ModelConfig.from_hf_dir(path)
    if cfg.tokenizer.kind == "hf":
        return ModelConfig.from_hf_config(ModelConfig.preset(cfg.model.preset).to_hf_config())
    return None


def make_setup(cfg: C.ExperimentConfig, devices: int, *, num_layers: int | None = None,
               model_path: str | None = None, vocab_size: int = 0) -> Setup:
    """``cfg``'s mesh over the first ``devices`` devices, its model at ``num_layers`` layers (all when
    None) with abstract parameters, its train step, sampler and engine (``training.assemble``)."""
    import jax

    from mage_jax.models import sharding as shd
    from mage_jax.training import assemble

    mesh = assemble.make_mesh(cfg, devices=jax.devices()[:devices])
    hf = base_model_config(cfg, model_path)
    model_config = assemble.model_config_of(cfg, hf_config=hf, vocab_size=vocab_size or 256)
    if num_layers is not None:
        model_config = dataclasses.replace(model_config, num_layers=num_layers)
    graphdef, params = shd.abstract_sharded(model_config, mesh)
    step = assemble.make_train_step(cfg, graphdef, mesh)
    opt_state = jax.eval_shape(step.optimizer.init, step.trainable(params)[0])  # LoRA: the adapters only
    opt_shardings = shd.opt_state_shardings(opt_state, mesh)
    opt_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), opt_state,
                             opt_shardings)
    shardings = jax.tree.map(lambda a: a.sharding, params)
    spec = assemble.make_spec(cfg, mesh, model_config, graphdef, shardings, eos_ids=[1], pad_id=0)
    sampler, engine = assemble.make_sampler(cfg, spec, mesh), assemble.make_engine(cfg, spec, mesh)
    return Setup(cfg, model_config, mesh, graphdef, params, opt_state, step, sampler, engine)


def compile_train_grads(setup: Setup, rows: int, length: int) -> Any:
    """The loss-and-gradient half of the program ``TrainStep.update`` runs."""
    from mage_jax import aot

    return aot.lower_train_grads(setup.step, setup.params, setup.opt_state, rows, length).compile()


def compile_train_apply(setup: Setup) -> Any:
    """The optimizer-step half (state donated) of the program ``TrainStep.update`` runs."""
    from mage_jax import aot

    return aot.lower_train_apply(setup.step, setup.params, setup.opt_state,
                                 setup.cfg.optim.mini_batch_rows).compile()


def compile_logprobs(setup: Setup, rows: int, length: int) -> Any:
    """The old / reference log-prob recompute, as ``TrainStep.compute_logprobs`` runs it."""
    from mage_jax import aot

    return aot.lower_logprobs(setup.step, setup.params, rows, length).compile()


def rollout_shape(setup: Setup) -> tuple[int, int, int]:
    """(rows, prompt tokens, new tokens) of the rollout's programs: the engine's slots (lockstep: the
    sampler's largest row bucket), the longest prompt bucket, the longest response (play or
    reflection)."""
    prompt = setup.sampler.spec.prompt_buckets[-1]
    if setup.engine is not None:
        return setup.engine.num_slots, prompt, setup.engine.programs.max_new_tokens
    r = setup.cfg.rollout
    return setup.sampler.batch_buckets[-1], prompt, r.max_new_tokens


def rollout_sampling(setup: Setup) -> Any:
    """The training sampling settings of the preset (the programs of evaluation sampling are the same
    shapes)."""
    from mage_jax.generate.step import SamplingParams

    s = setup.cfg.sampling.train
    return SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                          max_new_tokens=rollout_shape(setup)[2])


def compile_rollout(setup: Setup, name: str) -> Any:
    """One of the rollout's generation programs (``aot.lower_rollout``): the engine's ``insert`` or
    ``decode``, or ``lockstep``."""
    from mage_jax import aot

    programs = None if setup.engine is None else setup.engine.programs
    lowered = aot.lower_rollout(setup.sampler, programs, setup.params, rollout_sampling(setup))
    return lowered[name].compile()


def kv_cache_bytes(setup: Setup) -> int:
    """Bytes per device of the rollout's KV cache (the engine's slots, or the lockstep call's)."""
    import jax

    from mage_jax.models.sharding import cache_sharding
    from mage_jax.models.transformer import init_cache

    if setup.engine is not None:
        return device_bytes(setup.engine.programs.abstract_slots().cache)
    rows, prompt, new_tokens = rollout_shape(setup)
    cache = jax.eval_shape(lambda: init_cache(setup.model_config, rows, prompt + new_tokens))
    return device_bytes(cache, cache_sharding(setup.model_config, setup.mesh, rows))


def device_bytes(tree: Any, sharding: Any = None) -> int:
    """Bytes of one device's shard of every array of ``tree`` (its own shardings, or ``sharding``)."""
    import jax

    total = 0
    for leaf in jax.tree.leaves(tree):
        s = sharding or leaf.sharding
        total += math.prod(s.shard_shape(leaf.shape)) * leaf.dtype.itemsize
    return int(total)


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
    """Per-device bytes of one compiled program (XLA's memory analysis) and its FLOPs."""

    argument: int
    output: int
    alias: int
    temp: int
    flops: float

    @property
    def peak(self) -> int:
        return self.argument + self.output - self.alias + self.temp

    @classmethod
    def of(cls, compiled: Any) -> ProgramMemory:
        mem = compiled.memory_analysis()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        return cls(int(mem.argument_size_in_bytes), int(mem.output_size_in_bytes),
                   int(mem.alias_size_in_bytes), int(mem.temp_size_in_bytes),
                   float((cost or {}).get("flops", 0.0)))

    def as_dict(self) -> dict[str, float]:
        return {**dataclasses.asdict(self), "peak": self.peak}


def extrapolate(lo: tuple[int, Mapping[str, float]], hi: tuple[int, Mapping[str, float]],
                depth: int) -> dict[str, float]:
    """Linear in layers: v(depth) = v(hi) + (depth - hi) x (v(hi) - v(lo)) / (hi - lo), key by key."""
    (a, va), (b, vb) = lo, hi
    if a == b:
        return dict(vb)
    return {k: vb[k] + (depth - b) * (vb[k] - va[k]) / (b - a) for k in vb}


# ----------------------------------------------------------------------------------------------
# the plan


_COMPILED: dict[Any, dict[str, float]] = {}
"""Measured programs by what determines them (several presets share programs: one compile each)."""


def _measure(name: str, setup: Setup, depth: int, key: tuple, compile_fn: Any, log: Any) -> dict[str, float]:
    full_key = (name, depth, setup.mesh.devices.shape, repr(setup.model_config), setup.step.config, key)
    if full_key not in _COMPILED:
        started = time.perf_counter()
        log(f"compiling {name} on {setup.mesh.size} devices at {depth} layers {key} ...")
        _COMPILED[full_key] = ProgramMemory.of(compile_fn()).as_dict()
        seconds = time.perf_counter() - started
        log(f"  {name}: {_COMPILED[full_key]['peak'] / GB:,.2f} GB per device ({seconds:.0f} s)")
    return _COMPILED[full_key]


def compiled_depths(model_config: Any, layers: Sequence[int] | None = None) -> list[int]:
    """The depths a plan compiles: ``layers`` (capped at the model's depth), by default the full depth
    when the model scans its blocks (a scanned program costs the same to compile at any depth, so
    nothing is extrapolated) and ``DEFAULT_LAYERS`` when it unrolls them."""
    depth = model_config.num_layers
    if layers is None:
        layers = (depth,) if model_config.scan_layers else DEFAULT_LAYERS
    return sorted({min(n, depth) for n in layers})


def plan_devices(cfg: C.ExperimentConfig, devices: int, *, layers: Sequence[int] | None = None,
                 model_path: str | None = None, log: Any = None) -> dict[str, Any]:
    """The plan of ``cfg`` on ``devices`` devices: resident state, KV cache and the run's programs
    (``programs_of``), compiled at ``layers`` and extrapolated (default: the full depth when the model
    scans its blocks, else ``DEFAULT_LAYERS``)."""
    log = log or (lambda message: None)
    full = make_setup(cfg, devices, model_path=model_path)
    depth = full.model_config.num_layers
    depths = compiled_depths(full.model_config, layers)
    lo, hi = depths[0], depths[-1]
    params = device_bytes(full.params)
    opt_state = device_bytes(full.opt_state)
    ref = params if cfg.optim.kl_coef > 0 and not cfg.model.lora_rank else 0  # LoRA: the base, no copy
    # checkpoint.stop_during_updates keeps the state an iteration started from beside the updated one.
    kept = params + opt_state if cfg.checkpoint.stop_during_updates else 0
    state = {"params": params, "opt_state": opt_state, "ref_params": ref, "start_copy": kept,
             "total": params + opt_state + ref + kept}
    rows, length = cfg.optim.mini_batch_rows, _longest_row(cfg)
    r_rows, prompt, new_tokens = rollout_shape(full)
    shapes = {
        "train_grads": {"rows": rows, "length": length},
        "train_apply": {"rows": 0, "length": 0},
        "logprobs": {"rows": rows, "length": length},
    }
    names = programs_of(cfg)
    for name in names:
        if name in ROLLOUT_PROGRAMS:
            shapes[name] = {"rows": r_rows, "length": prompt + new_tokens, "prompt": prompt,
                            "new_tokens": new_tokens}
    measured: dict[str, dict[int, dict[str, float]]] = {p: {} for p in names}
    state_args: dict[str, dict[int, float]] = {p: {} for p in names}
    for n in depths:
        setup = make_setup(cfg, devices, num_layers=n, model_path=model_path)
        p_bytes = device_bytes(setup.params)
        compilers = {
            "train_grads": functools.partial(compile_train_grads, setup, rows, length),
            "train_apply": functools.partial(compile_train_apply, setup),
            "logprobs": functools.partial(compile_logprobs, setup, rows, length),
            **{name: functools.partial(compile_rollout, setup, name) for name in ROLLOUT_PROGRAMS},
        }
        for name in names:
            key = tuple(sorted(shapes[name].items()))
            if name in ROLLOUT_PROGRAMS:  # the engine's chunk and the sampling switches select programs too
                key += (("chunk", cfg.rollout.engine_chunk), ("sampling", repr(rollout_sampling(setup))))
            measured[name][n] = _measure(name, setup, n, key, compilers[name], log)
            state_args[name][n] = p_bytes + (device_bytes(setup.opt_state) if name == "train_apply" else 0)
    programs = {}
    for name in names:
        values = {n: {**measured[name][n], "state_arguments": state_args[name][n]} for n in depths}
        v = extrapolate((lo, values[lo]), (hi, values[hi]), depth)
        v = {k: int(round(x)) if k != "flops" else x for k, x in v.items()}
        v["extra"] = v["peak"] - v["state_arguments"]
        v["need"] = state["total"] + v["extra"]
        programs[name] = {"rows": 0, "length": 0, "prompt": 0, "new_tokens": 0, **shapes[name], **v}
    largest = max(names, key=lambda p: programs[p]["need"])
    return {
        "devices": devices, "mesh": dict(full.mesh.shape), "state": state, "kv_cache": kv_cache_bytes(full),
        "programs": programs, "peak": programs[largest]["need"], "largest": largest,
        "model": {**dataclasses.asdict(_model_name(cfg, model_path)), "params": _param_count(full.params),
                  "param_dtype": full.model_config.param_dtype, "dtype": full.model_config.dtype,
                  "remat": full.model_config.remat, "attention": full.model_config.attention},
        "layers_compiled": depths, "full_depth": depth,
    }


def _model_name(cfg: C.ExperimentConfig, model_path: str | None) -> Any:
    """The model by its folder's name and family when a folder gives it, else by its preset's."""
    from mage_jax.models.config import ModelName

    path = model_path or cfg.model.path
    return ModelName.of_folder(path) if path is not None else ModelName.of_preset(cfg.model.preset)


def _longest_row(cfg: C.ExperimentConfig) -> int:
    from mage_jax.training.assemble import row_length_buckets

    return row_length_buckets(cfg)[-1]


def _param_count(params: Any) -> int:
    import jax

    return int(sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params)))


def verdict(plan: Mapping[str, Any], hardware: Hardware, cfg: C.ExperimentConfig) -> dict[str, Any]:
    """Fits / does not fit ``hardware`` (its memory per device), with what to change when it does not."""
    usable = USABLE_FRACTION * hardware.hbm
    peak = plan["peak"]
    fits = peak <= usable
    programs = plan["programs"]
    advice: list[str] = []
    if not fits:
        over = peak - usable
        largest = plan["largest"]
        state = plan["state"]
        if state["total"] > 0.5 * usable:
            advice.append(f"resident state is {state['total'] / GB:.1f} GB per device: shard it over more "
                          "devices (mesh.fsdp) or train LoRA adapters instead of all parameters")
        if largest in ("insert", "decode"):
            r = programs[largest]
            advice.append(f"the rollout engine decodes {r['rows']} slots at once (KV cache "
                          f"{plan['kv_cache'] / GB:.1f} GB): set rollout.engine_slots to "
                          f"{max(r['rows'] // 2, 1)} or shorten rollout.max_response_tokens")
        if largest == "lockstep":
            r = programs[largest]
            advice.append(f"the rollout decodes {r['rows']} rows at once (KV cache "
                          f"{plan['kv_cache'] / GB:.1f} GB): set rollout.max_decode_rows to "
                          f"{max(r['rows'] // 2, 1)} or shorten rollout.max_response_tokens")
        if largest in ("train_grads", "logprobs"):
            if cfg.model.overrides.get("remat", "none") == "none":
                advice.append("turn on rematerialisation: --model.overrides.remat full")
            micro = cfg.optim.micro_batch_rows or cfg.optim.mini_batch_rows
            if micro > plan["devices"]:
                advice.append(f"accumulate over smaller micro-batches: optim.micro_batch_rows "
                              f"{max(micro // 2, 1)} (now {micro})")
            advice.append("shorten rows: rollout.max_prompt_tokens / rollout.max_response_tokens")
        advice.append(f"more devices (over by {over / GB:.1f} GB per device)")
    seconds = {p: q["flops"] / hardware.bf16_flops for p, q in programs.items()}
    return {"hardware": hardware.name, "devices": plan["devices"], "hbm": hardware.hbm, "usable": usable,
            "peak": peak, "fits": fits, "headroom": usable - peak, "seconds_at_peak": seconds,
            "advice": advice}


def make_plan(cfg: C.ExperimentConfig, hardware: Sequence[Hardware], *, devices: int | None = None,
              layers: Sequence[int] | None = None, model_path: str | None = None,
              log: Any = None) -> dict[str, Any]:
    """Plans of ``cfg`` for every device count the ``hardware`` needs (``devices`` overrides them all)
    and a verdict per hardware. Runs in a process with enough (fake) devices."""
    counts = sorted({devices or h.devices for h in hardware})
    plans = {n: plan_devices(cfg, n, layers=layers, model_path=model_path, log=log) for n in counts}
    first = plans[counts[0]]
    return {
        "env": cfg.env.name, "layers_compiled": first["layers_compiled"], "full_depth": first["full_depth"],
        "model": first["model"], "usable_fraction": USABLE_FRACTION,
        "plans": [{k: v for k, v in p.items() if k not in ("model", "layers_compiled", "full_depth")}
                  for p in plans.values()],
        "verdicts": [verdict(plans[devices or h.devices], h, cfg) for h in hardware],
    }


def plan_presets(pairs: Sequence[tuple[str, str]], *, layers: Sequence[int] | None = None,
                 log: Any = None) -> list[dict[str, Any]]:
    """The plan of every (environment, preset) against the hardware its definition names; programs
    shared by several presets are compiled once. Runs in a process with enough (fake) devices."""
    out = []
    for env, preset in pairs:
        hardware = [HARDWARE[n] for n in named_hardware(env, preset)] or list(HARDWARE.values())
        plan = make_plan(preset_config(env, preset), hardware, layers=layers, log=log)
        out.append({**plan, "preset": preset})
    return out


def summary_table(plans: Sequence[Mapping[str, Any]]) -> str:
    """Markdown: preset x hardware -> peak bytes per device and verdict."""
    lines = ["| env | preset | hardware | devices | peak / device | usable | largest | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    for plan in plans:
        for v in plan["verdicts"]:
            largest = next(p["largest"] for p in plan["plans"] if p["devices"] == v["devices"])
            lines.append(f"| {plan['env']} | {plan['preset']} | {v['hardware']} | {v['devices']} | "
                         f"{v['peak'] / GB:,.1f} GB | {v['usable'] / GB:,.1f} GB | {largest} | "
                         f"{'fits' if v['fits'] else 'does not fit'} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# command line


def parse_mesh(text: str) -> dict[str, int]:
    """``data=1,fsdp=8,tensor=1`` (any subset) -> mesh overrides; a bad spec is a ConfigError."""
    out: dict[str, int] = {}
    for part in filter(None, text.split(",")):
        name, sep, value = part.partition("=")
        if not sep or name.strip() not in ("data", "fsdp", "tensor"):
            raise C.ConfigError(f"--mesh takes data=N,fsdp=N,tensor=N (got {text!r})")
        try:
            out[f"mesh.{name.strip()}"] = int(value)
        except ValueError:
            raise C.ConfigError(f"--mesh {name.strip()} must be an integer (got {value!r})") from None
    return out


def preset_config(env: str, preset: str, overrides: Mapping[str, Any] | None = None) -> C.ExperimentConfig:
    """The validated config of ``env``'s ``preset`` (no model folder needed: the plan reads shapes only)."""
    from experiments.environments import environment

    spec = environment(env)
    if preset not in spec.presets:
        raise C.ConfigError(f"unknown preset {preset!r} for {env}; known: {', '.join(spec.presets)}")
    cfg = C.apply_overrides(C.ExperimentConfig(name=env), spec.presets[preset].overrides)
    cfg = C.apply_overrides(cfg, dict(overrides or {}))
    if cfg.model.path is not None or cfg.tokenizer.kind != "hf":
        return C.validate(cfg, check_paths=False)
    # A pretrained preset without its folder: validate as if it had one, plan from the preset's shapes.
    cfg = C.validate(C.apply_overrides(cfg, {"model.path": "MODEL_PATH"}), check_paths=False)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=None))


def named_hardware(env: str, preset: str) -> tuple[str, ...]:
    """The hardware a preset's definition names (``Preset.hardware``)."""
    from experiments.environments import environment

    return tuple(environment(env).presets[preset].hardware)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line and exit status 2, like every entry point
        raise C.ConfigError(message)


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m experiments.plan", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env", required=True, help="environment experiment, e.g. kuhn_poker")
    p.add_argument("--preset", required=True, help="tiny, small or paper")
    p.add_argument("--devices", type=int, default=None,
                   help="plan every hardware on this many devices (default: each hardware's own count)")
    p.add_argument("--mesh", default="",
                   help="mesh axes, e.g. data=1,fsdp=8,tensor=1 (default: the preset's)")
    p.add_argument("--hardware", action="append", default=None,
                   help=f"one of {', '.join(HARDWARE)} (repeatable; default: the hardware the preset names, "
                        "else every kind)")
    p.add_argument("--layers", type=int, nargs=2, default=None, metavar=("LO", "HI"),
                   help="depths compiled and extrapolated from (default: the full depth for a model that "
                        "scans its blocks, else 3 6)")
    p.add_argument("--model-path", default=None, help="a local HF folder to read the model config from")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    p.add_argument("--json", action="store_true", help="print the plan as JSON on stdout")
    return p


@dataclasses.dataclass(frozen=True)
class _Request:
    cfg: C.ExperimentConfig
    preset: str
    hardware: tuple[Hardware, ...]
    devices: int | None
    layers: tuple[int, int] | None
    model_path: str | None
    json: bool

    @property
    def fake_devices(self) -> int:
        return self.devices or max(h.devices for h in self.hardware)


def _request(argv: Sequence[str] | None) -> _Request:
    """Parse and check the command line; every problem is one ConfigError."""
    args = parser().parse_args(argv)
    overrides: dict[str, Any] = parse_mesh(args.mesh)
    overrides.update(C.parse_assignment(item) for item in args.set)
    cfg = preset_config(args.env, args.preset, overrides)
    names = args.hardware or list(named_hardware(args.env, args.preset)) or list(HARDWARE)
    unknown = [n for n in names if n not in HARDWARE]
    if unknown:
        raise C.ConfigError(f"unknown hardware {unknown[0]!r}; known: {', '.join(HARDWARE)}")
    if args.devices is not None and args.devices < 1:
        raise C.ConfigError(f"--devices must be >= 1 (got {args.devices})")
    if args.layers is not None and (min(args.layers) < 1 or args.layers[0] >= args.layers[1]):
        raise C.ConfigError(f"--layers takes two depths LO < HI, both >= 1 (got {args.layers})")
    hardware = tuple(HARDWARE[n] for n in dict.fromkeys(names))
    for count in {args.devices or h.devices for h in hardware}:
        m = cfg.mesh
        try:
            from mage_jax.models.sharding import MeshConfig

            MeshConfig(m.data, m.fsdp, m.tensor).resolve(count)
        except ValueError as err:
            raise C.ConfigError(f"mesh: {err}") from None
    return _Request(cfg, args.preset, hardware, args.devices,
                    None if args.layers is None else tuple(args.layers), args.model_path, args.json)


def table(plan: Mapping[str, Any], preset: str) -> str:
    """Markdown: one line per hardware (peak per device and verdict), then the programs per device count."""
    model = plan["model"]
    lines = [f"{plan['env']} / {preset}: {model['name']} ({model['family']}, {model['params'] / 1e9:.2f} B "
             "parameters, "
             f"remat {model['remat']}), depth {plan['full_depth']} extrapolated from "
             f"{plan['layers_compiled']}",
             "", "| hardware | devices | peak / device | usable | verdict |", "|---|---|---|---|---|"]
    for v in plan["verdicts"]:
        lines.append(f"| {v['hardware']} | {v['devices']} | {v['peak'] / GB:,.1f} GB | "
                     f"{v['usable'] / GB:,.1f} GB | {'fits' if v['fits'] else 'does not fit'} |")
    for v in plan["verdicts"]:
        for a in v["advice"]:
            lines.append(f"  {v['hardware']}: {a}")
    for p in plan["plans"]:
        s = p["state"]
        lines += ["", f"{p['devices']} devices, mesh {p['mesh']}: resident state {s['total'] / GB:,.2f} GB "
                  f"(params {s['params'] / GB:,.2f}, AdamW {s['opt_state'] / GB:,.2f}, reference "
                  f"{s['ref_params'] / GB:,.2f}), KV cache {p['kv_cache'] / GB:,.2f} GB",
                  "| program | rows x tokens | arguments | outputs | temporaries | peak | needs (with state) "
                  "| GFLOP |",
                  "|---|---|---|---|---|---|---|---|"]
        for name, q in p["programs"].items():
            shape = f"{q['rows']} x {q['length']}" if q["rows"] else "-"
            lines.append(f"| {name} | {shape} | {q['argument'] / GB:,.2f} GB | {q['output'] / GB:,.2f} GB | "
                         f"{q['temp'] / GB:,.2f} GB | {q['peak'] / GB:,.2f} GB | {q['need'] / GB:,.2f} GB | "
                         f"{q['flops'] / 1e9:,.0f} |")
    return "\n".join(lines)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        request = _request(argv)
    except C.ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    if os.environ.get(CHILD_ENV) != str(request.fake_devices):
        # The fake devices and XLA:CPU's schedule must be set before JAX starts: plan in a child process.
        env = dict(os.environ, **{CHILD_ENV: str(request.fake_devices)})
        env.pop("XLA_FLAGS", None)
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={request.fake_devices} {CPU_MEMORY_FLAGS}"
        env["JAX_PLATFORMS"] = "cpu"
        return subprocess.run([sys.executable, "-m", "experiments.plan", *argv], env=env).returncode
    try:
        plan = make_plan(request.cfg, request.hardware, devices=request.devices, layers=request.layers,
                         model_path=request.model_path, log=_log)
    except C.ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    plan["preset"] = request.preset
    if request.json:
        print(json.dumps(plan, indent=1))
    else:
        print(table(plan, request.preset))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
