"""Keras habits of the TensorFlow backend: tf.function and XLA, .keras files, configs, dropout.

The cross-backend files (test_reference_matrix, test_errors, test_weights, test_adapters, ...)
already run on this backend; these tests cover what only Keras has. Layers traced for unknown
shapes in every masking, and the blockwise loops' gradients in a ``tf.function``, are in
tests/test_compiled.py (hooks ``unknown_shape_function`` and ``graph_gradients``).
"""

from __future__ import annotations

import json
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
from tests.harness import TOLERANCE, max_diff, tolerance
from tests.reference.cases import MASK_KINDS, mask_arguments
from tests.reference.generate import load

REPO = Path(__file__).resolve().parent.parent
B, Q, K = 2, 4, 6


def draw(*shapes: tuple[int, ...], seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


# -- tf.function and XLA (every layer in every masking, unknown shapes: tests/test_compiled.py) --


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


# Keras 3.15 saving calls np.array(variable) under NumPy 2; a plain Dense model warns the same.
@pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword")
def test_keras_file_round_trip(tmp_path: Path) -> None:
    model = every_layer_model()
    x, xq, xk, xv = draw((3, 5, 8), (3, 3), (3, 6), (3, 6), seed=4)
    tokens = np.random.default_rng(4).integers(0, 10, (3, 5)).astype(np.int32)
    inputs = [x, np.array([1, 2, 3], np.int32), xq, xk, xv, tokens]
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
#: The layers reading Keras' padding mask, each on (B, T, 8) embeddings.
PADDED = {"block": lambda: keras_layers.TransformerEncoderBlock(8, 12, 2),
          "mha": lambda: keras_layers.MultiHeadAttention(8, 2),
          "dot": lambda: keras_layers.DotProductAttention(),
          "additive": lambda: keras_layers.AdditiveAttention(6),
          "relative": lambda: keras_layers.RelativeMultiHeadAttention(8, 2, 2)}


def attend(layer: Any, X: Any, **kwargs: Any) -> Any:
    """The block on ``X``, an attention layer on ``X`` as queries, keys and values."""
    if isinstance(layer, keras_layers.TransformerEncoderBlock):
        return layer(X, **kwargs)
    return layer(X, X, X, **kwargs)


@pytest.mark.parametrize("batch", [4, 3], ids=["B==T", "B!=T"])
@pytest.mark.parametrize("kind", list(PADDED))
def test_keras_padding_mask_is_query_and_key_padding(kind: str, batch: int) -> None:
    """Keras' ``(B, T)`` padding mask hides padded keys and rows, never read as ``(Q, K)``: as
    the ``(B, T, T)`` attention mask of query AND key padding, given as a model input."""
    keras.utils.set_random_seed(1)
    tokens, real = PADDED_TOKENS[:batch], PADDED_TOKENS[:batch] != 0
    ids, explicit = keras.Input((4,), dtype="int32"), keras.Input((4, 4), dtype="bool")
    embed, layer = keras.layers.Embedding(10, 8, mask_zero=True), PADDED[kind]()
    got = keras.Model(ids, attend(layer, embed(ids))).predict(tokens, verbose=0)
    given = keras.Model([ids, explicit], attend(layer, embed(ids), mask=explicit))
    want = given.predict([tokens, real[:, :, None] & real[:, None, :]], verbose=0)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # The unpadded rows equal the same layer given the lengths instead (valid_lens hides keys).
    by_lens = attend(layer, tf.identity(embed(tokens)), valid_lens=real.sum(axis=1)).numpy()
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
        layer = PADDED[kind]()
        inputs = rng.standard_normal((4, 4, 8)).astype(np.float32)
        fresh = rng.standard_normal(inputs.shape)
        other = np.where(PADDED_TOKENS[..., None] != 0, inputs, fresh).astype(np.float32)
    outs = []
    for x in (inputs, other):
        x = tf.constant(x)
        x._keras_mask = real  # as Keras attaches a padding mask
        out = layer(x) if kind == "encoder" else attend(layer, x)
        assert getattr(out, "_keras_mask", None) is real  # the query's padding is propagated
        outs.append(out.numpy())
    np.testing.assert_allclose(outs[0][PADDED_TOKENS != 0], outs[1][PADDED_TOKENS != 0],
                               rtol=1e-5, atol=1e-5)
    if kind == "mha":  # a padded query sees no key: its row is 0, as any fully masked row
        np.testing.assert_array_equal(outs[0][PADDED_TOKENS == 0], 0.0)
    else:  # the padded rows did change (they pass through the residual branches)
        assert not np.allclose(outs[0], outs[1])


def test_keras_padding_mask_and_explicit_mask_combine_and_are_checked() -> None:
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
    X, layer = tf.ones((2, 3, 8)), keras_layers.MultiHeadAttention(8, 2)
    with pytest.raises(TypeError) as err:
        layer(X, X, X, queries_mask=tf.ones((2, 3), tf.int32))
    assert str(err.value) == (
        "queries_mask must be a boolean padding mask (True = real position), got int32"
    )
    with pytest.raises(ValueError) as err:
        layer(X, X, X, keys_mask=tf.ones((2, 4), tf.bool))
    assert str(err.value) == "keys_mask must have shape (2, 3), got (2, 4)"


def test_padded_model_trains_with_fit_and_survives_a_keras_file(tmp_path: Path) -> None:
    """Embedding(mask_zero=True) -> positional encoding -> block (dropout) -> attention ->
    pooling: ``training`` reaches the layers, ``fit`` lowers the loss, the file predicts alike."""
    keras.utils.set_random_seed(2)
    ids = keras.Input((None,), dtype="int32")
    x = keras_layers.PositionalEncoding(8)(keras.layers.Embedding(10, 8, mask_zero=True)(ids))
    x = keras_layers.TransformerEncoderBlock(8, 12, 2, dropout=0.5)(x)
    x = keras_layers.MultiHeadAttention(8, 2, name="attention")(x, x, x)
    model = keras.Model(ids, keras.layers.Dense(1)(keras.layers.GlobalAveragePooling1D()(x)))
    tokens, target = np.tile(PADDED_TOKENS, (4, 1)), np.ones((16, 1))
    inference = model(tokens).numpy()
    np.testing.assert_array_equal(model(tokens, training=False).numpy(), inference)
    assert not np.allclose(model(tokens, training=True).numpy(), inference)
    model.compile(keras.optimizers.Adam(0.01), "mse")
    start = model.evaluate(tokens, target, verbose=0)
    history = model.fit(tokens, target, epochs=10, batch_size=8, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert model.evaluate(tokens, target, verbose=0) < 0.9 * start
    model.save(tmp_path / "padded.keras")
    loaded = keras.models.load_model(tmp_path / "padded.keras")
    inner = [keras.Model(m.inputs, m.get_layer("attention").output) for m in (model, loaded)]
    np.testing.assert_allclose(inner[1].predict(tokens, verbose=0), inner[0].predict(tokens, verbose=0),
                               rtol=1e-6, atol=1e-6)


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


# -- the blockwise path: tf.while_loop under tf.function and XLA, equal to the direct path ----

#: Ragged blocks: 13 queries in blocks of 4 (3 full and 1), 19 keys in blocks of 5 (3 and 4).
BQ, BH, BLQ, BLK, DEPTH = 2, 3, 13, 19, 8


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of 4 queries and 5 keys, so the loops run several times with a ragged tail."""
    monkeypatch.setattr(blockwise, "KEY_BLOCK", 5)
    monkeypatch.setattr(blockwise, "MIN_QUERY_BLOCK", 1)
    monkeypatch.setattr(blockwise, "TILE_SCORES", BQ * BH * 4 * 5)


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
    """``keras.Input((None,))``: build, predict at two lengths, save and load (``fit`` on a
    model of unknown length: test_padded_model_trains_with_fit_and_survives_a_keras_file)."""
    ids = keras.Input((None,), dtype="int32")
    encoder = keras_layers.TransformerEncoder(**ENC)
    model = keras.Model(ids, encoder(ids))
    rng = np.random.default_rng(5)
    for steps in (3, 9):
        tokens = rng.integers(0, 10, (2, steps))
        assert max_diff(model.predict(tokens, verbose=0), naive.encoder_of(encoder, tokens)) <= 1e-4
    model.save(tmp_path / "encoder.keras")
    loaded = keras.models.load_model(tmp_path / "encoder.keras")
    tokens = rng.integers(0, 10, (2, 7))
    np.testing.assert_allclose(loaded.predict(tokens, verbose=0), model.predict(tokens, verbose=0),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", MASK_KINDS)
def test_recomputed_blocks_in_a_tf_function_give_the_direct_gradients(
    kind: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In a ``tf.function`` (as Keras' ``train_step`` runs it), the blockwise path under a tape
    is recomputed one query block at a time (``recompute_blocks`` returns its output, blocks of
    4 queries in a ``tf.while_loop`` and a tail of 1, ragged key blocks of 5), and the gradients
    of q, k and v equal the direct path's eager ones. A tape outside the function is seen too."""
    B, H, Q, K = 2, 3, 13, 19
    # 4 queries a block (4, 4, 4, 1), the fewest allowed, each over ragged key blocks (5, 5, 5, 4)
    monkeypatch.setattr(blockwise, "MIN_QUERY_BLOCK", 4)
    monkeypatch.setattr(blockwise, "RECOMPUTE_SCORES", B * H * 4 * 5)
    calls: list[tuple[list[tuple[int, int]], bool]] = []
    hook = OPS.recompute_blocks

    def counting(fn: Any, blocks: list[tuple[int, int]], *arrays: Any) -> Any:
        out = hook(fn, blocks, *arrays)
        calls.append((blocks, out is not None))
        return out

    monkeypatch.setattr(OPS, "recompute_blocks", counting)
    rng = np.random.default_rng(len(kind))
    arrays = [tf.constant(rng.standard_normal((B, H, n, d)), tf.float32)
              for n, d in ((Q, 8), (K, 8), (K, 5))]
    masks = {name: x if name == "causal" else tf.constant(x)
             for name, x in mask_arguments(kind, rng, H, Q, K, B).items()}
    cotangent = tf.constant(rng.standard_normal((B, H, Q, 5)), tf.float32)

    def pooled(implementation: str, *xs: Any) -> Any:
        return ac.dot_product_attention(*xs, implementation=implementation, **masks)

    def gradients(implementation: str, *xs: Any) -> list[Any]:
        with tf.GradientTape() as tape:
            tape.watch(xs)
            out = pooled(implementation, *xs)
        return list(tape.gradient(out, list(xs), cotangent))

    want = [g.numpy() for g in gradients("direct", *arrays)]
    got = [g.numpy() for g in tf.function(lambda *xs: gradients("blockwise", *xs))(*arrays)]
    with tf.GradientTape() as tape:  # the tape outside, the function differentiated as one op
        tape.watch(arrays)
        out = tf.function(lambda *xs: pooled("blockwise", *xs))(*arrays)
    outside = [g.numpy() for g in tape.gradient(out, arrays, cotangent)]
    assert calls == [([(0, 4), (4, 4), (8, 4), (12, 1)], True)] * 2
    for i, w in enumerate(want):
        bound = tolerance(f"grad.{i}", "float32", w)
        for g in (got[i], outside[i]):
            assert np.isfinite(g).all(), i
            assert max_diff(g, w) <= bound, i
    calls.clear()
    tf.function(lambda *xs: pooled("blockwise", *xs))(*arrays)  # no tape: the loops as before
    assert calls == [([(0, 4), (4, 4), (8, 4), (12, 1)], False)]


#: The measurement of :func:`test_recomputed_backward_memory`, run in a fresh process.
_BACKWARD_MEMORY = """
import gc, json, sys
from pathlib import Path
import numpy as np
import tensorflow as tf
import attention_core as ac
import backends.tensorflow

def status(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

def step(n):
    rng = np.random.default_rng(0)
    q, k, v = (tf.constant(rng.standard_normal((1, 1, n, 4096)).astype(np.float32))
               for _ in range(3))
    def run():
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            loss = tf.reduce_sum(ac.dot_product_attention(q, k, v, implementation="blockwise"))
        return tape.gradient(loss, [q, k, v])
    return run

step(16)()
run = step(2048)
gc.collect()
Path("/proc/self/clear_refs").write_text("5")
base = status("VmRSS")
grads = run()
print(json.dumps({"extra": status("VmHWM") - base}))
"""


def _extra_memory(script: str) -> int:
    """The extra memory (bytes) a measuring script prints, run in a fresh process."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "KERAS_BACKEND": "tensorflow",
           "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         cwd=REPO, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(json.loads(out.stdout.strip().splitlines()[-1])["extra"])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_recomputed_backward_memory() -> None:
    """The eager recomputed backward sums the key and value blocks' gradients one block at a
    time and joins each result while the others' blocks are gone. At (1, 1, 2048, 4096) fp32,
    where the (n, D) arrays (A = 32 MiB each) outweigh the score tiles, forward + backward took
    14.0 A of extra memory when a whole second set of sums was formed next to the old one and
    the three results were joined with every block alive (commit e132585), and 12.3 A after
    (both measured by this code); the bound lies between."""
    extra = _extra_memory(_BACKWARD_MEMORY)
    array = 2048 * 4096 * 4
    assert extra <= 13 * array, f"{extra / array:.1f} arrays of extra memory"


#: The measurement of :func:`test_recomputed_backward_memory_in_a_tf_function`, in a fresh process.
_GRAPH_BACKWARD_MEMORY = """
import gc, json, sys
from pathlib import Path
import numpy as np
import tensorflow as tf
import attention_core as ac
import backends.tensorflow

def status(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

@tf.function
def step(q, k, v):
    with tf.GradientTape() as tape:
        tape.watch([q, k, v])
        loss = tf.reduce_sum(ac.dot_product_attention(q, k, v, implementation="blockwise"))
    return tape.gradient(loss, [q, k, v])

def inputs(n):
    rng = np.random.default_rng(0)
    return [tf.constant(rng.standard_normal((1, 4, n, 64)).astype(np.float32)) for _ in range(3)]

step(*inputs(64))
arrays = inputs(4096)
step.get_concrete_function(*arrays)
gc.collect()
Path("/proc/self/clear_refs").write_text("5")
base = status("VmRSS")
grads = step(*arrays)
print(json.dumps({"extra": status("VmHWM") - base}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_recomputed_backward_memory_in_a_tf_function() -> None:
    """A ``tf.function`` training step through the blockwise path recomputes its query blocks
    in the backward pass. At (1, 4, 4096, 64) fp32 (A = 4 MiB per input), the first call of
    the step's gradient took 162.4 A of extra memory when the plain loops were differentiated
    (every tile kept; commit eb35b35) and 20.3 A after (both measured by this code); the bound
    lies between."""
    extra = _extra_memory(_GRAPH_BACKWARD_MEMORY)
    array = 4 * 4096 * 64 * 4
    assert extra <= 40 * array, f"{extra / array:.1f} arrays of extra memory"
