"""Blockwise attention: exact softmax attention without forming the ``(Q, K)`` weights.

The online softmax of Milakov & Gimelshein (2018), used by Rabe & Staats ("Self-attention
does not need O(n^2) memory", 2021) and FlashAttention (Dao et al., 2022). Queries are taken a
block at a time; for each block the keys are visited a block at a time, keeping per query row
the running maximum ``m``, the running sum ``l`` of ``exp(s - m)`` and the running output
``acc = sum exp(s - m) v``. When a new key block raises the maximum to ``m'``, the old ``l``
and ``acc`` are rescaled by ``exp(m - m')``. At the end ``out = acc / l``, which is the
softmax-weighted sum of the values, exactly as on the direct path.

Hidden scores are selected away, as on the direct path, so their exponential is exactly 0; a
row with no visible key keeps ``l = 0`` and ``acc = 0`` and comes out as zeros, its
log-sum-exp ``m + log l`` as ``-inf``. float16 and bfloat16 are scored and pooled in float32.
Extra memory is a few tiles of ``(B, H, q_block, k_block)`` plus the running state
``(B, H, q_block, Dv)``, whatever the sequence length.

Under a tape (TensorFlow's, eager or in ``tf.function``, and MXNet's) the ops'
``recompute_blocks`` keeps the path's inputs only and recomputes one query block at a time in
the backward pass (Rabe & Staats' checkpointing; see :class:`~attention_core.ops.RecomputeOps`),
so training holds one block's tiles, not every tile. JAX's loop ops recompute their bodies
the same way under ``jax.grad`` (``jax.checkpoint``).

Shape legend: B batch, H heads, Q queries, K keys, D depth, Dv value depth.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from attention_core.kernels import Capabilities, Request, Result
from attention_core.kernels.rows import hidden, lse_out, narrowed, sink_column, widened
from attention_core.masks import FILL_VALUE
from attention_core.modifiers import Alibi, AllMasks, Softcap
from attention_core.ops import Array, Ops
from attention_core.scores import pooled, products

#: Largest number of scores in one tile, ``B * H * q_block * k_block``: 2**21 floats is 8 MiB
#: in float32, small enough to stay near the caches and to keep peak memory flat in n.
TILE_SCORES = 2**21

#: Scores in the tiles of one query block's recomputed backward (:func:`recompute_sizes`). Its
#: backward holds about six arrays of that size at once (scores, weights and their gradients),
#: so it gets half the forward's budget: at (1, 4, 16384, 64) the whole budget took MXNet's
#: step from 250 to 275 MiB of extra memory.
RECOMPUTE_SCORES = TILE_SCORES // 2

#: Keys per block when the tile budget allows; a multiple of the SIMD widths of every backend.
KEY_BLOCK = 1024

#: Fewest queries per block: below this the matrix products get too thin to be efficient.
MIN_QUERY_BLOCK = 16

#: Scores ``B * H * Q * K`` from which the automatic choice stops forming the weights (16 MiB
#: of float32): below it the direct path's few large kernels are quickest, above it the
#: blockwise path is as fast or faster and its memory stays flat (see docs/speed.md).
MIN_SCORES = 2**22

Carry = tuple[Array, Array, Array]


def block_sizes(batch_heads: int, num_queries: int, num_keys: int,
                scores: int | None = None) -> tuple[int, int]:
    """Chooses ``(q_block, k_block)`` so that one tile holds at most ``scores`` scores.

    Args:
        batch_heads: ``B * H``.
        num_queries: Q.
        num_keys: K.
        scores: The budget of a tile; None for :data:`TILE_SCORES`.

    Returns:
        Block sizes, each at least 1 and at most the length it divides.
    """
    k_block = max(1, min(num_keys, KEY_BLOCK))
    q_block = (TILE_SCORES if scores is None else scores) // max(1, batch_heads * k_block)
    return max(1, min(num_queries, max(q_block, MIN_QUERY_BLOCK))), k_block


def recompute_sizes(batch_heads: int, num_queries: int, num_keys: int) -> tuple[int, int]:
    """``(q_block, k_block)`` of a recomputed backward (``ops.recompute_blocks``).

    The backward of one query block records every tile of it, ``B * H * q_block * K`` scores,
    so ``q_block`` takes the budget :data:`RECOMPUTE_SCORES` over all the keys, but no fewer than
    :data:`MIN_QUERY_BLOCK` queries: thinner blocks read all the keys and values once per few
    rows, and the pass is bound by that traffic and by per-op overhead. The keys are then cut
    into as few tiles as the budget allows (all of them when the block's row fits), since each
    tile costs the backend a handful of ops.

    Args:
        batch_heads: ``B * H``.
        num_queries: Q.
        num_keys: K.

    Returns:
        Block sizes, each at least 1 and at most the length it divides.
    """
    q_block = max(MIN_QUERY_BLOCK, RECOMPUTE_SCORES // max(1, batch_heads * num_keys))
    q_block = max(1, min(num_queries, q_block))
    k_block = max(1, min(num_keys, RECOMPUTE_SCORES // max(1, batch_heads * q_block)))
    return q_block, k_block


#: Its blocks are cut in Python: Q and K must be known when the call is traced.
CAPABILITIES = Capabilities(lse=True, sinks=True, exact_non_finite=True, run_time_lengths=False,
                            ragged=True)


def prefers(ops: Ops, request: Request) -> bool:
    """From :data:`MIN_SCORES` scores on, with Q and K known now."""
    return enough_scores(request, MIN_SCORES)


def enough_scores(request: Request, least: float) -> bool:
    """Whether Q and K are known now and the call has at least ``least`` scores."""
    shape = request.call.shape
    return all(isinstance(d, int) for d in shape) and least <= math.prod(shape)


def blockwise(ops: Ops, q: Array, k: Array, v: Array, request: Request) -> Result:
    """The kernel: :func:`blockwise_attention` with the request's modifiers."""
    out, lse = blockwise_attention(ops, q, k, v, request)
    return Result(out, None, lse)


def blockwise_attention(
    ops: Ops,
    queries: Array,
    keys: Array,
    values: Array,
    request: Request,
    q_block: int | None = None,
    k_block: int | None = None,
) -> tuple[Array, Array | None]:
    """``softmax(queries @ keys^T) @ values`` over the visible keys, one tile of scores at a time.

    Key blocks that the mask modifiers hide from a whole query block are not visited (see
    :meth:`~attention_core.modifiers.MaskMod.span`): past the longest length, the causal
    edge, outside a window or a block's own segments, so that a window of w keys costs
    O(Q w), not O(Q K).

    Args:
        ops: The backend's ops.
        queries: ``(B, H, Q, D)``.
        keys: ``(B, Hkv, K, D)``; Hkv divides H (grouped-query heads).
        values: ``(B, Hkv, K, Dv)``.
        request: The call's modifiers, scale, dropout, sinks.
        q_block: Queries per block; chosen by :func:`block_sizes` when None.
        k_block: Keys per block; chosen by :func:`block_sizes` when None.

    Returns:
        ``(B, H, Q, Dv)`` in the inputs' dtype (rows with no visible key are zeros), and the
        rows' log-sum-exp ``(B, H, Q)`` when the request asks for it, else None.
    """
    B, H, Q, _ = ops.shape(queries)
    K = ops.shape(keys)[2]
    call, mask, scale = request.call, AllMasks(request.masks), request.scale
    batch_heads = math.prod([d if isinstance(d, int) else 1 for d in (B, H)])  # unknown: 1
    auto_q, auto_k = block_sizes(batch_heads, Q, K)
    q_block, k_block = q_block or auto_q, k_block or auto_k
    keys, values = widened(ops, keys), widened(ops, values)
    sinks = None if request.sinks is None else sink_column(ops, request.sinks)

    def part(x: Array | list[Array], k0: Any, kn: int) -> Array:
        """Keys or values ``k0 .. k0 + kn``, from the array or from a recomputation's blocks.

        A recomputation passes the keys and values as lists of key blocks of ``kn`` keys (the
        last may be shorter); ``k0`` is then a multiple of ``kn``.
        """
        if not isinstance(x, list):
            return ops.slice(x, 2, k0, kn)
        block = x[k0 // ops.shape(x[0])[2]]
        return block if ops.shape(block)[2] == kn else ops.slice(block, 2, 0, kn)

    def scores(q: Array, keys: Array | list[Array], q0: Any, qn: int, k0: Any, kn: int) -> Array:
        """The tile's scores, modified, with the hidden ones at ``-inf``."""
        s = products(ops, q, widened(ops, part(keys, k0, kn)))  # (B, H, qn, kn)
        tile = call.tile(q0, qn, k0, kn)
        for mod in request.scores:
            s = mod.apply(s, tile)
        return hidden(ops, s, mask.visible(tile))

    exp_diff = getattr(ops, "exp_diff", None) or (lambda x, y: ops.exp(x - y))
    constant = getattr(ops, "stop_gradient", None) or (lambda x: x)  # StopGradientOps

    def row_max(s: Array) -> Array:
        """The rows' largest scores, at least the dtype's lowest; no gradient flows through them.

        A row of ``-inf`` scores must not give ``m = -inf``, whose rescale ``exp(m - m_new)``
        would be NaN. The output does not depend on ``m`` (it cancels between ``acc`` and
        ``l``), so its gradient through ``m`` is zero.
        """
        m = ops.max(constant(s), -1)
        low = FILL_VALUE[ops.dtype_name(m)]  # the scores' (torch.autocast may choose it)
        return ops.where(m > low, m, low)  # a NaN row stays NaN through its weights

    def pool(p: Array, values: Array | list[Array], k0: Any, kn: int) -> Array:
        p = ops.dropout(p, request.dropout) if request.dropout > 0 else p
        return pooled(ops, p, widened(ops, part(values, k0, kn)))  # (B, H, qn, Dv)

    def span(q0: Any, qn: int, aligned: int | None) -> tuple[Any, int]:
        """``(first, count)`` of the keys the block visits; ``first`` a multiple of ``aligned``."""
        found = mask.span(call, q0, qn)
        if found is None:
            return 0, K
        first, count = found
        if aligned is None:
            return first, count
        if not isinstance(first, int):
            return 0, K
        return first - first % aligned, count + first % aligned

    def pooled_block(q: Array, keys: Array | list[Array], values: Array | list[Array], q0: Any,
                     qn: int, k_block: int = k_block) -> tuple[Array, Array]:
        """The block of queries ``q`` (from row ``q0``) pooled over the keys, and its lse."""
        q = widened(ops, q) * scale
        base, limit = span(q0, qn, k_block if isinstance(keys, list) else None)
        kn = min(k_block, limit)
        s = scores(q, keys, q0, qn, base, kn)  # the first key block starts the running state
        m = row_max(s)  # (B, H, qn, 1)
        p = exp_diff(s, m)  # exactly 0 where hidden
        start: Carry = (m, ops.sum(p, -1), pool(p, values, base, kn))

        def step(carry: Carry, k0: Any, kn: int) -> Carry:
            m, total, acc = carry
            s = scores(q, keys, q0, qn, k0, kn)
            m_new = ops.maximum(m, row_max(s))
            rescale = ops.exp(m - m_new)
            p = exp_diff(s, m_new)
            return m_new, total * rescale + ops.sum(p, -1), acc * rescale + pool(p, values, k0, kn)

        m, total, acc = _fold_blocks(ops, step, start, kn, limit, k_block, base)
        if sinks is not None:  # one more key, of score sink_h and value 0
            m_new = ops.maximum(m, sinks)
            rescale = ops.exp(m - m_new)
            m, total, acc = m_new, total * rescale + ops.exp(sinks - m_new), acc * rescale
        return acc / ops.where(total > 0, total, 1.0), m + ops.log(total)  # accumulation dtype

    def query_block(q0: Any, qn: int) -> Array:
        out, lse = pooled_block(ops.slice(queries, 2, q0, qn), keys, values, q0, qn)
        return ops.concatenate([out, lse], -1) if request.lse else narrow(out)

    def narrow(x: Array) -> Array:
        return narrowed(ops, x, request.dtype)

    # Recomputed in the backward pass, one query block at a time, where the ops can; not under
    # dropout, whose recomputation would draw another mask (every tile is then kept), nor where
    # arrays other than q, k, v may need gradients (see :func:`recomputable`).
    recompute = getattr(ops, "recompute_blocks", None)
    if recompute is not None and recomputable(request):
        size, key_size = recompute_sizes(batch_heads, Q, K)
        blocks = [(q0, min(size, Q - q0)) for q0 in range(0, Q, size)]

        def block(b: Any, q: Array, k: Array | list[Array], v: Array | list[Array]) -> Array:
            """Block ``b``'s output; a run-time ``b`` stands for a full block of ``size``."""
            q0, qn = blocks[b] if isinstance(b, int) else (b * size, size)
            return narrow(pooled_block(q, k, v, q0, qn, key_size)[0])

        # the masks, the block's place and the scale reach it by closure: they get no gradient
        out = recompute(block, blocks, key_size, queries, keys, values)
        if out is not None:
            return out, None

    both = _map_blocks(ops, query_block, Q, q_block, axis=2)
    if not request.lse:
        return both, None
    Dv = ops.shape(values)[3]
    lse = ops.slice(both, 3, Dv, 1)[:, :, :, 0]
    return narrow(ops.slice(both, 3, 0, Dv)), lse_out(ops, lse)


#: Score modifiers that hold no array a gradient could be asked of.
_CONSTANT_SCORES = (Softcap, Alibi)


def recomputable(request: Request) -> bool:
    """Whether ``ops.recompute_blocks`` gives every gradient the call has.

    It differentiates the queries, keys and values only: what reaches the blocks by closure
    gets none. So not with sinks, a score bias or a user's score function (which may hold a
    learned array), nor under dropout or when the log-sum-exp is asked for.
    """
    scores = (part for mod in request.scores for part in mod.parts())
    return (request.dropout == 0 and not request.lse and request.sinks is None
            and all(isinstance(part, _CONSTANT_SCORES) for part in scores))


def _fold_blocks(
    ops: Ops, step: Callable[[Carry, Any, int], Carry], carry: Carry, start: int, total: int,
    size: int, base: Any = 0,
) -> Carry:
    """Applies ``step(carry, k0, kn)`` to the key blocks from ``base + start`` to ``base + total``.

    ``base`` may be a run-time scalar. Full blocks run in the backend's loop (``ops.fold``)
    when it has one; the tail in Python.
    """
    full, tail = (total - start) // size, (total - start) % size  # (divmod: not on SymInts)
    first = start if isinstance(base, int) and base == 0 else base + start
    fold = getattr(ops, "fold", None)
    if fold is not None and full > 1:
        carry = fold(lambda i, c: step(c, first + i * size, size), carry, full)
    else:
        for i in range(full):
            carry = step(carry, first + i * size, size)
    return step(carry, first + full * size, tail) if tail else carry


def _map_blocks(ops: Ops, fn: Callable[[Any, int], Array], total: int, size: int, axis: int) -> Array:
    """Concatenates ``fn(q0, qn)`` along ``axis`` over the query blocks covering ``total``.

    Full blocks run in the backend's loop (``ops.map_concat``) when it has one; the tail in Python.
    """
    full, tail = total // size, total % size  # (divmod: not on SymInts)
    map_concat = getattr(ops, "map_concat", None)
    if map_concat is not None and full > 1:
        parts = [map_concat(lambda i: fn(i * size, size), full, axis)]
    else:
        parts = [fn(i * size, size) for i in range(full)]
    if tail:
        parts.append(fn(full * size, tail))
    return parts[0] if len(parts) == 1 else ops.concatenate(parts, axis)
