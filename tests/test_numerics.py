"""Numerics at the edges, on every backend, in every dtype it computes in and on every kernel.

The default policy (no host reads, nothing mended):

* Masked and fully masked rows in float16 and bfloat16 (and float32, float64): no NaN or inf,
  masked keys weigh exactly 0, rows with no visible key are exactly 0 (weights, and the
  attention output before any projection); the rest equals the float64 reference.
* Scores up to +-1.25e4: inputs built so that every product and partial sum of the scores is
  exact in every dtype, so the float64 reference of the same numbers is the exact answer; and
  random float64 inputs scaled to scores of 1e4.
* 65536 keys with one visible key per query: the output is that key's value, bit for bit.
* Infinite and NaN scores (user scores, ``score_bias``, ``score_mod``): a masked key weighs 0
  whatever its score, a visible ``-inf`` weighs 0, a row with nothing visible above ``-inf`` is
  zeros, a visible ``+inf`` or NaN makes its row NaN.
* float16 and bfloat16 are scored and pooled in float32: scores beyond float16's range equal
  the float64 answer on every kernel. Scores beyond float32's range never move weight onto a
  masked key on the core kernels.
* Gradients of dot-product attention with fully masked rows are finite, zero for those rows'
  queries, and equal the float64 formula (torch, TensorFlow, JAX, MXNet).

``check_numerics=True``: a NaN or inf in an input reaches exactly the rows that see it (the
fused kernels are passed over), and finite inputs keep their values and gradients.

The float64 reference is :func:`tests.strategies.attention`, computed from the inputs as rounded
to the tested dtype. On JAX every call runs under ``jax.jit`` (:func:`tests.strategies.run`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import attention_core as ac
from attention_core import kernels
from tests.harness import AUTODIFF, DTYPES, TOLERANCE, Harness, max_diff, tolerance
from tests.strategies import attention, run, visible

#: These tests run on the columns too (conftest.py; tests.harness.COLUMNS).
COLUMN_TESTS = True

#: The kernels these tests name, where the backend has them (``"fused"``: the framework's own).
KERNELS = ("direct", "blockwise", "fused")

#: The core kernels: the numeric policy of :mod:`attention_core.kernels.rows` is theirs.
CORE = ("direct", "blockwise")


def paths(h: Harness, dtype: str, names: tuple[str, ...] = KERNELS) -> list[str]:
    """The kernels of ``names`` the backend has for inputs of ``dtype`` (JAX's fused kernel
    takes no float16 on CPU)."""
    found = {e.name: e.capabilities for e in kernels.kernels(h.ops.name)}
    return [n for n in names if n in found and dtype in found[n].dtypes]


def _dpa(q: Any, k: Any, v: Any, lens: Any, mask: Any, **kw: Any) -> Any:
    return ac.dot_product_attention(q, k, v, lens, mask=mask, **kw)


def _softmax(scores: Any, mask: Any) -> Any:
    return ac.masked_softmax(scores, mask=mask)


def _call(h: Harness, path: str, q: Any, k: Any, v: Any, lens: Any = None, mask: Any = None,
          causal: bool = False, runner: Callable[..., Any] = run, **kw: Any,
          ) -> tuple[np.ndarray, np.ndarray | None]:
    """``(output, weights)`` as float64 NumPy; weights only on the direct path. ``path`` is a
    kernel's name or ``"auto"`` (the automatic choice); ``runner`` is
    :func:`tests.strategies.run` or one of :data:`TRACED`; ``kw`` are static keywords."""
    if path == "direct":
        out, w = runner(h, _dpa, q, k, v, lens, mask, causal=causal, return_weights=True,
                        implementation="direct", **kw)
        return h.numpy(out), h.numpy(w)
    if path != "auto":
        kw["implementation"] = path
    return h.numpy(runner(h, _dpa, q, k, v, lens, mask, causal=causal, **kw)), None


def _check_masked_rows(label: str, out: np.ndarray, w: np.ndarray | None, vis: np.ndarray,
                       expected: np.ndarray, expected_w: np.ndarray, tol: float,
                       sum_tol: float) -> list[str]:
    """What is wrong with one call's results (an empty list when nothing is): NaN or inf, a
    nonzero output of a row with no visible key, a nonzero weight of a masked key, visible
    weights whose sum is off 1 by more than ``sum_tol``, a difference from the reference above
    ``tol``."""
    problems = []
    seen = vis.any(-1)  # (B, H, Q)
    if not np.isfinite(out).all():
        problems.append(f"{label}: output has NaN or inf")
    elif not np.all(out[~seen] == 0.0):
        problems.append(f"{label}: a row with no visible key has a nonzero output")
    elif max_diff(out, expected) > tol:
        problems.append(f"{label}: output off the reference by {max_diff(out, expected):.3g}")
    if w is None:
        return problems
    if not np.isfinite(w).all():
        problems.append(f"{label}: weights have NaN or inf")
    elif not np.all(w[~vis] == 0.0):
        problems.append(f"{label}: a masked key has a nonzero weight")
    elif np.abs(w.sum(-1)[seen] - 1.0).max(initial=0.0) > sum_tol:
        problems.append(f"{label}: the weights of a row's visible keys do not sum to 1")
    elif max_diff(w, expected_w) > tol:
        problems.append(f"{label}: weights off the reference by {max_diff(w, expected_w):.3g}")
    return problems

# -- masked and fully masked rows in every dtype -----------------------------------------------

B, H, Q, K, D, DV = 2, 2, 5, 7, 8, 8  # DV = D: JAX's fused kernel needs it (else: direct)


def _masks(rng: np.random.Generator) -> dict[str, dict[str, Any]]:
    """Masking arguments, each leaving some rows with no visible key."""
    lens = rng.integers(1, K + 1, size=(B, Q))
    lens[0, 1] = lens[1, 4] = 0
    mask = rng.random((B, H, Q, K)) < 0.6
    mask[:, :, :, 3] = True
    mask[1, 0, 2] = mask[0, 1, 0] = False  # one row of one head
    return {
        "valid_lens (B, Q) with zeros": {"valid_lens": lens},
        "mask (B, H, Q, K) with empty rows": {"mask": mask},
        "valid_lens (B,) = 0 for one example": {"valid_lens": np.array([0, 4])},
        "causal, 7 queries and 4 keys": {"causal": True, "shape": (B, H, 7, 4)},
        "everything masked": {"mask": np.zeros((B, H, Q, K), bool)},
    }


def test_masked_and_fully_masked_rows_in_every_dtype(backend: str) -> None:
    """Scores of a few units (the reference comparison holds at 16 eps) and of a few hundred
    (masked scores beyond the visible ones: no NaN or inf, zeros exactly where masked)."""
    problems = _masked_rows_problems(Harness(backend), run)
    assert not problems, "\n".join(problems)


def _masked_rows_problems(h: Harness, runner: Callable[..., Any]) -> list[str]:
    """What :func:`test_masked_and_fully_masked_rows_in_every_dtype` finds wrong with the calls
    that ``runner`` makes."""
    rng = np.random.default_rng(8)
    problems = []
    for name, spec in _masks(rng).items():
        spec = dict(spec)
        shape = spec.pop("shape", (B, H, Q, K))
        b, heads, nq, nk = shape
        vis = visible(b, heads, nq, nk, spec.get("valid_lens"), spec.get("mask"),
                      spec.get("causal", False))
        for loud in (1.0, 100.0):
            x = [rng.standard_normal((b, heads, n, d)) for n, d in ((nq, D), (nk, D), (nk, DV))]
            x[0] = x[0] * loud
            for dtype in DTYPES[h.name]:
                arrays = [h.array(a, dtype) for a in x]
                expected, expected_w = attention(*(h.numpy(a) for a in arrays), vis)
                lens = None if "valid_lens" not in spec else h.array(spec["valid_lens"])
                mask = None if "mask" not in spec else h.array(spec["mask"])
                # loud scores in float32: rounding the scores moves the weights by more than
                # the tolerance (a relative error of eps on a score of 300 is 300 eps); float16
                # and bfloat16 are scored in float32, far within their own tolerance
                tol = TOLERANCE[dtype] if loud == 1.0 or dtype != "float32" else np.inf
                for path in paths(h, dtype):
                    out, w = _call(h, path, *arrays, lens, mask, spec.get("causal", False),
                                   runner)
                    problems += _check_masked_rows(f"{name}, x{loud:g}, {dtype}, {path}", out, w,
                                                   vis, expected, expected_w, tol,
                                                   TOLERANCE[dtype])
    return problems


#: The largest finite value of each dtype.
LARGEST = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38,
           "float32": float(np.finfo(np.float32).max), "float64": float(np.finfo(np.float64).max)}


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the reference's
def test_masked_softmax_with_the_dtype_extremes(backend: str) -> None:
    """Scores at +-0.99 of the dtype's largest finite value, masked ones among the largest."""
    h = Harness(backend)
    rng = np.random.default_rng(9)
    mask = rng.random((3, 4, 6)) < 0.5
    mask[0, 2] = False  # a row with no visible key
    mask[1, :, 1] = True
    vis = np.broadcast_to(mask, (3, 4, 6))
    problems = []
    for dtype in DTYPES[backend]:
        big = 0.99 * LARGEST[dtype]
        scores = h.array(rng.choice([-big, -1.0, 0.0, 3.0, big], size=(3, 4, 6)), dtype)
        w = h.numpy(run(h, _softmax, scores, h.array(mask)))
        s = h.numpy(scores)
        top = np.where(vis, s, -np.inf).max(-1, keepdims=True)
        top = np.where(np.isfinite(top), top, 0.0)
        e = np.where(vis, np.exp(np.where(vis, s, 0.0) - top), 0.0)  # s - top may be -inf: 0
        total = e.sum(-1, keepdims=True)
        expected = np.divide(e, total, out=np.zeros_like(e), where=total > 0)
        if not np.isfinite(w).all():
            problems.append(f"{dtype}: NaN or inf")
        elif not np.all(w[~vis] == 0.0):
            problems.append(f"{dtype}: a masked score got a nonzero weight")
        elif max_diff(w, expected) > TOLERANCE[dtype]:
            problems.append(f"{dtype}: off the reference by {max_diff(w, expected):.3g}")
    assert not problems, "\n".join(problems)


