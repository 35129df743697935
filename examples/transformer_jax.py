"""The encoder-decoder Transformer example in JAX/Flax: ``jax.value_and_grad`` and optax.

Params are a Flax pytree, every train step one ``jax.jit``-compiled function. The data, the
schedule, the searches and the report are the framework-free ones of
:mod:`examples.transformer`; :class:`FlaxDecoding` applies the ``TransformerEncoder`` and
``TransformerDecoder`` modules with the trained params for them. Run from the repository root:
``python -m examples.transformer_jax`` (``--save``, ``--plot``: see
:func:`examples.transformer.arguments`).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax  # type: ignore[import-untyped]

from attention_core.weights import subset
from backends.jax import Transformer, TransformerDecoder, TransformerEncoder, get_weights, init_from_weights
from examples import transformer as example
from examples.seq2seq import Seq2SeqData
from examples.seq2seq_jax import Params, masked_train_step


class FlaxDecoding(example.Decoding):
    """The encoder and decoder modules applied with canonical ``Transformer`` weights.

    Args:
        weights: ``encoder.*`` and ``decoder.*`` (``backends.jax.get_weights(params)`` of a
            trained ``Transformer``, or a file's).
    """

    def __init__(self, weights: Mapping[str, np.ndarray]) -> None:
        super().__init__("jax", TransformerEncoder(**example.CONFIG.stack()),
                         TransformerDecoder(**example.CONFIG.stack()))
        self.variables = {part: init_from_weights(module, subset(weights, part))
                          for part, module in (("encoder", self.encoder), ("decoder", self.decoder))}
        self.kept: list[Any] = []
        self._encode = jax.jit(self.encoder.apply)
        self._step = jax.jit(self.decoder.apply, static_argnames=("capacity",))  # start: traced

    def call_encoder(self, tokens: Any, valid_lens: Any) -> Any:
        """Applies the encoder module (compiled)."""
        return self._encode(self.variables["encoder"], tokens, valid_lens)

    def decode(self, tokens: Any, enc_outputs: Any, enc_valid_lens: Any, **cached: Any) -> Any:
        """Applies the decoder module: a cached step compiled, a full pass keeping what it sowed."""
        variables = self.variables["decoder"]
        if cached:
            return self._step(variables, tokens, enc_outputs, enc_valid_lens, **cached)
        logits, state = self.decoder.apply(variables, tokens, enc_outputs, enc_valid_lens,
                                           mutable=["intermediates"])
        self.kept = state["intermediates"]["attention_weights"][-1]
        return logits

    def kept_cross_attention(self) -> list[Any]:
        """The cross-attention weights the last full pass sowed, one array per block."""
        return list(self.kept[1])


def train_transformer(data: Seq2SeqData | None = None, *, steps: int = example.STEPS,
                      seed: int = 0) -> tuple[Transformer, Params, list[float]]:
    """Trains as :mod:`examples.transformer` describes, with ``optax.adam``.

    Clipping is ``optax.clip_by_global_norm``, the schedule a table looked up by optax's step
    count; ``seed`` makes the ``jax.random.key`` of the initial params and of dropout, and
    shuffles the batches. Returns the model, its trained params and the losses.
    """
    data = data or example.training_data(seed)
    model = Transformer(**example.CONFIG.transformer())
    init_key, dropout_key = jax.random.split(jax.random.key(seed))
    first = data.take(np.arange(example.BATCH_SIZE))
    params = jax.jit(model.init)(init_key, first.source, first.decoder_inputs, first.source_lens)["params"]
    rates = jnp.asarray(example.learning_rates(steps))
    optimizer = optax.chain(optax.clip_by_global_norm(example.CLIP), optax.adam(lambda count: rates[count]))
    train_step = masked_train_step(model, optimizer)
    opt_state = optimizer.init(params)
    losses = []
    for i, (b, _) in enumerate(example.batches(data, steps, seed)):
        batch = (b.source, b.decoder_inputs, b.source_lens, b.targets, b.loss_weights())
        params, opt_state, loss = train_step(params, opt_state, batch, jax.random.fold_in(dropout_key, i))
        losses.append(float(loss))
    return model, params, losses


def decoding(params: Params) -> FlaxDecoding:
    """The encoder and decoder modules with the trained ``Transformer`` params."""
    return FlaxDecoding(get_weights(params))


def main(argv: Sequence[str] | None = None) -> int:
    """Trains on the reversal task, decodes held-out sequences and prints how it went."""
    return example.run_script("Flax (JAX)", argv, train_transformer, decoding)


if __name__ == "__main__":
    sys.exit(main())
