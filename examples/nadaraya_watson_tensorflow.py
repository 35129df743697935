"""The Nadaraya-Watson example in Keras 3 (TensorFlow): the width fitted with ``tf.GradientTape``.

Run from the repository root: ``python -m examples.nadaraya_watson_tensorflow``. The data and the
loss are those of :mod:`examples.nadaraya_watson`; the optimiser is ``keras.optimizers.SGD``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import keras
import numpy as np
import tensorflow as tf

from backends.tensorflow import NadarayaWatson
from examples import nadaraya_watson as example


def fit_nadaraya_watson(
    data: example.RegressionData | None = None, epochs: int = 10, lr: float = 2.0, w0: float = 1.0
) -> tuple[NadarayaWatson, list[float]]:
    """Fits ``w`` as :mod:`examples.nadaraya_watson` describes, by ``keras.optimizers.SGD``."""
    data = data or example.nadaraya_watson_data()
    queries, keys, values, targets = map(tf.constant, example.training_arrays(data))
    layer = NadarayaWatson(parametric=True)
    layer.set_weights({"w": np.array([w0], np.float32)})
    optimizer = keras.optimizers.SGD(learning_rate=lr)
    losses = []
    for _ in range(epochs):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((layer(queries, keys, values)[:, 0] - targets) ** 2) / 2
        grads = tape.gradient(loss, layer.trainable_variables)
        optimizer.apply_gradients(zip(grads, layer.trainable_variables, strict=True))
        losses.append(float(loss))
    return layer, losses


def predict_nadaraya_watson(layer: NadarayaWatson, data: example.RegressionData) -> np.ndarray:
    """The example's predictions at the test inputs (see :mod:`examples.nadaraya_watson`)."""
    return np.asarray(layer(data.x_test, data.x_train, data.y_train))


def main(argv: Sequence[str] | None = None) -> int:
    """Fits the width and prints how it went."""
    example.arguments(argv, "TensorFlow/Keras")
    print(example.report("TensorFlow/Keras", fit_nadaraya_watson, predict_nadaraya_watson,
                         lambda layer: float(layer.get_weights()["w"][0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
