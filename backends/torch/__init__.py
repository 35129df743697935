"""The PyTorch backend: ``TorchOps`` and the layers as ``torch.nn.Module``s."""

from backends.torch.layers import (
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
from backends.torch.ops import OPS, TorchOps

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
    "TorchOps",
    "TransformerEncoder",
    "TransformerEncoderBlock",
]
