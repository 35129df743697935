"""The Transformer encoder block: position-wise FFN, add & norm, and their composition.

Shape legend: B batch, T positions, h = num_hiddens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from attention_core import checks
from attention_core.linear import dense, layer_norm
from attention_core.multihead import multi_head_attention
from attention_core.ops import Array, Ops
from attention_core.registry import ops_for
from attention_core.weights import subset


def position_wise_ffn(X: Array, weights: Mapping[str, Array], *, ops: Ops | None = None) -> Array:
    """``dense2(relu(dense1(X)))`` applied at every position alike.

    Args:
        X: ``(B, T, d_in)``.
        weights: ``dense1.kernel (d_in, f)``, ``dense1.bias (f,)``, ``dense2.kernel (f, out)``,
            ``dense2.bias (out,)``.
        ops: The backend's ops; found from ``X`` when omitted.
    """
    ops = ops or ops_for(X)
    checks.check_floating(ops, "X", X)
    hidden = ops.relu(dense(ops, X, weights["dense1.kernel"], weights["dense1.bias"]))
    return dense(ops, hidden, weights["dense2.kernel"], weights["dense2.bias"])


def add_norm(
    X: Array,
    Y: Array,
    weights: Mapping[str, Array],
    dropout: float = 0.0,
    *,
    ops: Ops | None = None,
) -> Array:
    """Residual connection then layer normalisation: ``LayerNorm(dropout(Y) + X)``.

    Args:
        X: The residual input, ``(B, T, h)``.
        Y: The sublayer's output, same shape.
        weights: ``ln.gamma (h,)`` and ``ln.beta (h,)``.
        dropout: Dropout rate on ``Y`` (applied whenever > 0).
        ops: The backend's ops; found from ``X`` when omitted.
    """
    ops = ops or ops_for(X)
    checks.check_floating(ops, "X", X)
    checks.check_same_dtype(ops, "X", X, Y=Y)
    x_shape, y_shape = ops.shape(X), ops.shape(Y)
    if len(x_shape) != len(y_shape) or any(
        isinstance(a, int) and isinstance(b, int) and a != b
        for a, b in zip(x_shape, y_shape, strict=True)
    ):
        raise ValueError(
            f"X and Y must have the same shape, got {checks.fmt_shape(x_shape)} and "
            f"{checks.fmt_shape(y_shape)}"
        )
    dropout = checks.check_dropout(dropout)
    Y = ops.dropout(Y, dropout) if dropout > 0 else Y
    return layer_norm(ops, X + Y, weights["ln.gamma"], weights["ln.beta"])


def transformer_encoder_block(
    X: Array,
    weights: Mapping[str, Array],
    num_heads: int,
    valid_lens: Any = None,
    *,
    mask: Any = None,
    dropout: float = 0.0,
    return_weights: bool = False,
    implementation: str | None = None,
    ops: Ops | None = None,
) -> Array | tuple[Array, Array]:
    """One post-norm Transformer encoder block.

    ``Y = AddNorm1(X, MHA(X, X, X))``, then ``AddNorm2(Y, FFN(Y))``.

    Args:
        X: ``(B, T, h)``.
        weights: ``attention.*``, ``addnorm1.*``, ``ffn.*``, ``addnorm2.*`` (DESIGN section 5).
        num_heads: Heads of the self-attention.
        valid_lens: Integer lengths of ``X``, ``(B,)`` or ``(B, T)``.
        mask: Boolean self-attention mask, True = may attend.
        dropout: Dropout rate of the attention weights and both residual branches.
        return_weights: Also return the self-attention weights ``(B, H, T, T)``.
        implementation: How the heads pool; see
            :func:`~attention_core.attention.dot_product_attention`.
        ops: The backend's ops; found from ``X`` when omitted.

    Returns:
        ``(B, T, h)``, and the attention weights if asked.
    """
    ops = ops or ops_for(X)
    result = multi_head_attention(
        X, X, X, subset(weights, "attention"), num_heads, valid_lens,
        mask=mask, dropout=dropout, return_weights=return_weights, implementation=implementation,
        ops=ops,
    )
    attended, attn = result if return_weights else (result, None)
    Y = add_norm(X, attended, subset(weights, "addnorm1"), dropout, ops=ops)
    out = add_norm(Y, position_wise_ffn(Y, subset(weights, "ffn"), ops=ops),
                   subset(weights, "addnorm2"), dropout, ops=ops)
    return (out, attn) if return_weights else out
