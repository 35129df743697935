"""Each framework's own call keywords (:mod:`attention_core.conventions`) and the shorthand.

Every layer is called with its framework's keywords and compared twice: with the same layer
called the library's way (the canonical arguments they stand for), and with the framework's
own layer given the same weights (converted) and the same native masks, within the fp32
tolerance. The expected values of the second comparison are the native layers' forward passes.

Sections run when their backend is named in ``ATTENTION_CORE_TEST_BACKENDS`` (a named backend
is imported unconditionally, so a missing one fails): torch (``nn.MultiheadAttention``,
``nn.TransformerEncoderLayer``), tensorflow (``keras.layers.MultiHeadAttention``), jax
(``flax.linen.MultiHeadDotProductAttention``). The self-attention shorthand runs on every
backend and column, over the harness.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest

from conftest import test_backends
from tests.harness import TOLERANCE, Harness, max_diff

#: The shorthand runs on the columns too (conftest.py; tests.harness.COLUMNS).
COLUMN_TESTS = True

TESTED = test_backends()
TOL = TOLERANCE["float32"]
B, T, S, H, D = 2, 5, 6, 2, 4  # batch, queries, keys (cross-attention), heads, head size
h = H * D
F = 12  # the encoder block's FFN width
LENS = np.array([T, 3])


def data(seed: int, *shape: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def allowed(seed: int, *shape: int) -> np.ndarray:
    """A random boolean mask with at least one True per row (True = may attend)."""
    mask = np.random.default_rng(seed).random(shape) > 0.4
    mask[..., 0] = True
    return mask


# -- the self-attention shorthand, every backend ---------------------------------------------


@pytest.mark.parametrize("layer, config", [
    ("MultiHeadAttention", {"num_hiddens": h, "num_heads": H}),
    ("DotProductAttention", {}),
    ("AdditiveAttention", {"num_hiddens": 6}),
])
def test_self_attention_shorthand(backend: str, layer: str, config: dict[str, Any]) -> None:
    """``layer(X)`` is ``layer(X, X, X)``; ``layer(Q, KV)`` is ``layer(Q, KV, KV)``."""
    harness = Harness(backend)
    ours = harness.make(layer, config)
    X, KV = harness.array(data(0, B, T, h)), harness.array(data(1, B, S, h))
    full = harness.numpy(harness.call(ours, X, X, X))
    assert max_diff(harness.numpy(harness.call(ours, X)), full) == 0.0
    assert max_diff(harness.numpy(harness.call(ours, X, KV)),
                    harness.numpy(harness.call(ours, X, KV, KV))) == 0.0
    other = harness.numpy(harness.call(ours, X, KV, harness.array(data(2, B, S, h))))
    assert max_diff(harness.numpy(harness.call(ours, X, KV)), other) > 1e-3  # values matter


def test_shorthand_keeps_masks(backend: str) -> None:
    harness = Harness(backend)
    ours = harness.make("MultiHeadAttention", {"num_hiddens": h, "num_heads": H})
    X = harness.array(data(0, B, T, h))
    lens = harness.array(LENS) if backend != "mxnet" else LENS
    short = harness.numpy(harness.call(ours, X, valid_lens=lens, causal=True))
    full = harness.numpy(harness.call(ours, X, X, X, lens, causal=True))
    assert max_diff(short, full) == 0.0


# -- torch ----------------------------------------------------------------------------------

needs_torch = pytest.mark.skipif("torch" not in TESTED, reason="torch is not tested in this env")
if "torch" in TESTED:
    import torch
    from torch import nn

    import backends.torch as torch_layers
    from backends.torch import convert as torch_convert


def torch_randomised(module: Any, seed: int) -> Any:
    """Every parameter random: no zero bias or unit scale hides a term."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.add_(0.3 * torch.randn(param.shape, generator=generator))
    return module.eval()


