"""Multi-head attention over the canonical weight mapping, with absolute or relative positions.

Head ``i`` uses columns ``i*h/H : (i+1)*h/H`` of the projected queries, and key/value head
``g`` columns ``g*h/H : (g+1)*h/H`` of the projected keys and values, where h = num_hiddens,
H = num_heads and Hkv = num_kv_heads (the canonical layout, on the Weights page). With
fewer key/value heads than query heads (grouped-query attention; Hkv = 1 is multi-query
attention), query head ``i`` uses key/value head ``i // (H / Hkv)``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from attention_core import cache as kv_cache
from attention_core import checks, parallel
from attention_core import weights as W
from attention_core.attention import (
    check_projected_inputs,
    dot_product_attention,
    softmax_visible,
    visibility,
)
from attention_core.cache import Positions
from attention_core.linear import dense
from attention_core.ops import Array, Ops, fixed_shape, matmul_transposed
from attention_core.positional import ROTARY_MAX_POSITIONS, relative_offsets, rotated_heads
from attention_core.registry import ops_for


@dataclass(frozen=True)
class HeadOptions:
    """How a multi-head attention forms its heads and scores, beyond the classic 2017 one.

    Attributes:
        num_kv_heads: Hkv, the key/value heads (None: H); must divide H.
        positional: ``"rotary"`` (queries and keys rotated by their positions after the
            projections), ``"alibi"`` (linear biases by distance), or None.
        rotary_base: The base of the rotary frequencies.
        window: Each query sees only the keys within this distance of its position, or None.
        softcap: c of the scores' soft-capping ``c * tanh(s / c)``, or None.
        scale: Multiplies the scores; None for ``1 / sqrt(h/H)``.
        context_parallel: The :class:`~attention_core.parallel.ContextParallel` of a
            sequence split across devices, or None.
    """

    num_kv_heads: int | None = None
    positional: str | None = None
    rotary_base: float = 10000.0
    window: int | None = None
    softcap: float | None = None
    scale: float | None = None
    context_parallel: Any = None

    def checked(self, num_heads: int) -> HeadOptions:
        """The options checked (as every backend raises), numbers made plain."""
        kv_heads = checks.check_kv_heads(num_heads, self.num_kv_heads)
        return HeadOptions(kv_heads, **{name: rule(getattr(self, name))
                                        for name, rule in checks.SCORE_OPTION_CHECKS.items()},
                           context_parallel=self.context_parallel)

    def kwargs(self) -> dict[str, Any]:
        """The options as keyword arguments of :func:`multi_head_attention`."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}


#: The options of the 2017 multi-head attention.
CLASSIC = HeadOptions()


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


