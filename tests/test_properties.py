"""Property tests (Hypothesis) on every backend: random shapes, heads, masks and lengths.

* dot-product and multi-head attention equal the float64 NumPy reference of
  :mod:`tests.strategies` within the float32 tolerance, on every pooling path;
* the attention weights of visible keys sum to 1, masked keys get exactly 0, and rows with no
  visible key are all zeros (weights and output);
* permuting the keys and values together (and the mask's key axis with them) leaves the output
  unchanged;
* each backend's ``PositionalEncoding`` table satisfies ``P[i + delta] = R(delta) P[i]`` for
  random offsets (``relative_rotation``).

The first four call the functional API, which sees only the arrays: a column whose arrays
are another env's backend's (:data:`SAME_ARRAYS_AS`) would run the same examples through the
same code again, so it skips them.

Every test runs derandomized with a fixed ``max_examples`` (see :func:`tests.strategies.profile`)
and reports the number of examples it ran to ``tests/report.py`` (key ``"properties"`` of the
backend's report file).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import attention_core as ac
from attention_core.kernels import blockwise
from tests import report
from tests.harness import TOLERANCE, Harness, max_diff
from tests.strategies import (
    PERMUTABLE_KINDS,
    Problem,
    attention,
    implementations,
    multi_head,
    problems,
    profile,
    run,
)

#: These tests run on the columns too (conftest.py; tests.harness.COLUMNS).
COLUMN_TESTS = True

TOL = TOLERANCE["float32"]

#: Columns whose arrays, ops and drawn examples are those of another env's backend (the JAX
#: columns both run JAX eagerly; the jax env runs under ``jax.jit``).
SAME_ARRAYS_AS = {"keras-torch": "torch", "nnx": "keras-jax"}


#: Columns that draw fewer examples of the functional properties: keras-jax runs them on eager
#: JAX, which compiles each primitive for each new shape (about 4 minutes of that env's test
#: time at full length), while the jax env runs the same properties under ``jax.jit`` with
#: every example. The divisor of each test's ``max_examples``.
EAGER_SHARE = {"keras-jax": 4}


def share(backend: str, max_examples: int) -> int:
    """How many examples a functional property draws on ``backend`` (:data:`EAGER_SHARE`)."""
    return max(1, max_examples // EAGER_SHARE.get(backend, 1))


def functional(backend: str) -> Harness:
    """The backend's harness for a test of the functional API; skips where it repeats another
    env's test (:data:`SAME_ARRAYS_AS`)."""
    if backend in SAME_ARRAYS_AS:
        pytest.skip(f"{backend}'s arrays are {SAME_ARRAYS_AS[backend]}'s: the same examples run "
                    f"in the {SAME_ARRAYS_AS[backend]} env")
    return Harness(backend)


@contextmanager
def _blocks(key_block: int, tile: int) -> Iterator[None]:
    """Blockwise path with ``key_block`` keys per block and ``tile`` scores per tile (so that small
    problems span several query and key blocks, with ragged tails)."""
    saved = blockwise.KEY_BLOCK, blockwise.TILE_SCORES, blockwise.MIN_QUERY_BLOCK
    blockwise.KEY_BLOCK, blockwise.TILE_SCORES, blockwise.MIN_QUERY_BLOCK = key_block, tile, 1
    try:
        yield
    finally:
        blockwise.KEY_BLOCK, blockwise.TILE_SCORES, blockwise.MIN_QUERY_BLOCK = saved


def _dpa(q: Any, k: Any, v: Any, lens: Any, mask: Any, blocks: tuple[int, int] | None = None,
         **kw: Any) -> Any:
    if blocks is None:
        return ac.dot_product_attention(q, k, v, lens, mask=mask, **kw)
    with _blocks(*blocks):  # under jax.jit: while tracing
        return ac.dot_product_attention(q, k, v, lens, mask=mask, **kw)


def _mha(q: Any, k: Any, v: Any, w: Any, lens: Any, mask: Any, **kw: Any) -> Any:
    return ac.multi_head_attention(q, k, v, w, valid_lens=lens, mask=mask, **kw)


def _lift(x: np.ndarray) -> np.ndarray:
    """Rank 3 ``(B, N, D)`` -> rank 4 ``(B, 1, N, D)``; rank 4 as it is."""
    return x if x.ndim == 4 else x[:, None]


def _float32_inputs(h: Harness, problem: Problem) -> tuple[list[Any], list[np.ndarray]]:
    """The problem's inputs as float32 backend arrays, and their rounded values in float64."""
    arrays = [h.array(x, "float32") for x in problem.inputs()]
    return arrays, [h.numpy(a) for a in arrays]


