"""The PyTorch implementation of the ops protocol: one torch call per method."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch
import torch._dynamo
import torch.nn.functional as F

from attention_core.kernels import (
    LOG,
    Capabilities,
    Request,
    Result,
    blockwise,
    query_spans,
    register_kernel,
)
from attention_core.kernels.direct import tile_visible, visible
from attention_core.modifiers import Causal
from attention_core.ops import NamespaceOps
from backends.torch import flex


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
            return autocasting(self.device.type)
        return autocasting("cpu") or autocasting("cuda")

    def from_numpy(self, x: np.ndarray, like: torch.Tensor | None = None) -> torch.Tensor:
        if torch.compiler.is_compiling():
            # The core's constant tables (sinusoidal encoding, clipped offsets) are NumPy code,
            # which Dynamo traces into tensors; it cannot trace a look at ``ndarray.dtype``.
            t = torch.as_tensor(x)
            if like is None:
                return t if self.device is None else t.to(self.device)
            return t.to(device=like.device, dtype=like.dtype if t.is_floating_point() else t.dtype)
        x = np.asarray(x)
        if x.dtype.kind == "V" and x.dtype.name == "bfloat16":  # ml_dtypes: widen exactly
            return torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16)
        t = torch.from_numpy(np.array(x, order="C", copy=True))
        if like is None:
            return t if self.device is None else t.to(self.device)
        dtype = like.dtype if t.is_floating_point() else t.dtype
        return t.to(device=like.device, dtype=dtype)

    def to_numpy(self, x: torch.Tensor) -> np.ndarray:
        x = x.detach()
        x = x if x.device.type == "cpu" else x.cpu()
        return (x.float() if x.dtype == torch.bfloat16 else x).numpy()

    def concrete(self, x: torch.Tensor) -> np.ndarray | None:
        if x.device.type != "cpu" or self.traced(x):  # on an accelerator (or meta): not read
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
        name = _DTYPE_NAMES.get(x.dtype)
        return str(x.dtype).removeprefix("torch.") if name is None else name

    def astype(self, x: torch.Tensor, dtype: str) -> torch.Tensor:
        return x.to(getattr(torch, dtype))

    def relu(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x)

    # The primitives that are one torch function taking the same arguments are that function
    # itself: a call costs no Python frame of ours (a decode step makes a few hundred). Their
    # parameters have torch's names, not the protocol's: they are passed by position.
    matmul = staticmethod(torch.matmul)  # type: ignore[assignment]
    exp = staticmethod(torch.exp)  # type: ignore[assignment]
    tanh = staticmethod(torch.tanh)  # type: ignore[assignment]
    sqrt = staticmethod(torch.sqrt)  # type: ignore[assignment]
    log = staticmethod(torch.log)  # type: ignore[assignment]
    logical_and = staticmethod(torch.logical_and)  # type: ignore[assignment]
    maximum = staticmethod(torch.maximum)  # type: ignore[assignment]
    transpose = staticmethod(torch.permute)  # type: ignore[assignment]
    expand_dims = staticmethod(torch.unsqueeze)  # type: ignore[assignment]
    slice = staticmethod(torch.narrow)
    concatenate = staticmethod(torch.cat)  # type: ignore[assignment]

    def where(self, cond: torch.Tensor, x: torch.Tensor, y: torch.Tensor | float) -> torch.Tensor:
        return torch.where(cond, x, y)

    def max(self, x: torch.Tensor, axis: int) -> torch.Tensor:
        return torch.amax(x, dim=axis, keepdim=True)

    def sum(self, x: torch.Tensor, axis: int) -> torch.Tensor:
        return torch.sum(x, dim=axis, keepdim=True)

    def mean(self, x: torch.Tensor, axis: int) -> torch.Tensor:
        return torch.mean(x, dim=axis, keepdim=True)

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

    def slice_update(self, x: torch.Tensor, axis: int, start: int,
                     new: torch.Tensor) -> torch.Tensor:
        return torch.slice_scatter(x, new, axis, start, start + new.shape[axis])

    def take(self, table: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        return F.embedding(indices, table)

    def stop_gradient(self, x: torch.Tensor) -> torch.Tensor:
        return x.detach()

    def dropout(self, x: torch.Tensor, rate: float) -> torch.Tensor:
        return F.dropout(x, rate, training=True)

    def array_key(self, x: Any) -> tuple[Any, ...] | None:
        """A plain tensor's type, shape, dtype, device and layout (a call plan's key); else None.

        None for anything else: tensor subclasses, nested tensors, other objects (see
        :func:`attention_core.declarations.call_key`).
        """
        if type(x) is not torch.Tensor or x.is_nested:
            return None
        return (x.shape, x.dtype, x.device, x.layout)

    def traced(self, x: torch.Tensor) -> bool:
        return _tracing() or _functorch(x)

    def placed(self, x: torch.Tensor) -> TorchOps:
        """Ops that make new arrays on ``x``'s device (these ones when that is theirs)."""
        device = x.device if isinstance(x, torch.Tensor) else None
        if device is None or device == self.device or (self.device is None
                                                        and device.type == "cpu"):
            return self
        return TorchOps(device)

    def cumsum(self, x: torch.Tensor, axis: int) -> torch.Tensor:
        return torch.cumsum(x, dim=axis)

    # -- sampling (attention_core.ops.SamplingOps): a torch.Generator is the state ----------

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        return torch.argmax(x, dim=-1)

    def sort_descending(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values, indices = torch.sort(x, dim=-1, descending=True, stable=True)
        return values, indices

    def new_sampling_state(self, seed: int, like: torch.Tensor | None = None) -> torch.Generator:
        """A ``torch.Generator`` seeded with ``seed``, on ``like``'s device (else the ops')."""
        device = like.device if isinstance(like, torch.Tensor) else self.device
        return torch.Generator(device=device or "cpu").manual_seed(seed)

    def uniform(self, shape: tuple[Any, ...],
                state: torch.Generator) -> tuple[torch.Tensor, torch.Generator]:
        # the Generator advances in place; torch.compile breaks its graph at this draw
        return torch.rand(shape, generator=state, device=state.device), state


    def silu(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(x)

    def erf(self, x: torch.Tensor) -> torch.Tensor:
        return torch.special.erf(x)

#: The names of the common dtypes, looked up rather than formed at every call.
_DTYPE_NAMES = {dtype: str(dtype).removeprefix("torch.") for dtype in (
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64,
    torch.bool)}


def autocasting(device_type: str) -> bool:
    """Whether ``torch.autocast`` is on for ``device_type`` (never for one it does not know: meta)."""
    try:
        return bool(torch.is_autocast_enabled(device_type))
    except RuntimeError:  # "unknown device type for autocast"
        return False


def _tracing() -> bool:
    """Whether ``torch.compile``, ``torch.export`` or ``torch.jit.trace`` records the call."""
    return bool(torch.compiler.is_compiling() or torch.compiler.is_exporting()
                or torch.jit.is_tracing())  # type: ignore[attr-defined, no-untyped-call]


_WRAPPED = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)


def _functorch(x: torch.Tensor) -> bool:
    """Whether ``x`` is a ``torch.func`` transform's tensor (no storage to read)."""
    return bool(_WRAPPED is not None and _WRAPPED(x))


def fused(ops: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
          request: Request) -> Result:
    """Pools with torch's ``scaled_dot_product_attention`` (SDPA): ``(B, H, Q, Dv)``.

    A call whose only mask is ``causal`` over as many queries as keys goes in as
    ``is_causal=True``, letting SDPA pick its fastest kernel, and one query (a decode step)
    at a known position as the keys up to it, unmasked; any other masks as one boolean
    ``attn_mask`` (always so, ``(B, 1, Q, K)``, for positions per example). Where the masks
    hide most key blocks from whole query blocks (packed documents, a window), SDPA runs once
    per query block on the keys it may see (:func:`attention_core.kernels.query_spans`). Fewer
    key/value heads go in as SDPA's own grouped-query heads. Rows with no visible key come out
    as zeros (torch's SDPA gives zeros there, checked by tests/test_torch.py).
    """
    masks, offset = request.masks, request.call.offset
    if len(masks) == 1 and isinstance(masks[0], Causal) and not request.call.per_example:
        if _zero(offset):
            return Result(_sdpa(q, k, v, None, request, causal=True))
        if q.shape[2] == 1 and type(offset) is int and offset > 0:  # one query: keys up to it
            return Result(_sdpa(q, k[:, :, :offset + 1], v[:, :, :offset + 1], None, request))
    cut = masks and not request.traced and not request.call.per_example
    spans = query_spans(request, SPAN_BLOCK) if cut else None
    if spans is None:
        return Result(_sdpa(q, k, v, visible(request), request))
    parts = []
    for q0, qn, k0, kn in spans:
        mask = tile_visible(request, request.call.tile(q0, qn, k0, kn))
        parts.append(_sdpa(q[:, :, q0:q0 + qn], k[:, :, k0:k0 + kn], v[:, :, k0:k0 + kn],
                           mask, request))
    return Result(parts[0] if len(parts) == 1 else torch.cat(parts, 2))


#: Queries per block when SDPA runs block by block on each block's keys.
SPAN_BLOCK = 128


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
          request: Request, causal: bool = False) -> torch.Tensor:
    """One SDPA call with the request's scale and dropout."""
    scale = request.scale
    if isinstance(scale, torch.Tensor):  # 1 / sqrt(D) of a depth traced as a tensor (jit.trace)
        q, scale = q * scale, 1.0
    # SDPA takes a bool for enable_gqa, not the SymBool of sizes traced as symbols: a branch
    gqa = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=request.dropout,
                                          is_causal=causal, scale=scale, **gqa)


