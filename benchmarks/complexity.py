"""``python -m benchmarks complexity``: conv, RNN and self-attention against n.

The source chapter compares three ways of mapping a sequence of n tokens of width d to another
such sequence (Vaswani et al. 2017, table 1): a convolution with kernel k costs O(k n d^2)
operations in O(1) sequential steps, a recurrent layer O(n d^2) in O(n) sequential steps, and
self-attention O(n^2 d) in O(1) steps, so self-attention does more work than an RNN once
n > d, yet needs no step to wait for the previous one. This command measures it on one
backend: for each n, the forward time of the framework's own 1-D convolution (d -> d
channels, kernel k), the framework's own recurrent layer of width d, and this library's
``MultiHeadAttention(d, heads, bias=True, keep_attention_weights=False)`` on ``(X, X, X)``
(:mod:`.complexity_natives` says which layer each backend uses), batch 1, float32, inference.

Why the whole ``MultiHeadAttention`` and not only the pooling: the convolution (k d^2 weights)
and the RNN (2 d^2) are whole layers with learned projections, so the attention contender is
one too (4 d^2 weights: 8 n d^2 operations for the projections besides the 4 n^2 d of the
pooling); it is the layer a user would put in their place. ``heads`` (default 1, so that a
head has the full depth d, as in the chapter's table) splits the same operations.

Timing reuses :mod:`.timing`: every round times the three contenders once each, in an order
rotated from round to round; a sample repeats a call until it lasts ``min_time``; the tables
give the median over rounds and, for the ratios, the median of the per-round ratios with its
order-statistic confidence interval. The run happens in a child process
(``python -m benchmarks.complexity``) started with the pinned thread environment of
:func:`benchmarks.thread_env`, as the other suites; it writes
``<out>/complexity-<backend>.json``. The parent prints the table and the crossover points and
draws ``<out>/complexity-<backend>.png`` (matplotlib, imported only there; without it,
``--replot`` draws it later from the JSON file in an environment that has it).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from attention_core import files, registry
from benchmarks import child_main, run_child, thread_env, timing
from benchmarks.report import pyplot

#: Identifies the JSON documents of this module.
SCHEMA = "attention-core-complexity/1"
#: The contenders, in the order of the first round (later rounds rotate it).
CONTENDERS = ("conv", "rnn", "attention")
LABELS = {"conv": "1-D convolution", "rnn": "RNN", "attention": "self-attention"}

#: Defaults: n = 16 ... 4096 (powers of two), width 64, kernel 3, one head, batch 1.
SIZES = tuple(2**i for i in range(4, 13))
WIDTH, KERNEL_SIZE, HEADS, BATCH = 64, 3, 1, 1
ROUNDS, MIN_TIME = 15, 0.05
#: ``--quick``: a smoke test in seconds (the numbers mean nothing).
QUICK_SIZES, QUICK_ROUNDS, QUICK_MIN_TIME = (8, 16), 2, 0.001


@dataclass
class ComplexityConfig:
    """What one ``python -m benchmarks complexity`` run measures.

    Attributes:
        sizes: Sequence lengths n, increasing.
        width: d, the width of all three layers.
        kernel_size: k, taps of the convolution (odd, so that ``same`` padding is symmetric
            and every framework pads alike).
        heads: Heads of the attention layer (must divide ``width``).
        batch: Batch size B.
        rounds: Interleaved rounds per n.
        min_time: Seconds one timing sample lasts at least.
        threads: Threads of the framework's intra-op pool.
        quick: Tiny sizes and few rounds (a smoke test).
    """

    sizes: tuple[int, ...] = SIZES
    width: int = WIDTH
    kernel_size: int = KERNEL_SIZE
    heads: int = HEADS
    batch: int = BATCH
    rounds: int = ROUNDS
    min_time: float = MIN_TIME
    threads: int = field(default_factory=lambda: os.cpu_count() or 1)
    quick: bool = False

    def __post_init__(self) -> None:
        self.sizes = tuple(sorted(set(self.sizes)))
        validate(self)

    def as_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ComplexityConfig:
        """Inverse of :meth:`as_dict`."""
        return cls(**{**data, "sizes": tuple(data["sizes"])})


def validate(config: ComplexityConfig) -> None:
    """Checks a configuration; the messages name the command-line option.

    Raises:
        ValueError: A size, width, kernel size, head count, batch, round count, time or
            thread count out of range.
    """
    if not config.sizes or min(config.sizes) < 1:
        raise ValueError(f"--sizes must be positive integers, got {list(config.sizes)}")
    for option, value in (("--width", config.width), ("--heads", config.heads),
                          ("--rounds", config.rounds), ("--threads", config.threads),
                          ("batch", config.batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{option} must be a positive integer, got {value!r}")
    k = config.kernel_size
    if isinstance(k, bool) or not isinstance(k, int) or k < 1 or k % 2 == 0:
        raise ValueError(f"--kernel-size must be an odd positive integer (so that 'same' padding "
                         f"puts (k-1)/2 zeros at each end on every framework), got {k!r}")
    if config.width % config.heads:
        raise ValueError(f"--heads ({config.heads}) must divide --width ({config.width})")
    if not config.min_time >= 0:
        raise ValueError(f"--min-time must be a number of seconds >= 0, got {config.min_time!r}")


# -- the operation model of the chapter's table ------------------------------------------------


def flop_model(n: int, width: int, kernel_size: int, batch: int = 1) -> dict[str, int]:
    """Floating-point operations of one forward call of each contender (2 per multiply-add).

    Only the matrix products are counted (biases, tanh and softmax are O(n d) or O(n^2)):

    * conv: ``2 k n d^2`` (each output position reads k inputs of d channels into d outputs);
    * rnn: ``4 n d^2`` (``x_t W`` and ``h_{t-1} U`` at each of the n steps);
    * attention: ``8 n d^2 + 4 n^2 d`` (four d x d projections; ``Q K^T`` and the pooling
      ``softmax(.) V``, each ``2 n^2 d`` whatever the number of heads).

    Returns:
        ``{"conv": ..., "rnn": ..., "attention": ...}`` for the whole batch.
    """
    n, d, k = int(n), int(width), int(kernel_size)
    return {"conv": batch * 2 * k * n * d * d, "rnn": batch * 4 * n * d * d,
            "attention": batch * (8 * n * d * d + 4 * n * n * d)}


#: Sequential steps: what must wait for what came before (the chapter's second column).
SEQUENTIAL_STEPS = {"conv": "O(1)", "rnn": "O(n)", "attention": "O(1)"}


# -- where self-attention overtakes --------------------------------------------------------------


def crossovers(sizes: Sequence[int], ratios: Sequence[float],
               intervals: Sequence[tuple[float, float]] | None = None) -> list[dict[str, Any]]:
    """Where ``ratio = time(attention) / time(other)`` crosses 1 between measured sizes.

    Between two neighbouring sizes whose ratios lie on different sides of 1, the crossing is
    interpolated linearly in ``log n`` against ``log ratio`` (a straight line on the log-log
    plot).

    Args:
        sizes: Increasing sequence lengths.
        ratios: Positive ratios, one per size.
        intervals: Confidence intervals ``(low, high)`` of the ratios, if known.

    Returns:
        One entry per crossing, in order of n: ``{"between": [n_lo, n_hi], "n": n_cross,
        "attention": "slower" | "faster", "clear": bool | None}``, where ``attention`` says
        how self-attention compares above the crossing and ``clear`` whether the intervals at
        both neighbouring sizes exclude 1 (None without intervals).
    """
    out = []
    bounds: Sequence[tuple[float, float] | None] = intervals if intervals is not None else [None] * len(sizes)
    points = list(zip(sizes, ratios, bounds, strict=True))
    for (n0, r0, i0), (n1, r1, i1) in itertools.pairwise(points):
        if (r0 > 1) == (r1 > 1):
            continue
        l0, l1 = math.log(r0), math.log(r1)
        t = l0 / (l0 - l1) if l0 != l1 else 0.5
        n_cross = math.exp(math.log(n0) + t * (math.log(n1) - math.log(n0)))
        clear = None if i0 is None or i1 is None else all(not lo <= 1 <= hi for lo, hi in (i0, i1))
        out.append({"between": [n0, n1], "n": n_cross, "attention": "slower" if r1 > 1 else "faster",
                    "clear": clear})
    return out


def crossover_text(other: str, sizes: Sequence[int], ratios: Sequence[float],
                   crossings: Sequence[dict[str, Any]]) -> str:
    """One sentence: where self-attention becomes slower or faster than ``other``."""
    if not crossings:
        side = "slower" if ratios[0] > 1 else "faster"
        return (f"self-attention is {side} than the {other} at every n measured "
                f"({sizes[0]} ... {sizes[-1]}): no crossover in this range")
    parts = [f"becomes {c['attention']} than the {other} at n ≈ {c['n']:.0f} "
             f"(between {c['between'][0]} and {c['between'][1]}"
             + ("; uncertain: a confidence interval there contains 1" if c.get("clear") is False else "")
             + ")" for c in crossings]
    first = "faster" if ratios[0] < 1 else "slower"
    return f"self-attention is {first} at n = {sizes[0]}, " + ", then ".join(parts)


# -- one backend, in this process ---------------------------------------------------------------


def _median_ms(values: Sequence[float]) -> float:
    return 1e3 * statistics.median(values)


def _load() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (other work on the machine), where the OS has them."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def _cpu_seconds() -> tuple[float, float, float] | None:
    """(busy CPU seconds of the whole machine, of this process, wall clock), Linux only."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        ticks = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AttributeError):
        return None
    jiffies = [int(x) for x in fields]
    busy = sum(jiffies) - jiffies[3] - (jiffies[4] if len(jiffies) > 4 else 0)  # minus idle, iowait
    own = os.times()
    return busy / ticks, own.user + own.system, time.perf_counter()


