"""An independent float64 implementation, written from the formulas with explicit loops.

Nothing here imports attention_core: it exists to check the core and the reference files
against a second, deliberately plain computation (math.exp per element, masks decided one
(query, key) pair at a time, heads taken by column slices).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def query_positions(Q: int, K: int, offset: int | None = None) -> list[int]:
    """p_i = i + offset for each query i; offset None means K - Q (aligned at the end)."""
    start = K - Q if offset is None else int(offset)
    return [i + start for i in range(Q)]


def visible(B: int, H: int, Q: int, K: int, valid_lens: Any = None, mask: Any = None,
            causal: bool = False, *, window: int | None = None,
            offset: int | None = None) -> np.ndarray:
    """visible[b, h, i, j]: may query i of example b (head h) attend to key j?

    Query i stands at p_i (``query_positions``), key j at j: causal asks j <= p_i, a window w
    asks |p_i - j| < w; every rule given must hold.
    """
    if window is not None and (int(window) != window or window < 1):
        raise ValueError(f"window must be an int >= 1, got {window!r}")
    out = np.ones((B, H, Q, K), dtype=bool)
    lens = None if valid_lens is None else np.asarray(valid_lens)
    m = None if mask is None else np.asarray(mask)
    pos = query_positions(Q, K, offset)
    for b in range(B):
        for h in range(H):
            for i in range(Q):
                for j in range(K):
                    ok = True
                    if lens is not None:
                        limit = lens[b] if lens.ndim == 1 else lens[b, i]
                        ok = ok and j < limit
                    if m is not None:
                        if m.ndim == 2:
                            ok = ok and bool(m[i, j])
                        elif m.ndim == 3:
                            ok = ok and bool(m[b, i, j])
                        else:
                            ok = ok and bool(m[b, h if m.shape[1] > 1 else 0, i, j])
                    if causal:
                        ok = ok and j <= pos[i]
                    if window is not None:
                        ok = ok and abs(pos[i] - j) < window
                    out[b, h, i, j] = ok
    return out


def softmax_row(scores: np.ndarray, vis: np.ndarray) -> np.ndarray:
    """Softmax over the visible entries of one row; all zeros if none is visible.

    A visible score of -inf gets weight 0; a row whose visible scores are all -inf is all zeros.
    """
    idx = [j for j in range(len(scores)) if vis[j] and scores[j] != -math.inf]
    out = np.zeros(len(scores))
    if not idx:
        return out
    top = max(scores[j] for j in idx)
    exps = {j: math.exp(scores[j] - top) for j in idx}
    total = sum(exps.values())
    for j in idx:
        out[j] = exps[j] / total
    return out


def alibi_slopes(H: int) -> list[float]:
    """ALiBi slopes (Press et al.): n = largest power of 2 <= H, head h < n gets
    2^(-8(h+1)/n); the other H - n heads take every other slope of 2n heads, from the first."""
    if H < 1:
        raise ValueError(f"H must be >= 1, got {H}")
    n = 1
    while n * 2 <= H:
        n *= 2
    slopes = [2 ** (-8 * (h + 1) / n) for h in range(n)]
    doubled = [2 ** (-8 * (t + 1) / (2 * n)) for t in range(2 * n)]
    for m in range(H - n):
        slopes.append(doubled[2 * m])
    return slopes


def alibi_bias(B: int, H: int, Q: int, K: int, offset: int | None = None) -> np.ndarray:
    """bias[b, h, i, j] = -slope[h] * |p_i - j|."""
    slopes = alibi_slopes(H)
    pos = query_positions(Q, K, offset)
    out = np.zeros((B, H, Q, K))
    for b in range(B):
        for h in range(H):
            for i in range(Q):
                for j in range(K):
                    out[b, h, i, j] = -slopes[h] * abs(pos[i] - j)
    return out


def full_bias(bias: Any, B: int, H: int, Q: int, K: int) -> np.ndarray:
    """A (Q, K), (B, Q, K) or (B, H, Q, K) bias spread to (B, H, Q, K); size-1 axes repeat."""
    x = np.asarray(bias, dtype=np.float64)
    if x.ndim == 2:
        x = x[None, None]
    elif x.ndim == 3:
        x = x[:, None]
    elif x.ndim != 4:
        raise ValueError(f"score_bias must have rank 2, 3 or 4, got shape {x.shape}")
    for size, want in zip(x.shape, (B, H, Q, K), strict=True):
        if size not in (1, want):
            raise ValueError(f"score_bias of shape {np.shape(bias)} does not fit {(B, H, Q, K)}")
    out = np.zeros((B, H, Q, K))
    nb, nh, nq, nk = x.shape
    for b in range(B):
        for h in range(H):
            for i in range(Q):
                for j in range(K):
                    out[b, h, i, j] = x[0 if nb == 1 else b, 0 if nh == 1 else h,
                                        0 if nq == 1 else i, 0 if nk == 1 else j]
    return out


def rotary(x: np.ndarray, positions: Any, base: float = 10000.0) -> np.ndarray:
    """Rotate-half rotary embedding of x (..., T, d) at positions (length T): with
    theta_t = p * base^(-2t/d), the pair (x[t], x[t + d/2]) turns by theta_t."""
    T, d = x.shape[-2], x.shape[-1]
    if d % 2:
        raise ValueError(f"rotary needs an even depth, got {d}")
    if len(positions) != T:
        raise ValueError(f"{len(positions)} positions for {T} rows")
    half = d // 2
    out = np.zeros(x.shape)
    for lead in np.ndindex(*x.shape[:-2]):
        src, dst = x[lead], out[lead]  # (T, d) views
        for r in range(T):
            p = float(positions[r])
            for t in range(half):
                theta = p * float(base) ** (-2 * t / d)
                c, s = math.cos(theta), math.sin(theta)
                dst[r, t] = src[r, t] * c - src[r, t + half] * s
                dst[r, t + half] = src[r, t + half] * c + src[r, t] * s
    return out


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, vis: np.ndarray, score: Any, *,
              softcap: float | None = None,
              bias: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """Generic pooling: q (B, H, Q, .), k (B, Hkv, K, .), v (B, Hkv, K, Dv), score(qi, kj).

    Query head h uses key/value head h // (H // Hkv). Each score is capped (c tanh(s / c)) when
    ``softcap`` is given, then ``bias`` is added: a (B, H, Q, K) array, or a list of them added
    one after another.
    """
    B, H, Q = q.shape[:3]
    Hkv, K = k.shape[1], k.shape[2]
    if Hkv < 1 or H % Hkv or v.shape[1] != Hkv:
        raise ValueError(f"{H} query heads cannot share {Hkv} key / {v.shape[1]} value heads")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0, got {softcap!r}")
    group = H // Hkv
    biases = [] if bias is None else list(bias) if isinstance(bias, (list, tuple)) else [bias]
    weights = np.zeros((B, H, Q, K))
    out = np.zeros((B, H, Q, v.shape[-1]))
    for b in range(B):
        for h in range(H):
            g = h // group
            for i in range(Q):
                s = np.zeros(K)
                for j in range(K):
                    e = float(score(q[b, h, i], k[b, g, j]))
                    if softcap is not None:
                        e = softcap * math.tanh(e / softcap)
                    for extra in biases:
                        e = e + float(extra[b, h, i, j])
                    s[j] = e
                weights[b, h, i] = softmax_row(s, vis[b, h, i])
                for j in range(K):
                    out[b, h, i] += weights[b, h, i, j] * v[b, g, j]
    return out, weights


def dot_product(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, vis: np.ndarray, *,
    positional: str | None = None, rotary_base: float = 10000.0, softcap: float | None = None,
    score_bias: Any = None, offset: int | None = None, bias: Any = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Scaled dot-product attention on rank-4 inputs (k, v may have fewer heads than q).

    positional "rotary" rotates q (at p_i) and k (at j) along d; "alibi" adds -slope[h]|p_i - j|.
    Score order: q.k / sqrt(d), softcap, + ALiBi, + score_bias (broadcast), + bias (full).
    """
    if positional not in (None, "rotary", "alibi"):
        raise ValueError(f"unknown positional {positional!r}")
    B, H, Q, d = q.shape
    K = k.shape[2]
    if positional == "rotary":
        q = rotary(q, query_positions(Q, K, offset), rotary_base)
        k = rotary(k, list(range(K)), rotary_base)
    biases = []
    if positional == "alibi":
        biases.append(alibi_bias(B, H, Q, K, offset))
    if score_bias is not None:
        biases.append(full_bias(score_bias, B, H, Q, K))
    if bias is not None:
        biases.append(bias)
    return attention(q, k, v, vis, lambda a, b: float(np.dot(a, b)) / math.sqrt(d),
                     softcap=softcap, bias=biases or None)


