"""Numerics at the edges, on every backend, in every dtype it computes in and on every pooling path.

* Masked and fully masked rows in float16 and bfloat16 (and float32, float64): no NaN or inf,
  masked keys weigh exactly 0, rows with no visible key are exactly 0 (weights, and the
  attention output before any projection); the rest equals the float64 reference.
* Scores up to +-1.25e4: inputs built so that every product and partial sum of the scores is
  exact in every dtype, so the float64 reference of the same numbers is the exact answer; and
  random float64 inputs scaled to scores of 1e4.
* 65536 keys with one visible key per query: the output is that key's value, bit for bit.
* NaN inputs reach only the rows they touch (see the ``nan`` tests for what is still open).
* Gradients of dot-product attention with fully masked rows are finite, zero for those rows'
  queries, and equal the float64 formula (torch, TensorFlow, JAX, MXNet).

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
from attention_core import attention as core_attention
from tests.harness import AUTODIFF, DTYPES, TOLERANCE, Harness, max_diff, tolerance
from tests.strategies import attention, implementations, run, visible

#: These tests run on the columns too (conftest.py; tests.harness.COLUMNS).
COLUMN_TESTS = True

#: Paths left out, with the reason (none now: JAX's fused kernel in float16 on CPU, which XLA
#: cannot compile under ``jax.jit``, falls back to the direct path in ``JaxOps.fused_attention``).
LEFT_OUT: dict[tuple[str, str, str], str] = {}


def paths(h: Harness, dtype: str) -> list[str]:
    """The pooling paths of a backend in a dtype, less :data:`LEFT_OUT`."""
    return [p for p in implementations(h) if (h.name, dtype, p) not in LEFT_OUT]


def _dpa(q: Any, k: Any, v: Any, lens: Any, mask: Any, **kw: Any) -> Any:
    return ac.dot_product_attention(q, k, v, lens, mask=mask, **kw)


def _softmax(scores: Any, mask: Any) -> Any:
    return ac.masked_softmax(scores, mask=mask)


def _call(h: Harness, path: str, q: Any, k: Any, v: Any, lens: Any = None, mask: Any = None,
          causal: bool = False, runner: Callable[..., Any] = run,
          ) -> tuple[np.ndarray, np.ndarray | None]:
    """``(output, weights)`` as float64 NumPy; weights only on the direct path. ``runner`` is
    :func:`tests.strategies.run` or one of :data:`TRACED`."""
    if path == "direct":
        out, w = runner(h, _dpa, q, k, v, lens, mask, causal=causal, return_weights=True)
        return h.numpy(out), h.numpy(w)
    return h.numpy(runner(h, _dpa, q, k, v, lens, mask, causal=causal, implementation=path)), None


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
                # loud scores: below float64, rounding the scores moves the weights by more
                # than the tolerance (a relative error of eps on a score of 300 is 300 eps)
                tol = TOLERANCE[dtype] if loud == 1.0 or dtype == "float64" else np.inf
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


# -- NaN inputs --------------------------------------------------------------------------------

#: Where NaN still reaches rows it should not, by test and path (None: every backend), with why.
#: Each is an expected failure (``xfail(strict=True)``): a fix makes it pass and the mark must go.
NAN_GAPS: dict[tuple[str, str], tuple[tuple[str, ...] | None, str]] = {}


def _nan_path(request: pytest.FixtureRequest, backend: str, test: str, path: str) -> Harness:
    h = Harness(backend)
    if path not in implementations(h):
        pytest.skip(f"{backend} has no {path} path")
    backends, why = NAN_GAPS.get((test, path), ((), ""))
    if backends is None or backend in backends:
        request.applymarker(pytest.mark.xfail(strict=True, reason=why))
    return h


def _nan_inputs(rng: np.random.Generator, nq: int = 4, nk: int = 6) -> list[np.ndarray]:
    """Values as deep as the keys: the fused kernels (torch's flash kernel on CPU, JAX's) need it."""
    return [rng.standard_normal((2, n, 8)) for n in (nq, nk, nk)]


def _compare_rows(out: np.ndarray, clean: np.ndarray, nan_rows: np.ndarray) -> None:
    """``nan_rows`` (B, Q) of ``out`` are all NaN, the others equal ``clean``."""
    assert np.isnan(out[nan_rows]).all(), "a row that touches the NaN is not NaN"
    assert not np.isnan(out[~nan_rows]).any(), "NaN reached a row that does not touch it"
    assert max_diff(out[~nan_rows], clean[~nan_rows]) <= TOLERANCE["float32"]


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "+inf", "-inf"])
@pytest.mark.parametrize("path", ["direct", "blockwise", "fused"])
def test_non_finite_query_reaches_only_its_row(backend: str, path: str, bad: float,
                                               request: pytest.FixtureRequest) -> None:
    """An inf counts as a NaN (issue 14): the query's row is NaN, the others untouched."""
    h = _nan_path(request, backend, "query", path)
    x = _nan_inputs(np.random.default_rng(12))
    clean, _ = _call(h, path, *(h.array(a, "float32") for a in x))
    x[0][1, 2, 5] = bad  # example 1, query 2
    out, _ = _call(h, path, *(h.array(a, "float32") for a in x))
    rows = np.zeros((2, 4), bool)
    rows[1, 2] = True
    _compare_rows(out, clean, rows)


