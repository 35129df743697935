"""A walk over the public API with bad arguments: only the library's own errors, by name.

Every layer's constructor arguments (by their declared type) and every argument of a good
call to every layer, and the functional entry points' arguments, are replaced in turn by
values of the wrong kind (a string, a number where an array or a flag belongs, an array of
the wrong rank). Each must raise ``ValueError`` or ``TypeError`` naming the argument, on every
backend: never a framework's own exception (``AttributeError``, ``RuntimeError``,
``InvalidArgumentError``, ``MXNetError``), never a silent success. The exact messages of the
common mistakes are in the catalogue of ``tests/test_errors.py``; this walk covers the rest.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import attention_core as ac
from attention_core import declarations as D
from tests.harness import COLUMNS, Harness

#: These tests run on the columns too (conftest.py; tests.harness.COLUMNS).
COLUMN_TESTS = True

R = np.random.default_rng(0)


def arr(*shape: int) -> np.ndarray:
    return R.standard_normal(shape).astype(np.float32)


TOKENS = np.array([[1, 2, 3], [4, 5, 6]])
LENS = np.array([2, 3])

#: A good constructor configuration of every layer.
CONFIGS: dict[str, dict[str, Any]] = {
    "DotProductAttention": {},
    "AdditiveAttention": {"num_hiddens": 8},
    "MultiHeadAttention": {"num_hiddens": 8, "num_heads": 2},
    "RelativeMultiHeadAttention": {"num_hiddens": 8, "num_heads": 2, "max_relative_position": 2},
    "PositionalEncoding": {"num_hiddens": 8},
    "LearnedPositionalEncoding": {"num_hiddens": 8},
    "RotaryEmbedding": {},
    "PositionWiseFFN": {"ffn_num_hiddens": 8, "ffn_num_outputs": 4},
    "AddNorm": {"num_hiddens": 8},
    "TransformerEncoderBlock": {"num_hiddens": 8, "ffn_num_hiddens": 16, "num_heads": 2},
    "TransformerEncoder": {"vocab_size": 11, "num_hiddens": 8, "ffn_num_hiddens": 16,
                           "num_heads": 2, "num_blks": 1},
    "TransformerDecoderBlock": {"num_hiddens": 8, "ffn_num_hiddens": 16, "num_heads": 2},
    "TransformerDecoder": {"vocab_size": 11, "num_hiddens": 8, "ffn_num_hiddens": 16,
                           "num_heads": 2, "num_blks": 1},
    "Transformer": {"src_vocab_size": 11, "tgt_vocab_size": 11, "num_hiddens": 8,
                    "ffn_num_hiddens": 16, "num_heads": 2, "num_blks": 1},
    "NadarayaWatson": {},
}

_QKV = {"queries": arr(2, 3, 8), "keys": arr(2, 4, 8), "values": arr(2, 4, 8),
        "valid_lens": LENS, "mask": np.ones((3, 4), bool)}
#: Packed segments of the 4 keys (the 3 queries take the ids of the last 3 positions).
_SCORED = {**_QKV, "segment_ids": np.array([[0, 0, 1, 1], [0, 1, 1, 1]], np.int32)}
_SELF = {"valid_lens": LENS, "mask": np.ones((3, 3), bool)}
_DECODER = {"enc_outputs": arr(2, 4, 8), "enc_valid_lens": LENS, **_SELF,
            "enc_mask": np.ones((3, 4), bool)}

#: A good call of every layer, every array argument given.
CALLS: dict[str, dict[str, Any]] = {
    "DotProductAttention": _SCORED,
    "AdditiveAttention": _QKV,
    "MultiHeadAttention": _SCORED,
    "RelativeMultiHeadAttention": {**_QKV, "keys": arr(2, 3, 8), "values": arr(2, 3, 8),
                                   **_SELF},
    "PositionalEncoding": {"X": arr(2, 3, 8)},
    "LearnedPositionalEncoding": {"X": arr(2, 3, 8)},
    "RotaryEmbedding": {"X": arr(2, 3, 8)},
    "PositionWiseFFN": {"X": arr(2, 3, 8)},
    "AddNorm": {"X": arr(2, 3, 8), "Y": arr(2, 3, 8)},
    "TransformerEncoderBlock": {"X": arr(2, 3, 8), **_SELF},
    "TransformerEncoder": {"tokens": TOKENS, **_SELF},
    "TransformerDecoderBlock": {"X": arr(2, 3, 8), **_DECODER},
    "TransformerDecoder": {"tokens": TOKENS, **_DECODER},
    "Transformer": {"src_tokens": TOKENS, "tgt_tokens": TOKENS, "src_valid_lens": LENS,
                    "tgt_valid_lens": LENS},
    "NadarayaWatson": {"queries": arr(2, 3), "keys": arr(2, 5), "values": arr(2, 5)},
}

#: Values of the wrong kind for a constructor argument, by its declared type.
WRONG_SETTINGS: dict[str, tuple[Any, ...]] = {
    "bool": ("yes", 2, None),
    "int": ("8", 2.5, [8], None),
    "float": ("0.1", [0.1], None),
    "str": (3, ["rotary"]),
    "any": (3, ["seq"]),  # context_parallel: an engine's object, refused where none runs it
}

#: Values of the wrong kind for an array argument of a call.
WRONG_ARRAYS: dict[str, Any] = {"a string": "x", "a float": 2.5, "a 1-d array": arr(3)}


def kind_of(annotation: Any) -> str:
    """The kind of a declared constructor argument: bool, int, float, str or any."""
    text = str(annotation)
    if annotation is typing.Any:
        return "any"
    return next(kind for kind in ("bool", "int", "float", "str") if kind in text)


def settings() -> list[tuple[str, str, Any]]:
    """(layer, argument, wrong value) for every constructor argument of every layer."""
    cases = []
    for layer in ac.LAYER_NAMES:
        declared = D.LAYERS[layer]
        hints = typing.get_type_hints(declared)
        for field in dataclasses.fields(declared):
            optional = "None" in str(hints[field.name])
            cases += [(layer, field.name, value) for value in WRONG_SETTINGS[kind_of(hints[field.name])]
                      if not (value is None and optional)]
    return cases


def assert_named(argument: str, act: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """``act(*args, **kwargs)`` raises the library's ValueError or TypeError naming ``argument``."""
    try:
        act(*args, **kwargs)
    except (ValueError, TypeError) as err:
        named = re.search(rf"(?<![\w.]){re.escape(argument)}(?!\w)", str(err))
        assert named, f"{type(err).__name__} not naming {argument}: {err}"
    except Exception as err:  # what the walk is for: a framework's own error
        pytest.fail(f"{type(err).__module__}.{type(err).__name__} reached the user: {err}")
    else:
        pytest.fail(f"accepted {argument} silently")


