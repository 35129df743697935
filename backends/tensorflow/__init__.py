"""The TensorFlow backend: Keras 3 layers; Keras must run on TensorFlow (else ImportError)."""

from backends.tensorflow.layers import *  # noqa: F403 - the declared layers (its __all__)
from backends.tensorflow.ops import OPS as OPS
from backends.tensorflow.ops import TensorFlowOps as TensorFlowOps

__all__ = [  # the declared layers, one class each, and the backend's own names
    "OPS", "AddNorm", "AdditiveAttention", "DotProductAttention", "LearnedPositionalEncoding",
    "MultiHeadAttention", "NadarayaWatson", "PositionWiseFFN", "PositionalEncoding",
    "RelativeMultiHeadAttention",
    "RotaryEmbedding", "TensorFlowOps", "Transformer", "TransformerDecoder",
    "TransformerDecoderBlock",
    "TransformerEncoder", "TransformerEncoderBlock"
]
