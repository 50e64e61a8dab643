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

from experiments import hlo_cost, targets
from experiments.targets import HARDWARE, Hardware
from mage_jax import config as C

GB = 1e9
EXIT_CONFIG_ERROR = 2
USABLE_FRACTION = 0.9
"""Share of a device's memory a plan may use: the rest is the runtime's (CUDA context, fragmentation).
On GPUs JAX preallocates 75% unless ``XLA_PYTHON_CLIENT_MEM_FRACTION`` is raised (docs/scaling.md)."""
DEFAULT_LAYERS = (3, 6)
CHILD_ENV = "MAGE_PLAN_CHILD"
"""Set in the process that compiles: ``cpu:N`` (N fake CPU devices), ``tpu`` or ``gpu`` (a target)."""
COMPILERS = ("auto", "target", "cpu")


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

    @property
    def spec(self) -> Any:
        """The ``ModelSpec`` the run's generation programs share (the engine's, or the lockstep sampler's)."""
        return (self.sampler if self.engine is None else self.engine.programs).spec

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


def make_setup(cfg: C.ExperimentConfig, devices: int | Sequence[Any], *, num_layers: int | None = None,
               model_path: str | None = None, vocab_size: int = 0) -> Setup:
    """``cfg``'s mesh over the first ``devices`` devices (or these devices: a target's topology), its
    model at ``num_layers`` layers (all when None) with abstract parameters, its train step, sampler and
    engine (``training.assemble``)."""
    import jax

    from mage_jax.models import sharding as shd
    from mage_jax.training import assemble

    mesh = assemble.make_mesh(cfg, devices=jax.devices()[:devices] if isinstance(devices, int) else devices)
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
class ProgramMeasure:
    """Per device, one compiled program: XLA's memory analysis, and from its optimized HLO the FLOPs and
    bytes accessed of one run (``hlo_cost``: loops counted by their trip counts, a decode chunk's loop
    once, so a decode program's figures are those of one step) and the library / Pallas kernels it
    calls."""

    argument: int
    output: int
    alias: int
    temp: int
    flops: float
    bytes_accessed: float
    kernels: dict[str, int]

    @property
    def peak(self) -> int:
        return self.argument + self.output - self.alias + self.temp

    @classmethod
    def of(cls, compiled: Any, platform: str, steps: int = 1) -> ProgramMeasure:
        """``steps``: the decode steps of one run of a program that loops until its rows are done (a decode
        chunk); its FLOPs and bytes are those of one step with its share of the loop's entry and exit."""
        mem = compiled.memory_analysis()
        cost = hlo_cost.program_cost(compiled.as_text(), platform, data_loop_trips=steps)
        return cls(int(mem.argument_size_in_bytes), int(mem.output_size_in_bytes),
                   int(mem.alias_size_in_bytes), int(mem.temp_size_in_bytes), cost.flops / steps,
                   cost.bytes_accessed / steps, cost.kernels)

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "peak": self.peak}


def extrapolate(lo: tuple[int, Mapping[str, Any]], hi: tuple[int, Mapping[str, Any]],
                depth: int) -> dict[str, Any]:
    """Linear in layers: v(depth) = v(hi) + (depth - hi) x (v(hi) - v(lo)) / (hi - lo), key by key (numbers;
    anything else, e.g. the kernels, is ``hi``'s)."""
    (a, va), (b, vb) = lo, hi
    if a == b:
        return dict(vb)
    return {k: vb[k] + (depth - b) * (vb[k] - va[k]) / (b - a) if isinstance(vb[k], (int, float)) else vb[k]
            for k in vb}


# ----------------------------------------------------------------------------------------------
# the model's own FLOPs and bytes (what the compilers' figures are held to)


def matmul_params(model_config: Any) -> int:
    """Parameters that take part in a product per token: every block's projections and the output head
    (the embedding lookup is no product; a tied head counts once)."""
    c = model_config
    attn = c.hidden_size * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)
    mlp = 3 * c.hidden_size * c.intermediate_size
    return c.num_layers * (attn + mlp) + c.hidden_size * c.vocab_size