def linear(x: np.ndarray, w: dict[str, np.ndarray], name: str) -> np.ndarray:
    y = x @ w[f"{name}.kernel"]
    return y + w[f"{name}.bias"] if f"{name}.bias" in w else y


def multi_head(queries: np.ndarray, keys: np.ndarray, values: np.ndarray, w: dict[str, np.ndarray],
               H: int, vis: np.ndarray, *, num_kv_heads: int | None = None,
               positional: str | None = None, rotary_base: float = 10000.0,
               softcap: float | None = None, score_bias: Any = None,
               offset: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Multi-head attention; head i takes columns i*d:(i+1)*d, d = h/H (h: W_q's columns).

    W_k and W_v have num_kv_heads * d columns; query head i uses key/value head
    i // (H // num_kv_heads). The window, like every mask, is in ``vis``.
    """
    q, k, v = linear(queries, w, "W_q"), linear(keys, w, "W_k"), linear(values, w, "W_v")
    Hkv = H if num_kv_heads is None else num_kv_heads
    if Hkv < 1 or H % Hkv:
        raise ValueError(f"num_kv_heads={Hkv} must divide num_heads={H}")
    h = q.shape[-1]
    size = h // H
    if k.shape[-1] != Hkv * size or v.shape[-1] != Hkv * size:
        raise ValueError(f"W_k/W_v give {k.shape[-1]}/{v.shape[-1]} columns, want {Hkv * size}")

    def heads(x: np.ndarray, n: int) -> np.ndarray:
        return np.stack([x[:, :, i * size:(i + 1) * size] for i in range(n)], axis=1)

    out, weights = dot_product(heads(q, H), heads(k, Hkv), heads(v, Hkv), vis,
                               positional=positional, rotary_base=rotary_base, softcap=softcap,
                               score_bias=score_bias, offset=offset)
    concat = np.concatenate([out[:, i] for i in range(H)], axis=-1)
    return linear(concat, w, "W_o"), weights


def additive(queries: np.ndarray, keys: np.ndarray, values: np.ndarray, w: dict[str, np.ndarray],
             vis: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Bahdanau attention: score(q, k) = w_v . tanh(W_q^T q + W_k^T k)."""
    wq, wk, wv = w["W_q.kernel"], w["W_k.kernel"], w["w_v.kernel"][:, 0]

    def score(qi: np.ndarray, kj: np.ndarray) -> float:
        return float(sum(wv[n] * math.tanh(float(qi @ wq[:, n] + kj @ wk[:, n]))
                         for n in range(len(wv))))

    out, weights = attention(queries[:, None], keys[:, None], values[:, None], vis, score)
    return out[:, 0], weights


def layer_norm(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    out = np.empty_like(x)
    for idx in np.ndindex(*x.shape[:-1]):
        row = x[idx]
        mean = sum(row) / len(row)
        var = sum((r - mean) ** 2 for r in row) / len(row)
        out[idx] = [(r - mean) / math.sqrt(var + eps) for r in row]
    return out * gamma + beta


def ffn(x: np.ndarray, w: dict[str, np.ndarray]) -> np.ndarray:
    return linear(np.maximum(linear(x, w, "dense1"), 0.0), w, "dense2")


def add_norm(x: np.ndarray, y: np.ndarray, w: dict[str, np.ndarray]) -> np.ndarray:
    return layer_norm(x + y, w["ln.gamma"], w["ln.beta"])


def sub(w: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    return {k[len(prefix) + 1:]: v for k, v in w.items() if k.startswith(prefix + ".")}


def encoder_block(x: np.ndarray, w: dict[str, np.ndarray], H: int,
                  vis: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    att, weights = multi_head(x, x, x, sub(w, "attention"), H, vis)
    y = add_norm(x, att, sub(w, "addnorm1"))
    return add_norm(y, ffn(y, sub(w, "ffn")), sub(w, "addnorm2")), weights


def pe_table(max_len: int, d: int) -> np.ndarray:
    """P[i, 2j] = sin(i / 10000^(2j/d)), P[i, 2j+1] = cos(i / 10000^(2j/d))."""
    P = np.zeros((max_len, d))
    for i in range(max_len):
        for col in range(d):
            j = col // 2
            angle = i / 10000 ** (2 * j / d)
            P[i, col] = math.sin(angle) if col % 2 == 0 else math.cos(angle)
    return P


def nadaraya_watson(queries: np.ndarray, keys: np.ndarray, values: np.ndarray,
                    w: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """f(x) = sum_i softmax_i(-((x - x_i) w)^2 / 2) y_i, for (B, Q) or (Q,) inputs."""
    q2, k2, v2 = (np.atleast_2d(a) for a in (queries, keys, values))
    out = np.zeros(q2.shape)
    weights = np.zeros((q2.shape[0], 1, q2.shape[1], k2.shape[1]))
    for b in range(q2.shape[0]):
        for i in range(q2.shape[1]):
            s = np.array([-((q2[b, i] - x) * w) ** 2 / 2 for x in k2[b]])
            weights[b, 0, i] = softmax_row(s, np.ones(len(s), bool))
            out[b, i] = float(weights[b, 0, i] @ v2[b])
    return (out if queries.ndim == 2 else out[0]), weights


def relative_multi_head(queries: np.ndarray, keys: np.ndarray, values: np.ndarray,
                        w: dict[str, np.ndarray], H: int,
                        vis: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Shaw et al. (2018): e_ij = q_i.(k_j + aK[clip(j - i)]) / sqrt(d), o_i = sum_j w_ij (v_j +
    aV[clip(j - i)]), query i at position i + K - Q; one pair (i, j) at a time."""
    q, k, v = linear(queries, w, "W_q"), linear(keys, w, "W_k"), linear(values, w, "W_v")
    table_k, table_v = w["rel_k.embedding"], w.get("rel_v.embedding")
    m = (len(table_k) - 1) // 2
    B, Q, h = q.shape
    K = k.shape[1]
    d = h // H
    weights = np.zeros((B, H, Q, K))
    out = np.zeros((B, Q, h))
    for b in range(B):
        for head in range(H):
            cols = slice(head * d, (head + 1) * d)
            for i in range(Q):
                r = [min(max(j - (i + K - Q), -m), m) + m for j in range(K)]
                s = np.array([float(q[b, i, cols] @ (k[b, j, cols] + table_k[r[j]])) / math.sqrt(d)
                              for j in range(K)])
                weights[b, head, i] = softmax_row(s, vis[b, head, i])
                for j in range(K):
                    vec = v[b, j, cols] + (table_v[r[j]] if table_v is not None else 0.0)
                    out[b, i, cols] += weights[b, head, i, j] * vec
    return linear(out, w, "W_o"), weights


def embedded(tokens: np.ndarray, table: np.ndarray, absolute: bool = True) -> np.ndarray:
    """Embedding row per token times sqrt(h), plus the sinusoidal table's row (if ``absolute``)."""
    B, T = tokens.shape
    h = table.shape[1]
    P = pe_table(T, h) if absolute else np.zeros((T, h))
    return np.array([[table[tokens[b, t]] * math.sqrt(h) + P[t] for t in range(T)]
                     for b in range(B)])


def transformer_encoder(tokens: np.ndarray, w: dict[str, np.ndarray], H: int,
                        vis: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """Embedding row per token times sqrt(h), plus the sinusoidal table, then each block."""
    x = embedded(tokens, w["token.embedding"])
    blocks = sorted({int(name.split(".")[1]) for name in w if name.startswith("blks.")})
    all_weights = []
    for i in blocks:
        x, weights = encoder_block(x, sub(w, f"blks.{i}"), H, vis)
        all_weights.append(weights)
    return x, all_weights


def encoder_of(layer: Any, tokens: np.ndarray) -> np.ndarray:
    """A ``TransformerEncoder`` layer's output on ``tokens``, nothing masked, in float64 from
    its canonical weights."""
    w = {name: np.asarray(x, np.float64) for name, x in layer.get_weights().items()}
    B, T = tokens.shape
    return transformer_encoder(tokens, w, layer.num_heads, np.ones((B, layer.num_heads, T, T), bool))[0]


def decoder_block(x: np.ndarray, w: dict[str, np.ndarray], H: int, self_vis: np.ndarray,
                  enc: np.ndarray | None = None, cross_vis: np.ndarray | None = None,
                  attention: dict[str, Any] | None = None
                  ) -> tuple[np.ndarray, list[np.ndarray]]:
    """Causal self-attention (``self_vis`` already holds the causal rule and any window; its
    other options, ``multi_head``'s keywords, in ``attention``), then cross-attention over
    ``enc`` when given, then the FFN, each followed by its add & norm."""
    att, self_weights = multi_head(x, x, x, sub(w, "self_attention"), H, self_vis,
                                   **(attention or {}))
    y = add_norm(x, att, sub(w, "addnorm1"))
    kept, last = [self_weights], "addnorm2"
    if enc is not None:
        assert cross_vis is not None
        att, cross_weights = multi_head(y, enc, enc, sub(w, "cross_attention"), H, cross_vis)
        y, last = add_norm(y, att, sub(w, "addnorm2")), "addnorm3"
        kept.append(cross_weights)
    return add_norm(y, ffn(y, sub(w, "ffn")), sub(w, last)), kept


def transformer_decoder(tokens: np.ndarray, w: dict[str, np.ndarray], H: int,
                        self_vis: np.ndarray, enc: np.ndarray | None = None,
                        cross_vis: np.ndarray | None = None,
                        attention: dict[str, Any] | None = None
                        ) -> tuple[np.ndarray, list[list[np.ndarray]]]:
    """Embedding times sqrt(h) plus the sinusoidal table (none when the self-attention has
    rotary or ALiBi positions), the blocks, then ``dense``."""
    attention = attention or {}
    x = embedded(tokens, w["token.embedding"], attention.get("positional") is None)
    blocks = sorted({int(name.split(".")[1]) for name in w if name.startswith("blks.")})
    kept: list[list[np.ndarray]] = [[], []] if enc is not None else [[]]
    for i in blocks:
        x, formed = decoder_block(x, sub(w, f"blks.{i}"), H, self_vis, enc, cross_vis, attention)
        for per_kind, weights in zip(kept, formed, strict=True):
            per_kind.append(weights)
    return linear(x, w, "dense"), kept
