"""Attention of the decoder: one function, interchangeable implementations chosen by config and platform.

Self-attention over the T tokens of a call (training, the log-prob recompute, prefill) takes

    queries [B,T,H,D], keys and values [B,T,Hkv,D] (H a multiple of Hkv: grouped-query attention),
    segment_ids int32 [B,T] (0 = padding), causal flag, optional sliding window

and never a dense [B,T,S] mask: query t sees key s when both carry the same non-zero segment id,
s <= t (causal) and t - s < window (sliding window). Padding queries see nothing; their outputs are
finite garbage that callers ignore. Implementations:

* ``dense``: the reference. Materialises float32 scores [B,H,T,T].
* ``prefix``: dense per block of 128 queries over only the key prefix the block can see (causal), so
  the upper triangle of blocks is never computed; the fast path for short rows on CPU.
* ``blockwise``: online softmax over key blocks inside a loop over query blocks, with a custom VJP that
  recomputes the probabilities block by block from the saved log-sum-exp (the flash-attention recipe),
  so forward and backward memory grow linearly in T. Causal blocks above the diagonal are skipped.
* ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")`` (GPU, bfloat16 / float16). cuDNN
  takes per-row lengths, not segment ids: every row must hold one contiguous run of real tokens (left
  or right padding, as every batch of this project does), which is shifted to the front for the call.
* ``splash``: the Pallas splash-attention kernel of ``jax.experimental.pallas.ops.tpu`` (TPU), with
  native segment ids, run per row under ``vmap`` and, with a mesh of several devices in context, always
  under ``shard_map`` (a Pallas kernel is opaque to the partitioner): heads over ``tensor``, rows over
  the other axes, padded with all-padding rows when they do not divide them (a 1-row micro-batch on 4
  chips).

``auto`` picks cuDNN on a GPU of compute capability 8.0 or later (not a T4) in half precision, splash on
a TPU when T is a multiple of its block, and otherwise dense up to ``dense_max_len`` tokens, blockwise
beyond. The platform is that of the mesh in context (``current_platform``), so a program traced for a
compile-only TPU or GPU topology (``experiments.plan --compiler target``) picks what that device runs;
a compile-only GPU has no compute capability to ask, so its compiler's caller names it
(``gpu_target``).

Decode over a KV cache (``cached_attention``) takes per-row lengths: row b's valid slots are
``kv_start[b] .. cache_index + t`` for new token t, so no mask array is ever built or passed around.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

IMPLEMENTATIONS = ("auto", "dense", "blockwise", "cudnn", "splash", "prefix")
_MASKED = -1e30  # finite, so a fully masked query row stays NaN-free
_HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


# ---------------------------------------------------------------------------- choice
_GPU_TARGET: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar(
    "gpu_target", default=None)
CUDNN_MIN_CAPABILITY = (8, 0)
"""cuDNN's flash attention needs Ampere or later (a T4 is 7.5)."""