def attention_flops(model_config: Any, context: float) -> float:
    """Forward FLOPs of one token's attention (both products, every layer) over ``context`` keys."""
    c = model_config
    return 4.0 * c.num_layers * c.num_heads * c.head_dim * context


def model_flops(name: str, model_config: Any, shape: Mapping[str, int], *, lora: bool) -> float:
    """The model's FLOPs of one run of program ``name`` (all devices): 2 N per token forward, 4 N more
    to train (2 N with LoRA: no weight gradients of the frozen base), and attention (causal rows: a
    token attends to half the row on average; its backward pass costs twice its forward). Remat's
    recomputation is not the model's: the compiler's figure carries it (2 N more per token under full
    remat). Decode: one step of every slot over the whole cache."""
    n = matmul_params(model_config)
    if name in ("train_grads", "logprobs"):
        tokens, half_row = shape["rows"] * shape["length"], shape["length"] / 2
        if name == "logprobs":
            return tokens * (2.0 * n + attention_flops(model_config, half_row))
        return tokens * ((4.0 if lora else 6.0) * n + 3 * attention_flops(model_config, half_row))
    if name == "insert":
        prompt = shape["prompt"]
        return shape["rows"] * prompt * (2.0 * n + attention_flops(model_config, prompt / 2))
    if name == "decode":
        return shape["rows"] * (2.0 * n + attention_flops(model_config, shape["length"]))
    return 0.0


# ----------------------------------------------------------------------------------------------
# the plan


_COMPILED: dict[Any, dict[str, Any]] = {}
"""Measured programs by what determines them (several presets share programs: one compile each)."""


def _measure(name: str, setup: Setup, depth: int, key: tuple, compile_fn: Any, log: Any) -> dict[str, Any]:
    device = setup.mesh.devices.flat[0]
    full_key = (name, depth, device.platform, device.device_kind, setup.mesh.devices.shape,
                repr(setup.model_config), setup.step.config, key)
    if full_key not in _COMPILED:
        started = time.perf_counter()
        log(f"compiling {name} on {setup.mesh.size} {device.device_kind} devices at {depth} layers {key} ...")
        steps = setup.cfg.rollout.engine_chunk if name == "decode" else 1
        _COMPILED[full_key] = ProgramMeasure.of(compile_fn(), device.platform, steps).as_dict()
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


def program_depths(model_config: Any, name: str, depths: Sequence[int]) -> list[int]:
    """The depths program ``name`` is compiled at: a training program of a model that scans its blocks at
    the full depth alone (it compiles in the same time at any depth, and between 1 and 2 scanned layers a
    compiler's schedule can shrink: 8 x H100 compiled ``paper``'s gradient program to 4.7 GB at 1 layer
    and 4.2 GB at 2, which extrapolated to a negative peak); the engine's programs, which run the blocks
    one after another, at ``depths``."""
    if model_config.scan_layers and name not in ROLLOUT_PROGRAMS:
        return [model_config.num_layers]
    return list(depths)


def _tracing_for(hardware: Hardware | None) -> Any:
    """What the model must be told while tracing for ``hardware``: a GPU target's compute capability
    (a compile-only GPU has none to ask; the attention implementation depends on it)."""
    import contextlib

    from mage_jax.models import attention

    if hardware is None or hardware.platform != "gpu":
        return contextlib.nullcontext()
    return attention.gpu_target(targets.gpu_compute_capability(hardware.target))


def plan_devices(cfg: C.ExperimentConfig, devices: int, *, layers: Sequence[int] | None = None,
                 model_path: str | None = None, log: Any = None,
                 hardware: Hardware | None = None) -> dict[str, Any]:
    """The plan of ``cfg`` on ``devices`` fake CPU devices, or (``hardware`` given) on ``hardware``'s own
    topology by its own compiler: resident state, KV cache and the run's programs (``programs_of``),
    compiled at ``layers`` and extrapolated (default: the full depth when the model scans its blocks,
    else ``DEFAULT_LAYERS``)."""
    log = log or (lambda message: None)
    on: int | list[Any] = devices if hardware is None else targets.topology_devices(hardware)
    with _tracing_for(hardware):
        return _plan_devices(cfg, on, layers=layers, model_path=model_path, log=log, hardware=hardware)


