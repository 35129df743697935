"""Every layer x every mask kind on every backend, against the float64 reference files."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.harness import DTYPES, TOLERANCE, Harness, max_diff
from tests.reference.cases import CASES, Case
from tests.reference.generate import load

_FILES: dict[str, Any] = {}


def reference(case: Case) -> dict[str, np.ndarray]:
    if case.layer not in _FILES:
        _FILES[case.layer] = load(case.layer)
    return _FILES[case.layer][case.name]


def run_case(h: Harness, case: Case, dtype: str) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Builds the layer, sets the reference weights, calls it; returns (got, expected)."""
    ref = reference(case)
    layer = h.make(case.layer, case.config, dtype)
    weights = {k[len("weight."):]: v.astype(dtype) for k, v in ref.items() if k.startswith("weight.")}
    if weights:
        layer.set_weights(weights)
    inputs = [h.array(ref[f"input.{name}"], dtype) for name in case.inputs]
    extra = {k[len("call."):]: v for k, v in ref.items() if k.startswith("call.")}
    kwargs: dict[str, Any] = {k: (bool(v) if k == "causal" else h.array(v)) for k, v in extra.items()}
    got: dict[str, np.ndarray] = {}
    if case.layer in ("DotProductAttention", "AdditiveAttention", "MultiHeadAttention"):
        out, attn = h.call(layer, *inputs, return_attention=True, **kwargs)
        got["attention"] = h.numpy(attn)
        got["attention_attr"] = h.numpy(h.attention_weights(layer))
    else:
        out = h.call(layer, *inputs, **kwargs)
        if "output.attention" in ref:
            got["attention_attr"] = h.numpy(h.attention_weights(layer))
    got["out"] = h.numpy(out)
    if "output.P" in ref:
        got["P"] = h.numpy(layer.P)[:, : ref["output.P"].shape[1]]
    expected = {"out": ref["output.out"]}
    if "output.attention" in ref:
        expected["attention_attr"] = ref["output.attention"]
        if "attention" in got:
            expected["attention"] = ref["output.attention"]
    if "output.P" in ref:
        expected["P"] = ref["output.P"]
    return got, expected


def matrix_params() -> list[Any]:
    return [pytest.param(c, id=f"{c.layer}-{c.name}") for c in CASES]


@pytest.mark.parametrize("case", matrix_params())
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_layer_matches_reference(backend: str, case: Case, dtype: str) -> None:
    if dtype not in DTYPES[backend]:
        pytest.skip(f"{backend} is tested in {DTYPES[backend]}")
    got, expected = run_case(Harness(backend), case, dtype)
    assert set(got) == set(expected)
    for key in expected:
        diff = max_diff(got[key], expected[key])
        assert diff <= TOLERANCE[dtype], f"{key}: max |diff| {diff:.3g} > {TOLERANCE[dtype]}"


def test_every_layer_has_reference_cases() -> None:
    from attention_core import LAYER_NAMES

    assert {c.layer for c in CASES} == set(LAYER_NAMES)


@pytest.mark.parametrize("case", matrix_params())
def test_same_weights_same_numbers_as_numpy(backend: str, case: Case) -> None:
    """The same canonical weights in this backend's layer and the NumPy layer (both float32,
    in this process) give outputs within 1e-5 of each other."""
    got, _ = run_case(Harness(backend), case, "float32")
    ours, _ = run_case(Harness("numpy"), case, "float32")
    for key in got:
        diff = max_diff(got[key], ours[key])
        assert diff <= TOLERANCE["float32"], f"{key}: max |diff| from numpy {diff:.3g}"
