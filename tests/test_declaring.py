"""A layer the library does not ship, declared once, runs natively on every backend.

:mod:`attention_core.declarations` promises that a new layer costs one declaration, and a
backend one line: ``class Name(Layer, Declaration): ...`` with that backend's generic
``Layer``. This file holds the proof. ``TanhDense`` is declared here, outside the library, and
given to :func:`~attention_core.declarations.register`. Each backend's native class is then that
one line, and nothing else in ``backends/`` knows the layer. Yet the layer has the constructor
signature and argument errors of the library's own layers, learns its input width on the first
call, draws its initial weights by the declared rule, and has gradients and the framework's own
weights file. Expected values come from a float64 NumPy computation over the layer's weights.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

import attention_core as ac
from attention_core import checks
from attention_core import declarations as D
from attention_core import weights as W
from attention_core.ops import Array, Ops
from conftest import test_backends
from tests.harness import AUTODIFF, QUICK_COMPILED_MODES, TOLERANCE, Harness, max_diff

#: These tests run on the columns too (conftest.py; tests.harness.COLUMNS).
COLUMN_TESTS = True

TOL = TOLERANCE["float32"]


@D.register
@dataclass(eq=False)
class TanhDense(D.Declaration):
    """``tanh(dropout(X) W + b)``: one dense layer with a tanh, ``(B, T, d) -> (B, T, n)``.

    Args:
        num_outputs: n, the output width.
        dropout: Dropout rate on the input, in training.
    """

    num_outputs: int
    dropout: float = 0.0
    cast_inputs: ClassVar[tuple[str, ...]] = ("X",)
    sizes: ClassVar[Mapping[str, D.Size]] = {"d_in": D.Size("X", "dense.kernel")}

    def own_weight_shapes(self, **dims: int | None) -> W.Spec:
        n = checks.check_positive_int("num_outputs", self.num_outputs)
        return {"dense.kernel": (dims.get("d_in"), n), "dense.bias": (n,)}

    def check_inputs(self, ops: Ops, **arguments: Any) -> None:
        checks.check_rank(ops, "X", arguments["X"], (3,), "(B, T, d)")

    def compute(self, run: D.Run, X: Array) -> Array:
        if run.dropout:
            X = run.ops.dropout(X, run.dropout)
        return run.ops.tanh(run.ops.matmul(X, run.weights["dense.kernel"]) + run.weights["dense.bias"])


@functools.cache
def native(backend: str) -> type:
    """The backend's class for the layer: the one line a new layer costs a backend."""
    Layer = Harness(backend).layer_base

    class TanhDense(Layer, globals()["TanhDense"]): ...  # type: ignore[misc, valid-type]

    return TanhDense


def reference(x: np.ndarray, weights: Mapping[str, np.ndarray]) -> np.ndarray:
    """``tanh(x W + b)`` in float64."""
    kernel, bias = (np.asarray(weights[n], np.float64) for n in ("dense.kernel", "dense.bias"))
    return np.tanh(np.asarray(x, np.float64) @ kernel + bias)


X = np.random.default_rng(0).standard_normal((2, 4, 5)).astype(np.float32)


def weights_of(layer: Any) -> dict[str, np.ndarray]:
    return {name: np.asarray(w, np.float64) for name, w in layer.get_weights().items()}


def test_the_native_class_has_the_declared_signature(backend: str) -> None:
    """The one-line class takes the declared arguments, then the framework's own, and its
    argument errors are the core's."""
    cls = native(backend)
    params = list(inspect.signature(cls).parameters)
    assert params[:2] == ["num_outputs", "dropout"]
    assert cls.__doc__ == TanhDense.__doc__
    with pytest.raises(ValueError, match="num_outputs must be a positive int, got 0"):
        cls(0)
    with pytest.raises(ValueError, match="dropout must be"):
        cls(3, dropout=1.5)


def test_first_call_learns_the_width_and_matches_float64(backend: str) -> None:
    """Weights of the declared shapes and init rule, made on the first call; output equal to
    the float64 computation over them, eagerly and in the quick compiled modes; another width
    afterwards is refused with the core's message."""
    h = Harness(backend)
    layer = h.make(native(backend), {"num_outputs": 3})
    out = h.numpy(h.call_mode(layer, False, h.array(X)))
    weights = weights_of(layer)
    assert {n: w.shape for n, w in weights.items()} == {"dense.kernel": (5, 3), "dense.bias": (3,)}
    limit = W.init_rule("dense.kernel", (5, 3)).b
    assert 0 < np.abs(weights["dense.kernel"]).max() <= limit
    np.testing.assert_array_equal(weights["dense.bias"], 0.0)
    expected = reference(X, weights)
    assert max_diff(out, expected) <= TOL
    for mode in QUICK_COMPILED_MODES.get(backend, ()):
        compiled = h.run(mode, layer, lambda m, x: m(x), [h.array(X)])
        assert max_diff(h.numpy(compiled), expected) <= TOL, mode
    with pytest.raises(ValueError, match="X"):
        h.call_mode(layer, False, h.array(X[..., :4]))
    assert weights_of(layer)["dense.kernel"].shape == (5, 3)


