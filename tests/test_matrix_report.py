"""The matrix report: the plugin writes what the cells measured; ``python -m tools.matrix`` turns
it into the table of docs/test-matrix.md."""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import test_backends
from tests.harness import Harness, tolerance
from tests.matrix import differences, measure
from tests.reference.cases import CASES
from tools.matrix import MATRIX_END, MATRIX_START, PAGE, matrix_table, write_between_markers

REPO = Path(__file__).resolve().parent.parent


def cell(layer: str, dtype: str, mode: str, forward: float, gradient: float | None,
         passed: bool = True, unbounded: float | None = None) -> dict[str, Any]:
    return {"layer": layer, "case": "c", "dtype": dtype, "mode": mode, "passed": passed,
            "forward": forward, "gradient": gradient, "gradient_unbounded": unbounded,
            "quantities": {}, "unbounded": []}


def document(backend: str, cells: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"schema": 1, "backend": backend, "finished": "2030-01-02T03:04:05+00:00",
            "python": "3.11.0", "versions": {backend: "9.9"}, "tox_env": backend,
            "machine": {"system": "Linux", "machine": "x86_64", "cpu": "Some CPU", "cpus": 2},
            "cells_in_matrix": len(cells), "tolerance": {"float32": 1e-5, "float64": 1e-10},
            "modes": {"eager": "eager", "compile": "torch.compile(fullgraph=True)"},
            "cells": cells, **extra}


REPORTS = [
    document("torch", [
        cell("MultiHeadAttention", "float32", "eager", 3.25e-7, 1.5e-6),
        cell("MultiHeadAttention", "float32", "compile", 4.8e-7, 2.5e-6),
        cell("AddNorm", "float64", "eager", 1e-15, 2e-15),
        cell("TransformerEncoderBlock", "bfloat16", "eager", 0.03, None, unbounded=1.5),
    ]),
    document("numpy", [cell("MultiHeadAttention", "float32", "eager", 2.5e-7, None),
                       cell("AddNorm", "float32", "eager", 7e-6, None, passed=False)],
             cells_in_matrix=10),
]


def test_table_shows_the_largest_measurement_per_backend_and_layer() -> None:
    text = matrix_table(sorted(REPORTS, key=lambda r: r["backend"] != "numpy"),
                        now=datetime.datetime(2030, 1, 2, 4, 0))
    lines = text.splitlines()
    assert "Generated 2030-01-02 04:00 UTC" in lines[0]
    run = next(line for line in lines if line.startswith("| `torch`"))
    assert "2030-01-02 03:04" in run and "torch 9.9" in run and "Some CPU" in run
    assert "4 / 4" in run
    numpy_run = next(line for line in lines if line.startswith("| `numpy`"))
    assert "1 / 2 (a partial run: the matrix has 10)" in numpy_run
    header = lines.index("| layer | `numpy` | `torch` |")
    rows = {line.split(" | ")[0][2:]: line for line in lines[header + 2:header + 6]}
    # float32 over every mode: the compiled cell is the larger one
    assert rows["MultiHeadAttention"] == "| MultiHeadAttention | 2.5e-07 | 4.8e-07 / 2.5e-06 |"
    assert rows["AddNorm"] == "| AddNorm | **✗ 7.0e-06** | n/a |"
    assert "| bfloat16 | eager | n/a | 3.0e-02 / (1.5e+00 †) |" in lines
    assert "| float32 | compiled | n/a | 4.8e-07 / 2.5e-06 |" in lines
    assert "| AddNorm | float64 | eager | n/a | 1.0e-15 / 2.0e-15 |" in lines


def test_table_goes_between_the_markers_and_nowhere_else(tmp_path: Path) -> None:
    page = tmp_path / "test-matrix.md"
    page.write_text(f"# title\n\nbefore\n{MATRIX_START}\nold table\n{MATRIX_END}\nafter\n")
    write_between_markers(page, "new table\nline 2")
    assert page.read_text() == (f"# title\n\nbefore\n{MATRIX_START}\nnew table\nline 2\n"
                                  f"{MATRIX_END}\nafter\n")
    page.write_text("no markers\n")
    with pytest.raises(ValueError, match=re.escape(f"has no {MATRIX_START} ... {MATRIX_END}")):
        write_between_markers(page, "x")


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tools.matrix", *args], capture_output=True,
                          text=True, cwd=REPO, timeout=300)


