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
import threading
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


#: Each Keras backend's ops: (module, class); the module's ``OPS`` is its shared instance.
_OPS = {
    "tensorflow": ("backends.tensorflow.ops", "TensorFlowOps"),
    "jax": ("backends.jax.ops", "JaxOps"),
    "torch": ("backends.torch.ops", "TorchOps"),
}


def _module() -> Any:
    """The ops module of Keras' current backend.

    Raises:
        ImportError: Keras runs on a backend other than TensorFlow, JAX and torch.
    """
    backend = keras.backend.backend()
    if backend not in _OPS:
        raise ImportError(f"backends.keras runs on Keras' {', '.join(KERAS_BACKENDS)} backends; "
                          f"Keras is set to {backend!r} (KERAS_BACKEND)")
    return importlib.import_module(_OPS[backend][0])


#: The ops class made for Keras' backend (one per process), and the lock it is made under.
_made: list[type] = []
_making = threading.Lock()


def ops_class() -> type:
    """The ops class for Keras' current backend, made once per process.

    Threads that make their first layers at the same moment get this one class too.
    TensorFlow's ops draw from a Keras ``SeedGenerator`` themselves; JAX's and torch's take
    :class:`KerasDropout` first.

    Raises:
        ImportError: Keras runs on a backend other than TensorFlow, JAX and torch.
    """
    if not _made:
        with _making:
            if not _made:
                _made.append(_new_ops_class())
    return _made[0]


def _new_ops_class() -> type:
    base: type = getattr(_module(), _OPS[keras.backend.backend()][1])
    if keras.backend.backend() == "tensorflow":
        return base
    return type(f"Keras{base.__name__}", (KerasDropout, base),
                {"__doc__": f"{base.__name__}, dropout from the layer's Keras ``SeedGenerator``."})


def keras_ops(seed_generator: keras.random.SeedGenerator | None = None) -> Ops:
    """The ops for Keras' current backend, drawing dropout from ``seed_generator``."""
    ops: Ops = ops_class()(seed_generator)
    return ops


@functools.cache
def backend_ops() -> Ops:
    """The shared ops instance of the framework Keras runs on (its adapter's ``OPS``).

    For conversions: NumPy data to a tensor, a tensor to NumPy.
    """
    ops: Ops = _module().OPS
    return ops
