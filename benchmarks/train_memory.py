"""Peak extra memory of forward + backward of blockwise attention, one subprocess per point.

Each point runs ``dot_product_attention(q, k, v, implementation="blockwise")`` on
``(1, heads, n, 64)`` float32 inputs and differentiates ``sum(out)`` with respect to ``q``,
``k`` and ``v`` by the framework's eager autodiff (``tf.GradientTape``, MXNet's
``autograd.record()``), in a fresh process measured as :mod:`benchmarks.memory` measures
(``VmHWM`` after ``/proc/self/clear_refs``, minus ``VmRSS`` before the call; a warm-up at 16
keys first, since both frameworks pool what they free). Extra memory includes the output and
the three gradients (``4 * heads * n * 64`` floats). Linux only.

Run it with the Python of the framework's environment, e.g.
``python -m benchmarks.train_memory --backend tensorflow --n 4096 8192 16384``; it prints one
line per point and the log-log slope of extra memory against n.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks import thread_env
from benchmarks.memory import TINY_WARMUP, _status, slope

#: Depth of the queries, keys and values.
DEPTH = 64


def _train_step(backend: str, heads: int, n: int) -> Callable[[], Any]:
    """A function running forward + backward once on fresh ``(1, heads, n, DEPTH)`` inputs."""
    import numpy as np

    import attention_core as ac

    rng = np.random.default_rng(0)
    data = [rng.standard_normal((1, heads, n, DEPTH)).astype(np.float32) for _ in range(3)]
    if backend == "tensorflow":
        import tensorflow as tf

        import backends.tensorflow  # (checks the Keras backend)

        q, k, v = (tf.constant(x) for x in data)

        def tf_step() -> Any:
            with tf.GradientTape() as tape:
                tape.watch([q, k, v])
                loss = tf.reduce_sum(ac.dot_product_attention(q, k, v, implementation="blockwise"))
            return [g.numpy() for g in tape.gradient(loss, [q, k, v])]

        return tf_step
    if backend == "mxnet":
        import mxnet as mx

        import backends.mxnet  # noqa: F401  (switches on the NumPy interface)

        def mx_step() -> Any:
            arrays = [mx.np.array(x) for x in data]
            for x in arrays:
                x.attach_grad()
            with mx.autograd.record():
                out: Any = ac.dot_product_attention(*arrays, implementation="blockwise")
            out.backward()
            return [x.grad.asnumpy() for x in arrays]

        return mx_step
    raise ValueError(f"train_memory measures tensorflow and mxnet, not {backend!r}")


def child(backend: str, n: int, heads: int) -> dict[str, Any]:
    """Measures one point in this process: ``{"extra_mib", "baseline_mib", "seconds"}``."""
    _train_step(backend, heads, TINY_WARMUP)()
    step = _train_step(backend, heads, n)
    import gc

    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    baseline = _status("VmRSS")
    start = time.perf_counter()
    step()
    seconds = time.perf_counter() - start
    mib = 2.0**20
    return {"extra_mib": (_status("VmHWM") - baseline) / mib, "baseline_mib": baseline / mib,
            "seconds": seconds}


def measure(backend: str, n: int, heads: int, threads: int, timeout: float = 3600.0) -> dict[str, Any]:
    """Runs one point in a fresh subprocess of this Python; ``{"ok": False, ...}`` on failure."""
    env = {**os.environ, **thread_env(threads), "MALLOC_MMAP_THRESHOLD_": "65536",
           "TF_CPP_MIN_LOG_LEVEL": "2", "KERAS_BACKEND": "tensorflow"}
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    command = [sys.executable, "-m", "benchmarks.train_memory", "--child", "--backend", backend,
               "--n", str(n), "--heads", str(heads)]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout,
                              check=False)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {timeout:.0f} s"}
    lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or [""])[-1][:300]
        return {"ok": False, "error": f"exit status {done.returncode}: {tail}"}
    return {"ok": True, **json.loads(lines[-1])}


def main(argv: Sequence[str] | None = None) -> int:
    """Measures each n in a subprocess and prints the figures and the log-log slope."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.train_memory",
                                     description="peak extra memory of forward + backward")
    parser.add_argument("--backend", required=True, choices=["tensorflow", "mxnet"])
    parser.add_argument("--n", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.backend, args.n[0], args.heads)), flush=True)
        return 0
    points = []
    for n in args.n:
        result = measure(args.backend, n, args.heads, args.threads)
        if result["ok"]:
            points.append((n, result["extra_mib"]))
            print(f"{args.backend} n={n} H={args.heads} D={DEPTH} fp32: "
                  f"{result['extra_mib']:.1f} MiB extra, {result['seconds']:.1f} s", flush=True)
        else:
            print(f"{args.backend} n={n} H={args.heads}: failed: {result['error']}", flush=True)
    fitted = slope(points)
    print(f"log-log slope: {'n/a' if fitted is None else f'{fitted:.2f}'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
