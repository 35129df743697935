"""The NumPy backend: the embedded default, inference layers over plain NumPy arrays."""

from backends.numpy.layers import *  # noqa: F403 - the declared layers (its __all__)
from backends.numpy.ops import OPS as OPS
from backends.numpy.ops import NumpyOps as NumpyOps

__all__ = [  # the declared layers, one class each, and the backend's own names
    "OPS", "AddNorm", "AdditiveAttention", "DotProductAttention", "LearnedPositionalEncoding",
    "MultiHeadAttention", "NadarayaWatson", "NumpyOps", "PositionWiseFFN", "PositionalEncoding",
    "RelativeMultiHeadAttention",
    "RotaryEmbedding", "Transformer", "TransformerDecoder", "TransformerDecoderBlock",
    "TransformerEncoder", "TransformerEncoderBlock"
]
