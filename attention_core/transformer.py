"""The Transformer: position-wise FFN, add & norm, the encoder and decoder blocks and stacks.

Shape legend: B batch, T positions (of the decoder's input when both sides appear), S the
encoder's positions, h = num_hiddens, V the vocabulary.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from attention_core import cache as kv_cache
from attention_core import checks, masks
from attention_core import weights as W
from attention_core.host import host_array
from attention_core.linear import dense, layer_norm, norm_eps, rms_norm
from attention_core.multihead import (
    CLASSIC,
    HeadOptions,
    cached_heads,
    heads,
    multi_head_attention,
    pool_heads,
    ragged_arguments,
    refuse_in_cached_call,
)
from attention_core.ops import Array, Ops, fixed_shape
from attention_core.positional import (
    ROTARY_MAX_POSITIONS,
    add_positions,
    positional_encoding,
    sinusoidal_encoding,
)
from attention_core.registry import backend_of, ops_for
from attention_core.weights import POST_NORM, BlockOptions, subset


def position_wise_ffn(
    X: Array, weights: Mapping[str, Array], *, activation: str = "relu", bias: bool = True,
    ops: Ops | None = None,
) -> Array:
    """``dense2(act(dense1(X)))`` applied at every position alike.

    ``act`` is ReLU, or the exact GELU ``x * (1 + erf(x / sqrt 2)) / 2``; for ``"swiglu"``
    the FFN is ``dense2(silu(gate(X)) * dense1(X))``.

    Args:
        X: ``(B, T, d_in)``.
        weights: ``dense1.kernel (d_in, f)``, ``gate.kernel (d_in, f)`` (``"swiglu"`` only),
            ``dense2.kernel (f, out)``, and with ``bias`` each one's ``.bias``; checked like
            ``set_weights`` checks a layer's (names, dtypes, shapes, and ``X``'s width
            against ``dense1.kernel``).
        activation: ``"relu"``, ``"gelu"`` or ``"swiglu"``.
        bias: Whether the dense layers have biases.
        ops: The backend's ops; found from ``X`` when omitted.
    """
    ops = ops or ops_for(X, "X")
    activation = checks.check_activation(activation)
    bias = checks.check_flag("bias", bias)
    checks.check_rank(ops, "X", X, (3,), "(B, T, d)")
    checks.check_floating(ops, "X", X)
    checks.check_matmul_dtype(ops, "X", X)
    weights = W.check_call_weights(
        ops, "position_wise_ffn", weights,
        lambda size: W.ffn_call_spec(size, activation=activation, bias=bias),
        {"X": (X, "dense1.kernel")})
    return _ffn(ops, X, weights, activation)


def _ffn(ops: Ops, X: Array, weights: Mapping[str, Array], activation: str) -> Array:
    """:func:`position_wise_ffn` of checked arguments."""

    def layer(name: str, x: Array) -> Array:
        return dense(ops, x, weights[f"{name}.kernel"], weights.get(f"{name}.bias"))

    up = layer("dense1", X)
    if activation == "relu":
        hidden = ops.relu(up)
    elif activation == "gelu":
        hidden = up * (1.0 + _erf(ops, up * (1.0 / math.sqrt(2.0)))) * 0.5
    else:
        gate = layer("gate", X)
        silu = getattr(ops, "silu", None)
        hidden = (silu(gate) if silu is not None else gate / (1.0 + ops.exp(-gate))) * up
    return layer("dense2", hidden)


def _erf(ops: Ops, x: Array) -> Array:
    """``erf(x)`` by the backend's ops (an optional method: the exact GELU needs it)."""
    erf = getattr(ops, "erf", None)
    if erf is None:
        raise TypeError(f"activation='gelu' needs the ops' erf, which the {ops.name} ops lack")
    return erf(x)


def normalise(
    ops: Ops, X: Array, weights: Mapping[str, Array], norm: str = "layer",
    eps: float | None = None,
) -> Array:
    """``X`` normalised over its last axis by ``ln.gamma`` (and ``ln.beta`` for ``"layer"``).

    LayerNorm or RMSNorm (:func:`~attention_core.linear.rms_norm`), ``eps`` None for the
    norm's default. Under mixed precision a float16 or bfloat16 ``X`` is normalised in
    float32 and the result cast back, as torch's norms do under autocast.
    """
    dtype = ops.dtype_name(X)
    if dtype in ("float16", "bfloat16") and getattr(ops, "mixes_dtypes", False):
        return ops.astype(normalise(ops, ops.astype(X, "float32"), weights, norm, eps), dtype)
    if norm == "rms":
        return rms_norm(ops, X, weights["ln.gamma"], norm_eps(norm, eps))
    return layer_norm(ops, X, weights["ln.gamma"], weights["ln.beta"], norm_eps(norm, eps))


def add_norm(
    X: Array,
    Y: Array,
    weights: Mapping[str, Array],
    dropout: float = 0.0,
    *,
    norm: str = "layer",
    eps: float | None = None,
    ops: Ops | None = None,
) -> Array:
    """Residual connection then normalisation: ``Norm(dropout(Y) + X)``.

    ``X`` and ``Y`` must have the same dtype, except under mixed precision
    (``ops.mixes_dtypes``, e.g. ``torch.autocast``), where the sum takes the wider one; a
    float16 or bfloat16 sum is then normalised in float32 and the result cast back.

    Args:
        X: The residual input, ``(B, T, h)``.
        Y: The sublayer's output, same shape.
        weights: ``ln.gamma (h,)`` and, for ``norm="layer"``, ``ln.beta (h,)``, checked like
            ``set_weights`` checks a layer's (and ``X``'s width against them).
        dropout: Dropout rate on ``Y`` (applied whenever > 0).
        norm: ``"layer"`` (LayerNorm) or ``"rms"`` (RMSNorm: no centring, no ``beta``).
        eps: The norm's epsilon; None for its default (1e-5 layer, 1e-6 rms).
        ops: The backend's ops; found from ``X`` when omitted.
    """
    ops = ops or ops_for(X, "X")
    norm, eps = checks.check_norm(norm), checks.check_eps(eps, "eps")
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
    weights = W.check_call_weights(
        ops, "add_norm", weights, lambda size: W.add_norm_call_spec(size, norm=norm),
        {"X": (X, "ln.gamma")})
    total = X + _dropped(ops, Y, dropout)  # under mixed precision, in the wider dtype
    return normalise(ops, total, weights, norm, eps)


def _dropped(ops: Ops, Y: Array, dropout: float) -> Array:
    """``dropout(Y)``, the rate checked."""
    dropout = checks.check_dropout(dropout)
    return ops.dropout(Y, dropout) if dropout > 0 else Y


