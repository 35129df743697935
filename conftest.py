"""Test configuration: the ``backend`` fixture, and the matrix report.

``ATTENTION_CORE_TEST_BACKENDS`` (a comma list) names the backends to test; unset, every
installed backend is tested. A named backend that cannot be loaded fails its tests, it is
never skipped.

The plugin ``tests/report.py`` writes what the matrix measured to
``$ATTENTION_CORE_REPORT_DIR/<backend>.json`` (default ``reports/``).
"""

from __future__ import annotations

import os

import pytest

from tests import harness

pytest_plugins = ["tests.report"]


def test_backends() -> list[str]:
    raw = os.environ.get("ATTENTION_CORE_TEST_BACKENDS", "").strip()
    if not raw:
        return harness.registry.available_backends()
    names = []
    for part in raw.split(","):
        if part.strip():
            try:
                names.append(harness.canonical_name(part))
            except ValueError:
                names.append(part.strip())  # reported as a failure by the fixture
    return names


test_backends.__test__ = False  # type: ignore[attr-defined]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend" in metafunc.fixturenames:
        metafunc.parametrize("backend", test_backends(), indirect=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselects the cells of a column (``tests.harness.COLUMNS``: ``keras-jax`` ...) in test
    modules that do not test layers (no ``COLUMN_TESTS = True``): the functional API and the
    ops of a column's arrays are its backend's, tested in that backend's env."""
    def column_cell(item: pytest.Item) -> bool:
        callspec = getattr(item, "callspec", None)
        name = None if callspec is None else callspec.params.get("backend")
        module = getattr(item, "module", None)
        return name in harness.COLUMNS and not getattr(module, "COLUMN_TESTS", False)

    deselected = [item for item in items if column_cell(item)]
    if deselected:
        items[:] = [item for item in items if not column_cell(item)]
        config.hook.pytest_deselected(items=deselected)


@pytest.fixture
def backend(request: pytest.FixtureRequest) -> str:
    name = request.param
    try:
        harness.load(name)
    except (ImportError, ValueError) as err:
        pytest.fail(f"backend {name!r} was asked for in ATTENTION_CORE_TEST_BACKENDS: {err}")
    return harness.canonical_name(name)
