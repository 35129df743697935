"""Flax NNX modules: every declared layer (:mod:`attention_core.declarations`) as an ``nnx.Module``.

The same classes, constructor arguments and canonical weights as the linen layers of
:mod:`backends.jax.layers`, held the NNX way: a module is an object with its own state, made
eagerly from an ``nnx.Rngs``, called directly, and transformed by ``nnx.jit``, ``nnx.grad``,
``nnx.split`` / ``nnx.merge`` and ``nnx.Optimizer``::

    from flax import nnx
    from backends.jax.nnx import MultiHeadAttention

    layer = MultiHeadAttention(100, 5, dropout=0.1, q_in=64, rngs=nnx.Rngs(0))
    Y = layer(Q, K, V, valid_lens)          # dropout on: NNX modules start in training mode
    layer.eval()                            # dropout off (``layer.train()`` turns it back on)

Design:

- **Parameters.** One ``nnx.Param`` per canonical weight, nested like linen's params tree: an
  attribute per first part of the canonical names, holding dicts by the rest (``layer.W_q``
  is ``{"kernel": Param, "bias": Param}``, ``encoder.blks`` is ``{"0": {"attention": ...}}``;
  a one-part name such as ``P``, ``w`` or ``sink_logits`` is a ``Param`` attribute). So ``nnx.state(layer,
  nnx.Param)`` reads like linen's params and its paths joined with dots are the canonical
  names; :meth:`Layer.get_weights` is exactly the canonical mapping. Initial values follow
  :func:`attention_core.weights.init_rule`, each drawn from ``rngs.params()``.
- **Input sizes.** Eager parameters need the widths of the inputs that reach a kernel at
  construction: the declared sizes are keyword arguments (``q_in``, ``k_in``, ``v_in`` for the
  attention layers, ``d_in`` for :class:`PositionWiseFFN`), as on the torch layers. A size not
  given is the layer's ``num_hiddens`` (the width of a residual stream); a layer without
  ``num_hiddens`` (:class:`PositionWiseFFN`) needs it given. A call whose input width differs
  raises the message of every backend (:func:`attention_core.checks.check_built_size`).
- **Randomness.** ``rngs`` draws the weights (``params`` stream) and is needed when there are
  weights; a layer with ``dropout > 0`` keeps a fork of its ``dropout`` stream, as
  ``nnx.Dropout`` does (a call may pass ``rngs=`` instead).
- **Training mode.** The attribute ``deterministic`` (False when made, as ``nnx.Dropout``),
  set by ``model.train()`` / ``model.eval()`` and ``nnx.view``. A call may override it with
  ``deterministic=``, or with the library-wide ``training=`` (``training=True`` is
  ``deterministic=False``); giving both raises unless they agree. Dropout needs
  ``deterministic`` False and a rate above 0.
- **dtypes.** ``param_dtype`` (default float32) holds the parameters; ``dtype`` is the compute
  dtype, None for ``param_dtype`` (inputs of a layer with weights are cast to it, as the linen
  layers cast them; a layer without weights computes in its inputs' dtype).
- **Attention weights** (before dropout) are sown as ``nnx.Intermediate`` named
  ``attention_weights`` (one entry per block for :class:`TransformerEncoder`, one per call for
  the decoder layers' nested lists), formed only when an ``nnx.capture`` of ``nnx.Intermediate``
  collects them and the layer keeps them (``keep_attention_weights``); otherwise calls pool
  on their fast path. ``return_attention=True`` returns them too.
- **Constants** (the sinusoidal ``P``) are not state: made once per arguments on the host
  (float64, rounded to the compute dtype), read as the attribute ``P``; so they never enter
  ``nnx.state``, an optimizer, or a checkpoint, and ``nnx.split`` / ``merge`` / ``jit`` keep
  them by construction.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import DTypeLike

from attention_core import checks, conventions
from attention_core import declarations as D
from attention_core import weights as W
from backends.jax.conventions import FLAX
from backends.jax.ops import OPS, JaxOps, floats_on_device
from backends.jax.parallel import context_parallel
from backends.jax.params import SAMPLERS, constants, nest


@dataclass(eq=False)
class NnxArguments:
    """The NNX modules' own constructor arguments, after the declared ones.

    Args:
        q_in: Queries' width (layers with a query projection); None for ``num_hiddens``.
        k_in: Keys' width, likewise.
        v_in: Values' width, likewise.
        d_in: The input's width (:class:`PositionWiseFFN`); must be given.
        param_dtype: Dtype of the parameters.
        dtype: Compute dtype; None for ``param_dtype``.
        deterministic: No dropout (``model.eval()`` sets it, ``model.train()`` clears it).
        rngs: Draws the weights (its ``params`` stream) and the dropout masks (a fork of its
            ``dropout`` stream); needed by a layer with weights.
    """

    _: KW_ONLY
    q_in: int | None = None
    k_in: int | None = None
    v_in: int | None = None
    d_in: int | None = None
    param_dtype: DTypeLike = jnp.float32
    dtype: DTypeLike | None = None
    deterministic: bool = False
    rngs: nnx.Rngs | None = None


def _capturing(module: nnx.Module) -> bool:
    """Whether an ``nnx.capture`` of ``nnx.Intermediate`` collects what ``module`` sows now.

    The test ``Module.sow`` makes: the capture gives each module a ``__captures__`` tuple.
    """
    return any(type(v) is nnx.Intermediate for v in vars(module).get("__captures__", ()))


@D.dataclass_transform()
class Layer(D.Declaration, nnx.Module):
    """Holds a declared layer's weights as ``nnx.Param`` and calls its forward."""

    convention = FLAX  # Flax's call keywords too (inputs_q ..., backends.jax.conventions)
    context_parallel_reader = staticmethod(context_parallel)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        own = {p.name: p for p in D.keyword_parameters(NnxArguments)}
        cls.extras = tuple(own[name] for name in
                           (*cls.sizes, "param_dtype", "dtype", "deterministic", "rngs"))
        super().__init_subclass__(**kwargs)

    if not TYPE_CHECKING:  # type checkers see the declared signature (dataclass_transform)

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._setup(args, kwargs)

    def _setup(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        declared, extras = self.bind_arguments(args, kwargs, *self.extras)
        for name, value in declared.items():
            setattr(self, name, value)
        self.check()
        rngs = extras.pop("rngs")
        if rngs is not None and not isinstance(rngs, nnx.Rngs):
            raise TypeError(f"rngs must be an nnx.Rngs, got {type(rngs).__name__}")
        self.param_dtype = np.dtype(extras.pop("param_dtype")).name
        dtype = extras.pop("dtype")
        self.dtype = None if dtype is None else np.dtype(dtype).name
        self.deterministic = bool(extras.pop("deterministic"))
        dims = {dim: self._size(dim, extras[dim]) for dim in self.sizes}
        spec = self.weight_shapes(**dims)
        if spec and rngs is None:
            raise TypeError(f"{type(self).__name__} draws its weights from rngs: pass "
                            "rngs=nnx.Rngs(0) (or another seed)")
        drawn = {}
        for name, shape in spec.items():
            sizes = tuple(int(d) for d in shape if d is not None)
            rule = W.init_rule(name, sizes)
            assert rngs is not None
            value = SAMPLERS[rule.kind](rngs.params(), rule, sizes, self.param_dtype)
            drawn[name] = nnx.Param(value)
        for group, value in nest(drawn).items():
            if hasattr(type(self), group):
                raise TypeError(f"weight group {group!r} of {type(self).__name__} would hide "
                                "an attribute of the module")
            setattr(self, group, value if isinstance(value, nnx.Param) else nnx.data(value))
        self.dims = dims
        rate = float(getattr(self, "dropout", 0.0))
        self.rngs = rngs.dropout.fork() if rate > 0 and rngs is not None else nnx.data(None)

    def _size(self, dim: str, given: int | None) -> int:
        """An input size: given, or ``num_hiddens`` (see the module's docstring)."""
        if given is not None:
            return checks.check_positive_int(dim, given)
        if "num_hiddens" not in self.argument_names():
            raise TypeError(f"{type(self).__name__} needs the width of "
                            f"{self.sizes[dim].argument}: pass {dim}=")
        return int(getattr(self, "num_hiddens"))  # noqa: B009 - not every declaration has it

    def spec(self) -> W.Spec:
        """Canonical names and shapes of this layer's weights."""
        return self.weight_shapes(**self.dims)

    def _compute_dtype(self) -> str:
        return self.dtype or self.param_dtype

    def __getattr__(self, name: str) -> Any:
        """A fixed table by its name (``P``), in the compute dtype: not state."""
        if not name.startswith("_") and "dims" in vars(self):
            tables = self._tables()
            if name in tables:
                return tables[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _tables(self) -> dict[str, jax.Array]:
        """The fixed tables (:meth:`constants`), made once per arguments, in the compute dtype."""
        arguments = tuple(self.arguments().items())
        tables = constants(self.declared().__name__, arguments)
        return {name: jnp.asarray(t, self._compute_dtype()) for name, t in tables.items()}

    def _params(self) -> dict[str, nnx.Param[Any]]:
        """The parameters by canonical name, in the declared order."""
        state = nnx.to_flat_state(nnx.state(self, nnx.Param))
        found = {".".join(str(p) for p in path): var for path, var in state}
        return {name: found[name] for name in self.spec()}

    def set_view(self, deterministic: bool | None = None) -> None:
        """Sets ``deterministic`` (what ``nnx.view(model, deterministic=...)`` calls)."""
        if deterministic is not None:
            self.deterministic = deterministic

    def __call__(self, *args: Any, deterministic: bool | None = None,
                 training: bool | None = None, rngs: nnx.Rngs | jax.Array | None = None,
                 **kwargs: Any) -> Any:
        """Calls the declared forward (see the layer's ``compute`` for its arguments).

        Args:
            *args: The declared call's arguments.
            deterministic: No dropout in this call; None for the attribute.
            training: Dropout in this call (``not deterministic``); None for the attribute.
            rngs: Draws this call's dropout masks (an ``nnx.Rngs`` or a key), instead of
                the layer's own stream.
            **kwargs: The declared call's keyword arguments.
        """
        bound = floats_on_device(self.bind_call(args, kwargs))
        off = self._deterministic(deterministic, training)
        prepared = self.prepare(OPS, self._compute_dtype(), bound)
        for dim, size in prepared.dims.items():
            checks.check_built_size(self.sizes[dim].argument, size, self.dims[dim])
        keeping = _capturing(self)
        need = self.needs_attention(prepared.return_attention, keeping, on_read=False)
        rate = 0.0 if off else float(getattr(self, "dropout", 0.0))
        dtype = self._compute_dtype()
        weights = {name: OPS.astype(p[...], dtype) for name, p in self._params().items()}
        stream = self.rngs if rate > 0 and rngs is None else None
        count = None if stream is None else stream.count[...]
        ops = JaxOps(rng=self._dropout_key(rngs)) if rate > 0 else OPS
        try:
            run = D.Run(ops, W.CheckedWeights(weights), self._tables(), rate, need)
            returned, kept = self.finish(self.compute(run, **prepared.arguments), need,
                                         prepared.return_attention)
        except BaseException:
            if stream is not None:  # the stream's count goes back: the call changed nothing
                stream.count[...] = count
            raise
        if need and keeping:
            for entry in (kept,) if self.attention_kind == "nested" else D.leaves(kept):
                self.sow(nnx.Intermediate, "attention_weights", entry)
        return returned

    def _deterministic(self, deterministic: bool | None, training: bool | None) -> bool:
        """Whether a call runs without dropout (see the module's docstring)."""
        if deterministic is None and training is None:
            return bool(self.deterministic)
        deterministic = checks.check_mode_flag("deterministic", deterministic)
        return not conventions.training_mode(
            training, None if deterministic is None else not deterministic)

    def _dropout_key(self, rngs: nnx.Rngs | jax.Array | None) -> jax.Array:
        """This call's dropout key: from ``rngs`` if given, else the layer's stream."""
        if isinstance(rngs, nnx.Rngs):
            return rngs.dropout()
        if rngs is not None:
            return rngs
        if self.rngs is None:
            raise ValueError(f"{type(self).__name__} has dropout but no rngs to draw it from: "
                             "construct it with rngs=nnx.Rngs(...), pass rngs= to the call, or "
                             "call .eval()")
        key: jax.Array = self.rngs()
        return key

    def get_weights(self) -> dict[str, np.ndarray]:
        """A copy of the weights in the canonical layout (the Weights page)."""
        return {name: np.array(p[...]) for name, p in self._params().items()}

    def set_weights(self, weights: Mapping[str, Any]) -> None:
        """Sets every weight from a canonical mapping; all names and shapes checked first.

        Values may be arrays of any framework, cast to the parameters' dtype; nothing is
        written unless every one is right.
        """
        params = self._params()
        dtypes = {name: OPS.dtype_name(p[...]) for name, p in params.items()}
        checked = W.check_weights(self.spec(), weights, dtype=dtypes)
        staged = {name: OPS.from_numpy(value, like=params[name][...])
                  for name, value in checked.items()}
        for name, value in staged.items():
            params[name][...] = value



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
