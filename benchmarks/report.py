"""Tables (screen and Markdown), the target check, the plot, and merging several runs.

Every function here reads the JSON documents of :func:`benchmarks.run.run_backend`;
none imports a framework. The plot needs matplotlib (``pip install "attention-core[plot]"``);
without it :func:`plot` says so and returns None.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from attention_core import files
from benchmarks import MEMORY_QUADRATIC_MAX
from benchmarks.run import SCHEMA
from tools import markdown

#: The markers in docs/speed.md between which ``python -m benchmarks --merge`` writes its section.
BENCH_START, BENCH_END = "<!-- bench:start -->", "<!-- bench:end -->"
#: The page ``--merge`` writes into by default, from the repository root.
PAGE = "docs/speed.md"

#: The issue's targets: speed ratio bounds (n >= 1024 and n = 128) on these backends ...
SPEED_TARGET_BACKENDS = ("torch", "tensorflow", "jax")
SPEED_TARGET_LARGE, SPEED_TARGET_SMALL = 1.00, 1.10
#: ... the fraction of the GEMM rate at n = 4096 (JAX: at least jax.nn's own rate) ...
FLOPS_TARGETS = {"torch": 0.70, "numpy": 0.30}
FLOPS_TARGET_N = 4096
#: ... and peak extra memory at n = 16384, 4 heads, on the default path.
MEMORY_TARGET_MIB, MEMORY_TARGET_N = 64.0, 16384

#: The training page, its markers, and the training targets: a training step's ours ÷ native at
#: n >= 1024 and at n = 128; extra memory of forward + backward at n = 16384, 4 heads; and
#: the large point (8 heads, n = 65536) training one step within 24 GiB (its peak resident set).
TRAIN_PAGE = "docs/training.md"
TRAIN_START, TRAIN_END = "<!-- train:start -->", "<!-- train:end -->"
TRAIN_TARGET_LARGE, TRAIN_TARGET_SMALL = 1.00, 1.15
TRAIN_MEMORY_TARGET_MIB, TRAIN_MEMORY_TARGET_N = 256.0, 16384
TRAIN_LARGE_LIMIT_MIB = 24 * 1024.0

Table = tuple[list[str], list[list[str]]]


def load(directory: str | Path) -> list[dict[str, Any]]:
    """The ``bench-<backend>.json`` documents of a directory, in the registry's backend order.

    Raises:
        ValueError: None found.
    """
    return markdown.load_backend_documents(
        directory, "bench-*.json", lambda doc: isinstance(doc, dict) and doc.get("schema") == SCHEMA,
        f"no benchmark results (bench-<backend>.json) in {Path(directory)}: run "
        "python -m benchmarks --out DIR first",
    )


# -- formatting -------------------------------------------------------------------------------


def _ratio(r: dict[str, Any] | None) -> str:
    if r is None:
        return "n/a"
    return f"{r['median']:.2f} [{r['low']:.2f}, {r['high']:.2f}]"


def _num(x: float | None, fmt: str = ".3g") -> str:
    return "n/a" if x is None else format(x, fmt)


def render(table: Table, markdown: bool) -> str:
    """A table as Markdown, or as aligned plain text for the screen."""
    headers, rows = table
    if markdown:
        lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows, strict=True)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)),
             "  ".join("-" * w for w in widths)]
    return "\n".join(lines + ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True))
                              for r in rows])


# -- one backend ------------------------------------------------------------------------------


def speed_table(doc: dict[str, Any]) -> Table:
    """N | ours ms | native ms | ratio [CI] | (tuned ratio [CI]) | A/A [CI] | max |diff|.

    Runs before the default layer was measured (``keep_attention_weights_false`` in the
    file) timed the tuned layer as ``ours`` and have no tuned column.
    """
    speed = doc["speed"]
    tuned = all("tuned_ratio" in p for p in speed["points"]) and bool(speed["points"])
    rows = [[str(p["n"]), f"{p['ours_ms']:.3f}", f"{p['native_ms']:.3f}", _ratio(p["ratio"]),
             *([_ratio(p["tuned_ratio"])] if tuned else []),
             _ratio(p["aa"]), f"{p['max_abs_diff']:.1e}"] for p in speed["points"]]
    conf = speed["points"][0]["ratio"]["confidence"] if speed["points"] else 0.95
    ours = "ours (keep_attention_weights=False)" if speed.get(
        "keep_attention_weights_false") else "ours"
    return (["n", f"{ours} ms", "native ms", f"{ours}/native [{conf:.0%} CI]",
             *(["tuned (keep_attention_weights=False)/native"] if tuned else []),
             "A/A control", "max |diff|"], rows)


def flops_table(doc: dict[str, Any]) -> Table:
    """N | per path: GFLOP/s (fraction of GEMM)."""
    fl = doc["flops"]
    paths = list(fl["points"][0]["paths"]) if fl["points"] else []
    rows = []
    for p in fl["points"]:
        rows.append([str(p["n"])] + [
            f"{p['paths'][k]['gflops']:.1f} ({p['paths'][k]['fraction_of_gemm']:.2f})"
            for k in paths])
    headers = ["n"] + [f"{k} ({p})" if k == "default" else k for k, p in zip(
        paths, [fl["points"][-1]["paths"][k]["implementation"] for k in paths], strict=True)]
    return headers, rows


def memory_table(doc: dict[str, Any]) -> Table:
    """Path (heads) | extra MiB per n | log-log slope."""
    mem = doc["memory"]
    sizes = sorted({p["n"] for p in mem["points"]})
    keys = list(dict.fromkeys((p["path"], p["heads"]) for p in mem["points"]))
    rows = []
    for path, heads in keys:
        cells = {p["n"]: (f"{p['extra_mib']:.1f}" if p["ok"] else "failed")
                 for p in mem["points"] if p["path"] == path and p["heads"] == heads}
        slope = mem["slopes"].get(path) if heads == mem["heads"] else None
        rows.append([f"{path} (H={heads})", *(cells.get(n, "") for n in sizes), _num(slope, ".2f")])
    return ["path", *(f"n={n}" for n in sizes), "slope"], rows


def machine_line(doc: dict[str, Any]) -> str:
    """One line: CPU, cores, RAM, Python, versions, threads, commit, date."""
    m = doc["machine"]
    versions = ", ".join(f"{k} {v}" for k, v in doc["versions"].items())
    return (f"{m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB RAM, {m['system']}; "
            f"Python {m['python']}, {versions}; {doc['threads']['count']} threads; "
            f"commit {m['git_commit']}; {m['date']}" + _memory_run(doc))


def _memory_run(doc: dict[str, Any]) -> str:
    """Where the memory suite ran in a pass of its own (``memory.run``), its commit and date."""
    run = doc.get("memory", {}).get("run")
    if not run:
        return ""
    return f"; memory suite: commit {run['machine']['git_commit']}, {run['machine']['date']}"


def backend_report(doc: dict[str, Any]) -> str:
    """The screen report of one backend's run."""
    parts = [f"== {doc['backend']}: {machine_line(doc)}"]
    if doc["config"].get("quick"):
        parts.append("(--quick: tiny sizes and few rounds; the numbers mean nothing)")
    if "speed" in doc:
        s = doc["speed"]
        parts += ["", f"speed: MultiHeadAttention({s['num_hiddens']}, {s['heads']}) forward, "
                  f"ours / {s['native']}", render(speed_table(doc), False)]
    if "flops" in doc:
        g = doc["flops"]["gemm"]
        parts += ["", f"flops: attention core (1, {doc['flops']['heads']}, n, 64), GFLOP/s "
                  f"(fraction of the {int(g['size'])}x{int(g['size'])} GEMM rate, "
                  f"{g['gflops']:.1f} GFLOP/s); native = {doc['flops']['native']}",
                  render(flops_table(doc), False)]
    if "memory" in doc:
        parts += ["", f"memory: peak extra MiB of one call on (1, H, n, 64); native = "
                  f"{doc['memory']['native']}", render(memory_table(doc), False)]
    if "train" in doc:
        parts += ["", "train: one training step, ours / native (median [interval]), A/A",
                  render(train_step_table([doc]), False)]
    if "train_memory" in doc:
        parts += ["", "train-memory: peak extra MiB of forward + backward on (1, H, n, 64)",
                  render(train_memory_table([doc]), False)]
    checks = target_rows([doc]) + train_target_rows([doc])
    if checks:
        parts += ["", "targets:", render((TARGET_HEADERS, checks), False)]
    return "\n".join(parts)