def _other_work(start: tuple[float, float, float] | None) -> dict[str, float] | None:
    """CPU seconds that other processes used since ``start`` (:func:`_cpu_seconds`)."""
    end = _cpu_seconds()
    if start is None or end is None:
        return None
    wall = end[2] - start[2]
    other = max(0.0, (end[0] - start[0]) - (end[1] - start[1]))
    return {"wall_s": round(wall, 2), "other_cpu_s": round(other, 2),
            "other_cores": round(other / wall, 3) if wall > 0 else 0.0}


def run_backend(name: str, config: ComplexityConfig, progress: bool = True) -> dict[str, Any]:
    """Times the three contenders at every size on one backend, in this process.

    The thread environment must already be set (it is in the child :func:`run` starts).

    Returns:
        The JSON document (see ``benchmarks/README.md``).
    """
    from benchmarks.complexity_natives import builder, layer_weights
    from benchmarks.run import Progress, machine_info

    b = builder(name, config.threads)
    settings = b.thread_settings()
    doc: dict[str, Any] = {
        "schema": SCHEMA, "backend": b.name, "machine": machine_info(),
        "versions": {"numpy": metadata.version("numpy"), **b.versions()},
        "threads": {"count": config.threads, "env": thread_env(config.threads),
                    "framework": settings},
        "config": config.as_dict(), "dtype": "float32", "mode": "forward, inference",
        "layers": dict(b.layers), "layers_short": dict(b.short),
        "model": {"flops": {"conv": "2 k n d^2", "rnn": "4 n d^2", "attention": "8 n d^2 + 4 n^2 d"},
                  "sequential_steps": SEQUENTIAL_STEPS},
    }
    doc["load_average"] = {"start": _load()}
    cpu_start = _cpu_seconds()
    weights = layer_weights(config.width, config.kernel_size)
    rng = np.random.default_rng(1)
    bar = Progress(len(config.sizes) * config.rounds, f"complexity {b.name}") if progress else None
    if bar is not None:
        bar.show("starting")
    points = []
    for n in config.sizes:
        x = rng.standard_normal((config.batch, n, config.width)).astype(np.float32)
        calls = {"conv": b.conv(x, weights).call, "rnn": b.rnn(x, weights).call,
                 "attention": b.attention(x, weights, config.heads).call}
        tick = functools.partial(bar.step, f"n={n}") if bar is not None else None
        times = timing.interleaved(calls, config.rounds, config.min_time, on_round=tick)
        flops = flop_model(n, config.width, config.kernel_size, config.batch)
        intervals = {c: timing.median_interval(times[c]) for c in CONTENDERS}
        points.append({
            "n": n,
            "ms": {c: _median_ms(times[c]) for c in CONTENDERS},
            "interval_ms": {c: [1e3 * intervals[c].low, 1e3 * intervals[c].high] for c in CONTENDERS},
            "rounds_ms": {c: [1e3 * t for t in times[c]] for c in CONTENDERS},
            "ratios": {f"attention/{c}": timing.ratio(times, "attention", c).as_dict()
                       for c in ("conv", "rnn")},
            "flops": flops,
            "gflops": {c: flops[c] / statistics.median(times[c]) / 1e9 for c in CONTENDERS},
            "attention_path": b.attention_path(config.heads, n, config.batch),
        })
        del calls
    if bar is not None:
        bar.close()
    doc["load_average"]["end"] = _load()
    doc["other_work"] = _other_work(cpu_start)
    doc["points"] = points
    doc["crossovers"] = _crossovers(points)
    doc["finished"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return doc


def _crossovers(points: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    sizes = [p["n"] for p in points]
    out = {}
    for c in ("conv", "rnn"):
        ratios = [p["ratios"][f"attention/{c}"] for p in points]
        out[c] = crossovers(sizes, [r["median"] for r in ratios], [(r["low"], r["high"]) for r in ratios])
    return out


# -- screen report -----------------------------------------------------------------------------


def _ratio(r: dict[str, Any]) -> str:
    return f"{r['median']:.2f} [{r['low']:.2f}, {r['high']:.2f}]"


def report(doc: dict[str, Any]) -> str:
    """The screen report of one run: machine, layers, table, crossovers, operation model."""
    from benchmarks.report import machine_line, render

    c = doc["config"]
    points = doc["points"]
    conf = points[0]["ratios"]["attention/conv"]["confidence"] if points else 0.95
    headers = ["n", "conv ms", "rnn ms", "attention ms", f"attn/conv [{conf:.0%} CI]",
               f"attn/rnn [{conf:.0%} CI]", "attention path"]
    rows = [[str(p["n"]), *(f"{p['ms'][k]:.4g}" for k in CONTENDERS),
             _ratio(p["ratios"]["attention/conv"]), _ratio(p["ratios"]["attention/rnn"]),
             p["attention_path"]] for p in points]
    sizes = [p["n"] for p in points]
    lines = [f"== {doc['backend']} complexity: {machine_line(doc)}"]
    if c.get("quick"):
        lines.append("(--quick: tiny sizes and few rounds; the numbers mean nothing)")
    other = doc.get("other_work")
    if other:
        lines.append(f"other processes used {other['other_cpu_s']:.1f} CPU seconds during the "
                     f"{other['wall_s']:.1f} s run ({other['other_cores']:.2f} cores on average; "
                     "above a few hundredths, they shared the cores and slowed the timings)")
    lines += [f"width d = {c['width']}, kernel k = {c['kernel_size']}, batch {c['batch']}, "
              f"{c['heads']} head(s), float32 forward in inference mode; medians of "
              f"{c['rounds']} interleaved rounds",
              *(f"  {k:<9} {doc['layers'][k]}" for k in CONTENDERS),
              "", render((headers, rows), False), ""]
    for name in ("conv", "rnn"):
        ratios = [p["ratios"][f"attention/{name}"]["median"] for p in points]
        lines.append(crossover_text(LABELS[name], sizes, ratios, doc["crossovers"][name]))
    if points:
        last = points[-1]
        lines.append(f"achieved GFLOP/s at n = {last['n']} (model below / median time): " + ", ".join(
            f"{LABELS[k]} {last['gflops'][k]:.3g}" for k in CONTENDERS))
    d = c["width"]
    lines.append(f"operation model (2 per multiply-add): conv 2knd², RNN 4nd² in n sequential "
                 f"steps, self-attention 8nd² + 4n²d in one; the chapter's n²d exceeds nd² "
                 f"from n > d = {d}")
    return "\n".join(lines)


# -- the plot ----------------------------------------------------------------------------------


def plot(doc: dict[str, Any], path: str | Path) -> str | None:
    """Draws time against n (log-log) and the attention ratios into a PNG file.

    Left: median forward time per contender with its confidence interval, and dashed guides
    proportional to n and n^2 through the mean of the three at the largest n. Right: time of
    self-attention divided by the convolution's and the RNN's, with the crossovers marked.

    Returns:
        The path written, or None when matplotlib is not installed.
    """
    plt = pyplot()
    if plt is None:
        return None
    from matplotlib.ticker import (  # type: ignore[import-not-found, unused-ignore]
        FuncFormatter,
        LogLocator,
        NullFormatter,
        ScalarFormatter,
    )

    c, points = doc["config"], doc["points"]
    sizes = np.array([p["n"] for p in points], float)
    colors = {"conv": "C0", "rnn": "C1", "attention": "C3"}
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.2))
    all_ms = []
    for k in CONTENDERS:
        ms = np.array([p["ms"][k] for p in points])
        lo = ms - np.array([p["interval_ms"][k][0] for p in points])
        hi = np.array([p["interval_ms"][k][1] for p in points]) - ms
        all_ms += [*ms]
        short = doc.get("layers_short", {}).get(k, k)
        if k == "attention":
            short = f"our MultiHeadAttention, {c['heads']} head{'s' if c['heads'] > 1 else ''}"
        left.errorbar(sizes, ms, yerr=[lo, hi], marker="o", ms=4, capsize=2, color=colors[k],
                      label=f"{LABELS[k]} ({short})")
    anchor_n = sizes[-1]
    anchor_ms = math.exp(statistics.fmean(math.log(points[-1]["ms"][k]) for k in CONTENDERS))
    grid = np.geomspace(sizes[0], sizes[-1], 50)
    for power, style, label in ((1, "--", "∝ n (guide)"), (2, ":", "∝ n² (guide)")):
        left.plot(grid, anchor_ms * (grid / anchor_n) ** power, style, color="0.55", lw=1.0,
                  label=label)
    low, high = min(all_ms), max(all_ms)
    left.set_ylim(low / 2, high * 2)
    left.set(xscale="log", yscale="log", xlabel="sequence length n (tokens)",
             ylabel="forward time per call (ms, median)",
             title=f"(a) time vs n: width d = {c['width']}, kernel k = {c['kernel_size']}, "
                   f"batch {c['batch']}")
    left.legend(fontsize=8, loc="best")
    for other, marker in (("conv", "s"), ("rnn", "^")):
        r = [p["ratios"][f"attention/{other}"] for p in points]
        med = np.array([x["median"] for x in r])
        err = [med - np.array([x["low"] for x in r]), np.array([x["high"] for x in r]) - med]
        right.errorbar(sizes, med, yerr=err, marker=marker, ms=5, capsize=2, color=colors[other],
                       label=f"self-attention ÷ {LABELS[other]}")
        for cross in doc["crossovers"][other]:
            right.axvline(cross["n"], color=colors[other], ls=":", lw=1.2)
            right.annotate(f"n ≈ {cross['n']:.0f}", (cross["n"], 0.03), xycoords=("data", "axes fraction"),
                           rotation=90, ha="center", va="bottom", fontsize=8, color=colors[other],
                           bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.85})
    right.axhline(1.0, color="0.3", lw=1, ls="--", label="equal time")
    if doc["crossovers"]["conv"] or doc["crossovers"]["rnn"]:
        right.plot([], [], ":", color="0.3", label="crossover (log-log interpolation)")
    right.set(xscale="log", yscale="log", xlabel="sequence length n (tokens)",
              ylabel="time ratio (median of per-round ratios)",
              title="(b) self-attention ÷ the other layer (above 1: attention slower)")
    right.legend(fontsize=8, loc="best")
    for ax in (left, right):
        ax.xaxis.set_major_locator(LogLocator(base=2))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_locator(LogLocator(base=2, subs=()))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.grid(True, which="both", alpha=0.3)
    quick = " (--quick: the numbers mean nothing)" if c.get("quick") else ""
    fig.suptitle(f"{doc['backend']}: conv, RNN and self-attention forward time, float32, "
                 f"{doc['threads']['count']} thread(s), {doc['machine']['cpu']}{quick}", fontsize=11)
    fig.tight_layout()
    files.save_figure(fig, path, dpi=110)
    plt.close(fig)
    return str(path)


