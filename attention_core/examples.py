"""The data of the source notes' attention-pooling example, and a NumPy fit of its kernel width.

The example regresses ``f(x) = 2 sin(x) + x^0.8`` from 50 noisy samples with Nadaraya-Watson
pooling: the test inputs are the queries, the training inputs the keys and the training targets
the values. The parametric version learns the kernel's inverse width ``w``; it is trained, as in
the notes, with *leave-one-out* keys: training point ``i`` is predicted from the other points
only (with itself among its keys, the best ``w`` would be infinite and the fit would copy the noise).

Every trainable backend fits ``w`` with its own autodiff and optimiser: ``backends/<name>/examples.py``
has ``fit_nadaraya_watson(data=None, epochs=10, lr=2.0, w0=1.0)``, which starts a parametric
``NadarayaWatson`` at ``w0`` (1 is the non-parametric kernel), takes ``epochs`` full-batch SGD
steps of rate ``lr`` on the leave-one-out loss, the mean of ``(prediction - target)^2 / 2``
(:func:`training_arrays`; :func:`nadaraya_watson_data` when ``data`` is None), and returns the
trained layer (JAX: its variables) and the loss before each step; and
``predict_nadaraya_watson(layer, data)``, the predictions at the test inputs from all the
training points. :func:`fit_width` fits ``w`` without autodiff, by a one-dimensional search,
for NumPy and for the demo.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from attention_core.attention import nadaraya_watson


def target(x: np.ndarray) -> np.ndarray:
    """The noiseless function of the example: ``2 sin(x) + x^0.8``."""
    return 2 * np.sin(x) + x**0.8


@dataclass(frozen=True)
class RegressionData:
    """Training and test data of the Nadaraya-Watson example (float32 arrays).

    Attributes:
        x_train: ``(n,)`` sorted training inputs in ``[0, 5)``.
        y_train: ``(n,)`` targets with Gaussian noise of standard deviation 0.5.
        x_test: ``(50,)`` test inputs ``0, 0.1, ..., 4.9``.
        y_truth: ``(50,)`` noiseless targets at the test inputs.
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_truth: np.ndarray


def nadaraya_watson_data(n_train: int = 50, seed: int = 0) -> RegressionData:
    """Draws the example's data from a seeded generator.

    Args:
        n_train: Number of training samples (at least 2, so leave-one-out has a key).
        seed: Seed of the inputs and the noise.
    """
    if isinstance(n_train, bool) or not isinstance(n_train, int) or n_train < 2:
        raise ValueError(f"n_train must be an integer >= 2, got {n_train!r}")
    rng = np.random.default_rng(seed)
    x_train = np.sort(rng.random(n_train) * 5)
    y_train = target(x_train) + rng.normal(0.0, 0.5, n_train)
    x_test = np.arange(0, 5, 0.1)
    return RegressionData(*(a.astype(np.float32) for a in (x_train, y_train, x_test, target(x_test))))


def leave_one_out(x_train: np.ndarray, y_train: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Keys and values for predicting each training point from the others.

    Args:
        x_train: ``(n,)``.
        y_train: ``(n,)``.

    Returns:
        ``keys`` and ``values``, each ``(n, n - 1)``: row ``i`` holds every point but ``i``.
    """
    n = len(x_train)
    others = ~np.eye(n, dtype=bool)  # (n, n): True off the diagonal
    keys = np.broadcast_to(x_train, (n, n))[others].reshape(n, n - 1)
    values = np.broadcast_to(y_train, (n, n))[others].reshape(n, n - 1)
    return keys, values


def leave_one_out_loss(w: float, data: RegressionData) -> float:
    """Mean of ``(f_w(x_i) - y_i)^2 / 2`` over training points, each predicted from the others."""
    keys, values = leave_one_out(data.x_train.astype(np.float64), data.y_train.astype(np.float64))
    queries = data.x_train.astype(np.float64)[:, None]  # (n, 1): one query per row
    predicted = np.asarray(nadaraya_watson(queries, keys, values, np.array([w])))[:, 0]
    return float(np.mean((predicted - data.y_train) ** 2) / 2)


def fit_width(data: RegressionData, low: float = 0.05, high: float = 50.0, steps: int = 60) -> float:
    """The ``w`` in ``[low, high]`` minimising :func:`leave_one_out_loss`, without autodiff.

    A golden-section search on ``log w``, after a coarse grid picks the bracket (the loss need
    not be unimodal over the whole range).

    Args:
        data: The example's data.
        low: Smallest width considered (> 0).
        high: Largest width considered.
        steps: Golden-section steps; each shrinks the bracket by 0.618.
    """
    if not 0 < low < high:
        raise ValueError(f"need 0 < low < high, got low={low!r}, high={high!r}")
    grid = np.geomspace(low, high, 41)
    losses = [leave_one_out_loss(float(w), data) for w in grid]
    best = int(np.argmin(losses))
    a, b = math.log(grid[max(best - 1, 0)]), math.log(grid[min(best + 1, len(grid) - 1)])
    ratio = (math.sqrt(5) - 1) / 2
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = leave_one_out_loss(math.exp(c), data), leave_one_out_loss(math.exp(d), data)
    for _ in range(steps):
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = leave_one_out_loss(math.exp(c), data)
        else:
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = leave_one_out_loss(math.exp(d), data)
    return math.exp((a + b) / 2)


def training_arrays(data: RegressionData) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """What every backend's fit of ``w`` trains on: each training point against the others.

    Returns:
        ``queries`` ``(n, 1)`` (one query per row: the point's input), ``keys`` and ``values``
        ``(n, n - 1)`` from :func:`leave_one_out`, and ``targets`` ``(n,)`` (the point's
        target), all float32.
    """
    keys, values = leave_one_out(data.x_train, data.y_train)
    return (data.x_train[:, None].astype(np.float32), keys.astype(np.float32),
            values.astype(np.float32), data.y_train.astype(np.float32))