# -- targets ----------------------------------------------------------------------------------

TARGET_HEADERS = ["target", "backend", "measured", "met"]


def _met(ok: bool | None) -> str:
    return "n/a" if ok is None else ("yes" if ok else "**no**")


def target_rows(docs: Sequence[dict[str, Any]]) -> list[list[str]]:
    """One row per target of the issue that these runs measured."""
    rows: list[list[str]] = []
    for doc in docs:
        b = doc["backend"]
        if "speed" in doc and b in SPEED_TARGET_BACKENDS:
            for p in doc["speed"]["points"]:
                bound = SPEED_TARGET_LARGE if p["n"] >= 1024 else (
                    SPEED_TARGET_SMALL if p["n"] == 128 else None)
                if bound is not None:
                    r = p["ratio"]["median"]
                    rows.append([f"MHA ours/native <= {bound:.2f} at n={p['n']}", b, f"{r:.2f}",
                                 _met(r <= bound)])
        flops = {p["n"]: p["paths"] for p in doc.get("flops", {}).get("points", [])}
        if FLOPS_TARGET_N in flops:
            paths = flops[FLOPS_TARGET_N]
            frac = paths["default"]["fraction_of_gemm"]
            if b in FLOPS_TARGETS:
                rows.append([f"core at n={FLOPS_TARGET_N} >= {FLOPS_TARGETS[b]:.2f} of GEMM", b,
                             f"{frac:.2f}", _met(frac >= FLOPS_TARGETS[b])])
            if b == "jax":
                ours, native = paths["default"]["gflops"], paths["native"]["gflops"]
                rows.append([f"core at n={FLOPS_TARGET_N} >= jax.nn.dot_product_attention", b,
                             f"{ours:.1f} vs {native:.1f} GFLOP/s", _met(ours >= native)])
        for p in doc.get("memory", {}).get("points", []):
            if p["path"] == "default" and p["n"] == MEMORY_TARGET_N and p["heads"] == 4:
                ok = p["ok"] and p["extra_mib"] <= MEMORY_TARGET_MIB
                rows.append([f"extra memory at n={MEMORY_TARGET_N}, H=4 <= {MEMORY_TARGET_MIB:.0f} MiB",
                             b, f"{p['extra_mib']:.1f} MiB" if p["ok"] else p["error"], _met(ok)])
            elif p["path"] == "default" and p["n"] >= 65536 and p["heads"] == 8:
                took = f"{p['extra_mib']:.1f} MiB, {p['seconds']:.0f} s" if p["ok"] else p["error"]
                rows.append([f"n={p['n']}, H=8 completes", b, took, _met(p["ok"])])
    return rows


