"""Keras 3 layers (TensorFlow backend) holding canonical weights and calling the core.

Each layer keeps its parameters as Keras variables named by the canonical layout of DESIGN
section 5 (``W_q.kernel``, ``ln.gamma``, ...), so ``layer.weights`` reads like the mapping.
Input sizes are inferred by ``build()`` on the first call (or from the mapping given to
``set_weights``); layers whose sizes are all known from the constructor create their weights
in ``__init__``. A call that raises changes nothing: a first call that fails leaves the layer
unbuilt, so the next call may still choose the input sizes.

Weights, two forms that cannot be confused:

* ``get_weights() -> dict[str, numpy.ndarray]`` and ``set_weights(mapping)`` use the canonical
  layout shared by every backend (DESIGN section 5). ``set_weights`` takes a mapping only.
* ``get_weight_list()`` and ``set_weight_list(list)`` are Keras' own list form (the values of
  ``layer.weights`` in order), which ``keras.layers.Layer.get_weights`` gives elsewhere.

Dropout is active only for ``training=True`` and draws from a ``keras.random.SeedGenerator``
owned by the layer, so ``keras.utils.set_random_seed`` makes it (and the initial weights)
reproducible, eagerly and under ``tf.function``.

The attention layers keep the last call's weights, before dropout, in ``attention_weights``
``(B, H, Q, K)``. With ``keep_attention_weights=False`` (constructor argument or attribute),
``DotProductAttention``, ``MultiHeadAttention`` and ``TransformerEncoderBlock`` calls that do
not ask for the weights (``return_attention=False``) pool by ``implementation`` instead (None
lets the core choose, see :func:`attention_core.attention.choose_implementation`; the
``"blockwise"`` path never forms the ``(B, H, Q, K)`` weights and runs its loops as
``tf.while_loop`` under ``tf.function``), and ``attention_weights`` is then None.
``TransformerEncoder`` does the same in its blocks and keeps a list, one ``(B, H, T, T)``
tensor per block (each None when not kept). ``RelativeMultiHeadAttention`` always forms its
weights (it has no ``implementation``); ``keep_attention_weights=False`` only leaves
``attention_weights`` None.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from attention_core import attention, checks, masks, multihead, positional, transformer
from attention_core import weights as W
from attention_core.host import PlainArguments
from backends.tensorflow.ops import OPS, TensorFlowOps

_serializable = keras.saving.register_keras_serializable(package="attention_core")


class Layer(PlainArguments, keras.layers.Layer):
    """Base of the Keras layers: canonical weights, dropout, and no change on a failed call.

    Args:
        dropout: Dropout rate, used only when called with ``training=True``.
        **kwargs: Passed to ``keras.layers.Layer`` (``name``, ``dtype``, ``trainable``, ...).

    Attributes:
        attention_weights: The last call's attention weights ``(B, H, Q, K)``, before dropout
            (attention layers only). Under ``tf.function`` this is the traced tensor; return
            the weights with ``return_attention=True`` to get them out of a compiled function.
    """

    def __init__(self, dropout: float = 0.0, **kwargs: Any) -> None:
        dropout = checks.check_dropout(dropout)
        super().__init__(**kwargs)
        self.dropout = dropout
        self.seed_generator = keras.random.SeedGenerator() if dropout > 0 else None
        self._ops = TensorFlowOps(self.seed_generator)
        self._dims: dict[str, int] = {}
        self._params: dict[str, keras.Variable] = {}
        self.attention_weights: tf.Tensor | None = None
        # valid_lens may be a Python list, as in the NumPy layers
        self._allow_non_tensor_positional_args = True

    def spec(self) -> W.Spec:
        """Canonical names and shapes of this layer's weights (None = not known yet)."""
        return {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Calls the layer; a failed call changes nothing and raises what ``call()`` raised.

        A first call that fails leaves the layer unbuilt. The error is the one ``call()``
        raised, not Keras' rewrapped copy (see :func:`_unwrap_call_error`).
        """
        # the dtype rule: without weights, the inputs' dtype, unless a policy other than
        # float32 was chosen for the layer (or globally), whose compute dtype then rules
        if getattr(self, "autocast", False) and self.dtype_policy.name == "float32" and not self.spec():
            self.autocast = False
        fresh = not self.built
        kwargs = self._with_padding_masks(args, kwargs)
        try:
            return super().__call__(*args, **kwargs)
        except BaseException as err:
            if fresh and self.built:
                self._unbuild()
            original = _unwrap_call_error(err)
            if original is err:
                raise
        raise original  # outside the except block: the original's own context is kept

    #: The call arguments whose Keras padding masks this layer honours: each gets a keyword
    #: argument ``<name>_mask`` (Keras' naming, as in ``keras.layers.MultiHeadAttention``).
    _padded_inputs: tuple[str, ...] = ()

    def _with_padding_masks(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """Moves the inputs' Keras padding masks (``_keras_mask``) into ``<name>_mask`` arguments.

        Keras hands the padding mask of a layer's only tensor argument to the call argument
        named ``mask``, which here is the attention mask (DESIGN section 4). Giving the padding
        masks their own arguments first keeps them apart: Keras then fills nothing, and a
        ``mask`` the caller gave stays the attention mask.
        """
        if not self._padded_inputs or all(
            getattr(value, "_keras_mask", None) is None for value in (*args, *kwargs.values())
        ):
            return kwargs  # the common case, decided without binding the arguments
        try:
            bound = self._call_signature.bind_partial(*args, **kwargs).arguments
        except TypeError:
            return kwargs  # Keras raises its own error for a call that does not bind
        found = {}
        for name in self._padded_inputs:
            padding = getattr(bound.get(name), "_keras_mask", None)
            if padding is not None and bound.get(f"{name}_mask") is None:
                found[f"{name}_mask"] = padding
        return {**kwargs, **found} if found else kwargs

    def _create(self, **dims: int | None) -> None:
        """Creates every weight of the spec for the given input sizes (initial values from the core)."""
        unknown = [W.INPUT_ARGS[dim] for dim, size in dims.items() if size is None]
        if unknown:
            names = f"{', '.join(unknown[:-1])} and {unknown[-1]}" if len(unknown) > 1 else unknown[0]
            raise ValueError(
                f"{type(self).__name__}: the last dimension of {names} must be known to create "
                "the weights, got None"
            )
        known = {dim: int(size) for dim, size in dims.items() if size is not None}
        saved, self._dims = self._dims, {**self._dims, **known}
        try:
            spec = self.spec()
            rng = np.random.default_rng(random.getrandbits(64))  # seeded by set_random_seed
            initial = W.init_weights(spec, rng, "float64")
        except BaseException:
            self._dims = saved
            raise
        for name, value in initial.items():
            self._params[name] = self.add_weight(
                shape=value.shape, initializer=_constant(value), dtype=self.variable_dtype,
                name=name,
            )

    def _unbuild(self) -> None:
        """Undoes the build of a first call that failed, so the call changes nothing."""
        for variable in self._params.values():
            self._untrack_variable(variable)
        self._tracker.unlock()
        self._params, self._dims = {}, {}
        self._build_shapes_dict = None
        self.built = False

    def _input_shapes(self, dims: Mapping[str, int]) -> dict[str, tuple[int | None, ...]]:
        """``build()`` arguments for input sizes read off a weight mapping."""
        return {f"{W.INPUT_ARGS[dim]}_shape": (None, None, size) for dim, size in dims.items()}

    def _check_built_for(self, **inputs: Any) -> None:
        """Checks the last dimension of each input against the size the layer was built for."""
        for dim, arg in W.INPUT_ARGS.items():
            if arg in inputs and dim in self._dims:
                size = self._ops.shape(inputs[arg])[-1]
                checks.check_built_size(arg, size, self._dims[dim])

    def _tensors(self) -> dict[str, Any]:
        """The weights as the core takes them, read (and autocast) for this call."""
        return {name: variable.value for name, variable in self._params.items()}

    def _rate(self, training: bool | None) -> float:
        return self.dropout if training else 0.0

    @property
    def canonical_variables(self) -> dict[str, keras.Variable]:
        """The Keras variables by canonical name (e.g. for ``tf.GradientTape``)."""
        return dict(self._params)

    def get_weights(self) -> dict[str, np.ndarray]:
        """Returns a copy of the weights in the canonical layout (DESIGN section 5).

        Unlike ``keras.layers.Layer.get_weights``, this is a mapping by canonical name; the
        Keras list is :meth:`get_weight_list`.

        Raises:
            ValueError: The input sizes are not known yet (call the layer or set_weights).
        """
        if self.spec() and not self._params:
            raise checks.not_built(type(self).__name__)
        return {name: np.array(variable.numpy()) for name, variable in self._params.items()}

    def set_weights(self, weights: Mapping[str, Any]) -> None:
        """Sets every weight from a canonical mapping; checks all names and shapes first.

        Before the first call, the input sizes are read off the mapping and the layer is
        built. A list (Keras' form) is refused: use :meth:`set_weight_list` for that. Values
        of any real float dtype are cast to the layer's variable dtype; every value is checked
        and converted before the layer changes (and a layer built here is unbuilt again if
        the assignment fails).

        Raises:
            TypeError: ``weights`` is not a mapping, or an entry is not floating point.
            ValueError: Missing or unexpected names, or a wrong shape.
        """
        dtype = keras.backend.standardize_dtype(self.variable_dtype)
        checked = W.check_weights(self.spec(), weights, dtype=dtype)
        staged = {name: tf.cast(OPS.from_numpy(value), dtype) for name, value in checked.items()}
        fresh = not self._params and bool(staged)
        if fresh:
            self.build(**self._input_shapes(W.dims_from_weights(checked)))
        try:
            for name, value in staged.items():
                self._params[name].assign(value)
        except BaseException:
            if fresh:
                self._unbuild()
            raise

    def get_weight_list(self) -> list[np.ndarray]:
        """Keras' list form: the values of ``layer.weights``, in order."""
        return list(keras.layers.Layer.get_weights(self))

    def set_weight_list(self, weights: list[Any]) -> None:
        """Keras' list form: sets ``layer.weights`` in order (see :meth:`get_weight_list`)."""
        keras.layers.Layer.set_weights(self, weights)

    def compute_mask(self, inputs: Any, previous_mask: Any = None) -> Any:
        """The output's Keras padding mask: the first input's (``(B, T)``), as Keras' MHA does.

        ``previous_mask`` is ignored: Keras sets it to the ``mask`` call argument when one is
        given, which here is an attention mask (DESIGN section 4), not a padding mask.
        """
        return getattr(inputs, "_keras_mask", None)


def _unwrap_call_error(err: BaseException) -> BaseException:
    """The exception ``call()`` raised, from the copy Keras raised in its place.

    With traceback filtering on (Keras' default), an exception raised inside ``call()`` is
    replaced by a new one of the same class whose message is the original's framed by
    "Exception encountered when calling X.call()" and a list of the call's arguments; Keras
    marks it with ``_keras_call_info_injected`` and raises it ``from None``, so the original is
    its ``__context__``. That message would differ from every other backend's, and ``except``
    clauses matching on messages would see another text. Here the original is found again:
    the marked exception's ``__cause__`` or ``__context__``, of the same class (or of any class
    when Keras fell back to a RuntimeError, for a class it could not rebuild). The argument list
    Keras wrote is added to it as a note (shown in tracebacks, not part of ``str(error)``).
    Anything else (filtering off, a future Keras that raises the original itself) is returned
    as it is.
    """
    if not getattr(err, "_keras_call_info_injected", False):
        return err
    original = err.__cause__ or err.__context__
    if original is None or not (type(original) is type(err) or type(err) is RuntimeError):
        return err
    text = str(err)
    where = text.find("Arguments received by ")
    if where >= 0 and hasattr(original, "add_note"):  # Python >= 3.11
        original.add_note(text[where:])
    return original


def _constant(value: np.ndarray) -> Any:
    """A Keras initializer returning ``value`` cast to the variable's dtype."""
    return lambda shape, dtype=None: tf.cast(value, dtype or "float32")


def _scores_shape(ops: TensorFlowOps, queries: Any, keys: Any) -> tuple[Any, ...]:
    """``(B, None, Q, K)`` of the scores of ``queries`` and ``keys`` (for the padding masks)."""
    q_shape, k_shape = ops.shape(queries), ops.shape(keys)
    return (q_shape[0], None, q_shape[-2], k_shape[-2])


class _Attention(Layer):
    """Shared call of the attention layers: checks, the core, ``attention_weights``."""

    #: Whether calls keep their weights in ``attention_weights`` (always, for additive attention).
    keep_attention_weights = True
    #: How calls that form no weights pool (None: the core chooses).
    implementation: str | None = None

    def _init_paths(self, keep_attention_weights: bool, implementation: str | None) -> None:
        """Sets the two pooling options of the layers that have them."""
        self.keep_attention_weights = bool(keep_attention_weights)
        self.implementation = checks.check_implementation(implementation)

    _padded_inputs = ("queries", "keys", "values")

    def _attend(self, queries: Any, keys: Any, values: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def call(
        self,
        queries: Any,
        keys: Any,
        values: Any,
        valid_lens: Any = None,
        *,
        mask: Any = None,
        causal: bool = False,
        return_attention: bool = False,
        training: bool | None = None,
        queries_mask: Any = None,
        keys_mask: Any = None,
        values_mask: Any = None,
    ) -> Any:
        """Attends; ``<input>_mask`` are Keras padding masks, filled in from ``_keras_mask``.

        ``queries_mask`` ``(B, Q)`` and ``keys_mask``/``values_mask`` ``(B, K)`` (True = a real
        position) are ANDed with ``valid_lens``, ``mask`` and ``causal``; see
        :func:`attention_core.masks.with_padding`.
        """
        if keys_mask is None or values_mask is None:
            keys_mask = values_mask if keys_mask is None else keys_mask
        else:
            keys_mask = self._ops.logical_and(keys_mask, values_mask)
        mask = masks.with_padding(
            self._ops, mask, _scores_shape(self._ops, queries, keys), queries_mask, keys_mask
        )
        need = return_attention or self.keep_attention_weights
        result = self._attend(
            queries, keys, values, valid_lens=valid_lens, mask=mask, causal=causal,
            dropout=self._rate(training), return_weights=need, ops=self._ops,
        )
        out, self.attention_weights = result if need else (result, None)
        return result if return_attention else out


@_serializable
class DotProductAttention(_Attention):
    """Scaled dot-product attention (no weights).

    Args:
        dropout: Dropout rate on the attention weights in training.
        keep_attention_weights: Keep each call's weights in ``attention_weights``; when
            False, calls without ``return_attention`` pool by ``implementation``.
        implementation: None, ``"direct"``, ``"blockwise"`` or ``"fused"``: how calls that do
            not form the weights pool (None lets the core choose).
        **kwargs: Passed to ``keras.layers.Layer``.
    """

    def __init__(
        self, dropout: float = 0.0, *, keep_attention_weights: bool = True,
        implementation: str | None = None, **kwargs: Any,
    ) -> None:
        super().__init__(dropout, **kwargs)
        self._init_paths(keep_attention_weights, implementation)

    def _attend(self, queries: Any, keys: Any, values: Any, **kwargs: Any) -> Any:
        checks.check_rank(self._ops, "queries", queries, (3,), "(B, Q, D)")
        implementation = None if kwargs["return_weights"] else self.implementation
        return attention.dot_product_attention(
            queries, keys, values, implementation=implementation, **kwargs
        )

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "dropout": self.dropout,
                "keep_attention_weights": self.keep_attention_weights,
                "implementation": self.implementation}


@_serializable
class AdditiveAttention(_Attention):
    """Additive (Bahdanau) attention with hidden size ``num_hiddens``.

    Args:
        num_hiddens: Size of the hidden features the scores are computed from.
        dropout: Dropout rate on the attention weights in training.
        **kwargs: Passed to ``keras.layers.Layer``.
    """

    def __init__(self, num_hiddens: int, dropout: float = 0.0, **kwargs: Any) -> None:
        super().__init__(dropout, **kwargs)
        self.num_hiddens = checks.check_positive_int("num_hiddens", num_hiddens)

    def spec(self) -> W.Spec:
        return W.additive_spec(self.num_hiddens, self._dims.get("q_in"), self._dims.get("k_in"))

    def build(self, queries_shape: Any, keys_shape: Any) -> None:
        self._create(q_in=queries_shape[-1], k_in=keys_shape[-1])

    def _attend(self, queries: Any, keys: Any, values: Any, **kwargs: Any) -> Any:
        attention.check_projected_inputs(self._ops, queries, keys, values)
        self._check_built_for(queries=queries, keys=keys)
        return attention.additive_attention(queries, keys, values, self._tensors(), **kwargs)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "num_hiddens": self.num_hiddens, "dropout": self.dropout}


@_serializable
class MultiHeadAttention(_Attention):
    """Multi-head attention: ``num_heads`` heads over ``num_hiddens`` projected features.

    Args:
        num_hiddens: Width h of the projections and of the output.
        num_heads: Number of heads H; must divide ``num_hiddens``.
        dropout: Dropout rate on the attention weights in training.
        bias: Whether the four projections have biases.
        keep_attention_weights: Keep each call's weights in ``attention_weights``; when
            False, calls without ``return_attention`` pool by ``implementation``.
        implementation: None, ``"direct"``, ``"blockwise"`` or ``"fused"``: how calls that do
            not form the weights pool (None lets the core choose).
        **kwargs: Passed to ``keras.layers.Layer``.
    """

    def __init__(
        self, num_hiddens: int, num_heads: int, dropout: float = 0.0, bias: bool = False, *,
        keep_attention_weights: bool = True, implementation: str | None = None, **kwargs: Any,
    ) -> None:
        checks.check_heads(num_hiddens, num_heads)
        super().__init__(dropout, **kwargs)
        self.num_hiddens, self.num_heads, self.bias = num_hiddens, num_heads, bool(bias)
        self._init_paths(keep_attention_weights, implementation)

    def spec(self) -> W.Spec:
        d = self._dims
        return W.multi_head_spec(
            self.num_hiddens, self.num_heads, self.bias, d.get("q_in"), d.get("k_in"), d.get("v_in")
        )

    def build(self, queries_shape: Any, keys_shape: Any, values_shape: Any) -> None:
        self._create(q_in=queries_shape[-1], k_in=keys_shape[-1], v_in=values_shape[-1])

    def _attend(self, queries: Any, keys: Any, values: Any, **kwargs: Any) -> Any:
        attention.check_projected_inputs(self._ops, queries, keys, values)
        self._check_built_for(queries=queries, keys=keys, values=values)
        implementation = None if kwargs["return_weights"] else self.implementation
        return multihead.multi_head_attention(
            queries, keys, values, self._tensors(), self.num_heads,
            implementation=implementation, **kwargs,
        )

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "num_hiddens": self.num_hiddens,
                "num_heads": self.num_heads, "dropout": self.dropout, "bias": self.bias,
                "keep_attention_weights": self.keep_attention_weights,
                "implementation": self.implementation}


