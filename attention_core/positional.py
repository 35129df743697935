"""Positional encodings: sinusoidal table, rotation property, learned and relative positions.

The sinusoidal table of Vaswani et al. has, for position ``i`` and column pair ``j``,
``P[i, 2j] = sin(i * w_j)`` and ``P[i, 2j+1] = cos(i * w_j)`` with ``w_j = 1 / 10000^(2j/d)``.
Lower columns oscillate faster, like the low bits of a binary counter.

Relative representations (Shaw et al., 2018) learn one vector per offset ``j - i`` between a
key and a query, clipped to ``[-m, m]``: ``2m + 1`` vectors serve any length.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from attention_core import checks
from attention_core.cache import check_start
from attention_core.host import host_array
from attention_core.masks import fits, own
from attention_core.ops import Array, Ops
from attention_core.registry import ops_for


def frequencies(num_hiddens: int) -> np.ndarray:
    """Returns ``w_j = 1 / 10000^(2j/d)`` for ``j = 0 .. ceil(d/2) - 1``, float64."""
    return 1.0 / np.power(10000.0, np.arange(0, num_hiddens, 2, dtype=np.float64) / num_hiddens)


def sinusoidal_encoding(max_len: int, num_hiddens: int, dtype: str = "float32") -> np.ndarray:
    """The sinusoidal position table, computed in float64 and cast to ``dtype``.

    Args:
        max_len: Number of positions (rows).
        num_hiddens: Encoding width d (columns); odd widths end with a sine column.
        dtype: NumPy dtype name of the result.

    Returns:
        ``P`` of shape ``(max_len, num_hiddens)``.
    """
    max_len = checks.check_positive_int("max_len", max_len)
    num_hiddens = checks.check_positive_int("num_hiddens", num_hiddens)
    angles = np.arange(max_len, dtype=np.float64)[:, None] * frequencies(num_hiddens)  # (L, J)
    table = np.empty((max_len, num_hiddens), dtype=np.float64)
    table[:, 0::2] = np.sin(angles)
    table[:, 1::2] = np.cos(angles[:, : num_hiddens // 2])
    return table.astype(dtype)


def relative_rotation(delta: float, num_hiddens: int) -> np.ndarray:
    """The linear map taking row ``i`` of the sinusoidal table to row ``i + delta``.

    For each column pair ``(2j, 2j+1)`` the map is the rotation
    ``[[cos(d w_j), sin(d w_j)], [-sin(d w_j), cos(d w_j)]]``, independent of ``i``: this is
    why a fixed offset is a linear function of the encoding.

    Args:
        delta: The offset (may be negative).
        num_hiddens: Encoding width; must be even, since a lone sine column has no partner.

    Returns:
        ``R`` of shape ``(num_hiddens, num_hiddens)``, float64, with ``R @ P[i] = P[i + delta]``.
    """
    num_hiddens = checks.check_positive_int("num_hiddens", num_hiddens)
    if num_hiddens % 2:
        raise ValueError(
            f"num_hiddens ({num_hiddens}) must be even for the rotation: "
            "the last sine column has no cosine partner"
        )
    theta = delta * frequencies(num_hiddens)  # (J,)
    rotation = np.zeros((num_hiddens, num_hiddens))
    even, odd = np.arange(0, num_hiddens, 2), np.arange(1, num_hiddens, 2)
    rotation[even, even] = np.cos(theta)
    rotation[even, odd] = np.sin(theta)
    rotation[odd, even] = -np.sin(theta)
    rotation[odd, odd] = np.cos(theta)
    return rotation


def add_positions(X: Array, P: Array, dropout: float = 0.0, *, ops: Ops | None = None) -> Array:
    """Adds the first T rows of a position table to ``X`` and applies dropout.

    Args:
        X: ``(B, T, d)``.
        P: ``(1, max_len, d)`` with ``max_len >= T``.
        dropout: Dropout rate on the sum (applied whenever > 0).
        ops: The backend's ops; found from ``X`` when omitted.

    Returns:
        ``dropout(X + P[:, :T])``, shape ``(B, T, d)``.

    When T is not known while tracing (an unknown dimension of ``tf.function``, the symbolic
    shapes of ``jax.export`` and of Keras' symbolic calls on JAX), the rows are taken by index,
    so the sum's shape is ``(B, T, d)`` as written; T > max_len is then an error of the gather
    on TensorFlow and NaN rows on JAX (whose gathers fill), not known until the program runs.
    """
    ops = ops or ops_for(X, "X")
    shape = checks.check_rank(ops, "X", X, (3,), "(B, T, num_hiddens)")
    checks.check_floating(ops, "X", X)
    _, max_len, width = ops.shape(P)
    checks.check_equal(lambda: f"X last dimension ({shape[2]}) must be num_hiddens ({width})",
                       shape[2], width)
    steps = shape[1]
    if isinstance(steps, int) and steps > max_len:
        raise ValueError(f"X has {steps} positions, more than max_len ({max_len})")
    # T unknown while tracing: T rows by index, whose count symbolic shapes can tell is T (of a
    # slice of max_len rows they cannot)
    rows = P[:, :steps] if isinstance(steps, int) else ops.take(P[0], ops.arange(steps))
    out = X + ops.astype(rows, ops.dtype_name(X))
    dropout = checks.check_dropout(dropout)
    return ops.dropout(out, dropout) if dropout > 0 else out


#: Rows of the sinusoidal table when the number of positions is not known until run time.
DEFAULT_MAX_LEN = 1000


def positional_encoding(
    X: Array, dropout: float = 0.0, *, max_len: int | None = None, ops: Ops | None = None
) -> Array:
    """Adds the sinusoidal encoding to ``X`` ``(B, T, d)``: the functional ``PositionalEncoding``.

    Args:
        X: ``(B, T, d)``; ``d`` must be known, ``T`` may be a run-time size (a traced graph).
        dropout: Dropout rate on the sum (applied whenever > 0).
        max_len: Rows of the table, sliced to the first T. None: T rows when T is known, else
            :data:`DEFAULT_MAX_LEN` (1000).
        ops: The backend's ops; found from ``X`` when omitted.

    Returns:
        ``dropout(X + P[:T])``, shape ``(B, T, d)``.
    """
    ops = ops or ops_for(X, "X")
    shape = checks.check_rank(ops, "X", X, (3,), "(B, T, num_hiddens)")
    steps, width = shape[1], shape[2]
    if not isinstance(width, int):
        raise ValueError("X must have a known width (last dimension)")
    if max_len is None:
        max_len = steps if isinstance(steps, int) else DEFAULT_MAX_LEN
    table = ops.from_numpy(sinusoidal_encoding(max_len, width, "float64")[None], like=X)
    return add_positions(X, table, dropout, ops=ops)


#: Stands for minus and plus infinity in the integer bounds of the clipped offsets.
_UNBOUNDED = 2**30


def relative_offsets(
    ops: Ops, num_queries: Any, num_keys: Any, max_relative_position: int, like: Array,
    first: Any = None, rows: Any = None,
) -> Array:
    """One-hot ``(Q, K, 2m + 1)`` of the clipped offset between each query and key.

    Query ``i`` stands at position ``p_i = first + i``, ``first`` by default ``K - Q``
    (aligned at the end, like ``causal``), key ``j`` at ``j``. Entry ``[i, j, r]`` is 1 when
    ``clip(j - p_i, -m, m) == r - m``, else 0. Contracting the keys axis with it gathers
    per-offset embeddings by matrix products, which every backend differentiates.

    Args:
        ops: The backend's ops.
        num_queries: Q (an int, or a run-time scalar).
        num_keys: K (an int, or a run-time scalar).
        max_relative_position: m >= 1; offsets beyond it share the edge vectors.
        like: An array whose floating dtype and device the result takes.
        first: The position of query 0 (an int or a run-time scalar); None for ``K - Q``.
        rows: Integer positions ``(B, Q)`` of the queries per example, in place of
            ``first``: the result is then ``(B, Q, K, 2m + 1)``.
    """
    m = checks.check_positive_int("max_relative_position", max_relative_position)
    keys = ops.expand_dims(ops.arange(num_keys), 0)  # (1, K)
    if rows is None:
        first = num_keys - num_queries if first is None else first
        rows = ops.expand_dims(ops.arange(num_queries) + first, -1)  # (Q, 1)
    else:
        keys, rows = ops.expand_dims(keys, 0), ops.expand_dims(rows, -1)  # (1, 1, K), (B, Q, 1)
    offsets = ops.expand_dims(keys - rows, -1)  # (Q, K, 1) or (B, Q, K, 1)
    r = ops.arange(2 * m + 1) - m  # (2m + 1,): the offsets -m .. m
    low = r - ops.astype(r <= -m, "int32") * _UNBOUNDED  # the edge vectors take every offset
    high = r + ops.astype(r >= m, "int32") * _UNBOUNDED  # beyond m
    hit = ops.logical_and(offsets >= low, offsets <= high)  # (Q, K, 2m + 1)
    return ops.astype(hit, ops.dtype_name(like))


# -- rotary positions (Su et al., 2021) ------------------------------------------------------

#: Positions per row of the fine table of :func:`rotary_angles` (run-time positions).
ROTARY_FINE = 1024
#: Rows of its coarse table: run-time positions below ``ROTARY_FINE * ROTARY_COARSE`` (2**22).
ROTARY_COARSE = 4096
#: Largest position (exclusive) the rotary tables serve.
ROTARY_MAX_POSITIONS = ROTARY_FINE * ROTARY_COARSE


def rotary_frequencies(depth: int, base: float) -> np.ndarray:
    """``theta_t = base^(-2t/d)`` for ``t = 0 .. d/2 - 1``, float64."""
    return 1.0 / np.power(float(base), np.arange(0, depth, 2, dtype=np.float64) / depth)


def check_rotary(depth: Any, base: Any, base_name: str = "rotary_base") -> tuple[int, float]:
    """Checks a rotary head depth (even) and base (> 1); returns them as int and float.

    ``base_name``: the base's argument as the caller takes it.
    """
    depth = checks.check_positive_int("depth", depth)
    if depth % 2:
        raise ValueError(f"rotary positions need an even depth per head, got {depth}: the "
                         "rotation turns pairs of features")
    return depth, checks.check_rotary_base(base, base_name)


def rotated_heads(ops: Ops, x: Array, start: Any, base: float, positions: Any = None,
                  tables: dict[Any, Any] | None = None) -> Array:
    """Heads ``(B, H, N, D)`` rotated by the angles of positions ``start .. start + N - 1``.

    Or, per example, by those of ``positions``: integers ``(B, N)`` (``start`` unused), a
    backend array or NumPy. ``tables``: where the tables of these positions are kept for
    other heads at the same positions (a cached call's, shared by its layers), by depth,
    base, dtype and device.
    """
    key = ("rotary", ops.shape(x)[-1], base, ops.dtype_name(x), str(getattr(x, "device", None)))
    found = None if tables is None else tables.get(key)
    if found is not None:  # made for these depth and base, which were checked then
        return turn(ops, x, *found)
    depth, base = check_rotary(fixed_width(ops, x), base)
    if positions is None:
        whole = rotary_angles(ops, start, ops.shape(x)[2], depth, base, x, whole=True)  # (N, d)
    else:
        whole = whole_tables(ops, *(ops.expand_dims(c, 1)  # (B, 1, N, d/2): every head's
                                    for c in rotary_table(ops, positions, depth, base, x)))
    if tables is not None:
        tables[key] = whole
    return turn(ops, x, *whole)


def rotary_angles(
    ops: Ops, start: Any, steps: Any, depth: int, base: float, like: Array, whole: bool = False
) -> tuple[Array, Array]:
    """``(cos, sin)`` ``(T, d/2)`` of positions ``start .. start + T - 1`` (:func:`rotary_table`).

    ``whole``: the tables of :func:`turn`, ``(T, d)``, instead.
    """
    if isinstance(start, int) and isinstance(steps, int) and getattr(ops, "host_tables", True):
        if start < 0 or start + steps > ROTARY_MAX_POSITIONS:  # checked on ints: no data read
            raise ValueError(f"rotary positions must be in [0, {ROTARY_MAX_POSITIONS}), got "
                             f"[{start}, {start + steps - 1}]")
        dtype = ops.dtype_name(like)
        if dtype in ("float16", "float32", "float64"):  # NumPy's own: the tables kept
            cos, sin = _known_angles(start, steps, depth, float(base), dtype, whole)
            return ops.from_numpy(cos, like=like), ops.from_numpy(sin, like=like)
        tables = rotary_table(ops, np.arange(start, start + steps), depth, base, like, False)
    else:
        tables = rotary_table(ops, ops.arange(steps) + start, depth, base, like)  # run-time
    return whole_tables(ops, *tables) if whole else tables


@functools.lru_cache(maxsize=256)
def _known_angles(start: int, steps: int, depth: int, base: float, dtype: str, whole: bool
                  ) -> tuple[np.ndarray, np.ndarray]:
    """The tables of :func:`rotary_table` for positions known now, in ``dtype``, kept.

    A decode step asks for the same few; they are made in float64 and rounded once, as
    there. ``whole``: as :func:`whole_tables` makes them. Callers copy them
    (``ops.from_numpy``) and never write to them.
    """
    angles = np.arange(start, start + steps, dtype=np.float64)[:, None] * rotary_frequencies(
        depth, base)
    cos, sin = np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)
    if whole:
        return np.concatenate([cos, cos], -1), np.concatenate([-sin, sin], -1)
    return cos, sin


def rotary_table(
    ops: Ops, positions: Any, depth: int, base: float, like: Array, check: bool = True
) -> tuple[Array, Array]:
    """``(cos, sin)`` of the angles ``p * theta_t`` of integer ``positions``, ``(..., d/2)``.

    In ``like``'s dtype. Positions known now (a NumPy array) are turned into angles in float64
    on the host, so the tables are the float64 values rounded once, at any position. Run-time
    positions (an array of the backend, maybe traced) are split as ``p = a * F + b`` with
    ``F`` = :data:`ROTARY_FINE`; the float64 tables of ``a F theta`` and ``b theta`` are
    gathered by one-hot products (exact) and combined by the angle-addition formulas, so the
    result is within a few roundings of the float64 one, also at positions in the tens of
    thousands, where ``p * theta`` in float32 would be off by ``1e-3`` radians. Ops that can
    take no host table (``ops.host_tables`` False: MXNet's graphs) give ``cos`` and ``sin``,
    and the angles are formed in float64 in the computation instead.

    Args:
        ops: The backend's ops.
        positions: Integer positions in ``[0, ROTARY_MAX_POSITIONS)``, any shape.
        depth: d, even.
        base: The base of the frequencies.
        like: An array whose floating dtype and device the tables take.
        check: Whether to check known positions' range (done by the caller when False).

    Raises:
        ValueError: A known position outside ``[0, ROTARY_MAX_POSITIONS)``.
    """
    theta = rotary_frequencies(depth, base)
    if isinstance(positions, np.ndarray) and not getattr(ops, "host_tables", True):
        positions = ops.from_numpy(positions.astype(np.int32))  # a small graph constant
    if isinstance(positions, np.ndarray):
        if check and positions.size and (positions.min() < 0
                                         or positions.max() >= ROTARY_MAX_POSITIONS):
            raise ValueError(f"rotary positions must be in [0, {ROTARY_MAX_POSITIONS}), got "
                             f"[{positions.min()}, {positions.max()}]")
        angles = positions.astype(np.float64)[..., None] * theta  # (..., d/2)
        return ops.from_numpy(np.cos(angles), like=like), ops.from_numpy(np.sin(angles), like=like)
    cos, sin = getattr(ops, "cos", None), getattr(ops, "sin", None)
    if cos is not None and sin is not None:  # the angles in float64, in the computation
        angles = ops.expand_dims(ops.astype(positions, "float64"), -1) * ops.from_numpy(theta)
        dtype = ops.dtype_name(like)
        return ops.astype(cos(angles), dtype), ops.astype(sin(angles), dtype)
    coarse = positions // ROTARY_FINE
    parts = []
    for index, size, step in ((coarse, ROTARY_COARSE, ROTARY_FINE),
                              (positions - coarse * ROTARY_FINE, ROTARY_FINE, 1)):
        onehot = ops.expand_dims(index, -1) == ops.arange(size)  # (..., size)
        onehot = ops.astype(onehot, ops.dtype_name(like))
        angles = np.arange(size, dtype=np.float64)[:, None] * step * theta  # (size, d/2)
        parts.append(tuple(ops.matmul(onehot, ops.from_numpy(table(angles), like=like))
                           for table in (np.cos, np.sin)))
    (cos_a, sin_a), (cos_b, sin_b) = parts
    return cos_a * cos_b - sin_a * sin_b, sin_a * cos_b + cos_a * sin_b


def rotate(ops: Ops, x: Array, cos: Array, sin: Array) -> Array:
    """Rotates each pair of features ``(x_t, x_{t + d/2})`` of ``x (..., T, d)`` by its angle.

    The "rotate half" layout (GPT-NeoX, Llama, KerasHub): ``x_t cos - x_{t+d/2} sin`` and
    ``x_{t+d/2} cos + x_t sin``, with ``cos``, ``sin`` ``(T, d/2)`` from :func:`rotary_angles`.
    """
    return turn(ops, x, *whole_tables(ops, cos, sin))


def whole_tables(ops: Ops, cos: Array, sin: Array) -> tuple[Array, Array]:
    """The tables of :func:`turn` from half ones: ``[cos, cos]`` and ``[-sin, sin]``, ``(..., d)``."""
    axis = len(ops.shape(cos)) - 1
    return ops.concatenate([cos, cos], axis), ops.concatenate([-sin, sin], axis)


def turn(ops: Ops, x: Array, cos: Array, sin: Array) -> Array:
    """:func:`rotate` by whole tables (:func:`whole_tables`): ``x cos + [x_2, x_1] sin``.

    The same numbers as :func:`rotate`'s formulas (``a + b (-s)`` is ``a - b s`` exactly), in
    fewer operations.
    """
    axis = len(ops.shape(x)) - 1
    half = fixed_width(ops, x) // 2
    swapped = ops.concatenate([ops.slice(x, axis, half, half), ops.slice(x, axis, 0, half)], axis)
    dtype = ops.dtype_name(x)
    if ops.dtype_name(cos) != dtype:  # the tables are made in x's dtype but for autocast's
        cos, sin = ops.astype(cos, dtype), ops.astype(sin, dtype)
    return x * cos + swapped * sin


def fixed_width(ops: Ops, x: Array) -> int:
    """The last dimension of ``x``, which must be known when the call is traced."""
    width = ops.shape(x)[-1]
    if not isinstance(width, int):
        raise ValueError("the depth of rotated heads must be known when the call is traced")
    return width


def rotary_embedding(
    X: Array, start: Any = None, *, positions: Any = None, base: float = 10000.0,
    ops: Ops | None = None,
) -> Array:
    """Rotates ``X`` ``(B, T, d)`` or ``(B, T, H, d)`` by the rotary angles of its positions.

    The functional ``RotaryEmbedding``: axis 1 is the sequence, the last axis the features
    (pairs ``(t, t + d/2)`` are turned, :func:`rotate`).

    Args:
        X: Floating, rank 3 or 4.
        start: The first position (positions ``start .. start + T - 1``): an int, or an
            integer scalar array; None for 0.
        positions: Integer positions ``(T,)`` or ``(B, T)``, in place of ``start``'s.
        base: The base of the frequencies ``base^(-2t/d)``.
        ops: The backend's ops; found from ``X`` when omitted.
    """
    return rotate_at(X, start, positions, base, ops or ops_for(X, "X"), ("start", "base"))


def rotate_at(X: Array, start: Any, positions: Any, base: float, ops: Ops,
              names: tuple[str, str]) -> Array:
    """:func:`rotary_embedding`, its messages naming ``start`` and ``base`` by ``names``.

    The layer takes ``start_index`` where the function takes ``start``.
    """
    shape = checks.check_rank(ops, "X", X, (3, 4), "(B, T, d) or (B, T, H, d)")
    checks.check_floating(ops, "X", X)
    depth, base = check_rotary(fixed_width(ops, X), base, names[1])
    if positions is None:
        first = check_start(ops, 0 if start is None else start, 0, ROTARY_MAX_POSITIONS, names[0])
        cos, sin = rotary_angles(ops, first, shape[1], depth, base, X)  # (T, d/2)
    else:
        if start is not None:
            raise ValueError(f"give {names[0]} or positions, not both")
        cos, sin = rotary_table(ops, _positions(ops, positions, shape), depth, base, X)
    if len(shape) == 4:  # (..., T, 1, d/2): the heads axis after the sequence
        cos, sin = ops.expand_dims(cos, -2), ops.expand_dims(sin, -2)
    return rotate(ops, X, cos, sin)


def _positions(ops: Ops, positions: Any, shape: tuple[Any, ...]) -> Any:
    """Checks integer positions ``(T,)`` or ``(B, T)`` for ``X`` of ``shape``.

    Returns them as a NumPy array when known now, else as the backend's int32 array.
    """
    host = None if own(ops, positions) else host_array(positions)
    dtype = ops.dtype_name(positions) if host is None else host.dtype.name
    if not dtype.startswith(("int", "uint")):
        raise TypeError(f"positions must have an integer dtype, got {dtype}")
    got = ops.shape(positions) if host is None else host.shape
    B, T = shape[0], shape[1]
    if not any(fits(got, want, broadcast=False) for want in ((T,), (B, T))):
        raise ValueError(f"positions must have shape (T,) or (B, T) = ({T},) or ({B}, {T}), "
                         f"got {checks.fmt_shape(got)}")
    if host is None:
        host = ops.concrete(positions)
        if host is None:  # run-time values
            return ops.astype(positions, "int32")
    return np.asarray(host).astype(np.int64)


# -- ALiBi (Press et al., 2022) --------------------------------------------------------------


def alibi_slopes(num_heads: int) -> np.ndarray:
    """The standard ALiBi slopes of ``num_heads`` heads, float64.

    For n heads, n a power of 2, head h (from 0) has ``2^(-8 (h + 1) / n)``. Otherwise the
    largest power of 2 below, n, gives the first n slopes, and the slopes of 2n heads, every
    other one from the first, give the rest.
    """
    num_heads = checks.check_positive_int("num_heads", num_heads)
    n = 1 << (num_heads.bit_length() - 1)

    def powers(count: int) -> np.ndarray:
        return np.power(2.0, -8.0 * np.arange(1, count + 1, dtype=np.float64) / count)

    return np.concatenate([powers(n), powers(2 * n)[0::2][: num_heads - n]])
