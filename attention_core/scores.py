"""The scores: grouped-query heads, and the terms added to the scores before masking.

``s_ij = q_i . k_j * scale`` is formed per query head; with fewer key/value heads than query
heads (grouped-query attention, Ainslie et al., 2023), query head ``h`` uses key/value head
``h // G``, ``G = H / Hkv``. The products take the queries of a group as rows of one matrix,
``(B, Hkv, G * Q, D) @ (B, Hkv, D, K)``, so keys and values are never repeated in memory.

Before masking, a call may change the scores, in this order (:class:`ScoreTerms`):

1. soft-capping (Gemma 2): ``s = c * tanh(s / c)``;
2. ALiBi (Press et al., 2022): ``s -= slope_h * |p_i - j|``, ``p_i`` the query's position;
3. ``score_bias``: any float array broadcastable to ``(B, H, Q, K)``.

Masks are applied after them, so a hidden key stays hidden whatever its bias; a visible
score of ``-inf`` weighs 0, like a hidden one.

Shape legend: B batch, H query heads, Hkv key/value heads, G = H / Hkv, Q queries, K keys,
D depth, Dv value depth.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from attention_core import checks
from attention_core.host import host_array
from attention_core.masks import distances, lifted, own, tile_columns, tile_rows
from attention_core.ops import FLOAT_DTYPES, Array, Ops, matmul_transposed
from attention_core.positional import alibi_slopes


def groups(ops: Ops, queries: Array, keys: Array) -> int:
    """G: query heads per key/value head (1 when the heads are as many, or not known now)."""
    H, Hkv = ops.shape(queries)[1], ops.shape(keys)[1]
    if isinstance(H, int) and isinstance(Hkv, int) and Hkv < H:
        return H // Hkv
    return 1


def _grouped(ops: Ops, x: Array, G: int) -> Array:
    """``(B, H, N, X) -> (B, Hkv, G * N, X)``: a group's query heads as rows of one matrix."""
    _, H, N, X = ops.shape(x)
    return ops.reshape(x, (-1, H // G, G * N, X))


def _ungrouped(ops: Ops, x: Array, G: int) -> Array:
    """``(B, Hkv, G * N, X) -> (B, H, N, X)``, the inverse of :func:`_grouped`."""
    _, Hkv, GN, X = ops.shape(x)
    return ops.reshape(x, (-1, Hkv * G, GN // G, X))


def products(ops: Ops, queries: Array, keys: Array) -> Array:
    """``queries @ keys^T`` per query head: ``(B, H, Q, D) x (B, Hkv, K, D) -> (B, H, Q, K)``."""
    G = groups(ops, queries, keys)
    if G == 1:
        return matmul_transposed(ops, queries, keys)
    return _ungrouped(ops, matmul_transposed(ops, _grouped(ops, queries, G), keys), G)


def pooled(ops: Ops, weights: Array, values: Array) -> Array:
    """``weights @ values`` per query head: ``(B, H, Q, K) x (B, Hkv, K, Dv) -> (B, H, Q, Dv)``."""
    G = groups(ops, weights, values)
    if G == 1:
        return ops.matmul(weights, values)
    return _ungrouped(ops, ops.matmul(_grouped(ops, weights, G), values), G)


def score_bias_array(ops: Ops, score_bias: Any, scores_shape: tuple[Any, ...]) -> Array:
    """Checks ``score_bias`` and lifts it to rank 4, broadcastable to ``(B, H, Q, K)``.

    Raises:
        TypeError: Not real floating point.
        ValueError: It cannot broadcast to the scores.
    """
    host = None if own(ops, score_bias) else host_array(score_bias)  # read as given
    dtype = ops.dtype_name(score_bias) if host is None else host.dtype.name
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"score_bias must be floating point ({', '.join(FLOAT_DTYPES)}), "
                        f"got {dtype}")
    shape = ops.shape(score_bias) if host is None else host.shape
    bias = score_bias if host is None else ops.from_numpy(host)
    return lifted(ops, "score_bias", bias, shape, scores_shape)


class ScoreTerms:
    """What one call adds to its scores before masking, by tiles (see the module docstring).

    Args:
        ops: The backend's ops.
        scores_shape: ``(B, H, Q, K)``.
        offset: Query ``i`` stands at position ``i + offset`` (keys at ``j``): ``K - Q`` in a
            plain call, the first new position in a cached one. An int or a run-time scalar.
        softcap: c of ``c * tanh(s / c)``, or None.
        alibi: Whether to add the ALiBi biases of the H heads.
        score_bias: A float array broadcastable to ``(B, H, Q, K)``, or None.
    """

    def __init__(self, ops: Ops, scores_shape: tuple[Any, ...], offset: Any,
                 softcap: float | None = None, alibi: bool = False,
                 score_bias: Any = None) -> None:
        self.ops, self.shape, self.offset = ops, tuple(scores_shape), offset
        self.softcap = checks.check_softcap(softcap)
        heads = scores_shape[1]
        if alibi and not isinstance(heads, int):
            raise ValueError("ALiBi needs the number of heads to be known when the call is traced")
        self.slopes = alibi_slopes(heads) if alibi else None
        self.bias = None if score_bias is None else score_bias_array(ops, score_bias, scores_shape)

    @property
    def empty(self) -> bool:
        """True when the scores are left as they are."""
        return self.softcap is None and self.slopes is None and self.bias is None

    def apply(self, s: Array, q0: Any, qn: int, k0: Any, kn: int) -> Array:
        """The tile ``s`` ``(B, H, qn, kn)`` of queries ``q0 :`` and keys ``k0 :``, changed."""
        ops = self.ops
        dtype = ops.dtype_name(s)
        if self.softcap is not None:
            s = ops.tanh(s * (1.0 / self.softcap)) * self.softcap
        if self.slopes is not None:
            s = s + ops.astype(self._alibi(q0, qn, k0, kn, s), dtype)
        if self.bias is not None:
            bias = tile_rows(ops, tile_columns(ops, self.bias, k0, kn, self.shape[3]), q0, qn,
                             self.shape[2])
            s = s + (bias if ops.dtype_name(bias) == dtype else ops.astype(bias, dtype))
        return s

    def _alibi(self, q0: Any, qn: int, k0: Any, kn: int, like: Array) -> Array:
        """``-slope_h * |p_i - j|`` ``(1, H, qn, kn)``, in float32 (float64 for float64 scores)."""
        ops, slopes = self.ops, self.slopes
        assert slopes is not None
        wide = "float64" if ops.dtype_name(like) == "float64" else "float32"
        distance = ops.astype(distances(ops, q0, qn, k0, kn, self.offset), wide)  # (qn, kn)
        distance = ops.maximum(distance, -distance)
        column = ops.from_numpy(-slopes.astype(wide)[:, None, None])  # (H, 1, 1)
        return ops.expand_dims(column * distance, 0)


def repeat_heads(ops: Ops, x: Array, heads: Any) -> Array:
    """``(B, Hkv, N, X) -> (B, H, N, X)``, each key/value head repeated for its query heads.

    For small per-head arrays only (the rows of a mask); keys and values are never repeated.
    """
    Hkv = ops.shape(x)[1]
    if not (isinstance(heads, int) and isinstance(Hkv, int)) or heads == Hkv:
        return x
    _, _, N, X = ops.shape(x)
    ones = ops.from_numpy(np.ones((1, 1, heads // Hkv, 1, 1)), like=x)
    return ops.reshape(ops.expand_dims(x, 2) * ones, (-1, heads, N, X))
