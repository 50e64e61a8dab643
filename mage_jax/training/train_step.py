"""The jitted policy update and the log-prob recompute (docs/method.md §5).

Both functions take the parameter state as a jit argument (functional NNX: the graph definition is
closed over, the state travels) and a mini-batch of fixed shape ``[R, T]`` in the ``PackedBatch``
layout: ``targets[r, t]`` is the token predicted from the prefix ``0..t`` and ``response_mask[r, t]``
marks response targets. Rows are split over the mesh axes ('data', 'fsdp'); parameters and optimizer
state keep the partition rules of ``mage_jax.models.sharding``. On one CPU device this is a 1x1x1 mesh.

* ``compute_logprobs(params, batch)`` -> log pi(target) at temperature 1 (float32 [R, T]). It gives
  the *old* log-probs (recomputed by the training model before the update, never the sampler's) and
  the *reference* log-probs of the frozen initial model for the KL term.
* ``update(state, batch)`` -> (new state, metrics): PPO clip / dual-clip loss with the configured
  aggregation, entropy bonus, optional KL to the reference (k3, clamped), gradients, then
  ``clip_by_global_norm`` + AdamW, all in one XLA program per mini-batch shape. A non-finite loss,
  gradient or updated state (parameters and optimizer moments, one all-finite flag reduced inside the
  step) skips the update: parameters and
  optimizer state are kept (``jnp.where`` over the tree) and ``skipped = 1`` is reported, so a
  non-finite state never leaves the step. So does a finite update that is too large for the
  parameters: ``update_ratio = ||delta|| / ||params||`` (global norms, two reductions) above
  ``max_update_ratio`` (a learning rate of 1e30 gives ~1e31 and parameters that stay finite for one
  update, then diverged sampling; normal runs stay below ~0.05, see ``OptimConfig.max_update_ratio``).

Programs are built once per process: ``shared_train_step`` hands every caller with the same graph,
optimizer settings, step config and mesh the same ``TrainStep`` (``make_optimizer`` and
``schedules.learning_rate_schedule`` return one object per setting), so a second run in a process, or a
test after another, compiles nothing new.

Constrained decoding: when rows were sampled under a token automaton, the recompute replays it
(``constraints.constraint_masks``) so the log-probs describe the same constrained distribution the
sampler drew from. The automaton is replayed over the first ``constraint_len`` response tokens, which
bounds the ``[R, T, V]`` mask to the short action strings it is meant for.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from mage_jax.algorithms import losses
from mage_jax.generate.constraints import constraint_masks
from mage_jax.models import lora
from mage_jax.models import sharding as shd
from mage_jax.training.xla_options import train_step_compiler_options

TOKEN_FIELDS = ("tokens", "positions", "token_mask", "targets", "response_mask")
TOKEN_DTYPES = (jnp.int32, jnp.int32, jnp.bool_, jnp.int32, jnp.bool_)
"""The dtype of each of ``TOKEN_FIELDS``."""


@flax.struct.dataclass
class TrainBatch:
    """One mini-batch of ``R`` rows cut to ``T`` tokens: the input of ``compute_logprobs`` and ``update``.

    Token arrays are ``[R, T]`` in the ``PackedBatch`` layout; ``prompt_lengths`` and ``advantages``
    are ``[R]``; ``old_logprobs`` / ``ref_logprobs`` ``[R, T]`` (the update needs them, the recompute
    does not; an update without ``old_logprobs`` takes log pi_old from its own forward pass, which is
    the recompute's value when the state has not moved since, i.e. an iteration's only update);
    ``transitions`` ``int32[R, S, V]`` is each row's constraint automaton (None: no row of the batch was
    constrained). Padding rows are fully masked. ``row_weights`` ``float32[R]`` (update only; None: 1
    each) counts a row as that many identical rows (``training.credit.merge_identical``).
    """

    tokens: Any
    positions: Any
    token_mask: Any
    targets: Any
    response_mask: Any
    prompt_lengths: Any
    advantages: Any = None
    old_logprobs: Any = None
    ref_logprobs: Any = None
    transitions: Any = None
    row_weights: Any = None

    @classmethod
    def from_packed(cls, packed: Any, index: np.ndarray, *, length: int | None = None,
                    advantages: np.ndarray | None = None, constrained: bool = False) -> TrainBatch:
        """Host arrays of rows ``index`` (``-1``: a masked padding row) of a ``PackedBatch``.

        ``advantages`` is per row ``[R]`` of the whole batch. ``length`` cuts the token axis (rows are
        right-padded, so any length that holds the longest selected row loses nothing). The old and
        reference log-probs are attached on the host by the caller (``replace`` with ``gather_rows`` of
        its host tables) before ``TrainStep.place_batch`` sends the batch to the device.
        """
        index = np.asarray(index, dtype=np.int64)
        pad = index < 0
        safe = np.where(pad, 0, index)
        length = packed.tokens.shape[1] if length is None else int(length)
        tokens: dict[str, np.ndarray] = {}
        for name in TOKEN_FIELDS:
            arr = np.asarray(getattr(packed, name))[safe, :length].copy()
            if pad.any():
                arr[pad] = packed.pad_id if name in ("tokens", "targets") else 0
            tokens[name] = arr
        adv = None
        if advantages is not None:
            adv = np.where(pad, 0.0, np.asarray(advantages, np.float32)[safe]).astype(np.float32)
        return cls(
            **tokens,
            prompt_lengths=np.where(pad, 0, np.asarray(packed.prompt_lengths)[safe]).astype(np.int32),
            advantages=adv,
            transitions=packed.row_transitions(safe) if constrained else None,
        )

    @classmethod
    def abstract(cls, rows: int, length: int, *, update: bool, reference: bool = False,
                 sharding: Any = None) -> TrainBatch:
        """The shapes and dtypes of a batch of ``rows`` x ``length`` (``jax.ShapeDtypeStruct`` leaves, for
        ahead-of-time lowering): with ``update`` the advantages and old log-probs ``update`` receives (and
        the reference log-probs with ``reference``), else what ``compute_logprobs`` receives; no
        constraint tables. ``sharding(shape)`` places each leaf (None: unplaced)."""
        def leaf(shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct(shape, dtype, sharding=None if sharding is None else sharding(shape))

        fields = {name: leaf((rows, length), dtype) for name, dtype in zip(TOKEN_FIELDS, TOKEN_DTYPES)}
        fields["prompt_lengths"] = leaf((rows,), jnp.int32)
        if update:
            fields["advantages"] = leaf((rows,), jnp.float32)
            fields["old_logprobs"] = leaf((rows, length), jnp.float32)
            fields["row_weights"] = leaf((rows,), jnp.float32)
            if reference:
                fields["ref_logprobs"] = leaf((rows, length), jnp.float32)
        return cls(**fields)

    @property
    def length(self) -> int:
        return int(self.tokens.shape[1])


def gather_rows(table: np.ndarray, index: np.ndarray, length: int) -> np.ndarray:
    """Rows ``index`` of a host ``[N, >= length]`` table cut to ``length`` tokens, zeros for padding rows
    (``-1``): the old / reference log-probs of a mini-batch. The tables live on the host: at the paper's
    lengths one iteration's rows x 12288 tokens of float32 are tens of GB, more than a device holds."""
    index = np.asarray(index, dtype=np.int64)
    rows = np.asarray(table)[np.where(index < 0, 0, index), :length]
    return np.where((index < 0)[:, None], np.float32(0.0), rows).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Static hyperparameters of the update (hashable; changing one recompiles)."""

    clip_eps: float = 0.2
    dual_clip: float | None = 3.0
    entropy_coef: float = 0.001
    kl_coef: float = 0.0
    kl_kind: str = "k3"
    aggregation: str = "token-mean"
    chunk_size: int = 512
    constraint_len: int = 0
    """Response tokens over which a constraint automaton is replayed (0: no constrained rows)."""
    response_len: int = 0
    """The most response tokens of any row (the generation bound): the head computes logits at these
    positions of each row only, not at its prompt positions, whose log-probs nothing uses. 0: every
    position (the [R, T, V] head). On one device only: over a mesh of several, the per-row gathers of
    the span partitioned into a program whose devices deadlocked (8 CPU devices, one of them never
    reaching an all-reduce: ``tests/training/test_multiprocess.py``), so there the whole-row head runs."""
    micro_batch_rows: int = 0
    """Rows per forward/backward pass inside one update (gradient accumulation); 0: the whole mini-batch."""
    adapters_only: bool = False
    """LoRA: gradients and optimizer state for the adapters only; the base parameters are frozen."""
    max_update_ratio: float = 1.0
    """Skip an update whose global norm exceeds this multiple of the parameters' global norm (0: never)."""


