"""``torch.compile``: the guarded SDPA against the bare one, in one process.

Issue 14's leak under ``torch.compile``: a compiled call cannot probe its inputs, so SDPA,
which cannot mask an overflowed score, ran on whatever came. Now, in a program that autograd
does not record (``torch.no_grad``), ``torch.cond`` picks SDPA only when an in-graph
bound says no score can overflow. This script times the forward of the compiled
``MultiHeadAttention(512, 8, bias=True)`` (``fullgraph=True``), self-attention, batch 1,
``valid_lens = [n - n // 4]``, in interleaved rounds (:mod:`benchmarks.timing`): ``new`` under
``torch.no_grad()`` (the bound and ``torch.cond``), ``old`` the same layer's weights in a layer
whose weights do not require gradients, run with autograd on, where no ``torch.cond`` is made:
bare SDPA, as every compiled call ran before the change (and a compiled training step still
runs). ``old`` runs twice per round: ``old'/old`` is the A/A control. Prints, per size, the
median ratio ``new/old`` over rounds with its 95% interval, and the control.

Usage: ``python -m benchmarks.torch_compiled_guard [--sizes 512,1024] [--rounds 15]
[--min-time 0.2]``, from the repository.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from backends.torch import MultiHeadAttention

ROOT = Path(__file__).resolve().parent.parent

HIDDEN, HEADS = 512, 8


def compiled(weights: dict[str, np.ndarray], x: torch.Tensor, **config: Any) -> Callable[..., Any]:
    """``MultiHeadAttention(512, 8, bias=True, **config)`` holding ``weights``, compiled."""
    layer = MultiHeadAttention(HIDDEN, HEADS, bias=True, keep_attention_weights=False, **config)
    layer.eval()
    layer(x, x, x)  # sizes inferred eagerly
    layer.set_weights(weights)
    fn: Callable[..., Any] = torch.compile(layer, fullgraph=True)
    return fn


def calls(weights: dict[str, np.ndarray], x: torch.Tensor, lens: torch.Tensor
          ) -> dict[str, Callable[[], Any]]:
    """``{"new": call, "old": call}`` of the module docstring, each compiled now."""
    guarded, bare = compiled(weights, x), compiled(weights, x)
    for p in bare.parameters():  # type: ignore[attr-defined]
        p.requires_grad_(False)

    def infer(fn: Callable[..., Any], grad: bool) -> Callable[[], Any]:
        def call() -> Any:
            with torch.set_grad_enabled(grad):
                return fn(x, x, x, lens).numpy()
        return call

    result = {"new": infer(guarded, False), "old": infer(bare, True)}
    for call in result.values():
        call()  # compiled here
    return result


def main() -> None:
    """Parses the arguments, compiles the layers per size, times them, prints."""
    timing = importlib.import_module("benchmarks.timing")
    args = timing.ab_parser(__doc__.splitlines()[0], "512,1024").parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    rng = np.random.default_rng(0)
    weights = {}
    for name in ("W_q", "W_k", "W_v", "W_o"):
        weights[f"{name}.kernel"] = (rng.standard_normal((HIDDEN, HIDDEN)) * HIDDEN**-0.5).astype(np.float32)
        weights[f"{name}.bias"] = (rng.standard_normal(HIDDEN) * 0.1).astype(np.float32)
    inputs = {n: (torch.from_numpy(rng.standard_normal((1, n, HIDDEN)).astype(np.float32)),
                  torch.tensor([n - n // 4])) for n in sizes}
    made = {n: calls(weights, *inputs[n]) for n in sizes}
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {head}; torch "
          f"{torch.__version__}, {os.cpu_count()} CPUs; {args.rounds} interleaved rounds, "
          "median [95% interval]", flush=True)
    for n in sizes:
        line = timing.new_against_old(f"n={n:5d} infer", made[n]["new"], made[n]["old"],
                                      args.rounds, args.min_time)
        print(line, flush=True)


if __name__ == "__main__":
    main()