@pytest.mark.parametrize("path", ["direct", "blockwise", "fused"])
def test_nan_query_of_a_row_with_no_visible_key_gives_zeros(backend: str, path: str,
                                                            request: pytest.FixtureRequest) -> None:
    h = _nan_path(request, backend, "query_of_empty_row", path)
    x = _nan_inputs(np.random.default_rng(13))
    lens = h.array(np.array([[6, 0, 3, 1], [2, 6, 6, 5]]))
    x[0][0, 1, 3] = np.nan  # example 0, query 1: sees no key
    out, _ = _call(h, path, *(h.array(a, "float32") for a in x), lens)
    assert not np.isnan(out).any() and np.all(out[0, 1] == 0.0)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "+inf", "-inf"])
@pytest.mark.parametrize("path", ["direct", "blockwise", "fused"])
def test_non_finite_masked_key_changes_nothing(backend: str, path: str, bad: float,
                                               request: pytest.FixtureRequest) -> None:
    """Key 5 of example 0 is past its length; key 2 is hidden from every query by the mask."""
    h = _nan_path(request, backend, "masked_key", path)
    x = _nan_inputs(np.random.default_rng(14))
    lens = h.array(np.array([5, 6]))
    mask = np.ones((4, 6), bool)
    mask[:, 2] = False
    clean, _ = _call(h, path, *(h.array(a, "float32") for a in x), lens, h.array(mask))
    x[1][0, 5, 1] = x[1][:, 2, 4] = bad
    out, _ = _call(h, path, *(h.array(a, "float32") for a in x), lens, h.array(mask))
    _compare_rows(out, clean, np.zeros((2, 4), bool))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "+inf", "-inf"])
@pytest.mark.parametrize("path", ["direct", "blockwise", "fused"])
def test_non_finite_visible_key_reaches_exactly_the_rows_that_see_it(
        backend: str, path: str, bad: float, request: pytest.FixtureRequest) -> None:
    """Causal, 4 queries and 6 keys: key 3 is seen by queries 1, 2, 3 (``j <= i + 2``)."""
    h = _nan_path(request, backend, "visible_key", path)
    x = _nan_inputs(np.random.default_rng(15))
    clean, _ = _call(h, path, *(h.array(a, "float32") for a in x), causal=True)
    x[1][:, 3, 0] = bad
    out, _ = _call(h, path, *(h.array(a, "float32") for a in x), causal=True)
    _compare_rows(out, clean, np.array([[False, True, True, True]] * 2))


@pytest.mark.parametrize("path", ["direct", "blockwise", "fused"])
def test_nan_in_a_masked_value_changes_nothing(backend: str, path: str,
                                               request: pytest.FixtureRequest) -> None:
    """A masked key must not influence the output, whatever its value holds."""
    h = _nan_path(request, backend, "masked_value", path)
    x = _nan_inputs(np.random.default_rng(16))
    mask = np.ones((4, 6), bool)
    mask[:, 2] = False
    clean, _ = _call(h, path, *(h.array(a, "float32") for a in x), None, h.array(mask))
    x[2][:, 2, 3] = np.nan
    out, _ = _call(h, path, *(h.array(a, "float32") for a in x), None, h.array(mask))
    _compare_rows(out, clean, np.zeros((2, 4), bool))



