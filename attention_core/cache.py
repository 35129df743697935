"""Key/value caches for incremental decoding: a fixed capacity and an explicit position.

A self-attention cache is a pair ``(keys, values)`` of projected heads ``(B, H, C, D)``: C, the
capacity, is fixed when the cache is made, and ``start``, the position of the call's first
token, is an argument of every call. A call of ``t`` tokens writes their keys and values at
rows ``[start, start + t)`` and its queries attend to rows ``j <= start + i``. No shape depends
on ``start``, so a compiled step (``jax.jit``, ``tf.function(jit_compile=True)``,
``torch.compile``) is traced once and reused at every position.

A sliding-window call (``window`` w) makes a ring of ``R = min(C, w)`` rows instead: position
``p`` at slot ``p mod R`` (:func:`is_ring`, :func:`ring_keys`, :func:`ring_written`).

Shape legend: B batch, H heads, C capacity, t the call's positions, D depth (h/H).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from attention_core import checks
from attention_core.host import framework_of, host_array, plain
from attention_core.ops import Array, Ops, fixed_shape

#: A self-attention cache: projected keys and values ``(B, H, C, D)``.
Pair = tuple[Array, Array]


def check_start(ops: Ops, start: Any, steps: Any, capacity: int | None, name: str = "start",
                batch: Any = None) -> Any:
    """Checks the position of a call's first token; returns it as an int when known now.

    Else as an int32 scalar array (a run-time position, under tracing). Known values are
    returned as ints so that the calls a decoder makes for its blocks, which check ``start``
    again, do not read an array back each time. Where ``batch`` is given, ``start`` may also
    hold one position per example, ``(B,)``: returned as an int64 NumPy array when its values
    are known now (host data, or a backend array :meth:`~attention_core.ops.Ops.concrete`
    reads), else as the backend's int32 array.

    Args:
        ops: The backend's ops.
        start: An int, an integer scalar array (a run-time position under tracing), or with
            ``batch`` integers ``(B,)`` of any framework.
        steps: t, the call's positions.
        capacity: C; None for no bound.
        name: The argument as the caller takes it (``start_index`` on the rotary embedding).
        batch: B, where one start per example is taken (any B when not an int, e.g. a
            run-time size); None where one start is.

    Raises:
        TypeError: ``start`` is not an integer.
        ValueError: ``start < 0``, ``start + t > C`` (when both are known now), or starts of
            a shape other than ``(B,)``.
    """
    start = plain(start)
    if isinstance(start, (bool, float)):
        raise TypeError(f"{name} must be an integer position, got {start!r}")
    if batch is not None and isinstance(start, (list, tuple)):
        start = host_array(start)
    if isinstance(start, np.ndarray) or (hasattr(start, "shape")
                                         and framework_of(start) not in (None, ops.name)):
        start = host_array(start)  # a NumPy or another framework's array: known now
        if start.shape == () and start.dtype.kind in "iu":
            start = int(start)
    value: Any = start
    if isinstance(start, np.ndarray):
        if start.shape == ():
            raise TypeError(f"{name} must be an integer position, got dtype {start.dtype}")
        if batch is None:
            raise TypeError(f"{name} must be an int or an integer scalar array, got an array of "
                            f"shape {start.shape}")
        return _per_example(name, start, start.shape, start.dtype.name, steps, capacity, batch)
    if not isinstance(start, int):
        own = framework_of(start) == ops.name  # the backend's (an MXNet Symbol has no .shape)
        if not (own or hasattr(start, "shape")):
            raise TypeError(f"{name} must be an int or an integer scalar array, got "
                            f"{type(start).__name__} of shape {getattr(start, 'shape', None)}")
        shape = tuple(ops.shape(start))
        if shape != () and batch is not None:
            known = ops.concrete(start)
            return _per_example(name, start if known is None else np.asarray(known), shape,
                                ops.dtype_name(start), steps, capacity, batch, ops)
        if shape != ():
            raise TypeError(f"{name} must be an int or an integer scalar array, got "
                            f"{type(start).__name__} of shape {getattr(start, 'shape', None)}")
        if not ops.dtype_name(start).startswith(("int", "uint")):
            raise TypeError(f"{name} must be an integer position, got dtype {ops.dtype_name(start)}")
        known = ops.concrete(start)
        value = None if known is None else int(known)
        start = ops.astype(start, "int32")
    _check_range(name, value, steps, capacity)
    return start if value is None else value


def _per_example(name: str, start: Any, shape: tuple[Any, ...], dtype: str, steps: Any,
                 capacity: int | None, batch: Any, ops: Ops | None = None) -> Any:
    """Checks one start per example, ``(B,)``: a NumPy array (values known) or ``ops``' array."""
    sized = type(batch) is int
    if len(shape) != 1 or (sized and isinstance(shape[0], int) and shape[0] != batch):
        want = f"(B,) = ({batch},)" if sized else "(B,)"
        raise ValueError(f"{name} must be an int or have shape {want}, got "
                         f"{checks.fmt_shape(shape)}")
    if not dtype.startswith(("int", "uint")):
        raise TypeError(f"{name} must be an integer position, got dtype {dtype}")
    if not isinstance(start, np.ndarray):
        assert ops is not None
        return ops.astype(start, "int32")  # run-time values: checked where they are used
    start = start.astype(np.int64)
    if start.size:
        _check_range(name, int(start.min()), 0, None)
        _check_range(name, int(start.max()), steps, capacity)
    return start


