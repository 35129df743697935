"""The reference files: current with the generator, and right by an independent computation."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import test_backends
from tests import naive
from tests.reference.cases import CASES, Case
from tests.reference.generate import compute_case, load, record

pytestmark = pytest.mark.skipif(
    "numpy" not in test_backends(), reason="the reference files are checked in the numpy env"
)

stored = record


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.layer}-{c.name}")
def test_files_are_current(case: Case) -> None:
    """Regenerating in memory gives the stored arrays within 1e-12 (rerun the generator if not)."""
    fresh, old = compute_case(case), stored(case)
    assert sorted(fresh) == sorted(old)
    for key, value in fresh.items():
        assert value.shape == old[key].shape, key
        if value.dtype.kind in "fc":
            same = value == old[key]  # also the infinities (a score_bias of -inf)
            assert np.max(np.abs(np.where(same, 0.0, value - old[key])), initial=0.0) <= 1e-12, key
        else:
            assert np.array_equal(value, old[key]), key


def naive_outputs(case: Case, ref: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The case recomputed by tests/naive.py from the stored inputs and weights."""
    x = {k[6:]: v for k, v in ref.items() if k.startswith("input.")}
    w = {k[7:]: v for k, v in ref.items() if k.startswith("weight.")}
    call = {k[5:]: v for k, v in ref.items() if k.startswith("call.")}
    masks = {"valid_lens": call.get("valid_lens"), "mask": call.get("mask"),
             "causal": bool(call.get("causal", False))}
    if case.layer in DECODER_LAYERS:
        out, kept = naive_decoder(case, x, w, call)
        return {"output.out": out, **{f"output.attention.{i}": a for i, a in enumerate(kept)}}
    cfg = case.config
    scored = {"positional": cfg.get("positional"), "rotary_base": cfg.get("rotary_base", 1e4),
              "softcap": cfg.get("softcap"), "score_bias": call.get("score_bias")}
    masks["window"] = cfg.get("window")
    if case.layer == "DotProductAttention":
        q, k, v = x["queries"], x["keys"], x["values"]
        vis = naive.visible(q.shape[0], 1, q.shape[1], k.shape[1], **masks)
        out, att = naive.dot_product(q[:, None], k[:, None], v[:, None], vis, **scored)
        return {"output.out": out[:, 0], "output.attention": att}
    if case.layer == "RotaryEmbedding":
        X = x["X"]
        T = X.shape[1]
        positions = call.get("positions", int(call.get("start_index", 0)) + np.arange(T))
        rows = [positions] * X.shape[0] if positions.ndim == 1 else list(positions)
        base = cfg.get("base", 1e4)
        if X.ndim == 3:
            out = np.stack([naive.rotary(X[b], list(rows[b]), base) for b in range(len(X))])
        else:  # (B, T, H, d): each head's (T, d)
            out = np.stack([np.stack([naive.rotary(X[b, :, h], list(rows[b]), base)
                                      for h in range(X.shape[2])], 1) for b in range(len(X))])
        return {"output.out": out}
    if case.layer == "AdditiveAttention":
        q, k = x["queries"], x["keys"]
        vis = naive.visible(q.shape[0], 1, q.shape[1], k.shape[1], **masks)
        out, att = naive.additive(q, k, x["values"], w, vis)
        return {"output.out": out, "output.attention": att}
    if case.layer == "MultiHeadAttention":
        q, k = x["queries"], x["keys"]
        H = case.config["num_heads"]
        vis = naive.visible(q.shape[0], H, q.shape[1], k.shape[1], **masks)
        out, att = naive.multi_head(q, k, x["values"], w, H, vis,
                                    num_kv_heads=cfg.get("num_kv_heads"), **scored)
        return {"output.out": out, "output.attention": att}
    if case.layer == "RelativeMultiHeadAttention":
        q, k = x["queries"], x["keys"]
        H = case.config["num_heads"]
        vis = naive.visible(q.shape[0], H, q.shape[1], k.shape[1], **masks)
        out, att = naive.relative_multi_head(q, k, x["values"], w, H, vis)
        return {"output.out": out, "output.attention": att}
    if case.layer == "TransformerEncoder":
        tokens = x["tokens"]
        H = case.config["num_heads"]
        vis = naive.visible(tokens.shape[0], H, tokens.shape[1], tokens.shape[1], **masks)
        out, atts = naive.transformer_encoder(tokens, w, H, vis)
        return {"output.out": out, "output.attention": np.stack(atts)}
    if case.layer == "TransformerEncoderBlock":
        X = x["X"]
        H = case.config["num_heads"]
        vis = naive.visible(X.shape[0], H, X.shape[1], X.shape[1], **masks)
        out, att = naive.encoder_block(X, w, H, vis)
        return {"output.out": out, "output.attention": att}
    if case.layer == "PositionalEncoding":
        cfg = case.config
        P = naive.pe_table(cfg["max_len"], cfg["num_hiddens"])[None]
        T = x["X"].shape[1]
        return {"output.out": x["X"] + P[:, :T], "output.P": P}
    if case.layer == "LearnedPositionalEncoding":
        return {"output.out": x["X"] + w["P"][:, : x["X"].shape[1]]}
    if case.layer == "PositionWiseFFN":
        return {"output.out": naive.ffn(x["X"], w)}
    if case.layer == "AddNorm":
        return {"output.out": naive.add_norm(x["X"], x["Y"], w)}
    if case.layer == "NadarayaWatson":
        width = float(w["w"][0]) if "w" in w else 1.0
        out, att = naive.nadaraya_watson(x["queries"], x["keys"], x["values"], width)
        return {"output.out": out, "output.attention": att}
    raise AssertionError(case.layer)