def _plan_devices(cfg: C.ExperimentConfig, on: int | list[Any], *, layers: Sequence[int] | None,
                  model_path: str | None, log: Any, hardware: Hardware | None) -> dict[str, Any]:
    full = make_setup(cfg, on, model_path=model_path)
    depth = full.model_config.num_layers
    depths = compiled_depths(full.model_config, layers)
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
    if "insert" in names:  # an insert prefills its one shape: insert_rows targets per device block
        shapes["insert"]["rows"] = full.engine.programs.insert_rows * full.engine.programs.ways
    measured: dict[str, dict[int, dict[str, Any]]] = {p: {} for p in names}
    state_args: dict[str, dict[int, float]] = {p: {} for p in names}
    at = {name: program_depths(full.model_config, name, depths) for name in names}
    for n in sorted({d for ds in at.values() for d in ds}):
        setup = full if n == depth else make_setup(cfg, on, num_layers=n, model_path=model_path)
        p_bytes = device_bytes(setup.params)
        compilers = {
            "train_grads": functools.partial(compile_train_grads, setup, rows, length),
            "train_apply": functools.partial(compile_train_apply, setup),
            "logprobs": functools.partial(compile_logprobs, setup, rows, length),
            **{name: functools.partial(compile_rollout, setup, name) for name in ROLLOUT_PROGRAMS},
        }
        for name in (name for name in names if n in at[name]):
            key = tuple(sorted(shapes[name].items()))
            if name in ROLLOUT_PROGRAMS:  # the engine's chunk and the sampling switches select programs too
                key += (("chunk", cfg.rollout.engine_chunk), ("sampling", repr(rollout_sampling(setup))))
            measured[name][n] = _measure(name, setup, n, key, compilers[name], log)
            state_args[name][n] = p_bytes + (device_bytes(setup.opt_state) if name == "train_apply" else 0)
            if name in ROLLOUT_PROGRAMS and generation_copies(setup):  # it reads a copy, not the state
                state_args[name][n] = 0
    size = full.mesh.size
    mc = full.model_config
    programs = {}
    for name in names:
        values = {n: {**measured[name][n], "state_arguments": state_args[name][n]} for n in at[name]}
        v = extrapolate((at[name][0], values[at[name][0]]), (at[name][-1], values[at[name][-1]]), depth)
        v = {k: int(round(x)) if k not in ("flops", "bytes_accessed") and isinstance(x, (int, float)) else x
             for k, x in v.items()}
        v["extra"] = v["peak"] - v["state_arguments"]
        v["need"] = state["total"] + v["extra"]
        shape = {"rows": 0, "length": 0, "prompt": 0, "new_tokens": 0, **shapes[name]}
        v["model_flops"] = model_flops(name, mc, shape, lora=bool(cfg.model.lora_rank)) / size
        programs[name] = {**shape, **v}
    kv_cache = kv_cache_bytes(full)
    if "decode" in programs:  # the least a decode step reads: the parameters it computes with, the cache
        programs["decode"]["ideal_bytes"] = compute_param_bytes(full) + kv_cache
    largest = max(names, key=lambda p: programs[p]["need"])
    return {
        "devices": size, "mesh": dict(full.mesh.shape), "state": state, "kv_cache": kv_cache,
        "compiler": targets.compiler_info(hardware),
        "programs": programs, "peak": programs[largest]["need"], "largest": largest,
        "model": {**dataclasses.asdict(_model_name(cfg, model_path)), "params": _param_count(full.params),
                  "param_dtype": full.model_config.param_dtype, "dtype": full.model_config.dtype,
                  "remat": full.model_config.remat, "attention": full.model_config.attention,
                  "matmul_params": matmul_params(mc)},
        "layers_compiled": sorted({d for ds in at.values() for d in ds}), "full_depth": depth,
    }


def generation_copies(setup: Setup) -> bool:
    """Whether generation reads a copy of the parameters (``ModelSpec.place_state``: narrowed to the
    compute dtype or gathered over ``fsdp``) that lives beside the training state while a rollout runs,
    rather than the training state's own arrays (``ModelSpec.copies_state``)."""
    return setup.spec.copies_state(setup.params)


