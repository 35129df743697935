"""attention-core: one implementation of attention and positional encoding for every framework.

The functional API takes a framework's own arrays and works out the backend from their type.
Layers come from the active backend: ``attention_core.MultiHeadAttention`` (or
``attention_core.layers.MultiHeadAttention``) is the class of the backend active at that moment;
``from backends.torch import MultiHeadAttention`` names one framework explicitly.
Importing this package imports no deep-learning framework.
"""

from __future__ import annotations

from typing import Any

from attention_core.attention import (
    additive_attention,
    dot_product_attention,
    masked_softmax,
    nadaraya_watson,
)
from attention_core.convert_hf import from_hf_llama, hf_config, to_hf_llama
from attention_core.generation import (
    Generated,
    beam_search,
    decoder_step,
    generate,
    greedy_search,
    repeat_rows,
)
from attention_core.multihead import (
    HeadOptions,
    multi_head_attention,
    relative_multi_head_attention,
)
from attention_core.positional import (
    alibi_slopes,
    positional_encoding,
    relative_rotation,
    rotary_embedding,
    sinusoidal_encoding,
)
from attention_core.registry import (
    BACKENDS,
    ENV_VAR,
    BackendNotInstalledError,
    available_backends,
    backend,
    set_backend,
    use_backend,
)
from attention_core.sampling import choose
from attention_core.transformer import (
    add_norm,
    position_wise_ffn,
    transformer_decoder,
    transformer_decoder_block,
    transformer_encoder,
    transformer_encoder_block,
    transformer_encoder_decoder,
)
from attention_core.weights import BlockOptions, load_weights, save_weights

#: The package version (pyproject.toml reads it from here; CHANGELOG.md names each release).
__version__ = "0.2.0"

#: Layer classes every backend provides (the README's table of layers).
LAYER_NAMES = (
    "DotProductAttention",
    "AdditiveAttention",
    "MultiHeadAttention",
    "RelativeMultiHeadAttention",
    "PositionalEncoding",
    "LearnedPositionalEncoding",
    "RotaryEmbedding",
    "PositionWiseFFN",
    "AddNorm",
    "TransformerEncoderBlock",
    "TransformerEncoder",
    "TransformerDecoderBlock",
    "TransformerDecoder",
    "Transformer",
    "NadarayaWatson",
)

__all__ = [
    "BACKENDS",
    "ENV_VAR",
    "LAYER_NAMES",
    "BackendNotInstalledError",
    "BlockOptions",
    "Generated",
    "HeadOptions",
    "add_norm",
    "additive_attention",
    "alibi_slopes",
    "available_backends",
    "backend",
    "beam_search",
    "choose",
    "dot_product_attention",
    "decoder_step",
    "from_hf_llama",
    "generate",
    "greedy_search",
    "hf_config",
    "load_weights",
    "masked_softmax",
    "multi_head_attention",
    "nadaraya_watson",
    "position_wise_ffn",
    "positional_encoding",
    "relative_multi_head_attention",
    "relative_rotation",
    "repeat_rows",
    "rotary_embedding",
    "save_weights",
    "set_backend",
    "sinusoidal_encoding",
    "to_hf_llama",
    "transformer_decoder",
    "transformer_decoder_block",
    "transformer_encoder",
    "transformer_encoder_decoder",
    "transformer_encoder_block",
    "use_backend",
    *LAYER_NAMES,
]


def __getattr__(name: str) -> Any:
    """Resolves layer names against the active backend at the moment of access."""
    if name in LAYER_NAMES:
        from attention_core import layers

        return getattr(layers, name)
    raise AttributeError(f"module 'attention_core' has no attribute {name!r}")
