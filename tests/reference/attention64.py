"""A float64 reference of dot-product attention with every modifier, written from the rules.

Nothing here imports attention_core: each (query, key) pair is decided and scored on its own,
in plain Python and NumPy, so that the open attention core (masks, score modifiers, sinks, the
log-sum-exp) is checked against a second computation. Peers confirm this reference in
tests/test_modifier_peers.py (FlexAttention, Hugging Face's gpt-oss attention).

Rules (query ``i`` of ``Q`` stands at position ``p_i = i + (K - Q)``, key ``j`` at ``j``):

* visible when every rule given holds: ``j < valid_lens[b]`` (or ``valid_lens[b, i]``),
  ``mask``, causal ``j <= p_i``, window ``|p_i - j| < window``, equal segment ids, prefix-LM
  ``j < prefix_lens[b] or j <= p_i``, and ``mask_fn(b, h, i, j)`` (``i`` the query's index);
* score: ``q . k * scale`` (``1 / sqrt(D)`` by default), then ``c tanh(s / c)``, then
  ``- slope_h |p_i - j|`` (ALiBi), then ``+ score_bias``, then ``score_fn(s, b, h, i, j)``;
* a hidden key weighs 0; a row's softmax denominator gains ``exp(sinks[h])``; a row with no
  visible key (and no sink) gives zeros and a log-sum-exp of ``-inf``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

MaskFn = Callable[[int, int, int, int], bool]
ScoreFn = Callable[[float, int, int, int, int], float]


def alibi_slopes(num_heads: int) -> list[float]:
    """The ALiBi slopes (Press et al.): for ``n``, the largest power of 2 <= H, head ``h < n``
    gets ``2^(-8 (h + 1) / n)``; head ``n + m`` gets ``2^(-8 (2m + 1) / (2n))`` (every other
    slope of 2n heads)."""
    n = 1
    while 2 * n <= num_heads:
        n *= 2
    first = [2.0 ** (-8.0 * (h + 1) / n) for h in range(n)]
    rest = [2.0 ** (-8.0 * (2 * m + 1) / (2 * n)) for m in range(num_heads - n)]
    return first + rest


def _entry(x: np.ndarray, b: int, h: int, i: int, j: int) -> Any:
    """``x[b, h, i, j]`` of an array broadcastable to (B, H, Q, K) (rank 2 to 4; size-1 axes
    repeat)."""
    if x.ndim == 2:  # (Q, K)
        full = x[None, None]
    elif x.ndim == 3:  # (B, Q, K): the head axis is the one left out
        full = x[:, None]
    else:
        full = x
    idx = [0 if full.shape[a] == 1 else n for a, n in enumerate((b, h, i, j))]
    return full[tuple(idx)]


def _segments(segment_ids: Any, b: int, i: int, j: int, position: int) -> bool:
    """Whether query ``i`` (at ``position``) and key ``j`` of example ``b`` share a segment."""
    if isinstance(segment_ids, (tuple, list)):
        query_ids, key_ids = (np.asarray(a) for a in segment_ids)
        return bool(query_ids[b, i] == key_ids[b, j])
    ids = np.asarray(segment_ids)
    if position < 0:
        raise ValueError(f"query {i} stands at position {position}: (B, K) segment ids give it none")
    return bool(ids[b, position] == ids[b, j])


def visible(b: int, h: int, i: int, j: int, position: int, *, valid_lens: Any, mask: Any,
            causal: bool, window: int | None, segment_ids: Any, prefix_lens: Any,
            mask_fn: MaskFn | None) -> bool:
    """Whether query ``i`` (at ``position``) of example ``b``, head ``h``, sees key ``j``."""
    if valid_lens is not None:
        lens = np.asarray(valid_lens)
        if j >= (lens[b] if lens.ndim == 1 else lens[b, i]):
            return False
    if mask is not None and not bool(_entry(np.asarray(mask), b, h, i, j)):
        return False
    if causal and j > position:
        return False
    if window is not None and abs(position - j) >= window:
        return False
    if segment_ids is not None and not _segments(segment_ids, b, i, j, position):
        return False
    if prefix_lens is not None and not (j < np.asarray(prefix_lens)[b] or j <= position):
        return False
    return mask_fn is None or bool(mask_fn(b, h, i, j))


def attention64(
    q: Any, k: Any, v: Any, *, valid_lens: Any = None, mask: Any = None, causal: bool = False,
    window: int | None = None, segment_ids: Any = None, prefix_lens: Any = None,
    mask_fn: MaskFn | None = None, score_fn: ScoreFn | None = None,
    softcap: float | None = None, alibi: bool = False, score_bias: Any = None,
    sinks: Any = None, scale: float | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Attention with every modifier, in float64, one (query, key) pair at a time.

    Args:
        q: ``(B, H, Q, D)`` or ``(B, Q, D)``.
        k: ``(B, Hkv, K, D)`` or ``(B, K, D)``; query head ``h`` uses head ``h // (H / Hkv)``.
        v: ``(B, Hkv, K, Dv)`` or ``(B, K, Dv)``.
        valid_lens, mask, causal, window, segment_ids, prefix_lens, mask_fn: the visibility
            rules of the module docstring (``segment_ids``: ``(B, K)``, or a pair ``(B, Q)``,
            ``(B, K)``); every rule given must hold.
        score_fn, softcap, alibi, score_bias, scale: the score terms, in the module's order.
        sinks: ``(H,)`` logits added to each row's softmax denominator (holding no value).

    Returns:
        ``(out, weights, lse)``: ``(B, H, Q, Dv)`` (``(B, Q, Dv)`` for rank-3 inputs),
        ``(B, H, Q, K)`` and ``(B, H, Q)``, float64.
    """
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    rank3 = q.ndim == 3
    if rank3:
        q, k, v = q[:, None], k[:, None], v[:, None]
    B, H, Q, D = q.shape
    Hkv, K = k.shape[1], k.shape[2]
    if H % Hkv or v.shape[1] != Hkv:
        raise ValueError(f"{H} query heads cannot share {Hkv} key / {v.shape[1]} value heads")
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    slopes = alibi_slopes(H)
    bias = None if score_bias is None else np.asarray(score_bias, np.float64)
    rules = {"valid_lens": valid_lens, "mask": mask, "causal": causal, "window": window,
             "segment_ids": segment_ids, "prefix_lens": prefix_lens, "mask_fn": mask_fn}
    out = np.zeros((B, H, Q, v.shape[-1]))
    weights = np.zeros((B, H, Q, K))
    lse = np.full((B, H, Q), -math.inf)
    for b in range(B):
        for h in range(H):
            g = h // (H // Hkv)
            for i in range(Q):
                p = i + K - Q
                scores: dict[int, float] = {}
                for j in range(K):
                    if not visible(b, h, i, j, p, **rules):
                        continue
                    s = float(np.dot(q[b, h, i], k[b, g, j])) * scale
                    if softcap is not None:
                        s = softcap * math.tanh(s / softcap)
                    if alibi:
                        s -= slopes[h] * abs(p - j)
                    if bias is not None:
                        s += float(_entry(bias, b, h, i, j))
                    if score_fn is not None:
                        s = float(score_fn(s, b, h, i, j))
                    if s != -math.inf:
                        scores[j] = s
                logits = list(scores.values())
                if sinks is not None:
                    logits.append(float(np.asarray(sinks, np.float64)[h]))
                if not logits:
                    continue
                top = max(logits)
                total = sum(math.exp(s - top) for s in logits)
                lse[b, h, i] = top + math.log(total)
                for j, s in scores.items():
                    weights[b, h, i, j] = math.exp(s - top) / total
                    out[b, h, i] += weights[b, h, i, j] * v[b, g, j]
    return (out[:, 0] if rank3 else out), weights, lse
