"""Gluon layers: every declared layer (:mod:`attention_core.declarations`) as a ``HybridBlock``.

Gluon habits: ``initialize()`` makes the parameters (input sizes deferred to the first call)
under their canonical names (kernels ``(in, out)``), also a ``save_parameters`` file's names;
dropout is on inside ``autograd.record()``; ``hybridize()`` builds a graph per input shapes,
dtypes and call options, which skips the core's value checks but not the declared input checks.
Fixed tables (``P``) are ``Constant`` s, kept out of files of layers with weights. MXNet 1.9.1
is the last release: ``Block._reg_params`` (names with dots), ``_collect_params_with_prefix``,
``Parameter._load_init``/``_deferred_init``/``_data`` and ``_cached_graph`` are relied on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING, Any

import mxnet as mx
import numpy as np
from mxnet import autograd, npx
from mxnet.gluon import Parameter

from attention_core import checks, masks, transformer
from attention_core import declarations as D
from attention_core import weights as W
from backends.mxnet.ops import OPS, MXNetOps

if TYPE_CHECKING:  # MXNet has no types; the rest of a HybridBlock is Any (Layer.__getattr__)

    class HybridBlock:
        _cached_graph: Any  # the built graph, (inputs, outputs); empty before the first call
        def __init__(self, prefix: str | None = None, params: Any = None) -> None: ...
        def __call__(self, *args: Any) -> Any: ...
        def cast(self, dtype: Any) -> None: ...
        def export(self, path: str, epoch: int = 0, remove_amp_cast: bool = True) -> None: ...
        def _collect_params_with_prefix(self, prefix: str = "") -> dict[str, Parameter]: ...
else:
    from mxnet.gluon import HybridBlock

#: Parameter dtypes the layers can be built in (MXNet's CPU matmul has no float16).
DTYPES = ("float32", "float64")


@mx.init.register
class CanonicalInit(mx.init.Initializer):
    """Draws a weight by its :func:`~attention_core.weights.init_rule` (in float32, then cast).

    Args:
        name: The canonical name (``W_q.kernel``, ...).
    """

    def __init__(self, name: str) -> None:
        super().__init__(name=name)
        self.canonical = name

    def _init_weight(self, _: Any, arr: Any) -> None:
        rule = W.init_rule(self.canonical, arr.shape)
        if rule.kind == "constant":
            arr[:] = rule.a
        else:  # mx.np.random.uniform(low, high) or .normal(loc, scale)
            arr[:] = getattr(mx.np.random, rule.kind)(rule.a, rule.b, size=arr.shape).astype(arr.dtype)


@dataclass(eq=False)
class GluonArguments:
    """The Gluon layers' own constructor arguments, after the declared ones.

    Args:
        dtype: NumPy dtype name of the parameters (``cast()`` changes it later).
        prefix: As for any ``HybridBlock``.
        params: As for any ``HybridBlock``: a ``ParameterDict`` to share.
    """

    _: KW_ONLY
    dtype: str = "float32"
    prefix: str | None = None
    params: Any = None


def _as_arrays(value: Any, may_pair: bool) -> Any:
    """An array argument as MXNet arrays: one, or a tuple of two where it may be a pair."""
    if value is None:
        return None
    if may_pair and isinstance(value, tuple) and len(value) == 2:
        return tuple(masks.as_backend_array(OPS, part) for part in value)
    return masks.as_backend_array(OPS, value)


def _flat(values: list[Any]) -> tuple[list[Any], tuple[bool, ...]]:
    """The arrays in order, a pair's two in its place (the graph's inputs), and which were pairs."""
    pairs = tuple(isinstance(v, tuple) for v in values)
    return [a for v in values for a in (v if isinstance(v, tuple) else (v,))], pairs


def _nested(arrays: list[Any], pairs: tuple[bool, ...]) -> list[Any]:
    """The arguments :func:`_flat` flattened, its pairs as tuples again (all single if none)."""
    out, rest = [], iter(arrays)
    for pair in pairs or (False,) * len(arrays):
        out.append((next(rest), next(rest)) if pair else next(rest))
    return out


def _has_data(param: Parameter) -> bool:
    return param._data is not None


@D.dataclass_transform()
# HybridBlock first: its params, cast()
class Layer(HybridBlock, GluonArguments, D.KeptAttention, D.Declaration):
    """Holds a declared layer's weights as Gluon parameters and calls its forward.

    Attributes:
        attention_weights: The last call's attention weights ``(B, H, Q, K)``, before dropout
            (a list, one per block, for the encoder); None when not formed.
    """

    extras = D.keyword_parameters(GluonArguments)

    if not TYPE_CHECKING:  # type checkers see the declared signature (dataclass_transform)

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._setup(args, kwargs)

    def _setup(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        declared, extras = self.bind_arguments(args, kwargs, *self.extras)
        dtype = extras["dtype"]
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        HybridBlock.__init__(self, prefix=extras["prefix"], params=extras["params"])
        self.__dict__.update(declared, dtype=dtype)  # plain values: no Block.__setattr__ needed
        self.check()
        self._weights: dict[str, Parameter] = {}
        for name, shape in self.weight_shapes().items():
            param = self.params.get(name, shape=tuple(d or 0 for d in shape), dtype=dtype,
                                    allow_deferred_init=True, init=CanonicalInit(name))
            self._reg_params[name] = self._weights[name] = param  # names contain dots
        self._tables = tuple(tables := self.constants("float64"))
        for name, table in tables.items():  # float64 values, rounded once to the dtype
            self._reg_params[name] = self.params.get_constant(name, mx.np.array(table, dtype="float64"))
            self._reg_params[name].cast(dtype)
        signature = self.call_signature().parameters.items()
        self._arrays = tuple(n for n, p in signature if not isinstance(p.default, bool)
                             and n not in self.cache_arguments + self.function_arguments)
        self._call: tuple[dict[str, Any], bool | str, list[Any]] = ({}, False, [])
        self._graph_key: Any = None
        self._attention_kept = self.finish(None, False, False)[1]

    def __getattr__(self, name: str) -> Any:
        """A held table by its name (``P``): a constant, or a weight of that name."""
        param = self.__dict__.get("_reg_params", {}).get(name)
        if param is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        if _has_data(param) or name not in self.__dict__.get("_tables", ()):
            return param.data()  # a weight's, or Gluon's "not initialized" error
        return param.value.astype(param.dtype)  # a table before initialize()

    def spec(self) -> W.Spec:
        """Canonical names and shapes of this layer's weights (None = not known yet)."""
        return self.weight_shapes(**self._dims())

    def _dims(self) -> dict[str, int]:
        """The input sizes fixed by the parameters that have values (``np.shape`` reads theirs)."""
        return self.dims_from_weights({n: p for n, p in self._weights.items() if _has_data(p)})

    def canonical_params(self) -> dict[str, Parameter]:
        """The Gluon parameters by canonical name (``W_q.kernel``, ...), e.g. to read gradients."""
        return dict(self._weights)

    @property
    def built(self) -> bool:
        """Whether every weight has a value (after the first call or ``set_weights``)."""
        return all(_has_data(p) for p in self._weights.values())

    def get_weights(self) -> dict[str, np.ndarray]:
        """Returns a copy of the weights in the canonical layout (the Weights page)."""
        if not self.built:
            raise checks.not_built(type(self).__name__)
        return {name: p.data().asnumpy() for name, p in self._weights.items()}

    def set_weights(self, weights: Mapping[str, Any]) -> None:
        """Sets every weight from a canonical mapping (of any real float dtype, cast).

        Works before ``initialize()`` and the first call (input sizes from the kernels' shapes);
        every name, shape and value is checked and converted before the first one is set.
        """
        dtypes = {name: np.dtype(p.dtype).name for name, p in self._weights.items()}
        checked = W.check_weights(self.spec(), weights, dtype=dtypes)
        staged = {name: OPS.from_numpy(value) for name, value in checked.items()}
        for name, value in staged.items():
            self._weights[name]._load_init(value, None)

    def cast(self, dtype: Any) -> None:
        """Casts like any block, the tables computed again from float64 rather than re-rounded."""
        super().cast(dtype)
        self.__dict__["dtype"] = np.dtype(dtype).name
        for table in (self._reg_params[name] for name in self._tables):
            if _has_data(table):
                table.set_data(table.value.astype(table.dtype))

    def _collect_params_with_prefix(self, prefix: str = "") -> dict[str, Parameter]:
        """What ``save_parameters``/``load_parameters`` see: the weights, or else the tables."""
        params = super()._collect_params_with_prefix(prefix)
        for name in self._tables if self._weights else ():
            params.pop(f"{prefix}.{name}" if prefix else name, None)
        return params

    def _init_tables(self, ctx: Any) -> None:
        """Gives the fixed tables (``P``) their values if they have none.

        E.g. a layer given ``set_weights`` or ``load_parameters`` but never ``initialize()``.
        """
        for table in (self._reg_params[name] for name in self._tables):
            if not _has_data(table) and not table._deferred_init:
                table.initialize(ctx=ctx)

    def _new_weights(self, dims: Mapping[str, int], ctx: Any) -> dict[str, Any]:
        """Values for the deferred weights a first call needs (not stored); {} when built."""
        self._init_tables(ctx)
        if self.built:
            self._check_built_dims(dims)
            return {}
        spec, new = self.weight_shapes(**{**self._dims(), **dims}), {}
        for name, param in ((n, p) for n, p in self._weights.items() if not _has_data(p)):
            if not param._deferred_init:
                param.data(ctx)  # raises Gluon's "has not been initialized" error
            init, _, default_init, data = param._deferred_init  # as deferred init makes it
            if data is None:
                data = mx.np.zeros(spec[name], dtype=param.dtype, ctx=mx.cpu())
                mx.init.create(default_init)(mx.init.InitDesc(param.name, {"__init__": init}), data)
            new[name] = data.as_in_ctx(ctx)
        return new

    def _check_built_dims(self, dims: Mapping[str, int]) -> None:
        """Refuses input sizes other than those the weights were made for."""
        known = self._dims()
        for name, size in dims.items():
            checks.check_built_size(self.sizes[name].argument, size, known[name])

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not npx.is_np_array():
            raise RuntimeError("backends.mxnet uses MXNet's NumPy interface, which was switched "
                               "off: call mxnet.npx.set_np() again")
        bound = self.bind_call(args, kwargs)
        if any(isinstance(bound[n], mx.sym.Symbol) for n in self._arrays):
            raise TypeError(f"{type(self).__name__} was called with Symbols (a hybridized parent "
                            "block passes them): these blocks build their graph from arrays of known "
                            "shapes, so hybridize() them under a parent that runs imperatively "
                            "(nn.Block, nn.Sequential) and call them with mxnet.numpy arrays")
        # before converting: NumPy inputs (all of one framework), lengths and masks from anywhere
        checks.check_inputs_framework(**{n: bound[n] for n in self.cast_inputs})
        masks.check_dtypes(OPS, bound)
        for n in self.id_inputs:  # nested lists of ids: NumPy's rules, checked by the core
            if bound[n] is not None and not masks.own(OPS, bound[n]):
                bound[n] = transformer.host_ids(n, bound[n])
                transformer.check_ids_form(n, bound[n].shape, bound[n].dtype.name)
        for n in self._arrays:
            bound[n] = _as_arrays(bound[n], n in self.pair_arguments)
        params = list(self._weights.values())
        prepared = self.prepare(OPS, np.dtype(params[0].dtype).name if params else None, bound)
        arrays, pairs = _flat([prepared.arguments[n] for n in self._arrays])
        options = {n: v for n, v in prepared.arguments.items() if n not in self._arrays}
        options["_pairs"] = pairs
        need = self.needs_attention(prepared.return_attention)
        ctx = next(a for a in arrays if a is not None).ctx
        self._make_weights(arrays, options, need, prepared.dims, ctx)
        if self.is_cached(options):  # state in, state out, run imperatively
            data = {n: p.data(ctx) for n, p in self._reg_params.items()}
            return self._finished(self._forward(OPS, arrays, options, need, data), need,
                                  prepared.return_attention)
        key = (tuple(None if a is None else (a.shape, a.dtype) for a in arrays),
               sorted(options.items()), need)
        if self._active and key != self._graph_key:
            self._clear_cached_op()
            self._graph_key = key
        self._call = (options, need, arrays)  # read by hybrid_forward
        try:
            out = super().__call__(*arrays)
        finally:
            self._call = ({}, False, [])
        out = tuple(out) if isinstance(out, (list, tuple)) else out
        return self._finished(out, need, prepared.return_attention)

    def _finished(self, out: Any, need: bool | str, return_attention: Any) -> Any:
        """What a call returns (:meth:`finish`), its attention weights kept."""
        returned, kept = self.finish(out, need, return_attention)
        if self.attention_kind:
            self._attention_kept = kept
        return returned

    def _make_weights(self, arrays: list[Any], options: Mapping[str, Any], need: bool | str,
                      dims: Mapping[str, int], ctx: Any) -> None:
        """A first call's deferred weights: run on once, then kept (a failed run keeps none).

        A cached call runs imperatively (its cache is a tree of arrays, not graph inputs), so
        it may be a layer's first call too.
        """
        with autograd.pause():
            new = self._new_weights(dims, ctx)
            if new:
                held = {n: p.data(ctx) for n, p in self._reg_params.items() if n not in new}
                self._forward(OPS, arrays, options, need, {**held, **new})
            for name, value in new.items():
                self._weights[name]._load_init(value, None)

    def hybrid_forward(self, F: Any, *arrays: Any, **params: Any) -> Any:
        """Runs the forward on arrays (imperative) or Symbols (building the hybridized graph)."""
        options, need, inputs = self._call
        known = [(s, a) for s, a in zip(arrays, inputs, strict=True) if s is not None]
        known += [(s, self._reg_params[n]) for n, s in params.items()]  # a graph's input shapes
        ops = MXNetOps({s.name: (a.shape, np.dtype(a.dtype).name) for s, a in known}) if F is mx.sym else OPS
        return self._forward(ops, list(arrays), options, need, params)

    def _forward(self, ops: MXNetOps, arrays: list[Any], options: Mapping[str, Any],
                 need: bool | str, params: Mapping[str, Any]) -> Any:
        """The declared forward on the given inputs, weights and tables."""
        weights = {n: v for n, v in params.items() if n in self._weights}
        tables = {n: v for n, v in params.items() if n not in self._weights}
        run = D.Run(ops, weights, tables, getattr(self, "dropout", 0.0), need)
        options = dict(options)
        nested = _nested(arrays, options.pop("_pairs", ()))
        return self.compute(run, **dict(zip(self._arrays, nested, strict=True)), **options)

    def export(self, path: str, epoch: int = 0, remove_amp_cast: bool = True) -> None:
        """``HybridBlock.export`` of the output alone (a built graph may return the weights too)."""
        graph = self._cached_graph
        if graph and len(graph[1].list_outputs()) > 1:
            self._cached_graph = (graph[0], graph[1][0])
        try:
            super().export(path, epoch, remove_amp_cast)  # also raises when nothing was built
        finally:
            self._cached_graph = graph

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.describe()})"


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
