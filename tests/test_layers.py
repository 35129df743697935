"""Layer behaviour shared by every backend: the seeds' own usage, shapes, training mode."""

from __future__ import annotations

import numpy as np

import attention_core as ac
from tests import naive
from tests.harness import Harness, max_diff

#: These tests run on the columns too (conftest.py; tests.harness.COLUMNS).
COLUMN_TESTS = True


def test_seed_usage_multi_head(backend: str) -> None:
    """As the seed uses it, in each way a layer can be set up (Gluon: hybridized too)."""
    h = Harness(backend)
    for setup in h.setups():
        attention = h.make("MultiHeadAttention", {"num_hiddens": 100, "num_heads": 5, "dropout": 0.5})
        setup(attention)
        X = h.array(np.ones((2, 4, 100), np.float32))
        valid_lens = h.array(np.array([3, 2]))
        out = h.call(attention, X, X, X, valid_lens)
        assert tuple(h.ops.shape(out)) == (2, 4, 100)
        w = h.numpy(h.attention_weights(attention))
        assert w.shape == (2, 5, 4, 4)
        np.testing.assert_allclose(w[0, :, :, :3], 1 / 3, atol=1e-6)
        np.testing.assert_array_equal(w[0, :, :, 3], 0.0)
        np.testing.assert_allclose(w[1, :, :, :2], 1 / 2, atol=1e-6)
        np.testing.assert_array_equal(w[1, :, :, 2:], 0.0)


def test_seed_usage_positional(backend: str) -> None:
    h = Harness(backend)
    encoding = h.module.PositionalEncoding(32, 0)
    X = h.call(encoding, h.array(np.zeros((1, 60, 32), np.float32)))
    np.testing.assert_array_equal(h.numpy(X), h.numpy(encoding.P)[:, :60])
    assert h.numpy(encoding.P).shape == (1, 1000, 32)
    assert max_diff(h.numpy(encoding.P)[0], naive.pe_table(1000, 32)) <= 1e-5
    np.testing.assert_array_equal(h.numpy(encoding.P)[0],
                                  ac.sinusoidal_encoding(1000, 32, "float32"))


def test_single_head_layers_report_one_head(backend: str) -> None:
    h = Harness(backend)
    q, k, v = (np.ones(s, np.float32) for s in [(2, 3, 4), (2, 5, 4), (2, 5, 6)])
    for layer in (h.make("DotProductAttention", {}), h.make("AdditiveAttention", {"num_hiddens": 7})):
        out, w = h.call(layer, h.array(q), h.array(k), h.array(v), return_attention=True)
        assert tuple(h.ops.shape(out)) == (2, 3, 6)
        assert tuple(h.ops.shape(w)) == (2, 1, 3, 5)


def test_numpy_layers_dropout_only_in_training() -> None:
    h = Harness("numpy")
    layer = h.module.DotProductAttention(dropout=0.5, seed=3)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s) for s in [(2, 3, 4), (2, 5, 4), (2, 5, 6)])
    a = layer(q, k, v)
    np.testing.assert_array_equal(a, layer(q, k, v))  # inference: deterministic
    b = layer(q, k, v, training=True)
    assert not np.allclose(a, b)


def test_numpy_seed_fixes_initial_weights() -> None:
    h = Harness("numpy")
    x = np.ones((1, 2, 4), np.float32)
    a, b = (h.module.MultiHeadAttention(4, 2, seed=7) for _ in range(2))
    a(x, x, x), b(x, x, x)
    for name, value in a.get_weights().items():
        np.testing.assert_array_equal(value, b.get_weights()[name])


#: Token id dtypes: each framework's integer dtypes (MXNet has no int16/uint16/uint32/uint64
#: arrays; JAX holds 64-bit ids only with x64 on, else NumPy's are narrowed to 32 bits).
TOKEN_DTYPES = ("int8", "uint8", "int16", "uint16", "int32", "int64", "uint32", "uint64")


def test_encoder_token_ids_of_every_integer_dtype(backend: str) -> None:
    """The encoder takes ids of every integer dtype its framework holds, all giving one answer."""
    h = Harness(backend)
    config = {"vocab_size": 11, "num_hiddens": 8, "ffn_num_hiddens": 12, "num_heads": 2,
              "num_blks": 2}
    encoder = h.make("TransformerEncoder", config)
    ids = np.array([[1, 2, 3, 10], [0, 0, 5, 9]])
    h.call(encoder, h.array(ids.astype(np.int32)))
    weights = {name: np.asarray(w, np.float64) for name, w in encoder.get_weights().items()}
    vis = np.ones((2, 2, 4, 4), bool)
    want, _ = naive.transformer_encoder(ids, weights, 2, vis)
    tried: list[str] = []
    first = np.zeros(0)
    for dtype in TOKEN_DTYPES:
        try:
            tokens = h.array(ids.astype(dtype))
        except (TypeError, ValueError, KeyError):  # a dtype the framework cannot hold
            continue
        if h.ops.dtype_name(tokens) != dtype:
            continue  # narrowed on the way in (JAX without x64)
        tried.append(dtype)
        got = h.numpy(h.call(encoder, tokens))
        assert max_diff(got, want) <= 1e-4, dtype
        np.testing.assert_array_equal(got, first if tried[1:] else got)  # one answer for all
        first = got
        functional = ac.transformer_encoder(tokens, {k: h.array(v.astype(np.float32))
                                                     for k, v in weights.items()}, 2)
        assert max_diff(h.numpy(functional), want) <= 1e-4, dtype
    assert {"int8", "uint8", "int32", "int64"} <= set(tried) or h.arrays == "jax"


def test_token_ids_from_the_host_are_taken_on_every_backend(backend: str) -> None:
    """Token ids as NumPy arrays of any integer dtype, nested lists, with lengths as NumPy or
    lists: read on the host like lengths and masks, they give the reference's answer."""
    h = Harness(backend)
    config = {"vocab_size": 11, "num_hiddens": 8, "ffn_num_hiddens": 12, "num_heads": 2,
              "num_blks": 1}
    encoder = h.make("TransformerEncoder", config)
    ids, lens = np.array([[1, 2, 3, 10], [0, 0, 5, 9]]), np.array([4, 2])
    h.call(encoder, h.array(ids.astype(np.int32)))
    weights = {name: np.asarray(w, np.float64) for name, w in encoder.get_weights().items()}
    vis = np.broadcast_to(np.arange(4) < lens[:, None, None, None], (2, 2, 4, 4))
    want, _ = naive.transformer_encoder(ids, weights, 2, vis)
    for tokens, valid_lens in ((ids, lens), (ids.tolist(), lens.tolist()),
                               (ids.astype(np.uint8), lens.astype(np.int32))):
        got = h.call(encoder, tokens, valid_lens)
        assert ac.registry.backend_of(got) == h.arrays
        assert max_diff(h.numpy(got), want) <= 1e-4, type(tokens).__name__
