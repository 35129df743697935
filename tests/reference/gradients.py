"""Generates the float64 reference gradients: ``python -m tests.reference.gradients`` (needs torch).

For every case of :mod:`tests.reference.cases` (every layer, every mask kind, every edge shape),
the inputs, call arguments and weights are read from the reference files of
:mod:`tests.reference.generate`, a cotangent ``C`` of the output's shape is drawn from a
generator seeded by the case's name, and the gradients of ``loss = sum(output * C)`` with
respect to every input and every weight are computed once, in float64, by torch autograd
through the core's functional API. They are written to
``tests/reference/data/gradients.npz`` with keys ``"<layer>/<case>::<name>"``, ``<name>`` being
``cotangent``, ``input.<i>`` (inputs by position) or ``weight.<canonical name>``, the names the
``gradients`` test hook returns. ``tests/test_gradients.py`` confirms the file by central
finite differences on the NumPy core, and compares every autodiff backend with it.
"""

from __future__ import annotations

import sys
import zlib
from pathlib import Path
from typing import Any

import numpy as np

import attention_core as ac
from attention_core.multihead import HeadOptions
from attention_core.positional import add_positions
from tests.reference.cases import CASES, Case, function_options
from tests.reference.generate import load

PATH = Path(__file__).parent / "data" / "gradients.npz"

#: Cases whose gradients are also checked entry by entry by finite differences (the others by
#: directional differences and sampled entries, see tests/test_gradients.py), by layer.
FULL_CHECK_CASES = {
    "DotProductAttention": ("mask_4d", "keys_shorter-causal", "softcap_bias-fully_masked_row"),
    "MultiHeadAttention": (
        "valid_lens_1d_bias", "mask_4d", "causal_valid_lens_bias", "fully_masked_row_bias",
        "llama-causal_valid_lens", "gqa-mask_4d", "alibi-fully_masked_row", "rotary-causal",
    ),
    "RotaryEmbedding": ("heads-start",),
    "AdditiveAttention": ("none", "valid_lens_2d", "causal", "fully_masked_row"),
    "TransformerEncoderBlock": ("none", "valid_lens_1d", "mask_3d", "fully_masked_row"),
    "RelativeMultiHeadAttention": ("valid_lens_2d", "mask_4d", "causal", "keys_only-fully_masked_row"),
    "TransformerEncoder": ("valid_lens_1d", "fully_masked_row"),
    "TransformerDecoderBlock": ("fully_masked_row+enc_fully_masked_row_bias",
                                "decoder_only-mask_4d_bias"),
    "TransformerDecoder": ("valid_lens_2d+enc_fully_masked_row", "decoder_only-llama-valid_lens_1d"),
    "Transformer": ("src_valid_lens_1d_zero+tgt_valid_lens_1d",),
    "PositionalEncoding": ("width_7",),
    "LearnedPositionalEncoding": ("basic",),
    "PositionWiseFFN": ("basic",),
    "AddNorm": ("basic",),
    "NadarayaWatson": ("parametric", "plain_unbatched"),
}


def gradient_cases() -> list[Case]:
    """Every case: each has floating inputs or weights, so each has gradients to compare."""
    return list(CASES)


def full_check_cases() -> list[Case]:
    """The :class:`Case` objects named in :data:`FULL_CHECK_CASES`, in that order."""
    by_name = {(c.layer, c.name): c for c in CASES}
    return [by_name[layer, name] for layer, names in FULL_CHECK_CASES.items() for name in names]


def key(case: Case) -> str:
    """The prefix of a case's entries in the gradients file."""
    return f"{case.layer}/{case.name}"


_FILES: dict[str, dict[str, dict[str, np.ndarray]]] = {}


def case_data(case: Case) -> tuple[list[np.ndarray], dict[str, np.ndarray], dict[str, Any]]:
    """A case's float64 inputs (by position), weights and call arguments, from the files
    (copies: a caller may change them in place)."""
    if case.layer not in _FILES:
        _FILES[case.layer] = load(case.layer)
    ref = {name: value.copy() for name, value in _FILES[case.layer][case.name].items()}
    inputs = [ref[f"input.{name}"] for name in case.inputs]
    weights = {k[len("weight."):]: v for k, v in ref.items() if k.startswith("weight.")}
    call: dict[str, Any] = {k[len("call."):]: v for k, v in ref.items() if k.startswith("call.")}
    if "causal" in call:
        call["causal"] = bool(call["causal"])
    return inputs, weights, call


