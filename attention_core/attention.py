"""Masked softmax and attention pooling: scaled dot-product, additive, Nadaraya-Watson.

Shape legend: B batch, H heads, Q queries, K keys, D depth of queries and keys, Dv depth of
values. Functions take the backend's own arrays and find the backend from their type, unless
an ``ops`` is passed (the adapters pass one that knows about training mode and randomness).
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from attention_core import checks, masks
from attention_core import weights as W
from attention_core.blockwise import blockwise_attention
from attention_core.linear import dense
from attention_core.masks import FILL_VALUE
from attention_core.ops import Array, Ops
from attention_core.positional import rotated_heads
from attention_core.registry import ops_for
from attention_core.scores import ScoreTerms, pooled, products, repeat_heads


def softmax_visible(ops: Ops, scores: Array, visible: Array | None) -> Array:
    """Softmax over the last axis counting only visible keys.

    ``w_ij = exp(s_ij - m_i) / sum_{j visible} exp(s_ij - m_i)`` for visible ``j``, 0 otherwise,
    with ``m_i`` the row's largest visible score. Masked entries are replaced by the dtype's
    most negative value before the exponential, whose result there is exactly 0. A row with no
    visible key, or whose visible scores are all ``-inf`` (or at the dtype's lowest value,
    which weighs like ``-inf``), therefore sums to 0; that sum is replaced by 1 before
    dividing, so the row is all zeros and no NaN appears, in values or in gradients. A ``+inf``
    or NaN visible score makes its row NaN, as IEEE arithmetic has it.

    Args:
        ops: The backend's ops.
        scores: ``(..., Q, K)``.
        visible: Boolean, broadcastable to ``scores``, or None for no mask.

    Returns:
        The weights, shape and dtype of ``scores``.
    """
    softmax = getattr(ops, "softmax", None)
    if softmax is not None:  # the framework's one-kernel softmax
        return _softmax_then_zero(ops, softmax, scores, visible)
    fill = FILL_VALUE[ops.dtype_name(scores)]
    masked = scores if visible is None else ops.where(visible, scores, fill)
    top = ops.max(masked, -1)  # (..., Q, 1)
    top = ops.where(top > fill, top, 0.0)  # nothing visible above the fill: avoid s - fill overflow
    shifted = scores - top
    e = ops.exp(shifted if visible is None else ops.where(visible, shifted, fill))  # 0 if masked
    total = ops.sum(e, -1)
    return e / ops.where(total != 0, total, 1.0)  # a NaN total (a NaN or +inf score) stays


def _softmax_then_zero(ops: Ops, softmax: Any, scores: Array, visible: Array | None) -> Array:
    """:func:`softmax_visible` by a framework's softmax kernel (``ops.softmax(x)``, last axis).

    Masked scores become the dtype's most negative value, whose exponential after the row's
    visible maximum is subtracted is exactly 0; rows with no visible score above that value
    (no visible key, or visible scores all ``-inf``), which the kernel makes uniform over the
    masked keys or NaN, are set to 0.
    """
    raw, seen = _filled_softmax(ops, softmax, scores, visible)
    return ops.where(seen, raw, 0.0)


def _filled_softmax(
    ops: Ops, softmax: Any, scores: Array, visible: Array | None
) -> tuple[Array, Array]:
    """``softmax`` of the scores with masked ones set to the fill, and which rows to keep.

    Returns:
        ``(weights, seen)``: ``seen`` ``(..., Q, 1)`` is False for the rows whose largest
        unmasked score is at most the fill (no visible key, or only ``-inf`` ones: the kernel
        leaves those uniform over the masked keys, or NaN), True otherwise, also for the rows
        whose largest score is NaN.
    """
    fill = FILL_VALUE[ops.dtype_name(scores)]
    filled = scores if visible is None else ops.where(visible, scores, fill)
    return softmax(filled), _seen_by_top(ops, filled, fill)


def _filled(ops: Ops, scores: Array, visible: Array | None, fill: float) -> Array:
    """The scores with the masked ones at the fill."""
    return scores if visible is None else ops.where(visible, scores, fill)


def _seen_by_top(ops: Ops, filled: Array, fill: float) -> Array:
    """Boolean ``(..., Q, 1)``: whether the row's largest score is above the fill.

    Masked scores are at the fill already. A NaN largest score counts as above (its row stays
    NaN). A pass over the scores.
    """
    top = ops.max(filled, -1)  # (..., Q, 1)
    return ops.where(top == top, top, math.inf) > fill


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
    return pool_visible(ops, scores, values, visible, dropout)


def pool_visible(
    ops: Ops,
    scores: Array,
    values: Array,
    visible: Array | None,
    dropout: float,
    want_weights: bool = True,
    finite: bool = False,
) -> tuple[Array, Array | None]:
    """``(dropout(w) @ values, w)`` with ``w = softmax_visible(scores, visible)``.

    Backends with a softmax kernel (``ops.softmax``) normalise in one pass; the rows with no
    visible score above the fill (see :func:`_filled_softmax`) are then zeroed in the output
    (and in the weights only when they are wanted).

    Args:
        ops: The backend's ops.
        scores: ``(B, H, Q, K)``.
        values: ``(B, H, K, Dv)`` or broadcastable.
        visible: Boolean mask broadcastable to the scores, or None.
        dropout: Rate applied to the weights before pooling (0 for none).
        want_weights: Whether the weights are returned; None is returned in their place
            otherwise (when that saves work).
        finite: The scores are known to be finite and above the fill (an eager call whose
            inputs were probed, or the branch of a traced call whose bound holds, see
            :func:`_inputs_in_range`): the softmax kernel's rows then need zeroing only where
            no key is visible, which skips a pass over the scores.
    """
    raw, seen = _softmax_rows(ops, scores, visible, finite)
    dropped = ops.dropout(raw, dropout) if dropout > 0 else raw
    out = pooled(ops, dropped, values)  # (grouped-query heads pool their group's values)
    if seen is None:
        return out, raw
    return ops.where(seen, out, 0.0), (ops.where(seen, raw, 0.0) if want_weights else None)


def visible_weights(ops: Ops, scores: Array, visible: Array | None, finite: bool = False) -> Array:
    """The weights of :func:`pool_visible` alone, with no values pooled."""
    raw, seen = _softmax_rows(ops, scores, visible, finite)
    return raw if seen is None else ops.where(seen, raw, 0.0)


def _softmax_rows(
    ops: Ops, scores: Array, visible: Array | None, finite: bool
) -> tuple[Array, Array | None]:
    """``(weights, seen)``: the softmax of the visible scores, and the rows to keep.

    ``seen`` is None when every row is already right (no softmax kernel: zeroed by
    :func:`softmax_visible`; or nothing masked); else the rows outside it are to be zeroed.
    """
    softmax = getattr(ops, "softmax", None)
    if softmax is None:
        return softmax_visible(ops, scores, visible), None
    if finite:
        fill = FILL_VALUE[ops.dtype_name(scores)]
        raw = softmax(scores if visible is None else ops.where(visible, scores, fill))
        return raw, None if visible is None else _any_visible(ops, visible)
    return _filled_softmax(ops, softmax, scores, visible)


def known_finite(ops: Ops, *arrays: Array) -> bool:
    """Whether the arrays' values are known now (an eager call) and all finite.

    One sum per array (float16 ones in float32, whose range the sum of any float16 array
    stays in), so the check costs a read of each and one transfer of a number to the host.
    """
    return _probe(ops, arrays, ())[0]


def _probe(
    ops: Ops, summed: tuple[Array, ...], bounded: tuple[Array, ...]
) -> tuple[bool, tuple[float, ...]]:
    """Probes the inputs of an eager call: ``(finite, norms)``.

    ``finite``: whether every array is known now and finite; ``norms``: the largest squared
    norm of a row (last axis) of each ``bounded`` array, empty when not known now. The
    ``summed`` arrays are checked by one sum each, the ``bounded`` ones by their rows' sums of
    squares (which overflow, and so count as not finite, only where a score could). Float16 is
    taken in float32. One transfer of a few numbers to the host, whatever the number of arrays.
    """
    flat = [ops.reshape(_widened(ops, x), (1, -1)) for x in summed]
    total = functools.reduce(operator.add, [ops.sum(x, -1) for x in flat])
    parts = [total] + [_largest_row_square(ops, x) for x in bounded]  # each (1, 1)
    value = ops.concrete(parts[0] if len(parts) == 1 else ops.concatenate(parts, -1))
    if value is None:  # under tracing
        return False, ()
    values = np.asarray(value, dtype=np.float64).reshape(-1)
    return bool(np.isfinite(values).all()), tuple(float(x) for x in values[1:])


def _widened(ops: Ops, x: Array) -> Array:
    """``x``, in float32 if it is float16 (whose sums of squares overflow early)."""
    return ops.astype(x, "float32") if ops.dtype_name(x) == "float16" else x


def _largest_row_square(ops: Ops, x: Array) -> Array:
    """``(1, 1)``: the largest squared norm of a row (last axis) of ``x``.

    Float16 is taken in float32. Inf or NaN when ``x`` holds either (or the squares overflow).
    """
    wide = _widened(ops, x)
    return ops.max(ops.reshape(ops.sum(wide * wide, -1), (1, -1)), -1)


def _scores_in_range(ops: Ops, q: Array, k: Array, factor: Any) -> Array:
    """``(1, 1)`` boolean, in the graph: whether the scores are far inside the dtype's range.

    True when ``|q| |k| factor``, which bounds every score ``q . k * factor`` and its partial
    sums, is below half the dtype's largest value. Scores are then finite and far above the
    fill (the dtype's lowest value), so a row needs zeroing only where no key is visible. False
    for a NaN or inf in ``q`` or ``k``. Costs a pass over the queries and keys, O((Q + K) D),
    nothing over the scores, and no host sync.
    """
    norms = ops.sqrt(_largest_row_square(ops, q)) * ops.sqrt(_largest_row_square(ops, k))
    if not isinstance(factor, float):  # a run-time factor, in the inputs' dtype
        factor = ops.astype(factor, ops.dtype_name(norms))
    return norms * factor < 0.5 * _LARGEST[ops.dtype_name(q)]


def _inputs_in_range(ops: Ops, q: Array, k: Array, v: Array, factor: Any) -> Array:
    """``(1, 1)`` boolean, in the graph: no input needs mending and no score can overflow.

    :func:`_scores_in_range` for the queries and keys (False when either holds a NaN or an
    inf), and the values finite, told by their sum (NaN or inf when any value is, or when the
    sum overflows; float16 summed in float32). When it holds, :func:`non_finite_rows` and
    :func:`values_onto_keys` change nothing, and every score is finite and far above the fill.
    A pass over each of the queries, keys and values, and no host sync.
    """
    total = ops.sum(ops.reshape(_widened(ops, v), (1, -1)), -1)  # (1, 1)
    return ops.logical_and(_scores_in_range(ops, q, k, factor), total - total == 0)


def non_finite_rows(ops: Ops, x: Array) -> Array:
    """Makes every row (last axis) of ``x`` that holds a NaN or an inf all NaN.

    An inf in a query or a key is treated as a NaN: its row reaches exactly the rows that see
    it, whole, as a NaN does (an inf score alone could weigh 0, or give a finite row).
    """
    return x + ops.sum(x - x, -1)


def values_onto_keys(ops: Ops, keys: Array, values: Array) -> tuple[Array, Array]:
    """Moves each non-finite value onto its key: that value row becomes zeros, the key NaN.

    A masked key weighs exactly 0, but ``0 * NaN`` is NaN, so a NaN or inf in the value of a
    masked key would reach every row through the product of the weights and the values. A NaN
    key reaches exactly the rows that see it: its scores are NaN there and replaced by the fill
    where it is masked. Moved to the key, the value's NaN or inf reaches the same rows, whole
    (NaN in every column), and no other.

    Args:
        ops: The backend's ops.
        keys: ``(..., K, D)``.
        values: ``(..., K, Dv)``, the leading axes those of ``keys``.

    Returns:
        ``(keys, values)``, changed only in the rows whose value holds a NaN or inf.
    """
    nan = ops.sum(values - values, -1)  # (..., K, 1): 0, or NaN where the row has a NaN or inf
    return keys + nan, ops.where(nan == 0, values, 0.0)


def _any_visible(ops: Ops, visible: Array) -> Array:
    """Boolean ``(..., Q, 1)``: whether the query row has a visible key."""
    return ops.max(ops.astype(visible, "int32"), -1) > 0


def _lift(ops: Ops, x: Array, rank: int) -> Array:
    """Adds the heads axis to a rank-3 array: ``(B, N, D) -> (B, 1, N, D)``."""
    return x if rank == 4 else ops.expand_dims(x, 1)


#: The ways :func:`dot_product_attention` can pool; None lets :func:`choose_implementation` pick.
IMPLEMENTATIONS = checks.IMPLEMENTATIONS

#: Scores ``B * H * Q * K`` from which the automatic choice stops forming the weights (16 MiB
#: of float32): below it the direct path's few large kernels are quickest, above it the
#: blockwise path is as fast or faster and its memory stays flat (see the README's benchmarks).
BLOCKWISE_MIN_SCORES = 2**22


def choose_implementation(
    ops: Ops, implementation: str | None, return_weights: bool, shape: tuple[Any, ...]
) -> str:
    """Picks how :func:`dot_product_attention` pools.

    The rule: weights asked for -> ``direct`` (the only path that forms them). Otherwise an
    explicit ``implementation`` is taken as given. Otherwise ``fused`` when the backend has a
    fused kernel and prefers it for this shape (``ops.prefers_fused``, True when absent);
    else ``blockwise`` when there are at least ``ops.blockwise_min_scores`` scores
    (:data:`BLOCKWISE_MIN_SCORES` when the ops do not say) and Q and K are known now; else
    ``direct``.

    Args:
        ops: The backend's ops.
        implementation: None, ``"direct"``, ``"blockwise"`` or ``"fused"``.
        return_weights: Whether the weights are wanted.
        shape: ``(B, H, Q, K)``; dimensions may be run-time tensors.

    Raises:
        ValueError: An unknown name, a path that cannot give what is asked, or ``fused`` on a
            backend without a fused kernel.
    """
    checks.check_implementation(implementation)
    if return_weights and implementation not in (None, "direct"):
        raise ValueError(
            f"implementation={implementation!r} never forms the attention weights: "
            "return_weights=True needs implementation=None or 'direct'"
        )
    fused = getattr(ops, "fused_attention", None)
    if implementation == "fused" and fused is None:
        raise ValueError(
            f"implementation='fused': the {ops.name} backend has no fused attention kernel; "
            "use None, 'direct' or 'blockwise'"
        )
    known = all(isinstance(d, int) for d in shape)
    if implementation == "blockwise" and not all(isinstance(d, int) for d in shape[2:]):
        raise ValueError(
            "implementation='blockwise' needs the numbers of queries and keys to be known "
            f"when the call is traced, got (B, H, Q, K) = {checks.fmt_shape(shape)}"
        )
    if return_weights:
        return "direct"
    if implementation is not None:
        return implementation
    prefers = getattr(ops, "prefers_fused", None)
    if fused is not None and (prefers is None or prefers(shape)):
        return "fused"
    B, H, Q, K = shape
    threshold = getattr(ops, "blockwise_min_scores", BLOCKWISE_MIN_SCORES)
    return "blockwise" if known and threshold <= B * H * Q * K else "direct"


def fused_pool(
    ops: Ops, q: Array, k: Array, v: Array, visible: Array | None, factor: Any, dropout: float,
    finite: bool = False, local: tuple[int, int] | None = None,
) -> Array:
    """Pools with the backend's ``fused_attention``.

    Rows with no visible key are zeroed here when the kernel does not zero them itself
    (``ops.fused_zeroes_empty_rows`` False). When the kernel does not put NaN where the direct
    path has it (``ops.fused_propagates_nan`` False), :func:`_fused_nan_rows` does, unless the
    inputs are known to be ``finite``. ``local`` is a sliding window already in ``visible``,
    as ``(left, right)`` keys of query index ``i`` (:meth:`~attention_core.masks.Visibility.local`):
    a kernel that takes one (``ops.fused_local_window``) is told, so it may skip the keys
    outside it.
    """
    if local is not None and getattr(ops, "fused_local_window", False):
        kernel = functools.partial(ops.fused_attention, local_window=local)  # type: ignore[attr-defined]
    else:
        kernel = ops.fused_attention  # type: ignore[attr-defined]
    if finite or getattr(ops, "fused_propagates_nan", True):
        out = kernel(q, k, v, visible, factor, dropout)
    else:
        out = _fused_nan_rows(ops, kernel, q, k, v, visible, factor, dropout)
    if visible is None or getattr(ops, "fused_zeroes_empty_rows", True):
        return out
    return ops.where(_any_visible(ops, visible), out, 0.0)


def _fused_nan_rows(
    ops: Ops, kernel: Callable[..., Array], q: Array, k: Array, v: Array, visible: Array | None,
    factor: Any, dropout: float,
) -> Array:
    """The fused kernel on finite queries and keys, then NaN in the rows the direct path has it.

    Those rows are the ones that see a non-finite key (values' are on their keys already, see
    :func:`values_onto_keys`) and the ones with a non-finite query that see any key. A kernel
    that adds the mask to the scores turns a masked NaN key into NaN for every row (NaN + -inf);
    torch's gives a NaN query row zeros when there is no mask, and NaN when nothing is visible.
    The NaN is made from booleans, so no gradient passes through it: on finite inputs the
    values and the gradients are the kernel's own.
    """
    q_ok, k_ok = ops.sum(q - q, -1) == 0, ops.sum(k - k, -1) == 0  # (B, H, Q|K, 1): finite rows
    q, k = ops.where(q_ok, q, 0.0), ops.where(k_ok, k, 0.0)
    out = kernel(q, k, v, visible, factor, dropout)
    dtype = ops.dtype_name(out)  # not the queries' under torch.autocast
    q_bad = 1.0 - ops.astype(q_ok, dtype)  # (B, H, Q, 1): 1 for a non-finite query
    k_bad = 1.0 - ops.astype(ops.transpose(k_ok, (0, 1, 3, 2)), dtype)  # (B, Hkv, 1, K)
    k_bad = repeat_heads(ops, k_bad, ops.shape(q)[1])  # (B, H, 1, K)
    if visible is None:  # every row sees every key
        count = ops.sum(k_bad, -1) + q_bad
    else:  # visible may broadcast along any axis, the keys' too
        seen = ops.astype(visible, dtype)
        count = ops.sum(seen * k_bad, -1) + q_bad * ops.max(seen, -1)  # (B, H, Q, 1)
    bad = count > 0
    return out + ops.where(bad, ops.astype(bad, dtype) * math.nan, 0.0)


#: The largest finite value of each dtype.
_LARGEST = {dtype: -fill for dtype, fill in FILL_VALUE.items()}


def _may_overflow(ops: Ops, q: Array, factor: Any, norms: tuple[float, ...]) -> bool:
    """Whether a score ``q . k * factor`` may overflow the dtype: True unless known now not to.

    A fused kernel adds the mask to the scores or fills them with a finite value of its own, so
    an overflowed score (``+inf`` at a masked key, or ``-inf`` at every visible key) would put
    weight or NaN on masked keys: it is skipped when this is True in an eager call. Under
    tracing it is used where the ops have no ``cond``; with one, the kernel runs only when
    :func:`_inputs_in_range` holds, checked in the graph (or, with ``attend_out_of_range``,
    when the program runs). The direct and blockwise paths mask
    the scores they form. ``norms`` are the largest squared row norms of the queries and keys
    (``|q . k| <= |q| |k|``), empty under tracing.
    """
    if not norms or not isinstance(factor, float):  # not known now
        return True
    bound = math.sqrt(norms[0]) * math.sqrt(norms[1]) * factor  # NaN (a NaN input): mended
    return bound >= 0.5 * _LARGEST[ops.dtype_name(q)]


def _unfused_path(ops: Ops, shape: tuple[Any, ...]) -> str:
    """The path :func:`choose_implementation` takes when there is no fused kernel."""
    threshold = getattr(ops, "blockwise_min_scores", BLOCKWISE_MIN_SCORES)
    known = all(isinstance(d, int) for d in shape)
    return "blockwise" if known and threshold <= math.prod(shape) else "direct"


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
    ops: Ops | None = None,
    _heads: bool = False,
    _offset: Any = None,
) -> Array | tuple[Array, Any]:
    """Scaled dot-product attention: ``softmax(Q K^T * scale) V`` over the visible keys.

    Query ``i`` stands at position ``p_i = i + (K - Q)``, key ``j`` at ``j`` (the positions
    ``causal``, ``window``, ALiBi and rotary positions use). Before masking, the scores may be
    soft-capped, given ALiBi biases and ``score_bias``, in that order
    (:mod:`attention_core.scores`); masks win over all of them.

    Args:
        queries: ``(B, Q, D)`` or ``(B, H, Q, D)``.
        keys: ``(B, K, D)`` or ``(B, Hkv, K, D)``, the rank of ``queries``; Hkv divides H
            (grouped-query attention: query head ``h`` uses key/value head ``h // (H / Hkv)``).
        values: ``(B, K, Dv)`` or ``(B, Hkv, K, Dv)``.
        valid_lens: Integer lengths, ``(B,)`` or ``(B, Q)``, shared by every head.
        mask: Boolean, True = may attend: ``(Q, K)``, ``(B, Q, K)`` or ``(B, H, Q, K)``.
        causal: Query ``i`` sees keys ``j <= i + (K - Q)``.
        scale: Multiplies the scores; ``1 / sqrt(D)`` when None.
        dropout: Dropout rate on the attention weights (applied whenever > 0).
        return_weights: Also return the weights, before dropout (direct path only).
            :data:`ON_READ`: in an eager call, pool as if they were not asked for and return
            a :class:`WeightsOnRead` that forms them; under tracing, return them as True does.
        implementation: ``"direct"`` forms the ``(B, H, Q, K)`` weights; ``"blockwise"`` visits
            the keys a block at a time with an online softmax and needs memory independent of
            K (:mod:`attention_core.blockwise`); ``"fused"`` calls the backend's own fused
            kernel (torch's ``scaled_dot_product_attention``, ...). None picks one by the rule
            of :func:`choose_implementation`. All three give the same numbers within the
            dtype's rounding. Soft-capping, ALiBi and ``score_bias`` are not given to a fused
            kernel: None then picks another path, and ``"fused"`` is refused.
        window: Query ``i`` sees only the keys ``j`` with ``|p_i - j| < window`` (with
            ``causal``, the ``window`` keys ending at its own position); ANDed with the other
            masks. The blockwise path skips the key blocks outside it: O(Q * window) work.
        softcap: c: the scaled scores become ``c * tanh(s / c)`` (Gemma 2); None for none.
        score_bias: Float, broadcastable to ``(B, H, Q, K)`` (``(Q, K)``, ``(B, Q, K)`` or
            ``(B, H, Q, K)``), added to the scores before masking.
        positional: ``"rotary"`` rotates the queries and keys by their positions (RoPE,
            :func:`~attention_core.positional.rotate`, ``rotary_base``); ``"alibi"`` adds
            ``-slope_h * |p_i - j|`` with the standard slopes of the H heads; None for neither.
        rotary_base: The base of the rotary frequencies ``base^(-2t/D)``.
        ops: The backend's ops; found from ``queries`` when omitted.
        _heads: Internal (:mod:`attention_core.multihead`): the inputs are heads this call
            projected from checked inputs. They are not checked again, and weights formed on
            read keep them as they are; otherwise they keep copies, which a change in place to
            the caller's arrays does not reach.
        _offset: Internal (cached calls): ``p_i - i``, in place of ``K - Q``.

    Returns:
        The output, shape of ``queries`` with depth Dv; with ``return_weights``, also the
        weights of shape ``(B, H, Q, K)`` (H = 1 for rank-3 inputs).
    """
    ops = ops or ops_for(queries, "queries")
    if not _heads:
        checks.check_qkv(ops, queries, keys, values)
    dropout = checks.check_dropout(dropout)
    rank = len(ops.shape(queries))
    factor = _scale_factor(ops, queries, scale)
    q, k, v = (_lift(ops, x, rank) for x in (queries, keys, values))  # (B, H, N, D)
    B, H, Q, _ = ops.shape(q)
    K = ops.shape(k)[2]
    shape = (B, H, Q, K)
    offset = K - Q if _offset is None else _offset
    positional = checks.check_positional(positional)
    if positional == "rotary":  # the positions' rotations, kept by weights formed on read too
        q, k = rotated_heads(ops, q, offset, rotary_base), rotated_heads(ops, k, 0, rotary_base)
    terms = ScoreTerms(ops, shape, offset, softcap, positional == "alibi", score_bias)
    terms_or_none = None if terms.empty else terms
    checks.check_return_weights(return_weights)
    # nothing to mend when the inputs are known finite (eager calls: one sum, one host sync);
    # a fused kernel is given only inputs whose scores cannot overflow (see _may_overflow)
    finite, norms = _probe(ops, (v,), (q, k))
    on_read = return_weights == ON_READ and bool(norms)  # an eager call: formed when read
    if return_weights == ON_READ and not norms:  # traced: formed in the program, as asked
        return_weights, implementation = True, None
    want = bool(return_weights) and not on_read
    if terms_or_none is not None and implementation == "fused":
        raise ValueError("implementation='fused': soft-capping, ALiBi and score_bias are not "
                         "given to a fused kernel; use None, 'direct' or 'blockwise'")
    visible = masks.Visibility(ops, shape, valid_lens, mask, causal, window, offset)
    path = choose_implementation(ops, implementation, want, shape)
    overflow = _may_overflow(ops, q, factor, norms)
    # a window goes to a fused kernel as a mask, so not by choice, unless the kernel takes it
    fused_fits = terms_or_none is None and (visible.window is None or implementation == "fused"
                                            or getattr(ops, "fused_local_window", False))
    if path == "fused" and ((overflow and norms) or not fused_fits):  # not the kernel
        path = _unfused_path(ops, shape)

    def pool(path: str, finite: bool, overflow: bool) -> Any:
        """The output on ``path``, and the weights when asked; inputs mended unless ``finite``."""
        out, weights = _pooled(ops, (q, k, v), visible, factor, dropout, path, want,
                               finite, overflow, terms_or_none)
        return (out, weights) if want else out

    cond = getattr(ops, "cond", None)
    # one bound for the whole batch: where a program may split the batch over devices, only
    # the fused kernel is worth a collective (see attention_core.ops.FusedAttentionOps)
    guarded = ("fused",) if getattr(ops, "batch_spans_devices", False) else ("fused", "direct")
    if not norms and cond is not None and path in guarded:
        # traced (nothing probed): a bound checked in the graph picks the branch. When it holds
        # the inputs need no mending and the scores cannot overflow: the path as chosen, on the
        # inputs as given, with no pass over the scores to find rows to zero. Otherwise the
        # inputs are mended, and the fused kernel gives way to the unfused path.
        slow = _unfused_path(ops, shape) if path == "fused" else path
        result = cond(_inputs_in_range(ops, q, k, v, factor), lambda: pool(path, True, False),
                      lambda: pool(slow, finite, True))
    elif not norms and path == "fused" and (outside := getattr(ops, "attend_out_of_range", None)):
        # traced where no branch can be taken in the graph: an operator checks the bound when
        # it runs, and gives the eager call's output where it fails; the kernel runs on the
        # inputs otherwise (zeros where the bound fails), and the output is picked
        out_of_range, slow = outside(q, k, v, visible.full(), factor, dropout)
        in_range = [ops.where(out_of_range, 0.0, x) for x in (q, k, v)]
        fast, _ = _pooled(ops, (in_range[0], in_range[1], in_range[2]), visible, factor,
                          dropout, path, False, True, False, None)
        # in the kernel's dtype (torch.autocast runs the kernel, not the operator, in its own)
        result = ops.where(out_of_range, ops.astype(slow, ops.dtype_name(fast)), fast)
    else:
        result = pool(path, finite, overflow)
    out, weights = result if want else (result, None)
    out = out if rank == 4 else out[:, 0]
    if on_read:  # the direct path's weights, from the inputs as this call had them
        kept = (q, k, v) if _heads else tuple(_snapshot(x) for x in (q, k, v))
        weights = WeightsOnRead(lambda: _direct_weights(ops, kept, visible, factor, finite,
                                                        overflow, terms_or_none))
    return (out, weights) if return_weights else out



def _snapshot(x: Array) -> Array:
    """A copy of ``x`` its caller cannot change in place (torch, NumPy and MXNet arrays can).

    ``x + 0`` keeps every value (-0 becomes 0, which no score can tell apart).
    """
    return x + 0


def _pooled(
    ops: Ops, qkv: tuple[Array, Array, Array], visible: masks.Visibility, factor: Any,
    dropout: float, path: str, want_weights: bool, finite: bool, overflow: bool,
    terms: ScoreTerms | None,
) -> tuple[Array, Array | None]:
    """``(output, weights or None)`` of :func:`dot_product_attention` pooled on ``path``.

    Args:
        ops: The backend's ops.
        qkv: Queries, keys and values, ``(B, H, N, D)``.
        visible: The mask.
        factor: Multiplies the scores.
        dropout: Dropout rate on the weights.
        path: ``"direct"``, ``"blockwise"`` or ``"fused"``.
        want_weights: Whether the direct path returns the weights.
        finite: The inputs are known finite: nothing is mended. Otherwise a NaN or inf in a
            query or key makes its row NaN (:func:`non_finite_rows`), and a value's moves onto
            its key (:func:`values_onto_keys`); a fused kernel that does not propagate NaN is
            mended by :func:`_fused_nan_rows` instead.
        overflow: A score may overflow (the direct path then finds the rows to zero from the
            scores themselves).
        terms: What is added to the scores before masking (not on the fused path), or None.
    """
    q, k, v = _mended(ops, qkv, path, finite)
    if path == "fused":  # the backend's fused kernel: the weights are never formed
        return fused_pool(ops, q, k, v, visible.full(), factor, dropout, finite,
                          visible.local()), None
    if path == "blockwise":
        return blockwise_attention(ops, q, k, v, visible, dropout, scale=factor,
                                   terms=terms), None
    return pool_visible(ops, _direct_scores(ops, q, k, factor, terms), v, visible.full(),
                        dropout, want_weights, _in_bound(finite, overflow, terms))


def _mended(
    ops: Ops, qkv: tuple[Array, Array, Array], path: str, finite: bool
) -> tuple[Array, Array, Array]:
    """The inputs of :func:`_pooled` on ``path``, mended unless known ``finite``."""
    q, k, v = qkv
    if not finite:
        if path != "fused" or getattr(ops, "fused_propagates_nan", True):
            q, k = non_finite_rows(ops, q), non_finite_rows(ops, k)  # else _fused_nan_rows does
        k, v = values_onto_keys(ops, k, v)
    return q, k, v


def _direct_weights(
    ops: Ops, qkv: tuple[Array, Array, Array], visible: masks.Visibility, factor: Any,
    finite: bool, overflow: bool, terms: ScoreTerms | None,
) -> Array:
    """The weights :func:`_pooled` gives on the direct path, without pooling the values."""
    q, k, _ = _mended(ops, qkv, "direct", finite)
    return visible_weights(ops, _direct_scores(ops, q, k, factor, terms), visible.full(),
                           _in_bound(finite, overflow, terms))


def _in_bound(finite: bool, overflow: bool, terms: ScoreTerms | None) -> bool:
    """Whether the direct path's scores are known finite and above the fill, unread.

    ``pool_visible``'s ``finite``: the inputs are finite, no product can overflow, and no term
    is added (a bias of ``-inf``, or a slope times a long distance, is not bounded by the
    queries and keys).
    """
    return finite and not overflow and terms is None


def _direct_scores(ops: Ops, q: Array, k: Array, factor: Any, terms: ScoreTerms | None) -> Array:
    """The scores of the direct path, ``(B, H, Q, K)``, with the call's terms added."""
    s = products(ops, q * factor, k)
    if terms is None:
        return s
    _, _, Q, K = ops.shape(s)
    return terms.apply(s, 0, Q, 0, K)


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
    if not known_finite(ops, queries, keys, values):
        queries, keys = non_finite_rows(ops, queries), non_finite_rows(ops, keys)
        keys, values = values_onto_keys(ops, keys, values)
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
    q = checks.check_rank(ops, "queries", queries, (3,), "(B, Q, Dq)")
    k = checks.check_rank(ops, "keys", keys, (3,), "(B, K, Dk)")
    v = checks.check_rank(ops, "values", values, (3,), "(B, K, Dv)")
    for name, x in (("queries", queries), ("keys", keys), ("values", values)):
        checks.check_floating(ops, name, x)
    checks.check_same_dtype(ops, "queries", queries, keys=keys, values=values)
    checks.check_matmul_dtype(ops, "queries", queries)
    checks.check_equal(
        lambda: f"keys and values must have the same length, got {k[1]} keys and {v[1]} values",
        k[1],
        v[1],
    )
    for name, s in (("keys", k), ("values", v)):
        checks.check_equal(
            functools.partial(
                "{} batch size ({}) must equal queries batch size ({})".format, name, s[0], q[0]
            ),
            s[0],
            q[0],
        )


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
    if w is not None:
        diff = diff * w
    scores = ops.expand_dims(diff * diff * -0.5, 1)  # (B, 1, Q, K)
    weights = softmax_visible(ops, scores, None)
    y = ops.expand_dims(ops.expand_dims(batched[2], 1), -1)  # (B, 1, K, 1)
    out = ops.matmul(weights, y)[:, 0, :, 0]  # (B, Q)
    out = out if len(q) == 2 else out[0]
    return (out, weights) if return_weights else out
