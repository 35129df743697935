"""The Nadaraya-Watson example in MXNet/Gluon: the kernel width fitted with ``autograd`` and a ``Trainer``.

Run from the repository root, in an environment with MXNet: ``python -m
examples.nadaraya_watson_mxnet``. The data and the loss are those of :mod:`examples.nadaraya_watson`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

from backends.mxnet import NadarayaWatson
from examples import nadaraya_watson as example


def fit_nadaraya_watson(
    data: example.RegressionData | None = None, epochs: int = 10, lr: float = 2.0, w0: float = 1.0
) -> tuple[NadarayaWatson, list[float]]:
    """Fits ``w`` as :mod:`examples.nadaraya_watson` describes, by a ``gluon.Trainer`` with ``"sgd"``."""
    data = data or example.nadaraya_watson_data()
    queries, keys, values, targets = map(mx.np.array, example.training_arrays(data))
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


def predict_nadaraya_watson(layer: NadarayaWatson, data: example.RegressionData) -> np.ndarray:
    """The example's predictions at the test inputs (see :mod:`examples.nadaraya_watson`)."""
    out = layer(*(mx.np.array(a) for a in (data.x_test, data.x_train, data.y_train)))
    return np.asarray(out.asnumpy())


def main(argv: Sequence[str] | None = None) -> int:
    """Fits the width and prints how it went."""
    example.arguments(argv, "MXNet/Gluon")
    print(example.report("MXNet/Gluon", fit_nadaraya_watson, predict_nadaraya_watson,
                         lambda layer: float(layer.get_weights()["w"][0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