@_serializable
class RelativeMultiHeadAttention(_Attention):
    """Multi-head attention with relative position representations (Shaw et al., 2018).

    The weights of :class:`MultiHeadAttention` plus ``rel_k.embedding (2m + 1, h/H)``, one
    vector per clipped offset between a key and a query added to the keys, and with
    ``relative_values`` ``rel_v.embedding``, added to the values; the heads share them. The
    attention weights are always formed (the offsets' terms need them), so there is no
    ``implementation`` option.

    Args:
        num_hiddens: Width h of the projections and of the output.
        num_heads: Number of heads H; must divide ``num_hiddens``.
        max_relative_position: m: offsets between a key and a query are clipped to [-m, m].
        dropout: Dropout rate on the attention weights in training.
        bias: Whether the four projections have biases.
        relative_values: Also add the offsets' vectors to the values (weight ``rel_v.embedding``).
        keep_attention_weights: Keep each call's weights in ``attention_weights``.
        **kwargs: Passed to ``keras.layers.Layer``.
    """

    def __init__(
        self, num_hiddens: int, num_heads: int, max_relative_position: int, dropout: float = 0.0,
        bias: bool = False, *, relative_values: bool = True, keep_attention_weights: bool = True,
        **kwargs: Any,
    ) -> None:
        W.relative_multi_head_spec(num_hiddens, num_heads, max_relative_position)  # validates
        super().__init__(dropout, **kwargs)
        self.num_hiddens, self.num_heads, self.bias = num_hiddens, num_heads, bool(bias)
        self.max_relative_position = max_relative_position
        self.relative_values = bool(relative_values)
        self.keep_attention_weights = bool(keep_attention_weights)

    def spec(self) -> W.Spec:
        d = self._dims
        return W.relative_multi_head_spec(
            self.num_hiddens, self.num_heads, self.max_relative_position, self.bias,
            self.relative_values, d.get("q_in"), d.get("k_in"), d.get("v_in"),
        )

    def build(self, queries_shape: Any, keys_shape: Any, values_shape: Any) -> None:
        self._create(q_in=queries_shape[-1], k_in=keys_shape[-1], v_in=values_shape[-1])

    def _attend(self, queries: Any, keys: Any, values: Any, **kwargs: Any) -> Any:
        attention.check_projected_inputs(self._ops, queries, keys, values)
        self._check_built_for(queries=queries, keys=keys, values=values)
        return multihead.relative_multi_head_attention(
            queries, keys, values, self._tensors(), self.num_heads, **kwargs
        )

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "num_hiddens": self.num_hiddens,
                "num_heads": self.num_heads, "max_relative_position": self.max_relative_position,
                "dropout": self.dropout, "bias": self.bias,
                "relative_values": self.relative_values,
                "keep_attention_weights": self.keep_attention_weights}


