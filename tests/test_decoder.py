"""The decoder side of the Transformer in the core: the decoder block, with and
without cross-attention, the decoder stack and the encoder-decoder, on each backend's own
arrays, against the independent float64 implementation of tests/naive.py."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import attention_core as ac
from attention_core import weights as W
from tests import naive
from tests.harness import TOLERANCE, Harness, max_diff

#: These tests run on the columns too (conftest.py; tests.harness.COLUMNS).
COLUMN_TESTS = True

B, T, S, h, H, F, V = 2, 5, 6, 8, 2, 12, 11


def spec_weights(spec: dict[str, tuple[int, ...]], rng: np.random.Generator
                 ) -> dict[str, np.ndarray]:
    """Float64 weights of the spec's shapes; layer-norm scales near 1."""
    out = {}
    for name, shape in spec.items():
        scale = 0.1 if name.endswith("ln.beta") else 0.5
        base = 1.0 if name.endswith("ln.gamma") else 0.0
        out[name] = base + scale * rng.standard_normal(shape)
    return out


def block_weights(rng: np.random.Generator, crossed: bool, prefix: str = "",
                  enc_width: int = h) -> dict[str, np.ndarray]:
    spec = {
        **W.multi_head_call_spec(lambda *a: None, set(), H, f"{prefix}self_attention.", h),
        **W.add_norm_call_spec(lambda *a: None, f"{prefix}addnorm1.", h),
        **W.ffn_call_spec(lambda n, axis, nd: F if axis == 1 else None, f"{prefix}ffn.", h),
        **W.add_norm_call_spec(lambda *a: None, f"{prefix}addnorm{3 if crossed else 2}.", h),
    }
    if crossed:
        for name in ("W_q", "W_k", "W_v", "W_o"):
            d_in = enc_width if name in ("W_k", "W_v") else h
            spec[f"{prefix}cross_attention.{name}.kernel"] = (d_in, h)
        spec.update(W.add_norm_call_spec(lambda *a: None, f"{prefix}addnorm2.", h))
    return spec_weights(spec, rng)


def stack_weights(rng: np.random.Generator, crossed: bool, blocks: int = 2,
                  prefix: str = "") -> dict[str, np.ndarray]:
    w = {f"{prefix}token.embedding": rng.standard_normal((V, h)),
         f"{prefix}dense.kernel": 0.5 * rng.standard_normal((h, V)),
         f"{prefix}dense.bias": 0.1 * rng.standard_normal(V)}
    for i in range(blocks):
        w.update(block_weights(rng, crossed, f"{prefix}blks.{i}."))
    return w


def self_visibility(valid_lens: Any = None) -> np.ndarray:
    return naive.visible(B, H, T, T, valid_lens, causal=True)


def on(h_: Harness, w: dict[str, np.ndarray]) -> dict[str, Any]:
    return {k: h_.array(v, "float32") for k, v in w.items()}


MASKS = ["none", "valid_lens", "enc_valid_lens", "enc_mask", "all"]


def masks_of(kind: str, rng: np.random.Generator) -> dict[str, Any]:
    """The call's masks: the decoder's key lengths, the encoder outputs' lengths (one 0: a
    row of the cross-attention that sees nothing) and a random cross-attention mask."""
    out: dict[str, Any] = {}
    if kind in ("valid_lens", "all"):
        out["valid_lens"] = np.array([T, 3])
    if kind in ("enc_valid_lens", "all"):
        out["enc_valid_lens"] = np.array([S, 0]) if kind == "all" else np.array([4, 2])
    if kind in ("enc_mask", "all"):
        out["enc_mask"] = rng.random((B, T, S)) < 0.6
    return out


