"""The direct kernel: forms the ``(B, H, Q, K)`` scores and weights, the only one that returns them.

Shape legend: B batch, H query heads, Hkv key/value heads, Q queries, K keys, D depth, Dv value
depth.
"""

from __future__ import annotations

from attention_core.kernels import Capabilities, Request, Result
from attention_core.kernels.rows import (
    lse_out,
    narrowed,
    sink_column,
    softmax_rows,
    softmax_weights,
    widened,
)
from attention_core.modifiers import AllMasks, Tile
from attention_core.ops import Array, Ops
from attention_core.scores import pooled, products

CAPABILITIES = Capabilities(weights=True, lse=True, sinks=True, exact_non_finite=True,
                            ragged=True)


def scores(ops: Ops, q: Array, k: Array, request: Request) -> Array:
    """``q k^T * scale`` per query head, modified, in the accumulation dtype: ``(B, H, Q, K)``."""
    s = products(ops, widened(ops, q) * request.scale, widened(ops, k))
    whole = request.call.whole()
    for mod in request.scores:
        s = mod.apply(s, whole)
    return s


def visible(request: Request) -> Array | None:
    """The AND of the mask modifiers over every query and key; None when nothing is hidden."""
    return tile_visible(request, request.call.whole())


def tile_visible(request: Request, tile: Tile) -> Array | None:
    """The AND of the mask modifiers over one tile; None when it hides nothing."""
    return AllMasks(request.masks).visible(tile)


def weights(ops: Ops, q: Array, k: Array, request: Request) -> tuple[Array, Array | None]:
    """``(weights, lse or None)`` in the accumulation dtype."""
    s, mask = scores(ops, q, k, request), visible(request)
    if request.sinks is None and not request.lse:
        return softmax_weights(ops, s, mask), None
    sinks = None if request.sinks is None else sink_column(ops, request.sinks)
    return softmax_rows(ops, s, mask, sinks)


def direct(ops: Ops, q: Array, k: Array, v: Array, request: Request) -> Result:
    """Pools ``dropout(w) @ v`` with ``w`` formed whole (see :mod:`attention_core.kernels.rows`)."""
    w, lse = weights(ops, q, k, request)
    dropped = ops.dropout(w, request.dropout) if request.dropout > 0 else w
    out = narrowed(ops, pooled(ops, dropped, widened(ops, v)), request.dtype)
    kept = None
    if request.weights:
        kept = narrowed(ops, w, request.dtype)
    return Result(out, kept, None if lse is None else lse_out(ops, lse[:, :, :, 0]))
