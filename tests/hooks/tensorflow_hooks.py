"""Test glue for the TensorFlow/Keras backend: Keras' shared hooks (tests/hooks/keras_hooks.py),
``tf.GradientTape`` and ``tf.function``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tests.hooks import eager
from tests.hooks.keras_hooks import call_mode as call_mode
from tests.hooks.keras_hooks import config as config
from tests.hooks.keras_hooks import make as make
from tests.hooks.keras_hooks import native_shapes as native_shapes
from tests.hooks.keras_hooks import native_weights as native_weights
from tests.hooks.keras_hooks import rebuild as rebuild
from tests.hooks.keras_hooks import save_load_native as save_load_native
from tests.hooks.keras_hooks import seeded_weights as seeded_weights
from tests.hooks.keras_hooks import set_native_weights as set_native_weights


def forward_and_gradients(layer: Any, forward: Callable[..., dict[str, Any]], inputs: Sequence[Any],
                          cotangent: np.ndarray) -> tuple[dict[str, Any], dict[str, Any]]:
    """``forward(layer, *inputs)`` (a dict with ``"out"``) and, by ``tf.GradientTape``, the
    gradients of ``sum(out * cotangent)`` by floating input (``input.<i>``; integer inputs
    such as token ids have none) and weight (``weight.<name>``). Works eagerly and inside
    ``tf.function``. ``result`` is returned as the forward gave it (the encoder's kept
    weights are a list, one tensor per block)."""
    xs = [tf.convert_to_tensor(x) for x in inputs]
    floating = {f"input.{i}": x for i, x in enumerate(xs) if x.dtype.is_floating}
    with tf.GradientTape() as tape:
        tape.watch(list(floating.values()))
        result = forward(layer, *xs)
        out = result["out"]
        loss = tf.reduce_sum(out * tf.cast(np.asarray(cotangent), out.dtype))
    variables = layer.canonical_variables  # after the call: the first one builds the layer
    grads = tape.gradient(loss, [*floating.values(), *variables.values()])
    names = [*floating, *(f"weight.{n}" for n in variables)]
    # an embedding table's gradient (by tf.gather) comes as IndexedSlices: made dense here
    dense = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
    return result, dict(zip(names, dense, strict=True))


def gradients(layer: Any, inputs: list[Any], kwargs: dict[str, Any], cotangent: Any) -> dict[str, np.ndarray]:
    """Gradients of ``sum(layer(*inputs, **kwargs) * cotangent)`` by ``tf.GradientTape``."""
    _, grads = forward_and_gradients(layer, lambda m, *xs: {"out": m(*xs, **kwargs)}, inputs,
                                     cotangent)
    return {name: np.asarray(g) for name, g in grads.items()}


def xla(layer: Any, fn: Callable[..., Any], arrays: Sequence[Any]) -> Any:
    """``fn(layer, *arrays)`` inside ``tf.function(jit_compile=True)``, the arrays (inputs,
    lengths, masks) as the function's arguments: one XLA program, gradients included."""
    return tf.function(lambda *a: fn(layer, *a), jit_compile=True)(*arrays)


MODES = {"eager": eager, "xla": xla}


def sgd_step(layer: Any, args: Sequence[Any], kwargs: dict[str, Any], target: np.ndarray,
             lr: float) -> None:
    with tf.GradientTape() as tape:
        out = layer(*args, **kwargs)
        loss = tf.reduce_mean((out - tf.cast(target, out.dtype)) ** 2)
    grads = tape.gradient(loss, layer.trainable_variables)
    keras.optimizers.SGD(lr).apply_gradients(zip(grads, layer.trainable_variables, strict=True))


# --- building (lazy sizes) ---


def first_call_compiled(layer: Any, *args: Any, **kwargs: Any) -> Any:
    """The layer's first call inside ``tf.function``, the batch size unknown when traced."""
    tensors = [tf.convert_to_tensor(x) for x in args]
    signature = [tf.TensorSpec([None, *x.shape[1:]], x.dtype) for x in tensors]
    return tf.function(lambda *a: layer(*a, **kwargs), input_signature=signature)(*tensors)


