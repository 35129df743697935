"""What the converters of native Transformer decoder layers share, with NumPy alone.

``backends.torch.convert`` converts ``torch.nn.TransformerDecoderLayer`` and
``backends.tensorflow.convert`` KerasHub's ``TransformerDecoder``; both native layers always
have biases on their attention projections, and both check the canonical
``TransformerDecoderBlock`` mapping they are given here, before building anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from attention_core import weights as W
from backends.numpy.ops import OPS as NUMPY_OPS

#: The block's attention sublayers, in order (the second only with cross-attention).
ATTENTIONS = ("self_attention", "cross_attention")


def last_addnorm(crossed: bool) -> str:
    """The add & norm after the FFN: ``addnorm3``, or ``addnorm2`` without cross-attention."""
    return "addnorm3" if crossed else "addnorm2"


def check_biased_decoder_block(
    weights: Mapping[str, Any], num_heads: int, where: str, why: str
) -> tuple[dict[str, np.ndarray], bool]:
    """Checks canonical ``TransformerDecoderBlock`` weights for a native layer with biases.

    Args:
        weights: Canonical name -> array.
        num_heads: H.
        where: The caller's name, for the messages.
        why: Why the native layer needs the biases, the end of that message.

    Returns:
        The weights as NumPy arrays, and whether the block has cross-attention.

    Raises:
        TypeError: ``weights`` is not a mapping, or an entry is not floating point.
        ValueError: An attention projection without a bias, or not a block's mapping
            (missing, unexpected or wrongly shaped weights).
    """
    if not isinstance(weights, Mapping):
        raise TypeError(
            f"{where}: weights must be a mapping of name -> array, got {type(weights).__name__}"
        )
    host = {name: np.asarray(value) for name, value in weights.items()}
    crossed = f"{ATTENTIONS[1]}.W_q.kernel" in host
    if any(f"{prefix}.W_q.bias" not in host for prefix in ATTENTIONS[:1 + crossed]):
        raise ValueError(f"{where}: the attention projections must have biases (bias=True): {why}")
    W.check_call_weights(NUMPY_OPS, where, host,
                         lambda size: W.decoder_block_call_spec(size, host, num_heads))
    return host, crossed