@pytest.mark.parametrize(("crossed", "kind"), [
    *[pytest.param(True, kind, id=f"cross-{kind}") for kind in MASKS],
    *[pytest.param(False, kind, id=f"decoder-only-{kind}") for kind in ("none", "valid_lens")],
])
def test_decoder_block_matches_naive(backend: str, crossed: bool, kind: str) -> None:
    rng = np.random.default_rng(len(kind) + 10 * crossed)
    hb = Harness(backend)
    w = block_weights(rng, crossed)
    X = rng.standard_normal((B, T, h))
    enc = rng.standard_normal((B, S, h)) if crossed else None
    masks = masks_of(kind, rng)
    want, want_weights = naive.decoder_block(
        X, w, H, self_visibility(masks.get("valid_lens")), enc,
        naive.visible(B, H, T, S, masks.get("enc_valid_lens"), masks.get("enc_mask"))
        if crossed else None)
    call = {k: hb.array(v) for k, v in masks.items()}
    enc_valid_lens = call.pop("enc_valid_lens", None)
    out, kept = ac.transformer_decoder_block(
        hb.array(X, "float32"), on(hb, w), H,
        None if enc is None else hb.array(enc, "float32"), enc_valid_lens,
        return_weights=True, **call)
    assert max_diff(hb.numpy(out), want) <= TOLERANCE["float32"]
    assert max_diff(hb.numpy(kept[0]), want_weights[0]) <= TOLERANCE["float32"]
    if crossed:
        assert max_diff(hb.numpy(kept[1]), want_weights[1]) <= TOLERANCE["float32"]
        if kind == "all":  # example 1 sees no encoder output: its cross-attention rows are 0
            assert not hb.numpy(kept[1])[1].any()
    else:
        assert len(kept) == 1


@pytest.mark.parametrize("crossed", [True, False], ids=["cross", "decoder-only"])
def test_decoder_matches_naive(backend: str, crossed: bool) -> None:
    rng = np.random.default_rng(3)
    hb = Harness(backend)
    w = stack_weights(rng, crossed)
    tokens = rng.integers(0, V, (B, T))
    enc = rng.standard_normal((B, S, h)) if crossed else None
    enc_lens = np.array([S, 2])
    cross_vis = naive.visible(B, H, T, S, enc_lens) if crossed else None
    want, want_weights = naive.transformer_decoder(tokens, w, H, self_visibility(), enc, cross_vis)
    logits, kept = ac.transformer_decoder(
        hb.array(tokens.astype(np.int32)), on(hb, w), H,
        None if enc is None else hb.array(enc, "float32"),
        hb.array(enc_lens) if crossed else None, return_weights=True)
    assert hb.numpy(logits).shape == (B, T, V)
    assert max_diff(hb.numpy(logits), want) <= TOLERANCE["float32"]
    assert [len(x) for x in kept] == ([2, 2] if crossed else [2])
    for got, expected in zip([a for x in kept for a in x], [a for x in want_weights for a in x],
                             strict=True):
        assert max_diff(hb.numpy(got), expected) <= TOLERANCE["float32"]


def test_transformer_matches_naive(backend: str) -> None:
    """The encoder-decoder: the encoder's outputs, padded by the sources' lengths, feed every
    decoder block's cross-attention."""
    rng = np.random.default_rng(4)
    hb = Harness(backend)
    enc_w = {"token.embedding": rng.standard_normal((V, h))}
    for i in range(2):
        spec = W.block_call_spec(lambda n, axis, nd: F if n.endswith("dense1.kernel") and axis == 1
                                 else None, set(), H, f"blks.{i}.", h)
        enc_w.update(spec_weights(spec, rng))
    dec_w = stack_weights(rng, True)
    src = rng.integers(0, V, (B, S))
    tgt = rng.integers(0, V, (B, T))
    src_lens = np.array([S, 3])
    enc_vis = naive.visible(B, H, S, S, src_lens)
    enc_out, enc_weights = naive.transformer_encoder(src, enc_w, H, enc_vis)
    want, dec_weights = naive.transformer_decoder(tgt, dec_w, H, self_visibility(), enc_out,
                                                  naive.visible(B, H, T, S, src_lens))
    weights = {**W.prefixed(enc_w, "encoder"), **W.prefixed(dec_w, "decoder")}
    logits, kept = ac.transformer_encoder_decoder(
        hb.array(src.astype(np.int32)), hb.array(tgt.astype(np.int32)), on(hb, weights), H,
        hb.array(src_lens), return_weights=True)
    assert max_diff(hb.numpy(logits), want) <= TOLERANCE["float32"]
    assert [len(x) for x in kept] == [2, 2, 2]
    for got, expected in zip(kept[0] + kept[1] + kept[2],
                             enc_weights + dec_weights[0] + dec_weights[1], strict=True):
        assert max_diff(hb.numpy(got), expected) <= TOLERANCE["float32"]
    # ids out of range are refused by name, on their side (a lookup may not clamp or wrap
    # them), given on the host: a JAX array's values are never read
    bad_src, bad_tgt = src.copy(), tgt.copy()
    bad_src[0, 0], bad_tgt[0, 0] = V, V + 3
    for side, ids in (("src", (bad_src, tgt)), ("tgt", (src, bad_tgt))):
        with pytest.raises(ValueError, match=rf"{side}_tokens must be in \[0, {side}_vocab_size\)"):
            ac.transformer_encoder_decoder(*(_host_read(hb, x.astype(np.int32)) for x in ids),
                                           on(hb, weights), H, hb.array(src_lens))