def has_training(docs: Sequence[dict[str, Any]]) -> bool:
    """Whether some document has a training suite's section."""
    return any(d.get("train") or d.get("train_memory") for d in docs)


def train_target_rows(docs: Sequence[dict[str, Any]]) -> list[list[str]]:
    """One row per training target that the training suites of these runs measured."""
    rows: list[list[str]] = []
    for doc in docs:
        b = doc["backend"]
        for p in doc.get("train", {}).get("points", []):
            bound = TRAIN_TARGET_LARGE if p["n"] >= 1024 else (
                TRAIN_TARGET_SMALL if p["n"] == 128 else None)
            if bound is not None:
                r = p["ratio"]["median"]
                rows.append([f"{p['kind']} training step ours/native <= {bound:.2f} at n={p['n']}",
                             b, f"{r:.2f}", _met(r <= bound)])
        tm_points = doc.get("train_memory", {}).get("points", [])
        if tm_points and not any(p["n"] >= 65536 and p["heads"] == 8 for p in tm_points):
            rows.append([f"n=65536, H=8 trains one step within "
                         f"{TRAIN_LARGE_LIMIT_MIB / 1024:.0f} GiB", b, "not measured", _met(None)])
        for p in tm_points:
            if p["path"] != "default":
                continue
            if p["n"] == TRAIN_MEMORY_TARGET_N and p["heads"] == 4:
                ok = p["ok"] and p["extra_mib"] <= TRAIN_MEMORY_TARGET_MIB
                rows.append([f"forward+backward extra memory at n={p['n']}, H=4 <= "
                             f"{TRAIN_MEMORY_TARGET_MIB:.0f} MiB", b,
                             f"{p['extra_mib']:.1f} MiB" if p["ok"] else p["error"], _met(ok)])
            elif p["n"] >= 65536 and p["heads"] == 8:
                ok = p["ok"] and p["peak_mib"] <= TRAIN_LARGE_LIMIT_MIB
                took = (f"peak {p['peak_mib']:.0f} MiB, {p['seconds']:.0f} s" if p["ok"]
                        else p["error"])
                rows.append([f"n={p['n']}, H=8 trains one step within "
                             f"{TRAIN_LARGE_LIMIT_MIB / 1024:.0f} GiB", b, took, _met(ok)])
    return rows


