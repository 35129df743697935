"""What the NaN handling costs a call with finite inputs, on one backend.

``dot_product_attention`` first probes the inputs (``attention._probe``: one sum of the
values, the largest row sums of squares of the queries and keys, and one host sync) and
mends nothing when they are finite; otherwise it moves non-finite values onto their keys
(:func:`attention_core.attention.values_onto_keys`) and makes non-finite query and key rows
NaN. This times the same call with that handling and without it (both functions replaced by
no-ops, the code before the NaN handling), in interleaved rounds in one process, and prints the
median ratio with its quartiles per size and mask.

Usage: ``python benchmarks/nan_cost.py BACKEND [--rounds N] [--out FILE]`` (the backend's default
path: torch's fused kernel, the direct path elsewhere at these sizes).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import attention_core as ac
from attention_core import attention, registry

SIZES = (16, 128, 512, 2048)
B, H, D = 1, 8, 64


def time_pair(call: Callable[[], Any], reps: int, rounds: int) -> tuple[list[float], float]:
    """Ratios with/without the NaN handling, one per round, and the last round's time per call."""
    real = (attention._probe, attention.values_onto_keys)
    modes = {"with": real,
             "without": (lambda ops, summed, bounded: (True, ()), lambda ops, k, v: (k, v))}
    ratios, per_call = [], 0.0
    try:
        for _ in range(rounds):
            times = {}
            for name, fns in modes.items():
                attention._probe, attention.values_onto_keys = fns  # type: ignore[assignment]
                start = time.perf_counter()
                for _ in range(reps):
                    call()
                times[name] = time.perf_counter() - start
            ratios.append(times["with"] / times["without"])
            per_call = times["with"] / reps
    finally:
        attention._probe, attention.values_onto_keys = real
    return ratios, per_call


def main() -> None:
    """Parses the arguments, times every size and mask, prints (and writes) the lines."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("backend")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", help="also write the lines to this file")
    args = parser.parse_args()
    ops = registry.load(args.backend).OPS
    rng = np.random.default_rng(0)
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [f"# backend {args.backend}, {stamp}; (B, H, n, D) = ({B}, {H}, n, {D}) float32; "
             f"{args.rounds} interleaved rounds; ratio = with the NaN handling / without"]
    print(lines[0], flush=True)
    for n in SIZES:
        q, k, v = (ops.from_numpy(rng.standard_normal((B, H, n, D)).astype(np.float32))
                   for _ in range(3))
        lens = ops.from_numpy(np.array([n - 3], np.int32))
        for label, valid_lens in (("no mask", None), ("valid_lens", lens)):
            def call(q: Any = q, k: Any = k, v: Any = v, valid_lens: Any = valid_lens) -> Any:
                return ops.to_numpy(ac.dot_product_attention(q, k, v, valid_lens, ops=ops))

            call()
            reps = max(1, int(2e7 / (n * n * D)))
            ratios, per_call = time_pair(call, reps, args.rounds)
            q25, q75 = np.quantile(ratios, [0.25, 0.75])
            line = (f"n={n:5d} {label:10s} ratio {statistics.median(ratios):.3f} "
                    f"[{q25:.3f}, {q75:.3f}]  {per_call * 1e3:.3f} ms per call with it")
            lines.append(line)
            print(line, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
