"""The NumPy backend: the embedded default, inference layers over plain NumPy arrays."""

from backends.numpy.layers import (
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
from backends.numpy.ops import OPS, NumpyOps

__all__ = [
    "OPS",
    "AddNorm",
    "AdditiveAttention",
    "DotProductAttention",
    "LearnedPositionalEncoding",
    "MultiHeadAttention",
    "NadarayaWatson",
    "NumpyOps",
    "PositionWiseFFN",
    "PositionalEncoding",
    "RelativeMultiHeadAttention",
    "TransformerEncoder",
    "TransformerEncoderBlock",
]
