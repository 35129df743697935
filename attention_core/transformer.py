"""The Transformer encoder: position-wise FFN, add & norm, the block, and the stack of blocks.

Shape legend: B batch, T positions, h = num_hiddens.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from attention_core import checks
from attention_core import weights as W
from attention_core.linear import dense, layer_norm
from attention_core.multihead import multi_head_attention
from attention_core.ops import Array, Ops, fixed_shape
from attention_core.positional import add_positions, positional_encoding
from attention_core.registry import ops_for
from attention_core.weights import subset


def position_wise_ffn(X: Array, weights: Mapping[str, Array], *, ops: Ops | None = None) -> Array:
    """``dense2(relu(dense1(X)))`` applied at every position alike.

    Args:
        X: ``(B, T, d_in)``.
        weights: ``dense1.kernel (d_in, f)``, ``dense1.bias (f,)``, ``dense2.kernel (f, out)``,
            ``dense2.bias (out,)``; checked like ``set_weights`` checks a layer's (names,
            dtypes, shapes, and ``X``'s width against ``dense1.kernel``).
        ops: The backend's ops; found from ``X`` when omitted.
    """
    ops = ops or ops_for(X)
    checks.check_rank(ops, "X", X, (3,), "(B, T, d)")
    checks.check_floating(ops, "X", X)
    checks.check_matmul_dtype(ops, "X", X)
    weights = W.check_call_weights(ops, "position_wise_ffn", weights, W.ffn_call_spec,
                                   {"X": (X, "dense1.kernel")})
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

    ``X`` and ``Y`` must have the same dtype, except under mixed precision
    (``ops.mixes_dtypes``, e.g. ``torch.autocast``), where the sum takes the wider one; a
    float16 or bfloat16 sum is then normalised in float32 and the result cast back.

    Args:
        X: The residual input, ``(B, T, h)``.
        Y: The sublayer's output, same shape.
        weights: ``ln.gamma (h,)`` and ``ln.beta (h,)``, checked like ``set_weights`` checks
            a layer's (and ``X``'s width against them).
        dropout: Dropout rate on ``Y`` (applied whenever > 0).
        ops: The backend's ops; found from ``X`` when omitted.
    """
    ops = ops or ops_for(X)
    checks.check_not_empty(ops, "X", X)
    checks.check_framework("X", X, Y=Y)
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
    weights = W.check_call_weights(ops, "add_norm", weights, W.add_norm_call_spec,
                                   {"X": (X, "ln.gamma")})
    dropout = checks.check_dropout(dropout)
    Y = ops.dropout(Y, dropout) if dropout > 0 else Y
    total = X + Y  # under mixed precision, in the wider dtype by the framework's promotion
    gamma, beta = weights["ln.gamma"], weights["ln.beta"]
    dtype = ops.dtype_name(total)
    if getattr(ops, "mixes_dtypes", False) and dtype in ("float16", "bfloat16"):
        # as torch's layer_norm under autocast: statistics in float32, the result in the input's dtype
        return ops.astype(layer_norm(ops, ops.astype(total, "float32"), gamma, beta), dtype)
    return layer_norm(ops, total, gamma, beta)


def transformer_encoder_block(
    X: Array,
    weights: Mapping[str, Array],
    num_heads: int,
    valid_lens: Any = None,
    *,
    mask: Any = None,
    dropout: float = 0.0,
    return_weights: bool | str = False,
    implementation: str | None = None,
    ops: Ops | None = None,
) -> Array | tuple[Array, Array]:
    """One post-norm Transformer encoder block.

    ``Y = AddNorm1(X, MHA(X, X, X))``, then ``AddNorm2(Y, FFN(Y))``.

    Args:
        X: ``(B, T, h)``.
        weights: ``attention.*``, ``addnorm1.*``, ``ffn.*``, ``addnorm2.*`` (DESIGN section 5),
            all of width h = the output size of ``attention.W_q.kernel``; checked like
            ``set_weights`` checks a layer's (and ``X``'s width against h).
        num_heads: Heads of the self-attention.
        valid_lens: Integer lengths of ``X``, ``(B,)`` or ``(B, T)``.
        mask: Boolean self-attention mask, True = may attend.
        dropout: Dropout rate of the attention weights and both residual branches.
        return_weights: Also return the self-attention weights ``(B, H, T, T)``; see
            :func:`attention_core.attention.dot_product_attention` for ``ON_READ``.
        implementation: How the heads pool; see
            :func:`~attention_core.attention.dot_product_attention`.
        ops: The backend's ops; found from ``X`` when omitted.

    Returns:
        ``(B, T, h)``, and the attention weights if asked.
    """
    ops = ops or ops_for(X)
    checks.check_floating(ops, "X", X)
    weights = W.check_call_weights(
        ops, "transformer_encoder_block", weights,
        lambda size: W.block_call_spec(size, weights, num_heads), {"X": (X, "attention.W_q.kernel")},
    )
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


