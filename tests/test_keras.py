"""Keras habits of ``backends.keras`` under every Keras backend: models, ``fit`` (also with
``jit_compile``), ``.keras`` files (also across Keras backends), padding masks, low precision.

Runs in the env of each Keras column (``tensorflow``, ``keras-jax``, ``keras-torch``); the
cross-backend matrix and the layer tests (``COLUMN_TESTS``) run there too. What only Keras on
TensorFlow has (``tf.function``, XLA, ``tf.GradientTape``) is in tests/test_tensorflow.py.

``.keras`` files between Keras backends: every Keras env writes the file of a model using every
layer, with its inputs and outputs, into ``$ATTENTION_CORE_EXCHANGE_DIR`` (see
tests/test_weights_exchange.py), and loads the files the other Keras envs wrote; CI's second
pass (``ATTENTION_CORE_EXCHANGE_REQUIRE=all``) requires every one of them.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import test_backends

if not {"tensorflow", "keras-jax", "keras-torch"} & set(test_backends()):
    pytest.skip("no Keras column is tested in this env", allow_module_level=True)

import keras
from keras.src.backend import set_keras_mask

import backends.keras as keras_layers
from tests import naive
from tests.harness import TOLERANCE, max_diff
from tests.reference.generate import load
from tests.test_weights_exchange import REQUIRE_ENV, exchange_dir

#: The test backends whose layers are ``backends.keras``' (the Keras backend each runs on).
KERAS_COLUMNS = {"tensorflow": "tensorflow", "keras-jax": "jax", "keras-torch": "torch"}
COLUMN = next(name for name in test_backends() if name in KERAS_COLUMNS)
assert keras.backend.backend() == KERAS_COLUMNS[COLUMN], (COLUMN, keras.backend.backend())


def draw(*shapes: tuple[int, ...], seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


def host(x: Any) -> np.ndarray:
    """A tensor of any Keras backend as NumPy."""
    return np.asarray(keras.ops.convert_to_numpy(x))


# -- models and .keras files --------------------------------------------------------------------


def every_layer_model() -> keras.Model:
    """A functional model using each layer (but the decoders'), unknown batch size; the
    sequences (``x``, ``tokens``) of unknown length too, below the positional tables' max_len
    (20) but not Keras on torch's stand-in length (83)."""
    h = 8
    x = keras.Input((None, h))
    lens = keras.Input((), dtype="int32")
    xq, xk, xv = keras.Input((3,)), keras.Input((6,)), keras.Input((6,))
    tokens = keras.Input((None,), dtype="int32")
    y = keras_layers.PositionalEncoding(h, 0.1, max_len=20)(x)
    y = keras_layers.LearnedPositionalEncoding(h, 0.1, max_len=20)(y)
    y = keras_layers.MultiHeadAttention(h, 2, 0.1, bias=True)(y, y, y, lens)
    y = keras_layers.AdditiveAttention(7, 0.1)(y, x, x, lens)
    y = keras_layers.DotProductAttention(0.1)(y, x, y, causal=True)
    y = keras_layers.AddNorm(h, 0.1)(y, keras_layers.PositionWiseFFN(11, h)(y))
    y = keras_layers.TransformerEncoderBlock(h, 12, 4, 0.1)(y, lens)
    encoded = keras_layers.TransformerEncoder(10, h, 12, 2, 2, 0.1, bias=True)(tokens, lens)
    y = keras_layers.RelativeMultiHeadAttention(h, 2, 2, 0.1, bias=True)(y, encoded, encoded, lens)
    y = keras_layers.RotaryEmbedding()(y)
    z = keras_layers.NadarayaWatson(parametric=True)(xq, xk, xv)
    return keras.Model([x, lens, xq, xk, xv, tokens], [y, z])


def model_inputs(seed: int = 4) -> list[np.ndarray]:
    x, xq, xk, xv = draw((3, 5, 8), (3, 3), (3, 6), (3, 6), seed=seed)
    tokens = np.random.default_rng(seed).integers(0, 10, (3, 5)).astype(np.int32)
    return [x, np.array([1, 2, 0], np.int32), xq, xk, xv, tokens]


# Keras saving calls np.array(variable) under NumPy 2; a plain Dense model warns the same.
@pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword")
def test_keras_file_round_trip(tmp_path: Path) -> None:
    model = every_layer_model()
    inputs = model_inputs()
    before = [host(y) for y in model(inputs)]
    assert all(np.isfinite(y).all() for y in before)  # the example of length 0 gives no NaN
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert [type(layer) for layer in loaded.layers] == [type(layer) for layer in model.layers]
    after = [host(y) for y in loaded(inputs)]
    for a, b in zip(before, after, strict=True):
        np.testing.assert_array_equal(a, b)
    for src, dst in zip(model.layers, loaded.layers, strict=True):
        if isinstance(src, keras_layers.layers.Layer):
            theirs = dst.get_weights()
            assert sorted(theirs) == sorted(src.get_weights())
            for name, value in src.get_weights().items():
                np.testing.assert_array_equal(theirs[name], value)


def test_symbolic_shapes_and_dtypes() -> None:
    """Symbolic calls (``compute_output_spec``) give the shapes and dtypes the eager call gives,
    unknown sizes included, the attention weights too."""
    X = keras.Input((None, 12))
    mha = keras_layers.MultiHeadAttention(12, 3)
    out, weights = mha(X, X, X, return_attention=True)
    assert tuple(out.shape) == (None, None, 12) and tuple(weights.shape) == (None, 3, None, None)
    assert out.dtype == weights.dtype == "float32"
    tokens = keras.Input((7,), dtype="int32")
    encoded = keras_layers.TransformerEncoder(10, 8, 12, 2, 1, dtype="float16")(tokens)
    assert tuple(encoded.shape) == (None, 7, 8) and encoded.dtype == "float16"
    real = host(mha(*draw((2, 5, 12), (2, 5, 12), (2, 5, 12))))
    assert real.shape == (2, 5, 12)


# -- .keras files between Keras backends ----------------------------------------------------------


def keras_files() -> Path:
    return exchange_dir() / "keras"


@pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword")
def test_keras_file_exchange_produce() -> None:
    """This Keras backend's file of the every-layer model, its inputs and outputs."""
    keras.utils.set_random_seed(7)
    model = every_layer_model()
    inputs = model_inputs(seed=5)
    outputs = [host(y) for y in model(inputs)]
    directory = keras_files()
    directory.mkdir(parents=True, exist_ok=True)
    backend = keras.backend.backend()
    tmp = directory / f".{backend}.{os.getpid()}.keras"
    model.save(tmp)
    np.savez(directory / f".{backend}.{os.getpid()}.npz",
             **{f"input.{i}": x for i, x in enumerate(inputs)},
             **{f"output.{i}": y for i, y in enumerate(outputs)})
    os.replace(tmp, directory / f"{backend}.keras")
    os.replace(directory / f".{backend}.{os.getpid()}.npz", directory / f"{backend}.npz")
    (directory / f"{backend}.json").write_text(json.dumps({"keras": keras.__version__}))


@pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword")
@pytest.mark.parametrize("producer", sorted(KERAS_COLUMNS.values()))
def test_keras_file_exchange_consume(producer: str) -> None:
    """A ``.keras`` file saved under another Keras backend loads here and predicts alike."""
    directory = keras_files()
    if not (directory / f"{producer}.json").exists():
        required = os.environ.get(REQUIRE_ENV, "").strip()
        if required == "all" or producer in required.split(","):
            pytest.fail(f"no .keras file from Keras on {producer} in {directory}")
        pytest.skip(f"Keras on {producer} has not written its file yet (the second pass reads it)")
    loaded = keras.models.load_model(directory / f"{producer}.keras")
    saved = np.load(directory / f"{producer}.npz")
    inputs = [saved[f"input.{i}"] for i in range(6)]
    for i, y in enumerate(loaded(inputs)):
        assert max_diff(host(y), saved[f"output.{i}"]) <= TOLERANCE["float32"], (producer, i)


# -- low precision ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "mixed_float16", "mixed_bfloat16"])
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
        assert all(v.dtype == ("float32" if "mixed" in dtype else dtype) for v in obj.weights)
    names = ["X"] if layer == "TransformerEncoderBlock" else ["queries", "keys", "values"]
    inputs = [ref[f"input.{name}"] for name in names]
    out = obj(*inputs, valid_lens=ref["call.valid_lens"], mask=ref["call.mask"])
    compute = dtype.replace("mixed_", "")
    assert keras.backend.standardize_dtype(out.dtype) == compute
    assert keras.backend.standardize_dtype(obj.attention_weights.dtype) == compute
    got = host(keras.ops.cast(out, "float32")).astype(np.float64)
    attn = host(keras.ops.cast(obj.attention_weights, "float32")).astype(np.float64)
    assert np.isfinite(got).all() and np.isfinite(attn).all()
    assert np.all(attn[0, :, 1] == 0) and np.all(attn[1, :, 2] == 0)
    assert max_diff(attn, ref["output.attention"]) <= TOLERANCE[compute]
    scale = max(1.0, float(np.abs(ref["output.out"]).max()))
    assert max_diff(got, ref["output.out"]) <= TOLERANCE[compute] * scale


# -- padding masks ------------------------------------------------------------------------------


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


def unmasked(x: Any) -> Any:
    """The same values as a new tensor, without the padding mask Keras attached to ``x``."""
    return keras.ops.convert_to_tensor(host(x))


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
    by_lens = host(attend(layer, unmasked(embed(tokens)), valid_lens=real.sum(axis=1)))
    np.testing.assert_allclose(got[real], by_lens[real], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["block", "mha", "encoder"])
def test_keras_padding_mask_keeps_padded_positions_out(kind: str) -> None:
    """Changing the padded positions' inputs does not change the real positions' outputs."""
    real = keras.ops.convert_to_tensor(PADDED_TOKENS != 0)
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
        x = keras.ops.convert_to_tensor(x)
        set_keras_mask(x, real)  # as Keras attaches a padding mask
        out = layer(x) if kind == "encoder" else attend(layer, x)
        assert keras_layers.layers._padding_mask(out) is real  # the query's padding is propagated
        outs.append(host(out))
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
    plain = unmasked(embedded)
    np.testing.assert_allclose(host(out), host(block(plain, mask=both)), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(host(keras_layers.layers._padding_mask(out)), real)
    assert keras_layers.layers._padding_mask(block(plain, mask=causal)) is None
    X, layer = keras.ops.ones((2, 3, 8)), keras_layers.MultiHeadAttention(8, 2)
    with pytest.raises(TypeError) as err:
        layer(X, X, X, queries_mask=keras.ops.ones((2, 3), "int32"))
    assert str(err.value) == (
        "queries_mask must be a boolean padding mask (True = real position), got int32"
    )
    with pytest.raises(ValueError) as err:
        layer(X, X, X, keys_mask=keras.ops.ones((2, 4), "bool"))
    assert str(err.value) == "keys_mask must have shape (2, 3), got (2, 4)"


# -- training -----------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword")
@pytest.mark.parametrize("jit_compile", [False, True], ids=["eager", "jit_compile"])
def test_padded_model_trains_with_fit_and_survives_a_keras_file(tmp_path: Path,
                                                                jit_compile: bool) -> None:
    """Embedding(mask_zero=True) -> positional encoding -> block (dropout) -> attention ->
    pooling: ``training`` reaches the layers, ``fit`` lowers the loss (also compiled by the
    Keras backend's compiler: XLA, ``jax.jit``), the file predicts alike. Keras on torch fits
    eagerly here: its compiled mode is torch.compile, which its matrix runs on the attention
    layers and the torch env on every layer (a compiled ``fit`` cost 135 s in CI)."""
    if jit_compile and keras.backend.backend() == "torch":
        pytest.skip("torch.compile: the keras-torch matrix's compiled cells and the torch env")
    keras.utils.set_random_seed(2)
    ids = keras.Input((None,), dtype="int32")
    x = keras_layers.PositionalEncoding(8)(keras.layers.Embedding(10, 8, mask_zero=True)(ids))
    x = keras_layers.TransformerEncoderBlock(8, 12, 2, dropout=0.5)(x)
    x = keras_layers.MultiHeadAttention(8, 2, name="attention")(x, x, x)
    model = keras.Model(ids, keras.layers.Dense(1)(keras.layers.GlobalAveragePooling1D()(x)))
    tokens, target = np.tile(PADDED_TOKENS, (4, 1)), np.ones((16, 1))
    inference = host(model(tokens))
    np.testing.assert_array_equal(host(model(tokens, training=False)), inference)
    assert not np.allclose(host(model(tokens, training=True)), inference)
    model.compile(keras.optimizers.Adam(0.01), "mse", jit_compile=jit_compile)
    start = model.evaluate(tokens, target, verbose=0)
    history = model.fit(tokens, target, epochs=10, batch_size=8, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert model.evaluate(tokens, target, verbose=0) < 0.9 * start
    model.save(tmp_path / "padded.keras")
    loaded = keras.models.load_model(tmp_path / "padded.keras")
    inner = [keras.Model(m.inputs, m.get_layer("attention").output) for m in (model, loaded)]
    np.testing.assert_allclose(inner[1].predict(tokens, verbose=0), inner[0].predict(tokens, verbose=0),
                               rtol=1e-6, atol=1e-6)


ENC = {"vocab_size": 10, "num_hiddens": 8, "ffn_num_hiddens": 12, "num_heads": 2, "num_blks": 2}


@pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword")
def test_encoder_in_a_functional_model_of_unknown_length(tmp_path: Path) -> None:
    """``keras.Input((None,))``: build, predict at two lengths, save and load."""
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


#: Each layer holding ``max_len`` rows (6, below Keras on torch's stand-in length, 83): how
#: to make it, its inputs of unknown length, and the first input's message past max_len.
MAX_LEN = 6
MAX_LEN_LAYERS: dict[str, tuple[Any, list[tuple[tuple[int, ...], str]], str]] = {
    "PositionalEncoding": (lambda: keras_layers.PositionalEncoding(8, max_len=MAX_LEN),
                           [((None, 8), "float32")], "X has {} positions"),
    "LearnedPositionalEncoding": (lambda: keras_layers.LearnedPositionalEncoding(8, max_len=MAX_LEN),
                                  [((None, 8), "float32")], "X has {} positions"),
    "TransformerEncoder": (lambda: keras_layers.TransformerEncoder(**ENC, max_len=MAX_LEN),
                           [((None,), "int32")], "tokens have {} positions"),
    "TransformerDecoder": (lambda: keras_layers.TransformerDecoder(**ENC, max_len=MAX_LEN,
                                                                   decoder_only=True),
                           [((None,), "int32")], "tokens have {} positions"),
    "Transformer": (lambda: keras_layers.Transformer(10, 10, 8, 12, 2, 2, max_len=MAX_LEN),
                    [((None,), "int32"), ((None,), "int32")], "tokens have {} positions"),
}


def max_len_inputs(specs: list[tuple[tuple[int, ...], str]], steps: int) -> list[np.ndarray]:
    """Real inputs of ``steps`` positions, batch 2, for the specs of :data:`MAX_LEN_LAYERS`."""
    rng = np.random.default_rng(steps)
    return [rng.integers(0, 10, (2, steps)).astype(np.int32) if dtype == "int32"
            else rng.standard_normal((2, steps, *shape[1:])).astype(np.float32)
            for shape, dtype in specs]


@pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword")
@pytest.mark.parametrize("name", list(MAX_LEN_LAYERS))
def test_max_len_layer_in_a_model_of_unknown_length(tmp_path: Path, name: str) -> None:
    """Built from ``keras.Input`` of unknown length (Keras on torch builds it at a stand-in
    length, 83, which is no length to check); a real call past max_len raises the library's
    message; the model's ``.keras`` file reloads and predicts alike."""
    make, specs, message = MAX_LEN_LAYERS[name]
    inputs = [keras.Input(shape, dtype=dtype) for shape, dtype in specs]
    layer = make()
    model = keras.Model(inputs, layer(*inputs))
    assert tuple(model.output.shape)[:2] == (None, None)
    real = max_len_inputs(specs, MAX_LEN)
    want = host(layer(*real))
    np.testing.assert_allclose(host(model(real)), want, rtol=1e-6, atol=1e-6)
    too_long = max_len_inputs(specs, MAX_LEN + 1)
    refusal = f"{message.format(MAX_LEN + 1)}, more than max_len ({MAX_LEN})"
    with pytest.raises(ValueError) as raised:
        layer(*too_long)
    assert str(raised.value) == refusal
    with pytest.raises(ValueError, match=re.escape(refusal)):  # Keras' Functional adds the call
        model(too_long)
    model.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras")
    np.testing.assert_allclose(host(loaded(real)), want, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(COLUMN != "keras-jax", reason="JAX traces Python: Keras on JAX only")
def test_kept_weights_in_a_jax_trace_are_formed_only_when_read(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``jax.jit`` a layer keeping its weights pools as if they were not asked for; a
    read in the same trace forms them (equal to the eager ``return_attention``), and a trace
    that does not read them forms none."""
    import jax

    from attention_core import kernels

    X = keras.ops.convert_to_tensor(draw((2, 6, 8), seed=3)[0])
    lens = keras.ops.convert_to_tensor(np.array([4, 0], np.int32))
    mha = keras_layers.MultiHeadAttention(8, 2)
    _, eager = mha(X, X, X, lens, return_attention=True)
    asked: list[bool] = []
    choose = kernels.choose

    def spy(ops: Any, request: kernels.Request, implementation: Any = None,
            **options: Any) -> Any:
        asked.append(request.weights)
        return choose(ops, request, implementation, **options)

    monkeypatch.setattr(kernels, "choose", spy)
    values = [v.value for v in mha.variables]

    def call(values: Any, x: Any, lengths: Any, read: bool) -> Any:
        mapping = list(zip(mha.variables, values, strict=True))
        with keras.StatelessScope(state_mapping=mapping):
            out = mha(x, x, x, lengths)
            return (out, mha.attention_weights) if read else out

    jax.jit(call, static_argnums=3)(values, X, lens, False)
    assert asked == [False]
    asked.clear()
    _, weights = jax.jit(call, static_argnums=3)(values, X, lens, True)
    assert asked == [False, True]
    assert max_diff(host(weights), host(eager)) <= 1e-6
    assert np.all(host(weights)[1] == 0)  # the example of length 0 sees no key


@pytest.mark.parametrize(("mask", "error", "message"), [
    (np.ones((2, 4, 4), np.int32), TypeError,
     "attention_mask must be boolean (True = may attend), got int32"),
    (np.ones((2, 3, 4), bool), ValueError,
     "attention_mask must have shape (Q, K), (B, Q, K) or (B, H, Q, K), broadcastable to "
     "(B, H, Q, K) = (2, 2, 4, 4), got (2, 3, 4)"),
], ids=["integer", "shape"])
@pytest.mark.parametrize("layer", ["MultiHeadAttention", "TransformerEncoder"])
def test_bad_attention_mask_is_named_as_given(layer: str, mask: np.ndarray, error: type,
                                              message: str) -> None:
    """Keras' ``attention_mask`` is checked as itself (the canonical ``mask`` it stands for is
    not what the user gave); the layer is unchanged."""
    if layer == "MultiHeadAttention":
        made, inputs = keras_layers.MultiHeadAttention(8, 2), draw((2, 4, 8))
    else:
        made, inputs = keras_layers.TransformerEncoder(11, 8, 12, 2, 1), [np.ones((2, 4), np.int32)]
    made(*inputs)
    before = made.get_weights()
    with pytest.raises(error) as info:
        made(*inputs, attention_mask=mask)
    assert str(info.value) == message
    assert all(np.array_equal(v, made.get_weights()[k]) for k, v in before.items())
