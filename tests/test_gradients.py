"""Reference gradients: the file covers every case and is confirmed by finite differences.

The file ``tests/reference/data/gradients.npz`` holds float64 gradients of
``sum(output * cotangent)`` for every reference case (every layer, mask kind and edge shape),
made once by torch autograd (``python -m tests.reference.gradients``). In the numpy env they are
confirmed by central finite differences on the NumPy core, so the file does not rest on torch:
entry by entry for a representative set of cases (``FULL_CHECK_CASES``), and for every case by
directional differences along random directions plus a few sampled entries (the largest among
them), which keeps the numpy env fast. Every autodiff backend is compared with the file in
``tests/test_reference_matrix.py``, in every dtype and mode of the matrix.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import numpy as np
import pytest

from conftest import test_backends
from tests.harness import max_diff
from tests.reference.cases import Case
from tests.reference.gradients import (
    case_data,
    forward,
    full_check_cases,
    gradient_cases,
    key,
    load_gradients,
    stored_gradients,
)

CASES = gradient_cases()

numpy_env = pytest.mark.skipif("numpy" not in test_backends(),
                               reason="the reference gradients are checked in the numpy env")


def case_ids(case: Case) -> str:
    return key(case)


def test_file_covers_every_case() -> None:
    assert {key(c) for c in CASES} == set(load_gradients())
    for case in CASES:
        inputs, weights, _ = case_data(case)
        expected = {"cotangent", *(f"input.{i}" for i, x in enumerate(inputs) if x.dtype.kind == "f"),
                    *(f"weight.{name}" for name in weights)}
        assert set(stored_gradients(case)) == expected, key(case)


STEP = 1e-6
#: Central differences with this step in float64 agree with the file to about 3e-9 here.
FD_TOLERANCE = 1e-7


def _setup(case: Case) -> tuple[Callable[[], float], dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The case's loss as a function of its (mutable) float64 arrays, those arrays, the file."""
    inputs, weights, call = case_data(case)
    ref = stored_gradients(case)
    C = ref["cotangent"]

    def loss() -> float:
        return float(np.sum(forward(case, inputs, weights, call) * C))

    assert forward(case, inputs, weights, call).shape == C.shape
    arrays = {f"input.{i}": x for i, x in enumerate(inputs) if x.dtype.kind == "f"}
    arrays.update({f"weight.{name}": w for name, w in weights.items()})
    return loss, arrays, ref


def central_difference(loss: Callable[[], float], x: np.ndarray, direction: np.ndarray) -> float:
    """d loss(x + t direction) / dt at t = 0, by central differences (``x`` restored after)."""
    original = x.copy()
    x += STEP * direction
    up = loss()
    x[...] = original - STEP * direction
    down = loss()
    x[...] = original
    return (up - down) / (2 * STEP)


def central_differences(loss: Callable[[], float], x: np.ndarray) -> np.ndarray:
    """d loss / d x by central differences, perturbing ``x`` in place one entry at a time."""
    grad = np.empty_like(x)
    flat = x.reshape(-1)
    for j in range(flat.size):
        original = flat[j]
        flat[j] = original + STEP
        up = loss()
        flat[j] = original - STEP
        down = loss()
        flat[j] = original
        grad.flat[j] = (up - down) / (2 * STEP)
    return grad


@numpy_env
@pytest.mark.parametrize("case", full_check_cases(), ids=case_ids)
def test_file_agrees_with_finite_differences_entry_by_entry(case: Case) -> None:
    loss, arrays, ref = _setup(case)
    for name, x in arrays.items():
        diff = max_diff(central_differences(loss, x), ref[name])
        assert diff <= FD_TOLERANCE, (f"{name}: max |fd - stored| {diff:.3g}; if the reference "
                                      "files changed, rerun python -m tests.reference.gradients")


#: Random unit directions and sampled entries per array in the fast check.
DIRECTIONS, ENTRIES = 2, 3


@numpy_env
@pytest.mark.parametrize("case", CASES, ids=case_ids)
def test_file_agrees_with_directional_differences(case: Case) -> None:
    """For every array: ``<grad, u>`` along random unit directions ``u``, the largest stored
    entry and a few random ones, each against central differences."""
    loss, arrays, ref = _setup(case)
    rng = np.random.default_rng(zlib.crc32(key(case).encode()))
    for name, x in arrays.items():
        grad = ref[name]
        directions = []
        for _ in range(DIRECTIONS):
            u = rng.standard_normal(x.shape)
            directions.append(u / np.linalg.norm(u))
        picks = {int(np.argmax(np.abs(grad))), *rng.integers(0, x.size, ENTRIES).tolist()}
        for j in sorted(picks):
            e = np.zeros(x.size)
            e[j] = 1.0
            directions.append(e.reshape(x.shape))
        for u in directions:
            fd = central_difference(loss, x, u)
            exact = float(np.sum(grad * u))
            assert abs(fd - exact) <= FD_TOLERANCE, (
                f"{name}: finite difference {fd:.10g} != stored {exact:.10g} along a direction; "
                "if the reference files changed, rerun python -m tests.reference.gradients")