def _host_read(hb: Harness, x: np.ndarray) -> Any:
    """``x`` as the backend's array where its values are read, else (JAX) as NumPy."""
    arr = hb.array(x)
    return x if hb.ops.concrete(arr) is None else arr


def test_later_tokens_do_not_change_earlier_logits() -> None:
    """Causality: the logits at positions < t do not depend on the tokens from t on, and a
    prefix decoded alone gives the full pass's first rows (what cached decoding relies on)."""
    rng = np.random.default_rng(5)
    w = {k: v.astype(np.float32) for k, v in stack_weights(rng, True).items()}
    enc = rng.standard_normal((B, S, h)).astype(np.float32)
    tokens = rng.integers(0, V, (B, T))
    full = ac.transformer_decoder(tokens, w, H, enc, max_len=T)
    changed = tokens.copy()
    changed[:, 3:] = (changed[:, 3:] + 1) % V
    other = ac.transformer_decoder(changed, w, H, enc, max_len=T)
    assert np.array_equal(full[:, :3], other[:, :3])
    assert not np.allclose(full[:, 3:], other[:, 3:])
    prefix = ac.transformer_decoder(tokens[:, :3], w, H, enc, max_len=T)
    assert max_diff(prefix, full[:, :3]) <= TOLERANCE["float32"]


def test_decoder_errors_name_the_argument() -> None:
    rng = np.random.default_rng(6)
    X = rng.standard_normal((B, T, h)).astype(np.float32)
    enc = rng.standard_normal((B, S, h)).astype(np.float32)
    crossed = {k: v.astype(np.float32) for k, v in block_weights(rng, True).items()}
    alone = {k: v.astype(np.float32) for k, v in block_weights(rng, False).items()}
    with pytest.raises(ValueError, match="enc_outputs is required"):
        ac.transformer_decoder_block(X, crossed, H)
    with pytest.raises(ValueError, match=r"enc_outputs must be None .* \(2, 6, 8\)"):
        ac.transformer_decoder_block(X, alone, H, enc)
    with pytest.raises(ValueError, match="enc_outputs last dimension"):
        ac.transformer_decoder_block(X, crossed, H, enc[..., :5])
    with pytest.raises(ValueError, match=r"enc_outputs must have shape \(B, S, h\), got \(6, 8\)"):
        ac.transformer_decoder_block(X, crossed, H, enc[0])
    # a block without its cross-attention's add & norm is refused by name
    broken = {k: v for k, v in crossed.items() if not k.startswith("addnorm3.")}
    with pytest.raises(ValueError, match=r"addnorm3\.ln\.gamma"):
        ac.transformer_decoder_block(X, broken, H, enc)
    # every block of a stack has the first block's form
    mixed = {**{k: v.astype(np.float32) for k, v in stack_weights(rng, True).items()}}
    mixed = {k: v for k, v in mixed.items() if not k.startswith("blks.1.cross_attention.")}
    with pytest.raises(ValueError, match=r"blks\.1\.cross_attention"):
        ac.transformer_decoder(rng.integers(0, V, (B, T)), mixed, H, enc)
    # the encoder-decoder's decoder must attend to the encoder
    dec = {k: v.astype(np.float32) for k, v in stack_weights(rng, False).items()}
    enc_w = {"token.embedding": rng.standard_normal((V, h)).astype(np.float32)}
    with pytest.raises(ValueError, match=r"decoder\.blks\.0\.cross_attention"):
        ac.transformer_encoder_decoder(rng.integers(0, V, (B, S)), rng.integers(0, V, (B, T)),
                       {**W.prefixed(enc_w, "encoder"), **W.prefixed(dec, "decoder")}, H)


# -- the layers ------------------------------------------------------------------------------

LAYERS = {
    "TransformerDecoderBlock": {"num_hiddens": h, "ffn_num_hiddens": F, "num_heads": H},
    "TransformerDecoder": {"vocab_size": V, "num_hiddens": h, "ffn_num_hiddens": F,
                           "num_heads": H, "num_blks": 2},
    "Transformer": {"src_vocab_size": V, "tgt_vocab_size": V + 2, "num_hiddens": h,
                    "ffn_num_hiddens": F, "num_heads": H, "num_blks": 2},
}


def flat(kept: Any) -> list[Any]:
    if isinstance(kept, (list, tuple)):
        return [leaf for k in kept for leaf in flat(k)]
    return [kept]