@pytest.mark.parametrize("path", ["direct", "blockwise", "fused"])
def test_nan_or_inf_in_a_visible_value_reaches_exactly_the_rows_that_see_it(
        backend: str, path: str, request: pytest.FixtureRequest) -> None:
    """Causal, 4 queries and 6 keys: key 3 is seen by queries 1, 2, 3; its value holds +inf in
    example 0 and NaN in example 1. Those rows are NaN throughout, the others as before."""
    h = _nan_path(request, backend, "visible_value", path)
    x = _nan_inputs(np.random.default_rng(18))
    clean, _ = _call(h, path, *(h.array(a, "float32") for a in x), causal=True)
    x[2][0, 3, 6], x[2][1, 3, 0] = np.inf, np.nan
    out, _ = _call(h, path, *(h.array(a, "float32") for a in x), causal=True)
    _compare_rows(out, clean, np.array([[False, True, True, True]] * 2))


#: Layers that project their inputs before pooling, with a configuration (depth 8).
PROJECTING = {
    "AdditiveAttention": {"num_hiddens": 6},
    "MultiHeadAttention": {"num_hiddens": 8, "num_heads": 2},
    "RelativeMultiHeadAttention": {"num_hiddens": 8, "num_heads": 2, "max_relative_position": 2},
}


@pytest.mark.parametrize("layer_name", sorted(PROJECTING))
def test_non_finite_values_in_a_layer_reach_only_the_rows_that_see_them(
        backend: str, layer_name: str) -> None:
    """Lengths (3, 6): example 0's key 4 is padding and its value is NaN and inf; example 1's
    key 1, seen by every query, has a NaN value. Example 0 is unchanged, example 1 all NaN."""
    h = Harness(backend)
    layer = h.make(layer_name, {**PROJECTING[layer_name], "dropout": 0.0})
    x = _nan_inputs(np.random.default_rng(19))
    lens = h.array(np.array([3, 6]))
    clean = h.numpy(h.call(layer, *(h.array(a, "float32") for a in x), lens))
    x[2][0, 4, :2], x[2][1, 1, 5] = (np.nan, np.inf), np.nan
    out = h.numpy(h.call(layer, *(h.array(a, "float32") for a in x), lens))
    _compare_rows(out, clean, np.array([[False] * 4, [True] * 4]))



@pytest.mark.parametrize("path", ["direct", "blockwise", "fused"])
def test_nan_with_a_mask_that_broadcasts_along_the_keys(backend: str, path: str,
                                                        request: pytest.FixtureRequest) -> None:
    """A ``(Q, 1)`` mask (query 1 sees nothing, the others every key) and a NaN key: the rows
    that see keys are NaN, query 1's row is 0."""
    h = _nan_path(request, backend, "broadcast_mask", path)
    x = _nan_inputs(np.random.default_rng(21))
    mask = np.array([[True], [False], [True], [True]])
    x[1][0, 4, 2] = np.nan
    out, _ = _call(h, path, *(h.array(a, "float32") for a in x), None, h.array(mask))
    assert np.isnan(out[0, [0, 2, 3]]).all() and np.all(out[0, 1] == 0.0)
    assert not np.isnan(out[1]).any()


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