DECODER_LAYERS = ("TransformerDecoderBlock", "TransformerDecoder", "Transformer")


def naive_decoder(case: Case, x: dict[str, np.ndarray], w: dict[str, np.ndarray],
                  call: dict[str, np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
    """A decoder case recomputed by tests/naive.py: its output and its kept attention weights,
    flattened in order (``[self, cross]``; a stack's per kind, block by block)."""
    H = case.config["num_heads"]
    if case.layer == "Transformer":
        src, tgt = x["src_tokens"], x["tgt_tokens"]
        (B, S), T = src.shape, tgt.shape[1]
        lens = call.get("src_valid_lens")
        enc, enc_kept = naive.transformer_encoder(src, naive.sub(w, "encoder"), H,
                                                  naive.visible(B, H, S, S, lens))
        out, kept = naive.transformer_decoder(
            tgt, naive.sub(w, "decoder"), H,
            naive.visible(B, H, T, T, call.get("tgt_valid_lens"), causal=True), enc,
            naive.visible(B, H, T, S, lens))
        return out, [*enc_kept, *(a for per_kind in kept for a in per_kind)]
    first = x["X"] if case.layer == "TransformerDecoderBlock" else x["tokens"]
    B, T = first.shape[:2]
    enc = x.get("enc_outputs")
    cfg = case.config
    self_vis = naive.visible(B, H, T, T, call.get("valid_lens"), call.get("mask"), causal=True,
                             window=cfg.get("window"))
    attention = {"num_kv_heads": cfg.get("num_kv_heads"), "positional": cfg.get("positional"),
                 "rotary_base": cfg.get("rotary_base", 1e4), "softcap": cfg.get("softcap")}
    cross_vis = None if enc is None else naive.visible(B, H, T, enc.shape[1],
                                                       call.get("enc_valid_lens"),
                                                       call.get("enc_mask"))
    if case.layer == "TransformerDecoderBlock":
        return naive.decoder_block(first, w, H, self_vis, enc, cross_vis, attention)
    out, kept = naive.transformer_decoder(first, w, H, self_vis, enc, cross_vis, attention)
    return out, [a for per_kind in kept for a in per_kind]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.layer}-{c.name}")
def test_files_agree_with_independent_computation(case: Case) -> None:
    ref = stored(case)
    expected = naive_outputs(case, ref)
    assert sorted(k for k in ref if k.startswith("output.")) == sorted(expected)
    for key, value in expected.items():
        assert ref[key].shape == value.shape, key
        assert np.max(np.abs(ref[key] - value)) <= 1e-10, key


def test_fully_masked_rows_are_zero_in_the_files() -> None:
    for layer in ("DotProductAttention", "AdditiveAttention", "MultiHeadAttention"):
        ref = load(layer)["fully_masked_row"]
        att = ref["output.attention"]
        assert np.all(att[0, :, 1] == 0.0) and np.all(att[1, :, 2] == 0.0)
        if layer != "MultiHeadAttention":  # its W_o bias would make the output non-zero
            assert np.all(ref["output.out"][0, 1] == 0.0) and np.all(ref["output.out"][1, 2] == 0.0)
