"""Flax (``flax.linen``) layers over the core, and the canonical weight layout for Flax params.

Each layer is a ``flax.linen.Module`` whose dataclass fields are the DESIGN constructor
arguments, in order, followed by ``param_dtype``. Parameters are created on ``init`` from the
input shapes and live in the usual params pytree, one nested dict per canonical name::

    MultiHeadAttention            {"W_q": {"kernel": (q_in, h)}, "W_k": ..., "W_v": ..., "W_o": ...}
    TransformerEncoderBlock       {"attention": {"W_q": {"kernel": ...}, ...}, "addnorm1": {"ln":
                                   {"gamma": ..., "beta": ...}}, "ffn": {"dense1": ...}, ...}
    LearnedPositionalEncoding     {"P": (1, max_len, h)}
    RelativeMultiHeadAttention    as MultiHeadAttention, plus {"rel_k": {"embedding": (2m+1, h/H)},
                                   "rel_v": {"embedding": (2m+1, h/H)}}
    TransformerEncoder            {"token": {"embedding": (V, h)}, "blks": {"0": {<block's
                                   params>}, "1": ...}}

so the canonical name is the params path joined with dots (``attention.W_q.kernel``), and
kernels are stored ``(in, out)`` as the canonical layout has them: :func:`get_weights` and
:func:`set_weights` only flatten and nest.

Calls take ``training: bool = False`` (static under ``jax.jit``). With ``training=True`` and a
dropout rate above 0, dropout draws from the ``'dropout'`` rng (``rngs={"dropout": key}``).
Attention weights, before dropout, are ``sow``n into ``'intermediates'`` as
``attention_weights``; ``return_attention=True`` also returns them. :class:`TransformerEncoder`
sows once per block, in order, so one call leaves a tuple of ``num_blks`` arrays there.

``DotProductAttention``, ``MultiHeadAttention``, ``TransformerEncoderBlock`` and
``TransformerEncoder`` form the ``(B, H, Q, K)`` weights only when they are used: when
``return_attention=True`` (not on the encoders), or when
``keep_attention_weights=True`` (the default) and ``'intermediates'`` is mutable
(``apply(..., mutable=["intermediates"])``), since sowing into an immutable collection keeps
nothing. Other calls pool by ``implementation`` (a field; None lets the core choose between
the direct and the blockwise path, see :func:`attention_core.attention.choose_implementation`),
never forming the weights on the blockwise path. ``RelativeMultiHeadAttention`` and
``AdditiveAttention`` always form them (their scores need them).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from attention_core import attention, checks, multihead, positional, transformer
from attention_core import weights as W
from attention_core.host import plain
from attention_core.ops import Array, Ops
from backends.jax.ops import OPS, JaxOps

# -- the canonical layout as a Flax params pytree ---------------------------------------------


def nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    """Canonical names -> nested dicts: ``{"W_q.kernel": a}`` -> ``{"W_q": {"kernel": a}}``."""
    tree: dict[str, Any] = {}
    for name, value in flat.items():
        *path, leaf = name.split(".")
        node = tree
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


#: Nested dicts -> canonical names, the inverse of :func:`nest` (one implementation, in the core).
flatten = W.flatten_tree


def _initializer(name: str) -> Callable[..., Array]:
    """The Flax initializer drawing what :func:`attention_core.weights.init_weights` draws."""
    leaf = name.rpartition(".")[2]
    if leaf == "kernel":
        return nn.initializers.glorot_uniform()
    if leaf in ("bias", "beta"):
        return nn.initializers.zeros_init()
    if leaf == "gamma":
        return nn.initializers.ones_init()
    if leaf == "P":
        return nn.initializers.normal(0.02)
    if leaf == "embedding":
        return _embedding_init
    return nn.initializers.uniform(1.0)


def _embedding_init(key: Array, shape: tuple[int, ...], dtype: DTypeLike = jnp.float32) -> Array:
    """An embedding table ``(N, D)``: normal with std ``1 / sqrt(D)`` (unit-norm rows on average)."""
    return nn.initializers.normal(1.0 / np.sqrt(shape[-1]))(key, shape, dtype)


def _draw(key: Array, spec: tuple[tuple[str, tuple[int, ...]], ...], dtype: DTypeLike) -> Any:
    """Draws one top-level params entry: an array, or nested dicts of them."""
    leaves = {name: _initializer(name)(jax.random.fold_in(key, i), shape, dtype)
              for i, (name, shape) in enumerate(spec)}
    return leaves[""] if "" in leaves else nest(leaves)


def _group_init(spec: Mapping[str, tuple[int, ...]], dtype: DTypeLike) -> Callable[[Array], Any]:
    """The init function of one top-level params entry, for ``self.param``."""
    return functools.partial(_draw, spec=tuple(spec.items()), dtype=dtype)


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
    """Returns the canonical weights (DESIGN section 5) of a Flax params pytree.

    Not for use inside ``jax.jit``: it copies the values to NumPy.

    Args:
        variables: What ``layer.init`` returns (``{"params": ...}``) or the params tree itself.
            None when the layer has not been initialised yet.
        layer: The module the variables belong to; names the layer in the error below.

    Returns:
        A new dict of canonical name -> NumPy array (a copy).

    Raises:
        ValueError: There are no params yet but the layer has weights.
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
    variables: Mapping[str, Any] | None,
    weights: Mapping[str, Any],
    *,
    layer: Layer | None = None,
) -> dict[str, Any]:
    """Returns new variables holding the canonical ``weights``; ``variables`` is not changed.

    Every name and shape is checked first (against the params already there), with the same
    messages as every other backend's ``set_weights``. Values take the dtype of the params they
    replace.

    Args:
        variables: ``{"params": ...}`` or the params tree itself; None (or empty) when nothing
            has been created yet, in which case ``layer`` is required and the params are built
            from ``weights`` as :func:`init_from_weights` does.
        weights: Canonical name -> array (any framework's, or NumPy).
        layer: The module the variables belong to.

    Returns:
        New variables, in the form given (``{"params": ...}`` or bare params; other collections
        are kept).

    Raises:
        TypeError: ``weights`` is not a mapping, or an entry is not floating point.
        ValueError: Missing or unexpected names, or a wrong shape.
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
    """Draws ``{"params": ...}`` on the host, as the NumPy layers do, without example inputs.

    The values are :func:`attention_core.weights.init_weights` with
    ``numpy.random.default_rng(seed)``: the NumPy layer built with the same ``seed`` starts
    from the same weights. Not traceable; use ``layer.init`` under ``jax.jit``.

    Args:
        layer: The (unbound) module.
        seed: Seed of the NumPy generator.
        **dims: Input sizes the layer would infer on its first call (``q_in``, ``k_in``,
            ``v_in`` for attention, ``d_in`` for :class:`PositionWiseFFN`).

    Raises:
        ValueError: An input size needed by the weights was not given.
    """
    spec = layer.spec(**dims)
    drawn = W.init_weights(spec, np.random.default_rng(seed), "float64")
    return {"params": nest({name: jnp.asarray(value, dtype=layer.param_dtype)
                            for name, value in drawn.items()})}


def init_from_weights(layer: Layer, weights: Mapping[str, Any]) -> dict[str, Any]:
    """Builds ``{"params": ...}`` for ``layer`` from canonical weights, without ``init``.

    Input sizes are read from the kernels (like a first call would infer them); every name and
    shape is checked first.

    Args:
        layer: The (unbound) module.
        weights: Canonical name -> array.

    Returns:
        Variables ready for ``layer.apply``, in ``layer.param_dtype``.
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


