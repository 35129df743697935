"""One backend's benchmark run, in this process: ``python -m benchmarks.run``.

The CLI (:mod:`benchmarks.cli`) starts this module in a child process per backend,
with the thread environment of :func:`benchmarks.thread_env`, so that every
framework (and NumPy's BLAS) starts with the same thread count and no two frameworks share a
process. It writes ``<out>/bench-<backend>.json``.
"""

from __future__ import annotations

import datetime
import functools
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any, TextIO

from benchmarks import (
    MAIN_SUITES,
    MEMORY_HEADS,
    SPEED_HEADS,
    TRAIN_MEMORY_HEADS,
    Config,
    child_main,
    flops,
    memory,
    thread_env,
    timing,
    train_memory,
)

#: Identifies the JSON documents of this module.
SCHEMA = "attention-core-bench/1"


class Progress:
    """A one-line progress bar on a stream (stderr): ``label [#####.....] 12/40 0:31 left``.

    On a terminal the line is redrawn in place; otherwise a line is written at every tenth.
    """

    def __init__(self, total: int, label: str, stream: TextIO | None = None, width: int = 28):
        self.total, self.label, self.width = max(1, total), label, width
        self.stream = stream or sys.stderr
        self.done, self.start, self.note = 0, time.monotonic(), ""
        self.tty = self.stream.isatty()
        self._shown = -1

    def step(self, note: str = "") -> None:
        """Counts one unit of work done; ``note`` says what runs next."""
        self.done = min(self.total, self.done + 1)
        self.show(note)

    def show(self, note: str = "") -> None:
        """Redraws the bar."""
        self.note = note or self.note
        filled = self.width * self.done // self.total
        elapsed = time.monotonic() - self.start
        left = elapsed / self.done * (self.total - self.done) if self.done else 0.0
        line = (f"{self.label} [{'#' * filled}{'.' * (self.width - filled)}] {self.done}/"
                f"{self.total} {_clock(elapsed)} elapsed, ~{_clock(left)} left  {self.note}")
        if self.tty:
            self.stream.write("\r" + line[:150].ljust(150))
        elif 10 * self.done // self.total != self._shown or self.done == self.total:
            self._shown = 10 * self.done // self.total
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        """Ends the line."""
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}:{secs:02d}"


