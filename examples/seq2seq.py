"""The framework-free parts of the Bahdanau-attention example: toy data, masks and decoding.

The example trains a GRU encoder-decoder whose decoder attends, at every step, from its previous
state to the encoder's outputs (additive attention, masked by the source lengths). The task is
small enough to learn in a few hundred steps on a CPU: give back a sequence of random tokens
reversed (or copied).

Every sequence uses three special tokens: :data:`PAD` fills the rows up to a common length,
:data:`BOS` starts the decoder's input and :data:`EOS` ends the source and the target. A source
``a b c`` is stored as ``a b c <eos> <pad> ...`` with valid length 4; its reversed target is
``c b a <eos> <pad> ...`` (valid length 4), and the decoder is fed ``<bos> c b a <pad> ...``
during training (teacher forcing).

The frameworks' model code lives in ``examples/seq2seq_<framework>.py``; what they would
otherwise each repeat lives here, on NumPy arrays: the data, the weights of the masked loss, minibatch
indices, greedy decoding around a framework's decoder step, and the accuracy of a prediction.

Each of those scripts has ``train_seq2seq(model=None, data=None, *, steps=200, batch_size=64,
lr=0.005, clip=1.0, seed=0)``: ``steps`` minibatch steps of ``batch_size`` examples with teacher
forcing, Adam at rate ``lr`` and the global gradient norm clipped to ``clip``; the loss is
softmax cross-entropy averaged over the target tokens and ``<eos>``, padding masked out by the
target valid lengths (:func:`loss_weights`). ``model`` defaults to one for ``data.vocab_size``,
``data`` to ``toy_task(2000, seed=seed)`` (reversal); ``seed`` seeds the initial weights and the
batches. It returns the trained model and the loss of each step.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

#: Padding token: fills every row up to the batch's length; masked out of attention and loss.
PAD = 0
#: Beginning-of-sequence token: the decoder's first input.
BOS = 1
#: End-of-sequence token: closes every source and target.
EOS = 2
#: The first ordinary token; tokens ``FIRST_TOKEN .. vocab_size - 1`` carry the content.
FIRST_TOKEN = 3

#: The toy tasks: how a target is made from a source's tokens.
TASKS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "reverse": lambda tokens: tokens[::-1],
    "copy": lambda tokens: tokens,
}


@dataclass(frozen=True)
class Seq2SeqData:
    """Padded token arrays of a toy sequence-to-sequence task (all int32).

    Attributes:
        source: ``(N, S)`` source tokens, then ``<eos>``, then ``<pad>``.
        source_lens: ``(N,)`` valid lengths of the sources (tokens + ``<eos>``).
        decoder_inputs: ``(N, T)`` ``<bos>`` then the target tokens, then ``<pad>``: the decoder's
            input under teacher forcing.
        targets: ``(N, T)`` target tokens, then ``<eos>``, then ``<pad>``: what each step
            should predict.
        target_lens: ``(N,)`` valid lengths of the targets (tokens + ``<eos>``).
        vocab_size: Number of token ids, the special ones included.
    """

    source: np.ndarray
    source_lens: np.ndarray
    decoder_inputs: np.ndarray
    targets: np.ndarray
    target_lens: np.ndarray
    vocab_size: int

    def __len__(self) -> int:
        return int(self.source.shape[0])

    def take(self, index: np.ndarray | Sequence[int]) -> Seq2SeqData:
        """The examples at ``index`` (a minibatch), with the same padded lengths."""
        index = np.asarray(index)
        return Seq2SeqData(self.source[index], self.source_lens[index],
                           self.decoder_inputs[index], self.targets[index],
                           self.target_lens[index], self.vocab_size)

    def loss_weights(self) -> np.ndarray:
        """``(N, T)`` float32 weights of the masked loss: 1 on target tokens and ``<eos>``, 0 on padding."""
        return loss_weights(self.target_lens, self.targets.shape[1])


def pad(sequences: Sequence[Sequence[int]], length: int, value: int = PAD) -> np.ndarray:
    """Stacks integer sequences into an ``(N, length)`` int32 array, padding with ``value``.

    Raises:
        ValueError: A sequence is longer than ``length``.
    """
    out = np.full((len(sequences), length), value, dtype=np.int32)
    for i, seq in enumerate(sequences):
        if len(seq) > length:
            raise ValueError(f"sequence {i} has {len(seq)} tokens, more than length={length}")
        out[i, : len(seq)] = seq
    return out


def loss_weights(valid_lens: np.ndarray | Sequence[int], steps: int) -> np.ndarray:
    """``(N, steps)`` float32: 1 where ``t < valid_lens[n]``, else 0 (the masked loss's weights)."""
    lens = np.asarray(valid_lens)
    return (np.arange(steps)[None, :] < lens[:, None]).astype(np.float32)


def toy_task(
    n: int,
    vocab_size: int = 13,
    min_len: int = 3,
    max_len: int = 8,
    *,
    task: str = "reverse",
    seed: int = 0,
) -> Seq2SeqData:
    """Random sequences of ordinary tokens and their targets, padded to fixed lengths.

    Lengths are drawn uniformly from ``[min_len, max_len]``, tokens uniformly from
    ``FIRST_TOKEN .. vocab_size - 1``. Sources and targets are padded to ``max_len + 1`` (the
    longest sequence plus ``<eos>``), whatever the lengths drawn, so every batch has one shape.

    Args:
        n: Number of examples.
        vocab_size: Number of token ids, the three special ones included (at least 4).
        min_len: Shortest sequence, without ``<eos>`` (at least 1).
        max_len: Longest sequence, without ``<eos>``.
        task: ``"reverse"`` or ``"copy"``.
        seed: Seed of the lengths and tokens.
    """
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(map(repr, TASKS))}, got {task!r}")
    if vocab_size <= FIRST_TOKEN:
        raise ValueError(f"vocab_size must be > {FIRST_TOKEN} (the special tokens), got {vocab_size}")
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")
    rng = np.random.default_rng(seed)
    lengths = rng.integers(min_len, max_len + 1, n)
    tokens = [rng.integers(FIRST_TOKEN, vocab_size, int(length)) for length in lengths]
    targets = [TASKS[task](t) for t in tokens]
    width = max_len + 1
    lens = (lengths + 1).astype(np.int32)
    return Seq2SeqData(
        source=pad([[*t, EOS] for t in tokens], width),
        source_lens=lens,
        decoder_inputs=pad([[BOS, *t] for t in targets], width),
        targets=pad([[*t, EOS] for t in targets], width),
        target_lens=lens.copy(),
        vocab_size=vocab_size,
    )


