"""Converting frameworks' own multi-head attention layers to and from the canonical weights.

Three native layers are supported, each by its backend's ``convert`` module (the only place
that imports the framework):

========================================  ==========================================
native layer                              functions
========================================  ==========================================
``torch.nn.MultiheadAttention``           ``backends.torch.convert``: ``from_torch``, ``to_torch``
``keras.layers.MultiHeadAttention``       ``backends.keras.convert``: ``from_keras``, ``to_keras``
``flax.linen.MultiHeadDotProductAttention``  ``backends.jax.convert``: ``from_flax``, ``to_flax``
========================================  ==========================================

The converters of native Transformer decoder layers (``torch.nn.TransformerDecoderLayer`` in
``backends.torch.convert``, KerasHub's ``TransformerDecoder`` in ``backends.keras.convert``)
share :func:`check_biased_decoder_block` here; the encoder layers' (``TransformerEncoderLayer``:
``from_torch_encoder_layer`` ...; KerasHub's ``TransformerEncoder``: ``from_kerashub_encoder``
...) sit beside them, and the layers take the native layers' call keywords
(:mod:`attention_core.conventions`). This module holds what they share, with NumPy
alone: the layout translations (torch's
``(out, in)`` matrices, and the per-head "einsum" kernels of Keras and Flax), and
:func:`from_native` / :func:`native_config`, which pick the converter from the object's type
without importing any framework.

The canonical MultiHeadAttention (the Weights page) has ``W_q.kernel (q_in, h)``,
``W_k.kernel (k_in, h)``, ``W_v.kernel (v_in, h)``, ``W_o.kernel (h, h)`` and, when it has
biases, a bias ``(h,)`` on each of the four. Head ``i`` uses columns ``i*d : (i+1)*d`` with
``d = h / H``. All three native layers split heads the same way (torch reshapes
``(B, T, h)`` to ``(B, T, H, d)``; Keras and Flax kernels are ``(in, H, d)``, which flattens to
the same columns), and all three scale scores by ``1/sqrt(d)``, as the core does.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from attention_core import checks, declarations, registry
from attention_core import weights as W
from attention_core.host import host_array

#: Canonical projection names, in order, and the einsum-layout (Flax) names of the same.
PROJECTIONS = ("W_q", "W_k", "W_v", "W_o")
EINSUM_NAMES = {"W_q": "query", "W_k": "key", "W_v": "value", "W_o": "out"}

#: Top-level module of a native layer's class -> the backend whose converter handles it.
_NATIVE_MODULES = {"torch": "torch", "keras": "tensorflow", "tf_keras": "tensorflow",
                   "tensorflow": "tensorflow", "flax": "jax"}
_FUNCTIONS = {"torch": ("from_torch", "torch_config"),
              "tensorflow": ("from_keras", "keras_config"),
              "jax": ("from_flax", "flax_config")}


# -- the canonical side -----------------------------------------------------------------------


def check_multi_head(
    weights: Mapping[str, Any], num_heads: int, where: str
) -> dict[str, np.ndarray]:
    """Checks a canonical MultiHeadAttention mapping (with or without biases).

    Args:
        weights: Canonical name -> array.
        num_heads: H; must divide h (read off ``W_o.kernel``).
        where: The caller's name, for the messages.

    Returns:
        The weights as NumPy arrays, in canonical order.

    Raises:
        TypeError: ``weights`` is not a mapping, or an entry is not floating point.
        ValueError: Missing, unexpected or wrongly shaped weights; h not divisible by H.
    """
    if not isinstance(weights, Mapping):
        raise TypeError(
            f"{where}: weights must be a mapping of name -> array, got {type(weights).__name__}"
        )
    h = int(np.shape(weights["W_o.kernel"])[-1]) if "W_o.kernel" in weights else num_heads
    checks.check_heads(h, num_heads)
    return W.check_weights(W.multi_head_spec(h, num_heads, "W_q.bias" in weights), weights, where)


def multi_head_config(weights: Mapping[str, Any], num_heads: int) -> dict[str, Any]:
    """Constructor arguments of the MultiHeadAttention that takes these canonical weights.

    Returns:
        ``{"num_hiddens": h, "num_heads": num_heads, "bias": bool}``.
    """
    checked = check_multi_head(weights, num_heads, "multi_head_config")
    return {"num_hiddens": int(checked["W_o.kernel"].shape[1]), "num_heads": num_heads,
            "bias": "W_q.bias" in checked}


def check_biases(present: Mapping[str, bool], where: str) -> bool:
    """Whether a native attention layer has its biases; ValueError when it has some only.

    Args:
        present: The native layer's bias names (``in_proj_bias``, ``query.bias``, ...) ->
            whether it has that bias.
        where: The caller's name, for the message.
    """
    have = [name for name, on in present.items() if on]
    if have and len(have) < len(present):
        lacking = [name for name, on in present.items() if not on]
        raise ValueError(
            f"{where}: biases on {have} only, none on {lacking}; this library's "
            "MultiHeadAttention has biases on all four projections or none"
        )
    return bool(have)


# -- torch's layout: (out, in) matrices ------------------------------------------------------


def from_out_in(
    matrices: Mapping[str, Any], biases: Mapping[str, Any] | None, where: str
) -> dict[str, np.ndarray]:
    """``(out, in)`` matrices (torch's ``Linear`` layout) -> canonical ``(in, out)`` kernels.

    Args:
        matrices: ``W_q``, ``W_k``, ``W_v``, ``W_o`` -> ``(h, in)`` arrays.
        biases: The same names -> ``(h,)`` arrays, or None for no biases.
        where: The caller's name, for the messages.
    """
    out = {f"{name}.kernel": np.asarray(matrices[name]).T for name in PROJECTIONS}
    if biases is not None:
        out.update({f"{name}.bias": np.asarray(biases[name]) for name in PROJECTIONS})
    for name in PROJECTIONS:
        if out[f"{name}.kernel"].ndim != 2:
            raise ValueError(f"{where}: {name}.kernel has shape "
                             f"{checks.fmt_shape(out[f'{name}.kernel'].shape)}, expected (in, h)")
    h = out["W_o.kernel"].shape[1]
    spec = W.multi_head_spec(h, 1, biases is not None)
    return W.check_weights(spec, out, where)


def to_out_in(
    weights: Mapping[str, Any], num_heads: int, where: str
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray] | None]:
    """Canonical weights -> ``(out, in)`` matrices and biases (None without biases)."""
    checked = check_multi_head(weights, num_heads, where)
    matrices = {name: np.ascontiguousarray(checked[f"{name}.kernel"].T) for name in PROJECTIONS}
    if "W_q.bias" not in checked:
        return matrices, None
    return matrices, {name: checked[f"{name}.bias"] for name in PROJECTIONS}


# -- the einsum layout of Keras and Flax: per-head kernels -------------------------------------


def from_einsum(params: Mapping[str, Any], where: str = "from_einsum") -> dict[str, np.ndarray]:
    """Per-head kernels (Keras ``EinsumDense``, Flax ``DenseGeneral``) -> canonical weights.

    Args:
        params: ``query``, ``key``, ``value`` -> ``{"kernel": (in, H, d), "bias": (H, d)}`` and
            ``out`` -> ``{"kernel": (H, d, h), "bias": (h,)}``: Flax's params of a
            ``MultiHeadDotProductAttention`` (or its variables ``{"params": ...}``), and what
            the Keras converter reads off ``keras.layers.MultiHeadAttention``. Biases on all
            four or on none.
        where: The caller's name, for the messages.

    Returns:
        The canonical mapping; ``num_heads`` is ``H``.

    Raises:
        ValueError: Missing or unexpected entries, inconsistent shapes, value heads of another
            size than query heads, an output width other than ``H * d``, biases on some
            projections only.
    """
    tree = params.get("params", params) if isinstance(params, Mapping) else params
    if not isinstance(tree, Mapping):
        raise TypeError(f"{where}: expected a mapping of params, got {type(params).__name__}")
    flat = W.flatten_tree(tree)
    kernels = [f"{EINSUM_NAMES[n]}.kernel" for n in PROJECTIONS]
    biases = [f"{EINSUM_NAMES[n]}.bias" for n in PROJECTIONS]
    has_bias = [name in flat for name in biases]
    if all(name in flat for name in kernels):
        check_biases(dict(zip(biases, has_bias, strict=True)), where)
    expected = set(kernels) | (set(biases) if any(has_bias) else set())
    missing, unexpected = sorted(expected - set(flat)), sorted(set(flat) - expected)
    if missing or unexpected:
        raise ValueError(
            f"{where}: missing params {missing}, unexpected params {unexpected}; expected "
            f"exactly {sorted(expected)}"
        )
    arrays = {name: np.asarray(value) for name, value in flat.items()}
    q = arrays["query.kernel"]
    if q.ndim != 3:
        raise ValueError(f"{where}: query.kernel has shape {checks.fmt_shape(q.shape)}, "
                         "expected (in, num_heads, head_dim)")
    _, heads, depth = q.shape
    h = heads * depth
    for name in ("key", "value"):
        got = arrays[f"{name}.kernel"].shape
        if len(got) != 3 or got[1] != heads:
            raise ValueError(f"{where}: {name}.kernel has shape {checks.fmt_shape(got)}, "
                             f"expected (in, {heads}, head_dim)")
    v_depth = arrays["value.kernel"].shape[2]
    if v_depth != depth or arrays["key.kernel"].shape[2] != depth:
        raise ValueError(
            f"{where}: value heads have size {v_depth} and key heads "
            f"{arrays['key.kernel'].shape[2]}, but query heads {depth}; this library's "
            "MultiHeadAttention projects queries, keys and values to one width h = num_heads * "
            "head size (for Keras: value_dim must equal key_dim)"
        )
    o = arrays["out.kernel"]
    if o.ndim != 3 or o.shape[:2] != (heads, depth):
        raise ValueError(f"{where}: out.kernel has shape {checks.fmt_shape(o.shape)}, "
                         f"expected ({heads}, {depth}, out)")
    if o.shape[2] != h:
        raise ValueError(
            f"{where}: the output width ({o.shape[2]}) must equal num_heads * head size "
            f"({heads} * {depth} = {h}), the width of this library's MultiHeadAttention"
        )
    out = {f"{name}.kernel": arrays[f"{EINSUM_NAMES[name]}.kernel"].reshape(-1, h)
           for name in ("W_q", "W_k", "W_v")}
    out["W_o.kernel"] = o.reshape(h, h)
    if all(has_bias):
        for name in ("W_q", "W_k", "W_v"):
            bias = arrays[f"{EINSUM_NAMES[name]}.bias"]
            if bias.shape != (heads, depth):
                raise ValueError(f"{where}: {EINSUM_NAMES[name]}.bias has shape "
                                 f"{checks.fmt_shape(bias.shape)}, expected ({heads}, {depth})")
            out[f"{name}.bias"] = bias.reshape(h)
        out["W_o.bias"] = arrays["out.bias"]
    return check_multi_head(out, heads, where)


def to_einsum(
    weights: Mapping[str, Any], num_heads: int, where: str = "to_einsum"
) -> dict[str, dict[str, np.ndarray]]:
    """Canonical weights -> per-head kernels, nested as Flax params (see :func:`from_einsum`)."""
    checked = check_multi_head(weights, num_heads, where)
    h = checked["W_o.kernel"].shape[1]
    depth = h // num_heads
    tree: dict[str, dict[str, np.ndarray]] = {}
    for name in ("W_q", "W_k", "W_v"):
        kernel = checked[f"{name}.kernel"]
        tree[EINSUM_NAMES[name]] = {"kernel": kernel.reshape(kernel.shape[0], num_heads, depth)}
        if f"{name}.bias" in checked:
            tree[EINSUM_NAMES[name]]["bias"] = checked[f"{name}.bias"].reshape(num_heads, depth)
    tree["out"] = {"kernel": checked["W_o.kernel"].reshape(num_heads, depth, h)}
    if "W_o.bias" in checked:
        tree["out"]["bias"] = checked["W_o.bias"]
    return tree


# -- picking the converter by type --------------------------------------------------------------


def native_backend(native: Any) -> str:
    """The backend whose converter handles ``native``, from its type alone (no import).

    A mapping is taken for Flax params or variables.

    Raises:
        TypeError: Not a supported native layer.
    """
    if isinstance(native, Mapping):
        return "jax"
    for cls in type(native).__mro__:
        owner = _NATIVE_MODULES.get(cls.__module__.partition(".")[0])
        if owner is not None:
            return owner
    raise TypeError(
        "expected a torch.nn.MultiheadAttention, a keras.layers.MultiHeadAttention or the "
        f"params of a flax.linen.MultiHeadDotProductAttention, got {type(native).__name__}"
    )


def _converter(native: Any, which: int) -> Any:
    name = native_backend(native)
    # Keras' converters work under any Keras backend (backends.keras.convert)
    module = importlib.import_module("backends.keras.convert" if name == "tensorflow"
                                     else f"backends.{name}.convert")
    return getattr(module, _FUNCTIONS[name][which])


def from_native(native: Any) -> dict[str, np.ndarray]:
    """Canonical MultiHeadAttention weights of a framework's own multi-head attention.

    Args:
        native: A ``torch.nn.MultiheadAttention``, a built ``keras.layers.MultiHeadAttention``,
            or the variables/params of a ``flax.linen.MultiHeadDotProductAttention``.

    Returns:
        Canonical name -> NumPy array, for ``MultiHeadAttention(**native_config(native))``.
    """
    if isinstance(native, Mapping):
        return from_einsum(native, "from_native")  # Flax params: NumPy alone suffices
    result: dict[str, np.ndarray] = _converter(native, 0)(native)
    return result


def native_config(native: Any) -> dict[str, Any]:
    """Constructor arguments of this library's MultiHeadAttention equal to ``native``.

    Returns:
        ``{"num_hiddens", "num_heads", "dropout", "bias"}``; for Flax params (which do not
        record the dropout rate) ``dropout`` is 0.0.
    """
    if isinstance(native, Mapping):
        weights = from_einsum(native, "native_config")
        heads = int(np.shape(W.flatten_tree(native.get("params", native))["query.kernel"])[1])
        return {**multi_head_config(weights, heads), "dropout": 0.0}
    result: dict[str, Any] = _converter(native, 1)(native)
    return result


# -- native Transformer decoder layers (torch's TransformerDecoderLayer, KerasHub's) --------


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
    host = _host_mapping(weights, where)
    crossed = f"{ATTENTIONS[1]}.W_q.kernel" in host
    _check_biased(host, ATTENTIONS[:1 + crossed], where, why)
    return check_decoder_block(host, num_heads, where), crossed


def check_decoder_block(weights: Mapping[str, Any], num_heads: int,
                        where: str) -> dict[str, np.ndarray]:
    """Checks canonical ``TransformerDecoderBlock`` weights (what a converter read, say).

    Returns:
        NumPy copies of the weights.

    Raises:
        TypeError, ValueError: As :func:`check_biased_decoder_block`, biases aside.
    """
    host = _host_mapping(weights, where)
    W.check_call_weights(registry.get_ops("numpy"), where, host,
                         lambda size: W.decoder_block_call_spec(size, host, num_heads))
    return host


def check_biased_encoder_block(
    weights: Mapping[str, Any], num_heads: int, where: str, why: str
) -> dict[str, np.ndarray]:
    """Checks canonical ``TransformerEncoderBlock`` weights for a native layer with biases.

    Args:
        weights: Canonical name -> array.
        num_heads: H.
        where: The caller's name, for the messages.
        why: Why the native layer needs the biases, the end of that message.

    Returns:
        The weights as NumPy arrays, in canonical order.

    Raises:
        TypeError: ``weights`` is not a mapping, or an entry is not floating point.
        ValueError: The attention projections without biases, or not a block's mapping
            (missing, unexpected or wrongly shaped weights).
    """
    host = _host_mapping(weights, where)
    _check_biased(host, ("attention",), where, why)
    return check_encoder_block(host, num_heads, where)


def check_encoder_block(weights: Mapping[str, Any], num_heads: int,
                        where: str) -> dict[str, np.ndarray]:
    """Checks canonical ``TransformerEncoderBlock`` weights (what a converter read, say).

    Returns:
        NumPy copies of the weights, in canonical order.

    Raises:
        TypeError, ValueError: As :func:`check_biased_encoder_block`, biases aside.
    """
    host = _host_mapping(weights, where)
    if "ffn.dense1.kernel" not in host:
        raise ValueError(f"{where}: missing weights: ffn.dense1.kernel")
    if host["ffn.dense1.kernel"].ndim != 2:
        raise ValueError(f"{where}: ffn.dense1.kernel has shape "
                         f"{checks.fmt_shape(host['ffn.dense1.kernel'].shape)}, expected (h, ffn)")
    h, ffn = host["ffn.dense1.kernel"].shape
    block = declarations.TransformerEncoderBlock(h, ffn, num_heads, bias="attention.W_q.bias" in host)
    block.check()
    return W.check_weights(block.weight_shapes(), host, where)


def _host_mapping(weights: Any, where: str) -> dict[str, np.ndarray]:
    """Canonical weights as NumPy copies (none shares memory with ``weights``).

    Raises:
        TypeError: ``weights`` is not a mapping (the message names ``where``).
    """
    if not isinstance(weights, Mapping):
        raise TypeError(
            f"{where}: weights must be a mapping of name -> array, got {type(weights).__name__}"
        )
    return {name: np.array(host_array(value)) for name, value in weights.items()}


def _check_biased(host: Mapping[str, Any], prefixes: tuple[str, ...], where: str, why: str) -> None:
    """ValueError unless each attention sublayer ``prefixes`` has all four projection biases.

    (A native ``bias=True`` covers the output projection too: ``bias="qkv"`` weights have none.)
    """
    if any(f"{prefix}.{part}.bias" not in host for prefix in prefixes
           for part in ("W_q", "W_k", "W_v", "W_o")):
        raise ValueError(f"{where}: the attention projections must have biases (bias=True): {why}")
