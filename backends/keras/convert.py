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

KerasHub's ``keras_hub.layers.TransformerDecoder`` converts to and from the canonical
``TransformerDecoderBlock`` weights: :func:`from_kerashub`, :func:`to_kerashub` and
:func:`kerashub_decoder_config`. Its post-norm form (``normalize_first=False``, the default)
with ReLU and ``layer_norm_epsilon=1e-5`` (both defaults) computes what the block computes;
built by a call with an ``encoder_sequence`` it has cross-attention, built by a call without
one it is the ``decoder_only`` block. Its attention projections always have biases, so the
block has ``bias=True``. Called with ``use_causal_mask=True`` (its default), its
``decoder_padding_mask`` ``(B, T)`` is ``valid_lens`` here and its ``encoder_padding_mask``
``(B, S)`` is ``enc_valid_lens`` (both hide keys only)::

    decoder_padding_mask = arange(T)[None, :] < valid_lens[:, None]
    encoder_padding_mask = arange(S)[None, :] < enc_valid_lens[:, None]

KerasHub is imported by these three functions only, when called.

The converters read and write Keras variables only, so they work under any Keras backend
(TensorFlow, JAX, torch); ``backends.keras.convert`` gives the same functions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import keras
import numpy as np

from attention_core import convert as C
from attention_core import weights as W
from attention_core.linear import LAYER_NORM_EPS

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
    _check_built(layer, where)
    return dict(config)


def _check_built(layer: Any, where: str) -> None:
    if not layer.built:
        raise ValueError(f"{where}: the Keras layer has no weights yet; call or build it first")


def keras_config(layer: keras.layers.MultiHeadAttention) -> dict[str, Any]:
    """Constructor arguments of this library's MultiHeadAttention equal to ``layer``.

    Returns:
        ``{"num_hiddens": num_heads * key_dim, "num_heads", "dropout", "bias": use_bias}``.
    """
    config = _check_layer(layer, "keras_config")
    weights = _read_attention(layer, "keras_config")
    return {"num_hiddens": int(config["num_heads"] * config["key_dim"]),
            "num_heads": int(config["num_heads"]), "dropout": float(config["dropout"]),
            "bias": "W_q.bias" in weights}


def from_keras(layer: keras.layers.MultiHeadAttention) -> dict[str, np.ndarray]:
    """The canonical weights of a built ``keras.layers.MultiHeadAttention`` (NumPy copies).

    Build the matching layer with ``MultiHeadAttention(**keras_config(layer))``.

    Raises:
        TypeError: ``layer`` is not a Keras MultiHeadAttention.
        ValueError: Not built yet, or a feature without a counterpart here (``value_dim``
            other than ``key_dim``, an output width other than ``num_heads * key_dim``,
            ``use_gate``, ``sliding_window``, other ``attention_axes``, biases on some
            projections only, a quantized projection).
    """
    return _read_attention(layer, "from_keras")


def _read_attention(layer: Any, where: str) -> dict[str, np.ndarray]:
    """The canonical weights of a Keras MultiHeadAttention.

    Each projection's kernel as Keras computes it (LoRA included), and its bias where it has
    one (all four or none).
    """
    _check_layer(layer, where)
    params: dict[str, dict[str, np.ndarray]] = {}
    for name in _SUBLAYERS:
        dense = _check_dense(_sublayer(layer, name), where)
        params[name] = {"kernel": _host(dense.kernel)}
        if dense.bias is not None:
            params[name]["bias"] = _host(dense.bias)
    return C.from_einsum(params, where)


def _check_dense(dense: Any, where: str) -> Any:
    """A Keras ``Dense`` or ``EinsumDense`` whose kernel is floating point (not quantized)."""
    mode = getattr(dense, "quantization_mode", None)
    if mode is not None:
        raise ValueError(f"{where}: {dense.name} is quantized ({mode}): this library's weights "
                         "are floating point; convert the layer before quantizing it")
    return dense


def _host(variable: Any) -> np.ndarray:
    return np.array(variable.numpy())


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
    _write_attention(layer, tree)
    return layer


