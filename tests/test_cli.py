"""``python -m attention_core``: demo (and its pictures), info, and one-line errors; nothing else.

The benchmarks, the matrix table and the worked examples are run from the repository
(``benchmarks/``, ``tools/``, ``examples/``), and no module of the package imports a framework.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import test_backends

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k != "ATTENTION_CORE_BACKEND"}
    full.update(env)
    return subprocess.run([sys.executable, "-m", "attention_core", *args], capture_output=True,
                          text=True, cwd=REPO, env=full, timeout=300)


def test_demo_default_is_numpy() -> None:
    out = cli("demo")
    assert out.returncode == 0, out.stderr
    assert "backend: numpy" in out.stdout
    assert "output shape: (2, 4, 100)" in out.stdout
    assert "attention weights shape: (2, 5, 4, 4)" in out.stdout
    assert "table P shape: (1, 1000, 32)" in out.stdout
    assert "in binary is" not in out.stdout and "wrote" not in out.stdout  # pictures only with --out


def test_demo_on_each_backend(backend: str) -> None:
    out = cli("demo", "--backend", backend)
    assert out.returncode == 0, out.stderr
    assert f"backend: {backend}" in out.stdout and "output shape: (2, 4, 100)" in out.stdout
    # example 0 sees 3 keys, example 1 sees 2: the printed weights show it
    line0 = next(x for x in out.stdout.splitlines() if "example 0, head 0" in x)
    line1 = next(x for x in out.stdout.splitlines() if "example 1, head 0" in x)
    assert line0.count("0.3333") == 3 and line1.count("0.5") == 2


PICTURES = ["attention_heatmaps.png", "encoding_columns.png", "encoding_heatmap.png",
            "nadaraya_watson_fit.png", "nadaraya_watson_weights.png"]


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib")
def test_demo_out_on_each_backend(backend: str, tmp_path: Path) -> None:
    out = cli("demo", "--backend", backend, "--out", str(tmp_path / "pictures"))
    assert out.returncode == 0, out.stderr
    assert f"backend: {backend}" in out.stdout and "output shape: (2, 4, 100)" in out.stdout
    assert "  5 in binary is 101" in out.stdout.splitlines()
    assert sorted(p.name for p in (tmp_path / "pictures").iterdir()) == PICTURES
    for name in PICTURES:
        assert f"wrote {tmp_path / 'pictures' / name}" in out.stdout
        assert (tmp_path / "pictures" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_out_without_matplotlib_is_a_one_line_error(tmp_path: Path) -> None:
    code = ("import sys\nsys.modules['matplotlib'] = None  # as if not installed\n"
            "from attention_core.__main__ import main\nsys.exit(main(sys.argv[1:]))")
    full = {k: v for k, v in os.environ.items() if k != "ATTENTION_CORE_BACKEND"}
    out = subprocess.run([sys.executable, "-c", code, "demo", "--out", str(tmp_path / "pictures")],
                         capture_output=True, text=True, cwd=REPO, env=full, timeout=300)
    assert out.returncode == 2
    assert out.stderr == ('error: plotting needs matplotlib, which is not installed: '
                          'pip install ".[plot]" in a checkout of attention-core, or '
                          'pip install "attention-core[plot]" from the package index\n')
    assert not (tmp_path / "pictures").exists()


def test_demo_follows_env_var() -> None:
    out = cli("demo", ATTENTION_CORE_BACKEND="numpy")
    assert "backend: numpy" in out.stdout


def test_info_lists_every_backend_and_marks_the_active_one() -> None:
    out = cli("info")
    assert out.returncode == 0
    lines = out.stdout.splitlines()
    for name in ("numpy", "torch", "tensorflow", "jax", "mxnet"):
        assert any(line[2:].startswith(name) for line in lines), name
    assert any(line.startswith("* numpy") for line in lines)


def test_info_starts_with_the_package_version() -> None:
    import attention_core

    out = cli("info")
    assert out.stdout.splitlines()[0] == f"attention-core {attention_core.__version__}"


@pytest.mark.skipif("numpy" not in test_backends(), reason="run once, in the numpy env")
def test_the_version_has_one_place() -> None:
    tomllib = pytest.importorskip("tomllib")
    import attention_core

    project = tomllib.loads((Path(REPO) / "pyproject.toml").read_text())
    assert "version" not in project["project"] and project["project"]["dynamic"] == ["version"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "attention_core.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", attention_core.__version__)


@pytest.mark.parametrize("args, env, message", [
    (("demo", "--backend", "theano"), {}, "error: unknown backend 'theano'"),
    (("info",), {"ATTENTION_CORE_BACKEND": "bogus"}, "error: ATTENTION_CORE_BACKEND='bogus'"),
])
def test_errors_are_one_line(args: tuple[str, ...], env: dict[str, str], message: str) -> None:
    out = cli(*args, **env)
    assert out.returncode == 2
    assert out.stderr.startswith(message)
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr


@pytest.mark.parametrize("command", ["bench", "matrix"])
def test_only_demo_and_info_are_commands(command: str) -> None:
    out = cli(command)
    assert out.returncode == 2
    assert f"invalid choice: '{command}' (choose from 'demo', 'info')" in out.stderr


FRAMEWORKS = {"torch", "tensorflow", "jax", "jaxlib", "flax", "mxnet", "keras", "optax"}


def framework_imports(source: str) -> list[tuple[int, str]]:
    """``(line, module)`` of every import of a framework in a module's source, at any depth."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [(node.lineno, n) for n in names if n.split(".")[0] in FRAMEWORKS]
    return found


def test_the_scan_finds_lazy_imports() -> None:
    source = "import numpy\n\ndef f():\n    import torch.nn as nn\n    from jax import numpy\n"
    assert framework_imports(source) == [(4, "torch.nn"), (5, "jax")]


def test_no_module_of_the_package_imports_a_framework() -> None:
    """Not at import time, and not inside a function either: only ``backends/<name>/`` may."""
    modules = sorted((Path(REPO) / "attention_core").rglob("*.py"))
    assert len(modules) > 10  # the scan saw the package
    found = [f"{path.relative_to(REPO)}:{line} imports {name}" for path in modules
             for line, name in framework_imports(path.read_text())]
    assert found == []