def _residual(
    ops: Ops, X: Array, sublayer: Callable[[Array], Any], norm_weights: Mapping[str, Array],
    dropout: float, block: BlockOptions, with_weights: bool,
) -> tuple[Array, Any]:
    """One sublayer with its residual connection and norm, and what else it returned.

    Post-norm ``Norm(X + dropout(f(X)))``, or with ``block.norm_first``
    ``X + dropout(f(Norm(X)))``. ``f`` returns ``(out, weights)`` when ``with_weights``.
    """
    inner = normalise(ops, X, norm_weights, block.norm, block.norm_eps) if block.norm_first else X
    result = sublayer(inner)
    out, extra = result if with_weights else (result, None)
    if block.norm_first:
        return X + _dropped(ops, out, dropout), extra
    return add_norm(X, out, norm_weights, dropout, norm=block.norm, eps=block.norm_eps,
                    ops=ops), extra


def check_block_options(block: Any) -> BlockOptions:
    """Checks a functional call's ``block`` (:class:`~attention_core.weights.BlockOptions`)."""
    if not isinstance(block, BlockOptions):
        raise TypeError(f"block must be a BlockOptions, got {type(block).__name__}")
    return block if block is POST_NORM else block.checked()


def _with_scale(options: HeadOptions | None, scale: float | None) -> HeadOptions:
    """The attention options of an encoder call: ``options``, with ``scale`` if given."""
    options = CLASSIC if options is None else options
    return options if scale is None else dataclasses.replace(options, scale=scale)


def transformer_encoder_block(
    X: Array,
    weights: Mapping[str, Array],
    num_heads: int,
    valid_lens: Any = None,
    *,
    mask: Any = None,
    causal: bool = False,
    score_bias: Any = None,
    dropout: float = 0.0,
    return_weights: bool | str = False,
    implementation: str | None = None,
    scale: float | None = None,
    options: HeadOptions | None = None,
    block: BlockOptions = POST_NORM,
    ops: Ops | None = None,
) -> Array | tuple[Array, Array]:
    """One Transformer encoder block, post-norm or pre-norm.

    ``Y = AddNorm1(X, MHA(X, X, X))``, then ``AddNorm2(Y, FFN(Y))``; with
    ``block.norm_first``, ``Y = X + MHA(N1(X))`` and ``Y + FFN(N2(Y))``, N1 and N2 the norms
    ``addnorm1`` and ``addnorm2``.

    Args:
        X: ``(B, T, h)``.
        weights: ``attention.*``, ``addnorm1.*``, ``ffn.*``, ``addnorm2.*`` (the canonical
            layout, on the Weights page),
            all of width h = the output size of ``attention.W_q.kernel`` (``attention.sinks
            (H,)`` too for attention sinks); checked like ``set_weights`` checks a layer's
            (and ``X``'s width against h).
        num_heads: Heads of the self-attention.
        valid_lens: Integer lengths of ``X``, ``(B,)`` or ``(B, T)``.
        mask: Boolean self-attention mask, True = may attend.
        causal: Position i attends to positions j <= i only.
        score_bias: Float, broadcastable to ``(B, H, T, T)``, added to the self-attention's
            scores.
        dropout: Dropout rate of the attention weights and both residual branches.
        return_weights: Also return the self-attention weights ``(B, H, T, T)``; see
            :func:`attention_core.attention.dot_product_attention` for ``ON_READ``.
        implementation: How the heads pool; see
            :func:`~attention_core.attention.dot_product_attention`.
        scale: Multiplies the self-attention's scores; None for ``1 / sqrt(h/H)``.
        options: The self-attention's :class:`~attention_core.multihead.HeadOptions`
            (grouped-query heads, rotary or ALiBi positions, window, soft-capping); ``scale``,
            if given, replaces theirs.
        block: The norms and FFN (:class:`~attention_core.weights.BlockOptions`).
        ops: The backend's ops; found from ``X`` when omitted.

    Returns:
        ``(B, T, h)``, and the attention weights if asked.
    """
    ops = ops or ops_for(X, "X")
    block = check_block_options(block)
    options = _with_scale(options, scale)
    checks.check_floating(ops, "X", X)
    weights = W.check_call_weights(
        ops, "transformer_encoder_block", weights,
        lambda size: W.with_sinks(W.block_call_spec(size, weights, num_heads,
                                                    num_kv_heads=options.num_kv_heads,
                                                    block=block), weights, num_heads),
        {"X": (X, "attention.W_q.kernel")},
    )

    def attend(Y: Array) -> Any:
        return multi_head_attention(
            Y, Y, Y, subset(weights, "attention"), num_heads, valid_lens,
            mask=mask, causal=causal, score_bias=score_bias, dropout=dropout,
            return_weights=return_weights, implementation=implementation, ops=ops,
            **options.kwargs(),
        )

    Y, attn = _residual(ops, X, attend, subset(weights, "addnorm1"), dropout, block,
                        bool(return_weights))
    out, _ = _residual(ops, Y, lambda Z: _ffn(ops, Z, subset(weights, "ffn"), block.activation),
                       subset(weights, "addnorm2"), dropout, block, False)
    return (out, attn) if return_weights else out


def _ids_side(weights: Mapping[str, Array]) -> str | None:
    """How a stack names its token ids in messages; None when they are checked already.

    ``""`` names them ``tokens``. A call given :class:`~attention_core.weights.CheckedWeights`
    comes from a caller that checked its inputs: a layer, before making its weights, or the
    encoder-decoder.
    """
    return None if isinstance(weights, W.CheckedWeights) else ""


def check_token_ids(tokens: Array, vocab_size: int, *, ops: Ops, side: str = "") -> str:
    """Checks token ids ``(B, T)``: integers, each in ``[0, vocab_size)`` when the values are known.

    Args:
        tokens: The ids: an array of the backend, or host data (NumPy, another framework's
            array, nested lists: :func:`host_ids`), checked as given.
        vocab_size: V.
        ops: The backend's ops.
        side: ``"src"`` or ``"tgt"`` for an encoder-decoder's inputs (the messages then name
            ``src_tokens`` and ``src_vocab_size``, ...); empty for a single stack's.

    Returns:
        The ids' dtype name.
    """
    name, vocab = (f"{side}_tokens", f"{side}_vocab_size") if side else ("tokens", "vocab_size")
    host = None if masks.own(ops, tokens) else host_ids(name, tokens)
    shape = tuple(ops.shape(tokens)) if host is None else host.shape
    dtype = ops.dtype_name(tokens) if host is None else host.dtype.name
    check_ids_form(name, shape, dtype)
    values = ops.concrete(tokens) if host is None else host
    if values is not None and values.size:
        if values.size <= 64:  # a decode step's few ids: Python's min and max are quicker
            flat = values.ravel().tolist()
            low, high = min(flat), max(flat)
        else:
            low, high = values.min(), values.max()
        if low < 0 or high >= vocab_size:
            bad = int(low) if low < 0 else int(high)
            raise ValueError(f"{name} must be in [0, {vocab}) = [0, {vocab_size}), got {bad}")
    return dtype


def check_ids_form(name: str, shape: tuple[Any, ...], dtype: str) -> None:
    """Checks that token ids ``name`` of ``shape`` and ``dtype`` are integers ``(B, T)``."""
    checks.check_rank_of(name, shape, (2,), "(B, T) token ids")
    if not dtype.startswith(("int", "uint")):
        raise TypeError(f"{name} must be integer token ids, got dtype {dtype}")


