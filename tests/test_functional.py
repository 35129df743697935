"""The functional API on each backend's own arrays, against the float64 reference files."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import attention_core as ac
from tests.harness import TOLERANCE, Harness, max_diff
from tests.reference.cases import CASES, FUNCTION_OPTIONS, Case
from tests.reference.generate import record

FUNCTIONAL = {
    "DotProductAttention": lambda x, w, cfg, kw: ac.dot_product_attention(
        x["queries"], x["keys"], x["values"], return_weights=True, **kw, **_options(cfg)),
    "AdditiveAttention": lambda x, w, cfg, kw: ac.additive_attention(
        x["queries"], x["keys"], x["values"], w, return_weights=True, **kw),
    "MultiHeadAttention": lambda x, w, cfg, kw: ac.multi_head_attention(
        x["queries"], x["keys"], x["values"], w, cfg["num_heads"], return_weights=True, **kw,
        **_options(cfg)),
    "RelativeMultiHeadAttention": lambda x, w, cfg, kw: ac.relative_multi_head_attention(
        x["queries"], x["keys"], x["values"], w, cfg["num_heads"], return_weights=True, **kw),
    "TransformerEncoderBlock": lambda x, w, cfg, kw: ac.transformer_encoder_block(
        x["X"], w, cfg["num_heads"], return_weights=True, **kw),
    "TransformerEncoder": lambda x, w, cfg, kw: ac.transformer_encoder(
        x["tokens"], w, cfg["num_heads"], return_weights=True, **kw),
    "PositionWiseFFN": lambda x, w, cfg, kw: ac.position_wise_ffn(x["X"], w),
    "AddNorm": lambda x, w, cfg, kw: ac.add_norm(x["X"], x["Y"], w),
    "PositionalEncoding": lambda x, w, cfg, kw: ac.positional_encoding(x["X"]),
    "RotaryEmbedding": lambda x, w, cfg, kw: ac.rotary_embedding(
        x["X"], kw.get("start_index"), positions=kw.get("positions"),
        base=cfg.get("base", 10000.0)),
    "NadarayaWatson": lambda x, w, cfg, kw: ac.nadaraya_watson(
        x["queries"], x["keys"], x["values"], w.get("w"), return_weights=True),
}



def _options(config: dict[str, Any]) -> dict[str, Any]:
    """The layer's constructor arguments that the function takes as keywords."""
    return {name: config[name] for name in FUNCTION_OPTIONS if name in config}


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


def _first_weighted_cases() -> list[Any]:
    """One base case of each layer whose function takes weights."""
    seen: dict[str, Any] = {}
    for c in CASES:
        if c.layer in FUNCTIONAL and c.edge is None and c.layer not in seen and any(
                k.startswith("weight.") for k in record(c)):
            seen[c.layer] = pytest.param(c, id=f"{c.layer}-{c.name}")
    return list(seen.values())


@pytest.mark.parametrize("case", _first_weighted_cases())
def test_functional_takes_host_weights(backend: str, case: Case) -> None:
    """Weights as ``get_weights()`` returns them (NumPy float32) go straight into a function."""
    h = Harness(backend)
    ref = record(case)
    x = {k[6:]: h.array(v, "float32") for k, v in ref.items() if k.startswith("input.")}
    w = {k[7:]: np.asarray(v, np.float32) for k, v in ref.items() if k.startswith("weight.")}
    kw = {k[5:]: (bool(v) if k == "call.causal" else h.array(v))
          for k, v in ref.items() if k.startswith("call.")}
    result = FUNCTIONAL[case.layer](x, w, case.config, kw)
    out = result[0] if isinstance(result, tuple) else result
    assert max_diff(h.numpy(out), ref["output.out"]) <= TOLERANCE["float32"]


def test_every_public_function_is_covered() -> None:
    covered = {"dot_product_attention", "additive_attention", "multi_head_attention",
               "relative_multi_head_attention", "transformer_encoder", "transformer_encoder_block",
               "position_wise_ffn", "add_norm",
               "positional_encoding", "nadaraya_watson", "rotary_embedding"}
    functions = {name for name in ac.__all__ if callable(getattr(ac, name, None))
                 and getattr(ac, name).__module__.startswith("attention_core.")
                 and name[0].islower()}
    rest = functions - covered
    # the rest are tested elsewhere against formulas or files (the decoder side against
    # tests/naive.py in tests/test_decoder.py, cached decoding against the full pass in
    # tests/test_cache.py, the searches in tests/test_generation.py, sampling in
    # tests/test_sampling.py, the Hugging Face converter in tests/test_convert_hf.py)
    assert rest == {"transformer_encoder_decoder", "transformer_decoder", "transformer_decoder_block",
                    "greedy_search", "beam_search", "generate", "choose", "decoder_step",
                    "repeat_rows", "alibi_slopes", "hf_config", "from_hf_llama", "to_hf_llama",
                    "masked_softmax", "sinusoidal_encoding", "relative_rotation", "save_weights",
                    "load_weights", "available_backends", "backend", "set_backend",
                    "use_backend"}


def _tracer(backend: str) -> Any:
    """The backend's tracing compiler (None: no tracing, or torch.compile, whose layer path the
    compile mode of tests/test_torch.py covers)."""
    if backend == "jax":
        import jax

        return jax.jit
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.function
    return None


def test_weights_are_checked_once_when_traced(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under jax.jit / tf.function the weights mapping is checked on static shapes while
    tracing (same message as eagerly), and not again when the traced program runs."""
    trace = _tracer(backend)
    if trace is None:
        pytest.skip(f"{backend}: no tracing compiler for functions here")
    from attention_core import weights as W

    h = Harness(backend)
    rng = np.random.default_rng(5)
    q = h.array(rng.standard_normal((2, 4, 8)).astype(np.float32))
    weights = {name: h.array(rng.standard_normal((8, 8)).astype(np.float32))
               for name in ("W_q.kernel", "W_k.kernel", "W_v.kernel", "W_o.kernel")}
    checks = []
    real = W.check_entries
    monkeypatch.setattr(W, "check_entries", lambda *a: (checks.append(1), real(*a))[1])
    f = trace(lambda q, w: ac.multi_head_attention(q, q, q, w, 2))
    eager = h.numpy(ac.multi_head_attention(q, q, q, weights, 2))
    checks.clear()
    for _ in range(3):
        np.testing.assert_allclose(h.numpy(f(q, weights)), eager, rtol=1e-5, atol=1e-6)
    assert len(checks) == 1, "checked on every run, not once at tracing"
    bad = {**weights, "W_o.kernel": h.array(rng.standard_normal((8, 6)).astype(np.float32))}
    with pytest.raises(ValueError) as info:
        f(q, bad)
    # tf.function's autograph puts the traced call's stack before the message
    assert str(info.value).rstrip().endswith(
        "multi_head_attention: W_o.kernel has shape (8, 6), expected (8, 8)")
