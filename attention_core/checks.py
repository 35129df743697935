"""Argument validation shared by the core and every adapter.

Each check raises with a message that names the argument, what it was and what was expected.
The messages are produced here only, so they are identical on every backend. Checks never
modify their arguments. Dimensions that are unknown until run time (a tensor instead of an
int, under tracing) are skipped.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

from attention_core.host import framework_of, plain
from attention_core.ops import FLOAT_DTYPES, Array, Ops


def _known(dim: Any) -> bool:
    return isinstance(dim, int)


def fmt_shape(shape: Sequence[Any]) -> str:
    """Formats a shape like NumPy, with ``?`` for dimensions known only at run time."""
    dims = [str(d) if _known(d) else "?" for d in shape]
    return "(" + ", ".join(dims) + ("," if len(dims) == 1 else "") + ")"


def check_dropout(dropout: float) -> float:
    """Checks a dropout rate (a Python or NumPy number) and returns it as a float."""
    if type(dropout) is float and 0.0 <= dropout < 1.0:  # the usual case, at every call
        return dropout
    dropout = plain(dropout)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)):
        raise TypeError(f"dropout must be a float in [0, 1), got {type(dropout).__name__}")
    if not 0.0 <= float(dropout) < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")
    return float(dropout)


#: The values of every ``implementation`` argument (None = choose automatically).
IMPLEMENTATIONS = ("direct", "blockwise", "fused")


def check_implementation(implementation: Any) -> str | None:
    """Checks an ``implementation`` argument: None, or the name of a kernel.

    The names are ``"direct"``, ``"blockwise"``, ``"fused"`` and those registered with
    :func:`attention_core.kernels.register_kernel`; whether the backend has it is checked when
    the call runs.
    """
    from attention_core.kernels import registered_names

    if implementation is not None and not isinstance(implementation, str):
        raise TypeError(f"implementation must be None or a kernel's name (str), got "
                        f"{type(implementation).__name__}")
    if implementation is not None and implementation not in {*IMPLEMENTATIONS,
                                                             *registered_names()}:
        raise ValueError(
            f"implementation must be None, 'direct', 'blockwise', 'fused' or a registered "
            f"kernel's name, got {implementation!r}"
        )
    return implementation


def check_causal(causal: Any) -> bool:
    """Checks ``causal``: True or False (NumPy's bool too)."""
    if causal is True or causal is False:
        return causal
    causal = plain(causal)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    return causal


def check_return_weights(return_weights: Any) -> None:
    """Checks ``return_weights``: a truth value, or the one string ``"on read"``."""
    if isinstance(return_weights, str) and return_weights != "on read":
        raise ValueError(
            f"return_weights must be True, False or 'on read', got {return_weights!r}"
        )


def check_positive_int(name: str, value: Any) -> int:
    """Checks that a size argument is a positive int (Python or NumPy) and returns it as an int."""
    if type(value) is int and value > 0:
        return value
    value = plain(value)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def check_flag(name: str, value: Any) -> bool:
    """Checks a yes/no argument: True or False (Python or NumPy); a string or number is refused."""
    if value is True or value is False:
        return value
    value = plain(value)
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def check_mode_flag(name: str, value: Any) -> Any:
    """:func:`check_flag` of a call's ``training`` or ``deterministic``, when given as a value.

    None and a framework's tensor (Keras' symbolic ``training``) are returned as they are.
    """
    if value is None or (hasattr(value, "shape") and framework_of(value) != "numpy"):
        return value
    return check_flag(name, value)


def check_scale(scale: Any) -> float | None:
    """Checks a ``scale`` argument: None, or a positive finite number (Python or NumPy).

    Returns:
        The scale as a float, or None.
    """
    scale = plain(scale)
    if scale is None:
        return None
    if (
        isinstance(scale, bool)
        or not isinstance(scale, (int, float))
        or not 0 < scale < math.inf
    ):
        raise ValueError(f"scale must be a positive finite float or None, got {scale!r}")
    return float(scale)


def check_heads(num_hiddens: int, num_heads: int) -> tuple[int, int]:
    """Checks that ``num_hiddens`` splits evenly into ``num_heads``; returns both as ints."""
    num_hiddens = check_positive_int("num_hiddens", num_hiddens)
    num_heads = check_positive_int("num_heads", num_heads)
    if num_hiddens % num_heads:
        raise ValueError(
            f"num_hiddens ({num_hiddens}) must be divisible by num_heads ({num_heads})"
        )
    return num_hiddens, num_heads


def check_floating(ops: Ops, name: str, x: Array) -> str:
    """Checks that ``x`` has a real floating dtype and returns the dtype's name.

    Complex arrays get a message of their own: attention over complex numbers (a softmax of
    complex scores) is not defined here, and they are not silently cast to real.
    """
    dtype = ops.dtype_name(x)
    if dtype.startswith("complex"):
        raise TypeError(
            f"{name} must be real floating point ({', '.join(FLOAT_DTYPES)}), got {dtype}: "
            "complex inputs are not supported"
        )
    if dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} must be floating point ({', '.join(FLOAT_DTYPES)}), got {dtype}"
        )
    return dtype


