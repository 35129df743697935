"""``score_bias``: a float array added to the scores, broadcastable to ``(B, H, Q, K)``."""

from __future__ import annotations

from typing import Any

from attention_core.masks import tile_columns, tile_rows
from attention_core.modifiers.base import Call, ScoreMod, Tile
from attention_core.ops import Array


class ScoreBias(ScoreMod):
    """Adds a bias of shape ``(Q, K)``, ``(B, Q, K)`` or ``(B, H, Q, K)`` to the scores.

    Args:
        bias: Float array of any framework.
    """

    def __init__(self, bias: Any) -> None:
        self.bias = bias

    def bind(self, call: Call) -> ScoreBias:
        from attention_core.scores import score_bias_array

        return ScoreBias(score_bias_array(call.ops, self.bias, call.shape))

    def apply(self, scores: Array, tile: Tile) -> Array:
        ops, (_, _, Q, K) = tile.ops, tile.call.shape
        bias = tile_rows(ops, tile_columns(ops, self.bias, tile.k0, tile.kn, K), tile.q0,
                         tile.qn, Q)
        dtype = ops.dtype_name(scores)
        return scores + (bias if ops.dtype_name(bias) == dtype else ops.astype(bias, dtype))
