"""A backend that is loaded can be used while another thread's first load is still running.

``python -m tests.distributed.held_load NAME``: thread ``loader`` starts the first load of
backend NAME, and an import hook holds the execution of ``backends.<NAME>``'s body until told to
go on. Meanwhile another thread uses the NumPy backend (loaded before): ``use_backend``,
``attention_core.MultiHeadAttention`` and a functional call on NumPy arrays (which looks its
backend up in the registry). Reports whether those finished while the other load was held, or
only after it was let go (a registry that holds a lock for every lookup, not just for first
loads, makes them wait for the whole import of the framework).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Sequence
from types import ModuleType

from tests.distributed.common import held_spec

#: How long the NumPy user may take before it counts as waiting for the held load (seconds; it
#: needs milliseconds when it does not wait).
PATIENCE = 60.0


class HoldingFinder(importlib.abc.MetaPathFinder):
    """Holds the execution of one module's body until :attr:`go` is set."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.entered = threading.Event()
        self.go = threading.Event()

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        return held_spec(self, fullname, path, target, self._hold)

    def _hold(self) -> None:
        """Says the body is about to run, then waits for :attr:`go`."""
        self.entered.set()
        self.go.wait()


def main(name: str) -> None:
    import numpy as np

    import attention_core as ac
    from attention_core import registry
    from tests.distributed.common import emit

    key = registry.canonical_name(name)
    q = np.ones((1, 2, 4))
    ac.dot_product_attention(q, q, q)  # the NumPy backend is loaded now
    finder = HoldingFinder(f"backends.{key}")
    sys.meta_path.insert(0, finder)

    loaded: list[str] = []
    loader = threading.Thread(target=lambda: loaded.append(registry.load(key).__name__), name="loader")
    loader.start()
    held = finder.entered.wait(PATIENCE)

    done: list[str] = []

    def numpy_user() -> None:
        with ac.use_backend("numpy"):
            assert ac.MultiHeadAttention is registry.load("numpy").MultiHeadAttention
        out = ac.dot_product_attention(q, q, q)
        done.append(type(out).__module__)

    user = threading.Thread(target=numpy_user, name="numpy user")
    user.start()
    user.join(PATIENCE)
    finished_while_held = not user.is_alive()
    finder.go.set()
    user.join()
    loader.join()
    emit({
        "backend": key,
        "load_was_held": held,
        "numpy_user_finished_while_held": finished_while_held,
        "numpy_user_result": done,
        "loaded": loaded,
    })


if __name__ == "__main__":
    main(sys.argv[1])
