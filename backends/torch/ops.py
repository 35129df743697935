"""The PyTorch implementation of the ops protocol: one torch call per method."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import torch
import torch._dynamo
import torch.nn.functional as F

from attention_core.attention import BLOCKWISE_MIN_SCORES
from attention_core.ops import NamespaceOps


class TorchOps(NamespaceOps):
    """``torch.Tensor`` arrays; dropout draws from torch's global generator.

    Args:
        device: Where arrays made from nothing (``arange``) or from NumPy data without a
            ``like`` go; the default device when None. Layers pass their input's device.
    """

    name = "torch"
    xp = torch

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = None if device is None else torch.device(device)

    @property
    def mixes_dtypes(self) -> bool:
        """Whether ``torch.autocast`` is on for this device (any device when none was given).

        Autocast runs the matrix products in its own dtype, so arrays of different floating
        dtypes meet in the core; it then lets them (see :class:`attention_core.ops.Ops`).
        """
        if self.device is not None:
            return bool(torch.is_autocast_enabled(self.device.type))
        return bool(torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda"))

    def from_numpy(self, x: np.ndarray, like: torch.Tensor | None = None) -> torch.Tensor:
        if torch.compiler.is_compiling():
            # The core's constant tables (sinusoidal encoding, clipped offsets) are NumPy code,
            # which Dynamo traces into tensors; it cannot trace a look at ``ndarray.dtype``.
            t = torch.as_tensor(x)
            if like is None:
                return t if self.device is None else t.to(self.device)
            return t.to(device=like.device, dtype=like.dtype if t.is_floating_point() else t.dtype)
        x = np.asarray(x)
        if x.dtype.name == "bfloat16":  # ml_dtypes: widen exactly, then narrow in torch
            return torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16)
        t = torch.from_numpy(np.array(x, order="C", copy=True))
        if like is None:
            return t if self.device is None else t.to(self.device)
        dtype = like.dtype if t.is_floating_point() else t.dtype
        return t.to(device=like.device, dtype=dtype)

    def to_numpy(self, x: torch.Tensor) -> np.ndarray:
        x = x.detach().cpu()
        return (x.float() if x.dtype == torch.bfloat16 else x).numpy()

    def concrete(self, x: torch.Tensor) -> np.ndarray | None:
        jit_tracing = torch.jit.is_tracing()  # type: ignore[attr-defined, no-untyped-call]
        if torch.compiler.is_compiling() or jit_tracing:
            return None
        try:
            return self.to_numpy(x)
        except RuntimeError:  # inside torch.func.grad / vmap a tensor has no storage to read
            return None

    def shape(self, x: torch.Tensor) -> tuple[Any, ...]:
        return tuple(x.shape)

    def reshape(self, x: torch.Tensor, shape: tuple[Any, ...]) -> torch.Tensor:
        """``torch.reshape``; by way of the flat array while ``torch.export`` records a length.

        Reshaping ``(B, H, T, T)`` to ``(B, Hkv, G * T, T)`` (grouped-query heads), torch
        gives the view a stride ``Min(T, T * T)`` whose check guards a symbolic ``T`` to the
        traced value ("Constraints violated"). A flat array's views have plain strides; the
        result is the same (a reshape reads the elements in row-major order either way).
        """
        if torch.compiler.is_exporting() and not all(isinstance(d, int) for d in x.shape):
            x = torch.reshape(x, (-1,))
        return torch.reshape(x, shape)

    def fixed_shape(self, x: torch.Tensor) -> tuple[int, ...]:
        """``x.shape`` as ints, also under ``torch.jit.trace``, which gives dimensions as tensors.

        For weights, whose shapes a trace may fix (see :func:`attention_core.ops.fixed_shape`).
        """
        if not torch.jit.is_tracing():  # type: ignore[attr-defined, no-untyped-call]
            return tuple(x.shape)
        with warnings.catch_warnings():  # "converting a tensor to a Python integer": it is fixed
            warnings.simplefilter("ignore", torch.jit.TracerWarning)  # type: ignore[attr-defined]
            return tuple(int(d) for d in x.shape)

    def dtype_name(self, x: torch.Tensor) -> str:
        return str(x.dtype).removeprefix("torch.")

    def astype(self, x: torch.Tensor, dtype: str) -> torch.Tensor:
        return x.to(getattr(torch, dtype))

    def relu(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x)

    def where(self, cond: torch.Tensor, x: torch.Tensor, y: torch.Tensor | float) -> torch.Tensor:
        return torch.where(cond, x, y)

    def max(self, x: torch.Tensor, axis: int) -> torch.Tensor:
        return torch.amax(x, dim=axis, keepdim=True)

    def sum(self, x: torch.Tensor, axis: int) -> torch.Tensor:
        return torch.sum(x, dim=axis, keepdim=True)

    def mean(self, x: torch.Tensor, axis: int) -> torch.Tensor:
        return torch.mean(x, dim=axis, keepdim=True)

    def transpose(self, x: torch.Tensor, axes: tuple[int, ...]) -> torch.Tensor:
        return torch.permute(x, axes)

    def expand_dims(self, x: torch.Tensor, axis: int) -> torch.Tensor:
        return torch.unsqueeze(x, axis)

    def slice(self, x: torch.Tensor, axis: int, start: Any, size: int) -> torch.Tensor:
        return torch.narrow(x, axis, start, size)

    def concatenate(self, xs: list[torch.Tensor], axis: int) -> torch.Tensor:
        return torch.cat(xs, axis)

    def arange(self, n: Any) -> torch.Tensor:
        return torch.arange(n, dtype=torch.int32, device=self.device)

    def linear(self, x: torch.Tensor, kernel: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        # F.linear takes (out, in): the transposed view of the canonical kernel, not a copy;
        # under torch.autocast it casts the bias with the product, as the core's dense does
        return F.linear(x, kernel.t(), bias)

    def layer_norm(self, x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor,
                   eps: float) -> torch.Tensor | None:
        if not x.dtype == gamma.dtype == beta.dtype or x.dtype not in _WIDE_FLOATS:
            return None  # the core's own, in float32 for narrow dtypes
        return F.layer_norm(x, (x.shape[-1],), gamma, beta, eps)

    def take(self, table: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        return F.embedding(indices, table)

    def stop_gradient(self, x: torch.Tensor) -> torch.Tensor:
        return x.detach()

    def dropout(self, x: torch.Tensor, rate: float) -> torch.Tensor:
        return F.dropout(x, rate, training=True)

    @property
    def cond(self) -> Callable[..., Any] | None:
        """``torch.cond`` where it can branch (see :func:`_can_cond`), None otherwise.

        A compiled call cannot probe its inputs, so the core checks its bound on the scores in
        the graph and this picks the branch (see :class:`attention_core.ops.Ops`). Eager calls
        probe instead; ``torch.jit.trace`` and ``torch.func`` have no ``torch.cond``.
        """
        return _compiled_cond if _can_cond() else None

    def prefers_fused(self, shape: tuple[Any, ...]) -> bool:
        """SDPA, except in a program recorded for export (``torch.export``, ``torch.jit.trace``).

        There no branch can be taken on the bound, and an exported program holds only
        torch's own operators: the direct path, which masks the scores it forms, is chosen
        (an explicit ``implementation="fused"`` is taken as given).
        """
        return not _exporting()

    @property
    def blockwise_min_scores(self) -> float:
        """Scores from which the automatic choice pools blockwise (none in some programs).

        None inside ``torch.cond`` or in an exported program. There the path taken is the
        direct one: Dynamo would unroll the blockwise loops into the program, and Inductor
        cannot lay out their blocks once the lengths are symbolic (a compiled layer called
        with a second length).
        """
        return math.inf if _can_cond() or _exporting() else BLOCKWISE_MIN_SCORES

    @property
    def attend_out_of_range(self) -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
        """:func:`_attend_out_of_range` where ``torch.cond`` cannot branch, None otherwise.

        That is while ``torch.compile`` traces a call that ``torch.cond`` cannot branch in
        (see :func:`_can_cond`). Not under ``torch.export``: an exported program holds only
        torch's own operators, so ONNX and other runtimes can take it.
        """
        compiling = torch.compiler.is_compiling() and not _exporting()
        return _attend_out_of_range if compiling and not _can_cond() else None

    #: SDPA adds the mask to the scores, so a NaN in a masked key spreads to every row (NaN + -inf);
    #: without a mask it gives a row whose query is NaN zeros. The core mends both.
    fused_propagates_nan = False

    def fused_attention(
        self,
        queries: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        visible: torch.Tensor | None,
        scale: float | torch.Tensor,
        dropout: float,
    ) -> torch.Tensor:
        """``matmul(dropout(softmax_visible(q k^T * scale, visible)), v)`` in one fused kernel.

        Args:
            queries: ``(B, H, Q, D)``.
            keys: ``(B, Hkv, K, D)``, Hkv dividing H.
            values: ``(B, Hkv, K, Dv)``.
            visible: Boolean, True = may attend, broadcastable to ``(B, H, Q, K)``; or None.
            scale: Multiplies the scores; a float, or a 0-d tensor when the depth is a run-time
                size (then folded into the queries).
            dropout: Dropout rate on the weights (0 for none).

        Returns:
            ``(B, H, Q, Dv)``; rows with no visible key are zero (torch's SDPA gives zeros
            there, checked by tests/test_torch.py).
        """
        if isinstance(scale, torch.Tensor):  # 1 / sqrt(D) of a depth traced as a tensor (jit.trace)
            queries, scale = queries * scale, 1.0
        if queries.shape[1] != keys.shape[1]:  # fewer key/value heads: SDPA's own GQA
            return F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=visible, dropout_p=dropout, scale=scale,
                enable_gqa=True,
            )
        return F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=visible, dropout_p=dropout, scale=scale
        )


def _exporting() -> bool:
    """Whether ``torch.export`` or ``torch.jit.trace`` is recording the call."""
    return bool(torch.compiler.is_exporting()
                or torch.jit.is_tracing())  # type: ignore[attr-defined, no-untyped-call]


def _can_cond() -> bool:
    """Whether ``torch.cond`` can pick the branch now: in a static ``torch.compile`` program.

    Only while ``torch.compile`` traces a call whose gradients are not wanted
    (``torch.no_grad``, ``torch.inference_mode``). Not where autograd records the call: the
    gradients of SDPA's inputs are laid out otherwise than the direct path's, which
    ``torch.cond``'s backward refuses. Not with ``dynamic=True``: Dynamo then makes the scale
    and the dropout rate symbolic floats, which ``torch.cond`` does not take from its branches.
    """
    if not torch.compiler.is_compiling():  # every eager call asks: answered by this alone
        return False
    static = getattr(torch._dynamo.config, "assume_static_by_default", True)
    return bool(static and not torch.is_grad_enabled())


def _compiled_cond(pred: torch.Tensor, if_true: Callable[[], Any], if_false: Callable[[], Any]) -> Any:
    """``torch.cond`` on the one-element ``pred``; each branch's tensors made contiguous.

    ``torch.cond`` needs both branches to give tensors of one layout, and SDPA lays out its
    output otherwise than a matrix product does.
    """
    def dense(branch: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            result = branch()
            if isinstance(result, tuple):
                return tuple(x.contiguous() for x in result)
            return result.contiguous()
        return run

    return torch.cond(torch.reshape(pred, ()), dense(if_true), dense(if_false))


def _attend_out_of_range(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
    visible: torch.Tensor | None, scale: float | torch.Tensor, dropout: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out_of_range, output)``: the core's bound failed, and the eager call then, else 0.

    ``output`` is the eager ``dot_product_attention`` of the inputs where the bound fails,
    zeros where it holds.
    One operator of the traced program (``attention_core::attend_out_of_range``), which
    checks the bound when it runs, on the host. Its gradient is zero for inputs in range;
    for others it runs the eager call again, under autograd, on the saved inputs. Dropout
    there draws its mask from a seed taken in the program, so both passes draw one mask.

    Args:
        queries: ``(B, H, Q, D)``.
        keys: ``(B, H, K, D)``.
        values: ``(B, H, K, Dv)``.
        visible: Boolean, True = may attend, broadcastable to ``(B, H, Q, K)``; or None.
        scale: Multiplies the scores; a 0-d tensor when it is ``1 / sqrt(D)`` of a depth
            traced as a size.
        dropout: Dropout rate on the weights (0 for none).

    Returns:
        A 0-d boolean tensor, and ``(B, H, Q, Dv)``.
    """
    B, H, Q, _ = queries.shape
    if visible is not None:
        visible = visible.expand(B, H, Q, keys.shape[2])
    seed = torch.randint(0, 2**62, (), dtype=torch.int64) if dropout > 0 else torch.zeros(
        (), dtype=torch.int64)
    factor = None if isinstance(scale, torch.Tensor) else scale  # None: 1 / sqrt(D) again
    out, out_of_range = torch.ops.attention_core.attend_out_of_range(
        queries, keys, values, visible, factor, dropout, seed)
    return out_of_range, out


