"""The encoder-decoder Transformer example: the parts no framework owns.

The task is :mod:`examples.seq2seq`'s reversal: sequences of 3 to 8 digits, given back in
reverse order. Tokens ``3 .. 12`` are the digits 0-9; ``<pad>``, ``<bos>`` and ``<eos>`` are
0, 1 and 2. A source ``4 0 7`` is stored as ``4 0 7 <eos> <pad> ...``, its target as
``7 0 4 <eos> <pad> ...``, and the decoder reads ``<bos> 7 0 4 <pad> ...`` in training.

The model is the library's ``Transformer`` of :data:`CONFIG` (2 blocks each side, width 32,
2 heads). Each framework's script trains it with its own autodiff and Adam:
``examples/transformer_torch.py``, ``examples/transformer_tensorflow.py`` and
``examples/transformer_jax.py``, each with ``train_transformer(data=None, *, steps=STEPS,
seed=0)``: ``steps`` minibatches of :data:`BATCH_SIZE`, the learning rate of
:func:`learning_rates` (linear warm-up, then a cosine decay to 0), the global gradient norm
clipped to :data:`CLIP`, the cross-entropy averaged over the target tokens and ``<eos>``.

What the scripts share lives here, on NumPy arrays: the data, the held-out set, the schedule,
greedy and beam search around a backend's encoder and cached decoder (:class:`Decoding`,
:func:`search`), the exact-match metric, the cross-attention picture and the report. Weights
move between frameworks as safetensors files: ``python -m examples.transformer_torch --save
w.safetensors`` trains and saves, ``python -m examples.transformer_decode w.safetensors
--backend mxnet`` decodes with them on any backend (:func:`from_weights`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

import attention_core as ac
from attention_core import registry
from attention_core.host import host_array
from attention_core.weights import subset
from examples import seq2seq
from examples.seq2seq import BOS, EOS, FIRST_TOKEN, PAD, Seq2SeqData


@dataclass(frozen=True)
class Config:
    """The sizes of the model (one vocabulary for sources and targets).

    Attributes:
        vocab_size: Token ids, the three special ones included.
        num_hiddens: h, the model width.
        ffn_num_hiddens: Width of the FFN hidden layers.
        num_heads: Heads of every attention.
        num_blks: Blocks of the encoder and of the decoder.
        dropout: Dropout rate in training.
        max_len: Rows of the sinusoidal table: the longest source or target.
    """

    vocab_size: int = 13
    num_hiddens: int = 32
    ffn_num_hiddens: int = 64
    num_heads: int = 2
    num_blks: int = 2
    dropout: float = 0.0
    max_len: int = 16

    def transformer(self) -> dict[str, Any]:
        """The arguments of ``Transformer(...)`` on any backend."""
        sizes = asdict(self)
        vocab = sizes.pop("vocab_size")
        return {"src_vocab_size": vocab, "tgt_vocab_size": vocab, **sizes}

    def stack(self) -> dict[str, Any]:
        """The arguments of ``TransformerEncoder(...)`` and ``TransformerDecoder(...)``."""
        return asdict(self)


#: The example's model.
CONFIG = Config()
#: Training: minibatch steps, examples per step, peak learning rate, warm-up steps, gradient
#: norm bound, and the number of training sequences.
STEPS, BATCH_SIZE, LEARNING_RATE, WARMUP, CLIP, TRAIN_SIZE = 400, 64, 0.005, 50, 1.0, 4000
#: Beams of the beam search, and its length penalty (``log P / L ** a``).
BEAM_SIZE, LENGTH_PENALTY = 4, 0.75
#: The held-out draw: sequences drawn with this seed, less those in the training data.
HELD_OUT_SIZE, HELD_OUT_SEED = 500, 1000
#: Weights trained once by ``python -m examples.transformer_torch --save <this file>`` (seed 0,
#: 400 steps); the tests decode with them on every backend.
TRAINED_WEIGHTS = Path(__file__).resolve().parents[1] / "tests/fixtures/transformer_reverse.safetensors"


# -- data and training --------------------------------------------------------------------------


def training_data(seed: int = 0) -> Seq2SeqData:
    """The :data:`TRAIN_SIZE` training sequences of seed ``seed`` (reversal, lengths 3-8)."""
    return seq2seq.toy_task(TRAIN_SIZE, CONFIG.vocab_size, seed=seed)


def held_out(train: Seq2SeqData) -> Seq2SeqData:
    """:data:`HELD_OUT_SIZE` fresh sequences, less those whose source is in ``train``."""
    test = seq2seq.toy_task(HELD_OUT_SIZE, CONFIG.vocab_size, seed=HELD_OUT_SEED)
    seen = {row.tobytes() for row in train.source}
    return test.take([i for i, row in enumerate(test.source) if row.tobytes() not in seen])


def learning_rates(steps: int, peak: float = LEARNING_RATE, warmup: int = WARMUP) -> np.ndarray:
    """The learning rate of each of ``steps`` steps, as float32.

    A linear warm-up, ``peak * (s + 1) / warmup``, reaches ``peak`` at step ``warmup - 1``;
    then a cosine decay, ``peak * (1 + cos(pi * p)) / 2`` with ``p = (s + 1 - warmup) /
    (steps + 1 - warmup)``, would reach 0 one step after the last.
    """
    s = np.arange(steps)
    progress = np.clip((s + 1 - warmup) / (steps + 1 - warmup), 0.0, 1.0)
    rates = peak * np.minimum((s + 1) / warmup, 1.0) * 0.5 * (1 + np.cos(np.pi * progress))
    return rates.astype(np.float32)


def batches(data: Seq2SeqData, steps: int, seed: int = 0) -> Iterator[tuple[Seq2SeqData, float]]:
    """The ``steps`` minibatches of :data:`BATCH_SIZE` (reshuffled each pass), each with its rate."""
    indices = seq2seq.minibatches(len(data), BATCH_SIZE, steps, seed)
    for index, rate in zip(indices, learning_rates(steps), strict=True):
        yield data.take(index), float(rate)


# -- decoding on a backend ----------------------------------------------------------------------


class Decoding:
    """A backend's encoder and decoder, called as the stateful layers are called.

    ``encoder(tokens, valid_lens)`` gives the encoder outputs; ``decoder(tokens, enc_outputs,
    enc_valid_lens, capacity=C)`` the logits and a new cache, and ``decoder(tokens, None,
    enc_valid_lens, cache=cache, start=t)`` the next position's. Flax's modules are applied
    instead (``examples.transformer_jax.FlaxDecoding`` overrides the calls).

    Args:
        backend: The backend's name (its ops convert the NumPy inputs).
        encoder: A ``TransformerEncoder`` of :data:`CONFIG`, holding its weights.
        decoder: A ``TransformerDecoder`` of :data:`CONFIG`, holding its weights.
        context: Made around every search and pass (torch: ``torch.no_grad``).
    """

    def __init__(self, backend: str, encoder: Any, decoder: Any,
                 context: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext) -> None:
        self.ops = registry.get_ops(backend)
        self.encoder, self.decoder, self.context = encoder, decoder, context

    def encode(self, source: np.ndarray, source_lens: np.ndarray) -> tuple[Any, Any]:
        """The encoder outputs ``(B, S, h)`` and the lengths, as the backend's arrays."""
        lens = self.ops.from_numpy(np.asarray(source_lens, np.int32))
        return self.call_encoder(self.ops.from_numpy(np.asarray(source, np.int32)), lens), lens

    def call_encoder(self, tokens: Any, valid_lens: Any) -> Any:
        """``encoder(tokens, valid_lens)``."""
        return self.encoder(tokens, valid_lens)

    def decode(self, tokens: Any, enc_outputs: Any, enc_valid_lens: Any, **cached: Any) -> Any:
        """``decoder(tokens, enc_outputs, enc_valid_lens, **cached)``: logits, and a cache if asked."""
        return self.decoder(tokens, enc_outputs, enc_valid_lens, **cached)

    def kept_cross_attention(self) -> list[Any]:
        """The last decoder call's cross-attention weights, one ``(B, H, T, S)`` array per block."""
        kept: list[Any] = self.decoder.attention_weights[1]
        return kept


