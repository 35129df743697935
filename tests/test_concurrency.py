"""The registry under concurrency: ``use_backend`` from many threads and tasks at once, first loads.

Every thread and every asyncio task sees only its own backend: ``attention_core.backend()``,
the layer classes (``attention_core.MultiHeadAttention``, ``attention_core.layers.*``) and
``registry.get_ops()`` all follow the ``use_backend`` block it is in, however the threads
interleave. The registry loads each backend's adapter, and so its framework, once, even when
many threads ask for it first at the same moment (``tests/distributed/first_load.py``, in a
fresh interpreter so the loads really are first), and a loaded backend stays usable while
another thread's first load of a framework is still running (``tests/distributed/held_load.py``).

The backends used are those of this env: NumPy and the framework the env tests (its
``ATTENTION_CORE_TEST_BACKENDS``). So that every backend name is exercised in every env, one
thread test and the asyncio test replace the loading by stand-in adapter modules.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

import attention_core as ac
from attention_core import layers, registry
from tests.distributed.common import parse, to_report

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

THREADS, ITERATIONS = 16, 200

#: The aliases of each backend (``torch`` -> ``["pytorch"]``).
ALIASES = {b: [a for a, c in registry.ALIASES.items() if c == b] for b in registry.BACKENDS}


def names_for(backend: str) -> list[str]:
    """The names the threads use in ``backend``'s env: NumPy's and the backend's, aliases too."""
    return list(dict.fromkeys(["numpy", "NumPy", backend, *ALIASES[backend]]))


