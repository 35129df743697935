"""One SGD step of ``backends.torch.TransformerEncoderBlock`` under DistributedDataParallel.

Run once per rank, with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set (the
gloo backend over TCP, ``env://``). Each rank also computes the step in one process on the full
batch (the same starting weights, the loss the mean over all examples), and reports how far its
DDP step (its share of the batch, gradients averaged by DDP) is from that: the output rows of
its share, every gradient, every updated weight. ``local_gradient`` is how far the gradients of
its own share alone (no averaging) are from the full batch's: large, so the comparison can fail.
"""

from __future__ import annotations

import faulthandler
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from backends.torch import TransformerEncoderBlock
from tests.distributed.common import batch, emit, max_abs_diff

B, T, H, FFN, HEADS = 8, 6, 16, 32, 4
LR = 0.1


def make_block(weights: dict[str, np.ndarray] | None = None) -> TransformerEncoderBlock:
    block = TransformerEncoderBlock(H, FFN, HEADS, dropout=0.0, bias=True, dtype=torch.float64)
    if weights is not None:
        block.set_weights(weights)
    return block


def loss_of(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean over the examples of each one's summed squared error."""
    return ((out - target) ** 2).sum(dim=(1, 2)).mean()


Step = tuple[np.ndarray, dict[str, np.ndarray], dict[str, np.ndarray]]


def sgd_step(model: torch.nn.Module, block: TransformerEncoderBlock, X: torch.Tensor,
             valid_lens: torch.Tensor, target: torch.Tensor) -> Step:
    """Output, gradients and updated weights of one SGD step of ``model`` (``block`` or its DDP)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    optimizer.zero_grad()
    out = model(X, valid_lens)
    loss_of(out, target).backward()
    grads = {}
    for name, p in block.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        grads[name] = p.grad.detach().numpy().copy()
    optimizer.step()
    return out.detach().numpy(), grads, block.get_weights()


def main() -> None:
    # a rank that hangs prints where, then exits, before the test's timeout (300 s) ends it
    faulthandler.dump_traceback_later(240, exit=True)
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    data = {k: torch.from_numpy(v) for k, v in batch(0, B, T, H).items()}
    share = slice(rank * B // world, (rank + 1) * B // world)

    torch.manual_seed(0)
    start = make_block().get_weights()
    single = make_block(start)  # one process, the whole batch
    full_out, full_grads, full_updated = sgd_step(single, single, data["X"], data["valid_lens"],
                                                  data["target"])
    alone = make_block(start)  # this rank's half, without DDP
    _, local_grads, _ = sgd_step(alone, alone, data["X"][share], data["valid_lens"][share],
                                 data["target"][share])

    began = time.perf_counter()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        block = make_block(start)
        ddp = DistributedDataParallel(block)
        out, grads, updated = sgd_step(ddp, block, data["X"][share], data["valid_lens"][share],
                                       data["target"][share])
        dist.barrier()
    finally:
        dist.destroy_process_group()
    emit({
        "rank": rank,
        "world_size": world,
        "share": [share.start, share.stop],
        "seconds": time.perf_counter() - began,
        "forward": max_abs_diff(out, full_out[share]),
        "gradient": max(max_abs_diff(grads[n], full_grads[n]) for n in full_grads),
        "updated_weights": max(max_abs_diff(updated[n], full_updated[n]) for n in full_updated),
        "gradient_scale": max(float(np.abs(g).max()) for g in full_grads.values()),
        "local_gradient": max(max_abs_diff(local_grads[n], full_grads[n]) for n in full_grads),
        "parameters": sorted(full_grads),
    })


if __name__ == "__main__":
    main()
