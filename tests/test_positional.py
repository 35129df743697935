"""The sinusoidal table and its rotation property, against the formula written out."""

from __future__ import annotations

import math

import numpy as np
import pytest

import attention_core as ac
from tests import naive
from tests.harness import TOLERANCE, Harness, max_diff

#: These tests run on the columns too (conftest.py; tests.harness.COLUMNS).
COLUMN_TESTS = True


@pytest.mark.parametrize("width", [1, 2, 7, 32])
def test_table_matches_formula(width: int) -> None:
    P = ac.sinusoidal_encoding(50, width, "float64")
    assert P.shape == (50, width)
    np.testing.assert_allclose(P, naive.pe_table(50, width), atol=1e-12)


def test_table_worked_values() -> None:
    P = ac.sinusoidal_encoding(3, 4, "float64")
    np.testing.assert_allclose(P[2], [math.sin(2), math.cos(2), math.sin(0.02), math.cos(0.02)],
                               atol=1e-15)


def test_table_is_cast_from_float64() -> None:
    P32 = ac.sinusoidal_encoding(1000, 64)
    assert P32.dtype == np.float32
    np.testing.assert_array_equal(P32, ac.sinusoidal_encoding(1000, 64, "float64").astype(np.float32))


@pytest.mark.parametrize("delta", [1, 5, -3, 17])
def test_rotation_maps_row_i_to_row_i_plus_delta(delta: int) -> None:
    P = ac.sinusoidal_encoding(100, 16, "float64")
    R = ac.relative_rotation(delta, 16)
    for i in range(max(0, -delta), min(100, 100 - delta), 7):
        np.testing.assert_allclose(R @ P[i], P[i + delta], atol=1e-12)


def test_rotation_needs_even_width() -> None:
    with pytest.raises(ValueError, match=r"num_hiddens \(7\) must be even for the rotation"):
        ac.relative_rotation(1, 7)


def test_layer_exposes_P_and_adds_it(backend: str) -> None:
    h = Harness(backend)
    layer = h.make("PositionalEncoding", {"num_hiddens": 32, "dropout": 0.0})
    X = h.call(layer, h.array(np.zeros((1, 60, 32), np.float32)))
    P = h.numpy(layer.P)
    assert P.shape == (1, 1000, 32)
    assert max_diff(h.numpy(X), P[:, :60]) <= TOLERANCE["float32"]
    assert max_diff(P[0], naive.pe_table(1000, 32)) <= TOLERANCE["float32"]


def test_binary_counter_analogy() -> None:
    """Lower columns oscillate faster, like the low bits of 0..7."""
    P = ac.sinusoidal_encoding(60, 32, "float64")
    crossings = [(np.diff(np.sign(P[:, c])) != 0).sum() for c in (0, 2, 4, 6)]
    assert crossings == sorted(crossings, reverse=True) and crossings[0] > crossings[-1]


#: The positions of the exactness check: the ends of the range asked for (up to 65,536),
#: and beyond it.
FAR = (0, 1, 4095, 65530, 65535, 65536, 1_000_000)


def test_rotary_is_exact_far_out(backend: str) -> None:
    """Rotary embedding at positions up to 65,536 (and 10^6) in float32: the float64 formula
    rounded (``tests/naive.py``, one angle at a time in Python floats) within 2e-6, with the
    positions known now (host tables) and as a run-time array (the two-level tables, or
    MXNet's float64 angles), where ``p * theta`` formed in float32 would be off by 1e-3."""
    hb = Harness(backend)
    rng = np.random.default_rng(5)
    X = rng.standard_normal((1, len(FAR), 64))
    expected = naive.rotary(X[0], list(FAR), 10000.0)[None]
    known = ac.rotary_embedding(hb.array(X, "float32"), positions=np.array(FAR))
    assert max_diff(hb.numpy(known), expected) <= 2e-6
    run_time = ac.rotary_embedding(hb.array(X, "float32"),
                                   positions=hb.array(np.array(FAR, np.int32)))
    assert max_diff(hb.numpy(run_time), expected) <= 2e-6
    compiled = hb.hooks.compiled_function if hasattr(hb.hooks, "compiled_function") else None
    if compiled is not None:  # traced: the positions have no value when the program is made
        fn = compiled(lambda x, p: ac.rotary_embedding(x, positions=p))
        traced = fn(hb.array(X, "float32"), hb.array(np.array(FAR, np.int32)))
        assert max_diff(hb.numpy(traced), expected) <= 2e-6
    theta = ac.positional.rotary_frequencies(64, 1e4)
    in_float32 = np.array(FAR, np.float32)[:, None] * theta.astype(np.float32)
    off = np.cos(in_float32.astype(np.float64)) - np.cos(np.array(FAR)[:, None] * theta)
    assert np.abs(off).max() > 1e-4  # what the angles formed in float32 would give


def test_rotary_keeps_norms_and_relative_angles() -> None:
    """Each pair keeps its norm, and q(p) . k(p') depends only on p - p'."""
    rng = np.random.default_rng(6)
    q, k = rng.standard_normal((2, 1, 1, 16))
    rot = lambda x, p: ac.rotary_embedding(x, positions=np.array([p]))  # noqa: E731
    np.testing.assert_allclose(np.linalg.norm(rot(q, 1234)), np.linalg.norm(q), rtol=1e-12)
    dots = [float(np.sum(rot(q, p + 7) * rot(k, p))) for p in (0, 100, 60000)]
    np.testing.assert_allclose(dots, dots[0], rtol=1e-9)


def test_alibi_slopes_are_the_standard_ones() -> None:
    np.testing.assert_allclose(ac.alibi_slopes(8), [2.0 ** -(i + 1) for i in range(8)])
    expected_12 = [2.0 ** (-8 * (i + 1) / 8) for i in range(8)] + [
        2.0 ** (-8 * (2 * m + 1) / 16) for m in range(4)]
    np.testing.assert_allclose(ac.alibi_slopes(12), expected_12)