def compute_param_bytes(setup: Setup) -> int:
    """Bytes of parameters one device generates with: all of them (gathered over ``fsdp``) except what
    ``tensor`` splits, in the dtype generation reads them in (``ModelSpec.generation_dtype``: float32
    master weights of a bfloat16 model are read as bfloat16)."""
    import jax
    import numpy as np

    spec = setup.spec
    tensor = setup.mesh.shape["tensor"]
    total = 0
    for leaf in jax.tree.leaves(setup.params):
        split = tensor if "tensor" in jax.tree.leaves(tuple(leaf.sharding.spec)) else 1
        total += math.prod(leaf.shape) * np.dtype(spec.generation_dtype(leaf.dtype)).itemsize // split
    return int(total)


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




GOALS = {"decode_bytes_ratio": 1.3, "train_flops_ratio": 1.45, "train_mfu": 0.45}
"""Efficiency goals read from a target compiler (issue 37): a decode step reads at most 1.3x the ideal
bytes (the parameters it computes with and the KV cache, once); the gradient program computes at most
1.45x the model's FLOPs (full remat alone adds a third); the roofline bound of the training programs'
MFU is at least 45 %. Reported met or not, never asserted."""


def roofline_seconds(program: Mapping[str, Any], hardware: Hardware) -> float:
    """max(FLOPs / peak, bytes accessed / memory bandwidth): the least time one run can take."""
    return max(program["flops"] / hardware.bf16_flops, program["bytes_accessed"] / hardware.bandwidth)


def iteration_counts(cfg: C.ExperimentConfig, plan: Mapping[str, Any]) -> dict[str, float]:
    """How many times each program runs in one training iteration at the plan's shapes, an upper bound:
    every LLM call (``num_tasks x group_size`` meta-episodes of ``num_episodes`` episodes of ``max_turns``
    turns, and a reflection between episodes) at its longest prompt and response and trained on; a decode
    program's figures are one step, a lockstep program's its prefill and one step. Evaluations not
    counted."""
    r, o = cfg.rollout, cfg.optim
    meta = r.num_tasks * r.group_size
    calls = meta * r.num_episodes * (r.max_turns or 1) + (meta * (r.num_episodes - 1) if r.reflect else 0)
    programs = plan["programs"]
    mini_batches = math.ceil(calls / o.mini_batch_rows)
    counts = {"train_grads": mini_batches * o.epochs, "train_apply": mini_batches * o.epochs,
              "logprobs": mini_batches * (1 + (o.kl_coef > 0))}
    if "decode" in programs:
        slots = programs["decode"]["rows"]
        counts["decode"] = math.ceil(calls / slots) * programs["decode"]["new_tokens"]
        counts["insert"] = math.ceil(calls / programs["insert"]["rows"])
    if "lockstep" in programs:
        lockstep = programs["lockstep"]
        counts["lockstep"] = math.ceil(calls / lockstep["rows"]) * lockstep["new_tokens"]
    return counts


def efficiency(plan: Mapping[str, Any], hardware: Hardware, cfg: C.ExperimentConfig) -> dict[str, Any]:
    """Roofline seconds per program, the predicted seconds of an iteration, the MFU bounds, and the
    goals of ``GOALS`` met or not (None where a program is missing)."""
    programs = plan["programs"]
    seconds = {p: roofline_seconds(q, hardware) for p, q in programs.items()}
    bound = {p: "compute" if q["flops"] / hardware.bf16_flops >= q["bytes_accessed"] / hardware.bandwidth
             else "memory" for p, q in programs.items()}
    counts = iteration_counts(cfg, plan)
    iteration = sum(counts[p] * seconds[p] for p in programs)
    train_s = seconds["train_grads"] + seconds["train_apply"]
    train_mfu = programs["train_grads"]["model_flops"] / (train_s * hardware.bf16_flops) if train_s else None
    model = sum(counts[p] * programs[p]["model_flops"] for p in programs)
    ratios: dict[str, float | None] = {
        "train_flops_ratio": (programs["train_grads"]["flops"] / programs["train_grads"]["model_flops"]
                              if programs["train_grads"]["model_flops"] else None),
        "train_mfu": train_mfu,
        "decode_bytes_ratio": (programs["decode"]["bytes_accessed"] / programs["decode"]["ideal_bytes"]
                               if "decode" in programs else None),
    }
    goals = {}
    for key, goal in GOALS.items():
        value = ratios[key]
        met = None if value is None else (value >= goal if key == "train_mfu" else value <= goal)
        goals[key] = {"value": value, "goal": goal, "met": met}
    return {"roofline_seconds": seconds, "bound": bound, "iteration_counts": counts,
            "iteration_seconds": iteration, "train_mfu_bound": train_mfu,
            "iteration_mfu_bound": model / (iteration * hardware.bf16_flops) if iteration else None,
            "goals": goals}


