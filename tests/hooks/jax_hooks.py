"""Test glue for the JAX backend: a stateful handle on a functional Flax module.

The cross-backend tests use layers statefully (call, then ``get_weights()``,
``attention_weights``, ...). :class:`FlaxLayer` holds a module and its variables: the first
call initialises them (``PRNGKey(0)``), later calls apply them. Every check and error message
comes from the library (``backends.jax``); the handle only keeps state, and keeps it only when
a call succeeds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import backends.jax as bj
from backends.jax.layers import Layer, flatten

RNGS = {"params": 0, "dropout": 1}


def _rngs() -> dict[str, jax.Array]:
    return {name: jax.random.PRNGKey(seed) for name, seed in RNGS.items()}


class FlaxLayer:
    """A Flax module with its variables and the last call's sown attention weights.

    Args:
        module: An unbound ``flax.linen`` layer of ``backends.jax``.
    """

    def __init__(self, module: Layer) -> None:
        self.module = module
        self.variables: dict[str, Any] | None = None
        self.attention_weights: jax.Array | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.variables is None:
            out, state = self.module.init_with_output(_rngs(), *args, mutable=True, **kwargs)
            variables = {"params": state.get("params", {})}
        else:
            variables = self.variables
            out, state = self.module.apply(variables, *args, rngs=_rngs(),
                                           mutable=["intermediates"], **kwargs)
        self.variables = variables  # only reached when the call succeeded
        sown = state.get("intermediates", {}).get("attention_weights")
        if sown is not None:
            self.attention_weights = sown[-1]
        return out

    def get_weights(self) -> dict[str, np.ndarray]:
        return bj.get_weights(self.variables, layer=self.module)

    def set_weights(self, weights: Mapping[str, Any]) -> None:
        self.variables = bj.set_weights(self.variables, weights, layer=self.module)

    @property
    def P(self) -> jax.Array:
        P: jax.Array = getattr(self.module, "P")  # noqa: B009 - only PositionalEncoding has it
        return P


def make(cls: Any, config: dict[str, Any], dtype: str) -> FlaxLayer:
    """Builds a handle; weights whose shapes the constructor fixes exist at once, as on numpy."""
    layer = FlaxLayer(cls(**config, param_dtype=dtype))
    if all(None not in shape for shape in layer.module.spec().values()):
        layer.variables = bj.init_weights(layer.module, seed=0)
    return layer


#: Handles of modules the tests construct directly (``h.module.MultiHeadAttention(...)``),
#: keyed by id; each entry keeps its module alive so the id is not reused.
_HANDLES: dict[int, tuple[Layer, FlaxLayer]] = {}


def handle(layer: FlaxLayer | Layer) -> FlaxLayer:
    """The stateful handle of a layer: itself, or one kept for a bare Flax module."""
    if isinstance(layer, FlaxLayer):
        return layer
    return _HANDLES.setdefault(id(layer), (layer, FlaxLayer(layer)))[1]


def call(layer: FlaxLayer | Layer, *args: Any, **kwargs: Any) -> Any:
    return handle(layer)(*args, **kwargs)


def attention_weights(layer: FlaxLayer | Layer) -> Any:
    """What the layer's last call sowed into ``'intermediates'``."""
    return handle(layer).attention_weights


def gradients(layer: FlaxLayer | Layer, inputs: list[Any], kwargs: dict[str, Any],
              cotangent: Any) -> dict[str, np.ndarray]:
    """Gradients of ``sum(output * cotangent)`` by ``jax.grad``, keyed ``input.<i>``/``weight.<name>``."""
    wrapper = handle(layer)
    if wrapper.variables is None:
        wrapper(*inputs, **kwargs)
    assert wrapper.variables is not None
    params = wrapper.variables["params"]
    ct = jnp.asarray(np.asarray(cotangent))

    def loss(params: Any, inputs: list[Any]) -> jax.Array:
        out = wrapper.module.apply({"params": params}, *inputs, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        return jnp.sum(out * ct.astype(out.dtype))

    d_params, d_inputs = jax.grad(loss, argnums=(0, 1))(params, [jnp.asarray(x) for x in inputs])
    result = {f"input.{i}": np.asarray(g) for i, g in enumerate(d_inputs)}
    result.update({f"weight.{name}": np.asarray(g) for name, g in flatten(d_params).items()})
    return result