# -- command line --------------------------------------------------------------------------------


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.replace(",", " ").split())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 16,32,64, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def configure(parser: argparse.ArgumentParser) -> None:
    """Adds the ``python -m benchmarks complexity`` arguments to a (sub)parser."""
    parser.add_argument("--backend", metavar="NAME",
                        help=f"the backend to time (default: the active one, ${registry.ENV_VAR} or numpy)")
    parser.add_argument("--sizes", type=_ints, metavar="N,...",
                        help="sequence lengths (default 16,32,...,4096; --quick: 8,16)")
    parser.add_argument("--width", type=int, default=WIDTH, help=f"width d of all three layers "
                                                                 f"(default {WIDTH})")
    parser.add_argument("--kernel-size", type=int, default=KERNEL_SIZE,
                        help=f"kernel size k of the convolution, odd (default {KERNEL_SIZE})")
    parser.add_argument("--heads", type=int, default=HEADS,
                        help=f"heads of the attention layer, dividing --width (default {HEADS})")
    parser.add_argument("--rounds", type=int, help=f"interleaved rounds per n (default {ROUNDS}; "
                                                   f"--quick: {QUICK_ROUNDS})")
    parser.add_argument("--min-time", type=float, metavar="SECONDS",
                        help=f"shortest timing sample (default {MIN_TIME}; --quick: {QUICK_MIN_TIME})")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help=f"threads of the framework (default: all cores, {os.cpu_count() or 1} here)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, two rounds: a smoke test")
    parser.add_argument("--out", default="benchmarks/results",
                        help="directory for complexity-<backend>.json and .png (default: benchmarks/results)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument("--replot", metavar="PATH",
                        help="instead of running: print the table and draw the PNG of an existing "
                             "complexity-<backend>.json (or of every one in a directory)")


