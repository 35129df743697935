"""Each framework's own call keywords, beside the library's, converted once to the canonical call.

The canonical call arguments (``valid_lens``, ``mask`` with True = may attend, ``causal``,
``return_attention``, ``score_bias``) mean the same on every backend. A backend's layers also
take their framework's usual keywords, with that framework's meaning. This module holds the
generic machinery; the keywords themselves are the adapters' own: each adapter lists its
framework's as a tuple of :class:`Keyword` (``backends/torch/conventions.py``,
``backends/keras/conventions.py`` for ``backends.keras`` and ``backends.tensorflow``,
``backends/jax/conventions.py`` for linen and NNX, each with its table of meanings) and names it
in its layer class's attribute ``convention`` (:attr:`Declaration.convention
<attention_core.declarations.Declaration.convention>`). The generic call path does the rest:

- :func:`parameters` adds the keywords to a layer class's call signature (a keyword is offered
  by the layers that take the canonical arguments it stands for);
- :func:`bind` (in ``Declaration.bind_call``) renames keywords that are another name for a
  canonical argument, refuses a keyword given with its canonical counterpart, and fills in the
  self-attention shorthand (``mha(X)`` is ``mha(X, X, X)``; ``mha(Q, KV)`` is
  ``mha(Q, KV, KV)``);
- :func:`convert` (in ``Declaration.prepare``) turns the framework's masks, which are arrays,
  into the canonical ``mask`` and ``score_bias``.

What a keyword does follows from its kind (batch-first inputs ``(B, T, D)`` everywhere):

=================  ===========================================================================
``ALIAS``          another name for a canonical argument (``fills``: one that defaults to it)
``ALLOWED``        bool, True = may attend: the canonical ``mask`` (its errors name the keyword)
``BLOCKED``        bool ``(Q, K)`` or ``(B*H, Q, K)``, True = may **not** attend; or float,
                   added to the scores (``score_bias``)
``PADDING``        bool ``(B, K)``, True = a padded key (hidden); or float ``(B, K)``, added to
                   every query's scores
``KEPT``           bool ``(B, K)``, True = a real key: padded keys are hidden
``ROWS``           bool ``(B, Q)``, True = a real query: a padded query sees no key, its
                   attention weights are 0
``CAUSAL``         query i sees keys j <= i; given with a mask, both apply (AND)
``WEIGHTS``        return ``(out, weights)`` (:class:`Returned`), weights averaged over the
                   heads ``(B, Q, K)``; ``(out, None)`` when False
``AVERAGE``        with ``WEIGHTS``: False returns the weights per head ``(B, H, Q, K)``
``DETERMINISTIC``  ``not training``
=================  ===========================================================================

A framework's causal flag aligns the causal mask at the first key, this library's
``causal=True`` at the last: they agree when Q == K (self-attention); for Q != K the flag is
refused, naming both. The returned weights are before dropout, as the layers keep them. A
keyword given with its canonical counterpart is a TypeError; so are masks of a dtype the kind
does not take, or a boolean and a float mask together; a mask of the wrong shape is a
ValueError. The messages are the same on every backend.
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
#: ``mask`` (True = may attend); masks of True = hidden, or float scores (of the scores, of the
#: keys); padding masks of the keys and of the queries (True = a real token); a causal flag;
#: the ``(out, weights)`` return form and its averaging over the heads; ``not training``.
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
            none: a ``ROWS`` mask has no canonical counterpart).
        meaning: Its meaning, for the messages (``"<framework>'s causal flag"``).
        requires: The canonical call arguments a layer must take to be offered it.
        layers: Only these declarations (by name) are offered it; empty for any.
        also: Further canonical arguments that must not be given with it.
        fills: A canonical argument it also gives when that is not given (an ``ALIAS`` of the
            values that the keys default to).
    """

    name: str
    kind: str
    canonical: str
    meaning: str
    requires: tuple[str, ...]
    layers: tuple[str, ...] = ()
    also: tuple[str, ...] = ()
    fills: str = ""


#: The canonical arguments of attention, which the keywords of its inputs and masks require.
QKV = ("queries", "keys", "values", "mask")
#: The declarations offered the keywords of an encoder block only.
ENCODER_BLOCK = ("TransformerEncoderBlock",)


def aliases(framework: str, names: tuple[str, str, str], value_fills: str = ""
            ) -> tuple[Keyword, ...]:
    """A framework's names of the queries, keys and values, as ``ALIAS`` keywords.

    Args:
        framework: The framework, possessive, for the messages (``"Flax's"``).
        names: Its names of the queries, keys and values.
        value_fills: A canonical argument the values' name also gives (``"keys"``), or "".
    """
    return tuple(Keyword(name, ALIAS, canonical, f"{framework} name for {canonical}", QKV,
                         fills=value_fills if canonical == "values" else "")
                 for name, canonical in zip(names, ("queries", "keys", "values"), strict=True))


