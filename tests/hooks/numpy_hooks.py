"""Test glue for the NumPy backend."""

from __future__ import annotations

from typing import Any


def make(cls: Any, config: dict[str, Any], dtype: str) -> Any:
    return cls(**config, seed=0, dtype=dtype)
