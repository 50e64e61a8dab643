"""Orbax checkpoints of a training run: periodic, keep-last-k, atomic, verified, resumable.

A checkpoint holds three items: ``state`` (the array pytree: parameters, optimizer state, step
counter, placed with their shardings), ``meta`` (JSON: iteration, RNG key, task-sampler state, the
resolved config) and ``checksums`` (JSON: a CRC-32 of every array of ``state``, keyed by its tree
path, and of the canonical ``meta``; CRC-32 because it guards against damage, not tampering, and
hashes about twice as fast as SHA-256, which matters for multi-GB optimizer states).

Orbax writes each step into ``<step>.orbax-checkpoint-tmp-*`` and renames it to ``<step>`` only
once every file is on disk, so a run killed during a save leaves the previous complete checkpoint as
the latest one; the unfinished temporary folder is ignored and removed at the next start.

A complete checkpoint can still be damaged afterwards (a truncated or deleted file, flipped bytes,
an edited meta file). Restoring verifies every array and the meta against the checksums; a damaged
latest step is moved aside to ``<step>.damaged`` (so a resumed run can save that step again) and the
newest intact older step is restored, with one warning line naming what was skipped. Only when no
step is intact does restoring fail, with one ``CheckpointError`` line.

Several processes (multi-host). Each process hashes the shards it holds; at a save the digests of
all processes are gathered (one collective) and written as one list per array, so every process
verifies its own shards on restore. Whether a step is intact is then agreed (one collective per step
tried: intact only if intact on every process), so all processes restore the same step even when
the damage lies in the data only one of them reads, and only process 0 moves a damaged step aside
(the others wait for it at a barrier). A checkpoint can only be verified by as many processes as
wrote it.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
import zlib
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from mage_jax.config import ConfigError

DAMAGED_SUFFIX = ".damaged"


class CheckpointError(ConfigError):
    """No intact checkpoint to restore; the message is one line naming each damaged step."""


class CheckpointMismatch(CheckpointError):
    """An intact checkpoint whose arrays have other shapes or dtypes than this run's state (the config
    changed the model or optimizer): a configuration problem, so no older step is tried."""


class DamagedCheckpoint(Exception):
    """One step failed to load or to verify; the message says why, in a few words."""


def _abstract(tree: Any) -> Any:
    """ShapeDtypeStructs (with shardings) of a template pytree: the restore target."""

    def leaf(x: Any) -> Any:
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        return x

    return jax.tree.map(leaf, tree)


def array_digest(x: Any) -> str:
    """CRC-32 (8 hex digits) of one array's dtype, shape and bytes.

    An array spread over several hosts is hashed from this process's distinct shards (keyed by their
    global index), so every process verifies the part it wrote and reads back.
    """
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        shards = {str(s.index): s.data for s in x.addressable_shards}
        parts = [(index, np.asarray(shards[index])) for index in sorted(shards)]
    else:
        parts = [("", np.asarray(jax.device_get(x)))]
    crc = 0
    for index, a in parts:
        crc = zlib.crc32(f"{index}|{a.dtype.str}|{a.shape}|".encode(), crc)
        crc = zlib.crc32(np.ascontiguousarray(a).reshape(-1).view(np.uint8), crc)
    return f"{crc:08x}"


def state_digests(state: Any) -> dict[str, str]:
    """``{tree path: array_digest}`` of every leaf of a state pytree (hashed on a few threads)."""
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        digests = list(pool.map(array_digest, [leaf for _, leaf in leaves]))
    return {jax.tree_util.keystr(path): d for (path, _), d in zip(leaves, digests)}


def gather_digests(local: Mapping[str, str]) -> dict[str, Any]:
    """The checksum entry of each array: its digest (one process), or the list of every process's
    digest of its own shards, in process order (one collective)."""
    if jax.process_count() == 1:
        return dict(local)
    paths = sorted(local)
    n = jax.process_count()
    values = np.array([int(local[p], 16) for p in paths], dtype=np.uint32)
    gathered = np.asarray(multihost_utils.process_allgather(values)).reshape(n, len(paths))
    return {p: [f"{int(gathered[i, j]):08x}" for i in range(n)] for j, p in enumerate(paths)}


def _all_agree(ok: bool) -> bool:
    """True when ``ok`` holds on every process (one collective with several processes)."""
    if jax.process_count() == 1:
        return ok
    return bool(np.all(np.asarray(multihost_utils.process_allgather(np.array([ok], dtype=np.int32)))))


def state_signature(state: Any) -> dict[str, list[Any]]:
    """``{tree path: [shape, dtype name]}`` of every leaf (arrays, shape structs or scalars)."""
    def signature(leaf: Any) -> list[Any]:
        dtype = leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype
        return [list(np.shape(leaf)), str(dtype)]

    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    return {jax.tree_util.keystr(path): signature(leaf) for path, leaf in leaves}


def _mismatch(saved: Mapping[str, Any], wanted: Mapping[str, list[Any]]) -> str | None:
    """The first difference between a saved signature and the template's, in words (None: same)."""
    for path in sorted(set(saved) | set(wanted)):
        if path not in wanted:
            return f"it holds {path}, which this run's state lacks"
        if path not in saved:
            return f"it lacks {path}"
        have, want = list(saved[path]), wanted[path]
        if have != want:
            return f"{path} is {have[0]} {have[1]} there but {want[0]} {want[1]} here"
    return None


