"""NumPy layers: every declared layer (:mod:`attention_core.declarations`) over NumPy arrays.

They are inference-first (``training=False`` by default, so dropout is off) and seeded:
``seed=`` fixes the initial weights and the dropout draws. Input sizes are inferred on the
first call, or from the mapping given to ``set_weights``. A call that raises changes nothing:
weights made for a first call are kept only once it succeeded.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from attention_core import checks
from attention_core import declarations as D
from attention_core import weights as W
from attention_core.ops import FLOAT_DTYPES
from backends.numpy.ops import OPS, NumpyOps


@dataclass(eq=False)
class NumpyArguments:
    """The NumPy layers' own constructor arguments, after the declared ones.

    Args:
        seed: Seed of the initial weights and of dropout; fresh entropy when None.
        dtype: NumPy dtype of the weights.
    """

    _: KW_ONLY
    seed: int | None = None
    dtype: str = "float32"


@D.dataclass_transform()
class Layer(NumpyArguments, D.KeptAttention, D.Declaration):
    """Holds a declared layer's weights as NumPy arrays and calls its forward.

    Attributes:
        attention_weights: The last call's attention weights ``(B, H, Q, K)``, before dropout
            (a list, one per block, for the encoder); None when not formed.
    """

    extras = D.keyword_parameters(NumpyArguments)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Gives a layer class a ``__call__`` that shows its call signature (for ``help()``)."""
        super().__init_subclass__(**kwargs)
        if cls.declared_or_none():
            training = inspect.Parameter("training", inspect.Parameter.KEYWORD_ONLY, default=False,
                                         annotation=bool)
            cls.__call__ = D.with_call_signature(  # type: ignore[method-assign]
                cls, Layer.__call__, "__call__", training)

    if not TYPE_CHECKING:  # type checkers see the declared signature (dataclass_transform)

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._setup(args, kwargs)

    def _setup(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        declared, extras = self.bind_arguments(args, kwargs, *self.extras)
        if extras["dtype"] not in FLOAT_DTYPES:
            raise ValueError(
                f"dtype must be one of {', '.join(FLOAT_DTYPES)}, got {extras['dtype']!r}"
            )
        vars(self).update(declared, **extras)
        self.check()
        self._ops = NumpyOps(np.random.default_rng(self.seed))
        self._dims: dict[str, int] = {}
        self._weights: dict[str, np.ndarray] | None = None
        self._constants = self.constants(self.dtype)
        self._attention_kept = self.finish(None, False, False)[1]
        if None not in {d for shape in self.weight_shapes().values() for d in shape}:
            self._weights = self._current()

    def spec(self) -> W.Spec:
        """Canonical names and shapes of this layer's weights (None = not known yet)."""
        return self.weight_shapes(**self._dims)

    @property
    def built(self) -> bool:
        """Whether every weight shape is known and the weights exist."""
        return self._weights is not None or not self.spec()

    def __getattr__(self, name: str) -> Any:
        """A held table by its name (``P``): a constant, or a weight of that name."""
        found = {**vars(self).get("_constants", {}), **(vars(self).get("_weights") or {})}
        if name in found:
            return found[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _current(self, **dims: int) -> dict[str, np.ndarray]:
        """The weights for inputs of these sizes: the held ones (checked), or new ones.

        New weights are not stored here: :meth:`__call__` keeps them once the call succeeded.
        """
        if self._weights is not None:
            for name, size in dims.items():
                checks.check_built_size(self.sizes[name].argument, size, self._dims.get(name))
            return self._weights
        return W.init_weights(self.weight_shapes(**dims), self._ops.rng, self.dtype)

    def __call__(self, *args: Any, training: bool = False, **kwargs: Any) -> Any:
        training = checks.check_flag("training", training)
        prepared = self.prepare(self._ops, self.dtype, self.bind_call(args, kwargs))
        weights = self._current(**prepared.dims)
        need = self.needs_attention(prepared.return_attention)
        rate = getattr(self, "dropout", 0.0) if training else 0.0
        run = D.Run(self._ops, weights, self._constants, rate, need)
        returned, kept = self.finish(self.compute(run, **prepared.arguments), need,
                                     prepared.return_attention)
        if self._weights is None:
            self._dims.update(prepared.dims)
            self._weights = weights
        if self.attention_kind:
            self._attention_kept = kept
        return returned

    def get_weights(self) -> dict[str, np.ndarray]:
        """Returns a copy of the weights in the canonical layout (the Weights page)."""
        if not self.built:
            raise checks.not_built(type(self).__name__)
        return {name: value.copy() for name, value in (self._weights or {}).items()}

    def set_weights(self, weights: Mapping[str, Any]) -> None:
        """Sets every weight from a canonical mapping; checks all names and shapes first.

        Values of any real float dtype are converted to the layer's dtype; every value is
        checked and converted before the layer changes.
        """
        checked = W.check_weights(self.spec(), weights, dtype=np.dtype(self.dtype).name)
        staged = {name: OPS.from_numpy(value) for name, value in checked.items()}  # new arrays
        self._dims.update(self.dims_from_weights(staged))
        self._weights = staged

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
