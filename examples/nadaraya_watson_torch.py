"""The Nadaraya-Watson example in PyTorch: the kernel width fitted with autograd and ``torch.optim.SGD``.

Run from the repository root: ``python -m examples.nadaraya_watson_torch``. The data and the
loss are those of :mod:`examples.nadaraya_watson`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np
import torch

from backends.torch import NadarayaWatson
from examples import nadaraya_watson as example


def fit_nadaraya_watson(
    data: example.RegressionData | None = None, epochs: int = 10, lr: float = 2.0, w0: float = 1.0
) -> tuple[NadarayaWatson, list[float]]:
    """Fits ``w`` as :mod:`examples.nadaraya_watson` describes, by ``torch.optim.SGD``."""
    data = data or example.nadaraya_watson_data()
    queries, keys, values, targets = map(torch.from_numpy, example.training_arrays(data))
    layer = NadarayaWatson(parametric=True)
    layer.set_weights({"w": np.array([w0], np.float32)})
    optimizer = torch.optim.SGD(layer.parameters(), lr=lr)
    losses = []
    for _ in range(epochs):
        optimizer.zero_grad()
        loss = ((layer(queries, keys, values)[:, 0] - targets) ** 2).mean() / 2
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return layer, losses


def predict_nadaraya_watson(layer: NadarayaWatson, data: example.RegressionData) -> np.ndarray:
    """The example's predictions at the test inputs (see :mod:`examples.nadaraya_watson`)."""
    with torch.no_grad():
        out = layer(*(torch.from_numpy(a) for a in (data.x_test, data.x_train, data.y_train)))
    return out.numpy()


def main(argv: Sequence[str] | None = None) -> int:
    """Fits the width and prints how it went."""
    example.arguments(argv, "PyTorch")
    print(example.report("PyTorch", fit_nadaraya_watson, predict_nadaraya_watson,
                         lambda layer: float(layer.get_weights()["w"][0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