def _checked(
    ops: Ops,
    name: str,
    weights: Mapping[str, Array],
    spec_of: Callable[[Callable[[str, int, int], int | None]], W.Spec],
    inputs: tuple[Array, Array, Array],
) -> W.CheckedWeights:
    """The call's weights, checked against the inputs' widths, the inputs checked first.

    A :class:`~attention_core.weights.CheckedWeights` mapping comes from a layer that checked
    its inputs too: only the widths are left to check.
    """
    queries, keys, values = inputs
    if not isinstance(weights, W.CheckedWeights):
        check_projected_inputs(ops, queries, keys, values)
    widths = {"queries": (queries, "W_q.kernel"), "keys": (keys, "W_k.kernel"),
              "values": (values, "W_v.kernel")}  # each input, and the kernel it must fit
    return W.check_call_weights(ops, name, weights, spec_of, widths)


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
    return_weights: bool | str = False,
    implementation: str | None = None,
    num_kv_heads: int | None = None,
    positional: str | None = None,
    rotary_base: float = 10000.0,
    window: int | None = None,
    softcap: float | None = None,
    score_bias: Any = None,
    scale: float | None = None,
    segment_ids: Any = None,
    mask_mod: Any = None,
    score_mod: Any = None,
    cache: Any = None,
    start: Any = 0,
    capacity: int | None = None,
    lengths: Any = None,
    padding: str = "right",
    padding_mask: Any = None,
    context_parallel: Any = None,
    ops: Ops | None = None,
    _layer: bool = False,
) -> Any:
    """Multi-head scaled dot-product attention with input and output projections.

    Query ``i`` stands at position ``i + (K - Q)``, key ``j`` at ``j`` (for ``causal``,
    ``window`` and the positions ``positional`` adds).

    Args:
        queries: ``(B, Q, Dq)``.
        keys: ``(B, K, Dk)``.
        values: ``(B, K, Dv)``.
        weights: ``W_q.kernel (Dq, h)``, ``W_k.kernel (Dk, Hkv*h/H)``, ``W_v.kernel (Dv,
            Hkv*h/H)``, ``W_o.kernel (h, h)``, with biases ``W_q.bias (h,)`` etc., and with
            attention sinks ``sinks (H,)`` (each head's sink logit, see
            :func:`~attention_core.attention.dot_product_attention`); checked like
            ``set_weights`` checks a layer's (names, dtypes, shapes, and the inputs' widths
            against the kernels).
        num_heads: H; must divide h.
        valid_lens: Integer lengths, ``(B,)`` or ``(B, Q)``, shared by every head.
        mask: Boolean, True = may attend: ``(Q, K)``, ``(B, Q, K)`` or ``(B, H, Q, K)``.
        causal: Query ``i`` sees keys ``j <= i + (K - Q)``.
        dropout: Dropout rate on the attention weights.
        return_weights: Also return the weights ``(B, H, Q, K)``, before dropout; see
            :func:`attention_core.attention.dot_product_attention` for ``ON_READ``.
        implementation: How the heads pool; see
            :func:`~attention_core.attention.dot_product_attention`.
        num_kv_heads: Hkv, key/value heads shared by groups of H/Hkv query heads (None: H).
        positional: ``"rotary"``, ``"alibi"`` or None; see :class:`HeadOptions`.
        rotary_base: The base of the rotary frequencies.
        window: Each query sees only the keys within ``window`` of its position.
        softcap: Soft-caps the scores at ``softcap``.
        score_bias: Float, broadcastable to ``(B, H, Q, K)``, added to the scores.
        scale: Multiplies the scores; None for ``1 / sqrt(h/H)``.
        segment_ids: Integer ``(B, K)`` or a pair ``(query_ids (B, Q), key_ids (B, K))``: a
            query sees only the keys of its own segment (packed sequences).
        mask_mod: Passed to :func:`~attention_core.attention.dot_product_attention`.
        score_mod: Passed to :func:`~attention_core.attention.dot_product_attention`.
        cache: ``(keys, values)`` ``(B, Hkv, C, h/H)`` each from an earlier cached call: the
            call is then causal over the cache (:func:`cached_heads`).
        start: A cached call's position of its first token: an int, or one per example
            ``(B,)`` (a ragged batch).
        capacity: C of a cache made now (with ``cache`` None): makes the call cached. With
            a ``window``, the cache is a ring of ``min(C, window)`` rows
            (:func:`~attention_core.cache.is_ring`).
        lengths: A cached call's real tokens per example ``(B,)``, the rest padding: example
            ``b``'s tokens sit at positions ``start[b] ..`` and only they are written.
        padding: Where the padding of ``lengths`` sits, ``"right"`` or ``"left"``.
        padding_mask: Boolean ``(B, t)``, True at the real tokens, in place of ``lengths``.
        context_parallel: A :class:`~attention_core.parallel.ContextParallel`: the inputs
            are this device's shard of a sequence split across devices, in its layout (keys
            and values of the same rows as the queries); ``valid_lens``, ``mask`` and
            ``segment_ids`` are the whole sequence's.
        ops: The backend's ops; found from ``queries`` when omitted.
        _layer: Internal: a layer's call, whose ``num_heads`` and head options the layer
            checked when it was made (and its inputs and weights, as ``weights`` says).

    Returns:
        The output ``(B, Q, h)``, and the weights if asked; a cached call returns
        ``(that, cache)``.
    """
    ops = ops or ops_for(queries, "queries")
    options = HeadOptions(num_kv_heads, positional, rotary_base, window, softcap, scale,
                          context_parallel)
    ragged = ragged_arguments(cache, capacity, lengths, padding, padding_mask)
    if cache is not None or capacity is not None:
        refuse_in_cached_call(valid_lens=valid_lens, mask=mask, score_bias=score_bias,
                              segment_ids=segment_ids)
        return cached_heads(ops, queries, keys, values, weights, num_heads, cache, start,
                            capacity=capacity, dropout=dropout, return_weights=return_weights,
                            implementation=implementation, options=options,
                            mask_mod=mask_mod, score_mod=score_mod, ragged=ragged,
                            checked=_layer)
    at = None
    if context_parallel is not None:
        at = _split_positions(ops, context_parallel, ops.shape(queries)[1], ops.shape(keys)[1],
                              return_weights, score_bias)
    weights, options, pair = _keys_values(ops, "multi_head_attention", queries, keys, values,
                                          weights, num_heads, options, checked=_layer,
                                          start=0 if at is None else at)
    return pool_heads(ops, queries, pair, weights, num_heads, valid_lens, mask=mask,
                      causal=causal, dropout=dropout, return_weights=return_weights,
                      implementation=implementation, options=options, score_bias=score_bias,
                      segment_ids=segment_ids, mask_mod=mask_mod, score_mod=score_mod,
                      positions=at)


