"""The active backend's layer classes: ``attention_core.layers.MultiHeadAttention`` etc.

Each access looks up the backend active at that moment (see :func:`attention_core.backend`).
"""

from __future__ import annotations

from typing import Any

from attention_core.registry import backend, load


def __getattr__(name: str) -> Any:
    from attention_core import LAYER_NAMES

    if name not in LAYER_NAMES:
        raise AttributeError(f"module 'attention_core.layers' has no attribute {name!r}")
    return getattr(load(backend()), name)