def train_step_table(docs: Sequence[dict[str, Any]]) -> Table:
    """Backend | layer | n | ours/native [interval] | A/A | ours ms | native ms | native."""
    rows = []
    for d in docs:
        train = d.get("train")
        if not train:
            continue
        for p in train["points"]:
            rows.append([f"`{d['backend']}`", p["kind"], str(p["n"]), _ratio(p["ratio"]),
                         _ratio(p["aa"]), f"{p['ours_ms']:.1f}", f"{p['native_ms']:.1f}",
                         train["natives"][p["kind"]]])
    return (["backend", "layer", "n", "ours/native", "A/A", "ours ms", "native ms", "native"],
            rows)


def _paths_taken(points: Sequence[dict[str, Any]]) -> str:
    taken = list(dict.fromkeys(p["implementation"] for p in points if p["ok"]))
    return ", ".join(taken) or "n/a"


def train_memory_table(docs: Sequence[dict[str, Any]]) -> Table:
    """Backend | path (taken) | extra MiB per n at 4 heads | slope."""
    sections = [(d["backend"], d["train_memory"]) for d in docs if d.get("train_memory")]
    sizes = sorted({p["n"] for _, tm in sections for p in tm["points"] if p["heads"] == tm["heads"]})
    rows = []
    for backend, tm in sections:
        pts = [p for p in tm["points"] if p["heads"] == tm["heads"] and p["path"] == tm["path"]]
        mixed = len({p["implementation"] for p in pts if p["ok"]}) > 1  # say which, per cell
        cells = {p["n"]: _mib(p) + (f" ({p['implementation']})" if mixed and p["ok"] else "")
                 for p in pts}
        rows.append([f"`{backend}`", f"{tm['path']} ({_paths_taken(pts)})",
                     *(cells.get(n, "") for n in sizes), _num(tm["slope"], ".2f")])
    return (["backend", "path (taken)", *(f"n={n}" for n in sizes), "slope"], rows)


def train_large_rows(docs: Sequence[dict[str, Any]]) -> Table:
    """Backend | point | path taken | extra MiB | peak MiB | seconds, for points beyond 4 heads."""
    rows = []
    for d in docs:
        tm = d.get("train_memory") or {"points": []}
        for p in tm["points"]:
            if p["heads"] == tm["heads"]:
                continue
            point = f"(1, {p['heads']}, {p['n']}, {tm['depth']})"
            if p["ok"]:
                rows.append([f"`{d['backend']}`", point, p["implementation"],
                             f"{p['extra_mib']:.1f}", f"{p['peak_mib']:.1f}",
                             f"{p['seconds']:.0f}"])
            else:
                rows.append([f"`{d['backend']}`", point, "failed", p["error"], "", ""])
    return (["backend", "(B, H, n, D)", "path taken", "extra MiB", "peak MiB", "seconds"], rows)