@_serializable
class PositionalEncoding(Layer):
    """Adds the sinusoidal table ``P`` (shape ``(1, max_len, num_hiddens)``) to the input.

    Args:
        num_hiddens: Width of the input and of the table.
        dropout: Dropout rate on the sum in training.
        max_len: Number of positions in the table.
        **kwargs: Passed to ``keras.layers.Layer``.

    Attributes:
        P: The table, a constant tensor in the layer's compute dtype (not a weight).
    """

    def __init__(
        self, num_hiddens: int, dropout: float = 0.0, max_len: int = 1000, **kwargs: Any
    ) -> None:
        super().__init__(dropout, **kwargs)
        self.num_hiddens, self.max_len = num_hiddens, max_len
        table = positional.sinusoidal_encoding(max_len, num_hiddens, "float64")[None]
        self.P = tf.cast(table, self.compute_dtype)

    def call(self, X: Any, training: bool | None = None) -> Any:
        return positional.add_positions(X, self.P, self._rate(training), ops=self._ops)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "num_hiddens": self.num_hiddens, "dropout": self.dropout,
                "max_len": self.max_len}


@_serializable
class LearnedPositionalEncoding(Layer):
    """Adds a learned table ``P`` (shape ``(1, max_len, num_hiddens)``) to the input.

    Args:
        num_hiddens: Width of the input and of the table.
        dropout: Dropout rate on the sum in training.
        max_len: Number of positions in the table.
        **kwargs: Passed to ``keras.layers.Layer``.
    """

    def __init__(
        self, num_hiddens: int, dropout: float = 0.0, max_len: int = 1000, **kwargs: Any
    ) -> None:
        super().__init__(dropout, **kwargs)
        self.num_hiddens, self.max_len = num_hiddens, max_len
        self._create()
        self.built = True

    def spec(self) -> W.Spec:
        return W.learned_positional_spec(self.num_hiddens, self.max_len)

    @property
    def P(self) -> keras.Variable:  # noqa: N802 - the name the source chapter uses
        """The learned table, ``(1, max_len, num_hiddens)``."""
        return self._params["P"]

    def call(self, X: Any, training: bool | None = None) -> Any:
        return positional.add_positions(X, self._tensors()["P"], self._rate(training), ops=self._ops)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "num_hiddens": self.num_hiddens, "dropout": self.dropout,
                "max_len": self.max_len}


