"""Per-backend test glue, ``tests/hooks/<backend>_hooks.py`` (see tests/harness.py)."""

from __future__ import annotations

import ast
from collections.abc import Callable, Sequence
from typing import Any


def eager(layer: Any, fn: Callable[..., Any], arrays: Sequence[Any]) -> Any:
    """The ``eager`` mode of every backend: ``fn(layer, *arrays)``, as it is."""
    return fn(layer, *arrays)


# --- native weights, names, config ---


def repr_arguments(text: str, cls_name: str) -> dict[str, Any]:
    """The arguments of a repr ``Name(a=1, b='x')``, in their order (values by literal_eval).

    Fails unless the text is one call of ``cls_name`` with keyword arguments only.
    """
    call = ast.parse(text, mode="eval").body
    assert isinstance(call, ast.Call) and isinstance(call.func, ast.Name), text
    assert call.func.id == cls_name and not call.args, text
    return {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords if kw.arg is not None}
