"""The two seams of generation: what every program needs of the model, and what the engine needs of its
slot programs.

* ``ModelSpec``: the model graph and config, the special ids, the prompt buckets, the cache dtype, the
  mesh and the parameter shardings. The lockstep sampler (``sampler.Sampler``), the slot programs
  (``slots.CompiledSlotPrograms``) and the rollout engine (``engine.RolloutEngine``) each take one; a run
  builds it once (``training.assemble.make_spec``).
* ``SlotPrograms``: exactly the members the rollout engine (``engine.EngineSession``) uses of the programs
  over its decode slots (insert, decode chunk, packing move, the shapes that pick them) and ``SlotState``
  the slot fields it reads back. ``slots.CompiledSlotPrograms`` implements them on the device; the host
  benchmark's stand-in (``experiments/benchmarks/stand_in_device.py``) with programs that only book time.
  The engine holds no other view of its programs, so a member it starts to use is a change here, where
  every implementation sees it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mage_jax.generate.bank import Bank
from mage_jax.generate.shapes import sorted_buckets
from mage_jax.generate.step import SamplingParams
from mage_jax.models.sharding import generation_sharding, param_shardings
from mage_jax.models.transformer import Transformer, unstack_layers

DEFAULT_PROMPT_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192)


@dataclasses.dataclass(frozen=True, eq=False)
class ModelSpec:
    """What every generation program needs of the model; see the module docstring.

    ``graphdef`` comes from ``nnx.split(model)``; ``config`` is its ``ModelConfig``. ``eos_ids`` stop a
    row; ``pad_id`` fills left padding and the unused tail of responses; prompts are left-padded to the
    smallest of ``prompt_buckets`` that holds them. With a ``mesh`` (axes 'data', 'fsdp', 'tensor' of
    ``mage_jax.models.sharding``) the state is placed with ``state_shardings`` (default: the partition
    rules), rows and the KV cache over ('data', 'fsdp') and kv heads over 'tensor'; without one everything
    stays where it is.
    """

    graphdef: Any
    config: Any
    eos_ids: tuple[int, ...]
    pad_id: int
    prompt_buckets: tuple[int, ...] = DEFAULT_PROMPT_BUCKETS
    cache_dtype: Any = None
    mesh: jax.sharding.Mesh | None = None
    state_shardings: Any = None
    _placed: dict[str, Any] = dataclasses.field(default_factory=dict, init=False, repr=False)
    """What ``place_state`` computes once: the generation graph, shardings and placing programs."""

    def __post_init__(self) -> None:
        eos = tuple(int(i) for i in self.eos_ids)
        if not eos:
            raise ValueError("generation needs at least one EOS id")
        object.__setattr__(self, "eos_ids", eos)
        object.__setattr__(self, "pad_id", int(self.pad_id))
        object.__setattr__(self, "prompt_buckets", sorted_buckets(self.prompt_buckets, "prompt_buckets"))
        for tid in (*eos, self.pad_id):
            if not 0 <= tid < self.vocab_size:
                raise ValueError(
                    f"special token id {tid} is outside the model vocabulary [0, {self.vocab_size})")

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    @property
    def program_key(self) -> tuple:
        """What selects a compiled program besides its shapes: programs built for two specs with the same
        key are interchangeable (``slots.CompiledSlotPrograms.shared``)."""
        return (self.graphdef, self.config, self.eos_ids, self.pad_id, self.prompt_buckets, self.cache_dtype,
                self.mesh)

    def mesh_context(self) -> contextlib.AbstractContextManager:
        """The mesh set for tracing and running a program (nothing without one)."""
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    def generation_dtype(self, dtype: Any) -> Any:
        """A parameter's dtype for generation: a floating one wider than the compute dtype narrowed to it
        (the model casts every parameter to the compute dtype before using it, so nothing changes but
        the bytes a decode step reads), anything else as it is."""
        compute = jnp.dtype(self.config.jnp_dtype)
        if jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize > compute.itemsize:
            return compute
        return dtype

    @property
    def generation_graphdef(self) -> Any:
        """The graph the generation programs run: the model's own, or for a model that scans its blocks the
        same model unrolled, over parameters ``place_state`` unstacked once per session. (Run from the
        stacked parameters, every decode step sliced each block's weights out of them, a copy written and
        read again: 2.3x the bytes of ``paper``'s ideal decode step on 8 x H100.)"""
        if not self.config.scan_layers:
            return self.graphdef
        if "graphdef" not in self._placed:
            unrolled = dataclasses.replace(self.config, scan_layers=False)
            self._placed["graphdef"] = nnx.graphdef(nnx.eval_shape(lambda: Transformer(unrolled,
                                                                                        rngs=nnx.Rngs(0))))
        return self._placed["graphdef"]

    def _unstacks(self, state: Any) -> bool:
        """Whether ``state`` is in the scanned layout that generation unrolls."""
        if not isinstance(state, nnx.State):  # e.g. a stand-in engine's None
            return False
        return bool(self.config.scan_layers) and any(
            path[0] == "layers" and not isinstance(path[1], int) for path, _ in nnx.to_flat_state(state))

    def _layout(self, state: Any) -> Any:
        """``state`` (abstract) in the layout generation reads: unstacked when the model scans."""
        return jax.eval_shape(unstack_layers, state) if self._unstacks(state) else state

    def _generation_shardings(self, state: Any) -> Any:
        """The placement of the parameters generation reads (None without a mesh): the partition rules (or
        ``state_shardings``) of that layout with the ``fsdp`` split gathered."""
        if self.mesh is None:
            return None
        if "shardings" not in self._placed:
            base = self.state_shardings
            if base is None or self._unstacks(state):
                base = param_shardings(self._layout(state), self.mesh)
            self._placed["shardings"] = jax.tree.map(generation_sharding, base)
        return self._placed["shardings"]

    def copies_state(self, state: Any) -> bool:
        """Whether ``place_state`` makes a copy of ``state`` (it then lives beside the training state while
        a session runs) rather than handing over its own arrays."""
        if self._unstacks(state):
            return True
        if any(self.generation_dtype(x.dtype) != x.dtype for x in jax.tree.leaves(state)):
            return True
        shardings = self._generation_shardings(state)
        if shardings is None:
            return False
        leaves = zip(jax.tree.leaves(state), jax.tree.leaves(shardings), strict=True)
        return any(getattr(x, "sharding", None) != s for x, s in leaves)

    def place_state(self, state: Any) -> Any:
        """``state`` placed for generation, once per session (not in every decode step): a scanned model's
        blocks unstacked (``generation_graphdef``), floating parameters in the compute dtype
        (``generation_dtype``), the parameter shardings with their ``fsdp`` split gathered
        (``models.sharding.generation_sharding``). A copy where any of these changes something; otherwise
        ``state`` itself (placed by the rules on a mesh)."""
        shardings = self._generation_shardings(state)
        if not self.copies_state(state):
            return state if shardings is None else jax.device_put(state, shardings)
        unstack = self._unstacks(state)
        if ("place", unstack) not in self._placed:  # one program for every session
            def place(s: Any) -> Any:
                s = unstack_layers(s) if unstack else s
                return jax.tree.map(lambda x: x.astype(self.generation_dtype(x.dtype)), s)

            self._placed["place", unstack] = jax.jit(place, out_shardings=shardings)
        return self._placed["place", unstack](state)

    def abstract_placed(self, state: Any) -> Any:
        """What ``place_state`` makes of ``state`` as ``jax.ShapeDtypeStruct`` leaves with their shardings:
        the parameters the generation programs are lowered for ahead of time."""
        layout = self._layout(state)
        shardings = self._generation_shardings(state)
        if shardings is None:
            shardings = jax.tree.map(lambda x: getattr(x, "sharding", None), layout)

        def one(x: Any, sharding: Any) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct(x.shape, self.generation_dtype(x.dtype), sharding=sharding)

        return jax.tree.map(one, layout, shardings)


@dataclasses.dataclass(frozen=True)
class Donor:
    """A slot whose cache positions ``bucket - length .. bucket - 1`` hold a prompt's keys and values
    (and whose ``prompt_hidden`` its last hidden state): a later request with the same prompt copies them
    instead of prefilling. Valid until the slot is given to another request (decode writes start at
    ``bucket``)."""

    slot: int
    bucket: int
    length: int


@runtime_checkable
class SlotState(Protocol):
    """What the engine reads back of its slots (``models.sharding.to_host`` of each field), per slot:
    done (EOS, limit reached or free), finished (ended with EOS), response tokens drawn so far, the tokens
    and their log-probs."""

    done: Any
    finished: Any
    length: Any
    tokens: Any
    logprobs: Any


@runtime_checkable
class SlotPrograms(Protocol):
    """The programs over ``num_slots`` decode slots that the rollout engine schedules; see the module
    docstring. Slots lie in ``ways`` device blocks of ``local_slots``; an insert starts at most
    ``insert_rows`` requests per block; a decode chunk runs up to ``chunk`` steps; responses hold at most
    ``max_new_tokens`` tokens."""

    num_slots: int
    ways: int
    local_slots: int
    insert_rows: int
    chunk: int
    max_new_tokens: int
    compile_count: int
    """Programs traced so far (a warm engine traces none)."""
    last_insert_bytes: tuple[int, int]
    """(all, automaton indices): host -> device bytes of the latest insert's arguments."""

    def empty(self) -> SlotState:
        """Free slots (every one done)."""
        ...

    def insert(self, state: Any, slots: Any, prompts: Sequence[Sequence[int]], source: Sequence[int],
               targets: Sequence[int], limits: Sequence[int], rules: Sequence[int], key_paths: np.ndarray,
               params: SamplingParams, key: jax.Array, donors: Sequence[Donor | None] | None = None, *,
               bank: Bank | None = None) -> SlotState:
        """Prefill the distinct ``prompts`` once and start request t in slot ``targets[t]`` from prompt
        ``source[t]`` (or from ``donors[t]``'s copy of it), ``limits[t]`` new tokens, automaton ``rules[t]``
        of ``bank``, key path ``key_paths[t]``; its first token is drawn from the prefill."""
        ...

    def decode(self, state: Any, slots: Any, params: SamplingParams, key: jax.Array,
               window: int | None = None, bucket: int | None = None, *,
               bank: Bank | None = None) -> tuple[SlotState, Any]:
        """Up to ``chunk`` steps of the decoding slots among the first ``bucket`` of every block, attending
        over the first ``window`` cache positions; (slots, steps run)."""
        ...

    def move(self, slots: Any, moves: Sequence[tuple[int, int]]) -> SlotState:
        """Move slot ``src`` to slot ``dst`` (same block) for each pair, freeing the sources."""
        ...

    def slot_bucket(self, highest_local: int) -> int:
        """The smallest slot bucket (per block) that holds local slot index ``highest_local``."""
        ...

    def window(self, furthest_write: int) -> int:
        """The cache prefix a chunk attends over when its furthest slot writes at ``furthest_write``."""
        ...

    def prompt_bucket(self, prompts: Sequence[Sequence[int]], donors: Sequence[Donor | None]) -> int:
        """The prompt bucket of an insert: it holds the longest prompt and every donor's bucket."""
        ...

    def bank_sharding(self) -> Any:
        """Where the engine's constraint bank lives (None: unplaced)."""
        ...
