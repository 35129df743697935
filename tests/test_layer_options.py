"""The open core's options on the layers: ``scale``, attention sinks, ``segment_ids``,
``mask_mod`` and ``score_mod``.

``scale`` and ``sinks`` are constructor arguments of the attention layers and of the blocks and
stacks that hold a multi-head attention; ``segment_ids``, ``mask_mod`` and ``score_mod`` are
call arguments of ``DotProductAttention`` and ``MultiHeadAttention``. Every number is checked
against a float64 NumPy computation written here from the formulas (softmax over the visible
keys, the sink's ``exp(sinks[h])`` added to each row's denominator, unscaled).
"""

from __future__ import annotations

import inspect
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import attention_core as ac
from attention_core import declarations as D
from tests.harness import TOLERANCE, Harness

#: These tests run on the columns too (conftest.py; tests.harness.COLUMNS).
COLUMN_TESTS = True

_CORE = inspect.signature(ac.dot_product_attention).parameters
needs_sinks = pytest.mark.skipif("sinks" not in _CORE,
                                 reason="the core's dot_product_attention takes no sinks yet")
needs_modifiers = pytest.mark.skipif(
    "mask_mod" not in _CORE or "score_mod" not in _CORE,
    reason="the core's dot_product_attention takes no mask_mod or score_mod yet")

TOL = TOLERANCE["float32"]
H, WIDTH, FFN, VOCAB = 2, 8, 12, 11
SRC = np.array([[1, 2, 3, 4], [5, 6, 7, 8]])
TGT = np.array([[3, 1, 4], [10, 0, 9]])


