"""PyTorch layers: ``torch.nn.Module``s that hold parameters and call the core.

Parameters are kept in the canonical layout of DESIGN section 5, kernels ``(in, out)``, in
submodules named like the canonical names (``W_q`` holds ``kernel`` and ``bias``). So
``state_dict()`` has exactly the keys and shapes of ``get_weights()``, weights move between
frameworks without a transpose, and the core's ``dense`` applies them as they are.

Input sizes are inferred on the first call, like ``torch.nn.LazyLinear``: a kernel whose input
size is unknown is a :class:`torch.nn.UninitializedParameter`, materialised in place (so a
parameter captured before the first call stays the one trained). They may also be given
(``q_in=`` etc.), or come from ``set_weights`` or ``load_state_dict`` before the first call.
A call that raises changes nothing: kernels it materialised are turned back into placeholders.

Dropout follows ``module.train()`` / ``module.eval()``. The attention layers keep the last
call's weights, before dropout, in ``attention_weights`` ``(B, H, Q, K)``; ``TransformerEncoder``
keeps a list of them, one ``(B, H, T, T)`` tensor per block. With
``keep_attention_weights=False`` (constructor argument or attribute), ``DotProductAttention``,
``MultiHeadAttention``, ``TransformerEncoderBlock`` and ``TransformerEncoder`` calls that do not
ask for the weights (``return_attention=False``) go through
``torch.nn.functional.scaled_dot_product_attention`` instead, never forming the ``(B, H, Q, K)``
weights, and ``attention_weights`` is then None (the encoder's: a list of None).
``RelativeMultiHeadAttention`` always forms them (its offsets' terms need them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import numpy as np
import torch
from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.parameter import Parameter, UninitializedParameter, is_lazy

from attention_core import attention, checks, multihead, positional, transformer
from attention_core import weights as W
from attention_core.host import PlainArguments
from backends.torch.ops import OPS, TorchOps

Tensor = torch.Tensor
T = TypeVar("T")


def _ops(x: Tensor) -> TorchOps:
    """Ops that create new arrays (``arange``, lengths given as lists) on ``x``'s device."""
    return TorchOps(x.device)