def from_weights(backend: str, weights: Mapping[str, np.ndarray]) -> Decoding:
    """A :class:`Decoding` of ``backend``'s layers holding canonical ``Transformer`` weights.

    Args:
        backend: Any backend's name; ``"jax"`` gives ``examples.transformer_jax.FlaxDecoding``.
        weights: ``encoder.*`` and ``decoder.*`` (e.g. ``attention_core.load_weights(path)``).
    """
    if backend == "jax":  # Flax modules hold no weights: the jax example applies them
        decoding: Decoding = importlib.import_module("examples.transformer_jax").FlaxDecoding(weights)
        return decoding
    module = registry.load(backend)
    encoder = module.TransformerEncoder(**CONFIG.stack())
    decoder = module.TransformerDecoder(**CONFIG.stack())
    for layer, prefix in ((encoder, "encoder"), (decoder, "decoder")):
        layer.set_weights(subset(weights, prefix))
    return Decoding(backend, encoder, decoder)


def search(decoding: Decoding, source: np.ndarray, source_lens: np.ndarray, *,
           beam_size: int = 1) -> ac.Generated:
    """Greedy search (``beam_size=1``) or beam search, each step one cached decoder call.

    Args:
        decoding: The backend's encoder and decoder.
        source: ``(B, S)`` source tokens; up to S tokens (``<eos>`` included) are generated.
        source_lens: ``(B,)`` their valid lengths.
        beam_size: Beams per example (:data:`LENGTH_PENALTY` ranks the finished ones).
    """
    with decoding.context():
        enc_outputs, lens = decoding.encode(source, source_lens)
        if beam_size > 1:
            enc_outputs, lens = ac.repeat_rows(enc_outputs, beam_size), ac.repeat_rows(lens, beam_size)
        steps = np.shape(source)[1]

        def step(tokens: Any, cache: Any, start: int) -> tuple[Any, Any]:
            if cache is None:  # the first call makes the caches
                return decoding.decode(tokens, enc_outputs, lens, capacity=steps)
            return decoding.decode(tokens, None, lens, cache=cache, start=start)

        bos = decoding.ops.from_numpy(np.full(len(source), BOS, np.int32))
        if beam_size == 1:
            return ac.greedy_search(step, bos, steps, eos=EOS)
        return ac.beam_search(step, bos, steps, beam_size=beam_size, eos=EOS,
                              length_penalty=LENGTH_PENALTY)