def verdict(plan: Mapping[str, Any], hardware: Hardware, cfg: C.ExperimentConfig) -> dict[str, Any]:
    """Fits / does not fit ``hardware`` (its memory per device), with what to change when it does not, and
    the predictions of ``efficiency`` (from the plan's compiler: the target's own, or XLA:CPU's)."""
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
    return {"hardware": hardware.name, "devices": plan["devices"], "compiler": plan["compiler"]["platform"],
            "hbm": hardware.hbm, "usable": usable, "peak": peak, "fits": fits, "headroom": usable - peak,
            "seconds_at_peak": seconds, "advice": advice, **efficiency(plan, hardware, cfg)}


def plan_for(plans: Sequence[Mapping[str, Any]], hardware: str) -> Mapping[str, Any]:
    """The plan hardware ``hardware``'s verdict reads: its own (a target's), or the CPU plan of its
    device count."""
    return next(p for p in plans if hardware in p["hardware"])


def make_plan(cfg: C.ExperimentConfig, hardware: Sequence[Hardware], *, compiler: str = "cpu",
              devices: int | None = None, layers: Sequence[int] | None = None, model_path: str | None = None,
              log: Any = None) -> dict[str, Any]:
    """Plans of ``cfg`` and a verdict per hardware. ``compiler`` ``cpu``: one plan per device count the
    ``hardware`` needs (``devices`` overrides them all), in a process with enough fake CPU devices;
    ``target``: one plan per hardware on its own topology by its own compiler, in a process of
    ``targets.compile_env``."""
    plans: list[dict[str, Any]] = []
    if compiler == "cpu":
        counts = sorted({devices or h.devices for h in hardware})
        for n in counts:
            plan = plan_devices(cfg, n, layers=layers, model_path=model_path, log=log)
            plans.append({**plan, "hardware": [h.name for h in hardware if (devices or h.devices) == n]})
    else:
        for h in hardware:
            if devices is not None:
                h = dataclasses.replace(h, devices=devices)
            plan = plan_devices(cfg, h.devices, layers=layers, model_path=model_path, log=log, hardware=h)
            plans.append({**plan, "hardware": [h.name]})
    first = plans[0]
    return {
        "env": cfg.env.name, "layers_compiled": first["layers_compiled"], "full_depth": first["full_depth"],
        "model": first["model"], "usable_fraction": USABLE_FRACTION, "goals": GOALS,
        "plans": [{k: v for k, v in p.items() if k not in ("model", "layers_compiled", "full_depth")}
                  for p in plans],
        "verdicts": [verdict(plan_for(plans, h.name), h, cfg) for h in hardware],
    }


def merge_plans(parts: Sequence[Mapping[str, Any]], hardware: Sequence[Hardware]) -> dict[str, Any]:
    """One plan from the plans of several compilers (the processes of ``main``), verdicts in the order of
    ``hardware``."""
    first = parts[0]
    verdicts = {v["hardware"]: v for part in parts for v in part["verdicts"]}
    return {**first, "plans": [p for part in parts for p in part["plans"]],
            "verdicts": [verdicts[h.name] for h in hardware]}