def _zero(n: Any) -> bool:
    """Whether ``n`` is 0, as a bool (SDPA takes no SymBool).

    A size traced as a symbol is compared by a branch, which Dynamo guards; a tensor (a
    run-time position) is not known to be 0.
    """
    if isinstance(n, torch.Tensor):
        return False
    if n == 0:  # noqa: SIM103 (``return n == 0`` gives a SymBool)
        return True
    return False


def prefers_fused(ops: Any, request: Request) -> bool:
    """SDPA, except in a program recorded for export (``torch.export``, ``torch.jit.trace``).

    An exported program then holds the direct kernel's plain operators, which ONNX and other
    runtimes take (``implementation="fused"`` is taken as given).
    """
    return not (torch.compiler.is_exporting()
                or torch.jit.is_tracing())  # type: ignore[attr-defined, no-untyped-call]


def prefers_blockwise(ops: Any, request: Request) -> bool:
    """From :data:`~attention_core.kernels.blockwise.MIN_SCORES` scores, in eager calls only.

    In a traced program the direct kernel is taken: Dynamo would unroll the blockwise loops
    into the program, and Inductor cannot lay out their blocks once the lengths are symbolic.
    """
    return not _tracing() and blockwise.enough_scores(request, blockwise.MIN_SCORES)


register_kernel("fused", fused, Capabilities(scores=frozenset(), ragged=True), backend="torch",
                priority=20, prefers=prefers_fused)
register_kernel("blockwise", blockwise.blockwise, blockwise.CAPABILITIES, backend="torch",
                priority=10, prefers=prefers_blockwise)
flex.register()


def _ignored_logging() -> set[Any]:
    """The logging functions Dynamo skips (``ignore_logger_methods`` in older torch)."""
    config = torch._dynamo.config
    found = getattr(config, "ignore_logging_functions", None)
    return found if found is not None else getattr(config, "ignore_logger_methods", set())


# Dynamo cannot trace a logger's methods (a whole-graph torch.compile fails on them): there the
# kernel choice, logged at DEBUG level in eager calls, goes unlogged.
_ignored_logging().add(LOG.isEnabledFor)


#: Dtypes torch's layer norm kernel computes as the core does (statistics in the same dtype).
_WIDE_FLOATS = (torch.float32, torch.float64)

#: The default torch ops (used by the functional API for torch tensors).
OPS = TorchOps()
