"""Bad input: one exception type and one message on every backend, and no state change."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import attention_core as ac
from attention_core import weights as W
from tests.harness import Harness

R = np.random.default_rng(0)
F32 = "float32"


def qkv(q: tuple[int, ...] = (2, 4, 8), k: tuple[int, ...] = (2, 6, 8),
        v: tuple[int, ...] = (2, 6, 5), dtypes: tuple[str, ...] = (F32, F32, F32)) -> list[np.ndarray]:
    return [R.standard_normal(s).astype(d) for s, d in zip((q, k, v), dtypes, strict=True)]


def dpa(h: Harness, arrays: list[np.ndarray], **kwargs: Any) -> Any:
    kw = {k: (h.array(v) if isinstance(v, np.ndarray) else v) for k, v in kwargs.items()}
    return ac.dot_product_attention(*(h.array(a) for a in arrays), **kw)


def encode(h: Harness, tokens: np.ndarray) -> Any:
    """The functional encoder (vocabulary of 11, one block) on ``tokens``."""
    spec = W.transformer_encoder_spec(11, 12, 16, 3, 1)
    weights = {k: h.array(v) for k, v in W.init_weights(spec, R).items()}
    return ac.transformer_encoder(h.array(tokens), weights, 3)


# (id, call(h), exception type, exact message)
BAD_CALLS: list[tuple[str, Callable[[Harness], Any], type[Exception], str]] = [
    ("depth_mismatch", lambda h: dpa(h, qkv(k=(2, 6, 7))), ValueError,
     "queries depth (8) must equal keys depth (7)"),
    ("length_mismatch", lambda h: dpa(h, qkv(v=(2, 5, 5))), ValueError,
     "keys and values must have the same length, got 6 keys and 5 values"),
    ("batch_mismatch", lambda h: dpa(h, qkv(k=(3, 6, 8), v=(3, 6, 5))), ValueError,
     "keys batch size (3) must equal queries batch size (2)"),
    ("queries_rank", lambda h: dpa(h, qkv(q=(4, 8))), ValueError,
     "queries must have shape (B, Q, D) or (B, H, Q, D), got (4, 8)"),
    # int32 and float16: dtypes every backend has (JAX has no 64-bit types unless x64 is on)
    ("integer_queries", lambda h: dpa(h, [np.ones((2, 4, 8), np.int32), *qkv()[1:]]), TypeError,
     "queries must be floating point (float16, bfloat16, float32, float64), got int32"),
    ("dtype_mismatch", lambda h: dpa(h, qkv(dtypes=(F32, "float16", F32))), TypeError,
     "keys dtype (float16) must match queries dtype (float32)"),
    ("valid_lens_shape", lambda h: dpa(h, qkv(), valid_lens=np.array([1, 2, 3])), ValueError,
     "valid_lens must have shape (B,) or (B, Q) = (2,) or (2, 4), got (3,)"),
    ("valid_lens_float", lambda h: dpa(h, qkv(), valid_lens=np.array([1.0, 2.0], F32)), TypeError,
     "valid_lens must have an integer dtype, got float32"),
    ("valid_lens_negative", lambda h: dpa(h, qkv(), valid_lens=np.array([-1, 2])), ValueError,
     "valid_lens must be >= 0, got -1"),
    ("valid_lens_too_long", lambda h: dpa(h, qkv(), valid_lens=np.array([7, 2])), ValueError,
     "valid_lens must be <= the number of keys (6), got 7"),
    ("mask_shape", lambda h: dpa(h, qkv(), mask=np.ones((3, 6), bool)), ValueError,
     "mask must have shape (Q, K), (B, Q, K) or (B, H, Q, K), broadcastable to (B, H, Q, K) "
     "= (2, 1, 4, 6), got (3, 6)"),
    ("mask_heads", lambda h: dpa(h, qkv(), mask=np.ones((2, 3, 4, 6), bool)), ValueError,
     "mask must have shape (Q, K), (B, Q, K) or (B, H, Q, K), broadcastable to (B, H, Q, K) "
     "= (2, 1, 4, 6), got (2, 3, 4, 6)"),
    ("mask_rank", lambda h: dpa(h, qkv(), mask=np.ones((6,), bool)), ValueError,
     "mask must have shape (Q, K), (B, Q, K) or (B, H, Q, K), broadcastable to (B, H, Q, K) "
     "= (2, 1, 4, 6), got (6,)"),
    ("mask_not_bool", lambda h: dpa(h, qkv(), mask=np.ones((4, 6), F32)), TypeError,
     "mask must be boolean (True = may attend), got float32"),
    ("causal_not_bool", lambda h: dpa(h, qkv(), causal="yes"), TypeError,
     "causal must be a bool, got str"),
    ("scale_negative", lambda h: dpa(h, qkv(), scale=-1.0), ValueError,
     "scale must be a positive float or None, got -1.0"),
    ("functional_dropout", lambda h: dpa(h, qkv(), dropout=1.0), ValueError,
     "dropout must be in [0, 1), got 1.0"),
    ("heads_not_dividing", lambda h: h.module.MultiHeadAttention(100, 3), ValueError,
     "num_hiddens (100) must be divisible by num_heads (3)"),
    ("layer_dropout", lambda h: h.module.DotProductAttention(dropout=1.5), ValueError,
     "dropout must be in [0, 1), got 1.5"),
    ("layer_dropout_negative", lambda h: h.module.AddNorm(8, dropout=-0.1), ValueError,
     "dropout must be in [0, 1), got -0.1"),
    ("zero_hiddens", lambda h: h.module.AdditiveAttention(0), ValueError,
     "num_hiddens must be a positive int, got 0"),
    ("empty_keys", lambda h: dpa(h, qkv(k=(2, 0, 8), v=(2, 0, 5))), ValueError,
     "keys must not have an empty dimension, got (2, 0, 8)"),
    ("masked_softmax_rank", lambda h: ac.masked_softmax(h.array(np.zeros((3, 4), F32))),
     ValueError, "scores must have shape (B, Q, K) or (B, H, Q, K), got (3, 4)"),
    ("relative_zero_offsets", lambda h: h.module.RelativeMultiHeadAttention(12, 3, 0), ValueError,
     "max_relative_position must be a positive int, got 0"),
    ("encoder_zero_blocks", lambda h: h.module.TransformerEncoder(11, 12, 16, 3, 0), ValueError,
     "num_blks must be a positive int, got 0"),
    ("tokens_float", lambda h: encode(h, np.ones((2, 5), F32)), TypeError,
     "tokens must be integer token ids, got dtype float32"),
    ("tokens_too_large", lambda h: encode(h, np.array([[1, 2, 11], [0, 0, 0]])), ValueError,
     "tokens must be in [0, vocab_size) = [0, 11), got 11"),
    ("tokens_negative", lambda h: encode(h, np.array([[1, -2, 3]])), ValueError,
     "tokens must be in [0, vocab_size) = [0, 11), got -2"),
    ("tokens_rank", lambda h: encode(h, np.array([1, 2, 3])), ValueError,
     "tokens must have shape (B, T) token ids, got (3,)"),
]


@pytest.mark.parametrize("name, call, exc, message", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_call(backend: str, name: str, call: Callable[[Harness], Any], exc: type[Exception],
                  message: str) -> None:
    with pytest.raises(exc, match="^" + re.escape(message) + "$"):
        call(Harness(backend))


def built_mha(h: Harness) -> Any:
    layer = h.make("MultiHeadAttention", {"num_hiddens": 8, "num_heads": 2})
    q, k, v = qkv()
    h.call(layer, h.array(q), h.array(k), h.array(v))
    return layer


def snapshot(h: Harness, layer: Any) -> tuple[dict[str, np.ndarray], np.ndarray]:
    return layer.get_weights(), h.numpy(h.attention_weights(layer))


def assert_unchanged(h: Harness, layer: Any, before: tuple[dict[str, np.ndarray], np.ndarray]) -> None:
    weights, attn = snapshot(h, layer)
    assert sorted(weights) == sorted(before[0])
    for name in weights:
        np.testing.assert_array_equal(weights[name], before[0][name])
    np.testing.assert_array_equal(attn, before[1])


@pytest.mark.parametrize("kwargs", [{"valid_lens": np.array([7, 2])}, {"mask": np.ones((3, 6), bool)}],
                         ids=["valid_lens", "mask"])
def test_bad_call_leaves_built_layer_unchanged(backend: str, kwargs: dict[str, Any]) -> None:
    h = Harness(backend)
    layer = built_mha(h)
    before = snapshot(h, layer)
    q, k, v = qkv()
    with pytest.raises(ValueError):
        h.call(layer, h.array(q), h.array(k), h.array(v), **{n: h.array(a) for n, a in kwargs.items()})
    assert_unchanged(h, layer, before)


def test_bad_first_call_does_not_build(backend: str) -> None:
    h = Harness(backend)
    layer = h.make("MultiHeadAttention", {"num_hiddens": 8, "num_heads": 2})
    q, k, v = qkv()
    with pytest.raises(ValueError, match="valid_lens must be <= the number of keys"):
        h.call(layer, h.array(q), h.array(k), h.array(v), h.array(np.array([9, 9])))
    # the next good call may still choose any input width
    q2 = R.standard_normal((2, 4, 3)).astype(F32)
    out = h.call(layer, h.array(q2), h.array(k), h.array(v))
    assert tuple(h.ops.shape(out)) == (2, 4, 8)


def test_built_layer_rejects_other_input_width(backend: str) -> None:
    h = Harness(backend)
    layer = built_mha(h)
    before = snapshot(h, layer)
    q, k, v = qkv(q=(2, 4, 5))
    with pytest.raises(ValueError, match=re.escape(
            "queries last dimension (5) must be 8, the size this layer was built for")):
        h.call(layer, h.array(q), h.array(k), h.array(v))
    assert_unchanged(h, layer, before)


SET_WEIGHTS_ERRORS = [
    ("missing", lambda w: {k: v for k, v in w.items() if k != "W_o.kernel"}, ValueError,
     "set_weights: missing weights ['W_o.kernel'], unexpected weights []; expected exactly "
     "['W_k.kernel', 'W_o.kernel', 'W_q.kernel', 'W_v.kernel']"),
    ("unexpected", lambda w: {**w, "W_x.kernel": w["W_o.kernel"]}, ValueError,
     "set_weights: missing weights [], unexpected weights ['W_x.kernel']; expected exactly "
     "['W_k.kernel', 'W_o.kernel', 'W_q.kernel', 'W_v.kernel']"),
    ("shape", lambda w: {**w, "W_q.kernel": w["W_q.kernel"][:3]}, ValueError,
     "set_weights: W_q.kernel has shape (3, 8), expected (8, 8)"),
    ("integer", lambda w: {**w, "W_k.kernel": w["W_k.kernel"].astype(np.int64)}, TypeError,
     "set_weights: W_k.kernel must be floating point, got int64"),
    ("not_mapping", lambda w: list(w.values()), TypeError,
     "set_weights: weights must be a mapping of name -> array, got list"),
]


@pytest.mark.parametrize("name, change, exc, message", SET_WEIGHTS_ERRORS,
                         ids=[c[0] for c in SET_WEIGHTS_ERRORS])
def test_set_weights_checks_everything_first(backend: str, name: str, change: Any,
                                             exc: type[Exception], message: str) -> None:
    h = Harness(backend)
    layer = built_mha(h)
    before = snapshot(h, layer)
    fresh = {k: v + 1.0 for k, v in before[0].items()}
    with pytest.raises(exc, match="^" + re.escape(message) + "$"):
        layer.set_weights(change(fresh))
    assert_unchanged(h, layer, before)


def test_positional_encoding_too_long(backend: str) -> None:
    h = Harness(backend)
    layer = h.make("PositionalEncoding", {"num_hiddens": 4, "max_len": 5})
    with pytest.raises(ValueError, match=re.escape("X has 6 positions, more than max_len (5)")):
        h.call(layer, h.array(np.zeros((1, 6, 4), F32)))


def test_positional_encoding_wrong_width(backend: str) -> None:
    h = Harness(backend)
    layer = h.make("PositionalEncoding", {"num_hiddens": 4, "max_len": 5})
    with pytest.raises(ValueError, match=re.escape("X last dimension (3) must be num_hiddens (4)")):
        h.call(layer, h.array(np.zeros((1, 2, 3), F32)))


def test_get_weights_before_first_call(backend: str) -> None:
    h = Harness(backend)
    layer = h.make("MultiHeadAttention", {"num_hiddens": 8, "num_heads": 2})
    with pytest.raises(ValueError, match="weights are created on the first call"):
        layer.get_weights()
