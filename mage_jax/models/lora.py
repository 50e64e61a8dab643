"""LoRA adapters on the decoder's projections, with flax's `nnx.LoRALinear` / `nnx.LoRAParam`.

A targeted projection (`ModelConfig.lora_targets`: any of q/k/v/o and gate/up/down) is built as a
`LoRALinear` when `ModelConfig.lora_rank > 0`: the base `kernel` (and `bias`) keep their paths and
variable type (`nnx.Param`), so Hugging Face loading and the partition rules see the same base tree,
and the adapter adds `lora/lora_a` [in, r] (he-uniform) and `lora/lora_b` [r, out] (zeros) as
`nnx.LoRAParam` variables. The output is `x W (+ b) + (alpha / r) * x A B`; with B = 0 it is the
base projection exactly. Adapters are kept in float32 (they are what the optimizer updates) and
computed in the model's compute dtype.

The functional helpers split a parameter state into adapters and frozen base (`split_adapters`),
switch the adapters off without a second copy of the base (`without_adapters`: zeros in place of
A and B, so the output is the base model's) and fold them into the kernels for export
(`merge_adapters`: W + (alpha / r) A B).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

# Projections an adapter may be put on (names of the decoder's `nnx.Linear` attributes).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRALinear(nnx.LoRALinear):
    """`nnx.LoRALinear` with the usual `alpha / rank` scale on the adapter's output."""

    def __init__(self, in_features: int, out_features: int, *, lora_rank: int, scale: float, **kwargs: Any):
        super().__init__(in_features, out_features, lora_rank=lora_rank, **kwargs)
        self.scale = float(scale)

    def __call__(self, x: jax.Array, out_sharding: Any = None) -> jax.Array:
        y = nnx.Linear.__call__(self, x, out_sharding=out_sharding)
        return y + self.scale * self.lora(x)


def split_adapters(state: nnx.State) -> tuple[nnx.State, nnx.State]:
    """A parameter state -> (adapters: the `LoRAParam` leaves, base: everything else)."""
    return nnx.split_state(state, nnx.LoRAParam, ...)


def has_adapters(state: nnx.State) -> bool:
    return bool(jax.tree.leaves(split_adapters(state)[0]))


def without_adapters(state: nnx.State) -> nnx.State:
    """The same state with every adapter matrix zero: the base model, sharing the base's arrays."""
    adapters, base = split_adapters(state)
    return nnx.merge_state(base, jax.tree.map(jnp.zeros_like, adapters))


def merge_adapters(state: nnx.State, scale: float) -> nnx.State:
    """The base state with every adapted kernel replaced by W + scale * A @ B (computed in float32 and
    cast back to the kernel's dtype); the adapter leaves are dropped."""
    adapters, base = split_adapters(state)
    flat = dict(nnx.to_flat_state(base))
    lora = dict(nnx.to_flat_state(adapters))
    for path, lora_a in lora.items():
        if path[-1] != "lora_a":
            continue
        module = path[:-2]  # (..., "q_proj", "lora", "lora_a") -> (..., "q_proj")
        lora_b = lora[(*module, "lora", "lora_b")]
        kernel = flat[(*module, "kernel")]
        w = kernel.get_value()
        delta = jnp.asarray(lora_a.get_value(), jnp.float32) @ jnp.asarray(lora_b.get_value(), jnp.float32)
        flat[(*module, "kernel")] = kernel.replace(
            (jnp.asarray(w, jnp.float32) + scale * delta).astype(w.dtype))
    return nnx.from_flat_state(list(flat.items()))
