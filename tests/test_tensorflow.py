"""Keras habits of the TensorFlow backend: tf.function and XLA, .keras files, configs, dropout.

The cross-backend files (test_reference_matrix, test_errors, test_weights, test_adapters, ...)
already run on this backend; these tests cover what only Keras has.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import test_backends

if "tensorflow" not in test_backends():
    pytest.skip("the tensorflow backend is not tested in this env", allow_module_level=True)

import keras
import tensorflow as tf

import attention_core as ac
import backends.numpy as numpy_layers
import backends.tensorflow as keras_layers
from attention_core import attention, blockwise
from backends.tensorflow.ops import OPS
from tests import naive
from tests.harness import TOLERANCE, max_diff
from tests.reference.cases import MASK_KINDS, mask_arguments
from tests.reference.generate import load

REPO = Path(__file__).resolve().parent.parent
B, Q, K = 2, 4, 6


def draw(*shapes: tuple[int, ...], seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


def doubled(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The masking arguments for the inputs repeated twice along the batch axis."""
    out = dict(kwargs)
    if "valid_lens" in out:
        out["valid_lens"] = np.concatenate([out["valid_lens"]] * 2)
    if "mask" in out and out["mask"].ndim >= 3:
        out["mask"] = np.concatenate([out["mask"]] * 2)
    return out


def spec(x: np.ndarray, keep_last: bool) -> tf.TensorSpec:
    """Every dimension unknown (the feature width kept when asked)."""
    shape = [None] * x.ndim
    if keep_last:
        shape[-1] = x.shape[-1]
    return tf.TensorSpec(shape, tf.as_dtype(x.dtype))


# -- tf.function, XLA, unknown batch; equal to NumPy with the same canonical weights -----------

SETUPS = {
    # layer: (numpy/keras constructor args, input shapes, whether causal may be given)
    "MultiHeadAttention": ({"num_hiddens": 12, "num_heads": 3, "bias": True},
                           [(B, Q, 10), (B, K, 7), (B, K, 9)], True),
    "TransformerEncoderBlock": ({"num_hiddens": 12, "ffn_num_hiddens": 16, "num_heads": 3,
                                 "bias": True}, [(B, K, 12)], False),
}
#: Mask kinds also run under XLA (each XLA compile takes a while on a small machine).
XLA_KINDS = ("valid_lens_1d", "valid_lens_2d", "mask_4d", "causal_valid_lens", "fully_masked_row")
GRAPH_CASES = [pytest.param(layer, kind, id=f"{layer}-{kind}")
               for layer, (_, _, causal) in SETUPS.items() for kind in MASK_KINDS
               if causal or not kind.startswith("causal")]


@pytest.mark.parametrize("layer, kind", GRAPH_CASES)
def test_graph_modes_equal_eager_and_numpy(layer: str, kind: str) -> None:
    config, shapes, _ = SETUPS[layer]
    inputs = draw(*shapes, seed=len(kind))
    q_len = shapes[0][1]
    masking = mask_arguments(kind, np.random.default_rng(1), 3, q=q_len, k=shapes[-1][1])
    reference = getattr(numpy_layers, layer)(**config, seed=0, dtype="float64")
    reference(*[x.astype(np.float64) for x in inputs])  # infers the input sizes
    weights = reference.get_weights()
    ours = getattr(keras_layers, layer)(**config)
    ours.set_weights({name: value.astype(np.float32) for name, value in weights.items()})

    causal = bool(masking.pop("causal", False))
    extra = {"causal": causal} if layer == "MultiHeadAttention" else {}
    names = sorted(masking)  # tensors passed to the traced function, by keyword
    arrays = [*inputs, *(masking[n] for n in names)]

    def call(*args: Any) -> Any:
        tensors = dict(zip(names, args[len(inputs):], strict=True))
        return ours(*args[: len(inputs)], **tensors, **extra)

    signature = [spec(a, keep_last=i < len(inputs)) for i, a in enumerate(arrays)]
    unknown = [tf.function(call, input_signature=signature)]
    if kind in XLA_KINDS:
        unknown.append(tf.function(call, input_signature=signature, jit_compile=True))
    graphs = list(unknown)
    if kind == "valid_lens_1d":  # XLA with every shape known, once per layer
        graphs.append(tf.function(call, jit_compile=True))

    eager = ours(*inputs, **masking, **extra).numpy()
    expected = reference(*[x.astype(np.float64) for x in inputs], **masking, **extra)
    assert max_diff(eager, expected) <= TOLERANCE["float32"]
    for fn in graphs:
        assert max_diff(fn(*arrays).numpy(), eager) <= TOLERANCE["float32"]
    # a second batch size runs through the same trace when the batch is unknown
    twice = [np.concatenate([x, x]) for x in inputs]
    masking2 = doubled(masking)
    expected2 = reference(*[x.astype(np.float64) for x in twice], **masking2, **extra)
    for fn in unknown:
        out = fn(*twice, *(masking2[n] for n in names)).numpy()
        assert max_diff(out, expected2) <= TOLERANCE["float32"]
        assert fn.experimental_get_tracing_count() == 1


