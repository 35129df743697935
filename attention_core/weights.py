"""The canonical weight layout: names, shapes, initialisation, checking, safetensors files.

Every backend's ``get_weights()`` returns, and ``set_weights()`` takes, a flat mapping from the
names below to NumPy arrays, so weights move between frameworks. Dense kernels are
``(in, out)``. A ``None`` in a spec is an input size not known until the first call.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np

from attention_core import checks, files
from attention_core.checks import check_heads, check_kv_heads, check_positive_int, fmt_shape
from attention_core.host import host_array
from attention_core.linear import norm_eps
from attention_core.masks import own
from attention_core.ops import Array, Ops, fixed_shape

Shape = tuple[int | None, ...]
Spec = dict[str, Shape]


class HasWeights(Protocol):
    """A layer in the canonical layout."""

    def get_weights(self) -> dict[str, np.ndarray]:
        """Returns the canonical mapping."""
        ...

    def set_weights(self, weights: Mapping[str, Any]) -> None:
        """Takes the canonical mapping."""
        ...


# -- specs --------------------------------------------------------------------------------


def dense_spec(name: str, d_in: int | None, d_out: int | None, bias: bool) -> Spec:
    """``name.kernel (d_in, d_out)`` and, with ``bias``, ``name.bias (d_out,)``."""
    spec: Spec = {f"{name}.kernel": (d_in, d_out)}
    if bias:
        spec[f"{name}.bias"] = (d_out,)
    return spec


@dataclasses.dataclass(frozen=True)
class BlockOptions:
    """How a Transformer block and stack are made, beyond the 2017 post-norm ones.

    Attributes:
        norm_first: Pre-norm: ``x + dropout(sublayer(norm(x)))`` for each sublayer, and a
            stack normalises its output last (``norm.*``); False: ``norm(x + dropout(...))``.
        norm: ``"layer"`` (LayerNorm: ``ln.gamma``, ``ln.beta``) or ``"rms"`` (RMSNorm:
            ``ln.gamma`` only).
        norm_eps: The norms' epsilon; None for the norm's default (1e-5 layer, 1e-6 rms).
        activation: The FFN's: ``"relu"``, ``"gelu"`` (exact, with erf) or ``"swiglu"``
            (``dense2(silu(gate x) * dense1 x)``, with ``ffn.gate``).
        ffn_bias: Whether the FFN's dense layers have biases.
        output_bias: Whether a decoder stack's logits have a bias ``dense.bias``.
        tie_output: A decoder stack's logits are ``X @ token.embedding^T`` (no ``dense.kernel``).
        scale_embeddings: A stack multiplies its token embeddings by ``sqrt(h)``.
    """

    norm_first: bool = False
    norm: str = "layer"
    norm_eps: float | None = None
    activation: str = "relu"
    ffn_bias: bool = True
    output_bias: bool = True
    tie_output: bool = False
    scale_embeddings: bool = True

    def checked(self) -> BlockOptions:
        """The options checked (as every layer's constructor raises), numbers made plain."""
        flags = {name: checks.check_flag(name, getattr(self, name))
                 for name in ("norm_first", "ffn_bias", "output_bias", "tie_output",
                              "scale_embeddings")}
        return BlockOptions(norm=checks.check_norm(self.norm),
                            norm_eps=checks.check_eps(self.norm_eps),
                            activation=checks.check_activation(self.activation), **flags)

    @property
    def eps(self) -> float:
        """The norms' epsilon: ``norm_eps``, or the norm's default."""
        return norm_eps(self.norm, self.norm_eps)


#: The options of the 2017 (post-norm, LayerNorm, ReLU) blocks.
POST_NORM = BlockOptions()


def part_spec(part: str, sizes: Sequence[int | None], flag: Any = None,
              bias: bool | str = True, prefix: str = "") -> Spec:
    """The weights of one part of a block, derived from its flags (the one rule for them).

    Args:
        part: ``"attention"``: ``sizes`` are ``(q_in, k_in, v_in, h, kv_width)``, giving
            ``W_q (q_in, h)``, ``W_k (k_in, kv_width)``, ``W_v (v_in, kv_width)`` and
            ``W_o (h, h)``. ``"ffn"``: ``(d_in, f, out)``, ``flag`` the activation, giving
            ``dense1 (d_in, f)``, ``gate (d_in, f)`` (``"swiglu"`` only) and
            ``dense2 (f, out)``. ``"norm"``: ``(h,)``, ``flag`` the norm, giving
            ``ln.gamma (h,)`` and, for ``"layer"``, ``ln.beta (h,)``.
        sizes: See ``part``; None where unknown.
        flag: See ``part``.
        bias: The dense layers' biases: True, False, or ``"qkv"`` (an attention's ``W_q``,
            ``W_k`` and ``W_v`` only).
        prefix: Put before every name.
    """
    if part == "norm":
        (h,) = sizes
        names = ("ln.gamma", "ln.beta") if flag != "rms" else ("ln.gamma",)
        return {f"{prefix}{name}": (h,) for name in names}
    if part == "ffn":
        d_in, f, out = sizes
        layers = [("dense1", d_in, f), ("gate", d_in, f), ("dense2", f, out)]
        return {name: shape for layer, rows, cols in layers
                if layer != "gate" or flag == "swiglu"
                for name, shape in dense_spec(f"{prefix}{layer}", rows, cols, bool(bias)).items()}
    q_in, k_in, v_in, h, kv_width = sizes
    spec: Spec = {}
    for name, rows, cols in (("W_q", q_in, h), ("W_k", k_in, kv_width), ("W_v", v_in, kv_width),
                             ("W_o", h, h)):
        spec.update(dense_spec(f"{prefix}{name}", rows, cols,
                               bias is True or (bias == "qkv" and name != "W_o")))
    return spec


def names_bias(names: Any, prefix: str = "") -> bool | str:
    """An attention's ``bias`` as its weights' names show it (a functional call's mapping).

    ``"qkv"`` when ``W_q``, ``W_k`` and ``W_v`` have biases and ``W_o`` none; else whether any
    projection has one (the others are then expected too).
    """
    has = [f"{prefix}{name}.bias" in names for name in ("W_q", "W_k", "W_v", "W_o")]
    return "qkv" if all(has[:3]) and not has[3] else any(has)


def multi_head_spec(
    num_hiddens: int,
    num_heads: int,
    bias: bool | str = False,
    q_in: int | None = None,
    k_in: int | None = None,
    v_in: int | None = None,
    num_kv_heads: int | None = None,
    sinks: bool = False,
) -> Spec:
    """``W_q`` projects the queries to h = num_hiddens, ``W_o`` is ``(h, h)``.

    ``W_k`` and ``W_v`` project the keys and values to ``Hkv * h/H`` columns, Hkv =
    ``num_kv_heads`` (None: H; grouped-query attention when fewer): key/value head ``g``
    takes columns ``g*h/H : (g+1)*h/H``. With ``sinks``, ``sink_logits (H,)`` holds each
    head's attention-sink logit. ``bias``: True, False or ``"qkv"`` (no ``W_o.bias``).
    """
    num_hiddens, num_heads = check_heads(num_hiddens, num_heads)
    kv_width = check_kv_heads(num_heads, num_kv_heads) * (num_hiddens // num_heads)
    spec = part_spec("attention", (q_in, k_in, v_in, num_hiddens, kv_width), bias=bias)
    if sinks:
        spec["sink_logits"] = (num_heads,)
    return spec


def additive_spec(num_hiddens: int, q_in: int | None = None, k_in: int | None = None) -> Spec:
    """``W_q (q_in, h)``, ``W_k (k_in, h)``, ``w_v (h, 1)``, no biases."""
    num_hiddens = check_positive_int("num_hiddens", num_hiddens)
    return {
        **dense_spec("W_q", q_in, num_hiddens, False),
        **dense_spec("W_k", k_in, num_hiddens, False),
        **dense_spec("w_v", num_hiddens, 1, False),
    }


def ffn_spec(ffn_num_hiddens: int, ffn_num_outputs: int, d_in: int | None = None,
             activation: str = "relu", bias: bool = True) -> Spec:
    """``dense1 (d_in, f)``, ``gate (d_in, f)`` for swiglu, ``dense2 (f, out)``, biases per ``bias``."""
    ffn_num_hiddens = check_positive_int("ffn_num_hiddens", ffn_num_hiddens)
    ffn_num_outputs = check_positive_int("ffn_num_outputs", ffn_num_outputs)
    return part_spec("ffn", (d_in, ffn_num_hiddens, ffn_num_outputs), activation, bias)


def add_norm_spec(num_hiddens: int, norm: str = "layer") -> Spec:
    """``ln.gamma (h,)`` and, for ``norm="layer"``, ``ln.beta (h,)``."""
    num_hiddens = check_positive_int("num_hiddens", num_hiddens)
    return part_spec("norm", (num_hiddens,), norm)


def encoder_block_spec(
    num_hiddens: int, ffn_num_hiddens: int, num_heads: int, bias: bool | str = False,
    block: BlockOptions = POST_NORM, num_kv_heads: int | None = None,
) -> Spec:
    """``attention.*``, ``addnorm1.*``, ``ffn.*``, ``addnorm2.*``, all at width h."""
    h = num_hiddens
    return {
        **prefixed(multi_head_spec(h, num_heads, bias, h, h, h, num_kv_heads), "attention"),
        **prefixed(add_norm_spec(h, block.norm), "addnorm1"),
        **prefixed(ffn_spec(ffn_num_hiddens, h, h, block.activation, block.ffn_bias), "ffn"),
        **prefixed(add_norm_spec(h, block.norm), "addnorm2"),
    }


def relative_multi_head_spec(
    num_hiddens: int,
    num_heads: int,
    max_relative_position: int,
    bias: bool = False,
    relative_values: bool = True,
    q_in: int | None = None,
    k_in: int | None = None,
    v_in: int | None = None,
) -> Spec:
    """:func:`multi_head_spec` plus one vector per clipped offset, shared by the heads.

    ``rel_k.embedding (2m + 1, h/H)`` and, with ``relative_values``,
    ``rel_v.embedding (2m + 1, h/H)``.
    """
    num_hiddens, num_heads = check_heads(num_hiddens, num_heads)
    spec = multi_head_spec(num_hiddens, num_heads, bias, q_in, k_in, v_in)
    offsets = 2 * check_positive_int("max_relative_position", max_relative_position) + 1
    spec["rel_k.embedding"] = (offsets, num_hiddens // num_heads)
    if relative_values:
        spec["rel_v.embedding"] = (offsets, num_hiddens // num_heads)
    return spec


def transformer_encoder_spec(
    vocab_size: int,
    num_hiddens: int,
    ffn_num_hiddens: int,
    num_heads: int,
    num_blks: int,
    bias: bool | str = False,
    block: BlockOptions = POST_NORM,
) -> Spec:
    """``token.embedding (vocab_size, h)`` and each block's weights.

    Block ``i`` has the names of :func:`encoder_block_spec` under ``blks.<i>.``; with
    ``block.norm_first``, the final norm ``norm.*`` follows.
    """
    vocab_size = check_positive_int("vocab_size", vocab_size)
    num_hiddens = check_positive_int("num_hiddens", num_hiddens)
    spec: Spec = {"token.embedding": (vocab_size, num_hiddens)}
    for i in range(check_positive_int("num_blks", num_blks)):
        layers = encoder_block_spec(num_hiddens, ffn_num_hiddens, num_heads, bias, block)
        spec.update(prefixed(layers, f"blks.{i}"))
    if block.norm_first:
        spec.update(part_spec("norm", (num_hiddens,), block.norm, prefix="final_norm."))
    return spec


def learned_positional_spec(num_hiddens: int, max_len: int) -> Spec:
    """``P (1, max_len, h)``."""
    num_hiddens = check_positive_int("num_hiddens", num_hiddens)
    max_len = check_positive_int("max_len", max_len)
    return {"P": (1, max_len, num_hiddens)}


def nadaraya_watson_spec(parametric: bool) -> Spec:
    """``w (1,)`` when parametric, else nothing."""
    return {"w": (1,)} if parametric else {}


def prefixed(mapping: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """Puts ``prefix.`` before every name."""
    return {f"{prefix}.{name}": value for name, value in mapping.items()}


def subset(mapping: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """The entries under ``prefix.``, with the prefix removed.

    The result is still marked as checked if ``mapping`` was (:class:`CheckedWeights`).
    """
    if isinstance(mapping, CheckedWeights):
        return mapping.part(prefix)
    start = len(prefix) + 1
    return {name[start:]: v for name, v in mapping.items() if name.startswith(prefix + ".")}


# -- initialisation -----------------------------------------------------------------------


class InitRule(NamedTuple):
    """How one weight's initial values are drawn: ``kind`` with parameters ``a`` and ``b``.

    ``"uniform"`` draws from [a, b), ``"normal"`` from N(a, b**2), ``"constant"`` fills with a.
    """

    kind: str
    a: float
    b: float = 0.0


def init_rule(name: str, shape: tuple[int, ...]) -> InitRule:
    """The initialisation rule of a weight, from its canonical name's last part and its shape.

    Kernels ``(in, out)`` are Glorot-uniform, biases, ``beta`` and ``sink_logits`` zero, ``gamma``
    one, a learned table ``P`` normal with std 0.02, an ``embedding`` table ``(N, D)`` normal
    with std ``1 / sqrt(D)`` (unit-norm rows on average), a kernel width ``w`` uniform in
    [0, 1).
    Every backend draws these with its own random numbers.
    """
    leaf = name.rpartition(".")[2]
    if leaf == "kernel":
        limit = math.sqrt(6.0 / (shape[0] + shape[1]))
        return InitRule("uniform", -limit, limit)
    if leaf in ("bias", "beta", "gamma", "sink_logits"):
        return InitRule("constant", 1.0 if leaf == "gamma" else 0.0)
    if leaf == "P":
        return InitRule("normal", 0.0, 0.02)
    if leaf == "embedding":
        return InitRule("normal", 0.0, 1.0 / math.sqrt(shape[-1]))
    return InitRule("uniform", 0.0, 1.0)


def draw(rule: InitRule, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Draws ``rule`` with NumPy (float64)."""
    if rule.kind == "uniform":
        return rng.uniform(rule.a, rule.b, shape)
    if rule.kind == "normal":
        return rng.normal(rule.a, rule.b, shape)
    return np.full(shape, rule.a)


def init_weights(spec: Spec, rng: np.random.Generator, dtype: str = "float32") -> dict[str, Any]:
    """Draws initial weights for a fully known spec, by :func:`init_rule`, in spec order."""
    out: dict[str, Any] = {}
    for name, shape in spec.items():
        dims = _known_dims(name, shape)
        out[name] = draw(init_rule(name, dims), dims, rng).astype(dtype)
    return out


def _known_dims(name: str, shape: Shape) -> tuple[int, ...]:
    if any(d is None for d in shape):
        raise ValueError(f"{name} has unknown dimensions {fmt_shape(shape)}: call the layer first")
    return tuple(int(d) for d in shape if d is not None)


# -- checking -------------------------------------------------------------------------------


def check_names(spec: Spec, weights: Any, where: str) -> None:
    """Checks that ``weights`` is a mapping holding exactly the names of ``spec``.

    Raises:
        TypeError: ``weights`` is not a mapping, or has keys that are not str.
        ValueError: Missing or unexpected names (both listed, with the expected ones).
    """
    if not isinstance(weights, Mapping):
        raise TypeError(
            f"{where}: weights must be a mapping of name -> array, got {type(weights).__name__}"
        )
    check_keys(weights, where)
    missing = sorted(set(spec) - set(weights))
    unexpected = sorted(set(weights) - set(spec))
    if missing or unexpected:
        raise ValueError(
            f"{where}: missing weights {missing}, unexpected weights {unexpected}; "
            f"expected exactly {sorted(spec)}"
        )


def check_keys(weights: Mapping[Any, Any], where: str) -> None:
    """Checks that every key of a weights mapping is a str (a name); lists the others.

    Raises:
        TypeError: Some keys are not str (``set_weights: weight names must be str, got None, 1``).
    """
    bad = [key for key in weights if not isinstance(key, str)]
    if bad:
        raise TypeError(f"{where}: weight names must be str, got {', '.join(map(repr, bad))}")


def is_float_dtype(name: str) -> bool:
    """Whether a dtype name is real floating point.

    float16/32/64, longdouble (float96 or float128), bfloat16 and ml_dtypes' other floats; any
    byte order (the name has none).
    """
    return name.startswith(("float", "bfloat"))


def check_entries(
    spec: Spec,
    weights: Mapping[str, Any],
    where: str,
    shape_of: Callable[[Any], Sequence[Any]],
    dtype_of: Callable[[Any], str],
) -> None:
    """Checks each entry's dtype (real floating) and shape against ``spec``, in its order.

    The one check of ``set_weights``, ``load_weights`` and the functional API's weights, on
    NumPy arrays (``np.shape``) or on a backend's arrays (``ops.shape``: static shapes, so it
    costs nothing at run time under tracing). An unknown dimension (None, or not an int)
    matches any size.

    Args:
        spec: The expected names and shapes, all present in ``weights``.
        weights: Name -> array.
        where: The caller's name, for the message.
        shape_of: The shape of an array.
        dtype_of: The NumPy-style name of an array's dtype.

    Raises:
        TypeError: An entry is not real floating point.
        ValueError: An entry has the wrong shape.
    """
    for name, want in spec.items():
        value = weights[name]
        dtype = dtype_of(value)
        if not is_float_dtype(dtype):
            raise TypeError(f"{where}: {name} must be floating point, got {dtype}")
        shape = tuple(shape_of(value))
        if len(shape) != len(want) or any(
            isinstance(w, int) and isinstance(g, int) and g != w
            for g, w in zip(shape, want, strict=True)
        ):
            raise ValueError(
                f"{where}: {name} has shape {fmt_shape(shape)}, expected {fmt_shape(want)}"
            )


def host_dtype(dtype: str) -> np.dtype[Any]:
    """The NumPy dtype that weights for a layer of ``dtype`` are converted to on the host.

    ``dtype`` itself, except bfloat16 without ``ml_dtypes``: float32, which the framework then
    narrows.
    """
    if dtype == "bfloat16":
        try:
            import ml_dtypes

            return np.dtype(ml_dtypes.bfloat16)
        except ImportError:
            return np.dtype(np.float32)
    return np.dtype(dtype)


def check_weights(
    spec: Spec,
    weights: Mapping[str, Any],
    where: str = "set_weights",
    dtype: str | Mapping[str, str] | None = None,
) -> dict[str, np.ndarray]:
    """Checks every name, dtype and shape against a spec, then converts, before anything changes.

    Every real floating dtype NumPy can cast is accepted (either byte order, float16, float64,
    longdouble, bfloat16): with ``dtype`` given, each value is converted to it here (see
    :func:`host_dtype`), so a caller that converts every value to its framework's arrays and
    only then writes cannot fail half-way.

    Args:
        spec: The expected names and shapes (``None`` matches any size).
        weights: The mapping given by the user (arrays of any framework, read on the host by
            :func:`attention_core.host.host_array`).
        where: The caller's name, for the message.
        dtype: The layer's dtype name (one for every weight, or by name); None keeps each
            value's dtype, in native byte order.

    Returns:
        The weights as C-contiguous native-byte-order NumPy arrays, in the spec's order: new
        arrays, sharing no memory with the values given (writing into those later changes
        nothing here, nor in a layer that keeps these).

    Raises:
        TypeError: ``weights`` is not a mapping, or an entry is not floating point.
        ValueError: Missing or unexpected names, or a wrong shape.
    """
    check_names(spec, weights, where)
    arrays = {name: host_array(weights[name]) for name in spec}
    check_entries(spec, arrays, where, np.shape, lambda a: a.dtype.name)
    out: dict[str, np.ndarray] = {}
    for name, value in arrays.items():
        want = dtype.get(name) if isinstance(dtype, Mapping) else dtype
        target = value.dtype.newbyteorder("=") if want is None else host_dtype(want)
        out[name] = np.array(value, dtype=target, order="C", copy=True)
    return out


# -- the functional API's mappings ------------------------------------------------------------


class CheckedWeights(dict[str, Any]):
    """A weights mapping :func:`check_call_weights` has checked (with its inputs' widths).

    A call given one takes its inputs as checked too: the functional entry point or the layer
    that made it has checked them (ranks, dtypes, widths) against these weights. A layer whose
    framework keeps each parameter's shape (torch) passes its own parameters this way.

    The functional entry points check the mapping they are given once; the parts they call
    (a block's attention, an encoder's blocks) receive this type, directly or through
    :func:`subset`, and do not check it again.
    """

    def part(self, prefix: str) -> CheckedWeights:
        """The entries under ``prefix.``, prefix removed (:func:`subset`).

        The mapping is grouped by the first part of the names once, when a part is first
        asked for; a checked mapping is not changed after it is made.
        """
        groups: dict[str, CheckedWeights] | None = self.__dict__.get("_groups")
        if groups is None:
            groups = {}
            for name, value in self.items():
                head, dot, rest = name.partition(".")
                if dot:
                    groups.setdefault(head, CheckedWeights())[rest] = value
            self.__dict__["_groups"] = groups
        head, dot, rest = prefix.partition(".")
        found = groups.get(head, CheckedWeights())
        return found.part(rest) if dot else found


def check_call_weights(
    ops: Ops,
    where: str,
    weights: Any,
    spec_of: Callable[[Callable[[str, int, int], int | None]], Spec],
    inputs: Mapping[str, tuple[Array, str]] | None = None,
) -> CheckedWeights:
    """Checks a functional call's weights mapping as ``set_weights`` checks a layer's.

    The spec is made from the mapping itself: ``spec_of(size)`` reads the sizes it depends on
    (``size(name, axis, ndim)``: that axis of ``weights[name]`` when it is there with ``ndim``
    dimensions, else None) and leaves None where a size cannot be read. Then, with the
    messages of :func:`check_weights` (``where`` in place of ``set_weights``): the names, each
    entry's dtype (real floating) and shape, and last, each input's last dimension against
    the first dimension of its kernel. Only static shapes are read (``fixed_shape``), so under
    tracing the check is done once, when the graph is made. Entries that are not the backend's
    arrays (a layer's ``get_weights()``: NumPy, or another framework's tensors) are converted,
    keeping their dtype.

    Args:
        ops: The backend's ops.
        where: The function's name, for the messages.
        weights: The mapping given; a :class:`CheckedWeights` is returned as it is.
        spec_of: Makes the spec from a size reader.
        inputs: Input name -> (array, weight name): that array's last dimension must be the
            first dimension of that weight.

    Returns:
        The mapping of backend arrays, marked as checked.

    Raises:
        TypeError: ``weights`` is not a mapping, or an entry is not floating point.
        ValueError: Missing or unexpected names, a wrong shape, or an input whose width does
            not fit its kernel.
    """
    if isinstance(weights, CheckedWeights):
        return weights
    if not isinstance(weights, Mapping):
        check_names({}, weights, where)  # raises the TypeError

    def size(name: str, axis: int, ndim: int) -> int | None:
        if name not in weights:
            return None
        shape = tuple(fixed_shape(ops, weights[name]))
        return shape[axis] if len(shape) == ndim and isinstance(shape[axis], int) else None

    spec = spec_of(size)
    check_names(spec, weights, where)
    check_entries(spec, weights, where, lambda a: fixed_shape(ops, a), ops.dtype_name)
    for arg, (x, name) in (inputs or {}).items():
        want = tuple(fixed_shape(ops, weights[name]))
        got = ops.shape(x)[-1]
        if isinstance(got, int) and isinstance(want[0], int) and got != want[0]:
            raise ValueError(
                f"{arg} last dimension ({got}) must be {want[0]}, as {name} has shape "
                f"{fmt_shape(want)}"
            )
    return CheckedWeights({name: value if own(ops, value) else ops.from_numpy(host_array(value))
                           for name, value in weights.items()})


Size = Callable[[str, int, int], int | None]


def _heads(h: int | None, num_heads: int) -> None:
    if h is None:
        check_positive_int("num_heads", num_heads)
    else:
        check_heads(h, num_heads)


def additive_call_spec(size: Size) -> Spec:
    """The spec of ``additive_attention``'s mapping, sizes read off it (check_call_weights)."""
    h = size("W_q.kernel", 1, 2)
    if h is not None:
        check_positive_int("num_hiddens", h)
    return {
        **dense_spec("W_q", size("W_q.kernel", 0, 2), h, False),
        **dense_spec("W_k", size("W_k.kernel", 0, 2), h, False),
        **dense_spec("w_v", h, 1, False),
    }


def multi_head_call_spec(
    size: Size, names: Any, num_heads: int, prefix: str = "", width: int | None = None,
    num_kv_heads: int | None = None,
) -> Spec:
    """The spec of ``multi_head_attention``'s mapping (names under ``prefix``).

    h is ``W_q.kernel``'s output size; the projections have biases when any of them has one
    (``W_q``, ``W_k`` and ``W_v`` only when ``W_o`` has none: :func:`names_bias`).
    With ``width`` (a block's h), every input size is ``width``. ``W_k`` and ``W_v`` have
    ``num_kv_heads * h/H`` columns (None: H).
    """
    h = width if width is not None else size(f"{prefix}W_q.kernel", 1, 2)
    _heads(h, num_heads)
    kv_heads = check_kv_heads(num_heads, num_kv_heads)
    kv_width = None if h is None else kv_heads * (h // num_heads)
    d_in = [width if width is not None else size(f"{prefix}{name}.kernel", 0, 2)
            for name in ("W_q", "W_k", "W_v")]
    return part_spec("attention", (*d_in, h, kv_width), bias=names_bias(names, prefix),
                     prefix=prefix)


def with_sinks(spec: Spec, names: Any, num_heads: int) -> Spec:
    """``spec`` with ``sink_logits (H,)`` for each multi-head attention in it that ``names`` hold.

    For the core's multi-head functions, whose attentions may have sink logits
    (``MultiHeadAttention(sinks=True)``): an attention is a ``<prefix>W_q.kernel`` of the spec,
    its logits ``<prefix>sink_logits``. Specs not passed through it (the converters') refuse
    them.
    """
    for name in [n for n in spec if n.endswith("W_q.kernel")]:
        sinks = name[:-len("W_q.kernel")] + "sink_logits"
        if sinks in names:
            spec[sinks] = (num_heads,)
    return spec


def relative_call_spec(size: Size, names: Any, num_heads: int) -> Spec:
    """The spec of ``relative_multi_head_attention``'s mapping.

    :func:`multi_head_call_spec`'s, and ``rel_k.embedding`` (``rel_v.embedding`` too if
    given) of ``2m + 1`` rows (an odd number) and h/H columns.
    """
    spec = multi_head_call_spec(size, names, num_heads)
    h = size("W_q.kernel", 1, 2)
    depth = h // num_heads if h is not None else None
    rows = size("rel_k.embedding", 0, 2)
    rows = rows if rows is None or rows % 2 else rows + 1
    spec["rel_k.embedding"] = (rows, depth)
    if "rel_v.embedding" in names:
        spec["rel_v.embedding"] = (rows, depth)
    return spec


def ffn_call_spec(size: Size, prefix: str = "", width: int | None = None,
                  activation: str = "relu", bias: bool = True) -> Spec:
    """The spec of ``position_wise_ffn``'s mapping (under ``prefix``).

    With ``width`` (a block's h), the input and output sizes are ``width``. ``activation``
    and ``bias`` as the function takes them (:func:`part_spec`).
    """
    hidden = size(f"{prefix}dense1.kernel", 1, 2)
    d_in = width if width is not None else size(f"{prefix}dense1.kernel", 0, 2)
    out = width if width is not None else size(f"{prefix}dense2.kernel", 1, 2)
    return part_spec("ffn", (d_in, hidden, out), activation, bias, prefix)


def add_norm_call_spec(size: Size, prefix: str = "", width: int | None = None,
                       norm: str = "layer") -> Spec:
    """The spec of ``add_norm``'s mapping (under ``prefix``), of ``width`` if given."""
    h = width if width is not None else size(f"{prefix}ln.gamma", 0, 1)
    return part_spec("norm", (h,), norm, prefix=prefix)


def block_call_spec(
    size: Size, names: Any, num_heads: int, prefix: str = "", width: int | None = None,
    num_kv_heads: int | None = None, block: BlockOptions = POST_NORM,
) -> Spec:
    """The spec of ``transformer_encoder_block``'s mapping (under ``prefix``).

    Every part has the width h: ``width`` if given (an encoder's), else the output size of
    ``attention.W_q.kernel``; its norms and FFN are those of ``block``.
    """
    h = width if width is not None else size(f"{prefix}attention.W_q.kernel", 1, 2)
    return {
        **multi_head_call_spec(size, names, num_heads, f"{prefix}attention.", h, num_kv_heads),
        **add_norm_call_spec(size, f"{prefix}addnorm1.", h, block.norm),
        **ffn_call_spec(size, f"{prefix}ffn.", h, block.activation, block.ffn_bias),
        **add_norm_call_spec(size, f"{prefix}addnorm2.", h, block.norm),
    }


def count_blocks(names: Any, prefix: str = "") -> int:
    """How many blocks ``<prefix>blks.<i>.*`` a stack's names hold (numbered from 0)."""
    if isinstance(names, CheckedWeights):  # not changed after it is made: counted once
        counted = names.__dict__.setdefault("_blocks", {})
        if prefix not in counted:
            counted[prefix] = _count_blocks(names, prefix)
        return int(counted[prefix])
    return _count_blocks(names, prefix)


def _count_blocks(names: Any, prefix: str) -> int:
    start = f"{prefix}blks."
    return len({name[len(start):].split(".")[0] for name in names if name.startswith(start)})


def encoder_call_spec(size: Size, names: Any, num_heads: int, prefix: str = "",
                      num_kv_heads: int | None = None, block: BlockOptions = POST_NORM) -> Spec:
    """The spec of ``transformer_encoder``'s mapping (under ``prefix``).

    ``token.embedding (V, h)``, one block of width h per distinct ``blks.<i>`` prefix in
    the mapping, numbered from 0, and with ``block.norm_first`` the final norm ``norm.*``.
    """
    h = size(f"{prefix}token.embedding", 1, 2)
    spec: Spec = {f"{prefix}token.embedding": (size(f"{prefix}token.embedding", 0, 2), h)}
    for i in range(count_blocks(names, prefix)):
        spec.update(block_call_spec(size, names, num_heads, f"{prefix}blks.{i}.", h,
                                    num_kv_heads, block))
    if block.norm_first:
        spec.update(part_spec("norm", (h,), block.norm, prefix=f"{prefix}final_norm."))
    return spec


def decoder_block_call_spec(
    size: Size, names: Any, num_heads: int, prefix: str = "", width: int | None = None,
    crossed: bool | None = None, num_kv_heads: int | None = None,
    block: BlockOptions = POST_NORM,
) -> Spec:
    """The spec of ``transformer_decoder_block``'s mapping (under ``prefix``).

    Every part has the width h (``width`` if given, else the output size of
    ``self_attention.W_q.kernel``), but the cross-attention's keys and values, whose input
    size is the encoder outputs' width. The block has cross-attention if ``crossed``, or when
    None, if the mapping holds ``cross_attention.W_q.kernel``. Its add & norms are numbered by
    the sublayer they follow (with ``block.norm_first``, they normalise its input). The
    self-attention has ``num_kv_heads`` key/value heads; the norms and FFN are ``block``'s.
    """
    h = width if width is not None else size(f"{prefix}self_attention.W_q.kernel", 1, 2)
    spec: Spec = {
        **multi_head_call_spec(size, names, num_heads, f"{prefix}self_attention.", h,
                               num_kv_heads),
        **add_norm_call_spec(size, f"{prefix}addnorm1.", h, block.norm),
    }
    if crossed is None:
        crossed = f"{prefix}cross_attention.W_q.kernel" in names
    if crossed:
        cross = f"{prefix}cross_attention."
        d_in = (h, size(f"{cross}W_k.kernel", 0, 2), size(f"{cross}W_v.kernel", 0, 2))
        spec.update(part_spec("attention", (*d_in, h, h), bias=names_bias(names, cross),
                              prefix=cross))
        spec.update(add_norm_call_spec(size, f"{prefix}addnorm2.", h, block.norm))
    spec.update(ffn_call_spec(size, f"{prefix}ffn.", h, block.activation, block.ffn_bias))
    spec.update(add_norm_call_spec(size, f"{prefix}addnorm{3 if crossed else 2}.", h,
                                   block.norm))
    return spec


def decoder_call_spec(
    size: Size, names: Any, num_heads: int, prefix: str = "", crossed: bool | None = None,
    num_kv_heads: int | None = None, block: BlockOptions = POST_NORM,
) -> Spec:
    """The spec of ``transformer_decoder``'s mapping (under ``prefix``).

    ``token.embedding (V, h)``, one block of width h per distinct ``blks.<i>`` prefix, each
    with cross-attention if ``crossed`` (when None: if block 0 has it), with
    ``block.norm_first`` the final norm ``norm.*``, then ``dense.kernel (h, V_out)`` (none
    with ``block.tie_output``: V_out = V) and ``dense.bias (V_out,)`` (per
    ``block.output_bias``).
    """
    vocab, h = size(f"{prefix}token.embedding", 0, 2), size(f"{prefix}token.embedding", 1, 2)
    spec: Spec = {f"{prefix}token.embedding": (vocab, h)}
    if crossed is None:
        crossed = f"{prefix}blks.0.cross_attention.W_q.kernel" in names
    for i in range(count_blocks(names, prefix)):
        spec.update(decoder_block_call_spec(size, names, num_heads, f"{prefix}blks.{i}.", h,
                                            crossed, num_kv_heads, block))
    if block.norm_first:
        spec.update(part_spec("norm", (h,), block.norm, prefix=f"{prefix}final_norm."))
    spec.update(output_spec(h, vocab if block.tie_output else size(f"{prefix}dense.kernel", 1, 2),
                            block, prefix))
    return spec


def output_spec(h: int | None, vocab: int | None, block: BlockOptions, prefix: str = "") -> Spec:
    """A decoder stack's logits: ``dense.kernel (h, V)`` unless tied, ``dense.bias (V,)`` if any."""
    spec: Spec = {} if block.tie_output else {f"{prefix}dense.kernel": (h, vocab)}
    if block.output_bias:
        spec[f"{prefix}dense.bias"] = (vocab,)
    return spec


def transformer_call_spec(size: Size, names: Any, num_heads: int,
                          block: BlockOptions = POST_NORM) -> Spec:
    """The spec of ``transformer``'s mapping: ``encoder.*`` and ``decoder.*``.

    The decoder's blocks have cross-attention, from the encoder's width to the decoder's.
    """
    return {**encoder_call_spec(size, names, num_heads, "encoder.", block=block),
            **decoder_call_spec(size, names, num_heads, "decoder.", crossed=True, block=block)}


# -- safetensors files ----------------------------------------------------------------------

_ST_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4"}
_ST_NAMES = {np.dtype(v).name: k for k, v in _ST_DTYPES.items()}


#: The header key the format reserves for the file's metadata (a str -> str object).
METADATA_KEY = "__metadata__"

#: The largest header the ``safetensors`` package reads (100 MB); larger ones are refused.
MAX_HEADER_BYTES = 100_000_000


def write_safetensors(path: str | os.PathLike[str], tensors: Mapping[str, np.ndarray]) -> None:
    """Writes arrays to a safetensors file (little-endian, C order, 8-byte aligned header).

    Every tensor is encoded before the file is touched, and the file is written atomically
    (:func:`attention_core.files.atomic_write`): a failed save leaves the previous file as it
    was, or no file.

    Raises:
        ValueError: A tensor is named ``__metadata__``, the key the format reserves.
        TypeError: A tensor's dtype is not one of float64, float32, float16, bfloat16, int64
            and int32.
        OSError: The file cannot be written (a path that is a directory, or whose directory
            does not exist, is named in the message: :func:`attention_core.files.check_writable`).
    """
    header: dict[str, Any] = {METADATA_KEY: {"format": "attention-core"}}
    blobs, offset = [], 0
    for name in sorted(tensors):
        if name == METADATA_KEY:
            raise ValueError(
                f"save_weights: a weight may not be named {METADATA_KEY!r}: the safetensors "
                "format reserves that key for the file's metadata"
            )
        array = np.asarray(tensors[name])
        if array.dtype.name == "bfloat16":
            code, raw = "BF16", np.ascontiguousarray(array).view("<u2").tobytes()
        elif array.dtype.name in _ST_NAMES:
            code = _ST_NAMES[array.dtype.name]
            raw = np.ascontiguousarray(array, dtype=_ST_DTYPES[code]).tobytes()
        else:
            raise TypeError(f"save_weights: {name} has unsupported dtype {array.dtype.name}")
        header[name] = {"dtype": code, "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with files.atomic_write(path, "save_weights") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for raw in blobs:
            f.write(raw)


def read_safetensors(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """Reads every array of a safetensors file, checking the file's structure.

    BF16 tensors are widened to float32 (exactly) when ``ml_dtypes`` is not installed.

    Every message names the file and what is wrong with it; nothing is returned from a file
    with any fault. The rules are at least those of the ``safetensors`` package: the tensors'
    data must tile the data area exactly (no overlap, no gap, no byte after the last tensor).

    Raises:
        OSError: The file cannot be read (e.g. FileNotFoundError).
        ValueError: The file is truncated, or not a safetensors file: too short for the header
            length, a header that runs past the end, is larger than 100 MB or is not a JSON
            object, a key given twice in the header, a ``__metadata__`` entry that is not an
            object of str -> str, an entry without a string dtype, a list of non-negative int
            dims and two non-negative int data offsets, a dtype other than F64, F32, F16,
            BF16, I64 and I32, data that lies outside the file or does not match the entry's
            dtype and shape, or data areas that overlap, leave bytes between them, or leave
            bytes after the last one.
    """
    with open(path, "rb") as f:
        data = f.read()
    bad = f"load_weights: {os.fspath(path)!r} is not a valid safetensors file"
    if len(data) < 8:
        raise ValueError(f"{bad}: only {len(data)} bytes")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise ValueError(f"{bad}: header of {n} bytes runs past the end of the file")
    if n > MAX_HEADER_BYTES:
        raise ValueError(f"{bad}: header of {n} bytes is larger than {MAX_HEADER_BYTES} bytes")
    try:
        header = json.loads(data[8 : 8 + n], object_pairs_hook=_no_duplicates)
    except _DuplicateKeyError as err:
        raise ValueError(f"{bad}: key {err.args[0]!r} appears twice in the header") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError(f"{bad}: header is not JSON") from None
    if not isinstance(header, dict):
        raise ValueError(f"{bad}: header is not a JSON object")
    metadata = header.get(METADATA_KEY, {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError(
            f"{bad}: {METADATA_KEY} must be an object of str -> str, got {_brief(metadata)}"
        )
    body = memoryview(data)[8 + n :]
    entries = {}
    for name, info in header.items():
        if name == METADATA_KEY:
            continue
        code, shape, (start, end) = _entry(bad, name, info)
        if code != "BF16" and code not in _ST_DTYPES:
            raise ValueError(f"{bad}: entry {name!r} has unsupported dtype {code}")
        itemsize = 2 if code == "BF16" else np.dtype(_ST_DTYPES[code]).itemsize
        if not start <= end <= len(body) or end - start != itemsize * math.prod(shape):
            raise ValueError(f"{bad}: data of {name!r} is truncated or misplaced")
        entries[name] = (code, shape, start, end)
    _check_tiling(bad, {name: (e[2], e[3]) for name, e in entries.items()}, len(body))
    return {name: _decode(code, body[start:end], shape)
            for name, (code, shape, start, end) in entries.items()}


class _DuplicateKeyError(Exception):
    """A JSON object of the header has a key twice (json.loads would keep the last silently)."""


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKeyError(key)
        out[key] = value
    return out


def _brief(value: Any) -> str:
    """A short description of a JSON value for a message (its repr, cut at 60 characters)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_tiling(bad: str, spans: dict[str, tuple[int, int]], size: int) -> None:
    """Checks that the tensors' ``[start, end)`` spans tile ``[0, size)`` exactly.

    Raises:
        ValueError: Two spans overlap, bytes lie before the first span or between two spans
            (belonging to no tensor), or bytes follow the last span.
    """
    previous: tuple[str, int] | None = None  # the name and end of the span before
    for name, (start, end) in sorted(spans.items(), key=lambda item: (item[1], item[0])):
        at = 0 if previous is None else previous[1]
        if start < at:
            assert previous is not None
            raise ValueError(
                f"{bad}: data of {name!r} (bytes {start} to {end}) overlaps data of "
                f"{previous[0]!r} (ending at byte {at})"
            )
        if start > at:
            after = "the start of the data" if previous is None else f"data of {previous[0]!r}"
            raise ValueError(
                f"{bad}: {start - at} bytes between {after} and data of {name!r} belong to "
                "no tensor"
            )
        previous = (name, end)
    at = 0 if previous is None else previous[1]
    if size > at:
        raise ValueError(f"{bad}: {size - at} bytes after the last tensor's data belong to no tensor")


def _count(x: Any) -> bool:
    """Whether ``x`` is a non-negative int (JSON numbers only; not a bool)."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _entry(bad: str, name: str, info: Any) -> tuple[str, tuple[int, ...], tuple[int, int]]:
    """The dtype code, shape and data offsets of one header entry, checked."""
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise ValueError(
            f"{bad}: entry {name!r} is malformed: expected an object with dtype, shape and "
            "data_offsets"
        )
    code, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(code, str):
        raise ValueError(f"{bad}: entry {name!r} has dtype {code!r}, expected a string such as 'F32'")
    if not isinstance(shape, list) or not all(_count(d) for d in shape):
        raise ValueError(
            f"{bad}: entry {name!r} has shape {shape!r}, expected a list of non-negative ints"
        )
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_count(o) for o in offsets):
        raise ValueError(
            f"{bad}: entry {name!r} has data_offsets {offsets!r}, expected [start, end], two "
            "non-negative ints"
        )
    return code, tuple(shape), (offsets[0], offsets[1])


def _decode(code: str, raw: memoryview, shape: tuple[int, ...]) -> np.ndarray:
    if code != "BF16":
        return np.frombuffer(raw, dtype=_ST_DTYPES[code]).reshape(shape).copy()
    bits = np.frombuffer(raw, dtype="<u2").reshape(shape)
    try:
        import ml_dtypes

        return bits.view(ml_dtypes.bfloat16).copy()
    except ImportError:
        return (bits.astype(np.uint32) << 16).view(np.float32)


def flatten_tree(tree: Mapping[str, Any], prefix: str = "", where: str = "weights"
                 ) -> dict[str, Any]:
    """Nested mappings -> canonical names: ``{"W_q": {"kernel": a}}`` -> ``{"W_q.kernel": a}``.

    Flat entries pass through unchanged, so a flat canonical mapping is its own result.

    Raises:
        TypeError: A key at any level is not a str (:func:`check_keys`; ``where`` names the
            caller).
    """
    check_keys(tree, where)
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update(flatten_tree(value, f"{prefix}{key}.", where))
        else:
            out[f"{prefix}{key}"] = value
    return out


#: Collections of a Flax variables dict that hold no weights and are left out of a file.
NON_WEIGHT_COLLECTIONS = ("intermediates",)


def canonical_weights(
    source: HasWeights | Mapping[str, Any], where: str = "save_weights"
) -> dict[str, np.ndarray]:
    """The flat canonical mapping of a layer, a canonical mapping or a Flax variables pytree.

    Args:
        source: A layer with ``get_weights()`` (numpy, torch, Keras, Gluon); a flat mapping of
            canonical names; or nested mappings whose paths joined with dots are the canonical
            names: Flax params (``{"W_q": {"kernel": ...}}``) or variables
            (``{"params": {...}}``, other collections than ``'intermediates'`` refused).
        where: The caller's name, for the messages.

    Returns:
        Canonical name -> NumPy array (via :func:`attention_core.host.host_array`; no
        framework is imported).

    Raises:
        TypeError: ``source`` is neither, or a leaf is not an array.
        ValueError: Flax variables hold collections other than params.
    """
    if isinstance(source, Mapping):
        tree: Mapping[str, Any] = source
        if isinstance(source.get("params"), Mapping):  # Flax variables; no canonical name is "params"
            others = sorted(k for k, v in source.items()
                            if k != "params" and k not in NON_WEIGHT_COLLECTIONS and v)
            if others:
                raise ValueError(
                    f"{where}: the Flax variables hold collections {others} besides 'params'; "
                    "the canonical layout has weights (params) only"
                )
            tree = source["params"]
        flat = flatten_tree(tree, where=where)
    elif callable(getattr(source, "get_weights", None)):
        flat = dict(source.get_weights())
    else:
        raise TypeError(
            f"{where}: expected a layer with get_weights() or a mapping of canonical name -> "
            f"array (for Flax, the variables or params pytree), got {type(source).__name__}"
        )
    out = {}
    for name, value in flat.items():
        if value is None or isinstance(value, (str, bytes)):
            raise TypeError(f"{where}: {name} must be an array, got {type(value).__name__}")
        out[name] = host_array(value)
    return out


def save_weights(
    path: str | os.PathLike[str], layer: HasWeights | Mapping[str, Any]
) -> None:
    """Saves canonical weights to one safetensors file, whatever the framework.

    Args:
        path: The file to write.
        layer: A layer with ``get_weights()`` (numpy, torch, Keras, Gluon), a canonical mapping,
            or, for Flax, what ``init`` returns (``{"params": ...}``) or the params tree:
            its paths joined with dots are the canonical names.

    The weights are read and encoded first, then written atomically: a save that fails (an
    unbuilt layer, a reserved name, a full disk) leaves the previous file byte for byte, or
    no file, and no temporary file.

    Raises:
        TypeError: ``layer`` is neither a layer nor a mapping, or a weight has a dtype the
            file cannot hold.
        ValueError: The layer has no weights yet, or a weight is named ``__metadata__``.
        OSError: The file cannot be written: ``IsADirectoryError`` for a directory,
            ``FileNotFoundError`` for a path whose directory does not exist, each naming the
            path given.
    """
    write_safetensors(path, canonical_weights(layer, "save_weights"))


def load_weights(
    path: str | os.PathLike[str], layer: HasWeights | None = None
) -> dict[str, np.ndarray]:
    """Reads canonical weights from a safetensors file and, if given a layer, sets them.

    The layer checks every name and shape before changing anything. Flax modules hold no
    weights: call ``load_weights(path)`` and pass the mapping to
    ``backends.jax.init_from_weights(module, mapping)`` or
    ``backends.jax.set_weights(variables, mapping)``.

    Returns:
        The flat mapping read from the file (canonical name -> NumPy array).

    Raises:
        TypeError: ``layer`` has no ``set_weights`` (e.g. a Flax module), or (naming the file)
            a weight in the file is not floating point.
        ValueError: The file is not a valid safetensors file (see :func:`read_safetensors`),
            or (naming the file) its names or shapes do not fit the layer. The layer is then
            left as it was.
        OSError: The file cannot be read.
    """
    if layer is not None and not callable(getattr(layer, "set_weights", None)):
        raise TypeError(
            f"load_weights: {type(layer).__name__} has no set_weights(); for a Flax module, "
            "use backends.jax.init_from_weights(module, load_weights(path)) or "
            "backends.jax.set_weights(variables, load_weights(path))"
        )
    weights = read_safetensors(path)
    if layer is not None:
        try:
            layer.set_weights(weights)  # checks every name and shape before changing anything
        except (TypeError, ValueError) as err:
            if type(err) not in (TypeError, ValueError):  # a subclass may take other arguments
                raise
            raise type(err)(f"load_weights: {os.fspath(path)!r} does not fit the layer: {err}") from err
    return weights
