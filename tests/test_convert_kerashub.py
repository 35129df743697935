"""KerasHub's ``TransformerDecoder`` and ``TransformerEncoder`` <-> the library's blocks' weights.

The expected values are KerasHub's own forward passes (its own code: CachedMultiHeadAttention,
LayerNormalization, Dense) with every weight random (biases, layer-norm scales and offsets
too), called the KerasHub way: ``use_causal_mask=True`` and boolean padding masks of the
decoder's input and of the encoder outputs. Converted to canonical weights, this library's
TensorFlow layer and the functional core (on NumPy) must give them within the fp32 tolerance,
with cross-attention and without (decoder-only); and the other way, a random block's weights
in a KerasHub layer must give the block's numbers, and convert back bit for bit.

The tests run in the tensorflow env (``ATTENTION_CORE_TEST_BACKENDS``), where keras-hub is
installed (tox.ini) and imported unconditionally, so a missing one fails.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest

import attention_core as ac
from conftest import test_backends
from tests.harness import TOLERANCE, max_diff

TESTED = test_backends()
TOL = TOLERANCE["float32"]
B, T, S, h, H, F = 2, 5, 6, 8, 2, 12
LENS = np.array([T, 3])  # the decoder inputs' lengths (as keys): valid_lens
ENC_LENS = np.array([4, S])  # the encoder outputs' lengths: enc_valid_lens

if "tensorflow" in TESTED:
    import keras
    import keras_hub

    import backends.tensorflow as tf_layers
    from backends.tensorflow import convert

pytestmark = pytest.mark.skipif("tensorflow" not in TESTED,
                                reason="KerasHub runs in the tensorflow env")

FORMS = [pytest.param(True, id="cross"), pytest.param(False, id="decoder-only")]


def inputs(seed: int, enc_width: int = h) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((B, T, h)).astype(np.float32),
            rng.standard_normal((B, S, enc_width)).astype(np.float32))


def random_value(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Every weight random: no zero bias, unit scale or zero offset hides a term."""
    base = 1.0 if name.endswith("gamma") else 0.0
    return (base + rng.normal(0.0, 0.3, shape)).astype(np.float32)


def kerashub_native(crossed: bool, seed: int = 0, enc_width: int = h, **kwargs: Any) -> Any:
    """A KerasHub decoder built by a call (with or without encoder outputs), then randomised."""
    layer = keras_hub.layers.TransformerDecoder(intermediate_dim=F, num_heads=H, **kwargs)
    X, enc = inputs(99, enc_width)
    layer(X, enc) if crossed else layer(X)
    rng = np.random.default_rng(seed)
    layer.set_weights([random_value(v.path, tuple(v.shape), rng) for v in layer.weights])
    return layer


def kerashub_run(layer: Any, X: np.ndarray, enc: np.ndarray | None) -> np.ndarray:
    """KerasHub's output: causal self-attention, keys padded by LENS and ENC_LENS."""
    kwargs: dict[str, Any] = {
        "decoder_padding_mask": np.arange(T)[None, :] < LENS[:, None], "use_causal_mask": True}
    if enc is None:
        return np.asarray(layer(X, **kwargs))
    kwargs["encoder_padding_mask"] = np.arange(S)[None, :] < ENC_LENS[:, None]
    return np.asarray(layer(X, enc, **kwargs))


def ours_run(layer: Any, X: np.ndarray, enc: np.ndarray | None) -> np.ndarray:
    """This library's TensorFlow layer, masked the same way."""
    if enc is None:
        return np.asarray(layer(X, valid_lens=LENS))
    return np.asarray(layer(X, enc, ENC_LENS, valid_lens=LENS))


def core_run(weights: dict[str, np.ndarray], X: np.ndarray, enc: np.ndarray | None) -> np.ndarray:
    """The functional core on NumPy arrays."""
    return np.asarray(ac.transformer_decoder_block(
        X, weights, H, enc, None if enc is None else ENC_LENS, valid_lens=LENS))


