"""attention_core.plot: what each figure draws, its labels, colour bars and readable text, and the
pictures of ``demo --out``.

Text is checked for overlaps by drawing each figure with the Agg renderer and comparing the
bounding boxes of every visible tick label, axis label, title and legend. The tests that draw
need matplotlib (the ``plot`` extra) and are skipped without it; the others run everywhere.
"""

from __future__ import annotations

import importlib.util
import itertools
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from attention_core import __main__ as cli
from attention_core import demo, plot
from tests.harness import Harness

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
needs_matplotlib = pytest.mark.skipif(not HAVE_MATPLOTLIB, reason='needs matplotlib (the "plot" extra)')


def python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                          timeout=300)


def sinusoid_table(positions: int, width: int) -> np.ndarray:
    """The sinusoidal table from its formula, one entry at a time."""
    table = np.zeros((positions, width))
    for i in range(positions):
        for c in range(width):
            angle = i / 10000 ** ((c - c % 2) / width)
            table[i, c] = math.sin(angle) if c % 2 == 0 else math.cos(angle)
    return table


# -- readable text: what the Agg renderer draws --------------------------------------------------


def drawn_texts(fig: Any) -> list[tuple[str, Any]]:
    """(description, window extent) of every piece of text the figure draws, after drawing it."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    found = []

    def add(what: str, text: Any) -> None:
        if text.get_visible() and text.get_text().strip():
            found.append((f"{what} {text.get_text()!r}", text.get_window_extent(renderer)))

    for n, ax in enumerate(fig.axes):
        for axis, name in ((ax.xaxis, "x"), (ax.yaxis, "y")):
            low, high = sorted(axis.get_view_interval())
            for tick in axis.get_major_ticks():
                if low - 1e-9 <= tick.get_loc() <= high + 1e-9:  # ticks outside the view are not drawn
                    add(f"axes {n} {name} tick", tick.label1)
                    add(f"axes {n} {name} tick", tick.label2)
            add(f"axes {n} {name}label", axis.label)
        for title in (ax.title, ax._left_title, ax._right_title):
            add(f"axes {n} title", title)
        legend = ax.get_legend()
        if legend is not None:
            found.append((f"axes {n} legend", legend.get_window_extent(renderer)))
    for text in fig.texts:
        add("figure text", text)
    return found


def overlaps(fig: Any) -> list[str]:
    """Pairs of texts whose boxes overlap (by more than half a pixel), and texts cut off."""
    texts = drawn_texts(fig)
    problems = [f"{a} overlaps {b}" for (a, box_a), (b, box_b) in itertools.combinations(texts, 2)
                if min(box_a.x1, box_b.x1) - max(box_a.x0, box_b.x0) > 0.5
                and min(box_a.y1, box_b.y1) - max(box_a.y0, box_b.y0) > 0.5]
    width, height = fig.bbox.width, fig.bbox.height
    problems += [f"{a} is cut off" for a, box in texts
                 if box.x0 < -0.5 or box.y0 < -0.5 or box.x1 > width + 0.5 or box.y1 > height + 0.5]
    return problems


def image_axes(fig: Any) -> list[Any]:
    return [ax for ax in fig.axes if ax.images]


def assert_readable(fig: Any, title: bool) -> None:
    problems = overlaps(fig)
    assert not problems, problems
    # every heatmap is read through a colour bar: its own, or one of the same colours and scale
    bars = [ax.images[0].colorbar for ax in image_axes(fig) if ax.images[0].colorbar is not None]
    for ax in image_axes(fig):
        image = ax.images[0]
        assert any(bar.mappable.get_clim() == image.get_clim() and bar.mappable.get_cmap() == image.get_cmap()
                   for bar in bars), ax.get_title()
    plots = [ax for ax in fig.axes if ax.images or ax.lines]
    assert plots
    for ax in plots:
        if title:
            assert ax.get_title()
    # each row of panels has a y label, each column an x label (shared axes label the outer ones)
    assert {ax.get_subplotspec().rowspan.start for ax in plots if ax.get_ylabel()} == \
        {ax.get_subplotspec().rowspan.start for ax in plots}
    assert {ax.get_subplotspec().colspan.start for ax in plots if ax.get_xlabel()} == \
        {ax.get_subplotspec().colspan.start for ax in plots}


@needs_matplotlib
def test_the_overlap_check_finds_overlapping_and_cut_off_text() -> None:
    fig = plot.plot_encoding_columns(np.zeros((60, 32)))
    assert not overlaps(fig)
    fig.text(0.5, 0.5, "one label")
    fig.text(0.52, 0.5, "another label")
    fig.text(0.99, 0.5, "this text runs off the right edge")
    found = overlaps(fig)
    assert any("'one label' overlaps figure text 'another label'" in p for p in found), found
    assert any("'this text runs off the right edge' is cut off" in p for p in found), found


# -- import without matplotlib ------------------------------------------------------------------


def test_import_does_not_import_matplotlib() -> None:
    code = ("import sys\nimport attention_core.plot as p\nimport attention_core.__main__\n"
            "assert 'matplotlib' not in sys.modules, 'imported by the module'\n"
            "p.binary_table(8)\nassert 'matplotlib' not in sys.modules, 'imported by binary_table'\n"
            "import numpy as np\np.plot_encoding_heatmap(np.zeros((4, 4)))\n"
            "assert 'matplotlib' in sys.modules\n")
    out = python(code)
    if HAVE_MATPLOTLIB:
        assert out.returncode == 0, out.stderr
    else:  # the call is where it fails, saying what to install
        assert 'pip install "attention-core[plot]"' in out.stderr, out.stderr


def test_without_matplotlib_the_error_says_what_to_install() -> None:
    code = ("import sys\nsys.modules['matplotlib'] = None  # as if not installed\n"
            "import numpy as np\nfrom attention_core import plot\n"
            "try:\n    plot.show_heatmaps(np.zeros((1, 1, 2, 2)), 'K', 'Q')\n"
            "except ImportError as err:\n    print(err)\n")
    out = python(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ('plotting needs matplotlib, which is not installed: '
                                  'pip install ".[plot]" in a checkout of attention-core, or '
                                  'pip install "attention-core[plot]" from the package index')


# -- binary_table ------------------------------------------------------------------------------


def test_binary_table_of_0_to_7_is_the_notes_table() -> None:
    assert plot.binary_table(8).splitlines() == [
        "0 in binary is 000", "1 in binary is 001", "2 in binary is 010", "3 in binary is 011",
        "4 in binary is 100", "5 in binary is 101", "6 in binary is 110", "7 in binary is 111",
    ]


@pytest.mark.parametrize("n, last", [(1, "0 in binary is 0"), (5, "4 in binary is 100"),
                                     (9, "8 in binary is 1000"), (16, "15 in binary is 1111")])
def test_binary_table_width_fits_the_largest_number(n: int, last: str) -> None:
    lines = plot.binary_table(n).splitlines()
    assert len(lines) == n and lines[-1] == last
    assert len({len(line.split()[-1]) for line in lines}) == 1  # the bits are padded to one width


@pytest.mark.parametrize("n", [0, -1, 2.0, True])
def test_binary_table_rejects_non_positive_ints(n: Any) -> None:
    with pytest.raises(ValueError, match=rf"n must be a positive int, got {re.escape(repr(n))}"):
        plot.binary_table(n)


# -- show_heatmaps -----------------------------------------------------------------------------


@needs_matplotlib
def test_show_heatmaps_draws_each_matrix_on_one_colour_scale() -> None:
    rng = np.random.default_rng(1)
    matrices = rng.random((2, 3, 4, 6))
    matrices[1, 2, 0, 0] = 5.0  # the largest value anywhere sets the top of every panel's scale
    fig = plot.show_heatmaps(matrices, "Keys", "Queries", ["Head 1", "Head 2", "Head 3"],
                             row_titles=["Example 1", "Example 2"], colorbar_label="weight")
    panels = image_axes(fig)
    assert len(panels) == 6 and len(fig.axes) == 7  # six panels and one colour bar
    for ax in panels:
        spec = ax.get_subplotspec()
        i, j = spec.rowspan.start, spec.colspan.start
        np.testing.assert_array_equal(ax.images[0].get_array(), matrices[i, j])
        assert ax.images[0].get_clim() == (matrices.min(), 5.0)
        assert ax.get_title() == f"Head {j + 1}"
        assert ax.get_xlabel() == ("Keys" if i == 1 else "")
        assert ax.get_ylabel() == (f"Example {i + 1}\nQueries" if j == 0 else "")
    (bar,) = {ax.images[0].colorbar for ax in panels} - {None}  # one, shared
    assert bar.ax.get_ylabel() == "weight"
    assert_readable(fig, title=True)


@needs_matplotlib
def test_show_heatmaps_single_panel_and_default_size() -> None:
    fig = plot.show_heatmaps(np.eye(5)[None, None], "Keys", "Queries")
    assert len(image_axes(fig)) == 1 and image_axes(fig)[0].get_title() == ""
    assert tuple(fig.get_size_inches()) == (3.5, 2.5)  # 2.5 x 2.5 per panel, plus the colour bar
    assert tuple(plot.show_heatmaps(np.eye(5)[None, None], "K", "Q", figsize=(4, 3)).get_size_inches()) \
        == (4, 3)
    assert_readable(fig, title=False)


@needs_matplotlib
def test_show_heatmaps_large_matrices_keep_tick_labels_apart() -> None:
    fig = plot.show_heatmaps(np.random.default_rng(0).random((3, 4, 37, 53)), "Key positions",
                             "Query positions", [f"Head {h}" for h in range(1, 5)])
    assert_readable(fig, title=True)


@needs_matplotlib
def test_show_heatmaps_of_a_constant_still_has_a_colour_range() -> None:
    fig = plot.show_heatmaps(np.full((1, 2, 3, 3), 0.25), "K", "Q")
    low, high = image_axes(fig)[0].images[0].get_clim()
    assert low < 0.25 < high


@pytest.mark.parametrize("shape", [(4, 4), (2, 4, 4), (1, 2, 3, 4, 5), (1, 0, 3, 3)])
def test_show_heatmaps_wants_rank_4(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=re.escape(f"matrices must have shape (rows, cols, Q, K) with no "
                                                   f"empty dimension, got {shape}")):
        plot.show_heatmaps(np.zeros(shape), "Keys", "Queries")


@pytest.mark.parametrize("name, kwargs", [
    ("titles", {"titles": ["Head 1", "Head 2"]}),
    ("titles", {"titles": "Head"}),
    ("row_titles", {"row_titles": ["a", "b", "c"]}),
])
def test_show_heatmaps_wants_one_title_per_column_and_row(name: str, kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=rf"^{name} must be a sequence of \d strings \(one per "):
        plot.show_heatmaps(np.zeros((2, 3, 4, 4)), "Keys", "Queries", **kwargs)


def test_show_heatmaps_rejects_what_is_not_numbers() -> None:
    with pytest.raises(TypeError, match="matrices must be an array of numbers, got str"):
        plot.show_heatmaps("weights", "Keys", "Queries")


# -- the positional encoding -------------------------------------------------------------------


@needs_matplotlib
def test_encoding_columns_draw_the_table_columns() -> None:
    table = sinusoid_table(80, 32)
    fig = plot.plot_encoding_columns(table[None])  # a layer's (1, L, d) table
    (ax,) = fig.axes
    assert [line.get_label() for line in ax.lines] == ["Col 6", "Col 7", "Col 8", "Col 9"]
    for line, column in zip(ax.lines, (6, 7, 8, 9), strict=True):
        np.testing.assert_array_equal(line.get_xdata(), np.arange(60))
        np.testing.assert_allclose(line.get_ydata(), table[:60, column], atol=1e-12)
    assert ax.get_xlabel() == "Row (position)" and ax.get_ylabel() and ax.get_title()
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["Col 6", "Col 7", "Col 8", "Col 9"]
    assert_readable(fig, title=True)


@pytest.mark.parametrize("kwargs, message", [
    ({"columns": (6, 32)}, r"columns must be column indices in \[0, 31\] of P, got \(6, 32\)"),
    ({"columns": ()}, r"columns must be column indices in \[0, 31\] of P, got \(\)"),
    ({"num_positions": 81}, r"num_positions must be an int in \[1, 80\] \(the rows of P\), got 81"),
    ({"num_positions": 0}, r"num_positions must be an int in \[1, 80\] \(the rows of P\), got 0"),
])
def test_encoding_columns_validation(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plot.plot_encoding_columns(np.zeros((80, 32)), **kwargs)


@pytest.mark.parametrize("shape", [(60,), (2, 60, 32), (1, 1, 60, 32), (0, 32)])
def test_encoding_plots_want_a_table(shape: tuple[int, ...]) -> None:
    message = re.escape(f"P must have shape (positions, columns) or (1, positions, columns), got {shape}")
    for draw in (plot.plot_encoding_columns, plot.plot_encoding_heatmap):
        with pytest.raises(ValueError, match=message):
            draw(np.zeros(shape))


@needs_matplotlib
def test_encoding_heatmap_shows_the_table_with_a_colour_bar() -> None:
    table = sinusoid_table(60, 32)
    fig = plot.plot_encoding_heatmap(table)
    (ax,) = image_axes(fig)
    np.testing.assert_allclose(ax.images[0].get_array(), table, atol=1e-12)
    assert ax.get_xlabel() == "Column (encoding dimension)" and ax.get_ylabel() == "Row (position)"
    assert_readable(fig, title=True)


@needs_matplotlib
def test_drawing_into_given_axes_returns_their_figure() -> None:
    from matplotlib.figure import Figure

    fig = Figure(layout="constrained")
    left, right = fig.subplots(1, 2)
    assert plot.plot_encoding_columns(np.zeros((60, 10)), ax=left) is fig
    assert plot.plot_encoding_heatmap(np.zeros((60, 10)), ax=right) is fig
    assert left.lines and right.images
    outer = Figure(layout="constrained")
    (inner,) = outer.subfigures(1, 1, squeeze=False)[0]
    assert plot.plot_encoding_columns(np.zeros((60, 10)), ax=inner.subplots()) is outer


# -- kernel regression and the Nadaraya-Watson width -------------------------------------------


@needs_matplotlib
def test_kernel_regression_plot() -> None:
    data = demo.nadaraya_watson_data(seed=3)
    mean = np.full_like(data.x_test, data.y_train.mean())
    fig = plot.plot_kernel_regression(data.x_train, data.y_train, data.x_test, data.y_truth,
                                      {"Mean": mean, "Truth + 1": data.y_truth + 1})
    (ax,) = fig.axes
    assert [line.get_label() for line in ax.lines] == ["Truth", "Samples", "Mean", "Truth + 1"]
    np.testing.assert_array_equal(ax.lines[1].get_xdata(), data.x_train)
    np.testing.assert_array_equal(ax.lines[1].get_ydata(), data.y_train)
    assert ax.lines[1].get_linestyle() == "None"  # samples are dots
    np.testing.assert_allclose(ax.lines[3].get_ydata(), data.y_truth + 1)
    assert ax.get_xlabel() == "x" and ax.get_ylabel() == "y"
    assert_readable(fig, title=True)


@pytest.mark.parametrize("args, message", [
    ((np.zeros(5), np.zeros(4), np.zeros(3), np.zeros(3)),
     r"y_train must be a non-empty 1-D array like x_train \(5,\), got shape \(4,\)"),
    ((np.zeros(5), np.zeros(5), np.zeros(3), np.zeros(2)),
     r"y_truth must be a non-empty 1-D array like x_test \(3,\), got shape \(2,\)"),
    ((np.zeros((5, 1)), np.zeros(5), np.zeros(3), np.zeros(3)),
     r"x_train must be a non-empty 1-D array, got shape \(5, 1\)"),
])
def test_kernel_regression_validation(args: tuple[np.ndarray, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plot.plot_kernel_regression(*args, {})
    with pytest.raises(ValueError, match=r"predictions\['fit'\] must be a non-empty 1-D array like x_test"):
        plot.plot_kernel_regression(np.zeros(5), np.zeros(5), np.zeros(3), np.zeros(3), {"fit": np.zeros(4)})


def leave_one_out_loss(w: float, x: np.ndarray, y: np.ndarray) -> float:
    """Mean of (prediction - y_i)^2 / 2, point i predicted from the other points, written out."""
    total = 0.0
    for i in range(len(x)):
        others = np.arange(len(x)) != i
        scores = -0.5 * ((x[i] - x[others]) * w) ** 2
        weights = np.exp(scores - scores.max())
        total += (weights @ y[others] / weights.sum() - y[i]) ** 2 / 2
    return total / len(x)


# -- the pictures of `demo --out` ----------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    if not HAVE_MATPLOTLIB:
        pytest.skip('needs matplotlib (the "plot" extra)')
    out = tmp_path_factory.mktemp("figures") / "new"  # a directory the demo creates
    return cli.demo("numpy", out), out


def test_demo_out_writes_the_five_pictures(demo_run: tuple[str, Path]) -> None:
    from matplotlib.image import imread

    text, out = demo_run
    names = ["encoding_columns.png", "encoding_heatmap.png", "attention_heatmaps.png",
             "nadaraya_watson_fit.png", "nadaraya_watson_weights.png"]
    assert sorted(p.name for p in out.iterdir()) == sorted(names)
    for name in names:
        assert f"wrote {out / name}" in text.splitlines()
        pixels = imread(out / name)
        assert pixels.shape[0] >= 250 and pixels.shape[1] >= 400, (name, pixels.shape)
        assert pixels[..., :3].std() > 0.05, name  # not a blank page


def test_demo_out_prints_the_binary_table(demo_run: tuple[str, Path]) -> None:
    text, _ = demo_run
    lines = [line.strip() for line in text.splitlines()]
    for i in range(8):
        assert f"{i} in binary is {i // 4}{i // 2 % 2}{i % 2}" in lines


def test_demo_width_minimises_the_leave_one_out_loss(demo_run: tuple[str, Path]) -> None:
    text, _ = demo_run
    match = re.search(r"Nadaraya-Watson: w = ([0-9.]+) minimises the leave-one-out loss", text)
    assert match, text
    w = float(match.group(1))
    data = demo.nadaraya_watson_data(seed=0)
    x, y = data.x_train.astype(np.float64), data.y_train.astype(np.float64)
    grid = [leave_one_out_loss(float(v), x, y) for v in np.geomspace(0.1, 100, 300)]
    best = leave_one_out_loss(w, x, y)
    assert best <= min(grid) + 1e-6
    assert best < leave_one_out_loss(1.0, x, y) - 0.05
    assert best < leave_one_out_loss(w * 0.95, x, y) and best < leave_one_out_loss(w * 1.05, x, y)


@needs_matplotlib
def test_demo_figures_are_readable() -> None:
    from backends import numpy as numpy_backend

    weights = np.random.default_rng(0).dirichlet(np.ones(4), size=(2, 5, 4))  # (B, H, Q, K)
    figures, _ = cli.demo_figures(numpy_backend.OPS, weights, [4, 4], sinusoid_table(60, 32))
    assert list(figures) == ["encoding_columns.png", "encoding_heatmap.png", "attention_heatmaps.png",
                             "nadaraya_watson_fit.png", "nadaraya_watson_weights.png"]
    for fig in figures.values():
        assert_readable(fig, title=True)
    # the fit's weights: one row per test input, one column per training input, rows sum to 1
    panels = image_axes(figures["nadaraya_watson_weights.png"])
    assert [ax.get_title() for ax in panels] == ["Non-parametric (w = 1)", "Parametric (w = 4.93)"]
    for ax in panels:
        np.testing.assert_allclose(np.asarray(ax.images[0].get_array()).sum(axis=1), 1, atol=1e-5)
        assert ax.images[0].get_array().shape == (50, 50)


# -- arrays of every backend -------------------------------------------------------------------


@needs_matplotlib
def test_plots_take_arrays_of_every_backend(backend: str) -> None:
    h = Harness(backend)
    matrices = np.random.default_rng(2).random((2, 2, 3, 5)).astype(np.float32)
    fig = plot.show_heatmaps(h.array(matrices), "Keys", "Queries")
    np.testing.assert_array_equal(image_axes(fig)[0].images[0].get_array(), matrices[0, 0])
    table = sinusoid_table(60, 16).astype(np.float32)
    (ax,) = plot.plot_encoding_columns(h.array(table[None])).axes
    np.testing.assert_array_equal(ax.lines[0].get_ydata(), table[:60, 6])
