"""Current-model blocks and stacks: pre-norm, RMSNorm, GELU and SwiGLU, ``bias="qkv"``, tied
logits, unscaled embeddings, and the attention options on the encoder.

Every number is checked against a float64 NumPy computation written here from the formulas
(Llama's: ``x + attn(rms(x))``, ``x + down(silu(gate x) * up x)``, rotate-half rotary,
grouped-query heads, a last RMSNorm, logits ``x @ E^T``), on every backend.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import attention_core as ac
from attention_core import declarations as D
from attention_core import weights as W
from tests.harness import TOLERANCE, Harness

#: These tests run on the columns too (conftest.py; tests.harness.COLUMNS).
COLUMN_TESTS = True

TOL = TOLERANCE["float32"]
H, KV, WIDTH, FFN, VOCAB = 4, 2, 16, 12, 13
TOKENS = np.array([[1, 5, 3, 12, 0], [7, 2, 9, 4, 11]])

#: A Llama/Qwen2-style decoder-only block: every new option away from its default.
LLAMA = {"num_hiddens": WIDTH, "ffn_num_hiddens": FFN, "num_heads": H, "bias": "qkv",
         "decoder_only": True, "num_kv_heads": KV, "positional": "rotary", "norm_first": True,
         "norm": "rms", "activation": "swiglu", "ffn_bias": False}
LLAMA_STACK = {"vocab_size": VOCAB, "num_blks": 2, **LLAMA, "tie_output": True,
               "output_bias": False, "scale_embeddings": False}


def data(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def given_weights(name: str, config: dict[str, Any], seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights for every name of the declared layer (gammas and biases not trivial)."""
    layer = D.LAYERS[name](**config)
    layer.check()
    return {n: data(*shape, seed=seed + i) * (0.5 if n.endswith("kernel") else 0.3)
            + (1.0 if n.endswith("gamma") else 0.0)
            for i, (n, shape) in enumerate(layer.weight_shapes().items())}


# -- the float64 reference ---------------------------------------------------------------------


