"""Composable mask and score modifiers: each way of masking or changing the scores, one module.

A call's keywords build modifiers (``valid_lens`` -> :func:`lengths`, ``causal`` ->
:func:`causal`, ...); a user may pass their own as ``mask_mod=`` and ``score_mod=``: a plain
function ``mask_mod(b, h, q_idx, kv_idx) -> bool`` or ``score_mod(score, b, h, q_idx, kv_idx)
-> score`` over index arrays of the active backend (``b`` ``(B, 1, 1, 1)``, ``h``
``(1, H, 1, 1)``, ``q_idx`` ``(1, 1, Q, 1)``, ``kv_idx`` ``(1, 1, 1, K)``, int32; with positions
per example, the positions ``(B, 1, Q, 1)`` and ``(B, 1, 1, K)``), or these objects, or lists
of either (masks ANDed, scores composed in order). Masks always win: a hidden key weighs exactly
0 whatever a score modifier makes of its score.

Example:
    ``dot_product_attention(q, k, v, mask_mod=lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)``
"""

from __future__ import annotations

from typing import Any

from attention_core.modifiers.alibi import Alibi
from attention_core.modifiers.base import (
    AllMasks,
    AnyMask,
    Call,
    Composed,
    MaskFunction,
    MaskMod,
    ScoreFunction,
    ScoreMod,
    Tile,
    as_mask_mod,
    as_score_mod,
)
from attention_core.modifiers.bias import ScoreBias
from attention_core.modifiers.boolean import BooleanMask
from attention_core.modifiers.causal import Causal
from attention_core.modifiers.lengths import Lengths
from attention_core.modifiers.prefix import PrefixLM
from attention_core.modifiers.segments import Segments
from attention_core.modifiers.softcap import Softcap
from attention_core.modifiers.window import Window

__all__ = [
    "Alibi", "AllMasks", "AnyMask", "BooleanMask", "Call", "Causal", "Composed", "Lengths",
    "MaskFunction", "MaskMod", "PrefixLM", "ScoreBias", "ScoreFunction", "ScoreMod", "Segments",
    "Softcap", "Tile", "Window", "alibi", "and_masks", "as_mask_mod", "as_score_mod", "boolean",
    "causal", "compose", "lengths", "or_masks", "prefix_lm", "score_bias", "segments", "softcap",
    "window",
]


def causal() -> MaskMod:
    """Query ``i`` sees keys ``j <= p_i``."""
    return Causal()


def window(size: int) -> MaskMod:
    """Query ``i`` sees keys ``j`` with ``|p_i - j| < size``."""
    return Window(size)


def lengths(valid_lens: Any) -> MaskMod:
    """Key ``j`` is visible when ``j < valid_lens[b]`` (``(B,)``) or ``valid_lens[b, i]`` (``(B, Q)``)."""
    return Lengths(valid_lens)


def boolean(mask: Any) -> MaskMod:
    """An explicit boolean mask, True = may attend."""
    return BooleanMask(mask)


def segments(segment_ids: Any) -> MaskMod:
    """Packed sequences: a query sees only the keys of its own segment."""
    return Segments(segment_ids)


def prefix_lm(prefix_lens: Any) -> MaskMod:
    """Key ``j`` is visible when ``j < prefix_lens[b]`` or ``j <= p_i``."""
    return PrefixLM(prefix_lens)


def softcap(cap: float) -> ScoreMod:
    """Scores become ``cap * tanh(s / cap)``."""
    return Softcap(cap)


def alibi() -> ScoreMod:
    """ALiBi biases ``-slope_h * |p_i - j|``."""
    return Alibi()


def score_bias(bias: Any) -> ScoreMod:
    """Adds ``bias`` (broadcastable to ``(B, H, Q, K)``) to the scores."""
    return ScoreBias(bias)


def and_masks(*mods: Any) -> MaskMod:
    """Keys visible to every one of the mask modifiers (callables or modifiers)."""
    return AllMasks([m for m in (as_mask_mod(x) for x in mods) if m is not None])


def or_masks(*mods: Any) -> MaskMod:
    """Keys visible to any of the mask modifiers (callables or modifiers)."""
    return AnyMask([m for m in (as_mask_mod(x) for x in mods) if m is not None])


def compose(*mods: Any) -> ScoreMod:
    """The score modifiers applied in order (callables or modifiers)."""
    return Composed([m for m in (as_score_mod(x) for x in mods) if m is not None])
