"""Command line: ``python -m attention_core {demo,info,matrix,bench}``.

``demo`` runs the source chapter's example (batch 2, 4 queries, 100 hiddens, 5 heads,
``valid_lens`` [3, 2]) on a backend and prints what it computed (with ``--out DIR`` it also draws
the notes' pictures into DIR, see :func:`demo_figures`); ``info`` lists the backends;
``matrix`` turns the test matrix's measurements (JSON files written by the test suite, one per
backend) into a Markdown table and writes it into README.md between its markers; ``bench``
runs the benchmarks (:mod:`attention_core.bench.cli`), or merges their results into README.md;
``bench complexity`` times a convolution, an RNN and self-attention against n on one backend
(:mod:`attention_core.bench.complexity`).
Errors are printed as one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from attention_core import examples, files, markdown, plot, registry
from attention_core.attention import nadaraya_watson
from attention_core.bench import cli as bench_cli

if TYPE_CHECKING:  # matplotlib is the optional "plot" extra
    from matplotlib.figure import Figure  # type: ignore[import-not-found, unused-ignore]


def info() -> str:
    """Describes every backend: installed or not, versions, and which one is active."""
    active = registry.backend()
    lines = [f"active backend: {active} (set {registry.ENV_VAR} or use set_backend/use_backend)"]
    for name in registry.BACKENDS:
        versions = [(d, registry.module_version(d)) for d in registry.FRAMEWORKS[name]]
        if registry.is_installed(name):
            state = ", ".join(f"{d} {v}" for d, v in versions if v) or "installed"
        else:
            state = f"not installed ({registry.PIP[name]})"
        mark = "*" if name == active else " "
        lines.append(f"{mark} {name:<11} {state}")
    aliases = ", ".join(f"{a}->{c}" for a, c in registry.ALIASES.items())
    lines.append(f"aliases: {aliases}")
    return "\n".join(lines)


def demo(name: str | None = None, out: str | Path | None = None) -> str:
    """Runs the chapter's multi-head attention and positional encoding examples.

    Args:
        name: The backend (default: the active one).
        out: Also write the pictures of :func:`demo_figures` into this directory (created if
            missing) as PNG files, and add the notes' binary table of 0..7 to the text. Needs
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
    rows, head columns) heatmaps; and the Nadaraya-Watson example of the notes, computed on the
    backend of ``ops``: the non-parametric fit (``w = 1``) and the parametric one, whose width
    :func:`attention_core.examples.fit_width` fits on NumPy by minimising the leave-one-out loss
    with a golden-section search on ``log w`` (no autodiff), and the weights of both fits.

    Args:
        ops: The backend's ops (the Nadaraya-Watson pooling runs on this backend).
        weights: The multi-head layer's weights ``(B, H, Q, K)``.
        valid_lens: The ``valid_lens`` of the demo, one per example, for the row labels.
        table: The positional-encoding rows the layer added, ``(positions, columns)``.

    Returns:
        The figures, keyed by file name, and a line saying which width was fitted.
    """
    data = examples.nadaraya_watson_data(seed=0)
    x_train, y_train, x_test = (ops.from_numpy(a) for a in (data.x_train, data.y_train, data.x_test))
    w = examples.fit_width(data)
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
              f"({examples.leave_one_out_loss(w, data):.4f}; {examples.leave_one_out_loss(1.0, data):.4f} "
              "at w = 1)")
    return figures, fitted


# -- matrix: the test matrix's measurements as a Markdown table ------------------------------

#: The markers in README.md between which ``matrix`` writes its table.
MATRIX_START, MATRIX_END = "<!-- matrix:start -->", "<!-- matrix:end -->"
_DTYPE_ORDER = ("float64", "float32", "float16", "bfloat16")
_LAYER_ORDER = ("DotProductAttention", "AdditiveAttention", "MultiHeadAttention",
                "RelativeMultiHeadAttention", "PositionalEncoding", "LearnedPositionalEncoding",
                "PositionWiseFFN", "AddNorm", "TransformerEncoderBlock", "TransformerEncoder",
                "NadarayaWatson")


def load_reports(directory: str | Path) -> list[dict[str, Any]]:
    """Reads the ``<backend>.json`` files the test suite wrote, in the registry's backend order."""
    return markdown.load_backend_documents(
        directory, "*.json",
        lambda doc: isinstance(doc, dict) and doc.get("schema") == 1 and "cells" in doc,
        f"no test matrix reports (<backend>.json) in {Path(directory)}: run tox, or "
        "pytest with ATTENTION_CORE_REPORT_DIR set",
    )


_NONE = "n/a"


def _fmt(value: float | None) -> str:
    if value is None:
        return _NONE
    return "0" if value == 0 else f"{value:.1e}"


def _largest(cells: list[dict[str, Any]], field: str) -> float | None:
    values = [c[field] for c in cells if c.get(field) is not None]
    return max(values) if values else None


