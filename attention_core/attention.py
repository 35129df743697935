"""Masked softmax and attention pooling: scaled dot-product, additive, Nadaraya-Watson.

Shape legend: B batch, H heads, Q queries, K keys, D depth of queries and keys, Dv depth of
values. Functions take the backend's own arrays and find the backend from their type, unless
an ``ops`` is passed (the adapters pass one that knows about training mode and randomness).

:func:`dot_product_attention` checks its inputs, turns its keywords into modifiers
(:mod:`attention_core.modifiers`), and lets the one rule of :func:`attention_core.kernels.choose`
pick the kernel that pools (:mod:`attention_core.kernels`). The numeric policy of every core
kernel is in :mod:`attention_core.kernels.rows`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from attention_core import checks, kernels
from attention_core import modifiers as mods
from attention_core import weights as W
from attention_core.host import host_array
from attention_core.kernels import Request, Result
from attention_core.kernels.rows import narrowed, softmax_weights, widened
from attention_core.linear import dense
from attention_core.masks import own
from attention_core.ops import FLOAT_DTYPES, Array, Ops
from attention_core.positional import rotated_heads
from attention_core.registry import ops_for
from attention_core.scores import pooled

#: The kernels every backend has, and the name an adapter registers its fused kernel under.
IMPLEMENTATIONS = checks.IMPLEMENTATIONS


def softmax_visible(ops: Ops, scores: Array, visible: Array | None) -> Array:
    """Softmax over the last axis counting only visible keys, in the scores' dtype.

    ``w_ij = exp(s_ij - m_i) / sum_{j visible} exp(s_ij - m_i)`` for visible ``j``, exactly 0
    otherwise (see :mod:`attention_core.kernels.rows`: a row with no visible key is zeros).

    Args:
        ops: The backend's ops.
        scores: ``(..., Q, K)``.
        visible: Boolean, broadcastable to ``scores``, or None for no mask.
    """
    w = softmax_weights(ops, widened(ops, scores), visible)
    dtype = ops.dtype_name(scores)
    return w if ops.dtype_name(w) == dtype else ops.astype(w, dtype)


def visibility(ops: Ops, shape: tuple[Any, ...], valid_lens: Any = None, mask: Any = None,
               causal: bool = False) -> Array | None:
    """``valid_lens``, ``mask`` and ``causal`` as one boolean mask ``(B, H, Q, K)``-broadcastable."""
    call = mods.Call(ops, tuple(shape), 0, shape[3] - shape[2])
    masks = _masks(call, valid_lens, mask, causal, None, None, None)
    return mods.AllMasks(masks).visible(call.whole())


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
    ops = ops or ops_for(scores, "scores")
    shape = checks.check_rank(ops, "scores", scores, (3, 4), "(B, Q, K) or (B, H, Q, K)")
    checks.check_floating(ops, "scores", scores)
    scores4 = scores if len(shape) == 4 else ops.expand_dims(scores, 1)
    weights = softmax_visible(ops, scores4, visibility(ops, ops.shape(scores4), valid_lens,
                                                      mask, causal))
    return weights if len(shape) == 4 else weights[:, 0]


def attend(ops: Ops, scores: Array, values: Array, valid_lens: Any, mask: Any, causal: bool,
           dropout: float) -> tuple[Array, Array]:
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
    visible = visibility(ops, ops.shape(scores), valid_lens, mask, causal)
    return pool_visible(ops, scores, values, visible, dropout)


def pool_visible(ops: Ops, scores: Array, values: Array, visible: Array | None,
                 dropout: float) -> tuple[Array, Array]:
    """``(dropout(w) @ values, w)`` with ``w = softmax_visible(scores, visible)``."""
    w = softmax_visible(ops, scores, visible)
    return pooled(ops, ops.dropout(w, dropout) if dropout > 0 else w, values), w


def non_finite_rows(ops: Ops, x: Array) -> Array:
    """Makes every row (last axis) of ``x`` that holds a NaN or an inf all NaN.

    An inf in a query or a key is treated as a NaN: its row reaches exactly the rows that see
    it, whole, as a NaN does (an inf score alone could weigh 0, or give a finite row).
    """
    return x + ops.sum(x - x, -1)


def values_onto_keys(ops: Ops, keys: Array, values: Array) -> tuple[Array, Array]:
    """Moves each non-finite value onto its key: that value row becomes zeros, the key NaN.

    A hidden key weighs exactly 0, but ``0 * NaN`` is NaN, so a NaN or inf in the value of a
    hidden key would reach every row through the product of the weights and the values. Moved
    to its key, it reaches exactly the rows that see that key, whole.

    Args:
        ops: The backend's ops.
        keys: ``(..., K, D)``.
        values: ``(..., K, Dv)``, the leading axes those of ``keys``.
    """
    nan = ops.sum(values - values, -1)  # (..., K, 1): 0, or NaN where the row has a NaN or inf
    return keys + nan, ops.where(nan == 0, values, 0.0)


def mended(ops: Ops, q: Array, k: Array, v: Array) -> tuple[Array, Array, Array]:
    """``check_numerics=True``: NaN and inf in the inputs made to reach exactly the rows that see them."""
    k, v = values_onto_keys(ops, non_finite_rows(ops, k), v)
    return non_finite_rows(ops, q), k, v


def _lift(ops: Ops, x: Array, rank: int) -> Array:
    """Adds the heads axis to a rank-3 array: ``(B, N, D) -> (B, 1, N, D)``."""
    return x if rank == 4 else ops.expand_dims(x, 1)


#: ``return_weights=ON_READ``: the weights as a :class:`WeightsOnRead` when the call is eager.
ON_READ = "on read"


class WeightsOnRead:
    """Attention weights formed when first read, from what one eager call kept.

    A call that keeps its weights without returning them pools on its fast path and keeps the
    inputs of the direct path's weights instead: the queries, keys and values as the call
    lifted them, the mask and the scale, all O((Q + K) D). Reading forms the weights by the
    direct path's own code on them, so they are the numbers a call that returned them gives.

    Args:
        form: Forms the weights ``(B, H, Q, K)``.
    """

    def __init__(self, form: Callable[[], Array]) -> None:
        self._form: Callable[[], Array] | None = form
        self._weights: Array | None = None

    def __call__(self) -> Array:
        """The weights, formed on the first call and kept (what they were made from is let go)."""
        if self._form is not None:
            self._weights, self._form = self._form(), None
        return self._weights


def formed(kept: Any) -> Any:
    """``kept`` with every :class:`WeightsOnRead` in it formed (a list stays a list)."""
    if isinstance(kept, WeightsOnRead):
        return kept()
    if isinstance(kept, list):
        return [formed(k) for k in kept]
    return kept


def _scale_factor(ops: Ops, queries: Array, scale: float | None) -> Any:
    """The factor the scores are multiplied by: ``scale``, or ``1 / sqrt(D)`` when None."""
    depth = ops.shape(queries)[-1]
    scale = checks.check_scale(scale)
    if scale is None and not isinstance(depth, int):  # depth known only at run time
        return 1.0 / ops.sqrt(ops.astype(depth, ops.dtype_name(queries)))
    if scale is None:
        return 1.0 / math.sqrt(depth)
    return scale


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
    return_weights: bool | str = False,
    implementation: str | None = None,
    window: int | None = None,
    softcap: float | None = None,
    score_bias: Any = None,
    positional: str | None = None,
    rotary_base: float = 10000.0,
    segment_ids: Any = None,
    mask_mod: Any = None,
    score_mod: Any = None,
    sinks: Any = None,
    return_lse: bool = False,
    check_numerics: bool = False,
    ops: Ops | None = None,
    _heads: bool = False,
    _offset: Any = None,
    _positions: Any = None,
    _key_positions: Any = None,
    _key_valid: Any = None,
) -> Any:
    """Scaled dot-product attention: ``softmax(Q K^T * scale) V`` over the visible keys.

    Query ``i`` stands at position ``p_i = i + (K - Q)`` (a cached call's ``start + i``), key
    ``j`` at ``j``: the positions ``causal``, ``window``, ALiBi and rotary use. Every mask
    keyword is a mask modifier and every score keyword a score modifier
    (:mod:`attention_core.modifiers`); the scores are scaled, soft-capped, given ALiBi biases,
    ``score_bias`` and ``score_mod``, in that order, and masks win over all of them.

    Args:
        queries: ``(B, Q, D)`` or ``(B, H, Q, D)``.
        keys: ``(B, K, D)`` or ``(B, Hkv, K, D)``, the rank of ``queries``; Hkv divides H
            (grouped-query attention: query head ``h`` uses key/value head ``h // (H / Hkv)``).
        values: ``(B, K, Dv)`` or ``(B, Hkv, K, Dv)``.
        valid_lens: Integer lengths, ``(B,)`` or ``(B, Q)``, shared by every head.
        mask: Boolean, True = may attend: ``(Q, K)``, ``(B, Q, K)`` or ``(B, H, Q, K)``.
        causal: Query ``i`` sees keys ``j <= p_i``.
        scale: Multiplies the scores; ``1 / sqrt(D)`` when None.
        dropout: Dropout rate on the attention weights (applied whenever > 0).
        return_weights: Also return the weights ``(B, H, Q, K)`` (H = 1 for rank-3 inputs),
            before dropout. :data:`ON_READ`: in an eager call, pool as if they were not asked
            for and return a :class:`WeightsOnRead` that forms them; traced, as True.
        implementation: The kernel's name (:mod:`attention_core.kernels`): ``"direct"``,
            ``"blockwise"``, ``"fused"`` (the framework's own, where it has one) or one a user
            registered; refused, with the reason, when it cannot do what the call asks. None
            lets :func:`attention_core.kernels.choose` pick.
        window: Query ``i`` sees only the keys ``j`` with ``|p_i - j| < window``.
        softcap: c: the scaled scores become ``c * tanh(s / c)`` (Gemma 2).
        score_bias: Float, broadcastable to ``(B, H, Q, K)``, added to the scores.
        positional: ``"rotary"`` rotates the queries and keys by their positions (RoPE,
            ``rotary_base``); ``"alibi"`` adds ``-slope_h * |p_i - j|``; None for neither.
        rotary_base: The base of the rotary frequencies ``base^(-2t/D)``.
        segment_ids: Integer ``(B, K)``, or a pair ``(query_ids (B, Q), key_ids (B, K))``:
            a query sees only the keys of its own segment (packed sequences).
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool``, a mask modifier, or a list.
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score``, a score modifier, or a
            list.
        sinks: Per-head sink logits ``(H,)``: each row's softmax denominator gains
            ``exp(sinks[h])`` (attention sinks, as in gpt-oss).
        return_lse: Also return each row's log-sum-exp ``(B, H, Q)`` in float32 (float64 for
            float64 inputs), ``-inf`` for a row with nothing visible (and no sink).
        check_numerics: Make a NaN or inf in an input reach exactly the rows that see it, as
            in exact arithmetic (a pass over the inputs; fused kernels are passed over).
        ops: The backend's ops; found from ``queries`` when omitted.
        _heads: Internal: the inputs are heads a layer projected from checked inputs.
        _offset: Internal (cached calls): the position of query 0, in place of ``K - Q``.
        _positions: Internal (cached calls): the queries' positions, a
            :class:`~attention_core.cache.Positions` (per example in a ragged batch), in place
            of ``_offset``.
        _key_positions: Internal: int32 ``(B, K)``, each key's position (None: ``j``).
        _key_valid: Internal: boolean ``(B, K)``, the keys that hold a token, which the causal
            and window masks alone see (None: all).

    Returns:
        The output, shape of ``queries`` with depth Dv; then the weights if asked, then the
        log-sum-exp if asked.
    """
    ops = ops or ops_for(queries, "queries")
    if not _heads:
        checks.check_qkv(ops, queries, keys, values)
    rank = len(ops.shape(queries))
    q, k, v = (_lift(ops, x, rank) for x in (queries, keys, values))  # (B, H, N, D)
    call = _call(ops, (*ops.shape(q)[:3], ops.shape(k)[2]), _offset, _positions, _key_positions,
                 _key_valid)
    if checks.check_positional(positional) == "rotary":
        q = rotated_heads(ops, q, call.offset, rotary_base, call.query_positions)
        k = rotated_heads(ops, k, 0, rotary_base, call.key_positions)
    checks.check_return_weights(return_weights)
    traced = ops.traced(q)
    on_read = return_weights == ON_READ and not traced
    request = Request(
        call, _masks(call, valid_lens, mask, causal, window, segment_ids, mask_mod),
        _scores(call, softcap, positional == "alibi", score_bias, score_mod),
        _scale_factor(ops, queries, scale), checks.check_dropout(dropout),
        _sinks(ops, sinks, call.shape[1]), bool(return_weights) != on_read,
        checks.check_flag("return_lse", return_lse), ops.dtype_name(q), traced,
        _depths_differ(ops, q, v), checks.check_flag("check_numerics", check_numerics))
    if request.check_numerics:
        q, k, v = mended(ops, q, k, v)
    result = kernels.run(ops, q, k, v, request, checks.check_implementation(implementation))
    weights = _weights_on_read(ops, (q, k, v), request, _heads) if on_read else result.weights
    return _returned(result, weights, rank, bool(return_weights), request.lse)


def _call(ops: Ops, shape: tuple[Any, ...], offset: Any, positions: Any, key_positions: Any,
          key_valid: Any) -> mods.Call:
    """The call's positions: ``K - Q`` or ``offset``, else per example (:meth:`mods.Call.at`)."""
    if positions is None and key_positions is None and key_valid is None:
        return mods.Call.of(ops, shape, offset)
    query = (0 if offset is None else offset) if positions is None else positions.query
    bound = None if positions is None else positions.bound
    return mods.Call.at(ops, shape, query, key_positions, key_valid, bound)


def _depths_differ(ops: Ops, q: Array, v: Array) -> bool:
    """Whether the values' depth differs from the queries' (True when not known now)."""
    d, dv = ops.shape(q)[3], ops.shape(v)[3]
    return not (isinstance(d, int) and isinstance(dv, int) and d == dv)


def _masks(call: mods.Call, valid_lens: Any, mask: Any, causal: Any, window: Any,
           segment_ids: Any, mask_mod: Any) -> tuple[mods.MaskMod, ...]:
    """The mask keywords of a call as bound mask modifiers, in the order given."""
    found: list[mods.MaskMod | None] = [
        None if valid_lens is None else mods.Lengths(valid_lens),
        None if mask is None else mods.BooleanMask(mask),
        mods.Causal() if checks.check_causal(causal) else None,
        None if window is None else mods.Window(window),
        None if segment_ids is None else mods.Segments(segment_ids),
        mods.as_mask_mod(mask_mod),
    ]
    return tuple(p.bind(call) for m in found if m is not None for p in m.parts())


def _scores(call: mods.Call, softcap: Any, alibi: bool, score_bias: Any, score_mod: Any
            ) -> tuple[mods.ScoreMod, ...]:
    """The score keywords of a call as bound score modifiers, in the order they apply."""
    found: list[mods.ScoreMod | None] = [
        None if softcap is None else mods.Softcap(softcap),
        mods.Alibi() if alibi else None,
        None if score_bias is None else mods.ScoreBias(score_bias),
        mods.as_score_mod(score_mod),
    ]
    return tuple(p.bind(call) for m in found if m is not None for p in m.parts())


def _sinks(ops: Ops, sinks: Any, heads: Any) -> Array | None:
    """Checks per-head sink logits ``(H,)`` of any framework; a backend array, or None."""
    if sinks is None:
        return None
    host = None if own(ops, sinks) else host_array(sinks)
    dtype = ops.dtype_name(sinks) if host is None else host.dtype.name
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"sinks must be floating point, got {dtype}")
    shape = ops.shape(sinks) if host is None else host.shape
    if len(shape) != 1 or (isinstance(heads, int) and isinstance(shape[0], int)
                           and shape[0] != heads):
        raise ValueError(f"sinks must have shape (H,) = ({heads},), got "
                         f"{checks.fmt_shape(shape)}")
    return sinks if host is None else ops.from_numpy(host)


def _returned(result: Result, weights: Any, rank: int, with_weights: bool, with_lse: bool
              ) -> Any:
    """The output (heads axis dropped for rank-3 inputs), then the weights and lse if asked."""
    out = result.out if rank == 4 else result.out[:, 0]
    extra = [x for x, wanted in ((weights, with_weights), (result.lse, with_lse)) if wanted]
    return (out, *extra) if extra else out


def _weights_on_read(ops: Ops, qkv: tuple[Array, Array, Array], request: Request,
                     heads: bool) -> WeightsOnRead:
    """The direct kernel's weights, formed when read, from the inputs as the call had them.

    A layer's own heads are kept as they are; a caller's arrays as copies (see
    :func:`_snapshot`), which a change in place does not reach.
    """
    kept = qkv if heads else (_snapshot(qkv[0]), _snapshot(qkv[1]), _snapshot(qkv[2]))
    return WeightsOnRead(lambda: _direct_weights(ops, kept, request))


def _snapshot(x: Array) -> Array:
    """A copy of ``x`` its caller cannot change in place (torch, NumPy and MXNet arrays can).

    ``x + 0`` keeps every value (-0 becomes 0, which no score can tell apart).
    """
    return x + 0


def _direct_weights(ops: Ops, qkv: tuple[Array, Array, Array], request: Request) -> Array:
    """The weights the direct kernel gives for ``request``, without pooling the values."""
    from attention_core.kernels.direct import weights

    w, _ = weights(ops, qkv[0], qkv[1], request)
    return narrowed(ops, w, request.dtype)


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
    return_weights: bool | str = False,
    ops: Ops | None = None,
) -> Array | tuple[Array, Array]:
    """Additive (Bahdanau) attention: score ``w_v^T tanh(W_q q + W_k k)``.

    Args:
        queries: ``(B, Q, Dq)``.
        keys: ``(B, K, Dk)``.
        values: ``(B, K, Dv)``.
        weights: ``W_q.kernel (Dq, h)``, ``W_k.kernel (Dk, h)``, ``w_v.kernel (h, 1)``;
            checked like ``set_weights`` checks a layer's (names, dtypes, shapes, and the
            inputs' widths against the kernels).
        valid_lens: See :func:`dot_product_attention`.
        mask: See :func:`dot_product_attention`.
        causal: See :func:`dot_product_attention`.
        dropout: Dropout rate on the attention weights.
        return_weights: Also return the weights ``(B, 1, Q, K)``, before dropout
            (:data:`ON_READ` counts as True: this function has only the direct path).
        ops: The backend's ops; found from ``queries`` when omitted.

    Returns:
        The output ``(B, Q, Dv)``, and the weights if asked.
    """
    ops = ops or ops_for(queries, "queries")
    check_projected_inputs(ops, queries, keys, values)
    weights = W.check_call_weights(
        ops, "additive_attention", weights, W.additive_call_spec,
        {"queries": (queries, "W_q.kernel"), "keys": (keys, "W_k.kernel")},
    )
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
    checks.check_framework("queries", queries, keys=keys, values=values)
    shapes = _projected_ranks(ops, queries, keys, values)
    for name, x in (("queries", queries), ("keys", keys), ("values", values)):
        checks.check_floating(ops, name, x)
    _check_projected(ops, (queries, keys, values), shapes)