def minibatches(n: int, batch_size: int, steps: int, seed: int = 0) -> Iterator[np.ndarray]:
    """Yields ``steps`` index arrays of ``batch_size`` examples out of ``n``, reshuffled each pass.

    Each pass over the data is a fresh permutation; a pass's last incomplete batch is dropped,
    so every batch has the same shape (one trace under ``tf.function`` / ``jax.jit``).
    """
    if not 0 < batch_size <= n:
        raise ValueError(f"batch_size must be in [1, n={n}], got {batch_size}")
    rng = np.random.default_rng(seed)
    done, began = 0, time.perf_counter()
    while True:
        order = rng.permutation(n)
        for start in range(0, n - batch_size + 1, batch_size):
            if done == steps:
                return
            yield order[start : start + batch_size]
            done += 1
            if SHOW_PROGRESS and (done % max(1, steps // 10) == 0 or done == steps):
                print(f"  training: step {done}/{steps}, {time.perf_counter() - began:.0f} s",
                      file=sys.stderr, flush=True)


#: Whether :func:`minibatches` reports its progress on stderr (a script's command line turns it
#: on: a training run takes from seconds to a minute).
SHOW_PROGRESS = False


def greedy_decode(
    step: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]],
    batch_size: int,
    num_steps: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Greedy decoding around a framework's decoder step.

    Starts every row from ``<bos>``, feeds each step's most likely token to the next step, and
    pads each row after its first ``<eos>``. All ``num_steps`` steps run, so the arrays returned
    have fixed shapes.

    Args:
        step: ``step(tokens)`` takes the ``(B,)`` int32 tokens of the previous step and returns
            the logits ``(B, vocab_size)`` of the next token and the attention weights of this
            step (any shape with B first, e.g. ``(B, S)``), as NumPy arrays. It carries the
            decoder's state between calls itself.
        batch_size: B.
        num_steps: Number of tokens to predict per row.

    Returns:
        ``tokens`` ``(B, num_steps)`` int32 (``<pad>`` after each row's ``<eos>``) and the
        attention weights of every step stacked on axis 1 (e.g. ``(B, num_steps, S)``).
    """
    tokens = np.full((batch_size,), BOS, dtype=np.int32)
    finished = np.zeros((batch_size,), dtype=bool)
    predicted, weights = [], []
    for _ in range(num_steps):
        logits, attention = step(tokens)
        tokens = np.asarray(np.argmax(logits, axis=-1), dtype=np.int32)
        predicted.append(np.where(finished, PAD, tokens))
        weights.append(np.asarray(attention))
        finished |= tokens == EOS
    return np.stack(predicted, axis=1), np.stack(weights, axis=1)


def token_accuracy(predicted: np.ndarray, data: Seq2SeqData) -> float:
    """Fraction of the target positions (tokens and ``<eos>``, not padding) predicted right.

    Args:
        predicted: ``(N, T')`` predicted tokens; a prediction shorter than the targets counts
            the missing positions as wrong.
        data: The examples the prediction is for.
    """
    scored = data.loss_weights() > 0
    steps = min(predicted.shape[1], data.targets.shape[1])
    right = np.zeros(data.targets.shape, dtype=bool)
    right[:, :steps] = predicted[:, :steps] == data.targets[:, :steps]
    return float(right[scored].mean())


def steps_argument(argv: Sequence[str] | None = None) -> int:
    """The ``--steps`` of a script's command line (default 200): how many training steps."""
    global SHOW_PROGRESS
    parser = argparse.ArgumentParser(description="Trains the seq2seq example, decodes held-out "
                                     "data and prints how it went, with the training's progress "
                                     "on stderr. Writes no file.")
    parser.add_argument("--steps", type=int, default=200, help="training steps (default: 200)")
    steps: int = parser.parse_args(argv).steps
    SHOW_PROGRESS = True
    return steps


def report(framework: str, losses: Sequence[float], predicted: np.ndarray, data: Seq2SeqData) -> str:
    """What a script's ``main`` prints after training and greedy decoding.

    Args:
        framework: The framework's name, for the first line.
        losses: The loss of each training step.
        predicted: ``(N, T')`` greedily decoded tokens of the held-out ``data``.
        data: The held-out examples.
    """
    first, last = float(np.mean(losses[:10])), float(np.mean(losses[-10:]))
    source = data.source[0, : int(data.source_lens[0])].tolist()
    decoded = predicted[0].tolist()
    return "\n".join([
        f"Seq2seq with Bahdanau attention in {framework}, {len(losses)} training steps",
        f"  loss, mean of the first 10 steps {first:.4f}, of the last 10 {last:.4f}",
        f"  held-out token accuracy {token_accuracy(predicted, data):.3f} ({len(data)} sequences)",
        f"  source {source} -> decoded {decoded}",
    ])


if __name__ == "__main__":
    from examples.__main__ import shared_main

    sys.exit(shared_main("seq2seq"))
