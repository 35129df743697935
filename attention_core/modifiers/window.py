"""``window``: query ``i`` sees the keys less than ``w`` positions from its own, ``|p_i - j| < w``.

ANDed with :mod:`~attention_core.modifiers.causal`, the ``w`` keys ending at the query.
"""

from __future__ import annotations

from typing import Any

from attention_core.checks import check_window
from attention_core.modifiers.base import Call, MaskMod, Span, Tile, of_valid_keys
from attention_core.ops import Array


class Window(MaskMod):
    """Hides the keys ``w`` or more positions away from the query.

    Args:
        size: ``w``, a positive int.
    """

    def __init__(self, size: int) -> None:
        checked = check_window(size)
        assert checked is not None
        self.size = checked

    def visible(self, tile: Tile) -> Array | None:
        w, first = self.size, tile.first_position()
        if (first is not None and isinstance(tile.kn, int) and isinstance(tile.qn, int)
                and tile.k0 > first + tile.qn - 1 - w and tile.k0 + tile.kn - 1 < first + w):
            return None  # the tile lies inside every query's window
        d = tile.distances()
        return of_valid_keys(tile, tile.ops.logical_and(d > -w, d < w))

    def span(self, call: Call, q0: Any, qn: int) -> Span | None:
        K, w, ops = call.shape[3], self.size, call.ops
        if not isinstance(K, int) or call.per_example:
            return None
        lowest = q0 + call.offset - (w - 1)  # the block's first query's first key
        if isinstance(lowest, int):
            end = min(K, lowest + qn + 2 * (w - 1))
            first = min(max(0, lowest), K - 1)
            return first, max(1, end - first)
        count = min(K, qn + 2 * (w - 1))
        first = ops.maximum(ops.astype(lowest, "int32"), 0)
        return -ops.maximum(-first, -(K - count)), count  # min(first, K - count)

    def local(self, call: Call) -> tuple[int, int] | None:
        """The window as ``(left, right)`` keys around query index ``i``, for a fused kernel.

        None with a run-time offset or positions per example, or when a side would be negative.
        """
        if not isinstance(call.offset, int):
            return None
        left, right = self.size - 1 - call.offset, self.size - 1 + call.offset
        return (left, right) if left >= 0 and right >= 0 else None
