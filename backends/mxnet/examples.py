"""The Nadaraya-Watson example in MXNet/Gluon: the kernel width fitted with ``autograd`` and a ``Trainer``.

The data are the framework-free ones of :mod:`attention_core.examples`.
"""

from __future__ import annotations

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

from attention_core import examples
from backends.mxnet.layers import NadarayaWatson


def fit_nadaraya_watson(
    data: examples.RegressionData | None = None, epochs: int = 10, lr: float = 2.0, w0: float = 1.0
) -> tuple[NadarayaWatson, list[float]]:
    """Fits ``w`` as :mod:`attention_core.examples` describes, by a ``gluon.Trainer`` with ``"sgd"``."""
    data = data or examples.nadaraya_watson_data()
    queries, keys, values, targets = map(mx.np.array, examples.training_arrays(data))
    layer = NadarayaWatson(parametric=True)
    layer.set_weights({"w": np.array([w0], np.float32)})
    trainer = gluon.Trainer(layer.collect_params(), "sgd", {"learning_rate": lr})
    losses = []
    for _ in range(epochs):
        with autograd.record():
            loss = ((layer(queries, keys, values)[:, 0] - targets) ** 2).mean() / 2
        loss.backward()
        trainer.step(1)  # the loss is already a mean: no further rescaling
        losses.append(float(loss))
    return layer, losses


def predict_nadaraya_watson(layer: NadarayaWatson, data: examples.RegressionData) -> np.ndarray:
    """The example's predictions at the test inputs (see :mod:`attention_core.examples`)."""
    out = layer(*(mx.np.array(a) for a in (data.x_test, data.x_train, data.y_train)))
    return np.asarray(out.asnumpy())
