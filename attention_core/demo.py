"""What ``python -m attention_core demo`` runs, and the data of its Nadaraya-Watson pictures.

:func:`demo` runs the d2l book's self-attention example (batch 2, 4 queries, 100 hiddens, 5 heads,
``valid_lens`` [3, 2]) on a backend and says what it computed; with ``out`` it also draws
the d2l book's pictures (:func:`demo_figures`).

The Nadaraya-Watson pictures regress ``f(x) = 2 sin(x) + x^0.8`` from 50 noisy samples with
attention pooling: the test inputs are the queries, the training inputs the keys and the
training targets the values. The parametric version has the kernel's inverse width ``w``, fitted,
as in the d2l book, with *leave-one-out* keys: training point ``i`` is predicted from the other
points only (with itself among its keys, the best ``w`` would be infinite and the fit would copy
the noise). :func:`fit_width` fits ``w`` on NumPy by a one-dimensional search, without autodiff
and without any framework. The worked examples that train ``w`` with each framework's autodiff
and optimiser live outside the package, in the repository's ``examples/`` (run from its root:
``python -m examples.nadaraya_watson_torch``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from attention_core import files, plot, registry
from attention_core.attention import nadaraya_watson

if TYPE_CHECKING:  # matplotlib is the optional "plot" extra
    from matplotlib.figure import Figure  # type: ignore[import-not-found, unused-ignore]


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


# -- the demo -----------------------------------------------------------------------------------


def demo(name: str | None = None, out: str | Path | None = None) -> str:
    """Runs the d2l book's multi-head attention and positional encoding examples.

    Args:
        name: The backend (default: the active one).
        out: Also write the pictures of :func:`demo_figures` into this directory (created if
            missing) as PNG files, and add the d2l book's binary table of 0..7 to the text. Needs
            matplotlib.

    Returns:
        What to print.
    """
    if out is not None:
        plot.require_matplotlib()  # fail before the work, with what to install
    key = registry.canonical_name(name) if name else registry.backend()
    module = registry.load(key)
    ops = module.OPS
    call: Callable[..., Any] = getattr(module, "call_layer", lambda layer, *a, **k: layer(*a, **k))
    num_hiddens, num_heads, batch, num_queries = 100, 5, 2, 4
    attention = module.MultiHeadAttention(num_hiddens, num_heads, 0.5)
    X = ops.from_numpy(np.ones((batch, num_queries, num_hiddens), np.float32))
    valid_lens = ops.from_numpy(np.array([3, 2], np.int32))
    output, weights = call(attention, X, X, X, valid_lens, return_attention=True)
    weights = ops.to_numpy(weights)
    encoding = module.PositionalEncoding(32, 0.0)
    P = call(encoding, ops.from_numpy(np.zeros((1, 60, 32), np.float32)))
    np.set_printoptions(precision=4, suppress=True)
    lines = [
        f"backend: {key}",
        f"MultiHeadAttention({num_hiddens}, {num_heads}, 0.5) on ones{(batch, num_queries, num_hiddens)}"
        " with valid_lens [3, 2]",
        f"  output shape: {tuple(ops.shape(output))}",
        f"  attention weights shape: {weights.shape} (batch, heads, queries, keys)",
        f"  example 0, head 0, query 0: {weights[0, 0, 0]}  (keys 3.. masked)",
        f"  example 1, head 0, query 0: {weights[1, 0, 0]}  (keys 2.. masked)",
        "PositionalEncoding(32, 0) on zeros(1, 60, 32)",
        f"  output shape: {tuple(ops.shape(P))}; table P shape: {tuple(ops.shape(encoding.P))}",
        f"  row 1, columns 0..3: {ops.to_numpy(P)[0, 1, :4]}",
    ]
    if out is not None:
        lines += ["Binary representations of 0..7 (lower bits flip faster, like lower encoding columns):",
                  *(f"  {line}" for line in plot.binary_table(8).splitlines())]
        figures, fitted = demo_figures(ops, weights, [3, 2], ops.to_numpy(P)[0])
        lines.append(fitted)
        Path(out).mkdir(parents=True, exist_ok=True)
        for filename, figure in figures.items():
            files.save_figure(figure, Path(out) / filename)
            lines.append(f"wrote {Path(out) / filename}")
    return "\n".join(lines)


def demo_figures(ops: Any, weights: np.ndarray, valid_lens: Sequence[int],
                 table: np.ndarray) -> tuple[dict[str, Figure], str]:
    """The pictures of ``demo --out``, by file name.

    The positional-encoding columns and heatmap of ``table``; the multi-head weights as (example
    rows, head columns) heatmaps; and the Nadaraya-Watson example of the d2l book, computed on the
    backend of ``ops``: the non-parametric fit (``w = 1``) and the parametric one, whose width
    :func:`fit_width` fits on NumPy by minimising the leave-one-out loss with a golden-section
    search on ``log w`` (no autodiff), and the weights of both fits.

    Args:
        ops: The backend's ops (the Nadaraya-Watson pooling runs on this backend).
        weights: The multi-head layer's weights ``(B, H, Q, K)``.
        valid_lens: The ``valid_lens`` of the demo, one per example, for the row labels.
        table: The positional-encoding rows the layer added, ``(positions, columns)``.

    Returns:
        The figures, keyed by file name, and a line saying which width was fitted.
    """
    data = nadaraya_watson_data(seed=0)
    x_train, y_train, x_test = (ops.from_numpy(a) for a in (data.x_train, data.y_train, data.x_test))
    w = fit_width(data)
    fits = {label: nadaraya_watson(x_test, x_train, y_train, width, return_weights=True, ops=ops)
            for label, width in (("Non-parametric (w = 1)", None), (f"Parametric (w = {w:.2f})", w))}
    fit_weights = np.stack([ops.to_numpy(a)[0, 0] for _, a in fits.values()])[None]  # (1, 2, Q, K)
    heads = [f"Head {h + 1}" for h in range(weights.shape[1])]
    rows = [f"Example {b + 1} ({n} valid keys)" for b, n in enumerate(valid_lens)]
    figures = {
        "encoding_columns.png": plot.plot_encoding_columns(table),
        "encoding_heatmap.png": plot.plot_encoding_heatmap(table),
        "attention_heatmaps.png": plot.show_heatmaps(weights, "Keys", "Queries", heads, row_titles=rows,
                                                     colorbar_label="Attention weight"),
        "nadaraya_watson_fit.png": plot.plot_kernel_regression(
            data.x_train, data.y_train, data.x_test, data.y_truth, {k: y for k, (y, _) in fits.items()}),
        "nadaraya_watson_weights.png": plot.show_heatmaps(
            fit_weights, "Sorted training inputs", "Sorted test inputs", list(fits), figsize=(8.0, 3.8),
            colorbar_label="Attention weight"),
    }
    fitted = (f"Nadaraya-Watson: w = {w:.4f} minimises the leave-one-out loss "
              f"({leave_one_out_loss(w, data):.4f}; {leave_one_out_loss(1.0, data):.4f} "
              "at w = 1)")
    return figures, fitted