def current_platform() -> str:
    """The platform the program being traced is for: that of the mesh in context (a compile-only TPU or
    GPU topology's too), else JAX's default backend."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)
    return device.platform if device is not None else jax.default_backend()


@contextlib.contextmanager
def gpu_target(compute_capability: tuple[int, int]) -> Iterator[None]:
    """Trace for a GPU of ``compute_capability`` (a compile-only target has no device to ask)."""
    token = _GPU_TARGET.set(tuple(compute_capability))
    try:
        yield
    finally:
        _GPU_TARGET.reset(token)


def gpu_compute_capability() -> tuple[int, int] | None:
    """(major, minor) of the GPU programs are traced for: ``gpu_target``'s, else the first GPU's; None
    when neither is known."""
    named = _GPU_TARGET.get()
    if named is not None:
        return named
    try:
        device = jax.devices("gpu")[0]
    except RuntimeError:
        return None
    capability = getattr(device, "compute_capability", None)
    return None if capability is None else tuple(int(x) for x in str(capability).split(".")[:2])


def choose_implementation(
    requested: str, seq_len: int, dtype, *, dense_max_len: int, platform: str | None = None,
    compute_capability: tuple[int, int] | None = None,
) -> str:
    """The implementation that runs for ``requested`` on ``platform`` (default: ``current_platform``) and,
    on a GPU, ``compute_capability`` (default: ``gpu_compute_capability``; unknown counts as recent).

    An explicit request the platform cannot honour is one clear ``ValueError``, never a silent switch.
    """
    platform = platform or current_platform()
    half = jnp.dtype(dtype) in _HALF
    gpu = platform in ("gpu", "cuda")
    capability = (compute_capability or gpu_compute_capability()) if gpu else None
    old_gpu = capability is not None and tuple(capability) < CUDNN_MIN_CAPABILITY
    if requested == "auto":
        if gpu and half and not old_gpu:
            return "cudnn"
        if platform == "tpu" and seq_len % _SPLASH_BLOCK == 0:
            return "splash"
        return "dense" if seq_len <= dense_max_len else "blockwise"
    if requested == "cudnn":
        if platform not in ("gpu", "cuda"):
            raise ValueError(f"attention='cudnn' needs an NVIDIA GPU, the platform is {platform!r}; "
                             "use 'auto', 'blockwise' or 'dense'")
        if not half:
            raise ValueError("attention='cudnn' needs bfloat16 or float16 activations, "
                             f"got {jnp.dtype(dtype).name}")
        if old_gpu:
            raise ValueError(f"attention='cudnn' needs a GPU of compute capability 8.0 or later, this one is "
                             f"{capability[0]}.{capability[1]}; use 'auto', 'blockwise' or 'dense'")
    if requested == "splash" and platform != "tpu":
        raise ValueError(f"attention='splash' needs a TPU, the platform is {platform!r}; "
                         "use 'auto', 'blockwise' or 'dense'")
    if requested not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attention implementation {requested!r}; "
                         f"known: {', '.join(IMPLEMENTATIONS)}")
    return requested


# ---------------------------------------------------------------------------- the one entry point
def self_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    *,
    implementation: str = "dense",
    causal: bool = True,
    sliding_window: int | None = None,
    block_size: int = 512,
) -> jax.Array:
    """Attention of T queries over the same T keys -> [B,T,H,D] in q's dtype (see the module docstring).

    ``implementation`` is a concrete one (``choose_implementation`` resolves ``auto``).
    """
    segment_ids = jnp.asarray(segment_ids).astype(jnp.int32)
    if implementation == "dense":
        return dense_attention(q, k, v, segment_ids, causal=causal, sliding_window=sliding_window)
    if implementation == "prefix":
        return prefix_attention(q, k, v, segment_ids, causal=causal, sliding_window=sliding_window)
    if implementation == "blockwise":
        return blockwise_attention(q, k, v, segment_ids, causal=causal, sliding_window=sliding_window,
                                   block_size=block_size)
    if implementation == "cudnn":
        return cudnn_attention(q, k, v, segment_ids, causal=causal, sliding_window=sliding_window)
    if implementation == "splash":
        return splash_attention(q, k, v, segment_ids, causal=causal, sliding_window=sliding_window)
    raise ValueError(f"unknown attention implementation {implementation!r}; "
                     f"known: {', '.join(i for i in IMPLEMENTATIONS if i != 'auto')}")


def _visible(q_idx, k_idx, q_seg, k_seg, causal: bool, sliding_window: int | None):
    """The mask predicate every implementation shares, broadcast over whatever index shapes it gets."""
    ok = (q_seg == k_seg) & (k_seg != 0)
    if causal:
        ok = ok & (k_idx <= q_idx)
    if sliding_window is not None:
        ok = ok & (q_idx - k_idx < sliding_window)
    return ok


def _grouped(q: jax.Array, kv_heads: int) -> jax.Array:
    """[B,T,H,D] -> [B,Hkv,G,T,D]: the G query heads sharing one kv head side by side."""
    b, t, h, d = q.shape
    return q.reshape(b, t, kv_heads, h // kv_heads, d).transpose(0, 2, 3, 1, 4)


def _ungrouped(o: jax.Array) -> jax.Array:
    """[B,Hkv,G,T,D] -> [B,T,H,D]."""
    b, kv, g, t, d = o.shape
    return o.transpose(0, 3, 1, 2, 4).reshape(b, t, kv * g, d)


# ---------------------------------------------------------------------------- dense (reference)
def dense_attention(q, k, v, segment_ids, *, causal=True, sliding_window=None):
    """Full float32 scores [B,Hkv,G,T,T]; the reference every other implementation is tested against."""
    t, kv_heads, dim = k.shape[1], k.shape[2], q.shape[-1]
    idx = jnp.arange(t)
    mask = _visible(idx[:, None], idx[None, :], segment_ids[:, :, None], segment_ids[:, None, :],
                    causal, sliding_window)  # [B,T,T]
    qg = _grouped(q, kv_heads)
    scores = jnp.einsum("bkgtd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) / math.sqrt(dim)
    scores = jnp.where(mask[:, None, None], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    out = jnp.einsum("bkgts,bskd->bkgtd", probs, v, preferred_element_type=jnp.float32)
    return _ungrouped(out).astype(q.dtype)


# ---------------------------------------------------------------------------- prefix (dense per query block)
PREFIX_BLOCK = 128


def prefix_attention(q, k, v, segment_ids, *, causal=True, sliding_window=None, block_size=PREFIX_BLOCK):
    """``dense_attention`` per block of ``block_size`` queries over only the keys that block can see.

    A causal query block never sees a later key, so each block's scores, mask and softmax are
    dense's restricted to its key prefix (and, with a sliding window, to the window's start): the same
    numbers with the upper triangle of blocks skipped, (n + 1) / 2n of dense's work for n blocks. The
    blocks are static slices unrolled in the program and differentiated by autodiff, so short rows
    keep dense's fused kernels without the loops of ``blockwise``; memory is at most dense's.
    Non-causal attention has no prefix to skip and is dense.
    """
    t, kv_heads, dim = k.shape[1], k.shape[2], q.shape[-1]
    if not causal or t <= block_size:
        return dense_attention(q, k, v, segment_ids, causal=causal, sliding_window=sliding_window)
    qg = _grouped(q, kv_heads)  # [B,Hkv,G,T,D]
    outs = []
    for q0 in range(0, t, block_size):
        q1 = min(q0 + block_size, t)
        k0 = 0 if sliding_window is None else max(0, q0 - sliding_window + 1)
        q_idx, k_idx = jnp.arange(q0, q1), jnp.arange(k0, q1)
        mask = _visible(q_idx[:, None], k_idx[None, :], segment_ids[:, q0:q1, None],
                        segment_ids[:, None, k0:q1], causal, sliding_window)  # [B,bq,bk]
        scores = jnp.einsum("bkgtd,bskd->bkgts", qg[:, :, :, q0:q1], k[:, k0:q1],
                            preferred_element_type=jnp.float32) / math.sqrt(dim)
        scores = jnp.where(mask[:, None, None], scores, _MASKED)
        probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
        outs.append(jnp.einsum("bkgts,bskd->bkgtd", probs, v[:, k0:q1], preferred_element_type=jnp.float32))
    return _ungrouped(jnp.concatenate(outs, axis=3)).astype(q.dtype)


# ---------------------------------------------------------------------------- blockwise (online softmax)
def blockwise_attention(q, k, v, segment_ids, *, causal=True, sliding_window=None, block_size=512):
    """Flash-style attention in plain JAX; memory O(T * block) per (row, head) in forward and backward."""
    b, t, h, d = q.shape
    kv_heads = k.shape[2]
    block = min(block_size, _round_up(t, 8))
    padded = _round_up(t, block)
    pad = padded - t
    if pad:  # padding keys and queries get segment 0: nobody sees them and their outputs are dropped
        q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
        segment_ids = jnp.pad(segment_ids, ((0, 0), (0, pad)))
    qg = _grouped(q, kv_heads)  # [B,Hkv,G,T,D]
    kt = k.transpose(0, 2, 1, 3)  # [B,Hkv,T,D]
    vt = v.transpose(0, 2, 1, 3)
    out = _flash(qg, kt, vt, segment_ids, block, causal, sliding_window)
    return _ungrouped(out)[:, :t]


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _key_block_range(i, block: int, blocks: int, causal: bool, sliding_window: int | None):
    """Key blocks [first, last) that query block i can see (the others are skipped, not masked)."""
    last = i + 1 if causal else blocks
    first = 0
    if sliding_window is not None and causal:
        first = jnp.maximum(0, (i * block - sliding_window + 1) // block)
    return first, last


def _query_block_range(j, block: int, blocks: int, causal: bool, sliding_window: int | None):
    """Query blocks [first, last) that can see key block j."""
    first = j if causal else 0
    last = blocks
    if sliding_window is not None and causal:
        last = jnp.minimum(blocks, ((j + 1) * block + sliding_window - 2) // block + 1)
    return first, last


def _block_scores(qb, kb, seg_q, seg_k, q0, k0, scale, causal, sliding_window):
    """Scaled float32 scores [B,Hkv,G,bq,bk] of one block pair and its visibility mask."""
    s = jnp.einsum("bkgtd,bksd->bkgts", qb, kb, preferred_element_type=jnp.float32) * scale
    q_idx = q0 + jnp.arange(qb.shape[3])
    k_idx = k0 + jnp.arange(kb.shape[2])
    mask = _visible(q_idx[:, None], k_idx[None, :], seg_q[:, :, None], seg_k[:, None, :],
                    causal, sliding_window)
    return s, mask[:, None, None]


def _slice(x, start, size, axis):
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _flash(q, k, v, seg, block, causal, sliding_window):
    return _flash_forward(q, k, v, seg, block, causal, sliding_window)[0]


def _flash_forward(q, k, v, seg, block, causal, sliding_window):
    b, kv_heads, g, t, d = q.shape
    blocks = t // block
    scale = 1.0 / math.sqrt(d)

    def one_query_block(i):
        qb = _slice(q, i * block, block, 3)
        seg_q = _slice(seg, i * block, block, 1)

        def step(j, carry):
            m, denom, acc = carry
            kb, vb = _slice(k, j * block, block, 2), _slice(v, j * block, block, 2)
            s, mask = _block_scores(qb, kb, seg_q, _slice(seg, j * block, block, 1), i * block, j * block,
                                    scale, causal, sliding_window)
            m_new = jnp.maximum(m, jnp.max(jnp.where(mask, s, _MASKED), axis=-1))
            p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
            correction = jnp.exp(m - m_new)
            denom = denom * correction + p.sum(axis=-1)
            pv = jnp.einsum("bkgts,bksd->bkgtd", p.astype(v.dtype), vb, preferred_element_type=jnp.float32)
            return m_new, denom, acc * correction[..., None] + pv

        shape = (b, kv_heads, g, block)
        init = (jnp.full(shape, _MASKED, jnp.float32), jnp.zeros(shape, jnp.float32),
                jnp.zeros((*shape, d), jnp.float32))
        first, last = _key_block_range(i, block, blocks, causal, sliding_window)
        m, denom, acc = jax.lax.fori_loop(first, last, step, init)
        seen = denom > 0
        out = acc / jnp.where(seen, denom, 1.0)[..., None]
        # log-sum-exp of the visible scores; +large for rows that see nothing so that the backward
        # pass's exp(s - lse) is exactly 0 there.
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, denom, 1.0)), -_MASKED)
        return out.astype(q.dtype), lse

    outs, lses = jax.lax.map(one_query_block, jnp.arange(blocks))  # [nq,B,Hkv,G,bq,(D)]
    out = jnp.moveaxis(outs, 0, 3).reshape(b, kv_heads, g, t, d)
    lse = jnp.moveaxis(lses, 0, 3).reshape(b, kv_heads, g, t)
    return out, lse


def _flash_fwd(q, k, v, seg, block, causal, sliding_window):
    out, lse = _flash_forward(q, k, v, seg, block, causal, sliding_window)
    return out, (q, k, v, seg, out, lse)


def _flash_bwd(block, causal, sliding_window, residuals, d_out):
    q, k, v, seg, out, lse = residuals
    b, kv_heads, g, t, d = q.shape
    blocks = t // block
    scale = 1.0 / math.sqrt(d)
    d_out = d_out.astype(jnp.float32)
    delta = jnp.sum(d_out * out.astype(jnp.float32), axis=-1)  # [B,Hkv,G,T]

    def probs_and_ds(i, j):
        """p and dS of block pair (query block i, key block j), both [B,Hkv,G,bq,bk] float32."""
        qb = _slice(q, i * block, block, 3)
        kb, vb = _slice(k, j * block, block, 2), _slice(v, j * block, block, 2)
        s, mask = _block_scores(qb, kb, _slice(seg, i * block, block, 1), _slice(seg, j * block, block, 1),
                                i * block, j * block, scale, causal, sliding_window)
        p = jnp.where(mask, jnp.exp(s - _slice(lse, i * block, block, 3)[..., None]), 0.0)
        dob = _slice(d_out, i * block, block, 3)
        dp = jnp.einsum("bkgtd,bksd->bkgts", dob, vb.astype(jnp.float32))
        ds = p * (dp - _slice(delta, i * block, block, 3)[..., None])
        return p, ds, qb, kb, dob

    def dq_block(i):
        def step(j, acc):
            _, ds, _, kb, _ = probs_and_ds(i, j)
            return acc + jnp.einsum("bkgts,bksd->bkgtd", ds, kb.astype(jnp.float32)) * scale

        first, last = _key_block_range(i, block, blocks, causal, sliding_window)
        return jax.lax.fori_loop(first, last, step, jnp.zeros((b, kv_heads, g, block, d), jnp.float32))

    def dkv_block(j):
        def step(i, carry):
            dk, dv = carry
            p, ds, qb, _, dob = probs_and_ds(i, j)
            dv = dv + jnp.einsum("bkgts,bkgtd->bksd", p, dob)
            dk = dk + jnp.einsum("bkgts,bkgtd->bksd", ds, qb.astype(jnp.float32)) * scale
            return dk, dv

        first, last = _query_block_range(j, block, blocks, causal, sliding_window)
        zeros = jnp.zeros((b, kv_heads, block, d), jnp.float32)
        return jax.lax.fori_loop(first, last, step, (zeros, zeros))

    dq = jnp.moveaxis(jax.lax.map(dq_block, jnp.arange(blocks)), 0, 3).reshape(q.shape)
    dk, dv = jax.lax.map(dkv_block, jnp.arange(blocks))
    dk = jnp.moveaxis(dk, 0, 2).reshape(k.shape)
    dv = jnp.moveaxis(dv, 0, 2).reshape(v.shape)
    d_seg = np.zeros(seg.shape, jax.dtypes.float0)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), d_seg


_flash.defvjp(_flash_fwd, _flash_bwd)


# ---------------------------------------------------------------------------- cuDNN (GPU)
def _contiguous_span(segment_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(start, length) int32 [B] of each row's run of real tokens (one run per row assumed)."""
    real = segment_ids != 0
    length = real.sum(axis=-1).astype(jnp.int32)
    start = jnp.where(length > 0, jnp.argmax(real, axis=-1), 0).astype(jnp.int32)
    return start, length