def split_dot_product(split: Any, queries: Array, keys: Array, values: Array,
                      valid_lens: Any = None, *, ops: Ops, positional: str | None = None,
                      rotary_base: float = 10000.0, return_weights: bool | str = False,
                      score_bias: Any = None, **shared: Any) -> Array:
    """:func:`~attention_core.attention.dot_product_attention` of a shard over every device's.

    The inputs ``(B, n/P, D)`` or ``(B, H, n/P, D)`` are this device's shard of a sequence
    split by ``split`` (a :class:`~attention_core.parallel.ContextParallel`), in its layout;
    rotary positions turn them by their rows' positions in the whole sequence. ``shared``:
    the call's masks and score options, as ``dot_product_attention`` takes them.
    """
    rank = len(ops.shape(queries))
    q, k, v = (x if rank == 4 else ops.expand_dims(x, 1) for x in (queries, keys, values))
    at = _split_positions(ops, split, ops.shape(q)[2], ops.shape(k)[2], return_weights,
                          score_bias)
    if checks.check_positional(positional) == "rotary":
        q, k = (rotated_heads(ops, x, 0, rotary_base, at.query) for x in (q, k))
    out = split.attend(q, k, v, valid_lens=valid_lens,
                       positional="alibi" if positional == "alibi" else None, **shared)
    return out if rank == 4 else out[:, 0]


def _split_positions(ops: Ops, split: Any, rows: Any, key_rows: Any,
                     return_weights: bool | str, score_bias: Any) -> Positions:
    """The whole-sequence positions of a context-parallel call's rows, its inputs checked."""
    if not isinstance(split, parallel.ContextParallel):
        raise TypeError("context_parallel must be a ContextParallel of the backend "
                        f"(or what the layer's context_parallel= takes), got "
                        f"{type(split).__name__}")
    parallel.refuse_in_split_call(return_weights=return_weights, score_bias=score_bias)
    if rows != key_rows:
        raise ValueError("context_parallel attends a shard to the shards of the same sequence: "
                         f"keys must have the queries' {rows} rows, got {key_rows}")
    return Positions(0, ops.expand_dims(split.positions(ops, rows), 0))


def _keys_values(
    ops: Ops, name: str, queries: Array, keys: Array, values: Array,
    weights: Mapping[str, Array], num_heads: int, options: HeadOptions, start: Any = 0,
    checked: bool = False,
) -> tuple[W.CheckedWeights, HeadOptions, tuple[Array, Array]]:
    """The call's checked weights and options, and its keys and values projected into heads.

    The keys and values are ``(B, Hkv, K, h/H)`` each, the keys rotated by their positions
    ``start ..`` under rotary positions (not yet when ``start`` is None); ``name`` is the
    function the messages name. ``checked``: a layer's call, whose ``num_heads`` and options
    the layer checked when made, and whose weights of those declared shapes are ``weights``
    (:class:`~attention_core.weights.CheckedWeights`): they are not checked again.
    """
    if not (checked and isinstance(weights, W.CheckedWeights)):
        checks.check_positive_int("num_heads", num_heads)
        options = options.checked(num_heads)
        weights = _checked(ops, name, weights,
                           lambda size: W.with_sinks(
                               W.multi_head_call_spec(size, weights, num_heads,
                                                      num_kv_heads=options.num_kv_heads),
                               weights, num_heads),
                           (queries, keys, values))
        num_hiddens = fixed_shape(ops, weights["W_q.kernel"])[-1]
        checks.check_heads(num_hiddens, num_heads)
    kv_heads = options.num_kv_heads or num_heads
    k = heads(ops, keys, weights, "W_k", kv_heads)
    if options.positional == "rotary" and isinstance(start, Positions):  # (1, K) positions
        k = rotated_heads(ops, k, 0, options.rotary_base, start.query)
    elif options.positional == "rotary" and start is not None:
        k = rotated_heads(ops, k, start, options.rotary_base)
    return weights, options, (k, heads(ops, values, weights, "W_v", kv_heads))