def host_ids(name: str, tokens: Any) -> np.ndarray:
    """Token ids given as host data (NumPy, nested lists, another framework's array) as NumPy.

    Raises:
        ValueError: Nested lists whose rows differ in length.
    """
    ragged = ValueError(f"{name} must have shape (B, T) token ids, got nested lists whose rows "
                        "differ in length")
    if isinstance(tokens, (list, tuple)) and len({
            len(row) if isinstance(row, (list, tuple)) else None for row in tokens}) > 1:
        raise ragged  # NumPy before 2 would make an object array of them
    try:
        return host_array(tokens)
    except ValueError:  # NumPy refuses ragged nested lists
        raise ragged from None


def backend_ids(ops: Ops, tokens: Any) -> Array:
    """Checked token ids as the backend's array: host data become int32 (each id < V)."""
    if masks.own(ops, tokens):
        return tokens
    return ops.from_numpy(np.asarray(host_array(tokens)).astype(np.int32))


def embed_tokens(tokens: Array, table: Array, *, ops: Ops, side: str | None = "") -> Array:
    """Looks up token ids in an embedding table, checking them first.

    Args:
        tokens: Integer ids ``(B, T)``, each in ``[0, V)``.
        table: ``(V, h)``.
        ops: The backend's ops.
        side: The ids' side in the messages (:func:`check_token_ids`); None when the caller
            has checked them (a layer, before making its weights).

    Returns:
        ``(B, T, h)``.

    Ids of any integer dtype are taken (int8 to uint64); those other than int32 and int64 are
    cast to int32 for the lookup, after the range check. Ids whose values are not read (on an
    accelerator, JAX arrays, traced) are checked on the device instead: an id outside
    ``[0, V)`` gives a row of NaN, never another token's row.
    """
    dtype = (ops.dtype_name(tokens) if side is None
             else check_token_ids(tokens, fixed_shape(ops, table)[0], ops=ops, side=side))
    if dtype not in ("int32", "int64"):  # every framework's lookup takes these two
        tokens = ops.astype(tokens, "int32")  # ids < vocab_size, which int32 holds
    if ops.concrete(tokens) is not None:  # checked on the host
        return ops.take(table, tokens)
    inside = ops.logical_and(tokens >= 0, tokens < fixed_shape(ops, table)[0])
    rows = ops.take(table, ops.where(inside, tokens, 0))
    return ops.where(ops.expand_dims(inside, -1), rows, math.nan)


