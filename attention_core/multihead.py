"""Multi-head attention over the canonical weight mapping.

Head ``i`` uses columns ``i*h/H : (i+1)*h/H`` of the projected queries, keys and values,
where h = num_hiddens and H = num_heads (DESIGN section 5).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from attention_core import checks
from attention_core.attention import check_projected_inputs, dot_product_attention
from attention_core.linear import dense
from attention_core.ops import Array, Ops
from attention_core.registry import ops_for


def split_heads(ops: Ops, x: Array, num_heads: int) -> Array:
    """``(B, N, h) -> (B, H, N, h/H)``: head ``i`` takes columns ``i*h/H : (i+1)*h/H``."""
    *lead, width = ops.shape(x)
    x = ops.reshape(x, (*lead, num_heads, width // num_heads))  # (B, N, H, h/H)
    return ops.transpose(x, (0, 2, 1, 3))


def merge_heads(ops: Ops, x: Array) -> Array:
    """``(B, H, N, h/H) -> (B, N, h)``, the inverse of :func:`split_heads`."""
    x = ops.transpose(x, (0, 2, 1, 3))  # (B, N, H, h/H)
    *lead, heads, depth = ops.shape(x)
    return ops.reshape(x, (*lead, heads * depth))


def project(ops: Ops, x: Array, weights: Mapping[str, Array], name: str) -> Array:
    """Applies the dense layer ``name`` (``W_q``, ...) of the mapping, with its bias if any."""
    return dense(ops, x, weights[f"{name}.kernel"], weights.get(f"{name}.bias"))


def multi_head_attention(
    queries: Array,
    keys: Array,
    values: Array,
    weights: Mapping[str, Array],
    num_heads: int,
    valid_lens: Any = None,
    *,
    mask: Any = None,
    causal: bool = False,
    dropout: float = 0.0,
    return_weights: bool = False,
    implementation: str | None = None,
    ops: Ops | None = None,
) -> Array | tuple[Array, Array]:
    """Multi-head scaled dot-product attention with input and output projections.

    Args:
        queries: ``(B, Q, Dq)``.
        keys: ``(B, K, Dk)``.
        values: ``(B, K, Dv)``.
        weights: ``W_q.kernel (Dq, h)``, ``W_k.kernel (Dk, h)``, ``W_v.kernel (Dv, h)``,
            ``W_o.kernel (h, h)`` and, with biases, ``W_q.bias (h,)`` etc.
        num_heads: H; must divide h.
        valid_lens: Integer lengths, ``(B,)`` or ``(B, Q)``, shared by every head.
        mask: Boolean, True = may attend: ``(Q, K)``, ``(B, Q, K)`` or ``(B, H, Q, K)``.
        causal: Query ``i`` sees keys ``j <= i + (K - Q)``.
        dropout: Dropout rate on the attention weights.
        return_weights: Also return the weights ``(B, H, Q, K)``, before dropout.
        implementation: How the heads pool; see
            :func:`~attention_core.attention.dot_product_attention`.
        ops: The backend's ops; found from ``queries`` when omitted.

    Returns:
        The output ``(B, Q, h)``, and the weights if asked.
    """
    ops = ops or ops_for(queries)
    check_projected_inputs(ops, queries, keys, values)
    num_hiddens = ops.shape(weights["W_q.kernel"])[-1]
    checks.check_heads(num_hiddens, num_heads)
    q = split_heads(ops, project(ops, queries, weights, "W_q"), num_heads)  # (B, H, Q, h/H)
    k = split_heads(ops, project(ops, keys, weights, "W_k"), num_heads)  # (B, H, K, h/H)
    v = split_heads(ops, project(ops, values, weights, "W_v"), num_heads)  # (B, H, K, h/H)
    pooled = dot_product_attention(
        q, k, v, valid_lens, mask=mask, causal=causal, dropout=dropout,
        return_weights=return_weights, implementation=implementation, ops=ops,
    )
    out, attn = pooled if return_weights else (pooled, None)
    out = project(ops, merge_heads(ops, out), weights, "W_o")  # (B, Q, h)
    return (out, attn) if return_weights else out
