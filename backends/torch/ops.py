"""The PyTorch implementation of the ops protocol: one torch call per method."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

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

    def take(self, table: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        return F.embedding(indices, table)

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

    @property
    def blockwise_min_scores(self) -> float:
        """Scores from which the automatic choice pools blockwise: none inside ``torch.cond``.

        There the branch a failed bound takes is the direct path: Dynamo would unroll the
        blockwise loops into the program, and Inductor cannot lay out their blocks once the
        lengths are symbolic (a compiled layer called with a second length).
        """
        return math.inf if _can_cond() else BLOCKWISE_MIN_SCORES

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
            keys: ``(B, H, K, D)``.
            values: ``(B, H, K, Dv)``.
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
        return F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=visible, dropout_p=dropout, scale=scale
        )


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


#: The default torch ops (used by the functional API for torch tensors).
OPS = TorchOps()