def heads(ops: Ops, x: Array, weights: Mapping[str, Array], name: str, num_heads: int) -> Array:
    """``x (B, N, d)`` through the projection ``name``, split into heads ``(B, H, N, d/H)``."""
    return split_heads(ops, project(ops, x, weights, name), num_heads)


def pool_heads(
    ops: Ops,
    queries: Array,
    pair: tuple[Array, Array],
    weights: Mapping[str, Array],
    num_heads: int,
    valid_lens: Any = None,
    *,
    mask: Any = None,
    causal: bool = False,
    dropout: float = 0.0,
    return_weights: bool | str = False,
    implementation: str | None = None,
    options: HeadOptions = CLASSIC,
    score_bias: Any = None,
    offset: Any = None,
    segment_ids: Any = None,
    mask_mod: Any = None,
    score_mod: Any = None,
    positions: Any = None,
    keys_at: tuple[Array, Array] | None = None,
    tables: dict[Any, Any] | None = None,
) -> Array | tuple[Array, Array]:
    """Projects the queries, pools them over projected keys and values, projects the output.

    Args:
        ops: The backend's ops.
        queries: ``(B, Q, Dq)``, not projected yet.
        pair: The keys and values, projected and split into heads, ``(B, Hkv, K, h/H)`` each
            (a cache's), the keys already rotated under rotary positions.
        weights: Checked weights of :func:`multi_head_attention` (``W_q``, ``W_o``, and
            ``sinks`` if it has them).
        num_heads: H.
        valid_lens: See :func:`multi_head_attention`.
        mask: See :func:`multi_head_attention`.
        causal: See :func:`multi_head_attention`.
        dropout: See :func:`multi_head_attention`.
        return_weights: See :func:`multi_head_attention`.
        implementation: See :func:`multi_head_attention`.
        options: Checked :class:`HeadOptions`. Their ``context_parallel`` pools a shard's
            queries over every device's keys (``positions``: the shard's), in place of
            :func:`~attention_core.attention.dot_product_attention`.
        score_bias: See :func:`multi_head_attention`.
        offset: Query ``i`` stands at position ``i + offset``; None for ``K - Q``.
        segment_ids: See :func:`multi_head_attention`.
        mask_mod: See :func:`multi_head_attention`.
        score_mod: See :func:`multi_head_attention`.
        positions: The queries' positions per example (a ragged cached call,
            :class:`~attention_core.cache.Positions`), in place of ``offset``.
        keys_at: The keys' positions and whether each holds a token, ``(B, K)`` each (a
            ring's, :func:`~attention_core.cache.ring_keys`); None: key ``j`` at ``j``.
        tables: The rotary tables of the queries' positions, kept for the call's other heads
            (:attr:`~attention_core.cache.Positions.tables` of a cached call).
    """
    q = heads(ops, queries, weights, "W_q", num_heads)  # (B, H, Q, h/H)
    if options.positional == "rotary":
        first = ops.shape(pair[0])[2] - ops.shape(q)[2] if offset is None else offset
        q = rotated_heads(ops, q, first, options.rotary_base,
                          None if positions is None else positions.query, tables)
    given = {"sinks": weights.get("sink_logits"), "segment_ids": segment_ids,
             "mask_mod": mask_mod, "score_mod": score_mod}
    shared = {"mask": mask, "causal": causal, "dropout": dropout,
              "implementation": implementation, "window": options.window,
              "softcap": options.softcap, "scale": options.scale,
              "positional": "alibi" if options.positional == "alibi" else None,
              **{name: value for name, value in given.items() if value is not None}}
    split = options.context_parallel
    if split is not None:
        return project(ops, merge_heads(ops, split.attend(q, *pair, valid_lens=valid_lens,
                                                          **shared)), weights, "W_o")
    pooled = dot_product_attention(
        q, *pair, valid_lens, return_weights=return_weights, score_bias=score_bias, ops=ops,
        _heads=True, _offset=offset, _positions=positions,
        _key_positions=keys_at and keys_at[0], _key_valid=keys_at and keys_at[1], **shared,
    )
    out, attn = pooled if return_weights else (pooled, None)
    out = project(ops, merge_heads(ops, out), weights, "W_o")  # (B, Q, h)
    return (out, attn) if return_weights else out