# -- scores up to 1e4 --------------------------------------------------------------------------


def _exact_large_scores(rng: np.random.Generator) -> tuple[list[np.ndarray], np.ndarray]:
    """Queries, keys, values and a mask whose scores reach +-12544, computed exactly in every dtype.

    Depth 4, so the default scale is 1/2. Queries are ``128 a``, keys ``b``, with integers
    ``a, b`` in [-7, 7]: every product ``64 a b`` and every partial sum of four is a multiple
    of 64 below 2**14 in magnitude, which float16 and bfloat16 hold exactly (at most 8
    significant bits), whatever the order of summation. Query 0 against key 0 scores +12544;
    query 1 sees only keys 1 and 2 (both -12544: a tie, weights 1/2 each) while key 0, masked,
    scores +12544; query 3 of example 1 sees nothing.
    """
    b_, h_, q_, k_, d_ = 2, 2, 4, 6, 4
    a = rng.integers(-7, 8, size=(b_, h_, q_, d_))
    b = rng.integers(-7, 8, size=(b_, h_, k_, d_))
    a[:, :, :2] = 7
    b[:, :, 0] = 7
    b[:, :, 1:3] = -7
    mask = rng.random((b_, h_, q_, k_)) < 0.6
    mask[:, :, 0, 0] = True
    mask[:, :, 1] = [False, True, True, False, False, False]
    mask[1, :, 3] = False
    v = rng.standard_normal((b_, h_, k_, d_)) * 3  # Dv = D: JAX's fused kernel needs it
    return [128.0 * a, b.astype(np.float64), v], mask


def test_scores_up_to_1e4_equal_the_reference(backend: str) -> None:
    h = Harness(backend)
    rng = np.random.default_rng(10)
    x, mask = _exact_large_scores(rng)
    vis = visible(2, 2, 4, 6, mask=mask)
    scores = np.einsum("bhqd,bhkd->bhqk", x[0], x[1]) / 2
    assert np.abs(scores[vis]).max() >= 1e4 and np.abs(scores).max() == 12544
    problems = []
    for dtype in DTYPES[backend]:
        arrays = [h.array(a, dtype) for a in x]
        rounded = [h.numpy(a) for a in arrays]
        assert np.array_equal(rounded[0], x[0]) and np.array_equal(rounded[1], x[1]), dtype
        expected, expected_w = attention(*rounded, vis)
        for path in paths(h, dtype):
            out, w = _call(h, path, *arrays, None, h.array(mask))
            problems += _check_masked_rows(f"{dtype}, {path}", out, w, vis, expected, expected_w,
                                           TOLERANCE[dtype], TOLERANCE[dtype])
    # random float64 inputs, queries scaled so that the largest |score| is 1e4
    if "float64" in DTYPES[backend]:
        q, k, v = (rng.standard_normal((2, 2, n, 8)) for n in (5, 9, 9))
        q *= 1e4 / np.abs(np.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(8)).max()
        lens = np.array([[9, 3, 1, 0, 7], [2, 9, 9, 5, 4]])
        vis = visible(2, 2, 5, 9, valid_lens=lens)
        expected, expected_w = attention(q, k, v, vis)
        arrays = [h.array(a, "float64") for a in (q, k, v)]
        for path in paths(h, "float64"):
            out, w = _call(h, path, *arrays, h.array(lens))
            problems += _check_masked_rows(f"random float64, {path}", out, w, vis, expected,
                                           expected_w, TOLERANCE["float64"], TOLERANCE["float64"])
    assert not problems, "\n".join(problems)


# -- very long keys ----------------------------------------------------------------------------

LONG = 65536


def test_long_keys_with_one_visible_key_give_its_value(backend: str) -> None:
    """65536 keys (64 key blocks on the blockwise path), one visible per query: weight exactly 1,
    output exactly that key's value, though many masked keys score far higher."""
    h = Harness(backend)
    rng = np.random.default_rng(11)
    b_, q_, d_ = 2, 3, 8
    q = rng.standard_normal((b_, q_, d_)) * 4
    k = rng.standard_normal((b_, LONG, d_)) * 4
    v = rng.standard_normal((b_, LONG, d_)) * 100
    where = np.array([[0, 40000, LONG - 1], [LONG - 1, 1025, 31]])  # the visible key per query
    mask = np.zeros((b_, q_, LONG), bool)
    mask[np.arange(b_)[:, None], np.arange(q_)[None, :], where] = True
    cases = {"mask (B, Q, K), one True per row": ({"mask": mask}, where),
             "valid_lens (B,) = 1": ({"valid_lens": np.array([1, 1])}, np.zeros((b_, q_), int))}
    problems = []
    for dtype in DTYPES[backend]:
        arrays = [h.array(a, dtype) for a in (q, k, v)]
        values = h.numpy(arrays[2])
        for name, (kw, chosen) in cases.items():
            expected = values[np.arange(b_)[:, None], chosen]  # (B, Q, D)
            lens = None if "valid_lens" not in kw else h.array(kw["valid_lens"])
            m = None if "mask" not in kw else h.array(kw["mask"])
            for path in paths(h, dtype):
                out, w = _call(h, path, *arrays, lens, m)
                if not np.array_equal(out, expected):
                    problems.append(f"{name}, {dtype}, {path}: output is not the visible key's "
                                    f"value (max |diff| {max_diff(out, expected):.3g})")
                if w is not None:
                    want = np.zeros((b_, 1, q_, LONG))
                    want[np.arange(b_)[:, None], 0, np.arange(q_)[None, :], chosen] = 1.0
                    if not np.array_equal(w, want):
                        problems.append(f"{name}, {dtype}, {path}: weights are not one-hot")
    assert not problems, "\n".join(problems)