def check_projected_shapes(ops: Ops, queries: Array, keys: Array, values: Array) -> None:
    """:func:`check_projected_inputs` of floating arrays of one framework (a layer's, cast)."""
    _check_projected(ops, (queries, keys, values), _projected_ranks(ops, queries, keys, values))


def _projected_ranks(ops: Ops, *inputs: Array) -> list[tuple[Any, ...]]:
    """The shapes of queries, keys and values, each checked to be rank 3 and not empty."""
    legends = (("queries", "(B, Q, Dq)"), ("keys", "(B, K, Dk)"), ("values", "(B, K, Dv)"))
    return [checks.check_rank(ops, name, x, (3,), legend)
            for (name, legend), x in zip(legends, inputs, strict=True)]


def _check_projected(ops: Ops, inputs: tuple[Array, Array, Array],
                     shapes: list[tuple[Any, ...]]) -> None:
    """Their dtypes agree and the backend multiplies them; keys, values and batches agree."""
    queries, keys, values = inputs
    q, k, v = shapes
    checks.check_same_dtype(ops, "queries", queries, keys=keys, values=values)
    checks.check_matmul_dtype(ops, "queries", queries)
    checks.check_equal(
        lambda: f"keys and values must have the same length, got {k[1]} keys and {v[1]} values",
        k[1],
        v[1],
    )
    checks.check_equal(
        lambda: f"keys batch size ({k[0]}) must equal queries batch size ({q[0]})", k[0], q[0])
    checks.check_equal(
        lambda: f"values batch size ({v[0]}) must equal queries batch size ({q[0]})", v[0], q[0])