def _check_range(name: str, value: int | None, steps: Any, capacity: int | None) -> None:
    """Refuses a known start below 0, or one whose ``steps`` positions pass ``capacity``."""
    if value is not None and value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    if (value is not None and capacity is not None and isinstance(steps, int)
            and value + steps > capacity):
        raise ValueError(f"start + positions must be <= the cache's capacity ({capacity}), got "
                         f"start {value} + {steps} positions = {value + steps}")


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


def flat_cache(cache: Sequence[Any]) -> list[Array]:
    """A decoder's cache as one list, for programs of plain array inputs and outputs.

    Block by block, each pair's keys then values: ``[blks.0 keys, blks.0 values, blks.1 keys,
    ...]`` (a block with cross-attention puts its cross pair after its self pair).
    """
    return [x for block in cache for pair in block for x in pair]


def nested_cache(flat: Sequence[Array], pairs: int = 1) -> list[tuple[Pair, ...]]:
    """The decoder's cache from :func:`flat_cache`'s list, ``pairs`` pairs per block.

    Raises:
        ValueError: A list whose length is not a whole number of blocks.
    """
    size = 2 * pairs
    if len(flat) % size:
        raise ValueError(f"a flat cache must hold {size} arrays per block (keys and values of "
                         f"{pairs} pair(s)), got {len(flat)}")
    return [tuple((flat[i + j], flat[i + j + 1]) for j in range(0, size, 2))
            for i in range(0, len(flat), size)]


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


def capacity_of(ops: Ops, cache: Array | None, capacity: Any, window: int | None = None) -> int:
    """R, the rows held: the cache's, or those of a cache made now of ``capacity``.

    A windowed call (``window`` w) makes a ring of ``min(capacity, w)`` rows
    (:func:`ring_rows`); a capacity given with a cache must be the one that makes it.
    """
    if cache is None:
        if capacity is None:
            raise ValueError("capacity is required to make a cache (cache is None)")
        return ring_rows(checks.check_positive_int("capacity", capacity), window)
    held = int(fixed_shape(ops, cache)[2])
    given = plain(capacity)
    if capacity is None or given == held:
        return held
    if window is None or type(given) is not int or ring_rows(given, window) != held:
        if window is None or type(given) is not int:
            raise ValueError(f"capacity ({capacity}) must equal the given cache's ({held})")
        raise ValueError(f"capacity ({capacity}) must make the given cache's {held} rows: a "
                         f"windowed layer keeps min(capacity, window) = min({given}, {window}) "
                         f"= {ring_rows(given, window)}")
    return held


