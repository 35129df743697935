"""The ops Keras layers compute with: those of the framework Keras runs on.

Keras 3 runs on TensorFlow, JAX or torch (``KERAS_BACKEND``). Its layers hold variables whose
values are that framework's own arrays, so the core runs on the matching backend's ops
(:class:`~backends.tensorflow.ops.TensorFlowOps`, :class:`~backends.jax.ops.JaxOps`,
:class:`~backends.torch.ops.TorchOps`); only dropout changes: it draws from the layer's Keras
``SeedGenerator`` (``keras.random.dropout``), so masks follow ``keras.utils.set_random_seed``,
and Keras' compiled steps (``jit_compile``) thread the generator's state as they do for
Keras' own layers.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import keras

from attention_core.ops import Ops

#: The Keras backends whose arrays the core computes on.
KERAS_BACKENDS = ("tensorflow", "jax", "torch")


class KerasDropout:
    """Dropout from a Keras ``SeedGenerator`` (a mixin before a backend's ops class).

    Args:
        seed_generator: The layer's generator; None for ops that never drop (an error if
            they are asked to).
    """

    def __init__(self, seed_generator: keras.random.SeedGenerator | None = None) -> None:
        super().__init__()
        self.seed_generator = seed_generator

    def dropout(self, x: Any, rate: float) -> Any:
        if self.seed_generator is None:
            raise ValueError("dropout in a Keras layer needs the layer's SeedGenerator; these "
                             "ops were made without one")
        return keras.random.dropout(x, rate, seed=self.seed_generator)


@functools.cache
def ops_class() -> type:
    """The ops class for Keras' current backend (made once per process).

    Raises:
        ImportError: Keras runs on a backend other than TensorFlow, JAX and torch.
    """
    backend = keras.backend.backend()
    if backend == "tensorflow":
        from backends.tensorflow.ops import TensorFlowOps

        return TensorFlowOps  # it draws from a Keras SeedGenerator itself
    if backend == "jax":
        from backends.jax.ops import JaxOps

        class KerasJaxOps(KerasDropout, JaxOps):
            """JAX arrays, dropout from the layer's Keras ``SeedGenerator``."""

        return KerasJaxOps
    if backend == "torch":
        from backends.torch.ops import TorchOps

        class KerasTorchOps(KerasDropout, TorchOps):
            """torch tensors, dropout from the layer's Keras ``SeedGenerator``."""

        return KerasTorchOps
    raise ImportError(f"backends.keras runs on Keras' {', '.join(KERAS_BACKENDS)} backends; "
                      f"Keras is set to {backend!r} (KERAS_BACKEND)")


def keras_ops(seed_generator: keras.random.SeedGenerator | None = None) -> Ops:
    """The ops for Keras' current backend, drawing dropout from ``seed_generator``."""
    ops: Ops = ops_class()(seed_generator)
    return ops


@functools.cache
def backend_ops() -> Ops:
    """The shared ops instance of the framework Keras runs on (its adapter's ``OPS``).

    For conversions: NumPy data to a tensor, a tensor to NumPy.
    """
    module = {"tensorflow": "backends.tensorflow.ops", "jax": "backends.jax.ops",
              "torch": "backends.torch.ops"}.get(keras.backend.backend())
    if module is None:
        ops_class()  # raises the ImportError
    ops: Ops = importlib.import_module(str(module)).OPS
    return ops