def test_dot_product_matches_float64_reference(backend: str) -> None:
    h = functional(backend)
    # JAX: the weights path (direct) and one other, to bound the number of compiled programs
    paths = ["blockwise"] if backend == "jax" else [None, *implementations(h)]
    # blockwise: (keys per block, scores per tile); JAX: 2 keys, tiles of 2 queries x 2 keys
    blockings = [(2, 4)] if backend == "jax" else [(1, 1), (2, 4), (3, 10**6), (1024, 2**21)]
    examples = 0

    @profile(share(backend, 100))
    @given(problem=problems(backend), path=st.sampled_from(paths),
           blocks=st.sampled_from(blockings))
    def check(problem: Problem, path: str | None, blocks: tuple[int, int]) -> None:
        nonlocal examples
        (q, k, v), rounded = _float32_inputs(h, problem)
        lens, mask = problem.call_arguments(h)
        expected, expected_w = attention(*(_lift(x) for x in rounded), problem.visible())
        if problem.H is None:
            expected = expected[:, 0]
        out, weights = run(h, _dpa, q, k, v, lens, mask, causal=problem.causal, return_weights=True)
        assert max_diff(h.numpy(out), expected) <= TOL, "direct output"
        assert max_diff(h.numpy(weights), expected_w) <= TOL, "weights"
        blocked = blocks if path in (None, "blockwise") else None
        if path == "fused" and h.ops.name == "jax" and problem.Dv != problem.D:
            with pytest.raises(ValueError, match="needs values as deep as the keys"):
                run(h, _dpa, q, k, v, lens, mask, causal=problem.causal, implementation=path)
            return  # JAX's kernel refuses it, saying why
        other = run(h, _dpa, q, k, v, lens, mask, causal=problem.causal, implementation=path,
                    blocks=blocked)
        assert max_diff(h.numpy(other), expected) <= TOL, f"output of implementation={path!r}"
        examples += 1

    check()
    report.record_properties(backend, "test_dot_product_matches_float64_reference", examples)


def test_visible_weights_sum_to_one_and_masked_are_zero(backend: str) -> None:
    """On the direct path (weights and output) and the automatic one (output)."""
    h = functional(backend)
    examples = 0

    @profile(share(backend, 80))
    @given(problem=problems(backend))
    def check(problem: Problem) -> None:
        nonlocal examples
        (q, k, v), _ = _float32_inputs(h, problem)
        lens, mask = problem.call_arguments(h)
        out, weights = run(h, _dpa, q, k, v, lens, mask, causal=problem.causal, return_weights=True)
        w, o = h.numpy(weights), _lift(h.numpy(out))
        vis = problem.visible()
        seen = vis.any(-1)  # (B, H, Q): rows with a visible key
        assert w.shape == vis.shape
        assert np.all(w[~vis] == 0.0), "a masked key got a nonzero weight"
        assert np.all(w >= 0.0)
        assert np.all(np.abs(w.sum(-1)[seen] - 1.0) <= TOL), "visible weights do not sum to 1"
        assert np.all(o[~seen] == 0.0), "a row with no visible key is not zero"
        auto = _lift(h.numpy(run(h, _dpa, q, k, v, lens, mask, causal=problem.causal)))
        assert np.all(auto[~seen] == 0.0), "a row with no visible key is not zero (automatic path)"
        examples += 1

    check()
    report.record_properties(backend, "test_visible_weights_sum_to_one_and_masked_are_zero",
                             examples)


@st.composite
def permuted(draw: Any, backend: str) -> tuple[Problem, list[int]]:
    problem = draw(problems(backend, kinds=PERMUTABLE_KINDS))
    return problem, draw(st.permutations(range(problem.K)))


def test_permuting_keys_and_values_together_changes_nothing(backend: str) -> None:
    """On the backend's automatic path (fused on torch, blockwise on numpy and mxnet, ...)."""
    h = functional(backend)
    examples = 0

    @profile(share(backend, 80))
    @given(case=permuted(backend))
    def check(case: tuple[Problem, list[int]]) -> None:
        nonlocal examples
        problem, perm = case
        q, k, v = problem.inputs()
        mask = problem.mask
        moved_mask = None if mask is None or mask.shape[-1] == 1 else mask[..., perm]
        axis = k.ndim - 2
        f32 = [h.array(x, "float32") for x in (q, k, v, np.take(k, perm, axis), np.take(v, perm, axis))]
        as_is = run(h, _dpa, *f32[:3], None, None if mask is None else h.array(mask))
        moved = run(h, _dpa, f32[0], *f32[3:], None,
                    None if mask is None else h.array(mask if moved_mask is None else moved_mask))
        assert max_diff(h.numpy(moved), h.numpy(as_is)) <= TOL
        examples += 1

    check()
    report.record_properties(backend, "test_permuting_keys_and_values_together_changes_nothing",
                             examples)