def call_with_unknown_widths(layer: Any, *args: Any) -> Any:
    """The layer called inside ``tf.function`` with every dimension unknown, widths included."""
    tensors = [tf.convert_to_tensor(x) for x in args]
    signature = [tf.TensorSpec([None] * len(x.shape), x.dtype) for x in tensors]
    return tf.function(lambda *a: layer(*a), input_signature=signature)(*tensors)


# --- compiled modes ---


def compiled_function(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A plain function as one XLA program: ``tf.function(jit_compile=True)``."""
    return tf.function(fn, jit_compile=True)


def loop_program(fn: Callable[..., Any], arrays: Sequence[Any]) -> tuple[bool, int]:
    """Whether the graph ``tf.function`` traces for ``fn(*arrays)`` holds a ``While`` op, and
    its number of ops (the loop bodies are functions of their own, counted once)."""
    graph = tf.function(fn, autograph=False).get_concrete_function(*arrays).graph
    types = [op.type for op in graph.get_operations()]
    return bool({"While", "StatelessWhile"} & set(types)), len(types)


def dropout_program(fn: Callable[[Any], Any], seed: int) -> Callable[[], Any]:
    """``fn(ops)`` in a ``tf.function``, ``ops`` drawing dropout from a Keras ``SeedGenerator``
    seeded by ``seed``, whose state each call advances."""
    from backends.tensorflow.ops import TensorFlowOps

    ops = TensorFlowOps(keras.random.SeedGenerator(seed))
    return tf.function(lambda: fn(ops))


def unknown_length_function(fn: Callable[[Any], Any]) -> tuple[Callable[[Any], Any], Callable[[], int]]:
    """``fn`` of ``(B, T)`` int32 token ids as one ``tf.function`` of unknown batch and length,
    and the number of times it has been traced."""
    compiled = tf.function(fn, input_signature=[tf.TensorSpec((None, None), tf.int32)])
    return compiled, compiled.experimental_get_tracing_count


# --- tests/test_tensorflow.py moved into shared tests (k2) ---


def unknown_shape_function(fn: Callable[..., Any], arrays: Sequence[Any], widths: int,
                           jit_compile: bool) -> tuple[Callable[..., Any], Callable[[], int]]:
    """``fn`` as one ``tf.function`` (XLA if ``jit_compile``) whose signature leaves every
    dimension of ``arrays`` unknown but the last of the first ``widths`` (the input widths a
    layer is built from), and the number of times it has been traced."""
    specs = []
    for i, x in enumerate(map(tf.convert_to_tensor, arrays)):
        shape: list[int | None] = [None] * x.shape.rank
        if i < widths:
            shape[-1] = x.shape[-1]
        specs.append(tf.TensorSpec(shape, x.dtype))
    compiled = tf.function(fn, input_signature=specs, jit_compile=jit_compile)
    return compiled, compiled.experimental_get_tracing_count


def graph_gradients(fn: Callable[..., Any], arrays: Sequence[Any], cotangent: np.ndarray,
                    traced: bool) -> list[np.ndarray]:
    """The gradients of ``sum(fn(*arrays) * cotangent)`` by each array, by ``tf.GradientTape``:
    eagerly, or in one ``tf.function`` if ``traced`` (autograph off: the only loops are the
    ops' own ``tf.while_loop``)."""
    def grads(*xs: Any) -> list[Any]:
        with tf.GradientTape() as tape:
            tape.watch(xs)
            loss = tf.reduce_sum(fn(*xs) * tf.constant(cotangent))
        return list(tape.gradient(loss, list(xs)))

    run = tf.function(grads, autograph=False) if traced else grads
    return [np.asarray(g) for g in run(*map(tf.convert_to_tensor, arrays))]
