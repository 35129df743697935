"""The test matrix's measurements as a Markdown table: ``python -m tools.matrix``.

Run from the repository root (``tox -e report`` does, as the last env of ``tox``). It reads the
JSON files the test suite wrote (one per backend, see ``tests/report.py``) and writes the table
into the site's page ``docs/test-matrix.md`` between :data:`MATRIX_START` and
:data:`MATRIX_END`. Errors are printed as one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tools import markdown

#: The markers in docs/test-matrix.md between which ``matrix`` writes its table.
MATRIX_START, MATRIX_END = "<!-- matrix:start -->", "<!-- matrix:end -->"
#: The page the table is written into, from the repository root.
PAGE = "docs/test-matrix.md"
_DTYPE_ORDER = ("float64", "float32", "float16", "bfloat16")
_LAYER_ORDER = ("DotProductAttention", "AdditiveAttention", "MultiHeadAttention",
                "RelativeMultiHeadAttention", "PositionalEncoding", "LearnedPositionalEncoding",
                "PositionWiseFFN", "AddNorm", "TransformerEncoderBlock", "TransformerEncoder",
                "TransformerDecoderBlock", "TransformerDecoder", "Transformer", "NadarayaWatson")


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
        Markdown, without the page's markers.
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
        f"Generated {now:%Y-%m-%d %H:%M} UTC by `python -m tools.matrix` (the last "
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
        "float16/bfloat16 gradients of the encoder and decoder layers, which must be finite but are not "
        "bounded: a ReLU follows rounded stages and flips (see `tests/harness.py`). "
        "`numpy` float64 is the reference itself, which `tests/naive.py` checks. "
        "n/a: a dtype the backend does not compute in, or, for `keras-jax` float16 and `nnx` "
        "bfloat16, one the JAX column leaves to the `jax` env (each runs one half precision; "
        "`tests/matrix.py`). "
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


def matrix(directory: str | Path, page: str | Path | None) -> str:
    """Builds the table from a directory of reports; writes it into ``page`` unless None."""
    body = matrix_table(load_reports(directory))
    if page is not None:
        write_between_markers(page, body)
    return body


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m tools.matrix", description=__doc__.split("\n")[0])
    parser.add_argument("directory", nargs="?", default="reports",
                        help="where the test runs wrote <backend>.json (default: reports)")
    parser.add_argument("--page", default=PAGE,
                        help=f"file to write the table into, between {MATRIX_START} and "
                             f"{MATRIX_END} (default: {PAGE})")
    parser.add_argument("--stdout", action="store_true", help="print the table, write no file")
    args = parser.parse_args(argv)
    try:
        body = matrix(args.directory, None if args.stdout else args.page)
    except (ValueError, TypeError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(body if args.stdout else f"wrote the test matrix table into {args.page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