def embed_with_positions(
    tokens: Array, table: Array, dropout: float, positions: Array | None, max_len: int | None,
    *, ops: Ops, start: Any = 0, side: str | None = "", scale_embeddings: bool = True,
) -> Array:
    """``dropout(E[tokens] * sqrt(h) + P)``: a stack's input, as the encoder and decoder make it.

    The scale brings the embeddings to the size of the table's entries, which lie in [-1, 1].

    Args:
        tokens: Integer ids ``(B, T)``.
        table: The embedding ``(V, h)``.
        dropout: Dropout rate of the sum.
        positions: The sinusoidal table ``(1, T', h)``, ``T' >= T``, sliced to its first T
            rows; made here when None, of ``max_len`` rows (T when None and T is known, else
            1000).
        max_len: See ``positions``.
        ops: The backend's ops.
        start: The position of the first token (a cached decoder's step): rows
            ``start .. start + T - 1`` of ``positions`` are added. An int or an integer scalar
            array, checked by the caller; or each token's own position, integers ``(B, T)``
            (a ragged batch).
        side: See :func:`embed_tokens`.
        scale_embeddings: False leaves out the factor sqrt(h).

    Returns:
        ``(B, T, h)``.
    """
    X = _embedded(ops, tokens, table, side, scale_embeddings)
    per_token = not isinstance(start, int) and len(ops.shape(start)) == 2
    at_zero = isinstance(start, int) and start == 0
    if positions is None and at_zero:
        return positional_encoding(X, dropout, max_len=max_len, ops=ops)
    if positions is None:  # a step at a later position: the table's first rows up to it
        if max_len is None:
            raise ValueError("positions or max_len is required when start is not 0")
        table = sinusoidal_encoding(max_len, fixed_shape(ops, table)[1], ops.dtype_name(X))
        positions = ops.from_numpy(table[None], like=X)
    if per_token:  # each token's row of the table (positions checked by the caller)
        return _dropped(ops, X + ops.take(positions[0], start), dropout)
    steps, rows = ops.shape(tokens)[1], ops.shape(positions)[1]
    known = start if isinstance(start, int) else ops.concrete(start)
    if isinstance(steps, int) and known is not None and int(known) + steps > rows:
        raise ValueError(f"tokens have {steps} positions, more than max_len ({rows})" if at_zero
                         else f"tokens have positions up to {int(known) + steps - 1}, beyond "
                         f"max_len ({rows})")
    if not at_zero:  # rows start .. start + T - 1, looked up: start may be a run-time scalar
        positions = ops.expand_dims(ops.take(positions[0], ops.arange(steps) + start), 0)
    return add_positions(X, positions, dropout, ops=ops)


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
    scale: float | None = None,
    options: HeadOptions | None = None,
    block: BlockOptions = POST_NORM,
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
        scale: Multiplies every block's attention scores; None for ``1 / sqrt(h/H)``.
        options: Every block's self-attention options (see
            :func:`transformer_encoder_block`). With rotary or ALiBi positions the attention
            places the tokens, and no sinusoidal table is added.
        block: Every block's norms and FFN, and the stack's: with ``norm_first`` the output
            is normalised last by ``norm.*``; ``scale_embeddings`` (see
            :class:`~attention_core.weights.BlockOptions`).
        ops: The backend's ops; found from ``tokens`` when omitted.

    Returns:
        ``(B, T, h)``, and the list of the blocks' attention weights if asked.
    """
    ops = ops or ops_for(tokens, "tokens")
    block = check_block_options(block)
    options = _with_scale(options, scale)
    side = _ids_side(weights)
    weights = W.check_call_weights(
        ops, "transformer_encoder", weights,
        lambda size: W.with_sinks(W.encoder_call_spec(size, weights, num_heads,
                                                      num_kv_heads=options.num_kv_heads,
                                                      block=block), weights, num_heads))
    X = _decoder_input(ops, tokens, weights["token.embedding"], dropout, positions, max_len, 0,
                       side, options, block)
    attention_weights = []
    for i in range(W.count_blocks(weights)):
        result = transformer_encoder_block(
            X, subset(weights, f"blks.{i}"), num_heads, valid_lens, mask=mask, dropout=dropout,
            return_weights=return_weights, implementation=implementation, options=options,
            block=block, ops=ops,
        )
        X, attn = result if return_weights else (result, None)
        attention_weights.append(attn)
    X = _final_norm(ops, X, weights, block)
    return (X, attention_weights) if return_weights else X


def transformer_decoder_block(
    X: Array,
    weights: Mapping[str, Array],
    num_heads: int,
    enc_outputs: Array | None = None,
    enc_valid_lens: Any = None,
    *,
    valid_lens: Any = None,
    mask: Any = None,
    enc_mask: Any = None,
    past: Array | None = None,
    dropout: float = 0.0,
    return_weights: bool | str = False,
    implementation: str | None = None,
    options: HeadOptions = CLASSIC,
    block: BlockOptions = POST_NORM,
    cache: Any = None,
    start: Any = 0,
    capacity: int | None = None,
    lengths: Any = None,
    padding: str = "right",
    padding_mask: Any = None,
    ops: Ops | None = None,
) -> Any:
    """One Transformer decoder block, with or without cross-attention, post- or pre-norm.

    ``Y = AddNorm1(X, MHA_self(X, X, X, causal))``; with cross-attention (the mapping holds
    ``cross_attention.*``) ``Z = AddNorm2(Y, MHA_cross(Y, E, E))`` over the encoder outputs
    ``E``, then ``AddNorm3(Z, FFN(Z))``; without it (decoder-only, GPT-style)
    ``AddNorm2(Y, FFN(Y))``. Each add & norm is numbered by the sublayer it follows. With
    ``block.norm_first`` each sublayer takes its norm's output instead, and adds to its input
    (``Y = X + MHA_self(N1(X))``, ...).

    Args:
        X: ``(B, T, h)``.
        weights: ``self_attention.*``, ``addnorm1.*``, then ``cross_attention.*`` and
            ``addnorm2.*`` when the block has cross-attention, then ``ffn.*`` and the last add &
            norm (the canonical layout, on the Weights page); all of width h = the output size of
            ``self_attention.W_q.kernel``, except ``cross_attention.W_k``/``W_v``, whose input
            size is the encoder outputs' width; checked like ``set_weights`` checks a layer's.
        num_heads: Heads of both attentions.
        enc_outputs: The encoder's outputs ``(B, S, h_enc)``; required with cross-attention,
            refused without it.
        enc_valid_lens: Integer lengths of the encoder outputs, ``(B,)`` or ``(B, T)``.
        valid_lens: Integer lengths of ``X`` as keys, ``(B,)`` or ``(B, T)``; the self-attention
            is causal whatever they are.
        mask: Boolean self-attention mask, True = may attend, combined with the causal one.
        enc_mask: Boolean cross-attention mask ``(T, S)``, ``(B, T, S)`` or ``(B, H, T, S)``.
        past: The block's earlier inputs ``(B, P, h)``, as the d2l book's prediction loop
            keeps them: the self-attention's keys and values are then ``concat(past, X)`` and
            ``X``'s rows are positions ``P .. P + T - 1`` (the causal rule aligns them at the
            end). ``valid_lens`` and ``mask`` then describe those ``P + T`` keys.
        dropout: Dropout rate of the attention weights and of every residual branch.
        return_weights: Also return the list of the block's attention weights: the
            self-attention's ``(B, H, T, T)``, then the cross-attention's ``(B, H, T, S)`` when
            the block has one; see :func:`attention_core.attention.dot_product_attention` for
            ``ON_READ``.
        implementation: How the heads pool; see
            :func:`~attention_core.attention.dot_product_attention`.
        options: The self-attention's :class:`~attention_core.multihead.HeadOptions`
            (grouped-query heads, rotary or ALiBi positions, window, soft-capping); the
            cross-attention is the classic one, but for ``options.scale``, which both take.
            Each attention has sinks when the mapping holds its ``sinks``.
        block: The norms and FFN (:class:`~attention_core.weights.BlockOptions`).
        cache: With ``capacity``, makes the call one against a key/value cache: ``X`` holds
            positions ``start ..`` and the call returns ``(output, cache)``
            (:func:`cached_decoder_block`, whose arguments ``cache`` to ``padding_mask`` are).
        start: See :func:`cached_decoder_block`.
        capacity: See :func:`cached_decoder_block`.
        lengths: See :func:`~attention_core.multihead.multi_head_attention`.
        padding: See :func:`~attention_core.multihead.multi_head_attention`.
        padding_mask: See :func:`~attention_core.multihead.multi_head_attention`.
        ops: The backend's ops; found from ``X`` when omitted.

    Returns:
        ``(B, T, h)``, and the list of weights if asked; a cached call ``(that, cache)``.
    """
    ragged = ragged_arguments(cache, capacity, lengths, padding, padding_mask)
    if cache is not None or capacity is not None:
        refuse_in_cached_call(valid_lens=valid_lens, mask=mask, past=past)
        return cached_decoder_block(
            X, weights, num_heads, cache, start, enc_outputs, enc_valid_lens, enc_mask=enc_mask,
            capacity=capacity, dropout=dropout, return_weights=return_weights,
            implementation=implementation, options=options, block=block, ragged=ragged, ops=ops)
    ops = ops or ops_for(X, "X")
    block = check_block_options(block)
    weights = _checked_block(ops, X, weights, num_heads, enc_outputs, cached_cross=False,
                             num_kv_heads=options.num_kv_heads, block=block)
    if enc_outputs is not None:
        check_cross_masks(ops, X, num_heads, ops.shape(enc_outputs)[1], enc_valid_lens,
                          enc_mask)
    if past is not None:
        checks.check_framework("X", X, past=past)
        checks.check_same_dtype(ops, "X", X, past=past)
        checks.check_rank(ops, "past", past, (3,), "(B, P, h)")
        checks.check_batch(ops, "past", past, "X", X)
        checks.check_last_dim(ops, "past", past, ops.shape(X)[-1])

    def attend_self(Y: Array) -> Any:
        # the block's earlier inputs, normalised as its own when pre-norm
        keys = Y if past is None else ops.concatenate([_pre_norm(ops, past, weights, block), Y],
                                                      1)  # (B, P + T, h)
        return multi_head_attention(
            Y, keys, keys, subset(weights, "self_attention"), num_heads, valid_lens, mask=mask,
            causal=True, dropout=dropout, return_weights=return_weights,
            implementation=implementation, ops=ops, **options.kwargs(),
        )

    def attend_cross(Y: Array) -> Any:
        return multi_head_attention(
            Y, enc_outputs, enc_outputs, subset(weights, "cross_attention"), num_heads,
            enc_valid_lens, mask=enc_mask, dropout=dropout, return_weights=return_weights,
            implementation=implementation, scale=options.scale, ops=ops,
        )

    out, kept = _decoder_sublayers(ops, X, weights, attend_self, attend_cross, dropout,
                                   bool(return_weights), block)
    return (out, kept) if return_weights else out


def _pre_norm(ops: Ops, past: Array, weights: Mapping[str, Array], block: BlockOptions) -> Array:
    """A decoder block's earlier inputs as its self-attention reads them: ``N1(past)`` if pre-norm."""
    if not block.norm_first:
        return past
    return normalise(ops, past, subset(weights, "addnorm1"), block.norm, block.norm_eps)


