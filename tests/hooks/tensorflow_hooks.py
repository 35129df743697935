"""Test glue for the TensorFlow/Keras backend."""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf


def make(cls: Any, config: dict[str, Any], dtype: str) -> Any:
    return cls(**config, dtype=dtype)


def gradients(layer: Any, inputs: list[Any], kwargs: dict[str, Any], cotangent: Any) -> dict[str, np.ndarray]:
    """Gradients of ``sum(layer(*inputs, **kwargs) * cotangent)`` by ``tf.GradientTape``."""
    xs = [tf.convert_to_tensor(x) for x in inputs]
    with tf.GradientTape() as tape:
        tape.watch(xs)
        out = layer(*xs, **kwargs)
        loss = tf.reduce_sum(out * tf.cast(cotangent, out.dtype))
    variables = layer.canonical_variables
    grads = tape.gradient(loss, [*xs, *variables.values()])
    names = [f"input.{i}" for i in range(len(xs))] + [f"weight.{n}" for n in variables]
    return {name: np.asarray(g) for name, g in zip(names, grads, strict=True)}
