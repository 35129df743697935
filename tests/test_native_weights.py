"""The framework's own weight store, initial values and config hold the declared layout.

One test per concept over the harness hooks (``tests/hooks/<backend>_hooks.py``): the native
store (torch ``state_dict``/``named_parameters``, Keras ``layer.weights``, the Flax params tree,
Gluon ``collect_params()``) holds exactly the canonical names of the layout (the Weights page),
in order,
nested where the framework nests; the initial values follow the declared rule; the config
(Keras ``get_config``, Flax dataclass fields, the repr elsewhere) lists the declared arguments
in the layout's order and rebuilds an equal layer; a relative attention layer without a value
table
holds none. The expected names come from :mod:`attention_core.weights`' specs, the initial
distributions and argument orders are written out here from the Weights page and the rule's
docstring.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from attention_core import weights as W
from tests.harness import DTYPES, FASTEST_GRADIENT_MODE, Harness

#: These tests run on the columns too (conftest.py; tests.harness.COLUMNS).
COLUMN_TESTS = True

#: Backends whose layers nest their sublayers' weights (torch submodules, Flax dicts); Keras
#: variables, Gluon parameters and NumPy hold flat dotted names.
NESTING = ("torch", "jax", "nnx")
#: Backends whose stores have no order of their own: JAX orders a dict's keys by sorting them
#: whenever it flattens one (``jax.jit``, msgpack files), so a Flax params tree (and
#: ``get_weights``, read off it) holds the names in the order it was last made in; so does
#: ``nnx.state`` (its keys sorted).
UNORDERED = ("jax", "nnx")

#: layer, config, input shapes (``"tokens"`` and a shape: token ids), expected names and shapes.
LAYOUTS: dict[str, tuple[str, dict[str, Any], list[Any], W.Spec]] = {
    "MultiHeadAttention-bias": (
        "MultiHeadAttention", {"num_hiddens": 16, "num_heads": 4, "bias": True},
        [(2, 3, 10), (2, 5, 7), (2, 5, 9)], W.multi_head_spec(16, 4, True, 10, 7, 9)),
    "AdditiveAttention": (
        "AdditiveAttention", {"num_hiddens": 6}, [(2, 3, 4), (2, 5, 7), (2, 5, 3)],
        W.additive_spec(6, 4, 7)),
    "RelativeMultiHeadAttention": (
        "RelativeMultiHeadAttention",
        {"num_hiddens": 12, "num_heads": 3, "max_relative_position": 2, "bias": True},
        [(2, 4, 10), (2, 4, 7), (2, 4, 9)], W.relative_multi_head_spec(12, 3, 2, True, True, 10, 7, 9)),
    "PositionWiseFFN": (
        "PositionWiseFFN", {"ffn_num_hiddens": 9, "ffn_num_outputs": 4}, [(2, 3, 5)],
        W.ffn_spec(9, 4, 5)),
    "AddNorm": ("AddNorm", {"num_hiddens": 6}, [(2, 3, 6), (2, 3, 6)], W.add_norm_spec(6)),
    "LearnedPositionalEncoding": (
        "LearnedPositionalEncoding", {"num_hiddens": 6, "max_len": 20}, [(2, 3, 6)],
        W.learned_positional_spec(6, 20)),
    "NadarayaWatson": ("NadarayaWatson", {"parametric": True}, [(2, 5), (2, 7), (2, 7)],
                       W.nadaraya_watson_spec(True)),
    "TransformerEncoderBlock": (
        "TransformerEncoderBlock", {"num_hiddens": 8, "ffn_num_hiddens": 16, "num_heads": 2,
                                    "bias": True}, [(2, 5, 8)], W.encoder_block_spec(8, 16, 2, True)),
    "TransformerEncoder": (
        "TransformerEncoder", {"vocab_size": 50, "num_hiddens": 16, "ffn_num_hiddens": 20,
                               "num_heads": 4, "num_blks": 3, "bias": True},
        ["tokens", (2, 5)], W.transformer_encoder_spec(50, 16, 20, 4, 3, True)),
}


def wide(backend: str) -> str:
    """The widest dtype the backend's layers are tested in."""
    return "float64" if "float64" in DTYPES[backend] else "float32"