@flax.struct.dataclass
class TrainState:
    """Everything the update changes: parameters, optimizer state and the count of applied updates.

    ``params`` is always the whole model state; with ``StepConfig.adapters_only`` the optimizer state
    mirrors the LoRA adapters alone and the base leaves pass through every update unchanged.
    """

    params: Any
    opt_state: Any
    step: jax.Array


@functools.cache
def make_optimizer(
    schedule: optax.Schedule, *, b1: float, b2: float, weight_decay: float, grad_clip: float
) -> optax.GradientTransformation:
    """Global-norm clipping then AdamW (docs/method.md §5). One object per setting (cached), so that
    ``shared_train_step`` recognises the same optimizer."""
    return optax.chain(
        optax.clip_by_global_norm(grad_clip),
        optax.adamw(schedule, b1=b1, b2=b2, weight_decay=weight_decay),
    )


def global_norm(tree: Any) -> jax.Array:
    """The float32 L2 norm of all leaves of ``tree`` together, scaled by the largest magnitude first so
    that a huge tree (an update of 1e30) gives its norm, not an overflowed inf."""
    leaves = [x.astype(jnp.float32) for x in jax.tree.leaves(tree)]
    if not leaves:
        return jnp.float32(0.0)
    scale = jnp.max(jnp.stack([jnp.max(jnp.abs(x)) for x in leaves]))
    scale = jnp.where((scale > 0) & jnp.isfinite(scale), scale, jnp.float32(1.0))
    squares = [jnp.sum(jnp.square(x / scale)) for x in leaves]
    return scale * jnp.sqrt(sum(squares, jnp.float32(0.0)))


