"""The scores: grouped-query heads, and the terms added to the scores before masking.

``s_ij = q_i . k_j * scale`` is formed per query head; with fewer key/value heads than query
heads (grouped-query attention, Ainslie et al., 2023), query head ``h`` uses key/value head
``h // G``, ``G = H / Hkv``. The products take the queries of a group as rows of one matrix,
``(B, Hkv, G * Q, D) @ (B, Hkv, D, K)``, so keys and values are never repeated in memory.

What a call adds to or changes in the scores is a score modifier
(:mod:`attention_core.modifiers`); ``score_bias`` is checked here.

Shape legend: B batch, H query heads, Hkv key/value heads, G = H / Hkv, Q queries, K keys,
D depth, Dv value depth.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from attention_core.host import host_array
from attention_core.masks import lifted, own
from attention_core.ops import FLOAT_DTYPES, Array, Ops, matmul_transposed


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