def ring_rows(capacity: int, window: int | None) -> int:
    """R: the rows a cache of ``capacity`` holds, ``min(capacity, window)`` for a windowed call.

    Its query sees no key ``window`` or more positions back, so the last ``window`` keys
    are all it needs: position ``p`` is kept at slot ``p mod R`` (:func:`is_ring`).
    """
    return capacity if window is None else min(capacity, window)


def is_ring(rows: int, window: int | None) -> bool:
    """Whether a windowed call's cache of ``rows`` is a ring: it holds ``window`` rows.

    A ring keeps position ``p`` at slot ``p mod R`` and takes positions past R. A cache of
    fewer rows than the window holds positions ``0 .. R - 1`` only (slot = position), as
    one of any size does without a window.
    """
    return window is not None and rows == window


def written(ops: Ops, cache: Array | None, new: Array, start: Any, capacity: int) -> Array:
    """``cache`` with rows ``[start, start + t)`` replaced by ``new (B, H, t, D)``.

    Rows known now (an int ``start``) are put in place by slicing. Otherwise they are placed
    by a product with a one-hot ``(C, t)`` matrix, exact (each row is one entry times 1 plus
    zeros), or for one row by broadcasting it, so the position may be a run-time scalar. A
    cache made now (``cache`` None) is zero elsewhere.
    """
    steps = ops.shape(new)[2]
    if cache is not None and isinstance(start, int) and isinstance(steps, int):
        return _put(ops, cache, new, start, capacity)
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


def _put(ops: Ops, cache: Array, new: Array, start: int, capacity: int) -> Array:
    """``cache`` with rows ``[start, start + t)`` replaced, the rows known now: one concatenation.

    Or one ``slice_update`` where the ops have it (:class:`~attention_core.ops.SliceUpdateOps`).
    """
    update = getattr(ops, "slice_update", None)
    if update is not None:
        return update(cache, 2, start, new)
    end = start + ops.shape(new)[2]
    parts = [ops.slice(cache, 2, 0, start)] if start > 0 else []
    parts.append(new)
    if end < capacity:
        parts.append(ops.slice(cache, 2, end, capacity - end))
    return parts[0] if len(parts) == 1 else ops.concatenate(parts, 2)


def placed(ops: Ops, start: Any, steps: Any, capacity: int, *, lengths: Any = None,
           padding: str = "right", padding_mask: Any = None, batch: Any = None,
           like: Array | None = None, ring: bool = False, limit: int | None = None
           ) -> Positions:
    """The positions of a cached call's t tokens (:func:`positions_of`), within the capacity.

    A ring (``ring``, :func:`is_ring`) takes positions past its rows; ``limit``, the
    rotary tables' bound on positions, then bounds them where the starts are known now.
    ``start`` may be the :class:`Positions` that a stack placed for all its blocks, whose
    caches it checked to have the same rows: they are returned as they are.

    Raises:
        ValueError: A position past the capacity (or ``limit``, for a ring) when the starts
            are known now, and the errors of :func:`positions_of`.
    """
    if isinstance(start, Positions):
        return start
    first = check_start(ops, start, steps, None if ring else capacity, batch=batch)
    if ring and limit is not None:
        _check_limit(first, steps, limit)
    return positions_of(ops, start, steps, lengths=lengths, padding=padding,
                        padding_mask=padding_mask, batch=batch, like=like)


def _check_limit(first: Any, steps: Any, limit: int) -> None:
    """Refuses known positions ``first .. first + steps - 1`` at or past ``limit`` (rotary's)."""
    known = first if isinstance(first, int) else (
        int(first.max()) if isinstance(first, np.ndarray) and first.size else None)
    if known is not None and isinstance(steps, int) and known + steps > limit:
        raise ValueError(f"rotary positions must be in [0, {limit}), got [{known}, "
                         f"{known + steps - 1}]")


def per_example(at: Positions) -> bool:
    """Whether the tokens' positions differ by example (``(B, t)``), not one shared start."""
    return not isinstance(at.query, int) and hasattr(at.query, "shape") and len(at.query.shape) == 2


