"""The Nadaraya-Watson example, trained: what every framework's script shares.

The example regresses ``f(x) = 2 sin(x) + x^0.8`` from 50 noisy samples with Nadaraya-Watson
pooling (its data and the framework-free width fit are those of the CLI demo,
:mod:`attention_core.demo`). The parametric version learns the kernel's inverse width ``w`` with
*leave-one-out* keys: training point ``i`` is predicted from the other points only.

Each ``examples/nadaraya_watson_<framework>.py`` fits ``w`` with that framework's autodiff and
optimiser: ``fit_nadaraya_watson(data=None, epochs=10, lr=2.0, w0=1.0)`` starts a parametric
``NadarayaWatson`` at ``w0`` (1 is the non-parametric kernel), takes ``epochs`` full-batch SGD
steps of rate ``lr`` on the leave-one-out loss, the mean of ``(prediction - target)^2 / 2``
(:func:`training_arrays`; :func:`attention_core.demo.nadaraya_watson_data` when ``data`` is
None), and returns the trained layer (JAX: its variables) and the loss before each step;
``predict_nadaraya_watson(layer, data)`` gives the predictions at the test inputs from all the
training points. Run one from the repository root, e.g. ``python -m examples.nadaraya_watson_torch``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from attention_core.demo import RegressionData, leave_one_out, leave_one_out_loss, nadaraya_watson_data

__all__ = ["RegressionData", "arguments", "nadaraya_watson_data", "report", "training_arrays"]


def training_arrays(data: RegressionData) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """What every framework's fit of ``w`` trains on: each training point against the others.

    Returns:
        ``queries`` ``(n, 1)`` (one query per row: the point's input), ``keys`` and ``values``
        ``(n, n - 1)`` from :func:`attention_core.demo.leave_one_out`, and ``targets`` ``(n,)``
        (the point's target), all float32.
    """
    keys, values = leave_one_out(data.x_train, data.y_train)
    return (data.x_train[:, None].astype(np.float32), keys.astype(np.float32),
            values.astype(np.float32), data.y_train.astype(np.float32))


def report(framework: str, fit: Callable[[RegressionData], tuple[Any, list[float]]],
           predict: Callable[[Any, RegressionData], np.ndarray], width: Callable[[Any], float]) -> str:
    """Fits ``w`` on the example's data and says how it went: what a script's ``main`` prints.

    Args:
        framework: The framework's name, for the first line.
        fit: The script's ``fit_nadaraya_watson`` (called on the data, other arguments default).
        predict: The script's ``predict_nadaraya_watson``.
        width: Reads the learned ``w`` from what ``fit`` returned.
    """
    data = nadaraya_watson_data()
    fitted, losses = fit(data)
    w = width(fitted)
    predicted = predict(fitted, data)
    error = float(np.mean((predicted - data.y_truth) ** 2))
    return "\n".join([
        f"Nadaraya-Watson pooling, w fitted with {framework} ({len(losses)} SGD steps)",
        "  leave-one-out loss per step: " + " ".join(f"{x:.4f}" for x in losses),
        f"  learned w = {w:.4f} (started at 1); leave-one-out loss {leave_one_out_loss(w, data):.4f}"
        f" (at w = 1: {leave_one_out_loss(1.0, data):.4f})",
        f"  mean squared error against the noiseless function at the test inputs: {error:.4f}",
    ])


def arguments(argv: Sequence[str] | None, framework: str) -> None:
    """A script's command line: no options, a ``--help`` that says what the script does."""
    argparse.ArgumentParser(description=f"Fits the Nadaraya-Watson kernel width in {framework} "
                            "on the leave-one-out loss (a second or so) and prints how it went. "
                            "Writes no file.").parse_args(argv)


if __name__ == "__main__":
    from examples.__main__ import shared_main

    sys.exit(shared_main("nadaraya_watson"))
