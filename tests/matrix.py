"""The cross-backend matrix, generated from one table: cases x dtypes x modes, per backend.

* cases: :data:`tests.reference.cases.CASES` (every layer, every mask kind, the edge shapes;
  the decoder layers with the masks of their self- and cross-attention, on the base shapes);
* dtypes: :data:`tests.harness.DTYPES` (tolerances in :data:`tests.harness.TOLERANCE`);
* modes: :data:`tests.harness.MODES`, run by the ``MODES`` hook of each backend.

Every cell builds the layer in its dtype, sets the reference weights, calls it on the reference
inputs (in the cell's mode) and compares, with the float64 reference files, the output, the
returned attention weights, the kept ones (attribute or sown; a decoder layer's nested list
array by array), and, on a backend with autodiff, the gradients of ``sum(output * cotangent)``
by every input and every weight.

Which cells run (:func:`cells`):

* eager, and ``hybridize()`` (which costs milliseconds): every case in float32 and float64;
  in float16 and bfloat16 every layer with every mask kind on the base shapes (the cases
  whose ``edge`` is None). The edge shapes test shape handling (broadcasting, squeezing, the
  causal end alignment), which does not depend on the dtype; the dtype's own risks (the fill
  value of masked scores, fully masked rows, overflow) are in every mask kind. It also keeps
  JAX within time: its eager mode compiles every primitive for each new shape and dtype
  (about 30 ms each on two cores), so its cost grows with the number of shape families per
  dtype (2 to 7 s each), hardly with the number of cells. The JAX columns (Keras on JAX,
  NNX) run one half precision each (:data:`COLUMN_HALF`); the jax env runs both.
* ``torch.compile``, ``tf.function(jit_compile=True)`` and ``jax.jit`` cost seconds per cell
  (one compilation of the forward and backward program each; 5 to 37 s for Inductor on two
  cores, the stacks the dearest), so they run :data:`COMPILED_CASES` in float32: each layer
  once or twice, chosen so that across the subset every layer class, every mask kind (the
  decoders' cross-attention and the encoder-decoder's source and target masks too) and every
  option (projection biases, each ``MultiHeadAttention`` option, a score bias, relative
  positions with and without values, decoder-only blocks, the rotary start index and
  positions, the causal end alignment with fewer keys than queries) runs at least once;
  :func:`tests.test_reference_matrix.test_compiled_subset_covers_every_kind_and_option`
  checks it. The mask kinds in each layer, and their combinations, are the eager modes'.
  Keras on torch compiles with the torch env's ``torch.compile``: it runs the subset's
  attention layers only (:data:`COMPILED_LAYERS`), where Keras' own layer code meets it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from attention_core.declarations import leaves
from tests.harness import AUTODIFF, DTYPES, MODES, Harness, max_diff
from tests.reference.cases import CASES, Case
from tests.reference.generate import RETURNS_ATTENTION, record
from tests.reference.gradients import stored_gradients

#: Modes cheap enough to run the whole matrix.
FULL_MODES = ("eager", "hybridize")
#: Dtypes that run every case in :data:`FULL_MODES`.
FULL_DTYPES = ("float32", "float64")
#: Dtypes of the other modes.
COMPILED_DTYPES = ("float32",)
#: Cases of the other modes, by layer.
COMPILED_CASES = {
    "DotProductAttention": ("keys_shorter-causal", "softcap_bias-fully_masked_row"),
    "AdditiveAttention": ("mask_3d",),
    "MultiHeadAttention": ("llama-causal_valid_lens", "alibi-fully_masked_row"),
    "RotaryEmbedding": ("heads-start", "positions_2d"),
    "TransformerEncoderBlock": ("valid_lens_1d",),
    "RelativeMultiHeadAttention": ("valid_lens_2d", "keys_only-fully_masked_row"),
    "TransformerEncoder": ("mask_2d",),
    "TransformerDecoderBlock": ("decoder_only-llama-mask_4d",),
    "TransformerDecoder": ("valid_lens_2d+enc_fully_masked_row",),
    "Transformer": ("src_valid_lens_1d+tgt_valid_lens_2d",),
    "PositionalEncoding": ("width_7",),
    "LearnedPositionalEncoding": ("basic",),
    "PositionWiseFFN": ("basic",),
    "AddNorm": ("basic",),
    "NadarayaWatson": ("parametric", "plain_unbatched"),
}

#: The half precision each JAX column runs in its full modes: one each, in every case. Their
#: adapters cast for float16 and bfloat16 alike, and the jax env runs both on the same ops
#: (eager JAX compiles each primitive per shape and dtype: about 1 s a cell here).
COLUMN_HALF = {"keras-jax": "bfloat16", "nnx": "float16"}

#: Backends whose compiled mode runs the subset's cases of these layers only: Keras on torch
#: hands the same programs to the same compiler as the torch env (10 to 21 s a cell here).
COMPILED_LAYERS = {"keras-torch": ("DotProductAttention", "MultiHeadAttention",
                                   "TransformerDecoderBlock")}


@dataclass(frozen=True)
class Cell:
    """One cell of the matrix."""

    backend: str
    case: Case
    dtype: str
    mode: str

    @property
    def id(self) -> str:
        return f"{self.backend}-{self.mode}-{self.dtype}-{self.case.layer}-{self.case.name}"


def runs(case: Case, dtype: str, mode: str, backend: str | None = None) -> bool:
    """Whether the matrix has the cell (see the module docstring)."""
    if mode in FULL_MODES:
        if dtype not in FULL_DTYPES and COLUMN_HALF.get(backend or "", dtype) != dtype:
            return False
        return dtype in FULL_DTYPES or case.edge is None
    layers = COMPILED_LAYERS.get(backend or "")
    return (dtype in COMPILED_DTYPES and case.name in COMPILED_CASES[case.layer]
            and (layers is None or case.layer in layers))


def cells(backend: str) -> list[Cell]:
    """Every cell of one backend, mode by mode, dtype by dtype, case by case."""
    return [Cell(backend, case, dtype, mode) for mode in MODES[backend]
            for dtype in DTYPES[backend] for case in CASES if runs(case, dtype, mode, backend)]


def reference(case: Case) -> dict[str, np.ndarray]:
    """The case's record in the reference files (``input.*``, ``call.*``, ``weight.*``, ``output.*``)."""
    return record(case)