# -- NaN and inf in the inputs -----------------------------------------------------------------

#: ``(label, path, keywords)`` of the calls that must carry a NaN or inf in an input to exactly
#: the rows that see it: ``check_numerics=True`` on the core kernels and in the automatic
#: choice, which must pass the fused kernels over (torch's is its default).
CHECKED = [(f"check_numerics, {path}", path, {"check_numerics": True})
           for path in (*CORE, "auto")]

#: ``(label, path, keywords)`` of the default calls on the core kernels: they select masked
#: scores away, so a masked key weighs 0 and a row with no visible key is zeros whatever the
#: scores hold (the fused kernels add the mask to the scores: NaN + -inf is NaN).
DEFAULT = [(f"default, {path}", path, {}) for path in CORE]


def _nan_inputs(rng: np.random.Generator, nq: int = 4, nk: int = 6) -> list[np.ndarray]:
    """Values as deep as the keys (JAX's fused kernel needs it)."""
    return [rng.standard_normal((2, n, 8)) for n in (nq, nk, nk)]


def _row_problems(label: str, out: np.ndarray, clean: np.ndarray, nan_rows: np.ndarray
                  ) -> list[str]:
    """What is wrong with ``out``: ``nan_rows`` (B, Q) must be all NaN, the others ``clean``."""
    if not np.isnan(out[nan_rows]).all():
        return [f"{label}: a row that sees the NaN or inf is not all NaN"]
    if np.isnan(out[~nan_rows]).any():
        return [f"{label}: NaN reached a row that does not see it"]
    if max_diff(out[~nan_rows], clean[~nan_rows]) > TOLERANCE["float32"]:
        return [f"{label}: a row that does not see the NaN or inf changed"]
    return []


def _non_finite_problems(h: Harness, cases: list[tuple[str, str, dict[str, Any]]],
                         x: list[np.ndarray], bad: list[np.ndarray], nan_rows: np.ndarray,
                         lens: Any = None, mask: Any = None, causal: bool = False) -> list[str]:
    """Calls each case on the clean inputs ``x`` and on ``bad``, in float32, and compares."""
    problems = []
    for label, path, kw in cases:
        clean, _ = _call(h, path, *(h.array(a, "float32") for a in x), lens, mask, causal, **kw)
        out, _ = _call(h, path, *(h.array(a, "float32") for a in bad), lens, mask, causal, **kw)
        problems += _row_problems(label, out, clean, nan_rows)
    return problems


def _spoilt(x: list[np.ndarray], which: int, where: Any, bad: float) -> list[np.ndarray]:
    """A copy of the inputs ``x`` with ``x[which][where] = bad``."""
    spoilt = [a.copy() for a in x]
    spoilt[which][where] = bad
    return spoilt


BAD = pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "+inf", "-inf"])


@BAD
def test_non_finite_query_reaches_only_its_row(backend: str, bad: float) -> None:
    """An inf counts as a NaN: the query's row is NaN, whole, the others untouched."""
    h = Harness(backend)
    x = _nan_inputs(np.random.default_rng(12))
    rows = np.zeros((2, 4), bool)
    rows[1, 2] = True
    problems = _non_finite_problems(h, CHECKED, x, _spoilt(x, 0, (1, 2, 5), bad), rows)
    assert not problems, "\n".join(problems)


def test_nan_query_of_a_row_with_no_visible_key_gives_zeros(backend: str) -> None:
    """Also by default: the row's NaN scores are all masked."""
    h = Harness(backend)
    x = _nan_inputs(np.random.default_rng(13))
    lens = h.array(np.array([[6, 0, 3, 1], [2, 6, 6, 5]]))
    x[0][0, 1, 3] = np.nan  # example 0, query 1: sees no key
    problems = []
    for label, path, kw in DEFAULT + CHECKED:
        out, _ = _call(h, path, *(h.array(a, "float32") for a in x), lens, **kw)
        if np.isnan(out).any() or not np.all(out[0, 1] == 0.0):
            problems.append(f"{label}: NaN in the output, or a nonzero row 1 of example 0")
    assert not problems, "\n".join(problems)


@BAD
def test_non_finite_masked_key_changes_nothing(backend: str, bad: float) -> None:
    """Key 5 of example 0 is past its length; key 2 is hidden from every query by the mask.
    Also by default: their scores are selected away."""
    h = Harness(backend)
    x = _nan_inputs(np.random.default_rng(14))
    lens = h.array(np.array([5, 6]))
    mask = np.ones((4, 6), bool)
    mask[:, 2] = False
    spoilt = _spoilt(_spoilt(x, 1, (0, 5, 1), bad), 1, (slice(None), 2, 4), bad)
    problems = _non_finite_problems(h, DEFAULT + CHECKED, x, spoilt, np.zeros((2, 4), bool),
                                    lens, h.array(mask))
    assert not problems, "\n".join(problems)


@BAD
def test_non_finite_visible_key_reaches_exactly_the_rows_that_see_it(backend: str,
                                                                      bad: float) -> None:
    """Causal, 4 queries and 6 keys: key 3 is seen by queries 1, 2, 3 (``j <= i + 2``)."""
    h = Harness(backend)
    x = _nan_inputs(np.random.default_rng(15))
    problems = _non_finite_problems(h, CHECKED, x, _spoilt(x, 1, (slice(None), 3, 0), bad),
                                    np.array([[False, True, True, True]] * 2), causal=True)
    assert not problems, "\n".join(problems)


def test_nan_in_a_masked_value_changes_nothing(backend: str) -> None:
    """A masked key must not influence the output, whatever its value holds (by default,
    ``0 * NaN`` may carry it into the pooled rows)."""
    h = Harness(backend)
    x = _nan_inputs(np.random.default_rng(16))
    mask = np.ones((4, 6), bool)
    mask[:, 2] = False
    problems = _non_finite_problems(h, CHECKED, x, _spoilt(x, 2, (slice(None), 2, 3), np.nan),
                                    np.zeros((2, 4), bool), mask=h.array(mask))
    assert not problems, "\n".join(problems)


def test_nan_or_inf_in_a_visible_value_reaches_exactly_the_rows_that_see_it(backend: str) -> None:
    """Causal, 4 queries and 6 keys: key 3 is seen by queries 1, 2, 3; its value holds +inf in
    example 0 and NaN in example 1. Those rows are NaN throughout, the others as before."""
    h = Harness(backend)
    x = _nan_inputs(np.random.default_rng(18))
    spoilt = _spoilt(_spoilt(x, 2, (0, 3, 6), np.inf), 2, (1, 3, 0), np.nan)
    problems = _non_finite_problems(h, CHECKED, x, spoilt,
                                    np.array([[False, True, True, True]] * 2), causal=True)
    assert not problems, "\n".join(problems)


def test_nan_with_a_mask_that_broadcasts_along_the_keys(backend: str) -> None:
    """A ``(Q, 1)`` mask (query 1 sees nothing, the others every key) and a NaN key in example
    0: the rows that see keys are NaN, query 1's row is 0, example 1 is untouched."""
    h = Harness(backend)
    x = _nan_inputs(np.random.default_rng(21))
    mask = h.array(np.array([[True], [False], [True], [True]]))
    x[1][0, 4, 2] = np.nan
    problems = []
    for label, path, kw in CHECKED:
        out, _ = _call(h, path, *(h.array(a, "float32") for a in x), None, mask, **kw)
        if not (np.isnan(out[0, [0, 2, 3]]).all() and np.all(out[0, 1] == 0.0)
                and not np.isnan(out[1]).any()):
            problems.append(f"{label}: NaN rows are not exactly queries 0, 2, 3 of example 0")
    assert not problems, "\n".join(problems)


