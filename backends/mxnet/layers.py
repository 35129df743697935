"""Gluon layers: ``HybridBlock`` s holding parameters in the canonical layout and calling the core.

Every layer works imperatively and after ``hybridize()``, with the Gluon habits: parameters are
created by ``initialize()`` (input sizes deferred to the first call, like
``nn.Dense(flatten=False)``), ``save_parameters``/``load_parameters`` round-trip, dropout is on
inside ``autograd.record()``, and ``attention_weights`` holds the last call's weights.

With ``keep_attention_weights=False`` (constructor argument or attribute),
``DotProductAttention``, ``MultiHeadAttention`` and ``TransformerEncoderBlock`` calls that do
not ask for the weights (``return_attention=False``) pool by ``implementation`` instead (None
lets the core choose, see :func:`attention_core.attention.choose_implementation`; the
``"blockwise"`` path never forms the ``(B, H, Q, K)`` weights), and ``attention_weights`` is
then None. MXNet has no loop the core can use, so a hybridized graph holds the blockwise
path's loops unrolled: one copy of the tile computation per (query block, key block).

Parameters are registered under their canonical names (``W_q.kernel``, ``attention.W_q.kernel``,
..., DESIGN section 5), which are also the names in a ``save_parameters`` file; kernels are
``(in, out)``, not Gluon's ``(out, in)``.

How a call runs: the layer checks its inputs, creates the weights the first call needs (and keeps
them only once that call has succeeded), then goes through ``HybridBlock.__call__``:
``hybrid_forward`` calls the core with :class:`~backends.mxnet.ops.MXNetOps` on arrays, or on
Symbols while a hybridized block builds its graph. A graph is built for given input shapes,
dtypes and call options (``causal``); a call with others builds a new one, as ``jax.jit``
retraces. Value checks (e.g. ``valid_lens`` <= the number of keys) run in imperative calls only,
except the token ids of ``TransformerEncoder``, checked on every call (MXNet's ``take`` would
wrap bad ids around instead of failing).

Host constants: a Symbol cannot hold an array's values, so :class:`MXNetOps` refuses
``ops.from_numpy`` while a graph is built. The one the core would make, the sinusoidal table of
``PositionalEncoding`` and ``TransformerEncoder``, is a Gluon ``Constant`` ``P`` of the layer,
so an ``export()`` ed graph takes only the caller's inputs. ``export()`` writes the layer's
output alone (not the attention weights a hybridized call also returns).

MXNet 1.9.1 is the last release, so a few of its internals are relied on: ``Block._reg_params``
(registering under canonical names, which contain dots), ``Parameter._load_init`` (what
``load_parameters`` uses), ``Parameter._deferred_init``/``_data``,
``HybridBlock._clear_cached_op`` and ``_cached_graph`` (``export()``), and
``Block._collect_params_with_prefix`` (what the parameters files hold).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import mxnet as mx
import numpy as np
from mxnet import autograd, npx
from mxnet.gluon import HybridBlock, Parameter

from attention_core import attention, checks, masks, multihead, positional, transformer
from attention_core import weights as W
from attention_core.host import PlainArguments
from backends.mxnet.ops import OPS, MXNetOps

#: Parameter dtypes the layers can be built in (MXNet's CPU matmul has no float16).
DTYPES = ("float32", "float64")


@mx.init.register
class CanonicalInit(mx.init.Initializer):
    """The initial values of :func:`attention_core.weights.init_weights`, as a Gluon initializer.

    Kernels are Glorot-uniform, biases and ``beta`` zero, ``gamma`` one, a learned table ``P``
    normal with std 0.02, an ``embedding`` table ``(N, D)`` normal with std ``1 / sqrt(D)``, a
    kernel width ``w`` uniform in [0, 1). Values are drawn in float32 and cast, so every
    parameter dtype works (MXNet's own ``Xavier`` fails on float64).

    Args:
        leaf: The last part of the canonical name (``kernel``, ``bias``, ``gamma``, ...).
    """

    def __init__(self, leaf: str) -> None:
        super().__init__(leaf=leaf)
        self.leaf = leaf

    def _init_weight(self, _: Any, arr: Any) -> None:
        shape = arr.shape
        if self.leaf == "kernel":
            limit = float(np.sqrt(6.0 / (shape[0] + shape[1])))
            value = mx.np.random.uniform(-limit, limit, size=shape)
        elif self.leaf in ("bias", "beta"):
            value = mx.np.zeros(shape)
        elif self.leaf == "gamma":
            value = mx.np.ones(shape)
        elif self.leaf == "P":
            value = mx.np.random.normal(0.0, 0.02, size=shape)
        elif self.leaf == "embedding":
            value = mx.np.random.normal(0.0, 1.0 / float(np.sqrt(shape[-1])), size=shape)
        else:
            value = mx.np.random.uniform(0.0, 1.0, size=shape)
        arr[:] = value.astype(arr.dtype)


def _has_data(param: Parameter) -> bool:
    return param._data is not None


#: The slots of :attr:`Layer._slots` that are not floating inputs.
_NOT_FLOATING = ("valid_lens", "mask", "tokens")


class Layer(PlainArguments, HybridBlock):
    """Base of the Gluon layers.

    A call's arrays are named by :attr:`_slots`; ``valid_lens`` and ``mask`` are host-side
    arguments, ``tokens`` integer ids, every other slot a floating input computed on (cast to
    the parameters' dtype by the dtype rule, :func:`attention_core.checks.compute_inputs`).

    Args:
        dropout: Dropout rate, active inside ``autograd.record()`` (training mode).
        dtype: NumPy dtype name of the parameters (``cast()`` changes it later).
        **kwargs: ``prefix`` and ``params``, as for any ``HybridBlock``.

    Attributes:
        attention_weights: The last call's attention weights ``(B, H, Q, K)``, before dropout
            (attention layers and the encoder block; the encoder keeps a list, one per block).
    """

    #: The names of the arrays :meth:`_run` gets, in order.
    _slots: tuple[str, ...] = ("X",)
    #: ``HybridBlock``'s built graph, ``(inputs, outputs)`` (empty before the first call).
    _cached_graph: Any

    def __init__(self, dropout: float = 0.0, *, dtype: str = "float32", **kwargs: Any) -> None:
        dropout = checks.check_dropout(dropout)
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        super().__init__(**kwargs)
        self.dropout = dropout
        self._param_dtype = dtype
        self._weights: dict[str, Parameter] = {}
        self._options: dict[str, Any] = {}
        self._inputs: list[Any] = []
        self._graph_key: Any = None
        self.attention_weights: Any = None

    # -- parameters -------------------------------------------------------------------------

    def _spec(self, dims: Mapping[str, int | None]) -> W.Spec:
        """Canonical names and shapes for the given input sizes (None = not known yet)."""
        return {}

    def _declare(self) -> None:
        """Creates a deferred Gluon parameter for every name of the spec, registered under it."""
        for name, shape in self._spec({}).items():
            param = self.params.get(
                name, shape=tuple(d or 0 for d in shape), dtype=self._param_dtype,
                allow_deferred_init=True,
                init=CanonicalInit(name.rpartition(".")[2]),
            )
            self._reg_params[name] = param  # what Block.__setattr__ does; names contain dots
            self._weights[name] = param

    def _dims(self) -> dict[str, int]:
        """The input sizes already fixed by the parameters' shapes."""
        dims = {}
        for dim, name in W.INPUT_KERNELS.items():
            shape = self._weights[name].shape if name in self._weights else None
            if shape and shape[0] > 0:
                dims[dim] = int(shape[0])
        return dims

    def spec(self) -> W.Spec:
        """Canonical names and shapes of this layer's weights (None = not known yet)."""
        known: dict[str, int | None] = dict(self._dims())
        return self._spec(known)

    def canonical_params(self) -> dict[str, Parameter]:
        """The Gluon parameters by canonical name (``W_q.kernel``, ...), e.g. to read gradients."""
        return dict(self._weights)

    @property
    def built(self) -> bool:
        """Whether every weight has a value (after the first call or ``set_weights``)."""
        return all(_has_data(p) for p in self._weights.values())

    def get_weights(self) -> dict[str, np.ndarray]:
        """Returns a copy of the weights in the canonical layout (DESIGN section 5)."""
        if not self.built:
            raise checks.not_built(type(self).__name__)
        return {name: p.data().asnumpy() for name, p in self._weights.items()}

    def set_weights(self, weights: Mapping[str, Any]) -> None:
        """Sets every weight from a canonical mapping; checks all names and shapes first.

        Works before ``initialize()`` and before the first call: input sizes are read off the
        kernels' shapes. Values of any real float dtype are cast to the parameters' dtype;
        every value is checked and converted before the first parameter changes.
        """
        dtypes = {name: np.dtype(p.dtype).name for name, p in self._weights.items()}
        checked = W.check_weights(self.spec(), weights, dtype=dtypes)
        staged = {name: OPS.from_numpy(value) for name, value in checked.items()}
        for name, value in staged.items():
            self._weights[name]._load_init(value, None)

    def _current(self, dims: Mapping[str, int], ctx: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """The weights to use for inputs of the given sizes, and those that must be created.

        Returns:
            ``(weights, new)``: when some weights must be created, every weight's array, and the
            subset created here, which is not stored (:meth:`_keep` stores it once the call has
            succeeded); ``({}, {})`` when the layer is built.
        """
        if self.built:
            known = self._dims()
            for name, size in dims.items():
                checks.check_built_size(W.INPUT_ARGS[name], size, known[name])
            return {}, {}
        spec = self._spec({**self._dims(), **dims})
        weights, new = {}, {}
        for name, param in self._weights.items():
            if _has_data(param):
                weights[name] = param.data(ctx)
            elif not param._deferred_init:
                param.data(ctx)  # raises Gluon's "has not been initialized" error
            else:
                new[name] = weights[name] = _initial_value(param, spec[name], ctx)
        return weights, new

    def _keep(self, new: Mapping[str, Any]) -> None:
        """Stores weights created for a call that succeeded (finishing deferred init)."""
        for name, value in new.items():
            self._weights[name]._load_init(value, None)

    # -- calls ------------------------------------------------------------------------------

    def _run(self, arrays: list[Any], **options: Any) -> Any:
        """Checks the inputs and calls the core on them through ``HybridBlock.__call__``.

        Args:
            arrays: The call's arrays in ``hybrid_forward`` order; None for absent ones.
            **options: Python call options that shape the graph (``causal``).

        Returns:
            What :meth:`_compute` returns.
        """
        if not npx.is_np_array():
            raise RuntimeError(
                "backends.mxnet uses MXNet's NumPy interface, which was switched off: call "
                "mxnet.npx.set_np() again"
            )
        if any(isinstance(a, mx.sym.Symbol) for a in arrays):
            raise TypeError(
                f"{type(self).__name__} was called with Symbols (a hybridized parent block passes "
                "them): these blocks build their graph from arrays of known shapes, so hybridize() "
                "them under a parent that runs imperatively (nn.Block, nn.Sequential) and call "
                "them with mxnet.numpy arrays"
            )
        named = dict(zip(self._slots, arrays, strict=True))
        floating = [i for i, n in enumerate(self._slots) if n not in _NOT_FLOATING]
        # before converting: NumPy inputs are taken (all of one framework), lengths and masks
        # from anywhere
        checks.check_inputs_framework(**{self._slots[i]: arrays[i] for i in floating})
        masks.check_dtypes(OPS, named.get("valid_lens"), named.get("mask"))
        arrays = [None if a is None else masks.as_backend_array(OPS, a) for a in arrays]
        params = list(self._weights.values())
        dtype = np.dtype(params[0].dtype).name if params else None
        cast = checks.compute_inputs(OPS, dtype, **{self._slots[i]: arrays[i] for i in floating})
        for i, x in zip(floating, cast, strict=True):
            arrays[i] = x
        dims = self._check_inputs(arrays)
        weights, new = self._current(dims, arrays[0].ctx)
        if new:  # the first call: run it on the new weights before keeping them
            with autograd.pause():
                self._compute(OPS, arrays, weights, options)
            self._keep(new)
        key = (tuple(None if a is None else (a.shape, a.dtype) for a in arrays), sorted(options.items()))
        if self._active and key != self._graph_key:
            self._clear_cached_op()
            self._graph_key = key
        self._options, self._inputs = options, arrays  # read by hybrid_forward
        try:
            out = super().__call__(*arrays)
        finally:
            self._inputs = []
        return tuple(out) if isinstance(out, (list, tuple)) else out

    def _check_inputs(self, arrays: list[Any]) -> dict[str, int]:
        """Checks what the core does not check before weights are made; returns the input sizes."""
        return {}

    def export(self, path: str, epoch: int = 0, remove_amp_cast: bool = True) -> None:
        """``HybridBlock.export`` of the layer's output alone.

        A hybridized call also returns the attention weights (to fill ``attention_weights``);
        the exported graph returns only the output, so ``SymbolBlock.imports`` gives one array.
        """
        graph = self._cached_graph
        if not graph or len(graph[1].list_outputs()) == 1:
            super().export(path, epoch, remove_amp_cast)  # also raises when nothing was built
            return
        self._cached_graph = (graph[0], graph[1][0])
        try:
            super().export(path, epoch, remove_amp_cast)
        finally:
            self._cached_graph = graph

    def hybrid_forward(self, F: Any, *arrays: Any, **params: Any) -> Any:
        """Calls the core with arrays (imperative) or Symbols (building the hybridized graph)."""
        ops = OPS if F is not mx.sym else self._graph_ops(list(arrays), params)
        return self._compute(ops, list(arrays), params, self._options)

    def _graph_ops(self, symbols: list[Any], params: Mapping[str, Any]) -> MXNetOps:
        """Ops for building a graph from its input and parameter Symbols.

        Shapes and dtypes come from :attr:`_inputs` and the parameters.
        """
        known = {s.name: (a.shape, np.dtype(a.dtype).name)
                 for s, a in zip(symbols, self._inputs, strict=True) if s is not None}
        for name, s in params.items():
            param = self._reg_params[name]
            known[s.name] = (param.shape, np.dtype(param.dtype).name)
        return MXNetOps(known)

    def _compute(self, ops: MXNetOps, arrays: list[Any], weights: Mapping[str, Any],
                 options: Mapping[str, Any]) -> Any:
        """The layer's computation: one call of the core."""
        raise NotImplementedError

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self._config().items())
        return f"{type(self).__name__}({args})"

    def _config(self) -> dict[str, Any]:
        return {"dropout": self.dropout}


def _path_config(layer: Any) -> dict[str, Any]:
    """``keep_attention_weights`` and ``implementation`` for ``repr``, when not the defaults."""
    config: dict[str, Any] = {}
    if not layer.keep_attention_weights:
        config["keep_attention_weights"] = False
    if layer.implementation is not None:
        config["implementation"] = layer.implementation
    return config


def _initial_value(param: Parameter, shape: tuple[int | None, ...], ctx: Any) -> Any:
    """A new value for a deferred parameter, as its deferred initialisation would make it."""
    init, _, default_init, data = param._deferred_init
    if data is None:
        dims = tuple(int(d) for d in shape if d is not None)
        if len(dims) != len(shape):
            raise ValueError(f"{param.name} has unknown dimensions {checks.fmt_shape(shape)}")
        with autograd.pause():
            data = mx.np.zeros(dims, dtype=param.dtype, ctx=mx.cpu())
            mx.init.create(default_init)(mx.init.InitDesc(param.name, {"__init__": init}), data)
    return data.as_in_ctx(ctx)


class _Attention(Layer):
    """Shared call of the attention layers: check, create weights if needed, attend, keep."""

    _slots = ("queries", "keys", "values", "valid_lens", "mask")

    #: Whether calls keep their weights in ``attention_weights`` (always, for additive attention).
    keep_attention_weights = True
    #: How calls that form no weights pool (None: the core chooses).
    implementation: str | None = None

    def _init_paths(self, keep_attention_weights: bool, implementation: str | None) -> None:
        """Sets the two pooling options of the layers that have them."""
        self.keep_attention_weights = bool(keep_attention_weights)
        self.implementation = checks.check_implementation(implementation)

    def __call__(
        self,
        queries: Any,
        keys: Any,
        values: Any,
        valid_lens: Any = None,
        *,
        mask: Any = None,
        causal: bool = False,
        return_attention: bool = False,
    ) -> Any:
        """Attends from ``queries`` ``(B, Q, Dq)`` to ``keys`` ``(B, K, Dk)`` over ``values`` ``(B, K, Dv)``.

        Args:
            queries: ``(B, Q, Dq)``.
            keys: ``(B, K, Dk)``.
            values: ``(B, K, Dv)``.
            valid_lens: Integer lengths, ``(B,)`` or ``(B, Q)``.
            mask: Boolean, True = may attend: ``(Q, K)``, ``(B, Q, K)`` or ``(B, H, Q, K)``.
            causal: Query ``i`` sees keys ``j <= i + (K - Q)``.
            return_attention: Also return the attention weights ``(B, H, Q, K)``.

        Returns:
            The output ``(B, Q, Dv)`` (``(B, Q, num_hiddens)`` for multi-head attention), and the
            weights if asked.
        """
        need = return_attention or self.keep_attention_weights
        result = self._run([queries, keys, values, valid_lens, mask], causal=causal, weights=need)
        out, self.attention_weights = result if need else (result, None)
        return result if return_attention else out

    def _check_inputs(self, arrays: list[Any]) -> dict[str, int]:
        attention.check_projected_inputs(OPS, *arrays[:3])
        return self._input_sizes(*arrays[:3])

    def _input_sizes(self, queries: Any, keys: Any, values: Any) -> dict[str, int]:
        return {}

    def _compute(self, ops: MXNetOps, arrays: list[Any], weights: Mapping[str, Any],
                 options: Mapping[str, Any]) -> Any:
        q, k, v, valid_lens, mask = arrays
        return self._attend(weights, q, k, v, valid_lens, mask=mask, causal=options["causal"],
                            dropout=self.dropout, return_weights=options["weights"], ops=ops)

    def _attend(self, weights: Mapping[str, Any], *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


class DotProductAttention(_Attention):
    """Scaled dot-product attention (no weights).

    Args:
        dropout: Dropout rate on the attention weights in training.
        keep_attention_weights: Keep each call's weights in ``attention_weights``; when
            False, calls without ``return_attention`` pool by ``implementation``.
        implementation: None, ``"direct"``, ``"blockwise"`` or ``"fused"``: how calls that do
            not form the weights pool (None lets the core choose).
        **kwargs: See :class:`Layer`.
    """

    def __init__(
        self, dropout: float = 0.0, *, keep_attention_weights: bool = True,
        implementation: str | None = None, **kwargs: Any,
    ) -> None:
        super().__init__(dropout, **kwargs)
        self._init_paths(keep_attention_weights, implementation)

    def _attend(self, weights: Mapping[str, Any], *args: Any, **kwargs: Any) -> Any:
        implementation = None if kwargs["return_weights"] else self.implementation
        return attention.dot_product_attention(*args, implementation=implementation, **kwargs)

    def _config(self) -> dict[str, Any]:
        return {"dropout": self.dropout, **_path_config(self)}


class AdditiveAttention(_Attention):
    """Additive (Bahdanau) attention with hidden size ``num_hiddens``.

    Args:
        num_hiddens: Hidden size h of the scoring network.
        dropout: Dropout rate on the attention weights in training.
        **kwargs: See :class:`Layer`.
    """

    def __init__(self, num_hiddens: int, dropout: float = 0.0, **kwargs: Any) -> None:
        super().__init__(dropout, **kwargs)
        self.num_hiddens = checks.check_positive_int("num_hiddens", num_hiddens)
        self._declare()

    def _spec(self, dims: Mapping[str, int | None]) -> W.Spec:
        return W.additive_spec(self.num_hiddens, dims.get("q_in"), dims.get("k_in"))

    def _input_sizes(self, queries: Any, keys: Any, values: Any) -> dict[str, int]:
        return {"q_in": queries.shape[-1], "k_in": keys.shape[-1]}

    def _attend(self, weights: Mapping[str, Any], *args: Any, **kwargs: Any) -> Any:
        q, k, v, valid_lens = args
        return attention.additive_attention(q, k, v, weights, valid_lens, **kwargs)

    def _config(self) -> dict[str, Any]:
        return {"num_hiddens": self.num_hiddens, "dropout": self.dropout}


class MultiHeadAttention(_Attention):
    """Multi-head attention: ``num_heads`` heads over ``num_hiddens`` projected features.

    Args:
        num_hiddens: Width h of the projections and the output.
        num_heads: Number of heads H; must divide h.
        dropout: Dropout rate on the attention weights in training.
        bias: Whether the four projections have biases.
        keep_attention_weights: Keep each call's weights in ``attention_weights``; when
            False, calls without ``return_attention`` pool by ``implementation``.
        implementation: None, ``"direct"``, ``"blockwise"`` or ``"fused"``: how calls that do
            not form the weights pool (None lets the core choose).
        **kwargs: See :class:`Layer`.
    """

    def __init__(
        self, num_hiddens: int, num_heads: int, dropout: float = 0.0, bias: bool = False, *,
        keep_attention_weights: bool = True, implementation: str | None = None, **kwargs: Any,
    ) -> None:
        checks.check_heads(num_hiddens, num_heads)
        super().__init__(dropout, **kwargs)
        self.num_hiddens, self.num_heads, self.bias = num_hiddens, num_heads, bool(bias)
        self._init_paths(keep_attention_weights, implementation)
        self._declare()

    def _spec(self, dims: Mapping[str, int | None]) -> W.Spec:
        return W.multi_head_spec(self.num_hiddens, self.num_heads, self.bias,
                                 dims.get("q_in"), dims.get("k_in"), dims.get("v_in"))

    def _input_sizes(self, queries: Any, keys: Any, values: Any) -> dict[str, int]:
        return {"q_in": queries.shape[-1], "k_in": keys.shape[-1], "v_in": values.shape[-1]}

    def _attend(self, weights: Mapping[str, Any], *args: Any, **kwargs: Any) -> Any:
        q, k, v, valid_lens = args
        implementation = None if kwargs["return_weights"] else self.implementation
        return multihead.multi_head_attention(q, k, v, weights, self.num_heads, valid_lens,
                                              implementation=implementation, **kwargs)

    def _config(self) -> dict[str, Any]:
        return {"num_hiddens": self.num_hiddens, "num_heads": self.num_heads,
                "dropout": self.dropout, "bias": self.bias,
                **_path_config(self)}


class RelativeMultiHeadAttention(_Attention):
    """Multi-head attention with relative position representations (Shaw et al., 2018).

    The weights of :class:`MultiHeadAttention` plus one learned vector per clipped offset
    between a key and a query, shared by the heads: ``rel_k.embedding`` ``(2m + 1, h/H)``, added
    to the keys, and with ``relative_values`` ``rel_v.embedding``, added to the values. The
    attention weights are always formed (the offsets' terms need them).

    Args:
        num_hiddens: Width h of the projections and the output.
        num_heads: Number of heads H; must divide h.
        max_relative_position: m: offsets between a key and a query are clipped to [-m, m].
        dropout: Dropout rate on the attention weights in training.
        bias: Whether the four projections have biases.
        relative_values: Also add the offsets' vectors to the values.
        keep_attention_weights: Keep each call's weights in ``attention_weights``.
        **kwargs: See :class:`Layer`.
    """

    def __init__(
        self, num_hiddens: int, num_heads: int, max_relative_position: int, dropout: float = 0.0,
        bias: bool = False, *, relative_values: bool = True, keep_attention_weights: bool = True,
        **kwargs: Any,
    ) -> None:
        W.relative_multi_head_spec(num_hiddens, num_heads, max_relative_position)  # checks them
        super().__init__(dropout, **kwargs)
        self.num_hiddens, self.num_heads, self.bias = num_hiddens, num_heads, bool(bias)
        self.max_relative_position = max_relative_position
        self.relative_values = bool(relative_values)
        self._init_paths(keep_attention_weights, None)
        self._declare()

    def _spec(self, dims: Mapping[str, int | None]) -> W.Spec:
        return W.relative_multi_head_spec(
            self.num_hiddens, self.num_heads, self.max_relative_position, self.bias,
            self.relative_values, dims.get("q_in"), dims.get("k_in"), dims.get("v_in"),
        )

    def _input_sizes(self, queries: Any, keys: Any, values: Any) -> dict[str, int]:
        return {"q_in": queries.shape[-1], "k_in": keys.shape[-1], "v_in": values.shape[-1]}

    def _attend(self, weights: Mapping[str, Any], *args: Any, **kwargs: Any) -> Any:
        q, k, v, valid_lens = args
        return multihead.relative_multi_head_attention(q, k, v, weights, self.num_heads,
                                                       valid_lens, **kwargs)

    def _config(self) -> dict[str, Any]:
        config = {"num_hiddens": self.num_hiddens, "num_heads": self.num_heads,
                  "max_relative_position": self.max_relative_position,
                  "dropout": self.dropout, "bias": self.bias}
        if not self.relative_values:
            config["relative_values"] = False
        return {**config, **_path_config(self)}


class _SinusoidalTable(Layer):
    """A layer holding the sinusoidal table ``P`` ``(1, max_len, num_hiddens)``, a Gluon ``Constant``.

    ``P`` has no gradient and is not one of the canonical weights; its value stays float64, so
    the table is rounded once to the parameter dtype (also after ``cast()``).
    """

    max_len: int
    num_hiddens: int

    def _register_table(self, max_len: int, num_hiddens: int) -> None:
        table = positional.sinusoidal_encoding(max_len, num_hiddens, "float64")[None]
        constant = self.params.get_constant("P", mx.np.array(table, dtype="float64"))
        constant.cast(self._param_dtype)  # its value stays float64: the table is rounded once
        self._reg_params["P"] = constant  # what Block.__setattr__ does; P is a property here

    @property
    def P(self) -> Any:  # noqa: N802 - the name the source chapter uses
        """The table, ``(1, max_len, num_hiddens)``, an ``mxnet.numpy`` array."""
        table = self._reg_params["P"]
        return table.data() if _has_data(table) else table.value.astype(table.dtype)

    def cast(self, dtype: Any) -> None:
        """Casts like any block, the table computed again from float64 rather than re-rounded."""
        super().cast(dtype)
        table = self._reg_params["P"]
        if _has_data(table):
            table.set_data(table.value.astype(table.dtype))


class PositionalEncoding(_SinusoidalTable):
    """Adds the sinusoidal table ``P`` (shape ``(1, max_len, num_hiddens)``) to the input.

    ``P`` is a Gluon ``Constant`` (no gradient, not in the canonical weights); like every
    parameter it exists after ``initialize()``.

    Args:
        num_hiddens: Width of the encoding.
        dropout: Dropout rate on the sum in training.
        max_len: Number of positions in the table.
        **kwargs: See :class:`Layer`.
    """

    def __init__(self, num_hiddens: int, dropout: float = 0.0,
                 max_len: int = positional.DEFAULT_MAX_LEN, **kwargs: Any) -> None:
        super().__init__(dropout, **kwargs)
        self.num_hiddens, self.max_len = num_hiddens, max_len
        self._register_table(max_len, num_hiddens)

    def __call__(self, X: Any) -> Any:
        """Returns ``dropout(X + P[:, :T])`` for ``X`` of shape ``(B, T, num_hiddens)``."""
        return self._run([X])

    def _compute(self, ops: MXNetOps, arrays: list[Any], weights: Mapping[str, Any],
                 options: Mapping[str, Any]) -> Any:
        return positional.add_positions(arrays[0], weights["P"], self.dropout, ops=ops)

    def _config(self) -> dict[str, Any]:
        return {"num_hiddens": self.num_hiddens, "dropout": self.dropout, "max_len": self.max_len}


class LearnedPositionalEncoding(Layer):
    """Adds a learned table ``P`` (shape ``(1, max_len, num_hiddens)``) to the input.

    Args:
        num_hiddens: Width of the encoding.
        dropout: Dropout rate on the sum in training.
        max_len: Number of positions in the table.
        **kwargs: See :class:`Layer`.
    """

    def __init__(self, num_hiddens: int, dropout: float = 0.0, max_len: int = 1000,
                 **kwargs: Any) -> None:
        super().__init__(dropout, **kwargs)
        self.num_hiddens, self.max_len = num_hiddens, max_len
        self._declare()

    def _spec(self, dims: Mapping[str, int | None]) -> W.Spec:
        return W.learned_positional_spec(self.num_hiddens, self.max_len)

    @property
    def P(self) -> Any:  # noqa: N802 - the name the source chapter uses
        """The learned table, ``(1, max_len, num_hiddens)`` (after ``initialize()``)."""
        return self._weights["P"].data()

    def __call__(self, X: Any) -> Any:
        """Returns ``dropout(X + P[:, :T])`` for ``X`` of shape ``(B, T, num_hiddens)``."""
        return self._run([X])

    def _compute(self, ops: MXNetOps, arrays: list[Any], weights: Mapping[str, Any],
                 options: Mapping[str, Any]) -> Any:
        return positional.add_positions(arrays[0], weights["P"], self.dropout, ops=ops)

    def _config(self) -> dict[str, Any]:
        return {"num_hiddens": self.num_hiddens, "dropout": self.dropout, "max_len": self.max_len}


class PositionWiseFFN(Layer):
    """Two dense layers with a ReLU between, applied at every position.

    Args:
        ffn_num_hiddens: Width of the hidden layer.
        ffn_num_outputs: Width of the output.
        **kwargs: See :class:`Layer`.
    """

    def __init__(self, ffn_num_hiddens: int, ffn_num_outputs: int, **kwargs: Any) -> None:
        super().__init__(0.0, **kwargs)
        self.ffn_num_hiddens, self.ffn_num_outputs = ffn_num_hiddens, ffn_num_outputs
        self._declare()

    def _spec(self, dims: Mapping[str, int | None]) -> W.Spec:
        return W.ffn_spec(self.ffn_num_hiddens, self.ffn_num_outputs, dims.get("d_in"))

    def __call__(self, X: Any) -> Any:
        """Returns ``dense2(relu(dense1(X)))`` for ``X`` of shape ``(B, T, d)``."""
        return self._run([X])

    def _check_inputs(self, arrays: list[Any]) -> dict[str, int]:
        shape = checks.check_rank(OPS, "X", arrays[0], (3,), "(B, T, d)")
        return {"d_in": shape[-1]}

    def _compute(self, ops: MXNetOps, arrays: list[Any], weights: Mapping[str, Any],
                 options: Mapping[str, Any]) -> Any:
        return transformer.position_wise_ffn(arrays[0], weights, ops=ops)

    def _config(self) -> dict[str, Any]:
        return {"ffn_num_hiddens": self.ffn_num_hiddens, "ffn_num_outputs": self.ffn_num_outputs}


class AddNorm(Layer):
    """Residual connection followed by layer normalisation over the last axis (eps 1e-5).

    Args:
        num_hiddens: Width of the normalised axis.
        dropout: Dropout rate on ``Y`` in training.
        **kwargs: See :class:`Layer`.
    """

    _slots = ("X", "Y")

    def __init__(self, num_hiddens: int, dropout: float = 0.0, **kwargs: Any) -> None:
        super().__init__(dropout, **kwargs)
        self.num_hiddens = num_hiddens
        self._declare()

    def _spec(self, dims: Mapping[str, int | None]) -> W.Spec:
        return W.add_norm_spec(self.num_hiddens)

    def __call__(self, X: Any, Y: Any) -> Any:
        """Returns ``LayerNorm(dropout(Y) + X)``."""
        return self._run([X, Y])

    def _check_inputs(self, arrays: list[Any]) -> dict[str, int]:
        checks.check_last_dim(OPS, "X", arrays[0], self.num_hiddens)
        return {}

    def _compute(self, ops: MXNetOps, arrays: list[Any], weights: Mapping[str, Any],
                 options: Mapping[str, Any]) -> Any:
        X, Y = arrays
        return transformer.add_norm(X, Y, weights, self.dropout, ops=ops)

    def _config(self) -> dict[str, Any]:
        return {"num_hiddens": self.num_hiddens, "dropout": self.dropout}


class TransformerEncoderBlock(Layer):
    """Self-attention and a position-wise FFN, each wrapped in add & norm.

    Args:
        num_hiddens: Model width h.
        ffn_num_hiddens: Hidden width of the FFN.
        num_heads: Heads of the self-attention.
        dropout: Dropout rate of the attention weights and both residual branches, in training.
        bias: Whether the attention projections have biases.
        keep_attention_weights: Keep each call's self-attention weights in
            ``attention_weights``; when False, calls pool by ``implementation``.
        implementation: None, ``"direct"``, ``"blockwise"`` or ``"fused"``: how calls that do
            not form the weights pool (None lets the core choose).
        **kwargs: See :class:`Layer`.
    """

    _slots = ("X", "valid_lens", "mask")

    def __init__(
        self,
        num_hiddens: int,
        ffn_num_hiddens: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = False,
        *,
        keep_attention_weights: bool = True,
        implementation: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(dropout, **kwargs)
        self.num_hiddens, self.ffn_num_hiddens = num_hiddens, ffn_num_hiddens
        self.num_heads, self.bias = num_heads, bool(bias)
        self.keep_attention_weights = bool(keep_attention_weights)
        self.implementation = checks.check_implementation(implementation)
        self._declare()

    def _spec(self, dims: Mapping[str, int | None]) -> W.Spec:
        return W.encoder_block_spec(self.num_hiddens, self.ffn_num_hiddens, self.num_heads, self.bias)

    def __call__(self, X: Any, valid_lens: Any = None, *, mask: Any = None) -> Any:
        """Encodes ``X`` ``(B, T, num_hiddens)``; ``valid_lens`` and ``mask`` limit the self-attention."""
        need = self.keep_attention_weights
        result = self._run([X, valid_lens, mask], weights=need)
        out, self.attention_weights = result if need else (result, None)
        return out

    def _check_inputs(self, arrays: list[Any]) -> dict[str, int]:
        checks.check_rank(OPS, "X", arrays[0], (3,), "(B, T, num_hiddens)")
        checks.check_last_dim(OPS, "X", arrays[0], self.num_hiddens)
        return {}

    def _compute(self, ops: MXNetOps, arrays: list[Any], weights: Mapping[str, Any],
                 options: Mapping[str, Any]) -> Any:
        X, valid_lens, mask = arrays
        need = options["weights"]
        return transformer.transformer_encoder_block(
            X, weights, self.num_heads, valid_lens, mask=mask, dropout=self.dropout,
            return_weights=need, implementation=None if need else self.implementation, ops=ops,
        )

    def _config(self) -> dict[str, Any]:
        return {"num_hiddens": self.num_hiddens, "ffn_num_hiddens": self.ffn_num_hiddens,
                "num_heads": self.num_heads, "dropout": self.dropout, "bias": self.bias,
                **_path_config(self)}


class TransformerEncoder(_SinusoidalTable):
    """The Transformer encoder: scaled token embedding, sinusoidal encoding, ``num_blks`` blocks.

    ``X = dropout(E[tokens] * sqrt(h) + P)``, then every :class:`TransformerEncoderBlock` in
    turn. Its weights are ``token.embedding`` ``(vocab_size, h)`` and block ``i`` 's under
    ``blks.<i>.``; all sizes are known at construction.

    Args:
        vocab_size: V, the number of token ids.
        num_hiddens: Model width h.
        ffn_num_hiddens: Hidden width of the blocks' FFNs.
        num_heads: Heads of every block's self-attention.
        num_blks: Number of blocks.
        dropout: Dropout rate of the encoding's sum and inside every block, in training.
        bias: Whether the attention projections have biases.
        keep_attention_weights: Keep each call's self-attention weights in
            ``attention_weights``, a list with one ``(B, H, T, T)`` array per block (a list of
            None when False); when False, calls pool by ``implementation``.
        implementation: None, ``"direct"``, ``"blockwise"`` or ``"fused"``: how calls that do
            not form the weights pool (None lets the core choose).
        max_len: Rows of the sinusoidal table ``P``, the longest sequence the encoder takes.
            ``P`` is a Gluon ``Constant`` of the graph (as in :class:`PositionalEncoding`) but
            stays out of ``save_parameters`` files, which hold the canonical weights only.
        **kwargs: See :class:`Layer`.
    """

    _slots = ("tokens", "valid_lens", "mask")

    def __init__(
        self,
        vocab_size: int,
        num_hiddens: int,
        ffn_num_hiddens: int,
        num_heads: int,
        num_blks: int,
        dropout: float = 0.0,
        bias: bool = False,
        *,
        keep_attention_weights: bool = True,
        implementation: str | None = None,
        max_len: int = positional.DEFAULT_MAX_LEN,
        **kwargs: Any,
    ) -> None:
        W.transformer_encoder_spec(vocab_size, num_hiddens, ffn_num_hiddens, num_heads, num_blks)
        super().__init__(dropout, **kwargs)
        self.vocab_size, self.num_hiddens, self.ffn_num_hiddens = vocab_size, num_hiddens, ffn_num_hiddens
        self.num_heads, self.num_blks, self.bias = num_heads, num_blks, bool(bias)
        self.keep_attention_weights = bool(keep_attention_weights)
        self.implementation = checks.check_implementation(implementation)
        self.attention_weights = [None] * num_blks
        self._declare()
        self.max_len = max_len
        self._register_table(max_len, num_hiddens)

    def _collect_params_with_prefix(self, prefix: str = "") -> dict[str, Parameter]:
        """What ``save_parameters``/``load_parameters`` see: the weights, not the constant ``P``."""
        params: dict[str, Parameter] = super()._collect_params_with_prefix(prefix)
        params.pop(f"{prefix}.P" if prefix else "P", None)
        return params

    def _spec(self, dims: Mapping[str, int | None]) -> W.Spec:
        return W.transformer_encoder_spec(self.vocab_size, self.num_hiddens, self.ffn_num_hiddens,
                                          self.num_heads, self.num_blks, self.bias)

    def __call__(self, tokens: Any, valid_lens: Any = None, *, mask: Any = None) -> Any:
        """Encodes integer token ids ``(B, T)`` into ``(B, T, num_hiddens)``.

        Args:
            tokens: Integer ids in ``[0, vocab_size)``, ``(B, T)``.
            valid_lens: Integer lengths, ``(B,)`` or ``(B, T)``, limiting the self-attention.
            mask: Boolean self-attention mask, True = may attend.
        """
        need = self.keep_attention_weights
        result = self._run([tokens, valid_lens, mask], weights=need)
        out, weights = result if need else (result, [None] * self.num_blks)
        self.attention_weights = list(weights)
        return out

    def _check_inputs(self, arrays: list[Any]) -> dict[str, int]:
        table = self._reg_params["P"]
        if not _has_data(table):  # weights from load_parameters, without initialize()
            table.initialize(ctx=arrays[0].ctx)
        if self._active:  # a built graph skips the core's value checks; check the ids here
            probe = mx.np.zeros((self.vocab_size, 1), ctx=arrays[0].ctx)
            transformer.embed_tokens(arrays[0], probe, ops=OPS)
        return {}

    def _compute(self, ops: MXNetOps, arrays: list[Any], weights: Mapping[str, Any],
                 options: Mapping[str, Any]) -> Any:
        tokens, valid_lens, mask = arrays
        weights = dict(weights)
        table = weights.pop("P", None)  # the held table is no canonical weight
        if table is None:  # a first call passes only the canonical weights
            table = self.P
        need = options["weights"]
        return transformer.transformer_encoder(
            tokens, weights, self.num_heads, valid_lens, mask=mask, dropout=self.dropout,
            return_weights=need, implementation=None if need else self.implementation,
            positions=table, ops=ops,
        )

    def _config(self) -> dict[str, Any]:
        return {"vocab_size": self.vocab_size, "num_hiddens": self.num_hiddens,
                "ffn_num_hiddens": self.ffn_num_hiddens, "num_heads": self.num_heads,
                "num_blks": self.num_blks, "dropout": self.dropout, "bias": self.bias,
                **_path_config(self),
                **({} if self.max_len == positional.DEFAULT_MAX_LEN else {"max_len": self.max_len})}


class NadarayaWatson(Layer):
    """Nadaraya-Watson attention pooling with a Gaussian kernel.

    Args:
        parametric: Learn the kernel's inverse width ``w`` (weight ``w`` of shape ``(1,)``).
        **kwargs: See :class:`Layer`.
    """

    _slots = ("queries", "keys", "values")

    def __init__(self, parametric: bool = False, **kwargs: Any) -> None:
        super().__init__(0.0, **kwargs)
        self.parametric = bool(parametric)
        self._declare()

    def _spec(self, dims: Mapping[str, int | None]) -> W.Spec:
        return W.nadaraya_watson_spec(self.parametric)

    def __call__(self, queries: Any, keys: Any, values: Any) -> Any:
        """Predicts at ``queries`` ``(B, Q)`` or ``(Q,)`` from ``keys``/``values`` ``(B, K)`` or ``(K,)``."""
        out, attn = self._run([queries, keys, values])
        self.attention_weights = attn
        return out

    def _compute(self, ops: MXNetOps, arrays: list[Any], weights: Mapping[str, Any],
                 options: Mapping[str, Any]) -> Any:
        q, k, v = arrays
        return attention.nadaraya_watson(q, k, v, weights.get("w"), return_weights=True, ops=ops)

    def _config(self) -> dict[str, Any]:
        return {"parametric": self.parametric}