@pytest.mark.parametrize("crossed", FORMS)
def test_kerashub_to_ours(crossed: bool) -> None:
    native = kerashub_native(crossed)
    X, enc = inputs(1)
    enc_or_none = enc if crossed else None
    expected = kerashub_run(native, X, enc_or_none)
    weights = convert.from_kerashub(native)
    config = convert.kerashub_decoder_config(native)
    assert config == {"num_hiddens": h, "ffn_num_hiddens": F, "num_heads": H, "dropout": 0.0,
                      "bias": True, "decoder_only": not crossed}
    ours = tf_layers.TransformerDecoderBlock(**config)
    ours.set_weights(weights)
    assert set(weights) == set(ours.get_weights())
    assert max_diff(ours_run(ours, X, enc_or_none), expected) <= TOL
    assert max_diff(core_run(weights, X, enc_or_none), expected) <= TOL


@pytest.mark.parametrize("crossed", FORMS)
def test_ours_to_kerashub(crossed: bool) -> None:
    X, enc = inputs(2)
    enc_or_none = enc if crossed else None
    ours = tf_layers.TransformerDecoderBlock(h, F, H, bias=True, decoder_only=not crossed)
    ours_run(ours, X, enc_or_none)  # builds it
    rng = np.random.default_rng(3)
    ours.set_weights({name: random_value(name, value.shape, rng)
                      for name, value in ours.get_weights().items()})
    weights = ours.get_weights()
    native = convert.to_kerashub(weights, H)
    assert isinstance(native, keras_hub.layers.TransformerDecoder)
    assert (native._cross_attention_layer is not None) == crossed
    expected = kerashub_run(native, X, enc_or_none)
    assert max_diff(ours_run(ours, X, enc_or_none), expected) <= TOL
    assert max_diff(core_run(weights, X, enc_or_none), expected) <= TOL
    assert convert.kerashub_decoder_config(native) == {
        "num_hiddens": h, "ffn_num_hiddens": F, "num_heads": H, "dropout": 0.0, "bias": True,
        "decoder_only": not crossed}
    back = convert.from_kerashub(native)
    assert set(back) == set(weights)
    for name, value in weights.items():
        assert back[name].dtype == value.dtype, name
        np.testing.assert_array_equal(back[name], value, err_msg=name)


def test_kerashub_cross_attention_over_wider_encoder_outputs() -> None:
    """Encoder outputs of another width than the decoder's: the functional core takes the
    weights (``cross_attention.W_k``/``W_v`` are ``(6, h)``), the layer's config refuses, and
    the weights go back to a KerasHub layer built for that width."""
    native = kerashub_native(True, seed=4, enc_width=6)
    X, enc = inputs(5, enc_width=6)
    expected = kerashub_run(native, X, enc)
    weights = convert.from_kerashub(native)
    assert weights["cross_attention.W_k.kernel"].shape == (6, h)
    assert max_diff(core_run(weights, X, enc), expected) <= TOL
    with pytest.raises(ValueError, match=r"encoder outputs are 6 wide, the decoder 8"):
        convert.kerashub_decoder_config(native)
    again = convert.to_kerashub(weights, H)
    assert max_diff(kerashub_run(again, X, enc), expected) <= TOL


def test_kerashub_config_keeps_the_dropout_rate() -> None:
    native = kerashub_native(False, dropout=0.25)
    assert convert.kerashub_decoder_config(native)["dropout"] == 0.25
    assert convert.to_kerashub(convert.from_kerashub(native), H, dropout=0.25).dropout == 0.25


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"normalize_first": True}, "from_kerashub: normalize_first=True is not supported: this "
                                "library's TransformerDecoderBlock is post-norm"),
    ({"activation": "gelu"}, "from_kerashub: the activation must be relu, as this library's "
                             "PositionWiseFFN's, got gelu"),
    ({"layer_norm_epsilon": 1e-6}, "from_kerashub: layer_norm_epsilon must be 1e-05, the epsilon "
                                   "of this library's AddNorm, got 1e-06"),
])
def test_from_kerashub_refuses_forms_without_counterpart(kwargs: dict[str, Any],
                                                         message: str) -> None:
    layer = kerashub_native(True, **kwargs)
    with pytest.raises(ValueError, match=re.escape(message)):
        convert.from_kerashub(layer)
    with pytest.raises(ValueError, match=re.escape(message.replace("from_kerashub",
                                                                   "kerashub_decoder_config"))):
        convert.kerashub_decoder_config(layer)


