"""Sliding-window and grouped-query attention: what they save, measured (one backend a run).

``python -m benchmarks.modern --backend numpy --rounds 3 --out benchmarks/results`` runs, in
this process, the suites of the backend (``--suite window,gqa`` picks; by default ``window``
on numpy and jax, ``gqa`` on numpy, torch, jax and tensorflow):

* ``window``: :func:`attention_core.dot_product_attention` with ``causal=True,
  window=1024, implementation="blockwise"`` on ``(1, 4, n, 64)`` queries, keys and values at
  n = 8192 and 65536, and, for contrast, the same path without a window at n = 8192 and
  16384. The four calls run in interleaved rounds (one call per sample; the two calls of each
  compared pair back to back, in an order alternating each round); the per-token time is
  seconds / n, and the ratio of the per-token times of the larger n to the smaller is taken
  in each round (median over rounds, with its interval). With a
  window the blockwise path skips the key blocks outside it, so the work is O(n·w) and the
  ratio should stay near 1 (target <= 1.5); without one it is O(n²) and the ratio is near 2
  for a doubled n. On JAX the call is ``jax.jit``-ed, compiled before the timing, and waited
  for with ``block_until_ready``.
* ``gqa``: ``MultiHeadAttention(512, 8)`` against ``MultiHeadAttention(512, 8,
  num_kv_heads=2)`` (both ``keep_attention_weights=False``, no biases): the bytes of
  ``W_k`` and ``W_v`` (from the layer's weights), the bytes of the key/value cache of capacity
  4096 that :func:`attention_core.multi_head_attention` with ``capacity=`` returns (the arrays' own
  ``nbytes``), and the forward time of causal self-attention at n = 1024 and 4096 (B = 1),
  the four layer calls in interleaved rounds (MHA and GQA at one n back to back, their order
  alternating), with the ratio GQA ÷ MHA per round. The implementation each call takes by
  default is recorded (the choice
  :func:`attention_core.kernels.choose` made during the call). torch runs in
  eval mode under ``torch.inference_mode()``; TensorFlow calls a ``tf.function``; JAX a
  ``jax.jit`` of ``apply``.

It writes ``modern-<backend>.json`` (a run of some suites keeps the other suites' sections of
an earlier file). ``--merge DIR --page FILE`` renders every backend's file into the part of
``FILE`` between ``<!-- measured: begin -->`` and ``<!-- measured: end -->`` (creating the page
with its title and a "Measured" section when it does not exist). ``--quick`` runs tiny sizes
(the smoke test). Run from the repository root.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

import attention_core as ac
from attention_core import kernels, registry
from benchmarks.run import machine_info
from benchmarks.timing import calibrate, median_interval, sample
from tools import markdown

SCHEMA = "attention-core-modern/1"
BACKENDS = ("numpy", "torch", "tensorflow", "jax", "mxnet")
SUITES = ("window", "gqa")
#: The suites a run without ``--suite`` measures on each backend.
DEFAULT_SUITES = {"numpy": ("window", "gqa"), "jax": ("window", "gqa"), "torch": ("gqa",),
                  "tensorflow": ("gqa",), "mxnet": ()}

#: The sliding-window suite: ``(batch, heads, n, depth)`` inputs, the window, the n of the
#: windowed calls and of the calls without a window.
WINDOW: dict[str, Any] = {"batch": 1, "heads": 4, "depth": 64, "window": 1024,
                          "window_sizes": [8192, 65536], "full_sizes": [8192, 16384]}
QUICK_WINDOW: dict[str, Any] = {"batch": 1, "heads": 2, "depth": 16, "window": 32,
                                "window_sizes": [128, 512], "full_sizes": [128, 256]}
#: The grouped-query suite: the layers, the cache's capacity and the n of the forward.
GQA: dict[str, Any] = {"num_hiddens": 512, "num_heads": 8, "num_kv_heads": 2, "batch": 1,
                       "capacity": 4096, "sizes": [1024, 4096]}
QUICK_GQA: dict[str, Any] = {"num_hiddens": 32, "num_heads": 8, "num_kv_heads": 2, "batch": 1,
                             "capacity": 64, "sizes": [16, 32]}
#: Targets: per-token ratio of the windowed path, GQA ÷ MHA forward time, bytes ratios.
WINDOW_TARGET, GQA_TIME_TARGET = 1.5, 1.0

TITLE = "# The attention of current models"
START, END = "<!-- measured: begin -->", "<!-- measured: end -->"


# -- frameworks --------------------------------------------------------------------------------


def _sync(backend: str) -> Callable[[Any], Any]:
    """Waits until an output is computed (JAX dispatches asynchronously; MXNet too)."""
    if backend == "jax":
        import jax

        return jax.block_until_ready
    if backend == "mxnet":
        return lambda x: x.wait_to_read() or x
    return lambda x: x


@contextlib.contextmanager
def _no_autograd(backend: str) -> Iterator[None]:
    """torch: ``inference_mode`` (as inference runs); elsewhere nothing."""
    if backend == "torch":
        import torch

        with torch.inference_mode():
            yield
    else:
        yield


@contextlib.contextmanager
def taken_paths() -> Iterator[list[str]]:
    """Records the path every ``dot_product_attention`` called (or traced) meanwhile chooses."""
    chosen: list[str] = []
    original = kernels.choose

    def spy(*args: Any, **kwargs: Any) -> Any:
        entry, passed = original(*args, **kwargs)
        chosen.append(entry.name)
        return entry, passed

    kernels.choose = spy
    try:
        yield chosen
    finally:
        kernels.choose = original


def _versions(backend: str) -> dict[str, str]:
    module = __import__(backend)
    return {"python": platform.python_version(), backend: str(module.__version__),
            "numpy": np.__version__}


# -- the sliding window ------------------------------------------------------------------------


def window_calls(backend: str, config: Mapping[str, Any]) -> dict[str, tuple[int, Callable[[], Any]]]:
    """Name -> ``(n, call)``: the windowed calls and the calls without a window."""
    ops = registry.get_ops(backend)
    sync = _sync(backend)
    B, H, D, w = config["batch"], config["heads"], config["depth"], config["window"]

    def attend(window: int | None) -> Callable[..., Any]:
        def run(q: Any, k: Any, v: Any) -> Any:
            return ac.dot_product_attention(q, k, v, causal=True, window=window,
                                            implementation="blockwise")

        if backend == "jax":
            import jax

            return jax.jit(run)
        return run

    calls: dict[str, tuple[int, Callable[[], Any]]] = {}
    for kind, sizes, window in (("window", config["window_sizes"], w),
                                ("full", config["full_sizes"], None)):
        for n in sizes:
            rng = np.random.default_rng(n)
            q, k, v = (ops.from_numpy(rng.standard_normal((B, H, n, D)).astype(np.float32))
                       for _ in range(3))
            calls[f"{kind} {n}"] = (n, functools.partial(_synced, sync, attend(window), q, k, v))
    return calls


def paired_rounds(calls: Mapping[str, Callable[[], Any]], pairs: Sequence[Sequence[str]],
                  rounds: int, min_time: float, warmup: int) -> dict[str, list[float]]:
    """Interleaved rounds in which the two calls of each compared pair run back to back.

    Each round times every pair, the pairs' order and the order within each pair rotated
    round by round, so that a ratio's two samples are always neighbours in time (as
    :func:`benchmarks.timing.interleaved` does for one group; here the noise of a loaded
    machine between a pair's samples is as short as it can be). A sample repeats a call until it
    lasts ``min_time`` (the count fixed before the first round, after ``warmup`` calls).
    """
    for call in calls.values():
        for _ in range(warmup):
            call()
    counts = {name: calibrate(call, min_time) for name, call in calls.items()}
    times: dict[str, list[float]] = {name: [] for name in calls}
    for r in range(rounds):
        shift = r % len(pairs)
        for pair in [*pairs[shift:], *pairs[:shift]]:
            for name in (pair if r % 2 == 0 else list(reversed(pair))):
                times[name].append(sample(calls[name], counts[name]))
    return times


def _synced(sync: Callable[[Any], Any], fn: Callable[..., Any], *args: Any) -> Any:
    return sync(fn(*args))


def _per_token_ratio(times: Mapping[str, Sequence[float]], small: tuple[str, int],
                     large: tuple[str, int], target: float | None) -> dict[str, Any]:
    """Per-token time at the larger n ÷ at the smaller, per round and of the best rounds."""
    (a, n_a), (b, n_b) = small, large
    per_round = [(tb / n_b) / (ta / n_a) for ta, tb in zip(times[a], times[b], strict=True)]
    best = (min(times[b]) / n_b) / (min(times[a]) / n_a)
    out = {"sizes": [n_a, n_b], "per_round": median_interval(per_round).as_dict(), "best": best,
           "target": target}
    if target is not None:
        out["met"] = bool(statistics.median(per_round) <= target)
    return out


def measure_window(backend: str, rounds: int, config: Mapping[str, Any]) -> dict[str, Any]:
    """The ``window`` section (see the module's docstring)."""
    calls = window_calls(backend, config)
    with _no_autograd(backend):
        for _, call in calls.values():  # compiles (JAX) before the timing
            call()
        ws, fs = config["window_sizes"], config["full_sizes"]
        pairs = [[f"window {n}" for n in ws], [f"full {n}" for n in fs]]
        times = paired_rounds({name: call for name, (_, call) in calls.items()}, pairs, rounds,
                              min_time=0.0, warmup=0)
    points = []
    for name, (n, _) in calls.items():
        kind = name.split()[0]
        s = times[name]
        points.append({"kind": kind, "n": n, "window": config["window"] if kind == "window" else None,
                       "seconds": s, "seconds_median": statistics.median(s),
                       "seconds_best": min(s), "us_per_token_median": 1e6 * statistics.median(s) / n,
                       "us_per_token_best": 1e6 * min(s) / n})
    return {
        "config": dict(config), "rounds": rounds, "implementation": "blockwise",
        "jit": backend == "jax", "points": points,
        "ratios": {
            "window": _per_token_ratio(times, (f"window {ws[0]}", ws[0]), (f"window {ws[1]}", ws[1]),
                                       WINDOW_TARGET),
            "full": _per_token_ratio(times, (f"full {fs[0]}", fs[0]), (f"full {fs[1]}", fs[1]), None),
        },
        "machine": machine_info(), "versions": _versions(backend),
    }


# -- grouped-query attention -------------------------------------------------------------------


class _Layer:
    """One backend's ``MultiHeadAttention``: built with given weights, called and read back."""

    def __init__(self, backend: str, config: Mapping[str, Any], kv_heads: int | None,
                 weights: Mapping[str, np.ndarray]) -> None:
        self.backend = backend
        module = registry.load(backend)
        ops = registry.get_ops(backend)
        h, H = config["num_hiddens"], config["num_heads"]
        layer = module.MultiHeadAttention(h, H, num_kv_heads=kv_heads, keep_attention_weights=False)
        sync = _sync(backend)
        self.call: Callable[[Any], Any]
        self.read: Callable[[], Mapping[str, Any]]
        if backend == "jax":
            import jax

            self.variables = module.init_from_weights(layer, weights)
            fn = jax.jit(lambda variables, x: layer.apply(variables, x, x, x, causal=True))
            self.call = lambda x: sync(fn(self.variables, x))
            self.read = lambda: module.get_weights(self.variables)
        elif backend == "tensorflow":
            import tensorflow as tf

            tiny = ops.from_numpy(np.zeros((1, 2, h), np.float32))
            layer(tiny, tiny, tiny)  # builds the weights
            layer.set_weights(weights)
            tf_fn = tf.function(lambda x: layer(x, x, x, causal=True), autograph=False)
            self.call = tf_fn
            self.read = layer.get_weights
        else:
            if backend == "mxnet":
                tiny = ops.from_numpy(np.zeros((1, 2, h), np.float32))
                layer(tiny, tiny, tiny)
            layer.set_weights(weights)
            if backend == "torch":
                layer.eval()
            self.call = lambda x: sync(layer(x, x, x, causal=True))
            self.read = layer.get_weights

    def weights(self) -> dict[str, np.ndarray]:
        """The layer's canonical weights as NumPy arrays."""
        ops = registry.get_ops(self.backend)
        return {k: np.asarray(ops.to_numpy(v)) if not isinstance(v, np.ndarray) else v
                for k, v in self.read().items()}


def _nbytes(backend: str, x: Any) -> int:
    """The bytes an array holds: its own ``nbytes`` (TensorFlow's tensors: their NumPy copy's)."""
    n = getattr(x, "nbytes", None)
    if isinstance(n, int):
        return n
    return int(np.asarray(registry.get_ops(backend).to_numpy(x)).nbytes)


def measure_gqa(backend: str, rounds: int, config: Mapping[str, Any],
                min_time: float = 0.2) -> dict[str, Any]:
    """The ``gqa`` section (see the module's docstring)."""
    import backends.numpy as np_layers

    ops = registry.get_ops(backend)
    h, H, Hkv, B = config["num_hiddens"], config["num_heads"], config["num_kv_heads"], config["batch"]
    kinds = {"mha": None, "gqa": Hkv}
    drawn = {}
    for kind, kv in kinds.items():  # the same seeded weights on every backend
        host = np_layers.MultiHeadAttention(h, H, num_kv_heads=kv, seed=0)
        host(*(np.zeros((1, 2, h), np.float32),) * 3)
        drawn[kind] = {k: v.astype(np.float32) for k, v in host.get_weights().items()}
    layers = {kind: _Layer(backend, config, kv, drawn[kind]) for kind, kv in kinds.items()}
    kv_bytes: dict[str, Any] = {}
    cache: dict[str, Any] = {}
    rng = np.random.default_rng(1)
    prompt = ops.from_numpy(rng.standard_normal((B, 1, h)).astype(np.float32))
    for kind, layer in layers.items():
        read = layer.weights()
        names = sorted(k for k in read if k.startswith(("W_k.", "W_v.")))
        kv_bytes[kind] = {"bytes": int(sum(read[k].nbytes for k in names)), "names": names,
                          "shapes": {k: list(read[k].shape) for k in names}}
        w = {k: ops.from_numpy(v) for k, v in read.items()}
        with _no_autograd(backend):
            _, pair = ac.multi_head_attention(prompt, prompt, prompt, w, H,
                                              capacity=config["capacity"],
                                              num_kv_heads=kinds[kind])
        cache[kind] = {"bytes": sum(_nbytes(backend, a) for a in pair),
                       "shape": [int(d) for d in ops.shape(pair[0])], "arrays": len(pair),
                       "dtype": ops.dtype_name(pair[0])}
    calls: dict[str, Callable[[], Any]] = {}
    paths: dict[str, dict[str, list[str]]] = {kind: {} for kind in kinds}
    with _no_autograd(backend):
        for n in config["sizes"]:
            X = ops.from_numpy(np.random.default_rng(n).standard_normal((B, n, h)).astype(np.float32))
            for kind, layer in layers.items():
                with taken_paths() as chosen:
                    layer.call(X)  # the first call (traced and compiled where it compiles)
                paths[kind][str(n)] = sorted(set(chosen))
                calls[f"{kind} {n}"] = functools.partial(layer.call, X)
        pairs = [[f"mha {n}", f"gqa {n}"] for n in config["sizes"]]
        times = paired_rounds(calls, pairs, rounds, min_time=min_time, warmup=1)
    points = []
    for n in config["sizes"]:
        mha, gqa = times[f"mha {n}"], times[f"gqa {n}"]
        per_round = [g / m for m, g in zip(mha, gqa, strict=True)]
        ratio = median_interval(per_round).as_dict()
        points.append({"n": n, "mha_ms": 1e3 * statistics.median(mha),
                       "gqa_ms": 1e3 * statistics.median(gqa), "mha_seconds": mha,
                       "gqa_seconds": gqa, "ratio": ratio, "best_ratio": min(gqa) / min(mha),
                       "target": GQA_TIME_TARGET, "met": bool(ratio["median"] <= GQA_TIME_TARGET)})
    return {
        "config": dict(config), "rounds": rounds, "min_time": min_time,
        "implementation": paths,
        "kv_weights": {**kv_bytes, "ratio": kv_bytes["mha"]["bytes"] / kv_bytes["gqa"]["bytes"]},
        "cache": {**cache, "ratio": cache["mha"]["bytes"] / cache["gqa"]["bytes"]},
        "points": points, "machine": machine_info(), "versions": _versions(backend),
    }


# -- the run, the file and the page ------------------------------------------------------------


def measure(backend: str, rounds: int, suites: Sequence[str], quick: bool = False,
            previous: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The backend's document: the suites measured now, the others kept from ``previous``."""
    doc: dict[str, Any] = {"schema": SCHEMA, "backend": backend, "quick": quick}
    if previous is not None and previous.get("quick") == quick:
        doc.update({k: previous[k] for k in SUITES if k in previous})
    if "window" in suites:
        doc["window"] = measure_window(backend, rounds, QUICK_WINDOW if quick else WINDOW)
    if "gqa" in suites:
        doc["gqa"] = measure_gqa(backend, rounds, QUICK_GQA if quick else GQA,
                                 0.01 if quick else 0.2)
    doc["date"] = time.strftime("%Y-%m-%d")
    return doc


def _interval(r: Mapping[str, Any], digits: int = 2) -> str:
    return f"{r['median']:.{digits}f} [{r['low']:.{digits}f}, {r['high']:.{digits}f}]"


def _mib(b: float) -> str:
    return f"{b / 2**20:.2f} MiB"


def _seconds(s: float) -> str:
    return f"{s:.3f} s" if s >= 0.1 else f"{1e3 * s:.1f} ms"


def _yes(met: bool) -> str:
    return "yes" if met else "**no**"


def _run_line(section: Mapping[str, Any]) -> str:
    m = section["machine"]
    versions = ", ".join(f"{k} {v}" for k, v in section["versions"].items())
    return (f"{section['rounds']} rounds, {m['cpu']} ({m['cores']} cores), {versions}, "
            f"commit {m['git_commit']}, {m['date'][:10]}")


def render(results: Sequence[Mapping[str, Any]]) -> str:
    """The Markdown of the runs: the window tables, then the grouped-query tables."""
    results = sorted(results, key=lambda r: r["backend"])
    lines: list[str] = []
    windows = [r for r in results if "window" in r]
    if windows:
        c = windows[0]["window"]["config"]
        lines += ["### Sliding window: cost per token against n", "",
                  f"`dot_product_attention(q, k, v, causal=True, implementation=\"blockwise\")` on "
                  f"({c['batch']}, {c['heads']}, n, {c['depth']}) float32 queries = keys = values, "
                  f"with `window={c['window']}` and without a window; the four calls timed in "
                  "interleaved rounds, one call a sample, the two calls of each ratio below back to back. "
                  "Time per token = seconds ÷ n "
                  "(median over rounds; best in brackets).", "",
                  "| backend | call | n | seconds / call | µs / token |", "|---|---|---|---|---|"]
        for r in windows:
            for p in r["window"]["points"]:
                call = f"window {p['window']}" if p["kind"] == "window" else "no window"
                lines.append(f"| {r['backend']} | {call} | {p['n']} | "
                             f"{_seconds(p['seconds_median'])} ({_seconds(p['seconds_best'])}) | "
                             f"{p['us_per_token_median']:.2f} ({p['us_per_token_best']:.2f}) |")
        lines += ["", "Per-token time at the larger n ÷ at the smaller: median of the per-round "
                  "ratios [its interval], and the ratio of the best rounds. The windowed path "
                  f"should stay flat (O(n·w): target ≤ {WINDOW_TARGET}); without a window the "
                  "cost per token grows with n (O(n²): about 2 for a doubled n).", "",
                  "| backend | call | n | per-token ratio [CI] | best rounds | target | met |",
                  "|---|---|---|---|---|---|---|"]
        for r in windows:
            for kind, label in (("window", f"window {r['window']['config']['window']}"),
                                ("full", "no window")):
                q = r["window"]["ratios"][kind]
                target = "" if q["target"] is None else f"≤ {q['target']}"
                met = "" if q["target"] is None else _yes(q["met"])
                lines.append(f"| {r['backend']} | {label} | {q['sizes'][1]} ÷ {q['sizes'][0]} | "
                             f"{_interval(q['per_round'])} | {q['best']:.2f} | {target} | {met} |")
        lines += ["", *(f"- {r['backend']}{' (jitted)' if r['window']['jit'] else ''}: "
                        f"{_run_line(r['window'])}." for r in windows), ""]
    gqas = [r for r in results if "gqa" in r]
    if gqas:
        c = gqas[0]["gqa"]["config"]
        mha = f"`MultiHeadAttention({c['num_hiddens']}, {c['num_heads']})`"
        gqa = (f"`MultiHeadAttention({c['num_hiddens']}, {c['num_heads']}, "
               f"num_kv_heads={c['num_kv_heads']})`")
        lines += ["### Grouped-query attention: memory and time", "",
                  f"MHA is {mha}, GQA is {gqa}, both with `keep_attention_weights=False` and no "
                  f"biases. Key/value weights: the bytes of `W_k` and `W_v` from the layer's "
                  f"weights. Cache: the `nbytes` of the key and value arrays that "
                  f"`multi_head_attention(..., capacity={c['capacity']})` returns "
                  f"(batch {c['batch']}).", "",
                  "| backend | K/V weights MHA | GQA | MHA ÷ GQA | cache MHA | GQA | MHA ÷ GQA "
                  "| cache arrays MHA → GQA |", "|---|---|---|---|---|---|---|---|"]
        for r in gqas:
            g = r["gqa"]
            kw, ca = g["kv_weights"], g["cache"]
            shapes = f"{tuple(ca['mha']['shape'])} → {tuple(ca['gqa']['shape'])}"
            lines.append(f"| {r['backend']} | {_mib(kw['mha']['bytes'])} | {_mib(kw['gqa']['bytes'])} "
                         f"| {kw['ratio']:.2f} | {_mib(ca['mha']['bytes'])} | "
                         f"{_mib(ca['gqa']['bytes'])} | {ca['ratio']:.2f} | K, V: {shapes} each |")
        lines += ["", f"Forward time of causal self-attention on ({c['batch']}, n, "
                  f"{c['num_hiddens']}) float32: the four layer calls timed in interleaved rounds, "
                  "the two of each n back to back, their order alternating; GQA ÷ MHA is the "
                  f"median of the per-round ratios [its interval] (target ≤ "
                  f"{GQA_TIME_TARGET}). The path is the implementation each call took by default.",
                  "", "| backend | n | path MHA / GQA | MHA ms | GQA ms | GQA ÷ MHA [CI] | best rounds "
                  "| met |", "|---|---|---|---|---|---|---|---|"]
        for r in gqas:
            g = r["gqa"]
            for p in g["points"]:
                paths = " / ".join(", ".join(g["implementation"][k][str(p["n"])]) for k in ("mha", "gqa"))
                lines.append(f"| {r['backend']} | {p['n']} | {paths} | {p['mha_ms']:.1f} | "
                             f"{p['gqa_ms']:.1f} | {_interval(p['ratio'])} | {p['best_ratio']:.2f} | "
                             f"{_yes(p['met'])} |")
        lines += ["", *(f"- {r['backend']}: {_run_line(r['gqa'])}." for r in gqas)]
    if any(r.get("quick") for r in results):
        lines += ["", "These are `--quick` runs (tiny sizes): not measurements."]
    return "\n".join(lines).rstrip()


def merge(directory: Path, page: Path) -> None:
    """Writes every ``modern-*.json`` of ``directory`` between the page's markers.

    A page that does not exist is made with its title and a "Measured" section holding the
    markers; an existing page must have both markers, and only what lies between them changes.
    """
    results = [json.loads(p.read_text()) for p in sorted(directory.glob("modern-*.json"))]
    if not results:
        raise ValueError(f"no modern-*.json in {directory}")
    if not page.exists():
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(f"{TITLE}\n\n## Measured\n\n{START}\n{END}\n")
    markdown.write_between_markers(page, render(results), START, END)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one backend's suites, or merges the runs into the page (see the docstring)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.modern", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=BACKENDS)
    parser.add_argument("--suite", help="comma-separated: window, gqa (default: the backend's)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--merge", type=Path, metavar="DIR")
    parser.add_argument("--page", type=Path, default=Path("docs/current-models.md"))
    args = parser.parse_args(argv)
    if args.merge is not None:
        merge(args.merge, args.page)
        return 0
    if args.backend is None:
        parser.error("--backend is required unless --merge is given")
    suites = DEFAULT_SUITES[args.backend] if args.suite is None else tuple(
        s.strip() for s in args.suite.split(",") if s.strip())
    unknown = set(suites) - set(SUITES)
    if unknown or not suites:
        parser.error(f"--suite: choose from {', '.join(SUITES)}, got {args.suite!r}")
    path = args.out / f"modern-{args.backend}.json"
    previous = json.loads(path.read_text()) if path.exists() else None
    result = measure(args.backend, args.rounds, suites, args.quick, previous)
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(render([result]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
