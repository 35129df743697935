"""``causal``: query ``i`` sees the keys up to its own position, ``j <= p_i``."""

from __future__ import annotations

from typing import Any

from attention_core.modifiers.base import Call, MaskMod, Span, Tile, of_valid_keys
from attention_core.ops import Array


class Causal(MaskMod):
    """Hides the keys after each query's position."""

    def visible(self, tile: Tile) -> Array | None:
        first = tile.first_position()
        if first is not None and isinstance(tile.kn, int) and tile.k0 + tile.kn - 1 <= first:
            return None  # every key of the tile is at or before the first query
        return of_valid_keys(tile, tile.distances() <= 0)

    def span(self, call: Call, q0: Any, qn: int) -> Span | None:
        K = call.shape[3]
        if call.per_example:  # keys at their indices, below a bound known now
            if call.bound is None or call.key_positions is not None or not isinstance(K, int):
                return None
            return 0, max(1, min(K, call.bound))
        if not (isinstance(q0, int) and isinstance(call.offset, int) and isinstance(K, int)):
            return None
        end = min(K, q0 + qn + call.offset)  # the block's last query sees keys < end
        return 0, max(1, end)
