"""Test glue shared by the Keras columns (``tensorflow``, ``keras-jax``, ``keras-torch``).

The Keras habits that do not depend on the framework Keras runs on: building in a dtype,
``training=``, ``.keras`` files, Keras' variables and configs. Each Keras backend's hooks
module adds its autodiff and compiled modes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import keras
import numpy as np


def make(cls: Any, config: dict[str, Any], dtype: str) -> Any:
    return cls(**config, dtype=dtype)


def call_mode(layer: Any, training: bool, *args: Any, **kwargs: Any) -> Any:
    return layer(*args, training=training, **kwargs)


def save_load_native(layer: Any, make_fresh: Callable[[], Any], args: Sequence[Any],
                     path: Path) -> tuple[Any, list[str]]:
    """A functional model around the layer (one ``keras.Input`` per argument), written to a
    ``.keras`` file and loaded with no ``custom_objects``; returns the loaded model's layer."""
    tensors = [keras.ops.convert_to_tensor(x) for x in args]
    inputs = [keras.Input(tuple(x.shape[1:]), dtype=keras.backend.standardize_dtype(x.dtype))
              for x in tensors]
    model = keras.Model(inputs, layer(*inputs))
    model.save(path / "layer.keras")
    loaded = keras.models.load_model(path / "layer.keras")
    (fresh,) = (m for m in loaded.layers if type(m) is type(layer))
    return fresh, list(fresh.get_weights())


def native_shapes(layer: Any) -> dict[str, tuple[int | None, ...] | None]:
    """The Keras variables by name and shape: none before the layer is built."""
    return {w.name: tuple(w.shape) for w in layer.weights}


def seeded_weights(cls: Any, config: dict[str, Any], seed: int, args: Sequence[Any]) -> dict[str, Any]:
    """The initial weights after ``keras.utils.set_random_seed(seed)`` and a first call."""
    keras.utils.set_random_seed(seed)
    layer = cls(**config)
    layer(*args)
    return dict(layer.get_weights())


def native_weights(layer: Any) -> dict[tuple[str, ...], np.ndarray]:
    """Keras' own list (``keras.layers.Layer.get_weights``, also ``get_weight_list``) by each
    variable's name below the layer (its path starts with the layer's name)."""
    paths = [str(variable.path) for variable in layer.weights]
    assert all(path.startswith(f"{layer.name}/") for path in paths), paths
    values = keras.layers.Layer.get_weights(layer)
    for ours, theirs in zip(layer.get_weight_list(), values, strict=True):
        np.testing.assert_array_equal(ours, theirs)
    return {(variable.name,): value for variable, value in zip(layer.weights, values, strict=True)}


def set_native_weights(layer: Any, values: dict[tuple[str, ...], np.ndarray]) -> None:
    """Keras' list form, in the order of ``layer.weights``."""
    assert [(v.name,) for v in layer.weights] == list(values)
    layer.set_weight_list(list(values.values()))


def config(layer: Any) -> dict[str, Any]:
    config: dict[str, Any] = layer.get_config()
    return config


def rebuild(layer: Any) -> Any:
    """Keras' serialization by registered name (``attention_core>Name``), as ``.keras`` files
    use it: ``from_config`` of the layer's config."""
    serialized = keras.saving.serialize_keras_object(layer)
    assert serialized["registered_name"] == f"attention_core>{type(layer).__name__}"
    return keras.saving.deserialize_keras_object(serialized)


def first_call_compiled(layer: Any, *args: Any, **kwargs: Any) -> Any:
    """The layer's first call inside a symbolic Keras model of unknown batch size."""
    tensors = [keras.ops.convert_to_tensor(x) for x in args]
    inputs = [keras.Input(tuple(x.shape[1:]), dtype=keras.backend.standardize_dtype(x.dtype))
              for x in tensors]
    model = keras.Model(inputs, layer(*inputs, **kwargs))
    return model(tensors)
