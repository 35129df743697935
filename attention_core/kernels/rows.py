"""The numeric policy every core kernel follows, one softmax row at a time.

* A hidden key is selected away (``where``), never given a large negative score: its weight is
  exactly 0 whatever its score, and a row with no visible key gives zero weights, a zero
  output and a log-sum-exp of ``-inf``. A visible score of ``-inf`` weighs 0 like a hidden
  one; a visible ``+inf`` or NaN makes its row NaN, as IEEE arithmetic has it.
* float16 and bfloat16 inputs are scored, normalised and pooled in float32
  (:func:`accumulation_dtype`), as FlashAttention and torch's fused kernels do; the output is
  cast back to the inputs' dtype, the log-sum-exp kept in float32 (:func:`lse_out`).
* Nothing reads the data on the host: every decision above is an array operation.

Shape legend: B batch, H heads, Q queries, K keys.
"""

from __future__ import annotations

import math
from typing import Any

from attention_core.ops import Array, Ops

#: The dtype each input dtype is scored and pooled in.
ACCUMULATION = {"float16": "float32", "bfloat16": "float32"}


def accumulation_dtype(dtype: str) -> str:
    """float32 for float16 and bfloat16 inputs, the dtype itself otherwise."""
    return ACCUMULATION.get(dtype, dtype)


def widened(ops: Ops, x: Array) -> Array:
    """``x`` in its accumulation dtype (itself when that is its dtype)."""
    dtype = ops.dtype_name(x)
    wide = accumulation_dtype(dtype)
    return x if wide == dtype else ops.astype(x, wide)


def narrowed(ops: Ops, x: Array, dtype: str) -> Array:
    """``x`` back in the inputs' ``dtype`` when that was widened (float16, bfloat16).

    Other results keep the dtype they were computed in: under ``torch.autocast`` the framework
    picks it.
    """
    return ops.astype(x, dtype) if dtype in ACCUMULATION and ops.dtype_name(x) != dtype else x


def lse_out(ops: Ops, lse: Array) -> Array:
    """A log-sum-exp as calls return it: float64 for float64 inputs, float32 otherwise."""
    return lse if ops.dtype_name(lse) in ("float32", "float64") else ops.astype(lse, "float32")


def hidden(ops: Ops, scores: Array, visible: Array | None) -> Array:
    """The scores with the hidden ones selected away to ``-inf``."""
    return scores if visible is None else ops.where(visible, scores, -math.inf)


def finite_max(ops: Ops, m: Array) -> Array:
    """A row maximum with ``-inf`` (nothing visible) replaced by 0, NaN and ``+inf`` kept."""
    return ops.where(m != -math.inf, m, 0.0)


def softmax_rows(ops: Ops, scores: Array, visible: Array | None, sinks: Array | None = None
                 ) -> tuple[Array, Array]:
    """``(weights, lse)`` of the visible scores, by the policy in the module docstring.

    Args:
        ops: The backend's ops.
        scores: ``(..., Q, K)``, in the accumulation dtype.
        visible: Boolean broadcastable to the scores, or None.
        sinks: ``(..., 1 or Q, 1)`` sink logits added to each row's denominator, or None.

    Returns:
        The weights, shape of ``scores``, and each row's log-sum-exp ``(..., Q, 1)``.
    """
    masked = hidden(ops, scores, visible)
    top = ops.max(masked, -1)
    if sinks is not None:
        top = ops.maximum(top, sinks)
    top = finite_max(ops, top)
    e = ops.exp(masked - top)  # exactly 0 where hidden
    total = ops.sum(e, -1)
    if sinks is not None:
        total = total + ops.exp(sinks - top)
    weights = e / ops.where(total > 0, total, 1.0)
    return weights, top + ops.log(total)  # log 0 = -inf: nothing visible


def softmax_weights(ops: Ops, scores: Array, visible: Array | None) -> Array:
    """The weights of :func:`softmax_rows` alone, by the backend's softmax kernel if it has one."""
    softmax: Any = getattr(ops, "softmax", None)
    if softmax is None:
        return softmax_rows(ops, scores, visible)[0]
    masked = hidden(ops, scores, visible)
    keep = ops.max(masked, -1) != -math.inf  # a row of -inf comes out of the kernel as NaN,
    # and so would its gradient, through a where that multiplies (MXNet's symbolic one): the
    # kernel is given zeros there
    return ops.where(keep, softmax(ops.where(keep, masked, 0.0)), 0.0)


def sink_column(ops: Ops, sinks: Array) -> Array:
    """Per-head sink logits ``(H,) -> (1, H, 1, 1)``, in the accumulation dtype."""
    for axis in (0, -1, -1):
        sinks = ops.expand_dims(sinks, axis)
    return widened(ops, sinks)
