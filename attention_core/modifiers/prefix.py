"""Prefix-LM: the first ``prefix_lens[b]`` keys are visible to every query, the rest causally.

A prefix (the prompt) attends both ways; the continuation attends causally, as in T5's
prefix-LM and PaliGemma: query ``i`` sees key ``j`` when ``j < prefix_lens[b]`` or ``j <= p_i``.
"""

from __future__ import annotations

from typing import Any

from attention_core.masks import lens_column
from attention_core.modifiers.base import Call, MaskMod, Span, Tile, refuse_per_example
from attention_core.ops import Array


class PrefixLM(MaskMod):
    """Bidirectional over each example's prefix, causal after it.

    Args:
        prefix_lens: Integer lengths ``(B,)`` of any framework.
    """

    def __init__(self, prefix_lens: Any) -> None:
        self.lens = prefix_lens
        self.longest: int | None = None

    def bind(self, call: Call) -> PrefixLM:
        refuse_per_example(call, "prefix_lens")
        bound = PrefixLM(None)
        B, H, _, K = call.shape
        bound.lens, bounds = lens_column(call.ops, self.lens, (B, H, 1, K), name="prefix_lens")
        bound.longest = None if bounds is None else bounds[1]
        return bound

    def visible(self, tile: Tile) -> Array:
        inside = tile.key_index() < self.lens
        return tile.ops.where(inside, inside, tile.distances() <= 0)  # inside or causal

    def span(self, call: Call, q0: Any, qn: int) -> Span | None:
        K = call.shape[3]
        if self.longest is None or not (isinstance(q0, int) and isinstance(call.offset, int)
                                        and isinstance(K, int)):
            return None
        return 0, max(1, min(K, max(self.longest, q0 + qn + call.offset)))