@_serializable
class PositionWiseFFN(Layer):
    """Two dense layers with a ReLU between, applied at every position.

    Args:
        ffn_num_hiddens: Width of the hidden layer.
        ffn_num_outputs: Width of the output.
        **kwargs: Passed to ``keras.layers.Layer``.
    """

    def __init__(self, ffn_num_hiddens: int, ffn_num_outputs: int, **kwargs: Any) -> None:
        W.ffn_spec(ffn_num_hiddens, ffn_num_outputs)  # validates the sizes
        super().__init__(0.0, **kwargs)
        self.ffn_num_hiddens, self.ffn_num_outputs = ffn_num_hiddens, ffn_num_outputs

    def spec(self) -> W.Spec:
        return W.ffn_spec(self.ffn_num_hiddens, self.ffn_num_outputs, self._dims.get("d_in"))

    def build(self, X_shape: Any) -> None:
        self._create(d_in=X_shape[-1])

    def call(self, X: Any) -> Any:
        checks.check_rank(self._ops, "X", X, (3,), "(B, T, d)")
        self._check_built_for(X=X)
        return transformer.position_wise_ffn(X, self._tensors(), ops=self._ops)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "ffn_num_hiddens": self.ffn_num_hiddens,
                "ffn_num_outputs": self.ffn_num_outputs}


