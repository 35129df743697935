"""Key/value caches for incremental decoding: a fixed capacity and an explicit position.

A self-attention cache is a pair ``(keys, values)`` of projected heads ``(B, H, C, D)``: C, the
capacity, is fixed when the cache is made, and ``start``, the position of the call's first
token, is an argument of every call. A call of ``t`` tokens writes their keys and values at
rows ``[start, start + t)`` and its queries attend to rows ``j <= start + i``. No shape depends
on ``start``, so a compiled step (``jax.jit``, ``tf.function(jit_compile=True)``,
``torch.compile``) is traced once and reused at every position.

Shape legend: B batch, H heads, C capacity, t the call's positions, D depth (h/H).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from attention_core import checks
from attention_core.host import framework_of, host_array, plain
from attention_core.ops import Array, Ops, fixed_shape

#: A self-attention cache: projected keys and values ``(B, H, C, D)``.
Pair = tuple[Array, Array]


def check_start(ops: Ops, start: Any, steps: Any, capacity: int, name: str = "start") -> Any:
    """Checks the position of a call's first token; returns it as an int when known now.

    Else as an int32 scalar array (a run-time position, under tracing). Known values are
    returned as ints so that the calls a decoder makes for its blocks, which check ``start``
    again, do not read an array back each time.

    Args:
        ops: The backend's ops.
        start: An int, or an integer scalar array (a run-time position under tracing).
        steps: t, the call's positions.
        capacity: C.
        name: The argument as the caller takes it (``start_index`` on the rotary embedding).

    Raises:
        TypeError: ``start`` is not an integer.
        ValueError: ``start < 0``, or ``start + t > C`` (when both are known now).
    """
    start = plain(start)
    if isinstance(start, (bool, float)):
        raise TypeError(f"{name} must be an integer position, got {start!r}")
    if isinstance(start, np.ndarray) or (hasattr(start, "shape")
                                         and framework_of(start) not in (None, ops.name)):
        start = host_array(start)  # a NumPy or another framework's array: known now
        if start.shape == () and start.dtype.kind in "iu":
            start = int(start)
    value: Any = start
    if isinstance(start, np.ndarray):
        if start.shape == ():
            raise TypeError(f"{name} must be an integer position, got dtype {start.dtype}")
        raise TypeError(f"{name} must be an int or an integer scalar array, got an array of "
                        f"shape {start.shape}")
    if not isinstance(start, int):
        own = framework_of(start) == ops.name  # the backend's (an MXNet Symbol has no .shape)
        if not (own or hasattr(start, "shape")) or tuple(ops.shape(start)) != ():
            raise TypeError(f"{name} must be an int or an integer scalar array, got "
                            f"{type(start).__name__} of shape {getattr(start, 'shape', None)}")
        if not ops.dtype_name(start).startswith(("int", "uint")):
            raise TypeError(f"{name} must be an integer position, got dtype {ops.dtype_name(start)}")
        known = ops.concrete(start)
        value = None if known is None else int(known)
        start = ops.astype(start, "int32")
    if value is not None and value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    if value is not None and isinstance(steps, int) and value + steps > capacity:
        raise ValueError(f"start + positions must be <= the cache's capacity ({capacity}), got "
                         f"start {value} + {steps} positions = {value + steps}")
    return start if value is None else value


def check_pair(ops: Ops, name: str, pair: Any, heads: tuple[Any, Any, Any], dtype: str,
               value_depth: Any = None) -> Pair:
    """Checks a cache pair: keys and values ``(B, H, C, D)`` with ``heads = (B, H, D)``.

    ``value_depth``: the values' D where it differs from the keys'.

    Raises:
        TypeError: Not a pair, or not of ``dtype``.
        ValueError: Another B, H or D, or keys and values of different capacities.
    """
    if not isinstance(pair, Sequence) or len(pair) != 2:
        raise TypeError(f"{name} must be a pair (keys, values), got {type(pair).__name__}")
    B, H, D = heads
    depths = (D, D if value_depth is None else value_depth)
    for part, array, depth in zip(("keys", "values"), pair, depths, strict=True):
        shape = ops.shape(array)
        if len(shape) != 4 or any(isinstance(a, int) and isinstance(b, int) and a != b
                                  for a, b in zip((shape[0], shape[1], shape[3]),
                                                  (B, H, depth), strict=True)):
            raise ValueError(f"{name} {part} must have shape (B, H, C, D) = ({B}, {H}, C, "
                             f"{depth}), got {checks.fmt_shape(shape)}")
        if ops.dtype_name(array) != dtype:
            raise TypeError(f"{name} {part} must have dtype {dtype}, got {ops.dtype_name(array)}")
    if ops.shape(pair[0])[2] != ops.shape(pair[1])[2]:
        raise ValueError(f"{name} keys and values must have the same capacity, got "
                         f"{ops.shape(pair[0])[2]} and {ops.shape(pair[1])[2]}")
    return pair[0], pair[1]


def check_block_cache(ops: Ops, name: str, cache: Any, crossed: bool,
                      like: tuple[str, Array]) -> None:
    """Checks the form of a decoder block's cache: ``(self_pair,)`` or ``(self_pair, cross_pair)``.

    Each pair holds keys and values whose batch is the step's (``like``: its name and array);
    their heads, depth and dtype are checked where they are read (:func:`check_pair`).

    Raises:
        TypeError: Not a block's cache, or a pair that is not two arrays.
        ValueError: A cross pair missing (or one too many), or another batch size.
    """
    if not isinstance(cache, Sequence) or isinstance(cache, str) or len(cache) not in (1, 2):
        got = f"{len(cache)} entries" if isinstance(cache, Sequence) else type(cache).__name__
        raise TypeError(f"{name} must be a block's cache, (self_pair,) or (self_pair, "
                        f"cross_pair), got {got}")
    if len(cache) != (2 if crossed else 1):
        raise ValueError(f"{name} must hold {'2 pairs (self, cross)' if crossed else '1 pair'} "
                         f"for this block, got {len(cache)}")
    for part, pair in zip(("self pair", "cross pair"), cache, strict=False):
        if (not isinstance(pair, Sequence) or len(pair) != 2
                or not all(hasattr(x, "shape") for x in pair)):
            got = (f"{len(pair)} entries" if isinstance(pair, Sequence)
                   else type(pair).__name__)
            raise TypeError(f"{name} {part} must be a pair (keys, values) of arrays, got {got}")
        for which, x in zip(("keys", "values"), pair, strict=True):
            if len(ops.shape(x)) != 4:
                raise ValueError(f"{name} {part} {which} must have shape (B, H, C, D), got "
                                 f"{checks.fmt_shape(ops.shape(x))}")
            checks.check_batch(ops, f"{name} {part} {which}", x, *like)


def capacity_of(ops: Ops, cache: Array | None, capacity: Any) -> int:
    """C: the cache's, or ``capacity`` for a cache made now; both given must agree."""
    if cache is None:
        if capacity is None:
            raise ValueError("capacity is required to make a cache (cache is None)")
        return checks.check_positive_int("capacity", capacity)
    held = int(fixed_shape(ops, cache)[2])
    if capacity is not None and plain(capacity) != held:
        raise ValueError(f"capacity ({capacity}) must equal the given cache's ({held})")
    return held


