"""``torch.nn.MultiheadAttention`` <-> canonical MultiHeadAttention weights.

torch keeps the query, key and value projections as ``(h, in)`` matrices, stacked into one
``in_proj_weight (3h, h)`` (q, k, v in that order) when keys and values have the query width
(``kdim == vdim == embed_dim``), and as ``q_proj_weight``, ``k_proj_weight``,
``v_proj_weight`` otherwise; ``in_proj_bias (3h,)`` is stacked the same way; the output
projection is ``out_proj`` (a ``Linear``, ``(h, h)``). ``bias=True`` (torch's default) gives all
four projections a bias, as ``bias=True`` does here. Head ``i`` takes columns ``i*d:(i+1)*d``
(``d = h / H``) of each projection, as here, and scores are scaled by ``1/sqrt(d)``.

Masks: torch's ``attn_mask`` and ``key_padding_mask`` are True where attention is **blocked**;
ours are True where it is allowed. For ``(B, T, D)`` inputs (``batch_first=True``)::

    key_padding_mask = torch.arange(K)[None, :] >= valid_lens[:, None]   # valid_lens (B,)
    attn_mask = ~mask                                                      # mask (Q, K)
    attn_mask = torch.ones(Q, K, dtype=torch.bool).triu(1)                 # causal, Q == K

torch's causal mask is aligned at the first key, ours at the last: they agree when Q == K.
A query that sees no key gives NaN in torch and zeros here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from attention_core import checks
from attention_core import convert as C
from attention_core import weights as W
from attention_core.linear import LAYER_NORM_EPS
from backends.torch.ops import OPS

_L = TypeVar("_L", bound=nn.Module)


def _host(t: torch.Tensor) -> np.ndarray:
    """A NumPy copy of a parameter (``Tensor.numpy()`` would share its memory)."""
    return np.array(OPS.to_numpy(t.detach()), copy=True)


def _required(value: torch.Tensor | None, name: str, canonical: str, where: str) -> torch.Tensor:
    """``value``, or a ValueError naming the native parameter that is None."""
    if value is None:
        raise ValueError(f"{where}: {name} is None, but this library's layer has it "
                         f"({canonical})")
    return value


def _check_module(module: Any, where: str, path: str = "") -> nn.MultiheadAttention:
    """Checks that a torch MultiheadAttention has a counterpart here.

    ``path`` is its name in a larger layer (``self_attn.``), for the messages.
    """
    if not isinstance(module, nn.MultiheadAttention):
        raise TypeError(f"{where}: expected a torch.nn.MultiheadAttention, got "
                        f"{type(module).__name__}")
    if module.bias_k is not None or module.bias_v is not None:
        raise ValueError(f"{where}: add_bias_kv=True is not supported: this library's "
                         "MultiHeadAttention has no learned extra key and value")
    if module.add_zero_attn:
        raise ValueError(f"{where}: add_zero_attn=True is not supported: this library's "
                         "MultiHeadAttention adds no zero key and value")
    C.check_biases({f"{path}in_proj_bias": module.in_proj_bias is not None,
                    f"{path}out_proj.bias": module.out_proj.bias is not None}, where)
    return module


def _thirds(stacked: torch.Tensor, name: str, h: int, where: str) -> list[np.ndarray]:
    """The query, key and value parts of a stacked ``(3h, ...)`` parameter, as NumPy copies."""
    if stacked.ndim not in (1, 2) or stacked.shape[0] != 3 * h:
        want = f"({3 * h},)" if stacked.ndim == 1 else f"({3 * h}, {h})"
        raise ValueError(f"{where}: {name} has shape {checks.fmt_shape(tuple(stacked.shape))}, "
                         f"expected {want}")
    return [_host(part) for part in stacked.chunk(3)]


def torch_config(module: nn.MultiheadAttention) -> dict[str, Any]:
    """Constructor arguments of this library's MultiHeadAttention equal to ``module``.

    Returns:
        ``{"num_hiddens": embed_dim, "num_heads", "dropout", "bias"}``.

    Raises:
        TypeError, ValueError: As :func:`from_torch`.
    """
    weights = _read_mha(module, "torch_config")
    return {"num_hiddens": int(module.embed_dim), "num_heads": int(module.num_heads),
            "dropout": float(module.dropout), "bias": "W_q.bias" in weights}


def from_torch(module: nn.MultiheadAttention) -> dict[str, np.ndarray]:
    """The canonical weights of a ``torch.nn.MultiheadAttention`` (copies, as NumPy arrays).

    ``batch_first`` does not matter (it changes only how the module is called). Build the
    matching layer with ``MultiHeadAttention(**torch_config(module))``.

    Raises:
        TypeError: ``module`` is not a ``torch.nn.MultiheadAttention``.
        ValueError: ``add_bias_kv`` or ``add_zero_attn``, which have no counterpart here; a
            bias on the input projections (``in_proj_bias``) but none on the output one
            (``out_proj.bias``), or the other way round; a weight that is None.
    """
    return _read_mha(module, "from_torch")


def _read_mha(module: Any, where: str, path: str = "") -> dict[str, np.ndarray]:
    """The canonical weights of a torch MultiheadAttention, checked (see :func:`from_torch`)."""
    module = _check_module(module, where, path)
    if module._qkv_same_embed_dim:
        stacked = _required(module.in_proj_weight, f"{path}in_proj_weight",
                            "W_q.kernel, W_k.kernel, W_v.kernel", where)
        q, k, v = _thirds(stacked, f"{path}in_proj_weight", module.embed_dim, where)
    else:
        q, k, v = (_host(_required(getattr(module, f"{x}_proj_weight"), f"{path}{x}_proj_weight",
                                   f"W_{x}.kernel", where)) for x in "qkv")
    out = _required(module.out_proj.weight, f"{path}out_proj.weight", "W_o.kernel", where)
    matrices = {"W_q": q, "W_k": k, "W_v": v, "W_o": _host(out)}
    biases = None
    if module.in_proj_bias is not None:
        bq, bk, bv = _thirds(module.in_proj_bias, f"{path}in_proj_bias", module.embed_dim, where)
        biases = {"W_q": bq, "W_k": bk, "W_v": bv, "W_o": _host(module.out_proj.bias)}
    return C.from_out_in(matrices, biases, where)


def to_torch(
    weights: Mapping[str, Any],
    num_heads: int,
    *,
    dropout: float = 0.0,
    batch_first: bool = True,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> nn.MultiheadAttention:
    """A ``torch.nn.MultiheadAttention`` holding canonical MultiHeadAttention weights.

    Args:
        weights: Canonical weights (``get_weights()``, ``load_weights(path)``, ...), with
            biases on all four projections or none (torch's ``bias``).
        num_heads: H.
        dropout: torch's ``dropout`` (on the attention weights, in training mode).
        batch_first: torch's ``batch_first``; True (not torch's default) takes ``(B, T, D)``
            inputs, as this library's layers do.
        device: Device of the parameters.
        dtype: Dtype of the parameters (torch's default dtype when None).

    Raises:
        ValueError: The weights are not a canonical MultiHeadAttention mapping, or queries are
            not ``num_hiddens`` wide (torch's ``embed_dim`` is both widths).
    """
    matrices, biases = C.to_out_in(weights, num_heads, "to_torch")
    h, q_in = matrices["W_q"].shape
    if q_in != h:
        raise ValueError(
            f"to_torch: W_q.kernel has shape ({q_in}, {h}), but torch.nn.MultiheadAttention "
            f"needs queries of width embed_dim = num_hiddens ({h})"
        )
    k_in, v_in = matrices["W_k"].shape[1], matrices["W_v"].shape[1]
    module = nn.MultiheadAttention(
        h, num_heads, dropout=dropout, bias=biases is not None, kdim=k_in, vdim=v_in,
        batch_first=batch_first, device=device, dtype=dtype,
    )
    with torch.no_grad():
        if module._qkv_same_embed_dim:
            stacked = np.concatenate([matrices["W_q"], matrices["W_k"], matrices["W_v"]])
            _copy(module.in_proj_weight, stacked)
        else:
            _copy(module.q_proj_weight, matrices["W_q"])
            _copy(module.k_proj_weight, matrices["W_k"])
            _copy(module.v_proj_weight, matrices["W_v"])
        _copy(module.out_proj.weight, matrices["W_o"])
        if biases is not None:
            _copy(module.in_proj_bias, np.concatenate([biases["W_q"], biases["W_k"], biases["W_v"]]))
            _copy(module.out_proj.bias, biases["W_o"])
    return module


def _copy(param: torch.Tensor, value: np.ndarray) -> None:
    if value.dtype.name == "bfloat16":  # ml_dtypes' bfloat16, which torch cannot read
        value = value.astype(np.float32)
    param.copy_(torch.as_tensor(np.ascontiguousarray(value)).to(param.dtype))


# -- torch.nn.TransformerDecoderLayer <-> canonical TransformerDecoderBlock weights ----------

#: Sublayers of ``nn.TransformerDecoderLayer`` and the canonical names they map to.
_DECODER_NORMS = {"norm1": "addnorm1", "norm2": "addnorm2", "norm3": "addnorm3"}
_DECODER_LINEARS = {"linear1": "ffn.dense1", "linear2": "ffn.dense2"}
_DECODER_ATTENTIONS = {"self_attn": "self_attention", "multihead_attn": "cross_attention"}


def _read_ffn_and_norms(layer: nn.Module, norms: Mapping[str, str],
                        where: str) -> dict[str, np.ndarray]:
    """The canonical FFN and layer-norm weights of a torch encoder or decoder layer (copies)."""
    weights = {}
    for name, canonical in _DECODER_LINEARS.items():
        linear = getattr(layer, name)
        kernel = _required(linear.weight, f"{name}.weight", f"{canonical}.kernel", where)
        weights[f"{canonical}.kernel"] = _host(kernel).T.copy()
        weights[f"{canonical}.bias"] = _host(linear.bias)
    for name, canonical in norms.items():
        norm = getattr(layer, name)
        weights[f"{canonical}.ln.gamma"] = _host(norm.weight)
        weights[f"{canonical}.ln.beta"] = _host(norm.bias)
    return weights


def _read_layer(layer: Any, attentions: Mapping[str, str], norms: Mapping[str, str],
                where: str) -> dict[str, np.ndarray]:
    """The canonical block weights of a checked torch encoder or decoder layer.

    Args:
        layer: The torch layer.
        attentions: Its attention sublayers (``self_attn`` ...) -> their canonical prefixes.
        norms: Its layer norms -> their canonical add & norms.
        where: The caller's name, for the messages.

    Raises:
        ValueError: Attention sublayers with biases and without in one layer (the block's
            ``bias`` covers them all), or what :func:`from_torch` refuses.
    """
    weights: dict[str, np.ndarray] = {}
    for attr, prefix in attentions.items():
        weights.update(W.prefixed(_read_mha(getattr(layer, attr), where, f"{attr}."), prefix))
    biased = {attr: f"{prefix}.W_q.bias" in weights for attr, prefix in attentions.items()}
    if len(set(biased.values())) > 1:
        raise ValueError(
            f"{where}: biases on {[a for a, on in biased.items() if on]} only, none on "
            f"{[a for a, on in biased.items() if not on]}; this library's block has biases on "
            "all its attention projections or none (bias)"
        )
    weights.update(_read_ffn_and_norms(layer, norms, where))
    check = C.check_decoder_block if len(attentions) > 1 else C.check_encoder_block
    heads = int(layer.self_attn.num_heads)
    return check(weights, heads, where)


def _write_ffn_and_norms(layer: nn.Module, host: Mapping[str, np.ndarray],
                         norms: Mapping[str, str]) -> None:
    """Copies canonical FFN and layer-norm weights into a torch encoder or decoder layer."""
    with torch.no_grad():
        for name, canonical in _DECODER_LINEARS.items():
            linear = getattr(layer, name)
            _copy(linear.weight, host[f"{canonical}.kernel"].T)
            _copy(linear.bias, host[f"{canonical}.bias"])
        for name, canonical in norms.items():
            norm = getattr(layer, name)
            _copy(norm.weight, host[f"{canonical}.ln.gamma"])
            _copy(norm.bias, host[f"{canonical}.ln.beta"])


def _check_decoder_layer(layer: Any, where: str) -> nn.TransformerDecoderLayer:
    return _check_post_norm(layer, nn.TransformerDecoderLayer, _DECODER_NORMS, where)


def _check_post_norm(layer: Any, cls: type[_L], norms: Mapping[str, str], where: str) -> _L:
    """Checks that a torch Transformer layer is one this library's block computes as it does."""
    block = cls.__name__.replace("Layer", "Block")
    if not isinstance(layer, cls):
        raise TypeError(f"{where}: expected a torch.nn.{cls.__name__}, got "
                        f"{type(layer).__name__}")
    if layer.norm_first:
        raise ValueError(f"{where}: norm_first=True is not supported: this library's "
                         f"{block} is post-norm (norm_first=False)")
    if layer.activation is not F.relu and not isinstance(layer.activation, nn.ReLU):
        raise ValueError(f"{where}: the activation must be ReLU, got {layer.activation!r}")
    for name in norms:
        norm = getattr(layer, name)
        if norm.bias is None or norm.weight is None or norm.eps != LAYER_NORM_EPS:
            raise ValueError(f"{where}: {name} must be a LayerNorm with a weight, a bias and "
                             f"eps={LAYER_NORM_EPS} (layer_norm_eps), as this library's AddNorm, "
                             f"got {norm!r}")
    for name in _DECODER_LINEARS:
        if getattr(layer, name).bias is None:
            raise ValueError(f"{where}: {name} must have a bias (bias=True), as this "
                             "library's PositionWiseFFN has")
    return layer


def decoder_layer_config(layer: nn.TransformerDecoderLayer) -> dict[str, Any]:
    """Constructor arguments of this library's TransformerDecoderBlock equal to ``layer``.

    Returns:
        ``{"num_hiddens": d_model, "ffn_num_hiddens": dim_feedforward, "num_heads", "dropout",
        "bias"}``.
    """
    where = "decoder_layer_config"
    weights = _read_layer(_check_decoder_layer(layer, where), _DECODER_ATTENTIONS, _DECODER_NORMS,
                          where)
    return _layer_config(layer, weights)


def _layer_config(layer: Any, weights: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """The block's constructor arguments, from a torch layer and its canonical weights."""
    h, ffn = weights["ffn.dense1.kernel"].shape
    return {"num_hiddens": int(h), "ffn_num_hiddens": int(ffn),
            "num_heads": int(layer.self_attn.num_heads), "dropout": float(layer.dropout.p),
            "bias": any(name.endswith("W_q.bias") for name in weights)}


def from_torch_decoder_layer(layer: nn.TransformerDecoderLayer) -> dict[str, np.ndarray]:
    """The canonical ``TransformerDecoderBlock`` weights of a ``torch.nn.TransformerDecoderLayer``.

    torch's post-norm layer (``norm_first=False``, ReLU) computes what the block computes:
    ``norm1(x + self_attn(x))``, ``norm2(x + multihead_attn(x, memory))``,
    ``norm3(x + linear2(relu(linear1(x))))``. Call it with a causal ``tgt_mask`` to match the
    block's causal self-attention. Build the block with
    ``TransformerDecoderBlock(**decoder_layer_config(layer))``.

    Raises:
        TypeError: ``layer`` is not a ``torch.nn.TransformerDecoderLayer``.
        ValueError: ``norm_first=True``, another activation than ReLU, ``bias=False``, a
            layer norm whose eps is not 1e-5, attention sublayers with biases and without,
            or what :func:`from_torch` refuses of either.
    """
    where = "from_torch_decoder_layer"
    return _read_layer(_check_decoder_layer(layer, where), _DECODER_ATTENTIONS, _DECODER_NORMS,
                       where)


def to_torch_decoder_layer(
    weights: Mapping[str, Any],
    num_heads: int,
    *,
    dropout: float = 0.0,
    batch_first: bool = True,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> nn.TransformerDecoderLayer:
    """A post-norm ``torch.nn.TransformerDecoderLayer`` holding canonical block weights.

    Args:
        weights: Canonical ``TransformerDecoderBlock`` weights with cross-attention, whose
            attention projections all have biases (torch's ``bias=True``).
        num_heads: H.
        dropout: torch's ``dropout``.
        batch_first: torch's ``batch_first``; True takes ``(B, T, D)`` as this library does.
        device: Device of the parameters.
        dtype: Dtype of the parameters (torch's default dtype when None).

    Raises:
        ValueError: The weights are not those of a block with cross-attention and biased
            projections (torch's layer has no decoder-only form, and its ``bias`` covers
            the attention projections, the FFN and the layer norms alike).
    """
    if "cross_attention.W_q.kernel" not in weights:
        raise ValueError("to_torch_decoder_layer: weights must have cross-attention "
                         "(cross_attention.*): torch.nn.TransformerDecoderLayer has no "
                         "decoder-only form")
    host, _ = C.check_biased_decoder_block(
        weights, num_heads, "to_torch_decoder_layer",
        "torch.nn.TransformerDecoderLayer's bias covers them, the FFN and the layer norms alike")
    parts = {prefix: to_torch(W.subset(host, prefix), num_heads, dropout=dropout,
                              batch_first=batch_first, device=device, dtype=dtype)
             for prefix in C.ATTENTIONS}
    h, ffn = host["ffn.dense1.kernel"].shape
    layer = nn.TransformerDecoderLayer(h, num_heads, ffn, dropout, batch_first=batch_first,
                                       device=device, dtype=dtype)
    layer.self_attn, layer.multihead_attn = parts["self_attention"], parts["cross_attention"]
    _write_ffn_and_norms(layer, host, _DECODER_NORMS)
    return layer


# -- torch.nn.TransformerEncoderLayer <-> canonical TransformerEncoderBlock weights ----------

#: The layer norms of ``nn.TransformerEncoderLayer`` and the canonical names they map to.
_ENCODER_NORMS = {"norm1": "addnorm1", "norm2": "addnorm2"}
_ENCODER_ATTENTIONS = {"self_attn": "attention"}


def _check_encoder_layer(layer: Any, where: str) -> nn.TransformerEncoderLayer:
    return _check_post_norm(layer, nn.TransformerEncoderLayer, _ENCODER_NORMS, where)


def encoder_layer_config(layer: nn.TransformerEncoderLayer) -> dict[str, Any]:
    """Constructor arguments of this library's TransformerEncoderBlock equal to ``layer``.

    Returns:
        ``{"num_hiddens": d_model, "ffn_num_hiddens": dim_feedforward, "num_heads", "dropout",
        "bias"}``.

    Raises:
        TypeError, ValueError: As :func:`from_torch_encoder_layer`.
    """
    where = "encoder_layer_config"
    weights = _read_layer(_check_encoder_layer(layer, where), _ENCODER_ATTENTIONS, _ENCODER_NORMS,
                          where)
    return _layer_config(layer, weights)


def from_torch_encoder_layer(layer: nn.TransformerEncoderLayer) -> dict[str, np.ndarray]:
    """The canonical ``TransformerEncoderBlock`` weights of a ``torch.nn.TransformerEncoderLayer``.

    torch's post-norm layer (``norm_first=False``, ReLU, ``layer_norm_eps=1e-5``, its
    defaults) computes what the block computes: ``norm1(x + self_attn(x))``, then
    ``norm2(x + linear2(relu(linear1(x))))``. Build the block with
    ``TransformerEncoderBlock(**encoder_layer_config(layer))``; it takes torch's ``src_mask``,
    ``src_key_padding_mask`` and ``is_causal`` (batch-first).

    Raises:
        TypeError: ``layer`` is not a ``torch.nn.TransformerEncoderLayer``.
        ValueError: ``norm_first=True``, another activation than ReLU, a ``layer_norm_eps``
            other than 1e-5, ``bias=False`` (torch's ``bias`` covers the FFN and the layer
            norms too, which always have biases here), a weight set to None or of another
            shape, or what :func:`from_torch` refuses of ``self_attn``.
    """
    where = "from_torch_encoder_layer"
    return _read_layer(_check_encoder_layer(layer, where), _ENCODER_ATTENTIONS, _ENCODER_NORMS,
                       where)


def to_torch_encoder_layer(
    weights: Mapping[str, Any],
    num_heads: int,
    *,
    dropout: float = 0.0,
    batch_first: bool = True,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> nn.TransformerEncoderLayer:
    """A post-norm ``torch.nn.TransformerEncoderLayer`` holding canonical block weights.

    Args:
        weights: Canonical ``TransformerEncoderBlock`` weights whose attention projections
            have biases (``bias=True``: torch's ``bias`` covers them, the FFN and the layer
            norms alike).
        num_heads: H.
        dropout: torch's ``dropout``.
        batch_first: torch's ``batch_first``; True takes ``(B, T, D)`` as this library does.
        device: Device of the parameters.
        dtype: Dtype of the parameters (torch's default dtype when None).

    Raises:
        TypeError: ``weights`` is not a mapping.
        ValueError: Projections without biases, or not a block's weights (missing,
            unexpected or wrongly shaped).
    """
    host = C.check_biased_encoder_block(
        weights, num_heads, "to_torch_encoder_layer",
        "torch.nn.TransformerEncoderLayer's bias covers them, the FFN and the layer norms alike")
    h, ffn = host["ffn.dense1.kernel"].shape
    layer = nn.TransformerEncoderLayer(h, num_heads, ffn, dropout, batch_first=batch_first,
                                       device=device, dtype=dtype)
    layer.self_attn = to_torch(W.subset(host, "attention"), num_heads, dropout=dropout,
                               batch_first=batch_first, device=device, dtype=dtype)
    _write_ffn_and_norms(layer, host, _ENCODER_NORMS)
    return layer
