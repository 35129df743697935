"""PyTorch: one training step of the default layers against torch's own, in one process.

Issue 17's training benchmark, torch part. A training step is the forward of the layer in
``train()`` mode on ``X (1, n, 512)`` with ``valid_lens = [n - n // 4]`` (torch's layers get the
equivalent key padding mask), then the backward of the output's sum; dropout 0 on both sides,
so that both do the same arithmetic. Contenders, timed in interleaved rounds
(:mod:`benchmarks.timing`), each ``ours ÷ native`` with the A/A control ``native' ÷ native``:

* ``mha``: ``MultiHeadAttention(512, 8, bias=True)`` as constructed by default (it keeps its
  attention weights, formed on read) against ``torch.nn.MultiheadAttention(512, 8,
  batch_first=True)`` holding the same weights (``backends.torch.convert.to_torch``);
* ``block``: ``TransformerEncoderBlock(512, 2048, 8, bias=True)`` against
  ``torch.nn.TransformerEncoderLayer(512, 8, 2048, dropout=0, batch_first=True)`` (post-norm,
  ReLU, as the block), each with its own initial weights (same shapes and arithmetic; the
  outputs are not compared).

Usage: ``python -m benchmarks.torch_training [--sizes 128,1024] [--rounds 15]
[--min-time 0.2]``, from the repository.
"""

from __future__ import annotations

import importlib
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from backends.torch import MultiHeadAttention, TransformerEncoderBlock
from backends.torch.convert import to_torch

ROOT = Path(__file__).resolve().parent.parent

HIDDEN, HEADS, FFN = 512, 8, 2048


def step(module: torch.nn.Module, forward: Callable[[], torch.Tensor]) -> Callable[[], Any]:
    """A training step: zero the gradients, ``forward()``, backward of the sum."""
    def call() -> Any:
        module.zero_grad(set_to_none=True)
        out = forward()
        out.sum().backward()  # type: ignore[no-untyped-call]
        return out
    return call


def contenders(kind: str, n: int) -> dict[str, Callable[[], Any]]:
    """``{"ours": step, "native": step}`` of one kind at length ``n``."""
    rng = np.random.default_rng(n)
    X = torch.from_numpy(rng.standard_normal((1, n, HIDDEN)).astype(np.float32))
    lens = torch.tensor([n - n // 4])
    padding = torch.arange(n)[None, :] >= lens[:, None]  # True = blocked
    if kind == "mha":
        ours = MultiHeadAttention(HIDDEN, HEADS, bias=True).train()
        ours(X, X, X, lens)  # sizes inferred
        native = to_torch(ours.get_weights(), HEADS, batch_first=True).train()
        return {"ours": step(ours, lambda: ours(X, X, X, lens)),
                "native": step(native, lambda: native(X, X, X, key_padding_mask=padding,
                                                      need_weights=False)[0])}
    block = TransformerEncoderBlock(HIDDEN, FFN, HEADS, bias=True).train()
    layer = torch.nn.TransformerEncoderLayer(HIDDEN, HEADS, FFN, dropout=0.0,
                                             batch_first=True).train()
    return {"ours": step(block, lambda: block(X, lens)),
            "native": step(layer, lambda: layer(X, src_key_padding_mask=padding))}


def main() -> None:
    """Parses the arguments, times each kind and size, prints one line each."""
    timing = importlib.import_module("benchmarks.timing")
    args = timing.ab_parser(__doc__.splitlines()[0], "128,1024").parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {head}; torch "
          f"{torch.__version__}, {os.cpu_count()} CPUs; {args.rounds} interleaved rounds, "
          "median [95% interval]", flush=True)
    for kind in ("mha", "block"):
        for n in sizes:
            made = contenders(kind, n)
            times = timing.interleaved({"ours": made["ours"], "native": made["native"],
                                        "native'": made["native"]}, args.rounds, args.min_time)
            r = timing.ratio(times, "ours", "native")
            aa = timing.ratio(times, "native'", "native")
            ms = 1e3 * statistics.median(times["native"])
            print(f"{kind:5s} n={n:5d}: ours/native {r.median:.3f} [{r.low:.3f}, {r.high:.3f}]"
                  f"   A/A {aa.median:.3f} [{aa.low:.3f}, {aa.high:.3f}]   native {ms:.1f} ms",
                  flush=True)


if __name__ == "__main__":
    main()
