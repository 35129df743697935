"""The Bahdanau-attention seq2seq example in JAX/Flax: a GRU encoder-decoder that attends.

Parameters are Flax params pytrees, gradients come from ``jax.value_and_grad`` and updates from
optax; every train step is one ``jax.jit``-compiled function. The data, the masks of the loss and
greedy decoding are the framework-free ones of :mod:`examples.seq2seq`. Run from the repository
root: ``python -m examples.seq2seq_jax`` (trains 200 steps and decodes held-out sequences).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax  # type: ignore[import-untyped]

from backends.jax import AdditiveAttention
from examples import seq2seq

Params = Any


class StackedGRUCell(nn.Module):
    """One step of ``num_layers`` ``flax.linen.GRUCell`` s, dropout between them.

    Called on ``(B, in)`` and a state ``(layers, B, h)``; returns the new state and the top
    output ``(B, h)``.

    Attributes:
        num_hiddens: Width h of every cell.
        num_layers: Number of stacked cells.
        dropout: Dropout between the cells when ``training=True`` (``'dropout'`` rng).
    """

    num_hiddens: int
    num_layers: int
    dropout: float = 0.0

    @nn.compact
    def __call__(self, state: jax.Array, x: jax.Array, training: bool = False) -> tuple[jax.Array, jax.Array]:
        """One step of every cell on ``x (B, in)``; the new state and the top output."""
        states = []
        for i in range(self.num_layers):
            if i:
                x = nn.Dropout(self.dropout, deterministic=not training)(x)
            new, x = nn.GRUCell(self.num_hiddens, name=f"cell_{i}")(state[i], x)
            states.append(new)
        return jnp.stack(states), x


class Seq2SeqEncoder(nn.Module):
    """Token embedding and stacked GRUs (``flax.linen.RNN`` over ``GRUCell`` s).

    Attributes:
        vocab_size: Number of token ids.
        embed_size: Width of the embedding.
        num_hiddens: Width h of the GRUs.
        num_layers: Number of stacked GRU layers.
        dropout: Dropout between the GRU layers when ``training=True``.
    """

    vocab_size: int
    embed_size: int
    num_hiddens: int
    num_layers: int
    dropout: float = 0.0

    @nn.compact
    def __call__(self, X: jax.Array, training: bool = False) -> tuple[jax.Array, jax.Array]:
        """Encodes tokens ``X (B, S)``; returns the outputs ``(B, S, h)`` and state ``(layers, B, h)``."""
        outputs = nn.Embed(self.vocab_size, self.embed_size)(X)
        states = []
        for i in range(self.num_layers):
            if i:
                outputs = nn.Dropout(self.dropout, deterministic=not training)(outputs)
            last, outputs = nn.RNN(nn.GRUCell(self.num_hiddens), return_carry=True)(outputs)
            states.append(last)
        return outputs, jnp.stack(states)


#: What the decoder carries between steps: encoder outputs, GRU state, source valid lengths.
DecoderState = tuple[jax.Array, jax.Array, jax.Array]


class Seq2SeqAttentionDecoder(nn.Module):
    """A GRU decoder that attends to the encoder's outputs at every step (Bahdanau attention).

    At step t the query is the top layer of the previous state ``(B, 1, h)``; keys and values are
    the encoder outputs, masked beyond each source's valid length. The context ``(B, 1, h)`` is
    concatenated with the embedded input token and fed to the stacked GRU cells. The attention
    weights ``(B, steps, S)`` are sown into ``'intermediates'`` as ``attention_weights``.

    Attributes:
        vocab_size: Number of token ids.
        embed_size: Width of the embedding.
        num_hiddens: Width h of the GRUs (and of the encoder's, which it attends to).
        num_layers: Number of stacked GRU layers.
        dropout: Dropout of the attention weights and between the GRU layers when ``training=True``.
    """

    vocab_size: int
    embed_size: int
    num_hiddens: int
    num_layers: int
    dropout: float = 0.0

    @nn.compact
    def __call__(self, X: jax.Array, state: DecoderState,
                 training: bool = False) -> tuple[jax.Array, DecoderState]:
        """Decodes input tokens ``X (B, steps)``; returns logits ``(B, steps, vocab)`` and the state."""
        enc_outputs, hidden, source_lens = state
        attention = AdditiveAttention(self.num_hiddens, self.dropout)
        rnn = StackedGRUCell(self.num_hiddens, self.num_layers, self.dropout)
        embedded = nn.Embed(self.vocab_size, self.embed_size)(X)  # (B, steps, e)
        outputs, weights = [], []
        for t in range(X.shape[1]):
            query = hidden[-1][:, None]  # (B, 1, h)
            context, attn = attention(query, enc_outputs, enc_outputs, source_lens,
                                      return_attention=True, training=training)
            hidden, out = rnn(hidden, jnp.concatenate([context[:, 0], embedded[:, t]], axis=-1),
                              training=training)
            outputs.append(out)
            weights.append(attn[:, 0, 0])  # (B, S)
        self.sow("intermediates", "attention_weights", jnp.stack(weights, axis=1))
        logits = nn.Dense(self.vocab_size)(jnp.stack(outputs, axis=1))
        return logits, (enc_outputs, hidden, source_lens)


class Seq2Seq(nn.Module):
    """An encoder-decoder: ``__call__`` with teacher forcing; :meth:`encode` and :meth:`decode` for decoding.

    Attributes:
        vocab_size: Number of token ids.
        embed_size: Width of the embeddings.
        num_hiddens: Width h of the GRUs.
        num_layers: Number of stacked GRU layers.
        dropout: Dropout rate when ``training=True``.
    """

    vocab_size: int
    embed_size: int = 32
    num_hiddens: int = 64
    num_layers: int = 2
    dropout: float = 0.0

    def setup(self) -> None:
        """Makes the encoder and the attention decoder of the same sizes."""
        sizes = (self.vocab_size, self.embed_size, self.num_hiddens, self.num_layers, self.dropout)
        self.encoder = Seq2SeqEncoder(*sizes)
        self.decoder = Seq2SeqAttentionDecoder(*sizes)

    def __call__(self, source: jax.Array, source_lens: jax.Array, decoder_inputs: jax.Array,
                 training: bool = False) -> jax.Array:
        """Logits ``(B, T, vocab)`` for every target position, given the right previous tokens."""
        state = self.encode(source, source_lens, training)
        return self.decoder(decoder_inputs, state, training)[0]

    def encode(self, source: jax.Array, source_lens: jax.Array, training: bool = False) -> DecoderState:
        """The decoder's first state: encoder outputs and final state, and the source lengths."""
        outputs, hidden = self.encoder(source, training)
        return outputs, hidden, source_lens

    def decode(self, tokens: jax.Array, state: DecoderState) -> tuple[jax.Array, jax.Array, DecoderState]:
        """One greedy step: logits ``(B, vocab)`` and attention ``(B, S)`` for tokens ``(B,)``."""
        logits, state = self.decoder(tokens[:, None], state)
        (weights,) = self.decoder.variables["intermediates"]["attention_weights"][-1:]
        return logits[:, 0], weights[:, 0], state


def translate(model: Seq2Seq, params: Params, source: Any, source_lens: Any,
              num_steps: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy decoding of ``num_steps`` tokens per source.

    Returns:
        The tokens ``(B, num_steps)`` (``<pad>`` after ``<eos>``) and the attention weights
        ``(B, num_steps, S)``, as NumPy arrays.
    """
    variables = {"params": params}
    state = jax.jit(lambda s, n: model.apply(variables, s, n, method=Seq2Seq.encode))(
        jnp.asarray(source), jnp.asarray(source_lens))

    @jax.jit
    def decode(tokens: jax.Array, state: DecoderState) -> tuple[jax.Array, jax.Array, DecoderState]:
        out, _ = model.apply(variables, tokens, state, method=Seq2Seq.decode, mutable=["intermediates"])
        return out

    def step(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        nonlocal state
        logits, weights, state = decode(jnp.asarray(tokens), state)
        return np.asarray(logits), np.asarray(weights)

    return seq2seq.greedy_decode(step, int(np.shape(source)[0]), num_steps)


#: A jitted train step: ``(params, opt_state, batch, key) -> (params, opt_state, loss)``.
TrainStep = Callable[[Params, Any, tuple[Any, ...], jax.Array], tuple[Params, Any, jax.Array]]


def masked_train_step(model: nn.Module, optimizer: Any) -> TrainStep:
    """The jitted train step of ``model`` with an optax ``optimizer``.

    ``batch`` is the model's inputs, then the targets ``(B, T)`` and the loss weights
    ``(B, T)`` (0 on padding). The loss is the softmax cross-entropy of the logits
    ``model.apply(params, *inputs, training=True)`` averaged with the weights; ``key`` is the
    ``'dropout'`` rng.
    """

    def loss_fn(params: Params, batch: tuple[Any, ...], key: jax.Array) -> jax.Array:
        *inputs, targets, weights = batch
        logits = model.apply({"params": params}, *inputs, training=True, rngs={"dropout": key})
        per_token = optax.softmax_cross_entropy_with_integer_labels(logits, targets)  # (B, T)
        return (per_token * weights).sum() / weights.sum()

    @jax.jit
    def train_step(params: Params, opt_state: Any, batch: tuple[Any, ...],
                   key: jax.Array) -> tuple[Params, Any, jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(params, batch, key)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


def train_seq2seq(
    model: Seq2Seq | None = None,
    data: seq2seq.Seq2SeqData | None = None,
    *,
    steps: int = 200,
    batch_size: int = 64,
    lr: float = 0.005,
    clip: float = 1.0,
    seed: int = 0,
) -> tuple[Seq2Seq, Params, list[float]]:
    """Trains as :mod:`examples.seq2seq` describes, with ``optax.adam``.

    Clipping is ``optax.clip_by_global_norm``; ``seed`` makes the ``jax.random.key`` of the
    initial params and of dropout. Returns the model, its trained params and the losses.
    """
    data = data or seq2seq.toy_task(2000, seed=seed)
    model = model or Seq2Seq(data.vocab_size)
    init_key, dropout_key = jax.random.split(jax.random.key(seed))
    first = data.take(np.arange(batch_size))
    params = jax.jit(model.init)(init_key, first.source, first.source_lens, first.decoder_inputs)["params"]
    optimizer = optax.chain(optax.clip_by_global_norm(clip), optax.adam(lr))
    train_step = masked_train_step(model, optimizer)
    opt_state = optimizer.init(params)
    losses = []
    for i, index in enumerate(seq2seq.minibatches(len(data), batch_size, steps, seed)):
        b = data.take(index)
        batch = (b.source, b.source_lens, b.decoder_inputs, b.targets, b.loss_weights())
        params, opt_state, loss = train_step(params, opt_state, batch, jax.random.fold_in(dropout_key, i))
        losses.append(float(loss))
    return model, params, losses


def main(argv: Sequence[str] | None = None) -> int:
    """Trains on the reversal task, decodes held-out sequences and prints how it went."""
    steps = seq2seq.steps_argument(argv)
    model, params, losses = train_seq2seq(steps=steps)
    test = seq2seq.toy_task(200, seed=1000)
    tokens, _ = translate(model, params, test.source, test.source_lens, test.targets.shape[1])
    print(seq2seq.report("JAX/Flax", losses, tokens, test))
    return 0


if __name__ == "__main__":
    sys.exit(main())