def written_at(ops: Ops, cache: Array | None, new: Array, at: Positions, capacity: int) -> Array:
    """``cache`` with each real token of ``new (B, H, t, D)`` written at its position's row.

    One shared start goes to :func:`written`. Per example, row ``c`` of example ``b`` takes
    new row ``r`` where ``query[b, r] == c`` and the token is real (``valid``): a product
    with a one-hot ``(B, 1, C, t)`` matrix, exact, then the untouched rows kept.
    """
    if not per_example(at):
        return written(ops, cache, new, at.query, capacity)
    rows = ops.expand_dims(ops.expand_dims(ops.arange(capacity), 0), -1)  # (1, C, 1)
    hits = rows == ops.expand_dims(at.query, 1)  # (B, C, t)
    if at.valid is not None:
        hits = ops.logical_and(hits, ops.expand_dims(at.valid, 1))
    onehot = ops.astype(ops.expand_dims(hits, 1), ops.dtype_name(new))  # (B, 1, C, t)
    put = ops.matmul(onehot, new)  # (B, H, C, D)
    if cache is None:
        return put
    return ops.where(ops.sum(onehot, -1) > 0, put, cache)  # rows written now, else kept


def ring_keys(ops: Ops, at: Positions, rows: int, steps: Any, held: bool
              ) -> tuple[Array, Array]:
    """The positions of the keys a ring call attends, and whether each holds a token.

    The keys are the ring's R rows (when ``held``), then the t new ones, all read before the
    new ones are written. Slot ``c`` holds position ``s - 1 - ((s - 1 - c) mod R)``, the
    latest one ``p < s`` with ``p mod R = c`` (``s`` the example's start), a token if
    ``>= 0``; the new rows stand at their own positions, a token where ``at.valid`` says.

    Returns:
        int32 positions and boolean validity, ``(B, R + t)`` (``(1, R + t)`` when every
        example shares one start and no padding).
    """
    rows_b = per_example(at)
    new = at.query if rows_b else ops.expand_dims(ops.arange(steps) + at.query, 0)  # (B|1, t)
    valid = at.valid if at.valid is not None else new >= 0
    if not held:
        return new, valid
    shared = isinstance(at.start, int) or tuple(ops.shape(at.start)) == ()
    begin = at.start if shared else ops.expand_dims(at.start, -1)  # a scalar or (B, 1)
    back = begin - 1 - ops.expand_dims(ops.arange(rows), 0) + rows  # (B|1, R), >= 0
    kept = begin - 1 - _mod(ops, back, rows)  # (B|1, R)
    if shared and rows_b:  # one start, rows per example: the ring's positions for each
        kept = kept + ops.astype(new[:, :1] < 0, "int32")  # + 0, as (B, R)
    return (ops.concatenate([kept, new], 1),
            ops.concatenate([kept >= 0, ops.logical_and(valid, new >= 0)], 1))


def ring_written(ops: Ops, cache: Array | None, new: Array, at: Positions, rows: int) -> Array:
    """A ring ``(B, H, R, D)`` with each real token of ``new (B, H, t, D)`` at its slot.

    Position ``p`` goes to slot ``p mod R``; of a chunk longer than the ring, each example's
    last R real tokens alone are written (distinct slots). A product with a one-hot ``(B, 1,
    R, t)`` matrix, exact, then the untouched slots kept; one shared new row is broadcast.
    """
    steps = ops.shape(new)[2]
    column = ops.expand_dims(ops.arange(steps), 0)  # (1, t)
    if not per_example(at):
        if cache is not None and steps == 1:  # one row: broadcast it, no product needed
            slot = ops.arange(rows) == _mod(ops, at.query, rows)  # (R,)
            return ops.where(ops.expand_dims(slot, -1), new, cache)
        positions, keep = column + at.query, column >= steps - rows  # (1, t)
    else:
        positions = at.query  # (B, t)
        shared = isinstance(at.start, int) or tuple(ops.shape(at.start)) == ()
        begin = at.start if shared else ops.expand_dims(at.start, -1)
        count = steps if at.valid is None else ops.sum(ops.astype(at.valid, "int32"), -1)
        keep = positions >= begin + count - rows  # each example's last R real tokens
        if at.valid is not None:
            keep = ops.logical_and(keep, at.valid)
    slots = ops.expand_dims(ops.arange(rows), -1)  # (R, 1)
    hits = ops.logical_and(ops.expand_dims(_mod(ops, positions, rows), 1) == slots,
                           ops.expand_dims(keep, 1))  # (B|1, R, t)
    onehot = ops.astype(ops.expand_dims(hits, 1), ops.dtype_name(new))  # (B|1, 1, R, t)
    put = ops.matmul(onehot, new)  # (B, H, R, D)
    if cache is None:
        return put
    return ops.where(ops.sum(onehot, -1) > 0, put, cache)


