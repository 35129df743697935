"""Test glue for ``backends.keras`` under ``KERAS_BACKEND=jax``: Keras' shared hooks
(tests/hooks/keras_hooks.py), and gradients and ``jax.jit`` by Keras' stateless calls (the
variables' values given by a ``keras.StatelessScope``, as Keras' own JAX trainer does)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import keras
import numpy as np

from tests.hooks import eager
from tests.hooks.keras_hooks import call_mode as call_mode
from tests.hooks.keras_hooks import config as config
from tests.hooks.keras_hooks import first_call_compiled as first_call_compiled
from tests.hooks.keras_hooks import make as make
from tests.hooks.keras_hooks import native_shapes as native_shapes
from tests.hooks.keras_hooks import native_weights as native_weights
from tests.hooks.keras_hooks import rebuild as rebuild
from tests.hooks.keras_hooks import save_load_native as save_load_native
from tests.hooks.keras_hooks import seeded_weights as seeded_weights
from tests.hooks.keras_hooks import set_native_weights as set_native_weights

#: JAX sows nothing: the Keras layers keep their attention weights as on every Keras backend.
SOWS_WEIGHTS = False


def _stateless(layer: Any, values: Sequence[Any]) -> keras.StatelessScope:
    """A scope in which the layer's variables (``layer.variables``, in order) read ``values``."""
    return keras.StatelessScope(state_mapping=list(zip(layer.variables, values, strict=True)))


def forward_and_gradients(layer: Any, forward: Callable[..., dict[str, Any]], inputs: Sequence[Any],
                          cotangent: np.ndarray) -> tuple[dict[str, Any], dict[str, Any]]:
    """``forward(layer, *inputs)`` (a dict with ``"out"``) and, by ``jax.value_and_grad`` over a
    stateless call, the gradients of ``sum(out * cotangent)`` by floating input (``input.<i>``)
    and weight (``weight.<name>``). Works eagerly and under ``jax.jit``."""
    xs = [jnp.asarray(x) for x in inputs]
    if not layer.built:
        forward(layer, *xs)
    floating = [i for i, x in enumerate(xs) if jnp.issubdtype(x.dtype, jnp.inexact)]
    variables = list(layer.variables)
    canonical = layer.canonical_variables
    position = {id(v): i for i, v in enumerate(variables)}  # not index(): == is elementwise
    trained = [position[id(v)] for v in canonical.values()]
    ct = jnp.asarray(np.asarray(cotangent))

    def loss(weights: list[Any], moving: list[Any]) -> tuple[jax.Array, dict[str, Any]]:
        values = [v.value for v in variables]
        for i, w in zip(trained, weights, strict=True):
            values[i] = w
        args = list(xs)
        for i, x in zip(floating, moving, strict=True):
            args[i] = x
        with _stateless(layer, values):
            result = forward(layer, *args)
        out = result["out"]
        return jnp.sum(out * ct.astype(out.dtype)), result

    (_, result), (d_weights, d_inputs) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
        [v.value for v in canonical.values()], [xs[i] for i in floating])
    layer.attention_weights = result.get("attention_attr")  # not what the trace saw
    grads = {f"input.{i}": g for i, g in zip(floating, d_inputs, strict=True)}
    grads.update({f"weight.{name}": g for name, g in zip(canonical, d_weights, strict=True)})
    return result, grads


def gradients(layer: Any, inputs: list[Any], kwargs: dict[str, Any], cotangent: Any) -> dict[str, np.ndarray]:
    """Gradients of ``sum(layer(*inputs, **kwargs) * cotangent)`` (see :func:`forward_and_gradients`)."""
    def forward(m: Any, *xs: Any) -> dict[str, Any]:
        out = m(*xs, **kwargs)
        return {"out": out[0] if isinstance(out, tuple) else out}

    _, grads = forward_and_gradients(layer, forward, inputs, cotangent)
    return {name: np.asarray(g) for name, g in grads.items()}


def jit(layer: Any, fn: Callable[..., Any], arrays: Sequence[Any]) -> Any:
    """``fn(layer, *arrays)`` under ``jax.jit``, the layer's variables and the arrays as traced
    arguments: one XLA program, gradients included."""
    variables = list(layer.variables)

    def traced(values: list[Any], *arrays: Any) -> Any:
        with _stateless(layer, values):
            return fn(layer, *arrays)

    try:
        return jax.jit(traced)([v.value for v in variables], *arrays)
    finally:  # nothing traced may stay on the layer
        layer.attention_weights = None


MODES = {"eager": eager, "jit": jit}


def sgd_step(layer: Any, args: Sequence[Any], kwargs: dict[str, Any], target: np.ndarray,
             lr: float) -> None:
    """``w - lr * grad`` for every trainable variable, the gradient by a stateless call."""
    if not layer.built:
        layer(*args, **kwargs)
    trainable = list(layer.trainable_variables)

    def loss(values: list[Any]) -> jax.Array:
        with keras.StatelessScope(state_mapping=list(zip(trainable, values, strict=True))):
            out = layer(*args, **kwargs)
        return jnp.mean((out - jnp.asarray(target, out.dtype)) ** 2)

    grads = jax.grad(loss)([v.value for v in trainable])
    for variable, grad in zip(trainable, grads, strict=True):
        variable.assign(variable.value - lr * grad)
