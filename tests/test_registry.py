"""Backend selection: names, aliases, the env var, set/use_backend, lazy imports, inference."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import attention_core as ac
from attention_core import registry

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if k != "ATTENTION_CORE_BACKEND"}
    full_env.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO, env=full_env, timeout=300)


def test_fixed_names() -> None:
    assert registry.BACKENDS == ("numpy", "torch", "tensorflow", "jax", "mxnet")
    assert registry.ENV_VAR == "ATTENTION_CORE_BACKEND"
    for alias, name in {"pytorch": "torch", "tf": "tensorflow", "keras": "tensorflow",
                        "flax": "jax", "gluon": "mxnet", "NumPy": "numpy"}.items():
        assert registry.canonical_name(alias) == name


def test_unknown_name_lists_valid_names() -> None:
    with pytest.raises(ValueError, match=r"unknown backend 'theano'; expected one of numpy, torch, "
                                         r"tensorflow, jax, mxnet \(aliases: pytorch->torch"):
        ac.set_backend("theano")
    with pytest.raises(ValueError, match="unknown backend"), ac.use_backend("cntk"):
        pass


def test_uninstalled_backend_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "mxnet" else real(name, *a))
    with pytest.raises(ac.BackendNotInstalledError, match=r"backend 'mxnet' needs mxnet, which is "
                                                          r"not installed; install it with: pip install"):
        ac.set_backend("gluon")
    assert issubclass(ac.BackendNotInstalledError, ImportError)
    assert "mxnet" not in ac.available_backends()
    assert ac.backend() == "numpy"  # nothing changed


def test_env_var_selects_default_and_bad_value_fails() -> None:
    ok = run_python("import attention_core as ac; print(ac.backend())", ATTENTION_CORE_BACKEND="NUMPY")
    assert ok.stdout.strip() == "numpy"
    bad = run_python("import attention_core as ac; ac.backend()", ATTENTION_CORE_BACKEND="foo")
    assert "ValueError: ATTENTION_CORE_BACKEND='foo': unknown backend 'foo'" in bad.stderr


def test_default_is_numpy() -> None:
    out = run_python("import attention_core as ac; print(ac.backend(), ac.available_backends()[0])")
    assert out.stdout.split() == ["numpy", "numpy"]


def test_importing_the_packages_imports_no_framework() -> None:
    code = ("import attention_core, backends, attention_core.layers, sys; "
            "print(sorted(m for m in ('torch','tensorflow','jax','mxnet','keras','flax') "
            "if m in sys.modules))")
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_use_backend_nests_and_restores() -> None:
    base = ac.backend()
    with ac.use_backend("numpy") as name:
        assert name == "numpy" == ac.backend()
    assert ac.backend() == base


def test_use_backend_is_context_local() -> None:
    names = ac.available_backends()
    for name in names:  # imported here: MXNet's NumPy mode (npx.set_np) is per thread
        registry.load(name)
    seen: dict[int, list[str]] = {}
    barrier = threading.Barrier(8)

    def work(i: int) -> None:
        name = names[i % len(names)]
        with ac.use_backend(name):
            barrier.wait()
            seen[i] = [ac.backend() for _ in range(50)]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, got in seen.items():
        assert set(got) == {names[i % len(names)]}
    assert ac.backend() == "numpy"


def test_layers_follow_the_active_backend() -> None:
    from backends.numpy import MultiHeadAttention

    with ac.use_backend("numpy"):
        assert ac.MultiHeadAttention is MultiHeadAttention
        assert ac.layers.MultiHeadAttention is MultiHeadAttention
    with pytest.raises(AttributeError):
        ac.NoSuchLayer  # noqa: B018


def test_backend_of_array_types(backend: str) -> None:
    from tests.harness import Harness

    h = Harness(backend)
    assert registry.backend_of(h.array(np.zeros(3, np.float32))) == backend
    with pytest.raises(TypeError, match="expected an array of numpy, torch, tensorflow, jax or "
                                        "mxnet, got list"):
        registry.backend_of([1.0, 2.0])


def test_set_backend_sets_process_default() -> None:
    out = run_python("import attention_core as ac; ac.set_backend('numpy'); print(ac.backend())")
    assert out.stdout.strip() == "numpy"


def test_a_backend_imported_by_the_user_is_found_while_torch_compile_traces(backend: str) -> None:
    """``torch.compile(fullgraph=True)`` of the functional API, first thing in a process whose
    user imported ``backends.torch`` (not through the registry): the registry finds the module
    without its lock, which Dynamo cannot enter."""
    if backend != "torch":
        pytest.skip("torch.compile")
    done = run_python(
        "import torch, attention_core as ac, backends.torch\n"
        "q = torch.randn(2, 3, 8)\n"
        "f = torch.compile(lambda q: ac.dot_product_attention(q, q, q), fullgraph=True)\n"
        "print(float((f(q) - ac.dot_product_attention(q, q, q)).abs().max()))\n")
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout.split()[-1]) <= 1e-6


def test_tensorflow_is_unavailable_while_keras_runs_elsewhere(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``backends.tensorflow`` holds Keras layers on TensorFlow: while Keras is set to JAX or
    torch (``KERAS_BACKEND`` or ``keras.json``), it is not offered as available (loading it
    would raise ImportError), so code that takes every available backend works there."""
    monkeypatch.delitem(sys.modules, "keras", raising=False)  # what Keras would choose
    monkeypatch.setenv("KERAS_BACKEND", "jax")
    assert registry.keras_backend() == "jax"
    assert "tensorflow" not in ac.available_backends()
    monkeypatch.delenv("KERAS_BACKEND")
    monkeypatch.setenv("KERAS_HOME", str(tmp_path))
    assert registry.keras_backend() is None  # no keras.json: Keras' default, TensorFlow
    (tmp_path / "keras.json").write_text('{"backend": "torch"}')
    assert registry.keras_backend() == "torch"
    assert "tensorflow" not in ac.available_backends()
    (tmp_path / "keras.json").write_text('{"backend": "tensorflow"}')
    assert ("tensorflow" in ac.available_backends()) == registry.is_installed("tensorflow")