def _write_attention(layer: Any, tree: Mapping[str, Mapping[str, np.ndarray]]) -> None:
    """Assigns per-head kernels (:func:`attention_core.convert.to_einsum`) to a built layer."""
    for part, values in tree.items():
        dense = _sublayer(layer, part)
        for leaf, value in values.items():
            _assign(getattr(dense, leaf), value)


def _assign(variable: Any, value: np.ndarray) -> None:
    variable.assign(keras.ops.cast(keras.ops.convert_to_tensor(value), variable.dtype))


# -- keras_hub.layers.TransformerDecoder <-> canonical TransformerDecoderBlock weights --------

#: KerasHub's attention sublayers (attributes of a built TransformerDecoder), in the order of
#: ``attention_core.convert.ATTENTIONS``.
_KERASHUB_ATTENTIONS = ("_self_attention_layer", "_cross_attention_layer")


def _kerashub_leaves(crossed: bool) -> dict[str, dict[str, str]]:
    """KerasHub's dense and layer-norm sublayers: attribute -> {variable: canonical name}.

    Those of a ``TransformerDecoder``; ``crossed=False`` gives a ``TransformerEncoder``'s too
    (it names its sublayers as a decoder without cross-attention does).
    """
    norms = {"_self_attention_layer_norm": "addnorm1"}
    if crossed:
        norms["_cross_attention_layer_norm"] = "addnorm2"
    norms["_feedforward_layer_norm"] = C.last_addnorm(crossed)
    leaves = {attr: {"kernel": f"{name}.kernel", "bias": f"{name}.bias"} for attr, name in
              (("_feedforward_intermediate_dense", "ffn.dense1"),
               ("_feedforward_output_dense", "ffn.dense2"))}
    leaves.update({attr: {"gamma": f"{name}.ln.gamma", "beta": f"{name}.ln.beta"}
                   for attr, name in norms.items()})
    return leaves


def _read_leaves(layer: Any, leaves: Mapping[str, Mapping[str, str]],
                 where: str) -> dict[str, np.ndarray]:
    """The variables named in ``leaves`` (:func:`_kerashub_leaves`), by canonical name.

    Raises:
        ValueError: One of them is None (a bias, scale or offset removed), a dense layer is
            quantized, or a layer norm is not this library's (RMS scaling, another epsilon).
    """
    weights = {}
    for attr, names in leaves.items():
        sub = getattr(layer, attr)
        if "kernel" in names:
            _check_dense(sub, where)
        elif sub.rms_scaling or sub.epsilon != LAYER_NORM_EPS:
            raise ValueError(f"{where}: {attr.lstrip('_')} must be a LayerNormalization with "
                             f"epsilon={LAYER_NORM_EPS} and no rms_scaling, as this library's "
                             f"AddNorm, got epsilon={sub.epsilon}, rms_scaling={sub.rms_scaling}")
        for leaf, name in names.items():
            value = getattr(sub, leaf)
            if value is None:
                raise ValueError(f"{where}: {attr.lstrip('_')}.{leaf} is None, but this "
                                 f"library's layer has it ({name})")
            weights[name] = _host(value)
    return weights


def _read_biased_attention(layer: Any, attr: str, prefix: str, where: str) -> dict[str, np.ndarray]:
    """The canonical weights of a KerasHub layer's attention sublayer, which must have biases."""
    weights = _read_attention(getattr(layer, attr), where)
    if "W_q.bias" not in weights:
        raise ValueError(f"{where}: {attr.lstrip('_')} has no biases: this library's block "
                         "takes KerasHub's attention with its biases (bias=True)")
    return W.prefixed(weights, prefix)


def _write_leaves(layer: Any, leaves: Mapping[str, Mapping[str, str]],
                  host: Mapping[str, np.ndarray]) -> None:
    """Assigns the canonical weights ``host`` to the variables named in ``leaves``."""
    for attr, names in leaves.items():
        for leaf, name in names.items():
            _assign(getattr(getattr(layer, attr), leaf), host[name])


def _check_kerashub_decoder(layer: Any, where: str) -> bool:
    """Checks that a KerasHub TransformerDecoder is a block here; whether it has cross-attention."""
    _check_kerashub(layer, "TransformerDecoder", where)
    _check_width(layer, layer._decoder_sequence_shape[-1], "decoder", where)
    return layer._cross_attention_layer is not None


