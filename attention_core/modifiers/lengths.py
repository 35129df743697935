"""``valid_lens``: key ``j`` is visible to the queries of example ``b`` when ``j < valid_lens[b]``.

Lengths of shape ``(B, Q)`` give each query its own.
"""

from __future__ import annotations

from typing import Any

from attention_core.masks import lens_column, tile_rows
from attention_core.modifiers.base import Call, MaskMod, Span, Tile
from attention_core.ops import Array


class Lengths(MaskMod):
    """Hides the keys at or after each example's (or query's) length.

    Args:
        valid_lens: Integer lengths, ``(B,)`` or ``(B, Q)``, of any framework.
        name: The argument's name in messages.
    """

    def __init__(self, valid_lens: Any, name: str = "valid_lens") -> None:
        self.lens, self.name = valid_lens, name
        self.bounds: tuple[int, int] | None = None

    def bind(self, call: Call) -> Lengths:
        bound = Lengths(None, self.name)
        bound.lens, bound.bounds = lens_column(call.ops, self.lens, call.shape, name=self.name)
        return bound

    def visible(self, tile: Tile) -> Array | None:
        shortest = None if self.bounds is None else self.bounds[0]
        if shortest is not None and isinstance(tile.k0, int) and tile.k0 + tile.kn <= shortest:
            return None  # every key of the tile is within every length
        lens = tile_rows(tile.ops, self.lens, tile.q0, tile.qn, tile.call.shape[2])
        return tile.key_index() < lens

    def span(self, call: Call, q0: Any, qn: int) -> Span | None:
        return None if self.bounds is None else (0, max(1, self.bounds[1]))