def test_first_call_inside_tf_function_builds_the_layer() -> None:
    q, k = draw((B, Q, 5), (B, K, 3))
    layer = keras_layers.MultiHeadAttention(8, 2)
    fn = tf.function(lambda a, b: layer(a, b, b, return_attention=True),
                     input_signature=[tf.TensorSpec((None, Q, 5)), tf.TensorSpec((None, K, 3))])
    out, attn = fn(q, k)
    assert out.shape == (B, Q, 8) and attn.shape == (B, 2, Q, K)
    assert {n: v.shape for n, v in layer.get_weights().items()} == {
        "W_q.kernel": (5, 8), "W_k.kernel": (3, 8), "W_v.kernel": (3, 8), "W_o.kernel": (8, 8)}
    expected = ac.multi_head_attention(q.astype(float), k.astype(float), k.astype(float),
                                       layer.get_weights(), 2)
    assert max_diff(out.numpy(), expected) <= TOLERANCE["float32"]


def test_functional_api_under_xla() -> None:
    q, k, v = draw((B, 3, Q, 4), (B, 3, K, 4), (B, 3, K, 2))
    lens = np.array([[1, 2, 3, 6], [0, 6, 5, 4]])

    @tf.function(jit_compile=True)
    def fn(a: Any, b: Any, c: Any, lengths: Any) -> Any:
        return ac.dot_product_attention(a, b, c, lengths, causal=True, return_weights=True)

    out, weights = fn(q, k, v, lens)
    expected, expected_w = ac.dot_product_attention(
        q.astype(float), k.astype(float), v.astype(float), lens, causal=True, return_weights=True
    )
    assert max_diff(out.numpy(), expected) <= TOLERANCE["float32"]
    assert max_diff(weights.numpy(), expected_w) <= TOLERANCE["float32"]
    assert np.all(weights.numpy()[1, :, 0] == 0.0)  # valid length 0: the row is all zeros


# -- .keras files, configs, weights -------------------------------------------------------------


def every_layer_model() -> keras.Model:
    """A functional model using each of the eleven layers, unknown batch size."""
    h = 8
    x = keras.Input((5, h))
    lens = keras.Input((), dtype="int32")
    xq, xk, xv = keras.Input((3,)), keras.Input((6,)), keras.Input((6,))
    tokens = keras.Input((5,), dtype="int32")
    y = keras_layers.PositionalEncoding(h, 0.1, max_len=20)(x)
    y = keras_layers.LearnedPositionalEncoding(h, 0.1, max_len=20)(y)
    y = keras_layers.MultiHeadAttention(h, 2, 0.1, bias=True)(y, y, y, lens)
    y = keras_layers.AdditiveAttention(7, 0.1)(y, x, x, lens)
    y = keras_layers.DotProductAttention(0.1)(y, x, y, causal=True)
    y = keras_layers.AddNorm(h, 0.1)(y, keras_layers.PositionWiseFFN(11, h)(y))
    y = keras_layers.TransformerEncoderBlock(h, 12, 4, 0.1)(y, lens)
    encoded = keras_layers.TransformerEncoder(10, h, 12, 2, 2, 0.1, bias=True)(tokens, lens)
    y = keras_layers.RelativeMultiHeadAttention(h, 2, 2, 0.1, bias=True)(y, encoded, encoded, lens)
    z = keras_layers.NadarayaWatson(parametric=True)(xq, xk, xv)
    return keras.Model([x, lens, xq, xk, xv, tokens], [y, z])