def test_kerashub_refusals() -> None:
    with pytest.raises(TypeError, match=r"from_kerashub: expected a keras_hub\.layers\."
                                        r"TransformerDecoder, got Dense"):
        convert.from_kerashub(keras.layers.Dense(2))
    unbuilt = keras_hub.layers.TransformerDecoder(intermediate_dim=F, num_heads=H)
    with pytest.raises(ValueError, match="from_kerashub: the Keras layer has no weights yet"):
        convert.from_kerashub(unbuilt)
    odd = keras_hub.layers.TransformerDecoder(intermediate_dim=F, num_heads=H)
    odd.build((None, None, 9))
    with pytest.raises(ValueError, match=re.escape(
            "from_kerashub: the decoder's width (9) must be divisible by num_heads (2)")):
        convert.from_kerashub(odd)
    # this library's side: KerasHub's attention always has biases
    for crossed in (True, False):
        ours = tf_layers.TransformerDecoderBlock(h, F, H, decoder_only=not crossed)  # bias=False
        X, enc = inputs(6)
        ours_run(ours, X, enc if crossed else None)
        with pytest.raises(ValueError, match=re.escape(
                "to_kerashub: the attention projections must have biases (bias=True): "
                "keras_hub.layers.TransformerDecoder's attention layers always have biases")):
            convert.to_kerashub(ours.get_weights(), H)
    biased = convert.from_kerashub(kerashub_native(True))
    unbiased_cross = {k: v for k, v in biased.items()
                      if not (k.startswith("cross_attention.") and k.endswith(".bias"))}
    with pytest.raises(ValueError, match="to_kerashub: the attention projections must have biases"):
        convert.to_kerashub(unbiased_cross, H)
    missing = {k: v for k, v in biased.items() if not k.startswith("addnorm3.")}
    with pytest.raises(ValueError, match=r"to_kerashub: missing weights .*addnorm3\.ln\.beta"):
        convert.to_kerashub(missing, H)
    with pytest.raises(TypeError, match="to_kerashub: weights must be a mapping"):
        convert.to_kerashub([1, 2], H)


# -- keras_hub.layers.TransformerEncoder <-> TransformerEncoderBlock -------------------------

ATTENTION_MASK = np.random.default_rng(7).random((B, T, T)) > 0.3
ATTENTION_MASK[..., 0] = True
PADDING = np.arange(T)[None, :] < LENS[:, None]


def kerashub_encoder(seed: int = 0, **kwargs: Any) -> Any:
    """A KerasHub encoder built by a call, then randomised."""
    layer = keras_hub.layers.TransformerEncoder(intermediate_dim=F, num_heads=H, **kwargs)
    layer(inputs(99)[0])
    rng = np.random.default_rng(seed)
    layer.set_weights([random_value(v.path, tuple(v.shape), rng) for v in layer.weights])
    return layer


@pytest.mark.parametrize("masks", [{}, {"padding_mask": PADDING}, {"attention_mask": ATTENTION_MASK},
                                   {"padding_mask": PADDING, "attention_mask": ATTENTION_MASK}],
                         ids=["none", "padding", "attention", "both"])