@contextmanager
def frequent_switches() -> Iterator[None]:
    """Makes the interpreter switch threads about every 10 microseconds, to interleave them."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def check_in(key: str, module: Any) -> list[str]:
    """What, inside ``use_backend(key)``, does not resolve to ``module`` (the backend's adapter)."""
    seen = {
        "backend()": ac.backend() == key,
        "MultiHeadAttention": ac.MultiHeadAttention is module.MultiHeadAttention,
        "layers.PositionalEncoding": layers.PositionalEncoding is module.PositionalEncoding,
        "get_ops()": registry.get_ops() is module.OPS,
    }
    return [what for what, ok in seen.items() if not ok]


def stress(names: list[str | None], adapter: Callable[[str], Any]) -> list[str]:
    """Starts ``THREADS`` threads together; thread ``i`` runs ``ITERATIONS`` iterations with
    ``names[i % len(names)]`` (None: no ``use_backend``, so the process default applies), each
    checking what resolves, inside and after a nested ``use_backend``. Returns what was wrong."""
    base = ac.backend()
    problems: list[str] = []
    lock = threading.Lock()
    barrier = threading.Barrier(THREADS)
    others = [n for n in names if n is not None]

    def work(i: int) -> None:
        name = names[i % len(names)]
        other = others[(i + 1) % len(others)]

        def note(it: int, wrong: list[str]) -> None:
            if wrong:
                with lock:
                    problems.append(f"thread {i} ({name}) iteration {it}: {wrong}")

        try:
            barrier.wait()
            for it in range(ITERATIONS):
                if name is None:
                    note(it, check_in(base, adapter(base)))
                    continue
                with ac.use_backend(name) as key:
                    note(it, check_in(key, adapter(key)))
                    with ac.use_backend(other) as inner:
                        note(it, [f"nested {w}" for w in check_in(inner, adapter(inner))])
                    note(it, [f"after nested {w}" for w in check_in(key, adapter(key))])
                note(it, [] if ac.backend() == base else [f"left {ac.backend()!r} behind"])
        except BaseException as err:
            with lock:
                problems.append(f"thread {i} ({name}): {type(err).__name__}: {err}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(THREADS)]
    with frequent_switches():
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return problems


def test_threads_each_see_their_own_backend(backend: str) -> None:
    names: list[str | None] = [*names_for(backend), None]
    before = ac.backend()
    problems = stress(names, registry.load)
    assert problems == [], f"{len(problems)} wrong lookups, e.g. {problems[:5]}"
    assert ac.backend() == before
    to_report(backend, "concurrency", {"threads": THREADS, "iterations": ITERATIONS,
                                       "names": [n for n in names if n is not None]})


def fake_adapters() -> dict[str, ModuleType]:
    """A stand-in adapter module per backend, each with its own classes and ops object."""
    fakes = {}
    for b in registry.BACKENDS:
        module = ModuleType(f"fake_backends.{b}")
        for name in ac.LAYER_NAMES:
            setattr(module, name, type(f"{b}.{name}", (), {}))
        module.OPS = SimpleNamespace(backend=b)  # type: ignore[attr-defined]
        fakes[b] = module
    return fakes


@pytest.fixture
def fakes(monkeypatch: pytest.MonkeyPatch) -> dict[str, ModuleType]:
    """Every backend "loaded" as a stand-in module (no framework is imported)."""
    modules = fake_adapters()

    def load(name: str) -> ModuleType:
        return modules[registry.canonical_name(name)]

    monkeypatch.setattr(registry, "load", load)
    monkeypatch.setattr(layers, "load", load)
    return modules


def test_threads_each_see_their_own_backend_all_names(fakes: dict[str, ModuleType]) -> None:
    names: list[str | None] = [*registry.BACKENDS, *registry.ALIASES, None]
    problems = stress(names, lambda key: fakes[key])
    assert problems == [], f"{len(problems)} wrong lookups, e.g. {problems[:5]}"


def test_asyncio_tasks_each_see_their_own_backend(fakes: dict[str, ModuleType]) -> None:
    names = [*registry.BACKENDS, *registry.ALIASES]

    async def task(i: int) -> list[str]:
        name = names[i % len(names)]
        wrong = []
        for it in range(50):
            with ac.use_backend(name) as key:
                await asyncio.sleep(0)  # every other task runs here, inside its own block
                wrong += [f"task {i} ({name}) iteration {it}: {w}" for w in check_in(key, fakes[key])]
            await asyncio.sleep(0)
        return wrong

    async def main() -> list[list[str]]:
        return await asyncio.gather(*(task(i) for i in range(THREADS)))

    problems = [p for found in asyncio.run(main()) for p in found]
    assert problems == []


def run_worker(script: str, *args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Runs ``python -m tests.distributed.<script> args`` from the repository, with ``env``
    added to the environment; its measurements."""
    env = {**{k: v for k, v in os.environ.items() if k != registry.ENV_VAR}, **(env or {})}
    done = subprocess.run([sys.executable, "-m", f"tests.distributed.{script}", *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{script} failed:\n{done.stdout}\n{done.stderr[-4000:]}"
    return parse(done.stdout)


def test_first_loads_from_many_threads_import_each_framework_once(backend: str) -> None:
    names = names_for(backend)
    result = run_worker("first_load", *names)
    assert result["problem_count"] == 0, result["problems"]
    keys = sorted({registry.canonical_name(n) for n in names})
    # the tensorflow adapter serves backends.keras' layers (Keras on any Keras backend)
    also = {"tensorflow": ["backends.keras"]}
    expected = [f"backends.{k}" for k in keys] + [m for k in keys for m in also.get(k, [])]
    assert result["adapters_imported"] == sorted(expected)
    assert result["module_objects"] == dict.fromkeys(keys, 1)  # every thread got the same module
    for key in keys:
        assert result["executed"][f"backends.{key}"] == 1, (key, result["executed"])
        for framework in registry.FRAMEWORKS[key]:  # numpy: already imported by attention_core
            before = framework in result["already_imported"]
            assert result["executed"].get(framework, 0) == (0 if before else 1), (framework, result)
            assert framework in result["frameworks_imported"]
    to_report(backend, "concurrency", {
        "first_loads": {"threads": result["threads"], "names": names,
                        "executed": {m: n for m, n in sorted(result["executed"].items())}}})


def test_a_loaded_backend_does_not_wait_for_another_first_load(backend: str) -> None:
    if backend == "numpy":
        pytest.skip("needs a framework that is not loaded yet; the numpy env has none")
    result = run_worker("held_load", backend)
    assert result["load_was_held"]
    assert result["numpy_user_finished_while_held"], (
        "a NumPy call waited for another thread's first load of " + backend)
    assert result["numpy_user_result"] == ["numpy"]
    assert result["loaded"] == [f"backends.{backend}"]
    to_report(backend, "concurrency", {"loaded_backend_waits_for_first_load": False})


#: The Keras backends whose ops class ``backends.keras`` makes (TensorFlow's is its own class).
MADE_OPS = {"jax": ("jax", "flax"), "torch": ("torch",)}


@pytest.mark.parametrize("keras_backend", sorted(MADE_OPS))
def test_keras_layers_made_first_in_many_threads_share_one_ops_class(keras_backend: str) -> None:
    """Each Keras backend installed here, in an interpreter of its own (``KERAS_BACKEND``): threads
    that make their first ``backends.keras`` layers at once get ops of one class."""
    needed = ("keras", *MADE_OPS[keras_backend])
    if any(importlib.util.find_spec(m) is None for m in needed):
        pytest.skip(f"Keras on {keras_backend} needs {', '.join(needed)}, not all installed here")
    result = run_worker("keras_first_ops", env={"KERAS_BACKEND": keras_backend})
    assert result["keras_backend"] == keras_backend
    assert result["layers"] == 8
    assert len(result["ops_classes"]) == 1, result["ops_classes"]
