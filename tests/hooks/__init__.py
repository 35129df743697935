"""Per-backend test glue, ``tests/hooks/<backend>_hooks.py`` (see tests/harness.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def eager(layer: Any, fn: Callable[..., Any], arrays: Sequence[Any]) -> Any:
    """The ``eager`` mode of every backend: ``fn(layer, *arrays)``, as it is."""
    return fn(layer, *arrays)
