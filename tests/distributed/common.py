"""What the worker scripts share: the data, and the one line of output the tests parse."""

from __future__ import annotations

import importlib.machinery
import json
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import numpy as np

#: The prefix of the line a worker prints its measurements on.
PREFIX = "RESULT "


def emit(result: dict[str, Any]) -> None:
    """Prints the measurements as one ``RESULT <json>`` line."""
    print(PREFIX + json.dumps(result), flush=True)


def parse(stdout: str) -> dict[str, Any]:
    """The measurements a worker printed (the last ``RESULT`` line of its output)."""
    lines = [line for line in stdout.splitlines() if line.startswith(PREFIX)]
    if not lines:
        raise ValueError(f"the worker printed no {PREFIX.strip()} line; its output was:\n{stdout}")
    parsed: dict[str, Any] = json.loads(lines[-1][len(PREFIX):])
    return parsed


def max_abs_diff(a: Any, b: Any) -> float:
    """max |a - b| over two arrays of the same shape, in float64."""
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    assert x.shape == y.shape, (x.shape, y.shape)
    return float(np.max(np.abs(x - y), initial=0.0))


def batch(seed: int, B: int, T: int, h: int) -> dict[str, np.ndarray]:
    """A float64 batch: ``X`` and ``target`` ``(B, T, h)`` and ``valid_lens`` ``(B,)`` in [1, T]."""
    rng = np.random.default_rng(seed)
    return {
        "X": rng.standard_normal((B, T, h)),
        "target": rng.standard_normal((B, T, h)),
        "valid_lens": rng.integers(1, T + 1, size=B),
    }



def attention_inputs(B: int, Q: int, K: int, D: int, h: int) -> dict[str, np.ndarray]:
    """A float64 attention batch: ``queries`` ``(B, Q, D)``, ``keys`` and ``values`` ``(B, K, D)``,
    ``valid_lens`` ``(B,)`` in [1, K] (those of :func:`batch`), and a ``target`` ``(B, Q, h)``."""
    data = batch(0, B, K, D)
    rng = np.random.default_rng(1)
    return {
        "queries": rng.standard_normal((B, Q, D)),
        "keys": data["X"],
        "values": data["target"],
        "valid_lens": data["valid_lens"],
        "target": rng.standard_normal((B, Q, h)),
    }

#: backend -> report key -> what the tests of this run measured under it (merged per key).
_MEASURED: dict[str, dict[str, dict[str, Any]]] = {}


def to_report(backend: str, key: str, measured: dict[str, Any]) -> None:
    """Hands measurements to the report plugin (``tests/report.py``) as ``key`` of
    ``<backend>.json``; several calls with the same key merge their entries."""
    from tests import report  # in the pytest process only (it imports pytest)

    merged = _MEASURED.setdefault(backend, {}).setdefault(key, {})
    merged.update(measured)
    section = getattr(report, "section", None)  # the plugin's entry point for extra keys
    if section is not None:
        section(backend, key, dict(merged))


def held_spec(hook: object, fullname: str, path: Sequence[str] | None,
              target: ModuleType | None, before: Callable[[], None]) -> importlib.machinery.ModuleSpec | None:
    """The spec the other finders of ``sys.meta_path`` give a module, with a loader that calls
    ``before()`` and then executes the module's body (an import hook's ``find_spec``)."""
    for finder in sys.meta_path:
        if finder is hook or not hasattr(finder, "find_spec"):
            continue
        spec: importlib.machinery.ModuleSpec | None = finder.find_spec(fullname, path, target)
        if spec is not None:
            break
    else:
        return None
    loader: Any = spec.loader
    run = loader.exec_module

    def exec_module(module: ModuleType) -> None:
        before()
        run(module)

    loader.exec_module = exec_module
    return spec


# -- the ring workers' sequence and masks (ring_torch.py, ring_jax.py) -------------------------

#: Batch, query heads, key/value heads, the whole sequence's length and the depth.
B, H, HKV, N, D = 2, 4, 2, 24, 8
LENGTHS = np.array([7, 20])
SEGMENTS = np.array([[0] * 9 + [1] * 10 + [2] * 5, [0] * 3 + [1] * 21], np.int32)
SINKS = np.array([0.5, -1.0, 2.0, 0.0])
#: Every mask kind a sharded call takes, by name, as keywords of dot_product_attention.
MASKS: dict[str, dict[str, Any]] = {
    "none": {}, "causal": {"causal": True}, "causal_window": {"causal": True, "window": 5},
    "lengths": {"valid_lens": LENGTHS},
    "causal_segments": {"causal": True, "segment_ids": SEGMENTS},
    "causal_sinks": {"causal": True, "sinks": SINKS}}
