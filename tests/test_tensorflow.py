"""Keras habits of the TensorFlow backend: tf.function and XLA, .keras files, configs, dropout.

The cross-backend files (test_reference_matrix, test_errors, test_weights, ...) already run on
this backend; these tests cover what only Keras has.
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


# -- the chapter's own usage, written the TensorFlow way ---------------------------------------


def test_seed_usage_as_in_the_chapter() -> None:
    attention = keras_layers.MultiHeadAttention(100, 5, 0.5)
    X = tf.ones((2, 4, 100))
    valid_lens = tf.constant([3, 2])
    output = attention(X, X, X, valid_lens, training=False)
    assert output.shape == (2, 4, 100)
    weights = attention.attention_weights.numpy()
    np.testing.assert_allclose(weights[0, :, :, :3], 1 / 3, atol=1e-6)
    np.testing.assert_allclose(weights[1, :, :, :2], 1 / 2, atol=1e-6)
    assert np.all(weights[0, :, :, 3:] == 0) and np.all(weights[1, :, :, 2:] == 0)

    pos_encoding = keras_layers.PositionalEncoding(32, 0)
    X = pos_encoding(tf.zeros((1, 60, 32)), training=False)
    np.testing.assert_array_equal(X.numpy(), pos_encoding.P[:, : X.shape[1], :].numpy())
    np.testing.assert_array_equal(pos_encoding.P.numpy()[0],
                                  ac.sinusoidal_encoding(1000, 32, "float32"))


# -- .keras files, configs, weights -------------------------------------------------------------


def every_layer_model() -> keras.Model:
    """A functional model using each of the nine layers, unknown batch size."""
    h = 8
    x = keras.Input((5, h))
    lens = keras.Input((), dtype="int32")
    xq, xk, xv = keras.Input((3,)), keras.Input((6,)), keras.Input((6,))
    y = keras_layers.PositionalEncoding(h, 0.1, max_len=20)(x)
    y = keras_layers.LearnedPositionalEncoding(h, 0.1, max_len=20)(y)
    y = keras_layers.MultiHeadAttention(h, 2, 0.1, bias=True)(y, y, y, lens)
    y = keras_layers.AdditiveAttention(7, 0.1)(y, x, x, lens)
    y = keras_layers.DotProductAttention(0.1)(y, x, y, causal=True)
    y = keras_layers.AddNorm(h, 0.1)(y, keras_layers.PositionWiseFFN(11, h)(y))
    y = keras_layers.TransformerEncoderBlock(h, 12, 4, 0.1)(y, lens)
    z = keras_layers.NadarayaWatson(parametric=True)(xq, xk, xv)
    return keras.Model([x, lens, xq, xk, xv], [y, z])


def model_inputs(batch: int = 3) -> list[np.ndarray]:
    x, xq, xk, xv = draw((batch, 5, 8), (batch, 3), (batch, 6), (batch, 6), seed=4)
    return [x, np.arange(batch, dtype=np.int32) % 5 + 1, xq, xk, xv]


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
]


@pytest.mark.parametrize("layer, config", CONFIGS, ids=[c[0] for c in CONFIGS])
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


def test_training_argument_controls_dropout() -> None:
    layer = keras_layers.DotProductAttention(dropout=0.5)
    q, k = draw((B, Q, 3), (B, K, 3))
    values = np.broadcast_to(np.eye(K, dtype=np.float32), (B, K, K))  # output = pooled weights
    inference = layer(q, k, values).numpy()
    weights = layer.attention_weights.numpy()[:, 0]
    np.testing.assert_allclose(inference, weights, atol=1e-6)
    np.testing.assert_array_equal(layer(q, k, values, training=False).numpy(), inference)
    for fn in (layer, tf.function(layer, jit_compile=True)):
        dropped, before = (t.numpy() for t in fn(q, k, values, training=True, return_attention=True))
        np.testing.assert_allclose(before[:, 0], weights, atol=1e-6)  # taken before dropout
        kept = dropped != 0
        assert 0.2 < kept.mean() < 0.8
        np.testing.assert_allclose(dropped[kept], 2 * weights[kept], rtol=1e-5)
        again = fn(q, k, values, training=True).numpy()
        assert not np.array_equal(dropped, again)  # a fresh mask each call


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


def test_keras_padding_mask_is_not_read_as_an_attention_mask() -> None:
    """Keras fills ``mask`` from X's padding mask; with B == T it would pass the shape checks."""
    embedded = keras.layers.Embedding(10, 8, mask_zero=True)(np.array([[1, 2, 0, 0]] * 4))
    assert embedded._keras_mask is not None
    block = keras_layers.TransformerEncoderBlock(8, 12, 2)
    plain = tf.identity(embedded)  # the same values, no Keras mask
    np.testing.assert_array_equal(block(embedded).numpy(), block(plain).numpy())
    np.testing.assert_array_equal(block(embedded, mask=np.tril(np.ones((4, 4), bool))).numpy(),
                                  block(plain, mask=np.tril(np.ones((4, 4), bool))).numpy())
    assert getattr(block(embedded), "_keras_mask", None) is None


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
