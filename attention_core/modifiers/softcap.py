"""``softcap``: the scores become ``c * tanh(s / c)`` (Gemma 2), bounded by ``c`` either way."""

from __future__ import annotations

from attention_core.checks import check_softcap
from attention_core.modifiers.base import ScoreMod, Tile
from attention_core.ops import Array


class Softcap(ScoreMod):
    """Soft-caps the scores at ``c``.

    Args:
        cap: ``c``, a finite real > 0.
    """

    def __init__(self, cap: float) -> None:
        checked = check_softcap(cap)
        assert checked is not None
        self.cap = checked

    def apply(self, scores: Array, tile: Tile) -> Array:
        return tile.ops.tanh(scores * (1.0 / self.cap)) * self.cap
