"""The encoder-decoder Transformer example in PyTorch: autograd and ``torch.optim.Adam``.

The data, the schedule, the searches and the report are the framework-free ones of
:mod:`examples.transformer`. Run from the repository root: ``python -m
examples.transformer_torch`` (trains 400 steps, decodes held-out sequences greedily and by
beam search; ``--save FILE`` writes the weights, ``--plot FILE.png`` the cross-attention).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F

from backends.torch import Transformer
from examples import transformer as example
from examples.seq2seq import Seq2SeqData


def train_transformer(data: Seq2SeqData | None = None, *, steps: int = example.STEPS,
                      seed: int = 0) -> tuple[Transformer, list[float]]:
    """Trains as :mod:`examples.transformer` describes; returns the model (in eval mode) and the losses.

    ``seed`` goes to ``torch.manual_seed`` (the initial weights) and to the batches.
    """
    torch.manual_seed(seed)
    data = data or example.training_data(seed)
    model = Transformer(**example.CONFIG.transformer())
    optimizer = torch.optim.Adam(model.parameters())
    model.train()
    losses = []
    for batch, rate in example.batches(data, steps, seed):
        for group in optimizer.param_groups:
            group["lr"] = rate
        source, inputs, lens, targets = map(torch.from_numpy, (
            batch.source, batch.decoder_inputs, batch.source_lens, batch.targets))
        per_token = F.cross_entropy(model(source, inputs, lens).transpose(1, 2), targets.long(),
                                    reduction="none")  # (B, T)
        weights = torch.from_numpy(batch.loss_weights())
        loss = (per_token * weights).sum() / weights.sum()
        optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        nn.utils.clip_grad_norm_(model.parameters(), example.CLIP)
        optimizer.step()
        losses.append(loss.item())
    model.eval()
    return model, losses


def decoding(model: Transformer) -> example.Decoding:
    """The model's own encoder and decoder, called without autograd."""
    return example.Decoding("torch", model.encoder, model.decoder, torch.no_grad)


def main(argv: Sequence[str] | None = None) -> int:
    """Trains on the reversal task, decodes held-out sequences and prints how it went."""
    torch.set_num_threads(1)  # tiny ops: one thread is faster than two
    return example.run_script("PyTorch", argv, train_transformer, decoding)


if __name__ == "__main__":
    sys.exit(main())
