"""``valid_lens``, boolean masks and ``causal`` -> one canonical mask.

The canonical mask is boolean, True where a query may attend to a key, and broadcasts
against scores of shape ``(B, H, Q, K)``. Every way of masking is reduced to it here, and all
of them combine with AND:

* ``valid_lens`` of shape ``(B,)``: key ``j`` is visible to every query of example ``b`` when
  ``j < valid_lens[b]``; of shape ``(B, Q)``: when ``j < valid_lens[b, i]`` for query ``i``.
* ``mask`` of shape ``(Q, K)``, ``(B, Q, K)`` or ``(B, H, Q, K)`` (size-1 axes broadcast).
* ``causal=True``: query ``i`` sees keys ``j <= i + (K - Q)``, i.e. aligned at the end when
  there are more keys than queries.
* ``window=w``: query ``i`` sees keys ``j`` with ``|i + (K - Q) - j| < w`` (with ``causal``, the
  ``w`` keys that end at its own position).

Query ``i`` stands at position ``p_i = i + (K - Q)`` and key ``j`` at ``j``; a cached call gives
its own offset (``p_i = start + i``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from attention_core.checks import check_window, fmt_shape
from attention_core.host import framework_of, host_array, plain
from attention_core.ops import Array, Ops

#: Score given to masked keys before the max is taken: the most negative finite value of the
#: dtype, so it never wins the max over a visible key (fp16 cannot hold -1e6).
FILL_VALUE = {
    "float16": -65504.0,
    "bfloat16": -3.3895313892515355e38,
    "float32": -3.4028234663852886e38,
    "float64": -1.7976931348623157e308,
}


def own(ops: Ops, x: Any) -> bool:
    """Whether ``x`` is an array of the computing backend (kept where it is, maybe traced)."""
    return framework_of(x) == ops.name and not isinstance(x, np.generic)


def as_backend_array(ops: Ops, x: Any) -> Array:
    """Converts host data of any framework to a backend array (see :func:`host_array`).

    ``valid_lens=[3, 2]``, NumPy arrays, another framework's tensors; the backend's own arrays
    are returned unchanged.
    """
    return x if own(ops, x) else ops.from_numpy(host_array(x))


def fits(shape: tuple[Any, ...], want: tuple[Any, ...], broadcast: bool) -> bool:
    """Whether ``shape`` equals ``want`` (or broadcasts to it), unknown dimensions passing."""
    if len(shape) != len(want):
        return False
    for got, need in zip(shape, want, strict=True):
        known = isinstance(got, int) and isinstance(need, int)
        if known and got != need and not (broadcast and got == 1):
            return False
    return True


def _check_lens_dtype(dtype: str, name: str = "valid_lens") -> None:
    if not dtype.startswith(("int", "uint")):
        raise TypeError(f"{name} must have an integer dtype, got {dtype}")


def _check_mask_dtype(dtype: str, name: str = "mask") -> None:
    if dtype != "bool":
        raise TypeError(f"{name} must be boolean (True = may attend), got {dtype}")


def check_dtypes(ops: Ops, arguments: Mapping[str, Any]) -> None:
    """Checks the dtypes of a call's lengths and masks as given, before any conversion.

    For adapters that must convert them to backend arrays before the core sees them (MXNet
    hands them to its graph): the messages are those of :func:`lens_column` and
    :func:`boolean_mask`, read off host data (strings, complex numbers) that the backend could
    not even hold. Lengths are the arguments named ``*valid_lens``, masks those named ``*mask``.
    """
    for name, value in arguments.items():
        if value is None or not name.endswith(("valid_lens", "mask")):
            continue
        dtype = ops.dtype_name(value) if own(ops, value) else host_array(value).dtype.name
        if name.endswith("valid_lens"):
            _check_lens_dtype(dtype, name)
        else:
            _check_mask_dtype(dtype, name)


def lens_column(
    ops: Ops, valid_lens: Any, scores_shape: tuple[Any, ...], *, name: str = "valid_lens"
) -> tuple[Array, tuple[int, int] | None]:
    """Checks ``valid_lens`` and returns it as int32 of shape ``(B, 1, 1, 1)`` or ``(B, 1, Q, 1)``.

    Key ``j`` of query ``i`` is visible when ``j < lens[b, 0, i or 0, 0]``. Also returns the
    ``(shortest, longest)`` length when the values are known now (not under tracing), else None.

    Args:
        ops: The backend's ops.
        valid_lens: Integer lengths, shape ``(B,)`` or ``(B, Q)``.
        scores_shape: ``(B, H, Q, K)``.
        name: The argument's name in messages (a decoder's ``enc_valid_lens``).

    Raises:
        TypeError: ``valid_lens`` is not integer.
        ValueError: Wrong shape, a negative length, or one longer than K.
    """
    B, _, Q, K = scores_shape
    host = None if own(ops, valid_lens) else host_array(valid_lens)  # read as given: checked before any cast
    _check_lens_dtype(ops.dtype_name(valid_lens) if host is None else host.dtype.name, name)
    shape = ops.shape(valid_lens) if host is None else host.shape
    allowed = [(B,), (B, Q)]
    if not any(fits(shape, want, broadcast=False) for want in allowed):
        raise ValueError(
            f"{name} must have shape (B,) or (B, Q) = {fmt_shape((B,))} or "
            f"{fmt_shape((B, Q))}, got {fmt_shape(shape)}"
        )
    values = ops.concrete(valid_lens) if host is None else host
    if values is not None and values.size:
        if values.min() < 0:
            raise ValueError(f"{name} must be >= 0, got {int(values.min())}")
        if isinstance(K, int) and values.max() > K:
            raise ValueError(
                f"{name} must be <= the number of keys ({K}), got {int(values.max())}"
            )
    if host is not None:  # in range now, so int32 holds them on every backend
        valid_lens = ops.from_numpy(host.astype(np.int32))
    lens = ops.expand_dims(ops.astype(valid_lens, "int32"), -1)  # (B, 1) or (B, Q, 1)
    lens = ops.expand_dims(lens, 1)  # (B, 1, 1) or (B, 1, Q, 1)
    lens = ops.expand_dims(lens, 1) if len(shape) == 1 else lens  # (B, 1, 1, 1)
    bounds = (int(values.min()), int(values.max())) if values is not None and values.size else None
    return lens, bounds


def boolean_mask(ops: Ops, mask: Any, scores_shape: tuple[Any, ...], *, name: str = "mask"
                 ) -> Array:
    """Checks a boolean mask and lifts it to rank 4, broadcastable to ``(B, H, Q, K)``.

    ``name`` is the argument's name in messages (a decoder's ``enc_mask``).

    Raises:
        TypeError: ``mask`` is not boolean.
        ValueError: ``mask`` cannot broadcast to the scores.
    """
    host = None if own(ops, mask) else host_array(mask)  # read as given, before converting
    _check_mask_dtype(ops.dtype_name(mask) if host is None else host.dtype.name, name)
    shape = ops.shape(mask) if host is None else host.shape
    return lifted(ops, name, mask if host is None else ops.from_numpy(host), shape,
                  scores_shape)


def lifted(ops: Ops, name: str, x: Array, shape: tuple[Any, ...],
           scores_shape: tuple[Any, ...]) -> Array:
    """Checks that ``x`` (of ``shape``) broadcasts to the scores as a mask does; lifts it to rank 4.

    Shapes ``(Q, K)``, ``(B, Q, K)`` (one for every head) or ``(B, H, Q, K)``, size-1 axes
    broadcasting; for masks and for ``score_bias``.

    Raises:
        ValueError: ``x`` cannot broadcast to the scores (``name`` is the argument's).
    """
    B, H, Q, K = scores_shape
    target = {2: (Q, K), 3: (B, Q, K), 4: (B, H, Q, K)}.get(len(shape), ())
    if not target or not fits(shape, target, broadcast=True):
        raise ValueError(
            f"{name} must have shape (Q, K), (B, Q, K) or (B, H, Q, K), broadcastable to "
            f"(B, H, Q, K) = {fmt_shape(scores_shape)}, got {fmt_shape(shape)}"
        )
    if len(shape) == 3:
        x = ops.expand_dims(x, 1)  # (B, 1, Q, K)
    while len(ops.shape(x)) < 4:
        x = ops.expand_dims(x, 0)
    return x


class Visibility:
    """The checked masks of one call, turned into boolean tiles on demand.

    The direct path asks for the whole ``(B, H, Q, K)`` mask once; the blockwise path asks
    for one tile of queries ``q0 : q0 + qn`` and keys ``k0 : k0 + kn`` at a time, so the
    full mask is never formed. ``q0`` and ``k0`` may be run-time scalars (a loop index under
    ``jax.lax.fori_loop``); ``qn`` and ``kn`` are ints.

    Args:
        ops: The backend's ops.
        scores_shape: ``(B, H, Q, K)`` of the scores the masks apply to.
        valid_lens: Optional integer lengths, ``(B,)`` or ``(B, Q)``.
        mask: Optional boolean mask, True = may attend.
        causal: Whether query ``i`` may only see keys ``j <= p_i``.
        window: Query ``i`` sees only keys ``j`` with ``|p_i - j| < window``; None for all.
        offset: ``p_i - i``, an int or a run-time scalar; None for ``K - Q``.
    """

    def __init__(
        self,
        ops: Ops,
        scores_shape: tuple[Any, ...],
        valid_lens: Any = None,
        mask: Any = None,
        causal: bool = False,
        window: int | None = None,
        offset: Any = None,
    ) -> None:
        causal = plain(causal)  # np.bool_ -> bool
        if not isinstance(causal, bool):
            raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
        self.ops, self.shape, self.causal = ops, tuple(scores_shape), bool(causal)
        self.window = check_window(window)
        _, _, Q, K = self.shape
        #: Query ``i`` stands at position ``i + offset``.
        self.offset: Any = K - Q if offset is None else offset
        self.lens: Array | None = None
        #: ``(shortest, longest)`` valid length when known now (not under tracing), else None.
        self.lens_bounds: tuple[int, int] | None = None
        if valid_lens is not None:
            self.lens, self.lens_bounds = lens_column(ops, valid_lens, scores_shape)
        self.mask = None if mask is None else boolean_mask(ops, mask, scores_shape)

    def key_limit(self, q0: Any, qn: int) -> int:
        """Keys from this index on are hidden from every query ``q0 : q0 + qn``.

        As far as is known now: the longest valid length, and the causal edge and the window
        of the block's last query (when ``q0`` and the offset are ints).

        Returns:
            An int in ``[1, K]`` (at least 1, so that a block with nothing visible still
            yields its zero rows).
        """
        K = self.shape[3]
        limit = K
        if self.lens_bounds is not None:
            limit = min(limit, self.lens_bounds[1])
        if isinstance(q0, int) and isinstance(self.offset, int):
            last = q0 + qn - 1 + self.offset  # the block's last query's position
            if self.causal:  # it sees keys j <= last
                limit = min(limit, last + 1)
            if self.window is not None:  # and j < last + window
                limit = min(limit, last + self.window)
        return max(1, limit)

    def key_span(self, q0: Any, qn: int) -> tuple[Any, int] | None:
        """``(first, count)``: the keys a window leaves to queries ``q0 : q0 + qn``.

        None without a window. Keys before ``first`` and from ``first + count`` on are hidden
        from the whole block; ``count`` is an int, ``first`` is a run-time scalar when ``q0``
        or the offset is (clipped so that the span stays inside ``[0, K)``).
        """
        if self.window is None:
            return None
        K = self.shape[3]
        ahead = 0 if self.causal else self.window - 1  # keys a query may see after its own
        lowest = q0 + self.offset - (self.window - 1)  # the first query's first key
        if isinstance(q0, int) and isinstance(self.offset, int):
            end = min(self.key_limit(q0, qn), K)  # at least 1
            first = min(max(0, lowest), end - 1)
            return first, end - first
        count = min(K, qn + self.window - 1 + ahead) if isinstance(K, int) else None
        if count is None:
            return None
        ops = self.ops
        first = ops.maximum(ops.astype(lowest, "int32"), 0)
        return -ops.maximum(-first, -(K - count)), count  # min(first, K - count)

    def local(self) -> tuple[int, int] | None:
        """The window as ``(left, right)``: query index ``i`` sees keys ``i - left .. i + right``.

        The form of a fused kernel's local window (``jax.nn.dot_product_attention``'s
        ``local_window_size``); None without a window, with a run-time offset, or when either
        side would be negative (the window then lies wholly before or after the query's index).
        """
        if self.window is None or not isinstance(self.offset, int):
            return None
        left, right = self.window - 1 - self.offset, self.window - 1 + self.offset
        return (left, right) if left >= 0 and right >= 0 else None

    @property
    def empty(self) -> bool:
        """True when nothing is masked."""
        return (self.lens is None and self.mask is None and not self.causal
                and self.window is None)

    def full(self) -> Array | None:
        """The whole mask, broadcastable to ``(B, H, Q, K)``; None when nothing is masked."""
        _, _, Q, K = self.shape
        return self.tile(0, Q, 0, K)

    def tile(self, q0: Any, qn: int, k0: Any, kn: int) -> Array | None:
        """The mask of queries ``q0 : q0 + qn`` and keys ``k0 : k0 + kn``.

        Parts known now to hide nothing in the tile (every key below the shortest valid
        length, or below the causal edge of the tile's first query) are left out.

        Returns:
            Boolean, broadcastable to ``(B, H, qn, kn)``; None when nothing is masked.
        """
        ops, (_, _, Q, K) = self.ops, self.shape
        static = all(isinstance(d, int) for d in (q0, k0, qn, kn, Q, K))
        parts = []
        shortest = None if self.lens_bounds is None else self.lens_bounds[0]
        if self.lens is not None and not (static and shortest is not None and k0 + kn <= shortest):
            lens = tile_rows(ops, self.lens, q0, qn, Q)  # (B, 1, 1 or qn, 1)
            parts.append(_offset(ops, ops.arange(kn), k0) < lens)
        if self.mask is not None:
            parts.append(tile_rows(ops, tile_columns(ops, self.mask, k0, kn, K), q0, qn, Q))
        # the tile's first query's position, when known now
        first = q0 + self.offset if static and isinstance(self.offset, int) else None
        if self.causal and not (first is not None and k0 + kn - 1 <= first):  # j <= p_i
            parts.append(distances(ops, q0, qn, k0, kn, self.offset) <= 0)
        w = self.window
        inside = first is not None and w is not None and (k0 > first + qn - 1 - w
                                                           and k0 + kn - 1 < first + w)
        if w is not None and not inside:
            distance = distances(ops, q0, qn, k0, kn, self.offset)
            parts.append(ops.logical_and(distance > -w, distance < w))
        if not parts:
            return None
        combined = parts[0]
        for part in parts[1:]:
            combined = ops.logical_and(combined, part)
        return combined


def distances(ops: Ops, q0: Any, qn: int, k0: Any, kn: int, offset: Any) -> Array:
    """``(qn, kn)`` int32: ``j - p_i`` for queries ``q0 : q0 + qn`` and keys ``k0 : k0 + kn``.

    ``p_i = i + offset`` is the query's position, ``j`` the key's; the causal rule, the window
    and ALiBi read them.
    """
    rows = ops.expand_dims(_offset(ops, ops.arange(qn), q0 + offset), -1)  # (qn, 1)
    return ops.expand_dims(_offset(ops, ops.arange(kn), k0), 0) - rows


def _offset(ops: Ops, index: Array, start: Any) -> Array:
    """``index + start``, skipping the addition for a start of 0."""
    return index if isinstance(start, int) and start == 0 else index + start


def tile_rows(ops: Ops, x: Array, q0: Any, qn: int, Q: Any) -> Array:
    """Rows ``q0 : q0 + qn`` (axis 2) of a rank-4 array, unless it broadcasts or is all ``Q``."""
    return x if _broadcasts(ops.shape(x)[2]) or _whole(q0, qn, Q) else ops.slice(x, 2, q0, qn)


def tile_columns(ops: Ops, x: Array, k0: Any, kn: int, K: Any) -> Array:
    """Columns ``k0 : k0 + kn`` (axis 3) of a rank-4 array, unless it broadcasts or is all ``K``."""
    return x if _broadcasts(ops.shape(x)[3]) or _whole(k0, kn, K) else ops.slice(x, 3, k0, kn)


def _broadcasts(size: Any) -> bool:
    """Whether an axis of this size broadcasts (size 1 known now; a run-time size never)."""
    return isinstance(size, int) and size == 1


def _whole(start: Any, size: Any, total: Any) -> bool:
    """Whether ``start : start + size`` is the whole axis of length ``total``, as known now.

    ``size`` and ``total`` may be the same run-time tensor (``full()`` under tracing).
    """
    if not (isinstance(start, int) and start == 0):
        return False
    return size is total or (isinstance(size, int) and isinstance(total, int) and size == total)


def combine(
    ops: Ops,
    scores_shape: tuple[Any, ...],
    valid_lens: Any = None,
    mask: Any = None,
    causal: bool = False,
    window: int | None = None,
) -> Array | None:
    """Reduces ``valid_lens``, ``mask``, ``causal`` and ``window`` to one boolean mask (AND).

    Args:
        ops: The backend's ops.
        scores_shape: ``(B, H, Q, K)`` of the scores the mask will apply to.
        valid_lens: Optional integer lengths, ``(B,)`` or ``(B, Q)``.
        mask: Optional boolean mask, True = may attend.
        causal: Whether query ``i`` may only see keys ``j <= i + (K - Q)``.
        window: Query ``i`` sees only keys ``j`` with ``|i + (K - Q) - j| < window``.

    Returns:
        A boolean array broadcastable to ``scores_shape``, or None when nothing is masked.
    """
    return Visibility(ops, scores_shape, valid_lens, mask, causal, window).full()


def with_padding(
    ops: Ops,
    mask: Any,
    scores_shape: tuple[Any, ...],
    queries_mask: Any = None,
    keys_mask: Any = None,
) -> Any:
    """ANDs padding masks of the queries and keys into an attention mask.

    A padding mask (Keras' ``_keras_mask``, e.g. from ``Embedding(mask_zero=True)``) marks the
    real positions of a sequence: ``(B, Q)`` for the queries, ``(B, K)`` for the keys, True =
    a real position. A padded key is hidden from every query; a padded query sees no key, so
    its row is 0 (as a fully masked row always is). Nothing changes when both are None.

    Args:
        ops: The backend's ops.
        mask: The caller's attention mask (None, or anything :func:`boolean_mask` takes).
        scores_shape: ``(B, H, Q, K)`` of the scores (H may be None).
        queries_mask: Optional ``(B, Q)`` padding mask of the queries.
        keys_mask: Optional ``(B, K)`` padding mask of the keys.

    Returns:
        ``mask`` itself when there is no padding mask, else a boolean mask of rank 3 or 4
        broadcastable to ``scores_shape``: the AND of ``mask`` and the padding.

    Raises:
        TypeError: A padding mask is not boolean.
        ValueError: A padding mask does not have the shape ``(B, Q)`` or ``(B, K)``.
    """
    if queries_mask is None and keys_mask is None:
        return mask
    B, _, Q, K = scores_shape
    padding = None
    for name, pad, size, axis in (("queries_mask", queries_mask, Q, -1),
                                  ("keys_mask", keys_mask, K, 1)):
        if pad is None:
            continue
        host = None if own(ops, pad) else host_array(pad)  # read as given, before converting
        dtype = ops.dtype_name(pad) if host is None else host.dtype.name
        if dtype != "bool":
            raise TypeError(f"{name} must be a boolean padding mask (True = real position), "
                            f"got {dtype}")
        pad = pad if host is None else ops.from_numpy(host)
        shape = ops.shape(pad)
        if not fits(shape, (B, size), broadcast=False):
            raise ValueError(f"{name} must have shape {fmt_shape((B, size))}, got {fmt_shape(shape)}")
        pad = ops.expand_dims(pad, axis)  # (B, Q, 1) or (B, 1, K)
        padding = pad if padding is None else ops.logical_and(padding, pad)
    if mask is None:
        return padding
    return ops.logical_and(boolean_mask(ops, mask, scores_shape), ops.expand_dims(padding, 1))
