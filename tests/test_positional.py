"""The sinusoidal table and its rotation property, against the formula written out."""

from __future__ import annotations

import math

import numpy as np
import pytest

import attention_core as ac
from tests import naive
from tests.harness import TOLERANCE, Harness, max_diff


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
