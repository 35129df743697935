"""NumPy layers: plain classes holding canonical NumPy weights and calling the core.

They are inference-first (``training=False`` by default, so dropout is off) and seeded:
``seed=`` fixes the initial weights and the dropout draws. Input sizes are inferred on the
first call, or from the mapping given to ``set_weights``. A call that raises changes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from attention_core import attention, checks, multihead, positional, transformer
from attention_core import weights as W
from attention_core.host import PlainArguments
from attention_core.ops import FLOAT_DTYPES
from backends.numpy.ops import OPS, NumpyOps


class Layer(PlainArguments):
    """Base of the NumPy layers.

    Args:
        dropout: Dropout rate, used only when called with ``training=True``.
        seed: Seed of the initial weights and of dropout; fresh entropy when None.
        dtype: NumPy dtype of the weights.

    Attributes:
        attention_weights: The last call's attention weights ``(B, H, Q, K)``, before dropout
            (attention layers only).
    """

    def __init__(self, dropout: float = 0.0, *, seed: int | None = None, dtype: str = "float32"):
        self.dropout = checks.check_dropout(dropout)
        if dtype not in FLOAT_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(FLOAT_DTYPES)}, got {dtype!r}")
        self.dtype = dtype
        self._rng = np.random.default_rng(seed)
        self._ops = NumpyOps(self._rng)
        self._dims: dict[str, int | None] = {}
        self._weights: dict[str, np.ndarray] | None = None
        self.attention_weights: np.ndarray | None = None

    def spec(self) -> W.Spec:
        """Canonical names and shapes of this layer's weights (None = not known yet)."""
        return {}

    @property
    def built(self) -> bool:
        """Whether every weight shape is known and the weights exist."""
        return self._weights is not None or not self.spec()

    def _current(self, **dims: int) -> dict[str, np.ndarray]:
        """The weights to use for inputs of the given sizes, creating them if needed.

        Nothing is stored here: :meth:`_commit` stores new weights once the call succeeded.
        """
        if self._weights is not None:
            for name, size in dims.items():
                checks.check_built_size(W.INPUT_ARGS[name], size, self._dims[name])
            return self._weights
        saved, self._dims = self._dims, {**self._dims, **dims}
        try:
            spec = self.spec()
        finally:
            self._dims = saved
        return W.init_weights(spec, self._rng, self.dtype)

    def _commit(self, weights: dict[str, np.ndarray]) -> None:
        """Keeps weights created by :meth:`_current` after the call that needed them succeeded."""
        if self._weights is None:
            self._dims.update(W.dims_from_weights(weights))
            self._weights = weights

    def get_weights(self) -> dict[str, np.ndarray]:
        """Returns a copy of the weights in the canonical layout (DESIGN section 5)."""
        if not self.built:
            raise checks.not_built(type(self).__name__)
        return {name: value.copy() for name, value in (self._weights or {}).items()}

    def set_weights(self, weights: Mapping[str, Any]) -> None:
        """Sets every weight from a canonical mapping; checks all names and shapes first.

        Values of any real float dtype are converted to the layer's dtype; every value is
        checked and converted before the layer changes.
        """
        checked = W.check_weights(self.spec(), weights, dtype=np.dtype(self.dtype).name)
        staged = {name: OPS.from_numpy(value).copy() for name, value in checked.items()}
        self._dims.update(W.dims_from_weights(staged))
        self._weights = staged

    def _rate(self, training: bool) -> float:
        return self.dropout if training else 0.0

    def _inputs(self, **inputs: Any) -> list[Any]:
        """The inputs in the layer's dtype if it has weights, else as given.

        The dtype rule of :func:`attention_core.checks.compute_inputs`.
        """
        return checks.compute_inputs(self._ops, self.dtype if self.spec() else None, **inputs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(dropout={self.dropout})"


class _Attention(Layer):
    """Shared call of the attention layers: check, create weights if needed, attend, keep.

    Args:
        dropout: Dropout rate on the attention weights in training.
        keep_attention_weights: Keep each call's weights in ``attention_weights`` (the
            default, as DESIGN section 3 asks). When False, calls without ``return_attention``
            never form the weights, so the core may pool blockwise (see
            :func:`attention_core.attention.choose_implementation`); ``attention_weights`` is
            then None.
        **kwargs: ``seed``, ``dtype``.
    """

    #: How the core pools when the weights are not needed (None = its automatic rule).
    implementation: str | None = None

    def __init__(self, dropout: float = 0.0, *, keep_attention_weights: bool = True, **kwargs: Any):
        super().__init__(dropout, **kwargs)
        self.keep_attention_weights = bool(keep_attention_weights)

    def __call__(
        self,
        queries: np.ndarray,
        keys: np.ndarray,
        values: np.ndarray,
        valid_lens: Any = None,
        *,
        mask: Any = None,
        causal: bool = False,
        return_attention: bool = False,
        training: bool = False,
    ) -> Any:
        queries, keys, values = self._inputs(queries=queries, keys=keys, values=values)
        attention.check_projected_inputs(self._ops, queries, keys, values)
        weights = self._current(**self._input_sizes(queries, keys, values))
        need = return_attention or self.keep_attention_weights
        pooling = {} if self.implementation is None else {"implementation": self.implementation}
        result = self._attend(
            weights, queries, keys, values, valid_lens, mask=mask, causal=causal,
            dropout=self._rate(training), return_weights=need, ops=self._ops, **pooling,
        )
        out, attn = result if need else (result, None)
        self._commit(weights)
        self.attention_weights = attn
        return (out, attn) if return_attention else out

    def _input_sizes(self, queries: Any, keys: Any, values: Any) -> dict[str, int]:
        return {}

    def _attend(self, weights: dict[str, np.ndarray], *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


class DotProductAttention(_Attention):
    """Scaled dot-product attention (no weights).

    Args:
        dropout: Dropout rate on the attention weights in training.
        keep_attention_weights: See :class:`_Attention`.
        implementation: ``"direct"``, ``"blockwise"`` or ``"fused"`` for calls that do not
            need the weights; None (default) lets the core choose.
        **kwargs: ``seed``, ``dtype``.
    """

    def __init__(
        self, dropout: float = 0.0, *, keep_attention_weights: bool = True,
        implementation: str | None = None, **kwargs: Any,
    ):
        super().__init__(dropout, keep_attention_weights=keep_attention_weights, **kwargs)
        self.implementation = checks.check_implementation(implementation)

    def _attend(self, weights: dict[str, np.ndarray], *args: Any, **kwargs: Any) -> Any:
        return attention.dot_product_attention(*args, **kwargs)


class AdditiveAttention(_Attention):
    """Additive (Bahdanau) attention with hidden size ``num_hiddens``."""

    def __init__(self, num_hiddens: int, dropout: float = 0.0, **kwargs: Any):
        super().__init__(dropout, **kwargs)
        self.num_hiddens = checks.check_positive_int("num_hiddens", num_hiddens)

    def spec(self) -> W.Spec:
        return W.additive_spec(self.num_hiddens, self._dims.get("q_in"), self._dims.get("k_in"))

    def _input_sizes(self, queries: Any, keys: Any, values: Any) -> dict[str, int]:
        return {"q_in": queries.shape[-1], "k_in": keys.shape[-1]}

    def _attend(self, weights: dict[str, np.ndarray], *args: Any, **kwargs: Any) -> Any:
        q, k, v, valid_lens = args
        return attention.additive_attention(q, k, v, weights, valid_lens, **kwargs)


class MultiHeadAttention(_Attention):
    """Multi-head attention: ``num_heads`` heads over ``num_hiddens`` projected features.

    Args:
        num_hiddens: h, the width of the projections and of the output.
        num_heads: H; must divide ``num_hiddens``.
        dropout: Dropout rate on the attention weights in training.
        bias: Whether the four projections have biases.
        keep_attention_weights: See :class:`_Attention`.
        implementation: See :class:`DotProductAttention`.
        **kwargs: ``seed``, ``dtype``.
    """

    def __init__(
        self, num_hiddens: int, num_heads: int, dropout: float = 0.0, bias: bool = False, *,
        keep_attention_weights: bool = True, implementation: str | None = None, **kwargs: Any,
    ):
        checks.check_heads(num_hiddens, num_heads)
        self.implementation = checks.check_implementation(implementation)
        super().__init__(dropout, keep_attention_weights=keep_attention_weights, **kwargs)
        self.num_hiddens, self.num_heads, self.bias = num_hiddens, num_heads, bool(bias)

    def spec(self) -> W.Spec:
        d = self._dims
        return W.multi_head_spec(
            self.num_hiddens, self.num_heads, self.bias, d.get("q_in"), d.get("k_in"), d.get("v_in")
        )

    def _input_sizes(self, queries: Any, keys: Any, values: Any) -> dict[str, int]:
        return {"q_in": queries.shape[-1], "k_in": keys.shape[-1], "v_in": values.shape[-1]}

    def _attend(self, weights: dict[str, np.ndarray], *args: Any, **kwargs: Any) -> Any:
        q, k, v, valid_lens = args
        return multihead.multi_head_attention(q, k, v, weights, self.num_heads, valid_lens, **kwargs)


class RelativeMultiHeadAttention(_Attention):
    """Multi-head attention with relative position representations (Shaw et al., 2018).

    Args:
        num_hiddens: h, the width of the projections and of the output.
        num_heads: H; must divide ``num_hiddens``.
        max_relative_position: m: offsets between a key and a query are clipped to [-m, m].
        dropout: Dropout rate on the attention weights in training.
        bias: Whether the four projections have biases.
        relative_values: Also add the offsets' vectors to the values (weight ``rel_v.embedding``).
        keep_attention_weights: Keep each call's weights in ``attention_weights``.
        **kwargs: ``seed``, ``dtype``.
    """

    def __init__(
        self, num_hiddens: int, num_heads: int, max_relative_position: int, dropout: float = 0.0,
        bias: bool = False, *, relative_values: bool = True, keep_attention_weights: bool = True,
        **kwargs: Any,
    ):
        W.relative_multi_head_spec(num_hiddens, num_heads, max_relative_position)  # validates
        super().__init__(dropout, keep_attention_weights=keep_attention_weights, **kwargs)
        self.num_hiddens, self.num_heads, self.bias = num_hiddens, num_heads, bool(bias)
        self.max_relative_position = max_relative_position
        self.relative_values = bool(relative_values)

    def spec(self) -> W.Spec:
        d = self._dims
        return W.relative_multi_head_spec(
            self.num_hiddens, self.num_heads, self.max_relative_position, self.bias,
            self.relative_values, d.get("q_in"), d.get("k_in"), d.get("v_in"),
        )

    def _input_sizes(self, queries: Any, keys: Any, values: Any) -> dict[str, int]:
        return {"q_in": queries.shape[-1], "k_in": keys.shape[-1], "v_in": values.shape[-1]}

    def _attend(self, weights: dict[str, np.ndarray], *args: Any, **kwargs: Any) -> Any:
        q, k, v, valid_lens = args
        return multihead.relative_multi_head_attention(
            q, k, v, weights, self.num_heads, valid_lens, **kwargs
        )


class PositionalEncoding(Layer):
    """Adds the sinusoidal table ``P`` (shape ``(1, max_len, num_hiddens)``) to the input."""

    def __init__(
        self, num_hiddens: int, dropout: float = 0.0, max_len: int = positional.DEFAULT_MAX_LEN,
        **kwargs: Any,
    ):
        super().__init__(dropout, **kwargs)
        self.num_hiddens, self.max_len = num_hiddens, max_len
        self.P = positional.sinusoidal_encoding(max_len, num_hiddens, self.dtype)[None]

    def __call__(self, X: np.ndarray, *, training: bool = False) -> np.ndarray:
        (X,) = self._inputs(X=X)
        return positional.add_positions(X, self.P, self._rate(training), ops=self._ops)


class LearnedPositionalEncoding(Layer):
    """Adds a learned table ``P`` (shape ``(1, max_len, num_hiddens)``) to the input."""

    def __init__(
        self, num_hiddens: int, dropout: float = 0.0, max_len: int = 1000, **kwargs: Any
    ):
        super().__init__(dropout, **kwargs)
        self.num_hiddens, self.max_len = num_hiddens, max_len
        self._weights = W.init_weights(self.spec(), self._rng, self.dtype)

    def spec(self) -> W.Spec:
        return W.learned_positional_spec(self.num_hiddens, self.max_len)

    @property
    def P(self) -> np.ndarray:  # noqa: N802 - the name the source chapter uses
        """The learned table, ``(1, max_len, num_hiddens)``."""
        assert self._weights is not None
        return self._weights["P"]

    def __call__(self, X: np.ndarray, *, training: bool = False) -> np.ndarray:
        (X,) = self._inputs(X=X)
        return positional.add_positions(X, self.P, self._rate(training), ops=self._ops)


class PositionWiseFFN(Layer):
    """Two dense layers with a ReLU between, applied at every position."""

    def __init__(self, ffn_num_hiddens: int, ffn_num_outputs: int, **kwargs: Any):
        super().__init__(0.0, **kwargs)
        self.ffn_num_hiddens, self.ffn_num_outputs = ffn_num_hiddens, ffn_num_outputs
        self.spec()  # validates the sizes

    def spec(self) -> W.Spec:
        return W.ffn_spec(self.ffn_num_hiddens, self.ffn_num_outputs, self._dims.get("d_in"))

    def __call__(self, X: np.ndarray) -> np.ndarray:
        (X,) = self._inputs(X=X)
        checks.check_rank(self._ops, "X", X, (3,), "(B, T, d)")
        weights = self._current(d_in=X.shape[-1])
        out = transformer.position_wise_ffn(X, weights, ops=self._ops)
        self._commit(weights)
        return out


class AddNorm(Layer):
    """Residual connection followed by layer normalisation over the last axis (eps 1e-5)."""

    def __init__(self, num_hiddens: int, dropout: float = 0.0, **kwargs: Any):
        super().__init__(dropout, **kwargs)
        self.num_hiddens = num_hiddens
        self._weights = W.init_weights(self.spec(), self._rng, self.dtype)

    def spec(self) -> W.Spec:
        return W.add_norm_spec(self.num_hiddens)

    def __call__(self, X: np.ndarray, Y: np.ndarray, *, training: bool = False) -> np.ndarray:
        X, Y = self._inputs(X=X, Y=Y)
        checks.check_last_dim(self._ops, "X", X, self.num_hiddens)
        assert self._weights is not None
        return transformer.add_norm(X, Y, self._weights, self._rate(training), ops=self._ops)


class TransformerEncoderBlock(Layer):
    """Self-attention and a position-wise FFN, each wrapped in add & norm.

    Args:
        num_hiddens: h, the model width.
        ffn_num_hiddens: Width of the FFN's hidden layer.
        num_heads: H; must divide ``num_hiddens``.
        dropout: Dropout rate of the attention weights and both residual branches, in training.
        bias: Whether the attention projections have biases.
        keep_attention_weights: Keep each call's self-attention weights in
            ``attention_weights``; False lets the core pool without forming them.
        implementation: See :class:`DotProductAttention`.
        **kwargs: ``seed``, ``dtype``.
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
    ):
        self.implementation = checks.check_implementation(implementation)
        super().__init__(dropout, **kwargs)
        self.keep_attention_weights = bool(keep_attention_weights)
        self.num_hiddens, self.ffn_num_hiddens = num_hiddens, ffn_num_hiddens
        self.num_heads, self.bias = num_heads, bool(bias)
        self._weights = W.init_weights(self.spec(), self._rng, self.dtype)

    def spec(self) -> W.Spec:
        return W.encoder_block_spec(
            self.num_hiddens, self.ffn_num_hiddens, self.num_heads, self.bias
        )

    def __call__(
        self, X: np.ndarray, valid_lens: Any = None, *, mask: Any = None, training: bool = False
    ) -> np.ndarray:
        (X,) = self._inputs(X=X)
        checks.check_rank(self._ops, "X", X, (3,), "(B, T, num_hiddens)")
        checks.check_last_dim(self._ops, "X", X, self.num_hiddens)
        assert self._weights is not None
        need = self.keep_attention_weights
        result: Any = transformer.transformer_encoder_block(
            X, self._weights, self.num_heads, valid_lens, mask=mask,
            dropout=self._rate(training), return_weights=need,
            implementation=self.implementation, ops=self._ops,
        )
        out, self.attention_weights = result if need else (result, None)
        return np.asarray(out)


class TransformerEncoder(Layer):
    """The Transformer encoder: scaled token embedding, sinusoidal encoding, ``num_blks`` blocks.

    Args:
        vocab_size: V, the number of token ids.
        num_hiddens: h, the model width.
        ffn_num_hiddens: Width of the blocks' FFN hidden layers.
        num_heads: H; must divide ``num_hiddens``.
        num_blks: Number of blocks.
        dropout: Dropout rate of the encoding's sum and inside every block, in training.
        bias: Whether the attention projections have biases.
        keep_attention_weights: Keep each block's self-attention weights, in
            ``attention_weights`` (a list, one ``(B, H, T, T)`` array per block).
        implementation: See :class:`DotProductAttention`.
        max_len: Rows of the sinusoidal table ``P`` ``(1, max_len, h)``, the longest sequence
            the encoder takes.
        **kwargs: ``seed``, ``dtype``.
    """

    def __init__(
        self, vocab_size: int, num_hiddens: int, ffn_num_hiddens: int, num_heads: int,
        num_blks: int, dropout: float = 0.0, bias: bool = False, *,
        keep_attention_weights: bool = True, implementation: str | None = None,
        max_len: int = positional.DEFAULT_MAX_LEN, **kwargs: Any,
    ):
        self.implementation = checks.check_implementation(implementation)
        super().__init__(dropout, **kwargs)
        self.keep_attention_weights = bool(keep_attention_weights)
        self.vocab_size, self.num_hiddens, self.ffn_num_hiddens = vocab_size, num_hiddens, ffn_num_hiddens
        self.num_heads, self.num_blks, self.bias = num_heads, num_blks, bool(bias)
        self._weights = W.init_weights(self.spec(), self._rng, self.dtype)
        self.attention_weights: list[np.ndarray | None] = [None] * num_blks  # type: ignore[assignment]
        self.max_len = max_len
        self.P = positional.sinusoidal_encoding(max_len, num_hiddens, self.dtype)[None]

    def spec(self) -> W.Spec:
        return W.transformer_encoder_spec(
            self.vocab_size, self.num_hiddens, self.ffn_num_hiddens, self.num_heads,
            self.num_blks, self.bias,
        )

    def __call__(
        self, tokens: np.ndarray, valid_lens: Any = None, *, mask: Any = None,
        training: bool = False,
    ) -> np.ndarray:
        assert self._weights is not None
        need = self.keep_attention_weights
        result: Any = transformer.transformer_encoder(
            tokens, self._weights, self.num_heads, valid_lens, mask=mask,
            dropout=self._rate(training), return_weights=need,
            implementation=self.implementation, positions=self.P, ops=self._ops,
        )
        out, weights = result if need else (result, [None] * self.num_blks)
        self.attention_weights = list(weights)
        return np.asarray(out)


class NadarayaWatson(Layer):
    """Nadaraya-Watson attention pooling with a Gaussian kernel.

    Args:
        parametric: Learn the kernel's inverse width ``w`` (weight ``w`` of shape ``(1,)``).
    """

    def __init__(self, parametric: bool = False, **kwargs: Any):
        super().__init__(0.0, **kwargs)
        self.parametric = bool(parametric)
        if self.parametric:
            self._weights = W.init_weights(self.spec(), self._rng, self.dtype)

    def spec(self) -> W.Spec:
        return W.nadaraya_watson_spec(self.parametric)

    def __call__(self, queries: np.ndarray, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
        queries, keys, values = self._inputs(queries=queries, keys=keys, values=values)
        w = self._weights["w"] if self._weights else None
        out, attn = attention.nadaraya_watson(
            queries, keys, values, w, return_weights=True, ops=self._ops
        )
        self.attention_weights = attn
        return out

    def __repr__(self) -> str:
        return f"NadarayaWatson(parametric={self.parametric})"