def test_cli_writes_the_page_and_imports_no_framework(tmp_path: Path) -> None:
    for r in REPORTS:
        (tmp_path / f"{r['backend']}.json").write_text(json.dumps(r))
    (tmp_path / "other.json").write_text('{"not": "a report"}')
    page = tmp_path / "test-matrix.md"
    page.write_text(f"intro\n{MATRIX_START}\n{MATRIX_END}\n")
    out = cli(str(tmp_path), "--page", str(page))
    assert out.returncode == 0, out.stderr
    text = page.read_text()
    assert text.startswith(f"intro\n{MATRIX_START}\nGenerated ") and text.endswith(f"{MATRIX_END}\n")
    assert text.index("| `numpy`") < text.index("| `torch`")  # the registry's order
    code = ("import sys; from tools.matrix import main; "
            f"main([{str(tmp_path)!r}, '--stdout']); "
            "print(sorted(m for m in ('torch', 'tensorflow', 'jax', 'mxnet') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.stdout.strip().endswith("[]"), out.stdout + out.stderr


def test_cli_without_reports_says_what_to_run(tmp_path: Path) -> None:
    out = cli(str(tmp_path), "--stdout")
    assert out.returncode == 2
    assert "no test matrix reports" in out.stderr and "run tox" in out.stderr


def test_the_page_has_the_markers() -> None:
    text = (REPO / PAGE).read_text()
    assert text.count(MATRIX_START) == 1 and text.count(MATRIX_END) == 1
    assert text.index(MATRIX_START) < text.index(MATRIX_END)


@pytest.mark.skipif("numpy" not in test_backends(), reason="run once, in the numpy env")
def test_plugin_writes_what_the_cells_measured(tmp_path: Path) -> None:
    """Two cells run in a child pytest; its report holds the differences they measured."""
    env = {**os.environ, "ATTENTION_CORE_TEST_BACKENDS": "numpy",
           "ATTENTION_CORE_REPORT_DIR": str(tmp_path)}
    selection = "numpy-eager-float16-AddNorm-basic or numpy-eager-float32-MultiHeadAttention-mask_4d_bias"
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "tests/test_reference_matrix.py", "-k", selection],
                         capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads((tmp_path / "numpy.json").read_text())
    assert report["backend"] == "numpy" and report["versions"]["numpy"] == np.__version__
    assert report["cells_in_matrix"] > len(report["cells"]) == 2
    h = Harness("numpy")
    for entry in report["cells"]:
        case = next(c for c in CASES if c.layer == entry["layer"] and c.name == entry["case"])
        got, expected = measure(h, case, entry["dtype"], entry["mode"])
        diffs = differences(got, expected)
        assert set(entry["quantities"]) == set(diffs)
        for q, (diff, bound) in entry["quantities"].items():
            assert diff == pytest.approx(diffs[q], rel=1e-12, abs=0.0)
            assert bound == tolerance(q, entry["dtype"], expected[q])
        assert entry["forward"] == max(diffs.values()) and entry["gradient"] is None
        assert entry["passed"] is True


@pytest.mark.skipif("numpy" not in test_backends(), reason="run once, in the numpy env")
def test_a_second_process_merges_its_cells_into_the_file_when_asked(tmp_path: Path) -> None:
    """keras-jax-x64's way: a later run adds its cells to the file (ATTENTION_CORE_REPORT_MERGE),
    replacing those it ran again; without the variable a run replaces the file."""
    first = "numpy-eager-float16-AddNorm-basic"
    second = "numpy-eager-float32-MultiHeadAttention-mask_4d_bias"

    def run(selection: str, tox_env: str, merge: bool) -> dict[str, Any]:
        env = {**os.environ, "ATTENTION_CORE_TEST_BACKENDS": "numpy",
               "ATTENTION_CORE_REPORT_DIR": str(tmp_path), "TOX_ENV_NAME": tox_env}
        env.pop("ATTENTION_CORE_REPORT_MERGE", None)
        if merge:
            env["ATTENTION_CORE_REPORT_MERGE"] = "1"
        out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                              "tests/test_reference_matrix.py", "-k", selection],
                             capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
        assert out.returncode == 0, out.stdout + out.stderr
        report: dict[str, Any] = json.loads((tmp_path / "numpy.json").read_text())
        return report

    def names(report: dict[str, Any]) -> list[str]:
        return [f"{c['dtype']}-{c['layer']}-{c['case']}" for c in report["cells"]]

    assert names(run(first, "a", merge=False)) == ["float16-AddNorm-basic"]
    merged = run(f"{second} or {first}", "b", merge=True)
    assert sorted(names(merged)) == ["float16-AddNorm-basic", "float32-MultiHeadAttention-mask_4d_bias"]
    assert merged["tox_env"] == "a, b"
    merged = run(second, "b", merge=True)  # ran again: replaced, not repeated
    assert sorted(names(merged)) == ["float16-AddNorm-basic", "float32-MultiHeadAttention-mask_4d_bias"]
    assert merged["tox_env"] == "a, b"
    replaced = run(second, "c", merge=False)
    assert names(replaced) == ["float32-MultiHeadAttention-mask_4d_bias"] and replaced["tox_env"] == "c"
