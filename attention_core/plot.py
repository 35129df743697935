"""Pictures of what the library computes: positional encodings, attention weights, kernel regression.

The d2l book's figures of attention, drawn from arrays of any backend (NumPy, torch, TensorFlow,
JAX or MXNet; they are copied to NumPy first):

* :func:`plot_encoding_columns`: a few columns of the sinusoidal table over the positions;
* :func:`plot_encoding_heatmap`: the whole table as a heatmap;
* :func:`show_heatmaps`: a grid of attention-weight matrices ``(rows, cols, Q, K)``, for
  example the weights of a multi-head layer as (batch rows, head columns);
* :func:`plot_kernel_regression`: noisy samples, the true function and fitted predictions, as in
  the Nadaraya-Watson example (:mod:`attention_core.demo` has its data and width fit).

:func:`binary_table` is the d2l book's table of ``0 .. n-1`` in binary; it needs no matplotlib.

matplotlib is the ``plot`` extra (``pip install ".[plot]"`` in a checkout). It is imported by the
plotting functions when they are called, never by ``import attention_core.plot``. Each function
returns a :class:`matplotlib.figure.Figure` that is not registered with ``pyplot``: save it with
``fig.savefig(path)``, or leave it as a Jupyter cell's value to display it. The functions that
draw on one set of axes also take ``ax=`` to draw into an existing figure (and return that figure).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from attention_core import registry

if TYPE_CHECKING:  # matplotlib is optional: mypy may run without it (the lint env)
    from matplotlib.axes import Axes  # type: ignore[import-not-found, unused-ignore]
    from matplotlib.figure import Figure  # type: ignore[import-not-found, unused-ignore]

#: What to install when matplotlib is missing.
INSTALL_HINT = registry.install_hint("plot")

#: Resolution of saved figures (dots per inch) unless the caller passes another to ``savefig``.
DPI = 120


def require_matplotlib() -> None:
    """Checks that matplotlib can be imported.

    Raises:
        ImportError: matplotlib is not installed; the message says what to install.
    """
    try:
        import matplotlib  # type: ignore[import-not-found, unused-ignore]  # noqa: F401
    except ImportError as err:
        raise ImportError(f"plotting needs matplotlib, which is not installed: {INSTALL_HINT}") from err


def _new_figure(figsize: tuple[float, float]) -> Figure:
    """A figure with constrained layout (labels, titles and colour bars never overlap)."""
    require_matplotlib()
    from matplotlib.figure import Figure  # type: ignore[import-not-found, unused-ignore]

    return Figure(figsize=figsize, dpi=DPI, layout="constrained")


def _axes(ax: Axes | None, figsize: tuple[float, float]) -> tuple[Figure, Axes]:
    """The caller's axes and their figure, or one new axes on a new figure."""
    if ax is not None:
        require_matplotlib()
        return ax.figure.figure, ax  # the top figure, also when the axes are in a subfigure
    fig = _new_figure(figsize)
    return fig, fig.add_subplot()


def _integer_ticks(ax: Axes) -> None:
    """Ticks at whole numbers only: rows and columns of a matrix are indices."""
    from matplotlib.ticker import MaxNLocator  # type: ignore[import-not-found, unused-ignore]

    ax.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))


def to_numpy(x: Any, name: str = "x") -> np.ndarray:
    """Copies an array of any backend (or a nested list) into a float64 NumPy array.

    Args:
        x: A NumPy, torch, TensorFlow, JAX or MXNet array, or anything ``np.asarray`` takes.
        name: The argument's name, for the error message.

    Raises:
        TypeError: ``x`` holds no numbers.
    """
    if not isinstance(x, np.ndarray):
        try:
            owner = registry.backend_of(x)
        except TypeError:
            owner = None
        if owner is not None:
            x = registry.get_ops(owner).to_numpy(x)
    try:
        return np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError) as err:
        raise TypeError(f"{name} must be an array of numbers, got {type(x).__name__}") from err


def _encoding_table(P: Any) -> np.ndarray:
    """The table ``(positions, columns)`` from ``P`` of shape ``(L, d)`` or ``(1, L, d)``."""
    table = to_numpy(P, "P")
    if table.ndim == 3 and table.shape[0] == 1:
        table = table[0]
    if table.ndim != 2 or 0 in table.shape:
        raise ValueError(
            f"P must have shape (positions, columns) or (1, positions, columns), got {table.shape}"
        )
    return table


