"""The PyTorch backend: ``TorchOps`` and the layers as ``torch.nn.Module``s."""

from backends.torch.layers import *  # noqa: F403 - the declared layers (its __all__)
from backends.torch.ops import OPS as OPS
from backends.torch.ops import TorchOps as TorchOps
from backends.torch.parallel import ContextParallel as ContextParallel
from backends.torch.parallel import ring_attention as ring_attention
from backends.torch.parallel import ulysses_attention as ulysses_attention

__all__ = [  # the declared layers, one class each, and the backend's own names
    "OPS",
    "AddNorm",
    "AdditiveAttention",
    "ContextParallel",
    "DotProductAttention",
    "LearnedPositionalEncoding",
    "MultiHeadAttention",
    "NadarayaWatson",
    "PositionWiseFFN",
    "PositionalEncoding",
    "RelativeMultiHeadAttention",
    "RotaryEmbedding",
    "TorchOps",
    "Transformer",
    "TransformerDecoder",
    "TransformerDecoderBlock",
    "TransformerEncoder",
    "TransformerEncoderBlock",
    "ring_attention",
    "ulysses_attention"
]
