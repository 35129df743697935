"""Keras 3 layers (TensorFlow backend): every declared layer as a ``keras.layers.Layer``.

One generic base, :class:`Layer`, turns each declaration of :mod:`attention_core.declarations`
into a Keras layer: its weights are Keras variables named by the canonical layout of DESIGN
section 5 (``W_q.kernel``, ``attention.W_q.kernel``, ...), created by ``build()`` from the
input sizes on the first call (or from the mapping given to ``set_weights``), or in
``__init__`` when the arguments fix every size. ``get_config()`` is the declared arguments,
and the classes are registered (package ``attention_core``), so ``.keras`` files load without
``custom_objects``. A call that raises changes nothing: a first call that fails leaves the
layer unbuilt.

Weights, two forms: ``get_weights() -> dict[str, numpy.ndarray]`` and ``set_weights(mapping)``
use the canonical layout of every backend; ``get_weight_list()`` and ``set_weight_list(list)``
are Keras' list form (the values of ``layer.weights`` in order).

Dropout is active only for ``training=True`` and draws from a ``keras.random.SeedGenerator``
owned by the layer; the initial weights are drawn by Keras initializers. Both follow
``keras.utils.set_random_seed``, eagerly and under ``tf.function``. The attention layers keep
the last call's weights, before dropout, in ``attention_weights`` (the traced tensor under
``tf.function``; return them with ``return_attention=True`` to get them out). Inputs whose
second axis is a sequence take Keras padding masks (``_keras_mask``, e.g. from
``Embedding(mask_zero=True)``) as ``<input>_mask`` call arguments, ANDed into the attention
mask (:func:`attention_core.masks.with_padding`).
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Mapping
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING, Any

import keras
import numpy as np
import tensorflow as tf

from attention_core import checks, masks
from attention_core import declarations as D
from attention_core import weights as W
from backends.tensorflow.ops import OPS, TensorFlowOps

_P = inspect.Parameter

#: Keras initializers of the three kinds of :func:`attention_core.weights.init_rule`.
_INITIALIZERS = {
    "uniform": lambda r: keras.initializers.RandomUniform(r.a, r.b),
    "normal": lambda r: keras.initializers.RandomNormal(r.a, r.b),
    "constant": lambda r: keras.initializers.Constant(r.a),
}


@dataclass(eq=False, repr=False)
class KerasArguments:
    """``keras.layers.Layer``'s own constructor arguments, after the declared ones.

    Args:
        name: The layer's name.
        dtype: Its dtype policy (``"float64"``, ``"mixed_float16"``, ...); None for the global one.
        trainable: Whether its weights are trained.
        autocast: Whether floating inputs are cast to the compute dtype.
        activity_regularizer: A Keras regularizer of the output.
    """

    _: KW_ONLY
    name: str | None = None
    dtype: Any = None
    trainable: bool = True
    autocast: bool = True
    activity_regularizer: Any = None


@D.dataclass_transform()
class Layer(D.Declaration, keras.layers.Layer, KerasArguments):
    """Holds a declared layer's weights as Keras variables and calls its forward.

    Attributes:
        attention_weights: The last call's attention weights ``(B, H, Q, K)``, before dropout
            (a list, one per block, for the encoder); None when not formed.
    """

    extras = D.keyword_parameters(KerasArguments)

    if not TYPE_CHECKING:  # type checkers see the declared signature (dataclass_transform)

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._setup(args, kwargs)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Gives a declared layer its ``call`` and ``build`` signatures, and registers it.

        Keras reads them: ``training`` and the ``<input>_mask`` arguments from ``call``,
        and the build arguments ``<input>_shape`` from ``build``.
        """
        super().__init_subclass__(**kwargs)
        if cls.declared_or_none() is None or "call" in vars(cls):
            return
        own = [_P(name, _P.KEYWORD_ONLY, default=None)
               for name in ("training", *(f"{seq}_mask" for seq in cls.sequences))]
        declared = list(cls.call_signature().parameters.values())
        cls.call = _Signed(Layer._forward, [*declared, *own])
        if cls.sizes:
            shapes = [_P(f"{arg}_shape", _P.POSITIONAL_OR_KEYWORD)
                      for arg in dict.fromkeys(cls.sizes.values())]
            cls.build = _Signed(Layer._build, shapes)
        if any(base in D.LAYERS.values() for base in cls.__bases__):
            keras.saving.register_keras_serializable(package="attention_core")(cls)

    def _setup(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        declared, extras = self.bind_arguments(args, kwargs, *self.extras)
        vars(self).update(declared)
        self.check()
        keras.layers.Layer.__init__(self, **extras)
        dropout = getattr(self, "dropout", 0.0)
        self.seed_generator = keras.random.SeedGenerator() if dropout > 0 else None
        self._ops = TensorFlowOps(self.seed_generator)
        self._dims: dict[str, int] = {}
        self._params: dict[str, keras.Variable] = {}
        self._weightless = not self.weight_shapes()
        tables = self.constants("float64")
        self._constants = {name: tf.cast(t, self.compute_dtype) for name, t in tables.items()}
        self.attention_weights: Any = self.finish(None, False, False)[1]
        self._allow_non_tensor_positional_args = True  # valid_lens may be a Python list
        if None not in {d for shape in self.weight_shapes().values() for d in shape}:
            self._create({})
            self.built = True

    def spec(self) -> W.Spec:
        """Canonical names and shapes of this layer's weights (None = not known yet)."""
        return self.weight_shapes(**self._dims)

    def __getattr__(self, name: str) -> Any:
        """A held table by its name (``P``): a constant, or a weight of that name."""
        found = {**vars(self).get("_constants", {}), **vars(self).get("_params", {})}
        if name in found:
            return found[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    __repr__ = keras.layers.Layer.__repr__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Calls the layer; a failed call changes nothing and raises what ``call()`` raised.

        A first call that fails leaves the layer unbuilt. The error is the one ``call()``
        raised, not Keras' rewrapped copy (see :func:`_unwrap_call_error`).
        """
        # the dtype rule: without weights, the inputs' dtype, unless a policy other than
        # float32 was chosen for the layer (or globally), whose compute dtype then rules
        if self.autocast and self.dtype_policy.name == "float32" and self._weightless:
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

    def _with_padding_masks(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """Moves the inputs' Keras padding masks (``_keras_mask``) into ``<name>_mask`` arguments.

        Keras hands the padding mask of a layer's only tensor argument to the call argument
        named ``mask``, which here is the attention mask (DESIGN section 4). Giving the padding
        masks their own arguments first keeps them apart: Keras then fills nothing, and a
        ``mask`` the caller gave stays the attention mask.
        """
        if not self.sequences or all(
            getattr(value, "_keras_mask", None) is None for value in (*args, *kwargs.values())
        ):
            return kwargs  # the common case, decided without binding the arguments
        try:
            bound = self._call_signature.bind_partial(*args, **kwargs).arguments
        except TypeError:
            return kwargs  # Keras raises its own error for a call that does not bind
        found = {}
        for name in self.sequences:
            padding = getattr(bound.get(name), "_keras_mask", None)
            if padding is not None and bound.get(f"{name}_mask") is None:
                found[f"{name}_mask"] = padding
        return {**kwargs, **found} if found else kwargs

    def _forward(self, *args: Any, training: bool | None = None, **kwargs: Any) -> Any:
        """The generic ``call``: the declared call, ``training`` and the padding masks."""
        paddings = {name: kwargs.pop(f"{name}_mask", None) for name in self.sequences}
        prepared = self.prepare(self._ops, self.compute_dtype, self.bind_call(args, kwargs))
        for dim, size in prepared.dims.items():
            checks.check_built_size(W.INPUT_ARGS[dim], size, self._dims.get(dim))
        arguments = prepared.arguments
        if any(pad is not None for pad in paddings.values()):
            arguments["mask"] = self._padded(arguments, paddings)
        need = self.needs_attention(prepared.return_attention)
        rate = getattr(self, "dropout", 0.0) if training else 0.0
        tensors = {name: variable.value for name, variable in self._params.items()}
        run = D.Run(self._ops, tensors, self._constants, rate, need)
        returned, kept = self.finish(self.compute(run, **arguments), need,
                                     prepared.return_attention)
        if self.attention:
            self.attention_weights = kept
        return returned

    def _padded(self, arguments: Mapping[str, Any], paddings: Mapping[str, Any]) -> Any:
        """The attention mask ANDed with the padding masks of the sequence inputs.

        The first sequence input gives the queries' padding; the others (or, alone, the
        first itself) the keys', ANDed.
        """
        first, *rest = self.sequences
        keys = rest or [first]
        found = [paddings[name] for name in keys if paddings[name] is not None]
        keys_mask = functools.reduce(self._ops.logical_and, found) if found else None
        q_shape, k_shape = self._ops.shape(arguments[first]), self._ops.shape(arguments[keys[0]])
        scores = (q_shape[0], None, q_shape[1], k_shape[1])  # (B, H, Q, K)
        return masks.with_padding(
            self._ops, arguments.get("mask"), scores, paddings[first], keys_mask
        )

    def _build(self, *args: Any, **kwargs: Any) -> None:
        """The generic ``build(<input>_shape, ...)``: the weights for those input sizes."""
        shapes = inspect.signature(type(self).build).bind(self, *args, **kwargs).arguments
        dims = {dim: shapes[f"{arg}_shape"][-1] for dim, arg in self.sizes.items()}
        unknown = list(dict.fromkeys(self.sizes[dim] for dim, size in dims.items() if size is None))
        if unknown:
            names = f"{', '.join(unknown[:-1])} and {unknown[-1]}" if len(unknown) > 1 else unknown[0]
            raise ValueError(
                f"{type(self).__name__}: the last dimension of {names} must be known to create "
                "the weights, got None"
            )
        self._create({dim: int(size) for dim, size in dims.items()})

    def _create(self, dims: dict[str, int]) -> None:
        """Creates every weight for these input sizes, by its rule's Keras initializer."""
        spec = self.weight_shapes(**dims)
        for name, shape in spec.items():
            rule = W.init_rule(name, shape)
            self._params[name] = self.add_weight(
                shape=shape, initializer=_INITIALIZERS[rule.kind](rule),
                dtype=self.variable_dtype, name=name,
            )
        self._dims = dims

    def _unbuild(self) -> None:
        """Undoes the build of a first call that failed, so the call changes nothing."""
        for variable in self._params.values():
            self._untrack_variable(variable)
        self._tracker.unlock()
        self._params, self._dims = {}, {}
        self._build_shapes_dict = None
        self.built = False

    def get_config(self) -> dict[str, Any]:
        """Keras' config: its own entries and the declared arguments."""
        return {**keras.layers.Layer.get_config(self), **self.arguments()}

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
        if not self.built:
            raise checks.not_built(type(self).__name__)
        return {name: np.array(variable.numpy()) for name, variable in self._params.items()}

    def set_weights(self, weights: Mapping[str, Any]) -> None:
        """Sets every weight from a canonical mapping; checks all names and shapes first.

        Before the first call, the input sizes are read off the mapping and the layer is
        built. A list (Keras' form) is refused: use :meth:`set_weight_list`. Values of any
        real float dtype are cast to the variable dtype; every value is checked and converted
        before the layer changes (a layer built here is unbuilt again if assigning fails).

        Raises:
            TypeError: ``weights`` is not a mapping, or an entry is not floating point.
            ValueError: Missing or unexpected names, or a wrong shape.
        """
        dtype = keras.backend.standardize_dtype(self.variable_dtype)
        checked = W.check_weights(self.spec(), weights, dtype=dtype)
        staged = {name: tf.cast(OPS.from_numpy(value), dtype) for name, value in checked.items()}
        fresh = not self.built
        if fresh:
            dims = W.dims_from_weights(checked)
            self.build(**{f"{self.sizes[d]}_shape": (None, None, dims[d]) for d in self.sizes})
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


class _Signed:
    """A generic method that shows Keras (``inspect.signature``) a layer class's own parameters.

    A callable descriptor rather than a function with ``__signature__``: Keras wraps ``build``
    with ``functools.wraps``, which would copy that attribute onto the bound wrapper.
    """

    def __init__(self, method: Any, parameters: list[inspect.Parameter]) -> None:
        self.method, self.__name__, self.__doc__ = method, method.__name__, method.__doc__
        self.parameters = [_P("self", _P.POSITIONAL_OR_KEYWORD), *parameters]

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.Signature(self.parameters)

    def __get__(self, layer: Any, owner: Any = None) -> Any:
        return self if layer is None else types.MethodType(self, layer)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.method(*args, **kwargs)


def _unwrap_call_error(err: BaseException) -> BaseException:
    """The exception ``call()`` raised, from the copy Keras raised in its place.

    With traceback filtering on (Keras' default), an exception raised inside ``call()`` is
    replaced by a new one of the same class whose message is the original's framed by
    "Exception encountered when calling X.call()" and a list of the call's arguments; Keras
    marks it with ``_keras_call_info_injected`` and raises it ``from None``, so the original is
    its ``__context__``. That message would differ from every other backend's. Here the
    original is found again: the marked exception's ``__cause__`` or ``__context__``, of the
    same class (or of any class when Keras fell back to a RuntimeError). The argument list
    Keras wrote is added to it as a note. Anything else is returned as it is.
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


class DotProductAttention(Layer, D.DotProductAttention): ...
class AdditiveAttention(Layer, D.AdditiveAttention): ...
class MultiHeadAttention(Layer, D.MultiHeadAttention): ...
class RelativeMultiHeadAttention(Layer, D.RelativeMultiHeadAttention): ...
class PositionalEncoding(Layer, D.PositionalEncoding): ...
class LearnedPositionalEncoding(Layer, D.LearnedPositionalEncoding): ...
class PositionWiseFFN(Layer, D.PositionWiseFFN): ...
class AddNorm(Layer, D.AddNorm): ...
class TransformerEncoderBlock(Layer, D.TransformerEncoderBlock): ...
class TransformerEncoder(Layer, D.TransformerEncoder): ...
class NadarayaWatson(Layer, D.NadarayaWatson): ...
