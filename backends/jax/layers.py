"""Flax (``flax.linen``) layers: every declared layer (:mod:`attention_core.declarations`).

Each layer is a ``flax.linen.Module`` whose fields are the declared constructor arguments, in
order, then the keywords ``param_dtype`` and ``dtype``. Params are made on ``init`` from the input shapes, one
entry per first part of the canonical names, nested by the rest (``{"W_q": {"kernel": ...}}``,
``{"blks": {"0": {"attention": ...}}}``), so a canonical name is a params path joined with dots
and :func:`get_weights` and :func:`set_weights` only flatten and nest. Initial values follow
:func:`attention_core.weights.init_rule`, drawn with ``jax.random``.

Calls take ``training: bool = False`` (static under ``jax.jit``; linen's
``deterministic=True`` is ``training=False``) and linen's ``inputs_q``, ``inputs_k``, ``inputs_v``
(:mod:`backends.jax.conventions`); dropout draws from the ``'dropout'`` rng. The field
``dtype`` is the compute dtype beside ``param_dtype``, as in Flax's own layers. Attention
weights, before dropout, are ``sow``n into ``'intermediates'`` as
``attention_weights`` (once per block for :class:`TransformerEncoder`); they are formed only
when returned or kept (``keep_attention_weights`` and ``mutable=["intermediates"]``). Fixed
tables (the sinusoidal ``P``) are constants in ``param_dtype``, attributes without ``init``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import KW_ONLY, dataclass, fields
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from attention_core import checks
from attention_core import declarations as D
from attention_core import weights as W
from attention_core.host import plain
from attention_core.ops import Array
from backends.jax.conventions import FLAX
from backends.jax.ops import OPS, JaxOps, floats_on_device
from backends.jax.parallel import context_parallel
from backends.jax.params import SAMPLERS, constants, flatten, nest

# -- the canonical layout as a Flax params pytree ---------------------------------------------


def _draw(key: Array, group: str, spec: tuple[tuple[str, tuple[int, ...]], ...],
          dtype: DTypeLike) -> Any:
    """Draws the params entry ``group`` (the init function of ``self.param``).

    An array, or nested dicts; each weight by the rule of its canonical name.
    """
    leaves = {}
    for i, (name, shape) in enumerate(spec):
        rule = W.init_rule(f"{group}.{name}" if name else group, shape)
        leaves[name] = SAMPLERS[rule.kind](jax.random.fold_in(key, i), rule, shape, dtype)
    return leaves[""] if "" in leaves else nest(leaves)


# -- layers -----------------------------------------------------------------------------------


@dataclass(eq=False, repr=False)  # the repr is Flax's
class FlaxArguments:
    """The Flax layers' own constructor arguments, after the declared ones.

    Args:
        param_dtype: Dtype of the params and the constants; floating inputs are cast to it
            when the layer has params (and ``dtype`` is None).
        dtype: The compute dtype, as in Flax's own layers: inputs, params and constants are
            cast to it for the call (the params stay in ``param_dtype``); None for the rule
            above.
    """

    _: KW_ONLY
    param_dtype: DTypeLike = jnp.float32
    dtype: DTypeLike | None = None


class Layer(FlaxArguments, nn.Module, D.Declaration):
    """Holds a declared layer's weights as Flax params and calls its forward."""

    extras = D.keyword_parameters(FlaxArguments)
    convention = FLAX  # linen's call keywords too (backends.jax.conventions)
    context_parallel_reader = staticmethod(context_parallel)

    def __post_init__(self) -> None:
        for field in fields(self):  # NumPy scalars as Python numbers, as elsewhere
            value = getattr(self, field.name, None)
            if plain(value) is not value:
                object.__setattr__(self, field.name, plain(value))
        self.check()
        super().__post_init__()

    def spec(self, **dims: int | None) -> W.Spec:
        """Canonical names and shapes of the weights for the given input sizes (None = unknown)."""
        return self.weight_shapes(**dims)

    @nn.nowrap
    def _tables(self) -> dict[str, Array]:
        """The fixed tables (:meth:`constants`) in ``param_dtype``, made once per arguments."""
        arguments = tuple((name, vars(self)[name]) for name in self.argument_names())
        tables = constants(self.declared().__name__, arguments)
        return {name: jnp.asarray(t, vars(self)["param_dtype"]) for name, t in tables.items()}

    @nn.nowrap
    def __getattr__(self, name: str) -> Any:
        """A fixed table by its name (``P``): a constant, available without ``init``."""
        if not name.startswith("_") and {*self.argument_names(), "param_dtype"} <= vars(self).keys():
            tables = self._tables()
            if name in tables:
                return tables[name]
        return super().__getattr__(name)

    def _params(self, **dims: int) -> dict[str, Array]:
        """The weights for inputs of these sizes: made on init, read (and checked) on apply."""
        for dim, size in dims.items():  # built for other sizes: the message of every backend
            group, _, rest = self.sizes[dim].weight.partition(".")
            if self.has_variable("params", group):
                built = np.shape(flatten(self.get_variable("params", group))[rest])[0]
                checks.check_built_size(self.sizes[dim].argument, size, built)
        groups: dict[str, dict[str, tuple[int, ...]]] = {}
        for name, shape in self.weight_shapes(**dims).items():
            group, _, rest = name.partition(".")
            groups.setdefault(group, {})[rest] = tuple(int(d) for d in shape if d is not None)
        weights: dict[str, Array] = {}
        for group, spec in groups.items():
            init = functools.partial(_draw, group=group, spec=tuple(spec.items()), dtype=self.param_dtype)
            value = self.param(group, init)
            weights.update({group: value} if "" in spec else W.prefixed(flatten(value), group))
        return weights

    @nn.compact
    def __call__(self, *args: Any, training: bool | None = None, decode: bool = False,
                 **kwargs: Any) -> Any:
        """Calls the declared forward (see the layer's ``compute``).

        ``training`` (default False) and ``decode`` are static; linen's ``deterministic``
        is ``not training`` (giving both, they must agree). ``decode=True`` (layers with a key/value
        cache) keeps the cache in the ``'cache'`` collection, as Flax's own attention does. A
        call without a cache in it, ``apply({"params": p}, x, enc, ..., decode=True,
        mutable=["cache"])`` on inputs as long as the longest decoding, makes it (of that
        capacity, at position 0; it holds the encoder outputs' projections, so it is made with
        the trained params); each ``apply({"params": p, "cache": c}, x_t, ..., decode=True,
        mutable=["cache"])`` then feeds the next positions and returns their output alone.
        """
        bound = floats_on_device(self.bind_call(args, kwargs))
        if decode:
            self._check_decode(bound)
            bound = self._decoding(bound)
        dtype = np.dtype(self.param_dtype if self.dtype is None else self.dtype).name
        prepared = self.prepare(OPS, dtype, bound)
        training = prepared.training_mode(training)
        weights = self._params(**prepared.dims)
        tables = self._tables()
        if self.dtype is not None:  # Flax's compute dtype: params cast for the call
            weights = {name: OPS.astype(w, dtype) for name, w in weights.items()}
            tables = {name: OPS.astype(t, dtype) for name, t in tables.items()}
        need = self.needs_attention(prepared.return_attention,
                                    self.is_mutable_collection("intermediates"), on_read=False)
        rate = float(getattr(self, "dropout", 0.0)) if training else 0.0
        ops = JaxOps(rng=self.make_rng("dropout")) if rate > 0 else OPS
        run = D.Run(ops, weights, tables, rate, need)
        result = self.compute(run, **prepared.arguments)
        returned, kept = self.finish(result, need, prepared.return_attention)
        if decode:
            returned = self._keep_cache(returned, prepared.arguments)
        if need and self.attention_kind == "nested":  # one entry per call: [self, cross], ...
            self.sow("intermediates", "attention_weights", kept)
        elif need:  # one entry per array: an encoder's blocks one by one
            for attn in D.leaves(kept):
                self.sow("intermediates", "attention_weights", attn)
        return returned


    def _check_decode(self, bound: Mapping[str, Any]) -> None:
        """``decode=True``: only for a layer with a cache, which the collection then holds."""
        if not self.cache_arguments:
            raise TypeError(f"{type(self).__name__} has no key/value cache: decode must be False")
        defaults = {n: p.default for n, p in self.call_signature().parameters.items()}
        given = [n for n in self.cache_arguments if not _unset(bound.get(n), defaults.get(n))]
        if given:
            raise ValueError(f"decode=True keeps the cache in the 'cache' collection: {given[0]} "
                             "must not be given")

    def _decoding(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """The cached call's arguments, from the ``'cache'`` collection.

        Its cache and position; when it holds none yet, a cache made now, as long as the input.
        """
        if self.has_variable("cache", "state"):
            return {**arguments, "cache": self.get_variable("cache", "state"),
                    "start": self.get_variable("cache", "index")}
        first = arguments[self.sequences[0]]
        return {**arguments, "capacity": int(np.shape(first)[1])}

    def _keep_cache(self, returned: Any, arguments: Mapping[str, Any]) -> Any:
        """Stores a cached call's new cache and position; returns its output alone.

        A cache made now starts at position 0: the rows the making call wrote are hidden
        until later calls write them again.
        """
        out, cache = returned
        steps = np.shape(arguments[self.sequences[0]])[1]
        made = arguments.get("capacity") is not None
        index = self.variable("cache", "index", lambda: jnp.zeros((), jnp.int32))
        state = self.variable("cache", "state", lambda: cache)
        if self.is_mutable_collection("cache"):
            state.value = cache
            index.value = jnp.zeros((), jnp.int32) if made else index.value + steps
        return out


def _unset(value: Any, default: Any) -> bool:
    """Whether a call argument is left at its default (None, or a plain value equal to it)."""
    return value is None or (isinstance(value, (int, str)) and value == default)


def _params_of(variables: Mapping[str, Any] | None) -> tuple[Mapping[str, Any] | None, bool]:
    """The params tree in ``variables`` (a ``{"params": ...}`` dict or the params themselves)."""
    if variables is None:
        return None, True
    if not isinstance(variables, Mapping):
        raise TypeError(
            f"expected Flax variables or params (a mapping), got {type(variables).__name__}"
        )
    if "params" in variables:
        return variables["params"], True
    return variables, not variables  # an empty dict is what init gives a layer without params


def get_weights(
    variables: Mapping[str, Any] | None, *, layer: Layer | None = None
) -> dict[str, np.ndarray]:
    """The canonical weights (a NumPy copy) of ``{"params": ...}`` or a params tree; not jittable.

    Args:
        variables: What ``layer.init`` returns, or its params; None before ``init``.
        layer: The module they belong to (names it when it has weights but no params yet).
    """
    params, _ = _params_of(variables)
    if not params:
        if layer is None:
            if params is None:
                raise ValueError("get_weights: no variables given; initialise the layer first")
            return {}
        if layer.spec():
            raise checks.not_built(type(layer).__name__)
        return {}
    return {name: np.array(value) for name, value in flatten(params).items()}


def set_weights(
    variables: Mapping[str, Any] | None, weights: Mapping[str, Any], *, layer: Layer | None = None
) -> dict[str, Any]:
    """New variables, in the form given, holding the canonical ``weights`` (names, shapes checked).

    Args:
        variables: ``{"params": ...}`` or the params (kept as they are: values take their
            dtypes); None or empty to build them from ``weights`` (:func:`init_from_weights`).
        weights: Canonical name -> array (any framework's, or NumPy).
        layer: The module they belong to; needed when there are no params yet.
    """
    params, wrapped = _params_of(variables)
    if not params:
        if layer is None:
            raise ValueError("set_weights: there are no params to replace; pass layer= to build "
                             "them from the weights")
        built = init_from_weights(layer, weights)
        return {**(variables or {}), **built} if wrapped else built["params"]
    current = flatten(params)
    spec = {name: tuple(np.shape(value)) for name, value in current.items()}
    dtypes = {name: OPS.dtype_name(value) for name, value in current.items()}
    checked = W.check_weights(spec, weights, dtype=dtypes)
    new = nest({name: OPS.from_numpy(checked[name], like=value) for name, value in current.items()})
    return {**(variables or {}), "params": new} if wrapped else new


def init_weights(layer: Layer, seed: int = 0, **dims: int) -> dict[str, Any]:
    """``{"params": ...}`` drawn on the host as the NumPy layer with this ``seed`` draws them.

    Args:
        layer: The (unbound) module.
        seed: Seed of ``numpy.random.default_rng``.
        **dims: The input sizes its weights need (``q_in``, ``k_in``, ``v_in``, ``d_in``).
    """
    spec = layer.spec(**dims)
    drawn = W.init_weights(spec, np.random.default_rng(seed), "float64")
    return {"params": nest({name: jnp.asarray(value, dtype=layer.param_dtype)
                            for name, value in drawn.items()})}


def init_from_weights(layer: Layer, weights: Mapping[str, Any]) -> dict[str, Any]:
    """``{"params": ...}`` in ``param_dtype`` from canonical weights (checked), without ``init``.

    The input sizes are read off the kernels, as a first call would infer them.
    """
    dtype = np.dtype(layer.param_dtype).name
    checked = W.check_weights(layer.spec(), weights, dtype=dtype)
    return {"params": nest({name: OPS.astype(OPS.from_numpy(value), dtype)
                            for name, value in checked.items()})}


def call_layer(layer: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Initialises a layer with ``PRNGKey(0)`` and returns its output on the given inputs.

    For one-off calls (the CLI demo): ``call_layer(MultiHeadAttention(100, 5), X, X, X)``.
    Keyword arguments go to the layer (``training`` defaults to False, as in every call).
    """
    rngs = {"params": jax.random.PRNGKey(0), "dropout": jax.random.PRNGKey(1)}
    out, _ = layer.init_with_output(rngs, *args, **kwargs)
    return out


class DotProductAttention(Layer, D.DotProductAttention): ...
class AdditiveAttention(Layer, D.AdditiveAttention): ...
class MultiHeadAttention(Layer, D.MultiHeadAttention): ...
class RelativeMultiHeadAttention(Layer, D.RelativeMultiHeadAttention): ...
class PositionalEncoding(Layer, D.PositionalEncoding): ...
class RotaryEmbedding(Layer, D.RotaryEmbedding): ...
class LearnedPositionalEncoding(Layer, D.LearnedPositionalEncoding): ...
class PositionWiseFFN(Layer, D.PositionWiseFFN): ...
class AddNorm(Layer, D.AddNorm): ...
class TransformerEncoderBlock(Layer, D.TransformerEncoderBlock): ...
class TransformerEncoder(Layer, D.TransformerEncoder): ...
class TransformerDecoderBlock(Layer, D.TransformerDecoderBlock): ...
class TransformerDecoder(Layer, D.TransformerDecoder): ...
class Transformer(Layer, D.Transformer): ...
class NadarayaWatson(Layer, D.NadarayaWatson): ...

__all__ = [  # the declared layers (attention_core.declarations.LAYERS), one class each
    "AddNorm", "AdditiveAttention", "DotProductAttention", "LearnedPositionalEncoding",
    "MultiHeadAttention", "NadarayaWatson", "PositionWiseFFN", "PositionalEncoding",
    "RelativeMultiHeadAttention", "RotaryEmbedding", "Transformer", "TransformerDecoder",
    "TransformerDecoderBlock", "TransformerEncoder", "TransformerEncoderBlock",
]