def plan_presets(pairs: Sequence[tuple[str, str]], *, layers: Sequence[int] | None = None,
                 compiler: str = "cpu", log: Any = None) -> list[dict[str, Any]]:
    """The plan of every (environment, preset) against the hardware its definition names (``compiler``
    ``target``: those of this process's platform, ``targets.compile_env``); programs shared by several
    presets are compiled once. Runs in a process with enough (fake) devices."""
    out = []
    for env, preset in pairs:
        hardware = [HARDWARE[n] for n in named_hardware(env, preset)] or list(HARDWARE.values())
        plan = make_plan(preset_config(env, preset), hardware, compiler=compiler, layers=layers, log=log)
        out.append({**plan, "preset": preset})
    return out


def _kernels(program: Mapping[str, Any]) -> str:
    """The attention and matmul kernels of a program, short (library / Pallas calls; '-' for none)."""
    names = sorted({k.split(":", 1)[-1].replace("__cudnn$", "cudnn ").replace("__cublas$", "cublas ")
                    for k in program.get("kernels", {})
                    if k.startswith(("__cudnn", "__cublas", "tpu_custom_call"))})
    return ", ".join(names) or "-"


def _goal(v: Mapping[str, Any], key: str, spec: str) -> str:
    g = v["goals"][key]
    if g["value"] is None:
        return "-"
    return f"{g['value']:{spec}} {'met' if g['met'] else 'not met'}"


def summary_table(plans: Sequence[Mapping[str, Any]]) -> str:
    """Markdown: preset x hardware -> compiler, peak bytes per device and verdict, predicted seconds per
    iteration, MFU bound, and the efficiency goals."""
    lines = ["| env | preset | hardware | devices | compiler | peak / device | usable | largest | verdict | "
             "s / iteration (predicted) | train MFU bound | train FLOPs / model | decode bytes / ideal |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for plan in plans:
        for v in plan["verdicts"]:
            largest = plan_for(plan["plans"], v["hardware"])["largest"]
            lines.append(f"| {plan['env']} | {plan['preset']} | {v['hardware']} | {v['devices']} | "
                         f"{v['compiler']} | {v['peak'] / GB:,.1f} GB | {v['usable'] / GB:,.1f} GB | "
                         f"{largest} | "
                         f"{'fits' if v['fits'] else 'does not fit'} | {v['iteration_seconds']:,.0f} | "
                         f"{_goal(v, 'train_mfu', '.2f')} | {_goal(v, 'train_flops_ratio', '.2f')} | "
                         f"{_goal(v, 'decode_bytes_ratio', '.2f')} |")
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
                   help="plan every hardware on this many devices (default: each hardware's own count; a TPU "
                        "target takes --topology instead)")
    p.add_argument("--mesh", default="",
                   help="mesh axes, e.g. data=1,fsdp=8,tensor=1 (default: the preset's)")
    p.add_argument("--hardware", action="append", default=None,
                   help=f"one of {', '.join(HARDWARE)} (repeatable; default: the hardware the preset names, "
                        "else every kind)")
    p.add_argument("--topology", action="append", default=[], metavar="NAME",
                   help="a TPU slice by its topology, e.g. v5p:4x4x4 (64 chips, 16 hosts); repeatable")
    p.add_argument("--compiler", choices=COMPILERS, default="auto",
                   help="target: each hardware's own compiler on its own topology (TPU: jax[tpu], GPU: "
                        "jax[cuda12]); cpu: XLA:CPU on fake devices (an upper bound); auto (default): the "
                        "target's compiler where it is installed, else cpu")
    p.add_argument("--layers", type=int, nargs=2, default=None, metavar=("LO", "HI"),
                   help="depths compiled and extrapolated from (default: the full depth for a model that "
                        "scans its blocks, else 3 6)")
    p.add_argument("--model-path", default=None, help="a local HF folder to read the model config from")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    p.add_argument("--json", action="store_true", help="print the plan as JSON on stdout")
    return p


@dataclasses.dataclass(frozen=True)
class _Request:
    argv: tuple[str, ...]
    cfg: C.ExperimentConfig
    preset: str
    hardware: tuple[Hardware, ...]
    platforms: tuple[str, ...]
    """Per hardware: the compiler's platform (``cpu``, ``tpu`` or ``gpu``)."""
    devices: int | None
    layers: tuple[int, int] | None
    model_path: str | None
    json: bool
    compiler: str

    def groups(self) -> dict[str, tuple[Hardware, ...]]:
        """The hardware each compiler's process plans, by platform."""
        out: dict[str, tuple[Hardware, ...]] = {}
        for h, platform in zip(self.hardware, self.platforms):
            out[platform] = (*out.get(platform, ()), h)
        return out

    def fake_devices(self, hardware: Sequence[Hardware]) -> int:
        return self.devices or max(h.devices for h in hardware)