def weight_array(value: np.ndarray, dtype: str) -> np.ndarray:
    """A reference weight rounded to ``dtype`` (bfloat16, which NumPy lacks: float32, which
    every backend's ``set_weights`` casts to its parameters' dtype)."""
    return value.astype(np.float32 if dtype == "bfloat16" else dtype)


def measure(h: Harness, case: Case, dtype: str, mode: str = "eager",
            gradients: bool | None = None) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Runs one cell; returns what it computed and what the reference files say, by quantity.

    Quantities: ``out``, ``attention`` (returned), ``attention_attr`` (kept or sown; a
    decoder layer's nested list as ``attention_attr.<i>``, one per array), ``P`` (the
    positional table), and ``grad.input.<i>`` / ``grad.weight.<name>``.
    """
    ref = reference(case)
    if gradients is None:
        gradients = h.name in AUTODIFF
    layer = h.make(case.layer, case.config, dtype)
    weights = {k[len("weight."):]: weight_array(v, dtype)
               for k, v in ref.items() if k.startswith("weight.")}
    if weights:
        layer.set_weights(weights)
    inputs = [h.array(ref[f"input.{name}"], dtype) for name in case.inputs]
    call = {k[len("call."):]: v for k, v in ref.items() if k.startswith("call.")}
    static = {"causal": bool(call.pop("causal"))} if "causal" in call else {}
    names = sorted(call)  # valid_lens, mask: arrays, passed to the mode like the inputs
    arrays = [*inputs, *(h.array(call[n]) for n in names)]
    n_inputs = len(inputs)
    kept = kept_references(ref)
    keeps = bool(kept)
    cotangent = stored_gradients(case)["cotangent"] if gradients else None

    def fn(layer: Any, *arrays: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        kwargs = dict(zip(names, arrays[n_inputs:], strict=True), **static)

        def forward(layer: Any, *xs: Any) -> dict[str, Any]:
            if case.layer in RETURNS_ATTENTION:
                out, attention = h.call(layer, *xs, return_attention=True, **kwargs)
                return {"out": out, "attention": attention,
                        "attention_attr": h.attention_weights(layer)}
            result = {"out": h.call(layer, *xs, **kwargs)}
            if keeps:
                result["attention_attr"] = h.attention_weights(layer)
            return result

        xs = list(arrays[:n_inputs])
        if cotangent is not None:
            return h.forward_and_gradients(layer, forward, xs, cotangent)
        return forward(layer, *xs), {}

    result, grads = h.run(mode, layer, fn, arrays)
    nested = keeps and "attention_attr" not in kept
    got = {}
    for name, value in result.items():
        got.update(_leaves(h, name, value) if nested and name == "attention_attr"
                   else {name: _stacked(h, value)})
    got.update({f"grad.{name}": h.numpy(value) for name, value in grads.items()})
    expected = {"out": ref["output.out"], **kept}
    if keeps and case.layer in RETURNS_ATTENTION:
        expected["attention"] = ref["output.attention"]
    if "output.P" in ref:
        got["P"] = h.numpy(layer.P)[:, : ref["output.P"].shape[1]]
        expected["P"] = ref["output.P"]
    if cotangent is not None:
        expected.update({f"grad.{k}": v for k, v in stored_gradients(case).items()
                         if k != "cotangent"})
    return got, expected


def kept_references(ref: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The kept attention weights a record holds, by quantity: ``attention_attr`` (one array,
    or the encoder's blocks stacked), or ``attention_attr.<i>`` per array of a nested list (the
    decoder layers'); none if the layer keeps none."""
    if "output.attention" in ref:
        return {"attention_attr": ref["output.attention"]}
    prefix = "output.attention."
    return {f"attention_attr.{key[len(prefix):]}": value for key, value in ref.items()
            if key.startswith(prefix)}


def _leaves(h: Harness, name: str, value: Any) -> dict[str, np.ndarray]:
    """A nested list of computed arrays as float64 NumPy, ``<name>.<i>`` in the order of
    :func:`attention_core.declarations.leaves` (Flax may give tuples for lists)."""
    return {f"{name}.{i}": h.numpy(leaf) for i, leaf in enumerate(leaves(value))}


def _stacked(h: Harness, value: Any) -> np.ndarray:
    """A computed array as float64 NumPy; a list (one array per encoder block) stacked first."""
    if isinstance(value, (list, tuple)):
        return np.stack([h.numpy(v) for v in value])
    return h.numpy(value)


def differences(got: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> dict[str, float]:
    """max |got - expected| per quantity; the quantities must be the same."""
    assert set(got) == set(expected), (
        f"computed {sorted(got)}, the reference has {sorted(expected)}")
    return {name: max_diff(got[name], expected[name]) for name in sorted(expected)}
