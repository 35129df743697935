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

from attention_core.checks import fmt_shape
from attention_core.host import framework_of, host_array
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


def check_integer_dtype(dtype: str, name: str = "valid_lens") -> None:
    """Refuses lengths or ids ``name`` of a dtype other than an integer one."""
    if not dtype.startswith(("int", "uint")):
        raise TypeError(f"{name} must have an integer dtype, got {dtype}")


def _check_mask_dtype(dtype: str, name: str = "mask") -> None:
    if dtype != "bool":
        raise TypeError(f"{name} must be boolean (True = may attend), got {dtype}")


def segment_parts(segment_ids: Any) -> tuple[tuple[str, Any], ...]:
    """The id arrays of a ``segment_ids`` argument, each with the name messages give it.

    One array ``(B, K)``, or a pair ``(query_ids, key_ids)`` given as a tuple of two (a list
    is host data, as for every array argument).
    """
    if isinstance(segment_ids, tuple) and len(segment_ids) == 2:
        return ("segment_ids[0]", segment_ids[0]), ("segment_ids[1]", segment_ids[1])
    return (("segment_ids", segment_ids),)


def check_dtypes(ops: Ops, arguments: Mapping[str, Any]) -> None:
    """Checks the dtypes of a call's lengths, masks and segment ids as given, before any conversion.

    For adapters that must convert them to backend arrays before the core sees them (MXNet
    hands them to its graph): the messages are those of :func:`lens_column`,
    :func:`boolean_mask` and the ``segment_ids`` modifier, read off host data (strings, complex
    numbers) that the backend could not even hold. Lengths are the arguments named
    ``*valid_lens``, masks those named ``*mask``.
    """
    for name, value in arguments.items():
        if value is None or not name.endswith(("valid_lens", "mask", "segment_ids")):
            continue
        parts = segment_parts(value) if name == "segment_ids" else ((name, value),)
        for part, array in parts:
            dtype = ops.dtype_name(array) if own(ops, array) else host_array(array).dtype.name
            if name.endswith("mask"):
                _check_mask_dtype(dtype, part)
            else:
                check_integer_dtype(dtype, part)


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
    check_integer_dtype(ops.dtype_name(valid_lens) if host is None else host.dtype.name, name)
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