def _request(argv: Sequence[str] | None) -> _Request:
    """Parse and check the command line; every problem is one ConfigError."""
    args = parser().parse_args(argv)
    overrides: dict[str, Any] = parse_mesh(args.mesh)
    overrides.update(C.parse_assignment(item) for item in args.set)
    cfg = preset_config(args.env, args.preset, overrides)
    names = args.hardware or ([] if args.topology else list(named_hardware(args.env, args.preset))
                              or list(HARDWARE))
    unknown = [n for n in names if n not in HARDWARE]
    if unknown:
        raise C.ConfigError(f"unknown hardware {unknown[0]!r}; known: {', '.join(HARDWARE)}")
    if args.devices is not None and args.devices < 1:
        raise C.ConfigError(f"--devices must be >= 1 (got {args.devices})")
    if args.layers is not None and (min(args.layers) < 1 or args.layers[0] >= args.layers[1]):
        raise C.ConfigError(f"--layers takes two depths LO < HI, both >= 1 (got {args.layers})")
    try:
        slices = [targets.topology_hardware(t) for t in args.topology]
    except ValueError as err:
        raise C.ConfigError(str(err)) from None
    hardware = tuple({h.name: h for h in [*(HARDWARE[n] for n in names), *slices]}.values())
    platforms = tuple(_platform(h, args.compiler) for h in hardware)
    if args.devices is not None and any(p == "tpu" for p in platforms):
        raise C.ConfigError("--devices cannot resize a TPU slice: name it with --topology (e.g. v5p:2x2x2 "
                            "for 8 chips), or plan on fake CPU devices with --compiler cpu")
    for count in {args.devices or h.devices for h in hardware}:
        m = cfg.mesh
        try:
            from mage_jax.models.sharding import MeshConfig

            MeshConfig(m.data, m.fsdp, m.tensor).resolve(count)
        except ValueError as err:
            raise C.ConfigError(f"mesh: {err}") from None
    return _Request(tuple(argv if argv is not None else sys.argv[1:]), cfg, args.preset, hardware, platforms,
                    args.devices, None if args.layers is None else tuple(args.layers), args.model_path,
                    args.json, args.compiler)


def _platform(hardware: Hardware, compiler: str) -> str:
    """The platform whose compiler plans ``hardware`` under ``--compiler``; a missing target compiler is
    a ConfigError for ``target`` and XLA:CPU for ``auto``."""
    if compiler == "cpu":
        return "cpu"
    if targets.compiler_installed(hardware.platform):
        return hardware.platform
    if compiler == "target":
        package, install = targets.COMPILER_PACKAGES[hardware.platform]
        raise C.ConfigError(f"{hardware.name} needs the {hardware.platform.upper()} compiler, which this "
                            f"Python has not got ({package}): {install}, or --compiler cpu")
    return "cpu"