def padded(generated: ac.Generated, width: int) -> np.ndarray:
    """``(B, width)`` int32 tokens: each sequence up to its first ``<eos>``, then ``<pad>``."""
    tokens = np.full((generated.tokens.shape[0], width), PAD, np.int32)
    steps = min(width, generated.tokens.shape[1])
    kept = np.arange(steps)[None, :] < generated.lengths[:, None]
    tokens[:, :steps] = np.where(kept, generated.tokens[:, :steps], PAD)
    return tokens


def exact_match(generated: ac.Generated, data: Seq2SeqData) -> np.ndarray:
    """``(B,)`` bool: the sequence generated is the target, ``<eos>`` included, and no more."""
    return np.asarray((padded(generated, data.targets.shape[1]) == data.targets).all(axis=1))


def cross_attention(decoding: Decoding, source: np.ndarray, source_lens: np.ndarray,
                    generated: ac.Generated) -> list[np.ndarray]:
    """The cross-attention weights that produced ``generated``, one ``(B, H, T, S)`` per block.

    One full (uncached) decoder pass over ``<bos>`` and the generated tokens, T = S, whose
    logits equal the cached steps' (tests/test_cache.py).
    """
    inputs = np.concatenate([np.full((len(source), 1), BOS, np.int32),
                             padded(generated, np.shape(source)[1] - 1)], axis=1)
    with decoding.context():
        enc_outputs, lens = decoding.encode(source, source_lens)
        decoding.decode(decoding.ops.from_numpy(inputs), enc_outputs, lens)
        return [np.asarray(host_array(w), np.float64) for w in decoding.kept_cross_attention()]


# -- reading the results ------------------------------------------------------------------------


def token_names(tokens: Sequence[int] | np.ndarray) -> list[str]:
    """Digits for ordinary tokens, ``<pad>``, ``<bos>`` and ``<eos>`` for the special ones."""
    special = {PAD: "<pad>", BOS: "<bos>", EOS: "<eos>"}
    return [special.get(int(t), str(int(t) - FIRST_TOKEN)) for t in tokens]


def plot_cross_attention(weights: np.ndarray, source: np.ndarray, generated: np.ndarray,
                         path: str | Path) -> None:
    """Saves the heatmaps of one example's cross-attention weights, one panel per head.

    Args:
        weights: ``(H, T, S)`` of one block.
        source: ``(S,)`` the source tokens (padding included: its columns are 0).
        generated: ``(T,)`` the tokens generated at the T decoder positions.
        path: The PNG file to write.
    """
    from attention_core import plot

    heads = weights.shape[0]
    fig = plot.show_heatmaps(weights[None], "source", "generated",
                             titles=[f"head {h + 1}" for h in range(heads)],
                             figsize=(2.6 * heads + 1.2, 3.0), colorbar_label="attention weight")
    fig.suptitle("Cross-attention of the last decoder block")
    for ax in fig.axes[:heads]:  # the panels, then the colour bar
        ax.set_xticks(range(len(source)), token_names(source))
        ax.set_yticks(range(len(generated)), token_names(generated))
        ax.tick_params(axis="x", labelrotation=90)
    fig.savefig(path)


def plot_example(decoding: Decoding, data: Seq2SeqData, generated: ac.Generated, index: int,
                 path: str | Path) -> None:
    """Plots the cross-attention of the last decoder block on example ``index`` of ``data``.

    Args:
        decoding: The backend's encoder and decoder.
        data: The examples.
        generated: What the search generated for them.
        index: The example to draw.
        path: The PNG file to write (see :func:`plot_cross_attention`).
    """
    one = data.take([index])
    chosen = ac.Generated(*(part[index : index + 1] for part in generated))
    last = cross_attention(decoding, one.source, one.source_lens, chosen)[-1][0]
    length = int(chosen.lengths[0])
    plot_cross_attention(last[:, :length], one.source[0], padded(chosen, length)[0], path)


