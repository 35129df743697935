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
from attention_core.kernels import blockwise
from backends.torch import DotProductAttention, MultiHeadAttention, TransformerDecoder, parallel
from backends.torch.ops import TorchOps
from backends.torch.parallel import ContextParallel, ring_attention, ulysses_attention
from tests.distributed.common import HKV, LENGTHS, B, D, H, N, emit, max_abs_diff
from tests.distributed.common import MASKS as COMMON_MASKS

MASKS = {**COMMON_MASKS,
         "causal_score_mod": {"causal": True,  # a score_mod: the ring autograd records
                              "score_mod": lambda s, b, h, q, kv: s - 0.05 * (q - kv)}}


def main() -> None:
    faulthandler.dump_traceback_later(240, exit=True)
    torch.set_num_threads(1)
    # small chunks and tiles: each shard's keys go round in chunks of 5 (12 rows: 5, 5, 2; 6
    # rows: 5, 1), each cut into ragged tiles of 3 queries by 3 keys in the forward and the
    # backward, those the masks hide skipped, the sinks in the first tile of each row only
    blockwise.KEY_BLOCK, blockwise.MIN_QUERY_BLOCK = 3, 1
    parallel.RING_TILE_SCORES = B * H * 3 * 3
    parallel.RING_CHUNK = 5
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
        result.update(_layer(rank, world, layout, sys.argv[2] if len(sys.argv) > 2 else "ring"))
        result.update(_dot_product_layer(rank, world, layout,
                                         sys.argv[2] if len(sys.argv) > 2 else "ring"))
        result.update(_stack(rank, world, layout, sys.argv[2] if len(sys.argv) > 2 else "ring"))
    finally:
        dist.destroy_process_group()
    emit(result)


def _layer(rank: int, world: int, layout: str, strategy: str) -> dict[str, float]:
    """A rotary grouped-query layer with sinks on the shards against the same on the whole sequence.

    Causal, with lengths: the output rows, the input's gradient, and the weights' gradients
    summed over the ranks.
    """
    ops, width = TorchOps(), 16
    torch.manual_seed(0)
    options = {"num_kv_heads": HKV, "positional": "rotary", "sinks": True,
               "dtype": torch.float64}
    whole = MultiHeadAttention(width, H, **options)
    split = MultiHeadAttention(width, H, **options,
                               context_parallel=ContextParallel(None, strategy, layout))
    X = torch.from_numpy(np.random.default_rng(9).standard_normal((B, N, width)))
    cot = torch.from_numpy(np.random.default_rng(10).standard_normal((B, N, width)))
    lens = torch.from_numpy(LENGTHS)
    full = X.clone().requires_grad_()
    out = whole(full, full, full, lens, causal=True)
    (out * cot).sum().backward()
    split.set_weights(whole.get_weights())
    mine_x = par.shard(ops, X, world, rank, 1, layout).requires_grad_()
    mine = split(mine_x, mine_x, mine_x, lens, causal=True)
    (mine * par.shard(ops, cot, world, rank, 1, layout)).sum().backward()
    got = {"layer.out": max_abs_diff(mine.detach(),
                                     par.shard(ops, out.detach(), world, rank, 1, layout)),
           "layer.dX": max_abs_diff(mine_x.grad, par.shard(ops, full.grad, world, rank, 1,
                                                           layout))}
    theirs = dict(whole.named_parameters())
    for name, p in split.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad)
        got[f"layer.d{name}"] = max_abs_diff(grad, theirs[name].grad)
    return got


def _dot_product_layer(rank: int, world: int, layout: str, strategy: str) -> dict[str, float]:
    """A rotary, windowed ``DotProductAttention`` layer on the shards against one process.

    Causal, with lengths, on ``(B, n, D)``: the output rows and the gradients of the queries,
    keys and values. By the ring only: Ulysses splits the heads, and the layer has one.
    """
    ops, got = TorchOps(), {}
    if strategy != "ring":  # refused by name at the call
        layer = DotProductAttention(context_parallel=ContextParallel(None, strategy, layout))
        x = par.shard(ops, torch.ones(B, N, D), world, rank, 1, layout)
        try:
            layer(x, x, x)
        except ValueError as err:
            assert "use strategy='ring'" in str(err), err
            return got
        raise AssertionError("Ulysses took a one-head DotProductAttention")
    options = {"positional": "rotary", "window": 5}
    whole = DotProductAttention(**options)
    split = DotProductAttention(**options, context_parallel=ContextParallel(None, strategy,
                                                                           layout))
    rng = np.random.default_rng(13)
    for label, shape in {"rows": (B, N, D)}.items():
        axis = len(shape) - 2
        q, k, v, cot = (torch.from_numpy(rng.standard_normal(shape)) for _ in range(4))
        full = [x.clone().requires_grad_() for x in (q, k, v)]
        out = whole(*full, torch.from_numpy(LENGTHS), causal=True)
        (out * cot).sum().backward()
        shards = [par.shard(ops, x, world, rank, axis, layout).detach().requires_grad_()
                  for x in (q, k, v)]
        mine = split(*shards, torch.from_numpy(LENGTHS), causal=True)
        (mine * par.shard(ops, cot, world, rank, axis, layout)).sum().backward()
        got[f"dpa_{label}.out"] = max_abs_diff(
            mine.detach(), par.shard(ops, out.detach(), world, rank, axis, layout))
        for name, x, s in zip("qkv", full, shards, strict=True):
            got[f"dpa_{label}.d{name}"] = max_abs_diff(
                s.grad, par.shard(ops, x.grad, world, rank, axis, layout))
    return got


def _stack(rank: int, world: int, layout: str, strategy: str) -> dict[str, float]:
    """A decoder-only stack (sinusoidal positions, grouped heads, lengths) on token shards.

    The logits rows, and the weights' gradients summed over the ranks, against one process.
    """
    torch.manual_seed(1)
    config = {"vocab_size": 30, "num_hiddens": 16, "ffn_num_hiddens": 24, "num_heads": H,
              "num_blks": 2, "decoder_only": True, "num_kv_heads": HKV, "dtype": torch.float64}
    whole = TransformerDecoder(**config)
    split = TransformerDecoder(**config, context_parallel=ContextParallel(None, strategy, layout))
    tokens = torch.from_numpy(np.random.default_rng(11).integers(0, 30, (B, N)))
    cot = torch.from_numpy(np.random.default_rng(12).standard_normal((B, N, 30)))
    lens = torch.from_numpy(LENGTHS)
    out = whole(tokens, valid_lens=lens)
    (out * cot).sum().backward()
    split.set_weights(whole.get_weights())
    ops = TorchOps()
    mine = split(par.shard(ops, tokens, world, rank, 1, layout), valid_lens=lens)
    (mine * par.shard(ops, cot, world, rank, 1, layout)).sum().backward()
    got = {"stack.out": max_abs_diff(mine.detach(),
                                     par.shard(ops, out.detach(), world, rank, 1, layout))}
    theirs = dict(whole.named_parameters())
    for name, p in split.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad)
        got[f"stack.d{name}"] = max_abs_diff(grad, theirs[name].grad)
    return got


if __name__ == "__main__":
    main()
