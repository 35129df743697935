"""A pytest plugin (loaded by conftest.py): what the matrix measured, one JSON file per backend.

Every cell of ``tests/test_reference_matrix.py`` calls :func:`record` with the max |diff| it
measured for each quantity (before it asserts, so a failing cell is reported with its real
numbers). At the end of the session, each backend that ran cells gets
``<dir>/<backend>.json``, ``<dir>`` being ``$ATTENTION_CORE_REPORT_DIR`` or ``reports/`` in the
repository (git-ignored). ``python -m tools.matrix`` (and ``tox -e report``) turn the
files into the Markdown table in docs/test-matrix.md.

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

Other test modules count their cases with :func:`count`; each counted group becomes one more
key of the file, e.g. ``"bad_input": {"cases": 96, "ran": 96, "passed": 96, "failed": []}``
(``tests/test_errors.py``): ``cases`` the size of the group's table, ``ran`` the cases this
run ran, ``passed`` those that passed, ``failed`` their names otherwise. The counts ride
along in the file of a backend that ran matrix cells (a run without them writes no file).

The property tests (``tests/test_properties.py``) add ``"properties": {"<test>": examples, ...}``,
the Hypothesis examples each ran (and passed), by :func:`record_properties`.
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
from tests.harness import COLUMNS, MODES, TOLERANCE, mode_name

ENV_VAR = "ATTENTION_CORE_REPORT_DIR"
DEFAULT_DIR = Path(__file__).resolve().parent.parent / "reports"
SCHEMA = 1
#: Set (to anything) to merge into an existing ``<backend>.json`` instead of replacing it: a
#: second process of the same env adds its cells (keras-jax's float64 cells run under
#: ``JAX_ENABLE_X64``, see tox.ini).
MERGE_VAR = "ATTENTION_CORE_REPORT_MERGE"

_CELLS: dict[str, list[dict[str, Any]]] = {}
#: key -> backend -> (cases in the table, case name -> passed)
_COUNTS: dict[str, dict[str, tuple[int, dict[str, bool]]]] = {}


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


def count(key: str, backend: str, case: str, passed: bool, cases: int) -> None:
    """Counts one case of a table of ``cases`` cases (e.g. a bad-input row) as run on ``backend``.

    Written as ``document[key] = {"cases", "ran", "passed", "failed"}`` (see the module
    docstring). A case counted twice keeps its last result.
    """
    _COUNTS.setdefault(key, {}).setdefault(backend, (cases, {}))[1][case] = passed


def counted(backend: str) -> dict[str, dict[str, Any]]:
    """The counted groups of one backend, as they are written into its file."""
    out = {}
    for key, by_backend in sorted(_COUNTS.items()):
        if backend in by_backend:
            cases, results = by_backend[backend]
            out[key] = {"cases": cases, "ran": len(results), "passed": sum(results.values()),
                        "failed": sorted(name for name, ok in results.items() if not ok)}
    return out


#: backend -> property test name -> examples it ran (tests/test_properties.py)
_PROPERTIES: dict[str, dict[str, int]] = {}


def record_properties(backend: str, test: str, examples: int) -> None:
    """Keeps how many Hypothesis examples one property test ran on ``backend`` (all passed:
    a failing test does not get here). Written as ``"properties": {test: examples, ...}``."""
    _PROPERTIES.setdefault(backend, {})[test] = examples


def properties(backend: str) -> dict[str, dict[str, int]]:
    """``{"properties": {...}}`` for a backend whose property tests ran, else ``{}``."""
    ran = _PROPERTIES.get(backend)
    return {"properties": dict(sorted(ran.items()))} if ran else {}


#: backend -> key -> measurements of other tests (``"concurrency"``, ``"scale_out"``)
_SECTIONS: dict[str, dict[str, dict[str, Any]]] = {}


def section(backend: str, key: str, value: dict[str, Any]) -> None:
    """Keeps a test module's measurements as ``key`` of ``<backend>.json`` (last call wins)."""
    _SECTIONS.setdefault(backend, {})[key] = value


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
    column = COLUMNS.get(backend)
    arrays = column.arrays if column else backend
    keras = ["keras"] if column and column.keras_backend else []
    names = [*keras, *registry.FRAMEWORKS.get(arrays, ()), "numpy"]
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
            "modes": {mode: mode_name(backend, mode) for mode in MODES.get(backend, ())},
            **counted(backend),
            **properties(backend),
            **dict(sorted(_SECTIONS.get(backend, {}).items())),
            "cells": measured,
        }
        path = directory / f"{backend}.json"
        if os.environ.get(MERGE_VAR) and path.exists():
            document = _merged(json.loads(path.read_text()), document)
            measured = document["cells"]
        head = json.dumps({k: v for k, v in document.items() if k != "cells"}, indent=1)
        rows = ",\n".join(f"  {json.dumps(cell)}" for cell in measured)  # one line per cell
        path.write_text(f'{head[:-2]},\n "cells": [\n{rows}\n ]\n}}\n')
        paths.append(path)
    return paths