def _entry(cells: list[dict[str, Any]], autodiff: bool) -> str:
    """``forward / gradient`` of a group of cells.

    ``(x †)`` is the largest unbounded gradient; ✗ marks a group with a failing cell.
    """
    if not cells:
        return _NONE
    text = _fmt(_largest(cells, "forward"))
    if autodiff:
        bounded, unbounded = _largest(cells, "gradient"), _largest(cells, "gradient_unbounded")
        text += " /" + ("" if bounded is None and unbounded is not None else f" {_fmt(bounded)}")
        if unbounded is not None:
            text += f" ({_fmt(unbounded)} †)"
    return text if all(c["passed"] for c in cells) else f"**✗ {text}**"


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _header(*columns: str) -> list[str]:
    return [_row(list(columns)), _row(["---"] * len(columns))]


def _run_row(report: dict[str, Any]) -> str:
    """One backend's test run: when, which versions, which machine, how many cells passed."""
    machine = report.get("machine", {})
    versions = ", ".join([f"Python {report.get('python', '?')}"] +
                         [f"{k} {v}" for k, v in report.get("versions", {}).items()])
    cells = report["cells"]
    run = f"{sum(c['passed'] for c in cells)} / {len(cells)}"
    if len(cells) != report.get("cells_in_matrix", len(cells)):
        run += f" (a partial run: the matrix has {report['cells_in_matrix']})"
    finished = str(report.get("finished", "?"))[:16].replace("T", " ")
    where = (f"{machine.get('system', '?')} {machine.get('machine', '')}, "
             f"{machine.get('cpu', '?')}, {machine.get('cpus', '?')} CPUs")
    env = f" (tox env `{report['tox_env']}`)" if report.get("tox_env") else ""
    return _row([f"`{report['backend']}`{env}", finished, versions, where, run])


def _reliability_entry(report: dict[str, Any]) -> list[str]:
    """A backend's bad-input, property-test, concurrency and scale-out results, as table cells."""
    bad = report.get("bad_input")
    bad_text = _NONE if bad is None else f"{bad['passed']} / {bad['cases']} passed"
    if bad is not None and bad["ran"] != bad["cases"]:
        bad_text += f" ({bad['cases'] - bad['ran']} do not apply)"
    props = report.get("properties")
    props_text = _NONE if not props else f"{sum(props.values())} examples in {len(props)} tests"
    threads = report.get("concurrency", {})
    thread_text = (f"{threads['threads']} threads x {threads['iterations']}" if "threads" in threads
                   else _NONE)
    scale = report.get("scale_out")
    scale_text = (_NONE if not scale else
                  f"{scale['engine']}: {scale['layer']}, max diff forward {_fmt(scale['forward'])}, "
                  f"gradient {_fmt(scale['gradient'])}")
    return [f"`{report['backend']}`", bad_text, props_text, thread_text, scale_text]


def reliability_table(reports: list[dict[str, Any]]) -> list[str]:
    """The lines of the reliability table; none when no report has its keys."""
    keys = ("bad_input", "properties", "concurrency", "scale_out")
    if not any(k in r for r in reports for k in keys):
        return []
    return ["", "**Reliability**, from the same runs: the bad-input catalogue "
            "(`tests/test_errors.py`), the Hypothesis property tests' examples "
            "(`tests/test_properties.py`), the registry under threads "
            "(`tests/test_concurrency.py`) and the frameworks' own distributed engines against "
            "one process (`tests/test_distributed.py`):", "",
            *_header("backend", "bad calls", "property examples", "use_backend threads",
                     "scale-out"),
            *(_row(_reliability_entry(r)) for r in reports)]