def _roll_rows(x: jax.Array, shift: jax.Array) -> jax.Array:
    """Row b of x [B,T,...] rotated left by shift[b] along T."""
    t = x.shape[1]
    index = (jnp.arange(t)[None, :] + shift[:, None]) % t
    index = index.reshape(index.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, index, axis=1)


def cudnn_attention(q, k, v, segment_ids, *, causal=True, sliding_window=None):
    """cuDNN flash attention with per-row lengths: each row's real tokens moved to the front, then back."""
    start, length = _contiguous_span(segment_ids)
    q, k, v = (_roll_rows(x, start) for x in (q, k, v))
    window = None if sliding_window is None else (sliding_window - 1, 0)
    out = jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, query_seq_lengths=length, key_value_seq_lengths=length,
        local_window_size=window, implementation="cudnn",
    )
    return _roll_rows(out, (q.shape[1] - start) % q.shape[1])


# ---------------------------------------------------------------------------- splash (TPU)
_SPLASH_BLOCK = 128


def splash_attention(q, k, v, segment_ids, *, causal=True, sliding_window=None, interpret: bool = False):
    """The Pallas splash kernel per row (``vmap``), heads-first layout; ``interpret`` runs it off-TPU."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash  # TPU-only: imported on use

    b, t, h, d = q.shape
    if t % _SPLASH_BLOCK:
        raise ValueError(f"splash attention needs a length that is a multiple of {_SPLASH_BLOCK}, got {t}")
    mesh = jax.sharding.get_abstract_mesh()
    heads_axis, row_axes = _splash_axes(mesh, h, k.shape[2])
    local_heads = h // (mesh.shape[heads_axis] if heads_axis else 1)
    shape = (t, t)
    if sliding_window is not None:
        head_mask = splash.LocalMask(shape, (sliding_window - 1, 0 if causal else None), offset=0)
    elif causal:
        head_mask = splash.CausalMask(shape)
    else:
        head_mask = splash.FullMask(shape)
    block = next(size for size in (512, 256, _SPLASH_BLOCK) if t % size == 0)
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                              block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block,
                              block_kv_dq=block)
    kernel = splash.make_splash_mha(splash.MultiHeadMask([head_mask] * local_heads), block_sizes=sizes,
                                    head_shards=1, q_seq_shards=1, interpret=interpret)
    q = (q.astype(jnp.float32) / math.sqrt(d)).astype(q.dtype)  # the kernel does not scale

    def one_row(qr, kr, vr, seg):
        out = kernel(qr.transpose(1, 0, 2), kr.transpose(1, 0, 2), vr.transpose(1, 0, 2),
                     segment_ids=splash.SegmentIds(q=seg, kv=seg))
        return out.transpose(1, 0, 2)

    # Padding tokens keep segment 0 and see each other, so no query row is empty (the kernel needs that);
    # real tokens never see them.
    rows = jax.vmap(one_row)
    if mesh.empty or mesh.size == 1:
        return rows(q, k, v, segment_ids)
    # A Pallas kernel is opaque to the partitioner ("Mosaic kernels cannot be automatically partitioned"):
    # it runs under shard_map whatever the rows, on each device's own rows and heads. Rows that do not
    # divide the devices are padded with all-padding rows (segment 0), computed beside the real ones.
    ways = math.prod(mesh.shape[a] for a in row_axes)
    pad = -b % ways
    if pad:
        q, k, v = (jnp.pad(x, ((0, pad), (0, 0), (0, 0), (0, 0))) for x in (q, k, v))
        segment_ids = jnp.pad(segment_ids, ((0, pad), (0, 0)))
    lead = row_axes or None
    spec = jax.sharding.PartitionSpec(lead, None, heads_axis, None)
    rows = jax.shard_map(rows, in_specs=(spec, spec, spec, jax.sharding.PartitionSpec(lead, None)),
                         out_specs=spec, check_vma=False)
    return rows(q, k, v, segment_ids)[:b]


def _splash_axes(mesh, heads: int, kv_heads: int) -> tuple[str | None, tuple[str, ...]]:
    """(the mesh axis the heads split over, the axes the rows split over) for splash under ``mesh``: heads
    over ``tensor`` when it divides both head counts (they arrive split so), rows over every other axis
    of more than one device, so that no device computes another's share."""
    if mesh.empty:
        return None, ()
    tensor = mesh.shape.get("tensor", 1)
    heads_axis = "tensor" if tensor > 1 and heads % tensor == 0 and kv_heads % tensor == 0 else None
    return heads_axis, tuple(a for a in mesh.axis_names if a != heads_axis and mesh.shape[a] > 1)