@pytest.mark.parametrize("layer", ac.LAYER_NAMES)
def test_constructor_arguments_of_the_wrong_kind(backend: str, layer: str) -> None:
    h = Harness(backend)
    for name, argument, value in (case for case in settings() if case[0] == layer):
        assert_named(argument, h.make, name, {**CONFIGS[name], argument: value})


@pytest.mark.parametrize("layer", ac.LAYER_NAMES)
def test_call_arguments_of_the_wrong_kind(backend: str, layer: str) -> None:
    h = Harness(backend)
    made = h.make(layer, CONFIGS[layer])
    good = {name: h.array(value) for name, value in CALLS[layer].items()}
    h.call(made, **good)
    for argument in good:
        for value in WRONG_ARRAYS.values():
            wrong = h.array(value) if isinstance(value, np.ndarray) else value
            assert_named(argument, h.call, made, **{**good, argument: wrong})


def numpy_weights(h: Harness, layer: str, **call: Any) -> dict[str, Any]:
    """The weights of the NumPy layer of :data:`CONFIGS` after a good call, as backend arrays."""
    from backends import numpy as numpy_layers

    made = getattr(numpy_layers, layer)(**CONFIGS[layer], seed=0)
    made(**call)
    return {name: h.array(value) for name, value in made.get_weights().items()}