def cached_heads(
    ops: Ops, queries: Array, keys: Array, values: Array, weights: Mapping[str, Array],
    num_heads: int, cache: Any, start: Any, *, capacity: int | None, dropout: float,
    return_weights: bool | str, implementation: str | None, options: HeadOptions,
    mask_mod: Any = None, score_mod: Any = None, ragged: Mapping[str, Any] | None = None,
    checked: bool = False,
) -> tuple[Array | tuple[Array, Array], tuple[Array, Array]]:
    """Causal multi-head attention of ``t`` new positions against a key/value cache.

    The new keys and values are projected (the keys rotated by their positions under rotary
    positions) and written into the cache at rows ``[start, start + t)``; query ``i``
    (position ``start + i``) then attends to rows ``j <= start + i`` (within the window, if
    any). Calling it on positions ``0..T-1``, in one call or in several chunks, gives the
    causal self-attention of the whole sequence (:mod:`attention_core.cache`). Returns
    ``(output, cache)`` (the output with the weights if asked).

    ``mask_mod`` and ``score_mod`` see query ``i`` at index ``start + i``. ``ragged``: the
    call's ``lengths``, ``padding`` and ``padding_mask`` (:func:`attention_core.cache.placed`).
    ``checked``: as for :func:`_keys_values` (a layer's call, or a stack's block's).
    """
    refuse_in_cached_call(context_parallel=options.context_parallel)
    weights, options, new = _keys_values(ops, "multi_head_attention", queries, keys,
                                         values, weights, num_heads, options, None, checked)
    B, Hkv, steps, D = ops.shape(new[0])  # (B, Hkv, t, h/H)
    pair = None if cache is None else kv_cache.check_pair(ops, "cache", cache, (B, Hkv, D),
                                                          ops.dtype_name(new[0]))
    size = kv_cache.capacity_of(ops, None if pair is None else pair[0], capacity, options.window)
    at, written, seen = _written(ops, pair, new, start, steps, size, options, ragged or {})
    result = pool_heads(ops, queries, seen[0], weights, num_heads, causal=True, dropout=dropout,
                        return_weights=return_weights, implementation=implementation,
                        options=options, offset=at.query, mask_mod=mask_mod,
                        score_mod=score_mod, positions=at if kv_cache.per_example(at) else None,
                        keys_at=seen[1], tables=at.tables)
    return result, written


#: The keys and values a cached call attends, and their positions and validity (a ring's).
Seen = tuple[tuple[Array, Array], tuple[Array, Array] | None]