#: Layers that project their inputs before pooling, with a configuration (depth 8).
PROJECTING = {
    "AdditiveAttention": {"num_hiddens": 6},
    "MultiHeadAttention": {"num_hiddens": 8, "num_heads": 2},
    "RelativeMultiHeadAttention": {"num_hiddens": 8, "num_heads": 2, "max_relative_position": 2},
}


@pytest.mark.parametrize("layer_name", sorted(PROJECTING))
def test_nan_in_one_example_of_a_layer_stays_in_it(backend: str, layer_name: str) -> None:
    """Layers take no ``check_numerics``: by default, a NaN value of example 1's key 1, seen by
    every query, reaches every row of example 1 (a column of it, where the values are not
    projected) and leaves example 0 as it was."""
    h = Harness(backend)
    layer = h.make(layer_name, {**PROJECTING[layer_name], "dropout": 0.0})
    x = _nan_inputs(np.random.default_rng(19))
    lens = h.array(np.array([3, 6]))
    clean = h.numpy(h.call(layer, *(h.array(a, "float32") for a in x), lens))
    x[2][1, 1, 5] = np.nan
    out = h.numpy(h.call(layer, *(h.array(a, "float32") for a in x), lens))
    assert np.isnan(out[1]).any(-1).all(), "a row of example 1 has no NaN"
    assert max_diff(out[0], clean[0]) <= TOLERANCE["float32"], "example 0 changed"


def _dpa_with_gradients(h: Harness, layer: Any, arrays: list[Any], paths: list[str],
                        call: dict[str, Any], cotangent: np.ndarray) -> dict[str, Any]:
    """``{path: (outputs, gradients)}`` of dot-product attention on each of ``paths`` (JAX:
    all in one program under ``jax.jit``, compiled once instead of once per path)."""
    def forward(path: str) -> Any:
        return lambda _, q, k, v: {"out": ac.dot_product_attention(q, k, v, implementation=path,
                                                                   **call)}

    def every_path(layer: Any, *xs: Any) -> Any:
        return {path: h.forward_and_gradients(layer, forward(path), list(xs), cotangent)
                for path in paths}

    return h.run("jit" if h.name == "jax" else "eager", layer, every_path, arrays)


def _gradient_problems(h: Harness, label: str, grads: Any, expected: dict[str, np.ndarray],
                       dtype: str) -> list[str]:
    """What is wrong with the gradients: NaN or inf, or a difference from the formula."""
    problems = []
    for key, want in expected.items():
        got = h.numpy(grads[key])
        if not np.isfinite(got).all():
            problems.append(f"{label}: {key} has NaN or inf")
        elif max_diff(got, want) > tolerance("grad." + key, dtype, want):
            problems.append(f"{label}: {key} off by {max_diff(got, want):.3g}")
    return problems

@pytest.mark.parametrize("check_numerics", [False, True], ids=["default", "check_numerics"])
def test_finite_inputs_keep_their_values_and_gradients(backend: str,
                                                       check_numerics: bool) -> None:
    """Outputs and gradients equal the float64 formula on every kernel, with a mask that
    broadcasts along the keys too; ``check_numerics=True`` (core kernels: it passes the fused
    ones over) changes no value and no gradient of finite inputs."""
    if backend not in AUTODIFF:
        pytest.skip(f"{backend} has no automatic differentiation")
    h = Harness(backend)
    rng = np.random.default_rng(20)
    b_, heads, nq, nk, d_ = 2, 2, 5, 4, 4
    x = [rng.standard_normal((b_, heads, n, d_)) for n in (nq, nk, nk)]
    cotangent = rng.standard_normal((b_, heads, nq, d_))
    rows = np.array([[True], [False], [True], [True], [False]])
    lens = np.array([[4, 0, 2, 1, 3], [3, 4, 0, 4, 1]])
    cases = {"no mask": ({}, visible(b_, heads, nq, nk)),
             "mask (Q, 1)": ({"mask": rows}, visible(b_, heads, nq, nk, mask=rows)),
             "valid_lens (B, Q)": ({"valid_lens": lens}, visible(b_, heads, nq, nk, lens))}
    layer = h.make("DotProductAttention", {"dropout": 0.0})
    arrays = [h.array(a, "float32") for a in x]
    rounded = [h.numpy(a) for a in arrays]
    kernels_ = paths(h, "float32", CORE if check_numerics else KERNELS)
    problems = []
    for name, (kw, vis) in cases.items():
        expected = _reference_gradients(*rounded, vis, cotangent)
        expected_out, _ = attention(*rounded, vis)
        call = {**{key: h.array(value) for key, value in kw.items()},
                "check_numerics": check_numerics}
        results = _dpa_with_gradients(h, layer, arrays, kernels_, call, cotangent)
        for path, (outs, grads) in results.items():
            label = f"{name}, {path}"
            if max_diff(h.numpy(outs["out"]), expected_out) > TOLERANCE["float32"]:
                problems.append(f"{label}: output off the reference")
            problems += _gradient_problems(h, label, grads, expected, "float32")
    assert not problems, "\n".join(problems)

# -- gradients with fully masked rows ----------------------------------------------------------


def _reference_gradients(q: np.ndarray, k: np.ndarray, v: np.ndarray, vis: np.ndarray,
                         cotangent: np.ndarray) -> dict[str, np.ndarray]:
    """Gradients of ``sum(attention(q, k, v) * cotangent)`` by the softmax's chain rule, float64.

    ``ds = w * (dw - sum_j dw_j w_j)``, zero wherever ``w`` is (masked keys, empty rows).
    """
    scale = 1.0 / np.sqrt(q.shape[-1])
    _, w = attention(q, k, v, vis)
    dw = cotangent @ v.swapaxes(-1, -2)
    ds = w * (dw - (dw * w).sum(-1, keepdims=True))
    return {"input.0": scale * ds @ k, "input.1": scale * ds.swapaxes(-1, -2) @ q,
            "input.2": w.swapaxes(-1, -2) @ cotangent}


def test_gradients_with_fully_masked_rows_are_finite_and_exact(backend: str) -> None:
    """Lengths with zeros and, separately, causal with more queries than keys; every dtype and
    path. The gradient of a query that sees no key is exactly 0."""
    if backend not in AUTODIFF:
        pytest.skip(f"{backend} has no automatic differentiation")
    h = Harness(backend)
    rng = np.random.default_rng(17)
    b_, heads, nq, nk, d_ = 2, 2, 5, 4, 4
    x = [rng.standard_normal((b_, heads, n, d_)) for n in (nq, nk, nk)]
    cotangent = rng.standard_normal((b_, heads, nq, d_))
    lens = np.array([[4, 0, 2, 1, 0], [3, 4, 0, 4, 1]])
    cases = {"valid_lens (B, Q) with zeros": ({"valid_lens": lens}, visible(b_, heads, nq, nk, lens)),
             "causal, 5 queries and 4 keys": ({"causal": True},
                                              visible(b_, heads, nq, nk, causal=True))}
    problems = []
    for dtype in DTYPES[backend]:
        layer = h.make("DotProductAttention", {"dropout": 0.0}, dtype)
        arrays = [h.array(a, dtype) for a in x]
        rounded = [h.numpy(a) for a in arrays]
        for name, (kw, vis) in cases.items():
            expected = _reference_gradients(*rounded, vis, cotangent)
            call = {**kw, "valid_lens": h.array(kw["valid_lens"])} if "valid_lens" in kw else kw
            empty = ~vis.any(-1)  # (B, H, Q)
            results = _dpa_with_gradients(h, layer, arrays, paths(h, dtype), call, cotangent)
            for path, (_, grads) in results.items():
                label = f"{name}, {dtype}, {path}"
                problems += _gradient_problems(h, label, grads, expected, dtype)
                if not np.all(h.numpy(grads["input.0"])[empty] == 0.0):
                    problems.append(f"{label}: a query that sees no key has a nonzero gradient")
    assert not problems, "\n".join(problems)