def torch_pair() -> tuple[Any, Any]:
    native = torch_randomised(nn.MultiheadAttention(h, H, batch_first=True), 0)
    ours = torch_layers.MultiHeadAttention(**torch_convert.torch_config(native)).eval()
    ours.set_weights(torch_convert.from_torch(native))
    return native, ours


def torch_masks(K: int) -> dict[str, Any]:
    """torch's masks for Q = T queries and K keys, and their canonical counterparts."""
    blocked = torch.from_numpy(~allowed(3, T, K))
    blocked_heads = torch.from_numpy(~allowed(4, B * H, T, K))
    padded = torch.arange(K)[None, :] >= torch.tensor([K, 3])[:, None]
    bias = torch.from_numpy(data(5, T, K))
    bias[0, 1] = -torch.inf
    bias_heads = torch.from_numpy(data(6, B * H, T, K))
    padding_bias = torch.from_numpy(data(7, B, K))
    return {"blocked": blocked, "blocked_heads": blocked_heads, "padded": padded, "bias": bias,
            "bias_heads": bias_heads, "padding_bias": padding_bias}


def torch_cases(K: int) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(name, torch's keywords, the canonical keywords meaning the same)."""
    m = torch_masks(K)
    heads = lambda x: x.reshape(B, H, T, K)  # noqa: E731 - torch's (B*H, Q, K), batch-major
    lens = torch.tensor([K, 3])
    cases = [
        ("attn_mask_bool", {"attn_mask": m["blocked"]}, {"mask": ~m["blocked"]}),
        ("attn_mask_bool_heads", {"attn_mask": m["blocked_heads"]},
         {"mask": heads(~m["blocked_heads"])}),
        ("attn_mask_float", {"attn_mask": m["bias"]}, {"score_bias": m["bias"]}),
        ("attn_mask_float_heads", {"attn_mask": m["bias_heads"]},
         {"score_bias": heads(m["bias_heads"])}),
        ("key_padding_mask", {"key_padding_mask": m["padded"]}, {"valid_lens": lens}),
        ("key_padding_mask_float", {"key_padding_mask": m["padding_bias"]},
         {"score_bias": m["padding_bias"][:, None, None, :]}),
        ("both_bool", {"attn_mask": m["blocked"], "key_padding_mask": m["padded"]},
         {"mask": ~m["blocked"], "valid_lens": lens}),
        ("both_float", {"attn_mask": m["bias_heads"], "key_padding_mask": m["padding_bias"]},
         {"score_bias": heads(m["bias_heads"]) + m["padding_bias"][:, None, None, :]}),
    ]
    if K == T:
        causal = torch.ones(T, T, dtype=torch.bool).triu(1)
        cases.append(("is_causal", {"attn_mask": causal, "is_causal": True}, {"causal": True}))
    return cases


CROSS = [pytest.param(T, id="self"), pytest.param(S, id="cross")]


@needs_torch
@pytest.mark.parametrize("K", CROSS)
def test_torch_keywords_match_native_and_canonical(K: int) -> None:
    native, ours = torch_pair()
    X, KV, V = (torch.from_numpy(data(i, B, n, h)) for i, n in ((10, T), (11, K), (12, K)))
    for name, keywords, canonical in torch_cases(K):
        expected, expected_weights = native(X, KV, V, **keywords)
        got, weights = ours(X, KV, V, need_weights=True, **keywords)
        assert max_diff(got.detach(), expected.detach()) <= TOL, name
        assert max_diff(weights.detach(), expected_weights.detach()) <= TOL, name
        plain = ours(X, KV, V, **keywords)
        assert max_diff(plain.detach(), expected.detach()) <= TOL, name  # no tuple: one output
        assert max_diff(ours(X, KV, V, **canonical).detach(), got.detach()) <= TOL, name
        if K == T:  # torch's names for the inputs, and the shorthand
            by_name = ours(query=X, key=X, value=X, **keywords)
            assert max_diff(by_name.detach(), native(X, X, X, **keywords)[0].detach()) <= TOL, name
            assert max_diff(ours(X, **keywords).detach(), by_name.detach()) == 0.0, name


@needs_torch
def test_torch_return_forms() -> None:
    native, ours = torch_pair()
    X = torch.from_numpy(data(13, B, T, h))
    mask = torch.from_numpy(~allowed(14, T, T))
    expected, per_head = native(X, X, X, attn_mask=mask, average_attn_weights=False)
    _, weights = ours(X, X, X, attn_mask=mask, need_weights=True, average_attn_weights=False)
    assert tuple(weights.shape) == (B, H, T, T)
    assert max_diff(weights.detach(), per_head.detach()) <= TOL
    alone = ours(X, attn_mask=mask, average_attn_weights=False)  # need_weights: torch's True
    assert max_diff(alone[1].detach(), per_head.detach()) <= TOL
    out, none = ours(X, attn_mask=mask, need_weights=False)
    assert none is None and max_diff(out.detach(), expected.detach()) <= TOL
    # the library's own form is kept when torch's keywords are not given
    _, canonical_weights = ours(X, X, X, mask=~mask, return_attention=True)
    assert tuple(canonical_weights.shape) == (B, H, T, T)
    assert max_diff(canonical_weights.detach(), per_head.detach()) <= TOL


@needs_torch
def test_torch_is_causal_alone_means_causal() -> None:
    """torch's nn.MultiheadAttention wants attn_mask with is_causal (a hint); here is_causal
    alone is the causal mask, like F.scaled_dot_product_attention's."""
    native, ours = torch_pair()
    X = torch.from_numpy(data(15, B, T, h))
    causal = torch.ones(T, T, dtype=torch.bool).triu(1)
    expected = native(X, X, X, attn_mask=causal, is_causal=True)[0]
    assert max_diff(ours(X, is_causal=True).detach(), expected.detach()) <= TOL
    assert max_diff(ours(X, X, X, causal=True).detach(), expected.detach()) <= TOL


def encoder_layer_pair() -> tuple[Any, Any]:
    native = torch_randomised(nn.TransformerEncoderLayer(h, H, F, 0.0, batch_first=True), 1)
    ours = torch_layers.TransformerEncoderBlock(**torch_convert.encoder_layer_config(native))
    ours.set_weights(torch_convert.from_torch_encoder_layer(native))
    return native, ours.eval()


@needs_torch
def test_torch_encoder_block_keywords_match_native_and_canonical() -> None:
    native, ours = encoder_layer_pair()
    X = torch.from_numpy(data(16, B, T, h))
    square = nn.Transformer.generate_square_subsequent_mask(T)  # float, -inf above the diagonal
    for name, keywords, canonical in torch_cases(T):
        keywords = {("src_" + k if k != "is_causal" else k).replace("src_attn_", "src_"): v
                    for k, v in keywords.items()}
        if name == "is_causal":
            keywords["src_mask"] = square
            canonical = {"causal": True}
        expected = native(X, **keywords)
        got = ours(X, **keywords)
        assert max_diff(got.detach(), expected.detach()) <= TOL, name
        assert max_diff(ours(X, **canonical).detach(), got.detach()) <= TOL, name
        assert max_diff(ours(src=X, **keywords).detach(), got.detach()) == 0.0, name


TORCH_ERRORS = [
    ("mask_and_attn_mask", lambda X, m: {"mask": ~m["blocked"], "attn_mask": m["blocked"]},
     TypeError, "got both mask and attn_mask (torch's attention mask: True = may not attend, or "
                "a float added to the scores): give one of them"),
    ("score_bias_and_attn_mask", lambda X, m: {"score_bias": m["bias"], "attn_mask": m["bias"]},
     TypeError, "got both score_bias and attn_mask (torch's attention mask: True = may not "
                "attend, or a float added to the scores): give one of them"),
    ("valid_lens_and_key_padding_mask",
     lambda X, m: {"valid_lens": torch.tensor([5, 3]), "key_padding_mask": m["padded"]},
     TypeError, "got both valid_lens and key_padding_mask (torch's padding mask: True = a padded "
                "key, or a float added to its scores): give one of them"),
    ("causal_and_is_causal", lambda X, m: {"causal": True, "is_causal": True}, TypeError,
     "got both causal and is_causal (torch's causal flag): give one of them"),
    ("return_attention_and_need_weights",
     lambda X, m: {"return_attention": True, "need_weights": True}, TypeError,
     "got both return_attention and need_weights (torch's return form): give one of them"),
    ("queries_and_query", lambda X, m: {"queries": X, "query": X}, TypeError,
     "got both queries and query (torch's name for queries): give one of them"),
    ("int_attn_mask", lambda X, m: {"attn_mask": m["blocked"].int()}, TypeError,
     "attn_mask must be boolean (True = may not attend) or floating point (added to the "
     "scores), got int32"),
    ("bool_and_float", lambda X, m: {"attn_mask": m["blocked"],
                                     "key_padding_mask": m["padding_bias"]}, TypeError,
     "attn_mask and key_padding_mask must both be boolean or both floating point (torch "
     "deprecates the mix), got bool and float32"),
    ("attn_mask_shape", lambda X, m: {"attn_mask": m["blocked_heads"][:3]}, ValueError,
     "attn_mask must have shape (Q, K) = (5, 5) or (B * num_heads, Q, K) = (4, 5, 5), "
     "got (3, 5, 5)"),
    ("key_padding_mask_shape", lambda X, m: {"key_padding_mask": m["padded"][:, :3]}, ValueError,
     "key_padding_mask must have shape (B, K) = (2, 5), got (2, 3)"),
    ("is_causal_cross", lambda X, m: {"key": X[:, :3], "value": X[:, :3], "is_causal": True},
     ValueError, "is_causal=True with 5 queries and 3 keys: torch's causal flag aligns the "
                 "causal mask at the first key, this library's causal=True at the last; give a "
                 "boolean mask instead"),
    ("no_queries", lambda X, m: {"key": X}, TypeError, "missing a required argument: 'queries'"),
]


@needs_torch
@pytest.mark.parametrize(("keywords", "error", "message"), [row[1:] for row in TORCH_ERRORS],
                         ids=[row[0] for row in TORCH_ERRORS])
def test_torch_keyword_errors(keywords: Any, error: type, message: str) -> None:
    _, ours = torch_pair()
    X = torch.from_numpy(data(17, B, T, h))
    arguments = keywords(X, torch_masks(T))
    args = () if {"queries", "query"} & set(arguments) or set(arguments) == {"key"} else (X,)
    before = ours.get_weights()
    with pytest.raises(error, match=re.escape(message)):
        ours(*args, **arguments)
    assert all(np.array_equal(v, ours.get_weights()[k]) for k, v in before.items())


@needs_torch
def test_torch_float_mask_needs_score_bias() -> None:
    ours = torch_layers.AdditiveAttention(6)
    X = torch.from_numpy(data(18, B, T, h))
    with pytest.raises(TypeError, match=re.escape(
            "a floating-point attn_mask is added to the scores, which AdditiveAttention does "
            "not take (no score_bias): give a boolean mask")):
        ours(X, attn_mask=torch.zeros(T, T))
    blocked = torch.from_numpy(~allowed(19, T, T))
    assert max_diff(ours(X, attn_mask=blocked).detach(), ours(X, mask=~blocked).detach()) == 0.0


@needs_torch
def test_torch_signature_lists_the_keywords() -> None:
    import inspect

    names = inspect.signature(torch_layers.MultiHeadAttention.forward).parameters
    assert {"attn_mask", "key_padding_mask", "is_causal", "need_weights",
            "average_attn_weights", "query", "key", "value"} <= set(names)
    block = inspect.signature(torch_layers.TransformerEncoderBlock.forward).parameters
    assert {"src", "src_mask", "src_key_padding_mask", "is_causal"} <= set(block)
    assert "attn_mask" not in block and "src_mask" not in names


# -- Keras ----------------------------------------------------------------------------------

needs_tf = pytest.mark.skipif("tensorflow" not in TESTED,
                              reason="tensorflow is not tested in this env")
if "tensorflow" in TESTED:
    import keras

    import backends.tensorflow as tf_layers
    from backends.tensorflow import convert as keras_convert


def keras_pair() -> tuple[Any, Any]:
    native = keras.layers.MultiHeadAttention(H, D)
    native(data(0, B, T, h), data(1, B, S, h), data(2, B, S, h))
    rng = np.random.default_rng(3)
    native.set_weights([rng.normal(0, 0.4, w.shape).astype(np.float32)
                        for w in native.get_weights()])
    ours = tf_layers.MultiHeadAttention(**keras_convert.keras_config(native))
    ours.set_weights(keras_convert.from_keras(native))
    return native, ours


@needs_tf
def test_keras_keywords_match_native_and_canonical() -> None:
    native, ours = keras_pair()
    q, v, k = data(20, B, T, h), data(21, B, S, h), data(22, B, S, h)
    mask = allowed(23, B, T, S)
    # Keras' (query, value): the keys are the values, positionally as here
    assert max_diff(ours(q, v), native(q, v)) <= TOL
    # Keras' (query, value, key) by its keywords; positional calls keep (queries, keys, values)
    by_name = ours(query=q, value=v, key=k, attention_mask=mask)
    expected = native(q, v, k, attention_mask=mask)
    assert max_diff(by_name, expected) <= TOL
    assert max_diff(ours(q, k, v, mask=mask), by_name) == 0.0
    # use_causal_mask and return_attention_scores
    out, scores = ours(query=q, value=q, use_causal_mask=True, return_attention_scores=True)
    expected, expected_scores = native(q, q, use_causal_mask=True, return_attention_scores=True)
    assert max_diff(out, expected) <= TOL and max_diff(scores, expected_scores) <= TOL
    canonical, weights = ours(q, causal=True, return_attention=True)
    assert max_diff(canonical, out) == 0.0 and max_diff(weights, scores) == 0.0


@needs_tf
def test_keras_keywords_in_a_functional_model() -> None:
    """Keras binds a call to ``call``'s signature and builds from the inputs' names."""
    native, ours = keras_pair()
    query, value = keras.Input((T, h)), keras.Input((S, h))
    model = keras.Model([query, value], ours(query=query, value=value))
    q, v = data(24, B, T, h), data(25, B, S, h)
    assert max_diff(model([q, v]), native(q, v)) <= TOL
    fresh = tf_layers.MultiHeadAttention(h, H)
    x = keras.Input((T, h))
    model = keras.Model(x, fresh(x, use_causal_mask=True))
    assert max_diff(model(q), fresh(q, q, q, causal=True)) == 0.0


def keras_paddings() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Keras' ``query_mask (B, T)``, ``value_mask`` and ``key_mask (B, S)``: True = real."""
    return (np.arange(T) < np.array([[T], [3]]), np.arange(S) < np.array([[S], [4]]),
            np.arange(S)[None] != np.array([[1], [0]]))


@needs_tf
def test_keras_padding_keywords_match_native_and_canonical() -> None:
    """``query_mask``, ``value_mask``, ``key_mask`` (with and without ``attention_mask``): the
    rows of real queries equal Keras' layer; every row equals the canonical mask."""
    native, ours = keras_pair()
    q, v, k = data(40, B, T, h), data(41, B, S, h), data(42, B, S, h)
    q_real, v_real, k_real = keras_paddings()
    both = q_real[:, :, None] & (v_real & k_real)[:, None, :]  # (B, T, S)
    for extra in ({}, {"attention_mask": allowed(43, B, T, S)}):
        pads = {"query_mask": q_real, "value_mask": v_real, "key_mask": k_real}
        got, weights = ours(query=q, value=v, key=k, **pads, **extra,
                            return_attention_scores=True)
        expected = np.asarray(native(q, v, k, **pads, **extra))
        assert max_diff(np.asarray(got)[q_real], expected[q_real]) <= TOL
        mask = both & extra["attention_mask"] if extra else both
        canonical = ours(q, k, v, mask=mask)
        assert max_diff(got, canonical) == 0.0
        assert np.all(np.asarray(weights).transpose(0, 2, 1, 3)[~q_real] == 0.0)
    # one mask alone: value_mask is the keys' padding (key defaults to value)
    alone = ours(query=q, value=v, value_mask=v_real)
    assert max_diff(alone, native(q, v, value_mask=v_real)) <= TOL
    assert max_diff(alone, ours(q, v, v, valid_lens=np.array([S, 4]))) <= TOL


KERAS_PADDING_ERRORS = [
    ("query_mask_float", {"query_mask": np.ones((B, T), np.float32)}, TypeError,
     "query_mask must be boolean (True = a real token), got float32"),
    ("query_mask_shape", {"query_mask": np.ones((B, S), bool)}, ValueError,
     "query_mask must have shape (B, Q) = (2, 5), got (2, 6)"),
    ("key_mask_shape", {"key_mask": np.ones((B, T), bool)}, ValueError,
     "key_mask must have shape (B, K) = (2, 6), got (2, 5)"),
    ("valid_lens_and_value_mask", {"valid_lens": np.array([S, 2]),
                                   "value_mask": np.ones((B, S), bool)}, TypeError,
     "got both valid_lens and value_mask (Keras' padding mask of the values, True = a real "
     "value): give one of them"),
]


@needs_tf
@pytest.mark.parametrize(("keywords", "error", "message"),
                         [row[1:] for row in KERAS_PADDING_ERRORS],
                         ids=[row[0] for row in KERAS_PADDING_ERRORS])
def test_keras_padding_keyword_errors(keywords: dict[str, Any], error: type, message: str) -> None:
    _, ours = keras_pair()
    q, kv = data(44, B, T, h), data(45, B, S, h)
    before = ours.get_weights()
    with pytest.raises(error, match=re.escape(message)):
        ours(query=q, value=kv, **keywords)
    assert all(np.array_equal(v, ours.get_weights()[k]) for k, v in before.items())


KERAS_ERRORS = [
    ("mask_and_attention_mask", {"mask": True, "attention_mask": True}, TypeError,
     "got both mask and attention_mask (Keras' name for mask): give one of them"),
    ("causal_and_use_causal_mask", {"causal": True, "use_causal_mask": True}, TypeError,
     "got both causal and use_causal_mask (Keras' causal flag): give one of them"),
    ("return_attention_twice", {"return_attention": True, "return_attention_scores": True},
     TypeError, "got both return_attention and return_attention_scores (Keras' name for "
                "return_attention): give one of them"),
    ("keys_and_key", {"keys": "x", "key": "x"}, TypeError,
     "got both keys and key (Keras' name for keys): give one of them"),
    ("use_causal_mask_cross", {"value": "kv", "use_causal_mask": True}, ValueError,
     "use_causal_mask=True with 5 queries and 6 keys: Keras' causal flag aligns the causal "
     "mask at the first key, this library's causal=True at the last; give a boolean mask "
     "instead"),
]


@needs_tf
@pytest.mark.parametrize(("keywords", "error", "message"), [row[1:] for row in KERAS_ERRORS],
                         ids=[row[0] for row in KERAS_ERRORS])
def test_keras_keyword_errors(keywords: dict[str, Any], error: type, message: str) -> None:
    _, ours = keras_pair()
    q, kv = data(26, B, T, h), data(27, B, S, h)
    values = {"x": q, "kv": kv, True: allowed(28, B, T, T)}
    arguments = {k: values.get(v, v) if not isinstance(v, bool) or k in ("mask", "attention_mask")
                 else v for k, v in keywords.items()}
    before = ours.get_weights()
    with pytest.raises(error, match=re.escape(message)):
        ours(q, **arguments)
    assert all(np.array_equal(v, ours.get_weights()[k]) for k, v in before.items())


# -- Flax -----------------------------------------------------------------------------------

needs_jax = pytest.mark.skipif("jax" not in TESTED, reason="jax is not tested in this env")
if "jax" in TESTED:
    import flax.linen as flax_nn
    import jax
    import jax.numpy as jnp

    import backends.jax as jax_layers
    from backends.jax import convert as flax_convert


def flax_pair(dtype: Any = None) -> tuple[Any, Any, Any, Any]:
    native = flax_nn.MultiHeadDotProductAttention(num_heads=H, qkv_features=h, out_features=h,
                                                  dropout_rate=0.5, dtype=dtype)
    variables = native.init(jax.random.key(0), data(0, B, T, h), data(1, B, S, h),
                            deterministic=True)
    rng = np.random.default_rng(4)
    variables = jax.tree_util.tree_map(
        lambda a: jnp.asarray(rng.normal(0, 0.4, a.shape), a.dtype), variables)
    ours = jax_layers.MultiHeadAttention(**flax_convert.flax_config(variables, native),
                                         dtype=dtype)
    ours_variables = jax_layers.set_weights(None, flax_convert.from_flax(variables), layer=ours)
    return native, variables, ours, ours_variables


@needs_jax
def test_flax_keywords_match_native_and_canonical() -> None:
    native, variables, ours, ours_variables = flax_pair()
    q, kv = data(30, B, T, h), data(31, B, S, h)
    mask = allowed(32, B, 1, T, S)
    expected = native.apply(variables, q, kv, mask=mask, deterministic=True)
    got = ours.apply(ours_variables, q, kv, mask=mask, deterministic=True)
    assert max_diff(got, expected) <= TOL
    assert max_diff(ours.apply(ours_variables, q, kv, kv, mask=mask), got) == 0.0
    by_name = ours.apply(ours_variables, inputs_q=q, inputs_k=kv, mask=mask, deterministic=True)
    assert max_diff(by_name, expected) <= TOL
    self_expected = native.apply(variables, q, mask=mask[..., :T], deterministic=True)
    assert max_diff(ours.apply(ours_variables, q, mask=mask[..., :T]), self_expected) <= TOL


@needs_jax
def test_flax_deterministic_is_not_training() -> None:
    _, _, ours, variables = flax_pair()
    q = data(33, B, T, h)
    rngs = {"dropout": jax.random.key(5)}
    dropped = ours.apply(variables, q, deterministic=False, rngs=rngs)
    assert max_diff(dropped, ours.apply(variables, q, training=True, rngs=rngs)) == 0.0
    assert max_diff(dropped, ours.apply(variables, q)) > 1e-3  # dropout did act
    agreeing = ours.apply(variables, q, training=True, deterministic=False, rngs=rngs)
    assert max_diff(agreeing, dropped) == 0.0
    with pytest.raises(ValueError, match=re.escape(
            "training=True and deterministic=True disagree: deterministic means training=False; "
            "give one of them")):
        ours.apply(variables, q, training=True, deterministic=True)


@needs_jax
def test_flax_compute_dtype() -> None:
    """``dtype`` computes in bfloat16 on float32 params, as Flax's own layer does."""
    native, variables, ours, ours_variables = flax_pair(jnp.bfloat16)
    assert {a.dtype for a in jax.tree_util.tree_leaves(ours_variables)} == {jnp.dtype("float32")}
    q, kv = data(34, B, T, h), data(35, B, S, h)
    expected = native.apply(variables, q, kv, deterministic=True)
    got = ours.apply(ours_variables, q, kv)
    assert got.dtype == expected.dtype == jnp.bfloat16
    assert max_diff(got.astype(jnp.float32), expected.astype(jnp.float32)) <= TOLERANCE["bfloat16"]
    full = flax_pair()[2].apply(ours_variables, q, kv)
    assert full.dtype == jnp.float32
    assert max_diff(got.astype(jnp.float32), full) > 0.0  # it did compute in bfloat16
