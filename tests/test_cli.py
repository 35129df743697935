"""``python -m attention_core``: demo and info, and one-line errors."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

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


def test_demo_on_each_backend(backend: str) -> None:
    out = cli("demo", "--backend", backend)
    assert out.returncode == 0, out.stderr
    assert f"backend: {backend}" in out.stdout and "output shape: (2, 4, 100)" in out.stdout
    # example 0 sees 3 keys, example 1 sees 2: the printed weights show it
    line0 = next(x for x in out.stdout.splitlines() if "example 0, head 0" in x)
    line1 = next(x for x in out.stdout.splitlines() if "example 1, head 0" in x)
    assert line0.count("0.3333") == 3 and line1.count("0.5") == 2


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


@pytest.mark.parametrize("args, env, message", [
    (("demo", "--backend", "theano"), {}, "error: unknown backend 'theano'"),
    (("info",), {"ATTENTION_CORE_BACKEND": "bogus"}, "error: ATTENTION_CORE_BACKEND='bogus'"),
])
def test_errors_are_one_line(args: tuple[str, ...], env: dict[str, str], message: str) -> None:
    out = cli(*args, **env)
    assert out.returncode == 2
    assert out.stderr.startswith(message)
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