# -- layer normalisation in float16 and bfloat16 -----------------------------------------------


def _layer_norm_reference(s: np.ndarray, gamma: np.ndarray, beta: np.ndarray) -> np.ndarray:
    """LayerNorm of the last axis in float64, biased variance, eps 1e-5."""
    centred = s - s.mean(-1, keepdims=True)
    return centred / np.sqrt((centred * centred).mean(-1, keepdims=True) + 1e-5) * gamma + beta


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_layer_norm_of_large_values_in_half_precision(backend: str, dtype: str) -> None:
    """``|x - mean|`` up to ~1e4, whose squares overflow float16: AddNorm (the layer, and the
    functional ``add_norm`` with random gamma and beta) equals the float64 reference of the
    rounded inputs, in the input's dtype."""
    if dtype not in DTYPES[backend]:
        pytest.skip(f"{backend} layers do not compute in {dtype}")
    h = Harness(backend)
    rng = np.random.default_rng(22)
    x = rng.standard_normal((2, 3, 8)) * 3000
    x[0, 0, :2] = (1e4, -1e4)
    y = rng.standard_normal((2, 3, 8)) * 10
    gamma, beta = rng.standard_normal(8), rng.standard_normal(8)
    xs, ys, gs, bs = (h.array(a, dtype) for a in (x, y, gamma, beta))
    s = h.numpy(xs) + h.numpy(ys)  # X + Y is exact in float64
    layer = h.make("AddNorm", {"num_hiddens": 8}, dtype)
    results = {
        "AddNorm": (h.call(layer, xs, ys), _layer_norm_reference(s, 1.0, 0.0)),
        "add_norm": (run(h, lambda X, Y, w: ac.add_norm(X, Y, w), xs, ys,
                         {"ln.gamma": gs, "ln.beta": bs}),
                     _layer_norm_reference(s, h.numpy(gs), h.numpy(bs))),
    }
    problems = []
    for name, (out, expected) in results.items():
        if h.ops.dtype_name(out) != dtype:
            problems.append(f"{name}: dtype {h.ops.dtype_name(out)}, not {dtype}")
        # the output is rounded to the dtype once: its error is eps * |y| at most, plus the
        # rounding of gamma * y + beta in the dtype
        tol = TOLERANCE[dtype] * max(1.0, float(np.abs(expected).max()))
        if max_diff(h.numpy(out), expected) > tol:
            problems.append(f"{name}: off the reference by {max_diff(h.numpy(out), expected):.3g}")
    assert not problems, "\n".join(problems)


# -- infinite and NaN scores -------------------------------------------------------------------


