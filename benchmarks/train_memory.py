"""Peak extra memory of forward + backward of attention, one subprocess per point.

Each point runs ``dot_product_attention(q, k, v)`` on ``(1, heads, n, 64)`` float32 inputs
(no mask) with the DEFAULT implementation (what a user gets; ``--path blockwise`` or
``direct`` forces one) and differentiates ``sum(out)`` with respect to ``q``, ``k`` and ``v``
the framework's way: torch autograd on CPU tensors, ``tf.GradientTape`` (eager), MXNet's
``autograd.record()``, and JAX's ``jax.jit(jax.grad(...))``, compiled by a call at the same
shape before the measured one (as :mod:`benchmarks.memory` does for JAX). The other
frameworks warm up at 16 keys (TensorFlow and MXNet pool what they free, so a larger warm-up
would leave a pool the measured call fits in). The point runs in a fresh process measured as
:mod:`benchmarks.memory` measures (``VmHWM`` after ``/proc/self/clear_refs``, minus ``VmRSS``
before the call). Extra memory includes the output and the three gradients
(``4 * heads * n * 64`` floats). Each point records the implementation the call took
(:func:`attention_core.kernels.choose`'s choice at that shape). Linux only.

Run it with the Python of the framework's environment, e.g.
``python -m benchmarks.train_memory --backend tensorflow --n 4096 8192 16384``; it prints one
line per point and the log-log slope of extra memory against n. ``python -m benchmarks
--suite train-memory`` runs the same points into ``bench-<backend>.json``.
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
#: Backends with autodiff, which this suite measures.
BACKENDS = ("torch", "tensorflow", "jax", "mxnet")
#: ``--path`` choices: ``default`` is the automatic choice.
PATHS = ("default", "blockwise", "direct")


def _implementation(path: str) -> str | None:
    return None if path == "default" else path


def resolved(backend: str, path: str, heads: int, n: int) -> str:
    """The implementation ``path`` takes at ``(1, heads, n, n)`` on a backend."""
    from attention_core import kernels, registry
    from attention_core.modifiers import Call

    ops = registry.load(backend).OPS
    request = kernels.Request(Call(ops, (1, heads, n, n)))
    return kernels.choose(ops, request, _implementation(path))[0].name


def _train_step(backend: str, heads: int, n: int, path: str = "default") -> Callable[[], Any]:
    """A function running forward + backward once on ``(1, heads, n, DEPTH)`` inputs."""
    import numpy as np

    import attention_core as ac

    impl = _implementation(path)
    rng = np.random.default_rng(0)
    data = [rng.standard_normal((1, heads, n, DEPTH)).astype(np.float32) for _ in range(3)]
    if backend == "torch":
        import torch

        import backends.torch  # (registers the backend)

        tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in data)

        def torch_step() -> Any:
            for x in (tq, tk, tv):
                x.grad = None
            out: Any = ac.dot_product_attention(tq, tk, tv, implementation=impl)
            out.sum().backward()
            return [x.grad for x in (tq, tk, tv)]

        return torch_step
    if backend == "tensorflow":
        import tensorflow as tf

        import backends.tensorflow  # (checks the Keras backend)

        q, k, v = (tf.constant(x) for x in data)

        def tf_step() -> Any:
            with tf.GradientTape() as tape:
                tape.watch([q, k, v])
                loss = tf.reduce_sum(ac.dot_product_attention(q, k, v, implementation=impl))
            return [g.numpy() for g in tape.gradient(loss, [q, k, v])]

        return tf_step
    if backend == "jax":
        import jax
        import jax.numpy as jnp

        import backends.jax  # (registers the backend)

        jq, jk, jv = (jnp.asarray(x) for x in data)

        def loss(a: Any, b: Any, c: Any) -> Any:
            out: Any = ac.dot_product_attention(a, b, c, implementation=impl)
            return jnp.sum(out)

        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        return lambda: jax.block_until_ready(grad(jq, jk, jv))  # type: ignore[no-untyped-call]
    if backend == "mxnet":
        import mxnet as mx

        import backends.mxnet  # noqa: F401  (switches on the NumPy interface)

        def mx_step() -> Any:
            arrays = [mx.np.array(x) for x in data]
            for x in arrays:
                x.attach_grad()
            with mx.autograd.record():
                out: Any = ac.dot_product_attention(*arrays, implementation=impl)
            out.backward()
            return [x.grad.asnumpy() for x in arrays]

        return mx_step
    raise ValueError(f"train_memory measures {', '.join(BACKENDS)}, not {backend!r}")


def child(backend: str, n: int, heads: int, path: str = "default", threads: int | None = None
          ) -> dict[str, Any]:
    """Measures one point in this process.

    Returns:
        ``{"extra_mib", "baseline_mib", "peak_mib", "seconds", "implementation"}``.
    """
    if threads is not None:
        from benchmarks.natives import harness

        harness(backend, threads).thread_settings()
    step = _train_step(backend, heads, n, path)
    if backend == "jax":
        step()  # compiles the measured shape
    else:
        _train_step(backend, heads, TINY_WARMUP, path)()
    import gc

    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    baseline = _status("VmRSS")
    start = time.perf_counter()
    grads = step()
    seconds = time.perf_counter() - start
    peak = _status("VmHWM")
    del grads
    mib = 2.0**20
    return {"extra_mib": (peak - baseline) / mib, "baseline_mib": baseline / mib,
            "peak_mib": peak / mib, "seconds": seconds,
            "implementation": resolved(backend, path, heads, n)}


def measure(backend: str, n: int, heads: int, threads: int, path: str = "default",
            timeout: float = 3600.0) -> dict[str, Any]:
    """Runs one point in a fresh subprocess of this Python.

    Returns:
        The child's result with ``"ok": True`` and ``wall_seconds``; or ``{"ok": False,
        "error": ...}`` when it failed, ran out of memory or time.
    """
    env = {**os.environ, **thread_env(threads), "MALLOC_MMAP_THRESHOLD_": "65536"}
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    command = [sys.executable, "-m", "benchmarks.train_memory", "--child", "--backend", backend,
               "--n", str(n), "--heads", str(heads), "--path", path, "--threads", str(threads)]
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


def main(argv: Sequence[str] | None = None) -> int:
    """Measures each n in a subprocess and prints the figures and the log-log slope."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.train_memory",
                                     description="peak extra memory of forward + backward")
    parser.add_argument("--backend", required=True, choices=BACKENDS)
    parser.add_argument("--n", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--path", choices=PATHS, default="default")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.backend, args.n[0], args.heads, args.path, args.threads)),
              flush=True)
        return 0
    points = []
    for n in args.n:
        result = measure(args.backend, n, args.heads, args.threads, args.path)
        if result["ok"]:
            points.append((n, result["extra_mib"]))
            print(f"{args.backend} {args.path} ({result['implementation']}) n={n} H={args.heads} "
                  f"D={DEPTH} fp32: {result['extra_mib']:.1f} MiB extra, "
                  f"{result['seconds']:.1f} s", flush=True)
        else:
            print(f"{args.backend} n={n} H={args.heads}: failed: {result['error']}", flush=True)
    fitted = slope(points)
    print(f"log-log slope: {'n/a' if fitted is None else f'{fitted:.2f}'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
