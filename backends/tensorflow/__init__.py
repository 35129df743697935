"""The TensorFlow backend: Keras 3 layers; Keras must run on TensorFlow (else ImportError)."""

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