def test_kerashub_encoder_to_ours(masks: dict[str, Any]) -> None:
    native = kerashub_encoder()
    X = inputs(8)[0]
    expected = np.asarray(native(X, **masks))
    weights = convert.from_kerashub_encoder(native)
    config = convert.kerashub_encoder_config(native)
    assert config == {"num_hiddens": h, "ffn_num_hiddens": F, "num_heads": H, "dropout": 0.0,
                      "bias": True}
    ours = tf_layers.TransformerEncoderBlock(**config)
    ours.set_weights(weights)
    assert max_diff(np.asarray(ours(X, **masks)), expected) <= TOL  # KerasHub's keywords
    canonical: dict[str, Any] = {}
    if "padding_mask" in masks:
        canonical["valid_lens"] = LENS
    if "attention_mask" in masks:
        canonical["mask"] = ATTENTION_MASK
    assert max_diff(np.asarray(ours(X, **canonical)), expected) <= TOL
    assert max_diff(np.asarray(ac.transformer_encoder_block(X, weights, H, **canonical)),
                    expected) <= TOL


def test_ours_to_kerashub_encoder() -> None:
    X = inputs(9)[0]
    ours = tf_layers.TransformerEncoderBlock(h, F, H, bias=True)
    ours(X)
    rng = np.random.default_rng(10)
    ours.set_weights({name: random_value(name, value.shape, rng)
                      for name, value in ours.get_weights().items()})
    weights = ours.get_weights()
    native = convert.to_kerashub_encoder(weights, H)
    assert isinstance(native, keras_hub.layers.TransformerEncoder)
    expected = np.asarray(native(X, padding_mask=PADDING))
    assert max_diff(np.asarray(ours(X, valid_lens=LENS)), expected) <= TOL
    assert convert.kerashub_encoder_config(native) == {
        "num_hiddens": h, "ffn_num_hiddens": F, "num_heads": H, "dropout": 0.0, "bias": True}
    back = convert.from_kerashub_encoder(native)
    assert set(back) == set(weights)
    for name, value in weights.items():
        np.testing.assert_array_equal(back[name], value, err_msg=name)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"normalize_first": True}, "from_kerashub_encoder: normalize_first=True is not supported: "
                                "this library's TransformerEncoderBlock is post-norm"),
    ({"activation": "gelu"}, "from_kerashub_encoder: the activation must be relu, as this "
                             "library's PositionWiseFFN's, got gelu"),
    ({"layer_norm_epsilon": 1e-6}, "from_kerashub_encoder: layer_norm_epsilon must be 1e-05, the "
                                   "epsilon of this library's AddNorm, got 1e-06"),
])
def test_from_kerashub_encoder_refuses_forms_without_counterpart(kwargs: dict[str, Any],
                                                                 message: str) -> None:
    layer = kerashub_encoder(**kwargs)
    with pytest.raises(ValueError, match=re.escape(message)):
        convert.from_kerashub_encoder(layer)
    with pytest.raises(ValueError, match=re.escape(
            message.replace("from_kerashub_encoder", "kerashub_encoder_config"))):
        convert.kerashub_encoder_config(layer)


def test_kerashub_encoder_refusals() -> None:
    with pytest.raises(TypeError, match=r"from_kerashub_encoder: expected a keras_hub\.layers\."
                                        r"TransformerEncoder, got Dense"):
        convert.from_kerashub_encoder(keras.layers.Dense(2))
    unbuilt = keras_hub.layers.TransformerEncoder(intermediate_dim=F, num_heads=H)
    with pytest.raises(ValueError, match="from_kerashub_encoder: the Keras layer has no weights"):
        convert.from_kerashub_encoder(unbuilt)
    odd = keras_hub.layers.TransformerEncoder(intermediate_dim=F, num_heads=H)
    odd.build((None, None, 9))
    with pytest.raises(ValueError, match=re.escape(
            "from_kerashub_encoder: the encoder's width (9) must be divisible by num_heads (2)")):
        convert.from_kerashub_encoder(odd)
    unbiased = tf_layers.TransformerEncoderBlock(h, F, H)
    unbiased(inputs(11)[0])
    with pytest.raises(ValueError, match=re.escape(
            "to_kerashub_encoder: the attention projections must have biases (bias=True)")):
        convert.to_kerashub_encoder(unbiased.get_weights(), H)
    good = convert.from_kerashub_encoder(kerashub_encoder())
    missing = {k: v for k, v in good.items() if not k.startswith("addnorm2.")}
    with pytest.raises(ValueError, match=r"to_kerashub_encoder: missing weights .*addnorm2\.ln"):
        convert.to_kerashub_encoder(missing, H)
    with pytest.raises(TypeError, match="to_kerashub_encoder: weights must be a mapping"):
        convert.to_kerashub_encoder([1, 2], H)