def config_from(args: argparse.Namespace) -> ComplexityConfig:
    """The :class:`ComplexityConfig` the arguments ask for.

    Raises:
        ValueError: An option out of range (see :func:`validate`).
    """
    quick = bool(args.quick)
    return ComplexityConfig(
        sizes=args.sizes or (QUICK_SIZES if quick else SIZES), width=args.width,
        kernel_size=args.kernel_size, heads=args.heads,
        rounds=args.rounds if args.rounds is not None else (QUICK_ROUNDS if quick else ROUNDS),
        min_time=args.min_time if args.min_time is not None else (QUICK_MIN_TIME if quick else MIN_TIME),
        threads=args.threads, quick=quick)


def load(path: str | Path) -> list[dict[str, Any]]:
    """The ``complexity-<backend>.json`` documents of a file or a directory.

    Raises:
        ValueError: None found.
    """
    from tools import markdown

    target = Path(path)
    if target.is_file():
        doc = json.loads(target.read_text())
        if isinstance(doc, dict) and doc.get("schema") == SCHEMA:
            return [doc]
        raise ValueError(f"{target} is not a complexity result ({SCHEMA})")
    return markdown.load_backend_documents(
        target, "complexity-*.json", lambda doc: isinstance(doc, dict) and doc.get("schema") == SCHEMA,
        f"no complexity results (complexity-<backend>.json) in {target}: run "
        "python -m benchmarks complexity --out DIR first")