def nadaraya_watson(
    queries: Array,
    keys: Array,
    values: Array,
    w: Array | float | None = None,
    *,
    return_weights: bool | str = False,
    ops: Ops | None = None,
) -> Array | tuple[Array, Array]:
    """Nadaraya-Watson kernel regression: ``f(x) = sum_i softmax(-((x - x_i) w)^2 / 2) y_i``.

    Args:
        queries: ``(B, Q)`` or ``(Q,)``: the points ``x`` to predict at.
        keys: ``(B, K)`` or ``(K,)``: the training inputs ``x_i``.
        values: ``(B, K)`` or ``(K,)``: the training targets ``y_i``.
        w: The kernel's inverse width (a scalar or an array of one element); 1 when None.
        return_weights: Also return the weights ``(B, 1, Q, K)`` (:data:`ON_READ` counts as
            True).
        ops: The backend's ops; found from ``queries`` when omitted.

    Returns:
        The predictions, shape of ``queries``, and the weights if asked.
    """
    ops = ops or ops_for(queries, "queries")
    checks.check_framework("queries", queries, keys=keys, values=values)
    q = checks.check_rank(ops, "queries", queries, (1, 2), "(B, Q) or (Q,)")
    checks.check_rank(ops, "keys", keys, (len(q),), "(B, K) or (K,) like queries")
    checks.check_rank(ops, "values", values, (len(q),), "(B, K) or (K,) like queries")
    checks.check_floating(ops, "queries", queries)
    checks.check_same_dtype(ops, "queries", queries, keys=keys, values=values)
    checks.check_matmul_dtype(ops, "queries", queries)
    k, v = ops.shape(keys), ops.shape(values)
    for i, axis in enumerate(("batch", "length")[2 - len(q) :]):
        checks.check_equal(
            lambda: f"keys and values must have the same shape, got {checks.fmt_shape(k)} and "
            f"{checks.fmt_shape(v)}",
            k[i],
            v[i],
        )
        if axis == "batch":
            checks.check_equal(
                lambda: f"keys batch size ({k[0]}) must equal queries batch size ({q[0]})",
                k[0],
                q[0],
            )
    batched = [x if len(q) == 2 else ops.expand_dims(x, 0) for x in (queries, keys, values)]
    diff = ops.expand_dims(batched[0], -1) - ops.expand_dims(batched[1], 1)  # (B, Q, K)
    if isinstance(w, (np.ndarray, np.generic, list, tuple)):  # host data: to the backend
        w = ops.from_numpy(np.asarray(w), like=queries)
    if w is not None:  # a Python number, or an array of one element
        diff = diff * w
    scores = ops.expand_dims(diff * diff * -0.5, 1)  # (B, 1, Q, K)
    weights = softmax_visible(ops, scores, None)
    y = ops.expand_dims(ops.expand_dims(batched[2], 1), -1)  # (B, 1, K, 1)
    out = ops.matmul(weights, y)[:, 0, :, 0]  # (B, Q)
    out = out if len(q) == 2 else out[0]
    return (out, weights) if return_weights else out
