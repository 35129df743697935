"""The Bahdanau-attention seq2seq example in PyTorch: a GRU encoder-decoder that attends.

It trains with torch's autograd and ``torch.optim.Adam``. The data, the masks of the loss and
greedy decoding are the framework-free ones of :mod:`examples.seq2seq`. Run from the repository
root: ``python -m examples.seq2seq_torch`` (trains 200 steps and decodes held-out sequences).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from backends.torch import AdditiveAttention
from examples import seq2seq

Tensor = torch.Tensor


class Seq2SeqEncoder(nn.Module):
    """Token embedding and a multi-layer ``nn.GRU``.

    Args:
        vocab_size: Number of token ids.
        embed_size: Width of the embedding.
        num_hiddens: Width h of the GRU.
        num_layers: Number of stacked GRU layers.
        dropout: Dropout between the GRU layers, in training mode.
    """

    def __init__(self, vocab_size: int, embed_size: int, num_hiddens: int, num_layers: int,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embed_size)
        self.rnn = nn.GRU(embed_size, num_hiddens, num_layers, dropout=dropout, batch_first=True)

    def forward(self, X: Tensor) -> tuple[Tensor, Tensor]:
        """Encodes tokens ``X (B, S)``; returns the outputs ``(B, S, h)`` and state ``(layers, B, h)``."""
        outputs, state = self.rnn(self.embedding(X))
        return outputs, state


#: What the decoder carries between steps: encoder outputs, GRU state, source valid lengths.
DecoderState = tuple[Tensor, Tensor, Tensor]


class Seq2SeqAttentionDecoder(nn.Module):
    """A GRU decoder that attends to the encoder's outputs at every step (Bahdanau attention).

    At step t the query is the top layer of the previous state ``(B, 1, h)``; keys and values are
    the encoder outputs, masked beyond each source's valid length. The context ``(B, 1, h)`` is
    concatenated with the embedded input token and fed to the GRU.

    Args:
        vocab_size: Number of token ids.
        embed_size: Width of the embedding.
        num_hiddens: Width h of the GRU (and of the encoder's, which it attends to).
        num_layers: Number of stacked GRU layers.
        dropout: Dropout of the attention weights and between the GRU layers, in training mode.

    Attributes:
        attention_weights: The last call's attention weights ``(B, steps, S)``.
    """

    def __init__(self, vocab_size: int, embed_size: int, num_hiddens: int, num_layers: int,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.attention = AdditiveAttention(num_hiddens, dropout, q_in=num_hiddens, k_in=num_hiddens)
        self.embedding = nn.Embedding(vocab_size, embed_size)
        self.rnn = nn.GRU(embed_size + num_hiddens, num_hiddens, num_layers, dropout=dropout,
                          batch_first=True)
        self.dense = nn.Linear(num_hiddens, vocab_size)
        self.attention_weights: Tensor | None = None

    def init_state(self, encoded: tuple[Tensor, Tensor], source_lens: Tensor) -> DecoderState:
        """The state of the first step: the encoder's outputs and final state, and the lengths."""
        outputs, state = encoded
        return outputs, state, source_lens

    def forward(self, X: Tensor, state: DecoderState) -> tuple[Tensor, DecoderState]:
        """Decodes input tokens ``X (B, steps)``; returns logits ``(B, steps, vocab)`` and the state."""
        enc_outputs, hidden, source_lens = state
        embedded = self.embedding(X)  # (B, steps, e)
        outputs, weights = [], []
        for t in range(X.shape[1]):
            query = hidden[-1].unsqueeze(1)  # (B, 1, h)
            context, attn = self.attention(query, enc_outputs, enc_outputs, source_lens,
                                           return_attention=True)  # (B, 1, h), (B, 1, 1, S)
            out, hidden = self.rnn(torch.cat([context, embedded[:, t : t + 1]], dim=-1), hidden)
            outputs.append(out)
            weights.append(attn[:, 0, 0])
        self.attention_weights = torch.stack(weights, dim=1)
        return self.dense(torch.cat(outputs, dim=1)), (enc_outputs, hidden, source_lens)


class Seq2Seq(nn.Module):
    """An encoder-decoder: teacher forcing in ``forward``, greedy decoding in :meth:`predict`."""

    def __init__(self, encoder: Seq2SeqEncoder, decoder: Seq2SeqAttentionDecoder) -> None:
        super().__init__()
        self.encoder, self.decoder = encoder, decoder

    def forward(self, source: Tensor, source_lens: Tensor, decoder_inputs: Tensor) -> Tensor:
        """Logits ``(B, T, vocab)`` for every target position, given the right previous tokens."""
        state = self.decoder.init_state(self.encoder(source), source_lens)
        return self.decoder(decoder_inputs, state)[0]

    @torch.no_grad()
    def predict(self, source: Any, source_lens: Any, num_steps: int) -> tuple[np.ndarray, np.ndarray]:
        """Greedy decoding (in eval mode) of ``num_steps`` tokens per source.

        Returns:
            The tokens ``(B, num_steps)`` (``<pad>`` after ``<eos>``) and the attention weights
            ``(B, num_steps, S)``, as NumPy arrays.
        """
        self.eval()
        source, source_lens = torch.as_tensor(source), torch.as_tensor(source_lens)
        state = self.decoder.init_state(self.encoder(source), source_lens)

        def step(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            nonlocal state
            logits, state = self.decoder(torch.from_numpy(tokens)[:, None], state)
            weights = self.decoder.attention_weights
            assert weights is not None
            return logits[:, 0].numpy(), weights[:, 0].numpy()

        return seq2seq.greedy_decode(step, source.shape[0], num_steps)


def make_seq2seq(vocab_size: int, embed_size: int = 32, num_hiddens: int = 64, num_layers: int = 2,
                 dropout: float = 0.0) -> Seq2Seq:
    """A :class:`Seq2Seq` of an encoder and an attention decoder of the same sizes."""
    return Seq2Seq(Seq2SeqEncoder(vocab_size, embed_size, num_hiddens, num_layers, dropout),
                   Seq2SeqAttentionDecoder(vocab_size, embed_size, num_hiddens, num_layers, dropout))


def train_seq2seq(
    model: Seq2Seq | None = None,
    data: seq2seq.Seq2SeqData | None = None,
    *,
    steps: int = 200,
    batch_size: int = 64,
    lr: float = 0.005,
    clip: float = 1.0,
    seed: int = 0,
) -> tuple[Seq2Seq, list[float]]:
    """Trains as :mod:`examples.seq2seq` describes, with ``torch.optim.Adam``.

    ``seed`` goes to ``torch.manual_seed``; the model comes back in eval mode.
    """
    torch.manual_seed(seed)
    data = data or seq2seq.toy_task(2000, seed=seed)
    model = model or make_seq2seq(data.vocab_size)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    losses = []
    for index in seq2seq.minibatches(len(data), batch_size, steps, seed):
        batch = data.take(index)
        logits = model(*(torch.from_numpy(a) for a in
                         (batch.source, batch.source_lens, batch.decoder_inputs)))
        weights = torch.from_numpy(batch.loss_weights())
        per_token = F.cross_entropy(logits.transpose(1, 2), torch.from_numpy(batch.targets).long(),
                                    reduction="none")  # (B, T)
        loss = (per_token * weights).sum() / weights.sum()
        optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        losses.append(loss.item())
    model.eval()
    return model, losses


def main(argv: Sequence[str] | None = None) -> int:
    """Trains on the reversal task, decodes held-out sequences and prints how it went."""
    steps = seq2seq.steps_argument(argv)
    model, losses = train_seq2seq(steps=steps)
    test = seq2seq.toy_task(200, seed=1000)
    tokens, _ = model.predict(test.source, test.source_lens, test.targets.shape[1])
    print(seq2seq.report("PyTorch", losses, tokens, test))
    return 0


if __name__ == "__main__":
    sys.exit(main())
