"""``keras.layers.MultiHeadAttention`` <-> canonical MultiHeadAttention weights.

Keras keeps per-head kernels: ``query``, ``key`` and ``value`` are ``(in, num_heads, key_dim)``
(biases ``(num_heads, key_dim)``), ``attention_output`` is ``(num_heads, value_dim, out)``
(bias ``(out,)``); ``use_bias`` (default True) gives all four a bias. Flattening the head axes
gives the canonical ``(in, h)`` kernels with head ``i`` in columns ``i*key_dim:(i+1)*key_dim``,
as here; scores are scaled by ``1/sqrt(key_dim)``, as here. So:

* ``num_hiddens = num_heads * key_dim`` (it may differ from the width of the inputs);
* ``value_dim`` must equal ``key_dim`` (one projected width h here), else a ValueError;
* the output width must be ``num_hiddens``: Keras' ``output_shape`` defaults to the query's
  width, so give ``output_shape=num_heads * key_dim`` when the query is another width.

Keras calls are ``layer(query, value, key)``: values before keys. Masks mean the same thing
(``attention_mask`` True = may attend, ``(B, Q, K)``); ``valid_lens`` becomes
``attention_mask = arange(K)[None, None, :] < valid_lens[:, None, None]``. Keras'
``use_causal_mask`` is aligned at the first key, ``causal=True`` here at the last: they agree
when Q == K.

The converter is part of the TensorFlow backend, so Keras must run on TensorFlow.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import keras
import numpy as np

from attention_core import convert as C

_SUBLAYERS = {"query": "query_dense", "key": "key_dense", "value": "value_dense",
              "out": "output_dense"}


def _sublayer(layer: Any, name: str) -> Any:
    attr = _SUBLAYERS[name]
    return getattr(layer, attr, None) or getattr(layer, f"_{attr}")


def _check_layer(layer: Any, where: str) -> dict[str, Any]:
    """Checks that a Keras MultiHeadAttention has a counterpart here; returns its config."""
    if not isinstance(layer, keras.layers.MultiHeadAttention):
        raise TypeError(f"{where}: expected a keras.layers.MultiHeadAttention, got "
                        f"{type(layer).__name__}")
    config = layer.get_config()
    if config.get("use_gate"):
        raise ValueError(f"{where}: use_gate=True is not supported: this library's "
                         "MultiHeadAttention has no output gate")
    if config.get("sliding_window") is not None:
        raise ValueError(f"{where}: sliding_window is not supported; pass the band as a "
                         "boolean mask instead")
    axes = config.get("attention_axes")
    if axes is not None and tuple(axes) != (1,):
        raise ValueError(f"{where}: attention_axes={tuple(axes)} is not supported; this "
                         "library attends over axis 1 of (batch, time, features) inputs")
    if config["value_dim"] != config["key_dim"]:
        raise ValueError(
            f"{where}: value_dim ({config['value_dim']}) must equal key_dim "
            f"({config['key_dim']}): this library's MultiHeadAttention projects queries, keys "
            "and values to one width num_hiddens = num_heads * key_dim"
        )
    if not layer.built:
        raise ValueError(f"{where}: the Keras layer has no weights yet; call or build it first")
    return dict(config)


def keras_config(layer: keras.layers.MultiHeadAttention) -> dict[str, Any]:
    """Constructor arguments of this library's MultiHeadAttention equal to ``layer``.

    Returns:
        ``{"num_hiddens": num_heads * key_dim, "num_heads", "dropout", "bias": use_bias}``.
    """
    config = _check_layer(layer, "keras_config")
    return {"num_hiddens": int(config["num_heads"] * config["key_dim"]),
            "num_heads": int(config["num_heads"]), "dropout": float(config["dropout"]),
            "bias": bool(config["use_bias"])}


def from_keras(layer: keras.layers.MultiHeadAttention) -> dict[str, np.ndarray]:
    """The canonical weights of a built ``keras.layers.MultiHeadAttention`` (NumPy copies).

    Build the matching layer with ``MultiHeadAttention(**keras_config(layer))``.

    Raises:
        TypeError: ``layer`` is not a Keras MultiHeadAttention.
        ValueError: Not built yet, or a feature without a counterpart here (``value_dim``
            other than ``key_dim``, an output width other than ``num_heads * key_dim``,
            ``use_gate``, ``sliding_window``, other ``attention_axes``).
    """
    config = _check_layer(layer, "from_keras")
    params: dict[str, dict[str, np.ndarray]] = {}
    for name in _SUBLAYERS:
        dense = _sublayer(layer, name)
        params[name] = {"kernel": np.array(dense.kernel.numpy())}
        if config["use_bias"]:
            params[name]["bias"] = np.array(dense.bias.numpy())
    return C.from_einsum(params, "from_keras")


def to_keras(
    weights: Mapping[str, Any],
    num_heads: int,
    *,
    dropout: float = 0.0,
    dtype: Any = None,
    name: str | None = None,
) -> keras.layers.MultiHeadAttention:
    """A built ``keras.layers.MultiHeadAttention`` holding canonical MultiHeadAttention weights.

    Args:
        weights: Canonical weights, with biases on all four projections or none (``use_bias``).
        num_heads: H; ``key_dim = value_dim = num_hiddens / H``.
        dropout: Keras' ``dropout``.
        dtype: Keras' ``dtype`` (a dtype policy name); Keras' default when None.
        name: The layer's name.

    Returns:
        The layer, built for inputs of the kernels' widths, ``output_shape = num_hiddens``.
        Call it as ``layer(queries, values, keys)``.
    """
    tree = C.to_einsum(weights, num_heads, "to_keras")
    h = tree["out"]["kernel"].shape[2]
    layer = keras.layers.MultiHeadAttention(
        num_heads=num_heads, key_dim=h // num_heads, dropout=dropout,
        use_bias="bias" in tree["out"], output_shape=h, dtype=dtype, name=name,
    )
    layer.build(query_shape=(None, None, tree["query"]["kernel"].shape[0]),
                value_shape=(None, None, tree["value"]["kernel"].shape[0]),
                key_shape=(None, None, tree["key"]["kernel"].shape[0]))
    for part, values in tree.items():
        dense = _sublayer(layer, part)
        for leaf, value in values.items():
            variable = getattr(dense, leaf)
            variable.assign(keras.ops.cast(keras.ops.convert_to_tensor(value), variable.dtype))
    return layer
