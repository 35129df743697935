"""ALiBi (Press et al., 2022): ``s -= slope_h * |p_i - j|``, with the standard slopes of the H heads."""

from __future__ import annotations

import numpy as np

from attention_core.modifiers.base import Call, ScoreMod, Tile
from attention_core.ops import Array
from attention_core.positional import alibi_slopes


class Alibi(ScoreMod):
    """Linear biases by distance, one slope per head."""

    def __init__(self) -> None:
        self.slopes: np.ndarray | None = None

    def bind(self, call: Call) -> Alibi:
        heads = call.shape[1]
        if not isinstance(heads, int):
            raise ValueError("ALiBi needs the number of heads to be known when the call is traced")
        bound = Alibi()
        bound.slopes = alibi_slopes(heads)
        return bound

    def apply(self, scores: Array, tile: Tile) -> Array:
        ops, dtype = tile.ops, tile.ops.dtype_name(scores)
        assert self.slopes is not None
        d = ops.astype(tile.distances(), dtype)  # (qn, kn), or (B, 1, qn, kn) per example
        d = ops.maximum(d, -d)
        column = ops.from_numpy(-self.slopes.astype(dtype)[:, None, None])  # (H, 1, 1)
        if len(ops.shape(d)) == 4:
            return scores + ops.expand_dims(column, 0) * d
        return scores + ops.expand_dims(column * d, 0)