def test_gradients_match_float64(backend: str) -> None:
    """The framework's autodiff through the declared forward: d/dx and d/dW of
    ``sum(out * cotangent)`` against the float64 formulas."""
    if backend not in AUTODIFF:
        pytest.skip(f"the {backend} backend has no autodiff")
    h = Harness(backend)
    layer = h.make(native(backend), {"num_outputs": 3})
    h.call_mode(layer, False, h.array(X))
    weights = weights_of(layer)
    cot = np.random.default_rng(1).standard_normal((2, 4, 3))
    grads = h.hook("gradients")(layer, [h.array(X)], {}, h.array(cot.astype(np.float32)))
    delta = cot * (1 - reference(X, weights) ** 2)  # through tanh
    expected = {
        "input.0": delta @ weights["dense.kernel"].T,
        "weight.dense.kernel": np.einsum("btd,btn->dn", X.astype(np.float64), delta),
        "weight.dense.bias": delta.sum((0, 1)),
    }
    for name, value in expected.items():
        assert max_diff(np.asarray(grads[name], np.float64), value) <= 4 * TOL, name


def test_dropout_only_in_training_and_the_native_file(backend: str, tmp_path: Path) -> None:
    """Inference calls are deterministic; a training call drops inputs (autodiff backends);
    the framework's own weights file moves the layer to a fresh one."""
    h = Harness(backend)
    layer = h.make(native(backend), {"num_outputs": 3, "dropout": 0.5})
    out = h.numpy(h.call_mode(layer, False, h.array(X)))
    np.testing.assert_array_equal(h.numpy(h.call_mode(layer, False, h.array(X))), out)
    if backend in AUTODIFF:
        assert max_diff(h.numpy(h.call_mode(layer, True, h.array(X))), out) > 0
    fresh, names = h.save_load_native(layer, lambda: native(backend)(3, dropout=0.5),
                                      [h.array(X)], tmp_path)
    assert sorted(names) == ["dense.bias", "dense.kernel"]
    np.testing.assert_array_equal(h.numpy(h.call_mode(fresh, False, h.array(X))), out)


def test_every_declared_layer_is_exported(backend: str) -> None:
    """Each backend exports one native class for each declaration of the core, a subclass of
    its generic ``Layer`` and of the declaration."""
    h = Harness(backend)
    Layer = h.layer_base
    core = D.library_layers()
    assert len(core) == len(ac.LAYER_NAMES) == 15 and set(core) == set(ac.LAYER_NAMES)
    assert set(core) <= set(h.module.__all__)
    for name, declaration in core.items():
        assert issubclass(getattr(h.module, name), Layer), name
        assert issubclass(getattr(h.module, name), declaration), name


def test_a_declaration_needs_a_new_name() -> None:
    """``register`` refuses a second declaration under a name taken, and changes nothing."""
    clash = type("MultiHeadAttention", (D.Declaration,), {"__module__": __name__})
    before = dict(D.LAYERS)
    with pytest.raises(ValueError, match="declaration must have a new name, got "
                                         "'MultiHeadAttention', which attention_core"):
        D.register(clash)
    assert before == D.LAYERS
    assert D.register(TanhDense) is TanhDense  # the same one again: nothing to do


@pytest.mark.skipif("numpy" not in test_backends(), reason="framework-free; runs in the numpy env")
@pytest.mark.parametrize("name", sorted(D.LAYERS))
def test_the_quick_binding_binds_as_inspect_does(name: str) -> None:
    """Every call binds its arguments (``bind_call``) without :mod:`inspect` where it can: the
    result equals ``Signature.bind`` with defaults applied, names in order, for every mix of
    positional and keyword arguments; a call ``inspect`` refuses gets None (and then
    ``inspect``'s own TypeError)."""
    signature = D.LAYERS[name].call_signature()
    binding = D.Binding.of(signature)
    assert binding is not None
    names = list(signature.parameters)
    for n_args in range(len(binding.positional) + 2):
        args = tuple(object() for _ in range(n_args))
        for mask in range(2 ** len(names) + 1):
            keywords = {x: object() for i, x in enumerate(names) if mask >> i & 1}
            if mask == 2 ** len(names):
                keywords = {"no_such_argument": object()}
            try:
                bound = signature.bind(*args, **keywords)
            except TypeError:
                assert binding.bind(args, keywords) is None, (n_args, keywords)
                continue
            bound.apply_defaults()
            quick = binding.bind(args, keywords)
            assert quick is not None
            assert list(quick.items()) == list(bound.arguments.items())
