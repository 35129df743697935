"""Keras 3 layers on any Keras backend: every declared layer as a ``keras.layers.Layer``.

One generic base, :class:`Layer`, holds any declaration of :mod:`attention_core.declarations`:
weights are Keras variables named by the canonical layout (the Weights page), made by
``build()`` on the first call (or ``set_weights``), or in ``__init__`` when the arguments fix
every size, by Keras initializers; dropout (``training=True`` only) draws from the layer's
``keras.random.SeedGenerator``. ``get_config()`` is the declared arguments (``context_parallel``
as its engine's plain values), and the classes are
registered, so ``.keras`` files load without ``custom_objects``. A failed call changes nothing.
Keras padding masks of the sequence inputs arrive as ``<input>_mask`` call arguments.

The same classes run under ``KERAS_BACKEND=tensorflow``, ``jax`` and ``torch``: the variables
hold that framework's arrays and the core computes on its ops (:func:`backends.keras.ops.keras_ops`).
``backends.tensorflow`` serves these classes under TensorFlow, so ``.keras`` files name them
``attention_core>Name`` on every backend.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Mapping
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING, Any, cast

import keras
import ml_dtypes
import numpy as np
from keras.src.backend import get_keras_mask as _get_keras_mask
from keras.src.backend import set_keras_mask

from attention_core import attention, checks
from attention_core import declarations as D
from attention_core import weights as W
from attention_core.host import framework_of
from backends.keras.conventions import KERAS
from backends.keras.ops import backend_ops, keras_ops

_P = inspect.Parameter

#: Keras initializers of the three kinds of :func:`attention_core.weights.init_rule`.
_INITIALIZERS = {
    "uniform": lambda r: keras.initializers.RandomUniform(r.a, r.b),
    "normal": lambda r: keras.initializers.RandomNormal(r.a, r.b),
    "constant": lambda r: keras.initializers.Constant(r.a),
}


@dataclass(eq=False, repr=False)
class KerasArguments:
    """``keras.layers.Layer``'s constructor arguments, after the declared ones."""

    _: KW_ONLY
    name: str | None = None
    dtype: Any = None
    trainable: bool = True
    autocast: bool = True
    activity_regularizer: Any = None


if TYPE_CHECKING:  # Keras has no types: a base of Any attributes, so mypy sees exact signatures

    class _Keras:
        call: Any
        build: Any
        compute_output_spec: Any
        def __getattr__(self, name: str) -> Any: ...
        def __setattr__(self, name: str, value: Any) -> None: ...
        def __call__(self, *args: Any, **kwargs: Any) -> Any: ...
else:
    _Keras = keras.layers.Layer


def _torch_key(variable: Any) -> str:
    """A variable's key among a Keras-on-torch layer's torch parameters.

    Its path, with the canonical names' dots as ``/`` (torch refuses ``.`` in a name).
    """
    return str(variable.path).replace(".", "/")


class _TorchParameters:
    """Keras on torch: the layer's variables as torch parameters, keyed by :func:`_torch_key`.

    Keras' ``TorchLayer`` (and a model holding the layer) keys them by variable path, which
    holds the canonical dotted names (``multi_head_attention/W_q.kernel``). The variables keep
    their names and take the path ``multi_head_attention/W_q/kernel`` once made; these hooks
    key them so while they are made. (Other Keras backends never call the first hook, and
    the other two find no torch parameters.)
    """

    def _track_variables(self: Any) -> None:
        import torch

        self._torch_params = torch.nn.ParameterDict(
            {_torch_key(variable): variable.value for variable in self.variables})

    def _post_track_variable(self: Any, variable: Any) -> None:
        if hasattr(self, "_torch_params") and _torch_key(variable) not in self.torch_params:
            self.torch_params[_torch_key(variable)] = variable.value

    def _post_untrack_variable(self: Any, variable: Any) -> None:
        if hasattr(self, "_torch_params") and _torch_key(variable) in self.torch_params:
            self.torch_params.pop(_torch_key(variable))