def inputs(h: Harness, shapes: list[Any], dtype: str, high: int = 50) -> list[Any]:
    """Random inputs of these shapes, or token ids below ``high`` for ``["tokens", shape]``."""
    rng = np.random.default_rng(0)
    if shapes[0] == "tokens":
        return [h.array(rng.integers(0, high, shapes[1]).astype(np.int32))]
    return [h.array(rng.standard_normal(s), dtype) for s in shapes]


def built(h: Harness, name: str, config: dict[str, Any], shapes: list[Any], dtype: str,
          high: int = 50, hook: str = "build") -> Any:
    """The layer after its first call (which creates the weights the input sizes fix); a
    backend's ``build`` hook creates them faster (values drawn another way), its
    ``initialise`` hook faster and as the call draws them."""
    layer = h.make(name, config, dtype)
    getattr(h.hooks, hook, h.call)(layer, *inputs(h, shapes, dtype, high))
    return layer


def output(h: Harness, layer: Any, args: list[Any]) -> np.ndarray:
    """The layer's output, in the mode its backend runs a whole layer fastest in."""
    mode = FASTEST_GRADIENT_MODE.get(h.name, "eager")
    return h.numpy(h.run(mode, layer, lambda m, *a: h.call(m, *a), args))


def paths(backend: str, names: Any) -> list[tuple[str, ...]]:
    """The native paths of canonical names: nested at each dot, or the dotted name itself."""
    return [tuple(n.split(".")) if backend in NESTING else (n,) for n in names]


def assert_in_order(backend: str, got: Any, expected: Any) -> None:
    """``got`` lists ``expected``, in order unless the backend keeps none (:data:`UNORDERED`)."""
    got, expected = list(got), list(expected)
    assert got == expected if backend not in UNORDERED else sorted(got) == sorted(expected)


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_native_store_holds_the_canonical_names_in_order(backend: str, case: str) -> None:
    """The framework's store is the canonical mapping: the same names in the same order, the
    same values, in the layer's dtype; writing either one writes the other."""
    h = Harness(backend)
    name, config, shapes, expected = LAYOUTS[case]
    layer = built(h, name, config, shapes, wide(backend))
    native = h.hook("native_weights")(layer)
    assert_in_order(backend, native, paths(backend, expected))
    canonical = layer.get_weights()
    assert_in_order(backend, canonical, expected)
    for weight, shape in expected.items():
        (path,) = paths(backend, [weight])
        value = native[path]
        assert value.shape == shape and value.dtype == np.dtype(wide(backend)), weight
        np.testing.assert_array_equal(value, canonical[weight])
    h.hook("set_native_weights")(layer, {path: value * 2 for path, value in native.items()})
    for weight, value in layer.get_weights().items():
        np.testing.assert_array_equal(value, canonical[weight] * 2)
    layer.set_weights(canonical)  # and the other way: the native store holds them again
    again = h.hook("native_weights")(layer)
    assert list(again) == list(native)
    for path, value in native.items():
        np.testing.assert_array_equal(again[path], value)


#: Layers whose framework file is read back here (more, into layers only constructed, in
#: tests/test_adapters.py::test_native_file_round_trip).
ROUND_TRIP = ("MultiHeadAttention-bias",)


@pytest.mark.parametrize("case", ROUND_TRIP)
def test_native_file_holds_the_names_in_order(backend: str, case: str, tmp_path: Path) -> None:
    """The framework's own file, read into a layer set up as usual but never called (Gluon:
    ``initialize()``d, its input sizes deferred): the canonical names in order, the weights
    and input sizes from the file before any call, the same outputs."""
    h = Harness(backend)
    name, config, shapes, expected = LAYOUTS[case]
    args = inputs(h, shapes, "float32")
    src = built(h, name, config, shapes, "float32")
    out = output(h, src, args)
    fresh, names = h.save_load_native(src, lambda: h.make(name, config), args, tmp_path)
    assert_in_order(backend, names, expected)
    loaded = fresh.get_weights()
    for weight, value in src.get_weights().items():
        np.testing.assert_array_equal(loaded[weight], value)
    np.testing.assert_array_equal(output(h, fresh, args), out)