def _written(ops: Ops, pair: tuple[Array, Array] | None, new: tuple[Array, Array], start: Any,
             steps: Any, size: int, options: HeadOptions, ragged: Mapping[str, Any]
             ) -> tuple[kv_cache.Positions, tuple[Array, Array], Seen]:
    """The new tokens' positions, the cache with them written, and the keys the call attends.

    The new keys are rotated at their positions under rotary. The call attends to the cache
    written, or of a ring (:func:`~attention_core.cache.is_ring`), to its rows before the
    write then the new ones, with their positions (:func:`~attention_core.cache.ring_keys`):
    a chunk longer than the ring sees all it must.
    """
    ring = kv_cache.is_ring(size, options.window)
    rotary = options.positional == "rotary"
    at = kv_cache.placed(ops, start, steps, size, batch=ops.shape(new[0])[0], like=new[0],
                         ring=ring, limit=ROTARY_MAX_POSITIONS if rotary else None, **ragged)
    if rotary:  # the new keys at their positions
        rows = at.query if kv_cache.per_example(at) else None
        new = (rotated_heads(ops, new[0], at.query, options.rotary_base, rows, at.tables),
               new[1])
    if not ring:
        keys, values = (kv_cache.written_at(ops, old, rows, at, size)
                        for old, rows in zip(pair or (None, None), new, strict=True))
        return at, (keys, values), ((keys, values), None)
    seen = tuple(x if old is None else ops.concatenate([old, x], 2)
                 for old, x in zip(pair or (None, None), new, strict=True))
    keys, values = (kv_cache.ring_written(ops, old, rows, at, size)
                    for old, rows in zip(pair or (None, None), new, strict=True))
    return at, (keys, values), ((seen[0], seen[1]),
                                kv_cache.ring_keys(ops, at, size, steps, pair is not None))


def cached_attention(
    ops: Ops, queries: Array, keys: Array, values: Array, cache: Any, start: Any, *,
    capacity: int | None, options: HeadOptions, ragged: Mapping[str, Any] | None = None,
    **pooling: Any,
) -> tuple[Any, tuple[Array, Array]]:
    """Causal attention of ``t`` new positions against a cache of earlier keys and values.

    :func:`~attention_core.attention.dot_product_attention`, no projections. The cache pair
    has the inputs' rank: ``(B, C, D)`` or ``(B, Hkv, C, D)`` each, keys rotated under rotary
    positions; the new keys and values are written at rows ``[start,
    start + t)`` and query ``i`` sees rows ``j <= start + i``, as in :func:`cached_heads`
    (or a windowed call's ring, :func:`~attention_core.cache.is_ring`).
    ``ragged``: as for :func:`cached_heads`. ``pooling``: the keywords of
    ``dot_product_attention`` that pool (dropout, return_weights, implementation, mask_mod,
    score_mod).
    """
    checks.check_qkv(ops, queries, keys, values)
    rank = len(ops.shape(queries))
    q, k, v = (x if rank == 4 else ops.expand_dims(x, 1) for x in (queries, keys, values))
    B, Hkv, steps, D = ops.shape(k)
    pair = None if cache is None else kv_cache.check_pair(
        ops, "cache", _lifted_pair(ops, cache, rank), (B, Hkv, D), ops.dtype_name(k),
        ops.shape(v)[3])
    size = kv_cache.capacity_of(ops, None if pair is None else pair[0], capacity, options.window)
    at, written, (seen, keys_at) = _written(ops, pair, (k, v), start, steps, size, options,
                                            ragged or {})
    ragged_rows = kv_cache.per_example(at)
    if options.positional == "rotary":
        q = rotated_heads(ops, q, at.query, options.rotary_base,
                          at.query if ragged_rows else None, at.tables)
    result = dot_product_attention(
        q, *seen, causal=True, window=options.window, softcap=options.softcap,
        scale=options.scale, positional="alibi" if options.positional == "alibi" else None,
        ops=ops, _heads=True, _offset=at.query, _positions=at if ragged_rows else None,
        _key_positions=keys_at and keys_at[0], _key_valid=keys_at and keys_at[1],
        **{name: value for name, value in pooling.items() if value is not None})
    if rank == 3:
        out = result[0][:, 0] if isinstance(result, tuple) else result[:, 0]
        result = (out, *result[1:]) if isinstance(result, tuple) else out
        written = tuple(x[:, 0] for x in written)
    return result, (written[0], written[1])


def _lifted_pair(ops: Ops, cache: Any, rank: int) -> Any:
    """A rank-3 call's cache ``(B, C, D)`` pair as heads ``(B, 1, C, D)``; others as given."""
    if rank == 4 or not isinstance(cache, (tuple, list)) or len(cache) != 2:
        return cache
    return tuple(ops.expand_dims(x, 1) if hasattr(x, "shape") and len(ops.shape(x)) == 3 else x
                 for x in cache)