def _merged(earlier: dict[str, Any], now: dict[str, Any]) -> dict[str, Any]:
    """``now`` written over ``earlier``, a file of the same backend from an earlier run.

    Cells are keyed by (layer, case, dtype, mode): this run's replace the earlier run's, the
    rest stay; keys this run did not write (counts of modules it did not run) stay too.
    """
    if earlier.get("schema") != now["schema"] or earlier.get("backend") != now["backend"]:
        raise ValueError(f"{MERGE_VAR}: the file for {now['backend']!r} holds another schema "
                         f"or backend ({earlier.get('schema')!r}, {earlier.get('backend')!r})")

    def key(cell: dict[str, Any]) -> tuple[str, ...]:
        return cell["layer"], cell["case"], cell["dtype"], cell["mode"]

    ran = {key(cell) for cell in now["cells"]}
    kept = [cell for cell in earlier["cells"] if key(cell) not in ran]
    named = ", ".join(str(e) for e in (earlier.get("tox_env"), now["tox_env"]) if e)
    envs = dict.fromkeys(e.strip() for e in named.split(",") if e.strip())
    return {**earlier, **now, "tox_env": ", ".join(envs) or None, "cells": kept + now["cells"]}


#: What a pytest-xdist worker sends its controller (``workeroutput``) under this key.
WORKER_KEY = "attention_core_report"


def _state() -> str:
    """Everything recorded in this process, as JSON (for the controller of xdist workers)."""
    counts = {k: {b: [n, r] for b, (n, r) in by.items()} for k, by in _COUNTS.items()}
    return json.dumps({"cells": _CELLS, "counts": counts, "properties": _PROPERTIES,
                       "sections": _SECTIONS})


def _merge(state: str) -> None:
    """Adds a worker's records (:func:`_state`) to this process's."""
    loaded = json.loads(state)
    for backend, cells in loaded["cells"].items():
        _CELLS.setdefault(backend, []).extend(cells)
    for key, by_backend in loaded["counts"].items():
        for backend, (cases, results) in by_backend.items():
            _COUNTS.setdefault(key, {}).setdefault(backend, (cases, {}))[1].update(results)
    for backend, ran in loaded["properties"].items():
        _PROPERTIES.setdefault(backend, {}).update(ran)
    for backend, sections in loaded["sections"].items():
        _SECTIONS.setdefault(backend, {}).update(sections)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Writes the files; a pytest-xdist worker hands its records to the controller instead."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput[WORKER_KEY] = _state()
    elif _CELLS:
        write(report_dir())


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """pytest-xdist: a worker finished; keep what it recorded."""
    state = getattr(node, "workeroutput", {}).get(WORKER_KEY)
    if state is not None:
        _merge(state)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _CELLS:
        where = report_dir()
        counts = ", ".join(f"{b} {len(c)} cells" for b, c in sorted(_CELLS.items()))
        terminalreporter.write_line(f"matrix report: {counts} -> {where}/")
    for key, by_backend in sorted(_COUNTS.items()):
        parts = []
        for b in sorted(by_backend):
            group = counted(b)[key]
            part = f"{b} {group['passed']}/{group['cases']} passed"
            if group["ran"] != group["cases"]:
                part += f" ({group['ran']} ran)"
            if b not in _CELLS:
                part += " (not written: no matrix cells ran)"
            parts.append(part)
        terminalreporter.write_line(f"{key}: {', '.join(parts)}")


@pytest.hookimpl(specname="pytest_terminal_summary")
def pytest_terminal_summary_properties(terminalreporter: Any) -> None:
    """One line per backend: the property tests' examples (``record_properties``)."""
    for backend, ran in sorted(_PROPERTIES.items()):
        note = "" if backend in _CELLS else " (not written: no matrix cells ran)"
        terminalreporter.write_line(
            f"properties: {backend} {sum(ran.values())} examples in {len(ran)} tests{note}")