def _run_line(doc: dict[str, Any], section: str) -> str:
    run = doc[section]["run"]
    m = run["machine"]
    versions = ", ".join(f"{k} {v}" for k, v in run["versions"].items())
    passes: dict[str, list[str]] = {}  # points kept from earlier passes record their own
    for p in doc[section]["points"]:
        if p.get("git_commit"):
            label = (f"{p['kind']} {p['n']}" if "kind" in p else f"{p['n']}" if p["heads"] ==
                     doc[section]["heads"] else f"{p['n']} x {p['heads']}")
            passes.setdefault(f"{p['git_commit']}, {p['date']}", []).append(label)
    where = ("; passes: " + "; ".join(f"n = {', '.join(ns)} at commit {c}"
                                      for c, ns in passes.items())) if len(passes) > 1 else ""
    return (f"{m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB RAM; Python {m['python']}, "
            f"{versions}; {run['threads']['count']} threads; commit {m['git_commit']}; {m['date']}"
            + where)


def train_markdown(docs: Sequence[dict[str, Any]], now: datetime.datetime | None = None) -> str:
    """The training page's section (without the markers), from the runs' training sections."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    steps = [d for d in docs if d.get("train")]
    mems = [d for d in docs if d.get("train_memory")]
    lines = [f"Generated {now:%Y-%m-%d %H:%M} UTC by `python -m benchmarks --merge` from the "
             "runs below (one environment and process per backend); never typed by hand."]
    if not steps and not mems:
        return "\n".join([*lines, "", "No run has measured the training suites yet."])
    lines += ["", "| backend | suite | machine and versions |", "|---|---|---|"]
    lines += [f"| `{d['backend']}` | train | {_run_line(d, 'train')} |" for d in steps]
    lines += [f"| `{d['backend']}` | train-memory | {_run_line(d, 'train_memory')} |"
              for d in mems]
    if any(d[s]["run"]["config"].get("quick") for s in ("train", "train_memory")
           for d in docs if d.get(s)):
        lines += ["", "**Some of these are `--quick` runs: tiny sizes, the numbers mean nothing.**"]
    if steps:
        lines += ["", "**One training step, ours ÷ native** (forward on `X (1, n, 512)` with "
                  "`valid_lens = [n - n//4]`, then the gradients of the output's sum by every "
                  "weight; median of interleaved rounds [confidence interval]; A/A = native ÷ "
                  "itself, the noise control). Layers: `MultiHeadAttention(512, 8, bias=True)` "
                  "(mha) and `TransformerEncoderBlock(512, 2048, 8, bias=True)` (block), as "
                  "constructed by default.", "", render(train_step_table(steps), True)]
    if mems:
        heads = mems[0]["train_memory"]["heads"]
        lines += ["", f"**Peak extra memory of forward + backward**, MiB, (1, {heads}, n, 64) "
                  "fp32, gradients of `sum(dot_product_attention(q, k, v))` by q, k and v, one "
                  "subprocess per point (VmHWM - VmRSS before the call; the output and the three "
                  "gradients count), with the fitted log-log slope (2: forms the n x n scores; "
                  "≤ 1: does not). The path is the one asked for and, in brackets, the "
                  "implementations it took; where it took several, each cell names its own, and "
                  "the slope mixes their laws.", "", render(train_memory_table(mems), True)]
        large = train_large_rows(mems)
        if large[1]:
            lines += ["", "**The large point**: one training step of the same call with 8 heads "
                      "(peak MiB is the whole process's resident set at its peak).", "",
                      render(large, True)]
    checks = train_target_rows(docs)
    if checks:
        lines += ["", "**Targets (training)**", "", render((TARGET_HEADERS, checks),
                                                                       True)]
    return "\n".join(lines)


# -- several backends: the page's section ------------------------------------------------------


def merged_markdown(docs: Sequence[dict[str, Any]], plot_name: str | None = None,
                    now: datetime.datetime | None = None) -> str:
    """The speed page's section for runs of several backends (without the markers)."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    names = [d["backend"] for d in docs]
    lines = [f"Generated {now:%Y-%m-%d %H:%M} UTC by `python -m benchmarks --merge` "
             "from the runs below (one environment and process per backend); never typed by hand.",
             "", "| backend | machine and versions |", "|---|---|"]
    lines += [f"| `{d['backend']}` | {machine_line(d)} |" for d in docs]
    if any(d["config"].get("quick") for d in docs):
        lines += ["", "**These are `--quick` runs: tiny sizes, the numbers mean nothing.**"]
    speed = [d for d in docs if "speed" in d]
    if speed:
        sizes = sorted({p["n"] for d in speed for p in d["speed"]["points"]})
        by = {d["backend"]: {p["n"]: p for p in d["speed"]["points"]} for d in speed}
        layer = ("`keep_attention_weights=False`" if any(
            d["speed"].get("keep_attention_weights_false") for d in speed)
            else "as constructed by default")
        lines += ["", f"**(a) MultiHeadAttention(512, 8) forward time, ours ({layer}) ÷ native** "
                  "(median of interleaved rounds [confidence interval]; A/A = native ÷ itself, "
                  "the noise control). Native: " + "; ".join(
                      f"`{d['backend']}` {d['speed']['native']}" for d in speed) + ".", ""]
        table = (["n", *(f"`{d['backend']}`" for d in speed), "A/A (widest)"],
                 [[str(n), *(_ratio(by[d["backend"]].get(n, {}).get("ratio")) for d in speed),
                   _widest([by[d["backend"]][n]["aa"] for d in speed if n in by[d["backend"]]])]
                  for n in sizes])
        lines.append(render(table, True))
        tuned = [d for d in speed if all("tuned_ratio" in p for p in d["speed"]["points"])]
        if tuned:
            lines += ["", "The tuned layer (`keep_attention_weights=False`) ÷ native, in the same "
                      "rounds:", "", render((["n", *(f"`{d['backend']}`" for d in tuned)], [
                          [str(n), *(_ratio(by[d["backend"]].get(n, {}).get("tuned_ratio"))
                                     for d in tuned)] for n in sizes]), True)]
    flops = [d for d in docs if "flops" in d and d["flops"]["points"]]
    if flops:
        paths = ["default", "direct", "blockwise", "fused", "native"]
        rows = []
        for d in flops:
            last = d["flops"]["points"][-1]
            rows.append([f"`{d['backend']}`", str(last["n"]), f"{d['flops']['gemm']['gflops']:.1f}",
                         *(f"{last['paths'][k]['gflops']:.1f} ({last['paths'][k]['fraction_of_gemm']:.2f})"
                           if k in last["paths"] else "-" for k in paths)])
        lines += ["", "**(b) Attention core GFLOP/s (fraction of the same process's GEMM rate)**, "
                  "(1, 8, n, 64) fp32, `4·B·H·n²·D / time`, at the largest n; `default` is the "
                  "automatic choice, `native` the framework's own attention function.", "",
                  render((["backend", "n", "GEMM GFLOP/s", *paths], rows), True)]
    memory = [d for d in docs if "memory" in d]
    if memory:
        rows = []
        for d in memory:
            mem = d["memory"]
            for path, slope in mem["slopes"].items():
                pts = {p["n"]: p for p in mem["points"] if p["path"] == path and p["heads"] == mem["heads"]}
                if not pts:
                    continue
                big = max(pts)
                at = pts[max((n for n in pts if n <= MEMORY_QUADRATIC_MAX), default=big)]
                rows.append([f"`{d['backend']}`", path, str(at["n"]), _mib(at), str(big), _mib(pts[big]),
                             _num(slope, ".2f")])
        lines += ["", "**(c) Peak extra memory of one attention call**, (1, 4, n, 64) fp32, one "
                  "subprocess per point (VmHWM - VmRSS before the call; the output counts), and "
                  "the fitted log-log slope (2: forms the n x n scores; ≤ 1: does not).", "",
                  render((["backend", "path", "n", "MiB", "largest n", "MiB", "slope"], rows), True)]
    checks = target_rows(docs)
    if checks:
        lines += ["", "**Targets**", "", render((TARGET_HEADERS, checks), True)]
    if plot_name:
        lines += ["", f"![benchmarks]({plot_name})"]
    del names
    return "\n".join(lines)


