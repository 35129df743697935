"""``flax.linen.MultiHeadDotProductAttention`` <-> canonical MultiHeadAttention weights.

Flax keeps per-head kernels in the params: ``query``, ``key``, ``value`` ``{"kernel": (in,
num_heads, head_dim), "bias": (num_heads, head_dim)}`` and ``out`` ``{"kernel": (num_heads,
head_dim, out), "bias": (out,)}``, biases when ``use_bias`` (default True). Flattening the head
axes gives the canonical ``(in, h)`` kernels with head ``i`` in columns ``i*head_dim:
(i+1)*head_dim``, as here; scores are scaled by ``1/sqrt(head_dim)``, as here. So
``num_hiddens = qkv_features`` (which defaults to the query's width), and the output width
``out_features`` (which also defaults to the query's width) must equal it.

Flax is functional, so the converters work on params: :func:`from_flax` reads the variables
(or params) that ``init`` returned, :func:`to_flax` returns a module and its variables.
Masks mean the same thing (``mask`` True = may attend, ``(B, H or 1, Q, K)``): ``valid_lens``
becomes ``mask = (jnp.arange(K) < valid_lens[:, None])[:, None, None, :]``;
``flax.linen.make_causal_mask`` is aligned at the first key, ``causal=True`` here at the last:
they agree when Q == K. A query that sees no key gets uniform weights in Flax, zeros here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from attention_core import convert as C


def _check_module(module: Any, where: str) -> None:
    if not isinstance(module, nn.MultiHeadDotProductAttention):
        raise TypeError(f"{where}: module must be a flax.linen.MultiHeadDotProductAttention, "
                        f"got {type(module).__name__}")
    unsupported = {
        "normalize_qk": module.normalize_qk,
        "decode": module.decode,
        "attention_fn": module.attention_fn is not nn.dot_product_attention,
        "qkv_dot_general": module.qkv_dot_general is not None
        or module.qkv_dot_general_cls is not None,
        "out_dot_general": module.out_dot_general is not None
        or module.out_dot_general_cls is not None,
        "qk_attn_weights_einsum_cls":
            getattr(module, "qk_attn_weights_einsum_cls", None) is not None,
        "attn_weights_value_einsum_cls":
            getattr(module, "attn_weights_value_einsum_cls", None) is not None,
    }
    used = [name for name, on in unsupported.items() if on]
    if used:
        raise ValueError(f"{where}: {', '.join(used)} is not supported: this library's "
                         "MultiHeadAttention is plain scaled dot-product attention")


def _params(variables: Any, where: str) -> Mapping[str, Any]:
    if isinstance(variables, nn.Module):
        raise TypeError(f"{where}: a Flax module holds no weights; pass the variables that "
                        "module.init(...) returned (or their 'params')")
    if not isinstance(variables, Mapping):
        raise TypeError(f"{where}: expected Flax variables or params (a mapping), got "
                        f"{type(variables).__name__}")
    params: Mapping[str, Any] = variables.get("params", variables)
    return params


def flax_config(variables: Mapping[str, Any],
                module: nn.MultiHeadDotProductAttention | None = None) -> dict[str, Any]:
    """Constructor arguments of this library's MultiHeadAttention equal to the Flax layer.

    Args:
        variables: What ``module.init`` returned, or its ``"params"``.
        module: The module, to read ``dropout_rate`` from (0.0 without it).

    Returns:
        ``{"num_hiddens", "num_heads", "dropout", "bias"}``.
    """
    weights = _read(variables, module, "flax_config")
    heads = int(np.shape(_params(variables, "flax_config")["query"]["kernel"])[1])
    config = C.multi_head_config(weights, heads)
    return {**config, "dropout": float(module.dropout_rate) if module is not None else 0.0}


def from_flax(variables: Mapping[str, Any],
              module: nn.MultiHeadDotProductAttention | None = None) -> dict[str, np.ndarray]:
    """The canonical weights of a ``flax.linen.MultiHeadDotProductAttention`` (NumPy copies).

    Args:
        variables: What ``module.init`` returned (``{"params": ...}``), or the params.
        module: The module, optional: if given, options without a counterpart here
            (``normalize_qk``, ``decode``, a custom ``attention_fn`` or dot_general) are refused.

    Returns:
        Canonical name -> NumPy array, for ``MultiHeadAttention(**flax_config(variables))``.

    Raises:
        ValueError: Params of another layout, ``out_features`` other than ``qkv_features``,
            biases on some projections only; with ``module``, params that the module would not
            use as they are (biases with ``use_bias=False`` or none with ``use_bias=True``,
            another number of heads).
    """
    return _read(variables, module, "from_flax")


def _read(variables: Any, module: nn.MultiHeadDotProductAttention | None,
          where: str) -> dict[str, np.ndarray]:
    """The canonical weights of Flax params, checked against the module when it is given."""
    params = _params(variables, where)
    if module is not None:
        _check_module(module, where)
    weights = C.from_einsum(params, where)
    if module is None:
        return weights
    heads = int(np.shape(params["query"]["kernel"])[1])
    biased = "W_q.bias" in weights
    if module.num_heads != heads or bool(module.use_bias) != biased:
        raise ValueError(
            f"{where}: the params are those of {heads} heads {'with' if biased else 'without'} "
            f"biases, but the module has num_heads={module.num_heads}, "
            f"use_bias={module.use_bias}: pass the module that made them"
        )
    return weights


def to_flax(
    weights: Mapping[str, Any],
    num_heads: int,
    *,
    dropout: float = 0.0,
    param_dtype: DTypeLike = jnp.float32,
) -> tuple[nn.MultiHeadDotProductAttention, dict[str, Any]]:
    """A ``flax.linen.MultiHeadDotProductAttention`` and variables holding canonical weights.

    Args:
        weights: Canonical weights, with biases on all four projections or none (``use_bias``).
        num_heads: H.
        dropout: Flax's ``dropout_rate``.
        param_dtype: Dtype of the params.

    Returns:
        ``(module, {"params": ...})``, ``qkv_features = out_features = num_hiddens``. Call it as
        ``module.apply(variables, queries, keys, values, mask=...)``.
    """
    tree = C.to_einsum(weights, num_heads, "to_flax")
    h = tree["out"]["kernel"].shape[2]
    module = nn.MultiHeadDotProductAttention(
        num_heads=num_heads, qkv_features=h, out_features=h, use_bias="bias" in tree["out"],
        dropout_rate=dropout, param_dtype=param_dtype,
    )
    params = {part: {leaf: jnp.asarray(value, dtype=param_dtype) for leaf, value in leaves.items()}
              for part, leaves in tree.items()}
    return module, {"params": params}
