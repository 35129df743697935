"""The Bahdanau-attention seq2seq example in Keras 3 (TensorFlow): a GRU encoder-decoder that attends.

It trains with ``tf.GradientTape`` and ``keras.optimizers.Adam``, the train step under
``tf.function``. The data, the masks of the loss and greedy decoding are the framework-free ones
of :mod:`examples.seq2seq`. Run from the repository root: ``python -m examples.seq2seq_tensorflow``
(trains 200 steps and decodes held-out sequences).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from backends.tensorflow import AdditiveAttention
from examples import seq2seq


class _BuiltByCall:
    """Mixin: no symbolic build; the sublayers create their weights on the first call.

    Without a ``build`` of its own, a Keras layer with sublayers is first traced on symbolic
    inputs to build them, which for the step-by-step decoder costs seconds. Call such a model
    once eagerly before tracing it (``tf.function`` creates no variables after its first trace).
    """

    def build(self, input_shape: Any) -> None:
        """Nothing to create here."""


class StackedGRU(_BuiltByCall, keras.layers.Layer):
    """``num_layers`` ``keras.layers.GRU`` s on top of each other, dropout between them.

    Called on a sequence ``(B, T, in)``; returns the top layer's outputs ``(B, T, h)`` and the
    final state ``(layers, B, h)``, the layout of ``torch.nn.GRU``.
    """

    def __init__(self, num_hiddens: int, num_layers: int, dropout: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.grus = [keras.layers.GRU(num_hiddens, return_sequences=True, return_state=True)
                     for _ in range(num_layers)]
        self.dropout = keras.layers.Dropout(dropout)

    def call(self, X: Any, training: bool | None = None) -> tuple[Any, Any]:
        """Runs the stacked GRUs over ``X (B, T, in)``; the top outputs and the final state."""
        states = []
        for i, gru in enumerate(self.grus):
            if i:
                X = self.dropout(X, training=training)
            X, last = gru(X, training=training)
            states.append(last)
        return X, tf.stack(states)


class StackedGRUCell(_BuiltByCall, keras.layers.Layer):
    """One step of ``num_layers`` ``keras.layers.GRUCell`` s, dropout between them.

    The decoder steps one token at a time; a cell is what a ``keras.layers.GRU`` runs at each
    step, without the loop around it (much cheaper to trace than a GRU layer per step).
    Called on ``(B, in)`` and a state ``(layers, B, h)``; returns the top output ``(B, h)`` and
    the new state ``(layers, B, h)``.
    """

    def __init__(self, num_hiddens: int, num_layers: int, dropout: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.cells = [keras.layers.GRUCell(num_hiddens) for _ in range(num_layers)]
        self.dropout = keras.layers.Dropout(dropout)

    def call(self, x: Any, state: Any, training: bool | None = None) -> tuple[Any, Any]:
        """One step of every cell on ``x (B, in)``; the top output and the new state."""
        states = []
        for i, cell in enumerate(self.cells):
            if i:
                x = self.dropout(x, training=training)
            x, new = cell(x, [state[i]], training=training)
            states.append(new[0])
        return x, tf.stack(states)


class Seq2SeqEncoder(_BuiltByCall, keras.layers.Layer):
    """Token embedding and stacked ``keras.layers.GRU`` s.

    Args:
        vocab_size: Number of token ids.
        embed_size: Width of the embedding.
        num_hiddens: Width h of the GRUs.
        num_layers: Number of stacked GRU layers.
        dropout: Dropout between the GRU layers, in training.
        **kwargs: Passed to ``keras.layers.Layer``.
    """

    def __init__(self, vocab_size: int, embed_size: int, num_hiddens: int, num_layers: int,
                 dropout: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.embedding = keras.layers.Embedding(vocab_size, embed_size)
        self.rnn = StackedGRU(num_hiddens, num_layers, dropout)

    def call(self, X: Any, training: bool | None = None) -> tuple[Any, Any]:
        """Runs the stacked GRUs over ``X (B, T, in)``; the top outputs and the final state."""
        """Encodes tokens ``X (B, S)``; returns the outputs ``(B, S, h)`` and state ``(layers, B, h)``."""
        return self.rnn(self.embedding(X), training=training)


class Seq2SeqAttentionDecoder(_BuiltByCall, keras.layers.Layer):
    """A GRU decoder that attends to the encoder's outputs at every step (Bahdanau attention).

    At step t the query is the top layer of the previous state ``(B, 1, h)``; keys and values are
    the encoder outputs, masked beyond each source's valid length. The context ``(B, 1, h)`` is
    concatenated with the embedded input token and fed to the stacked GRU cells.

    Args:
        vocab_size: Number of token ids.
        embed_size: Width of the embedding.
        num_hiddens: Width h of the GRUs (and of the encoder's, which it attends to).
        num_layers: Number of stacked GRU layers.
        dropout: Dropout of the attention weights and between the GRU layers, in training.
        **kwargs: Passed to ``keras.layers.Layer``.

    Attributes:
        attention_weights: The last call's attention weights ``(B, steps, S)``.
    """

    def __init__(self, vocab_size: int, embed_size: int, num_hiddens: int, num_layers: int,
                 dropout: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.attention = AdditiveAttention(num_hiddens, dropout)
        self.embedding = keras.layers.Embedding(vocab_size, embed_size)
        self.rnn = StackedGRUCell(num_hiddens, num_layers, dropout)
        self.dense = keras.layers.Dense(vocab_size)
        self.attention_weights: Any = None

    def init_state(self, encoded: tuple[Any, Any], source_lens: Any) -> tuple[Any, Any, Any]:
        """The state of the first step: the encoder's outputs and final state, and the lengths."""
        outputs, state = encoded
        return outputs, state, source_lens

    def call(self, X: Any, state: tuple[Any, Any, Any],
             training: bool | None = None) -> tuple[Any, tuple[Any, Any, Any]]:
        """Decodes input tokens ``X (B, steps)``; returns logits ``(B, steps, vocab)`` and the state."""
        enc_outputs, hidden, source_lens = state
        embedded = self.embedding(X)  # (B, steps, e)
        outputs, weights = [], []
        for t in range(X.shape[1]):
            query = hidden[-1][:, None]  # (B, 1, h)
            context, attn = self.attention(query, enc_outputs, enc_outputs, source_lens,
                                           return_attention=True, training=training)
            out, hidden = self.rnn(tf.concat([context[:, 0], embedded[:, t]], axis=-1), hidden,
                                   training=training)
            outputs.append(out)
            weights.append(attn[:, 0, 0])  # (B, S)
        self.attention_weights = tf.stack(weights, axis=1)
        return self.dense(tf.stack(outputs, axis=1)), (enc_outputs, hidden, source_lens)


class Seq2Seq(_BuiltByCall, keras.Model):
    """An encoder-decoder: teacher forcing in ``call``, greedy decoding in :meth:`translate`."""

    def __init__(self, encoder: Seq2SeqEncoder, decoder: Seq2SeqAttentionDecoder, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.encoder, self.decoder = encoder, decoder

    def call(self, inputs: tuple[Any, Any, Any], training: bool | None = None) -> Any:
        """Logits ``(B, T, vocab)`` from ``(source, source_lens, decoder_inputs)`` (teacher forcing)."""
        source, source_lens, decoder_inputs = inputs
        state = self.decoder.init_state(self.encoder(source, training=training), source_lens)
        return self.decoder(decoder_inputs, state, training=training)[0]

    def translate(self, source: Any, source_lens: Any, num_steps: int) -> tuple[np.ndarray, np.ndarray]:
        """Greedy decoding of ``num_steps`` tokens per source (``predict`` is Keras' own).

        Returns:
            The tokens ``(B, num_steps)`` (``<pad>`` after ``<eos>``) and the attention weights
            ``(B, num_steps, S)``, as NumPy arrays.
        """
        source, source_lens = tf.constant(source), tf.constant(source_lens)
        state = self.decoder.init_state(self.encoder(source), source_lens)

        def step(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            nonlocal state
            logits, state = self.decoder(tf.constant(tokens)[:, None], state)
            return logits[:, 0].numpy(), self.decoder.attention_weights[:, 0].numpy()

        return seq2seq.greedy_decode(step, int(source.shape[0]), num_steps)


def make_seq2seq(vocab_size: int, embed_size: int = 32, num_hiddens: int = 64, num_layers: int = 2,
                 dropout: float = 0.0) -> Seq2Seq:
    """A :class:`Seq2Seq` of an encoder and an attention decoder of the same sizes."""
    return Seq2Seq(Seq2SeqEncoder(vocab_size, embed_size, num_hiddens, num_layers, dropout),
                   Seq2SeqAttentionDecoder(vocab_size, embed_size, num_hiddens, num_layers, dropout))


def masked_train_step(model: keras.Layer, optimizer: keras.optimizers.Optimizer,
                      forward: Callable[..., Any]) -> Callable[..., Any]:
    """A ``tf.function`` train step: ``step(*inputs, targets, weights)`` returns the loss.

    The loss is the softmax cross-entropy of the logits ``forward(*inputs)`` ``(B, T, V)``
    against ``targets`` ``(B, T)``, averaged with ``weights`` ``(B, T)`` (0 on padding); the
    optimizer applies its gradients to ``model.trainable_variables``, read when the step is
    traced (call the model once eagerly before, to create them).
    """
    cross_entropy = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")

    def train_step(*batch: Any) -> Any:
        *inputs, targets, weights = batch
        with tf.GradientTape() as tape:
            logits = forward(*inputs)
            loss = cross_entropy(targets, logits, sample_weight=weights) / tf.reduce_sum(weights)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    return tf.function(train_step)


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
    """Trains as :mod:`examples.seq2seq` describes, with ``keras.optimizers.Adam``.

    Clipping is Adam's ``global_clipnorm``, the padding mask the loss's ``sample_weight``, and
    ``seed`` goes to ``keras.utils.set_random_seed``.
    """
    keras.utils.set_random_seed(seed)
    data = data or seq2seq.toy_task(2000, seed=seed)
    model = model or make_seq2seq(data.vocab_size)
    optimizer = keras.optimizers.Adam(learning_rate=lr, global_clipnorm=clip)
    compiled_step = masked_train_step(model, optimizer, lambda *inputs: model(inputs, training=True))
    losses = []
    for i, index in enumerate(seq2seq.minibatches(len(data), batch_size, steps, seed)):
        batch = data.take(index)
        arrays = (batch.source, batch.source_lens, batch.decoder_inputs, batch.targets)
        if i == 0:  # create the weights eagerly, before tracing the step
            model(arrays[:3])
            optimizer.build(model.trainable_variables)
        losses.append(float(compiled_step(*arrays, batch.loss_weights())))
    return model, losses


def main(argv: Sequence[str] | None = None) -> int:
    """Trains on the reversal task, decodes held-out sequences and prints how it went."""
    steps = seq2seq.steps_argument(argv)
    model, losses = train_seq2seq(steps=steps)
    test = seq2seq.toy_task(200, seed=1000)
    tokens, _ = model.translate(test.source, test.source_lens, test.targets.shape[1])
    print(seq2seq.report("TensorFlow/Keras", losses, tokens, test))
    return 0


if __name__ == "__main__":
    sys.exit(main())