def _mod(ops: Ops, x: Any, rows: int) -> Any:
    """``x mod rows``, exact, of an int or an int32 array (no integer division in every ops).

    The quotient is taken in float32 twice: once of ``x``, then of the small remainder left,
    which two comparisons bring into ``[0, rows)``.
    """
    if isinstance(x, int) or rows == 1:
        return x % rows if isinstance(x, int) else x * 0
    for _ in range(2):
        x = x - ops.astype(ops.astype(x, "float32") * (1.0 / rows), "int32") * rows
    x = ops.where(x < 0, x + rows, x)
    return ops.where(x >= rows, x - rows, x)


def visible(ops: Ops, start: Any, steps: int, capacity: int) -> Array:
    """The boolean ``(t, C)`` mask of a cached call: query i sees rows ``j <= start + i``."""
    rows = ops.expand_dims(ops.arange(steps) + start, -1)  # (t, 1)
    return ops.expand_dims(ops.arange(capacity), 0) <= rows  # (t, C)



@dataclass(frozen=True)
class Positions:
    """The positions of the t new tokens of one call, per example where they differ.

    Attributes:
        start: The position of each example's first real token: an int, an int32 scalar
            array, or int32 ``(B,)``.
        query: The tokens' positions: an int or an int32 scalar array, the first of t
            consecutive positions that every example shares (the fast path), else int32
            ``(B, t)``. Padding tokens' positions are clamped to ``>= 0``.
        valid: None (every token is real), or boolean ``(B, t)``: the real tokens.
        bound: A bound known now on every position plus one, ``max(start) + t``; None when
            the starts are known only at run time.
        tables: Arrays made from the positions once per call and shared by its layers (the
            rotary tables, :func:`attention_core.positional.rotated_heads`).
    """

    start: Any
    query: Any
    valid: Any = None
    bound: int | None = None
    tables: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)


#: The sides ``padding=`` may name.
PADDINGS = ("left", "right")


