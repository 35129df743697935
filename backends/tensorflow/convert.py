"""The Keras converters (:mod:`backends.keras.convert`) under the TensorFlow backend."""

from backends.keras.convert import (
    from_keras,
    from_kerashub,
    from_kerashub_encoder,
    keras_config,
    kerashub_decoder_config,
    kerashub_encoder_config,
    to_keras,
    to_kerashub,
    to_kerashub_encoder,
)

__all__ = [
    "from_keras",
    "from_kerashub",
    "from_kerashub_encoder",
    "keras_config",
    "kerashub_decoder_config",
    "kerashub_encoder_config",
    "to_keras",
    "to_kerashub",
    "to_kerashub_encoder",
]