class Dense(LazyModuleMixin, nn.Module):
    """Holds a dense layer's ``kernel`` ``(in, out)`` and optional ``bias`` ``(out,)``.

    It is never called: the owning layer passes the parameters to the core, which applies
    them. An unknown input size makes ``kernel`` a :class:`~torch.nn.UninitializedParameter`
    that the owner materialises; :class:`~torch.nn.modules.lazy.LazyModuleMixin` lets
    ``state_dict`` / ``load_state_dict`` handle it meanwhile.

    Args:
        d_in: Input size, or None to learn it on the first call.
        d_out: Output size.
        bias: Whether there is a bias.
        device: Device of the parameters.
        dtype: Dtype of the parameters.
    """

    def __init__(
        self,
        d_in: int | None,
        d_out: int,
        bias: bool = False,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        self.d_out = d_out
        self.kernel = (
            UninitializedParameter(**factory)
            if d_in is None
            else Parameter(torch.empty(d_in, d_out, **factory))
        )
        self.bias = Parameter(torch.empty(d_out, **factory)) if bias else None

    @property
    def d_in(self) -> int | None:
        """The input size, None until known."""
        unknown = isinstance(self.kernel, UninitializedParameter)  # (not is_lazy: dynamo)
        return None if unknown else OPS.fixed_shape(self.kernel)[0]

    def materialize(self, d_in: int) -> None:
        """Gives the kernel its shape ``(d_in, d_out)``, in place (values uninitialised)."""
        assert isinstance(self.kernel, UninitializedParameter)
        self.kernel.materialize((d_in, self.d_out))

    def unmaterialize(self) -> None:
        """Turns the kernel back into a placeholder, in place: undoes :meth:`materialize`."""
        kernel = self.kernel
        kernel.grad = None
        kernel.data = torch.empty(0, device=kernel.device, dtype=kernel.dtype)
        kernel.__class__ = UninitializedParameter

    def extra_repr(self) -> str:
        return f"d_in={self.d_in}, d_out={self.d_out}, bias={self.bias is not None}"


class Norm(nn.Module):
    """Holds layer normalisation's ``gamma`` and ``beta``, both ``(num_hiddens,)``."""

    def __init__(
        self,
        num_hiddens: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.gamma = Parameter(torch.empty(num_hiddens, device=device, dtype=dtype))
        self.beta = Parameter(torch.empty(num_hiddens, device=device, dtype=dtype))


class Embedding(nn.Module):
    """Holds a table of learned vectors, ``embedding`` ``(num_embeddings, embedding_dim)``.

    Like :class:`Dense` it is never called: the owner passes the table to the core, which
    looks rows up in it (token ids) or combines them (relative offsets).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.embedding = Parameter(torch.empty(num_embeddings, embedding_dim, device=device,
                                               dtype=dtype))

    def extra_repr(self) -> str:
        return f"{self.embedding.shape[0]}, {self.embedding.shape[1]}"


class Layer(PlainArguments, nn.Module):
    """Base of the torch layers: canonical weights, lazy input sizes, dropout by mode.

    Args:
        dropout: Dropout rate, applied in training mode only.
        device: Device of the parameters (and buffers).
        dtype: Dtype of the parameters (and buffers); torch's default dtype when None.

    Attributes:
        attention_weights: The last call's attention weights ``(B, H, Q, K)``, before dropout
            (attention layers only); None before the first call and after a fused call.
    """

    def __init__(
        self,
        dropout: float = 0.0,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.dropout = checks.check_dropout(dropout)
        self._factory: dict[str, Any] = {"device": device, "dtype": dtype}
        self.attention_weights: Tensor | None = None

    def spec(self) -> W.Spec:
        """Canonical names and shapes of this layer's weights (None = not known yet)."""
        return {}

    @property
    def built(self) -> bool:
        """Whether every weight's shape is known."""
        return not any(is_lazy(p) for p in self.parameters())

    def _weights(self) -> dict[str, Tensor]:
        """The parameters by canonical name (the ``state_dict`` keys)."""
        return dict(self.named_parameters())

    def get_weights(self) -> dict[str, np.ndarray]:
        """Returns a copy of the weights in the canonical layout (DESIGN section 5)."""
        if not self.built:
            raise checks.not_built(type(self).__name__)
        return {name: OPS.to_numpy(p).copy() for name, p in self.named_parameters()}

    def set_weights(self, weights: Mapping[str, Any]) -> None:
        """Sets every weight from a canonical mapping; checks all names and shapes first.

        Values may be arrays of any framework and of any real float dtype (read on the host
        by :func:`attention_core.host.host_array`); they are cast to the parameters' dtype.
        Every value is checked and converted before the first parameter changes. Setting the
        weights of a layer not called yet fixes its input sizes.
        """
        params = self._weights()
        dtypes = {name: OPS.dtype_name(p) for name, p in params.items()}
        checked = W.check_weights(self.spec(), weights, dtype=dtypes)
        staged = {name: OPS.from_numpy(value, like=params[name]) for name, value in checked.items()}
        with torch.no_grad():
            for name, value in staged.items():
                param = params[name]
                if isinstance(param, UninitializedParameter):
                    param.materialize(value.shape)
                param.copy_(value)

    def reset_parameters(self) -> None:
        """Draws initial values for every weight whose shape is known.

        The rules of ``attention_core.weights.init_weights`` (Glorot-uniform kernels, zero
        biases, ...), drawn from a generator seeded by torch's, so ``torch.manual_seed``
        fixes them.
        """
        self._init([name for name, p in self.named_parameters() if not is_lazy(p)])

    def _init(self, names: list[str]) -> None:
        if not names:
            return
        spec = self.spec()
        seed = int(torch.randint(0, 2**62, ()).item())
        values = W.init_weights({n: spec[n] for n in names}, np.random.default_rng(seed), "float64")
        params = self._weights()
        with torch.no_grad():
            for name in names:
                params[name].copy_(torch.from_numpy(values[name]))

    def _dense_for(self, dim: str) -> Dense:
        module = self.get_submodule(W.INPUT_KERNELS[dim].rpartition(".")[0])
        assert isinstance(module, Dense)
        return module

    def _build(self, **dims: Any) -> list[Dense]:
        """Checks input sizes against the known ones; materialises the kernels of unknown ones.

        Returns:
            The kernels materialised now, to undo with :meth:`_run` if the call fails.
        """
        fresh: dict[str, Dense] = {}
        for dim, size in dims.items():
            dense = self._dense_for(dim)
            known = dense.d_in
            if known is None:
                fresh[dim] = dense
            else:
                checks.check_built_size(W.INPUT_ARGS[dim], size, known)
        if fresh:
            self._materialize({dim: int(dims[dim]) for dim in fresh})
        return list(fresh.values())

    @torch.compiler.disable(  # type: ignore[untyped-decorator, no-untyped-call]
        reason="input sizes are inferred eagerly: call the layer once, or set_weights, "
        "before compiling with fullgraph=True"
    )
    def _materialize(self, dims: dict[str, int]) -> None:
        """Gives the kernels of the unknown input sizes their shapes and initial values."""
        for dim, size in dims.items():
            self._dense_for(dim).materialize(size)
        self._init([W.INPUT_KERNELS[dim] for dim in dims])

    def _run(self, fresh: list[Dense], call: Callable[[], T]) -> T:
        """Runs ``call``; if it raises, first undoes the kernels materialised for it."""
        if not fresh:
            return call()
        try:
            return call()
        except BaseException:
            for dense in fresh:
                dense.unmaterialize()
            raise

    def _inputs(self, **inputs: Any) -> list[Any]:
        """The inputs in the layer's compute dtype, that of its parameters.

        The dtype rule of :func:`attention_core.checks.compute_inputs`. Under
        ``torch.autocast`` the autocast dtype governs the computation: the inputs are then
        checked but not cast.
        """
        param = next(self.parameters(), None)
        autocast = param is not None and torch.is_autocast_enabled(param.device.type)
        dtype = None if param is None or autocast else OPS.dtype_name(param)
        return checks.compute_inputs(OPS, dtype, **inputs)

    def _rate(self) -> float:
        return self.dropout if self.training else 0.0


class DotProductAttention(Layer):
    """Scaled dot-product attention (no weights).

    Args:
        dropout: Dropout rate on the attention weights in training mode.
        keep_attention_weights: Keep each call's weights in ``attention_weights``; when
            False, calls without ``return_attention`` take the fused path.
        implementation: How calls that do not need the weights pool: ``"fused"`` (torch's
            ``scaled_dot_product_attention``), ``"blockwise"`` or ``"direct"``; None lets the
            core choose (fused on torch).
        device: Unused (no parameters); accepted like every torch layer.
        dtype: Unused (no parameters); accepted like every torch layer.
    """

    def __init__(
        self,
        dropout: float = 0.0,
        *,
        keep_attention_weights: bool = True,
        implementation: str | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(dropout, device=device, dtype=dtype)
        self.keep_attention_weights = bool(keep_attention_weights)
        self.implementation = checks.check_implementation(implementation)

    def forward(
        self,
        queries: Tensor,
        keys: Tensor,
        values: Tensor,
        valid_lens: Any = None,
        *,
        mask: Any = None,
        causal: bool = False,
        return_attention: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Attends ``queries (B, Q, D)`` to ``keys (B, K, D)``; returns ``(B, Q, Dv)``."""
        ops = _ops(queries)
        checks.check_rank(ops, "queries", queries, (3,), "(B, Q, D)")
        need = return_attention or self.keep_attention_weights
        result: Any = attention.dot_product_attention(
            queries, keys, values, valid_lens, mask=mask, causal=causal,
            dropout=self._rate(), return_weights=need, implementation=self.implementation,
            ops=ops,
        )
        out, self.attention_weights = result if need else (result, None)
        return result if return_attention else out

    def extra_repr(self) -> str:
        return f"dropout={self.dropout}"


class AdditiveAttention(Layer):
    """Additive (Bahdanau) attention with hidden size ``num_hiddens``.

    Args:
        num_hiddens: Size of the hidden features ``tanh(W_q q + W_k k)``.
        dropout: Dropout rate on the attention weights in training mode.
        q_in: Queries' size, or None to learn it on the first call.
        k_in: Keys' size, or None to learn it on the first call.
        device: Device of the parameters.
        dtype: Dtype of the parameters.
    """

    def __init__(
        self,
        num_hiddens: int,
        dropout: float = 0.0,
        *,
        q_in: int | None = None,
        k_in: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        W.additive_spec(num_hiddens, q_in, k_in)  # checks the sizes
        super().__init__(dropout, device=device, dtype=dtype)
        self.num_hiddens = num_hiddens
        self.W_q = Dense(q_in, num_hiddens, **self._factory)
        self.W_k = Dense(k_in, num_hiddens, **self._factory)
        self.w_v = Dense(num_hiddens, 1, **self._factory)
        self.reset_parameters()

    def spec(self) -> W.Spec:
        return W.additive_spec(self.num_hiddens, self.W_q.d_in, self.W_k.d_in)

    def forward(
        self,
        queries: Tensor,
        keys: Tensor,
        values: Tensor,
        valid_lens: Any = None,
        *,
        mask: Any = None,
        causal: bool = False,
        return_attention: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Attends ``queries (B, Q, Dq)`` to ``keys (B, K, Dk)``; returns ``(B, Q, Dv)``."""
        queries, keys, values = self._inputs(queries=queries, keys=keys, values=values)
        ops = _ops(queries)
        attention.check_projected_inputs(ops, queries, keys, values)
        fresh = self._build(q_in=queries.shape[-1], k_in=keys.shape[-1])
        out, attn = self._run(fresh, lambda: attention.additive_attention(
            queries, keys, values, self._weights(), valid_lens, mask=mask, causal=causal,
            dropout=self._rate(), return_weights=True, ops=ops,
        ))
        self.attention_weights = attn
        return (out, attn) if return_attention else out

    def extra_repr(self) -> str:
        return f"num_hiddens={self.num_hiddens}, dropout={self.dropout}"


class MultiHeadAttention(Layer):
    """Multi-head attention: ``num_heads`` heads over ``num_hiddens`` projected features.

    Args:
        num_hiddens: Width h of the projections and of the output; divisible by num_heads.
        num_heads: Number of heads H.
        dropout: Dropout rate on the attention weights in training mode.
        bias: Whether the four projections have biases.
        q_in: Queries' size, or None to learn it on the first call.
        k_in: Keys' size, or None to learn it on the first call.
        v_in: Values' size, or None to learn it on the first call.
        keep_attention_weights: Keep each call's weights in ``attention_weights``; when
            False, calls without ``return_attention`` take the fused path.
        implementation: How calls that do not need the weights pool: ``"fused"`` (torch's
            ``scaled_dot_product_attention``), ``"blockwise"`` or ``"direct"``; None lets the
            core choose (fused on torch).
        device: Device of the parameters.
        dtype: Dtype of the parameters.
    """

    def __init__(
        self,
        num_hiddens: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = False,
        *,
        q_in: int | None = None,
        k_in: int | None = None,
        v_in: int | None = None,
        keep_attention_weights: bool = True,
        implementation: str | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        checks.check_heads(num_hiddens, num_heads)
        super().__init__(dropout, device=device, dtype=dtype)
        self.num_hiddens, self.num_heads, self.bias = num_hiddens, num_heads, bool(bias)
        self.keep_attention_weights = bool(keep_attention_weights)
        self.implementation = checks.check_implementation(implementation)
        self.W_q = Dense(q_in, num_hiddens, self.bias, **self._factory)
        self.W_k = Dense(k_in, num_hiddens, self.bias, **self._factory)
        self.W_v = Dense(v_in, num_hiddens, self.bias, **self._factory)
        self.W_o = Dense(num_hiddens, num_hiddens, self.bias, **self._factory)
        self.reset_parameters()

    def spec(self) -> W.Spec:
        return W.multi_head_spec(self.num_hiddens, self.num_heads, self.bias,
                                 self.W_q.d_in, self.W_k.d_in, self.W_v.d_in)

    def forward(
        self,
        queries: Tensor,
        keys: Tensor,
        values: Tensor,
        valid_lens: Any = None,
        *,
        mask: Any = None,
        causal: bool = False,
        return_attention: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Attends ``queries (B, Q, Dq)`` to ``keys (B, K, Dk)``; returns ``(B, Q, h)``."""
        queries, keys, values = self._inputs(queries=queries, keys=keys, values=values)
        ops = _ops(queries)
        attention.check_projected_inputs(ops, queries, keys, values)
        fresh = self._build(q_in=queries.shape[-1], k_in=keys.shape[-1], v_in=values.shape[-1])
        rate = self._rate()
        need = return_attention or self.keep_attention_weights
        result: Any = self._run(fresh, lambda: multihead.multi_head_attention(
            queries, keys, values, self._weights(), self.num_heads, valid_lens, mask=mask,
            causal=causal, dropout=rate, return_weights=need, implementation=self.implementation,
            ops=ops,
        ))
        out, self.attention_weights = result if need else (result, None)
        return result if return_attention else out

    def extra_repr(self) -> str:
        return (f"num_hiddens={self.num_hiddens}, num_heads={self.num_heads}, "
                f"dropout={self.dropout}, bias={self.bias}")


class RelativeMultiHeadAttention(Layer):
    """Multi-head attention with relative position representations (Shaw et al., 2018).

    The offset ``j - i`` between key ``j`` and query ``i``, clipped to ``[-m, m]``, picks a
    learned vector added to the key (``rel_k.embedding``) and, with ``relative_values``, to the
    value (``rel_v.embedding``); both tables are ``(2m + 1, h/H)``, shared by the heads. The
    core forms the attention weights on every call (there is no fused path), so
    ``keep_attention_weights`` only decides whether they are kept.

    Args:
        num_hiddens: Width h of the projections and of the output; divisible by num_heads.
        num_heads: Number of heads H.
        max_relative_position: m: offsets beyond ``[-m, m]`` share the edge vectors.
        dropout: Dropout rate on the attention weights in training mode.
        bias: Whether the four projections have biases.
        relative_values: Also add the offsets' vectors to the values.
        keep_attention_weights: Keep each call's weights in ``attention_weights``.
        q_in: Queries' size, or None to learn it on the first call.
        k_in: Keys' size, or None to learn it on the first call.
        v_in: Values' size, or None to learn it on the first call.
        device: Device of the parameters.
        dtype: Dtype of the parameters.
    """

    def __init__(
        self,
        num_hiddens: int,
        num_heads: int,
        max_relative_position: int,
        dropout: float = 0.0,
        bias: bool = False,
        *,
        relative_values: bool = True,
        keep_attention_weights: bool = True,
        q_in: int | None = None,
        k_in: int | None = None,
        v_in: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        checks.check_heads(num_hiddens, num_heads)
        W.relative_multi_head_spec(num_hiddens, num_heads, max_relative_position)  # checks m
        super().__init__(dropout, device=device, dtype=dtype)
        self.num_hiddens, self.num_heads, self.bias = num_hiddens, num_heads, bool(bias)
        self.max_relative_position = max_relative_position
        self.relative_values = bool(relative_values)
        self.keep_attention_weights = bool(keep_attention_weights)
        self.W_q = Dense(q_in, num_hiddens, self.bias, **self._factory)
        self.W_k = Dense(k_in, num_hiddens, self.bias, **self._factory)
        self.W_v = Dense(v_in, num_hiddens, self.bias, **self._factory)
        self.W_o = Dense(num_hiddens, num_hiddens, self.bias, **self._factory)
        offsets, depth = 2 * max_relative_position + 1, num_hiddens // num_heads
        self.rel_k = Embedding(offsets, depth, **self._factory)
        self.rel_v = Embedding(offsets, depth, **self._factory) if self.relative_values else None
        self.reset_parameters()

    def spec(self) -> W.Spec:
        return W.relative_multi_head_spec(
            self.num_hiddens, self.num_heads, self.max_relative_position, self.bias,
            self.relative_values, self.W_q.d_in, self.W_k.d_in, self.W_v.d_in,
        )

    def forward(
        self,
        queries: Tensor,
        keys: Tensor,
        values: Tensor,
        valid_lens: Any = None,
        *,
        mask: Any = None,
        causal: bool = False,
        return_attention: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Attends ``queries (B, Q, Dq)`` to ``keys (B, K, Dk)``; returns ``(B, Q, h)``."""
        queries, keys, values = self._inputs(queries=queries, keys=keys, values=values)
        ops = _ops(queries)
        attention.check_projected_inputs(ops, queries, keys, values)
        fresh = self._build(q_in=queries.shape[-1], k_in=keys.shape[-1], v_in=values.shape[-1])
        out, attn = self._run(fresh, lambda: multihead.relative_multi_head_attention(
            queries, keys, values, self._weights(), self.num_heads, valid_lens, mask=mask,
            causal=causal, dropout=self._rate(), return_weights=True, ops=ops,
        ))
        self.attention_weights = attn if return_attention or self.keep_attention_weights else None
        return (out, attn) if return_attention else out

    def extra_repr(self) -> str:
        return (f"num_hiddens={self.num_hiddens}, num_heads={self.num_heads}, "
                f"max_relative_position={self.max_relative_position}, dropout={self.dropout}, "
                f"bias={self.bias}, relative_values={self.relative_values}")


class _SinusoidalTable(Layer):
    """A layer holding the sinusoidal table ``P`` as a non-persistent buffer.

    ``P`` ``(1, max_len, num_hiddens)`` follows ``.to()`` like any buffer and stays out of
    ``state_dict``. Changing its dtype recomputes it from the float64 table, so ``.double()``
    gives the exact table.
    """

    P: Tensor
    max_len: int
    num_hiddens: int

    def _register_table(
        self, table: np.ndarray, device: torch.device | str | None, dtype: torch.dtype | None
    ) -> None:
        """Holds the float64 ``table`` ``(max_len, num_hiddens)`` as ``P``, in ``dtype``."""
        dtype = dtype or torch.get_default_dtype()
        self.register_buffer(
            "P", torch.from_numpy(table[None]).to(device=device, dtype=dtype), persistent=False
        )

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> _SinusoidalTable:
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        if self.P.is_floating_point():  # a cast from float32 to float64 would keep float32 digits
            table = positional.sinusoidal_encoding(self.max_len, self.num_hiddens, "float64")
            self.P = torch.from_numpy(table[None]).to(device=self.P.device, dtype=self.P.dtype)
        return self


class PositionalEncoding(_SinusoidalTable):
    """Adds the sinusoidal table ``P`` (a non-persistent buffer ``(1, max_len, num_hiddens)``).

    ``P`` follows ``.to()`` like any buffer and stays out of ``state_dict``. Changing its
    dtype recomputes it from the float64 table, so ``.double()`` gives the exact table.

    Args:
        num_hiddens: Width d of the encoding.
        dropout: Dropout rate on the sum, in training mode.
        max_len: Number of positions in the table.
        device: Device of ``P``.
        dtype: Dtype of ``P``.
    """

    def __init__(
        self,
        num_hiddens: int,
        dropout: float = 0.0,
        max_len: int = positional.DEFAULT_MAX_LEN,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        table = positional.sinusoidal_encoding(max_len, num_hiddens, "float64")
        super().__init__(dropout, device=device, dtype=dtype)
        self.num_hiddens, self.max_len = num_hiddens, max_len
        self._register_table(table, device, dtype)

    def forward(self, X: Tensor) -> Tensor:
        """Returns ``dropout(X + P[:, :T])`` for ``X (B, T, num_hiddens)``."""
        (X,) = self._inputs(X=X)
        return positional.add_positions(X, self.P, self._rate(), ops=_ops(X))

    def extra_repr(self) -> str:
        return f"num_hiddens={self.num_hiddens}, dropout={self.dropout}, max_len={self.max_len}"


class LearnedPositionalEncoding(Layer):
    """Adds a learned table ``P`` (a parameter ``(1, max_len, num_hiddens)``) to the input.

    Args:
        num_hiddens: Width d of the encoding.
        dropout: Dropout rate on the sum, in training mode.
        max_len: Number of positions in the table.
        device: Device of ``P``.
        dtype: Dtype of ``P``.
    """

    def __init__(
        self,
        num_hiddens: int,
        dropout: float = 0.0,
        max_len: int = 1000,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        W.learned_positional_spec(num_hiddens, max_len)  # checks the sizes
        super().__init__(dropout, device=device, dtype=dtype)
        self.num_hiddens, self.max_len = num_hiddens, max_len
        self.P = Parameter(torch.empty(1, max_len, num_hiddens, **self._factory))
        self.reset_parameters()

    def spec(self) -> W.Spec:
        return W.learned_positional_spec(self.num_hiddens, self.max_len)

    def forward(self, X: Tensor) -> Tensor:
        """Returns ``dropout(X + P[:, :T])`` for ``X (B, T, num_hiddens)``."""
        (X,) = self._inputs(X=X)
        return positional.add_positions(X, self.P, self._rate(), ops=_ops(X))

    def extra_repr(self) -> str:
        return f"num_hiddens={self.num_hiddens}, dropout={self.dropout}, max_len={self.max_len}"


class PositionWiseFFN(Layer):
    """Two dense layers with a ReLU between, applied at every position.

    Args:
        ffn_num_hiddens: Width of the hidden layer.
        ffn_num_outputs: Width of the output.
        d_in: Input width, or None to learn it on the first call.
        device: Device of the parameters.
        dtype: Dtype of the parameters.
    """

    def __init__(
        self,
        ffn_num_hiddens: int,
        ffn_num_outputs: int,
        *,
        d_in: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        W.ffn_spec(ffn_num_hiddens, ffn_num_outputs, d_in)  # checks the sizes
        super().__init__(0.0, device=device, dtype=dtype)
        self.ffn_num_hiddens, self.ffn_num_outputs = ffn_num_hiddens, ffn_num_outputs
        self.dense1 = Dense(d_in, ffn_num_hiddens, True, **self._factory)
        self.dense2 = Dense(ffn_num_hiddens, ffn_num_outputs, True, **self._factory)
        self.reset_parameters()

    def spec(self) -> W.Spec:
        return W.ffn_spec(self.ffn_num_hiddens, self.ffn_num_outputs, self.dense1.d_in)

    def forward(self, X: Tensor) -> Tensor:
        """Returns ``dense2(relu(dense1(X)))`` for ``X (B, T, d)``."""
        (X,) = self._inputs(X=X)
        ops = _ops(X)
        checks.check_rank(ops, "X", X, (3,), "(B, T, d)")
        fresh = self._build(d_in=X.shape[-1])
        return self._run(fresh, lambda: transformer.position_wise_ffn(X, self._weights(), ops=ops))

    def extra_repr(self) -> str:
        return f"ffn_num_hiddens={self.ffn_num_hiddens}, ffn_num_outputs={self.ffn_num_outputs}"


class AddNorm(Layer):
    """Residual connection then layer normalisation over the last axis (eps 1e-5).

    Args:
        num_hiddens: Width h of the inputs.
        dropout: Dropout rate on ``Y``, in training mode.
        device: Device of the parameters.
        dtype: Dtype of the parameters.
    """

    def __init__(
        self,
        num_hiddens: int,
        dropout: float = 0.0,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        W.add_norm_spec(num_hiddens)  # checks the size
        super().__init__(dropout, device=device, dtype=dtype)
        self.num_hiddens = num_hiddens
        self.ln = Norm(num_hiddens, **self._factory)
        self.reset_parameters()

    def spec(self) -> W.Spec:
        return W.add_norm_spec(self.num_hiddens)

    def forward(self, X: Tensor, Y: Tensor) -> Tensor:
        """Returns ``LayerNorm(dropout(Y) + X)`` for ``X``, ``Y`` of shape ``(B, T, h)``."""
        X, Y = self._inputs(X=X, Y=Y)
        ops = _ops(X)
        checks.check_last_dim(ops, "X", X, self.num_hiddens)
        return transformer.add_norm(X, Y, self._weights(), self._rate(), ops=ops)

    def extra_repr(self) -> str:
        return f"num_hiddens={self.num_hiddens}, dropout={self.dropout}"


class TransformerEncoderBlock(Layer):
    """Self-attention and a position-wise FFN, each wrapped in add & norm (post-norm).

    Its parts are the layers ``attention``, ``addnorm1``, ``ffn`` and ``addnorm2``, which is
    where the canonical names ``attention.W_q.kernel`` etc. come from; the block calls the
    core's ``transformer_encoder_block`` with their parameters.

    Args:
        num_hiddens: Width h of the block's input and output.
        ffn_num_hiddens: Hidden width of the FFN.
        num_heads: Heads of the self-attention.
        dropout: Dropout rate of the attention weights and both residual branches.
        bias: Whether the attention projections have biases.
        keep_attention_weights: Keep each call's self-attention weights in
            ``attention_weights``; when False, calls take the fused path.
        implementation: How calls that do not need the weights pool: ``"fused"`` (torch's
            ``scaled_dot_product_attention``), ``"blockwise"`` or ``"direct"``; None lets the
            core choose (fused on torch).
        device: Device of the parameters.
        dtype: Dtype of the parameters.
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
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        W.encoder_block_spec(num_hiddens, ffn_num_hiddens, num_heads, bias)  # checks the sizes
        super().__init__(dropout, device=device, dtype=dtype)
        h = num_hiddens
        self.num_hiddens, self.ffn_num_hiddens = num_hiddens, ffn_num_hiddens
        self.num_heads, self.bias = num_heads, bool(bias)
        self.keep_attention_weights = bool(keep_attention_weights)
        self.implementation = checks.check_implementation(implementation)
        self.attention = MultiHeadAttention(h, num_heads, dropout, bias, q_in=h, k_in=h, v_in=h,
                                            **self._factory)
        self.addnorm1 = AddNorm(h, dropout, **self._factory)
        self.ffn = PositionWiseFFN(ffn_num_hiddens, h, d_in=h, **self._factory)
        self.addnorm2 = AddNorm(h, dropout, **self._factory)

    def spec(self) -> W.Spec:
        return W.encoder_block_spec(self.num_hiddens, self.ffn_num_hiddens, self.num_heads,
                                    self.bias)

    def forward(self, X: Tensor, valid_lens: Any = None, *, mask: Any = None) -> Tensor:
        """Encodes ``X (B, T, h)``; returns ``(B, T, h)``."""
        (X,) = self._inputs(X=X)
        ops = _ops(X)
        checks.check_rank(ops, "X", X, (3,), "(B, T, num_hiddens)")
        checks.check_last_dim(ops, "X", X, self.num_hiddens)
        need = self.keep_attention_weights
        result: Any = transformer.transformer_encoder_block(
            X, self._weights(), self.num_heads, valid_lens, mask=mask, dropout=self._rate(),
            return_weights=need, implementation=self.implementation, ops=ops,
        )
        out, self.attention_weights = result if need else (result, None)
        return out

    def extra_repr(self) -> str:
        return (f"num_hiddens={self.num_hiddens}, ffn_num_hiddens={self.ffn_num_hiddens}, "
                f"num_heads={self.num_heads}, dropout={self.dropout}, bias={self.bias}")


class TransformerEncoder(_SinusoidalTable):
    """The Transformer encoder: token embedding scaled by sqrt(h), sinusoidal positions, blocks.

    Its parts are ``token`` (holding ``embedding (vocab_size, h)``) and ``blks``, a
    :class:`torch.nn.ModuleList` of :class:`TransformerEncoderBlock`, so the parameter names
    are the canonical ``token.embedding``, ``blks.0.attention.W_q.kernel`` etc. The encoder
    calls the core's ``transformer_encoder`` with all of them.

    Args:
        vocab_size: Number of token ids V.
        num_hiddens: Model width h.
        ffn_num_hiddens: Hidden width of the blocks' FFNs.
        num_heads: Heads of every block's self-attention.
        num_blks: Number of blocks.
        dropout: Dropout rate of the positional encoding's sum and inside every block.
        bias: Whether the attention projections have biases.
        keep_attention_weights: Keep each block's self-attention weights: ``attention_weights``
            is then a list with one ``(B, H, T, T)`` tensor per block, also kept by the block
            itself (``blks[i].attention_weights``). When False, the blocks take the fused path
            and the list holds None.
        implementation: How calls that do not need the weights pool: ``"fused"`` (torch's
            ``scaled_dot_product_attention``), ``"blockwise"`` or ``"direct"``; None lets the
            core choose (fused on torch).
        max_len: Rows of the sinusoidal table ``P`` (a non-persistent buffer, as in
            :class:`PositionalEncoding`): the longest sequence the encoder takes. Calls slice
            it to their length, which may be symbolic (``torch.export`` with a ``Dim``,
            ``torch.onnx.export`` with a dynamic axis).
        device: Device of the parameters.
        dtype: Dtype of the parameters.
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
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        W.transformer_encoder_spec(vocab_size, num_hiddens, ffn_num_hiddens, num_heads, num_blks,
                                   bias)  # checks the sizes
        super().__init__(dropout, device=device, dtype=dtype)
        self.vocab_size, self.num_hiddens, self.ffn_num_hiddens = (vocab_size, num_hiddens,
                                                                   ffn_num_hiddens)
        self.num_heads, self.num_blks, self.bias = num_heads, num_blks, bool(bias)
        self.keep_attention_weights = bool(keep_attention_weights)
        self.implementation = checks.check_implementation(implementation)
        self.token = Embedding(vocab_size, num_hiddens, **self._factory)
        self.blks = nn.ModuleList(
            TransformerEncoderBlock(num_hiddens, ffn_num_hiddens, num_heads, dropout, bias,
                                    keep_attention_weights=keep_attention_weights,
                                    implementation=implementation, **self._factory)
            for _ in range(num_blks)
        )
        self.attention_weights: list[Tensor | None] = [None] * num_blks  # type: ignore[assignment]
        self.reset_parameters()
        self.max_len = max_len
        self._register_table(
            positional.sinusoidal_encoding(max_len, num_hiddens, "float64"), device, dtype
        )

    def spec(self) -> W.Spec:
        return W.transformer_encoder_spec(self.vocab_size, self.num_hiddens, self.ffn_num_hiddens,
                                          self.num_heads, self.num_blks, self.bias)

    def forward(self, tokens: Tensor, valid_lens: Any = None, *, mask: Any = None) -> Tensor:
        """Encodes integer ``tokens (B, T)``; returns ``(B, T, h)``."""
        ops = _ops(tokens)
        need = self.keep_attention_weights
        result: Any = transformer.transformer_encoder(
            tokens, self._weights(), self.num_heads, valid_lens, mask=mask, dropout=self._rate(),
            return_weights=need, implementation=self.implementation, positions=self.P, ops=ops,
        )
        out, weights = result if need else (result, [None] * self.num_blks)
        for block, attn in zip(self.blks, weights, strict=True):
            block.attention_weights = attn
        self.attention_weights = list(weights)
        return out

    def extra_repr(self) -> str:
        return (f"vocab_size={self.vocab_size}, num_hiddens={self.num_hiddens}, "
                f"ffn_num_hiddens={self.ffn_num_hiddens}, num_heads={self.num_heads}, "
                f"num_blks={self.num_blks}, dropout={self.dropout}, bias={self.bias}, "
                f"max_len={self.max_len}")


class NadarayaWatson(Layer):
    """Nadaraya-Watson attention pooling with a Gaussian kernel.

    Args:
        parametric: Learn the kernel's inverse width ``w`` (a parameter of shape ``(1,)``).
        device: Device of ``w``.
        dtype: Dtype of ``w``.
    """

    def __init__(
        self,
        parametric: bool = False,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(0.0, device=device, dtype=dtype)
        self.parametric = bool(parametric)
        self.w = Parameter(torch.empty(1, **self._factory)) if self.parametric else None
        self.reset_parameters()

    def spec(self) -> W.Spec:
        return W.nadaraya_watson_spec(self.parametric)

    def forward(self, queries: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        """Predicts at ``queries (B, Q)`` or ``(Q,)`` from pairs ``keys``, ``values``."""
        if self.w is not None:
            queries, keys, values = self._inputs(queries=queries, keys=keys, values=values)
        out, attn = attention.nadaraya_watson(
            queries, keys, values, self.w, return_weights=True, ops=_ops(queries)
        )
        self.attention_weights = attn
        return out

    def extra_repr(self) -> str:
        return f"parametric={self.parametric}"
