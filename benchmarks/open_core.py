"""The open core's two speed goals, measured: per-call overhead, and packed sequences.

``python -m benchmarks.open_core --backend torch --out benchmarks/results`` times, in this
process, interleaved round by round (:func:`benchmarks.timing.interleaved`):

* **overhead** (torch only): ``backends.torch.MultiHeadAttention(256, 8)`` against
  ``torch.nn.MultiheadAttention(256, 8, batch_first=True)`` (``need_weights=False``), both
  in eval mode under ``torch.no_grad()``, one query over 64 keys and values: the eager cost of
  a call whose arithmetic is tiny, so that the time is the layers' own overhead.
* **packed**: ``dot_product_attention`` (the automatic choice) on 8 documents of 1,024 tokens
  packed into one row with ``segment_ids`` and ``causal=True``, against 8 separate causal
  calls of 1,024 tokens, ``(1, 4, n, 64)`` float32. The packed call skips the key blocks of
  other documents, so it should cost about the separate calls, not the (8,192)^2 square.

It writes ``open-core-<backend>-<threads>.json`` (``--threads`` sets torch's); ``--merge DIR
--page FILE`` renders every such file into the table between ``<!-- open-core:start -->`` and
``<!-- open-core:end -->`` of ``FILE``. Run from the repository root.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

import attention_core as ac
from attention_core import registry
from benchmarks.run import machine_info
from benchmarks.timing import interleaved, ratio
from tools import markdown

START, END = "<!-- open-core:start -->", "<!-- open-core:end -->"
#: Documents packed into one row, and the tokens of each.
DOCUMENTS, TOKENS = 8, 1024


def overhead_contenders() -> dict[str, Callable[[], Any]]:
    """The library's and torch's multi-head attention on one query over 64 keys."""
    import torch

    from backends.torch import MultiHeadAttention

    torch.manual_seed(0)
    ours = MultiHeadAttention(256, 8).eval()
    native = torch.nn.MultiheadAttention(256, 8, batch_first=True).eval()
    x, kv = torch.randn(1, 1, 256), torch.randn(1, 64, 256)
    ours(x, kv, kv)

    def run(fn: Callable[[], Any]) -> Callable[[], Any]:
        def call() -> Any:
            with torch.no_grad():
                return fn()
        return call

    return {"ours": run(lambda: ours(x, kv, kv)),
            "torch.nn.MultiheadAttention": run(lambda: native(x, kv, kv, need_weights=False))}


def packed_contenders(backend: str) -> dict[str, Callable[[], Any]]:
    """One packed call of 8 documents against 8 separate calls, on ``backend``'s arrays."""
    ops = registry.get_ops(backend)
    rng = np.random.default_rng(0)
    n = DOCUMENTS * TOKENS
    q, k, v = (ops.from_numpy(rng.standard_normal((1, 4, n, 64)).astype(np.float32))
               for _ in range(3))
    ids = np.repeat(np.arange(DOCUMENTS, dtype=np.int32), TOKENS)[None]
    docs = [tuple(ops.slice(x, 2, d * TOKENS, TOKENS) for x in (q, k, v))
            for d in range(DOCUMENTS)]
    packed = ac.dot_product_attention(q, k, v, segment_ids=ids, causal=True)
    alone = ops.concatenate([ac.dot_product_attention(*d, causal=True) for d in docs], 2)
    diff = float(np.abs(ops.to_numpy(packed) - ops.to_numpy(alone)).max())
    if diff > 1e-5:
        raise AssertionError(f"packed and separate calls differ by {diff:.3g}")

    def wait(x: Any) -> Any:
        return ops.to_numpy(x[..., :1, :1]) if backend != "numpy" else x

    return {"packed": lambda: wait(ac.dot_product_attention(q, k, v, segment_ids=ids,
                                                            causal=True)),
            "separate": lambda: [wait(ac.dot_product_attention(*d, causal=True))
                                 for d in docs]}


def run(backend: str, rounds: int, threads: int | None = None) -> dict[str, Any]:
    """Both measurements on ``backend`` (the overhead on torch only), torch on ``threads``."""
    if backend == "torch" and threads is not None:
        import torch

        torch.set_num_threads(threads)
    result: dict[str, Any] = {"backend": backend, "machine": machine_info(), "rounds": rounds,
                              "threads": _threads(backend)}
    if backend == "torch":
        times = interleaved(overhead_contenders(), rounds, min_time=0.2)
        r = ratio(times, "ours", "torch.nn.MultiheadAttention")
        result["overhead"] = {"ratio": [r.median, r.low, r.high],
                              "us": {k: 1e6 * float(np.median(v)) for k, v in times.items()}}
    times = interleaved(packed_contenders(backend), rounds, min_time=0.5, warmup=1)
    r = ratio(times, "packed", "separate")
    result["packed"] = {"ratio": [r.median, r.low, r.high],
                        "ms": {k: 1e3 * float(np.median(v)) for k, v in times.items()}}
    return result


def _threads(backend: str) -> int | None:
    """The threads the backend computes on: torch's own count, else ``OMP_NUM_THREADS``."""
    if backend == "torch":
        import torch

        return int(torch.get_num_threads())
    given = os.environ.get("OMP_NUM_THREADS", "")
    return int(given) if given.isdigit() else None


def render(results: Sequence[dict[str, Any]]) -> str:
    """The markdown table of the runs."""
    lines = ["| backend | threads | measure | ratio (median [95% interval]) | per call |",
             "|---|---|---|---|---|"]
    for res in results:
        b, t = res["backend"], res.get("threads") or "default"
        if "overhead" in res:
            o = res["overhead"]
            lo, mid, hi = o["ratio"][1], o["ratio"][0], o["ratio"][2]
            us = ", ".join(f"{k} {v:.0f} µs" for k, v in o["us"].items())
            lines.append(f"| `{b}` | {t} | MultiHeadAttention(256, 8), 1 query over 64 keys, ÷ "
                         f"torch.nn.MultiheadAttention | {mid:.2f} [{lo:.2f}, {hi:.2f}] | {us} |")
        p = res["packed"]
        ms = ", ".join(f"{k} {v:.0f} ms" for k, v in p["ms"].items())
        lines.append(f"| `{b}` | {t} | {DOCUMENTS} packed documents of {TOKENS} ÷ {DOCUMENTS} "
                     f"separate calls | {p['ratio'][0]:.2f} [{p['ratio'][1]:.2f}, "
                     f"{p['ratio'][2]:.2f}] | {ms} |")
    machines = "; ".join(f"`{r['backend']}`: {r['machine'].get('cpu', '?')}, "
                         f"{r['machine'].get('date', '?')}, {r['rounds']} rounds" for r in results)
    return "\n".join(lines) + f"\n\nMeasured on {machines}.\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one backend's measurements, or merges the runs into the page."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.open_core", description=__doc__)
    parser.add_argument("--backend", choices=("numpy", "torch", "tensorflow", "jax", "mxnet"))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, help="torch's threads (default: torch's own)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--merge", type=Path, metavar="DIR")
    parser.add_argument("--page", type=Path, default=Path("docs/speed.md"))
    args = parser.parse_args(argv)
    if args.merge is not None:
        results = [json.loads(p.read_text()) for p in sorted(args.merge.glob("open-core-*.json"))]
        markdown.write_between_markers(args.page, render(results), START, END)
        return 0
    if args.backend is None:
        parser.error("--backend is required unless --merge is given")
    result = run(args.backend, args.rounds, args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"open-core-{args.backend}-{result['threads'] or 'default'}.json"
    (args.out / name).write_text(json.dumps(result, indent=2))
    print(render([result]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