def aligned(value: np.ndarray) -> np.ndarray:
    """A copy of ``value`` at an address that is a multiple of 64 bytes: JAX on the CPU takes
    such a NumPy array without copying it (others it copies), so a layer that kept the
    caller's array would show it."""
    buffer = np.empty(value.nbytes + 64, np.uint8)
    start = -buffer.ctypes.data % 64
    out = buffer[start:start + value.nbytes].view(value.dtype).reshape(value.shape)
    out[...] = value
    return out


@pytest.mark.parametrize("called", [False, True], ids=["fresh", "called"])
def test_set_and_get_weights_hold_copies(backend: str, called: bool) -> None:
    """``set_weights`` keeps no reference to the caller's arrays (writing into them later
    changes neither the weights nor the output), and ``get_weights`` returns copies (writing
    into them changes nothing either); before the first call and after it."""
    h = Harness(backend)
    name, config, shapes, expected = LAYOUTS["MultiHeadAttention-bias"]
    args = inputs(h, shapes, "float32")
    layer = built(h, name, config, shapes, "float32") if called else h.make(name, config)
    rng = np.random.default_rng(1)
    given = {weight: aligned(rng.normal(0.0, 0.5, shape).astype(np.float32))
             for weight, shape in expected.items()}
    kept = {weight: value.copy() for weight, value in given.items()}
    layer.set_weights(given)
    out = output(h, layer, args)
    for value in given.values():
        value += 1.0
    got = layer.get_weights()
    for weight, value in got.items():
        np.testing.assert_array_equal(value, kept[weight], err_msg=weight)
        value += 1.0
    for weight, value in layer.get_weights().items():
        np.testing.assert_array_equal(value, kept[weight], err_msg=weight)
    np.testing.assert_array_equal(output(h, layer, args), out)


# -- initial values -------------------------------------------------------------------------


def rule(name: str, shape: tuple[int, ...]) -> tuple[str, float, float]:
    """The declared initialisation of a weight, from the Weights page and ``init_rule``'s docstring:
    kernels Glorot-uniform, biases and ``beta`` 0, ``gamma`` 1, learned ``P`` N(0, 0.02**2),
    ``embedding`` tables N(0, 1/D), a kernel width ``w`` uniform in [0, 1)."""
    leaf = name.rpartition(".")[2]
    if leaf == "kernel":
        limit = math.sqrt(6.0 / (shape[0] + shape[1]))
        return ("uniform", -limit, limit)
    if leaf in ("bias", "beta", "gamma"):
        return ("constant", float(leaf == "gamma"), 0.0)
    if leaf == "P":
        return ("normal", 0.0, 0.02)
    if leaf == "embedding":
        return ("normal", 0.0, 1.0 / math.sqrt(shape[-1]))
    assert leaf == "w", name
    return ("uniform", 0.0, 1.0)


#: Layers with large tables, so that their sample moments are close to the rule's.
INITIALISED = {
    "TransformerEncoder": ({"vocab_size": 500, "num_hiddens": 64, "ffn_num_hiddens": 128,
                            "num_heads": 4, "num_blks": 1, "bias": True}, ["tokens", (1, 3)]),
    "RelativeMultiHeadAttention": ({"num_hiddens": 64, "num_heads": 1, "max_relative_position": 300,
                                    "relative_values": False}, [(1, 2, 3)] * 3),
    "LearnedPositionalEncoding": ({"num_hiddens": 64, "max_len": 500}, [(1, 3, 64)]),
    "NadarayaWatson": ({"parametric": True}, [(1, 3), (1, 4), (1, 4)]),
}


@pytest.mark.parametrize("name", list(INITIALISED))
def test_initial_weights_follow_the_declared_rule(backend: str, name: str) -> None:
    """Each initial weight is drawn by its rule: constants exact, uniform draws inside their
    bounds, and (4096 draws or more) mean and std within five standard errors of the rule's
    (for a std: sqrt(0.2/n) relative for uniform draws, sqrt(0.5/n) for normal ones)."""
    h = Harness(backend)
    config, shapes = INITIALISED[name]
    layer = built(h, name, config, shapes, "float32", high=500, hook="initialise")
    for weight, value in layer.get_weights().items():
        kind, a, b = rule(weight, value.shape)
        assert W.init_rule(weight, value.shape) == (kind, a, b), weight  # what the core declares
        x = np.asarray(value, np.float64)
        if kind == "constant":
            np.testing.assert_array_equal(x, a, err_msg=weight)
            continue
        if kind == "uniform":
            assert a <= x.min() and x.max() <= b, weight
            mean, std, spread = (a + b) / 2, (b - a) / math.sqrt(12), math.sqrt(0.2 / x.size)
        else:
            mean, std, spread = a, b, math.sqrt(0.5 / x.size)
        if x.size >= 4096:
            assert abs(x.mean() - mean) <= 5 * std / math.sqrt(x.size), weight
            assert abs(x.std() / std - 1) <= 5 * spread, (weight, x.std(), std)