#: Keras runs on torch (the layers are torch modules).
_ON_TORCH = keras.backend.backend() == "torch"


def _in_jax_trace(arguments: Mapping[str, Any]) -> bool:
    """Keras on JAX inside a trace (``jax.jit``, Keras' compiled ``predict`` and ``fit``)."""
    if keras.backend.backend() != "jax":
        return False
    import jax

    return any(isinstance(value, jax.core.Tracer) for value in arguments.values())


def _context_parallel_reader() -> Any:
    """The reader of ``context_parallel=`` of the engine Keras runs on, as a class attribute.

    JAX's ``shard_map`` or ``torch.distributed``; None on TensorFlow (refused).
    """
    if keras.backend.backend() == "jax":
        from backends.jax.parallel import context_parallel
    elif keras.backend.backend() == "torch":
        from backends.torch.parallel import context_parallel  # type: ignore[assignment]
    else:
        return None
    return staticmethod(context_parallel)


@D.dataclass_transform()
class Layer(D.KeptAttention, D.Declaration, _TorchParameters, _Keras, KerasArguments):
    """Holds a declared layer's weights as Keras variables and calls its forward.

    Attributes:
        attention_weights: The last call's attention weights ``(B, H, Q, K)``, before dropout
            (a list, one per block, for the encoder); None when not formed.
    """

    extras = D.keyword_parameters(KerasArguments)
    convention = KERAS  # Keras' call keywords too (backends.keras.conventions)
    context_parallel_reader = _context_parallel_reader()
    runs_on = f"Keras' {keras.backend.backend()} backend"

    if not TYPE_CHECKING:  # type checkers see the declared signature (dataclass_transform)

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._setup(args, kwargs)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Registers a declared layer; gives it the ``call`` and ``build`` signatures Keras reads."""
        super().__init_subclass__(**kwargs)
        if cls.declared_or_none() is None or "call" in vars(cls):
            return
        own = [_P(name, _P.KEYWORD_ONLY, default=None)
               for name in ("training", *(f"{seq}_mask" for seq in cls.sequences))]
        declared = list(cls.call_signature().parameters.values())
        cls.call = _Signed(Layer._forward, [*declared, *own])
        if cls.sizes:
            shapes = [_P(f"{arg}_shape", _P.POSITIONAL_OR_KEYWORD)
                      for arg in dict.fromkeys(s.argument for s in cls.sizes.values())]
            cls.build = _Signed(Layer._build, shapes)
        if any(base in D.LAYERS.values() for base in cls.__bases__):
            keras.saving.register_keras_serializable(package="attention_core")(cls)

    def _setup(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        declared, extras = self.bind_arguments(args, kwargs, *self.extras)
        self.__dict__.update(declared)
        self.check()
        keras.layers.Layer.__init__(self, **extras)
        self.seed_generator = keras.random.SeedGenerator() if getattr(self, "dropout", 0) else None
        self._ops = keras_ops(self.seed_generator)
        self._dims: dict[str, int] = {}
        self._params: dict[str, keras.Variable] = {}
        self._weightless = not self.weight_shapes()
        self._constants = {n: _rounded(t, self.compute_dtype)
                           for n, t in self.constants("float64").items()}
        self._attention_kept = self.finish(None, False, False)[1]
        self._allow_non_tensor_positional_args = True  # valid_lens may be a Python list
        self._convert_input_args = False  # Keras' conversion, by _converted
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
        try:  # Keras on torch: the layer is a torch.nn.Module, which finds its own attributes
            return super().__getattr__(name)
        except AttributeError:
            pass
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    __repr__ = keras.layers.Layer.__repr__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Calls the layer; a failed call changes nothing and raises what ``call()`` raised."""
        # the dtype rule: without weights, the inputs' dtype, unless a policy not float32 rules
        if self.autocast and self.dtype_policy.name == "float32" and self._weightless:
            self.autocast = False
        fresh = not self.built
        args, kwargs = self.canonical_call(args, kwargs)  # Keras builds from canonical names
        args = tuple(self._converted(x) for x in args)
        kwargs = self._with_padding_masks(args, {k: self._converted(x) for k, x in kwargs.items()})
        self._check_arrays(args, kwargs)
        try:
            return super().__call__(*args, **kwargs)
        except BaseException as err:
            if fresh and self.built:
                self._unbuild()
            original = _unwrap_call_error(err)
            if original is err:
                raise
        raise original  # outside the except block: the original's own context is kept

    def compute_output_spec(self, *args: Any, **kwargs: Any) -> Any:
        """Keras' output spec; on torch, a ``max_len`` layer's unknown sizes stand at 1, then 2.

        Keras on torch finds a spec by calling the layer on stand-in tensors, each unknown size
        made 83 (then 89), which a table of ``max_len`` rows would refuse as too long: no
        length is known yet, so no length is checked. Here each unknown size but the batch's
        stands at 1, then 2, and an output size that differs between the two is unknown; the
        real call checks the real length.
        """
        spec = super().compute_output_spec
        if not (_ON_TORCH and getattr(self, "max_len", 0) >= 2 and _unknown_sizes((args, kwargs))):
            return spec(*args, **kwargs)
        one, two = (spec(*_standing_at(args, n), **_standing_at(kwargs, n)) for n in (1, 2))
        return keras.tree.map_structure(_unknown_where_unequal, one, two)

    def _converted(self, x: Any) -> Any:
        """Keras' conversion of an array argument, but for integers the backend would narrow.

        Keras makes tensors of array arguments, floats cast by the dtype policy. An integer
        NumPy array whose values the tensor does not hold (JAX without x64 holds no int64: a
        length of 2**32 + 3 would become 3) stays on the host, where the core's checks name it.
        """
        converted = self.dtype_policy.convert_input(x, self.autocast, self.input_dtype)
        if (isinstance(x, np.ndarray) and x.dtype.kind in "iu" and converted is not x
                and not np.array_equal(keras.ops.convert_to_numpy(converted), x)):
            return x
        mask = _padding_mask(x)
        if mask is not None and converted is not x:
            set_keras_mask(converted, mask)
        return converted

    def _check_arrays(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Refuses inputs computed on that are not arrays (nested lists), as the core does.

        Before Keras builds the weights from their shapes, which lists do not have.
        """
        try:
            bound = self._call_signature.bind_partial(*args, **kwargs).arguments
        except TypeError:
            return  # Keras raises its own error for a call that does not bind
        given = {name: bound[name] for name in self.cast_inputs if bound.get(name) is not None}
        if any(framework_of(x) is None for x in given.values()):
            checks.check_inputs_framework(**given)

    def _with_padding_masks(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """Moves the inputs' padding masks (``_keras_mask``) into ``<name>_mask`` arguments.

        Keras would give a lone tensor argument's padding mask to ``mask``, the attention mask.
        """
        if all(_padding_mask(value) is None for value in (*args, *kwargs.values())):
            return kwargs  # the common case, decided without binding the arguments
        try:
            bound = self._call_signature.bind_partial(*args, **kwargs).arguments
        except TypeError:
            return kwargs  # Keras raises its own error for a call that does not bind
        found = {f"{name}_mask": _padding_mask(bound.get(name)) for name in self.sequences}
        return {**kwargs, **{k: v for k, v in found.items() if v is not None and bound.get(k) is None}}

    def _forward(self, *args: Any, training: bool | None = None, **kwargs: Any) -> Any:
        """The generic ``call``: the declared call, ``training`` and the padding masks."""
        training = checks.check_mode_flag("training", training)
        paddings = {name: kwargs.pop(f"{name}_mask", None) for name in self.sequences}
        prepared = self.prepare(self._ops, self.compute_dtype, self.bind_call(args, kwargs))
        for dim, size in prepared.dims.items():
            checks.check_built_size(self.sizes[dim].argument, size, self._dims.get(dim))
        arguments = prepared.arguments
        if any(pad is not None for pad in paddings.values()):
            arguments.update(self.padding_masks(self._ops, arguments, paddings))
        need = self.needs_attention(prepared.return_attention)
        tensors = {name: variable.value for name, variable in self._params.items()}
        rate = getattr(self, "dropout", 0.0) if training else 0.0
        if need == attention.ON_READ and not rate and _in_jax_trace(arguments):
            return self._pooled_in_trace(tensors, arguments, prepared.return_attention)
        run = D.Run(self._ops, tensors, self._constants, rate, need)
        returned, kept = self.finish(self.compute(run, **arguments), need,
                                     prepared.return_attention)
        if self.attention_kind:
            self._attention_kept = kept
        return returned

    def _pooled_in_trace(self, tensors: Mapping[str, Any], arguments: Mapping[str, Any],
                         return_attention: Any) -> Any:
        """A call without dropout in a JAX trace, its weights kept but not returned.

        The core forms kept weights in a traced program (they cannot wait for a read after
        it), which takes the direct path; JAX traces Python, so here the call pools on its
        fast path and keeps a second, weight-forming pass, run only if the weights are read in
        the same trace (unread, it never enters the program).
        """
        run = D.Run(self._ops, tensors, self._constants, 0.0, False)
        returned, _ = self.finish(self.compute(run, **arguments), False, return_attention)

        def form() -> Any:
            again = D.Run(self._ops, tensors, self._constants, 0.0, True)
            return self.finish(self.compute(again, **arguments), True, False)[1]

        self._attention_kept = attention.WeightsOnRead(form)
        return returned

    def _build(self, *args: Any, **kwargs: Any) -> None:
        """The generic ``build(<input>_shape, ...)``: the weights for those input sizes."""
        shapes = inspect.signature(type(self).build).bind(self, *args, **kwargs).arguments
        dims = {dim: shapes[f"{s.argument}_shape"][-1] for dim, s in self.sizes.items()}
        if unknown := list(dict.fromkeys(self.sizes[d].argument for d, size in dims.items() if size is None)):
            names = " and ".join([", ".join(unknown[:-1]), unknown[-1]] if unknown[1:] else unknown)
            raise ValueError(f"{type(self).__name__}: the last dimension of {names} must be known "
                             "to create the weights, got None")
        self._create({dim: int(size) for dim, size in dims.items()})

    def _create(self, dims: dict[str, int]) -> None:
        """Creates every weight for these input sizes, by its rule's Keras initializer."""
        spec = self.weight_shapes(**dims)
        for name, shape in spec.items():
            rule = W.init_rule(name, cast("tuple[int, ...]", shape))  # every size is known
            variable = self.add_weight(
                shape=shape, initializer=_INITIALIZERS[rule.kind](rule),
                dtype=self.variable_dtype, name=name,
            )
            if _ON_TORCH:  # Keras on torch: a path any model can key torch parameters by
                variable._path = _torch_key(variable)
            self._params[name] = variable
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
        """Keras' config: its own entries and the declared arguments.

        ``context_parallel`` is written as its engine's plain values.
        """
        config = {**keras.layers.Layer.get_config(self), **self.arguments()}
        split = config.get("context_parallel")
        if split is not None:
            if not callable(getattr(split, "config", None)):
                raise ValueError(f"context_parallel: a {type(split).__name__} gives no config() "
                                 "of plain values, so the layer's config cannot hold it")
            config["context_parallel"] = split.config()
        return config

    @property
    def canonical_variables(self) -> dict[str, keras.Variable]:
        """The Keras variables by canonical name (e.g. for ``tf.GradientTape``)."""
        return dict(self._params)

    def get_weights(self) -> dict[str, np.ndarray]:
        """A copy of the weights by canonical name (Keras' list: :meth:`get_weight_list`)."""
        if not self.built:
            raise checks.not_built(type(self).__name__)
        return {name: np.array(keras.ops.convert_to_numpy(variable.value))
                for name, variable in self._params.items()}

    def set_weights(self, weights: Mapping[str, Any]) -> None:
        """Sets every weight from a canonical mapping (not Keras' list), all checked first."""
        dtype = keras.backend.standardize_dtype(self.variable_dtype)
        checked = W.check_weights(self.spec(), weights, dtype=dtype)
        ops = backend_ops()
        staged = {name: keras.ops.cast(ops.from_numpy(value), dtype) for name, value in checked.items()}
        fresh = not self.built
        if fresh:
            dims = self.dims_from_weights(checked)
            self.build(**{f"{s.argument}_shape": (None, None, dims[d]) for d, s in self.sizes.items()})
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
        """The first input's padding mask (``previous_mask`` may be the attention mask)."""
        return _padding_mask(inputs)


def _padding_mask(value: Any) -> Any:
    """The padding mask Keras attached to a tensor (``_keras_mask``), or None.

    An attribute on TensorFlow and torch tensors; JAX arrays take no attributes, so Keras keeps
    theirs in a table read by ``keras.src.backend.get_keras_mask`` (no public name in Keras 3).
    """
    if value is None or isinstance(value, (int, float, bool, str, list, tuple)):
        return None
    return _get_keras_mask(value)


def _unknown_sizes(inputs: Any) -> bool:
    """Whether a symbolic input has an unknown size other than its batch (its first)."""
    return any(isinstance(x, keras.KerasTensor) and None in x.shape[1:]
               for x in keras.tree.flatten(inputs))


def _standing_at(inputs: Any, size: int) -> Any:
    """The symbolic inputs with each unknown size but the batch's made ``size``."""
    def stand(x: Any) -> Any:
        if not isinstance(x, keras.KerasTensor):
            return x
        shape = (x.shape[0], *(size if d is None else d for d in x.shape[1:])) if x.shape else x.shape
        return keras.KerasTensor(shape, dtype=x.dtype, sparse=x.sparse)
    return keras.tree.map_structure(stand, inputs)


def _unknown_where_unequal(one: Any, two: Any) -> Any:
    """The spec of two stand-in calls' outputs: a size that differs between them is unknown."""
    if not isinstance(one, keras.KerasTensor):
        return one
    shape = tuple(a if a == b else None for a, b in zip(one.shape, two.shape, strict=True))
    return keras.KerasTensor(shape, dtype=one.dtype, sparse=one.sparse)


def _rounded(table: np.ndarray, dtype: str) -> Any:
    """A float64 table rounded once to ``dtype`` on the host, as the backend's tensor."""
    name = keras.backend.standardize_dtype(dtype)
    host = np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)
    return keras.ops.convert_to_tensor(np.asarray(table).astype(host), dtype=name)


class _Signed:
    """A generic method showing Keras (``inspect.signature``) a layer class's own parameters.

    Not a function with ``__signature__``: Keras' ``functools.wraps`` of ``build`` would copy it.
    """

    def __init__(self, method: Any, parameters: list[inspect.Parameter]) -> None:
        self.method, self.__name__, self.__doc__ = method, method.__name__, method.__doc__
        self.parameters = [_P("self", _P.POSITIONAL_OR_KEYWORD), *parameters]

    __signature__ = property(lambda self: inspect.Signature(self.parameters))

    def __get__(self, layer: Any, owner: Any = None) -> Any:
        return self if layer is None else types.MethodType(self, layer)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.method(*args, **kwargs)


def _unwrap_call_error(err: BaseException) -> BaseException:
    """The exception ``call()`` raised, not Keras' copy with the call's arguments around it.

    Keras marks its copy ``_keras_call_info_injected``; the arguments become a note.
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