def table(plan: Mapping[str, Any], preset: str) -> str:
    """Markdown: one line per hardware (compiler, peak per device, verdict, predictions), then the
    programs of each plan."""
    model = plan["model"]
    lines = [f"{plan['env']} / {preset}: {model['name']} ({model['family']}, {model['params'] / 1e9:.2f} B "
             "parameters, "
             f"remat {model['remat']}), depth {plan['full_depth']} extrapolated from "
             f"{plan['layers_compiled']}",
             "", "| hardware | devices | compiler | peak / device | usable | verdict | "
             "s / iteration (predicted) | train MFU bound | train FLOPs / model | decode bytes / ideal |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for v in plan["verdicts"]:
        lines.append(f"| {v['hardware']} | {v['devices']} | {v['compiler']} | {v['peak'] / GB:,.1f} GB | "
                     f"{v['usable'] / GB:,.1f} GB | {'fits' if v['fits'] else 'does not fit'} | "
                     f"{v['iteration_seconds']:,.0f} | {_goal(v, 'train_mfu', '.2f')} | "
                     f"{_goal(v, 'train_flops_ratio', '.2f')} | {_goal(v, 'decode_bytes_ratio', '.2f')} |")
    for v in plan["verdicts"]:
        for a in v["advice"]:
            lines.append(f"  {v['hardware']}: {a}")
    lines.append("Predictions are rooflines (max of FLOPs / peak and bytes / bandwidth), not measurements; "
                 "a plan compiled on XLA:CPU is an upper bound of the target's bytes.")
    for p in plan["plans"]:
        s, c = p["state"], p["compiler"]
        lines += ["", f"{', '.join(p['hardware'])}: {p['devices']} devices, mesh {p['mesh']}, compiled by "
                  f"{c['platform']} ({c['target']}, {c['version']}): resident state "
                  f"{s['total'] / GB:,.2f} GB "
                  f"(params {s['params'] / GB:,.2f}, AdamW {s['opt_state'] / GB:,.2f}, reference "
                  f"{s['ref_params'] / GB:,.2f}), KV cache {p['kv_cache'] / GB:,.2f} GB",
                  "| program | rows x tokens | arguments | outputs | temporaries | peak | needs (with state) "
                  "| GFLOP | GB accessed | kernels |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for name, q in p["programs"].items():
            shape = f"{q['rows']} x {q['length']}" if q["rows"] else "-"
            lines.append(f"| {name} | {shape} | {q['argument'] / GB:,.2f} GB | {q['output'] / GB:,.2f} GB | "
                         f"{q['temp'] / GB:,.2f} GB | {q['peak'] / GB:,.2f} GB | {q['need'] / GB:,.2f} GB | "
                         f"{q['flops'] / 1e9:,.0f} | {q['bytes_accessed'] / GB:,.2f} | {_kernels(q)} |")
    return "\n".join(lines)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _child_env(platform: str, fake_devices: int) -> dict[str, str]:
    """The environment of the process that compiles for ``platform``."""
    if platform != "cpu":
        return {**targets.compile_env(platform), CHILD_ENV: platform}
    env = dict(os.environ, **{CHILD_ENV: f"cpu:{fake_devices}"})
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={fake_devices} {CPU_MEMORY_FLAGS}"
    env["JAX_PLATFORMS"] = "cpu"
    return env


RESULT = "PLAN-RESULT "
"""The line a compiling process prints its plan on, for the process that started it."""


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        request = _request(argv)
    except C.ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    groups = request.groups()
    child = os.environ.get(CHILD_ENV)
    if child is not None:  # this process compiles for one platform and hands its plan back
        platform = child.split(":")[0]
        try:
            plan = make_plan(request.cfg, groups[platform], compiler="cpu" if platform == "cpu" else "target",
                             devices=request.devices, layers=request.layers, model_path=request.model_path,
                             log=_log)
        except C.ConfigError as err:
            print(f"error: {err}", file=sys.stderr)
            return EXIT_CONFIG_ERROR
        print(RESULT + json.dumps(plan))
        return 0
    # The fake devices, the XLA:CPU schedule and a target's platform are set before JAX starts: each
    # compiler plans in a process of its own.
    parts = []
    for platform, hardware in groups.items():
        if platform == "cpu" and request.compiler == "auto":
            installs = " / ".join(dict.fromkeys(targets.COMPILER_PACKAGES[h.platform][1] for h in hardware))
            _log(f"note: {', '.join(h.name for h in hardware)} planned on XLA:CPU (an upper bound): "
                 f"{installs} compiles for the device itself")
        env = _child_env(platform, request.fake_devices(hardware))
        proc = subprocess.run([sys.executable, "-m", "experiments.plan", *argv], env=env,
                              stdout=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            return proc.returncode
        parts.append(json.loads(proc.stdout.split(RESULT, 1)[1]))
    plan = merge_plans(parts, request.hardware)
    plan["preset"] = request.preset
    if request.json:
        print(json.dumps(plan, indent=1))
    else:
        print(table(plan, request.preset))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