def ragged_arguments(cache: Any, capacity: Any, lengths: Any, padding: Any, padding_mask: Any
                     ) -> dict[str, Any]:
    """A cached call's ``lengths``, ``padding`` and ``padding_mask``; refused without a cache."""
    given = {"lengths": lengths, "padding_mask": padding_mask}
    if cache is None and capacity is None:
        for name, value in {**given, "padding": None if padding == "right" else padding}.items():
            if value is not None:
                raise ValueError(f"{name} is an argument of a cached call: give cache or "
                                 "capacity too (uncached calls take valid_lens or mask)")
    return {"padding": padding, **{name: value for name, value in given.items()
                                    if value is not None}}


def refuse_in_cached_call(**arguments: Any) -> None:
    """Refuses the arguments a cached call does not take (its keys are the cache's rows)."""
    for name, value in arguments.items():
        if value is not None:
            raise ValueError(f"{name} must be None in a cached call (cache or capacity given): "
                             "the cache's rows up to each query's position are its keys")


def per_query(ops: Ops, x: Array, table: Array) -> Array:
    """``y[b, h, i] = x[b, h, i] @ table[i]``: a different matrix for every query.

    Args:
        ops: The backend's ops.
        x: ``(B, H, Q, A)``.
        table: ``(Q, A, C)``, or ``(B, Q, A, C)``: one per example and query.

    Returns:
        ``(B, H, Q, C)``, by one batched product over the queries.
    """
    if len(ops.shape(table)) == 4:  # (B, Q, H, A) @ (B, Q, A, C)
        return ops.transpose(ops.matmul(ops.transpose(x, (0, 2, 1, 3)), table), (0, 2, 1, 3))
    heads = ops.shape(x)[1]
    rows = ops.shape(table)[0]
    columns = ops.shape(table)[2]
    by_query = ops.reshape(ops.transpose(x, (2, 0, 1, 3)), (rows, -1, ops.shape(x)[3]))  # (Q, BH, A)
    y = ops.reshape(ops.matmul(by_query, table), (rows, -1, heads, columns))  # (Q, B, H, C)
    return ops.transpose(y, (1, 2, 0, 3))


