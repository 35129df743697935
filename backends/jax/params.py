"""The canonical weight layout as JAX params, shared by the linen and NNX modules.

Canonical names (``W_q.kernel``, ``blks.0.attention.W_o.kernel``) are params paths joined with
dots: :func:`nest` and :func:`flatten` turn one into the other. Initial values follow
:func:`attention_core.weights.init_rule`, drawn by :data:`SAMPLERS` with ``jax.random``; a
layer's fixed tables (the sinusoidal ``P``) come from :func:`constants`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from attention_core import declarations as D
from attention_core import weights as W
from attention_core.ops import Array


def nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    """Canonical names -> nested dicts: ``{"W_q.kernel": a}`` -> ``{"W_q": {"kernel": a}}``."""
    tree: dict[str, Any] = {}
    for name, value in flat.items():
        *path, leaf = name.split(".")
        node = tree
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


#: Nested dicts -> canonical names, the inverse of :func:`nest` (one implementation, in the core).
flatten = W.flatten_tree

#: The kinds of :class:`attention_core.weights.InitRule`, drawn with ``jax.random``:
#: ``SAMPLERS[rule.kind](key, rule, shape, dtype)``.
SAMPLERS: dict[str, Callable[[Array, W.InitRule, tuple[int, ...], DTypeLike], Array]] = {
    "uniform": lambda key, rule, shape, dtype: jax.random.uniform(key, shape, dtype, rule.a, rule.b),
    "normal": lambda key, rule, shape, dtype: rule.a + rule.b * jax.random.normal(key, shape, dtype),
    "constant": lambda key, rule, shape, dtype: jnp.full(shape, rule.a, dtype),
}


@functools.lru_cache(maxsize=32)
def constants(layer: str, arguments: tuple[Any, ...]) -> dict[str, Any]:
    """A declared layer's fixed tables in float64, made once per arguments (``(name, value)``s).

    The tables are read-only NumPy arrays (shared between calls).
    """
    tables = D.LAYERS[layer](**dict(arguments)).constants("float64")
    for table in tables.values():
        table.flags.writeable = False
    return tables