def model_inputs(batch: int = 3) -> list[np.ndarray]:
    x, xq, xk, xv = draw((batch, 5, 8), (batch, 3), (batch, 6), (batch, 6), seed=4)
    tokens = np.random.default_rng(4).integers(0, 10, (batch, 5)).astype(np.int32)
    return [x, np.arange(batch, dtype=np.int32) % 5 + 1, xq, xk, xv, tokens]


# Keras 3.15 saving calls np.array(variable) under NumPy 2; a plain Dense model warns the same.
@pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword")
def test_keras_file_round_trip(tmp_path: Path) -> None:
    model = every_layer_model()
    inputs = model_inputs()
    before = [y.numpy() for y in model(inputs)]
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert [type(layer) for layer in loaded.layers] == [type(layer) for layer in model.layers]
    after = [y.numpy() for y in loaded(inputs)]
    for a, b in zip(before, after, strict=True):
        np.testing.assert_array_equal(a, b)
    for src, dst in zip(model.layers, loaded.layers, strict=True):
        if isinstance(src, keras_layers.layers.Layer):
            theirs = dst.get_weights()
            assert sorted(theirs) == sorted(src.get_weights())
            for name, value in src.get_weights().items():
                np.testing.assert_array_equal(theirs[name], value)


def test_model_trains_with_fit() -> None:
    keras.utils.set_random_seed(0)
    x = keras.Input((5, 8))
    y = keras_layers.TransformerEncoderBlock(8, 12, 2, 0.1)(keras_layers.PositionalEncoding(8)(x))
    model = keras.Model(x, y)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    X, target = draw((16, 5, 8), (16, 5, 8), seed=5)
    start = model.evaluate(X, target, verbose=0)
    model.fit(X, target, epochs=10, batch_size=8, verbose=0)
    assert model.evaluate(X, target, verbose=0) < 0.9 * start


CONFIGS = [
    ("DotProductAttention", {"dropout": 0.2}),
    ("AdditiveAttention", {"num_hiddens": 7, "dropout": 0.1}),
    ("MultiHeadAttention", {"num_hiddens": 12, "num_heads": 3, "dropout": 0.1, "bias": True}),
    ("PositionalEncoding", {"num_hiddens": 6, "dropout": 0.3, "max_len": 50}),
    ("LearnedPositionalEncoding", {"num_hiddens": 6, "dropout": 0.0, "max_len": 50}),
    ("PositionWiseFFN", {"ffn_num_hiddens": 9, "ffn_num_outputs": 4}),
    ("AddNorm", {"num_hiddens": 6, "dropout": 0.2}),
    ("TransformerEncoderBlock", {"num_hiddens": 6, "ffn_num_hiddens": 10, "num_heads": 2,
                                 "dropout": 0.1, "bias": False}),
    ("NadarayaWatson", {"parametric": True}),
    ("DotProductAttention", {"dropout": 0.0, "keep_attention_weights": False,
                             "implementation": "blockwise"}),
    ("MultiHeadAttention", {"num_hiddens": 12, "num_heads": 3, "dropout": 0.0, "bias": False,
                            "keep_attention_weights": False, "implementation": "direct"}),
    ("TransformerEncoderBlock", {"num_hiddens": 6, "ffn_num_hiddens": 10, "num_heads": 2,
                                 "dropout": 0.0, "bias": False, "keep_attention_weights": False,
                                 "implementation": "blockwise"}),
    ("RelativeMultiHeadAttention", {"num_hiddens": 12, "num_heads": 3, "max_relative_position": 4,
                                    "dropout": 0.1, "bias": True}),
    ("RelativeMultiHeadAttention", {"num_hiddens": 6, "num_heads": 2, "max_relative_position": 1,
                                    "dropout": 0.0, "bias": False, "relative_values": False,
                                    "keep_attention_weights": False}),
    ("TransformerEncoder", {"vocab_size": 20, "num_hiddens": 6, "ffn_num_hiddens": 10,
                            "num_heads": 2, "num_blks": 3, "dropout": 0.1, "bias": True}),
    ("TransformerEncoder", {"vocab_size": 20, "num_hiddens": 6, "ffn_num_hiddens": 10,
                            "num_heads": 2, "num_blks": 1, "dropout": 0.0, "bias": False,
                            "keep_attention_weights": False, "implementation": "blockwise"}),
]


@pytest.mark.parametrize("layer, config", CONFIGS,
                         ids=[f"{c[0]}-{len(c[1])}" for c in CONFIGS])
