"""The MXNet/Gluon backend: ``HybridBlock`` layers over MXNet's NumPy interface.

Importing it switches MXNet to its NumPy interface for the whole process (``mxnet.npx.set_np()``,
as d2l's MXNet chapters do): ``mxnet.numpy.ndarray`` arrays, with NumPy shape semantics and the
``bool`` dtype the masks need. The layers refuse to run (a ``RuntimeError`` asking for
``npx.set_np()``) if code switches it back. MXNet 1.9.1, the last release, needs ``numpy<1.24``.
"""

from typing import Any

from mxnet import npx

npx.set_np()

from backends.mxnet.layers import *  # noqa: E402, F403 - after set_np(); its __all__
from backends.mxnet.ops import OPS as OPS  # noqa: E402
from backends.mxnet.ops import MXNetOps as MXNetOps  # noqa: E402


def call_layer(layer: Any, *args: Any, **kwargs: Any) -> Any:
    """Calls a layer, first initialising its never-initialised parameters (the CLI demo's way)."""
    for param in layer.collect_params().values():
        if param._data is None and not param._deferred_init:  # never initialised
            param.initialize()
    return layer(*args, **kwargs)

__all__ = [  # the declared layers, one class each, and the backend's own names
    "OPS", "AddNorm", "AdditiveAttention", "DotProductAttention", "LearnedPositionalEncoding",
    "MXNetOps", "MultiHeadAttention", "NadarayaWatson", "PositionWiseFFN", "PositionalEncoding",
    "RelativeMultiHeadAttention",
    "RotaryEmbedding", "Transformer", "TransformerDecoder", "TransformerDecoderBlock",
    "TransformerEncoder", "TransformerEncoderBlock", "call_layer"
]
