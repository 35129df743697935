"""The JAX implementation of the ops protocol, over ``jax.numpy``.

Every method is traceable: the core runs unchanged under ``jax.jit``, ``jax.grad`` and
``jax.vmap``. Importing this module does not touch JAX's configuration (64-bit mode stays as
the user set it).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


class JaxOps:
    """``jax.Array`` primitives; dropout draws from the PRNG key the instance is bound to.

    Args:
        rng: A JAX PRNG key (``jax.random.key(0)`` or ``jax.random.PRNGKey(0)``) for dropout.
            The n-th dropout call on this instance uses ``jax.random.fold_in(rng, n)``, so one
            instance gives different masks to the different dropouts of one forward pass, and
            the same key gives the same masks again. Without a key, dropout raises.

    Example:
        ``ac.dot_product_attention(q, k, v, dropout=0.1, ops=JaxOps(rng=jax.random.key(0)))``
    """

    name = "jax"

    def __init__(self, rng: jax.Array | None = None) -> None:
        self.rng = rng
        self._draws = 0

    def from_numpy(self, x: np.ndarray, like: Any = None) -> jax.Array:
        x = np.asarray(x)
        return jnp.asarray(x, dtype=like.dtype if like is not None and x.dtype.kind == "f" else None)

    def to_numpy(self, x: Any) -> np.ndarray:
        return np.asarray(x)

    def concrete(self, x: Any) -> np.ndarray | None:
        return None if isinstance(x, jax.core.Tracer) else np.asarray(x)

    def shape(self, x: Any) -> tuple[int, ...]:
        return tuple(jnp.shape(x))

    def dtype_name(self, x: Any) -> str:
        return str(np.dtype(x.dtype).name)

    def astype(self, x: Any, dtype: str) -> jax.Array:
        return jnp.asarray(x).astype(dtype)

    def exp(self, x: jax.Array) -> jax.Array:
        return jnp.exp(x)

    def tanh(self, x: jax.Array) -> jax.Array:
        return jnp.tanh(x)

    def sqrt(self, x: jax.Array) -> jax.Array:
        return jnp.sqrt(x)

    def relu(self, x: jax.Array) -> jax.Array:
        return jax.nn.relu(x)

    def where(self, cond: Any, x: jax.Array, y: Any) -> jax.Array:
        return jnp.where(cond, x, jnp.asarray(y, dtype=x.dtype))

    def logical_and(self, a: Any, b: Any) -> jax.Array:
        return jnp.logical_and(a, b)

    def maximum(self, a: jax.Array, b: jax.Array) -> jax.Array:
        return jnp.maximum(a, b)

    def max(self, x: jax.Array, axis: int) -> jax.Array:
        return jnp.max(x, axis=axis, keepdims=True)

    def sum(self, x: jax.Array, axis: int) -> jax.Array:
        return jnp.sum(x, axis=axis, keepdims=True)

    def mean(self, x: jax.Array, axis: int) -> jax.Array:
        return jnp.mean(x, axis=axis, keepdims=True)

    def matmul(self, a: jax.Array, b: jax.Array) -> jax.Array:
        return jnp.matmul(a, b)

    def reshape(self, x: jax.Array, shape: tuple[Any, ...]) -> jax.Array:
        return jnp.reshape(x, shape)

    def transpose(self, x: jax.Array, axes: tuple[int, ...]) -> jax.Array:
        return jnp.transpose(x, axes)

    def expand_dims(self, x: Any, axis: int) -> jax.Array:
        return jnp.expand_dims(x, axis)

    def slice(self, x: jax.Array, axis: int, start: Any, size: int) -> jax.Array:
        return jax.lax.dynamic_slice_in_dim(x, start, size, axis)

    def concatenate(self, xs: list[jax.Array], axis: int) -> jax.Array:
        return jnp.concatenate(xs, axis)

    def arange(self, n: Any) -> jax.Array:
        return jnp.arange(n, dtype=jnp.int32)

    def dropout(self, x: jax.Array, rate: float) -> jax.Array:
        if self.rng is None:
            raise ValueError(
                "dropout on JAX arrays needs a PRNG key: pass ops=JaxOps(rng=jax.random.key(0)) "
                "to the functional API; Flax layers draw it from the 'dropout' rng when called "
                "with training=True"
            )
        key = jax.random.fold_in(self.rng, self._draws)
        self._draws += 1
        keep = jax.random.bernoulli(key, 1.0 - rate, jnp.shape(x))
        return jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros((), x.dtype))


#: The default JAX ops (used by the functional API for JAX arrays); it has no key, so dropout
#: through it raises: bind a key with ``JaxOps(rng=key)``.
OPS = JaxOps()