@pytest.mark.parametrize(("name", "decoder_only"), [
    ("TransformerDecoderBlock", False), ("TransformerDecoderBlock", True),
    ("TransformerDecoder", False), ("TransformerDecoder", True), ("Transformer", False),
])
def test_decoder_layers_match_naive(backend: str, name: str, decoder_only: bool) -> None:
    """Each layer, built by its first call with its own initial weights, equals the float64
    decoder on those weights, and keeps its attention weights in the documented structure."""
    rng = np.random.default_rng(7)
    hb = Harness(backend)
    config = dict(LAYERS[name], **({"decoder_only": True} if decoder_only else {}))
    layer = hb.make(name, config)
    enc = rng.standard_normal((B, S, h))
    enc_lens = np.array([S, 2])
    tokens = rng.integers(0, V, (B, T))
    if name == "TransformerDecoderBlock":
        X = rng.standard_normal((B, T, h))
        args = [hb.array(X, "float32")] + ([] if decoder_only else
                                           [hb.array(enc, "float32"), hb.array(enc_lens)])
    elif name == "TransformerDecoder":
        args = [hb.array(tokens.astype(np.int32))] + (
            [] if decoder_only else [hb.array(enc, "float32"), hb.array(enc_lens)])
    else:
        src = rng.integers(0, V, (B, S))
        args = [hb.array(src.astype(np.int32)), hb.array(tokens.astype(np.int32)),
                hb.array(enc_lens)]
    out = hb.numpy(hb.call(layer, *args))
    w = {k: np.asarray(v, np.float64) for k, v in layer.get_weights().items()}
    cross_vis = None if decoder_only else naive.visible(B, H, T, S, enc_lens)
    if name == "TransformerDecoderBlock":
        want, kept = naive.decoder_block(X, w, H, self_visibility(), None if decoder_only else enc,
                                         cross_vis)
    elif name == "TransformerDecoder":
        want, kept = naive.transformer_decoder(tokens, w, H, self_visibility(),
                                               None if decoder_only else enc, cross_vis)
    else:
        enc_out, enc_kept = naive.transformer_encoder(src, naive.sub(w, "encoder"), H,
                                                      naive.visible(B, H, S, S, enc_lens))
        want, dec_kept = naive.transformer_decoder(tokens, naive.sub(w, "decoder"), H,
                                                   self_visibility(), enc_out, cross_vis)
        kept = [enc_kept, *dec_kept]
    assert out.shape == want.shape
    assert max_diff(out, want) <= TOLERANCE["float32"]
    got = hb.attention_weights(layer)
    if backend != "jax":  # Flax sows the arrays one by one, in this order
        assert len(got) == len(kept)
    assert len(flat(got)) == len(flat(kept))
    for a, b in zip(flat(got), flat(kept), strict=True):
        assert max_diff(hb.numpy(a), b) <= TOLERANCE["float32"]


def test_keras_padding_masks_of_a_decoder(backend: str) -> None:
    """Keras: the decoder input's padding mask hides padded positions of the self-attention
    (rows and keys), the encoder outputs' hides their padded keys in the cross-attention: the
    same as the equivalent ``mask`` and ``enc_mask``."""
    if backend != "tensorflow":
        pytest.skip("Keras padding masks are a Keras convention")
    rng = np.random.default_rng(8)
    hb = Harness(backend)
    layer = hb.make("TransformerDecoderBlock", LAYERS["TransformerDecoderBlock"])
    X = hb.array(rng.standard_normal((B, T, h)), "float32")
    enc = hb.array(rng.standard_normal((B, S, h)), "float32")
    pad = np.arange(T)[None] < np.array([[T], [3]])
    enc_pad = np.arange(S)[None] < np.array([[4], [S]])
    got = hb.numpy(layer(X, enc, X_mask=hb.array(pad), enc_outputs_mask=hb.array(enc_pad)))
    got_weights = [hb.numpy(a) for a in layer.attention_weights]
    mask = pad[:, :, None] & pad[:, None, :]
    enc_mask = pad[:, :, None] & enc_pad[:, None, :]
    want = hb.numpy(layer(X, enc, mask=hb.array(mask), enc_mask=hb.array(enc_mask)))
    want_weights = [hb.numpy(a) for a in layer.attention_weights]
    assert max_diff(got, want) <= TOLERANCE["float32"]
    for a, b in zip(got_weights, want_weights, strict=True):
        assert max_diff(a, b) <= TOLERANCE["float32"]
    assert not got_weights[1][0, :, :, 4:].any()  # example 0's padded encoder outputs: hidden
    assert not got_weights[0][1, :, 3:].any()  # example 1's padded rows see nothing