def plot_encoding_columns(
    P: Any,
    columns: Sequence[int] = (6, 7, 8, 9),
    num_positions: int = 60,
    *,
    ax: Axes | None = None,
    figsize: tuple[float, float] = (6, 2.8),
) -> Figure:
    """Plots a few columns of a positional-encoding table against the position.

    With the sinusoidal table, lower columns oscillate faster: columns 6 and 7 (a sine and a
    cosine of the same frequency) complete more periods over 60 positions than columns 8 and 9.

    Args:
        P: The table, ``(L, d)`` or a layer's ``(1, L, d)``, of any backend.
        columns: Which columns to draw, one line each (legend ``Col 6`` ...).
        num_positions: How many positions (rows) from 0 to draw; at most ``L``.
        ax: Draw into these axes instead of a new figure.
        figsize: Size of a new figure, in inches.

    Returns:
        The figure.

    Raises:
        ValueError: ``P`` is not a table, a column is outside it, or ``num_positions`` exceeds it.
    """
    table = _encoding_table(P)
    if isinstance(num_positions, bool) or not isinstance(num_positions, int) \
            or not 0 < num_positions <= table.shape[0]:
        raise ValueError(f"num_positions must be an int in [1, {table.shape[0]}] (the rows of P), "
                         f"got {num_positions!r}")
    columns = list(columns)
    bad = [c for c in columns if isinstance(c, bool) or not isinstance(c, int)
           or not 0 <= c < table.shape[1]]
    if not columns or bad:
        raise ValueError(f"columns must be column indices in [0, {table.shape[1] - 1}] of P, "
                         f"got {tuple(columns)!r}")
    fig, ax = _axes(ax, figsize)
    positions = np.arange(num_positions)
    for column, style in zip(columns, ("-", "--", "-.", ":") * len(columns), strict=False):
        ax.plot(positions, table[:num_positions, column], style, label=f"Col {column}")
    ax.set_xlabel("Row (position)")
    ax.set_ylabel("Encoding value")
    ax.set_title(f"Positional encoding: columns {', '.join(map(str, columns))}")
    ax.set_xlim(0, num_positions - 1)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    return fig


def plot_encoding_heatmap(
    P: Any,
    *,
    ax: Axes | None = None,
    figsize: tuple[float, float] = (4.2, 4.5),
    cmap: str = "Blues",
) -> Figure:
    """Draws a positional-encoding table as a heatmap, positions down, columns across.

    Args:
        P: The table, ``(L, d)`` or a layer's ``(1, L, d)``, of any backend.
        ax: Draw into these axes instead of a new figure.
        figsize: Size of a new figure, in inches.
        cmap: matplotlib colour map.

    Returns:
        The figure (with a colour bar).
    """
    table = _encoding_table(P)
    fig, ax = _axes(ax, figsize)
    image = ax.imshow(table, cmap=cmap, aspect="auto", interpolation="nearest")
    _integer_ticks(ax)
    ax.set_xlabel("Column (encoding dimension)")
    ax.set_ylabel("Row (position)")
    ax.set_title(f"Positional encoding P ({table.shape[0]} x {table.shape[1]})")
    fig.colorbar(image, ax=ax, label="Value")
    return fig


def show_heatmaps(
    matrices: Any,
    xlabel: str,
    ylabel: str,
    titles: Sequence[str] | None = None,
    figsize: tuple[float, float] | None = None,
    cmap: str = "Reds",
    *,
    row_titles: Sequence[str] | None = None,
    colorbar_label: str | None = None,
) -> Figure:
    """Draws a grid of matrices, such as attention weights, with one shared colour bar.

    Panel ``(i, j)`` shows ``matrices[i, j]``, its rows (queries) down and its columns (keys)
    across. All panels share one colour scale, so their values compare directly.

    Args:
        matrices: ``(rows, cols, Q, K)``, of any backend; e.g. the weights ``(B, H, Q, K)`` of
            a multi-head layer give one row per example and one column per head.
        xlabel: Label under the bottom row (what the K columns are, e.g. ``"Keys"``).
        ylabel: Label left of the first column (what the Q rows are, e.g. ``"Queries"``).
        titles: One title per column of panels (e.g. ``["Head 1", ...]``), or None.
        figsize: Size of the whole figure, in inches; None gives each panel about
            2.5 x 2.5 inches (the seeds' default, there for a single panel).
        cmap: matplotlib colour map.
        row_titles: One label per row of panels, put above ``ylabel`` (e.g. ``"Example 1"``).
        colorbar_label: Label of the colour bar, or None.

    Returns:
        The figure.

    Raises:
        ValueError: ``matrices`` is not of rank 4 or is empty, or ``titles``/``row_titles``
            does not have one entry per column/row.
    """
    values = to_numpy(matrices, "matrices")
    if values.ndim != 4 or 0 in values.shape:
        raise ValueError(
            f"matrices must have shape (rows, cols, Q, K) with no empty dimension, got {values.shape}"
        )
    num_rows, num_cols = values.shape[:2]
    for name, labels, count, what in (("titles", titles, num_cols, "column"),
                                      ("row_titles", row_titles, num_rows, "row")):
        if labels is not None and (isinstance(labels, str) or len(labels) != count):
            raise ValueError(f"{name} must be a sequence of {count} strings (one per {what} of "
                             f"matrices {values.shape}), got {labels!r}")
    if figsize is None:
        figsize = (2.5 * num_cols + 1.0, 2.5 * num_rows)
    fig = _new_figure(figsize)
    axes = fig.subplots(num_rows, num_cols, sharex=True, sharey=True, squeeze=False)
    low, high = float(values.min()), float(values.max())
    if low == high:  # a constant grid still gets a colour bar with a range
        low, high = low - 0.5, high + 0.5
    images = []
    for i in range(num_rows):
        for j in range(num_cols):
            ax = axes[i, j]
            images.append(ax.imshow(values[i, j], cmap=cmap, vmin=low, vmax=high, aspect="auto",
                                    interpolation="nearest"))
            _integer_ticks(ax)
            if i == num_rows - 1:
                ax.set_xlabel(xlabel)
            if j == 0:
                ax.set_ylabel(ylabel if row_titles is None else f"{row_titles[i]}\n{ylabel}")
            if titles is not None:
                ax.set_title(titles[j])
    # the pad is a fraction of the grid's width: keep the bar about a quarter inch from the panels
    fig.colorbar(images[-1], ax=axes, shrink=0.8 if num_rows > 1 else 1.0, pad=min(0.05, 0.25 / figsize[0]),
                 label=colorbar_label)
    return fig


