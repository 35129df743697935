"""The Nadaraya-Watson example in JAX/Flax: the width fitted with ``jax.value_and_grad`` and optax.

Run from the repository root: ``python -m examples.nadaraya_watson_jax``. The data and the loss
are those of :mod:`examples.nadaraya_watson`; every step is one ``jax.jit``-compiled function.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax  # type: ignore[import-untyped]

from backends.jax import NadarayaWatson, get_weights, set_weights
from examples import nadaraya_watson as example

Params = Any


def fit_nadaraya_watson(
    data: example.RegressionData | None = None, epochs: int = 10, lr: float = 2.0, w0: float = 1.0
) -> tuple[Params, list[float]]:
    """Fits ``w`` as :mod:`examples.nadaraya_watson` describes, by ``optax.sgd``.

    Returns the variables ``{"params": {"w": ...}}`` in place of a layer.
    """
    data = data or example.nadaraya_watson_data()
    queries, keys, values, targets = map(jnp.asarray, example.training_arrays(data))
    layer = NadarayaWatson(parametric=True)
    variables = set_weights(None, {"w": np.array([w0], np.float32)}, layer=layer)
    optimizer = optax.sgd(lr)

    def loss_fn(variables: Params) -> jax.Array:
        predicted = cast(jax.Array, layer.apply(variables, queries, keys, values))
        return jnp.mean((predicted[:, 0] - targets) ** 2) / 2

    @jax.jit
    def step(variables: Params, opt_state: Any) -> tuple[Params, Any, jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(variables)
        updates, opt_state = optimizer.update(grads, opt_state)
        return optax.apply_updates(variables, updates), opt_state, loss

    opt_state = optimizer.init(variables)
    losses = []
    for _ in range(epochs):
        variables, opt_state, loss = step(variables, opt_state)
        losses.append(float(loss))
    return variables, losses


def predict_nadaraya_watson(variables: Params, data: example.RegressionData) -> np.ndarray:
    """The example's predictions at the test inputs (see :mod:`examples.nadaraya_watson`)."""
    layer = NadarayaWatson(parametric=True)
    return np.asarray(layer.apply(variables, data.x_test, data.x_train, data.y_train))


def main(argv: Sequence[str] | None = None) -> int:
    """Fits the width and prints how it went."""
    example.arguments(argv, "JAX/Flax")
    print(example.report("JAX/Flax", fit_nadaraya_watson, predict_nadaraya_watson,
                         lambda variables: float(get_weights(variables)["w"][0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