def functions(h: Harness) -> dict[str, tuple[Callable[..., Any], dict[str, Any]]]:
    """Functional entry points and a good call of each, as the backend's arrays."""
    q, k, v = (h.array(x) for x in (arr(2, 3, 8), arr(2, 4, 8), arr(2, 4, 8)))
    decoder = {name: CALLS["TransformerDecoder"][name] for name in ("tokens", "enc_outputs",
                                                                    "enc_valid_lens")}
    block = {name: CALLS["TransformerDecoderBlock"][name] for name in ("X", "enc_outputs",
                                                                       "enc_valid_lens")}
    pair = {name: CALLS["Transformer"][name] for name in ("src_tokens", "tgt_tokens",
                                                          "src_valid_lens")}
    return {
        "transformer_decoder": (ac.transformer_decoder, {
            "weights": numpy_weights(h, "TransformerDecoder", **decoder), "num_heads": 2,
            **{name: h.array(value) for name, value in decoder.items()}}),
        "cached_decoder": (ac.transformer_decoder, {
            "weights": numpy_weights(h, "TransformerDecoder", **decoder), "num_heads": 2,
            "capacity": 3, **{name: h.array(value) for name, value in decoder.items()}}),
        "transformer_decoder_block": (ac.transformer_decoder_block, {
            "weights": numpy_weights(h, "TransformerDecoderBlock", **block), "num_heads": 2,
            **{name: h.array(value) for name, value in block.items()}}),
        "transformer_encoder_decoder": (ac.transformer_encoder_decoder, {
            "weights": numpy_weights(h, "Transformer", **pair), "num_heads": 2,
            **{name: h.array(value) for name, value in pair.items()}}),
        "dot_product_attention": (ac.dot_product_attention, {
            "queries": q, "keys": k, "values": v, "valid_lens": h.array(LENS),
            "mask": h.array(np.ones((3, 4), bool)),
            "segment_ids": h.array(_SCORED["segment_ids"])}),
        "masked_softmax": (ac.masked_softmax, {"scores": h.array(arr(2, 3, 4)),
                                               "valid_lens": h.array(LENS)}),
        "nadaraya_watson": (ac.nadaraya_watson, {"queries": h.array(arr(2, 3)),
                                                 "keys": h.array(arr(2, 5)),
                                                 "values": h.array(arr(2, 5))}),
        "rotary_embedding": (ac.rotary_embedding, {"X": h.array(arr(2, 3, 8))}),
    }


def test_functional_arguments_of_the_wrong_kind(backend: str) -> None:
    if backend in COLUMNS:
        pytest.skip("the functional API on the column's arrays runs in its backend's env")
    h = Harness(backend)
    for function, good in functions(h).values():
        function(**good)
        for argument in (name for name in good if name not in ("weights", "num_heads", "capacity")):
            for value in WRONG_ARRAYS.values():
                wrong = h.array(value) if isinstance(value, np.ndarray) else value
                assert_named(argument, function, **{**good, argument: wrong})


@pytest.mark.parametrize("layer", ["MultiHeadAttention", "TransformerEncoderBlock", "AddNorm"])
def test_numpy_inputs_are_taken_as_the_backends_arrays(backend: str, layer: str) -> None:
    """A layer called on NumPy arrays (inputs, lengths, masks) gives what it gives on the
    backend's own arrays, on every backend (torch's layers raised torch's matmul error)."""
    h = Harness(backend)
    made = h.make(layer, CONFIGS[layer])
    given = {name: value for name, value in CALLS[layer].items()}
    own = h.numpy(h.call(made, **{name: h.array(value) for name, value in given.items()}))
    assert np.array_equal(h.numpy(h.call(made, **given)), own)


#: The call keywords of a mode, by backend (torch and Gluon set it on the layer or by a scope).
MODE_KEYWORDS = {"numpy": ("training",), "tensorflow": ("training",),
                 "jax": ("training", "deterministic")}


@pytest.mark.parametrize("value", ["no", 2])
def test_training_flag_of_the_wrong_kind(backend: str, value: Any) -> None:
    """A call's ``training`` (and Flax's ``deterministic``) given as a string or a number is
    refused by name where the call takes it: ``training="no"`` ran with dropout on."""
    h = Harness(backend)
    made = h.make("MultiHeadAttention", {**CONFIGS["MultiHeadAttention"], "dropout": 0.5})
    good = {name: h.array(value) for name, value in CALLS["MultiHeadAttention"].items()}
    h.call(made, **good)
    taken = MODE_KEYWORDS.get(COLUMNS[backend].arrays if backend in COLUMNS else backend, ())
    if backend.startswith("keras"):
        taken = ("training",)
    if not taken:
        pytest.skip(f"{backend}'s layers take no training keyword (the framework's own mode)")
    for name in taken:
        with pytest.raises(TypeError, match=f"{name} must be True or False, got {value!r}"):
            h.call(made, **good, **{name: value})
