"""Cached against uncached decoding: tokens per second for 256 generated tokens.

``python -m benchmarks.decoding --backend torch --out benchmarks/results`` times greedy
generation with a decoder-only ``TransformerDecoder`` (GPT-style) on one backend, in this
process, two ways, interleaved round by round:

* **cached**: each step feeds the new token alone against the key/value cache
  (:func:`attention_core.transformer_decoder` with ``cache=``);
* **uncached**: each step runs the decoder over the whole prefix again and reads its last row
  (the d2l book's prediction loop without a cache). On JAX both are jitted: the cached step
  once, with the position as an array; the uncached one over a buffer of the full length
  (the rows after the prefix are hidden by the causal mask and not read), so that neither
  compiles per step.

Both run the same host-side greedy search (:func:`attention_core.greedy_search`) on the same
weights, and the benchmark checks they generate the same tokens. It writes
``decode-<backend>.json``; ``--merge DIR --page FILE`` renders every backend's file into the
table between ``<!-- decode:start -->`` and ``<!-- decode:end -->`` of ``FILE``. Run from the
repository root.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

import attention_core as ac
from attention_core import registry
from benchmarks.run import machine_info
from benchmarks.timing import median_interval
from tools import markdown

#: The model: a decoder-only stack of 2 blocks, h = 256, 4 heads, FFN 1024, vocabulary 1000.
MODEL: dict[str, Any] = {"vocab_size": 1000, "num_hiddens": 256, "ffn_num_hiddens": 1024, "num_heads": 4,
         "num_blks": 2}
#: Tokens generated after a one-token prompt, and the batch.
TOKENS, BATCH = 256, 1
START, END = "<!-- decode:start -->", "<!-- decode:end -->"


def weights(backend: str) -> tuple[dict[str, Any], Any]:
    """The model's weights and sinusoidal table as the backend's float32 arrays (seed 0)."""
    import backends.numpy as np_layers

    layer = np_layers.TransformerDecoder(**MODEL, decoder_only=True, max_len=TOKENS + 1, seed=0)
    layer(np.zeros((1, 1), np.int32))
    ops = registry.get_ops(backend)
    w = {k: ops.from_numpy(v.astype(np.float32)) for k, v in layer.get_weights().items()}
    return w, ops.from_numpy(np.asarray(layer.P, np.float32))


def steps(backend: str) -> dict[str, Callable[..., Any]]:
    """The cached and the uncached decoding step of :mod:`attention_core.generation`."""
    w, P = weights(backend)
    if backend == "jax":
        return _jitted(w, P)
    heads, capacity = MODEL["num_heads"], TOKENS + 1
    ops = registry.get_ops(backend)

    def cached(ids: Any, cache: Any, start: int) -> Any:
        return ac.transformer_decoder(ids, w, heads, cache=cache, start=start,
                                      capacity=capacity if cache is None else None, positions=P)

    def uncached(ids: Any, prefix: Any, start: int) -> Any:
        rows = ids if prefix is None else ops.concatenate([prefix, ids], 1)
        return ac.transformer_decoder(rows, w, heads, positions=P), rows

    return {"cached": cached, "uncached": uncached}


def _jitted(w: dict[str, Any], P: Any) -> dict[str, Callable[..., Any]]:
    """JAX: both steps compiled once (see the module's docstring)."""
    import jax
    import jax.numpy as jnp

    heads, capacity = MODEL["num_heads"], TOKENS + 1
    step = jax.jit(lambda ids, cache, start: ac.transformer_decoder(
        ids, w, heads, cache=cache, start=start, positions=P))
    def last_row(rows: Any, t: Any) -> Any:
        logits: Any = ac.transformer_decoder(rows, w, heads, positions=P)
        return jax.lax.dynamic_slice_in_dim(logits, t, 1, axis=1)

    full = jax.jit(last_row)

    def cached(ids: Any, cache: Any, start: int) -> Any:
        if cache is None:
            return ac.transformer_decoder(ids, w, heads, capacity=capacity, positions=P)
        return step(ids, cache, jnp.asarray(start, jnp.int32))

    def uncached(ids: Any, buffer: Any, start: int) -> Any:
        rows = jnp.zeros((ids.shape[0], capacity), jnp.int32) if buffer is None else buffer
        rows = rows.at[:, start].set(ids[:, 0])
        return full(rows, jnp.asarray(start, jnp.int32)), rows

    return {"cached": cached, "uncached": uncached}


def generate(step: Callable[..., Any], backend: str) -> tuple[float, np.ndarray]:
    """Seconds to generate :data:`TOKENS` tokens greedily, and the tokens."""
    bos = registry.get_ops(backend).from_numpy(np.ones(BATCH, np.int32))
    began = time.perf_counter()
    tokens = ac.greedy_search(step, bos, TOKENS).tokens
    return time.perf_counter() - began, tokens


def measure(backend: str, rounds: int) -> dict[str, Any]:
    """Interleaved rounds of both ways (the order alternating), after one warm-up each.

    torch runs without autograd (``torch.no_grad()``), as inference does.
    """
    if backend == "torch":
        import torch

        with torch.no_grad():
            return _measure(backend, rounds)
    return _measure(backend, rounds)


def _measure(backend: str, rounds: int) -> dict[str, Any]:
    ways = steps(backend)
    firsts = {name: generate(step, backend)[1] for name, step in ways.items()}  # warm-up
    same = bool(np.array_equal(firsts["cached"], firsts["uncached"]))
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    for r in range(rounds):
        for name in (("cached", "uncached") if r % 2 == 0 else ("uncached", "cached")):
            seconds[name].append(generate(ways[name], backend)[0])
    ratios = [u / c for c, u in zip(seconds["cached"], seconds["uncached"], strict=True)]
    return {
        "backend": backend, "model": MODEL, "tokens": TOKENS, "batch": BATCH, "rounds": rounds,
        "same_tokens": same,
        "tokens_per_second": {name: TOKENS / float(np.median(s)) for name, s in seconds.items()},
        "seconds": seconds, "speedup": median_interval(ratios).as_dict(),
        "versions": _versions(backend), "machine": machine_info(),
        "date": time.strftime("%Y-%m-%d"),
    }


def _versions(backend: str) -> dict[str, str]:
    names = {"torch": "torch", "tensorflow": "tensorflow", "jax": "jax", "mxnet": "mxnet",
             "numpy": "numpy"}
    module = __import__(names[backend])
    return {"python": platform.python_version(), backend: str(module.__version__),
            "numpy": np.__version__}


def render(results: Sequence[dict[str, Any]]) -> str:
    """The Markdown table of the runs, one row per backend."""
    lines = ["| backend | cached tokens/s | uncached tokens/s | cached ÷ uncached [95% CI] "
             "| same tokens | rounds | date |", "|---|---|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: r["backend"]):
        s = r["speedup"]
        lines.append(
            f"| {r['backend']} | {r['tokens_per_second']['cached']:.1f} | "
            f"{r['tokens_per_second']['uncached']:.1f} | {s['median']:.2f} "
            f"[{s['low']:.2f}, {s['high']:.2f}] | {'yes' if r['same_tokens'] else 'no'} | "
            f"{r['rounds']} | {r['date']} |")
    first = results[0] if results else None
    if first is not None:
        lines.append("")
        model = ", ".join(f"{k}={v}" for k, v in first["model"].items())
        lines.append(f"Decoder-only `TransformerDecoder` ({model}), "
                     f"batch {first['batch']}, {first['tokens']} tokens generated greedily after one "
                     f"start token, float32, on {first['machine']['cpu']} "
                     f"({first['machine']['cores']} cores).")
    return "\n".join(lines)


def merge(directory: Path, page: Path) -> None:
    """Writes the table of every ``decode-*.json`` in ``directory`` into ``page``."""
    results = [json.loads(p.read_text()) for p in sorted(directory.glob("decode-*.json"))]
    if not results:
        raise ValueError(f"no decode-*.json in {directory}")
    markdown.write_between_markers(page, render(results), START, END)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one backend's benchmark, or merges the runs into the page (see the docstring)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.decoding", description=__doc__)
    parser.add_argument("--backend", choices=("numpy", "torch", "tensorflow", "jax", "mxnet"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--merge", type=Path, metavar="DIR")
    parser.add_argument("--page", type=Path, default=Path("docs/decoding.md"))
    args = parser.parse_args(argv)
    if args.merge is not None:
        merge(args.merge, args.page)
        return 0
    if args.backend is None:
        parser.error("--backend is required unless --merge is given")
    result = measure(args.backend, args.rounds)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"decode-{args.backend}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(render([result]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