def positions_of(ops: Ops, start: Any, steps: Any, *, lengths: Any = None,
                 padding: str = "right", padding_mask: Any = None, batch: Any = None,
                 like: Array | None = None) -> Positions:
    """The positions of a call's t tokens, from its start and, in a ragged batch, its lengths.

    Example b's real tokens sit at ``start_b .. start_b + n_b - 1``. With ``lengths`` (n_b),
    they are the columns ``t - n_b .. t - 1`` (``padding="left"``) or ``0 .. n_b - 1``
    (``"right"``); with ``padding_mask``, its True columns, at ``start + cumsum(mask) - 1``
    (Hugging Face's rule, which reads no values). The next call's start is ``start +
    lengths``. One start and neither lengths nor a mask keeps the start as it is: the fast
    path of every example at ``start .. start + t - 1``.

    Args:
        ops: The backend's ops.
        start: An int, an integer scalar array, or integers ``(B,)`` of any framework.
        steps: t.
        lengths: Integers ``(B,)`` in ``[0, t]`` of any framework: each example's real tokens.
        padding: Where the padding of ``lengths`` sits: ``"left"`` or ``"right"``.
        padding_mask: Boolean ``(B, t)`` of any framework, True at the real tokens.
        batch: B, where the caller knows it (else taken from ``lengths`` or the mask).
        like: An array whose device the positions take (torch).

    Raises:
        TypeError: An argument of the wrong type or dtype.
        ValueError: Arguments of the wrong shapes or values, or both lengths and a mask.
    """
    if padding not in PADDINGS:
        raise ValueError(f"padding must be 'left' or 'right', got {padding!r}")
    if lengths is not None and padding_mask is not None:
        raise ValueError("give lengths or padding_mask, not both")
    lens = None if lengths is None else _checked_rows(ops, "lengths", lengths, steps, batch, like)
    mask = None if padding_mask is None else _checked_rows(ops, "padding_mask", padding_mask,
                                                           steps, batch, like)
    found = next((ops.shape(x)[0] for x in (lens, mask) if x is not None), None)
    size = batch if batch is not None else found
    first = check_start(ops, start, steps, None, "start", batch=size if size is not None else "B")
    host = isinstance(first, np.ndarray)
    bound = (int(first.max(initial=0)) if host else first) + steps if (
        (host or isinstance(first, int)) and isinstance(steps, int)) else None
    if host:
        first = ops.from_numpy(first.astype(np.int32), like=like)
    shared = isinstance(first, int) or tuple(ops.shape(first)) == ()
    if lens is None and mask is None and shared:
        return Positions(first, first, None, bound)  # one start: the fast path
    column = ops.expand_dims(ops.arange(steps), 0)  # (1, t)
    begin = first if shared else ops.expand_dims(first, -1)  # a scalar or (B, 1)
    if mask is not None:
        counted = ops.astype(ops.cumsum(ops.astype(mask, "int32"), 1), "int32")
        return Positions(first, _clamped(ops, counted - 1 + begin), mask, bound)
    if lens is None:
        return Positions(first, column + begin, None, bound)
    n = ops.expand_dims(lens, -1)  # (B, 1)
    if padding == "left":
        valid = column >= steps - n
        return Positions(first, _clamped(ops, column - (steps - n) + begin), valid, bound)
    return Positions(first, column + (n - n) + begin, column < n, bound)  # (B, t)


def _checked_rows(ops: Ops, name: str, x: Any, steps: Any, batch: Any, like: Array | None
                  ) -> Array:
    """Checks ``lengths (B,)`` (integers in ``[0, t]``) or ``padding_mask (B, t)`` (boolean).

    Returns:
        The backend's array: int32 lengths, or the boolean mask.
    """
    host = None if framework_of(x) == ops.name and not isinstance(x, np.ndarray) else (
        host_array(x))
    shape = tuple(ops.shape(x)) if host is None else host.shape
    dtype = ops.dtype_name(x) if host is None else host.dtype.name
    want = (batch if batch is not None else "B",) + ((steps,) if name == "padding_mask" else ())
    if len(shape) != len(want) or any(isinstance(a, int) and type(b) is int and a != b
                                      for a, b in zip(shape, want, strict=True)):
        raise ValueError(f"{name} must have shape {_legend(want)}, got {checks.fmt_shape(shape)}")
    if name == "padding_mask":
        if dtype != "bool":
            raise TypeError(f"padding_mask must be boolean (True = a real token), got {dtype}")
        return ops.from_numpy(host, like=like) if host is not None else x
    if not dtype.startswith(("int", "uint")):
        raise TypeError(f"lengths must have an integer dtype, got {dtype}")
    known = host if host is not None else ops.concrete(x)
    if known is not None and known.size and (known.min() < 0 or (
            isinstance(steps, int) and known.max() > steps)):
        bad = int(known.min()) if known.min() < 0 else int(known.max())
        raise ValueError(f"lengths must be in [0, {steps}] (the call's positions), got {bad}")
    if host is not None:
        return ops.from_numpy(host.astype(np.int32), like=like)
    return ops.astype(x, "int32")


def _legend(want: tuple[Any, ...]) -> str:
    """``(B,) = (2,)``, or ``(B, t) = (2, 5)``, the letters alone where no size is known."""
    letters = "(B,)" if len(want) == 1 else "(B, t)"
    if not all(type(w) is int for w in want):
        return letters
    return f"{letters} = {checks.fmt_shape(want)}"


def _clamped(ops: Ops, positions: Array) -> Array:
    """Positions below 0 (of padding tokens) as 0."""
    return ops.where(positions >= 0, positions, 0)