def cached_decoder_block(
    X: Array,
    weights: Mapping[str, Array],
    num_heads: int,
    cache: Any = None,
    start: Any = 0,
    enc_outputs: Array | None = None,
    enc_valid_lens: Any = None,
    *,
    enc_mask: Any = None,
    capacity: int | None = None,
    dropout: float = 0.0,
    return_weights: bool | str = False,
    implementation: str | None = None,
    options: HeadOptions = CLASSIC,
    block: BlockOptions = POST_NORM,
    ragged: Mapping[str, Any] | None = None,
    ops: Ops | None = None,
    _stacked: bool = False,
) -> tuple[Array | tuple[Array, list[Array]], tuple[Any, ...]]:
    """A decoder block over ``t`` new positions, against its key/value cache.

    Equal to :func:`transformer_decoder_block` on the whole sequence, row for row: the
    self-attention is :func:`~attention_core.multihead.cached_heads`, and the
    cross-attention's keys and values, projected from ``enc_outputs`` by the call that makes
    the cache, are kept in it.

    Args:
        X: ``(B, t, h)``, positions ``start .. start + t - 1``.
        weights: Those of :func:`transformer_decoder_block`.
        num_heads: Heads of both attentions.
        cache: The block's cache from an earlier call: ``(self_pair,)``, or
            ``(self_pair, cross_pair)`` with cross-attention, each pair ``(keys, values)``
            ``(B, Hkv or H, C or S, h/H)``; None to make one of ``capacity`` rows.
        start: The position of ``X``'s first row: an int or an integer scalar array; or
            one per example ``(B,)``; or the :class:`~attention_core.cache.Positions` a stack
            placed for its blocks.
        enc_outputs: ``(B, S, h_enc)``: required when the block has cross-attention and the
            cache is made now; when the cache holds their projections it is not read.
        enc_valid_lens: See :func:`transformer_decoder_block`; given at every call.
        enc_mask: See :func:`transformer_decoder_block`, ``(t, S)``, ``(B, t, S)`` or
            ``(B, H, t, S)`` for these rows.
        capacity: C of a cache made now.
        dropout: See :func:`transformer_decoder_block`.
        return_weights: Also return ``[self (B, H, t, C), cross (B, H, t, S)]``.
        implementation: How the heads pool.
        options: See :func:`transformer_decoder_block`.
        block: See :func:`transformer_decoder_block`.
        ragged: A ragged batch's ``lengths``, ``padding`` or ``padding_mask``, with ``start``
            one position per example (:func:`~attention_core.multihead.multi_head_attention`).
        ops: The backend's ops; found from ``X`` when omitted.
        _stacked: Internal: a stack's call, which checked the heads, the options, the weights
            and the caches of its blocks (the encoder outputs' widths are checked here).

    Returns:
        ``(output, cache)``: as :func:`transformer_decoder_block` returns, and the new cache.
    """
    ops = ops or ops_for(X, "X")
    crossed = "cross_attention.W_q.kernel" in weights
    cached_cross = cache is not None and crossed
    if not _stacked:
        block = check_block_options(block)
        if cache is not None:
            kv_cache.check_block_cache(ops, "cache", cache, crossed, ("X", X))
        if cached_cross:  # enc_outputs are not read, but if given they must be of this batch
            check_encoder_outputs(ops, enc_outputs, None, like=("X", X))
    if not _stacked or (crossed and not cached_cross):  # encoder outputs read: their widths
        weights = _checked_block(ops, X, weights, num_heads,
                                 None if cached_cross else enc_outputs, cached_cross=cached_cross,
                                 num_kv_heads=options.num_kv_heads, block=block)
    if crossed:
        keys = cache[1][0] if cached_cross else enc_outputs
        check_cross_masks(ops, X, num_heads, ops.shape(keys)[-2], enc_valid_lens, enc_mask)
    new_cache: list[Any] = []

    def attend_self(Y: Array) -> Any:
        result, pair = cached_heads(
            ops, Y, Y, Y, subset(weights, "self_attention"), num_heads,
            None if cache is None else cache[0], start, capacity=capacity, dropout=dropout,
            return_weights=return_weights, implementation=implementation, options=options,
            ragged=ragged, checked=_stacked,
        )
        new_cache.append(pair)
        return result

    def attend_cross(Y: Array) -> Any:
        cross = subset(weights, "cross_attention")
        if cache is not None and cached_cross:
            depth = fixed_shape(ops, cross["W_q.kernel"])[-1] // num_heads
            pair = kv_cache.check_pair(ops, "cache cross pair", cache[1],
                                       (ops.shape(Y)[0], num_heads, depth), ops.dtype_name(Y))
        else:
            pair = (heads(ops, enc_outputs, cross, "W_k", num_heads),
                    heads(ops, enc_outputs, cross, "W_v", num_heads))
        new_cache.append(pair)
        return pool_heads(ops, Y, pair, cross, num_heads, enc_valid_lens, mask=enc_mask,
                          dropout=dropout, return_weights=return_weights,
                          implementation=implementation,
                          options=HeadOptions(scale=checks.check_scale(options.scale)))

    out, kept = _decoder_sublayers(ops, X, weights, attend_self, attend_cross, dropout,
                                   bool(return_weights), block)
    return ((out, kept) if return_weights else out), tuple(new_cache)


def _checked_block(ops: Ops, X: Array, weights: Mapping[str, Array], num_heads: int,
                   enc_outputs: Array | None, *, cached_cross: bool,
                   num_kv_heads: int | None = None, block: BlockOptions = POST_NORM
                   ) -> W.CheckedWeights:
    """A decoder block's weights checked against ``X`` and the encoder outputs (if read)."""
    checks.check_floating(ops, "X", X)
    crossed = "cross_attention.W_q.kernel" in weights
    check_encoder_outputs(ops, enc_outputs, crossed and not cached_cross, like=("X", X))
    inputs = {"X": (X, "self_attention.W_q.kernel")}
    if enc_outputs is not None:
        inputs["enc_outputs"] = (enc_outputs, "cross_attention.W_k.kernel")
    return W.check_call_weights(
        ops, "transformer_decoder_block", weights,
        lambda size: W.with_sinks(W.decoder_block_call_spec(size, weights, num_heads,
                                                            num_kv_heads=num_kv_heads,
                                                            block=block),
                                  weights, num_heads), inputs,
    )


def _decoder_sublayers(
    ops: Ops, X: Array, weights: Mapping[str, Array], attend_self: Callable[[Array], Any],
    attend_cross: Callable[[Array], Any], dropout: float, with_weights: bool,
    block: BlockOptions = POST_NORM,
) -> tuple[Array, list[Array]]:
    """A decoder block's sublayers in order, given its two attentions (full or cached).

    Each with its residual connection and norm, post-norm or pre-norm (:func:`_residual`).

    Returns:
        The output, and the attention weights the attentions returned (when ``with_weights``).
    """
    Y, self_weights = _residual(ops, X, attend_self, subset(weights, "addnorm1"), dropout,
                                block, with_weights)
    kept = [self_weights]
    last = "addnorm2"
    if "cross_attention.W_q.kernel" in weights:
        Y, cross_weights = _residual(ops, Y, attend_cross, subset(weights, "addnorm2"), dropout,
                                     block, with_weights)
        kept.append(cross_weights)
        last = "addnorm3"
    out, _ = _residual(ops, Y, lambda Z: _ffn(ops, Z, subset(weights, "ffn"), block.activation),
                       subset(weights, last), dropout, block, False)
    return out, kept


