"""Masked softmax and attention pooling: scaled dot-product, additive, Nadaraya-Watson.

Shape legend: B batch, H heads, Q queries, K keys, D depth of queries and keys, Dv depth of
values. Functions take the backend's own arrays and find the backend from their type, unless
an ``ops`` is passed (the adapters pass one that knows about training mode and randomness).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from attention_core import checks, masks
from attention_core.linear import dense
from attention_core.ops import Array, Ops
from attention_core.registry import ops_for

#: Score given to masked keys before the max is taken: the most negative finite value of the
#: dtype, so it never wins the max over a visible key (fp16 cannot hold -1e6).
FILL_VALUE = {
    "float16": -65504.0,
    "bfloat16": -3.3895313892515355e38,
    "float32": -3.4028234663852886e38,
    "float64": -1.7976931348623157e308,
}


def softmax_visible(ops: Ops, scores: Array, visible: Array | None) -> Array:
    """Softmax over the last axis counting only visible keys.

    ``w_ij = exp(s_ij - m_i) / sum_{j visible} exp(s_ij - m_i)`` for visible ``j``, 0 otherwise,
    with ``m_i`` the row's largest visible score. Masked entries are replaced by the dtype's
    most negative value before the exponential, whose result there is exactly 0. A row with no
    visible key therefore sums to 0; that sum is replaced by 1 before dividing, so the row is
    all zeros and no NaN appears, in values or in gradients.

    Args:
        ops: The backend's ops.
        scores: ``(..., Q, K)``.
        visible: Boolean, broadcastable to ``scores``, or None for no mask.

    Returns:
        The weights, shape and dtype of ``scores``.
    """
    if visible is None:
        e = ops.exp(scores - ops.max(scores, -1))
        return e / ops.sum(e, -1)
    fill = FILL_VALUE[ops.dtype_name(scores)]
    top = ops.max(ops.where(visible, scores, fill), -1)  # (..., Q, 1)
    top = ops.where(top > fill, top, 0.0)  # rows with no visible key: avoid s - fill overflow
    e = ops.exp(ops.where(visible, scores - top, fill))  # exactly 0 where masked
    total = ops.sum(e, -1)
    return e / ops.where(total > 0, total, 1.0)


def masked_softmax(
    scores: Array,
    valid_lens: Any = None,
    mask: Any = None,
    causal: bool = False,
    *,
    ops: Ops | None = None,
) -> Array:
    """Softmax over the keys axis of ``scores`` with masked keys given zero weight.

    Args:
        scores: ``(B, Q, K)`` or ``(B, H, Q, K)``, floating.
        valid_lens: Integer lengths, ``(B,)`` or ``(B, Q)``.
        mask: Boolean, True = may attend: ``(Q, K)``, ``(B, Q, K)`` or ``(B, H, Q, K)``.
        causal: Query ``i`` sees keys ``j <= i + (K - Q)``.
        ops: The backend's ops; found from ``scores`` when omitted.

    Returns:
        The weights, same shape as ``scores``; rows with no visible key are all zeros.
    """
    ops = ops or ops_for(scores)
    shape = checks.check_rank(ops, "scores", scores, (3, 4), "(B, Q, K) or (B, H, Q, K)")
    checks.check_floating(ops, "scores", scores)
    scores4 = scores if len(shape) == 4 else ops.expand_dims(scores, 1)
    visible = masks.combine(ops, ops.shape(scores4), valid_lens, mask, causal)
    weights = softmax_visible(ops, scores4, visible)
    return weights if len(shape) == 4 else weights[:, 0]


def attend(
    ops: Ops,
    scores: Array,
    values: Array,
    valid_lens: Any,
    mask: Any,
    causal: bool,
    dropout: float,
) -> tuple[Array, Array]:
    """Masks, normalises and pools: the part every attention scoring function shares.

    Args:
        ops: The backend's ops.
        scores: ``(B, H, Q, K)``.
        values: ``(B, H, K, Dv)`` or broadcastable (e.g. ``(B, 1, K, Dv)``).
        valid_lens: See :func:`masked_softmax`.
        mask: See :func:`masked_softmax`.
        causal: See :func:`masked_softmax`.
        dropout: Rate applied to the weights before pooling (0 for none).

    Returns:
        ``(output (B, H, Q, Dv), weights (B, H, Q, K))``, the weights taken before dropout.
    """
    visible = masks.combine(ops, ops.shape(scores), valid_lens, mask, causal)
    weights = softmax_visible(ops, scores, visible)
    dropped = ops.dropout(weights, dropout) if dropout > 0 else weights
    return ops.matmul(dropped, values), weights


def _lift(ops: Ops, x: Array, rank: int) -> Array:
    """Adds the heads axis to a rank-3 array: ``(B, N, D) -> (B, 1, N, D)``."""
    return x if rank == 4 else ops.expand_dims(x, 1)


def dot_product_attention(
    queries: Array,
    keys: Array,
    values: Array,
    valid_lens: Any = None,
    *,
    mask: Any = None,
    causal: bool = False,
    scale: float | None = None,
    dropout: float = 0.0,
    return_weights: bool = False,
    ops: Ops | None = None,
) -> Array | tuple[Array, Array]:
    """Scaled dot-product attention: ``softmax(Q K^T * scale) V`` over the visible keys.

    Args:
        queries: ``(B, Q, D)`` or ``(B, H, Q, D)``.
        keys: ``(B, K, D)`` or ``(B, H, K, D)``, the rank of ``queries``.
        values: ``(B, K, Dv)`` or ``(B, H, K, Dv)``.
        valid_lens: Integer lengths, ``(B,)`` or ``(B, Q)``, shared by every head.
        mask: Boolean, True = may attend: ``(Q, K)``, ``(B, Q, K)`` or ``(B, H, Q, K)``.
        causal: Query ``i`` sees keys ``j <= i + (K - Q)``.
        scale: Multiplies the scores; ``1 / sqrt(D)`` when None.
        dropout: Dropout rate on the attention weights (applied whenever > 0).
        return_weights: Also return the weights, before dropout. Without it, a backend
            whose ops have ``fused_attention`` (see :class:`~attention_core.ops.FusedAttentionOps`)
            pools in one fused kernel instead.
        ops: The backend's ops; found from ``queries`` when omitted.

    Returns:
        The output, shape of ``queries`` with depth Dv; with ``return_weights``, also the
        weights of shape ``(B, H, Q, K)`` (H = 1 for rank-3 inputs).
    """
    ops = ops or ops_for(queries)
    checks.check_qkv(ops, queries, keys, values)
    dropout = checks.check_dropout(dropout)
    rank = len(ops.shape(queries))
    depth = ops.shape(queries)[-1]
    if scale is None and not isinstance(depth, int):  # depth known only at run time
        factor: Any = 1.0 / ops.sqrt(ops.astype(depth, ops.dtype_name(queries)))
    elif scale is None:
        factor = 1.0 / math.sqrt(depth)
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"scale must be a positive float or None, got {scale!r}")
    else:
        factor = float(scale)
    fused = None if return_weights else getattr(ops, "fused_attention", None)
    if fused is not None:  # the backend's fused kernel: the weights are never formed
        q, k, v = (_lift(ops, x, rank) for x in (queries, keys, values))
        B, H, Q, _ = ops.shape(q)
        visible = masks.combine(ops, (B, H, Q, ops.shape(k)[2]), valid_lens, mask, causal)
        out = fused(q, k, v, visible, factor, dropout)  # (B, H, Q, Dv)
        return out if rank == 4 else out[:, 0]
    q = _lift(ops, queries, rank) * factor  # (B, H, Q, D), scale folded into Q
    k_t = ops.transpose(_lift(ops, keys, rank), (0, 1, 3, 2))  # (B, H, D, K)
    scores = ops.matmul(q, k_t)  # (B, H, Q, K)
    out, weights = attend(ops, scores, _lift(ops, values, rank), valid_lens, mask, causal, dropout)
    out = out if rank == 4 else out[:, 0]
    return (out, weights) if return_weights else out


def additive_attention(
    queries: Array,
    keys: Array,
    values: Array,
    weights: Mapping[str, Array],
    valid_lens: Any = None,
    *,
    mask: Any = None,
    causal: bool = False,
    dropout: float = 0.0,
    return_weights: bool = False,
    ops: Ops | None = None,
) -> Array | tuple[Array, Array]:
    """Additive (Bahdanau) attention: score ``w_v^T tanh(W_q q + W_k k)``.

    Args:
        queries: ``(B, Q, Dq)``.
        keys: ``(B, K, Dk)``.
        values: ``(B, K, Dv)``.
        weights: ``W_q.kernel (Dq, h)``, ``W_k.kernel (Dk, h)``, ``w_v.kernel (h, 1)``.
        valid_lens: See :func:`dot_product_attention`.
        mask: See :func:`dot_product_attention`.
        causal: See :func:`dot_product_attention`.
        dropout: Dropout rate on the attention weights.
        return_weights: Also return the weights ``(B, 1, Q, K)``, before dropout.
        ops: The backend's ops; found from ``queries`` when omitted.

    Returns:
        The output ``(B, Q, Dv)``, and the weights if asked.
    """
    ops = ops or ops_for(queries)
    check_projected_inputs(ops, queries, keys, values)
    dropout = checks.check_dropout(dropout)
    q = ops.expand_dims(dense(ops, queries, weights["W_q.kernel"]), 2)  # (B, Q, 1, h)
    k = ops.expand_dims(dense(ops, keys, weights["W_k.kernel"]), 1)  # (B, 1, K, h)
    features = ops.tanh(q + k)  # (B, Q, K, h)
    scores = ops.transpose(ops.matmul(features, weights["w_v.kernel"]), (0, 3, 1, 2))  # (B,1,Q,K)
    values4 = ops.expand_dims(values, 1)  # (B, 1, K, Dv)
    out, w = attend(ops, scores, values4, valid_lens, mask, causal, dropout)
    return (out[:, 0], w) if return_weights else out[:, 0]


def check_projected_inputs(ops: Ops, queries: Array, keys: Array, values: Array) -> None:
    """Checks ``(B, Q, Dq)``, ``(B, K, Dk)``, ``(B, K, Dv)``: depths may differ, lengths not."""
    q = checks.check_rank(ops, "queries", queries, (3,), "(B, Q, Dq)")
    k = checks.check_rank(ops, "keys", keys, (3,), "(B, K, Dk)")
    v = checks.check_rank(ops, "values", values, (3,), "(B, K, Dv)")
    for name, x in (("queries", queries), ("keys", keys), ("values", values)):
        checks.check_floating(ops, name, x)
    checks.check_same_dtype(ops, "queries", queries, keys=keys, values=values)
    checks.check_equal(
        f"keys and values must have the same length, got {k[1]} keys and {v[1]} values", k[1], v[1]
    )
    for name, s in (("keys", k), ("values", v)):
        checks.check_equal(
            f"{name} batch size ({s[0]}) must equal queries batch size ({q[0]})", s[0], q[0]
        )


def nadaraya_watson(
    queries: Array,
    keys: Array,
    values: Array,
    w: Array | float | None = None,
    *,
    return_weights: bool = False,
    ops: Ops | None = None,
) -> Array | tuple[Array, Array]:
    """Nadaraya-Watson kernel regression: ``f(x) = sum_i softmax(-((x - x_i) w)^2 / 2) y_i``.

    Args:
        queries: ``(B, Q)`` or ``(Q,)``: the points ``x`` to predict at.
        keys: ``(B, K)`` or ``(K,)``: the training inputs ``x_i``.
        values: ``(B, K)`` or ``(K,)``: the training targets ``y_i``.
        w: The kernel's inverse width (a scalar or an array of one element); 1 when None.
        return_weights: Also return the weights ``(B, 1, Q, K)``.
        ops: The backend's ops; found from ``queries`` when omitted.

    Returns:
        The predictions, shape of ``queries``, and the weights if asked.
    """
    ops = ops or ops_for(queries)
    q = checks.check_rank(ops, "queries", queries, (1, 2), "(B, Q) or (Q,)")
    checks.check_rank(ops, "keys", keys, (len(q),), "(B, K) or (K,) like queries")
    checks.check_rank(ops, "values", values, (len(q),), "(B, K) or (K,) like queries")
    checks.check_floating(ops, "queries", queries)
    checks.check_same_dtype(ops, "queries", queries, keys=keys, values=values)
    k, v = ops.shape(keys), ops.shape(values)
    for i, axis in enumerate(("batch", "length")[2 - len(q) :]):
        checks.check_equal(
            f"keys and values must have the same shape, got {checks.fmt_shape(k)} and "
            f"{checks.fmt_shape(v)}",
            k[i],
            v[i],
        )
        if axis == "batch":
            checks.check_equal(
                f"keys batch size ({k[0]}) must equal queries batch size ({q[0]})", k[0], q[0]
            )
    batched = [x if len(q) == 2 else ops.expand_dims(x, 0) for x in (queries, keys, values)]
    diff = ops.expand_dims(batched[0], -1) - ops.expand_dims(batched[1], 1)  # (B, Q, K)
    if w is not None:
        diff = diff * w
    scores = ops.expand_dims(diff * diff * -0.5, 1)  # (B, 1, Q, K)
    weights = softmax_visible(ops, scores, None)
    y = ops.expand_dims(ops.expand_dims(batched[2], 1), -1)  # (B, 1, K, 1)
    out = ops.matmul(weights, y)[:, 0, :, 0]  # (B, Q)
    out = out if len(q) == 2 else out[0]
    return (out, weights) if return_weights else out