@functools.lru_cache(maxsize=16)
def _sinusoidal_table(max_len: int, num_hiddens: int) -> np.ndarray:
    table = positional.sinusoidal_encoding(max_len, num_hiddens, "float64")[None]
    table.flags.writeable = False
    return table


# -- layers -----------------------------------------------------------------------------------


class Layer(nn.Module):
    """Base of the Flax layers: argument checks, params from a canonical spec, dropout ops."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):  # NumPy scalars as Python numbers, as elsewhere
            value = getattr(self, field.name, None)
            if plain(value) is not value:
                object.__setattr__(self, field.name, plain(value))
        self.check_arguments()
        super().__post_init__()

    def check_arguments(self) -> None:
        """Checks the constructor arguments (as the other backends' constructors do)."""
        if hasattr(self, "dropout"):
            checks.check_dropout(self.dropout)
        if hasattr(self, "implementation"):
            checks.check_implementation(self.implementation)
        self.spec()

    def spec(self, **dims: int | None) -> W.Spec:
        """Canonical names and shapes of the weights for the given input sizes (None = unknown)."""
        return {}

    def _weights(self, **dims: int) -> dict[str, Array]:
        """The canonical weights for inputs of the given sizes: created on init, read on apply.

        A layer already built for other input sizes raises the same error as on every backend,
        before Flax's own shape check would.
        """
        for dim, size in dims.items():
            group, _, rest = W.INPUT_KERNELS[dim].partition(".")
            if self.has_variable("params", group):
                built = np.shape(flatten(self.get_variable("params", group))[rest])[0]
                checks.check_built_size(W.INPUT_ARGS[dim], size, built)
        groups: dict[str, dict[str, tuple[int, ...]]] = {}
        for name, shape in self.spec(**dims).items():
            assert None not in shape, f"{name}: every input size is known when called"
            group, _, rest = name.partition(".")
            groups.setdefault(group, {})[rest] = tuple(int(d) for d in shape if d is not None)
        weights: dict[str, Array] = {}
        for group, sub in groups.items():
            value = self.param(group, _group_init(sub, self.param_dtype))
            weights.update({group: value} if "" in sub else W.prefixed(flatten(value), group))
        return weights

    def _inputs(self, **inputs: Any) -> list[Any]:
        """The inputs in ``param_dtype`` if the layer has weights, else as given.

        The dtype rule of :func:`attention_core.checks.compute_inputs`.
        """
        dtype = np.dtype(self.param_dtype).name if self.spec() else None
        return checks.compute_inputs(OPS, dtype, **inputs)

    def _ops(self, training: bool) -> tuple[Ops, float]:
        """The ops and dropout rate of a call: a key from the ``'dropout'`` rng when needed."""
        rate = float(getattr(self, "dropout", 0.0)) if training else 0.0
        if rate > 0:
            return JaxOps(rng=self.make_rng("dropout")), rate
        return OPS, 0.0

    def _pooling(self, return_attention: bool) -> dict[str, Any]:
        """``return_weights`` and ``implementation`` for the core.

        The weights are formed only when returned, or kept (``keep_attention_weights``) where a
        sow would keep them: a sow into an immutable ``'intermediates'`` keeps nothing.
        """
        keep = getattr(self, "keep_attention_weights", True)
        need = return_attention or (keep and self.is_mutable_collection("intermediates"))
        return {"return_weights": need, "implementation": getattr(self, "implementation", None)}

    def _keep_attention(self, result: Any, need: bool, return_attention: bool) -> Any:
        """Sows the weights of a result that has them and returns the output.

        Args:
            result: ``(out, weights)`` when ``need``, else ``out``.
            need: Whether the weights were formed.
            return_attention: Return ``(out, weights)`` rather than ``out``.
        """
        if not need:
            return result
        out, attn = result
        self.sow("intermediates", "attention_weights", attn)
        return (out, attn) if return_attention else out


class _Attention(Layer):
    """Shared call of the attention layers: check, get weights, attend, sow."""

    @nn.compact
    def __call__(
        self,
        queries: Array,
        keys: Array,
        values: Array,
        valid_lens: Any = None,
        *,
        mask: Any = None,
        causal: bool = False,
        return_attention: bool = False,
        training: bool = False,
    ) -> Any:
        """Attends from ``queries`` ``(B, Q, Dq)`` to ``keys`` ``(B, K, Dk)`` over ``values``.

        Args:
            queries: ``(B, Q, Dq)``.
            keys: ``(B, K, Dk)``.
            values: ``(B, K, Dv)``.
            valid_lens: Integer lengths, ``(B,)`` or ``(B, Q)``.
            mask: Boolean, True = may attend: ``(Q, K)``, ``(B, Q, K)`` or ``(B, H, Q, K)``.
            causal: Query ``i`` sees keys ``j <= i + (K - Q)`` (static).
            return_attention: Also return the attention weights ``(B, H, Q, K)``.
            training: Apply dropout to the attention weights (static).

        Returns:
            The output, and the attention weights (before dropout) if asked.
        """
        queries, keys, values = self._inputs(queries=queries, keys=keys, values=values)
        attention.check_projected_inputs(OPS, queries, keys, values)
        weights = self._weights(**self._input_sizes(queries, keys, values))
        ops, rate = self._ops(training)
        pooling = self._pooling(return_attention)
        result = self._attend(
            weights, queries, keys, values, valid_lens, mask=mask, causal=causal,
            dropout=rate, ops=ops, **pooling,
        )
        return self._keep_attention(result, pooling["return_weights"], return_attention)

    def _input_sizes(self, queries: Array, keys: Array, values: Array) -> dict[str, int]:
        return {}

    def _attend(self, weights: dict[str, Array], *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


class DotProductAttention(_Attention):
    """Scaled dot-product attention (no weights).

    Attributes:
        dropout: Dropout rate on the attention weights when ``training=True``.
        param_dtype: Unused (no weights); kept for a uniform signature.
        keep_attention_weights: Sow each call's weights into ``'intermediates'`` when that
            collection is mutable; when False, calls without ``return_attention`` never form
            them.
        implementation: How calls that do not need the weights pool: ``"blockwise"``,
            ``"direct"`` or ``"fused"`` (``jax.nn.dot_product_attention``); None lets the core
            choose (direct, or blockwise for large scores, on CPU).
    """

    dropout: float = 0.0
    param_dtype: DTypeLike = jnp.float32
    keep_attention_weights: bool = True
    implementation: str | None = None

    def _attend(self, weights: dict[str, Array], *args: Any, **kwargs: Any) -> Any:
        return attention.dot_product_attention(*args, **kwargs)


class AdditiveAttention(_Attention):
    """Additive (Bahdanau) attention with hidden size ``num_hiddens``.

    Attributes:
        num_hiddens: Size of the hidden layer scoring each query-key pair.
        dropout: Dropout rate on the attention weights when ``training=True``.
        param_dtype: Dtype of the weights.
    """

    num_hiddens: int
    dropout: float = 0.0
    param_dtype: DTypeLike = jnp.float32

    def spec(self, **dims: int | None) -> W.Spec:
        return W.additive_spec(self.num_hiddens, dims.get("q_in"), dims.get("k_in"))

    def _input_sizes(self, queries: Array, keys: Array, values: Array) -> dict[str, int]:
        return {"q_in": queries.shape[-1], "k_in": keys.shape[-1]}

    def _attend(self, weights: dict[str, Array], *args: Any, **kwargs: Any) -> Any:
        q, k, v, valid_lens = args
        kwargs.pop("implementation")  # additive scores are always formed
        return attention.additive_attention(q, k, v, weights, valid_lens, **kwargs)


class MultiHeadAttention(_Attention):
    """Multi-head attention: ``num_heads`` heads over ``num_hiddens`` projected features.

    Input sizes are inferred on ``init``. Params: ``W_q``, ``W_k``, ``W_v``, ``W_o``, each
    ``{"kernel": (in, num_hiddens)}`` (and ``"bias"`` when ``bias=True``).

    Attributes:
        num_hiddens: Width h of the projections and of the output.
        num_heads: H; must divide ``num_hiddens``.
        dropout: Dropout rate on the attention weights when ``training=True``.
        bias: Whether the projections have biases.
        param_dtype: Dtype of the weights.
        keep_attention_weights: Sow each call's weights into ``'intermediates'`` when that
            collection is mutable; when False, calls without ``return_attention`` never form
            them.
        implementation: How calls that do not need the weights pool: ``"blockwise"``,
            ``"direct"`` or ``"fused"`` (``jax.nn.dot_product_attention``); None lets the core
            choose (direct, or blockwise for large scores, on CPU).
    """

    num_hiddens: int
    num_heads: int
    dropout: float = 0.0
    bias: bool = False
    param_dtype: DTypeLike = jnp.float32
    keep_attention_weights: bool = True
    implementation: str | None = None

    def check_arguments(self) -> None:
        checks.check_heads(self.num_hiddens, self.num_heads)
        super().check_arguments()

    def spec(self, **dims: int | None) -> W.Spec:
        return W.multi_head_spec(self.num_hiddens, self.num_heads, self.bias,
                                 dims.get("q_in"), dims.get("k_in"), dims.get("v_in"))

    def _input_sizes(self, queries: Array, keys: Array, values: Array) -> dict[str, int]:
        return {"q_in": queries.shape[-1], "k_in": keys.shape[-1], "v_in": values.shape[-1]}

    def _attend(self, weights: dict[str, Array], *args: Any, **kwargs: Any) -> Any:
        q, k, v, valid_lens = args
        return multihead.multi_head_attention(q, k, v, weights, self.num_heads, valid_lens, **kwargs)


class RelativeMultiHeadAttention(_Attention):
    """Multi-head attention with relative position representations (Shaw et al., 2018).

    The scores and the pooled values of each head get a learned vector per clipped offset
    between key and query (see :func:`attention_core.multihead.relative_multi_head_attention`).
    Input sizes are inferred on ``init``. Params: those of :class:`MultiHeadAttention`, plus
    ``rel_k`` and (with ``relative_values``) ``rel_v``, each ``{"embedding": (2m + 1, h/H)}``.
    The weights are always formed, so there is no ``implementation``.

    Attributes:
        num_hiddens: Width h of the projections and of the output.
        num_heads: H; must divide ``num_hiddens``.
        max_relative_position: m: offsets between a key and a query are clipped to [-m, m].
        dropout: Dropout rate on the attention weights when ``training=True``.
        bias: Whether the projections have biases.
        param_dtype: Dtype of the weights.
        relative_values: Also add the offsets' vectors to the values (param ``rel_v``).
        keep_attention_weights: Sow each call's weights into ``'intermediates'`` when that
            collection is mutable.
    """

    num_hiddens: int
    num_heads: int
    max_relative_position: int
    dropout: float = 0.0
    bias: bool = False
    param_dtype: DTypeLike = jnp.float32
    relative_values: bool = True
    keep_attention_weights: bool = True

    def check_arguments(self) -> None:
        checks.check_heads(self.num_hiddens, self.num_heads)
        super().check_arguments()

    def spec(self, **dims: int | None) -> W.Spec:
        return W.relative_multi_head_spec(
            self.num_hiddens, self.num_heads, self.max_relative_position, self.bias,
            self.relative_values, dims.get("q_in"), dims.get("k_in"), dims.get("v_in"),
        )

    def _input_sizes(self, queries: Array, keys: Array, values: Array) -> dict[str, int]:
        return {"q_in": queries.shape[-1], "k_in": keys.shape[-1], "v_in": values.shape[-1]}

    def _attend(self, weights: dict[str, Array], *args: Any, **kwargs: Any) -> Any:
        q, k, v, valid_lens = args
        kwargs.pop("implementation")  # the offsets' terms need the weights: always direct
        return multihead.relative_multi_head_attention(
            q, k, v, weights, self.num_heads, valid_lens, **kwargs
        )


class PositionalEncoding(Layer):
    """Adds the sinusoidal table ``P`` to the input (no params).

    Attributes:
        num_hiddens: Width of the table.
        dropout: Dropout rate on the sum when ``training=True``.
        max_len: Number of positions in the table.
        param_dtype: Dtype of ``P``.
    """

    num_hiddens: int
    dropout: float = 0.0
    max_len: int = 1000
    param_dtype: DTypeLike = jnp.float32

    def check_arguments(self) -> None:
        checks.check_dropout(self.dropout)
        checks.check_positive_int("max_len", self.max_len)
        checks.check_positive_int("num_hiddens", self.num_hiddens)

    @property
    def P(self) -> jax.Array:  # noqa: N802 - the name the source chapter uses
        """The table, ``(1, max_len, num_hiddens)``: a constant, available without ``init``."""
        return jnp.asarray(_sinusoidal_table(self.max_len, self.num_hiddens), dtype=self.param_dtype)

    @nn.compact
    def __call__(self, X: Array, *, training: bool = False) -> Array:
        """Returns ``dropout(X + P[:, :T])`` for ``X`` of shape ``(B, T, num_hiddens)``."""
        ops, rate = self._ops(training)
        return positional.add_positions(X, self.P, rate, ops=ops)


class LearnedPositionalEncoding(Layer):
    """Adds a learned table, param ``P`` of shape ``(1, max_len, num_hiddens)``, to the input.

    Attributes:
        num_hiddens: Width of the table.
        dropout: Dropout rate on the sum when ``training=True``.
        max_len: Number of positions in the table.
        param_dtype: Dtype of ``P``.
    """

    num_hiddens: int
    dropout: float = 0.0
    max_len: int = 1000
    param_dtype: DTypeLike = jnp.float32

    def spec(self, **dims: int | None) -> W.Spec:
        return W.learned_positional_spec(self.num_hiddens, self.max_len)

    @nn.compact
    def __call__(self, X: Array, *, training: bool = False) -> Array:
        """Returns ``dropout(X + P[:, :T])`` for ``X`` of shape ``(B, T, num_hiddens)``."""
        (X,) = self._inputs(X=X)
        P = self._weights()["P"]
        ops, rate = self._ops(training)
        return positional.add_positions(X, P, rate, ops=ops)


class PositionWiseFFN(Layer):
    """Two dense layers with a ReLU between, applied at every position.

    Attributes:
        ffn_num_hiddens: Width of the hidden layer.
        ffn_num_outputs: Width of the output.
        param_dtype: Dtype of the weights.
    """

    ffn_num_hiddens: int
    ffn_num_outputs: int
    param_dtype: DTypeLike = jnp.float32

    def spec(self, **dims: int | None) -> W.Spec:
        return W.ffn_spec(self.ffn_num_hiddens, self.ffn_num_outputs, dims.get("d_in"))

    @nn.compact
    def __call__(self, X: Array) -> Array:
        """Returns ``dense2(relu(dense1(X)))`` for ``X`` of shape ``(B, T, d)``."""
        (X,) = self._inputs(X=X)
        checks.check_rank(OPS, "X", X, (3,), "(B, T, d)")
        weights = self._weights(d_in=X.shape[-1])
        return transformer.position_wise_ffn(X, weights, ops=OPS)


class AddNorm(Layer):
    """Residual connection then layer normalisation over the last axis (eps 1e-5).

    Attributes:
        num_hiddens: Width of the normalised axis.
        dropout: Dropout rate on ``Y`` when ``training=True``.
        param_dtype: Dtype of ``ln.gamma`` and ``ln.beta``.
    """

    num_hiddens: int
    dropout: float = 0.0
    param_dtype: DTypeLike = jnp.float32

    def spec(self, **dims: int | None) -> W.Spec:
        return W.add_norm_spec(self.num_hiddens)

    @nn.compact
    def __call__(self, X: Array, Y: Array, *, training: bool = False) -> Array:
        """Returns ``LayerNorm(dropout(Y) + X)``."""
        X, Y = self._inputs(X=X, Y=Y)
        checks.check_last_dim(OPS, "X", X, self.num_hiddens)
        weights = self._weights()
        ops, rate = self._ops(training)
        return transformer.add_norm(X, Y, weights, rate, ops=ops)


class TransformerEncoderBlock(Layer):
    """Self-attention and a position-wise FFN, each wrapped in add & norm.

    Params: ``attention`` (as :class:`MultiHeadAttention`), ``addnorm1``, ``ffn``,
    ``addnorm2``. The self-attention weights are sown as ``attention_weights`` (when kept).

    Attributes:
        num_hiddens: Model width h.
        ffn_num_hiddens: Hidden width of the FFN.
        num_heads: Heads of the self-attention.
        dropout: Dropout rate of the attention weights and both residual branches.
        bias: Whether the attention projections have biases.
        param_dtype: Dtype of the weights.
        keep_attention_weights: Sow each call's self-attention weights into
            ``'intermediates'`` when that collection is mutable; when False, calls never form
            them.
        implementation: How calls that do not need the weights pool: ``"blockwise"``,
            ``"direct"`` or ``"fused"`` (``jax.nn.dot_product_attention``); None lets the core
            choose (direct, or blockwise for large scores, on CPU).
    """

    num_hiddens: int
    ffn_num_hiddens: int
    num_heads: int
    dropout: float = 0.0
    bias: bool = False
    param_dtype: DTypeLike = jnp.float32
    keep_attention_weights: bool = True
    implementation: str | None = None

    def spec(self, **dims: int | None) -> W.Spec:
        return W.encoder_block_spec(self.num_hiddens, self.ffn_num_hiddens, self.num_heads, self.bias)

    @nn.compact
    def __call__(
        self, X: Array, valid_lens: Any = None, *, mask: Any = None, training: bool = False
    ) -> Array:
        """Encodes ``X`` ``(B, T, num_hiddens)``; ``valid_lens`` and ``mask`` as for attention."""
        (X,) = self._inputs(X=X)
        checks.check_rank(OPS, "X", X, (3,), "(B, T, num_hiddens)")
        checks.check_last_dim(OPS, "X", X, self.num_hiddens)
        weights = self._weights()
        ops, rate = self._ops(training)
        pooling = self._pooling(False)
        result = transformer.transformer_encoder_block(
            X, weights, self.num_heads, valid_lens, mask=mask, dropout=rate, ops=ops, **pooling,
        )
        return self._keep_attention(result, pooling["return_weights"], False)


class TransformerEncoder(Layer):
    """The Transformer encoder: scaled token embedding, sinusoidal encoding, ``num_blks`` blocks.

    ``X = dropout(E[tokens] * sqrt(h) + P)``, then each :class:`TransformerEncoderBlock` in
    turn. Params: ``token`` ``{"embedding": (vocab_size, h)}`` and ``blks``, one entry per
    block keyed ``"0"``, ``"1"``, ... holding that block's params, so the canonical names are
    ``token.embedding`` and ``blks.<i>.attention.W_q.kernel`` etc.

    Each block's self-attention weights ``(B, H, T, T)`` are sown into ``'intermediates'`` as
    ``attention_weights`` (when kept), one sow per block in order: after one call,
    ``state["intermediates"]["attention_weights"]`` is a tuple of ``num_blks`` arrays, the
    counterpart of the other backends' ``attention_weights`` list.

    Attributes:
        vocab_size: V, the number of token ids.
        num_hiddens: Model width h.
        ffn_num_hiddens: Hidden width of the blocks' FFNs.
        num_heads: Heads of every block's self-attention.
        num_blks: Number of blocks.
        dropout: Dropout rate of the encoding's sum and inside every block.
        bias: Whether the attention projections have biases.
        param_dtype: Dtype of the weights.
        keep_attention_weights: Sow each call's per-block weights into ``'intermediates'``
            when that collection is mutable; when False, calls never form them.
        implementation: How the blocks pool when the weights are not needed; see
            :class:`TransformerEncoderBlock`.
        max_len: Rows of the sinusoidal table (a constant, not a param): the longest sequence
            the encoder takes.
    """

    vocab_size: int
    num_hiddens: int
    ffn_num_hiddens: int
    num_heads: int
    num_blks: int
    dropout: float = 0.0
    bias: bool = False
    param_dtype: DTypeLike = jnp.float32
    keep_attention_weights: bool = True
    implementation: str | None = None
    max_len: int = positional.DEFAULT_MAX_LEN

    def check_arguments(self) -> None:
        super().check_arguments()
        checks.check_positive_int("max_len", self.max_len)

    def spec(self, **dims: int | None) -> W.Spec:
        return W.transformer_encoder_spec(self.vocab_size, self.num_hiddens, self.ffn_num_hiddens,
                                          self.num_heads, self.num_blks, self.bias)

    @nn.compact
    def __call__(
        self, tokens: Array, valid_lens: Any = None, *, mask: Any = None, training: bool = False
    ) -> Array:
        """Encodes integer ``tokens`` ``(B, T)`` to ``(B, T, num_hiddens)``.

        Args:
            tokens: Token ids in ``[0, vocab_size)``.
            valid_lens: Integer lengths, ``(B,)`` or ``(B, T)``.
            mask: Boolean self-attention mask, True = may attend.
            training: Apply dropout (static).
        """
        weights = self._weights()
        ops, rate = self._ops(training)
        pooling = self._pooling(False)
        table = jnp.asarray(_sinusoidal_table(self.max_len, self.num_hiddens), self.param_dtype)
        result = transformer.transformer_encoder(
            tokens, weights, self.num_heads, valid_lens, mask=mask, dropout=rate,
            positions=table, ops=ops, **pooling,
        )
        if not pooling["return_weights"]:
            return result
        out, per_block = result
        for attn in per_block:
            self.sow("intermediates", "attention_weights", attn)
        return out


class NadarayaWatson(Layer):
    """Nadaraya-Watson attention pooling with a Gaussian kernel.

    Attributes:
        parametric: Learn the kernel's inverse width, param ``w`` of shape ``(1,)``.
        param_dtype: Dtype of ``w``.
    """

    parametric: bool = False
    param_dtype: DTypeLike = jnp.float32

    def spec(self, **dims: int | None) -> W.Spec:
        return W.nadaraya_watson_spec(self.parametric)

    @nn.compact
    def __call__(self, queries: Array, keys: Array, values: Array) -> Array:
        """Predicts at ``queries`` ``(B, Q)`` or ``(Q,)`` from ``keys`` and ``values``."""
        queries, keys, values = self._inputs(queries=queries, keys=keys, values=values)
        w = self._weights()["w"] if self.parametric else None
        result = attention.nadaraya_watson(queries, keys, values, w, return_weights=True, ops=OPS)
        return self._keep_attention(result, True, False)