def written(ops: Ops, cache: Array | None, new: Array, start: Any, capacity: int) -> Array:
    """``cache`` with rows ``[start, start + t)`` replaced by ``new (B, H, t, D)``.

    The rows are placed by a product with a one-hot ``(C, t)`` matrix, exact (each row is one
    entry times 1 plus zeros), or for one row by broadcasting it, so the position may be a
    run-time scalar. A cache made now (``cache`` None) is zero elsewhere.
    """
    steps = ops.shape(new)[2]
    offset = ops.arange(capacity) - start  # (C,): row c holds new row c - start
    if cache is not None and steps == 1:  # one row: broadcast it, no product needed
        return ops.where(ops.expand_dims(offset == 0, -1), new, cache)
    onehot = ops.expand_dims(offset, -1) == ops.expand_dims(ops.arange(steps), 0)  # (C, t)
    onehot = ops.astype(onehot, ops.dtype_name(new))
    placed = ops.matmul(ops.expand_dims(ops.expand_dims(onehot, 0), 0), new)  # (B, H, C, D)
    if cache is None:
        return placed
    inside = ops.logical_and(offset >= 0, offset < steps)  # (C,)
    return ops.where(ops.expand_dims(inside, -1), placed, cache)


def visible(ops: Ops, start: Any, steps: int, capacity: int) -> Array:
    """The boolean ``(t, C)`` mask of a cached call: query i sees rows ``j <= start + i``."""
    rows = ops.expand_dims(ops.arange(steps) + start, -1)  # (t, 1)
    return ops.expand_dims(ops.arange(capacity), 0) <= rows  # (t, C)

