"""Each framework's own call keywords, beside the library's, converted once to the canonical call.

The canonical call arguments (``valid_lens``, ``mask`` with True = may attend, ``causal``,
``return_attention``, ``score_bias``) mean the same on every backend. A backend's layers also
take their framework's usual keywords, with that framework's meaning; an adapter names its
framework in the class attribute ``convention`` (:attr:`Declaration.convention
<attention_core.declarations.Declaration.convention>`: ``"torch"``, ``"keras"``, ``"flax"``),
and the generic call path does the rest:

- :func:`parameters` adds the keywords to a layer class's call signature (a keyword is offered
  by the layers that take the canonical arguments it stands for);
- :func:`bind` (in ``Declaration.bind_call``) renames keywords that are another name for a
  canonical argument, refuses a keyword given with its canonical counterpart, and fills in the
  self-attention shorthand (``mha(X)`` is ``mha(X, X, X)``; ``mha(Q, KV)`` is
  ``mha(Q, KV, KV)``);
- :func:`convert` (in ``Declaration.prepare``) turns the framework's masks, which are arrays,
  into the canonical ``mask`` and ``score_bias``.

The keywords and their meaning (batch-first inputs ``(B, T, D)`` everywhere):

=======  =============================  =====================================================
torch    ``query``, ``key``, ``value``  the queries, keys and values (``src``: the block's X)
torch    ``attn_mask``, ``src_mask``    bool ``(Q, K)`` or ``(B*H, Q, K)``, True = may **not**
                                        attend; or float, added to the scores (``score_bias``)
torch    ``key_padding_mask``,          bool ``(B, K)``, True = padding (hidden); or float
         ``src_key_padding_mask``       ``(B, K)``, added to every query's scores
torch    ``is_causal``                  query i sees keys j <= i; given with ``attn_mask``
                                        (torch's "hint"), both apply (AND)
torch    ``need_weights``,              return torch's ``(out, weights)``: weights averaged
         ``average_attn_weights``       over the heads ``(B, Q, K)`` unless
                                        ``average_attn_weights=False`` ``(B, H, Q, K)``;
                                        ``(out, None)`` for ``need_weights=False``
Keras    ``query``, ``value``, ``key``  Keras' names (``key`` defaults to ``value``; without
                                        ``value=``, as the shorthand: keys = queries)
Keras    ``attention_mask``             bool, True = may attend: the canonical ``mask``
                                        (its errors name ``attention_mask``)
Keras    ``use_causal_mask``            query i sees keys j <= i
Keras    ``return_attention_scores``    return ``(out, scores)``, scores ``(B, H, Q, K)``
Keras    ``padding_mask``               the encoder block's ``(B, T)``, True = a real token
                                        (KerasHub's ``TransformerEncoder``)
Keras    ``value_mask``, ``key_mask``   ``(B, K)``, True = a real key: padded keys are hidden
Keras    ``query_mask``                 ``(B, Q)``, True = a real query: a padded query sees
                                        no key, its attention weights are 0 (Keras' own layer
                                        spreads them evenly); Keras also fills these three
                                        from the inputs' padding masks (``_keras_mask``)
Flax     ``inputs_q``, ``inputs_k``,    linen's names (``inputs_k`` defaults to ``inputs_q``,
         ``inputs_v``                   ``inputs_v`` to ``inputs_k``)
Flax     ``deterministic``              ``not training`` (linen's ``mask`` is the canonical
                                        ``mask`` already)
=======  =============================  =====================================================

torch and Keras align their causal masks at the first key, this library's ``causal=True`` at
the last: they agree when Q == K (self-attention); for Q != K the framework's causal keyword
is refused, naming both. torch returns weights after dropout; here they are before dropout,
as the layers keep them. A keyword given with its canonical counterpart (``mask`` and
``attention_mask``, ``valid_lens`` and ``key_padding_mask`` ...) is a TypeError; so are masks of
another dtype than torch takes, or a boolean and a float torch mask together (torch deprecates
the mix); a mask of the wrong shape is a ValueError. The messages are the same on every
backend.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from attention_core import masks
from attention_core.checks import check_mode_flag, fmt_shape
from attention_core.host import host_array
from attention_core.ops import Array, Ops

#: The kinds of keywords: another name for a canonical argument; another name for the canonical
#: ``mask`` (True = may attend); torch's masks (True = hidden, or float scores); Keras' padding
#: masks of the keys and of the queries (True = a real token); a causal flag; torch's return
#: form; Flax's ``deterministic``.
ALIAS, ALLOWED, BLOCKED, PADDING, KEPT, ROWS, CAUSAL, WEIGHTS, AVERAGE, DETERMINISTIC = (
    "alias", "allowed", "blocked", "padding", "kept", "rows", "causal", "weights", "average",
    "deterministic")

#: The kinds whose values are arrays, converted by :func:`convert` (with the backend's ops), so
#: that their errors name the keyword given.
ARRAY_KINDS = (ALLOWED, BLOCKED, PADDING, KEPT, ROWS)
#: The kinds of boolean padding masks, True = a real token.
_REAL = (KEPT, ROWS)


@dataclass(frozen=True)
class Keyword:
    """One keyword of a framework's call convention.

    Attributes:
        name: The framework's keyword.
        kind: What it is (``ALIAS`` ...).
        canonical: The canonical argument it stands for: giving both is an error ("" for
            none: Keras' ``query_mask`` has no canonical counterpart).
        meaning: Its meaning, for the messages (``"torch's mask, True = may not attend"``).
        requires: The canonical call arguments a layer must take to be offered it.
        layers: Only these declarations (by name) are offered it; empty for any.
        also: Further canonical arguments that must not be given with it.
        fills: A canonical argument it also gives when that is not given (Keras' ``key``
            defaults to ``value``).
    """

    name: str
    kind: str
    canonical: str
    meaning: str
    requires: tuple[str, ...]
    layers: tuple[str, ...] = ()
    also: tuple[str, ...] = ()
    fills: str = ""


_QKV = ("queries", "keys", "values", "mask")
_BLOCK = ("TransformerEncoderBlock",)


def _aliases(framework: str, names: tuple[str, str, str], value_fills: str = ""
             ) -> tuple[Keyword, ...]:
    return tuple(Keyword(name, ALIAS, canonical, f"{framework} name for {canonical}", _QKV,
                         fills=value_fills if canonical == "values" else "")
                 for name, canonical in zip(names, ("queries", "keys", "values"), strict=True))


_TORCH_MASK = "torch's attention mask: True = may not attend, or a float added to the scores"
_TORCH_PADDING = "torch's padding mask: True = a padded key, or a float added to its scores"

#: The keywords of each framework, by the name an adapter gives in ``convention``.
CONVENTIONS: dict[str, tuple[Keyword, ...]] = {
    "torch": (
        *_aliases("torch's", ("query", "key", "value")),
        Keyword("attn_mask", BLOCKED, "mask", _TORCH_MASK, _QKV, also=("score_bias",)),
        Keyword("key_padding_mask", PADDING, "valid_lens", _TORCH_PADDING, _QKV),
        Keyword("src", ALIAS, "X", "torch's name for X", ("X", "mask"), _BLOCK),
        Keyword("src_mask", BLOCKED, "mask", _TORCH_MASK, ("X", "mask"), _BLOCK,
                also=("score_bias",)),
        Keyword("src_key_padding_mask", PADDING, "valid_lens", _TORCH_PADDING, ("X", "mask"),
                _BLOCK),
        Keyword("is_causal", CAUSAL, "causal", "torch's causal flag", ("causal",)),
        Keyword("need_weights", WEIGHTS, "return_attention", "torch's return form",
                ("return_attention",)),
        Keyword("average_attn_weights", AVERAGE, "return_attention", "torch's return form",
                ("return_attention",)),
    ),
    "keras": (
        *_aliases("Keras'", ("query", "key", "value"), value_fills="keys"),
        Keyword("attention_mask", ALLOWED, "mask", "Keras' name for mask", ("mask",)),
        Keyword("padding_mask", KEPT, "valid_lens",
                "KerasHub's padding mask, True = a real token", ("X", "mask"), _BLOCK),
        Keyword("query_mask", ROWS, "", "Keras' padding mask of the queries, True = a real "
                "query", _QKV),
        Keyword("value_mask", KEPT, "valid_lens", "Keras' padding mask of the values, True = "
                "a real value", _QKV),
        Keyword("key_mask", KEPT, "valid_lens", "Keras' padding mask of the keys, True = a "
                "real key", _QKV),
        Keyword("use_causal_mask", CAUSAL, "causal", "Keras' causal flag", ("causal",)),
        Keyword("return_attention_scores", ALIAS, "return_attention",
                "Keras' name for return_attention", ("return_attention",)),
    ),
    "flax": (
        *_aliases("Flax's", ("inputs_q", "inputs_k", "inputs_v")),
        Keyword("deterministic", DETERMINISTIC, "training", "Flax's deterministic = not training",
                ()),
    ),
}


@dataclass(frozen=True)
class Returned:
    """The return form of torch (``need_weights``): ``(out, weights)``, or ``(out, None)``.

    Given as a call's ``return_attention``, it is true when the weights are returned;
    ``Declaration.finish`` shapes the result by :meth:`form`.

    Attributes:
        weights: torch's ``need_weights``.
        average: torch's ``average_attn_weights``: the weights averaged over the heads.
        ops: The backend's ops (set by ``Declaration.prepare``), to average with.
    """

    weights: bool
    average: bool = True
    ops: Ops | None = None

    def __bool__(self) -> bool:
        return self.weights

    def form(self, returned: Any) -> tuple[Any, Any]:
        """``(out, weights)`` from what the call returns, as torch returns it."""
        if not self.weights:
            return returned, None
        out, weights = returned
        if self.average:
            assert self.ops is not None, "Returned.ops is set by Declaration.prepare"
            shape = self.ops.shape(weights)
            weights = self.ops.reshape(self.ops.mean(weights, 1), (shape[0], *shape[2:]))
        return out, weights


# -- the keywords a layer class is offered ------------------------------------------------------


@functools.cache
def keywords(convention: str | None, layer: str, takes: frozenset[str]) -> tuple[Keyword, ...]:
    """The keywords of ``convention`` offered by a declared layer.

    Args:
        convention: The adapter's convention (None for none).
        layer: The declaration's name.
        takes: The canonical call arguments the layer takes.
    """
    if convention is None:
        return ()
    if convention not in CONVENTIONS:
        raise ValueError(f"convention must be one of {sorted(CONVENTIONS)} or None, "
                         f"got {convention!r}")
    return tuple(k for k in CONVENTIONS[convention]
                 if set(k.requires) <= takes and (not k.layers or layer in k.layers))


def parameters(convention: str | None, layer: str, params: list[inspect.Parameter]
               ) -> list[inspect.Parameter]:
    """A layer class's call parameters: the canonical ones, then its framework's keywords.

    A required canonical argument that has another name becomes optional (None): one of the
    two names gives it (:func:`bind` checks that one does).
    """
    offered = keywords(convention, layer, frozenset(p.name for p in params))
    renamed = {k.canonical for k in offered if k.kind == ALIAS}
    canonical = [p.replace(default=None) if p.name in renamed and p.default is p.empty else p
                 for p in params]
    return [*canonical, *(inspect.Parameter(k.name, inspect.Parameter.KEYWORD_ONLY, default=None)
                          for k in offered)]


# -- binding: names, conflicts and the shorthand ---------------------------------------------------


def bind(layer: Any, arguments: dict[str, Any], defaults: Mapping[str, Any],
         required: tuple[str, ...], shorthand: Mapping[str, str]) -> dict[str, Any]:
    """A bound call with its framework's keywords given their canonical names (in place).

    Keywords that are arrays stay for :func:`convert`; ``deterministic`` stays for
    ``Declaration.prepare``.

    Args:
        layer: The layer (its class's ``convention`` and declaration name are read).
        arguments: The call bound to the class's call signature (:func:`parameters`).
        defaults: The canonical arguments' defaults (a counterpart differing from its default
            was given).
        required: The canonical arguments without default, which a keyword may give instead.
        shorthand: Arguments that default to another (``keys`` to ``queries``, ``values`` to
            ``keys``): the self-attention shorthand.

    Raises:
        TypeError: A keyword given with its canonical counterpart, or a required argument
            given by neither name.
    """
    offered = _offered(layer)
    given = {name: arguments.get(name) for name in defaults} if offered else {}
    for keyword in offered:
        value = arguments.get(keyword.name)
        if value is None:
            arguments.pop(keyword.name, None)
            continue
        for other in (keyword.canonical, *keyword.also):
            if other in defaults and given[other] is not defaults[other]:
                raise TypeError(f"got both {other} and {keyword.name} ({keyword.meaning}): "
                                "give one of them")
        if keyword.kind in ARRAY_KINDS or keyword.kind == DETERMINISTIC:
            continue
        del arguments[keyword.name]
        if keyword.kind == ALIAS:
            arguments[keyword.canonical] = value
            if keyword.fills and arguments.get(keyword.fills) is None:
                arguments[keyword.fills] = value
        elif keyword.kind == CAUSAL:
            arguments["causal"] = _causal(keyword, bool(value), arguments)
        elif keyword.kind in (WEIGHTS, AVERAGE):
            arguments["return_attention"] = _returned(arguments, keyword, bool(value))
    for name in required:
        if arguments.get(name) is None:
            raise TypeError(f"missing a required argument: {name!r}")
    for name, source in shorthand.items():
        if arguments.get(name) is None:
            arguments[name] = arguments[source]
    return arguments


def _offered(layer: Any) -> tuple[Keyword, ...]:
    """The keywords a layer's class offers (set when the class is made)."""
    offered: tuple[Keyword, ...] = getattr(type(layer), "_call_keywords", ())
    return offered


def _returned(arguments: dict[str, Any], keyword: Keyword, value: bool) -> Returned:
    """The return form of torch, from ``need_weights`` or ``average_attn_weights`` (the other kept)."""
    current = arguments.get("return_attention")
    form = current if isinstance(current, Returned) else Returned(True)
    if keyword.kind == WEIGHTS:
        return dataclasses.replace(form, weights=value)
    return dataclasses.replace(form, average=value)


def _length(x: Any) -> int | None:
    """The sequence length (axis -2) of an input, when known before the call runs."""
    try:
        return int(x.shape[-2])
    except (AttributeError, IndexError, TypeError, ValueError):
        return None


def _causal(keyword: Keyword, value: bool, arguments: Mapping[str, Any]) -> bool:
    """A framework's causal flag as ``causal``, refused where the alignments differ (Q != K)."""
    if not value:
        return False
    first = _first(arguments)
    q, k = _length(first), _length(_keys(arguments, first))
    if q is not None and k is not None and q != k:
        raise ValueError(
            f"{keyword.name}=True with {q} queries and {k} keys: {keyword.meaning} aligns the "
            "causal mask at the first key, this library's causal=True at the last; give a "
            "boolean mask instead")
    return True


# -- converting the framework's masks ------------------------------------------------------------


def convert(layer: Any, ops: Ops, arguments: dict[str, Any]) -> tuple[dict[str, Any], bool | None]:
    """A bound call's framework masks as ``mask`` and ``score_bias``; Flax's training mode.

    Args:
        layer: The layer (its ``num_heads``, if it has one, is torch's H of ``(B*H, Q, K)``).
        ops: The backend's ops.
        arguments: The call after :func:`bind` (changed in place).

    Returns:
        The canonical arguments, and ``not deterministic`` when given (else None).

    Raises:
        TypeError: A mask of a dtype the framework does not take, torch masks of two kinds
            (bool and float), or a float mask where the layer takes no ``score_bias``.
        ValueError: A mask of the wrong shape.
    """
    offered = _offered(layer)
    deterministic = check_mode_flag("deterministic", arguments.pop("deterministic", None))
    found = [(k, arguments.pop(k.name, None)) for k in offered if k.kind in ARRAY_KINDS]
    given = [(k, value) for k, value in found if value is not None]
    if given:
        _masks(layer, ops, arguments, given)
    return arguments, None if deterministic is None else not deterministic


def _masks(layer: Any, ops: Ops, arguments: dict[str, Any],
           given: list[tuple[Keyword, Any]]) -> None:
    B, Q, K = _sizes(ops, arguments)
    H = int(getattr(layer, "num_heads", 1))
    first = _first(arguments)
    heads = _shape(ops, first)[1] if first is not None and len(_shape(ops, first)) == 4 else H
    scores = (B, heads, Q, K)
    kinds = {}
    for keyword, value in given:
        dtype = _dtype(ops, value)
        floating = dtype.startswith(("float", "bfloat"))
        if dtype != "bool" and not (floating and keyword.kind in (BLOCKED, PADDING)):
            expected = ("boolean (True = a real token)" if keyword.kind in _REAL else
                        "boolean (True = may attend)" if keyword.kind == ALLOWED else
                        "boolean (True = may not attend) or floating point (added to the scores)")
            raise TypeError(f"{keyword.name} must be {expected}, got {dtype}")
        kinds[keyword.name] = dtype
    if len({d == "bool" for d in kinds.values()}) > 1:
        (a, da), (b, db) = kinds.items()
        raise TypeError(f"{a} and {b} must both be boolean or both floating point (torch "
                        f"deprecates the mix), got {da} and {db}")
    bool_parts = [] if arguments.get("mask") is None else [
        masks.boolean_mask(ops, arguments["mask"], scores)]
    float_parts = [] if arguments.get("score_bias") is None else [_lifted_bias(
        ops, arguments["score_bias"], scores)]
    for keyword, value in given:
        array = masks.as_backend_array(ops, value)
        shape = tuple(ops.shape(array))
        if keyword.kind == ALLOWED:
            array = masks.lifted(ops, keyword.name, array, shape, scores)
        elif keyword.kind == BLOCKED:
            array = _lifted_attention_mask(ops, keyword.name, array, shape, (B, H, Q, K))
        else:
            axis, want = ("Q", (B, Q)) if keyword.kind == ROWS else ("K", (B, K))
            if not masks.fits(shape, want, broadcast=False):
                raise ValueError(f"{keyword.name} must have shape (B, {axis}) = "
                                 f"{fmt_shape(want)}, got {fmt_shape(shape)}")
            if keyword.kind == ROWS:  # (B, 1, Q, 1): a padded query sees no key
                array = ops.expand_dims(ops.expand_dims(array, -1), 1)
            else:  # (B, 1, 1, K)
                array = ops.expand_dims(ops.expand_dims(array, 1), 1)
        if kinds[keyword.name] == "bool":
            blocked = keyword.kind in (BLOCKED, PADDING)
            bool_parts.append(_inverted(ops, array) if blocked else array)
        else:
            float_parts.append(array)
    if float_parts and "score_bias" not in arguments:
        name = next(k.name for k, _ in given if kinds[k.name] != "bool")
        raise TypeError(f"a floating-point {name} is added to the scores, which "
                        f"{type(layer).declared().__name__} does not take (no score_bias): give "
                        "a boolean mask")
    if bool_parts:
        arguments["mask"] = functools.reduce(ops.logical_and, bool_parts)
    if float_parts:
        arguments["score_bias"] = functools.reduce(lambda a, b: a + b, float_parts)


def _sizes(ops: Ops, arguments: Mapping[str, Any]) -> tuple[Any, Any, Any]:
    """``(B, Q, K)`` of a bound call: a stack's token ids ``(B, T)`` attend over themselves."""
    first = _first(arguments)
    if first is None:
        B, T = _shape(ops, arguments["tokens"])[:2]
        return B, T, T
    q_shape, k_shape = _shape(ops, first), _shape(ops, _keys(arguments, first))
    return q_shape[0], q_shape[-2], k_shape[-2]


def _shape(ops: Ops, x: Any) -> tuple[Any, ...]:
    """The shape of the backend's array, or of host data (checked by the call later)."""
    return tuple(ops.shape(x)) if masks.own(ops, x) else np.shape(x)


def _first(arguments: Mapping[str, Any]) -> Any:
    """The queries (or the block's ``X``) of a bound call."""
    return arguments["queries"] if "queries" in arguments else arguments.get("X")


def _keys(arguments: Mapping[str, Any], first: Any) -> Any:
    """The keys of a bound call: the queries when not given (the shorthand) or not taken."""
    keys = arguments.get("keys")
    return first if keys is None else keys


def _lifted_bias(ops: Ops, bias: Any, scores: tuple[Any, ...]) -> Array:
    """The canonical ``score_bias`` lifted to rank 4, to add a framework's float mask to."""
    array = masks.as_backend_array(ops, bias)
    return masks.lifted(ops, "score_bias", array, tuple(ops.shape(array)), scores)


def _dtype(ops: Ops, x: Any) -> str:
    return ops.dtype_name(x) if masks.own(ops, x) else host_array(x).dtype.name


def _lifted_attention_mask(ops: Ops, name: str, x: Array, shape: tuple[Any, ...],
                           scores: tuple[Any, ...]) -> Array:
    """A torch ``(Q, K)`` or ``(B*H, Q, K)`` mask as ``(1, 1, Q, K)`` or ``(B, H, Q, K)``."""
    B, H, Q, K = scores
    batched = (B * H if isinstance(B, int) else None, Q, K)
    if masks.fits(shape, (Q, K), broadcast=False):
        return ops.expand_dims(ops.expand_dims(x, 0), 0)
    if masks.fits(shape, batched, broadcast=False):
        return ops.reshape(x, (-1, H, *shape[1:]))
    raise ValueError(f"{name} must have shape (Q, K) = {fmt_shape((Q, K))} or (B * num_heads, "
                     f"Q, K) = {fmt_shape(batched)}, got {fmt_shape(shape)}")


def _inverted(ops: Ops, blocked: Array) -> Array:
    """True = may attend, from torch's True = may not."""
    false, true = (ops.from_numpy(np.asarray(v)) for v in (False, True))
    return ops.where(blocked, false, true)


def training_mode(training: bool | None, deterministic_training: bool | None) -> bool:
    """A call's training mode from the adapter's ``training`` and Flax's ``deterministic``.

    Args:
        training: The ``training`` keyword (None when not given).
        deterministic_training: ``not deterministic`` (None when not given).

    Raises:
        ValueError: Both given and they disagree.
    """
    training = check_mode_flag("training", training)
    if training is not None and deterministic_training is not None \
            and bool(training) != deterministic_training:
        raise ValueError(f"training={bool(training)} and deterministic="
                         f"{not deterministic_training} disagree: deterministic means "
                         "training=False; give one of them")
    if training is not None:
        return bool(training)
    return bool(deterministic_training)
