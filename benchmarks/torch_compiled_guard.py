"""``torch.compile``: the guarded SDPA against the bare one, in one process.

Issue 14's leak under ``torch.compile``: a compiled call cannot probe its inputs, so SDPA,
which cannot mask an overflowed score, ran on whatever came. Now, in a program that autograd
does not record (``torch.no_grad``), ``torch.cond`` picks SDPA only when an in-graph bound
says no score can overflow; in a training step, where ``torch.cond`` cannot branch, the fused
path runs as the eager call inside one operator, which probes the inputs when it runs and
runs again in the backward pass.

This script times ``dot_product_attention`` compiled with ``fullgraph=True``, self-attention
on ``(1, 8, n, 64)`` float32 with ``valid_lens = [n - n // 4]``, in interleaved rounds
(:mod:`benchmarks.timing`). ``new`` uses the torch ops, ``old`` ops without ``torch.cond``
and without the operator: the bare SDPA, as every compiled call ran before. ``infer`` lines
time the forward under ``torch.no_grad()``; ``train`` lines a training step (the forward,
then the backward of the output's sum). ``old`` runs twice per round: ``old'/old`` is the A/A
control. Prints, per size and line, the median ratio ``new/old`` over rounds with its 95%
interval, and the control.

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
from typing import Any, cast

import numpy as np
import torch

import attention_core as ac
from backends.torch import TorchOps

ROOT = Path(__file__).resolve().parent.parent

HEADS, DEPTH = 8, 64


class _BareOps(TorchOps):
    """Torch ops with neither ``torch.cond`` nor the eager-call operator: the bare SDPA."""

    cond = None
    attend_out_of_range = None


def calls(n: int, train: bool) -> dict[str, Callable[[], Any]]:
    """``{"new": call, "old": call}`` of an ``infer`` or ``train`` line, each compiled now.

    A call returns the output, and in a training step the queries' gradient after it.
    """
    q = torch.from_numpy(np.random.default_rng(n).standard_normal((1, HEADS, n, DEPTH))
                         .astype(np.float32)).requires_grad_(train)
    lens = torch.tensor([n - n // 4])

    def call_with(ops: TorchOps) -> Callable[[], Any]:
        def attend(q: torch.Tensor) -> torch.Tensor:
            return cast(torch.Tensor, ac.dot_product_attention(q, q, q, lens, ops=ops))

        fn = torch.compile(attend, fullgraph=True)

        def call() -> Any:
            if not train:
                with torch.no_grad():
                    return fn(q).numpy()
            q.grad = None
            out = fn(q)
            out.sum().backward()  # type: ignore[no-untyped-call]
            assert q.grad is not None
            return np.concatenate([out.detach().numpy().ravel(), q.grad.numpy().ravel()])
        return call

    result = {"new": call_with(TorchOps()), "old": call_with(_BareOps())}
    for call in result.values():
        call()  # compiled here
    return result


def main() -> None:
    """Parses the arguments, compiles the calls per size, times them, prints."""
    timing = importlib.import_module("benchmarks.timing")
    args = timing.ab_parser(__doc__.splitlines()[0], "512,1024").parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    made = {(n, line): calls(n, line == "train") for n in sizes for line in ("infer", "train")}
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {head}; torch "
          f"{torch.__version__}, {os.cpu_count()} CPUs; {args.rounds} interleaved rounds, "
          "median [95% interval]", flush=True)
    for (n, line), made_now in made.items():
        print(timing.new_against_old(f"n={n:5d} {line}", made_now["new"], made_now["old"],
                                     args.rounds, args.min_time), flush=True)


if __name__ == "__main__":
    main()