def sub(w: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    return {name[len(prefix) + 1:]: x for name, x in w.items() if name.startswith(prefix + ".")}


def linear(x: np.ndarray, w: dict[str, np.ndarray], name: str) -> np.ndarray:
    y = x @ w[f"{name}.kernel"]
    return y + w[f"{name}.bias"] if f"{name}.bias" in w else y


def norm(x: np.ndarray, w: dict[str, np.ndarray], kind: str, eps: float | None = None
         ) -> np.ndarray:
    if kind == "rms":
        eps = 1e-6 if eps is None else eps
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w["ln.gamma"]
    eps = 1e-5 if eps is None else eps
    centred = x - x.mean(-1, keepdims=True)
    return centred / np.sqrt((centred ** 2).mean(-1, keepdims=True) + eps) * w["ln.gamma"] \
        + w["ln.beta"]


_ERF = np.vectorize(math.erf)


def ffn(x: np.ndarray, w: dict[str, np.ndarray], activation: str) -> np.ndarray:
    up = linear(x, w, "dense1")
    if activation == "relu":
        hidden = np.maximum(up, 0.0)
    elif activation == "gelu":
        hidden = 0.5 * up * (1.0 + _ERF(up / math.sqrt(2.0)))
    else:
        gate = linear(x, w, "gate")
        hidden = gate / (1.0 + np.exp(-gate)) * up
    return linear(hidden, w, "dense2")


def rotate(x: np.ndarray) -> np.ndarray:
    """Rotate-half rotary (HF Llama) of heads ``(B, H, N, D)`` at positions 0 .. N-1."""
    N, D = x.shape[-2:]
    angle = np.arange(N)[:, None] * 10000.0 ** (-np.arange(D // 2) * 2 / D)
    cos, sin = np.cos(angle), np.sin(angle)
    first, second = x[..., :D // 2], x[..., D // 2:]
    return np.concatenate([first * cos - second * sin, second * cos + first * sin], -1)


def attention(x: np.ndarray, w: dict[str, np.ndarray], heads: int, kv_heads: int,
              causal: bool, rotary: bool) -> np.ndarray:
    """Self-attention, grouped-query: query head i reads key/value head ``i // (H / Hkv)``."""
    B, N, h = x.shape
    d = h // heads

    def split(y: np.ndarray, n: int) -> np.ndarray:
        return y.reshape(B, N, n, d).transpose(0, 2, 1, 3)

    q = split(linear(x, w, "W_q"), heads)
    k, v = (np.repeat(split(linear(x, w, name), kv_heads), heads // kv_heads, axis=1)
            for name in ("W_k", "W_v"))
    if rotary:
        q, k = rotate(q), rotate(k)
    s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(d)
    if causal:
        s = np.where(np.tri(N, dtype=bool), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    out = (p / p.sum(-1, keepdims=True)) @ v
    return linear(out.transpose(0, 2, 1, 3).reshape(B, N, h), w, "W_o")


def block(x: np.ndarray, w: dict[str, np.ndarray], c: dict[str, Any], causal: bool,
          name: str) -> np.ndarray:
    """One encoder or decoder-only block of config ``c``, post- or pre-norm."""
    kind, eps = c.get("norm", "layer"), c.get("norm_eps")
    heads, kv = c["num_heads"], c.get("num_kv_heads") or c["num_heads"]

    def attend(y: np.ndarray) -> np.ndarray:
        return attention(y, sub(w, name), heads, kv, causal, c.get("positional") == "rotary")

    def feed(y: np.ndarray) -> np.ndarray:
        return ffn(y, sub(w, "ffn"), c.get("activation", "relu"))

    n1, n2 = sub(w, "addnorm1"), sub(w, "addnorm2")
    if c.get("norm_first"):
        x = x + attend(norm(x, n1, kind, eps))
        return x + feed(norm(x, n2, kind, eps))
    x = norm(x + attend(x), n1, kind, eps)
    return norm(x + feed(x), n2, kind, eps)


def llama(tokens: np.ndarray, w: dict[str, np.ndarray], c: dict[str, Any]) -> np.ndarray:
    """The decoder-only stack of :data:`LLAMA_STACK`: unscaled embedding, blocks, final norm, tied."""
    x = w["token.embedding"][tokens]
    for i in range(c["num_blks"]):
        x = block(x, sub(w, f"blks.{i}"), c, True, "self_attention")
    return norm(x, sub(w, "final_norm"), "rms") @ w["token.embedding"].T


# -- helpers -----------------------------------------------------------------------------------


def made(h: Harness, name: str, config: dict[str, Any], seed: int = 0) -> tuple[Any, dict]:
    layer = h.make(name, config)
    weights = given_weights(name, config, seed)
    layer.set_weights(weights)
    return layer, {n: x.astype(np.float64) for n, x in weights.items()}


def ids(h: Harness, tokens: np.ndarray) -> Any:
    return h.array(tokens.astype(np.int32))


def close(got: Any, want: np.ndarray, h: Harness) -> None:
    diff = float(np.max(np.abs(h.numpy(got) - want)))
    assert diff <= TOL, f"max |diff| {diff:.3g} > {TOL}"


# -- the numbers -------------------------------------------------------------------------------


def test_llama_block(backend: str) -> None:
    """A pre-norm RMS SwiGLU decoder-only block: GQA, rotary, q/k/v biases and none on W_o."""
    h = Harness(backend)
    layer, w = made(h, "TransformerDecoderBlock", LLAMA)
    x = data(2, 5, WIDTH, seed=20)
    close(h.call(layer, h.array(x)), block(x.astype(float), w, LLAMA, True, "self_attention"), h)


def test_llama_stack(backend: str) -> None:
    """The stack: no embedding scale, no sinusoidal table, a last RMSNorm, tied logits."""
    h = Harness(backend)
    layer, w = made(h, "TransformerDecoder", LLAMA_STACK)
    close(h.call(layer, ids(h, TOKENS)), llama(TOKENS, w, LLAMA_STACK), h)


@pytest.mark.parametrize("norm_first", [False, True])
def test_gelu_encoder_block(backend: str, norm_first: bool) -> None:
    """GELU (exact, erf) and LayerNorm of a chosen epsilon, post-norm and pre-norm."""
    h = Harness(backend)
    config = {"num_hiddens": WIDTH, "ffn_num_hiddens": FFN, "num_heads": H, "bias": True,
              "activation": "gelu", "norm_eps": 1e-3, "norm_first": norm_first}
    layer, w = made(h, "TransformerEncoderBlock", config, seed=40)
    x = data(2, 5, WIDTH, seed=21) * 2
    close(h.call(layer, h.array(x)), block(x.astype(float), w, config, False, "attention"), h)


def test_encoder_takes_the_attention_options(backend: str) -> None:
    """An encoder stack with rotary, grouped-query attention, pre-norm: no sinusoidal table."""
    h = Harness(backend)
    config = {"vocab_size": VOCAB, "num_hiddens": WIDTH, "ffn_num_hiddens": FFN,
              "num_heads": H, "num_blks": 1, "num_kv_heads": KV, "positional": "rotary",
              "norm_first": True, "norm": "rms", "activation": "swiglu",
              "scale_embeddings": False}
    layer, w = made(h, "TransformerEncoder", config, seed=60)
    x = w["token.embedding"][TOKENS]
    want = norm(block(x, sub(w, "blks.0"), config, False, "attention"), sub(w, "final_norm"), "rms")
    close(h.call(layer, ids(h, TOKENS)), want, h)


def test_cached_pre_norm_decoder_equals_the_whole_call(backend: str) -> None:
    """A prompt, then one token at a time against the cache: the causal call's rows."""
    h = Harness(backend)
    layer, w = made(h, "TransformerDecoder", LLAMA_STACK)
    want = llama(TOKENS, w, LLAMA_STACK)
    logits, cache = h.call(layer, ids(h, TOKENS[:, :3]), capacity=5)
    close(logits, want[:, :3], h)
    for t in (3, 4):
        logits, cache = h.call(layer, ids(h, TOKENS[:, t:t + 1]), cache=cache, start=t)
        close(logits, want[:, t:t + 1], h)


def test_functional_stack_equals_the_layer(backend: str) -> None:
    h = Harness(backend)
    layer, w = made(h, "TransformerDecoder", LLAMA_STACK)
    options = ac.HeadOptions(num_kv_heads=KV, positional="rotary")
    block_options = ac.BlockOptions(norm_first=True, norm="rms", activation="swiglu",
                                    ffn_bias=False, output_bias=False, tie_output=True,
                                    scale_embeddings=False)
    got = ac.transformer_decoder(ids(h, TOKENS), {n: h.array(x.astype(np.float32))
                                                  for n, x in w.items()}, H,
                                 options=options, block=block_options)
    close(got, llama(TOKENS, w, LLAMA_STACK), h)
    close(got, h.numpy(h.call(layer, ids(h, TOKENS))), h)


# -- the weights and the config ------------------------------------------------------------------


def spec(name: str, config: dict[str, Any]) -> dict[str, Any]:
    layer = D.LAYERS[name](**config)
    layer.check()
    return layer.weight_shapes()


BLOCK = {"num_hiddens": WIDTH, "ffn_num_hiddens": FFN, "num_heads": H}


def test_defaults_keep_the_names() -> None:
    """The default arguments give the 2017 layouts, name for name and in order."""
    assert list(spec("TransformerEncoderBlock", BLOCK)) == list(W.encoder_block_spec(WIDTH, FFN, H))
    assert spec("AddNorm", {"num_hiddens": 8}) == {"ln.gamma": (8,), "ln.beta": (8,)}
    decoder = spec("TransformerDecoder", {"vocab_size": VOCAB, "num_blks": 1, **BLOCK})
    assert [n for n in decoder if not n.startswith("blks.")] == [
        "token.embedding", "dense.kernel", "dense.bias"]


@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("activation", ["relu", "gelu", "swiglu"])
@pytest.mark.parametrize("bias", [True, False, "qkv"])
@pytest.mark.parametrize("ffn_bias", [True, False])
def test_names_follow_the_flags(norm: str, activation: str, bias: bool | str,
                                ffn_bias: bool) -> None:
    names = set(spec("TransformerDecoderBlock", {
        **BLOCK, "norm": norm, "activation": activation, "bias": bias, "ffn_bias": ffn_bias}))
    for i in (1, 2, 3):
        assert (f"addnorm{i}.ln.beta" in names) == (norm == "layer")
        assert f"addnorm{i}.ln.gamma" in names
    assert ("ffn.gate.kernel" in names) == (activation == "swiglu")
    assert ("ffn.gate.bias" in names) == (activation == "swiglu" and ffn_bias)
    assert ("ffn.dense1.bias" in names) == ("ffn.dense2.bias" in names) == ffn_bias
    for part in ("self_attention", "cross_attention"):
        assert {f"{part}.W_{p}.bias" in names for p in "qkv"} == {bias is not False}
        assert (f"{part}.W_o.bias" in names) == (bias is True)


@pytest.mark.parametrize("norm_first, tie_output, output_bias", [
    (False, False, True), (True, True, False), (True, False, False), (False, True, True)])
def test_stack_names_follow_the_flags(norm_first: bool, tie_output: bool,
                                      output_bias: bool) -> None:
    names = set(spec("TransformerDecoder", {
        "vocab_size": VOCAB, "num_blks": 1, **BLOCK, "norm": "rms", "norm_first": norm_first,
        "tie_output": tie_output, "output_bias": output_bias}))
    assert ("final_norm.ln.gamma" in names) == norm_first and "final_norm.ln.beta" not in names
    assert ("dense.kernel" in names) == (not tie_output)
    assert ("dense.bias" in names) == output_bias


def test_weights_round_trip(backend: str, tmp_path: Path) -> None:
    """set_weights/get_weights and a file carry every new name, unchanged."""
    h = Harness(backend)
    layer, w = made(h, "TransformerDecoder", LLAMA_STACK)
    got = layer.get_weights()
    assert sorted(got) == sorted(w)
    for name, value in w.items():
        np.testing.assert_array_equal(got[name], value.astype(np.float32), err_msg=name)
    ac.save_weights(tmp_path / "w.safetensors", layer)
    fresh = h.make("TransformerDecoder", LLAMA_STACK)
    ac.load_weights(tmp_path / "w.safetensors", fresh)
    np.testing.assert_array_equal(h.numpy(h.call(fresh, ids(h, TOKENS))),
                                  h.numpy(h.call(layer, ids(h, TOKENS))))


@pytest.mark.parametrize("name, config", [
    ("TransformerDecoder", LLAMA_STACK),
    ("TransformerEncoderBlock", {**BLOCK, "activation": "gelu", "norm_eps": 1e-3,
                                 "window": 3, "bias": "qkv"}),
    ("Transformer", {"src_vocab_size": VOCAB, "tgt_vocab_size": VOCAB, "num_blks": 1, **BLOCK,
                     "norm_first": True, "norm": "rms", "activation": "swiglu"}),
    ("PositionWiseFFN", {"ffn_num_hiddens": 8, "ffn_num_outputs": 4, "activation": "swiglu",
                         "bias": False}),
    ("AddNorm", {"num_hiddens": 8, "norm": "rms", "eps": 1e-4}),
])
def test_new_fields_in_the_config(backend: str, name: str, config: dict[str, Any]) -> None:
    """The framework's config holds the new arguments; a layer rebuilt from it too."""
    h = Harness(backend)
    layer = h.make(name, config)
    saved = h.hook("config")(layer)
    assert {key: saved[key] for key in config} == config
    assert h.hook("config")(h.hook("rebuild")(layer)) == saved


def test_layers_read_every_block_option() -> None:
    """The layers pass every field of BlockOptions they have (the list read when computing)."""
    assert tuple(f.name for f in dataclasses.fields(W.BlockOptions)) == D._BLOCK_OPTIONS