@torch.library.custom_op("attention_core::attend_out_of_range", mutates_args=())
def _attend(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
    visible: torch.Tensor | None, scale: float | None, dropout: float, seed: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`_attend_out_of_range`."""
    if _in_range(queries, keys, values, scale):
        return _output_like(queries, values, 0.0), torch.zeros((), dtype=torch.bool)
    with torch.no_grad():  # contiguous, as the fake says (SDPA lays its output out otherwise)
        out = _eager_call(queries, keys, values, visible, scale, dropout, seed).contiguous()
    return out, torch.ones((), dtype=torch.bool)


@_attend.register_fake
def _(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
      visible: torch.Tensor | None, scale: float | None, dropout: float,
      seed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _output_like(queries, values, None), torch.empty((), dtype=torch.bool)


@torch.library.custom_op("attention_core::attend_out_of_range_backward", mutates_args=())
def _attend_backward(
    grad: torch.Tensor, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
    visible: torch.Tensor | None, scale: float | None, dropout: float, seed: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of :func:`_attend`'s inputs: zeros in range, else by its eager call.

    Out of range, the eager call runs again, under autograd. An operator's body runs below
    autograd's dispatch keys; the eager call is recorded by letting autograd back in for its
    span (a private torch guard: tests/test_torch.py's compiled training steps fail if it
    stops doing so).
    """
    if _in_range(queries, keys, values, scale):
        return queries.new_zeros(queries.shape), keys.new_zeros(keys.shape), values.new_zeros(
            values.shape)
    autograd_back = torch._C._SetExcludeDispatchKeyGuard(
        torch._C.DispatchKey.AutogradFunctionality, False)
    with autograd_back, torch.enable_grad():
        leaves = [x.detach().requires_grad_() for x in (queries, keys, values)]
        out = _eager_call(leaves[0], leaves[1], leaves[2], visible, scale, dropout, seed)
        dq, dk, dv = torch.autograd.grad(out, leaves, grad)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()  # as the fake says


@_attend_backward.register_fake
def _(grad: torch.Tensor, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
      visible: torch.Tensor | None, scale: float | None, dropout: float,
      seed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return queries.new_empty(queries.shape), keys.new_empty(keys.shape), values.new_empty(
        values.shape)


def _attend_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    queries, keys, values, visible, scale, dropout, seed = inputs
    ctx.save_for_backward(queries, keys, values, visible, seed)
    ctx.scale, ctx.dropout = scale, dropout


def _attend_gradient(ctx: Any, grad: torch.Tensor, _: torch.Tensor) -> tuple[Any, ...]:
    queries, keys, values, visible, seed = ctx.saved_tensors
    dq, dk, dv = _attend_backward(grad, queries, keys, values, visible, ctx.scale, ctx.dropout,
                                  seed)
    return dq, dk, dv, None, None, None, None


_attend.register_autograd(_attend_gradient, setup_context=_attend_context)


def _output_like(queries: torch.Tensor, values: torch.Tensor, fill: float | None) -> torch.Tensor:
    """``(B, H, Q, Dv)`` of the queries' dtype and device: ``fill``, or empty when None."""
    shape = (*queries.shape[:-1], values.shape[-1])
    return queries.new_empty(shape) if fill is None else queries.new_full(shape, fill)


def _in_range(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
              scale: float | None) -> bool:
    """The core's bound (``_inputs_in_range``), read on the host."""
    from attention_core.attention import _inputs_in_range, _scale_factor

    factor = _scale_factor(OPS, queries, scale)
    return bool(_inputs_in_range(OPS, queries, keys, values, factor).reshape(()))


def _eager_call(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
    visible: torch.Tensor | None, scale: float | None, dropout: float, seed: torch.Tensor,
) -> torch.Tensor:
    """The library's eager call, its dropout drawn from ``seed``.

    With dropout, the global generator is seeded from ``seed`` for the call's span, then put
    back as it was.
    """
    from attention_core.attention import dot_product_attention

    devices = [queries.device] if queries.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, enabled=dropout > 0):
        if dropout > 0:
            torch.manual_seed(int(seed))
        return cast(torch.Tensor, dot_product_attention(queries, keys, values, mask=visible,
                                                        scale=scale, dropout=dropout, ops=OPS))


#: Dtypes torch's layer norm kernel computes as the core does (statistics in the same dtype).
_WIDE_FLOATS = (torch.float32, torch.float64)

#: The default torch ops (used by the functional API for torch tensors).
OPS = TorchOps()
