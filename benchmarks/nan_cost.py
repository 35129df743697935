"""What ``check_numerics=True`` costs a call with finite inputs, on one backend.

By default ``dot_product_attention`` mends nothing and reads nothing on the host. With
``check_numerics=True`` it first makes every query and key row that holds a NaN or inf all NaN
and moves non-finite values onto their keys (``attention.mended``: a few passes over the
inputs), and the automatic choice passes the fused kernels over (torch's SDPA gives way to the
direct or blockwise kernel). This times the same call both ways, in interleaved rounds in one
process, and prints per size and mask the median ratio with its quartiles, the kernel each
way took, and the median ratio to a default call on the checked call's kernel (what the passes
alone cost).

Usage: ``python benchmarks/nan_cost.py BACKEND [--rounds N] [--out FILE] [--device DEVICE]``
(``--device``: torch only, e.g. ``cuda``; every call ends with a read of its output on the host).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import attention_core as ac
from attention_core import registry

SIZES = (16, 128, 512, 2048)
B, H, D = 1, 8, 64

#: The two ways a call is timed: the default, and with the check.
MODES: dict[str, dict[str, Any]] = {"default": {}, "check_numerics": {"check_numerics": True}}


class _KernelNames(logging.Handler):
    """Keeps the name of each kernel that ``attention_core.kernels.run`` logs."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.names: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.names.append(str(record.args[1]) if isinstance(record.args, tuple) else "?")


def kernel_taken(call: Callable[[], Any]) -> str:
    """The kernel one run of ``call`` took (from the DEBUG log of the kernel choice)."""
    log = logging.getLogger("attention_core.kernels")
    handler, level = _KernelNames(), log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    try:
        call()
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    return handler.names[-1] if handler.names else "?"


def time_rounds(calls: dict[str, Callable[[], Any]], reps: int, rounds: int
                ) -> tuple[dict[str, list[float]], float]:
    """Ratios of check_numerics to each other call, one per round, and a default call's time.

    The time is the last round's, per call.
    """
    ratios: dict[str, list[float]] = {name: [] for name in calls if name != "check_numerics"}
    per_call = 0.0
    for _ in range(rounds):
        times = {}
        for name, call in calls.items():
            start = time.perf_counter()
            for _ in range(reps):
                call()
            times[name] = time.perf_counter() - start
        for name in ratios:
            ratios[name].append(times["check_numerics"] / times[name])
        per_call = times["default"] / reps
    return ratios, per_call


def _inputs(ops: Any, rng: np.random.Generator, n: int, device: str | None) -> list[Any]:
    """Queries, keys and values ``(B, H, n, D)`` float32, and lengths ``[n - 3]``."""
    arrays = [ops.from_numpy(rng.standard_normal((B, H, n, D)).astype(np.float32))
              for _ in range(3)] + [ops.from_numpy(np.array([max(1, n - 3)], np.int32))]
    return [x.to(device) for x in arrays] if device else arrays


def _call(ops: Any, q: Any, k: Any, v: Any, valid_lens: Any, kw: dict[str, Any]
          ) -> Callable[[], Any]:
    """One call of ``dot_product_attention``, its output read on the host."""
    return lambda: ops.to_numpy(ac.dot_product_attention(q, k, v, valid_lens, ops=ops, **kw))


def main() -> None:
    """Parses the arguments, times every size and mask, prints (and writes) the lines."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("backend")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", help="also write the lines to this file")
    parser.add_argument("--device", help="torch only: the device of the inputs (e.g. cuda)")
    args = parser.parse_args()
    if args.device and args.backend != "torch":
        parser.error("--device is for the torch backend only")
    ops = registry.load(args.backend).OPS
    rng = np.random.default_rng(0)
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    where = f" on {args.device}" if args.device else ""
    lines = [f"# backend {args.backend}{where}, {stamp}; (B, H, n, D) = ({B}, {H}, n, {D}) "
             f"float32; {args.rounds} interleaved rounds; ratio = check_numerics=True / default"]
    print(lines[0], flush=True)
    for n in SIZES:
        q, k, v, lens = _inputs(ops, rng, n, args.device)
        for label, valid_lens in (("no mask", None), ("valid_lens", lens)):
            calls = {name: _call(ops, q, k, v, valid_lens, kw) for name, kw in MODES.items()}
            taken = {name: kernel_taken(call) for name, call in calls.items()}
            same = {"implementation": taken["check_numerics"]}
            calls["same kernel"] = _call(ops, q, k, v, valid_lens, same)
            reps = max(1, int(2e7 / (n * n * D)))
            ratios, per_call = time_rounds(calls, reps, args.rounds)
            q25, q75 = np.quantile(ratios["default"], [0.25, 0.75])
            line = (f"n={n:5d} {label:10s} ratio {statistics.median(ratios['default']):.3f} "
                    f"[{q25:.3f}, {q75:.3f}]  default {per_call * 1e3:.3f} ms per call "
                    f"({taken['default']}; checked: {taken['check_numerics']}, "
                    f"{statistics.median(ratios['same kernel']):.3f} x that kernel's default)")
            lines.append(line)
            print(line, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
