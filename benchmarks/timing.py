"""Interleaved A/B timing: the median of per-round ratios, its confidence interval, A/A control.

Each round times every contender once, in an order that rotates from round to round, so slow
drifts of the machine (another process, frequency scaling, a warm cache) touch all contenders
alike. A round's ratio is ``time(candidate) / time(baseline)`` from the same round; the result
is the median over rounds with a distribution-free confidence interval for the median (order
statistics of the binomial, no normality assumed). A second, identical copy of the baseline
timed in the same rounds gives the A/A control: its median ratio should be 1 and its interval
should contain 1; when it does not, the rounds are too noisy to trust the other ratios.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

#: A function that runs the measured call once and waits until its result is computed.
Call = Callable[[], Any]


@dataclass(frozen=True)
class Ratio:
    """The median of per-round ratios and a confidence interval for it.

    Attributes:
        median: Median over rounds of ``time(candidate) / time(baseline)``.
        low: Lower end of the interval.
        high: Upper end of the interval.
        confidence: The interval's actual coverage (at least the one asked for when there are
            enough rounds; with very few rounds, the coverage of ``[min, max]``).
        rounds: Number of rounds.
    """

    median: float
    low: float
    high: float
    confidence: float
    rounds: int

    def as_dict(self) -> dict[str, float | int]:
        """The fields as a JSON-ready dict."""
        return {"median": self.median, "low": self.low, "high": self.high,
                "confidence": self.confidence, "rounds": self.rounds}


def median_interval(values: Sequence[float], confidence: float = 0.95) -> Ratio:
    """The median of ``values`` and an order-statistic confidence interval for it.

    The interval is ``[x_(k), x_(n+1-k)]`` (sorted, 1-based) with the largest ``k`` for which
    ``P(Binomial(n, 1/2) <= k - 1) <= (1 - confidence) / 2``: it covers the true median with
    probability at least ``confidence`` whatever the distribution. With too few values for
    that, the interval is ``[min, max]`` and ``confidence`` reports its real coverage
    ``1 - 2^(1-n)``.

    Args:
        values: At least one number.
        confidence: Coverage asked for, in (0, 1).

    Returns:
        The :class:`Ratio`.

    Raises:
        ValueError: ``values`` is empty or ``confidence`` is outside (0, 1).
    """
    if not values:
        raise ValueError("median_interval needs at least one value")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    x = sorted(float(v) for v in values)
    n = len(x)
    tail = 0.0  # P(Bin(n, 1/2) <= k - 1) for the current k
    k = 0
    while k + 1 <= n // 2:
        step = tail + math.comb(n, k) / 2**n
        if step > (1 - confidence) / 2:
            break
        tail, k = step, k + 1
    if k == 0:  # too few rounds: [min, max]
        k, tail = 1, 1 / 2**n
    return Ratio(statistics.median(x), x[k - 1], x[n - k], 1 - 2 * tail, n)


def calibrate(call: Call, min_time: float, max_calls: int = 1000) -> int:
    """How many back-to-back calls make one sample last at least ``min_time`` seconds."""
    calls = 1
    while True:
        start = time.perf_counter()
        for _ in range(calls):
            call()
        elapsed = time.perf_counter() - start
        if elapsed >= min_time or calls >= max_calls:
            return calls
        calls = min(max_calls, max(calls * 2, math.ceil(calls * min_time / max(elapsed, 1e-9))))


def sample(call: Call, calls: int) -> float:
    """Seconds per call over ``calls`` back-to-back calls."""
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls


def interleaved(
    contenders: Mapping[str, Call],
    rounds: int,
    min_time: float,
    warmup: int = 2,
    on_round: Callable[[], None] | None = None,
) -> dict[str, list[float]]:
    """Times the contenders in interleaved rounds.

    Args:
        contenders: Name -> call (which must wait for its result).
        rounds: Number of rounds; in round ``r`` the contenders run in their order rotated by
            ``r``.
        min_time: Seconds one sample lasts at least; each contender gets its own number of
            calls per sample, fixed before the first round.
        warmup: Calls of each contender before calibrating (compilation, caches, allocators).
        on_round: Called after each round (a progress bar).

    Returns:
        Name -> seconds per call, one value per round.
    """
    names = list(contenders)
    for name in names:
        for _ in range(warmup):
            contenders[name]()
    calls = {name: calibrate(contenders[name], min_time) for name in names}
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(sample(contenders[name], calls[name]))
        if on_round is not None:
            on_round()
    return times


def ratio(times: Mapping[str, Sequence[float]], candidate: str, baseline: str,
          confidence: float = 0.95) -> Ratio:
    """The median per-round ratio ``candidate / baseline`` and its interval."""
    pairs = zip(times[candidate], times[baseline], strict=True)
    return median_interval([c / b for c, b in pairs], confidence)


def new_against_old(label: str, new: Call, old: Call, rounds: int, min_time: float) -> str:
    """One line: ``new/old`` over interleaved rounds, with the A/A control ``old'/old``.

    ``old`` is timed twice per round (``old`` and ``old'``); ``new`` and ``old`` must give the
    same numbers (checked first, to 1e-4 relative). The line ends with ``old``'s median time.
    """
    np.testing.assert_allclose(new(), old(), rtol=1e-4, atol=1e-5)
    times = interleaved({"old": old, "new": new, "old'": old}, rounds, min_time)
    r, aa = ratio(times, "new", "old"), ratio(times, "old'", "old")
    per_call = 1e3 * statistics.median(times["old"])
    return (f"{label}: new/old {r.median:.3f} [{r.low:.3f}, {r.high:.3f}]   "
            f"A/A {aa.median:.3f} [{aa.low:.3f}, {aa.high:.3f}]   old {per_call:.1f} ms")


def ab_parser(description: str, sizes: str) -> argparse.ArgumentParser:
    """The arguments of a new-against-old script: ``--sizes``, ``--rounds``, ``--min-time``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--sizes", default=sizes, help="comma-separated sequence lengths")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--min-time", type=float, default=0.2)
    return parser
