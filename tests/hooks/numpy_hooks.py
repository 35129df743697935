"""Test glue for the NumPy backend."""

from __future__ import annotations

from typing import Any

from tests.hooks import eager


def make(cls: Any, config: dict[str, Any], dtype: str) -> Any:
    return cls(**config, seed=0, dtype=dtype)


#: NumPy has one way to run: as it is.
MODES = {"eager": eager}
