"""Command line: ``python -m attention_core {demo,info}``.

``demo`` runs the source chapter's example (batch 2, 4 queries, 100 hiddens, 5 heads,
``valid_lens`` [3, 2]) on a backend and prints what it computed; ``info`` lists the backends.
Errors are printed as one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from importlib import metadata
from typing import Any

import numpy as np

from attention_core import registry


def _version(module: str) -> str | None:
    """The installed version of the distribution providing ``module`` (read, not imported)."""
    for dist in metadata.packages_distributions().get(module, [module]):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def info() -> str:
    """Describes every backend: installed or not, versions, and which one is active."""
    active = registry.backend()
    lines = [f"active backend: {active} (set {registry.ENV_VAR} or use set_backend/use_backend)"]
    for name in registry.BACKENDS:
        versions = [(d, _version(d)) for d in registry.FRAMEWORKS[name]]
        if registry.is_installed(name):
            state = ", ".join(f"{d} {v}" for d, v in versions if v) or "installed"
        else:
            state = f"not installed ({registry.PIP[name]})"
        mark = "*" if name == active else " "
        lines.append(f"{mark} {name:<11} {state}")
    aliases = ", ".join(f"{a}->{c}" for a, c in registry.ALIASES.items())
    lines.append(f"aliases: {aliases}")
    return "\n".join(lines)


def demo(name: str | None = None) -> str:
    """Runs the chapter's multi-head attention and positional encoding examples."""
    key = registry.canonical_name(name) if name else registry.backend()
    module = registry.load(key)
    ops = module.OPS
    call: Callable[..., Any] = getattr(module, "call_layer", lambda layer, *a, **k: layer(*a, **k))
    num_hiddens, num_heads, batch, num_queries = 100, 5, 2, 4
    attention = module.MultiHeadAttention(num_hiddens, num_heads, 0.5)
    X = ops.from_numpy(np.ones((batch, num_queries, num_hiddens), np.float32))
    valid_lens = ops.from_numpy(np.array([3, 2], np.int32))
    out, weights = call(attention, X, X, X, valid_lens, return_attention=True)
    weights = ops.to_numpy(weights)
    encoding = module.PositionalEncoding(32, 0.0)
    P = call(encoding, ops.from_numpy(np.zeros((1, 60, 32), np.float32)))
    np.set_printoptions(precision=4, suppress=True)
    return "\n".join([
        f"backend: {key}",
        f"MultiHeadAttention({num_hiddens}, {num_heads}, 0.5) on ones{(batch, num_queries, num_hiddens)}"
        " with valid_lens [3, 2]",
        f"  output shape: {tuple(ops.shape(out))}",
        f"  attention weights shape: {weights.shape} (batch, heads, queries, keys)",
        f"  example 0, head 0, query 0: {weights[0, 0, 0]}  (keys 3.. masked)",
        f"  example 1, head 0, query 0: {weights[1, 0, 0]}  (keys 2.. masked)",
        "PositionalEncoding(32, 0) on zeros(1, 60, 32)",
        f"  output shape: {tuple(ops.shape(P))}; table P shape: {tuple(ops.shape(encoding.P))}",
        f"  row 1, columns 0..3: {ops.to_numpy(P)[0, 1, :4]}",
    ])


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m attention_core", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_demo = sub.add_parser("demo", help="run the chapter's example on a backend")
    p_demo.add_argument("--backend", help=f"backend name (default: ${registry.ENV_VAR}, else numpy)")
    sub.add_parser("info", help="list backends, versions and the active one")
    args = parser.parse_args(argv)
    try:
        print(demo(args.backend) if args.command == "demo" else info())
    except (ValueError, TypeError, ImportError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