def test_config_round_trip(layer: str, config: dict[str, Any]) -> None:
    cls = getattr(keras_layers, layer)
    original = cls(**config, name="original", dtype="float64")
    saved = original.get_config()
    assert {k: saved[k] for k in config} == config
    assert saved["name"] == "original"
    copy = cls.from_config(saved)
    assert copy.get_config() == saved and copy.compute_dtype == "float64"
    registered = keras.saving.serialize_keras_object(original)
    assert registered["registered_name"] == f"attention_core>{layer}"
    assert type(keras.saving.deserialize_keras_object(registered)) is cls


def test_two_weight_forms() -> None:
    layer = keras_layers.MultiHeadAttention(6, 2, dropout=0.5, bias=True)
    q, k, v = draw((1, 2, 4), (1, 3, 5), (1, 3, 3))
    layer(q, k, v)
    canonical = layer.get_weights()
    assert [w.name for w in layer.weights] == list(canonical)  # the variables carry the names
    as_list = layer.get_weight_list()
    assert len(as_list) == 8 == len(keras.layers.Layer.get_weights(layer))
    for value, (name, expected) in zip(as_list, canonical.items(), strict=True):
        np.testing.assert_array_equal(value, expected, err_msg=name)
    layer.set_weight_list([w * 2 for w in as_list])
    for name, value in layer.get_weights().items():
        np.testing.assert_array_equal(value, canonical[name] * 2)
    with pytest.raises(TypeError, match="weights must be a mapping"):
        layer.set_weights(as_list)


def test_keras_initial_weights_follow_set_random_seed() -> None:
    q, k, v = draw((1, 2, 4), (1, 3, 5), (1, 3, 3))
    weights = []
    for seed in (3, 3, 4):
        keras.utils.set_random_seed(seed)
        layer = keras_layers.MultiHeadAttention(6, 2)
        layer(q, k, v)
        weights.append(layer.get_weights()["W_q.kernel"])
    np.testing.assert_array_equal(weights[0], weights[1])
    assert not np.array_equal(weights[0], weights[2])


# -- training mode ------------------------------------------------------------------------------


def test_training_is_passed_down_by_a_model() -> None:
    x = keras.Input((Q, 8))
    model = keras.Model(x, keras_layers.TransformerEncoderBlock(8, 12, 2, dropout=0.5)(x))
    (X,) = draw((B, Q, 8))
    inference = model(X).numpy()
    np.testing.assert_array_equal(model(X, training=False).numpy(), inference)
    assert not np.allclose(model(X, training=True).numpy(), inference)


# -- low precision ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "mixed_float16"])
@pytest.mark.parametrize("layer", ["DotProductAttention", "MultiHeadAttention",
                                   "TransformerEncoderBlock"])
def test_low_precision_fully_masked_rows(layer: str, dtype: str) -> None:
    ref = load(layer)["fully_masked_row"]
    config = {"DotProductAttention": {}, "MultiHeadAttention": {"num_hiddens": 12, "num_heads": 3},
              "TransformerEncoderBlock": {"num_hiddens": 12, "ffn_num_hiddens": 16,
                                          "num_heads": 3}}[layer]
    obj = getattr(keras_layers, layer)(**config, dtype=dtype)
    weights = {k[7:]: v for k, v in ref.items() if k.startswith("weight.")}
    if weights:
        obj.set_weights(weights)
    names = ["X"] if layer == "TransformerEncoderBlock" else ["queries", "keys", "values"]
    inputs = [ref[f"input.{name}"] for name in names]
    out = obj(*inputs, valid_lens=ref["call.valid_lens"], mask=ref["call.mask"])
    compute = dtype.replace("mixed_", "")
    assert out.dtype == compute and obj.attention_weights.dtype == compute
    got, attn = np.asarray(out, np.float64), np.asarray(obj.attention_weights, np.float64)
    assert np.isfinite(got).all() and np.isfinite(attn).all()
    assert np.all(attn[0, :, 1] == 0) and np.all(attn[1, :, 2] == 0)
    assert max_diff(attn, ref["output.attention"]) <= TOLERANCE[compute]
    scale = max(1.0, float(np.abs(ref["output.out"]).max()))
    assert max_diff(got, ref["output.out"]) <= TOLERANCE[compute] * scale


