"""The cross-backend matrix: every cell of tests/matrix.py against the float64 reference files.

One test per cell (backend x mode x dtype x case). Each compares the output, the returned and
the kept attention weights and, on a backend with autodiff, the gradients by every input and
weight, and records its measurements for the report (tests/report.py) before asserting.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from conftest import test_backends
from tests import report
from tests.harness import (
    DTYPES,
    LOW_PRECISION_UNBOUNDED_GRADIENTS,
    MODES,
    TOLERANCE,
    Harness,
    load,
    max_diff,
    tolerance,
)
from tests.matrix import COMPILED_CASES, Cell, cells, differences, measure
from tests.reference.cases import CASES, MASK_KINDS, MASK_SIDES, Case, mask_parts


def matrix_params() -> list[Any]:
    params = []
    for name in test_backends():
        if name not in DTYPES:  # an unknown backend name: one cell that fails
            params.append(pytest.param(Cell(name, CASES[0], "float32", "eager"), id=name))
            continue
        params += [pytest.param(cell, id=cell.id) for cell in cells(name)]
    return params


_HARNESSES: dict[str, Harness] = {}


def harness(name: str) -> Harness:
    if name not in _HARNESSES:
        try:
            load(name)
        except (ImportError, ValueError) as err:
            pytest.fail(f"backend {name!r} was asked for in ATTENTION_CORE_TEST_BACKENDS: {err}")
        _HARNESSES[name] = Harness(name)
    return _HARNESSES[name]


@pytest.mark.parametrize("cell", matrix_params())
def test_cell_matches_reference(cell: Cell) -> None:
    h = harness(cell.backend)
    got, expected = measure(h, cell.case, cell.dtype, cell.mode)
    diffs = differences(got, expected)
    bounds = {q: tolerance(q, cell.dtype, expected[q]) for q in diffs}
    unbounded = set()
    if cell.dtype in ("float16", "bfloat16") and cell.case.layer in LOW_PRECISION_UNBOUNDED_GRADIENTS:
        unbounded = {q for q in diffs if q.startswith("grad.")}
    failures = [f"{q}: max |diff| {d:.3g} > {bounds[q]:.3g}" for q, d in diffs.items()
                if q not in unbounded and not d <= bounds[q]]
    failures += [f"{q}: not finite" for q in unbounded if not np.isfinite(got[q]).all()]
    report.record(cell, diffs, bounds, unbounded, passed=not failures)
    assert not failures, "; ".join(failures)


# -- the table itself --------------------------------------------------------------------------


def test_every_layer_has_reference_cases() -> None:
    from attention_core import LAYER_NAMES

    assert {c.layer for c in CASES} == set(LAYER_NAMES)


def test_every_attention_layer_has_every_mask_kind() -> None:
    for layer in ("DotProductAttention", "AdditiveAttention", "MultiHeadAttention"):
        assert {c.mask_kind for c in CASES if c.layer == layer and c.edge is None} == set(MASK_KINDS)
    encoder = {c.mask_kind for c in CASES if c.layer == "TransformerEncoderBlock"}
    assert encoder == {k for k in MASK_KINDS if not k.startswith("causal")}  # no causal argument


def test_the_decoder_block_has_every_mask_kind_on_both_attentions() -> None:
    """The block's self-attention (causal: no causal argument) and its cross-attention each
    have every mask kind alone; decoder-only blocks mask their self-attention only; the decoder
    masks both attentions, the encoder-decoder its sources and its targets."""
    block = [c for c in CASES if c.layer == "TransformerDecoderBlock"]
    crossed = {c.mask_kind for c in block if "enc_outputs" in c.inputs}
    kinds = {k for k in MASK_KINDS if not k.startswith("causal")}
    assert crossed >= kinds | {f"enc_{k}" for k in kinds - {"none"}}
    alone = [c.mask_kind or "none" for c in block if "enc_outputs" not in c.inputs]
    assert {p for kind in alone for p, _ in mask_parts(kind)} == {""}
    for layer, prefixes in (("TransformerDecoder", {"", "enc_"}), ("Transformer", {"src_", "tgt_"})):
        used = {p for c in CASES if c.layer == layer for p, _ in mask_parts(c.mask_kind or "none")}
        assert used >= prefixes, layer


def test_compiled_subset_names_real_cases_of_every_layer() -> None:
    names = {(c.layer, c.name) for c in CASES}
    assert set(COMPILED_CASES) == {c.layer for c in CASES}
    for layer, cases in COMPILED_CASES.items():
        assert all((layer, name) in names for name in cases), layer


def options(case: Case) -> set[str]:
    """What a case sets besides its layer and masks: constructor options, call extras, and the
    causal end alignment with fewer keys than queries."""
    config = case.config
    found = {k for k in ("num_kv_heads", "rotary_base", "window", "softcap") if k in config}
    found |= {f"{k}={config[k]}" for k in ("positional", "parametric") if k in config}
    found |= {k for k in ("bias", "decoder_only") if config.get(k)}
    found |= {"keys_only"} if config.get("relative_values") is False else set()
    found |= set(case.extra)
    if case.edge == "keys_shorter" and "causal" in (case.mask_kind or ""):
        found.add("causal_keys_shorter")
    return found


def test_compiled_subset_covers_every_kind_and_option() -> None:
    """The compiled modes' subset (tests/matrix.py) runs every mask kind (bar none), each
    attention of the decoders and the encoder-decoder, and every option of the cases."""
    compiled = [c for c in CASES if c.name in COMPILED_CASES[c.layer]]
    parts = {part for c in compiled for part in mask_parts(c.mask_kind or "none")}
    assert {kind for _, kind in parts} >= set(MASK_KINDS) - {"none"}
    assert {prefix for prefix, _ in parts} == set(MASK_SIDES)
    assert set().union(*map(options, compiled)) == set().union(*map(options, CASES))


def test_every_backend_hook_provides_its_modes(backend: str) -> None:
    h = Harness(backend)
    assert tuple(getattr(h.hooks, "MODES", {})) == MODES[backend]


def test_tolerances_follow_the_design() -> None:
    assert TOLERANCE["float32"] == 1e-5


# -- the same weights in two backends of one process ------------------------------------------


def case_params() -> list[Any]:
    return [pytest.param(c, id=f"{c.layer}-{c.name}") for c in CASES if c.edge is None]


@pytest.mark.parametrize("case", case_params())
def test_same_weights_same_numbers_as_numpy(backend: str, case: Case) -> None:
    """The same canonical weights in this backend's layer and the NumPy layer (both float32,
    in this process) give outputs within 1e-5 of each other."""
    got, _ = measure(Harness(backend), case, "float32", gradients=False)
    ours, _ = measure(Harness("numpy"), case, "float32", gradients=False)
    for key in got:
        diff = max_diff(got[key], ours[key])
        assert diff <= TOLERANCE["float32"], f"{key}: max |diff| from numpy {diff:.3g}"