# -- configs --------------------------------------------------------------------------------

#: The layers' documented constructor arguments, in order, then the keyword-only ones.
ARGUMENTS = {
    "DotProductAttention": (["dropout"], ["keep_attention_weights", "implementation"]),
    "AdditiveAttention": (["num_hiddens", "dropout"], []),
    "MultiHeadAttention": (["num_hiddens", "num_heads", "dropout", "bias"],
                           ["keep_attention_weights", "implementation"]),
    "RelativeMultiHeadAttention": (
        ["num_hiddens", "num_heads", "max_relative_position", "dropout", "bias"],
        ["relative_values", "keep_attention_weights"]),
    "PositionalEncoding": (["num_hiddens", "dropout", "max_len"], []),
    "LearnedPositionalEncoding": (["num_hiddens", "dropout", "max_len"], []),
    "PositionWiseFFN": (["ffn_num_hiddens", "ffn_num_outputs"], []),
    "AddNorm": (["num_hiddens", "dropout"], []),
    "TransformerEncoderBlock": (["num_hiddens", "ffn_num_hiddens", "num_heads", "dropout", "bias"],
                                ["keep_attention_weights", "implementation"]),
    "TransformerEncoder": (
        ["vocab_size", "num_hiddens", "ffn_num_hiddens", "num_heads", "num_blks", "dropout", "bias"],
        ["keep_attention_weights", "implementation", "max_len"]),
    "NadarayaWatson": (["parametric"], []),
}

#: Configs with every argument given; keyword-only ones only where they differ from the
#: default (a repr leaves defaults of keyword-only arguments out).
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
                            "keep_attention_weights": False, "implementation": "blockwise",
                            "max_len": 64}),
]


def declared_class(layer: Any) -> type:
    """The library's class of a layer (a Flax handle's module)."""
    return type(getattr(layer, "module", layer))


@pytest.mark.parametrize("layer, config", CONFIGS, ids=[f"{c[0]}-{len(c[1])}" for c in CONFIGS])
def test_config_lists_the_declared_arguments_in_order(backend: str, layer: str,
                                                      config: dict[str, Any]) -> None:
    """The framework's config (Keras ``get_config``, Flax's fields, the repr) lists the documented
    arguments first and in order, then the keyword-only ones, with the values given; a layer
    rebuilt from it (Keras: by its registered name) has the same class and config."""
    h = Harness(backend)
    original = h.make(layer, config, wide(backend))
    saved = h.hook("config")(original)
    design, keyword = ARGUMENTS[layer]
    declared = [name for name in saved if name in design + keyword]  # Keras adds name, dtype
    assert declared == [name for name in design + keyword if name in saved]
    assert declared[:len(design)] == design
    assert {name: saved[name] for name in config} == config
    copy = h.hook("rebuild")(original)
    assert declared_class(copy) is declared_class(original)
    assert h.hook("config")(copy) == saved


# -- a layer that keeps no value table --------------------------------------------------------


def test_relative_attention_without_value_table_holds_none(backend: str) -> None:
    h = Harness(backend)
    config = {"num_hiddens": 12, "num_heads": 3, "max_relative_position": 2, "bias": True,
              "relative_values": False}
    layer = built(h, "RelativeMultiHeadAttention", config, [(2, 4, 10), (2, 4, 7), (2, 4, 9)],
                  "float32")
    names = ["W_q.kernel", "W_q.bias", "W_k.kernel", "W_k.bias", "W_v.kernel", "W_v.bias",
             "W_o.kernel", "W_o.bias", "rel_k.embedding"]
    native = h.hook("native_weights")(layer)
    assert_in_order(backend, native, paths(backend, names))
    assert native[paths(backend, ["rel_k.embedding"])[0]].shape == (5, 4)  # 2m + 1 offsets, h/H
    assert_in_order(backend, layer.get_weights(), names)
