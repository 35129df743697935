"""The JAX backend: ``jax.numpy`` ops and ``flax.linen`` layers over the core.

Flax is functional, so the canonical weights are read and written on params pytrees by module
functions rather than layer methods::

    import jax, jax.numpy as jnp
    from backends.jax import MultiHeadAttention, get_weights, set_weights

    layer = MultiHeadAttention(100, 5, dropout=0.5)
    X = jnp.ones((2, 4, 100))
    variables = layer.init(jax.random.key(0), X, X, X, jnp.array([3, 2]))
    Y = layer.apply(variables, X, X, X, jnp.array([3, 2]))            # (2, 4, 100)
    weights = get_weights(variables)                                   # {'W_q.kernel': ...}
    variables = set_weights(variables, weights)                        # a new pytree

:func:`init_from_weights` makes variables from canonical weights; :func:`call_layer` inits and
applies once (the CLI demo uses it).
"""

from backends.jax.layers import *  # noqa: F403 - the declared layers (its __all__)
from backends.jax.layers import call_layer as call_layer
from backends.jax.layers import get_weights as get_weights
from backends.jax.layers import init_from_weights as init_from_weights
from backends.jax.layers import init_weights as init_weights
from backends.jax.layers import set_weights as set_weights
from backends.jax.ops import OPS as OPS
from backends.jax.ops import JaxOps as JaxOps
from backends.jax.parallel import ContextParallel as ContextParallel
from backends.jax.parallel import ring_attention as ring_attention

__all__ = [  # the declared layers, one class each, and the backend's own names
    "OPS", "AddNorm", "AdditiveAttention", "ContextParallel", "DotProductAttention", "JaxOps",
    "LearnedPositionalEncoding",
    "MultiHeadAttention", "NadarayaWatson", "PositionWiseFFN", "PositionalEncoding",
    "RelativeMultiHeadAttention",
    "RotaryEmbedding", "Transformer", "TransformerDecoder", "TransformerDecoderBlock",
    "TransformerEncoder", "TransformerEncoderBlock", "call_layer",
    "get_weights", "init_from_weights", "init_weights", "ring_attention", "set_weights"
]
