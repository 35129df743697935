"""A pytest plugin (loaded by conftest.py): what the matrix measured, one JSON file per backend.

Every cell of ``tests/test_reference_matrix.py`` calls :func:`record` with the max |diff| it
measured for each quantity (before it asserts, so a failing cell is reported with its real
numbers). At the end of the session, each backend that ran cells gets
``<dir>/<backend>.json``, ``<dir>`` being ``$ATTENTION_CORE_REPORT_DIR`` or ``reports/`` in the
repository (git-ignored). ``python -m attention_core matrix`` (and ``tox -e report``) turn the
files into the Markdown table in README.md.

File layout (``schema`` 1)::

    {"schema": 1, "backend": "torch", "finished": "2025-01-01T12:00:00+00:00",
     "python": "3.11.9", "versions": {"torch": "2.13.0", "numpy": "2.3.1"},
     "machine": {"system": ..., "machine": ..., "cpu": ..., "cpus": 2},
     "tox_env": "torch", "cells_in_matrix": 496, "tolerance": {"float32": 1e-05, ...},
     "modes": {"compile": "torch.compile(fullgraph=True)", ...},
     "cells": [{"layer": ..., "case": ..., "dtype": ..., "mode": ..., "passed": true,
                "forward": 3.1e-07, "gradient": 1.2e-06, "gradient_unbounded": null,
                "quantities": {"out": [diff, bound], "grad.input.0": [diff, bound], ...},
                "unbounded": []}, ...]}

``forward`` is the largest diff of the output, attention weights and positional table;
``gradient`` the largest of the gradients bounded by the tolerance (None on a backend without
autodiff), ``gradient_unbounded`` the largest of those that are not (see
``tests.harness.LOW_PRECISION_UNBOUNDED_GRADIENTS``).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from attention_core import registry
from tests.harness import MODE_NAMES, MODES, TOLERANCE

ENV_VAR = "ATTENTION_CORE_REPORT_DIR"
DEFAULT_DIR = Path(__file__).resolve().parent.parent / "reports"
SCHEMA = 1

_CELLS: dict[str, list[dict[str, Any]]] = {}


def record(cell: Any, diffs: dict[str, float], bounds: dict[str, float], unbounded: Iterable[str],
           passed: bool) -> None:
    """Keeps one cell's measurements (``cell`` is a :class:`tests.matrix.Cell`)."""
    unbounded = set(unbounded)
    forward = [d for q, d in diffs.items() if not q.startswith("grad.")]
    gradient = [d for q, d in diffs.items() if q.startswith("grad.") and q not in unbounded]
    loose = [d for q, d in diffs.items() if q in unbounded]
    _CELLS.setdefault(cell.backend, []).append({
        "layer": cell.case.layer,
        "case": cell.case.name,
        "dtype": cell.dtype,
        "mode": cell.mode,
        "passed": passed,
        "forward": max(forward) if forward else None,
        "gradient": max(gradient) if gradient else None,
        "gradient_unbounded": max(loose) if loose else None,
        "quantities": {q: [d, bounds[q]] for q, d in diffs.items()},
        "unbounded": sorted(unbounded),
    })


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _versions(backend: str) -> dict[str, str]:
    names = [*registry.FRAMEWORKS.get(backend, ()), "numpy"]
    if backend == "tensorflow" and _version("tensorflow") is None:
        names.insert(0, "tensorflow-cpu")
    found = {name: _version(name) for name in dict.fromkeys(names)}
    return {name: v for name, v in found.items() if v is not None}


def report_dir() -> Path:
    return Path(os.environ.get(ENV_VAR) or DEFAULT_DIR)


def write(directory: Path) -> list[Path]:
    """Writes one file per backend that ran cells; returns the paths."""
    from tests.matrix import cells

    directory.mkdir(parents=True, exist_ok=True)
    finished = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    paths = []
    for backend, measured in sorted(_CELLS.items()):
        document = {
            "schema": SCHEMA,
            "backend": backend,
            "finished": finished,
            "python": platform.python_version(),
            "versions": _versions(backend),
            "machine": {"system": f"{platform.system()} {platform.release()}",
                        "machine": platform.machine(), "cpu": _cpu(), "cpus": os.cpu_count()},
            "tox_env": os.environ.get("TOX_ENV_NAME"),
            "cells_in_matrix": len(cells(backend)),
            "tolerance": TOLERANCE,
            "modes": {mode: MODE_NAMES[mode] for mode in MODES.get(backend, ())},
            "cells": measured,
        }
        path = directory / f"{backend}.json"
        head = json.dumps({k: v for k, v in document.items() if k != "cells"}, indent=1)
        rows = ",\n".join(f"  {json.dumps(cell)}" for cell in measured)  # one line per cell
        path.write_text(f'{head[:-2]},\n "cells": [\n{rows}\n ]\n}}\n')
        paths.append(path)
    return paths


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _CELLS:
        write(report_dir())


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _CELLS:
        where = report_dir()
        counts = ", ".join(f"{b} {len(c)} cells" for b, c in sorted(_CELLS.items()))
        terminalreporter.write_line(f"matrix report: {counts} -> {where}/")