def _torch_reference_call(module: Any, X: Any, enc: Any, enc_lens: np.ndarray) -> Any:
    import torch

    causal = torch.ones(T, T, dtype=torch.bool).triu(1)  # True = blocked, torch's convention
    padding = torch.as_tensor(np.arange(S)[None] >= enc_lens[:, None])
    return module(X, enc, tgt_mask=causal, memory_key_padding_mask=padding)


def test_torch_decoder_layer_converts_both_ways(backend: str) -> None:
    """``torch.nn.TransformerDecoderLayer`` (post-norm, ReLU) and our block give the same
    output from the same weights, converted either way; a converted block converts back."""
    if backend != "torch":
        pytest.skip("torch's own layer")
    import torch
    from torch import nn

    from backends.torch import convert

    torch.manual_seed(0)
    rng = np.random.default_rng(9)
    X = torch.as_tensor(rng.standard_normal((B, T, h)), dtype=torch.float32)
    enc = torch.as_tensor(rng.standard_normal((B, S, h)), dtype=torch.float32)
    enc_lens = np.array([S, 2])
    native = nn.TransformerDecoderLayer(h, H, F, dropout=0.0, batch_first=True).eval()
    for p in native.parameters():  # no zero bias or unit gamma hides a term
        torch.nn.init.normal_(p, std=0.3)
    hb = Harness(backend)
    ours = hb.make("TransformerDecoderBlock", convert.decoder_layer_config(native))
    ours.set_weights(convert.from_torch_decoder_layer(native))
    with torch.no_grad():
        want = _torch_reference_call(native, X, enc, enc_lens)
        got = ours(X, enc, torch.as_tensor(enc_lens))
    assert max_diff(hb.numpy(got), hb.numpy(want)) <= TOLERANCE["float32"]
    # ours -> torch: a fresh block's weights, randomised
    fresh = hb.make("TransformerDecoderBlock", {**LAYERS["TransformerDecoderBlock"], "bias": True})
    weights = {k: v + 0.1 * rng.standard_normal(v.shape).astype(v.dtype)
               for k, v in block_weights(rng, True).items()}
    bias = {f"{p}.{n}.bias": 0.1 * rng.standard_normal(h)
            for p in ("self_attention", "cross_attention") for n in ("W_q", "W_k", "W_v", "W_o")}
    fresh.set_weights({**weights, **bias})
    module = convert.to_torch_decoder_layer(fresh.get_weights(), H).eval()
    with torch.no_grad():
        want = _torch_reference_call(module, X, enc, enc_lens)
        got = fresh(X, enc, torch.as_tensor(enc_lens))
    assert max_diff(hb.numpy(got), hb.numpy(want)) <= TOLERANCE["float32"]
    back = convert.from_torch_decoder_layer(module)
    assert set(back) == set(fresh.get_weights())
    for name, value in fresh.get_weights().items():
        np.testing.assert_array_equal(back[name], value, err_msg=name)


def test_torch_decoder_layer_refusals(backend: str) -> None:
    if backend != "torch":
        pytest.skip("torch's own layer")
    from torch import nn

    from backends.torch import convert

    with pytest.raises(ValueError, match="norm_first=True is not supported"):
        convert.from_torch_decoder_layer(nn.TransformerDecoderLayer(h, H, F, norm_first=True))
    with pytest.raises(ValueError, match="the activation must be ReLU"):
        convert.from_torch_decoder_layer(nn.TransformerDecoderLayer(h, H, F, activation="gelu"))
    with pytest.raises(TypeError, match=r"expected a torch\.nn\.TransformerDecoderLayer"):
        convert.from_torch_decoder_layer(nn.Linear(2, 2))
    rng = np.random.default_rng(10)
    alone = block_weights(rng, False)
    with pytest.raises(ValueError, match="no decoder-only form"):
        convert.to_torch_decoder_layer(alone, H)
    with pytest.raises(ValueError, match="must have biases"):
        convert.to_torch_decoder_layer(block_weights(rng, True), H)
    self_biased = {**block_weights(rng, True), **{f"self_attention.{n}.bias": np.zeros(h)
                                                  for n in ("W_q", "W_k", "W_v", "W_o")}}
    with pytest.raises(ValueError, match="must have biases"):  # the cross-attention's too
        convert.to_torch_decoder_layer(self_biased, H)