def check_token_ids(tokens: Array, vocab_size: int, *, ops: Ops) -> str:
    """Checks token ids ``(B, T)``: integers, each in ``[0, vocab_size)`` when the values are known.

    Returns:
        The ids' dtype name.
    """
    checks.check_rank(ops, "tokens", tokens, (2,), "(B, T) token ids")
    dtype = ops.dtype_name(tokens)
    if not dtype.startswith(("int", "uint")):
        raise TypeError(f"tokens must be integer token ids, got dtype {dtype}")
    values = ops.concrete(tokens)
    if values is not None and values.size and (values.min() < 0 or values.max() >= vocab_size):
        bad = int(values.min()) if values.min() < 0 else int(values.max())
        raise ValueError(f"tokens must be in [0, vocab_size) = [0, {vocab_size}), got {bad}")
    return dtype


def embed_tokens(tokens: Array, table: Array, *, ops: Ops) -> Array:
    """Looks up token ids in an embedding table, checking them first.

    Args:
        tokens: Integer ids ``(B, T)``, each in ``[0, V)``.
        table: ``(V, h)``.
        ops: The backend's ops.

    Returns:
        ``(B, T, h)``.

    Ids of any integer dtype are taken (int8 to uint64); those other than int32 and int64 are
    cast to int32 for the lookup, after the range check.
    """
    dtype = check_token_ids(tokens, fixed_shape(ops, table)[0], ops=ops)
    if dtype not in ("int32", "int64"):  # every framework's lookup takes these two
        tokens = ops.astype(tokens, "int32")  # ids < vocab_size, which int32 holds
    return ops.take(table, tokens)


def transformer_encoder(
    tokens: Array,
    weights: Mapping[str, Array],
    num_heads: int,
    valid_lens: Any = None,
    *,
    mask: Any = None,
    dropout: float = 0.0,
    return_weights: bool | str = False,
    implementation: str | None = None,
    positions: Array | None = None,
    max_len: int | None = None,
    ops: Ops | None = None,
) -> Array | tuple[Array, list[Array]]:
    """The Transformer encoder: embed, scale, add positions, then the blocks in turn.

    ``X = dropout(E[tokens] * sqrt(h) + P)``, with ``P`` the sinusoidal table (the scale brings
    the embeddings to the size of the table's entries, which lie in [-1, 1]); then
    ``X = block_i(X)`` for ``i = 0 .. num_blks - 1``.

    Args:
        tokens: Integer ids ``(B, T)``.
        weights: ``token.embedding (V, h)`` and ``blks.<i>.*`` for each block
            (:func:`transformer_encoder_block`'s names), numbered from 0, all of width h;
            checked like ``set_weights`` checks a layer's.
        num_heads: Heads of every block's self-attention.
        valid_lens: Integer lengths of the sequences, ``(B,)`` or ``(B, T)``.
        mask: Boolean self-attention mask, True = may attend.
        dropout: Dropout rate of the positional encoding's sum and inside every block.
        return_weights: Also return each block's self-attention weights ``(B, H, T, T)``;
            see :func:`attention_core.attention.dot_product_attention` for ``ON_READ``.
        implementation: How the blocks' heads pool; see
            :func:`~attention_core.attention.dot_product_attention`.
        positions: The sinusoidal table ``(1, T', h)``, ``T' >= T``, sliced to the first T
            rows (the layers hold one of ``max_len`` rows); made here when None.
        max_len: Rows of the table made here when ``positions`` is None: by default T rows
            when T is known, else 1000 (a run-time length under tracing or export).
        ops: The backend's ops; found from ``tokens`` when omitted.

    Returns:
        ``(B, T, h)``, and the list of the blocks' attention weights if asked.
    """
    ops = ops or ops_for(tokens)
    weights = W.check_call_weights(ops, "transformer_encoder", weights,
                                   lambda size: W.encoder_call_spec(size, weights, num_heads))
    table = weights["token.embedding"]
    num_hiddens = fixed_shape(ops, table)[1]
    X = embed_tokens(tokens, table, ops=ops) * math.sqrt(num_hiddens)  # (B, T, h)
    if positions is not None:
        steps, rows = ops.shape(tokens)[1], ops.shape(positions)[1]
        if isinstance(steps, int) and steps > rows:
            raise ValueError(f"tokens have {steps} positions, more than max_len ({rows})")
    if positions is None:
        X = positional_encoding(X, dropout, max_len=max_len, ops=ops)
    else:
        X = add_positions(X, positions, dropout, ops=ops)
    num_blks = len({name.split(".")[1] for name in weights if name.startswith("blks.")})
    attention_weights = []
    for i in range(num_blks):
        result = transformer_encoder_block(
            X, subset(weights, f"blks.{i}"), num_heads, valid_lens, mask=mask, dropout=dropout,
            return_weights=return_weights, implementation=implementation, ops=ops,
        )
        X, attn = result if return_weights else (result, None)
        attention_weights.append(attn)
    return (X, attention_weights) if return_weights else X
