"""Keras 3 layers under any Keras backend (``KERAS_BACKEND``: tensorflow, jax or torch).

``from backends.keras import MultiHeadAttention`` gives a ``keras.layers.Layer`` whose weights
are Keras variables of the framework Keras runs on; the core computes on that framework's
arrays. Under TensorFlow these are the classes ``backends.tensorflow`` serves.
"""

from backends.keras.layers import *  # noqa: F403 - the declared layers (its __all__)
from backends.keras.ops import backend_ops
from backends.keras.ops import keras_ops as keras_ops

#: The ops of the framework Keras runs on (its adapter's ``OPS``), for the functional API.
OPS = backend_ops()

__all__ = [  # the declared layers, one class each, and the backend's own names
    "OPS", "AddNorm", "AdditiveAttention", "DotProductAttention", "LearnedPositionalEncoding",
    "MultiHeadAttention", "NadarayaWatson", "PositionWiseFFN", "PositionalEncoding",
    "RelativeMultiHeadAttention", "RotaryEmbedding", "Transformer", "TransformerDecoder",
    "TransformerDecoderBlock", "TransformerEncoder", "TransformerEncoderBlock", "keras_ops",
]
