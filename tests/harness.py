"""What the cross-backend tests need to know about a backend, in one place.

Tolerances per dtype live here and nowhere else. Backend-specific test glue lives in
``tests/hooks/<backend>_hooks.py`` (optional), which may define:

* ``make(cls, config, dtype) -> layer``: build a layer computing in ``dtype`` (a NumPy name);
* ``call(layer, *args, **kwargs)``: call a layer (default: ``layer(*args, **kwargs)``);
* ``attention_weights(layer)``: the weights kept by the layer's last call
  (default: ``layer.attention_weights``);
* ``gradients(layer, inputs, kwargs, cotangent) -> dict``: gradients of
  ``sum(output * cotangent)`` with respect to each input (``"input.<i>"``, by position) and
  each weight (``"weight.<canonical name>"``), as NumPy arrays.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import numpy as np

from attention_core import registry

#: Largest allowed max |difference| from the float64 reference, per compute dtype.
TOLERANCE = {"float64": 1e-10, "float32": 1e-5, "float16": 1e-2, "bfloat16": 5e-2}

#: Compute dtypes each backend is tested in against the reference files.
DTYPES = {
    "numpy": ("float32", "float64"),
    "torch": ("float32", "float64"),
    "tensorflow": ("float32", "float64"),
    "jax": ("float32",),
    "mxnet": ("float32", "float64"),
}


class Harness:
    """Converts arrays, builds layers and calls them on one backend."""

    def __init__(self, name: str) -> None:
        self.name = registry.canonical_name(name)
        self.module = registry.load(self.name)
        self.ops = self.module.OPS
        try:
            self.hooks: Any = importlib.import_module(f"tests.hooks.{self.name}_hooks")
        except ModuleNotFoundError:
            self.hooks = None
        default: Callable[..., Any] = lambda layer, *a, **k: layer(*a, **k)  # noqa: E731
        self._call = getattr(self.hooks, "call", default)

    def array(self, x: Any, dtype: str | None = None) -> Any:
        """A backend array from NumPy data; floating data is cast to ``dtype`` if given."""
        x = np.asarray(x)
        if dtype is not None and x.dtype.kind == "f":
            x = x.astype(dtype)
        return self.ops.from_numpy(x)

    def numpy(self, x: Any) -> np.ndarray:
        return np.asarray(self.ops.to_numpy(x), dtype=np.float64)

    def make(self, layer: str, config: dict[str, Any], dtype: str = "float32") -> Any:
        cls = getattr(self.module, layer)
        if self.hooks is not None and hasattr(self.hooks, "make"):
            return self.hooks.make(cls, config, dtype)
        return cls(**config)

    def call(self, layer: Any, *args: Any, **kwargs: Any) -> Any:
        return self._call(layer, *args, **kwargs)

    def attention_weights(self, layer: Any) -> Any:
        """The attention weights the layer's last call kept."""
        if self.hooks is not None and hasattr(self.hooks, "attention_weights"):
            return self.hooks.attention_weights(layer)
        return layer.attention_weights


def max_diff(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b|, after checking the shapes agree; inf if either has a NaN."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, f"shape {a.shape} != reference shape {b.shape}"
    if np.isnan(a).any() or np.isnan(b).any():
        return float("inf")
    return float(np.max(np.abs(a - b))) if a.size else 0.0
