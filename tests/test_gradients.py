"""Reference gradients: confirmed by finite differences, matched by every autodiff backend.

The file ``tests/reference/data/gradients.npz`` holds float64 gradients of
``sum(output * cotangent)`` made once by torch autograd (``python -m tests.reference.gradients``).
In the numpy env they are confirmed by central finite differences on the NumPy core, so the
file does not rest on torch. Every backend with autodiff that is being tested must match them
through its ``gradients`` test hook; one without the hook fails rather than passing silently.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from attention_core import registry
from conftest import test_backends
from tests.harness import TOLERANCE, Harness, max_diff
from tests.reference.cases import Case
from tests.reference.gradients import case_data, forward, gradient_cases, key, load_gradients

#: Backends that have automatic differentiation (and so a ``gradients`` hook to provide).
AUTODIFF = ("torch", "tensorflow", "jax", "mxnet")

CASES = gradient_cases()
_STORED: dict[str, dict[str, np.ndarray]] = {}


def stored(case: Case) -> dict[str, np.ndarray]:
    if not _STORED:
        _STORED.update(load_gradients())
    return _STORED[key(case)]


def case_ids(case: Case) -> str:
    return key(case)


def test_file_covers_the_cases() -> None:
    for case in CASES:
        inputs, weights, _ = case_data(case)
        expected = {"cotangent", *(f"input.{i}" for i in range(len(inputs))),
                    *(f"weight.{name}" for name in weights)}
        assert set(stored(case)) == expected


# -- (a) the file against central finite differences, NumPy float64 -------------------------

STEP = 1e-6
#: Central differences with this step in float64 agree with the file to about 3e-9 here.
FD_TOLERANCE = 1e-7


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


@pytest.mark.skipif("numpy" not in test_backends(),
                    reason="the reference gradients are checked in the numpy env")
@pytest.mark.parametrize("case", CASES, ids=case_ids)
def test_file_agrees_with_finite_differences(case: Case) -> None:
    inputs, weights, call = case_data(case)
    ref = stored(case)
    C = ref["cotangent"]

    def loss() -> float:
        return float(np.sum(forward(case, inputs, weights, call) * C))

    assert forward(case, inputs, weights, call).shape == C.shape
    arrays = {f"input.{i}": x for i, x in enumerate(inputs)}
    arrays.update({f"weight.{name}": w for name, w in weights.items()})
    for name, x in arrays.items():
        diff = max_diff(central_differences(loss, x), ref[name])
        assert diff <= FD_TOLERANCE, (f"{name}: max |fd - stored| {diff:.3g}; if the reference "
                                      "files changed, rerun python -m tests.reference.gradients")


# -- (b) every autodiff backend under test against the file ---------------------------------


def autodiff_backends() -> list[str]:
    return [name for name in test_backends() if name in AUTODIFF]


#: Gradients are compared in float32 at the output tolerance. The gradients are up to ~8 in
#: size; torch's float32 ones differ from the file by at most 3e-6.
DTYPE = "float32"


@pytest.mark.parametrize("case", CASES, ids=case_ids)
@pytest.mark.parametrize("name", autodiff_backends())
def test_backend_gradients_match_file(name: str, case: Case) -> None:
    try:
        registry.load(name)
    except (ImportError, ValueError) as err:
        pytest.fail(f"backend {name!r} was asked for in ATTENTION_CORE_TEST_BACKENDS: {err}")
    h = Harness(name)
    if h.hooks is None or not hasattr(h.hooks, "gradients"):
        pytest.fail(f"backend {name!r} has autodiff but tests/hooks/{name}_hooks.py has no "
                    "gradients(layer, inputs, kwargs, cotangent)")
    dtype = DTYPE
    inputs, weights, call = case_data(case)
    layer = h.make(case.layer, case.config, dtype)
    layer.set_weights({n: w.astype(dtype) for n, w in weights.items()})
    kwargs: dict[str, Any] = {k: (v if k == "causal" else h.array(v)) for k, v in call.items()}
    ref = stored(case)
    got = h.hooks.gradients(layer, [h.array(x, dtype) for x in inputs], kwargs,
                            ref["cotangent"].astype(dtype))
    expected = {k: v for k, v in ref.items() if k != "cotangent"}
    assert set(got) == set(expected)
    for k, v in expected.items():
        diff = max_diff(got[k], v)
        assert diff <= TOLERANCE[dtype], f"{k}: max |diff| {diff:.3g} > {TOLERANCE[dtype]}"