def relative_multi_head_attention(
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
    return_weights: bool | str = False,
    cache: Any = None,
    start: Any = 0,
    capacity: int | None = None,
    lengths: Any = None,
    padding: str = "right",
    padding_mask: Any = None,
    ops: Ops | None = None,
) -> Any:
    """Multi-head attention with relative position representations (Shaw et al., 2018).

    With ``a_ij = E[clip(j - i, -m, m) + m]`` the learned vector of the offset between key ``j``
    and query ``i`` (:func:`~attention_core.positional.relative_offsets`), each head computes

    ``e_ij = q_i . (k_j + aK_ij) / sqrt(d)``, ``w_i = softmax over visible j of e_ij``,
    ``o_i = sum_j w_ij (v_j + aV_ij)``,

    the value term only when the mapping has ``rel_v.embedding``. The tables are shared by
    every head. The weights are always formed (the offsets' terms need them), so there is no
    blockwise or fused path.

    Args:
        queries: ``(B, Q, Dq)``.
        keys: ``(B, K, Dk)``.
        values: ``(B, K, Dv)``.
        weights: Those of :func:`multi_head_attention`, plus ``rel_k.embedding (2m + 1, h/H)``
            and, optionally, ``rel_v.embedding (2m + 1, h/H)``.
        num_heads: H; must divide h.
        valid_lens: See :func:`multi_head_attention`.
        mask: See :func:`multi_head_attention`.
        causal: See :func:`multi_head_attention`.
        dropout: Dropout rate on the attention weights (both value terms use the dropped ones).
        return_weights: Also return the weights ``(B, H, Q, K)``, before dropout; see
            :func:`attention_core.attention.dot_product_attention` for ``ON_READ``.
        cache: A key/value cache (see :func:`multi_head_attention`): the call is causal over
            it, query ``i`` at position ``start + i``, each offset measured from there.
        start: See :func:`multi_head_attention`.
        capacity: See :func:`multi_head_attention`.
        lengths: See :func:`multi_head_attention`.
        padding: See :func:`multi_head_attention`.
        padding_mask: See :func:`multi_head_attention`.
        ops: The backend's ops; found from ``queries`` when omitted.

    Returns:
        The output ``(B, Q, h)``, and the weights if asked; then the new cache when ``cache``
        or ``capacity`` is given.
    """
    ops = ops or ops_for(queries, "queries")
    weights = _checked(ops, "relative_multi_head_attention", weights,
                       lambda size: W.relative_call_spec(size, weights, num_heads),
                       (queries, keys, values))
    dropout = checks.check_dropout(dropout)
    num_hiddens = fixed_shape(ops, weights["W_q.kernel"])[-1]
    num_hiddens, num_heads = checks.check_heads(num_hiddens, num_heads)
    ragged = ragged_arguments(cache, capacity, lengths, padding, padding_mask)
    cached = cache is not None or capacity is not None
    if cached:
        refuse_in_cached_call(valid_lens=valid_lens, mask=mask)
    table_k, table_v = weights["rel_k.embedding"], weights.get("rel_v.embedding")
    m = (fixed_shape(ops, table_k)[0] - 1) // 2
    q = split_heads(ops, project(ops, queries, weights, "W_q"), num_heads)  # (B, H, Q, d)
    k = split_heads(ops, project(ops, keys, weights, "W_k"), num_heads)  # (B, H, K, d)
    v = split_heads(ops, project(ops, values, weights, "W_v"), num_heads)  # (B, H, K, d)
    B, H, Q, _ = ops.shape(q)
    if cached:
        pair = None if cache is None else kv_cache.check_pair(
            ops, "cache", cache, (B, H, ops.shape(k)[3]), ops.dtype_name(k))
        size = kv_cache.capacity_of(ops, None if pair is None else pair[0], capacity)
        at, new_cache, ((k, v), _) = _written(ops, pair, (k, v), start, Q, size, CLASSIC, ragged)
        offsets, visible = _cached_offsets(ops, at, Q, size, m, q)
    else:
        offsets = relative_offsets(ops, Q, ops.shape(k)[2], m, like=q)  # (Q, K, R)
        visible = visibility(ops, (B, H, Q, ops.shape(k)[2]), valid_lens, mask, causal)
    q = q * (1.0 / math.sqrt(num_hiddens // num_heads))  # the heads' depth
    scores = matmul_transposed(ops, q, k)  # (B, H, Q, K)
    by_offset = ops.matmul(q, ops.transpose(table_k, (1, 0)))  # (B, H, Q, R)
    rank = len(ops.shape(offsets))
    scores = scores + per_query(ops, by_offset, ops.transpose(
        offsets, (0, 2, 1) if rank == 3 else (0, 1, 3, 2)))
    attn = softmax_visible(ops, scores, visible)  # (B, H, Q, K)
    dropped = ops.dropout(attn, dropout) if dropout > 0 else attn
    out = ops.matmul(dropped, v)  # (B, H, Q, d)
    if table_v is not None:
        out = out + ops.matmul(per_query(ops, dropped, offsets), table_v)  # (B, H, Q, R) @ (R, d)
    out = project(ops, merge_heads(ops, out), weights, "W_o")  # (B, Q, h)
    result = (out, attn) if return_weights else out
    return (result, new_cache) if cached else result


def _cached_offsets(ops: Ops, at: kv_cache.Positions, steps: int, capacity: int, m: int,
                    like: Array) -> tuple[Array, Array]:
    """A cached call's relative offsets and causal mask, its queries at their positions.

    Returns:
        The one-hot offsets ``(t, C, 2m + 1)`` (``(B, t, C, 2m + 1)`` per example) and the
        mask of the rows each query sees, ``j <= p_i``: ``(t, C)`` (``(B, 1, t, C)``).
    """
    if not kv_cache.per_example(at):
        return (relative_offsets(ops, steps, capacity, m, like, first=at.query),
                kv_cache.visible(ops, at.query, steps, capacity))
    rows = ops.expand_dims(ops.expand_dims(ops.arange(capacity), 0), 0)  # (1, 1, C)
    seen = rows <= ops.expand_dims(at.query, -1)  # (B, t, C)
    return (relative_offsets(ops, steps, capacity, m, like, rows=at.query),
            ops.expand_dims(seen, 1))