# -- Keras integration details ------------------------------------------------------------------


#: Token ids with padding (0) at the end; row 2 has none, row 3 only one real token.
PADDED_TOKENS = np.array([[1, 2, 0, 0], [3, 1, 2, 0], [1, 1, 1, 1], [2, 0, 0, 0]])


def _padding_model(kind: str, batch: int) -> tuple[keras.Model, keras.Model, np.ndarray]:
    """``Embedding(mask_zero=True)`` -> layer, and the same weights given the explicit mask.

    Returns the model reading Keras' padding mask, the model given the equivalent ``(B, T, T)``
    attention mask (query AND key padding) as a second input, and the tokens.
    """
    keras.utils.set_random_seed(1)
    tokens = PADDED_TOKENS[:batch]
    steps = tokens.shape[1]
    ids = keras.Input((steps,), dtype="int32")
    explicit = keras.Input((steps, steps), dtype="bool")
    embed = keras.layers.Embedding(10, 8, mask_zero=True)
    if kind == "block":
        layer = keras_layers.TransformerEncoderBlock(8, 12, 2)
        masked, given = layer(embed(ids)), layer(embed(ids), mask=explicit)
    else:
        layer = ATTENTION_LAYERS[kind]()
        X = embed(ids)
        masked, given = layer(X, X, X), layer(X, X, X, mask=explicit)
    return keras.Model(ids, masked), keras.Model([ids, explicit], given), tokens


#: The attention layers, each taking (B, T, 8) queries, keys and values.
ATTENTION_LAYERS = {
    "mha": lambda: keras_layers.MultiHeadAttention(8, 2),
    "dot": lambda: keras_layers.DotProductAttention(),
    "additive": lambda: keras_layers.AdditiveAttention(6),
    "relative": lambda: keras_layers.RelativeMultiHeadAttention(8, 2, 2),
}


@pytest.mark.parametrize("batch", [4, 3], ids=["B==T", "B!=T"])
@pytest.mark.parametrize("kind", ["block", *ATTENTION_LAYERS])
def test_keras_padding_mask_is_query_and_key_padding(kind: str, batch: int) -> None:
    """Keras' ``(B, T)`` padding mask hides padded keys and rows, never read as ``(Q, K)``."""
    model, explicit_model, tokens = _padding_model(kind, batch)
    real = tokens != 0
    pair_mask = real[:, :, None] & real[:, None, :]  # (B, T, T)
    got = model.predict(tokens, verbose=0)
    want = explicit_model.predict([tokens, pair_mask], verbose=0)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # The unpadded rows equal the same layer given the lengths instead (valid_lens hides keys).
    layer = model.layers[-1]
    embedded = tf.identity(model.layers[1](tokens))  # the same values, no Keras mask
    lens = real.sum(axis=1)
    args = (embedded, lens) if kind == "block" else (embedded, embedded, embedded, lens)
    by_lens = layer(*args).numpy()
    np.testing.assert_allclose(got[real], by_lens[real], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["block", "mha", "encoder"])
def test_keras_padding_mask_keeps_padded_positions_out(kind: str) -> None:
    """Changing the padded positions' inputs does not change the real positions' outputs."""
    real = tf.constant(PADDED_TOKENS != 0)
    rng = np.random.default_rng(3)
    if kind == "encoder":
        layer: Any = keras_layers.TransformerEncoder(10, 8, 12, 2, 2)
        inputs = PADDED_TOKENS
        other = np.where(PADDED_TOKENS != 0, PADDED_TOKENS, rng.integers(1, 10, PADDED_TOKENS.shape))
    else:
        layer = (keras_layers.TransformerEncoderBlock(8, 12, 2) if kind == "block"
                 else keras_layers.MultiHeadAttention(8, 2))
        inputs = rng.standard_normal((4, 4, 8)).astype(np.float32)
        fresh = rng.standard_normal(inputs.shape)
        other = np.where(PADDED_TOKENS[..., None] != 0, inputs, fresh).astype(np.float32)
    outs = []
    for x in (inputs, other):
        x = tf.constant(x)
        x._keras_mask = real  # as Keras attaches a padding mask
        out = layer(x) if kind != "mha" else layer(x, x, x)
        assert getattr(out, "_keras_mask", None) is real  # the query's padding is propagated
        outs.append(out.numpy())
    np.testing.assert_allclose(outs[0][PADDED_TOKENS != 0], outs[1][PADDED_TOKENS != 0],
                               rtol=1e-5, atol=1e-5)
    if kind == "mha":  # a padded query sees no key: its row is 0, as any fully masked row
        np.testing.assert_array_equal(outs[0][PADDED_TOKENS == 0], 0.0)
    else:  # the padded rows did change (they pass through the residual branches)
        assert not np.allclose(outs[0], outs[1])


