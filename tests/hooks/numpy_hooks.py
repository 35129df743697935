"""Test glue for the NumPy backend."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tests.hooks import eager


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


def seeded_weights(cls: Any, config: dict[str, Any], seeds: Sequence[int],
                   args: Sequence[Any]) -> list[dict[str, Any]]:
    """The initial weights of a layer made with ``seed=seed``, after a first call, per seed."""
    weights = []
    for seed in seeds:
        layer = cls(**config, seed=seed)
        layer(*args)
        weights.append(layer.get_weights())
    return weights