def data(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# -- the float64 reference ---------------------------------------------------------------------


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float,
           sinks: np.ndarray | None = None, causal: bool = False,
           visible: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Softmax attention of heads ``(B, H, N, D)``: output and weights (the sink's share left out).

    ``visible``, boolean and broadcastable to the scores, hides the keys where it is False.
    """
    s = np.einsum("bhqd,bhkd->bhqk", q, k) * scale
    if causal:
        Q, K = s.shape[-2:]
        s = np.where(np.arange(K)[None, :] <= np.arange(Q)[:, None] + (K - Q), s, -np.inf)
    if visible is not None:
        s = np.where(visible, s, -np.inf)
    top = s.max(-1, keepdims=True)
    if sinks is not None:
        top = np.maximum(top, sinks[None, :, None, None])
    e = np.exp(s - top)
    total = e.sum(-1, keepdims=True)
    if sinks is not None:
        total = total + np.exp(sinks[None, :, None, None] - top)
    w = e / total
    return w @ v, w


def heads(x: np.ndarray) -> np.ndarray:
    B, N, h = x.shape
    return x.reshape(B, N, H, h // H).transpose(0, 2, 1, 3)


def mha(w: dict[str, np.ndarray], q: np.ndarray, k: np.ndarray, v: np.ndarray,
        scale: float | None, causal: bool = False, visible: np.ndarray | None = None
        ) -> tuple[np.ndarray, np.ndarray]:
    """Multi-head attention from canonical weights (``sinks`` when they hold them)."""
    qh, kh, vh = (heads(x @ w[f"{n}.kernel"]) for x, n in ((q, "W_q"), (k, "W_k"), (v, "W_v")))
    scale = 1 / math.sqrt(qh.shape[-1]) if scale is None else scale
    out, weights = attend(qh, kh, vh, scale, w.get("sink_logits"), causal, visible)
    B, _, N, d = out.shape
    return out.transpose(0, 2, 1, 3).reshape(B, N, H * d) @ w["W_o.kernel"], weights


def sub(w: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    return {name[len(prefix) + 1:]: x for name, x in w.items() if name.startswith(prefix + ".")}


def add_norm(x: np.ndarray, y: np.ndarray, w: dict[str, np.ndarray]) -> np.ndarray:
    z = x + y
    z = (z - z.mean(-1, keepdims=True)) / np.sqrt(z.var(-1, keepdims=True) + 1e-5)
    return z * w["ln.gamma"] + w["ln.beta"]


def ffn(x: np.ndarray, w: dict[str, np.ndarray]) -> np.ndarray:
    hidden = np.maximum(x @ w["dense1.kernel"] + w["dense1.bias"], 0.0)
    return hidden @ w["dense2.kernel"] + w["dense2.bias"]


def encoder_block(w: dict[str, np.ndarray], x: np.ndarray, scale: float | None) -> np.ndarray:
    y = add_norm(x, mha(sub(w, "attention"), x, x, x, scale)[0], sub(w, "addnorm1"))
    return add_norm(y, ffn(y, sub(w, "ffn")), sub(w, "addnorm2"))


def decoder_block(w: dict[str, np.ndarray], x: np.ndarray, scale: float | None,
                  enc: np.ndarray | None = None) -> np.ndarray:
    y = add_norm(x, mha(sub(w, "self_attention"), x, x, x, scale, causal=True)[0],
                 sub(w, "addnorm1"))
    if enc is None:
        return add_norm(y, ffn(y, sub(w, "ffn")), sub(w, "addnorm2"))
    y = add_norm(y, mha(sub(w, "cross_attention"), y, enc, enc, scale)[0], sub(w, "addnorm2"))
    return add_norm(y, ffn(y, sub(w, "ffn")), sub(w, "addnorm3"))


def embedded(table: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """``E[tokens] * sqrt(h)`` plus the sinusoidal table."""
    T, h = tokens.shape[1], table.shape[1]
    angle = np.arange(T)[:, None] / 10000 ** (2 * (np.arange(h) // 2) / h)
    table_p = np.where(np.arange(h) % 2 == 0, np.sin(angle), np.cos(angle))
    return table[tokens] * math.sqrt(h) + table_p


def encoder(w: dict[str, np.ndarray], tokens: np.ndarray, scale: float | None) -> np.ndarray:
    x = embedded(w["token.embedding"], tokens)
    return encoder_block(sub(w, "blks.0"), x, scale)


def decoder(w: dict[str, np.ndarray], tokens: np.ndarray, scale: float | None,
            enc: np.ndarray | None = None) -> np.ndarray:
    x = decoder_block(sub(w, "blks.0"), embedded(w["token.embedding"], tokens), scale, enc)
    return x @ w["dense.kernel"] + w["dense.bias"]


# -- the layers, their inputs and their reference ----------------------------------------------

BLOCK = {"num_hiddens": WIDTH, "ffn_num_hiddens": FFN, "num_heads": H}
STACK = {"num_hiddens": WIDTH, "ffn_num_hiddens": FFN, "num_heads": H, "num_blks": 1}
X, ENC = data(2, 3, WIDTH, seed=1), data(2, 4, WIDTH, seed=2)

#: name -> (layer, config, inputs, reference(weights, scale)): the layers holding a multi-head
#: attention, one block each.
HOLDERS: dict[str, tuple[str, dict[str, Any], tuple[np.ndarray, ...], Any]] = {
    "encoder_block": ("TransformerEncoderBlock", BLOCK, (X,),
                      lambda w, s: encoder_block(w, X.astype(float), s)),
    "decoder_block": ("TransformerDecoderBlock", BLOCK, (X, ENC),
                      lambda w, s: decoder_block(w, X.astype(float), s, ENC.astype(float))),
    "decoder_only_block": ("TransformerDecoderBlock", {**BLOCK, "decoder_only": True}, (X,),
                           lambda w, s: decoder_block(w, X.astype(float), s)),
    "encoder": ("TransformerEncoder", {"vocab_size": VOCAB, **STACK}, (SRC,),
                lambda w, s: encoder(w, SRC, s)),
    "decoder": ("TransformerDecoder", {"vocab_size": VOCAB, **STACK}, (TGT, ENC),
                lambda w, s: decoder(w, TGT, s, ENC.astype(float))),
    "transformer": ("Transformer", {"src_vocab_size": VOCAB, "tgt_vocab_size": VOCAB, **STACK},
                    (SRC, TGT), lambda w, s: decoder(sub(w, "decoder"), TGT, s,
                                                     encoder(sub(w, "encoder"), SRC, s))),
}


def inputs(h: Harness, arrays: tuple[np.ndarray, ...]) -> list[Any]:
    """Backend arrays; token ids as int32 (JAX holds no int64 by default)."""
    return [h.array(a.astype(np.int32) if a.dtype.kind == "i" else a) for a in arrays]


def weights64(layer: Any) -> dict[str, np.ndarray]:
    return {name: np.asarray(x, np.float64) for name, x in layer.get_weights().items()}


def with_sinks(weights: dict[str, np.ndarray], seed: int = 3) -> dict[str, np.ndarray]:
    """The weights with each ``sink_logits`` set to random logits, not all zero."""
    rng = np.random.default_rng(seed)
    return {name: (rng.uniform(-2, 2, x.shape).astype(x.dtype) if name.endswith("sink_logits") else x)
            for name, x in weights.items()}


def close(got: Any, want: np.ndarray, h: Harness) -> None:
    diff = float(np.max(np.abs(h.numpy(got) - want)))
    assert diff <= TOL, f"max |diff| {diff:.3g} > {TOL}"


# -- scale ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [None, 0.3])
def test_dot_product_attention_scale(backend: str, scale: float | None) -> None:
    """``scale`` multiplies ``Q K^T``; None is ``1 / sqrt(D)``. Both outputs and weights."""
    h = Harness(backend)
    q, k, v = data(2, 3, 4, seed=4), data(2, 5, 4, seed=5), data(2, 5, 6, seed=6)
    layer = h.make("DotProductAttention", {"scale": scale})
    out, weights = h.call(layer, *inputs(h, (q, k, v)), return_attention=True)
    ref, ref_weights = attend(*(x[:, None].astype(float) for x in (q, k, v)),
                              0.5 if scale is None else scale)
    close(out, ref[:, 0], h)
    close(weights, ref_weights, h)


def test_multi_head_attention_scale(backend: str) -> None:
    h = Harness(backend)
    q, k, v = data(2, 3, 5, seed=7), data(2, 4, 6, seed=8), data(2, 4, 3, seed=9)
    layer = h.make("MultiHeadAttention", {"num_hiddens": WIDTH, "num_heads": H, "scale": 1.7})
    out = h.call(layer, *inputs(h, (q, k, v)))
    close(out, mha(weights64(layer), *(x.astype(float) for x in (q, k, v)), 1.7)[0], h)


@pytest.mark.parametrize("holder", list(HOLDERS))
def test_scale_reaches_every_attention(backend: str, holder: str) -> None:
    """A block's or stack's ``scale`` is that of each of its attentions (self and cross)."""
    h = Harness(backend)
    name, config, arrays, reference = HOLDERS[holder]
    layer = h.make(name, {**config, "scale": 0.9})
    out = h.call(layer, *inputs(h, arrays))
    close(out, reference(weights64(layer), 0.9), h)


@pytest.mark.parametrize("name, config", [
    ("DotProductAttention", {"scale": 0.25}),
    ("MultiHeadAttention", {"num_hiddens": WIDTH, "num_heads": H, "scale": 0.25, "sinks": True}),
    *[(HOLDERS[k][0], {**HOLDERS[k][1], "scale": 2, "sinks": True}) for k in HOLDERS],
])
def test_scale_and_sinks_in_the_config(backend: str, name: str, config: dict[str, Any]) -> None:
    """The framework's config holds them (``scale`` a float), and a layer rebuilt from it too."""
    h = Harness(backend)
    layer = h.make(name, config)
    saved = h.hook("config")(layer)
    assert {key: saved[key] for key in ("scale", "sinks") if key in config} == {
        key: float(config[key]) if key == "scale" else config[key]
        for key in ("scale", "sinks") if key in config}
    assert type(saved.get("scale")) is float
    assert h.hook("config")(h.hook("rebuild")(layer)) == saved


@pytest.mark.parametrize("sinks", [False, pytest.param(True, marks=needs_sinks)])
def test_cached_decoder_keeps_scale_and_sinks(backend: str, sinks: bool) -> None:
    """A decoder called a step at a time against its cache gives the whole call's rows."""
    h = Harness(backend)
    name, config, _, _ = HOLDERS["decoder"]
    layer = h.make(name, {**config, "scale": 0.7, "sinks": sinks})
    prompt, step = inputs(h, (TGT[:, :2], ENC)), inputs(h, (TGT[:, 2:],))
    if sinks:
        h.call(layer, *prompt)
        layer.set_weights(with_sinks(layer.get_weights()))
    first, cache = h.call(layer, *prompt, capacity=3)
    last, _ = h.call(layer, *step, None, cache=cache, start=2)
    want = decoder(weights64(layer), TGT, 0.7, ENC.astype(float))
    close(first, want[:, :2], h)
    close(last, want[:, 2:], h)


# -- attention sinks: the weight --------------------------------------------------------------


def declared_spec(name: str, config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    layer = D.LAYERS[name](**config)
    layer.check()
    return layer.weight_shapes()


@pytest.mark.parametrize("holder", ["multi_head", *HOLDERS])
def test_sinks_weights_by_name(holder: str) -> None:
    """``sinks=True`` adds ``sinks (H,)`` to each multi-head attention, nothing else; without
    it the weights are those of before (old files fit)."""
    name, config = (("MultiHeadAttention", {"num_hiddens": WIDTH, "num_heads": H})
                    if holder == "multi_head" else HOLDERS[holder][:2])
    plain, sinks = declared_spec(name, config), declared_spec(name, {**config, "sinks": True})
    attentions = [n[:-len("W_q.kernel")] for n in plain if n.endswith("W_q.kernel")]
    assert attentions
    assert sinks == {**plain, **{f"{prefix}sink_logits": (H,) for prefix in attentions}}
    assert not any("sink_logits" in n for n in plain)


def test_sinks_are_canonical_weights(backend: str, tmp_path: Path) -> None:
    """``set_weights``/``get_weights`` carry ``sinks``; a file holds it and loads into a layer
    with sinks, and one without sinks refuses it rather than dropping it."""
    h = Harness(backend)
    config = {"num_hiddens": WIDTH, "num_heads": H, "sinks": True}
    spec = {"W_q.kernel": (3, 8), "W_k.kernel": (4, 8), "W_v.kernel": (5, 8),
            "W_o.kernel": (8, 8), "sink_logits": (2,)}
    given = {name: data(*shape, seed=i) for i, (name, shape) in enumerate(spec.items())}
    layer = h.make("MultiHeadAttention", config)
    layer.set_weights(given)
    got = layer.get_weights()
    assert sorted(got) == sorted(given)
    np.testing.assert_array_equal(got["sink_logits"], given["sink_logits"])
    ac.save_weights(tmp_path / "w.safetensors", layer)
    assert ac.load_weights(tmp_path / "w.safetensors")["sink_logits"].shape == (2,)
    fresh = h.make("MultiHeadAttention", config)
    ac.load_weights(tmp_path / "w.safetensors", fresh)
    np.testing.assert_array_equal(fresh.get_weights()["sink_logits"], given["sink_logits"])
    without = h.make("MultiHeadAttention", {**config, "sinks": False})
    with pytest.raises(ValueError, match=r"unexpected weights \['sink_logits'\]"):
        ac.load_weights(tmp_path / "w.safetensors", without)


def test_block_sinks_are_canonical_weights(backend: str) -> None:
    h = Harness(backend)
    config = {**BLOCK, "sinks": True}
    given = {name: data(*shape, seed=i) for i, (name, shape)
             in enumerate(declared_spec("TransformerDecoderBlock", config).items())}
    layer = h.make("TransformerDecoderBlock", config)
    layer.set_weights(given)
    got = layer.get_weights()
    for name in ("self_attention.sink_logits", "cross_attention.sink_logits"):
        np.testing.assert_array_equal(got[name], given[name])


# -- attention sinks: the numbers --------------------------------------------------------------


@needs_sinks
def test_multi_head_attention_sinks(backend: str) -> None:
    """The sinks start at zero; each head's softmax gains ``exp(sinks[h])`` (unscaled)."""
    h = Harness(backend)
    q, k, v = data(2, 3, 5, seed=7), data(2, 4, 6, seed=8), data(2, 4, 3, seed=9)
    layer = h.make("MultiHeadAttention", {"num_hiddens": WIDTH, "num_heads": H, "scale": 0.6,
                                          "sinks": True})
    arrays = inputs(h, (q, k, v))
    h.call(layer, *arrays)
    np.testing.assert_array_equal(layer.get_weights()["sink_logits"], np.zeros(H, np.float32))
    layer.set_weights(with_sinks(layer.get_weights()))
    out, weights = h.call(layer, *arrays, return_attention=True)
    ref, ref_weights = mha(weights64(layer), *(x.astype(float) for x in (q, k, v)), 0.6)
    close(out, ref, h)
    close(weights, ref_weights, h)
    assert np.all(h.numpy(weights).sum(-1) < 1 - 1e-3)  # the sinks took a share of each row


@needs_sinks
@pytest.mark.parametrize("holder", list(HOLDERS))
def test_sinks_reach_every_attention(backend: str, holder: str) -> None:
    h = Harness(backend)
    name, config, arrays, reference = HOLDERS[holder]
    layer = h.make(name, {**config, "sinks": True, "scale": 0.8})
    backend_arrays = inputs(h, arrays)
    h.call(layer, *backend_arrays)
    layer.set_weights(with_sinks(layer.get_weights()))
    close(h.call(layer, *backend_arrays), reference(weights64(layer), 0.8), h)


@needs_sinks
def test_sinks_through_the_native_format(backend: str, tmp_path: Path) -> None:
    """The framework's own file (state_dict, .keras, msgpack, .params) holds the sinks too."""
    h = Harness(backend)
    config = {"num_hiddens": WIDTH, "num_heads": H, "sinks": True}
    q = data(2, 3, WIDTH, seed=10)
    layer = h.make("MultiHeadAttention", config)
    arrays = inputs(h, (q,))
    h.call(layer, *arrays)
    layer.set_weights(with_sinks(layer.get_weights()))
    fresh, _ = h.save_load_native(layer, lambda: h.make("MultiHeadAttention", config), arrays,
                                  tmp_path)
    np.testing.assert_array_equal(fresh.get_weights()["sink_logits"], layer.get_weights()["sink_logits"])


# -- mask_mod and score_mod ---------------------------------------------------------------------


def causal_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return kv_idx <= q_idx


def halved(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return score * 0.5


@needs_modifiers
def test_dot_product_attention_modifiers(backend: str) -> None:
    """A call's ``mask_mod`` and ``score_mod`` reach the core as given."""
    h = Harness(backend)
    q, k, v = data(2, 4, 4, seed=11), data(2, 4, 4, seed=12), data(2, 4, 3, seed=13)
    layer = h.make("DotProductAttention", {"scale": 0.8})
    out = h.call(layer, *inputs(h, (q, k, v)), mask_mod=causal_mod, score_mod=halved)
    ref, _ = attend(*(x[:, None].astype(float) for x in (q, k, v)), 0.4, causal=True)
    close(out, ref[:, 0], h)


@needs_modifiers
def test_multi_head_attention_modifiers(backend: str) -> None:
    h = Harness(backend)
    x = data(2, 4, WIDTH, seed=14)
    layer = h.make("MultiHeadAttention", {"num_hiddens": WIDTH, "num_heads": H})
    arrays = inputs(h, (x,))
    h.call(layer, *arrays)
    out = h.call(layer, *arrays, mask_mod=causal_mod, score_mod=halved)
    x64 = x.astype(float)
    close(out, mha(weights64(layer), x64, x64, x64, 0.5 / math.sqrt(WIDTH // H), True)[0], h)


# -- segment_ids --------------------------------------------------------------------------------

#: Two rows of packed documents: lengths 2, 3, 1 and 4, 2.
IDS = np.array([[0, 0, 1, 1, 1, 2], [5, 5, 5, 5, 7, 7]], np.int32)


def same_segment(q_ids: np.ndarray, kv_ids: np.ndarray) -> np.ndarray:
    """Where query ``i`` and key ``j`` share a segment, ``(B, 1, Q, K)``."""
    return q_ids[:, None, :, None] == kv_ids[:, None, None, :]


def ids_as(h: Harness, ids: np.ndarray, where: str) -> Any:
    return ids if where == "host" else h.array(ids)


@pytest.mark.parametrize("where", ["host", "backend"])
@pytest.mark.parametrize("causal", [False, True])
def test_multi_head_attention_segment_ids(backend: str, where: str, causal: bool) -> None:
    """Packed self-attention: each query sees only its own document's keys."""
    h = Harness(backend)
    x = data(2, 6, WIDTH, seed=16)
    layer = h.make("MultiHeadAttention", {"num_hiddens": WIDTH, "num_heads": H})
    arrays = inputs(h, (x,))
    h.call(layer, *arrays)
    out = h.call(layer, *arrays, causal=causal, segment_ids=ids_as(h, IDS, where))
    x64 = x.astype(float)
    close(out, mha(weights64(layer), x64, x64, x64, None, causal, same_segment(IDS, IDS))[0], h)


def test_packed_layer_equals_separate_calls(backend: str) -> None:
    """The packed call of a layer equals calling it on each document alone."""
    h = Harness(backend)
    x = data(2, 6, WIDTH, seed=17)
    layer = h.make("MultiHeadAttention", {"num_hiddens": WIDTH, "num_heads": H})
    packed = h.numpy(h.call(layer, *inputs(h, (x,)), causal=True, segment_ids=IDS))
    for b, row in enumerate(IDS):
        for doc in np.unique(row):
            where = np.flatnonzero(row == doc)
            alone = h.call(layer, *inputs(h, (x[b:b + 1, where],)), causal=True)
            close(alone, packed[b:b + 1, where].astype(float), h)


@pytest.mark.parametrize("where", ["host", "backend"])
def test_dot_product_attention_segment_id_pair(backend: str, where: str) -> None:
    """Cross-attention between packed rows: ``(query_ids, key_ids)``."""
    h = Harness(backend)
    q, k, v = data(2, 4, 4, seed=18), data(2, 6, 4, seed=19), data(2, 6, 3, seed=20)
    q_ids = np.array([[0, 1, 1, 2], [5, 5, 7, 7]], np.int32)
    layer = h.make("DotProductAttention", {})
    out = h.call(layer, *inputs(h, (q, k, v)),
                 segment_ids=(ids_as(h, q_ids, where), ids_as(h, IDS, where)))
    ref, _ = attend(*(x[:, None].astype(float) for x in (q, k, v)), 0.5,
                    visible=same_segment(q_ids, IDS))
    close(out, ref[:, 0], h)