def _check_kerashub(layer: Any, kind: str, where: str) -> None:
    """Checks that a KerasHub ``kind`` (TransformerDecoder ...) is a block here, and built."""
    import keras_hub

    if not isinstance(layer, getattr(keras_hub.layers, kind)):
        raise TypeError(f"{where}: expected a keras_hub.layers.{kind}, got "
                        f"{type(layer).__name__}")
    block = kind + "Block"
    if layer.normalize_first:
        raise ValueError(f"{where}: normalize_first=True is not supported: this library's "
                         f"{block} is post-norm (normalize_first=False)")
    if layer.activation is not keras.activations.relu:
        name = getattr(layer.activation, "__name__", repr(layer.activation))
        raise ValueError(f"{where}: the activation must be relu, as this library's "
                         f"PositionWiseFFN's, got {name}")
    if layer.layer_norm_epsilon != LAYER_NORM_EPS:
        raise ValueError(f"{where}: layer_norm_epsilon must be {LAYER_NORM_EPS}, the epsilon "
                         f"of this library's AddNorm, got {layer.layer_norm_epsilon}")
    _check_built(layer, where)


def _check_width(layer: Any, width: int, what: str, where: str) -> None:
    if width % layer.num_heads:
        raise ValueError(f"{where}: the {what}'s width ({width}) must be divisible by "
                         f"num_heads ({layer.num_heads}): KerasHub's heads are width // "
                         "num_heads wide, and this library's together make the whole width")


def kerashub_decoder_config(layer: Any) -> dict[str, Any]:
    """Constructor arguments of this library's TransformerDecoderBlock equal to ``layer``.

    Args:
        layer: A built ``keras_hub.layers.TransformerDecoder``.

    Returns:
        ``{"num_hiddens", "ffn_num_hiddens": intermediate_dim, "num_heads", "dropout",
        "bias": True, "decoder_only"}``; ``decoder_only`` when the layer has no cross-attention.

    Raises:
        ValueError: What :func:`from_kerashub` refuses, or cross-attention over encoder outputs
            of another width than the decoder's: the layer takes the block's own width (the
            functional ``attention_core.transformer_decoder_block`` takes either).
    """
    where = "kerashub_decoder_config"
    _, crossed = _read_kerashub_decoder(layer, where)
    attention = keras_config(layer._self_attention_layer)
    h = attention["num_hiddens"]
    if crossed and layer._encoder_sequence_shape[-1] != h:
        raise ValueError(
            f"{where}: the encoder outputs are {layer._encoder_sequence_shape[-1]} wide, the "
            f"decoder {h}: this library's TransformerDecoderBlock takes encoder outputs of its "
            "own width (from_kerashub's weights serve attention_core.transformer_decoder_block)"
        )
    return {"num_hiddens": h, "ffn_num_hiddens": int(layer.intermediate_dim),
            "num_heads": attention["num_heads"], "dropout": float(layer.dropout),
            "bias": True, "decoder_only": not crossed}


def from_kerashub(layer: Any) -> dict[str, np.ndarray]:
    """The canonical ``TransformerDecoderBlock`` weights of a KerasHub ``TransformerDecoder``.

    KerasHub's post-norm layer computes what the block computes:
    ``self_attention_layer_norm(x + self_attention(x))``, then (with cross-attention)
    ``cross_attention_layer_norm(x + cross_attention(x, encoder_sequence))``, then
    ``feedforward_layer_norm(x + output_dense(relu(intermediate_dense(x))))``. Call it with
    ``use_causal_mask=True`` (its default) to match the block's causal self-attention. Build
    the block with ``TransformerDecoderBlock(**kerashub_decoder_config(layer))``.

    Args:
        layer: A built ``keras_hub.layers.TransformerDecoder`` (called once, or built with
            ``layer.build(decoder_shape, encoder_shape_or_None)``).

    Returns:
        Canonical name -> NumPy copy: ``self_attention.*``, ``addnorm1.*``, then
        ``cross_attention.*`` and ``addnorm2.*`` when it has cross-attention, ``ffn.*`` and
        the last add & norm (``addnorm3``, or ``addnorm2`` without cross-attention).

    Raises:
        TypeError: ``layer`` is not a KerasHub TransformerDecoder.
        ValueError: Not built yet, ``normalize_first=True``, another activation than relu,
            a ``layer_norm_epsilon`` other than this library's (1e-5), a width that
            ``num_heads`` does not divide, attention without biases, or a bias, ``gamma`` or
            ``beta`` set to None (or what :func:`from_keras` refuses of an attention layer).
    """
    return _read_kerashub_decoder(layer, "from_kerashub")[0]