def check_matmul_dtype(ops: Ops, name: str, x: Array) -> None:
    """Refuses, before any work, a floating dtype the backend cannot multiply matrices in.

    A backend says so with an optional ``ops.matmul_refusal(x) -> str | None``: why arrays
    like ``x`` cannot be multiplied (MXNet: float16 on CPU), or None when they can.
    """
    refusal = getattr(ops, "matmul_refusal", None)
    why = refusal(x) if refusal is not None else None
    if why:
        raise TypeError(
            f"{name} dtype {ops.dtype_name(x)} is not supported by the {ops.name} backend: {why}"
        )


def compute_inputs(ops: Ops, dtype: str | None, **inputs: Array) -> list[Array]:
    """The dtype rule: a layer with weights computes in its own compute dtype.

    The inputs are checked to be arrays of one framework (:func:`check_framework`), each to be
    real floating point (:func:`check_floating`'s messages), then
    cast to ``dtype`` when it has another floating dtype, as Keras' autocast does: a float32
    layer given float64 or float16 inputs computes in float32 and returns float32. A layer
    without weights passes ``dtype=None`` and computes in its inputs' dtype (which must then
    agree, as the core checks).

    Args:
        ops: The backend's ops.
        dtype: The layer's compute dtype (that of its weights), or None.
        **inputs: The inputs computed on, by argument name (None entries are passed through).

    Returns:
        The inputs, in order, cast where needed.
    """
    check_inputs_framework(**inputs)
    out = []
    for name, x in inputs.items():
        if x is not None and check_floating(ops, name, x) != dtype and dtype is not None:
            x = ops.astype(x, dtype)
        out.append(x)
    return out


def check_rank(ops: Ops, name: str, x: Array, ranks: Sequence[int], legend: str) -> tuple[Any, ...]:
    """Checks the rank of ``x`` and returns its shape.

    Args:
        ops: The backend's ops.
        name: The argument's name, for the message.
        x: The array.
        ranks: The allowed ranks.
        legend: The expected shapes in words, e.g. ``"(B, Q, D) or (B, H, Q, D)"``.
    """
    shape = tuple(ops.shape(x))
    check_rank_of(name, shape, ranks, legend)  # also refuses an empty dimension
    return shape


def check_rank_of(name: str, shape: tuple[Any, ...], ranks: Sequence[int], legend: str) -> None:
    """:func:`check_rank` and :func:`check_not_empty` of a shape (host data's, read on the host)."""
    if len(shape) not in ranks:
        raise ValueError(f"{name} must have shape {legend}, got {fmt_shape(shape)}")
    if 0 in [d for d in shape if isinstance(d, int)]:  # a run-time size is not compared
        raise ValueError(f"{name} must not have an empty dimension, got {fmt_shape(shape)}")


def check_not_empty(ops: Ops, name: str, x: Array) -> tuple[Any, ...]:
    """Checks that no known dimension of ``x`` is 0 and returns its shape.

    An empty array is refused before any framework op sees it (MXNet's engine would report
    its failure only at a later, unrelated call).
    """
    shape = ops.shape(x)
    if 0 in [d for d in shape if isinstance(d, int)]:  # a run-time size is not compared
        raise ValueError(f"{name} must not have an empty dimension, got {fmt_shape(shape)}")
    return shape


def check_framework(ref_name: str, ref: Array, **others: Array) -> None:
    """Checks that the main inputs of a call are arrays of one framework, that of ``ref``.

    Host-side arguments (lengths, masks, weights to set) may come from any framework and are
    converted (:mod:`attention_core.host`); the inputs computed on are never converted, so
    mixing frameworks there is refused, with both frameworks named.

    Args:
        ref_name: The first input's name (``"queries"``, ``"X"``), for the message.
        ref: The first input.
        **others: The other inputs by name.
    """
    want = framework_of(ref)
    if want is None:
        raise TypeError(
            f"{ref_name} must be an array of numpy, torch, tensorflow, jax or mxnet, "
            f"got {type(ref).__name__}"
        )
    for name, x in others.items():
        owner = framework_of(x)
        if owner != want:
            got = f"a {owner} array" if owner is not None else type(x).__name__
            raise TypeError(f"{name} must be a {want} array like {ref_name}, got {got}")