def machine_info() -> dict[str, Any]:
    """CPU model, cores, RAM, OS, Python, date and git commit of this run."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    ram = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                ram = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    commit = None
    try:
        root = Path(__file__).resolve().parents[1]
        done = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root,
                              capture_output=True, text=True, timeout=10, check=False)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10, check=False)
        if done.returncode == 0:
            commit = done.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "ram_gib": ram,
            "system": f"{platform.system()} {platform.release()}", "machine": platform.machine(),
            "python": platform.python_version(), "git_commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def _memory_plan(harness: Any, config: Config) -> list[tuple[str, int, int]]:
    """``(path, n, heads)`` points of the memory suite.

    Above ``memory_quadratic_max`` only the O(n)-memory paths run, and the path that
    ``default`` resolves to is not measured a second time under its own name.
    """
    paths = [p for p in harness.paths() if config.memory_paths is None or p in config.memory_paths]
    plan = []
    for path in paths:
        for n in config.memory_sizes:
            if n <= config.memory_quadratic_max:
                plan.append((path, n, MEMORY_HEADS))
            elif harness.linear_memory(path, MEMORY_HEADS, n) and (
                    path == "default" or path != harness.resolved("default", MEMORY_HEADS, n)):
                plan.append((path, n, MEMORY_HEADS))  # beyond: O(n) paths, default's not twice
    if config.large_point is not None:
        heads, n = config.large_point
        plan.append(("default", n, heads))
    return plan


def run_backend(name: str, config: Config, progress: bool = True) -> dict[str, Any]:
    """Runs the configured suites on one backend in this process.

    The thread environment must already be set (it is in the child the CLI starts).

    Returns:
        The JSON document (see ``benchmarks/README.md`` for its fields).
    """
    from benchmarks.natives import NATIVE_ATTENTION, NATIVE_LAYER, harness

    h = harness(name, config.threads)
    settings = h.thread_settings()
    doc: dict[str, Any] = {
        "schema": SCHEMA, "backend": h.name, "machine": machine_info(),
        "versions": {"numpy": metadata.version("numpy"), **h.versions()},
        "threads": {"count": config.threads, "env": thread_env(config.threads),
                    "framework": settings},
        "config": config.as_dict(),
    }
    mem_plan = _memory_plan(h, config) if "memory" in config.suites else []
    train_plan = _train_memory_plan(config) if "train-memory" in config.suites else []
    from benchmarks import training

    trains = "train" in config.suites and h.name in training.STEPS
    total = (len(config.sizes) * config.rounds if "speed" in config.suites else 0) + (
        1 + len(config.sizes) * len(h.paths()) if "flops" in config.suites else 0) + len(
        mem_plan) + (2 * len(config.train_sizes) if trains else 0) + len(train_plan)
    bar = Progress(total, f"bench {h.name}") if progress else None

    def tick(note: str = "") -> None:
        if bar is not None:
            bar.step(note)

    if bar is not None:
        bar.show("starting")
    if "speed" in config.suites:
        points = []
        for n in config.sizes:
            ours, tuned, native, diff = h.mha_pair(n)
            times = timing.interleaved({"ours": ours, "tuned": tuned, "native": native,
                                        "native_again": native},
                                       config.rounds, config.min_time,
                                       on_round=functools.partial(tick, f"speed n={n}"))
            points.append({
                "n": n, "ratio": timing.ratio(times, "ours", "native").as_dict(),
                "tuned_ratio": timing.ratio(times, "tuned", "native").as_dict(),
                "aa": timing.ratio(times, "native_again", "native").as_dict(),
                "ours_ms": 1e3 * sorted(times["ours"])[len(times["ours"]) // 2],
                "tuned_ms": 1e3 * sorted(times["tuned"])[len(times["tuned"]) // 2],
                "native_ms": 1e3 * sorted(times["native"])[len(times["native"]) // 2],
                "max_abs_diff": diff,
            })
        doc["speed"] = {"native": NATIVE_LAYER[h.name], "heads": SPEED_HEADS,
                        "num_hiddens": 512, "layer": "default", "tuned": "keep_attention_weights=False",
                        "points": points}
    if "flops" in config.suites:
        gemm = flops.gemm_rate(h.gemm_call, config.gemm_size, config.flops_rounds, config.min_time)
        tick("flops")
        fpoints = [{"n": n, "paths": flops.core_rates(
            h, SPEED_HEADS, n, config.flops_rounds, config.min_time, gemm["gflops"],
            on_path=functools.partial(tick, f"flops n={n}"))} for n in config.sizes]
        doc["flops"] = {"gemm": gemm, "heads": SPEED_HEADS, "native": NATIVE_ATTENTION[h.name],
                        "points": fpoints}
    if "memory" in config.suites:
        mpoints = []
        for path, n, heads in mem_plan:
            tick(f"memory {path} n={n} H={heads}")
            result = memory.measure(h.name, path, n, heads, config.threads, config.memory_timeout)
            mpoints.append({"path": path, "n": n, "heads": heads, **result})
        slopes = {}
        for path in h.paths():
            pts = [(p["n"], p["extra_mib"]) for p in mpoints
                   if p["path"] == path and p["heads"] == MEMORY_HEADS and p["ok"]]
            slopes[path] = memory.slope(pts)
        doc["memory"] = {"heads": MEMORY_HEADS, "native": NATIVE_ATTENTION[h.name],
                         "points": mpoints, "slopes": slopes}
    run = {"machine": doc["machine"], "versions": doc["versions"], "threads": doc["threads"],
           "config": doc["config"]}
    if trains:
        tpoints = []
        for kind in training.KINDS:
            for n in config.train_sizes:
                tick(f"train {kind} n={n}")
                tpoints.append({**training.time_point(h.name, kind, n, config.rounds,
                                                      config.min_time),
                                "git_commit": doc["machine"]["git_commit"],
                                "date": doc["machine"]["date"]})
        doc["train"] = {"natives": training.NATIVES[h.name], "points": tpoints, "run": run}
    if train_plan and h.name in train_memory.BACKENDS:
        tmpoints = []
        for n, heads in train_plan:
            tick(f"train-memory n={n} H={heads}")
            result = train_memory.measure(h.name, n, heads, config.threads,
                                          config.train_memory_path, config.memory_timeout)
            tmpoints.append({"n": n, "heads": heads, "path": config.train_memory_path,
                             "git_commit": doc["machine"]["git_commit"],
                             "date": doc["machine"]["date"], **result})
        doc["train_memory"] = train_memory_section(tmpoints, config.train_memory_path, run)
    if bar is not None:
        bar.close()
    return doc


def _train_memory_plan(config: Config) -> list[tuple[int, int]]:
    """``(n, heads)`` points of the training-memory suite."""
    plan = [(n, TRAIN_MEMORY_HEADS) for n in config.train_memory_sizes]
    if config.train_large_point is not None:
        heads, n = config.train_large_point
        plan.append((n, heads))
    return plan


def train_memory_section(points: list[dict[str, Any]], path: str, run: dict[str, Any]
                         ) -> dict[str, Any]:
    """The ``train_memory`` section: points, and the slope of the 4-head points of ``path``."""
    fitted = memory.slope([(p["n"], p["extra_mib"]) for p in points
                           if p["ok"] and p["heads"] == TRAIN_MEMORY_HEADS and p["path"] == path])
    return {"heads": TRAIN_MEMORY_HEADS, "depth": 64, "path": path, "points": points,
            "slope": fitted, "run": run}


#: The sections of the suites, by suite name.
SECTIONS = {"speed": "speed", "flops": "flops", "memory": "memory", "train": "train",
            "train-memory": "train_memory"}


def _merge_points(old: list[dict[str, Any]], new: list[dict[str, Any]], key: tuple[str, ...]
                  ) -> list[dict[str, Any]]:
    """``old`` points whose key no new point has, then the new ones, sorted by the key."""
    fresh = {tuple(p[k] for k in key) for p in new}
    kept = [p for p in old if tuple(p[k] for k in key) not in fresh]
    return sorted(kept + new, key=lambda p: tuple(p[k] for k in key))


def keep_previous(old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """What a run writes into a ``bench-<backend>.json`` that exists already.

    The sections of suites this run did not run are kept from the old file. When the run ran
    none of the main suites (speed, flops, memory), the top-level machine, versions, threads
    and config stay the old file's (they describe its main suites' run; the training sections
    record their own run under ``run``). Training points of an old section are kept unless
    this run measured the same point again (``train``: kind and n; ``train_memory``: path, n
    and heads), so large points may run in passes of their own; the slope is refitted.
    """
    if old is None or old.get("schema") != new["schema"] or old.get("backend") != new["backend"]:
        return new
    ran = set(new["config"]["suites"])
    base = old if not ran & set(MAIN_SUITES) else new
    doc = dict(base)
    for suite, section in SECTIONS.items():
        if section in new:
            doc[section] = new[section]
        elif suite not in ran and section in old:
            doc[section] = old[section]
    if "train" in new and "train" in old:
        doc["train"] = {**new["train"], "points": _merge_points(
            old["train"]["points"], new["train"]["points"], ("kind", "n"))}
    if "train_memory" in new and "train_memory" in old:
        tm = new["train_memory"]
        points = _merge_points(old["train_memory"]["points"], tm["points"], ("path", "heads", "n"))
        doc["train_memory"] = train_memory_section(points, tm["path"], tm["run"])
    suites = set(old["config"]["suites"]) | ran
    doc["config"] = {**base["config"], "suites": [s for s in SECTIONS if s in suites]}
    return doc


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the child: runs one backend and writes its JSON file."""
    return child_main(argv, "benchmarks.run", Config.from_dict, run_backend, "bench",
                      keep_previous)


if __name__ == "__main__":
    sys.exit(main())