def _vector(x: Any, name: str, like: tuple[str, np.ndarray] | None = None) -> np.ndarray:
    """``x`` as a non-empty 1-D NumPy array, of the length of ``like`` (its name and value) if given."""
    vector = to_numpy(x, name)
    if vector.ndim != 1 or not vector.size or (like is not None and vector.shape != like[1].shape):
        expected = "a non-empty 1-D array" + (f" like {like[0]} {like[1].shape}" if like else "")
        raise ValueError(f"{name} must be {expected}, got shape {vector.shape}")
    return vector


def plot_kernel_regression(
    x_train: Any,
    y_train: Any,
    x_test: Any,
    y_truth: Any,
    predictions: Mapping[str, Any],
    *,
    ax: Axes | None = None,
    figsize: tuple[float, float] = (6.5, 3.5),
    title: str = "Nadaraya-Watson regression",
) -> Figure:
    """Plots a regression: training samples, the true function and one line per prediction.

    Args:
        x_train: ``(n,)`` training inputs.
        y_train: ``(n,)`` noisy training targets (drawn as dots).
        x_test: ``(m,)`` test inputs.
        y_truth: ``(m,)`` the true function at ``x_test``.
        predictions: Name -> ``(m,)`` predictions at ``x_test``, one line each.
        ax: Draw into these axes instead of a new figure.
        figsize: Size of a new figure, in inches.
        title: The axes' title.

    Returns:
        The figure.

    Raises:
        ValueError: The arrays are not 1-D or their lengths do not match.
    """
    x_train_, x_test_ = _vector(x_train, "x_train"), _vector(x_test, "x_test")
    y_train_ = _vector(y_train, "y_train", like=("x_train", x_train_))
    y_truth_ = _vector(y_truth, "y_truth", like=("x_test", x_test_))
    lines = {name: _vector(value, f"predictions[{name!r}]", like=("x_test", x_test_))
             for name, value in predictions.items()}
    fig, ax = _axes(ax, figsize)
    ax.plot(x_test_, y_truth_, "k-", label="Truth")
    ax.plot(x_train_, y_train_, "o", alpha=0.5, label="Samples")
    for (name, y), style in zip(lines.items(), ("--", "-.", ":", "-") * len(lines), strict=False):
        ax.plot(x_test_, y, style, linewidth=2, label=name)
    ax.set_xlabel("x")
    ax.set_ylabel("y")
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    return fig


def binary_table(n: int = 8) -> str:
    """The d2l book's table of ``0 .. n-1`` in binary, one line each (``"5 in binary is 101"``).

    Lower bits flip faster (every number, every two, every four...), like the lower columns of
    the sinusoidal encoding. Needs no matplotlib.

    Args:
        n: How many numbers, from 0.

    Raises:
        ValueError: ``n`` is not a positive int.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise ValueError(f"n must be a positive int, got {n!r}")
    width = max(1, (n - 1).bit_length())
    return "\n".join(f"{i} in binary is {i:0{width}b}" for i in range(n))
