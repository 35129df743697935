"""The ops protocol: the primitives the core is written against.

Every backend supplies one class that satisfies :class:`Ops`. The core never imports a
framework; it calls these methods and the ordinary Python operators (``+ - * / < <=`` and
basic slicing), which every supported array type implements with NumPy semantics.

Semantics are stated for NumPy. Shape legend used throughout the package: B batch, H heads,
Q queries, K keys, D depth (Dv value depth).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import numpy as np

#: A backend's own array type (``numpy.ndarray``, ``torch.Tensor``, ``tf.Tensor``, ...).
Array = Any

#: Dtype names the core understands, as NumPy (and ml_dtypes) spell them.
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")



class NamespaceOps:
    """The primitives that a NumPy-like array namespace ``xp`` spells as NumPy does.

    A backend whose framework has such a namespace (``numpy``, ``jax.numpy``, ``torch``) sets
    ``xp`` and inherits these, defining the rest of :class:`Ops` itself (and overriding any
    primitive its namespace spells differently).
    """

    #: The array namespace: a module with NumPy's names and semantics for these primitives.
    xp: Any

    def exp(self, x: Array) -> Array:
        return self.xp.exp(x)

    def tanh(self, x: Array) -> Array:
        return self.xp.tanh(x)

    def sqrt(self, x: Array) -> Array:
        return self.xp.sqrt(x)

    def log(self, x: Array) -> Array:
        return self.xp.log(x)

    def logical_and(self, a: Array, b: Array) -> Array:
        return self.xp.logical_and(a, b)

    def maximum(self, a: Array, b: Array) -> Array:
        return self.xp.maximum(a, b)

    def matmul(self, a: Array, b: Array) -> Array:
        return self.xp.matmul(a, b)

    def reshape(self, x: Array, shape: tuple[Any, ...]) -> Array:
        return self.xp.reshape(x, shape)

    def max(self, x: Array, axis: int) -> Array:
        return self.xp.max(x, axis=axis, keepdims=True)

    def sum(self, x: Array, axis: int) -> Array:
        return self.xp.sum(x, axis=axis, keepdims=True)

    def mean(self, x: Array, axis: int) -> Array:
        return self.xp.mean(x, axis=axis, keepdims=True)

    def transpose(self, x: Array, axes: tuple[int, ...]) -> Array:
        return self.xp.transpose(x, axes)

    def expand_dims(self, x: Array, axis: int) -> Array:
        return self.xp.expand_dims(x, axis)

    def concatenate(self, xs: list[Array], axis: int) -> Array:
        return self.xp.concatenate(xs, axis)

    def take(self, table: Array, indices: Array) -> Array:
        return self.xp.take(table, indices, axis=0)

@runtime_checkable
class Ops(Protocol):
    """Array primitives used by the core, one method per primitive.

    Ops may also set ``mixes_dtypes: bool`` (False when absent): True while the framework
    casts the operands of some primitives itself, as ``torch.autocast`` runs the matrix
    products in bfloat16 or float16. Arrays of different floating dtypes then meet: the core
    does not reject them (:func:`~attention_core.checks.check_same_dtype`), they combine by the
    framework's type promotion, a bias is added in its product's dtype, and layer
    normalisation of a float16 or bfloat16 sum computes its statistics in float32 (see
    :func:`~attention_core.transformer.add_norm`).

    Attributes:
        name: The canonical backend name (``"numpy"``, ``"torch"``, ...).
    """

    name: str

    # -- conversion and introspection -------------------------------------------------

    def from_numpy(self, x: np.ndarray, like: Array | None = None) -> Array:
        """Converts a NumPy array into a backend array.

        Like ``np.asarray(x)``; with ``like``, the result also takes ``like``'s floating
        dtype (when ``x`` is floating) and device.
        """
        ...

    def to_numpy(self, x: Array) -> np.ndarray:
        """Returns the values of ``x`` as a NumPy array (``np.asarray(x)``)."""
        ...

    def concrete(self, x: Array) -> np.ndarray | None:
        """Returns the values of ``x`` if reading them costs no transfer, else ``None``.

        Values are read only when they are known now and already in host memory (NumPy, a
        torch or TensorFlow tensor on the CPU). ``None`` under tracing (``jax.jit``,
        ``tf.function``, ``torch.compile``, a hybridized Gluon block), for arrays on an
        accelerator, and for every JAX array: value checks are then skipped (or done on the
        device), shape checks still run. No default call waits for a device because of it.
        """
        ...

    def traced(self, x: Array) -> bool:
        """Whether ``x`` is a placeholder of a program being traced (no values, ever)."""
        ...

    def shape(self, x: Array) -> tuple[Any, ...]:
        """Returns ``x.shape`` as a tuple; a dimension unknown until run time may be a tensor."""
        ...

    def dtype_name(self, x: Array) -> str:
        """Returns the dtype as NumPy spells it: ``"float32"``, ``"bfloat16"``, ``"int64"``, ``"bool"``."""
        ...

    def astype(self, x: Array, dtype: str) -> Array:
        """Returns ``x.astype(dtype)``, ``dtype`` given by name as in :meth:`dtype_name`."""
        ...

    # -- elementwise ------------------------------------------------------------------

    def exp(self, x: Array) -> Array:
        """Returns ``np.exp(x)``."""
        ...

    def tanh(self, x: Array) -> Array:
        """Returns ``np.tanh(x)``."""
        ...

    def log(self, x: Array) -> Array:
        """Natural logarithm, elementwise (``log 0 = -inf``)."""
        ...

    def sqrt(self, x: Array) -> Array:
        """Returns ``np.sqrt(x)``."""
        ...

    def relu(self, x: Array) -> Array:
        """Returns ``np.maximum(x, 0)``."""
        ...

    def where(self, cond: Array, x: Array, y: Array | float) -> Array:
        """Returns ``np.where(cond, x, y)`` with broadcasting.

        ``y`` may be a Python float, taken in ``x``'s dtype.
        """
        ...

    def logical_and(self, a: Array, b: Array) -> Array:
        """Returns ``np.logical_and(a, b)`` with broadcasting."""
        ...

    def maximum(self, a: Array, b: Array) -> Array:
        """Returns ``np.maximum(a, b)`` with broadcasting."""
        ...

    # -- reductions ---------------------------------------------------------------------

    def max(self, x: Array, axis: int) -> Array:
        """Returns ``np.max(x, axis=axis, keepdims=True)``."""
        ...

    def sum(self, x: Array, axis: int) -> Array:
        """Returns ``np.sum(x, axis=axis, keepdims=True)``."""
        ...

    def mean(self, x: Array, axis: int) -> Array:
        """Returns ``np.mean(x, axis=axis, keepdims=True)``."""
        ...

    # -- shapes -------------------------------------------------------------------------

    def matmul(self, a: Array, b: Array) -> Array:
        """Returns ``np.matmul(a, b)``: batched over the leading axes, broadcasting them."""
        ...

    def reshape(self, x: Array, shape: tuple[Any, ...]) -> Array:
        """Returns ``np.reshape(x, shape)``; one entry may be ``-1``."""
        ...

    def transpose(self, x: Array, axes: tuple[int, ...]) -> Array:
        """Returns ``np.transpose(x, axes)``."""
        ...

    def expand_dims(self, x: Array, axis: int) -> Array:
        """Returns ``np.expand_dims(x, axis)``."""
        ...

    def slice(self, x: Array, axis: int, start: Any, size: int) -> Array:
        """Returns ``x[..., start : start + size, ...]`` along ``axis``.

        ``size`` is an int; ``start`` may be a run-time scalar (a loop index under tracing).
        """
        ...

    def concatenate(self, xs: list[Array], axis: int) -> Array:
        """Returns ``np.concatenate(xs, axis)``."""
        ...

    def arange(self, n: Any) -> Array:
        """Returns ``np.arange(n, dtype=np.int32)``; ``n`` may be a run-time scalar."""
        ...

    def take(self, table: Array, indices: Array) -> Array:
        """Returns ``np.take(table, indices, axis=0)``, an embedding lookup.

        Rows of ``table`` ``(V, D)`` picked by an integer array of any shape S, giving
        ``S + (D,)``. Indices are checked by the caller; the gradient flows to ``table``.
        """
        ...

    # -- randomness ---------------------------------------------------------------------

    def dropout(self, x: Array, rate: float) -> Array:
        """Inverted dropout: zeroes each entry with probability ``rate``, scales the rest.

        The kept entries are multiplied by ``1 / (1 - rate)``. Only called with
        ``0 < rate < 1``; the randomness is the backend's own (a NumPy ``Generator``, torch's
        global RNG, a JAX key, ...).
        """
        ...

    # -- scans --------------------------------------------------------------------------

    def cumsum(self, x: Array, axis: int) -> Array:
        """Returns ``np.cumsum(x, axis)`` of an integer array (the integer dtype may widen)."""
        ...


# A framework's fused attention kernel is not an ops method: its adapter registers it as a
# kernel ("fused") with its capabilities (attention_core.kernels.register_kernel). Any ops may
# define ``softmax(x)`` (over the last axis), a one-kernel softmax the direct kernel then uses.


class LoopOps(Ops, Protocol):
    """Optional: ops that run the blockwise path's loops as compiled loops.

    Without these methods the core loops in Python, which is what eager frameworks want;
    a tracing framework supplies them so a long sequence does not unroll into a huge graph.
    A body is traced once, so the ops must make the dropout calls inside it draw a fresh mask
    in every iteration (JAX folds the loop index into its key). Differentiated, a loop should
    recompute its body in the backward pass rather than keep every iteration's intermediates
    (every tile of scores): JAX wraps the bodies in ``jax.checkpoint``.
    """

    def fold(self, body: Callable[[Any, Any], Any], init: Any, n: int) -> Any:
        """Returns ``carry`` after ``carry = body(i, carry)`` for ``i = 0 .. n - 1``.

        ``carry`` is a tuple of arrays of fixed shapes; ``i`` may be a run-time scalar.
        """
        ...

    def map_concat(self, fn: Callable[[Any], Array], n: int, axis: int) -> Array:
        """Returns ``np.concatenate([fn(i) for i in range(n)], axis)``; ``i`` may be a run-time scalar."""
        ...


class RecomputeOps(Ops, Protocol):
    """Optional: ops whose autodiff would keep every tile, and that recompute the blockwise path.

    A tape that records every op (TensorFlow's ``tf.GradientTape``, MXNet's
    ``autograd.record()``), or the gradient of a traced loop that keeps every iteration's
    intermediates (TensorFlow's ``tf.while_loop`` in ``tf.function``), would keep every tile
    of the blockwise loops for the backward pass: O(Q * K) memory. With this hook the path
    keeps only its inputs and recomputes its query blocks one at a time in the backward pass
    (the checkpointing of Rabe & Staats, 2021), so the backward holds one block's tiles,
    ``q_block * K * B * H`` scores, within :data:`~attention_core.kernels.blockwise.TILE_SCORES`.
    It is not used under dropout, whose recomputation would draw another mask. JAX needs no
    hook: its loop ops (``fold``, ``map_concat``) rematerialise their bodies with
    ``jax.checkpoint``, which recomputes the tiles under its compiled gradient. Nor does
    torch: it trains on SDPA by default, whose backward recomputes the weights itself.
    """

    def recompute_blocks(
        self, fn: Callable[[Any, Array, list[Array], list[Array]], Array],
        blocks: list[tuple[int, int]], k_block: int, queries: Array, keys: Array, values: Array,
    ) -> Array | None:
        """Returns the blocks' outputs concatenated along the queries, or None where it does not apply.

        Args:
            fn: ``fn(b, q_b, key_blocks, value_blocks)`` is block ``b``'s output
                ``(B, H, qn, Dv)``, where ``q_b`` is ``queries[:, :, q0 : q0 + qn]`` with
                ``(q0, qn) = blocks[b]``; ``b`` may be a run-time scalar (in a traced loop)
                for a block of the first block's size ``n``, then ``(q0, qn) = (b * n, n)``.
                ``key_blocks`` lists the keys split along axis 2 into blocks of ``k_block``
                (the last one shorter), ``value_blocks`` the values alike; or the whole keys
                and values, as arrays, if the ops prefer them. Given lists, the ops' ``fold``
                (if any) must run the key blocks with Python indices while ``fn`` runs. The
                masks and the scale reach it by closure and get no gradient.
            blocks: ``(q0, qn)`` of each block, in order, covering the queries.
            k_block: Keys per block of ``key_blocks``. The ops differentiate with respect to
                the blocks, each a separate array, since the gradient of a slice of the whole
                keys would be an array of the whole keys' size per slice.
            queries: ``(B, H, Q, D)``.
            keys: ``(B, H, K, D)``.
            values: ``(B, H, K, Dv)``.

        Returns:
            ``(B, H, Q, Dv)``, whose gradients with respect to ``queries``, ``keys`` and
            ``values`` are those of the query blocks recomputed one at a time, the key and
            value blocks' gradients summed over the query blocks as they come. None where the
            ops do not recompute (e.g. no gradient can be recorded): the blockwise path then
            loops as without the hook.
        """
        ...


class InPlaceOps(Ops, Protocol):
    """Optional: ops that can reuse a temporary's memory (NumPy, which has no autograd).

    The blockwise path calls ``exp_diff`` on score tiles it never reads again, so a backend
    may compute it in place and save a tile-sized allocation and a pass over memory.
    """

    def exp_diff(self, x: Array, y: Array) -> Array:
        """Returns ``np.exp(x - y)`` (``y`` broadcast); may overwrite ``x`` with the result."""
        ...


class SliceUpdateOps(Ops, Protocol):
    """Optional: ops that replace a slice of an array in one operation (torch).

    A cached call writes its rows at a position known now with it, instead of two slices and
    a concatenation.
    """

    def slice_update(self, x: Array, axis: int, start: int, new: Array) -> Array:
        """Returns a new ``x`` with ``[start, start + n)`` along ``axis`` replaced by ``new``."""
        ...


class StopGradientOps(Ops, Protocol):
    """Optional: ops with autodiff, whose ``stop_gradient`` keeps an array out of it.

    The blockwise path's running maximum only keeps the exponentials in range: the output does
    not depend on it, so no gradient flows through it in exact arithmetic. Taking it from
    ``stop_gradient(scores)`` saves the maximum's backward, and under a recording autodiff
    the score tile kept for it.
    """

    def stop_gradient(self, x: Array) -> Array:
        """Returns ``x``'s values, with no gradient flowing back to ``x``."""
        ...


class ProductOps(Ops, Protocol):
    """Optional: ops with a product against a transposed operand that copies nothing (MXNet).

    Scores are ``q @ k^T``. Where ``transpose`` makes a copy, :func:`matmul_transposed` calls
    ``matmul_transposed`` instead, which saves that copy and, under a recording autodiff, the
    copy kept for the backward pass.
    """

    def matmul_transposed(self, a: Array, b: Array) -> Array:
        """Returns ``a @ b^T`` for ``a (B, H, M, D)`` and ``b (B, H, N, D)``: ``(B, H, M, N)``."""
        ...


def matmul_transposed(ops: Ops, a: Array, b: Array) -> Array:
    """``a @ b^T`` for ``a (B, H, M, D)`` and ``b (B, H, N, D)``, by the ops' own where they have it."""
    method = getattr(ops, "matmul_transposed", None)  # ProductOps
    if method is not None:
        return method(a, b)
    return ops.matmul(a, ops.transpose(b, (0, 1, 3, 2)))


class LinearOps(Ops, Protocol):
    """Optional: ops with one kernel each for a dense layer and a layer normalisation (torch).

    :func:`attention_core.linear.dense` calls ``linear`` when a bias is given, instead of a
    product and an addition, which saves a pass over the output and an op per layer.
    :func:`attention_core.linear.layer_norm` calls ``layer_norm`` and takes its result unless
    it is None: one kernel forward and one backward instead of a chain of elementwise ops.
    """

    def layer_norm(self, x: Array, gamma: Array, beta: Array, eps: float) -> Array | None:
        """Returns what :func:`attention_core.linear.layer_norm` computes, or None.

        None where the kernel would not give the same numbers (dtypes that differ, float16
        and bfloat16, whose statistics the core takes in float32): the core computes then.
        """
        ...

    def linear(self, x: Array, kernel: Array, bias: Array) -> Array:
        """Returns ``x @ kernel + bias``: ``x (..., in)``, ``kernel (in, out)``, ``bias (out,)``.

        The bias is added in the product's dtype (cast when that differs, as under mixed
        precision).
        """
        ...


def fixed_shape(ops: Ops, x: Array) -> tuple[Any, ...]:
    """The shape of a weight (a kernel, an embedding table), which stays fixed under tracing.

    ``ops.fixed_shape(x)`` when the ops have it: ints where :meth:`Ops.shape` gives run-time
    sizes for every array (``torch.jit.trace`` gives each dimension as a tensor, to record how
    the input's shape flows). Else ``ops.shape(x)``.
    """
    method = getattr(ops, "fixed_shape", None)
    return ops.shape(x) if method is None else tuple(method(x))


class SamplingOps(Ops, Protocol):
    """Optional: ops that sample tokens on the device (:func:`attention_core.sampling.choose`).

    The randomness is each framework's own, reproducible by seed but not shared across
    frameworks: NumPy a ``numpy.random.Generator``; torch a ``torch.Generator`` on the logits'
    device; JAX a PRNG key, split at every draw (jittable: the new key is returned); TensorFlow
    a Keras ``SeedGenerator``; MXNet its global generator (``mx.random.seed``), shared with
    every other draw of the process. A state that advances in place is returned as it is.
    """

    def argmax(self, x: Array) -> Array:
        """Returns ``np.argmax(x, axis=-1)``, integers of the framework's index dtype."""
        ...

    def sort_descending(self, x: Array) -> tuple[Array, Array]:
        """Returns ``x`` sorted along the last axis, largest first, and the indices that do it."""
        ...

    def new_sampling_state(self, seed: int, like: Array | None = None) -> Any:
        """The framework's generator seeded with ``seed``, drawing where ``like`` lives."""
        ...

    def uniform(self, shape: tuple[Any, ...], state: Any) -> tuple[Array, Any]:
        """Floats uniform in ``[0, 1)`` of ``shape``, and the state to draw from next."""
        ...