# ---------------------------------------------------------------------------- decode over a KV cache
def cached_attention(q, cache_k, cache_v, kv_start, cache_index):
    """New queries q [B,T,H,D] (already written at slots cache_index..) over the cache -> [B,T,H,D].

    Keys [B,Hkv,D,S] and values [B,Hkv,S,D] are the cache's head-major layout (no transposed operand).
    New token t of row b sees slots ``kv_start[b] <= s <= cache_index[b] + t`` (``cache_index`` a scalar
    or int32[B]): per-row lengths, from
    which the mask is recomputed by comparison inside the fused score computation.
    """
    b, t, h, d = q.shape
    kv_heads, s = cache_k.shape[1], cache_k.shape[-1]
    groups = h // kv_heads
    qg = _grouped(q, kv_heads).reshape(b, kv_heads, groups * t, d)
    scores = jnp.einsum("bkmd,bkds->bkms", qg, cache_k.astype(q.dtype), preferred_element_type=jnp.float32)
    scores = scores.reshape(b, kv_heads, groups, t, s) / math.sqrt(d)
    slots = jnp.arange(s)
    index = jnp.broadcast_to(jnp.asarray(cache_index, jnp.int32), (b,))  # a scalar, or one per row
    last = index[:, None] + jnp.arange(t)  # [B,T]
    mask = (slots[None, None, :] >= jnp.asarray(kv_start, jnp.int32)[:, None, None]) & (
        slots[None, None, :] <= last[:, :, None])  # [B,T,S]
    scores = jnp.where(mask[:, None, None], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype).reshape(b, kv_heads, groups * t, s)
    out = jnp.einsum("bkms,bksd->bkmd", probs, cache_v.astype(q.dtype), preferred_element_type=jnp.float32)
    return _ungrouped(out.reshape(b, kv_heads, groups, t, d)).astype(q.dtype)
