"""The TensorFlow backend: Keras 3 layers on the TensorFlow backend of Keras.

``from backends.tensorflow import MultiHeadAttention`` gives a ``keras.layers.Layer``. Keras
must be set to its TensorFlow backend (the default; ``KERAS_BACKEND=tensorflow``): importing
this package with another Keras backend raises ImportError.
"""

from backends.tensorflow.layers import (
    AdditiveAttention,
    AddNorm,
    DotProductAttention,
    LearnedPositionalEncoding,
    MultiHeadAttention,
    NadarayaWatson,
    PositionalEncoding,
    PositionWiseFFN,
    RelativeMultiHeadAttention,
    TransformerEncoder,
    TransformerEncoderBlock,
)
from backends.tensorflow.ops import OPS, TensorFlowOps

__all__ = [
    "OPS",
    "AddNorm",
    "AdditiveAttention",
    "DotProductAttention",
    "LearnedPositionalEncoding",
    "MultiHeadAttention",
    "NadarayaWatson",
    "PositionWiseFFN",
    "PositionalEncoding",
    "RelativeMultiHeadAttention",
    "TensorFlowOps",
    "TransformerEncoder",
    "TransformerEncoderBlock",
]
