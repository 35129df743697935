"""The MXNet implementation of the ops protocol, over MXNet's NumPy interface.

One array API is used throughout: ``mxnet.numpy`` / ``mxnet.npx`` (imperative arrays) and
their symbolic twins ``mxnet.symbol.numpy`` / ``mxnet.symbol.npx`` (graphs of a hybridized
block). That interface has a real ``bool`` dtype, which the core's masks need. It is switched
on process-wide by importing :mod:`backends.mxnet` (``npx.set_np()``).

A :class:`MXNetOps` made without ``symbols`` works on ``mxnet.numpy.ndarray``; one made with
``symbols`` builds a graph: its methods return Symbols, and the shapes and dtypes the core
asks for are inferred from the known shapes and dtypes of the graph's inputs (``symbols``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import mxnet as mx
import numpy as np

from attention_core.kernels import Request, blockwise, register_kernel
from attention_core.ops import NamespaceOps

Symbol = mx.sym.Symbol


class GlobalSeed(NamedTuple):
    """The sampling state of MXNet: the seed given to its global generator, and the device."""

    seed: int
    ctx: Any


#: The integer dtypes MXNet arrays can have (others are converted to int64, values kept).
_INTEGERS = ("int8", "uint8", "int32", "int64")


class MXNetOps(NamespaceOps):
    """``mxnet.numpy`` arrays, or Symbols when ``symbols`` is given.

    Args:
        symbols: For graph building: the name of every input variable of the graph (data and
            parameters) -> its ``(shape, dtype name)``. None for imperative arrays.
    """

    name = "mxnet"

    @property
    def blockwise_min_scores(self) -> int:
        """Scores from which the automatic choice takes the blockwise path.

        Inference: from any size, since as on NumPy it is the faster path from n = 128 (8
        heads: 8 against 4 GFLOP/s; 24 against 9 at n = 512). Training (imperative calls under
        ``autograd.record()`` in training mode): the core's default, since the blockwise
        backward recomputes each block in Python (``recompute_blocks``).
        """
        if not self.symbolic and mx.autograd.is_recording() and mx.autograd.is_training():
            return blockwise.MIN_SCORES
        return 0

    def __init__(self, symbols: Mapping[str, tuple[tuple[int, ...], str]] | None = None) -> None:
        self.symbolic = symbols is not None
        self._known = dict(symbols or {})
        self.xp: Any = mx.sym.np if self.symbolic else mx.np
        self.npx: Any = mx.sym.npx if self.symbolic else mx.npx

    #: Largest NumPy array :meth:`from_numpy` turns into a Symbol (one graph node per value).
    SYMBOL_CONSTANT_SIZE = 512

    @property
    def host_tables(self) -> bool:
        """Whether tables made on the host can enter the computation (not in a graph of Symbols).

        A graph takes only small constants (:meth:`from_numpy`); the core then makes its
        tables in the graph (rotary angles with :meth:`cos` and :meth:`sin` in float64).
        """
        return not self.symbolic

    def cos(self, x: Any) -> Any:
        return self.xp.cos(x)

    def sin(self, x: Any) -> Any:
        return self.xp.sin(x)

    def from_numpy(self, x: np.ndarray, like: Any = None) -> Any:
        x = np.asarray(x)
        if self.symbolic:
            if x.size > self.SYMBOL_CONSTANT_SIZE or x.dtype.kind not in "fiub":
                raise TypeError("MXNetOps: cannot turn a NumPy array into a Symbol; pass arrays "
                                "as inputs")
            kind = self.dtype_name(like) if like is not None and x.dtype.kind == "f" else (
                "bool" if x.dtype.kind == "b" else x.dtype.name)
            values = [self.xp.full((1,), v.item(), dtype=kind) for v in x.reshape(-1)]
            flat = values[0] if len(values) == 1 else self.xp.concatenate(values, axis=0)
            return flat.reshape(x.shape)
        if x.dtype.kind in "iu" and x.dtype.name not in _INTEGERS:  # int16, uint64, ...: int64
            if x.dtype == np.uint64:  # values beyond int64 (refused by any range check) saturate
                x = np.minimum(x, np.uint64(np.iinfo(np.int64).max))
            x = x.astype(np.int64)
        dtype = like.dtype if like is not None and x.dtype.kind == "f" else x.dtype
        ctx = like.ctx if like is not None else None
        return mx.np.array(x, dtype=dtype, ctx=ctx)

    def matmul_refusal(self, x: Any) -> str | None:
        """Why MXNet cannot multiply matrices like ``x``: float16 on CPU (see ``checks``)."""
        on_cpu = not isinstance(x, Symbol) and x.ctx.device_type == "cpu"
        if on_cpu and np.dtype(x.dtype).name == "float16":
            return "MXNet multiplies float16 matrices on GPU only; use float32 or float64 on CPU"
        return None

    def to_numpy(self, x: Any) -> np.ndarray:
        return x.asnumpy() if isinstance(x, mx.np.ndarray) else np.asarray(x)

    def concrete(self, x: Any) -> np.ndarray | None:
        return None if isinstance(x, Symbol) or x.ctx.device_type != "cpu" else self.to_numpy(x)

    def traced(self, x: Any) -> bool:
        return isinstance(x, Symbol)

    def shape(self, x: Any) -> tuple[int, ...]:
        if not isinstance(x, Symbol):
            return tuple(x.shape)
        _, (shape,), _ = x.infer_shape_partial(**self._inputs(x, 0))
        if shape is None or any(d < 0 for d in shape):
            raise TypeError(
                "MXNetOps: the shape of a Symbol could not be inferred from its inputs; the "
                "layers of backends.mxnet build their graph from NDArray inputs of known shapes"
            )
        return tuple(int(d) for d in shape)

    def dtype_name(self, x: Any) -> str:
        if not isinstance(x, Symbol):
            return np.dtype(x.dtype).name
        _, (dtype,), _ = x.infer_type_partial(**self._inputs(x, 1))
        return np.dtype(dtype).name

    def astype(self, x: Any, dtype: str) -> Any:
        return x.astype(dtype) if isinstance(x, Symbol) else x.astype(dtype, copy=False)

    def relu(self, x: Any) -> Any:
        return self.npx.relu(x)

    def where(self, cond: Any, x: Any, y: Any) -> Any:
        if isinstance(y, (int, float)):  # MXNet 1.9's where(cond, x, scalar) has a wrong gradient
            y = self.xp.full_like(x, y)
        return self.xp.where(cond, x, y)

    def logical_and(self, a: Any, b: Any) -> Any:
        return a * b  # boolean product; MXNet 1.9 has no logical_and and no boolean bitwise_and

    def reshape(self, x: Any, shape: tuple[Any, ...]) -> Any:
        return self.xp.reshape(x, tuple(int(d) for d in shape))

    def slice(self, x: Any, axis: int, start: Any, size: int) -> Any:
        return x[(slice(None),) * axis + (slice(int(start), int(start) + size),)]

    def concatenate(self, xs: list[Any], axis: int) -> Any:
        return self.xp.concatenate(xs, axis=axis)

    def arange(self, n: Any) -> Any:
        return self.xp.arange(int(n), dtype="int32")

    def recompute_blocks(
        self, fn: Callable[..., Any], blocks: list[tuple[int, int]], k_block: int, queries: Any,
        keys: Any, values: Any,
    ) -> Any:
        # autograd.record() keeps every op of the blockwise loops for the backward pass; this
        # keeps the inputs instead and recomputes one block at a time there. Graphs (Symbols)
        # and calls outside record() are left to the blockwise loops.
        if self.symbolic or not mx.autograd.is_recording():
            return None  # nothing kept: the loops as they are
        # MXNet routes an autograd.Function's gradients wrongly (zeros, or memory never
        # written) to an input that is not in the recorded graph (keys that need no
        # gradient, say): such an input is tied to a throwaway variable (x + 0 * anchor).
        # Inputs already in the graph go as they are, with no copy.
        anchor = mx.np.zeros((), dtype=queries.dtype, ctx=queries.ctx)
        anchor.attach_grad()
        tied = [x if _recorded(x) else x + 0 * anchor for x in (queries, keys, values)]
        return _Recomputed(fn, blocks, k_block)(*tied)

    def softmax(self, x: Any) -> Any:
        return self.npx.softmax(x, axis=-1)  # optional hook: one kernel for the direct path's

    def matmul_transposed(self, a: Any, b: Any) -> Any:
        # batch_dot reads b transposed; np.transpose would copy it (and autograd keep the copy)
        return self.npx.batch_dot(a, b, transpose_b=True)

    def layer_norm(self, x: Any, gamma: Any, beta: Any, eps: float) -> Any:
        # Gluon's LayerNorm operator: one forward and one backward instead of a chain of
        # elementwise ops; float32 and float64 alike only (the core takes narrow dtypes)
        dtypes = {self.dtype_name(a) for a in (x, gamma, beta)}
        if dtypes not in ({"float32"}, {"float64"}):
            return None
        return self.npx.layer_norm(x, gamma, beta, axis=-1, eps=eps)

    def stop_gradient(self, x: Any) -> Any:
        return x if self.symbolic else x.detach()  # a graph (Symbol) is differentiated whole

    def dropout(self, x: Any, rate: float) -> Any:
        # Active only while recording in training mode (autograd.record()), as Gluon does.
        return self.npx.dropout(x, p=rate)

    def _inputs(self, x: Any, field: int) -> dict[str, Any]:
        """The known shapes (field 0) or dtypes (field 1) of the inputs ``x`` depends on."""
        return {n: self._known[n][field] for n in x.list_arguments() if n in self._known}

    def cumsum(self, x: Any, axis: int) -> Any:
        return self.xp.cumsum(x, axis=axis)

    # -- sampling (attention_core.ops.SamplingOps): MXNet's global generator ----------------

    def argmax(self, x: Any) -> Any:
        return self.xp.argmax(x, axis=-1)

    def sort_descending(self, x: Any) -> tuple[Any, Any]:
        values, indices = self.npx.topk(x, axis=-1, k=self.shape(x)[-1], ret_typ="both",
                                        is_ascend=False, dtype="int64")
        return values, indices

    def new_sampling_state(self, seed: int, like: Any = None) -> GlobalSeed:
        """Seeds MXNet's GLOBAL generator (``mx.random.seed``), which every draw shares.

        The state only records the seed and the device to draw on: another draw in between
        (dropout, ``mx.np.random``) changes what the next sample gets.
        """
        mx.random.seed(seed)
        return GlobalSeed(seed, like.ctx if like is not None else mx.context.current_context())

    def uniform(self, shape: tuple[int, ...], state: GlobalSeed) -> tuple[Any, GlobalSeed]:
        return self.xp.random.uniform(0, 1, size=shape, ctx=state.ctx), state

    def silu(self, x: Any) -> Any:
        return x * self.npx.sigmoid(x)

    def erf(self, x: Any) -> Any:
        return self.npx.erf(x)


class _Recomputed(mx.autograd.Function):
    """Blockwise attention whose query blocks are recomputed, one at a time, in the backward.

    The forward runs ``fn(b, q_b, keys, values)`` for each block ``b`` of queries with
    recording paused, keeping only the inputs; the backward runs each block again under
    ``autograd.record()`` on the keys and values split into key blocks, differentiates it, and
    sums each key block's gradients as it goes. Key blocks, each its own array, get gradients
    of their own size: MXNet's gradient of a slice of the whole keys is an array of the whole
    keys' size, one per slice and query block, which took 885 s and 823 MiB at (1, 4, 16384,
    64). One instance per call (MXNet's rule for ``autograd.Function``).
    """

    def __init__(self, fn: Callable[..., Any], blocks: list[tuple[int, int]], k_block: int) -> None:
        super().__init__()
        self.fn, self.blocks, self.k_block = fn, blocks, k_block

    def forward(self, queries: Any, keys: Any, values: Any) -> Any:
        self.save_for_backward(queries, keys, values)
        out = mx.np.empty(queries.shape[:3] + values.shape[3:], dtype=values.dtype,
                          ctx=values.ctx)
        for b, (q0, qn) in enumerate(self.blocks):
            out[:, :, q0 : q0 + qn] = self.fn(b, queries[:, :, q0 : q0 + qn], keys, values)
            _settle(out)
        return out

    def backward(self, d_out: Any) -> Any:
        queries, keys, values = self.saved_tensors
        d_out = d_out.as_np_ndarray()  # MXNet hands gradients over as legacy NDArrays
        k_blocks, v_blocks = (_split(x, self.k_block) for x in (keys, values))
        for x in (*k_blocks, *v_blocks):  # each query block's gradient adds to the last's
            x.attach_grad(grad_req="add")  # (zeros first: a block all skip gets nothing)
        d_q = mx.np.empty_like(queries)
        for b, (q0, qn) in enumerate(self.blocks):
            q = queries[:, :, q0 : q0 + qn].detach()
            q.attach_grad()
            with mx.autograd.record(train_mode=False):
                out = self.fn(b, q, k_blocks, v_blocks)
            out.backward(d_out[:, :, q0 : q0 + qn])
            d_q[:, :, q0 : q0 + qn] = q.grad
            _settle(d_q)
        del out  # its graph holds the key blocks
        return (d_q.as_nd_ndarray(), _joined(k_blocks), _joined(v_blocks))


def _joined(blocks: list[Any]) -> Any:
    """The gradients of ``blocks`` concatenated along the keys.

    ``blocks`` is emptied first, so that the blocks are freed before the whole gradient is made.
    """
    grads = [x.grad for x in blocks]
    blocks.clear()
    return (grads[0] if len(grads) == 1 else mx.np.concatenate(grads, axis=2)).as_nd_ndarray()


def _split(x: Any, size: int) -> list[Any]:
    """``x`` cut along the keys into blocks of ``size``, each its own array with no history."""
    if size >= x.shape[2]:
        return [x.detach()]  # one block: the array itself, not a copy
    return [x[:, :, k0 : k0 + size].detach() for k0 in range(0, x.shape[2], size)]


def _recorded(x: Any) -> bool:
    """Whether ``x`` is in the graph being recorded (a variable, or an operator's output)."""
    try:
        mx.autograd.get_symbol(x)
    except mx.base.MXNetError:
        return False
    return True


def _settle(x: Any) -> None:
    """Waits for ``x``'s pending writes.

    The engine runs asynchronously: a Python loop that does not wait queues every block's
    operators, each with its output's memory, at once. At (1, 4, 16384, 64) the forward's
    blocks held 380 MiB that way.
    """
    x.wait_to_read()


#: The default MXNet ops, on imperative ``mxnet.numpy`` arrays (used by the functional API).
OPS = MXNetOps()


def _prefers_blockwise(ops: Any, request: Request) -> bool:
    """From :attr:`MXNetOps.blockwise_min_scores` scores on."""
    return blockwise.enough_scores(request, ops.blockwise_min_scores)


register_kernel("blockwise", blockwise.blockwise, blockwise.CAPABILITIES, backend="mxnet",
                priority=10, prefers=_prefers_blockwise)
