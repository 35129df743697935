"""Ring attention over ``torch.distributed`` (gloo) against one process on the whole sequence.

Run once per rank with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set. Each rank
holds its zigzag (or contiguous) shard of q, k, v; it reports how far its output rows and the
gradients of its shards are from one process's, in float64, for each mask.
"""

from __future__ import annotations

import faulthandler
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

import attention_core as ac
from attention_core import parallel as par
from backends.torch.ops import TorchOps
from backends.torch.parallel import ring_attention, ulysses_attention
from tests.distributed.common import emit, max_abs_diff

B, H, HKV, N, D = 2, 4, 2, 24, 8
LENGTHS = np.array([7, 20])
SEGMENTS = np.array([[0] * 9 + [1] * 10 + [2] * 5, [0] * 3 + [1] * 21], np.int32)
SINKS = np.array([0.5, -1.0, 2.0, 0.0])
MASKS = {"none": {}, "causal": {"causal": True}, "causal_window": {"causal": True, "window": 5},
         "lengths": {"valid_lens": LENGTHS}, "causal_segments": {"causal": True,
                                                                "segment_ids": SEGMENTS},
         "causal_sinks": {"causal": True, "sinks": SINKS}}


def main() -> None:
    faulthandler.dump_traceback_later(240, exit=True)
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    layout = sys.argv[1] if len(sys.argv) > 1 else "zigzag"
    strategy = {"ring": ring_attention, "ulysses": ulysses_attention}[
        sys.argv[2] if len(sys.argv) > 2 else "ring"]
    rng = np.random.default_rng(5)
    q, k, v, cot = (torch.from_numpy(rng.standard_normal(s)) for s in
                    ((B, H, N, D), (B, HKV, N, D), (B, HKV, N, D), (B, H, N, D)))
    ops = TorchOps()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    result: dict[str, float] = {}
    try:
        for name, given in MASKS.items():
            masks = {key: torch.from_numpy(x) if isinstance(x, np.ndarray) else x
                     for key, x in given.items()}
            if strategy is ulysses_attention and set(masks) - {"causal", "window"}:
                continue  # Ulysses takes position masks only, so far
            full = [x.clone().requires_grad_() for x in (q, k, v)]
            out = ac.dot_product_attention(*full, **masks)
            (out * cot).sum().backward()
            shards = [par.shard(ops, x, world, rank, 2, layout).detach().requires_grad_()
                      for x in (q, k, v)]
            mine = strategy(*shards, layout=layout, **masks)
            (mine * par.shard(ops, cot, world, rank, 2, layout)).sum().backward()
            result[f"{name}.out"] = max_abs_diff(
                mine.detach(), par.shard(ops, out.detach(), world, rank, 2, layout))
            for label, x, s in zip("qkv", full, shards, strict=True):
                result[f"{name}.d{label}"] = max_abs_diff(
                    s.grad, par.shard(ops, x.grad, world, rank, 2, layout))
    finally:
        dist.destroy_process_group()
    emit(result)


if __name__ == "__main__":
    main()