# -- every KerasHub variable counts, and what a converter returns is a copy ------------------

#: KerasHub's layers: (make, run the native layer on X and encoder outputs, the converter, its
#: config function, run canonical weights on NumPy, the converter back).
LAYERS: dict[str, Any] = {
    "decoder-cross": (lambda: kerashub_native(True), lambda n, X, enc: kerashub_run(n, X, enc),
                      "from_kerashub", "kerashub_decoder_config",
                      lambda w, X, enc: core_run(w, X, enc), "to_kerashub"),
    "decoder-only": (lambda: kerashub_native(False), lambda n, X, enc: kerashub_run(n, X, None),
                     "from_kerashub", "kerashub_decoder_config",
                     lambda w, X, enc: core_run(w, X, None), "to_kerashub"),
    "encoder": (lambda: kerashub_encoder(), lambda n, X, enc: np.asarray(n(X, padding_mask=PADDING)),
                "from_kerashub_encoder", "kerashub_encoder_config",
                lambda w, X, enc: np.asarray(ac.transformer_encoder_block(X, w, H, LENS)),
                "to_kerashub_encoder"),
}


@pytest.mark.parametrize("kind", list(LAYERS))
def test_kerashub_converters_follow_every_variable(kind: str) -> None:
    """An offset on each KerasHub variable moves the converted block alike (and not what was
    converted before); each bias, scale and offset removed is refused by name; an offset on
    each canonical weight moves the KerasHub layer made of them, each one removed is refused."""
    from tests.test_convert import (
        array_bumps,
        assert_each_refused,
        assert_exact_or_refused,
        assert_follows,
        keras_bumps,
        keras_removals,
    )

    make, run_native, reader, config, run_ours, writer = LAYERS[kind]
    X, enc = inputs(12)
    native = make()
    assert_follows(lambda: run_native(native, X, enc), lambda: getattr(convert, reader)(native),
                   lambda w: run_ours(w, X, enc), keras_bumps(native))
    for what, fresh in keras_removals(make).items():
        layer = fresh()
        for where in (reader, config):
            assert_exact_or_refused(
                where, lambda n=layer: run_native(n, X, enc),
                lambda n=layer, w=where: run_ours(getattr(convert, reader)(n), X, enc)
                if getattr(convert, w)(n) else None, what)
    weights = getattr(convert, reader)(make())
    to_native = getattr(convert, writer)
    assert_follows(lambda: run_ours(weights, X, enc), lambda: to_native(weights, H),
                   lambda n: run_native(n, X, enc), array_bumps(weights))
    assert_each_refused(writer, weights, lambda w: to_native(w, H))


def test_kerashub_refuses_a_removed_layer_norm_offset() -> None:
    layer = kerashub_native(True)
    layer._cross_attention_layer_norm.beta = None
    with pytest.raises(ValueError, match=re.escape(
            "from_kerashub: cross_attention_layer_norm.beta is None, but this library's layer "
            "has it (addnorm2.ln.beta)")):
        convert.from_kerashub(layer)
    rms = kerashub_encoder()
    rms._feedforward_layer_norm.rms_scaling = True
    with pytest.raises(ValueError, match=re.escape(
            "kerashub_encoder_config: feedforward_layer_norm must be a LayerNormalization with "
            "epsilon=1e-05 and no rms_scaling")):
        convert.kerashub_encoder_config(rms)