def matrix_table(reports: list[dict[str, Any]], now: datetime.datetime | None = None) -> str:
    """The Markdown section: where the numbers come from, then the tables.

    Args:
        reports: The documents of :func:`load_reports`.
        now: The generation time (default: now, UTC).

    Returns:
        Markdown, without the README markers.
    """
    now = now or datetime.datetime.now(datetime.timezone.utc)
    names = [r["backend"] for r in reports]
    autodiff = {r["backend"]: any(c["gradient"] is not None for c in r["cells"]) for r in reports}
    by_backend = {r["backend"]: r["cells"] for r in reports}

    def entries(mode: str | None = None, **where: Any) -> list[str]:
        """One entry per backend for the cells matching ``where`` (and eager or compiled)."""
        out = []
        for b in names:
            cells = [c for c in by_backend[b] if all(c[k] == v for k, v in where.items())
                     and (mode is None or (c["mode"] == "eager") == (mode == "eager"))]
            out.append(_entry(cells, autodiff[b]))
        return out

    seen = {c["layer"] for b in names for c in by_backend[b]}
    layers = [x for x in _LAYER_ORDER if x in seen] + sorted(seen - set(_LAYER_ORDER))
    seen = {c["dtype"] for b in names for c in by_backend[b]}
    dtypes = [d for d in _DTYPE_ORDER if d in seen] + sorted(seen - set(_DTYPE_ORDER))
    tolerance = reports[0].get("tolerance", {})
    bounds = ", ".join(f"{d} {tolerance[d]:.3g}" for d in dtypes if d in tolerance)
    compiled = "; ".join(f"`{r['backend']}` {name}" for r in reports
                         for m, name in r.get("modes", {}).items() if m != "eager")
    lines = [
        f"Generated {now:%Y-%m-%d %H:%M} UTC by `python -m attention_core matrix` (the last "
        "env of `tox`) from what the test runs below measured; never typed by hand.",
        "",
        *_header("backend", "test run finished (UTC)", "versions", "machine", "cells passed"),
        *(_run_row(r) for r in reports),
        *reliability_table(reports),
        "",
        "Each entry is the largest max |diff| from the float64 reference files, as **outputs "
        "and attention weights / gradients** (by every input and weight; no gradients on "
        f"NumPy). Bounds: {bounds}; for gradients, times the gradient's largest entry when "
        "that is above 1. **✗** marks a group with a cell over its bound. (x †): the "
        "float16/bfloat16 gradients of the encoder block and the encoder, which must be finite but are not "
        "bounded: a ReLU follows rounded stages and flips (see `tests/harness.py`). "
        "`numpy` float64 is the reference itself, which `tests/naive.py` checks. "
        f"Compiled modes: {compiled or 'none'}.",
        "",
        "**float32, every mode**, by layer:",
        "",
        *_header("layer", *(f"`{b}`" for b in names)),
        *(_row([layer, *entries(layer=layer, dtype="float32")]) for layer in layers),
        "",
        "**By dtype and mode**, every layer:",
        "",
        *_header("dtype", "mode", *(f"`{b}`" for b in names)),
    ]
    groups = [(dtype, mode) for dtype in dtypes for mode in ("eager", "compiled")]
    for dtype, mode in groups:
        row = entries(mode, dtype=dtype)
        if any(e != _NONE for e in row):
            lines.append(_row([dtype, mode, *row]))
    lines += ["", "<details><summary>Every layer, dtype and mode</summary>", "",
              *_header("layer", "dtype", "mode", *(f"`{b}`" for b in names))]
    for layer in layers:
        for dtype, mode in groups:
            row = entries(mode, dtype=dtype, layer=layer)
            if any(e != _NONE for e in row):
                lines.append(_row([layer, dtype, mode, *row]))
    lines += ["", "</details>"]
    return "\n".join(lines)


def write_between_markers(path: str | Path, body: str) -> None:
    """Replaces what lies between :data:`MATRIX_START` and :data:`MATRIX_END` in a file."""
    markdown.write_between_markers(path, body, MATRIX_START, MATRIX_END)


def matrix(directory: str | Path, readme: str | Path | None) -> str:
    """Builds the table from a directory of reports; writes it into ``readme`` unless None."""
    body = matrix_table(load_reports(directory))
    if readme is not None:
        write_between_markers(readme, body)
    return body


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m attention_core", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_demo = sub.add_parser("demo", help="run the chapter's example on a backend")
    p_demo.add_argument("--backend", help=f"backend name (default: ${registry.ENV_VAR}, else numpy)")
    p_demo.add_argument("--out", metavar="DIR",
                        help="also draw the pictures into DIR as PNG files and print the binary table "
                             f"of 0..7 (needs matplotlib: {plot.INSTALL_HINT})")
    sub.add_parser("info", help="list backends, versions and the active one")
    p_matrix = sub.add_parser("matrix", help="the test matrix's measurements as a Markdown table, "
                                             "written into README.md")
    p_matrix.add_argument("directory", nargs="?", default="reports",
                          help="where the test runs wrote <backend>.json (default: reports)")
    p_matrix.add_argument("--readme", default="README.md",
                          help=f"file to write the table into, between {MATRIX_START} and "
                               f"{MATRIX_END} (default: README.md)")
    p_matrix.add_argument("--stdout", action="store_true", help="print the table, write no file")
    p_bench = sub.add_parser("bench", help="benchmarks: speed against the native layers, memory, "
                                           "GEMM fraction (or --merge the results into README.md); "
                                           "bench complexity: conv vs RNN vs self-attention")
    bench_cli.configure(p_bench)
    args = parser.parse_args(argv)
    try:
        if args.command == "bench":
            return bench_cli.run(args)
        if args.command == "demo":
            print(demo(args.backend, args.out))
        elif args.command == "matrix":
            body = matrix(args.directory, None if args.stdout else args.readme)
            print(body if args.stdout else f"wrote the test matrix table into {args.readme}")
        else:
            print(info())
    except (ValueError, TypeError, ImportError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
