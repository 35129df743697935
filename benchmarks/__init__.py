"""Benchmarks: ``python -m benchmarks``.

Three suites, each run for one backend per process (a child process with the thread count
pinned before the framework is imported):

* ``speed``: this library's ``MultiHeadAttention`` forward time divided by the framework's
  own layer's (or, for NumPy and Gluon, by a plain direct implementation in the same
  framework), with the same weights and the same mask, timed in interleaved rounds in one
  process: median ratio, a confidence interval and an A/A control (:mod:`.timing`, :mod:`.natives`).
* ``memory``: peak extra resident memory of one attention call against n, one subprocess per
  point, with the fitted log-log slope (:mod:`.memory`).
* ``flops``: achieved GFLOP/s of the attention core (``4 B H n^2 D / time``) divided by the
  same process's matrix-multiply GFLOP/s (:mod:`.flops`).

Two training suites, not run unless asked for (``--suite train,train-memory``):

* ``train``: one training step (forward, gradients of the output's sum by every weight) of the
  default ``MultiHeadAttention`` and ``TransformerEncoderBlock`` against the framework's own
  layers, interleaved (:mod:`.training`);
* ``train-memory``: peak extra memory of forward + backward of ``dot_product_attention`` with
  the default implementation against n, with the log-log slope (:mod:`.train_memory`).

Results go to ``<out>/bench-<backend>.json`` with the machine they ran on; :mod:`.report`
prints the tables, draws the plot and merges the files of several environments into the
table of ``docs/speed.md``. No module here imports a framework at import time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from attention_core import files

#: Suites in the order they run.
SUITES = ("speed", "flops", "memory", "train", "train-memory")
#: The suites a run without ``--suite`` runs (the training suites take long; ask for them).
DEFAULT_SUITES = ("speed", "flops", "memory")
#: Suites recorded at the top of the JSON document; the others record their run in their section.
MAIN_SUITES = DEFAULT_SUITES

#: The fixed shapes of the issue: batch 1, head depth 64, fp32, ``valid_lens`` on.
BATCH, DEPTH, DTYPE = 1, 64, "float32"
#: Heads and sequence lengths of the speed and flops suites (num_hiddens = 8 * 64 = 512).
SPEED_HEADS = 8
SPEED_SIZES = (128, 256, 512, 1024, 2048, 4096)
#: Heads and sequence lengths of the memory suite; paths that form the (n, n) scores stop at
#: ``MEMORY_QUADRATIC_MAX``, the O(n)-memory paths go on to the largest size.
MEMORY_HEADS = 4
MEMORY_SIZES = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
MEMORY_QUADRATIC_MAX = 16384
#: The extra memory point: 8 heads at n = 65536 on the default path must complete.
LARGE_POINT = (8, 65536)
#: Sequence lengths of the training-step suite (the issue's targets: n = 128 and n >= 1024).
TRAIN_SIZES = (128, 1024, 2048)
#: Heads and sequence lengths of the training-memory suite, and its large point (heads, n).
TRAIN_MEMORY_HEADS = 4
TRAIN_MEMORY_SIZES = (1024, 2048, 4096, 8192, 16384)
TRAIN_LARGE_POINT = (8, 65536)
#: Square matrix product whose rate is the denominator of the flops suite.
GEMM_SIZE = 2048

#: Sizes and repetitions of ``--quick`` (seconds, for the smoke test and development).
QUICK_SIZES = (16, 32)
QUICK_MEMORY_SIZES = (256, 512)
QUICK_GEMM_SIZE = 128


@dataclass
class Config:
    """What one benchmark run measures.

    Attributes:
        suites: Subset of :data:`SUITES`.
        sizes: Sequence lengths of the speed and flops suites.
        memory_sizes: Sequence lengths of the memory suite.
        memory_quadratic_max: Largest n for paths that form the ``(n, n)`` scores.
        memory_paths: Paths of the memory suite, or None for every path of the backend.
        large_point: ``(heads, n)`` of the extra memory point of the default path, or None.
        rounds: Interleaved rounds per speed point.
        flops_rounds: Timed samples per flops point (the median is kept).
        min_time: Seconds one timing sample lasts at least.
        gemm_size: Size of the square matrix product of the flops suite.
        threads: Threads of every framework's intra-op pool.
        quick: Tiny sizes and few rounds (a smoke test; the numbers mean nothing).
        memory_timeout: Seconds one memory subprocess may take.
        train_sizes: Sequence lengths of the training-step suite.
        train_memory_sizes: Sequence lengths of the training-memory suite (4 heads).
        train_large_point: ``(heads, n)`` of its extra point, or None.
        train_memory_path: ``default`` (the automatic choice), ``blockwise`` or ``direct``.
    """

    suites: tuple[str, ...] = DEFAULT_SUITES
    sizes: tuple[int, ...] = SPEED_SIZES
    memory_sizes: tuple[int, ...] = MEMORY_SIZES
    memory_quadratic_max: int = MEMORY_QUADRATIC_MAX
    memory_paths: tuple[str, ...] | None = None
    large_point: tuple[int, int] | None = LARGE_POINT
    rounds: int = 15
    flops_rounds: int = 5
    min_time: float = 0.1
    gemm_size: int = GEMM_SIZE
    threads: int = field(default_factory=lambda: os.cpu_count() or 1)
    quick: bool = False
    memory_timeout: float = 3600.0
    train_sizes: tuple[int, ...] = TRAIN_SIZES
    train_memory_sizes: tuple[int, ...] = TRAIN_MEMORY_SIZES
    train_large_point: tuple[int, int] | None = TRAIN_LARGE_POINT
    train_memory_path: str = "default"

    @classmethod
    def quick_config(cls, **overrides: Any) -> Config:
        """The ``--quick`` configuration, with ``overrides`` applied."""
        base: dict[str, Any] = {
            "sizes": QUICK_SIZES, "memory_sizes": QUICK_MEMORY_SIZES, "large_point": None,
            "memory_paths": ("default",), "rounds": 3, "flops_rounds": 2, "min_time": 0.002,
            "gemm_size": QUICK_GEMM_SIZE,
            "quick": True, "memory_timeout": 300.0, "train_sizes": QUICK_SIZES,
            "train_memory_sizes": QUICK_MEMORY_SIZES, "train_large_point": None,
        }
        return cls(**{**base, **overrides})

    def as_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        """Inverse of :meth:`as_dict`."""
        data = dict(data)
        for key in ("suites", "sizes", "memory_sizes", "memory_paths", "train_sizes",
                    "train_memory_sizes", "large_point", "train_large_point"):
            if data.get(key) is not None:
                data[key] = tuple(data[key])
        return cls(**data)


def thread_env(threads: int) -> dict[str, str]:
    """Environment variables that pin every framework's thread pools to ``threads``.

    They must be set before the framework (and NumPy's BLAS) is loaded, so the benchmark runs
    each backend in a child process started with them. Set here: ``OMP_NUM_THREADS`` (torch,
    MXNet operators, OpenMP BLAS), ``MKL_NUM_THREADS``, ``OPENBLAS_NUM_THREADS`` (NumPy's
    BLAS), ``TF_NUM_INTRAOP_THREADS`` / ``TF_NUM_INTEROP_THREADS`` (TensorFlow's pools: intra
    ``threads``, inter 1), and ``XLA_FLAGS`` with ``--xla_cpu_multi_thread_eigen=true
    intra_op_parallelism_threads=<threads>`` (JAX). In the child, :func:`pin_framework_threads`
    also calls ``torch.set_num_threads`` and TensorFlow's ``tf.config.threading`` setters.
    """
    n = str(int(threads))
    xla = os.environ.get("XLA_FLAGS", "")
    xla = " ".join(f for f in xla.split() if "multi_thread_eigen" not in f
                   and "intra_op_parallelism_threads" not in f)
    xla = f"{xla} --xla_cpu_multi_thread_eigen=true intra_op_parallelism_threads={n}".strip()
    return {
        "OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "OPENBLAS_NUM_THREADS": n,
        "VECLIB_MAXIMUM_THREADS": n, "NUMEXPR_NUM_THREADS": n,
        "TF_NUM_INTRAOP_THREADS": n, "TF_NUM_INTEROP_THREADS": "1",
        "XLA_FLAGS": xla, "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"),
        "KERAS_BACKEND": "tensorflow",
    }


__all__ = ["BATCH", "DEFAULT_SUITES", "DEPTH", "DTYPE", "SUITES", "Config", "thread_env"]


def run_child(module: str, backend: str, config: Any, out: Path, progress: bool) -> int:
    """Runs ``python -m <module>`` for one backend in a child process; its exit status.

    The child gets the thread environment of ``config.threads`` and this checkout on its path;
    its module hands the command line to :func:`child_main`.
    """
    env = {**os.environ, **thread_env(config.threads)}
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    command = [sys.executable, "-m", module, "--backend", backend,
               "--config", json.dumps(config.as_dict()), "--out", str(out)]
    if not progress:
        command.append("--no-progress")
    return subprocess.run(command, env=env, stdout=subprocess.DEVNULL, check=False).returncode


def child_main(
    argv: Sequence[str] | None, module: str, from_dict: Callable[[dict[str, Any]], Any],
    run_backend: Callable[..., dict[str, Any]], prefix: str,
    combine: Callable[[dict[str, Any] | None, dict[str, Any]], dict[str, Any]] | None = None,
) -> int:
    """The child's entry point: runs one backend and writes ``<out>/<prefix>-<backend>.json``.

    Args:
        argv: The command line (``sys.argv[1:]`` when None), as :func:`run_child` builds it.
        module: The child's module, for the usage line.
        from_dict: Makes the configuration from its JSON.
        run_backend: ``run_backend(name, config, progress=...)``, returning the document.
        prefix: The file name's start (``bench``, ``complexity``).
        combine: ``combine(previous document or None, new document)``, what is written when
            the file exists already (default: the new document).
    """
    parser = argparse.ArgumentParser(prog=f"python -m {module}")
    parser.add_argument("--backend", required=True)
    parser.add_argument("--config", required=True, help="the configuration as JSON")
    parser.add_argument("--out", required=True, help=f"directory for {prefix}-<backend>.json")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    doc = run_backend(args.backend, from_dict(json.loads(args.config)),
                      progress=not args.no_progress)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{prefix}-{doc['backend']}.json"
    if combine is not None:
        doc = combine(json.loads(path.read_text()) if path.exists() else None, doc)
    files.write_text(path, json.dumps(doc, indent=1) + "\n")
    print(path)
    return 0