def _read_kerashub_decoder(layer: Any, where: str) -> tuple[dict[str, np.ndarray], bool]:
    """A checked KerasHub decoder's canonical weights, and whether it has cross-attention."""
    crossed = _check_kerashub_decoder(layer, where)
    weights: dict[str, np.ndarray] = {}
    for attr, prefix in zip(_KERASHUB_ATTENTIONS, C.ATTENTIONS[:1 + crossed], strict=False):
        weights.update(_read_biased_attention(layer, attr, prefix, where))
    weights.update(_read_leaves(layer, _kerashub_leaves(crossed), where))
    return C.check_decoder_block(weights, layer.num_heads, where), crossed


def to_kerashub(
    weights: Mapping[str, Any],
    num_heads: int,
    *,
    dropout: float = 0.0,
    dtype: Any = None,
    name: str | None = None,
) -> Any:
    """A built KerasHub ``TransformerDecoder`` holding canonical ``TransformerDecoderBlock`` weights.

    Args:
        weights: Canonical block weights, with or without cross-attention, whose attention
            projections all have biases (``bias=True``).
        num_heads: H.
        dropout: KerasHub's ``dropout`` (the attention weights' and the residual branches').
        dtype: KerasHub's ``dtype`` (a dtype policy name); Keras' default when None.
        name: The layer's name.

    Returns:
        The post-norm ReLU layer (``normalize_first=False``, ``layer_norm_epsilon=1e-5``),
        built for ``(B, T, h)`` inputs and, with cross-attention, encoder outputs of the width
        of ``cross_attention.W_k.kernel``. Call it as ``layer(X, encoder_sequence)``, or
        ``layer(X)`` without cross-attention.

    Raises:
        TypeError: ``weights`` is not a mapping.
        ValueError: An attention projection without a bias (KerasHub has no unbiased
            attention), or the weights are not a block's.
    """
    import keras_hub

    host, crossed = C.check_biased_decoder_block(
        weights, num_heads, "to_kerashub",
        "keras_hub.layers.TransformerDecoder's attention layers always have biases")
    h, ffn = host["ffn.dense1.kernel"].shape
    layer = keras_hub.layers.TransformerDecoder(
        intermediate_dim=ffn, num_heads=num_heads, dropout=dropout, activation="relu",
        layer_norm_epsilon=LAYER_NORM_EPS, normalize_first=False, dtype=dtype, name=name,
    )
    encoder = (None, None, host["cross_attention.W_k.kernel"].shape[0]) if crossed else None
    layer.build((None, None, h), encoder)
    for attr, prefix in zip(_KERASHUB_ATTENTIONS, C.ATTENTIONS[:1 + crossed], strict=False):
        _write_attention(getattr(layer, attr),
                         C.to_einsum(W.subset(host, prefix), num_heads, "to_kerashub"))
    _write_leaves(layer, _kerashub_leaves(crossed), host)
    return layer


# -- keras_hub.layers.TransformerEncoder <-> canonical TransformerEncoderBlock weights --------

def _check_kerashub_encoder(layer: Any, where: str) -> None:
    _check_kerashub(layer, "TransformerEncoder", where)
    _check_width(layer, int(layer._feedforward_intermediate_dense.kernel.shape[0]), "encoder",
                 where)