def check_inputs_framework(**inputs: Array) -> None:
    """:func:`check_framework` of the given inputs (None entries skipped) against the first."""
    given = {name: x for name, x in inputs.items() if x is not None}
    if given:
        first, *others = given
        check_framework(first, given[first], **{name: given[name] for name in others})


def check_same_dtype(ops: Ops, ref_name: str, ref: Array, **others: Array) -> None:
    """Checks that every array in ``others`` has the dtype of ``ref``.

    Skipped while the ops mix dtypes (``ops.mixes_dtypes``, under ``torch.autocast``).
    """
    if getattr(ops, "mixes_dtypes", False):
        return
    want = ops.dtype_name(ref)
    for name, x in others.items():
        got = ops.dtype_name(x)
        if got != want:
            raise TypeError(f"{name} dtype ({got}) must match {ref_name} dtype ({want})")


def check_equal(what: str | Callable[[], str], a: Any, b: Any) -> None:
    """Raises ``ValueError`` with the message ``what`` when two known dimensions differ.

    ``what`` may be a function making the message, called only on failure: a message that
    names a dimension must be made that way, since formatting a symbolic dimension (a length
    under ``torch.compile(dynamic=True)``) fixes it to its value and the trace to that length.
    """
    if _known(a) and _known(b) and a != b:
        raise ValueError(what if isinstance(what, str) else what())


def check_batch(ops: Ops, name: str, x: Array, like_name: str, like: Array) -> None:
    """Checks that ``x``'s batch (first) axis equals ``like``'s: no broadcasting of examples.

    An argument paired with another example by example (a decoder's encoder outputs and its
    tokens, a cache and the step's input) must have its batch size exactly, never 1 for all.
    """
    x_shape, like_shape = ops.shape(x), ops.shape(like)
    if not x_shape or not like_shape:
        return  # a scalar: refused for its rank where it is read
    got, want = x_shape[0], like_shape[0]
    check_equal(functools.partial("{0} batch size ({1}) must equal {2} batch size ({3})".format,
                                  name, got, like_name, want), got, want)


def check_qkv(ops: Ops, queries: Array, keys: Array, values: Array) -> None:
    """Checks queries ``(B, [H,] Q, D)``, keys ``(B, [H,] K, D)``, values ``(B, [H,] K, Dv)``."""
    check_framework("queries", queries, keys=keys, values=values)
    legend = "(B, Q, D) or (B, H, Q, D)"
    q = check_rank(ops, "queries", queries, (3, 4), legend)
    k = check_rank(ops, "keys", keys, (len(q),), legend.replace("Q", "K") + " like queries")
    v = check_rank(ops, "values", values, (len(q),), "(B, [H,] K, Dv) like queries")
    for name, x in (("queries", queries), ("keys", keys), ("values", values)):
        check_floating(ops, name, x)
    check_same_dtype(ops, "queries", queries, keys=keys, values=values)
    check_matmul_dtype(ops, "queries", queries)
    check_equal(lambda: f"queries depth ({q[-1]}) must equal keys depth ({k[-1]})", q[-1], k[-1])
    check_equal(
        lambda: f"keys and values must have the same length, got {k[-2]} keys and {v[-2]} values",
        k[-2],
        v[-2],
    )
    for name, s in (("keys", k), ("values", v)):
        check_equal(
            functools.partial("{0} batch size ({1}) must equal queries batch size ({2})".format,
                              name, s[0], q[0]),
            s[0],
            q[0],
        )
    if len(q) == 4:  # grouped-query heads: the keys' heads divide the queries'
        check_equal(lambda: f"values heads size ({v[1]}) must equal keys heads size ({k[1]})",
                    v[1], k[1])
        if _known(k[1]) and _known(q[1]) and q[1] % k[1]:
            raise ValueError(f"keys heads size ({k[1]}) must divide queries heads size ({q[1]}): "
                             "each key/value head serves an equal group of query heads")


def check_last_dim(ops: Ops, name: str, x: Array, expected: int) -> None:
    """Checks the size of the last axis (e.g. the model width a layer was built for)."""
    got = ops.shape(x)[-1]
    check_equal(lambda: f"{name} last dimension ({got}) must be {expected}", got, expected)