def _softmax_reference(s: np.ndarray, vis: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(weights, nan_rows)`` by the documented rule, float64: a visible ``-inf`` weighs 0 (any
    finite score, the dtype's lowest too, is a score like any other); a row with nothing
    visible above ``-inf`` is all zeros; a visible ``+inf`` or NaN makes its row NaN
    (``nan_rows``, weights there left 0)."""
    nan_rows = (vis & (np.isnan(s) | (s == np.inf))).any(-1)
    live = vis & (s > -np.inf) & ~nan_rows[..., None]
    top = np.where(live, s, -np.inf).max(-1, keepdims=True, initial=-np.inf)
    e = np.where(live, np.exp(np.where(live, s, 0.0) - np.where(np.isfinite(top), top, 0.0)), 0.0)
    total = e.sum(-1, keepdims=True)
    return np.divide(e, total, out=np.zeros_like(e), where=total > 0), nan_rows


#: The lowest finite value of each dtype.
LOWEST = {dtype: -value for dtype, value in LARGEST.items()}


def _infinite_scores(dtype: str) -> np.ndarray:
    """``(2, 6, 5)`` scores: rows of -inf (all, some), the dtype's lowest value, +inf, NaN."""
    lowest = LOWEST[dtype]
    inf, nan = np.inf, np.nan
    rows = [[-inf, -inf, 0.5, 1.0, 2.0],  # visible -inf only when two keys are visible
            [-inf, 2.0, -inf, 1.0, -3.0],
            [lowest, lowest, 3.0, 3.0, -1.0],  # the dtype's lowest value, visible
            [-inf, -inf, -inf, -inf, -inf],
            [inf, 0.0, 1.0, -inf, 0.0],  # +inf visible: NaN; masked: nothing
            [0.5, nan, -inf, 2.0, inf]]
    return np.array([rows, rows[::-1]], dtype=np.float64)


def _weight_problems(label: str, w: np.ndarray, vis: np.ndarray, expected: np.ndarray,
                     nan_rows: np.ndarray, tol: float) -> list[str]:
    """What is wrong with weights ``w`` against :func:`_softmax_reference`'s."""
    if not np.isnan(w[nan_rows]).any(-1).all():
        return [f"{label}: a row with a visible +inf or NaN score is not NaN"]
    ok = w[~nan_rows]
    if np.isnan(ok).any():
        return [f"{label}: NaN in a row without a visible +inf or NaN score"]
    if not np.all(ok[~vis[~nan_rows]] == 0.0):
        return [f"{label}: a masked key has a nonzero weight"]
    if max_diff(ok, expected[~nan_rows]) > tol:
        return [f"{label}: off the reference by {max_diff(ok, expected[~nan_rows]):.3g}"]
    return []


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_masked_softmax_with_infinite_scores_never_leaks(backend: str) -> None:
    """User scores holding -inf, +inf, NaN and the dtype's lowest value, masked by lengths, a
    mask, causal and nothing: masked keys weigh exactly 0 and the other weights follow the
    rule of :func:`_softmax_reference`, in every dtype."""
    h = Harness(backend)
    rng = np.random.default_rng(23)
    mask = rng.random((2, 6, 5)) < 0.5
    mask[:, 3] = [True, True, False, False, True]
    cases = {"valid_lens (B,) = (2, 4)": {"valid_lens": np.array([2, 4])},
             "valid_lens (B, Q)": {"valid_lens": rng.integers(0, 6, size=(2, 6))},
             "mask (B, Q, K)": {"mask": mask},
             "causal": {"causal": True},
             "no mask": {}}
    problems = []
    for dtype in DTYPES[backend]:
        arrays = h.array(_infinite_scores(dtype), dtype)
        s = h.numpy(arrays)
        for name, spec in cases.items():
            vis = visible(2, 1, 6, 5, spec.get("valid_lens"), spec.get("mask"),
                          spec.get("causal", False))[:, 0]
            expected, nan_rows = _softmax_reference(s, vis)
            lens = None if "valid_lens" not in spec else h.array(spec["valid_lens"])
            m = None if "mask" not in spec else h.array(spec["mask"])
            w = h.numpy(run(h, lambda x, lens, m, causal: ac.masked_softmax(x, lens, m, causal),
                            arrays, lens, m, causal=spec.get("causal", False)))
            problems += _weight_problems(f"{name}, {dtype}", w, vis, expected, nan_rows,
                                         TOLERANCE[dtype])
    assert not problems, "\n".join(problems)


def _output_problems(label: str, out: np.ndarray, expected: np.ndarray, nan_rows: np.ndarray,
                     tol: float) -> list[str]:
    """What is wrong with ``out``: ``nan_rows`` (B, Q) must be all NaN, the others within
    ``tol`` of ``expected``."""
    if not np.isnan(out[nan_rows]).all():
        return [f"{label}: a row with a visible +inf or NaN score is not all NaN"]
    if max_diff(out[~nan_rows], expected[~nan_rows]) > tol:
        return [f"{label}: output off the reference by "
                f"{max_diff(out[~nan_rows], expected[~nan_rows]):.3g}"]
    return []


def _lse_problems(label: str, lse: np.ndarray, expected: np.ndarray, nan_rows: np.ndarray
                  ) -> list[str]:
    """What is wrong with the log-sum-exp of the rows outside ``nan_rows``: ``-inf`` exactly
    where expected, else within 1e-5 (float32)."""
    got, want = lse[~nan_rows], expected[~nan_rows]
    empty = want == -np.inf
    if not np.array_equal(got == -np.inf, empty) or max_diff(got[~empty], want[~empty]) > 1e-5:
        return [f"{label}: log-sum-exp off the reference"]
    return []


def _scored(q: Any, k: Any, v: Any, lens: Any, bias: Any, **kw: Any) -> Any:
    return ac.dot_product_attention(q, k, v, lens, score_bias=bias, return_lse=True, **kw)


def _infinite_bias(rng: np.random.Generator) -> tuple[list[np.ndarray], np.ndarray]:
    """Inputs ``(2, 4|6, 8)`` with lengths (3, 6) and a score bias ``(2, 4, 6)`` holding -inf,
    +inf and NaN: example 0's rows 0 and 1 see nothing above -inf (zeros), row 2 a -inf among
    finite scores and +inf and NaN on padding keys; example 1's rows 0 and 1 see +inf and NaN
    (NaN rows), row 2 one finite score among -inf ones."""
    x = [rng.standard_normal((2, n, 8)) for n in (4, 6, 6)]
    bias = rng.standard_normal((2, 4, 6))
    bias[0, 0] = bias[0, 1, :3] = bias[0, 2, 0] = bias[1, 2, :5] = -np.inf
    bias[0, 2, 4] = bias[0, 3, 3] = bias[1, 0, 2] = np.inf
    bias[0, 2, 5] = bias[1, 1, 1] = np.nan
    return x, bias


def _minus_inf_below_key_2(h: Harness) -> Callable[..., Any]:
    """A score_mod: keys 0 and 1 score -inf."""
    return lambda s, b, head, q_idx, kv_idx: h.ops.where(kv_idx >= 2, s, -np.inf)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_infinite_score_modifiers_follow_the_rule_on_the_core_kernels(backend: str) -> None:
    """``score_bias`` of -inf, +inf and NaN (:func:`_infinite_bias`), and a ``score_mod`` that
    gives keys 0 and 1 -inf (lengths (1, 6): example 0 sees nothing above -inf), by default:
    outputs, weights and log-sum-exp follow :func:`_softmax_reference` (``-inf`` for a row
    with nothing visible above it). The fused kernels take no score modifiers."""
    h = Harness(backend)
    x, bias = _infinite_bias(np.random.default_rng(25))
    cases = {"score_bias": (np.array([3, 6]), bias, {}),
             "score_mod": (np.array([1, 6]), np.zeros((4, 6)),
                           {"score_mod": _minus_inf_below_key_2(h)})}
    problems = []
    for dtype in DTYPES[backend]:
        arrays = [h.array(a, dtype) for a in x]
        q, k, v = (h.numpy(a) for a in arrays)
        for name, (lens, b, kw) in cases.items():
            given = h.array(b, dtype)
            s = np.einsum("bqd,bkd->bqk", q, k) / np.sqrt(8) + h.numpy(given)
            if "score_mod" in kw:
                s[:, :, :2] = -np.inf
            vis = visible(2, 1, 4, 6, lens)[:, 0]
            w_ref, nan_rows = _softmax_reference(s, vis)
            live = vis & (s > -np.inf) & ~nan_rows[..., None]
            with np.errstate(divide="ignore"):  # log 0: a row with nothing visible
                lse_ref = np.log(np.where(live, np.exp(np.where(live, s, 0.0)), 0.0).sum(-1))
            for path in CORE:
                label = f"{name}, {dtype}, {path}"
                got = run(h, _scored, *arrays, h.array(lens), given, implementation=path,
                          return_weights=path == "direct", **kw)
                out, lse = h.numpy(got[0]), h.numpy(got[-1])[:, 0]
                problems += _output_problems(label, out, w_ref @ v, nan_rows, TOLERANCE[dtype])
                if path == "direct":
                    problems += _weight_problems(label, h.numpy(got[1])[:, 0], vis, w_ref,
                                                 nan_rows, TOLERANCE[dtype])
                problems += _lse_problems(label, lse, lse_ref, nan_rows)
    assert not problems, "\n".join(problems)


# -- scores beyond the range of the dtype -------------------------------------------------------


def _overflowing(big: float) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """Queries and keys of magnitude ``big``, depth 64 (scores ``+-8 big**2``): example 0's two
    visible keys score ``-8 big**2``, its padding keys ``+8 big**2``; example 1 sees keys 0-2,
    of which key 1 alone scores 4, the others ``-8 big**2``, key 3 (padding) ``+8 big**2``.
    Returns the inputs, the lengths and the visibility ``(B, Q, K)``."""
    q = np.full((2, 3, 64), big)
    k = np.full((2, 4, 64), -big)
    k[0, 2:] = k[1, 3] = big
    k[1, 1] = 0.5 / big
    v = np.random.default_rng(24).integers(-8, 8, size=(2, 4, 64)).astype(np.float64)
    lens = np.array([2, 3])
    return [q, k, v], lens, visible(2, 1, 3, 4, lens)[:, 0]


#: |q| = |k| at which the scores, 8e4, pass float16's largest value (65504).
HALF_BIG = 100.0


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the reference's
def test_scores_beyond_float16_equal_the_float64_answer(backend: str) -> None:
    """float16 and bfloat16 inputs are scored and pooled in float32, on every kernel (torch's
    SDPA and XLA's kernel do likewise): at ``|q| = |k| = 100`` the scores of ``+-80000`` are
    finite, example 0's two visible keys tie (weights 1/2), and the output is the float64
    answer within the dtype's rounding."""
    h = Harness(backend)
    x, lens, vis = _overflowing(HALF_BIG)
    problems = []
    for dtype in [d for d in ("float16", "bfloat16") if d in DTYPES[backend]]:
        arrays = [h.array(a, dtype) for a in x]
        expected, expected_w = attention(*(h.numpy(a)[:, None] for a in arrays), vis[:, None])
        for path in paths(h, dtype):
            out, w = _call(h, path, *arrays, h.array(lens))
            problems += _check_masked_rows(f"{dtype}, {path}", out, None if w is None else w[:, 0],
                                           vis, expected[:, 0], expected_w[:, 0],
                                           TOLERANCE[dtype], TOLERANCE[dtype])
    assert not problems, "\n".join(problems)


#: |q| = |k| at which the scores pass the largest value of the dtype they are computed in
#: (float32 for bfloat16).
OVERFLOW = {"bfloat16": 1e19, "float32": 1e19, "float64": 1e154}


def _leak_problems(h: Harness, runner: Callable[..., Any], dtypes: tuple[str, ...],
                   names: tuple[str, ...] = CORE) -> list[str]:
    """What is wrong with the answers of the core kernels among ``names`` to :func:`_overflowing` at
    :data:`OVERFLOW`: example 0's visible scores overflow to -inf and its padding's to +inf,
    so its rows must be zeros; example 1's rows key 1's value, its weights one-hot.

    The fused kernels are left out: they add the mask to the scores, so an overflowed score
    can move weight onto a masked key there (documented in docs/numerics.md)."""
    problems = []
    for dtype in [d for d in dtypes if d in DTYPES[h.name]]:
        x, lens, _ = _overflowing(OVERFLOW[dtype])
        expected = np.zeros((2, 3, 64))
        expected[1] = x[2][1, 1]
        one_hot = np.zeros((2, 3, 4))
        one_hot[1, :, 1] = 1.0
        arrays = [h.array(a, dtype) for a in x]
        for path in paths(h, dtype, names):
            out, w = _call(h, path, *arrays, h.array(lens), runner=runner)
            if not np.array_equal(out, expected):
                problems.append(f"{dtype}, {path}: output off by {max_diff(out, expected):.3g}")
            if w is not None and not np.array_equal(w[:, 0], one_hot):
                problems.append(f"{dtype}, {path}: weights are not one-hot on key 1 / zero")
    return problems


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_overflowing_scores_in_a_padded_batch_never_leak(backend: str) -> None:
    """The core kernels, scores beyond float32's range (float64's for float64): a row whose
    visible scores overflowed to -inf is zeros, never the mean of the padding; a finite
    visible score among -inf ones takes all the weight."""
    problems = _leak_problems(Harness(backend), run, tuple(OVERFLOW))
    assert not problems, "\n".join(problems)


def test_scores_beyond_float16_in_the_multi_head_layer(backend: str) -> None:
    """MultiHeadAttention(64, 1) in float16 with identity projections, ``|q| = |k| = 100``, on
    the layer's own kernel: the padded batch's output is the float64 answer (example 0 the
    mean of its two visible values, example 1 key 1's value)."""
    if "float16" not in DTYPES[backend]:
        pytest.skip(f"{backend} layers do not compute in float16")
    h = Harness(backend)
    layer = h.make("MultiHeadAttention", {"num_hiddens": 64, "num_heads": 1}, "float16")
    x, lens, vis = _overflowing(HALF_BIG)
    arrays = [h.array(a, "float16") for a in x]
    h.call(layer, *arrays, h.array(lens))  # builds
    eye = np.eye(64, dtype=np.float16)
    layer.set_weights({f"{n}.kernel": eye for n in ("W_q", "W_k", "W_v", "W_o")})
    out = h.numpy(h.call(layer, *arrays, h.array(lens)))
    expected, _ = attention(*(h.numpy(a)[:, None] for a in arrays), vis[:, None])
    assert max_diff(out, expected[:, 0]) <= TOLERANCE["float16"], max_diff(out, expected[:, 0])


# -- traced calls --------------------------------------------------------------------------------


def _tf_function(jit_compile: bool) -> Callable[..., Any]:
    """A runner (see :func:`_call`) that traces each call in a new ``tf.function``."""
    def runner(h: Harness, fn: Callable[..., Any], *arrays: Any, **static: Any) -> Any:
        import tensorflow as tf

        traced = tf.function(functools.partial(fn, **static), jit_compile=jit_compile,
                             autograph=False)
        return traced(*arrays)

    return runner


def _torch_compile(h: Harness, fn: Callable[..., Any], *arrays: Any, **static: Any) -> Any:
    """A runner that compiles each call afresh with ``torch.compile(fullgraph=True)``."""
    import torch

    torch._dynamo.reset()
    with torch.no_grad():
        return torch.compile(functools.partial(fn, **static), fullgraph=True)(*arrays)


#: Traced runners by backend and mode (JAX runs every call of these tests under ``jax.jit``
#: already). ``torch.compile`` costs seconds a call: only the overflow test uses it.
TRACED = {("tensorflow", "tf.function"): _tf_function(False),
          ("tensorflow", "xla"): _tf_function(True)}
COMPILED = {("torch", "compile"): _torch_compile}


def _traced(backend: str, mode: str) -> Callable[..., Any]:
    runners = {**TRACED, **COMPILED}
    if (backend, mode) not in runners:
        pytest.skip(f"{backend} has no traced mode {mode!r} here")
    return runners[backend, mode]


@pytest.mark.parametrize("mode", sorted({mode for _, mode in TRACED}))
def test_masked_and_fully_masked_rows_under_tracing(backend: str, mode: str) -> None:
    """:func:`test_masked_and_fully_masked_rows_in_every_dtype` with every call traced."""
    problems = _masked_rows_problems(Harness(backend), _traced(backend, mode))
    assert not problems, "\n".join(problems)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("mode", sorted({mode for _, mode in (*TRACED, *COMPILED)}))
def test_overflowing_scores_under_tracing_never_leak(backend: str, mode: str) -> None:
    """:func:`test_overflowing_scores_in_a_padded_batch_never_leak` with every call traced or
    compiled (float32 and the direct kernel only under ``torch.compile``, where the automatic
    choice takes the fused kernel or the direct one): the selection of the masked scores
    survives the graph compilers."""
    compiled = (backend, mode) in COMPILED  # the direct kernel: what a compiled call takes
    problems = _leak_problems(Harness(backend), _traced(backend, mode),
                              ("float32",) if compiled else tuple(OVERFLOW),
                              ("direct",) if compiled else CORE)
    assert not problems, "\n".join(problems)

# -- the dtype rule ---------------------------------------------------------------------

#: Every layer with weights, its config and input shapes (``None``: valid_lens of the batch).
WEIGHTED_LAYERS: dict[str, tuple[dict[str, Any], tuple[tuple[int, ...], ...]]] = {
    "AdditiveAttention": ({"num_hiddens": 6}, ((2, 4, 3), (2, 6, 8), (2, 6, 5))),
    "MultiHeadAttention": ({"num_hiddens": 8, "num_heads": 2}, ((2, 4, 8), (2, 6, 8), (2, 6, 5))),
    "RelativeMultiHeadAttention": ({"num_hiddens": 12, "num_heads": 3, "max_relative_position": 2},
                                   ((2, 4, 12), (2, 4, 12), (2, 4, 12))),
    "LearnedPositionalEncoding": ({"num_hiddens": 4, "max_len": 6}, ((2, 5, 4),)),
    "PositionWiseFFN": ({"ffn_num_hiddens": 6, "ffn_num_outputs": 4}, ((2, 3, 5),)),
    "AddNorm": ({"num_hiddens": 8}, ((2, 3, 8), (2, 3, 8))),
    "TransformerEncoderBlock": ({"num_hiddens": 12, "ffn_num_hiddens": 16, "num_heads": 3},
                                ((2, 5, 12),)),
    "NadarayaWatson": ({"parametric": True}, ((2, 3), (2, 5), (2, 5))),
}


def _other_dtypes(backend: str) -> list[str]:
    """Input dtypes other than float32 that the backend's arrays can hold (JAX: no float64
    without ``jax_enable_x64``)."""
    return [d for d in ("float64", "float16") if not (backend == "jax" and d == "float64")]


@pytest.mark.parametrize("layer_name", sorted(WEIGHTED_LAYERS))
def test_a_layer_with_weights_computes_in_its_own_dtype(backend: str, layer_name: str) -> None:
    """A float32 layer given float64 or float16 inputs casts them to float32 on entry: the
    output is float32 and equals the output for the inputs cast to float32 first."""
    h = Harness(backend)
    config, shapes = WEIGHTED_LAYERS[layer_name]
    rng = np.random.default_rng(7)
    data = [rng.standard_normal(s) for s in shapes]
    layer = h.make(layer_name, config)
    for dtype in _other_dtypes(backend):
        given = [x.astype(dtype) for x in data]
        out = h.call(layer, *(h.array(x) for x in given))
        assert h.ops.dtype_name(out) == "float32", (layer_name, dtype)
        first = h.call(layer, *(h.array(x.astype(np.float32)) for x in given))
        np.testing.assert_allclose(h.numpy(out), h.numpy(first), rtol=0, atol=1e-6,
                                   err_msg=f"{layer_name} on {dtype} inputs")


def test_a_layer_without_weights_computes_in_its_inputs_dtype(backend: str) -> None:
    """DotProductAttention and PositionalEncoding compute in their inputs' dtype."""
    h = Harness(backend)
    rng = np.random.default_rng(8)
    q, k, v = (rng.standard_normal(s) for s in ((2, 4, 8), (2, 6, 8), (2, 6, 5)))
    dtypes = [d for d in ("float64",) if d in DTYPES[backend]] + ["float32"]
    for dtype in dtypes:
        for name, config, inputs in (("DotProductAttention", {}, (q, k, v)),
                                     ("PositionalEncoding", {"num_hiddens": 8, "max_len": 6},
                                      (q,))):
            out = h.call(h.make(name, config), *(h.array(x, dtype) for x in inputs))
            assert h.ops.dtype_name(out) == dtype, (name, dtype)


# -- host-side arguments from any framework, NumPy scalar arguments -----------------------


def _foreign(kind: str, x: np.ndarray) -> Any:
    """``x`` as an array of another framework (None when that framework is not installed)."""
    import importlib.util

    module = {"torch": "torch", "tf": "tensorflow", "jax": "jax", "mx": "mxnet"}[kind]
    if importlib.util.find_spec(module) is None:
        return None
    if kind == "torch":
        import torch

        return torch.from_numpy(x)
    if kind == "tf":
        import tensorflow as tf

        return tf.constant(x)
    if kind == "jax":
        import jax.numpy as jnp

        return jnp.asarray(x)
    import mxnet as mx

    return mx.np.array(x, dtype=x.dtype) if x.dtype != np.bool_ else mx.np.array(x, dtype="bool")


def test_lengths_and_masks_of_any_integer_dtype_and_framework(backend: str) -> None:
    """``valid_lens`` of every NumPy integer dtype (uint64, int16, ...), as a list, or as another
    framework's array, and masks from anywhere, give the float64 reference's answer."""
    h = Harness(backend)
    rng = np.random.default_rng(9)
    q, k, v = (rng.standard_normal(s) for s in ((2, 3, 4), (2, 5, 4), (2, 5, 3)))
    lens = np.array([4, 2])
    mask = rng.random((3, 5)) < 0.7
    vis = (np.arange(5)[None, None, None, :] < lens[:, None, None, None]) & mask[None, None]
    expected = attention(q[:, None], k[:, None], v[:, None], vis)[0][:, 0]
    given_lens: list[Any] = [lens.astype(d) for d in ("int8", "uint8", "int16", "uint16", "int32",
                                                      "uint32", "int64", "uint64")]
    given_lens += [lens.tolist(), *(_foreign(kind, lens) for kind in ("torch", "tf", "jax", "mx"))]
    given_masks: list[Any] = [mask, mask.tolist(),
                              *(_foreign(kind, mask) for kind in ("torch", "tf", "jax", "mx"))]
    Q, K, V = (h.array(x, "float32") for x in (q, k, v))
    for i, lengths in enumerate(given_lens):
        for j, m in enumerate(given_masks):
            if lengths is None or m is None:
                continue
            out = h.numpy(ac.dot_product_attention(Q, K, V, lengths, mask=m))
            assert max_diff(out, expected) <= TOLERANCE["float32"], (i, j)


def test_weights_to_set_may_come_from_any_framework(backend: str) -> None:
    """``set_weights`` takes torch tensors (also ones that require grad, and bfloat16), TF and
    JAX arrays alike, cast to the layer's dtype."""
    import importlib.util

    h = Harness(backend)
    layer = h.make("AddNorm", {"num_hiddens": 4})
    gamma, beta = np.array([1.0, 2.0, 0.5, -1.0]), np.array([0.25, 0.0, -0.5, 1.0])
    sources: list[tuple[str, Any, Any]] = [("numpy", gamma, beta)]
    if importlib.util.find_spec("torch") is not None:
        import torch

        sources += [
            ("torch requires_grad", torch.tensor(gamma, requires_grad=True), torch.tensor(beta)),
            ("torch bfloat16", torch.tensor(gamma, dtype=torch.bfloat16),
             torch.tensor(beta, dtype=torch.bfloat16)),
        ]
    sources += [(kind, _foreign(kind, gamma), _foreign(kind, beta)) for kind in ("tf", "jax", "mx")]
    for label, g, b in sources:
        if g is None:
            continue
        layer.set_weights({"ln.gamma": g, "ln.beta": b})
        got = layer.get_weights()
        assert got["ln.gamma"].dtype == np.float32, label
        np.testing.assert_array_equal(got["ln.gamma"], gamma.astype(np.float32), err_msg=label)
        np.testing.assert_array_equal(got["ln.beta"], beta.astype(np.float32), err_msg=label)


#: Each layer's constructor arguments given as NumPy scalars.
NUMPY_SCALAR_CONFIGS: dict[str, dict[str, Any]] = {
    "DotProductAttention": {"dropout": np.float32(0.0)},
    "AdditiveAttention": {"num_hiddens": np.int64(6), "dropout": np.float64(0.0)},
    "MultiHeadAttention": {"num_hiddens": np.int32(8), "num_heads": np.int64(2),
                           "dropout": np.float32(0.25), "bias": np.bool_(True)},
    "RelativeMultiHeadAttention": {"num_hiddens": np.int64(12), "num_heads": np.uint8(3),
                                   "max_relative_position": np.int16(2)},
    "PositionalEncoding": {"num_hiddens": np.int64(4), "dropout": np.float32(0.0),
                           "max_len": np.int32(6)},
    "LearnedPositionalEncoding": {"num_hiddens": np.int64(4), "max_len": np.int64(6)},
    "PositionWiseFFN": {"ffn_num_hiddens": np.int64(6), "ffn_num_outputs": np.int32(4)},
    "AddNorm": {"num_hiddens": np.int64(8), "dropout": np.float16(0.5)},
    "TransformerEncoderBlock": {"num_hiddens": np.int64(12), "ffn_num_hiddens": np.int64(16),
                                "num_heads": np.int64(3)},
    "TransformerEncoder": {"vocab_size": np.int64(11), "num_hiddens": np.int64(12),
                           "ffn_num_hiddens": np.int32(16), "num_heads": np.int64(3),
                           "num_blks": np.int64(1)},
    "NadarayaWatson": {"parametric": np.bool_(True)},
}


def _module_of(h: Harness, layer: Any) -> Any:
    """The object holding a layer's constructor arguments (a Flax handle's module; an NNX
    handle's, made with inputs 8 wide when it waits for its first call's widths)."""
    module = getattr(layer, "module", layer)
    return layer.build(dict.fromkeys(layer.cls.sizes, 8)) if module is None else module


@pytest.mark.parametrize("layer_name", sorted(NUMPY_SCALAR_CONFIGS))
def test_numpy_scalar_arguments_are_kept_as_python_numbers(backend: str, layer_name: str) -> None:
    """Every constructor takes NumPy scalars where it takes Python numbers, and keeps the
    Python numbers (so configs, reprs and saved files hold no NumPy types)."""
    h = Harness(backend)
    config = NUMPY_SCALAR_CONFIGS[layer_name]
    module = _module_of(h, h.make(layer_name, config))
    for name, value in config.items():
        kept = getattr(module, name)
        assert type(kept) is type(value.item()), (name, type(kept))
        assert kept == value.item(), name


def test_numpy_scalar_functional_arguments(backend: str) -> None:
    """``scale``, ``dropout``, ``causal``, ``return_weights`` and ``num_heads`` as NumPy scalars
    give the float64 reference's answer."""
    h = Harness(backend)
    rng = np.random.default_rng(10)
    q, k, v = (rng.standard_normal(s) for s in ((2, 4, 8), (2, 6, 8), (2, 6, 5)))
    vis = np.arange(6)[None, None, None, :] <= np.arange(4)[None, None, :, None] + 2
    expected, weights = attention(q[:, None], k[:, None], v[:, None], vis, scale=0.25)
    out, w = ac.dot_product_attention(
        *(h.array(x, "float32") for x in (q, k, v)), scale=np.float32(0.25),
        dropout=np.float32(0.0), causal=np.bool_(True), return_weights=np.bool_(True))
    assert max_diff(h.numpy(out), expected[:, 0]) <= TOLERANCE["float32"]
    assert max_diff(h.numpy(w), weights) <= TOLERANCE["float32"]
