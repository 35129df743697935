"""The functional API on each backend's own arrays, against the float64 reference files."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import attention_core as ac
from tests.harness import TOLERANCE, Harness, max_diff
from tests.reference.cases import CASES, Case
from tests.reference.generate import record

FUNCTIONAL = {
    "DotProductAttention": lambda x, w, cfg, kw: ac.dot_product_attention(
        x["queries"], x["keys"], x["values"], return_weights=True, **kw),
    "AdditiveAttention": lambda x, w, cfg, kw: ac.additive_attention(
        x["queries"], x["keys"], x["values"], w, return_weights=True, **kw),
    "MultiHeadAttention": lambda x, w, cfg, kw: ac.multi_head_attention(
        x["queries"], x["keys"], x["values"], w, cfg["num_heads"], return_weights=True, **kw),
    "RelativeMultiHeadAttention": lambda x, w, cfg, kw: ac.relative_multi_head_attention(
        x["queries"], x["keys"], x["values"], w, cfg["num_heads"], return_weights=True, **kw),
    "TransformerEncoderBlock": lambda x, w, cfg, kw: ac.transformer_encoder_block(
        x["X"], w, cfg["num_heads"], return_weights=True, **kw),
    "TransformerEncoder": lambda x, w, cfg, kw: ac.transformer_encoder(
        x["tokens"], w, cfg["num_heads"], return_weights=True, **kw),
    "PositionWiseFFN": lambda x, w, cfg, kw: ac.position_wise_ffn(x["X"], w),
    "AddNorm": lambda x, w, cfg, kw: ac.add_norm(x["X"], x["Y"], w),
    "PositionalEncoding": lambda x, w, cfg, kw: ac.positional_encoding(x["X"]),
    "NadarayaWatson": lambda x, w, cfg, kw: ac.nadaraya_watson(
        x["queries"], x["keys"], x["values"], w.get("w"), return_weights=True),
}



def functional_cases() -> list[Any]:
    """The base shapes (the layers run the edge shapes too, in tests/test_reference_matrix.py)."""
    return [pytest.param(c, id=f"{c.layer}-{c.name}") for c in CASES
            if c.layer in FUNCTIONAL and c.edge is None]


@pytest.mark.parametrize("case", functional_cases())
def test_functional_matches_reference(backend: str, case: Case) -> None:
    h = Harness(backend)
    ref = record(case)
    x = {k[6:]: h.array(v, "float32") for k, v in ref.items() if k.startswith("input.")}
    w = {k[7:]: h.array(v, "float32") for k, v in ref.items() if k.startswith("weight.")}
    kw = {k[5:]: (bool(v) if k == "call.causal" else h.array(v))
          for k, v in ref.items() if k.startswith("call.")}
    result = FUNCTIONAL[case.layer](x, w, case.config, kw)
    out, attn = result if isinstance(result, tuple) else (result, None)
    assert max_diff(h.numpy(out), ref["output.out"]) <= TOLERANCE["float32"]
    if attn is not None:
        got = np.stack([h.numpy(a) for a in attn]) if isinstance(attn, list) else h.numpy(attn)
        assert max_diff(got, ref["output.attention"]) <= TOLERANCE["float32"]


def test_every_public_function_is_covered() -> None:
    covered = {"dot_product_attention", "additive_attention", "multi_head_attention",
               "relative_multi_head_attention", "transformer_encoder", "transformer_encoder_block",
               "position_wise_ffn", "add_norm",
               "positional_encoding", "nadaraya_watson"}
    functions = {name for name in ac.__all__ if callable(getattr(ac, name, None))
                 and getattr(ac, name).__module__.startswith("attention_core.")
                 and name[0].islower()}
    rest = functions - covered
    # the rest are tested elsewhere against formulas or files
    assert rest == {"masked_softmax", "sinusoidal_encoding", "relative_rotation", "save_weights",
                    "load_weights", "available_backends", "backend", "set_backend",
                    "use_backend"}