@st.composite
def multi_head_problems(draw: Any, backend: str) -> Problem:
    """A :class:`Problem` with ``H`` heads of depth ``extra["depth"]`` over rank-3 inputs of
    depths ``D`` (queries), ``extra["Dk"]`` (keys), ``Dv`` (values); biases or not."""
    problem = draw(problems(backend, heads=(1, 2, 3), max_dim=6))
    jax = backend == "jax"
    if problem.H is None:  # JAX draws rank 3 too; multi-head always has its heads
        problem.H = 2
        if problem.mask is not None and problem.mask.ndim == 4:
            problem.mask = np.repeat(problem.mask, 2, axis=1)
    problem.extra = {"depth": 2 if jax else draw(st.integers(1, 3)),
                     "Dk": problem.D if jax else draw(st.integers(1, 6)),
                     "bias": draw(st.booleans())}
    return problem


def test_multi_head_matches_float64_reference(backend: str) -> None:
    h = functional(backend)
    examples = 0

    @profile(share(backend, 80))
    @given(problem=multi_head_problems(backend))
    def check(problem: Problem) -> None:
        nonlocal examples
        H = problem.heads
        rng = np.random.default_rng(problem.seed)
        B, Q, K, Dq, Dk, Dv = (problem.B, problem.Q, problem.K, problem.D, problem.extra["Dk"],
                               problem.Dv)
        hidden = H * problem.extra["depth"]
        inputs = [rng.standard_normal(s) for s in ((B, Q, Dq), (B, K, Dk), (B, K, Dv))]
        shapes = {"W_q": (Dq, hidden), "W_k": (Dk, hidden), "W_v": (Dv, hidden),
                  "W_o": (hidden, hidden)}
        w = {f"{n}.kernel": rng.standard_normal(s) / np.sqrt(s[0]) for n, s in shapes.items()}
        if problem.extra["bias"]:
            w.update({f"{n}.bias": rng.standard_normal(hidden) for n in shapes})
        x32 = [h.array(x, "float32") for x in inputs]
        w32 = {n: h.array(x, "float32") for n, x in w.items()}
        lens, mask = problem.call_arguments(h)
        out, weights = run(h, _mha, *x32, w32, lens, mask, num_heads=H, causal=problem.causal,
                           return_weights=True)
        expected, expected_w = multi_head(*(h.numpy(x) for x in x32),
                                          {n: h.numpy(x) for n, x in w32.items()}, H,
                                          problem.visible())
        assert max_diff(h.numpy(out), expected) <= TOL, "output"
        assert max_diff(h.numpy(weights), expected_w) <= TOL, "weights"
        examples += 1

    check()
    report.record_properties(backend, "test_multi_head_matches_float64_reference", examples)


MAX_LEN = 1000  # the layers' default table length
_TABLES: dict[tuple[str, int], np.ndarray] = {}


def _table(h: Harness, width: int) -> np.ndarray:
    """The layer's ``P[0]`` ``(max_len, width)`` in float64, one layer per backend and width."""
    key = (h.name, width)
    if key not in _TABLES:
        layer = h.make("PositionalEncoding", {"num_hiddens": width, "dropout": 0.0})
        _TABLES[key] = h.numpy(layer.P)[0]
    return _TABLES[key]


def test_positional_encoding_rotation_for_random_offsets(backend: str) -> None:
    """Every row pair ``(i, i + delta)`` of the table for a random width and offset."""
    h = Harness(backend)
    examples = 0

    @profile(60)
    @given(width=st.integers(1, 48).map(lambda n: 2 * n),
           delta=st.integers(-(MAX_LEN - 1), MAX_LEN - 1))
    def check(width: int, delta: int) -> None:
        nonlocal examples
        P = _table(h, width)
        assert P.shape == (MAX_LEN, width)
        R = ac.relative_rotation(delta, width)
        rows = np.arange(max(0, -delta), MAX_LEN - max(0, delta))  # i and i + delta in the table
        assert max_diff(P[rows] @ R.T, P[rows + delta]) <= TOL
        examples += 1

    check()
    report.record_properties(backend, "test_positional_encoding_rotation_for_random_offsets",
                             examples)
