"""The device mesh's axis names and the row constraint the model applies to its activations.

The smallest piece of the sharding scheme, kept apart so that the model (``transformer``) can pin its
activations without importing ``sharding``, which builds the model to initialise it on the mesh.
"""

from __future__ import annotations

import math

import jax
from jax.sharding import PartitionSpec

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")


def constrain_rows(x: jax.Array) -> jax.Array:
    """Keep an activation's rows split over the batch axes of the mesh in context (`jax.set_mesh`).

    Without it, XLA may resolve "rows on fsdp" against "weight rows on fsdp" by gathering the whole
    mini-batch's activations onto every device instead of gathering the (much smaller) weights. A
    no-op without a mesh in context or when the rows do not divide the batch axes.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    axes = tuple(a for a in BATCH_AXES if a in mesh.axis_names)
    ways = math.prod(mesh.shape[a] for a in axes)
    if ways == 1 or x.shape[0] % ways:
        return x
    return jax.lax.with_sharding_constraint(x, PartitionSpec(axes, *([None] * (x.ndim - 1))))