@dataclass(frozen=True)
class Returned:
    """The ``WEIGHTS`` return form: ``(out, weights)``, or ``(out, None)``.

    Given as a call's ``return_attention``, it is true when the weights are returned;
    ``Declaration.finish`` shapes the result by :meth:`form`.

    Attributes:
        weights: The ``WEIGHTS`` keyword: the weights are returned.
        average: The ``AVERAGE`` keyword: the weights averaged over the heads.
        ops: The backend's ops (set by ``Declaration.prepare``), to average with.
    """

    weights: bool
    average: bool = True
    ops: Ops | None = None

    def __bool__(self) -> bool:
        return self.weights

    def form(self, returned: Any) -> tuple[Any, Any]:
        """``(out, weights)`` from what the call returns, in this form."""
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
def keywords(convention: tuple[Keyword, ...], layer: str, takes: frozenset[str]
             ) -> tuple[Keyword, ...]:
    """The keywords of ``convention`` offered by a declared layer.

    Args:
        convention: The adapter's keywords (empty for none).
        layer: The declaration's name.
        takes: The canonical call arguments the layer takes.
    """
    return tuple(k for k in convention
                 if set(k.requires) <= takes and (not k.layers or layer in k.layers))


def parameters(convention: tuple[Keyword, ...], layer: str, params: list[inspect.Parameter]
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

    Keywords that are arrays stay for :func:`convert`, as does a ``DETERMINISTIC`` one.

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
    given: dict[str, Any] | None = None  # the canonical arguments as given, when first needed
    for keyword in _offered(layer):
        value = arguments.pop(keyword.name, None)
        if value is None:
            continue
        if given is None:
            given = {name: arguments.get(name) for name in defaults}
        for other in (keyword.canonical, *keyword.also):
            if other in defaults and given[other] is not defaults[other]:
                raise TypeError(f"got both {other} and {keyword.name} ({keyword.meaning}): "
                                "give one of them")
        if keyword.kind in ARRAY_KINDS or keyword.kind == DETERMINISTIC:
            arguments[keyword.name] = value  # for convert
            continue
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
    """The return form, from a ``WEIGHTS`` or ``AVERAGE`` keyword (the other kept)."""
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
    """A bound call's framework masks as ``mask`` and ``score_bias``; its training mode.

    Args:
        layer: The layer (its ``num_heads``, if it has one, is the H of ``(B*H, Q, K)``).
        ops: The backend's ops.
        arguments: The call after :func:`bind` (changed in place).

    Returns:
        The canonical arguments, and ``not`` the ``DETERMINISTIC`` keyword when given (else
        None).

    Raises:
        TypeError: A mask of a dtype the framework does not take, masks of two kinds
            (bool and float), or a float mask where the layer takes no ``score_bias``.
        ValueError: A mask of the wrong shape.
    """
    offered = _offered(layer)
    flags = [k.name for k in offered if k.kind == DETERMINISTIC]
    deterministic = check_mode_flag(flags[0], arguments.pop(flags[0], None)) if flags else None
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
            array = _lifted_blocked(ops, keyword.name, array, shape, (B, H, Q, K))
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


def _lifted_blocked(ops: Ops, name: str, x: Array, shape: tuple[Any, ...],
                           scores: tuple[Any, ...]) -> Array:
    """A ``BLOCKED`` ``(Q, K)`` or ``(B*H, Q, K)`` mask as ``(1, 1, Q, K)`` or ``(B, H, Q, K)``."""
    B, H, Q, K = scores
    batched = (B * H if isinstance(B, int) else None, Q, K)
    if masks.fits(shape, (Q, K), broadcast=False):
        return ops.expand_dims(ops.expand_dims(x, 0), 0)
    if masks.fits(shape, batched, broadcast=False):
        return ops.reshape(x, (-1, H, *shape[1:]))
    raise ValueError(f"{name} must have shape (Q, K) = {fmt_shape((Q, K))} or (B * num_heads, "
                     f"Q, K) = {fmt_shape(batched)}, got {fmt_shape(shape)}")


def _inverted(ops: Ops, blocked: Array) -> Array:
    """True = may attend, from True = may not."""
    false, true = (ops.from_numpy(np.asarray(v)) for v in (False, True))
    return ops.where(blocked, false, true)


def training_mode(training: bool | None, deterministic_training: bool | None) -> bool:
    """A call's training mode from the adapter's ``training`` and the ``DETERMINISTIC`` keyword.

    Args:
        training: The ``training`` keyword (None when not given).
        deterministic_training: ``not deterministic``, the keyword's value negated (None when not
            given).

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
