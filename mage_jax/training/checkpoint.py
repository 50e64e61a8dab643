"""Orbax checkpoints of a training run: periodic, keep-last-k, atomic, resumable.

A checkpoint holds two items: ``state`` (the array pytree: parameters, optimizer state, step
counter, placed with their shardings) and ``meta`` (JSON: iteration, RNG key, task-sampler state,
the resolved config). Orbax writes each step into ``<step>.orbax-checkpoint-tmp-*`` and renames it
to ``<step>`` only once every file is on disk, so a run killed during a save leaves the previous
complete checkpoint as the latest one; the unfinished temporary folder is ignored and removed at the
next start.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax
import orbax.checkpoint as ocp


def _abstract(tree: Any) -> Any:
    """ShapeDtypeStructs (with shardings) of a template pytree: the restore target."""

    def leaf(x: Any) -> Any:
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        return x

    return jax.tree.map(leaf, tree)


class Checkpointer:
    """Save / restore ``(state, meta)`` pairs under one directory."""

    def __init__(self, directory: str, *, keep: int = 2, every: int = 0):
        self.directory = os.path.abspath(directory)
        self.every = every
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            create=True,
            cleanup_tmp_directories=True,
            enable_async_checkpointing=False,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def should_save(self, iteration: int) -> bool:
        return self.every > 0 and iteration % self.every == 0

    def save(self, iteration: int, state: Any, meta: Mapping[str, Any]) -> bool:
        """Write checkpoint ``iteration`` (synchronously); an existing one of that step is kept as is."""
        if iteration in self._manager.all_steps():
            return False
        saved = self._manager.save(
            iteration,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(dict(meta))),
            force=True,
        )
        self._manager.wait_until_finished()
        return bool(saved)

    def restore(self, template: Any, step: int | None = None) -> tuple[Any, dict[str, Any]]:
        """Restore ``(state, meta)`` of ``step`` (default: the latest).

        ``template`` (a pytree like the saved state) gives the structure and the target shardings.
        """
        if step is None:
            step = self.latest_step()
        if step is None:
            raise FileNotFoundError(f"no complete checkpoint in {self.directory}")
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(_abstract(template)), meta=ocp.args.JsonRestore()
            ),
        )
        return restored["state"], dict(restored["meta"])

    def restore_meta(self, step: int | None = None) -> dict[str, Any]:
        """Only the JSON metadata (e.g. to read the config of a run before building its model)."""
        if step is None:
            step = self.latest_step()
        if step is None:
            raise FileNotFoundError(f"no complete checkpoint in {self.directory}")
        restored = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(restored["meta"])

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def key_to_json(key: jax.Array) -> list[int]:
    """A PRNG key as plain ints (for the JSON metadata)."""
    data = jax.random.key_data(key) if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) else key
    return [int(x) for x in jax.device_get(data).reshape(-1)]


def key_from_json(values: list[int], *, typed: bool = True) -> jax.Array:
    import numpy as np

    data = jax.numpy.asarray(np.asarray(values, dtype=np.uint32))
    return jax.random.wrap_key_data(data) if typed else data