def _layout_hint(saved: Mapping[str, Any], template: Any) -> str:
    """When the two states keep the decoder blocks in different layouts (one block per layer, or one
    stacked block: ``ModelConfig.scan_layers``), say so."""
    def per_layer(paths: Any) -> bool | None:
        paths = [p for p in paths if "['layers']" in p]
        return None if not paths else any(p.split("['layers']", 1)[1].startswith("[") and
                                          p.split("['layers']", 1)[1][1:2].isdigit() for p in paths)

    have, want = per_layer(saved), per_layer(state_signature(template))
    if have is None or want is None or have == want:
        return ""
    saved_layout, this_layout = ("unrolled", "scanned") if have else ("scanned", "unrolled")
    return (f" (its decoder blocks are {saved_layout}, this run's are {this_layout}: ModelConfig.scan_layers "
            f"differs, and a checkpoint restores only in the layout it was saved in; add "
            f"--model.overrides.scan_layers {str(not have).lower()} to the command)")


def meta_digest(meta: Mapping[str, Any]) -> str:
    """CRC-32 of the canonical JSON of the metadata (what a JSON round trip preserves)."""
    text = json.dumps(meta, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return f"{zlib.crc32(text.encode()):08x}"


def verify(state: Any, meta: Mapping[str, Any], checksums: Any) -> None:
    """Raise ``DamagedCheckpoint`` naming the first array (or the meta) that does not match."""
    if not isinstance(checksums, Mapping) or not isinstance(checksums.get("arrays"), Mapping):
        raise DamagedCheckpoint("its checksums are missing or unreadable")
    if meta_digest(meta) != checksums.get("meta"):
        raise DamagedCheckpoint("meta does not match its checksum")
    expected = checksums["arrays"]
    actual = state_digests(state)
    if set(actual) != set(expected):
        raise DamagedCheckpoint("its arrays do not match the checksum list")
    for path, digest in actual.items():
        entry = expected[path]
        if isinstance(entry, list):  # written by several processes: this process's shards
            entry = entry[jax.process_index()] if len(entry) == jax.process_count() else None
        if digest != entry:
            raise DamagedCheckpoint(f"array {path} does not match its checksum")


class Checkpointer:
    """Save / restore ``(state, meta)`` pairs under one directory, verified by per-array checksums."""

    def __init__(self, directory: str, *, keep: int = 2, every: int = 0):
        self.directory = os.path.abspath(directory)
        self.every = every
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            create=True,
            cleanup_tmp_directories=True,
            enable_async_checkpointing=False,
        )
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=("state", "meta", "checksums"))
        self._reader = self._manager
        if jax.process_count() > 1:
            # Restores read only this process's shards and need no other process: with the process as
            # its own group a failed read skips no barrier that the others then wait at forever.
            alone = ocp.options.MultiprocessingOptions(primary_host=jax.process_index(),
                                                       active_processes={jax.process_index()})
            self._reader = ocp.CheckpointManager(
                self.directory, item_names=("state", "meta", "checksums"),
                options=ocp.CheckpointManagerOptions(create=False,
                                                     multiprocessing_options=alone))

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
        meta = dict(meta)
        checksums = {"arrays": gather_digests(state_digests(state)), "shapes": state_signature(state),
                     "meta": meta_digest(meta)}
        saved = self._manager.save(
            iteration,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta),
                                    checksums=ocp.args.JsonSave(checksums)),
            force=True,
        )
        self._manager.wait_until_finished()
        return bool(saved)

    def restore(self, template: Any, step: int | None = None) -> tuple[Any, dict[str, Any]]:
        """Restore ``(state, meta)`` of ``step``, verified against its checksums.

        ``template`` (a pytree like the saved state) gives the structure and the target shardings.
        With ``step=None`` the newest intact step is restored: damaged newer steps are moved aside and
        named in one warning line on stderr. ``CheckpointError`` when the asked step (or, by default,
        every step) is damaged; ``CheckpointMismatch`` when an intact step holds arrays of other shapes
        or dtypes than ``template`` (the config changed); ``FileNotFoundError`` when there is no
        checkpoint at all.
        """
        _drop_orbax_leftovers()
        if self._reader is not self._manager:
            self._reader.reload()
        steps = sorted(self._manager.all_steps(), reverse=True)
        if not steps:
            raise FileNotFoundError(f"no complete checkpoint in {self.directory}")
        if not any(os.path.isdir(os.path.join(self.directory, str(s), "checksums")) for s in steps):
            return self._restore_unverified(template, step if step is not None else steps[0], steps)
        if step is not None:
            if step not in steps:
                raise CheckpointError(f"no checkpoint of step {step} in {self.directory} "
                                      f"(steps: {sorted(steps) or 'none'})")
            restored, damage = self._restore_agreed(template, step)
            if damage is not None:
                raise CheckpointError(f"checkpoint step {step} in {self.directory} is damaged: {damage}")
            return restored
        skipped: list[str] = []
        for candidate in steps:
            restored, damage = self._restore_agreed(template, candidate)
            if damage is not None:
                skipped.append(f"step {candidate} ({damage})")
                continue
            if skipped:
                for bad in steps[: steps.index(candidate)]:
                    self._move_aside(bad)
                print(f"warning: skipped damaged checkpoint {'; '.join(skipped)} in {self.directory} "
                      f"(moved aside as <step>{DAMAGED_SUFFIX}); restored step {candidate}", file=sys.stderr)
            return restored
        raise CheckpointError(f"no intact checkpoint in {self.directory}: {'; '.join(skipped)}")

    def _restore_unverified(self, template: Any, step: int, steps: list[int]) -> tuple[Any, dict[str, Any]]:
        """A directory written before checksums existed (no step has them): restored as it is, once
        named in a warning line. A missing checksum beside checksummed steps is damage instead."""
        if step not in steps:
            raise CheckpointError(
                f"no checkpoint of step {step} in {self.directory} (steps: {sorted(steps)})")
        try:
            restored = self._reader.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(_abstract(template)), meta=ocp.args.JsonRestore()))
        except Exception as err:
            first = str(err).strip().splitlines()[0][:100] if str(err).strip() else type(err).__name__
            raise CheckpointError(f"checkpoint step {step} in {self.directory} (written without checksums) "
                                  f"cannot be restored: {type(err).__name__}: {first}") from None
        print(f"warning: checkpoint step {step} in {self.directory} predates checksums; restored it "
              "unverified", file=sys.stderr)
        return restored["state"], dict(restored["meta"])

    def _restore_agreed(self, template: Any, step: int) -> tuple[Any, str | None]:
        """``(restored, None)``, or ``(None, why)`` when ``step`` is damaged on any process (every process
        reaches the one agreement, whatever failed where, so none waits for another forever)."""
        try:
            restored, damage = self._restore_verified(template, step), None
        except DamagedCheckpoint as err:
            restored, damage = None, str(err)
        if _all_agree(damage is None):
            return restored, None
        if damage is None:
            return None, "damaged as another process reads it"
        return None, damage if jax.process_count() == 1 else f"{damage}, on process {jax.process_index()}"

    def _restore_verified(self, template: Any, step: int) -> tuple[Any, dict[str, Any]]:
        try:
            checksums = self._reader.restore(step, args=ocp.args.Composite(checksums=ocp.args.JsonRestore()))
            saved = checksums["checksums"]["shapes"]
            if not isinstance(saved, Mapping):
                raise TypeError("shapes is not an object")
        except Exception as err:
            reason = type(err).__name__
            raise DamagedCheckpoint(f"its checksums are missing or unreadable ({reason})") from None
        difference = _mismatch(saved, state_signature(template))
        arrays = checksums["checksums"].get("arrays")
        arrays = arrays if isinstance(arrays, Mapping) else {}
        writers = {len(v) for v in arrays.values() if isinstance(v, list)}
        if difference is None and writers and writers != {jax.process_count()}:
            difference = f"it was written by {max(writers)} processes, this run has {jax.process_count()}"
        if difference is not None:
            raise CheckpointMismatch(
                f"checkpoint step {step} in {self.directory} does not fit this run's model / optimizer: "
                f"{difference}; resume with the config it was saved with{_layout_hint(saved, template)}")
        try:
            restored = self._reader.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(_abstract(template)), meta=ocp.args.JsonRestore(),
                    checksums=ocp.args.JsonRestore(),
                ),
            )
            meta = restored["meta"]
            if not isinstance(meta, Mapping):
                raise DamagedCheckpoint("its meta is not a JSON object")
            meta = dict(meta)
            verify(restored["state"], meta, restored["checksums"])
        except DamagedCheckpoint:
            raise
        except Exception as err:  # orbax / tensorstore / JSON errors of a damaged step all land here
            first = str(err).strip().splitlines()[0][:100] if str(err).strip() else ""
            reason = f"{type(err).__name__}: {first}" if first else type(err).__name__
            raise DamagedCheckpoint(f"unreadable: {reason}") from None
        return restored["state"], meta

    def _move_aside(self, step: int) -> None:
        """Rename a damaged step (process 0 only; every process waits for it, then rereads the steps)."""
        if jax.process_index() == 0:
            source = os.path.join(self.directory, str(step))
            target = source + DAMAGED_SUFFIX
            n = 1
            while os.path.exists(target):
                n += 1
                target = f"{source}{DAMAGED_SUFFIX}{n}"
            os.replace(source, target)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"checkpoint step {step} moved aside")
            self._reader.reload()
        self._manager.reload()

    def delete(self, step: int) -> None:
        """Remove checkpoint ``step`` (e.g. one written after the checkpoint a run resumed from)."""
        self._manager.delete(step)

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
        if self._reader is not self._manager:
            self._reader.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _drop_orbax_leftovers() -> None:
    """Keep a damaged step's report to its one line.

    After a failed read orbax leaves tensorstore callbacks (which then find their event loop closed)
    and unfinished read coroutines behind; when they end, during the restore or at a later garbage
    collection, Python prints "Exception ignored" tracebacks of 5-60 lines each for a problem already
    reported. This hook drops those two kinds, and only those; everything else reaches the previous hook.
    """
    previous = sys.unraisablehook
    if getattr(previous, "drops_orbax_leftovers", False):
        return

    def hook(unraisable: Any) -> None:
        exc, obj = unraisable.exc_value, unraisable.object
        closed_loop = isinstance(exc, RuntimeError) and "Event loop is closed" in str(exc)
        orbax_read = inspect.iscoroutine(obj) and "orbax" in obj.cr_code.co_filename
        if not (closed_loop or orbax_read):
            previous(unraisable)

    hook.drops_orbax_leftovers = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


def key_to_json(key: jax.Array) -> list[int]:
    """A PRNG key as plain ints (for the JSON metadata)."""
    data = jax.random.key_data(key) if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) else key
    return [int(x) for x in jax.device_get(data).reshape(-1)]


def key_from_json(values: list[int], *, typed: bool = True) -> jax.Array:
    data = jax.numpy.asarray(np.asarray(values, dtype=np.uint32))
    return jax.random.wrap_key_data(data) if typed else data
