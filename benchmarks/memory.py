"""Peak extra memory of one attention call, one subprocess per point.

The parent (:func:`measure`) starts ``python -m benchmarks.memory --backend NAME
--path PATH --n N --heads H --threads T``, with ``MALLOC_MMAP_THRESHOLD_=65536`` in its
environment so that freed large blocks go back to the operating system at once. The child
creates the inputs, warms the call up once (JAX: at the same shape, which compiles it;
TensorFlow and MXNet, whose allocators keep freed memory for reuse, at 16 keys only, so the
measured call, which TensorFlow traces, cannot fit in what a warm-up left; the others at
``min(n // 2, 4096)``, which keeps the largest points short), then writes ``5`` to
``/proc/self/clear_refs`` (which resets the peak resident set size
``VmHWM`` to the current one), reads ``VmRSS`` as the baseline, runs the call once, waits for
its result and reads ``VmHWM``. Extra memory is ``VmHWM - baseline``: everything the call
needed at its peak, its output included (``B H n D`` floats). Linux only.

:func:`slope` fits ``log(extra) = a + slope * log(n)``: about 2 for a path that forms the
``(n, n)`` scores, at most 1 for one that does not.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import thread_env

#: Warm-up size of backends that do not compile per shape.
WARMUP_MAX = 4096


def _status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes (``VmRSS``, ``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise OSError(f"/proc/self/status has no {field}")


#: Frameworks whose allocator keeps what was freed for reuse (TensorFlow's, MXNet's pool):
#: a large warm-up would leave a pool the measured call fits in, so they warm up at
#: :data:`TINY_WARMUP` keys (starting the runtime only) and trace the measured shape in it.
POOLED = ("tensorflow", "mxnet")
TINY_WARMUP = 16


def child(backend: str, path: str, n: int, heads: int, threads: int) -> dict[str, Any]:
    """Measures one point in this process (the framework is imported here).

    Returns:
        ``{"extra_mib", "baseline_mib", "peak_mib", "seconds", "implementation"}``.
    """
    from benchmarks.natives import harness as make_harness

    harness = make_harness(backend, threads)
    harness.thread_settings()
    same = harness.name == "jax"
    pooled = harness.name in POOLED  # keeps freed memory: warm up small, or it hides the call's
    warm_n = n if same else TINY_WARMUP if pooled else max(1, min(n // 2, WARMUP_MAX))
    call = harness.attention_call(path, *harness.qkv(heads, n))
    if same:
        call()
    else:
        harness.attention_call(path, *harness.qkv(heads, warm_n))()
    import gc

    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    baseline = _status("VmRSS")
    start = time.perf_counter()
    out = call()
    seconds = time.perf_counter() - start
    peak = _status("VmHWM")
    del out
    mib = 2.0**20
    return {"extra_mib": (peak - baseline) / mib, "baseline_mib": baseline / mib,
            "peak_mib": peak / mib, "seconds": seconds,
            "implementation": harness.resolved(path, heads, n)}


def measure(backend: str, path: str, n: int, heads: int, threads: int,
            timeout: float = 3600.0) -> dict[str, Any]:
    """Runs one point in a fresh subprocess.

    Returns:
        The child's result, with ``"ok": True``; or ``{"ok": False, "error": ...}`` when it
        failed, ran out of memory or time.
    """
    env = {**os.environ, **thread_env(threads), "MALLOC_MMAP_THRESHOLD_": "65536"}
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    command = [sys.executable, "-m", "benchmarks.memory", "--backend", backend,
               "--path", path, "--n", str(n), "--heads", str(heads), "--threads", str(threads)]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout,
                              check=False)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {timeout:.0f} s"}
    wall = time.perf_counter() - start
    lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
    if done.returncode != 0 or not lines:
        why = "killed (out of memory?)" if done.returncode < 0 else f"exit status {done.returncode}"
        tail = (done.stderr.strip().splitlines() or [""])[-1][:300]
        return {"ok": False, "error": f"{why}: {tail}".rstrip(": "), "wall_seconds": wall}
    return {"ok": True, **json.loads(lines[-1]), "wall_seconds": wall}


def slope(points: Sequence[tuple[int, float]], min_mib: float = 1.0) -> float | None:
    """Least-squares slope of ``log(extra)`` against ``log(n)``.

    Args:
        points: ``(n, extra MiB)`` pairs.
        min_mib: Points below this are left out (page-granular noise, not the call's arrays).

    Returns:
        The slope, or None with fewer than two usable points.
    """
    usable = [(math.log(n), math.log(m)) for n, m in points if m >= min_mib and n > 0]
    if len({x for x, _ in usable}) < 2:
        return None
    mx = sum(x for x, _ in usable) / len(usable)
    my = sum(y for _, y in usable) / len(usable)
    sxx = sum((x - mx) ** 2 for x, _ in usable)
    return sum((x - mx) * (y - my) for x, y in usable) / sxx


def main(argv: Sequence[str] | None = None) -> int:
    """The child's entry point: prints one JSON line with the measurement."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.memory",
                                     description="peak extra memory of one attention call")
    parser.add_argument("--backend", required=True)
    parser.add_argument("--path", required=True,
                        help="default, direct, blockwise, fused or native")
    parser.add_argument("--n", type=int, required=True)
    parser.add_argument("--heads", type=int, required=True)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    result = child(args.backend, args.path, args.n, args.heads, args.threads)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