def _mib(p: dict[str, Any]) -> str:
    return f"{p['extra_mib']:.1f}" if p["ok"] else "failed"


def _widest(ratios: Sequence[dict[str, Any]]) -> str:
    if not ratios:
        return "n/a"
    return _ratio(max(ratios, key=lambda r: r["high"] - r["low"]))


def write_between_markers(path: str | Path, body: str, start: str = BENCH_START,
                          end: str = BENCH_END) -> None:
    """Replaces what lies between the bench markers in a file (see :mod:`tools.markdown`)."""
    markdown.write_between_markers(path, body, start, end)


# -- plot -------------------------------------------------------------------------------------


def pyplot() -> Any | None:
    """The ``pyplot`` module on matplotlib's file-only Agg backend; None without matplotlib."""
    try:
        import matplotlib  # type: ignore[import-not-found, unused-ignore]

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return None
    return plt


def plot(docs: Sequence[dict[str, Any]], path: str | Path) -> str | None:
    """Draws speed ratio, GEMM fraction and memory against n into a PNG file.

    Three panels one above the other, each the page's width, in the order and with the
    letters of the page's tables; each legend sits to the right of its panel, off the data.

    Returns:
        The path written, or None when matplotlib is not installed.
    """
    plt = pyplot()
    if plt is None:
        return None
    from matplotlib.ticker import ScalarFormatter  # type: ignore[import-not-found, unused-ignore]

    fig, axes = plt.subplots(3, 1, figsize=(9, 12))
    color = {d["backend"]: f"C{i}" for i, d in enumerate(docs)}
    ax = axes[0]
    for d in docs:
        pts = d.get("speed", {}).get("points", [])
        if pts:
            n = [p["n"] for p in pts]
            med = [p["ratio"]["median"] for p in pts]
            err = [[p["ratio"]["median"] - p["ratio"]["low"] for p in pts],
                   [p["ratio"]["high"] - p["ratio"]["median"] for p in pts]]
            ax.errorbar(n, med, yerr=err, marker="o", capsize=3, label=d["backend"],
                        color=color[d["backend"]])
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set(xlabel="n (batch 1, 8 heads, depth 64)", ylabel="time, ours ÷ native",
           title="(a) MultiHeadAttention forward, ours ÷ native (below 1: ours is faster)")
    ax = axes[1]
    for d in docs:
        pts = d.get("flops", {}).get("points", [])
        if pts:
            ax.plot([p["n"] for p in pts], [p["paths"]["default"]["fraction_of_gemm"] for p in pts],
                    marker="o", label=d["backend"], color=color[d["backend"]])
    ax.set(xlabel="n (batch 1, 8 heads, depth 64)", ylabel="GFLOP/s ÷ GEMM GFLOP/s",
           title="(b) attention core, fraction of the same process's GEMM rate")
    ax = axes[2]
    for d in docs:
        mem = d.get("memory")
        if not mem:
            continue
        for path_name, style in (("default", "-"), ("native", ":"), ("direct", "--")):
            pts = sorted((p["n"], p["extra_mib"]) for p in mem["points"]
                         if p["path"] == path_name and p["heads"] == mem["heads"] and p["ok"]
                         and p["extra_mib"] > 0)
            if pts:
                line = ax.plot(*zip(*pts, strict=True), style, marker=".", color=color[d["backend"]],
                               label=f"{d['backend']} {path_name}")
                if path_name != "default":
                    line[0].set_alpha(0.6)
    ax.axhline(MEMORY_TARGET_MIB, color="gray", lw=0.8, ls="--")
    ax.set(yscale="log", xlabel="n (batch 1, 4 heads, depth 64)", ylabel="peak extra memory, MiB",
           title="(c) memory of one call (solid: default, dotted: native, dashed: direct)")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(ScalarFormatter())
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    files.save_figure(fig, path, dpi=110)
    plt.close(fig)
    return str(path)
