"""The encoder-decoder Transformer example in Keras 3 (TensorFlow): ``tf.GradientTape`` and Adam.

The train step runs under ``tf.function``. The data, the schedule, the searches and the report
are the framework-free ones of :mod:`examples.transformer`; the searches run the Keras
``TransformerEncoder`` and ``TransformerDecoder`` given the trained model's weights. Run from the
repository root: ``python -m examples.transformer_tensorflow`` (``--save``, ``--plot``: see
:func:`examples.transformer.arguments`).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence

import keras

from backends.tensorflow import Transformer
from examples import transformer as example
from examples.seq2seq import Seq2SeqData
from examples.seq2seq_tensorflow import masked_train_step


def train_transformer(data: Seq2SeqData | None = None, *, steps: int = example.STEPS,
                      seed: int = 0) -> tuple[Transformer, list[float]]:
    """Trains as :mod:`examples.transformer` describes; returns the model and the losses.

    Clipping is Adam's ``global_clipnorm``, the padding mask the loss's ``sample_weight``;
    ``seed`` goes to ``keras.utils.set_random_seed`` and to the batches.
    """
    keras.utils.set_random_seed(seed)
    data = data or example.training_data(seed)
    model = Transformer(**example.CONFIG.transformer())
    optimizer = keras.optimizers.Adam(global_clipnorm=example.CLIP)
    optimizer.build(model.trainable_variables)  # the weights exist: the config fixes every size
    compiled_step = masked_train_step(model, optimizer, functools.partial(model, training=True))
    losses = []
    for batch, rate in example.batches(data, steps, seed):
        optimizer.learning_rate = rate
        losses.append(float(compiled_step(batch.source, batch.decoder_inputs, batch.source_lens,
                                          batch.targets, batch.loss_weights())))
    return model, losses


def decoding(model: Transformer) -> example.Decoding:
    """Keras' ``TransformerEncoder`` and ``TransformerDecoder`` holding the model's weights."""
    return example.from_weights("tensorflow", model.get_weights())


def main(argv: Sequence[str] | None = None) -> int:
    """Trains on the reversal task, decodes held-out sequences and prints how it went."""
    return example.run_script("Keras (TensorFlow)", argv, train_transformer, decoding)


if __name__ == "__main__":
    sys.exit(main())