@_serializable
class AddNorm(Layer):
    """Residual connection followed by layer normalisation over the last axis (eps 1e-5).

    Args:
        num_hiddens: Width of the normalised axis.
        dropout: Dropout rate on the sublayer's output in training.
        **kwargs: Passed to ``keras.layers.Layer``.
    """

    def __init__(self, num_hiddens: int, dropout: float = 0.0, **kwargs: Any) -> None:
        super().__init__(dropout, **kwargs)
        self.num_hiddens = num_hiddens
        self._create()
        self.built = True

    def spec(self) -> W.Spec:
        return W.add_norm_spec(self.num_hiddens)

    def call(self, X: Any, Y: Any, training: bool | None = None) -> Any:
        checks.check_last_dim(self._ops, "X", X, self.num_hiddens)
        return transformer.add_norm(X, Y, self._tensors(), self._rate(training), ops=self._ops)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "num_hiddens": self.num_hiddens, "dropout": self.dropout}


@_serializable
class TransformerEncoderBlock(Layer):
    """Self-attention and a position-wise FFN, each wrapped in add & norm.

    Args:
        num_hiddens: Model width h.
        ffn_num_hiddens: Hidden width of the FFN.
        num_heads: Heads of the self-attention; must divide ``num_hiddens``.
        dropout: Dropout rate of the attention weights and both residual branches.
        bias: Whether the attention projections have biases.
        keep_attention_weights: Keep each call's self-attention weights in
            ``attention_weights``; when False, calls pool by ``implementation``.
        implementation: None, ``"direct"``, ``"blockwise"`` or ``"fused"``: how calls that do
            not form the weights pool (None lets the core choose).
        **kwargs: Passed to ``keras.layers.Layer``.
    """

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
        self._create()
        self.built = True

    def spec(self) -> W.Spec:
        return W.encoder_block_spec(
            self.num_hiddens, self.ffn_num_hiddens, self.num_heads, self.bias
        )

    _padded_inputs = ("X",)

    def call(
        self, X: Any, valid_lens: Any = None, *, mask: Any = None, training: bool | None = None,
        X_mask: Any = None,
    ) -> Any:
        """Runs the block; ``X_mask`` ``(B, T)`` is X's Keras padding mask (True = real position).

        Keras fills ``X_mask`` in from ``X._keras_mask``; padded positions are hidden as keys
        and their rows are 0 in the attention (ANDed with ``valid_lens`` and ``mask``).
        """
        checks.check_rank(self._ops, "X", X, (3,), "(B, T, num_hiddens)")
        checks.check_last_dim(self._ops, "X", X, self.num_hiddens)
        mask = masks.with_padding(self._ops, mask, _scores_shape(self._ops, X, X), X_mask, X_mask)
        need = self.keep_attention_weights
        result = transformer.transformer_encoder_block(
            X, self._tensors(), self.num_heads, valid_lens, mask=mask,
            dropout=self._rate(training), return_weights=need,
            implementation=None if need else self.implementation, ops=self._ops,
        )
        out, self.attention_weights = result if need else (result, None)
        return out

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "num_hiddens": self.num_hiddens,
                "ffn_num_hiddens": self.ffn_num_hiddens, "num_heads": self.num_heads,
                "dropout": self.dropout, "bias": self.bias,
                "keep_attention_weights": self.keep_attention_weights,
                "implementation": self.implementation}


