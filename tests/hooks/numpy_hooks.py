"""Test glue for the NumPy backend."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tests.hooks import eager, repr_arguments


def make(cls: Any, config: dict[str, Any], dtype: str) -> Any:
    return cls(**config, seed=0, dtype=dtype)


#: NumPy has one way to run: as it is.
MODES = {"eager": eager}


def call_mode(layer: Any, training: bool, *args: Any, **kwargs: Any) -> Any:
    return layer(*args, training=training, **kwargs)


def save_load_native(layer: Any, make_fresh: Callable[[], Any], args: Sequence[Any],
                     path: Path) -> tuple[Any, list[str]]:
    """NumPy's own form of a layer's weights: an ``.npz`` of the canonical mapping."""
    np.savez(path / "weights.npz", **layer.get_weights())
    with np.load(path / "weights.npz") as data:
        names = list(data.files)
        fresh = make_fresh()
        fresh.set_weights({name: data[name] for name in names})
    return fresh, names


# --- building (lazy sizes) ---


def seeded_weights(cls: Any, config: dict[str, Any], seed: int, args: Sequence[Any]) -> dict[str, Any]:
    """The initial weights of a layer made with ``seed=seed``, after a first call."""
    layer = cls(**config, seed=seed)
    layer(*args)
    return dict(layer.get_weights())


# --- native weights, names, config ---


def native_weights(layer: Any) -> dict[tuple[str, ...], np.ndarray]:
    """NumPy holds the canonical mapping itself: its weights by name, none nested."""
    return {(name,): value for name, value in layer.get_weights().items()}


def set_native_weights(layer: Any, values: dict[tuple[str, ...], np.ndarray]) -> None:
    layer.set_weights({".".join(path): value for path, value in values.items()})


def config(layer: Any) -> dict[str, Any]:
    """The arguments the repr shows, ``Name(a=1, ...)``, in order."""
    return repr_arguments(repr(layer), type(layer).__name__)


def rebuild(layer: Any) -> Any:
    return type(layer)(**config(layer))