def check_built_size(arg: str, size: Any, built: int | None) -> None:
    """Checks an input's last dimension against the size a layer's weights were made for."""
    if _known(size) and _known(built) and size != built:
        raise ValueError(
            f"{arg} last dimension ({size}) must be {built}, the size this layer was built for"
        )


def not_built(layer: str) -> ValueError:
    """The error for reading the weights of a layer whose input sizes are not known yet."""
    return ValueError(
        f"{layer}: weights are created on the first call; call the layer or set_weights first"
    )


#: The values of the attention layers' ``positional`` argument (None: no positions added).
POSITIONAL = ("rotary", "alibi")


def check_positional(positional: Any) -> str | None:
    """Checks a ``positional`` argument: None, ``"rotary"`` or ``"alibi"``."""
    if positional is not None and positional not in POSITIONAL:
        raise ValueError(f"positional must be None, 'rotary' or 'alibi', got {positional!r}")
    return positional


def check_window(window: Any) -> int | None:
    """Checks a sliding ``window``: None, or a positive int (the keys within it of a query)."""
    window = plain(window)
    return None if window is None else check_positive_int("window", window)


def check_softcap(softcap: Any) -> float | None:
    """Checks a ``softcap``: None, or a positive finite number (scores become c tanh(s / c))."""
    softcap = plain(softcap)
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not (
            0 < softcap < math.inf):
        raise ValueError(f"softcap must be None or a positive finite number, got {softcap!r}")
    return float(softcap)


def check_kv_heads(num_heads: int, num_kv_heads: Any) -> int:
    """Checks ``num_kv_heads`` (None: ``num_heads``), which must divide ``num_heads``."""
    if plain(num_kv_heads) is None:
        return num_heads
    num_kv_heads = check_positive_int("num_kv_heads", num_kv_heads)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_kv_heads ({num_kv_heads}) must divide num_heads ({num_heads})")
    return num_kv_heads


def check_rotary_base(base: Any, name: str = "rotary_base") -> float:
    """Checks the base of rotary frequencies: a finite number > 1; returns it as a float.

    ``name``: the argument as the caller takes it (``base`` on the rotary embedding).
    """
    base = plain(base)
    if isinstance(base, bool) or not isinstance(base, (int, float)) or not 1 < base < math.inf:
        raise ValueError(f"{name} must be a finite number > 1, got {base!r}")
    return float(base)


#: The checks of the attention layers' score options, by argument name (in this order).
SCORE_OPTION_CHECKS: dict[str, Callable[[Any], Any]] = {
    "positional": check_positional,
    "rotary_base": check_rotary_base,
    "window": check_window,
    "softcap": check_softcap,
    "scale": check_scale,
}


#: The normalisations of the Transformer blocks (``norm``).
NORMS = ("layer", "rms")
#: The activations of the position-wise FFN (``activation``).
ACTIVATIONS = ("relu", "gelu", "swiglu")


def check_norm(norm: Any) -> str:
    """Checks a ``norm`` argument: ``"layer"`` (LayerNorm) or ``"rms"`` (RMSNorm)."""
    if not isinstance(norm, str) or norm not in NORMS:
        raise ValueError(f"norm must be 'layer' or 'rms', got {norm!r}")
    return norm


def check_activation(activation: Any) -> str:
    """Checks an FFN ``activation``: ``"relu"``, ``"gelu"`` (exact, erf) or ``"swiglu"``."""
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise ValueError(f"activation must be 'relu', 'gelu' or 'swiglu', got {activation!r}")
    return activation


def check_bias(bias: Any) -> bool | str:
    """Checks the attention projections' ``bias``: True, False or ``"qkv"`` (no ``W_o`` bias).

    Raises:
        TypeError: Neither a bool nor a str.
        ValueError: A str other than ``"qkv"``.
    """
    bias = plain(bias)
    if isinstance(bias, bool) or bias == "qkv":
        return bias
    error = ValueError if isinstance(bias, str) else TypeError
    raise error(f"bias must be True, False or 'qkv' (biases on W_q, W_k and W_v only), "
                f"got {bias!r}")


def check_eps(eps: Any, name: str = "norm_eps") -> float | None:
    """Checks a normalisation's epsilon: None (the norm's default) or a positive finite number."""
    eps = plain(eps)
    if eps is None:
        return None
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < math.inf:
        raise ValueError(f"{name} must be None or a positive finite number, got {eps!r}")
    return float(eps)
