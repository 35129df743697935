"""Generates the float64 reference files: ``python -m tests.reference.generate``.

For each case of :mod:`tests.reference.cases`, inputs and weights are drawn from a generator
seeded by the case's name, and outputs are computed in float64 by the NumPy layers. Biases,
``gamma`` and ``beta`` are drawn at random too, so that no term of the computation is hidden
by a zero or a one. One ``.npz`` per layer is written under ``tests/reference/data``; keys are
``"<case>::<group>.<name>"`` with group ``input``, ``call``, ``weight`` or ``output``. The
attention weights a layer keeps are ``output.attention``: one array, or the blocks' stacked
(the encoder's); a layer that keeps a nested list (the decoder layers: ``[self, cross]`` ...)
has one ``output.attention.<i>`` per array instead, in the order of
:func:`attention_core.declarations.leaves`.
"""

from __future__ import annotations

import sys
import zlib
from pathlib import Path
from typing import Any

import numpy as np

import backends.numpy as np_layers
from attention_core.declarations import leaves
from tests.reference.cases import CASES, INTEGER_INPUTS, Case, case_masks

DATA = Path(__file__).parent / "data"

#: Layers whose call takes ``return_attention`` (the others keep their weights only).
RETURNS_ATTENTION = ("DotProductAttention", "AdditiveAttention", "MultiHeadAttention",
                     "RelativeMultiHeadAttention")


def _rng(case: Case) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(f"{case.layer}/{case.name}".encode()))


def call_arguments(
    case: Case, rng: np.random.Generator
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Draws a case's inputs (float64, or int64 token ids) and masking arguments."""
    inputs = {name: (rng.integers(0, case.config[INTEGER_INPUTS[name]], shape)
                     if name in INTEGER_INPUTS else rng.standard_normal(shape))
              for name, shape in case.inputs.items()}
    extra: dict[str, Any] = {}
    if case.mask_kind is not None:
        extra = case_masks(case.mask_kind, case.inputs, rng, case.heads)
    extra.update(_other_arguments(case, rng))
    return inputs, extra


def _other_arguments(case: Case, rng: np.random.Generator) -> dict[str, Any]:
    """The call arguments of ``case.extra`` (see :class:`tests.reference.cases.Case`)."""
    out: dict[str, Any] = {}
    first = next(iter(case.inputs.values()))
    if "score_bias" in case.extra:
        b, q, k = first[0], first[1], case.inputs["keys"][1]
        shape = {2: (q, k), 3: (b, q, k), 4: (b, case.heads, q, k)}[case.extra["score_bias"]]
        bias = rng.standard_normal(shape)
        if len(shape) == 4:  # a score of -inf: no weight where visible, nothing where hidden
            bias[0, 0, 0, 0] = -np.inf
        out["score_bias"] = bias
    if "start_index" in case.extra:
        out["start_index"] = np.asarray(case.extra["start_index"], dtype=np.int64)
    if "positions" in case.extra:
        out["positions"] = rng.integers(0, 100, size=case.extra["positions"]).astype(np.int64)
    return out


def randomise(weights: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Replaces constant initial values (zero biases, unit gammas) by random ones."""
    out = {}
    for name, value in weights.items():
        leaf = name.rpartition(".")[2]
        if leaf in ("bias", "beta"):
            value = 0.1 * rng.standard_normal(value.shape)
        elif leaf == "gamma":
            value = 1.0 + 0.1 * rng.standard_normal(value.shape)
        elif leaf == "w":
            value = 0.5 + rng.random(value.shape)
        out[name] = value
    return out


def run(
    layer: Any, case: Case, inputs: dict[str, np.ndarray], extra: dict[str, Any]
) -> dict[str, np.ndarray]:
    """Calls a NumPy layer the way the case says; returns its output and attention weights."""
    args = list(inputs.values())
    if case.layer in RETURNS_ATTENTION:
        out, attn = layer(*args, return_attention=True, **extra)
        return {"out": out, "attention": attn}
    out = layer(*args, **extra)
    result = {"out": out}
    kept = layer.attention_weights
    if layer.attention_kind == "nested":  # arrays of several shapes: one key each, in order
        result.update({f"attention.{i}": leaf for i, leaf in enumerate(leaves(kept))})
    elif isinstance(kept, list):  # one array per block: (blocks, B, H, T, T)
        result["attention"] = np.stack(kept)
    elif kept is not None:
        result["attention"] = kept
    return result


def compute_case(case: Case) -> dict[str, np.ndarray]:
    """Inputs, call arguments, weights and float64 outputs of one case, as flat arrays."""
    rng = _rng(case)
    inputs, extra = call_arguments(case, rng)
    layer = getattr(np_layers, case.layer)(**case.config, seed=0, dtype="float64")
    if not layer.built:  # infer input sizes by a first call
        run(layer, case, inputs, extra)
    weights = randomise(layer.get_weights(), rng)
    layer.set_weights(weights)
    outputs = run(layer, case, inputs, extra)
    record: dict[str, np.ndarray] = {}
    record.update({f"input.{k}": v for k, v in inputs.items()})
    record.update({f"call.{k}": np.asarray(v) for k, v in extra.items()})
    record.update({f"weight.{k}": v for k, v in weights.items()})
    record.update({f"output.{k}": np.asarray(v, dtype=np.float64) for k, v in outputs.items()})
    if case.layer == "PositionalEncoding":
        record["output.P"] = layer.P
    return record


def compute_all() -> dict[str, dict[str, np.ndarray]]:
    """Every layer's file contents: layer -> {"<case>::<key>": array}."""
    files: dict[str, dict[str, np.ndarray]] = {}
    for case in CASES:
        record = compute_case(case)
        files.setdefault(case.layer, {}).update(
            {f"{case.name}::{key}": value for key, value in record.items()}
        )
    return files


def load(layer: str) -> dict[str, dict[str, np.ndarray]]:
    """Reads one layer's file: case name -> {"<group>.<name>": array}."""
    cases: dict[str, dict[str, np.ndarray]] = {}
    with np.load(DATA / f"{layer}.npz") as data:
        for key in data.files:
            case, _, field = key.partition("::")
            cases.setdefault(case, {})[field] = data[key]
    return cases


_LOADED: dict[str, dict[str, dict[str, np.ndarray]]] = {}


def record(case: Case) -> dict[str, np.ndarray]:
    """One case's stored record (``input.*``, ``call.*``, ``weight.*``, ``output.*``), each
    layer's file read once per process."""
    if case.layer not in _LOADED:
        _LOADED[case.layer] = load(case.layer)
    return _LOADED[case.layer][case.name]


def main() -> int:
    """Writes every reference file."""
    DATA.mkdir(exist_ok=True)
    for layer, arrays in compute_all().items():
        np.savez_compressed(DATA / f"{layer}.npz", **arrays)
        print(f"wrote {DATA / (layer + '.npz')} ({len(arrays)} arrays)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