def check_encoder_outputs(ops: Ops, enc_outputs: Array | None, crossed: bool | None,
                          like: tuple[str, Array]) -> None:
    """Checks that ``enc_outputs`` are given exactly when the block attends to them.

    Args:
        ops: The backend's ops.
        enc_outputs: ``(B, S, h)`` or None.
        crossed: Whether the decoder attends to them; None when it may do without (a cached
            call whose cache holds their projections).
        like: The decoder's input and its name (``X``, ``tokens``): its batch is theirs.
    """
    if enc_outputs is not None:
        backend_of(enc_outputs, "enc_outputs")  # an array, before its shape is read
    if crossed and enc_outputs is None:
        raise ValueError("enc_outputs is required: this decoder has cross-attention "
                         "(cross_attention.* weights); got None")
    if crossed is False and enc_outputs is not None:
        raise ValueError("enc_outputs must be None for a decoder-only block (no "
                         "cross_attention.* weights), got an array of shape "
                         f"{checks.fmt_shape(ops.shape(enc_outputs))}")
    if enc_outputs is not None:
        checks.check_rank(ops, "enc_outputs", enc_outputs, (3,), "(B, S, h)")
        checks.check_floating(ops, "enc_outputs", enc_outputs)
        checks.check_batch(ops, "enc_outputs", enc_outputs, *like)


def check_cross_masks(ops: Ops, X: Array, num_heads: int, keys: Any, enc_valid_lens: Any,
                      enc_mask: Any) -> None:
    """Checks the cross-attention's lengths and mask, named as the decoder takes them.

    Args:
        ops: The backend's ops.
        X: The decoder's input or token ids, ``(B, T, ...)``: the cross-attention's queries.
        num_heads: H.
        keys: S, the encoder outputs' length.
        enc_valid_lens: Their lengths, ``(B,)`` or ``(B, T)``, or None.
        enc_mask: The boolean cross-attention mask, or None.
    """
    scores = (*ops.shape(X)[:2], keys)
    scores = (scores[0], num_heads, scores[1], scores[2])  # (B, H, T, S)
    if enc_valid_lens is not None:
        masks.lens_column(ops, enc_valid_lens, scores, name="enc_valid_lens")
    if enc_mask is not None:
        masks.boolean_mask(ops, enc_mask, scores, name="enc_mask")


def transformer_decoder(
    tokens: Array,
    weights: Mapping[str, Array],
    num_heads: int,
    enc_outputs: Array | None = None,
    enc_valid_lens: Any = None,
    *,
    valid_lens: Any = None,
    mask: Any = None,
    enc_mask: Any = None,
    dropout: float = 0.0,
    return_weights: bool | str = False,
    implementation: str | None = None,
    positions: Array | None = None,
    max_len: int | None = None,
    options: HeadOptions = CLASSIC,
    block: BlockOptions = POST_NORM,
    cache: Any = None,
    start: Any = 0,
    capacity: int | None = None,
    lengths: Any = None,
    padding: str = "right",
    padding_mask: Any = None,
    ops: Ops | None = None,
) -> Any:
    """The Transformer decoder: embed, scale, add positions, the blocks, then the vocabulary.

    ``X = dropout(E[tokens] * sqrt(h) + P)``, ``X = block_i(X, enc_outputs)`` for each block,
    and the logits ``X @ dense.kernel + dense.bias``. ``block`` may leave out the scale and
    the bias, normalise ``X`` last (pre-norm) and tie the output to the embedding
    (``X @ token.embedding^T``).

    Args:
        tokens: Integer ids ``(B, T)``.
        weights: ``token.embedding (V, h)``, ``blks.<i>.*`` for each block
            (:func:`transformer_decoder_block`'s names, every block with cross-attention or
            none), ``dense.kernel (h, V_out)`` and ``dense.bias (V_out,)``.
        num_heads: Heads of every attention.
        enc_outputs: ``(B, S, h_enc)``; required when the blocks have cross-attention.
        enc_valid_lens: Integer lengths of the encoder outputs.
        valid_lens: Integer lengths of the tokens as keys (the self-attention is causal).
        mask: Boolean self-attention mask, combined with the causal one.
        enc_mask: Boolean cross-attention mask.
        dropout: Dropout rate of the positional encoding's sum and inside every block.
        return_weights: Also return the blocks' self-attention weights, one per block, and
            with cross-attention their cross-attention weights: ``[self, cross]`` as the d2l
            book's decoder keeps them (``[self]`` for a decoder-only stack).
        implementation: How the heads pool.
        positions: The sinusoidal table ``(1, T', h)``, ``T' >= T``; made here when None.
        max_len: Rows of the table made here when ``positions`` is None.
        options: Every block's self-attention options (see
            :func:`transformer_decoder_block`). With rotary or ALiBi positions the attention
            places the tokens, and no sinusoidal table is added.
        block: Every block's norms and FFN, and the stack's: the final norm
            ``final_norm.*`` with ``norm_first``, ``output_bias``, ``tie_output``,
            ``scale_embeddings`` (see :class:`~attention_core.weights.BlockOptions`).
        cache: With ``capacity``, makes the call one against the blocks' key/value caches:
            ``tokens`` are positions ``start ..`` and the call returns ``(logits, cache)``
            (:func:`cached_decoder`, whose arguments ``cache`` to ``padding_mask`` are).
        start: See :func:`cached_decoder`.
        capacity: See :func:`cached_decoder`.
        lengths: See :func:`cached_decoder`.
        padding: See :func:`cached_decoder`.
        padding_mask: See :func:`cached_decoder`.
        ops: The backend's ops; found from ``tokens`` when omitted.

    Returns:
        The logits ``(B, T, V_out)``, and the weights if asked; a cached call
        ``(that, cache)``.
    """
    ragged_arguments(cache, capacity, lengths, padding, padding_mask)
    if cache is not None or capacity is not None:
        refuse_in_cached_call(valid_lens=valid_lens, mask=mask)
        return cached_decoder(
            tokens, weights, num_heads, cache, start, enc_outputs, enc_valid_lens,
            enc_mask=enc_mask, capacity=capacity, dropout=dropout, return_weights=return_weights,
            implementation=implementation, positions=positions, max_len=max_len,
            options=options, block=block, lengths=lengths, padding=padding,
            padding_mask=padding_mask, ops=ops)
    ops = ops or ops_for(tokens, "tokens")
    block = check_block_options(block)
    side = _ids_side(weights)
    weights = _checked_decoder(ops, weights, num_heads, options, block)
    check_encoder_outputs(ops, enc_outputs, "blks.0.cross_attention.W_q.kernel" in weights,
                          like=("tokens", tokens))
    X = _decoder_input(ops, tokens, weights["token.embedding"], dropout, positions, max_len, 0,
                       side, options, block)
    kept: list[list[Array]] = []
    for i in range(W.count_blocks(weights)):
        result = transformer_decoder_block(
            X, subset(weights, f"blks.{i}"), num_heads, enc_outputs, enc_valid_lens,
            valid_lens=valid_lens, mask=mask, enc_mask=enc_mask, dropout=dropout,
            return_weights=return_weights, implementation=implementation, options=options,
            block=block, ops=ops,
        )
        X, formed = result if return_weights else (result, [])
        kept = _collected(kept, formed)
    logits = _logits(ops, _final_norm(ops, X, weights, block), weights, block)
    return (logits, kept) if return_weights else logits


