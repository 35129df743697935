"""Many threads make their first ``use_backend`` calls at the same moment, in a fresh interpreter.

``python -m tests.distributed.first_load NAME [NAME ...]`` starts ``THREADS`` threads on a
barrier; thread ``i`` uses backend ``NAMES[i % len(NAMES)]`` (names or aliases) for
``ITERATIONS`` iterations, the first of which is the process's first load of that backend. In
each iteration it checks, inside ``use_backend``, that ``attention_core.backend()``,
``attention_core.MultiHeadAttention``, ``attention_core.layers.PositionalEncoding`` and
``registry.get_ops()`` are its own backend's, also after a nested ``use_backend("numpy")``
has been left. An import hook counts how often the body of each backend's adapter package
(``backends.<name>``) and of each framework module runs: the registry must load each once.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from types import ModuleType

from tests.distributed.common import held_spec

THREADS, ITERATIONS = 16, 200

#: Seconds each watched module's body is held back, so that every thread reaches the registry
#: while the first loads are still running.
DELAY = 0.05


class CountingFinder(importlib.abc.MetaPathFinder):
    """Counts how often the bodies of some modules are executed (each should be: once)."""

    def __init__(self, names: set[str]) -> None:
        self.names = names
        self.executed: Counter[str] = Counter()
        self.threads: dict[str, set[str]] = {}
        self.lock = threading.Lock()

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.names:
            return None
        return held_spec(self, fullname, path, target, lambda: self._executing(fullname))

    def _executing(self, fullname: str) -> None:
        """Counts one execution of the module's body and holds it for :data:`DELAY` seconds."""
        with self.lock:
            self.executed[fullname] += 1
            self.threads.setdefault(fullname, set()).add(threading.current_thread().name)
        time.sleep(DELAY)


def main(names: list[str]) -> None:
    from attention_core import registry  # imports numpy, and no framework

    keys = [registry.canonical_name(n) for n in names]
    watched = {f"backends.{k}" for k in keys} | {m for k in keys for m in registry.FRAMEWORKS[k]}
    already = sorted(m for m in watched if m in sys.modules)
    finder = CountingFinder(watched)
    sys.meta_path.insert(0, finder)
    sys.setswitchinterval(1e-5)  # switch threads often: interleave the checks below

    import attention_core as ac
    from tests.distributed.common import emit

    barrier = threading.Barrier(THREADS)
    problems: list[str] = []
    modules: dict[str, set[int]] = {}
    first_load: list[float] = []
    slowest: dict[str, float] = {}
    lock = threading.Lock()

    def work(i: int) -> None:
        name = names[i % len(names)]
        try:
            barrier.wait()
            began = time.perf_counter()
            for it in range(ITERATIONS):
                start = time.perf_counter()
                with ac.use_backend(name) as key:
                    module = registry.load(key)
                    if it == 0:
                        with lock:
                            first_load.append(time.perf_counter() - began)
                    with lock:
                        modules.setdefault(key, set()).add(id(module))
                    seen = {
                        "backend()": ac.backend() == key,
                        "MultiHeadAttention": ac.MultiHeadAttention is module.MultiHeadAttention,
                        "layers.PositionalEncoding":
                            ac.layers.PositionalEncoding is module.PositionalEncoding,
                        "get_ops()": registry.get_ops() is module.OPS,
                    }
                    with ac.use_backend("numpy"):
                        seen["nested"] = ac.backend() == "numpy"
                    seen["restored"] = ac.backend() == key
                    wrong = [what for what, ok in seen.items() if not ok]
                    if wrong:
                        with lock:
                            problems.append(f"thread {i} ({name}) iteration {it}: {wrong}")
                if it > 0:  # how long an iteration with the backend already loaded waited
                    with lock:
                        slowest[key] = max(slowest.get(key, 0.0), time.perf_counter() - start)
                if ac.backend() != "numpy":
                    with lock:
                        problems.append(f"thread {i} ({name}) iteration {it}: left {ac.backend()}")
        except BaseException as err:  # reported, not lost in the thread
            with lock:
                problems.append(f"thread {i} ({name}): {type(err).__name__}: {err}")

    threads = [threading.Thread(target=work, args=(i,), name=f"t{i}") for i in range(THREADS)]
    began = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    emit({
        "threads": THREADS,
        "iterations": ITERATIONS,
        "names": names,
        "seconds": time.perf_counter() - began,
        "first_load_seconds": [min(first_load, default=0.0), max(first_load, default=0.0)],
        "slowest_later_iteration": slowest,
        "problems": problems[:20],
        "problem_count": len(problems),
        "already_imported": already,
        "executed": dict(finder.executed),
        "executing_threads": {m: len(t) for m, t in finder.threads.items()},
        "module_objects": {k: len(ids) for k, ids in modules.items()},
        "adapters_imported": sorted(m for m in sys.modules if m.partition(".")[0] == "backends"
                                    and m.count(".") == 1),
        "frameworks_imported": sorted(
            m for m in ("numpy", "torch", "tensorflow", "keras", "jax", "flax", "mxnet")
            if m in sys.modules),
    })


if __name__ == "__main__":
    main(sys.argv[1:])