def _show(doc: dict[str, Any], folder: Path) -> None:
    """Prints a run's report and draws its PNG next to the JSON file."""
    print(report(doc))
    json_path = folder / f"complexity-{doc['backend']}.json"
    png = plot(doc, folder / f"complexity-{doc['backend']}.png")
    print(f"\nsaved {json_path}" + (
        f" and {png}" if png else " (no plot: matplotlib is not installed; pip install matplotlib, "
                                  f"then python -m benchmarks complexity --replot {json_path})"))


def run(args: argparse.Namespace) -> int:
    """The ``python -m benchmarks complexity`` command; returns the exit status.

    Raises:
        ValueError: An unknown backend, an option out of range, or --replot without results.
        ImportError: The backend is not installed.
    """
    if args.replot:
        target = Path(args.replot)
        for doc in load(target):
            _show(doc, target if target.is_dir() else target.parent)
        return 0
    config = config_from(args)
    name = registry.canonical_name(args.backend) if args.backend else registry.backend()
    if not registry.is_installed(name):
        raise registry.BackendNotInstalledError(
            f"backend {name!r} is not installed here: {registry.PIP[name]}")
    out = Path(args.out)
    if run_child("benchmarks.complexity", name, config, out, not args.no_progress) != 0:
        print(f"error: the complexity benchmark failed on {name} (see above)", file=sys.stderr)
        return 1
    _show(json.loads((out / f"complexity-{name}.json").read_text()), out)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the child: runs one backend and writes its JSON file."""
    return child_main(argv, "benchmarks.complexity", ComplexityConfig.from_dict,
                      run_backend, "complexity")


if __name__ == "__main__":
    sys.exit(main())