def all_finite(tree: Any) -> jax.Array:
    """One boolean: every floating-point leaf of ``tree`` is finite (integer leaves always are)."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


class TrainStep:
    """Builds and holds the jitted update and log-prob functions for one model graph."""

    def __init__(
        self,
        graphdef: Any,
        optimizer: optax.GradientTransformation,
        schedule: optax.Schedule,
        config: StepConfig,
        mesh: Mesh,
    ):
        self.graphdef = graphdef
        self.optimizer = optimizer
        self.schedule = schedule
        self.config = config
        self.mesh = mesh
        self._platform = mesh.devices.flat[0].platform  # a compile-only topology's too
        self._replicated = shd.replicated(mesh)
        self._programs: dict[Any, tuple[Any, Any, Any]] = {}
        self._logprobs = None
        self._state_shardings: dict[Any, TrainState] = {}

    # ------------------------------------------------------------------ state
    def init_state(self, params: Any) -> TrainState:
        """Optimizer state for ``params``, everything placed with the partition rules."""
        params = jax.device_put(params, shd.param_shardings(params, self.mesh))
        if self.config.adapters_only and not lora.has_adapters(params):
            raise ValueError("adapters_only needs a model with LoRA adapters (ModelConfig.lora_rank > 0)")
        opt_state = jax.jit(self.optimizer.init)(self.trainable(params)[0])
        opt_state = jax.device_put(opt_state, shd.opt_state_shardings(opt_state, self.mesh))
        state = TrainState(params=params, opt_state=opt_state, step=np.zeros((), np.int32))
        return jax.device_put(state, self.state_shardings(state))

    def state_shardings(self, state: TrainState) -> TrainState:
        """The placement of a state shaped like ``state`` (cached by its tree and leaf shapes)."""
        leaves, tree = jax.tree.flatten((state.params, state.opt_state))
        key = (tree, tuple(np.shape(x) for x in leaves))
        if key not in self._state_shardings:
            self._state_shardings[key] = TrainState(
                params=shd.param_shardings(state.params, self.mesh),
                opt_state=shd.opt_state_shardings(state.opt_state, self.mesh),
                step=self._replicated,
            )
        return self._state_shardings[key]

    # ------------------------------------------------------------------ batches
    def place_batch(self, batch: TrainBatch) -> TrainBatch:
        """Put a mini-batch on the mesh: rows over ('data', 'fsdp') when they divide them, else
        replicated (``sharding.rows_sharding``)."""

        def place(value: Any) -> jax.Array:
            return jax.device_put(value, shd.rows_sharding(self.mesh, np.shape(value)[0], np.ndim(value)))

        return jax.tree.map(place, batch)

    # ------------------------------------------------------------------ model
    def trainable(self, params: Any) -> tuple[Any, Any]:
        """(what the optimizer updates, the frozen rest or None): the adapters and the base under
        ``adapters_only``, else every parameter."""
        if self.config.adapters_only:
            return lora.split_adapters(params)
        return params, None

    @staticmethod
    def _join(trainable: Any, frozen: Any) -> Any:
        return trainable if frozen is None else nnx.merge_state(frozen, trainable)

    def _token_logprobs(self, params: Any, batch: TrainBatch) -> tuple[jax.Array, jax.Array]:
        # Fresh variables: under LoRA the frozen base's come from outside the gradient's trace, and a
        # rematerialised block may not update variables of another trace.
        model = nnx.merge(self.graphdef, params, copy=True)
        hidden, _ = model(batch.tokens, batch.positions, batch.token_mask)
        span = self.config.response_len
        length = batch.targets.shape[1]
        if span <= 0 or span >= length or self.mesh.size > 1:
            allowed = self._allowed(batch) if batch.transitions is not None else None
            return losses.token_logprobs_and_entropy(
                hidden, model.head_weight(), batch.targets, chunk_size=self.config.chunk_size,
                temperature=1.0, allowed=allowed,
            )
        # The head over each row's response span only: targets p - 1 .. p - 1 + span of a row whose
        # prompt has p tokens (the response is never longer than the generation bound ``span``), then
        # scattered back to [R, T] with zeros at the prompt (and padding) positions.
        start = jnp.maximum(batch.prompt_lengths - 1, 0)
        index = jnp.clip(start[:, None] + jnp.arange(span)[None, :], 0, length - 1)  # [R, span]
        targets = jnp.take_along_axis(batch.targets, index, axis=1)
        allowed = None
        if batch.transitions is not None:
            steps = max(1, min(self.config.constraint_len, span))
            masks = constraint_masks(batch.transitions, targets[:, :steps])  # [R, steps, V]
            if steps < span:  # beyond the automaton's tokens nothing is constrained
                masks = jnp.concatenate([masks, jnp.ones((masks.shape[0], span - steps, masks.shape[2]),
                                                         bool)], axis=1)
            allowed = masks
        logp, entropy = losses.token_logprobs_and_entropy(
            jnp.take_along_axis(hidden, index[:, :, None], axis=1), model.head_weight(), targets,
            chunk_size=self.config.chunk_size, temperature=1.0, allowed=allowed,
        )
        offset = jnp.arange(length)[None, :] - start[:, None]  # [R, T]: position in the span
        inside = (offset >= 0) & (offset < span)
        back = jnp.clip(offset, 0, span - 1)
        return (jnp.where(inside, jnp.take_along_axis(logp, back, axis=1), 0.0),
                jnp.where(inside, jnp.take_along_axis(entropy, back, axis=1), 0.0))

    def _allowed(self, batch: TrainBatch) -> jax.Array:
        """bool[R, T, V]: the constraint mask of each target position (all True outside the response)."""
        targets = batch.targets
        rows, length = targets.shape
        steps = max(1, min(self.config.constraint_len, length))
        start = jnp.maximum(batch.prompt_lengths - 1, 0)  # target index of the first response token
        gather = jnp.clip(start[:, None] + jnp.arange(steps)[None, :], 0, length - 1)
        response = jnp.take_along_axis(targets, gather, axis=1)
        masks = constraint_masks(batch.transitions, response)  # [R, steps, V]
        offset = jnp.arange(length)[None, :] - start[:, None]  # [R, T]
        inside = (offset >= 0) & (offset < steps)
        picked = jnp.take_along_axis(masks, jnp.clip(offset, 0, steps - 1)[:, :, None], axis=1)
        return jnp.where(inside[:, :, None], picked, True)

    # ------------------------------------------------------------------ jitted entry points
    def logprobs_program(self) -> Any:
        """The jitted log-prob recompute, ``(params, batch, adapters)`` with ``adapters`` a traced bool
        (the policy and a LoRA run's frozen reference share one program; ``compute_logprobs`` runs it
        under the mesh; ``.lower`` it for an ahead-of-time compile). One compile per batch shape: the
        trainer's mini-batches are ``optim.mini_batch_rows`` rows (padding rows masked) of a length
        bucket, so one per length bucket."""
        if self._logprobs is None:

            def one(params, batch):
                logp, _ = self._token_logprobs(params, batch)
                return jnp.where(batch.response_mask, logp, 0.0)

            def logprobs(params, batch, adapters):
                # The log-probs are placed like the batch's rows: split when they divide the batch axes,
                # else replicated (a 16-row mini-batch on 64 chips).
                rows = batch.tokens.shape[0]
                placed = functools.partial(jax.lax.with_sharding_constraint,
                                           shardings=shd.rows_sharding(self.mesh, rows, 2))
                adapted, base = lora.split_adapters(params)
                if jax.tree.leaves(adapted):  # off: every adapter matrix zero (``lora.without_adapters``)
                    off = jax.tree.map(lambda a: jnp.where(adapters, a, jnp.zeros_like(a)), adapted)
                    params = nnx.merge_state(base, off)
                # ``micro_batch_rows`` rows at a time, like the update: the [rows, chunk, vocab] logits of
                # a whole mini-batch would be the largest buffer of the run.
                micro = self.config.micro_batch_rows or rows
                if micro == rows or rows % micro:
                    return placed(one(params, batch))
                # The parameters ride in the scan's carry, so the model (and its remat) is merged from
                # them inside the loop body's trace. A micro-batch of padding rows only is all zeros
                # without running the model (as in the update).
                def body(p, part):
                    return p, jax.lax.cond(part.response_mask.any(), one,
                                           lambda _, part: jnp.zeros(part.tokens.shape, jnp.float32), p, part)

                _, parts = jax.lax.scan(body, params, split_micro_batches(batch, micro))
                return placed(merge_micro_batches(parts))

            self._logprobs = jax.jit(logprobs, compiler_options=train_step_compiler_options(self._platform))
        return self._logprobs

    def _jitted(self, shardings: TrainState) -> tuple[Any, Any, Any]:
        """(update, grads, apply) jitted for a state placed like ``shardings``."""
        key = jax.tree.flatten(shardings)
        key = (tuple(key[0]), key[1])
        if key not in self._programs:
            grad_shardings = self.trainable(shardings.params)[0]
            options = train_step_compiler_options(self._platform)
            update = jax.jit(self._update_fn, donate_argnums=(0,),
                             out_shardings=(shardings, self._replicated), compiler_options=options)
            grads = jax.jit(self._grads_fn, out_shardings=(grad_shardings, self._replicated),
                            compiler_options=options)
            apply = jax.jit(self._apply_fn, donate_argnums=(0,),
                            out_shardings=(shardings, self._replicated), compiler_options=options)
            self._programs[key] = (update, grads, apply)
        return self._programs[key]

    def update_program(self, shardings: TrainState) -> Any:
        """The jitted ``update`` for a state placed like ``shardings``, ``(state, batch, lr_scale)`` with
        the state donated: loss, gradients and the optimizer step with the non-finite and update-size
        skips in one program (run under the mesh; ``.lower`` it for an ahead-of-time compile)."""
        return self._jitted(shardings)[0]

    def update_programs(self, shardings: TrainState) -> tuple[Any, Any]:
        """The two halves of ``update_program`` as programs of their own: loss and gradients of the
        trainable parameters (run under the mesh), and the optimizer step (the state donated). The
        fused program is their composition (``tests/training/test_train_step.py`` checks both give the
        same state); the halves serve memory plans (``mage_jax.aot``) that size each part."""
        return self._jitted(shardings)[1:]

    def compute_logprobs(self, params: Any, batch: TrainBatch, *, adapters: bool = True) -> jax.Array:
        """log pi(target) at temperature 1, float32 [R, T] (0 outside the response).

        ``adapters=False`` switches LoRA adapters off (the frozen base model: the KL reference of a
        LoRA run, computed from the same parameters without a second copy of the base).
        """
        program = self.logprobs_program()
        with jax.set_mesh(self.mesh):  # the model keeps activation rows on the mesh's batch axes
            return program(params, batch, np.bool_(adapters))

    def update(self, state: TrainState, batch: TrainBatch, lr_scale: float = 1.0, *,
               donate: bool = True) -> tuple[TrainState, dict[str, Any]]:
        """One optimizer step on one mini-batch (``state`` is donated unless ``donate=False``).

        ``lr_scale`` multiplies the step (a run-level decay of the learning rate, e.g. cosine over the
        iterations; a traced scalar, so changing it never recompiles). ``donate=False`` leaves
        ``state`` intact beside the new one (the trainer keeps an iteration's starting state that
        way, to save it when a stop request lands during the updates); the new state then needs
        buffers of its own.

        One jitted program per mini-batch shape (``update_program``). ``donate=False`` copies the state
        first (a device copy, no program, where this process holds every shard; a copy program across
        processes) and donates the copy: the peak is the same two states a non-donating program would
        hold.
        """
        program = self.update_program(self.state_shardings(state))
        if not donate:
            state = _copy(state)
        with jax.set_mesh(self.mesh):  # the model keeps activation rows on the mesh's batch axes
            return program(state, batch, np.float32(lr_scale))

    def _update_fn(self, state: TrainState, batch: TrainBatch, lr_scale: jax.Array):
        """Gradients of ``batch`` then the optimizer step: one program. It holds no more than the two
        halves would: the optimizer state is on the device either way, and the activations are dead
        before the optimizer runs."""
        grads, metrics = self._grads_fn(state.params, batch)
        return self._apply_fn(state, grads, metrics, lr_scale)

    def _apply_fn(self, state: TrainState, grads: Any, metrics: dict[str, jax.Array], lr_scale: jax.Array):
        params, frozen = self.trainable(state.params)
        updates, new_opt_state = self.optimizer.update(grads, state.opt_state, params)
        # AdamW's updates (weight decay included) are proportional to the learning rate: scaling them
        # is the same as scaling the learning rate.
        updates = jax.tree.map(lambda u: u * lr_scale.astype(u.dtype), updates)
        new_params = optax.apply_updates(params, updates)
        # An overflowing step (a huge learning rate) can turn finite gradients into non-finite parameters.
        finite = (jnp.isfinite(metrics["loss"]) & all_finite(grads) & all_finite(new_params)
                  & all_finite(new_opt_state))
        # A finite but huge one leaves parameters that sampling then turns into NaN: skip it as well.
        ratio = global_norm(updates) / jnp.maximum(global_norm(state.params), jnp.finfo(jnp.float32).tiny)
        if self.config.max_update_ratio > 0:
            finite = finite & (ratio <= self.config.max_update_ratio)

        def keep_if_skipped(new, old):
            return jnp.where(finite, new, old)

        new_state = TrainState(
            params=self._join(jax.tree.map(keep_if_skipped, new_params, params), frozen),
            opt_state=jax.tree.map(keep_if_skipped, new_opt_state, state.opt_state),
            step=state.step + finite.astype(jnp.int32),
        )
        metrics = dict(metrics)
        metrics.update(
            grad_norm=optax.global_norm(grads),
            lr=jnp.asarray(self.schedule(state.step), jnp.float32) * lr_scale,
            skipped=(~finite).astype(jnp.float32),
            update_ratio=ratio,
        )
        return new_state, metrics

    def _grads_fn(self, params: Any, batch: TrainBatch):
        """Loss, gradients and metrics of one mini-batch, over ``micro_batch_rows`` rows at a time.

        The micro-batches run under one ``lax.scan`` in this program, so only one micro-batch's
        activations are alive at a time; gradients and metrics accumulate in float32. Each
        micro-batch's loss is weighted by its share of the aggregation's denominator (response
        tokens for token-mean, real rows for the seq-mean modes) and its token-mean diagnostics by
        its share of response tokens, so the sums equal the whole mini-batch's values.
        """
        cfg = self.config
        rows = batch.tokens.shape[0]
        micro = cfg.micro_batch_rows or rows
        if rows % micro:
            raise ValueError(f"micro_batch_rows {micro} does not divide the mini-batch's {rows} rows")
        if micro == rows:
            one = jnp.float32(1.0)
            grads, metrics = self._micro_grads(params, batch, one, one)
        else:
            mask, weights = batch.response_mask, batch.row_weights
            agg_total = jnp.maximum(aggregation_count(mask, cfg.aggregation, weights), 1.0)
            token_total = jnp.maximum(aggregation_count(mask, "token-mean", weights), 1.0)

            zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32),
                                 jax.eval_shape(self._micro_grads, params, batch, 1.0, 1.0))

            def contribution(part: TrainBatch):
                part_mask, part_weights = part.response_mask, part.row_weights
                agg_weight = aggregation_count(part_mask, cfg.aggregation, part_weights) / agg_total
                token_weight = aggregation_count(part_mask, "token-mean", part_weights) / token_total
                grads, metrics = self._micro_grads(params, part, agg_weight, token_weight)
                return jax.tree.map(lambda x: x.astype(jnp.float32), (grads, metrics))

            def body(acc, part: TrainBatch):
                # A micro-batch of padding rows only (the padded tail of a short mini-batch) has weight
                # 0 and adds exactly zero: it is skipped, not run through the model.
                add = jax.lax.cond(part.response_mask.any(), contribution, lambda _: zeros, part)
                return jax.tree.map(jnp.add, acc, add), None

            (grads, metrics), _ = jax.lax.scan(body, zeros, split_micro_batches(batch, micro))
            grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, self.trainable(params)[0])
        metrics = dict(metrics, response_tokens=aggregation_count(batch.response_mask, "token-mean",
                                                                  batch.row_weights))
        return grads, metrics

    def _micro_grads(self, params: Any, batch: TrainBatch, agg_weight: jax.Array, token_weight: jax.Array):
        """Gradients of ``agg_weight`` x the loss of ``batch`` and its metrics, each weighted like its
        aggregation (``agg_weight`` for loss terms, ``token_weight`` for token-mean diagnostics)."""
        cfg = self.config
        mask = batch.response_mask
        trainable, frozen = self.trainable(params)

        def loss_fn(trainable):
            logp, entropy = self._token_logprobs(self._join(trainable, frozen), batch)
            # No old log-probs: the state the rows are scored with is the one they were recomputed for
            # (the iteration's single update), so log pi_old is this forward's value, held constant.
            old = jax.lax.stop_gradient(logp) if batch.old_logprobs is None else batch.old_logprobs
            weights = batch.row_weights
            pg_loss, pg_metrics = losses.ppo_loss(
                logp, old, batch.advantages, mask,
                clip_eps=cfg.clip_eps, dual_clip=cfg.dual_clip, agg_mode=cfg.aggregation, row_weights=weights,
            )
            entropy_term = losses.aggregate(entropy, mask, cfg.aggregation, weights)
            loss = pg_loss - cfg.entropy_coef * entropy_term
            kl_term = jnp.float32(0.0)
            if cfg.kl_coef > 0:
                kl = losses.kl_penalty(logp, batch.ref_logprobs, cfg.kl_kind)
                kl_term = losses.aggregate(kl, mask, cfg.aggregation, weights)
                loss = loss + cfg.kl_coef * kl_term
            metrics = {
                "loss": agg_weight * loss,
                "policy_loss": agg_weight * pg_loss,
                "clip_fraction": token_weight * pg_metrics["clip_fraction"],
                "dual_clip_fraction": token_weight * pg_metrics["dual_clip_fraction"],
                "approx_kl": token_weight * pg_metrics["approx_kl"],
                "entropy": agg_weight * entropy_term,
                "kl_loss": agg_weight * kl_term,
            }
            return agg_weight * loss, metrics

        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable)
        return grads, metrics


_SHARED: dict[tuple[Any, ...], TrainStep] = {}


def shared_train_step(graphdef: Any, optimizer: optax.GradientTransformation, schedule: optax.Schedule,
                      config: StepConfig, mesh: Mesh) -> TrainStep:
    """The process's ``TrainStep`` for these arguments (built on first use): runs, evaluations and tests
    with the same model graph, optimizer, step config and mesh share its compiled programs. The
    optimizer and schedule are matched by identity (``make_optimizer`` and ``learning_rate_schedule``
    return one object per setting), the rest by value."""
    key = (graphdef, optimizer, schedule, config, mesh)
    if key not in _SHARED:
        _SHARED[key] = TrainStep(graphdef, optimizer, schedule, config, mesh)
    return _SHARED[key]


def aggregation_count(mask: jax.Array, mode: str, row_weights: jax.Array | None = None) -> jax.Array:
    """The denominator of ``losses.aggregate(..., mode, row_weights)`` over these rows, float32: response
    tokens (token-mean) or rows with at least one response token (the seq-mean modes), each row counted
    ``row_weights`` times."""
    mask = mask.astype(jnp.float32)
    weights = jnp.ones(mask.shape[:1]) if row_weights is None else row_weights.astype(jnp.float32)
    if mode == "token-mean":
        return (mask.sum(axis=-1) * weights).sum()
    return ((mask.sum(axis=-1) > 0).astype(jnp.float32) * weights).sum()


def split_micro_batches(batch: TrainBatch, micro_rows: int) -> TrainBatch:
    """``[R, ...]`` -> ``[R / micro_rows, micro_rows, ...]``; micro-batch ``j`` holds rows ``j, j + n,
    j + 2n, ...`` (n micro-batches). Strided, so with rows split contiguously over the mesh every
    micro-batch keeps ``micro_rows / devices`` rows on each device and the split moves no data."""

    def split(x: jax.Array) -> jax.Array:
        n = x.shape[0] // micro_rows
        return jnp.moveaxis(x.reshape((micro_rows, n) + x.shape[1:]), 1, 0)

    return jax.tree.map(split, batch)


def fill_micro_batches(index: np.ndarray, micro_rows: int) -> np.ndarray:
    """The rows ``index`` of a mini-batch (``-1``: padding) reordered so that ``split_micro_batches``
    puts the real rows into the fewest micro-batches: the k-th real row goes to micro-batch
    ``k // micro_rows``, so the padding-only micro-batches at the end are skipped rather than each
    micro-batch running one real row beside padding. Row order is free: the loss and the recompute
    take each row by its index."""
    index = np.asarray(index)
    rows = len(index)
    if micro_rows <= 0 or micro_rows >= rows or rows % micro_rows:
        return index
    n = rows // micro_rows
    ordered = np.concatenate([index[index >= 0], index[index < 0]])
    out = np.empty_like(index)
    k = np.arange(rows)
    out[(k % micro_rows) * n + k // micro_rows] = ordered
    return out


def merge_micro_batches(parts: jax.Array) -> jax.Array:
    """The inverse of ``split_micro_batches`` for one array: ``[n, micro_rows, ...]`` -> ``[R, ...]``."""
    n, micro = parts.shape[:2]
    return jnp.moveaxis(parts, 0, 1).reshape((n * micro,) + parts.shape[2:])


_copy_program = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))


def _copy(tree: Any) -> Any:
    """A copy of ``tree`` in buffers of its own, on the same shardings. ``device_put`` copies without a
    program but only arrays this process holds entirely; an array spread over several processes (a
    multi-host mesh) is copied by a program, which keeps its sharding."""
    if all(getattr(x, "is_fully_addressable", True) for x in jax.tree.leaves(tree)):
        return jax.device_put(tree, may_alias=False)
    return _copy_program(tree)