def test_keras_padding_mask_and_explicit_mask_combine() -> None:
    """An explicit attention mask is ANDed with the padding mask and is not propagated."""
    embedded = keras.layers.Embedding(10, 8, mask_zero=True)(PADDED_TOKENS)
    block = keras_layers.TransformerEncoderBlock(8, 12, 2)
    causal = np.tril(np.ones((4, 4), bool))
    real = PADDED_TOKENS != 0
    both = causal[None] & real[:, :, None] & real[:, None, :]
    out = block(embedded, mask=causal)
    plain = tf.identity(embedded)
    np.testing.assert_allclose(out.numpy(), block(plain, mask=both).numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(out._keras_mask.numpy(), real)
    assert getattr(block(plain, mask=causal), "_keras_mask", None) is None


def test_keras_padding_mask_is_checked() -> None:
    X = tf.ones((2, 3, 8))
    layer = keras_layers.MultiHeadAttention(8, 2)
    with pytest.raises(TypeError) as err:
        layer(X, X, X, queries_mask=tf.ones((2, 3), tf.int32))
    assert str(err.value) == (
        "queries_mask must be a boolean padding mask (True = real position), got int32"
    )
    with pytest.raises(ValueError) as err:
        layer(X, X, X, keys_mask=tf.ones((2, 4), tf.bool))
    assert str(err.value) == "keys_mask must have shape (2, 3), got (2, 4)"


def test_keras_padding_mask_trains() -> None:
    """``fit`` on Embedding(mask_zero=True) -> block -> masked pooling: finite, weights move."""
    keras.utils.set_random_seed(2)
    ids = keras.Input((None,), dtype="int32")
    h = keras_layers.TransformerEncoderBlock(8, 12, 2)(keras.layers.Embedding(10, 8, mask_zero=True)(ids))
    h = keras_layers.MultiHeadAttention(8, 2)(h, h, h)
    out = keras.layers.Dense(1)(keras.layers.GlobalAveragePooling1D()(h))
    model = keras.Model(ids, out)
    model.compile("adam", "mse")
    before = [w.numpy().copy() for w in model.weights]
    history = model.fit(np.tile(PADDED_TOKENS, (4, 1)), np.ones((16, 1)), epochs=3, batch_size=8,
                        verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert any(not np.array_equal(a, w.numpy()) for a, w in zip(before, model.weights, strict=True))


def test_keras_padding_mask_survives_a_keras_file(tmp_path: Path) -> None:
    model, _, tokens = _padding_model("block", 3)
    path = tmp_path / "padded.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    np.testing.assert_allclose(loaded.predict(tokens, verbose=0), model.predict(tokens, verbose=0),
                               rtol=1e-6, atol=1e-6)


def test_valid_lens_may_be_a_list() -> None:
    layer = keras_layers.MultiHeadAttention(8, 2)
    X = tf.ones((2, 4, 8))
    np.testing.assert_array_equal(layer(X, X, X, [3, 2]).numpy(),
                                  layer(X, X, X, tf.constant([3, 2])).numpy())


def test_other_keras_backend_is_refused() -> None:
    code = ("import keras; keras.backend.backend = lambda: 'jax'\n"
            "try:\n    import backends.tensorflow\n"
            "except ImportError as err:\n    print(err)\n")
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert ("backends.tensorflow needs the TensorFlow backend of Keras, but Keras is set to 'jax'"
            in out.stdout)
    assert "KERAS_BACKEND=tensorflow" in out.stdout


def test_unknown_input_width_cannot_build() -> None:
    layer = keras_layers.MultiHeadAttention(8, 2)
    fn = tf.function(lambda x: layer(x, x, x), input_signature=[tf.TensorSpec((None, None, None))])
    with pytest.raises(ValueError, match=r"MultiHeadAttention: the last dimension of queries, "
                                         r"keys and values must be known to create the weights"):
        fn(np.ones((1, 2, 4), np.float32))
    assert not layer.built and not layer.weights
    assert layer(*[np.ones((1, 2, 3), np.float32)] * 3).shape == (1, 2, 8)
    built = tf.function(lambda x: layer(x, x, x), input_signature=[tf.TensorSpec((None, None, None))])
    assert built(np.ones((1, 2, 3), np.float32)).shape == (1, 2, 8)  # built: width unknown when traced


# -- the blockwise path: tf.while_loop under tf.function and XLA, equal to the direct path ----

#: Ragged blocks: 13 queries in blocks of 4 (3 full and 1), 19 keys in blocks of 5 (3 and 4).
BQ, BH, BLQ, BLK, DEPTH = 2, 3, 13, 19, 8


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of 4 queries and 5 keys, so the loops run several times with a ragged tail."""
    monkeypatch.setattr(blockwise, "KEY_BLOCK", 5)
    monkeypatch.setattr(blockwise, "MIN_QUERY_BLOCK", 1)
    monkeypatch.setattr(blockwise, "TILE_SCORES", BQ * BH * 4 * 5)


def block_masks(kind: str, q: int = BLQ, k: int = BLK) -> dict[str, Any]:
    rng = np.random.default_rng(len(kind))
    if kind == "combined":  # every way of masking at once, ANDed
        return {**mask_arguments("valid_lens_2d", rng, BH, q, k, BQ),
                **mask_arguments("mask_3d", rng, BH, q, k, BQ), "causal": True}
    return mask_arguments(kind, rng, BH, q, k, BQ)


def block_inputs(q: int = BLQ, k: int = BLK) -> list[tf.Tensor]:
    shapes = (BQ, BH, q, DEPTH), (BQ, BH, k, DEPTH), (BQ, BH, k, 5)
    return [tf.constant(x) for x in draw(*shapes, seed=q + k)]


def pooled(implementation: str, q: Any, k: Any, v: Any, masks: dict[str, Any]) -> tf.Tensor:
    return attention.dot_product_attention(q, k, v, implementation=implementation, ops=OPS,
                                           **masks)


def test_blockwise_with_an_unknown_batch(small_blocks: None) -> None:
    q, k, v = block_inputs()
    lens = tf.constant([7, BLK], tf.int32)
    specs = [tf.TensorSpec([None, *x.shape[1:]], x.dtype) for x in (q, k, v)]
    traced = tf.function(lambda q, k, v, lens: pooled("blockwise", q, k, v, {"valid_lens": lens}),
                         input_signature=[*specs, tf.TensorSpec([None], tf.int32)])
    direct = pooled("direct", q, k, v, {"valid_lens": lens}).numpy()
    assert max_diff(traced(q, k, v, lens).numpy(), direct) <= TOLERANCE["float32"]


def test_blockwise_gradients_equal_direct_in_a_tf_function(small_blocks: None) -> None:
    """The tf.while_loop gradients in graph mode (eager: tests/test_adapters.py)."""
    q, k, v = block_inputs()
    masks = {name: tf.constant(x) if name != "causal" else x
             for name, x in block_masks("combined").items()}
    ct = tf.constant(draw((BQ, BH, BLQ, 5), seed=9)[0])

    def grads(implementation: str, q: Any, k: Any, v: Any) -> list[tf.Tensor]:
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            loss = tf.reduce_sum(pooled(implementation, q, k, v, masks) * ct)
        return list(tape.gradient(loss, [q, k, v]))

    run = tf.function(grads, autograph=False)
    for got, want in zip(run("blockwise", q, k, v), grads("direct", q, k, v), strict=True):
        assert max_diff(got.numpy(), want.numpy()) <= TOLERANCE["float32"]


def test_blockwise_dropout_in_a_layer_under_tf_function(small_blocks: None) -> None:
    keras.utils.set_random_seed(0)
    layer = keras_layers.DotProductAttention(0.5, keep_attention_weights=False,
                                             implementation="blockwise")
    q, k, v = draw((BQ, BLQ, DEPTH), (BQ, BLK, DEPTH), (BQ, BLK, 1), seed=1)
    v = np.ones_like(v)  # each output is then the sum of the kept weights, 0 or 2 each
    step = tf.function(lambda: layer(q, k, v, training=True))
    outs = [step().numpy() for _ in range(2)]
    assert not np.allclose(outs[0], outs[1])
    assert 0.5 < float(np.mean(outs[0])) < 1.5  # inverted dropout keeps the mean near 1


# -- relative positions and the Transformer encoder ---------------------------------------------

#: A small encoder: 10 token ids, width 8, FFN 12, 2 heads, 2 blocks.
ENC = {"vocab_size": 10, "num_hiddens": 8, "ffn_num_hiddens": 12, "num_heads": 2, "num_blks": 2}


def test_relative_attention_with_unknown_lengths_under_xla() -> None:
    """One trace with unknown batch and lengths serves several (Q, K), equal to NumPy."""
    reference = numpy_layers.RelativeMultiHeadAttention(12, 3, 2, bias=True, seed=0, dtype="float64")
    ours = keras_layers.RelativeMultiHeadAttention(12, 3, 2, bias=True)
    signature = [tf.TensorSpec((None, None, 10)), tf.TensorSpec((None, None, 7)),
                 tf.TensorSpec((None, None, 9)), tf.TensorSpec((None,), tf.int32)]
    fn = tf.function(lambda q, k, v, lens: ours(q, k, v, lens, causal=True, return_attention=True),
                     input_signature=signature, jit_compile=True)
    for q_len, k_len in ((4, 6), (5, 2)):  # keys after and before the queries' end: both clipped
        q, k, v = draw((B, q_len, 10), (B, k_len, 7), (B, k_len, 9), seed=q_len)
        lens = np.array([k_len, 1], np.int32)
        expected, expected_w = reference(*(x.astype(np.float64) for x in (q, k, v)), lens,
                                         causal=True, return_attention=True)
        if not ours.built:
            ours.set_weights({n: w.astype(np.float32) for n, w in reference.get_weights().items()})
        out, weights = fn(q, k, v, lens)
        assert max_diff(out.numpy(), expected) <= TOLERANCE["float32"]
        assert max_diff(weights.numpy(), expected_w) <= TOLERANCE["float32"]
    assert fn.experimental_get_tracing_count() == 1


def test_additive_attention_with_one_query_and_a_large_batch() -> None:
    """A Bahdanau decoder step's shapes: queries (64, 1, h). TF 2.21's oneDNN batch matmul
    corrupted the heap on the (B, 1, K, h) @ (h, 1) score product (tensorflow#117700); the ops
    now contract dense kernels with tensordot. Same numbers as the NumPy layer."""
    rng = np.random.default_rng(7)
    q = rng.standard_normal((64, 1, 64)).astype(np.float32)
    kv = rng.standard_normal((64, 9, 64)).astype(np.float32)
    lens = rng.integers(1, 10, 64)
    layer = keras_layers.AdditiveAttention(64)
    out = layer(tf.constant(q), tf.constant(kv), tf.constant(kv), tf.constant(lens))
    reference = numpy_layers.AdditiveAttention(64, dtype="float64")
    reference.set_weights(layer.get_weights())
    expected = reference(q.astype(np.float64), kv.astype(np.float64), kv.astype(np.float64), lens)
    assert max_diff(out.numpy(), expected) <= TOLERANCE["float32"]


# -- unknown sequence lengths (issue 14, item 16) -------------------------------------------------


def test_encoder_in_a_functional_model_of_unknown_length(tmp_path: Path) -> None:
    """``keras.Input((None,))``: build, predict at two lengths, fit, save and load."""
    keras.utils.set_random_seed(4)
    ids = keras.Input((None,), dtype="int32")
    encoder = keras_layers.TransformerEncoder(**ENC)
    model = keras.Model(ids, encoder(ids))
    rng = np.random.default_rng(5)
    for steps in (3, 9):
        tokens = rng.integers(0, 10, (2, steps))
        got = model.predict(tokens, verbose=0)
        assert max_diff(got, naive.encoder_of(encoder, tokens)) <= 1e-4
    model.compile("adam", "mse")
    history = model.fit(rng.integers(0, 10, (8, 6)), rng.standard_normal((8, 6, 8)), epochs=2,
                        batch_size=4, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    model.save(tmp_path / "encoder.keras")
    loaded = keras.models.load_model(tmp_path / "encoder.keras")
    tokens = rng.integers(0, 10, (2, 7))
    np.testing.assert_allclose(loaded.predict(tokens, verbose=0), model.predict(tokens, verbose=0),
                               rtol=1e-6, atol=1e-6)
