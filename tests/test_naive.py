"""tests/naive.py's attention options checked against hand-derivable facts (never attention_core)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from conftest import test_backends
from tests import naive

pytestmark = pytest.mark.skipif(
    "numpy" not in test_backends(), reason="the naive code is checked in the numpy env"
)

RNG = np.random.default_rng(7)


def mha_weights(h: int, kv_cols: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"W_q.kernel": rng.normal(size=(h, h)), "W_k.kernel": rng.normal(size=(h, kv_cols)),
            "W_v.kernel": rng.normal(size=(h, kv_cols)), "W_o.kernel": rng.normal(size=(h, h)),
            "W_o.bias": rng.normal(size=h)}


def inputs(B: int, Q: int, K: int, h: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return RNG.normal(size=(B, Q, h)), RNG.normal(size=(B, K, h)), RNG.normal(size=(B, K, h))


def close(a: Any, b: Any, tol: float = 1e-12) -> bool:
    return bool(np.max(np.abs(np.asarray(a) - np.asarray(b)), initial=0.0) <= tol)


# --- positions and masks ---------------------------------------------------------------------

def test_window_and_offset_in_visible() -> None:
    vis = naive.visible(1, 1, 4, 4, window=2)[0, 0]
    assert np.array_equal(vis, np.abs(np.arange(4)[:, None] - np.arange(4)) < 2)
    causal = naive.visible(1, 1, 4, 4, causal=True, window=2)[0, 0]
    assert np.array_equal(causal, np.tril(np.ones((4, 4), bool)) & ~np.tril(np.ones((4, 4), bool), -2))
    # One query at the end of 6 keys: position 5; with offset=2 it stands at 2.
    assert np.array_equal(naive.visible(1, 1, 1, 6, causal=True)[0, 0, 0], [True] * 6)
    assert np.array_equal(naive.visible(1, 1, 1, 6, causal=True, offset=2)[0, 0, 0],
                          [True, True, True, False, False, False])
    assert np.array_equal(naive.visible(1, 1, 1, 6, window=2, offset=2)[0, 0, 0],
                          [False, True, True, True, False, False])
    # The window is ANDed with valid_lens.
    assert np.array_equal(naive.visible(1, 1, 1, 6, [3], window=3)[0, 0, 0],
                          [False, False, False, False, False, False])
    with pytest.raises(ValueError):
        naive.visible(1, 1, 2, 2, window=0)


def test_window_at_least_K_changes_nothing() -> None:
    q, k, v = inputs(2, 3, 5, 8)
    w = mha_weights(8, 8, RNG)
    for causal in (False, True):
        plain = naive.multi_head(q, k, v, w, 2, naive.visible(2, 2, 3, 5, [5, 3], causal=causal))
        wide = naive.multi_head(q, k, v, w, 2, naive.visible(2, 2, 3, 5, [5, 3], causal=causal,
                                                              window=5))
        assert close(plain[0], wide[0], 0.0) and close(plain[1], wide[1], 0.0)


def test_window_one_attends_to_the_diagonal_only() -> None:
    q, k, v = (RNG.normal(size=(1, 1, 4, 3)) for _ in range(3))
    out, weights = naive.dot_product(q, k, v, naive.visible(1, 1, 4, 4, window=1))
    assert np.array_equal(weights[0, 0], np.eye(4)) and close(out, v, 0.0)


# --- softmax with -inf and score_bias --------------------------------------------------------

def test_softmax_row_with_minus_infinity() -> None:
    inf = math.inf
    row = naive.softmax_row(np.array([0.0, -inf, 0.0, 5.0]), np.array([True, True, True, False]))
    assert list(row) == [0.5, 0.0, 0.5, 0.0]
    nothing = naive.softmax_row(np.array([-inf, -inf, 3.0]), np.array([True, True, False]))
    assert list(nothing) == [0.0, 0.0, 0.0] and not np.isnan(nothing).any()


def test_minus_infinity_bias_equals_masking() -> None:
    B, H, Q, K = 2, 2, 3, 5
    q, k, v = inputs(B, Q, K, 8)
    w = mha_weights(8, 8, RNG)
    hide = np.zeros((B, Q, K), bool)
    hide[0, :, 1] = hide[1, 2, :] = True  # a key of example 0; a whole row of example 1
    bias = np.where(hide, -math.inf, 0.0)
    masked = naive.multi_head(q, k, v, w, H, naive.visible(B, H, Q, K, mask=~hide))
    biased = naive.multi_head(q, k, v, w, H, naive.visible(B, H, Q, K), score_bias=bias)
    assert close(masked[0], biased[0], 0.0) and close(masked[1], biased[1], 0.0)
    assert np.all(biased[1][1, :, 2] == 0.0)


def test_score_bias_shapes_broadcast() -> None:
    B, H, Q, K = 2, 3, 2, 4
    q, k, v = (RNG.normal(size=(B, H, n, 4)) for n in (Q, K, K))
    vis = naive.visible(B, H, Q, K)
    qk = RNG.normal(size=(Q, K))
    want = naive.dot_product(q, k, v, vis, bias=np.broadcast_to(qk, (B, H, Q, K)))
    for shaped in (qk, np.broadcast_to(qk, (B, Q, K)), qk[None, None], np.broadcast_to(qk, (1, H, Q, K))):
        got = naive.dot_product(q, k, v, vis, score_bias=shaped)
        assert close(got[0], want[0], 0.0) and close(got[1], want[1], 0.0)
    with pytest.raises(ValueError):
        naive.dot_product(q, k, v, vis, score_bias=np.zeros((B, 2, Q, K)))


def test_score_bias_shifts_the_logits() -> None:
    # q = 0: every score is 0, so the weights are softmax(bias) of each row.
    q, k, v = np.zeros((1, 1, 1, 2)), RNG.normal(size=(1, 1, 3, 2)), RNG.normal(size=(1, 1, 3, 2))
    bias = np.array([[0.0, math.log(2.0), math.log(5.0)]])
    _, weights = naive.dot_product(q, k, v, naive.visible(1, 1, 1, 3), score_bias=bias)
    assert close(weights[0, 0, 0], [1 / 8, 2 / 8, 5 / 8], 1e-15)


# --- softcap ----------------------------------------------------------------------------------

def test_huge_softcap_changes_nothing() -> None:
    q, k, v = inputs(2, 3, 4, 6)
    w = mha_weights(6, 6, RNG)
    vis = naive.visible(2, 3, 3, 4, [4, 2], causal=True)
    plain = naive.multi_head(q, k, v, w, 3, vis)
    capped = naive.multi_head(q, k, v, w, 3, vis, softcap=1e9)
    assert close(plain[0], capped[0], 1e-9) and close(plain[1], capped[1], 1e-9)


def test_softcap_bounds_the_scores() -> None:
    # Scores lie in [-c, c], so two weights of a row differ by a factor of at most exp(2c)
    # (reached: large scores saturate tanh to exactly +-1 in float64).
    q, k, v = (10 * RNG.normal(size=(1, 2, 3, 4)) for _ in range(3))
    c = 0.5
    _, weights = naive.dot_product(q, k, v, naive.visible(1, 2, 3, 3), softcap=c)
    ratios = np.max(weights, axis=-1) / np.min(weights, axis=-1)
    assert np.all(ratios <= math.exp(2 * c) * (1 + 1e-12))
    # One query, one key with q.k / sqrt(d) = 3: its capped score is c tanh(3 / c); hand check
    # through a second key with score 0.
    q1 = np.array([[[[3.0, 0.0, 0.0, 0.0]]]]) * 2  # sqrt(4) = 2
    k1 = np.array([[[[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]]]])
    _, w1 = naive.dot_product(q1, k1, np.zeros((1, 1, 2, 1)), naive.visible(1, 1, 1, 2), softcap=c)
    e = math.exp(c * math.tanh(3 / c))
    assert close(w1[0, 0, 0], [e / (e + 1), 1 / (e + 1)], 1e-15)


# --- ALiBi ------------------------------------------------------------------------------------

def test_alibi_slopes() -> None:
    assert naive.alibi_slopes(8) == [2.0 ** -n for n in range(1, 9)]
    assert naive.alibi_slopes(6) == [2 ** -(8 * 1 / 4), 2 ** -(8 * 2 / 4), 2 ** -(8 * 3 / 4),
                                     2 ** -(8 * 4 / 4), 2 ** -(8 * 1 / 8), 2 ** -(8 * 3 / 8)]
    assert naive.alibi_slopes(1) == [2.0 ** -8]
    assert naive.alibi_slopes(2) == [2.0 ** -4, 2.0 ** -8]
    assert naive.alibi_slopes(3) == [2.0 ** -4, 2.0 ** -8, 2.0 ** -2]


def test_alibi_weights_by_distance() -> None:
    # q = 0: the weights are softmax(-slope |p - j|) with the query at position K - 1 = 3.
    q, k, v = np.zeros((1, 2, 1, 2)), RNG.normal(size=(1, 2, 4, 2)), RNG.normal(size=(1, 2, 4, 2))
    _, weights = naive.dot_product(q, k, v, naive.visible(1, 2, 1, 4), positional="alibi")
    for h, slope in enumerate(naive.alibi_slopes(2)):
        e = [math.exp(-slope * (3 - j)) for j in range(4)]
        assert close(weights[0, h, 0], [x / sum(e) for x in e], 1e-15)
    _, at0 = naive.dot_product(q, k, v, naive.visible(1, 2, 1, 4), positional="alibi", offset=0)
    e = [math.exp(-0.0625 * j) for j in range(4)]
    assert close(at0[0, 0, 0], [x / sum(e) for x in e], 1e-15)


def test_causal_alibi_equals_the_kerashub_form() -> None:
    B, H, T = 2, 4, 5
    x = RNG.normal(size=(B, T, 8))
    w = mha_weights(8, 8, RNG)
    vis = naive.visible(B, H, T, T, [5, 3], causal=True)
    slopes = naive.alibi_slopes(H)
    keras = np.array([[[slopes[h] * (j - (T - 1)) for j in range(T)] for _ in range(T)]
                      for h in range(H)])[None]
    ours = naive.multi_head(x, x, x, w, H, vis, positional="alibi")
    theirs = naive.multi_head(x, x, x, w, H, vis, score_bias=keras)
    assert close(ours[0], theirs[0]) and close(ours[1], theirs[1])


# --- rotary -----------------------------------------------------------------------------------

def test_rotary_at_position_zero_is_the_identity_and_keeps_pair_norms() -> None:
    x = RNG.normal(size=(2, 3, 4, 8))
    assert np.array_equal(naive.rotary(x, [0, 0, 0, 0]), x)
    y = naive.rotary(x, [0, 1, 7, 1000])
    for t in range(4):
        assert close(x[..., t] ** 2 + x[..., t + 4] ** 2, y[..., t] ** 2 + y[..., t + 4] ** 2)


def test_rotary_by_hand() -> None:
    # d = 2: theta = p; d = 4, t = 1: theta = p * base^(-1/2).
    x = np.array([[0.3, -1.2]])
    p = 2.5
    assert close(naive.rotary(x, [p]), [[0.3 * math.cos(p) + 1.2 * math.sin(p),
                                        -1.2 * math.cos(p) + 0.3 * math.sin(p)]], 1e-15)
    y = naive.rotary(np.array([[0.0, 1.0, 0.0, 0.0]]), [3], base=100.0)
    assert close(y, [[0.0, math.cos(0.3), 0.0, math.sin(0.3)]], 1e-15)


def test_rotary_dot_products_depend_on_the_distance_only() -> None:
    q, k = RNG.normal(size=(1, 16)), RNG.normal(size=(1, 16))
    for p, p2, shift in ((5, 2, 8), (0, 9, 31), (4, 4, 100)):
        near = float(naive.rotary(q, [p])[0] @ naive.rotary(k, [p2])[0])
        far = float(naive.rotary(q, [p + shift])[0] @ naive.rotary(k, [p2 + shift])[0])
        assert abs(near - far) <= 1e-12
    same = float(naive.rotary(q, [6])[0] @ naive.rotary(k, [6])[0])
    assert abs(same - float(q[0] @ k[0])) <= 1e-12


def test_rotary_in_dot_product_uses_the_query_positions() -> None:
    q, k, v = (RNG.normal(size=(1, 2, n, 4)) for n in (2, 3, 3))
    vis = naive.visible(1, 2, 2, 3)
    want = naive.dot_product(naive.rotary(q, [1, 2]), naive.rotary(k, [0, 1, 2]), v, vis)
    got = naive.dot_product(q, k, v, vis, positional="rotary")
    assert close(got[1], want[1], 0.0)
    moved = naive.dot_product(q, k, v, vis, positional="rotary", offset=0, rotary_base=50.0)
    want0 = naive.dot_product(naive.rotary(q, [0, 1], 50.0), naive.rotary(k, [0, 1, 2], 50.0), v, vis)
    assert close(moved[1], want0[1], 0.0)


# --- grouped-query attention ------------------------------------------------------------------

def test_gqa_with_as_many_kv_heads_is_plain_multi_head() -> None:
    q, k, v = inputs(2, 3, 4, 8)
    w = mha_weights(8, 8, RNG)
    vis = naive.visible(2, 4, 3, 4, [4, 2], causal=True)
    plain = naive.multi_head(q, k, v, w, 4, vis)
    gqa = naive.multi_head(q, k, v, w, 4, vis, num_kv_heads=4)
    assert close(plain[0], gqa[0], 0.0) and close(plain[1], gqa[1], 0.0)


@pytest.mark.parametrize(("H", "Hkv"), [(4, 2), (4, 1), (6, 3)])
@pytest.mark.parametrize("positional", [None, "rotary", "alibi"])
def test_gqa_equals_multi_head_with_repeated_kv_columns(H: int, Hkv: int, positional: str | None) -> None:
    d = 2
    q, k, v = inputs(2, 3, 4, H * d)
    w = mha_weights(H * d, Hkv * d, RNG)
    group = H // Hkv

    def repeat(m: np.ndarray) -> np.ndarray:
        return np.concatenate([m[:, (i // group) * d:(i // group + 1) * d] for i in range(H)], axis=1)

    full = {**w, "W_k.kernel": repeat(w["W_k.kernel"]), "W_v.kernel": repeat(w["W_v.kernel"])}
    vis = naive.visible(2, H, 3, 4, [4, 3], causal=True, window=3)
    kw: dict[str, Any] = {"positional": positional, "softcap": 2.0}
    gqa = naive.multi_head(q, k, v, w, H, vis, num_kv_heads=Hkv, **kw)
    rep = naive.multi_head(q, k, v, full, H, vis, **kw)
    assert close(gqa[0], rep[0], 0.0) and close(gqa[1], rep[1], 0.0)


def test_gqa_rejects_a_non_divisor() -> None:
    q, k, v = inputs(1, 2, 2, 6)
    with pytest.raises(ValueError):
        naive.multi_head(q, k, v, mha_weights(6, 4, RNG), 3, naive.visible(1, 3, 2, 2), num_kv_heads=2)