def _checked_decoder(ops: Ops, weights: Mapping[str, Array], num_heads: int,
                     options: HeadOptions, block: BlockOptions) -> W.CheckedWeights:
    """A decoder stack's weights, checked (:func:`~attention_core.weights.decoder_call_spec`)."""
    return W.check_call_weights(
        ops, "transformer_decoder", weights,
        lambda size: W.with_sinks(W.decoder_call_spec(size, weights, num_heads,
                                                      num_kv_heads=options.num_kv_heads,
                                                      block=block),
                                  weights, num_heads))


def _final_norm(ops: Ops, X: Array, weights: Mapping[str, Array], block: BlockOptions) -> Array:
    """A stack's output: ``X``, normalised by ``final_norm.*`` when pre-norm."""
    if not block.norm_first:
        return X
    return normalise(ops, X, subset(weights, "final_norm"), block.norm, block.norm_eps)


def _logits(ops: Ops, X: Array, weights: Mapping[str, Array], block: BlockOptions) -> Array:
    """A decoder stack's logits: ``X @ dense.kernel`` (or ``token.embedding^T``) ``+ dense.bias``."""
    kernel = (ops.transpose(weights["token.embedding"], (1, 0)) if block.tie_output
              else weights["dense.kernel"])
    return dense(ops, X, kernel, weights.get("dense.bias"))


def _embedded(ops: Ops, tokens: Array, table: Array, side: str | None,
              scale_embeddings: bool) -> Array:
    """``E[tokens]``, times sqrt(h) if ``scale_embeddings``."""
    X = embed_tokens(tokens, table, ops=ops, side=side)
    return X * math.sqrt(fixed_shape(ops, table)[1]) if scale_embeddings else X


def _decoder_input(
    ops: Ops, tokens: Array, table: Array, dropout: float, positions: Array | None,
    max_len: int | None, start: Any, side: str | None, options: HeadOptions,
    block: BlockOptions = POST_NORM,
) -> Array:
    """A stack's input: :func:`embed_with_positions`, or without the sinusoidal table.

    No table when the self-attention places the tokens itself (rotary or ALiBi positions).
    A sequence split across devices (``options.context_parallel``) adds the table's rows of
    this device's positions.
    """
    if options.positional is None and options.context_parallel is not None:
        start = _split_start(ops, options.context_parallel, tokens, positions, max_len)
    if options.positional is None:
        return embed_with_positions(tokens, table, dropout, positions, max_len, ops=ops,
                                    start=start, side=side,
                                    scale_embeddings=block.scale_embeddings)
    X = _embedded(ops, tokens, table, side, block.scale_embeddings)
    return _dropped(ops, X, dropout)


def _split_start(ops: Ops, split: Any, tokens: Array, positions: Array | None,
                 max_len: int | None) -> Array:
    """This device's token positions ``(1, T)`` in the whole split sequence, checked."""
    steps = ops.shape(tokens)[1]
    rows = max_len if positions is None else ops.shape(positions)[1]
    whole = steps * split.size()
    if isinstance(rows, int) and whole > rows:
        raise ValueError(f"tokens have {whole} positions (the whole sequence over "
                         f"{split.size()} devices), more than max_len ({rows})")
    return ops.expand_dims(split.positions(ops, steps), 0)


def _collected(kept: list[list[Array]], formed: list[Array]) -> list[list[Array]]:
    """A stack's kept weights, one list per kind of attention, with one more block's added."""
    kept = kept or [[] for _ in formed]
    for per_kind, weights_i in zip(kept, formed, strict=True):
        per_kind.append(weights_i)
    return kept


def cached_decoder(
    tokens: Array,
    weights: Mapping[str, Array],
    num_heads: int,
    cache: Any = None,
    start: Any = 0,
    enc_outputs: Array | None = None,
    enc_valid_lens: Any = None,
    *,
    enc_mask: Any = None,
    capacity: int | None = None,
    dropout: float = 0.0,
    return_weights: bool | str = False,
    implementation: str | None = None,
    positions: Array | None = None,
    max_len: int | None = None,
    options: HeadOptions = CLASSIC,
    block: BlockOptions = POST_NORM,
    lengths: Any = None,
    padding: str = "right",
    padding_mask: Any = None,
    ops: Ops | None = None,
) -> tuple[Array | tuple[Array, list[list[Array]]], list[Any]]:
    """The decoder over ``t`` new positions, each block against its key/value cache.

    Equal to :func:`transformer_decoder` on the whole sequence, row for row (see
    :func:`cached_decoder_block`). A first call (``cache`` None) on the first ``t`` tokens
    (a prompt, or the start token) makes the caches of ``capacity`` rows; each later call
    passes the cache it returned and the position of its first token.

    Args:
        tokens: Integer ids ``(B, t)``, positions ``start .. start + t - 1``.
        weights: Those of :func:`transformer_decoder`.
        num_heads: Heads of every attention.
        cache: One block cache per block (:func:`cached_decoder_block`), or None.
        start: The position of the first token: an int or an integer scalar array; or one
            per example ``(B,)``, a ragged batch.
        enc_outputs: ``(B, S, h_enc)``, required when the cache is made with cross-attention.
        enc_valid_lens: Integer lengths of the encoder outputs, given at every call.
        enc_mask: Boolean cross-attention mask of these rows.
        capacity: C of the caches made now: the longest sequence the calls will reach.
        dropout: See :func:`transformer_decoder`.
        return_weights: Also return ``[self, cross]``, one list of per-block weights each.
        implementation: How the heads pool.
        positions: The sinusoidal table ``(1, T', h)``, ``T' >= start + t``; made here when
            None (``start`` must then be 0).
        max_len: Rows of the table made here when ``positions`` is None.
        options: See :func:`transformer_decoder`.
        block: See :func:`transformer_decoder`.
        lengths: A ragged batch's real tokens per example ``(B,)``, the rest padding
            (:func:`~attention_core.multihead.multi_head_attention`).
        padding: Where the padding of ``lengths`` sits, ``"right"`` or ``"left"``.
        padding_mask: Boolean ``(B, t)``, True at the real tokens, in place of ``lengths``.
        ops: The backend's ops; found from ``tokens`` when omitted.

    Returns:
        ``(logits, cache)``: the logits ``(B, t, V_out)`` (with the weights if asked) and
        the new cache, one block cache per block. The logits at padding are meaningless.
    """
    ops = ops or ops_for(tokens, "tokens")
    block = check_block_options(block)
    side = _ids_side(weights)
    weights = _checked_decoder(ops, weights, num_heads, options, block)
    blocks = W.count_blocks(weights)
    if cache is not None and (not isinstance(cache, (list, tuple)) or len(cache) != blocks):
        raise ValueError(f"cache must hold one block cache per block ({blocks}), got "
                         f"{len(cache) if isinstance(cache, (list, tuple)) else type(cache).__name__}")
    crossed = "blks.0.cross_attention.W_q.kernel" in weights
    for i, block_cache in enumerate(cache or ()):
        kv_cache.check_block_cache(ops, f"cache[{i}]", block_cache, crossed, ("tokens", tokens))
    check_encoder_outputs(ops, enc_outputs, None if cache else crossed, like=("tokens", tokens))
    held = None if cache is None else cache[0][0][0]  # block 0's self-attention keys
    ragged = ragged_arguments(cache, capacity, lengths, padding, padding_mask)
    window = checks.check_window(options.window)  # a ring holds the window: no bound
    rows = kv_cache.capacity_of(ops, held, capacity, window)
    for i, block_cache in enumerate(cache or ()):  # one placing serves every block
        held_i = ops.shape(block_cache[0][0])[2]
        if isinstance(held_i, int) and held_i != rows:
            raise ValueError(f"cache[{i}] self pair keys must have cache[0]'s {rows} rows (C), "
                             f"got {held_i}")
    rotary = options.positional == "rotary"
    at = kv_cache.placed(ops, start, ops.shape(tokens)[1], rows, batch=ops.shape(tokens)[0],
                         like=tokens, ring=kv_cache.is_ring(rows, window),
                         limit=ROTARY_MAX_POSITIONS if rotary else None, **ragged)
    X = _decoder_input(ops, tokens, weights["token.embedding"], dropout, positions, max_len,
                       at.query, side, options, block)
    width = fixed_shape(ops, weights["token.embedding"])[1]
    num_heads = checks.check_heads(width, num_heads)[1]  # the blocks' heads, checked once
    options = options.checked(num_heads)
    kept: list[list[Array]] = []
    new_cache = []
    for i in range(blocks):
        result, block_cache = cached_decoder_block(
            X, subset(weights, f"blks.{i}"), num_heads, None if cache is None else cache[i],
            at, enc_outputs, enc_valid_lens, enc_mask=enc_mask, capacity=capacity,
            dropout=dropout, return_weights=return_weights, implementation=implementation,
            options=options, block=block, ragged=ragged, ops=ops, _stacked=True,
        )
        new_cache.append(block_cache)
        X, formed = result if return_weights else (result, [])
        kept = _collected(kept, formed)
    logits = _logits(ops, _final_norm(ops, X, weights, block), weights, block)
    return ((logits, kept) if return_weights else logits), new_cache


