"""Building a layer, alike on every framework: input sizes come from the first call.

A layer made without its input sizes has no weights until its first call, eager or inside the
framework's compiled mode; the framework's own store holds placeholders of the declared shapes
meanwhile (torch, Gluon) or nothing (Keras, Flax, NumPy). A first call that fails builds
nothing. A built layer refuses other widths with the core's message in every mode, and
compiled modes check shapes, not values. Seeded initial weights are reproducible; torch and
Flax make weights from given input sizes before any call (NNX modules only so: a width not
given is ``num_hiddens``); a constant table is no weight.

The bad-input catalogue (tests/test_errors.py) already checks, eagerly on every backend, the
messages of ``get_weights`` before the first call and of a built layer given another width;
tests/test_errors.py::test_failed_first_call_leaves_input_sizes_open the eager failed first call
of multi-head attention. The hooks used here (``first_call_compiled``, ``native_shapes``,
``seeded_weights``, ``weights_from_sizes``, ``call_with_unknown_widths``) are described in
tests/hooks/*_hooks.py; a backend without one skips the test, saying why.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from attention_core import weights as W
from tests import naive
from tests.harness import MODES, TOLERANCE, Harness, max_diff

#: These tests run on the columns too (conftest.py; tests.harness.COLUMNS).
COLUMN_TESTS = True

NOT_BUILT = "weights are created on the first call; call the layer or set_weights first"
#: Backends whose compiled mode cannot make a layer's first call, and why.
NO_COMPILED_FIRST_CALL = {
    "numpy": "NumPy has no compiled mode",
    "torch": "torch.compile refuses an unbuilt layer with advice (tests/test_torch.py)",
}
#: Compiled modes whose first call sees the values of the arrays (Gluon's deferred
#: initialisation runs the first hybridized call imperatively); in the others, and in later
#: compiled calls, a value check such as ``valid_lens <= K`` cannot run.
SEES_VALUES = {("mxnet", "hybridize")}


def draw(*shapes: tuple[int, ...], seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


#: Per layer: its config, its declared weight shapes (input sizes unknown), and the shapes of
#: queries, keys and values (three widths, so each kernel's input size is told apart) and the
#: valid lengths of a first call. Those of tests/test_errors.py and tests/test_adapters.py: on
#: JAX, whose eager mode compiles each primitive for each shape, they are compiled already.
LAYERS: dict[str, tuple[dict[str, Any], W.Spec, list[tuple[int, ...]], np.ndarray]] = {
    "MultiHeadAttention": ({"num_hiddens": 8, "num_heads": 2}, W.multi_head_spec(8, 2, False),
                           [(2, 4, 3), (2, 6, 8), (2, 6, 5)], np.array([3, 6])),
    "RelativeMultiHeadAttention": (
        {"num_hiddens": 12, "num_heads": 3, "max_relative_position": 2, "bias": True},
        W.relative_multi_head_spec(12, 3, 2, True, True), [(2, 4, 10), (2, 6, 7), (2, 6, 9)],
        np.array([[1, 2, 3, 4], [6, 6, 5, 2]])),
}


def make(h: Harness, layer: str) -> Any:
    return h.make(layer, LAYERS[layer][0])


def declared(layer: str) -> dict[str, tuple[int | None, ...]]:
    return dict(LAYERS[layer][1])


def assert_unbuilt(h: Harness, layer: Any, name: str) -> None:
    """No weights yet; the native store holds at most placeholders of the declared shapes."""
    with pytest.raises(ValueError) as err:
        layer.get_weights()
    assert str(err.value) == f"{name}: {NOT_BUILT}"
    native: dict[str, Any] = getattr(h.hooks, "native_shapes", lambda layer: {})(layer)
    if native:  # torch and Gluon: every weight, the shapes not yet known left open
        spec = declared(name)
        assert sorted(native) == sorted(spec)  # their order: tests/test_native_weights.py
        for key, shape in native.items():
            assert shape in ((None, spec[key]) if None in spec[key] else (spec[key],)), key
    else:
        assert h.name not in ("torch", "mxnet"), "torch and Gluon hold placeholders"


#: Backends whose layers are made with their input sizes, so that no first call learns them.
SIZED_WHEN_MADE = {"nnx": "NNX modules are made with their input widths (q_in= ...): "
                          "tests/test_nnx.py"}


def first_call(h: Harness, compiled: bool) -> Any:
    if h.name in SIZED_WHEN_MADE:
        pytest.skip(SIZED_WHEN_MADE[h.name])
    if not compiled:
        return h.call
    reason = NO_COMPILED_FIRST_CALL.get(h.name)
    if reason is not None:
        pytest.skip(reason)
    return h.hook("first_call_compiled")


#: (mode of the first call, layer): multi-head attention eagerly and compiled, relative eagerly.
FIRST_CALLS = [(False, "MultiHeadAttention"), (True, "MultiHeadAttention"),
               (False, "RelativeMultiHeadAttention")]


@contextlib.contextmanager
def raises_core_message(message: str, compiled: bool) -> Iterator[None]:
    """A ValueError saying the core's message: exactly when eager, inside the framework's report
    of the failed trace when compiled."""
    with pytest.raises(ValueError) as err:
        yield
    assert (message in str(err.value)) if compiled else (str(err.value) == message), str(err.value)


@pytest.mark.parametrize("compiled, name", FIRST_CALLS,
                         ids=[f"{'compiled' if c else 'eager'}-{n}" for c, n in FIRST_CALLS])
def test_input_sizes_are_inferred_on_the_first_call(backend: str, compiled: bool, name: str) -> None:
    """First calls that fail build nothing (shape errors in every mode, value errors where the
    values are seen: eagerly and Gluon's hybridized call); the next one builds from its inputs."""
    h = Harness(backend)
    run = first_call(h, compiled)
    layer = make(h, name)
    assert_unbuilt(h, layer, name)
    _, _, shapes, lens = LAYERS[name]
    q, k, v = (h.array(x) for x in draw(*shapes))
    short = h.array(draw((2, 5, shapes[2][2]))[0])
    bad = {"keys and values must have the same length, got 6 keys and 5 values": [q, k, short]}
    mode = MODES[backend][1] if compiled else "eager"
    # lengths given on the host; Keras makes them JAX arrays there, whose values are not read
    if (mode == "eager" or (backend, mode) in SEES_VALUES) and backend != "keras-jax":
        bad["valid_lens must be <= the number of keys (6), got 9"] = [q, k, v, np.array([9, 9])]
    for message, args in bad.items():
        with raises_core_message(message, compiled):
            run(layer, *args)
        assert_unbuilt(h, layer, name)
    out, attention = run(layer, q, k, v, h.array(lens), return_attention=True)
    weights = {key: np.asarray(w, np.float64) for key, w in layer.get_weights().items()}
    hidden = LAYERS[name][0]["num_hiddens"]
    kernels = {f"W_{x}.kernel": (shape[2], hidden) for x, shape in zip("qkv", shapes, strict=True)}
    assert {key: w.shape for key, w in weights.items()} == {**declared(name), **kernels}
    reference: Any = naive.multi_head if name == "MultiHeadAttention" else naive.relative_multi_head
    heads = LAYERS[name][0]["num_heads"]
    want, want_attention = reference(h.numpy(q), h.numpy(k), h.numpy(v), weights, heads,
                                     naive.visible(2, heads, 4, 6, lens))
    assert max_diff(h.numpy(out), want) <= TOLERANCE["float32"]
    assert max_diff(h.numpy(attention), want_attention) <= TOLERANCE["float32"]
    native = getattr(h.hooks, "native_shapes", None)
    if native is not None:  # the framework's own store holds the weights just made
        assert native(layer) == {key: w.shape for key, w in weights.items()}


def test_the_first_call_under_autodiff_trains_the_weights_it_creates(backend: str) -> None:
    """Gradients reach every weight the first call creates (Gluon: imperative and hybridized)."""
    h = Harness(backend)
    if backend in ("numpy", "jax"):
        pytest.skip("NumPy has no autodiff" if backend == "numpy" else
                    "Flax creates the params in init(), outside jax.grad, which takes them as given")
    for setup in h.setups():
        layer = h.make("MultiHeadAttention", {"num_hiddens": 8, "num_heads": 2, "bias": True})
        setup(layer)
        q, k, ct = draw((2, 3, 5), (2, 4, 6), (2, 3, 8))
        grads = h.hook("gradients")(layer, [h.array(q), h.array(k), h.array(k)],
                                    {"valid_lens": h.array(np.array([2, 4]))}, ct)
        names = list(layer.get_weights())
        assert {f"weight.{n}" for n in names} <= set(grads) and len(names) == 8
        for name in names:
            assert np.abs(np.asarray(grads[f"weight.{name}"])).sum() > 0, name


def test_a_built_layer_checks_shapes_in_its_compiled_mode(backend: str) -> None:
    """Another width is refused with the core's message (eagerly: the catalogue's
    ``layer_other_width`` row), and so are lengths of a wrong shape; the lengths' values are
    not checked, the trace cannot see them."""
    h = Harness(backend)
    if len(MODES[backend]) == 1:
        pytest.skip(f"{backend} has no compiled mode")
    if backend in ("torch", "keras-torch"):
        pytest.skip("torch.compile costs seconds per graph: tests/test_torch.py and the matrix")
    mode = MODES[backend][1]
    layer = make(h, "MultiHeadAttention")
    q, k, v, wide = (h.array(x) for x in draw((2, 4, 8), (2, 6, 8), (2, 6, 5), (2, 4, 5)))
    h.call(layer, q, k, v)
    call = lambda m, *a: h.call(m, *a)  # noqa: E731
    wrong = {"queries last dimension (5) must be 8, the size this layer was built for": [wide, k, v],
             "valid_lens must have shape (B,) or (B, Q) = (2,) or (2, 4), got (3,)":
                 [q, k, v, h.array(np.array([1, 2, 3]))]}
    for message, arrays in wrong.items():
        with raises_core_message(message, compiled=True):
            h.run(mode, layer, call, arrays)
    # the values are not known while tracing: lengths out of range pass unseen
    too_long = [q, k, v, h.array(np.array([9, 9]))]
    assert tuple(h.ops.shape(h.run(mode, layer, call, too_long))) == (2, 4, 8)


def test_a_width_unknown_at_build_time_is_refused_with_a_reason(backend: str) -> None:
    h = Harness(backend)
    unknown = getattr(h.hooks, "call_with_unknown_widths", None)
    if unknown is None:
        pytest.skip(f"{backend} knows every input width on a first call (only Keras traces with "
                    "unknown widths)")
    layer = make(h, "MultiHeadAttention")
    x = h.array(np.ones((1, 2, 4), np.float32))
    with pytest.raises(ValueError) as err:
        unknown(layer, x, x, x)
    assert ("MultiHeadAttention: the last dimension of queries, keys and values must be known to "
            "create the weights") in str(err.value)
    assert_unbuilt(h, layer, "MultiHeadAttention")
    narrow = h.array(np.ones((1, 2, 3), np.float32))
    assert tuple(h.ops.shape(h.call(layer, narrow, narrow, narrow))) == (1, 2, 8)
    # built: the width may now be unknown when traced
    assert tuple(h.ops.shape(unknown(layer, narrow, narrow, narrow))) == (1, 2, 8)


def test_seeded_initial_weights_are_reproducible(backend: str) -> None:
    """The framework's own seeding (NumPy ``seed=``, ``torch.manual_seed``,
    ``keras.utils.set_random_seed``, the Flax params rng, ``mx.random.seed``) fixes them."""
    h = Harness(backend)
    seeded = h.hook("seeded_weights")
    args = [h.array(x) for x in draw((2, 4, 8), (2, 6, 8), (2, 6, 5))]
    cls = getattr(h.module, "MultiHeadAttention")  # noqa: B009
    weights = [seeded(cls, {"num_hiddens": 8, "num_heads": 2}, seed, args) for seed in (3, 3, 4)]
    assert sorted(weights[0]) == ["W_k.kernel", "W_o.kernel", "W_q.kernel", "W_v.kernel"]
    for name, value in weights[0].items():
        np.testing.assert_array_equal(np.asarray(weights[1][name]), np.asarray(value), err_msg=name)
        assert not np.array_equal(np.asarray(weights[2][name]), np.asarray(value)), name


#: What ``weights_from_sizes`` says without the sizes: torch's layer stays lazy, Flax's
#: ``init_weights`` names the first weight it cannot shape.
WITHOUT_SIZES = {"torch": f"MultiHeadAttention: {NOT_BUILT}",
                 "jax": "W_q.kernel has unknown dimensions (?, 8): call the layer first",
                 "nnx": None}  # NNX: a width not given is num_hiddens


def test_weights_before_the_first_call(backend: str) -> None:
    """Layers without input sizes to learn have their (no) weights at once; torch (``q_in=``
    ...) and Flax (``init_weights``) make the others from given sizes, Flax by the core's rule
    from NumPy's generator: the NumPy layer's weights for the same seed."""
    h = Harness(backend)
    for name, config in (("DotProductAttention", {}), ("PositionalEncoding", {"num_hiddens": 4})):
        assert h.make(name, config).get_weights() == {}
    from_sizes = getattr(h.hooks, "weights_from_sizes", None)
    if from_sizes is None:
        pytest.skip(f"{backend} learns input sizes from a call or set_weights only")
    cls, config = getattr(h.module, "MultiHeadAttention"), {"num_hiddens": 8, "num_heads": 2}  # noqa: B009
    if WITHOUT_SIZES[backend] is None:
        assert {n: np.shape(w) for n, w in from_sizes(cls, config, 3, {}).items()} == {
            f"W_{x}.kernel": (8, 8) for x in "qkvo"}
    else:
        with pytest.raises(ValueError) as err:
            from_sizes(cls, config, 3, {})
        assert str(err.value) == WITHOUT_SIZES[backend]
    weights = from_sizes(cls, config, 3, {"q_in": 5, "k_in": 6, "v_in": 7})
    assert {n: np.shape(w) for n, w in weights.items()} == {
        "W_q.kernel": (5, 8), "W_k.kernel": (6, 8), "W_v.kernel": (7, 8), "W_o.kernel": (8, 8)}
    if backend == "jax":
        numpy_layer = Harness("numpy").module.MultiHeadAttention(8, 2, seed=3)
        numpy_layer(*(np.zeros((1, 2, d), np.float32) for d in (5, 6, 7)))
        for name, value in numpy_layer.get_weights().items():
            np.testing.assert_array_equal(weights[name], value, err_msg=name)


def test_a_positional_encoding_holds_no_weights(backend: str) -> None:
    """Its table is a constant: no weight before or after calls, none to train, and ``P`` added
    in every quick mode (the table's values: tests/test_layers.py)."""
    h = Harness(backend)
    layer = h.make("PositionalEncoding", {"num_hiddens": 32, "dropout": 0})
    X = h.array(np.zeros((1, 60, 32), np.float32))
    for mode in MODES[backend] if backend != "torch" else ("eager",):  # compile: Inductor, slow
        out = h.run(mode, layer, lambda m, x: h.call(m, x), [X])
        np.testing.assert_array_equal(h.numpy(out), h.numpy(layer.P)[:, :60])
    assert layer.get_weights() == {}
    assert getattr(h.hooks, "native_shapes", lambda layer: {})(layer) == {}
    if backend != "numpy":
        grads = h.hook("gradients")(layer, [X], {}, np.ones((1, 60, 32)))
        assert set(grads) == {"input.0"}


def test_valid_lens_may_be_a_list(backend: str) -> None:
    h = Harness(backend)
    layer = make(h, "MultiHeadAttention")
    X = h.array(draw((2, 4, 8))[0])
    np.testing.assert_array_equal(h.numpy(h.call(layer, X, X, X, [3, 2])),
                                  h.numpy(h.call(layer, X, X, X, h.array(np.array([3, 2])))))
