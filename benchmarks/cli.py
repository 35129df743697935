"""``python -m benchmarks``: run the benchmarks, or merge runs into the site's speed page.

Run mode starts one child process per backend (``python -m benchmarks.run``) with
the thread environment pinned (:func:`benchmarks.thread_env`), so each framework has
a process to itself and every one uses the same number of threads; then prints each backend's
tables and saves ``<out>/bench-<backend>.json`` and ``<out>/bench-<backend>.png``.
Merge mode (``--merge DIR``) reads the ``bench-*.json`` files that runs in several
environments wrote to DIR, writes the combined Markdown into ``docs/speed.md`` between
``<!-- bench:start -->`` and ``<!-- bench:end -->`` and draws ``DIR/bench.png``.
``python -m benchmarks complexity`` (:mod:`benchmarks.complexity`) times a convolution, an RNN
and self-attention against n on one backend. Run from the repository root (the benchmarks are
not part of the installed package). Errors are printed as one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from attention_core import registry
from benchmarks import DEFAULT_SUITES, SUITES, Config, complexity, report, run_child


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.replace(",", " ").split())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 128,256, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _maybe_ints(text: str) -> tuple[int, ...]:
    return () if text.strip().lower() == "none" else _ints(text)


def _large_point(text: str) -> tuple[int, ...]:
    if text.strip().lower() == "none":
        return ()  # no large point
    values = _ints(text)
    if len(values) != 2:
        raise argparse.ArgumentTypeError(f"expected HEADS,N like 8,65536 or none, got {text!r}")
    return values[0], values[1]


def _suites(text: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    unknown = [x for x in names if x not in SUITES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown suite(s) {', '.join(unknown) or text!r}; choose from {', '.join(SUITES)}")
    return tuple(s for s in SUITES if s in names)


def configure(parser: argparse.ArgumentParser) -> None:
    """Adds the benchmark arguments to a parser."""
    parser.add_argument("--backend", nargs="+", metavar="NAME",
                        help="backends to run, each in its own process (default: the installed ones)")
    parser.add_argument("--suite", type=_suites, default=DEFAULT_SUITES, metavar="LIST",
                        help=f"comma list of {','.join(SUITES)} (default: "
                             f"{','.join(DEFAULT_SUITES)}; the training suites only when named)")
    parser.add_argument("--sizes", type=_ints, metavar="N,...",
                        help="sequence lengths of the speed and flops suites "
                             "(default 128,...,4096; --quick: 16,32)")
    parser.add_argument("--memory-sizes", type=_ints, metavar="N,...",
                        help="sequence lengths of the memory suite (default 1024,...,65536; "
                             "paths that form the n x n scores stop at 16384)")
    parser.add_argument("--train-sizes", type=_ints, metavar="N,...",
                        help="sequence lengths of the train suite (default 128,1024,2048)")
    parser.add_argument("--train-memory-sizes", type=_maybe_ints, metavar="N,...|none",
                        help="sequence lengths of the train-memory suite, 4 heads (default "
                             "1024,...,16384; none: only the large point)")
    parser.add_argument("--train-large-point", type=_large_point, metavar="HEADS,N|none",
                        help="the train-memory suite's extra point (default 8,65536)")
    parser.add_argument("--train-memory-path", choices=("default", "blockwise", "direct"),
                        help="implementation of the train-memory suite (default: default, the "
                             "automatic choice)")
    parser.add_argument("--memory-timeout", type=float, metavar="SECONDS",
                        help="longest time of one memory or train-memory subprocess; a point that "
                             "takes longer is recorded as timed out (default 3600)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds per speed point "
                                                   "(default 15; --quick: 3)")
    parser.add_argument("--min-time", type=float, metavar="SECONDS",
                        help="shortest timing sample; short calls are repeated (default 0.1; "
                             "--quick: 0.002)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="threads of every framework (default: all cores, "
                             f"{os.cpu_count() or 1} here)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes, few rounds, one memory path: a smoke test in seconds")
    parser.add_argument("--out", default="benchmarks/results",
                        help="directory for bench-<backend>.json and .png (default: benchmarks/results)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument("--merge", metavar="DIR",
                        help=f"merge the bench-*.json files of DIR into the table of {report.PAGE} and "
                             "DIR/bench.png instead of running")
    parser.add_argument("--page", default=report.PAGE,
                        help=f"file --merge writes into, between {report.BENCH_START} and "
                             f"{report.BENCH_END} (default: {report.PAGE})")
    parser.add_argument("--train-page", default=report.TRAIN_PAGE,
                        help=f"file --merge writes the training suites' tables into, between "
                             f"{report.TRAIN_START} and {report.TRAIN_END}, when a run has them "
                             f"(default: {report.TRAIN_PAGE})")
    parser.add_argument("--stdout", action="store_true", help="with --merge: print, write no page")
    commands = parser.add_subparsers(dest="bench_command", metavar="{complexity}")
    complexity.configure(commands.add_parser(
        "complexity", help="conv, RNN and self-attention forward time against n on one backend "
                           "(see python -m benchmarks complexity --help)",
        description="Times a 1-D convolution, an RNN and self-attention of the same width against "
                    "the sequence length n on one backend, in a child process with pinned threads; "
                    "writes complexity-<backend>.json and .png."))


def config_from(args: argparse.Namespace) -> Config:
    """The :class:`Config` the arguments ask for."""
    overrides: dict[str, object] = {"suites": args.suite, "threads": args.threads}
    if args.sizes:
        overrides["sizes"] = args.sizes
    if args.memory_sizes:
        overrides["memory_sizes"] = args.memory_sizes
    for name in ("train_sizes", "train_memory_sizes", "train_memory_path", "memory_timeout"):
        if getattr(args, name) is not None:
            overrides[name] = getattr(args, name)
    if args.train_large_point is not None:
        overrides["train_large_point"] = args.train_large_point or None
    if args.rounds:
        overrides["rounds"] = args.rounds
    if args.min_time:
        overrides["min_time"] = args.min_time
    return Config.quick_config(**overrides) if args.quick else Config(**overrides)  # type: ignore[arg-type]


def merge(directory: str | Path, page: str | Path | None,
          train_page: str | Path | None = None) -> str:
    """Merges a directory of results: the pages' sections (unless ``page`` is None) and plot.

    The plot is linked by its path relative to the page's directory. When some run measured
    a training suite, its section goes into ``train_page`` too (and into the returned text).

    Returns:
        The Markdown section (then, after a blank line, the training section, if any).
    """
    folder = Path(directory)
    docs = report.load(folder)
    png = report.plot(docs, folder / "bench.png")
    name = None
    if png is not None:
        base = Path(page).resolve().parent if page is not None else Path.cwd()
        name = Path(os.path.relpath(Path(png).resolve(), base)).as_posix()
    body = report.merged_markdown(docs, name)
    if page is not None:
        report.write_between_markers(page, body)
    if not report.has_training(docs):
        return body
    train = report.train_markdown(docs)
    if page is not None and train_page is not None:
        report.write_between_markers(train_page, train, report.TRAIN_START, report.TRAIN_END)
    return f"{body}\n\n{train}"


def run(args: argparse.Namespace) -> int:
    """Runs what the parsed arguments ask for; returns the exit status.

    Raises:
        ValueError: Unknown backend names, or --merge on a directory without results.
        ImportError: A named backend is not installed.
    """
    if getattr(args, "bench_command", None) == "complexity":
        return complexity.run(args)
    if args.merge:
        body = merge(args.merge, None if args.stdout else args.page, args.train_page)
        if args.stdout:
            print(body)
        else:
            trained = report.has_training(report.load(args.merge))
            also = f", the training tables into {args.train_page}" if trained else ""
            print(f"wrote the benchmark table into {args.page}{also} and "
                  f"{Path(args.merge) / 'bench.png'}")
        return 0
    names = [registry.canonical_name(b) for b in args.backend] if args.backend else \
        registry.available_backends()
    for name in names:
        if not registry.is_installed(name):
            raise registry.BackendNotInstalledError(
                f"backend {name!r} is not installed here: {registry.PIP[name]}")
    config = config_from(args)
    out = Path(args.out)
    failed = []
    for name in dict.fromkeys(names):
        if run_child("benchmarks.run", name, config, out, not args.no_progress) != 0:
            failed.append(name)
            continue
        doc = json.loads((out / f"bench-{name}.json").read_text())
        print(report.backend_report(doc))
        png = report.plot([doc], out / f"bench-{name}.png")
        print(f"\nsaved {out / f'bench-{name}.json'}" + (
            f" and {png}" if png else " (no plot: matplotlib is not installed; "
                                      "pip install matplotlib)") + "\n")
    if failed:
        print(f"error: the benchmark failed on {', '.join(failed)} (see above)", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m benchmarks``; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="benchmarks: speed against the native layers, memory, GEMM fraction (or --merge "
                    "the results into docs/speed.md); complexity: conv vs RNN vs self-attention")
    configure(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (ValueError, TypeError, ImportError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
