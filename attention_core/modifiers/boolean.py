"""``mask``: an explicit boolean mask, True = may attend, ``(Q, K)``, ``(B, Q, K)`` or ``(B, H, Q, K)``."""

from __future__ import annotations

from typing import Any

from attention_core.masks import boolean_mask, tile_columns, tile_rows
from attention_core.modifiers.base import Call, MaskMod, Tile
from attention_core.ops import Array


class BooleanMask(MaskMod):
    """Hides the keys where the mask is False (size-1 axes broadcast).

    Args:
        mask: Boolean array of any framework.
        name: The argument's name in messages.
    """

    def __init__(self, mask: Any, name: str = "mask") -> None:
        self.mask, self.name = mask, name

    def bind(self, call: Call) -> BooleanMask:
        return BooleanMask(boolean_mask(call.ops, self.mask, call.shape, name=self.name),
                           self.name)

    def visible(self, tile: Tile) -> Array:
        _, _, Q, K = tile.call.shape
        ops = tile.ops
        return tile_rows(ops, tile_columns(ops, self.mask, tile.k0, tile.kn, K), tile.q0,
                         tile.qn, Q)