def forward(case: Case, inputs: list[Any], weights: dict[str, Any], call: dict[str, Any]) -> Any:
    """The case's layer as the core's function of its inputs and weights (any backend)."""
    heads = case.config.get("num_heads", 1)
    options = function_options(case)
    if case.layer == "DotProductAttention":
        queries, keys, values = inputs
        return ac.dot_product_attention(queries, keys, values, **call, **options)
    if case.layer == "MultiHeadAttention":
        queries, keys, values = inputs
        return ac.multi_head_attention(queries, keys, values, weights, heads, **call, **options)
    if case.layer == "RotaryEmbedding":
        (X,) = inputs
        return ac.rotary_embedding(X, call.get("start_index"), positions=call.get("positions"),
                                   base=case.config.get("base", 10000.0))
    if case.layer == "RelativeMultiHeadAttention":
        queries, keys, values = inputs
        return ac.relative_multi_head_attention(queries, keys, values, weights, heads, **call)
    if case.layer == "TransformerEncoder":
        (tokens,) = inputs
        return ac.transformer_encoder(tokens, weights, heads, **call)
    if case.layer == "TransformerDecoderBlock":
        X, *enc_outputs = inputs  # no encoder outputs: decoder-only
        return ac.transformer_decoder_block(X, weights, heads, *enc_outputs, **call,
                                            options=HeadOptions(**options))
    if case.layer == "TransformerDecoder":
        tokens, *enc_outputs = inputs
        return ac.transformer_decoder(tokens, weights, heads, *enc_outputs, **call,
                                      options=HeadOptions(**options))
    if case.layer == "Transformer":
        src_tokens, tgt_tokens = inputs
        return ac.transformer_encoder_decoder(src_tokens, tgt_tokens, weights, heads, **call)
    if case.layer == "AdditiveAttention":
        queries, keys, values = inputs
        return ac.additive_attention(queries, keys, values, weights, **call)
    if case.layer == "TransformerEncoderBlock":
        (X,) = inputs
        return ac.transformer_encoder_block(X, weights, heads, **call)
    if case.layer == "PositionalEncoding":
        (X,) = inputs
        return ac.positional_encoding(X)
    if case.layer == "LearnedPositionalEncoding":
        (X,) = inputs
        return add_positions(X, weights["P"])
    if case.layer == "PositionWiseFFN":
        (X,) = inputs
        return ac.position_wise_ffn(X, weights)
    if case.layer == "AddNorm":
        X, Y = inputs
        return ac.add_norm(X, Y, weights)
    if case.layer == "NadarayaWatson":
        queries, keys, values = inputs
        return ac.nadaraya_watson(queries, keys, values, weights.get("w"))
    raise ValueError(f"no reference gradients for {case.layer}")


def cotangent(case: Case, shape: tuple[int, ...]) -> np.ndarray:
    """The cotangent ``C`` of a case, drawn from a generator seeded by the case's name."""
    rng = np.random.default_rng(zlib.crc32(f"gradients/{key(case)}".encode()))
    return rng.standard_normal(shape)


def compute_case(case: Case) -> dict[str, np.ndarray]:
    """The cotangent and the float64 gradients of one case, by torch autograd."""
    import torch

    inputs, weights, call = case_data(case)
    x = [torch.tensor(a) if a.dtype.kind in "iu"  # token ids: no gradient
         else torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in inputs]
    w = {n: torch.tensor(a, dtype=torch.float64, requires_grad=True) for n, a in weights.items()}
    out = forward(case, x, w, call)
    C = cotangent(case, tuple(out.shape))
    (out * torch.from_numpy(C)).sum().backward()
    grads = {f"input.{i}": t.grad for i, t in enumerate(x) if t.is_floating_point()}
    grads.update({f"weight.{n}": t.grad for n, t in w.items()})
    record = {"cotangent": C}
    for name, grad in grads.items():
        assert grad is not None, name
        record[name] = grad.numpy()
    return record


_READ: dict[str, dict[str, np.ndarray]] = {}


def _read() -> dict[str, dict[str, np.ndarray]]:
    """The file, read once per process (some 50,000 arrays, a second or two), read-only."""
    if not _READ:
        with np.load(PATH) as data:
            for full in data.files:
                prefix, _, name = full.partition("::")
                array = data[full]
                array.flags.writeable = False
                _READ.setdefault(prefix, {})[name] = array
    return _READ


def load_gradients() -> dict[str, dict[str, np.ndarray]]:
    """The file: ``"<layer>/<case>"`` -> {name: array}; the arrays are read-only, and each
    call gets new dicts."""
    return {case: dict(arrays) for case, arrays in _read().items()}


def stored_gradients(case: Case) -> dict[str, np.ndarray]:
    """One case's ``cotangent`` and float64 gradients (read-only arrays, a new dict)."""
    return dict(_read()[key(case)])


def main(argv: list[str]) -> int:
    """Writes the gradients file; with ``--new``, only the cases it lacks are computed."""
    kept = load_gradients() if "--new" in argv and PATH.exists() else {}
    arrays = {f"{key(case)}::{name}": value
              for case in gradient_cases()
              for name, value in (kept.get(key(case)) or compute_case(case)).items()}
    np.savez_compressed(PATH, **arrays)  # type: ignore[arg-type]
    print(f"wrote {PATH} ({len(arrays)} arrays, {len(kept)} cases kept)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
