"""Command line: ``python -m attention_core {demo,info}``.

``demo`` runs the d2l book's self-attention example on a backend and prints what it computed (with
``--out DIR`` it also draws the d2l book's pictures into DIR, see :mod:`attention_core.demo`);
``info`` prints the version and lists the backends. The benchmarks, the test matrix's README table
and the worked examples are run from the repository, not from the installed package:
``python -m benchmarks``, ``python -m tools.matrix`` and ``python -m examples.<name>``.
Errors are printed as one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from attention_core import __version__, plot, registry
from attention_core.demo import demo, demo_figures

__all__ = ["demo", "demo_figures", "info", "main"]


def info() -> str:
    """Describes the package's version and every backend: installed or not, versions, the active one."""
    active = registry.backend()
    lines = [f"attention-core {__version__}",
             f"active backend: {active} (set {registry.ENV_VAR} or use set_backend/use_backend)"]
    for name in registry.BACKENDS:
        versions = [(d, registry.module_version(d)) for d in registry.FRAMEWORKS[name]]
        if registry.is_installed(name):
            state = ", ".join(f"{d} {v}" for d, v in versions if v) or "installed"
        else:
            state = f"not installed ({registry.PIP[name]})"
        mark = "*" if name == active else " "
        lines.append(f"{mark} {name:<11} {state}")
    aliases = ", ".join(f"{a}->{c}" for a, c in registry.ALIASES.items())
    lines.append(f"aliases: {aliases}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m attention_core", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_demo = sub.add_parser("demo", help="run the d2l book's self-attention example on a backend")
    p_demo.add_argument("--backend", help=f"backend name (default: ${registry.ENV_VAR}, else numpy)")
    p_demo.add_argument("--out", metavar="DIR",
                        help="also draw the pictures into DIR as PNG files and print the binary table "
                             f"of 0..7 (needs matplotlib: {plot.INSTALL_HINT})")
    sub.add_parser("info", help="the package's version; backends, their versions and the active one")
    args = parser.parse_args(argv)
    try:
        if args.command == "demo":
            print(demo(args.backend, args.out))
        else:
            print(info())
    except (ValueError, TypeError, ImportError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