def report(framework: str, data: Seq2SeqData, greedy: ac.Generated, beam: ac.Generated,
           beam_size: int = BEAM_SIZE) -> list[str]:
    """The decoding lines of a script's report: exact match of both searches, one example."""
    source = data.source[0, : int(data.source_lens[0]) - 1]
    decoded = padded(greedy, data.targets.shape[1])[0, : int(greedy.lengths[0]) - 1]
    return [
        f"  {framework}, held-out exact match ({len(data)} sequences): greedy "
        f"{exact_match(greedy, data).mean():.3f}, beam search ({beam_size} beams) "
        f"{exact_match(beam, data).mean():.3f}",
        f"  source {' '.join(token_names(source))} -> greedy {' '.join(token_names(decoded))}",
    ]


def training_report(framework: str, losses: Sequence[float], seconds: float) -> list[str]:
    """The training lines of a script's report: steps, time, and the loss at both ends."""
    first, last = float(np.mean(losses[:10])), float(np.mean(losses[-10:]))
    return [
        f"Transformer (encoder-decoder) in {framework}: {len(losses)} training steps in {seconds:.1f} s",
        f"  loss, mean of the first 10 steps {first:.4f}, of the last 10 {last:.4f}",
    ]


# -- the scripts ------------------------------------------------------------------------------


def arguments(argv: Sequence[str] | None, *, trains: bool) -> argparse.Namespace:
    """A script's command line: training options (``trains``) or the weights file to decode with."""
    parser = argparse.ArgumentParser(description="Trains the encoder-decoder Transformer to reverse "
                                     "sequences and decodes held-out ones" if trains else
                                     "Decodes held-out sequences with saved Transformer weights")
    if trains:
        seq2seq.SHOW_PROGRESS = True  # the training's progress on stderr
        parser.add_argument("--steps", type=int, default=STEPS, help=f"training steps (default {STEPS})")
        parser.add_argument("--save", metavar="FILE", help="save the trained weights (safetensors) "
                            "to FILE")
    else:
        parser.add_argument("weights", nargs="?", default=str(TRAINED_WEIGHTS),
                            help="a safetensors file of the example's Transformer weights (default: "
                            "the tests' tests/fixtures/transformer_reverse.safetensors)")
        parser.add_argument("--backend", default="numpy", choices=registry.BACKENDS,
                            help="the backend that decodes (default numpy)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the training data and weights; its sequences are not held out")
    parser.add_argument("--beam", type=int, default=BEAM_SIZE, help=f"beam size (default {BEAM_SIZE})")
    parser.add_argument("--plot", metavar="PNG", help="draw the cross-attention of one held-out "
                        "example into the file PNG (needs matplotlib); no file is written without "
                        "--plot or --save")
    parser.add_argument("--example", type=int, default=0, help="the held-out example to draw")
    return parser.parse_args(argv)


def evaluate(framework: str, decoding: Decoding, args: argparse.Namespace) -> list[str]:
    """Decodes the held-out set of ``args.seed`` both ways, plots if asked; the report's lines."""
    test = held_out(training_data(args.seed))
    greedy = search(decoding, test.source, test.source_lens)
    beam = search(decoding, test.source, test.source_lens, beam_size=args.beam)
    lines = report(framework, test, greedy, beam, args.beam)
    if args.plot:
        plot_example(decoding, test, greedy, args.example, args.plot)
        lines.append(f"  wrote {Path(args.plot).resolve()}: the cross-attention of held-out "
                     f"example {args.example}")
    return lines


def run_script(framework: str, argv: Sequence[str] | None, train: Callable[..., tuple[Any, ...]],
               decoding: Callable[[Any], Decoding]) -> int:
    """A training script's ``main``: trains, prints the report, saves the weights if asked.

    Args:
        framework: The framework's name, for the report.
        argv: The command line (:func:`arguments`).
        train: ``train_transformer``: called with ``steps=`` and ``seed=``, it returns what was
            trained (a model, or Flax params) and the losses, last.
        decoding: Makes the :class:`Decoding` of what was trained.
    """
    args = arguments(argv, trains=True)
    start = time.perf_counter()
    *_, trained, losses = train(steps=args.steps, seed=args.seed)
    lines = training_report(framework, losses, time.perf_counter() - start)
    print("\n".join(lines + evaluate(framework, decoding(trained), args)))
    if args.save:
        ac.save_weights(args.save, trained)
        print(f"  wrote {Path(args.save).resolve()}: the trained weights")
    return 0


if __name__ == "__main__":
    from examples.__main__ import shared_main

    sys.exit(shared_main("transformer"))
