"""Achieved GFLOP/s of the attention core, as a fraction of the same process's GEMM rate.

Attention on ``(B, H, n, D)`` does two products of ``2 B H n^2 D`` flops each (scores and
pooling), so its rate is ``4 B H n^2 D / time``, counted in full although a quarter of the
keys are masked. The denominator is the rate of a square fp32 matrix product
(:data:`~benchmarks.GEMM_SIZE`) in the same framework, process and thread count: a
fraction near 1 means attention runs as fast as the machine multiplies matrices.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from benchmarks import BATCH, DEPTH, timing


def attention_flops(heads: int, n: int, batch: int = BATCH, depth: int = DEPTH) -> float:
    """``4 B H n^2 D``: the scores and the pooling products."""
    return 4.0 * batch * heads * n * n * depth


def rate(call: timing.Call, flops: float, samples: int, min_time: float) -> dict[str, float]:
    """GFLOP/s of a call: the median over ``samples`` timed samples (after one warm-up call).

    Returns:
        ``{"seconds": median seconds per call, "gflops": flops / seconds / 1e9}``.
    """
    call()
    calls = timing.calibrate(call, min_time)
    seconds = statistics.median(timing.sample(call, calls) for _ in range(max(1, samples)))
    return {"seconds": seconds, "gflops": flops / seconds / 1e9}


def gemm_rate(gemm: Callable[[int], timing.Call], size: int, samples: int,
              min_time: float) -> dict[str, float]:
    """The rate of a square ``(size, size) @ (size, size)`` product (``2 size^3`` flops)."""
    out = rate(gemm(size), 2.0 * size**3, samples, min_time)
    return {**out, "size": float(size)}


def core_rates(
    harness: Any, heads: int, n: int, samples: int, min_time: float, gemm_gflops: float,
    on_path: Callable[[], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """Rates of every attention path of a harness at one n, each with its GEMM fraction.

    Args:
        harness: A :class:`~benchmarks.natives.Harness`.
        heads: H.
        n: Sequence length (queries = keys).
        samples: Timed samples per path (the median is kept).
        min_time: Seconds one sample lasts at least.
        gemm_gflops: The GEMM rate to divide by.
        on_path: Called after each path (a progress bar).

    Returns:
        Path -> ``{"seconds", "gflops", "fraction_of_gemm", "implementation"}``.
    """
    q, k, v, lens = harness.qkv(heads, n)
    flops = attention_flops(heads, n)
    out: dict[str, dict[str, Any]] = {}
    for path in harness.paths():
        result: dict[str, Any] = rate(harness.attention_call(path, q, k, v, lens), flops,
                                      samples, min_time)
        result["fraction_of_gemm"] = result["gflops"] / gemm_gflops
        result["implementation"] = harness.resolved(path, heads, n)
        out[path] = result
        if on_path is not None:
            on_path()
    return out
