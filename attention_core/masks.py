"""``valid_lens``, boolean masks and ``causal`` -> one canonical mask.

The canonical mask is boolean, True where a query may attend to a key, and broadcasts
against scores of shape ``(B, H, Q, K)``. Every way of masking is reduced to it here, and all
of them combine with AND:

* ``valid_lens`` of shape ``(B,)``: key ``j`` is visible to every query of example ``b`` when
  ``j < valid_lens[b]``; of shape ``(B, Q)``: when ``j < valid_lens[b, i]`` for query ``i``.
* ``mask`` of shape ``(Q, K)``, ``(B, Q, K)`` or ``(B, H, Q, K)`` (size-1 axes broadcast).
* ``causal=True``: query ``i`` sees keys ``j <= i + (K - Q)``, i.e. aligned at the end when
  there are more keys than queries.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from attention_core.checks import fmt_shape
from attention_core.ops import Array, Ops

_HOST_ARRAYS = (list, tuple, np.ndarray, np.generic, int)


def as_backend_array(ops: Ops, x: Any) -> Array:
    """Converts Python lists and NumPy arrays (e.g. ``valid_lens=[3, 2]``) to backend arrays."""
    if isinstance(x, _HOST_ARRAYS) and not isinstance(x, bool):
        return ops.from_numpy(np.asarray(x))
    return x


def _fits(shape: tuple[Any, ...], want: tuple[Any, ...], broadcast: bool) -> bool:
    """Whether ``shape`` equals ``want`` (or broadcasts to it), unknown dimensions passing."""
    if len(shape) != len(want):
        return False
    for got, need in zip(shape, want, strict=True):
        known = isinstance(got, int) and isinstance(need, int)
        if known and got != need and not (broadcast and got == 1):
            return False
    return True


def _is_integer(dtype: str) -> bool:
    return dtype.startswith(("int", "uint"))


def valid_lens_mask(ops: Ops, valid_lens: Any, scores_shape: tuple[Any, ...]) -> Array:
    """Returns the mask ``key index < valid length``, broadcastable to ``(B, 1, Q, K)``.

    Args:
        ops: The backend's ops.
        valid_lens: Integer lengths, shape ``(B,)`` or ``(B, Q)``.
        scores_shape: ``(B, H, Q, K)``.

    Raises:
        TypeError: ``valid_lens`` is not integer.
        ValueError: Wrong shape, a negative length, or one longer than K.
    """
    B, _, Q, K = scores_shape
    valid_lens = as_backend_array(ops, valid_lens)
    dtype = ops.dtype_name(valid_lens)
    if not _is_integer(dtype):
        raise TypeError(f"valid_lens must have an integer dtype, got {dtype}")
    shape = ops.shape(valid_lens)
    allowed = [(B,), (B, Q)]
    if not any(_fits(shape, want, broadcast=False) for want in allowed):
        raise ValueError(
            f"valid_lens must have shape (B,) or (B, Q) = {fmt_shape((B,))} or "
            f"{fmt_shape((B, Q))}, got {fmt_shape(shape)}"
        )
    values = ops.concrete(valid_lens)
    if values is not None and values.size:
        if values.min() < 0:
            raise ValueError(f"valid_lens must be >= 0, got {int(values.min())}")
        if isinstance(K, int) and values.max() > K:
            raise ValueError(
                f"valid_lens must be <= the number of keys ({K}), got {int(values.max())}"
            )
    lens = ops.expand_dims(ops.astype(valid_lens, "int32"), -1)  # (B, 1) or (B, Q, 1)
    lens = ops.expand_dims(lens, 1)  # (B, 1, 1) or (B, 1, Q, 1)
    if len(shape) == 1:
        lens = ops.expand_dims(lens, 1)  # (B, 1, 1, 1)
    return ops.arange(K) < lens


def boolean_mask(ops: Ops, mask: Any, scores_shape: tuple[Any, ...]) -> Array:
    """Checks a boolean mask and lifts it to rank 4, broadcastable to ``(B, H, Q, K)``.

    Raises:
        TypeError: ``mask`` is not boolean.
        ValueError: ``mask`` cannot broadcast to the scores.
    """
    mask = as_backend_array(ops, mask)
    dtype = ops.dtype_name(mask)
    if dtype != "bool":
        raise TypeError(f"mask must be boolean (True = may attend), got {dtype}")
    shape = ops.shape(mask)
    B, H, Q, K = scores_shape
    target = {2: (Q, K), 3: (B, Q, K), 4: (B, H, Q, K)}.get(len(shape), ())
    if not target or not _fits(shape, target, broadcast=True):
        raise ValueError(
            "mask must have shape (Q, K), (B, Q, K) or (B, H, Q, K), broadcastable to "
            f"(B, H, Q, K) = {fmt_shape(scores_shape)}, got {fmt_shape(shape)}"
        )
    if len(shape) == 3:
        mask = ops.expand_dims(mask, 1)  # (B, 1, Q, K)
    while len(ops.shape(mask)) < 4:
        mask = ops.expand_dims(mask, 0)
    return mask


def causal_mask(ops: Ops, scores_shape: tuple[Any, ...]) -> Array:
    """Returns ``j <= i + (K - Q)`` of shape ``(Q, K)``.

    Query ``i`` sees keys up to its own position, the last query aligned with the last key.
    """
    _, _, Q, K = scores_shape
    rows = ops.expand_dims(ops.arange(Q), -1)  # (Q, 1)
    cols = ops.expand_dims(ops.arange(K), 0)  # (1, K)
    return cols <= rows + (K - Q)


def combine(
    ops: Ops,
    scores_shape: tuple[Any, ...],
    valid_lens: Any = None,
    mask: Any = None,
    causal: bool = False,
) -> Array | None:
    """Reduces ``valid_lens``, ``mask`` and ``causal`` to one boolean mask (AND of all given).

    Args:
        ops: The backend's ops.
        scores_shape: ``(B, H, Q, K)`` of the scores the mask will apply to.
        valid_lens: Optional integer lengths, ``(B,)`` or ``(B, Q)``.
        mask: Optional boolean mask, True = may attend.
        causal: Whether query ``i`` may only see keys ``j <= i + (K - Q)``.

    Returns:
        A boolean array broadcastable to ``scores_shape``, or None when nothing is masked.
    """
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    parts = []
    if valid_lens is not None:
        parts.append(valid_lens_mask(ops, valid_lens, scores_shape))
    if mask is not None:
        parts.append(boolean_mask(ops, mask, scores_shape))
    if causal:
        parts.append(causal_mask(ops, scores_shape))
    if not parts:
        return None
    combined = parts[0]
    for part in parts[1:]:
        combined = ops.logical_and(combined, part)
    return combined
