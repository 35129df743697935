"""Keras layers made first in many threads at once: every layer's ops are of one class.

``KERAS_BACKEND=jax python -m tests.distributed.keras_first_ops``: ``THREADS`` threads each make
their first ``backends.keras`` layer at the same moment, in a fresh interpreter (no layer made
before). The ops module's lookup is slowed down, as a first import of the framework's ops is,
so that the threads meet where the class is made. Reports the ops classes the layers got.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import keras

from backends.keras import ops as keras_ops
from tests.distributed.common import emit

THREADS = 8


def main() -> None:
    looked_up = keras_ops._module

    def slow() -> Any:  # a first import of the framework's ops takes a while
        time.sleep(0.05)
        return looked_up()

    keras_ops._module = slow  # type: ignore[assignment]
    import backends.keras as layers

    barrier = threading.Barrier(THREADS)
    classes: list[type] = []

    def work() -> None:
        barrier.wait()
        classes.append(type(layers.MultiHeadAttention(8, 2)._ops))

    threads = [threading.Thread(target=work) for _ in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    emit({"keras_backend": keras.backend.backend(), "layers": len(classes),
          "ops_classes": sorted({f"{c.__qualname__}@{id(c):x}" for c in classes})})


if __name__ == "__main__":
    main()