@pytest.mark.parametrize("mended", [False, True], ids=["probed", "always_mended"])
def test_finite_inputs_keep_their_values_and_gradients(backend: str, mended: bool,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The NaN handling changes nothing for finite inputs: outputs and gradients equal the
    float64 formula on every path, also when the inputs are mended on every call (as under
    ``torch.compile``, where the probe cannot read the inputs, or in the branch that traced
    TensorFlow and JAX calls take when their bound fails) and with a mask that
    broadcasts along the keys."""
    if backend not in AUTODIFF:
        pytest.skip(f"{backend} has no automatic differentiation")
    if mended:  # nothing probed, and the bound of traced calls fails: the mending branch
        monkeypatch.setattr(core_attention, "_probe", lambda ops, summed, bounded: (False, ()))
        monkeypatch.setattr(core_attention, "_inputs_in_range",
                            lambda ops, q, k, v, factor: ops.max(ops.reshape(q - q, (1, -1)), -1) > 0)
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
    problems = []
    for name, (kw, vis) in cases.items():
        expected = _reference_gradients(*rounded, vis, cotangent)
        expected_out, _ = attention(*rounded, vis)
        call = {key: h.array(value) for key, value in kw.items()}
        results = _dpa_with_gradients(h, layer, arrays, paths(h, "float32"), call, cotangent)
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


# -- issue 14: infinite scores never move weight onto masked keys ------------------------------


def _softmax_reference(s: np.ndarray, vis: np.ndarray, lowest: float) -> tuple[np.ndarray, np.ndarray]:
    """``(weights, nan_rows)`` by the documented rule, float64: a visible score at or below the
    dtype's lowest value weighs like ``-inf`` (0); a row with nothing visible above it is all
    zeros; a visible ``+inf`` or NaN makes its row NaN (``nan_rows``, weights there left 0)."""
    nan_rows = (vis & (np.isnan(s) | (s == np.inf))).any(-1)
    live = vis & (s > lowest) & ~nan_rows[..., None]
    top = np.where(live, s, -np.inf).max(-1, keepdims=True, initial=-np.inf)
    e = np.where(live, np.exp(np.where(live, s, 0.0) - np.where(np.isfinite(top), top, 0.0)), 0.0)
    total = e.sum(-1, keepdims=True)
    return np.divide(e, total, out=np.zeros_like(e), where=total > 0), nan_rows


def _infinite_scores(dtype: str) -> np.ndarray:
    """``(2, 6, 5)`` scores: rows of -inf (all, some), the dtype's lowest value, +inf, NaN."""
    lowest = FILL[dtype]
    inf, nan = np.inf, np.nan
    rows = [[-inf, -inf, 0.5, 1.0, 2.0],  # visible -inf only when two keys are visible
            [-inf, 2.0, -inf, 1.0, -3.0],
            [lowest, lowest, 3.0, 3.0, -1.0],  # the dtype's lowest value, visible
            [-inf, -inf, -inf, -inf, -inf],
            [inf, 0.0, 1.0, -inf, 0.0],  # +inf visible: NaN; masked: nothing
            [0.5, nan, -inf, 2.0, inf]]
    return np.array([rows, rows[::-1]], dtype=np.float64)


#: The lowest finite value of each dtype (the masked scores' fill).
FILL = {dtype: -value for dtype, value in LARGEST.items()}


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
            expected, nan_rows = _softmax_reference(s, vis, FILL[dtype])
            lens = None if "valid_lens" not in spec else h.array(spec["valid_lens"])
            m = None if "mask" not in spec else h.array(spec["mask"])
            w = h.numpy(run(h, lambda x, lens, m, causal: ac.masked_softmax(x, lens, m, causal),
                            arrays, lens, m, causal=spec.get("causal", False)))
            label = f"{name}, {dtype}"
            if not np.isnan(w[nan_rows]).any(-1).all():
                problems.append(f"{label}: a row with a visible +inf or NaN score is not NaN")
            ok = w[~nan_rows]
            if np.isnan(ok).any():
                problems.append(f"{label}: NaN in a row without a visible +inf or NaN score")
            elif not np.all(ok[~vis[~nan_rows]] == 0.0):
                problems.append(f"{label}: a masked key has a nonzero weight")
            elif max_diff(ok, expected[~nan_rows]) > TOLERANCE[dtype]:
                problems.append(f"{label}: off the reference by "
                                f"{max_diff(ok, expected[~nan_rows]):.3g}")
    assert not problems, "\n".join(problems)


def _overflowing(big: float) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """Queries and keys of magnitude ``big``, depth 64, whose scores overflow: example 0's two
    visible keys score -inf and its padding keys +inf; example 1 sees keys 0-2, of which key 1
    alone scores finitely (4), key 3 (padding) +inf. Returns the inputs, the lengths and the
    expected output (zeros for example 0, key 1's value for example 1)."""
    q = np.full((2, 3, 64), big)
    k = np.full((2, 4, 64), -big)
    k[0, 2:] = k[1, 3] = big
    k[1, 1] = 0.5 / big
    v = np.random.default_rng(24).integers(-8, 8, size=(2, 4, 64)).astype(np.float64)
    expected = np.zeros((2, 3, 64))
    expected[1] = v[1, 1]
    return [q, k, v], np.array([2, 3]), expected


#: Scores that overflow, per dtype: float16 at |q| = |k| = 100, the wider types at 1e19.
OVERFLOW = {"float16": 100.0, "bfloat16": 1e19, "float32": 1e19, "float64": 1e154}

#: Paths whose overflow is not guarded, with why (none now: the fused kernels are skipped when a
#: probe of the inputs finds scores that may overflow, or under jax.jit, which cannot probe,
#: when a bound on the scores checked in the program says so).
OVERFLOW_GAPS: dict[tuple[str, str], str] = {}


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_overflowing_scores_in_a_padded_batch_never_leak(backend: str) -> None:
    """Every path and dtype: a row whose visible scores overflowed to -inf is zeros, never the
    mean of the padding; a finite visible score among -inf ones takes all the weight."""
    h = Harness(backend)
    problems = []
    for dtype in DTYPES[backend]:
        x, lens, expected = _overflowing(OVERFLOW[dtype])
        arrays = [h.array(a, dtype) for a in x]
        for path in paths(h, dtype):
            if (backend, path) in OVERFLOW_GAPS and dtype != "float16":
                continue  # JAX's fused kernel in float16 on CPU is the direct path
            out, w = _call(h, path, *arrays, h.array(lens))
            if not np.array_equal(out, expected):
                problems.append(f"{dtype}, {path}: output off by {max_diff(out, expected):.3g}")
            one_hot = np.zeros((2, 3, 4))
            one_hot[1, :, 1] = 1.0
            if w is not None and not np.array_equal(w[:, 0], one_hot):
                problems.append(f"{dtype}, {path}: weights are not one-hot on key 1 / zero")
    assert not problems, "\n".join(problems)


# -- traced calls: what the eager probe decides is decided in the graph -------------------------


def _tf_function(jit_compile: bool) -> Callable[..., Any]:
    """A runner (see :func:`_call`) that traces each call in a new ``tf.function``."""
    def runner(h: Harness, fn: Callable[..., Any], *arrays: Any, **static: Any) -> Any:
        import tensorflow as tf

        traced = tf.function(functools.partial(fn, **static), jit_compile=jit_compile,
                             autograph=False)
        return traced(*arrays)

    return runner


#: Traced runners of the backends whose eager calls probe their inputs (JAX runs every call of
#: these tests under ``jax.jit`` already): under tracing the probe cannot read the inputs.
TRACED = {("tensorflow", "tf.function"): _tf_function(False),
          ("tensorflow", "xla"): _tf_function(True)}


def _torch_compile(warm_up: bool = False, train: bool = False,
                   dynamic: bool | None = None) -> Callable[..., Any]:
    """A runner that compiles each call with ``torch.compile(fullgraph=True)`` and runs it
    under ``torch.no_grad()``; with ``warm_up``, the program first runs on inputs one query
    and one key longer, so the call itself compiles again with symbolic lengths (what a
    compiled layer does at its second length). With ``train``, the queries, keys and values
    require gradients and autograd records the call (a training step's forward pass);
    ``dynamic`` is ``torch.compile``'s."""
    def runner(h: Harness, fn: Callable[..., Any], *arrays: Any, **static: Any) -> Any:
        import torch

        torch._dynamo.reset()  # each call compiled afresh, as its own program
        compiled = torch.compile(functools.partial(fn, **static), fullgraph=True,
                                 dynamic=dynamic)
        if train:
            q, k, v, *rest = arrays
            result = compiled(*(x.detach().requires_grad_() for x in (q, k, v)), *rest)
            if isinstance(result, tuple):
                return tuple(x.detach() for x in result)
            return result.detach()
        with torch.no_grad():
            if warm_up:
                q, k, v, *rest = arrays
                compiled(*(torch.cat([x, x[:, :1]], 1) for x in (q, k, v)), *rest)
            return compiled(*arrays)

    return runner


#: Compiled torch runners: compiling costs seconds a call, so only the overflow test uses them.
#: ``torch.cond`` picks the branch in programs that autograd does not record and whose floats
#: are not symbolic (see ``backends.torch.ops``).
#: In a training step's forward pass and with ``dynamic=True``, where ``torch.cond`` cannot
#: branch, the fused kernel runs as the eager call inside one operator of the program.
COMPILED = {("torch", "compile"): _torch_compile(),
            ("torch", "compile-2nd-length"): _torch_compile(warm_up=True),
            ("torch", "compile-train"): _torch_compile(train=True),
            ("torch", "compile-dynamic"): _torch_compile(dynamic=True)}


#: The dtypes the compiled runners check (a compilation per call and path costs seconds).
COMPILED_DTYPES = {"compile": ("float16", "float32"), "compile-2nd-length": ("float16",),
                   "compile-train": ("float16", "bfloat16"), "compile-dynamic": ("float16",)}


def _traced(backend: str, mode: str) -> Callable[..., Any]:
    if (backend, mode) in COMPILED:
        return COMPILED[backend, mode]
    if (backend, mode) not in TRACED:
        pytest.skip(f"{backend} has no traced mode {mode!r} here")
    return TRACED[backend, mode]


@pytest.mark.parametrize("mode", sorted({mode for _, mode in TRACED}))
def test_masked_and_fully_masked_rows_under_tracing(backend: str, mode: str) -> None:
    """:func:`test_masked_and_fully_masked_rows_in_every_dtype` with every call traced: the
    scores are bounded in the graph, and rows with no visible key are zeros without a pass
    over the scores."""
    problems = _masked_rows_problems(Harness(backend), _traced(backend, mode))
    assert not problems, "\n".join(problems)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("mode", sorted({mode for _, mode in (*TRACED, *COMPILED)}))
def test_overflowing_scores_under_tracing_never_leak(backend: str, mode: str) -> None:
    """:func:`test_overflowing_scores_in_a_padded_batch_never_leak` with every call traced,
    where the bound on the scores is checked in the graph, and with a NaN and an inf query
    row (which the bound must not pass either)."""
    runner = _traced(backend, mode)
    h = Harness(backend)
    problems = []
    for dtype in COMPILED_DTYPES.get(mode, DTYPES[backend]):
        x, lens, expected = _overflowing(OVERFLOW[dtype])
        arrays = [h.array(a, dtype) for a in x]
        for path in paths(h, dtype):
            out, w = _call(h, path, *arrays, h.array(lens), runner=runner)
            if not np.array_equal(out, expected):
                problems.append(f"{dtype}, {path}: output off by {max_diff(out, expected):.3g}")
            one_hot = np.zeros((2, 3, 4))
            one_hot[1, :, 1] = 1.0
            if w is not None and not np.array_equal(w[:, 0], one_hot):
                problems.append(f"{dtype}, {path}: weights are not one-hot on key 1 / zero")
    assert not problems, "\n".join(problems)


def test_overflowing_scores_in_the_multi_head_layer(backend: str) -> None:
    """MultiHeadAttention(64, 1) in float16 with identity projections, |q| = |k| = 100: the
    padded batch's output is zeros where every visible score is -inf, else key 1's value."""
    if "float16" not in DTYPES[backend]:
        pytest.skip(f"{backend} layers do not compute in float16")
    h = Harness(backend)
    layer = h.make("MultiHeadAttention", {"num_hiddens": 64, "num_heads": 1}, "float16")
    x, lens, expected = _overflowing(100.0)
    arrays = [h.array(a, "float16") for a in x]
    h.call(layer, *arrays, h.array(lens))  # builds
    eye = np.eye(64, dtype=np.float16)
    layer.set_weights({f"{n}.kernel": eye for n in ("W_q", "W_k", "W_v", "W_o")})
    out = h.numpy(h.call(layer, *arrays, h.array(lens)))
    assert np.array_equal(out, expected), max_diff(out, expected)


# -- issue 14: an inf in a query or a key is treated as NaN ------------------------------------


@pytest.mark.parametrize("layer_name", sorted(PROJECTING))
def test_inf_in_layer_queries_and_keys_reaches_only_the_rows_that_see_it(
        backend: str, layer_name: str) -> None:
    """Lengths (3, 6): example 0's key 4 (padding) holds +inf and -inf, changing nothing;
    example 1's query 2 holds -inf and its key 1, seen by every query, +inf: example 1 all NaN."""
    h = Harness(backend)
    layer = h.make(layer_name, {**PROJECTING[layer_name], "dropout": 0.0})
    x = _nan_inputs(np.random.default_rng(28))
    lens = h.array(np.array([3, 6]))
    clean = h.numpy(h.call(layer, *(h.array(a, "float32") for a in x), lens))
    x[1][0, 4, :2] = (np.inf, -np.inf)
    x[0][1, 0, 3] = -np.inf
    x[1][1, 1, 5] = np.inf
    out = h.numpy(h.call(layer, *(h.array(a, "float32") for a in x), lens))
    _compare_rows(out, clean, np.array([[False] * 4, [True] * 4]))
# -- issue 14: the dtype rule ---------------------------------------------------------------------

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


# -- issue 14: host-side arguments from any framework, NumPy scalar arguments -----------------------


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