def kerashub_encoder_config(layer: Any) -> dict[str, Any]:
    """Constructor arguments of this library's TransformerEncoderBlock equal to ``layer``.

    Args:
        layer: A built ``keras_hub.layers.TransformerEncoder``.

    Returns:
        ``{"num_hiddens", "ffn_num_hiddens": intermediate_dim, "num_heads", "dropout",
        "bias": True}``.

    Raises:
        TypeError, ValueError: As :func:`from_kerashub_encoder`.
    """
    _read_kerashub_encoder(layer, "kerashub_encoder_config")
    attention = keras_config(layer._self_attention_layer)
    return {"num_hiddens": attention["num_hiddens"], "ffn_num_hiddens": int(layer.intermediate_dim),
            "num_heads": attention["num_heads"], "dropout": float(layer.dropout), "bias": True}


def from_kerashub_encoder(layer: Any) -> dict[str, np.ndarray]:
    """The canonical ``TransformerEncoderBlock`` weights of a KerasHub ``TransformerEncoder``.

    KerasHub's post-norm layer (``normalize_first=False``, relu, ``layer_norm_epsilon=1e-5``:
    its defaults) computes what the block computes: ``self_attention_layer_norm(x + self_attention(x))``, then
    ``feedforward_layer_norm(x + output_dense(relu(intermediate_dense(x))))``. Build the block
    with ``TransformerEncoderBlock(**kerashub_encoder_config(layer))``; on Keras it takes
    KerasHub's ``padding_mask`` and ``attention_mask``.

    Args:
        layer: A built ``keras_hub.layers.TransformerEncoder`` (called once, or built with
            ``layer.build((None, None, h))``).

    Raises:
        TypeError: ``layer`` is not a KerasHub TransformerEncoder.
        ValueError: Not built yet, ``normalize_first=True``, another activation than relu,
            a ``layer_norm_epsilon`` other than this library's (1e-5), a width that
            ``num_heads`` does not divide, attention without biases, or a bias, ``gamma`` or
            ``beta`` set to None (or what :func:`from_keras` refuses of an attention layer).
    """
    return _read_kerashub_encoder(layer, "from_kerashub_encoder")


def _read_kerashub_encoder(layer: Any, where: str) -> dict[str, np.ndarray]:
    """A checked KerasHub encoder's canonical weights."""
    _check_kerashub_encoder(layer, where)
    weights = _read_biased_attention(layer, "_self_attention_layer", "attention", where)
    weights.update(_read_leaves(layer, _kerashub_leaves(False), where))
    return C.check_encoder_block(weights, layer.num_heads, where)


def to_kerashub_encoder(
    weights: Mapping[str, Any],
    num_heads: int,
    *,
    dropout: float = 0.0,
    dtype: Any = None,
    name: str | None = None,
) -> Any:
    """A built KerasHub ``TransformerEncoder`` holding canonical ``TransformerEncoderBlock`` weights.

    Args:
        weights: Canonical block weights whose attention projections have biases
            (``bias=True``).
        num_heads: H.
        dropout: KerasHub's ``dropout``.
        dtype: KerasHub's ``dtype`` (a dtype policy name); Keras' default when None.
        name: The layer's name.

    Returns:
        The post-norm relu layer (``normalize_first=False``, ``layer_norm_epsilon=1e-5``),
        built for ``(B, T, h)`` inputs.

    Raises:
        TypeError: ``weights`` is not a mapping.
        ValueError: Projections without biases (KerasHub's attention always has them), or not
            a block's weights (missing, unexpected or wrongly shaped).
    """
    import keras_hub

    where = "to_kerashub_encoder"
    host = C.check_biased_encoder_block(
        weights, num_heads, where,
        "keras_hub.layers.TransformerEncoder's attention layer always has them")
    h, ffn = host["ffn.dense1.kernel"].shape
    layer = keras_hub.layers.TransformerEncoder(
        intermediate_dim=ffn, num_heads=num_heads, dropout=dropout, activation="relu",
        layer_norm_epsilon=LAYER_NORM_EPS, normalize_first=False, dtype=dtype, name=name,
    )
    layer.build((None, None, h))
    _write_attention(layer._self_attention_layer,
                     C.to_einsum(W.subset(host, "attention"), num_heads, where))
    _write_leaves(layer, _kerashub_leaves(False), host)
    return layer