@_serializable
class TransformerEncoder(Layer):
    """The Transformer encoder: scaled token embedding, sinusoidal encoding, ``num_blks`` blocks.

    ``X = dropout(E[tokens] * sqrt(h) + P)``, then each :class:`TransformerEncoderBlock` in
    turn. The weights are ``token.embedding (vocab_size, h)`` and, for block ``i``, the
    block's names under ``blks.<i>.``, all Keras variables of this one layer.

    Token ids must lie in ``[0, vocab_size)``: eager calls check them (ValueError); under
    ``tf.function`` they are not checked, and an id out of range fails in ``tf.gather`` on CPU
    but reads zeros under XLA.

    Args:
        vocab_size: V, the number of token ids.
        num_hiddens: Model width h.
        ffn_num_hiddens: Hidden width of the blocks' FFNs.
        num_heads: Heads of every block's self-attention; must divide ``num_hiddens``.
        num_blks: Number of blocks.
        dropout: Dropout rate of the encoding's sum and inside every block, in training.
        bias: Whether the attention projections have biases.
        keep_attention_weights: Keep each block's self-attention weights in
            ``attention_weights``; when False, calls pool by ``implementation``.
        implementation: None, ``"direct"``, ``"blockwise"`` or ``"fused"``: how calls that do
            not form the weights pool (None lets the core choose).
        max_len: Rows of the sinusoidal table ``P``: the longest sequence the encoder takes.
            Calls slice it to their length, which may be unknown until run time
            (``keras.Input((None,))``, ``tf.function`` with ``TensorSpec((None, None))``).
        **kwargs: Passed to ``keras.layers.Layer``.

    Attributes:
        P: The sinusoidal table ``(1, max_len, h)``, a constant in the compute dtype (not a
            weight).
        attention_weights: A list with one entry per block: that block's self-attention
            weights ``(B, H, T, T)`` of the last call, before dropout (None entries when the
            weights are not kept).
    """

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
        implementation = checks.check_implementation(implementation)
        super().__init__(dropout, **kwargs)
        self.vocab_size, self.num_hiddens, self.ffn_num_hiddens = vocab_size, num_hiddens, ffn_num_hiddens
        self.num_heads, self.num_blks, self.bias = num_heads, num_blks, bool(bias)
        self.keep_attention_weights = bool(keep_attention_weights)
        self.implementation = implementation
        self._create()
        self.built = True
        self.attention_weights: list[tf.Tensor | None] = [None] * num_blks
        table = positional.sinusoidal_encoding(max_len, num_hiddens, "float64")[None]
        self.max_len, self.P = max_len, tf.cast(table, self.compute_dtype)

    def spec(self) -> W.Spec:
        return W.transformer_encoder_spec(
            self.vocab_size, self.num_hiddens, self.ffn_num_hiddens, self.num_heads,
            self.num_blks, self.bias,
        )

    _padded_inputs = ("tokens",)

    def call(
        self, tokens: Any, valid_lens: Any = None, *, mask: Any = None,
        training: bool | None = None, tokens_mask: Any = None,
    ) -> Any:
        """Encodes; ``tokens_mask`` ``(B, T)`` is the tokens' Keras padding mask, if they have one.

        Keras fills ``tokens_mask`` in from ``tokens._keras_mask``; it is ANDed into every
        block's self-attention mask as in :class:`TransformerEncoderBlock`.
        """
        if tokens_mask is not None:
            shape = checks.check_rank(self._ops, "tokens", tokens, (2,), "(B, T) token ids")
            scores = (shape[0], None, shape[1], shape[1])
            mask = masks.with_padding(self._ops, mask, scores, tokens_mask, tokens_mask)
        need = self.keep_attention_weights
        result = transformer.transformer_encoder(
            tokens, self._tensors(), self.num_heads, valid_lens, mask=mask,
            dropout=self._rate(training), return_weights=need,
            implementation=None if need else self.implementation, positions=self.P,
            ops=self._ops,
        )
        out, weights = result if need else (result, [None] * self.num_blks)
        self.attention_weights = list(weights)
        return out

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "vocab_size": self.vocab_size,
                "num_hiddens": self.num_hiddens, "ffn_num_hiddens": self.ffn_num_hiddens,
                "num_heads": self.num_heads, "num_blks": self.num_blks,
                "dropout": self.dropout, "bias": self.bias,
                "keep_attention_weights": self.keep_attention_weights,
                "implementation": self.implementation, "max_len": self.max_len}


@_serializable
class NadarayaWatson(Layer):
    """Nadaraya-Watson attention pooling with a Gaussian kernel.

    Args:
        parametric: Learn the kernel's inverse width ``w`` (weight ``w`` of shape ``(1,)``).
        **kwargs: Passed to ``keras.layers.Layer``.
    """

    def __init__(self, parametric: bool = False, **kwargs: Any) -> None:
        super().__init__(0.0, **kwargs)
        self.parametric = bool(parametric)
        self._create()
        self.built = True

    def spec(self) -> W.Spec:
        return W.nadaraya_watson_spec(self.parametric)

    def call(self, queries: Any, keys: Any, values: Any) -> Any:
        w = self._tensors().get("w")
        out, weights = attention.nadaraya_watson(
            queries, keys, values, w, return_weights=True, ops=self._ops
        )
        self.attention_weights = weights
        return out

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "parametric": self.parametric}