def check_sequence_pair(ops: Ops, src_tokens: Array, tgt_tokens: Array, num_heads: int,
                        src_valid_lens: Any, tgt_valid_lens: Any) -> None:
    """Checks a source and target of one batch, and their lengths by their own names.

    The sources' lengths mask the encoder's keys (queries: the sources) and the
    cross-attention's (queries: the targets); the targets' the decoder's own keys.
    """
    checks.check_batch(ops, "tgt_tokens", tgt_tokens, "src_tokens", src_tokens)
    (B, S), T = ops.shape(src_tokens)[:2], ops.shape(tgt_tokens)[1]
    for name, lens, frames in (("src_valid_lens", src_valid_lens, ((S, S), (T, S))),
                               ("tgt_valid_lens", tgt_valid_lens, ((T, T),))):
        for queries, keys in (() if lens is None else frames):
            masks.lens_column(ops, lens, (B, num_heads, queries, keys), name=name)


def transformer_encoder_decoder(
    src_tokens: Array,
    tgt_tokens: Array,
    weights: Mapping[str, Array],
    num_heads: int,
    src_valid_lens: Any = None,
    *,
    tgt_valid_lens: Any = None,
    dropout: float = 0.0,
    return_weights: bool | str = False,
    implementation: str | None = None,
    positions: Array | None = None,
    max_len: int | None = None,
    scale: float | None = None,
    block: BlockOptions = POST_NORM,
    ops: Ops | None = None,
) -> Array | tuple[Array, list[list[Array]]]:
    """The encoder-decoder Transformer: the decoder's logits over the encoded source.

    Args:
        src_tokens: Source ids ``(B, S)``.
        tgt_tokens: Target ids ``(B, T)``, the decoder's input (shifted right by the caller).
        weights: ``encoder.*`` (:func:`transformer_encoder`'s names) and ``decoder.*``
            (:func:`transformer_decoder`'s, with cross-attention).
        num_heads: Heads of every attention.
        src_valid_lens: Integer lengths of the sources: padding the encoder and the
            cross-attention skip.
        tgt_valid_lens: Integer lengths of the targets as keys of the causal self-attention.
        dropout: Dropout rate everywhere the encoder and decoder apply it.
        return_weights: Also return ``[encoder, decoder self, decoder cross]``, one list of
            per-block weights each.
        implementation: How the heads pool.
        positions: The sinusoidal table ``(1, T', h)``, as long as the longer of the source
            and the target; made here when None.
        max_len: Rows of the tables made here when ``positions`` is None; by default each
            input's length.
        scale: Multiplies every attention's scores; None for ``1 / sqrt(h/H)``.
        block: The encoder's and the decoder's (see :func:`transformer_decoder`).
        ops: The backend's ops; found from ``src_tokens`` when omitted.

    Returns:
        The logits ``(B, T, V_out)``, and the weights if asked.
    """
    ops = ops or ops_for(src_tokens, "src_tokens")
    block = check_block_options(block)
    checks.check_framework("src_tokens", src_tokens, tgt_tokens=tgt_tokens)
    ids_checked = isinstance(weights, W.CheckedWeights)  # by the layer that calls
    weights = W.check_call_weights(
        ops, "transformer_encoder_decoder", weights,
        lambda size: W.with_sinks(W.transformer_call_spec(size, weights, num_heads, block),
                                  weights, num_heads))
    for side, tokens in (() if ids_checked else (("src", src_tokens), ("tgt", tgt_tokens))):
        table = weights[("encoder." if side == "src" else "decoder.") + "token.embedding"]
        check_token_ids(tokens, fixed_shape(ops, table)[0], ops=ops, side=side)
    check_sequence_pair(ops, src_tokens, tgt_tokens, num_heads, src_valid_lens, tgt_valid_lens)
    encoded = transformer_encoder(
        src_tokens, subset(weights, "encoder"), num_heads, src_valid_lens, dropout=dropout,
        return_weights=return_weights, implementation=implementation, positions=positions,
        max_len=max_len, scale=scale, block=block, ops=ops,
    )
    enc_outputs, enc_weights = encoded if return_weights else (encoded, None)
    decoded = transformer_decoder(
        tgt_tokens, subset(weights, "decoder"), num_heads, enc_outputs, src_valid_lens,
        valid_lens=tgt_valid_lens, dropout=dropout, return_weights=return_weights,
        implementation=implementation, positions=positions, max_len=max_len,
        options=HeadOptions(scale=scale), block=block, ops=ops,
    )
    if not return_weights:
        return decoded
    logits, (self_weights, cross_weights) = decoded
    return logits, [list(enc_weights or []), self_weights, cross_weights]
