"""The TensorFlow implementation of the ops protocol.

Each method is a TensorFlow one-liner. They work on eager tensors, on the symbolic tensors of a
``tf.function`` trace (including ``jit_compile=True``) and on Keras variables, which convert
to tensors when read.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from attention_core.kernels import blockwise, register_kernel

if keras.backend.backend() != "tensorflow":
    raise ImportError(
        "backends.tensorflow needs the TensorFlow backend of Keras, but Keras is set to "
        f"{keras.backend.backend()!r}; set the environment variable KERAS_BACKEND=tensorflow "
        "(or \"backend\" in ~/.keras/keras.json) before keras is first imported"
    )


#: ``depth > 0`` while a traced recomputation runs its blocks: ``fold`` then loops in Python.
_UNROLL = threading.local()


def _could_record() -> bool:
    """Whether a gradient tape is active (TensorFlow's own test; True if it is not found).

    Forward-only eager calls at (1, 8, 2048, 64) ran 1.15x slower through the recomputed
    blocks (smaller query blocks and split keys), so they are only used under a tape.
    """
    try:
        from tensorflow.python.eager import record
    except ImportError:  # pragma: no cover - a TensorFlow that moved it
        return True
    return bool(record.could_possibly_record())


def _joined(parts: list[Any], axis: int) -> tf.Tensor:
    """``tf.concat(parts, axis)``, emptying ``parts`` so that its blocks are freed at once."""
    joined = tf.concat(parts, axis)
    parts.clear()
    return joined


class TensorFlowOps:
    """TensorFlow tensors; dropout draws from a Keras ``SeedGenerator`` when one is given.

    Args:
        seed_generator: The generator a layer owns, so that its dropout masks follow
            ``keras.utils.set_random_seed`` and work under ``tf.function`` and XLA. Without
            one, dropout uses TensorFlow's stateful ``tf.nn.dropout``.
    """

    name = "tensorflow"

    def __init__(self, seed_generator: keras.random.SeedGenerator | None = None) -> None:
        self.seed_generator = seed_generator

    def from_numpy(self, x: np.ndarray, like: Any = None) -> tf.Tensor:
        x = np.asarray(x)
        return tf.cast(x, like.dtype) if like is not None and x.dtype.kind == "f" else tf.constant(x)

    def to_numpy(self, x: Any) -> np.ndarray:
        return np.asarray(x.numpy() if hasattr(x, "numpy") else x)  # tensors and Keras variables

    def concrete(self, x: Any) -> np.ndarray | None:
        if isinstance(x, keras.KerasTensor):
            return None
        if tf.executing_eagerly() and "CPU" not in getattr(x, "device", "CPU"):
            return None  # on an accelerator: not read
        value = tf.get_static_value(x)  # values of eager tensors and graph constants, else None
        return None if value is None else np.asarray(value)

    def traced(self, x: Any) -> bool:
        return isinstance(x, keras.KerasTensor) or not tf.executing_eagerly()

    def shape(self, x: Any) -> tuple[Any, ...]:
        static = tuple(x.shape)
        if all(d is not None for d in static):
            return static
        dynamic = tf.shape(x)
        return tuple(d if d is not None else dynamic[i] for i, d in enumerate(static))

    def dtype_name(self, x: Any) -> str:
        return str(tf.as_dtype(x.dtype).name)

    def astype(self, x: Any, dtype: str) -> tf.Tensor:
        return tf.cast(x, dtype)

    def exp(self, x: Any) -> tf.Tensor:
        return tf.exp(x)

    def tanh(self, x: Any) -> tf.Tensor:
        return tf.tanh(x)

    def sqrt(self, x: Any) -> tf.Tensor:
        return tf.sqrt(x)

    def log(self, x: Any) -> tf.Tensor:
        return tf.math.log(x)

    def relu(self, x: Any) -> tf.Tensor:
        return tf.nn.relu(x)

    def where(self, cond: Any, x: Any, y: Any) -> tf.Tensor:
        return tf.where(cond, x, tf.convert_to_tensor(y, dtype=x.dtype))

    def softmax(self, x: Any) -> tf.Tensor:
        return tf.nn.softmax(x)  # optional hook: one kernel for the direct path's softmax

    def logical_and(self, a: Any, b: Any) -> tf.Tensor:
        return tf.logical_and(a, b)

    def maximum(self, a: Any, b: Any) -> tf.Tensor:
        return tf.maximum(a, b)

    def max(self, x: Any, axis: int) -> tf.Tensor:
        return tf.reduce_max(x, axis=axis, keepdims=True)

    def sum(self, x: Any, axis: int) -> tf.Tensor:
        return tf.reduce_sum(x, axis=axis, keepdims=True)

    def mean(self, x: Any, axis: int) -> tf.Tensor:
        return tf.reduce_mean(x, axis=axis, keepdims=True)

    def matmul(self, a: Any, b: Any) -> tf.Tensor:
        if len(b.shape) == 2 and len(a.shape) > 2:
            # A dense kernel: one 2-D product. TF 2.21's oneDNN batch matmul corrupts the heap
            # for a rank-4 `a` with a size-1 axis times a rank-2 `b` (tensorflow#117700), e.g.
            # additive attention's scores for one query, as in a Bahdanau decoder step.
            return tf.tensordot(a, b, axes=1)
        return tf.matmul(a, b)

    def reshape(self, x: Any, shape: tuple[Any, ...]) -> tf.Tensor:
        return tf.reshape(x, shape)

    def transpose(self, x: Any, axes: tuple[int, ...]) -> tf.Tensor:
        return tf.transpose(x, axes)

    def expand_dims(self, x: Any, axis: int) -> tf.Tensor:
        return tf.expand_dims(x, axis)

    def slice(self, x: Any, axis: int, start: Any, size: int) -> tf.Tensor:
        if isinstance(start, int):
            return x[(slice(None),) * axis + (slice(start, start + size),)]
        rank = len(x.shape)  # a run-time start: one dynamic slice whose static shape is kept
        begin = tf.stack([tf.cast(start, tf.int32) if a == axis else 0 for a in range(rank)])
        out = tf.slice(x, begin, [size if a == axis else -1 for a in range(rank)])
        out.set_shape([*x.shape[:axis], size, *x.shape[axis + 1 :]])
        return out

    def concatenate(self, xs: list[Any], axis: int) -> tf.Tensor:
        return tf.concat(xs, axis)

    def arange(self, n: Any) -> tf.Tensor:
        return tf.range(n, dtype=tf.int32)

    def take(self, table: Any, indices: Any) -> tf.Tensor:
        return tf.gather(table, indices)

    def fold(self, body: Callable[[Any, Any], Any], init: Any, n: int) -> Any:
        # eager: a Python loop is what tf.while_loop would run; a traced recomputation unrolls
        if tf.executing_eagerly() or getattr(_UNROLL, "depth", 0):
            carry = init
            for i in range(n):
                carry = body(i, carry)
            return carry

        def step(i: tf.Tensor, carry: tuple[tf.Tensor, ...]) -> tuple[Any, ...]:
            new = tuple(body(i, carry))
            for value, old in zip(new, carry, strict=True):
                value.set_shape(old.shape)  # the carry keeps its static shapes
            return i + 1, new

        _, carry = tf.while_loop(
            lambda i, _: i < n, step, (tf.constant(0), tuple(init)), maximum_iterations=n,
            parallel_iterations=1,
        )
        return carry

    def map_concat(self, fn: Callable[[Any], Any], n: int, axis: int) -> tf.Tensor:
        if tf.executing_eagerly():
            return tf.concat([fn(i) for i in range(n)], axis)
        first = fn(0)  # traced outside the loop: gives the parts' dtype and static shape
        parts = tf.TensorArray(first.dtype, size=n - 1, element_shape=first.shape)

        def step(i: tf.Tensor, parts: tf.TensorArray) -> tuple[Any, tf.TensorArray]:
            return i + 1, parts.write(i - 1, fn(i))

        _, parts = tf.while_loop(
            lambda i, _: i < n, step, (tf.constant(1), parts), maximum_iterations=n - 1,
            parallel_iterations=1,
        )
        stacked = parts.stack()  # (n - 1, *first.shape)
        rank = len(first.shape)
        moved = tf.transpose(stacked, [*range(1, axis + 1), 0, *range(axis + 1, rank + 1)])
        dims = self.shape(moved)
        rest = tf.reshape(moved, [*dims[:axis], (n - 1) * first.shape[axis], *dims[axis + 2 :]])
        return tf.concat([first, rest], axis)

    def recompute_blocks(
        self, fn: Callable[..., Any], blocks: list[tuple[int, int]], k_block: int, queries: Any,
        keys: Any, values: Any,
    ) -> tf.Tensor | None:
        # An eager tf.GradientTape records every op, and the gradient of a traced
        # tf.while_loop keeps every iteration's intermediates, so the blockwise loops would
        # keep every tile for the backward pass. One custom gradient instead keeps the inputs
        # and recomputes one query block at a time, summing the key blocks' gradients as it
        # goes. Traced, it needs a tape when the graph is traced (as in Keras' train_step).
        if not _could_record():
            return None  # no tape keeps anything: smaller query blocks would only cost time
        num_keys = int(keys.shape[2])
        sizes = [min(k_block, num_keys - k0) for k0 in range(0, num_keys, k_block)]
        if not tf.executing_eagerly():
            return self._recompute_traced(fn, blocks, sizes, queries, keys, values)

        @tf.custom_gradient  # type: ignore[untyped-decorator]
        def attend(q: Any, k: Any, v: Any) -> Any:
            q = tf.stop_gradient(q)  # the outer tape records nothing of the forward
            k_parts = tf.split(tf.stop_gradient(k), sizes, axis=2)
            v_parts = tf.split(tf.stop_gradient(v), sizes, axis=2)
            out = tf.concat([fn(b, q[:, :, q0 : q0 + qn], k_parts, v_parts)
                             for b, (q0, qn) in enumerate(blocks)], 2)

            def backward(d_out: Any) -> tuple[Any, Any, Any]:
                d_q = []
                # the key and value blocks' gradients, summed over the query blocks one block
                # at a time, each block's new gradient dropped once added: a whole second
                # set of sums never exists next to the old one (32 MiB at (1, 4, 16384, 64))
                d_kv: list[Any] = []
                for b, (q0, qn) in enumerate(blocks):
                    q_b = q[:, :, q0 : q0 + qn]
                    with tf.GradientTape() as tape:
                        tape.watch([q_b, *k_parts, *v_parts])
                        out_b = fn(b, q_b, k_parts, v_parts)
                    grads = tape.gradient(out_b, [q_b, *k_parts, *v_parts],
                                          d_out[:, :, q0 : q0 + qn],
                                          unconnected_gradients=tf.UnconnectedGradients.ZERO)
                    del tape, out_b
                    d_q.append(grads[0])
                    if not d_kv:
                        d_kv = grads[1:]
                        continue
                    for i in range(len(d_kv)):
                        d_kv[i], grads[1 + i] = d_kv[i] + grads[1 + i], None
                d_k, d_v = d_kv[: len(sizes)], d_kv[len(sizes) :]
                del d_kv
                # each result joined while the others' blocks are already gone
                return (_joined(d_q, 2), _joined(d_k, 2), _joined(d_v, 2))

            return out, backward

        return attend(queries, keys, values)

    def stop_gradient(self, x: Any) -> tf.Tensor:
        return tf.stop_gradient(x)

    def _recompute_traced(
        self, fn: Callable[..., Any], blocks: list[tuple[int, int]], sizes: list[int],
        queries: Any, keys: Any, values: Any,
    ) -> tf.Tensor:
        """``recompute_blocks`` in a traced graph: the blocks of the first one's size in a loop.

        The forward pass runs the blocks in ``map_concat``'s ``tf.while_loop`` on the whole
        keys and values; nothing of it is kept for the gradient. The backward pass loops over
        the same blocks, recomputing each under a tape on the key blocks (with the key fold
        unrolled, so that each key block is a separate array) and summing their gradients in
        the loop's state; the last, shorter block (if any) runs after the loop.
        """
        size = blocks[0][1]
        full = sum(1 for _, qn in blocks if qn == size)
        tail = blocks[full:]

        def block_grads(b: Any, q_b: Any, k_parts: list[Any], v_parts: list[Any],
                        d_out_b: Any) -> list[Any]:
            """The gradients of block ``b`` w.r.t. ``q_b`` and the key and value blocks."""
            inputs = [tf.identity(x) for x in (q_b, *k_parts, *v_parts)]  # the loop's own
            with tf.GradientTape() as tape:
                tape.watch(inputs)
                with self._unrolled_folds():
                    out_b = fn(b, inputs[0], inputs[1 : 1 + len(sizes)], inputs[1 + len(sizes) :])
            return list(tape.gradient(out_b, inputs, d_out_b,
                                      unconnected_gradients=tf.UnconnectedGradients.ZERO))

        @tf.custom_gradient  # type: ignore[untyped-decorator]
        def attend(q: Any, k: Any, v: Any) -> Any:
            q, k, v = (tf.stop_gradient(x) for x in (q, k, v))
            parts = [self.map_concat(lambda b: fn(b, self.slice(q, 2, b * size, size), k, v),
                                     full, 2) if full > 1 else fn(0, q[:, :, :size], k, v)]
            parts += [fn(full + i, q[:, :, q0 : q0 + qn], k, v) for i, (q0, qn) in enumerate(tail)]
            out = parts[0] if len(parts) == 1 else tf.concat(parts, 2)

            def backward(d_out: Any) -> tuple[Any, Any, Any]:
                k_parts = tf.split(k, sizes, axis=2)
                v_parts = tf.split(v, sizes, axis=2)

                def step(b: Any, d_q: tf.TensorArray, d_kv: tuple[Any, ...]) -> tuple[Any, ...]:
                    q0 = b * size
                    grads = block_grads(b, self.slice(q, 2, q0, size), k_parts, v_parts,
                                        self.slice(d_out, 2, q0, size))
                    return b + 1, d_q.write(b, grads[0]), tuple(
                        s + g for s, g in zip(d_kv, grads[1:], strict=True))

                d_q_blocks = tf.TensorArray(q.dtype, size=full,
                                            element_shape=[*q.shape[:2], size, q.shape[3]])
                _, d_q_blocks, d_kv = tf.while_loop(
                    lambda b, *_: b < full, step,
                    (tf.constant(0), d_q_blocks, tuple(tf.zeros_like(x) for x in
                                                       (*k_parts, *v_parts))),
                    maximum_iterations=full, parallel_iterations=1,
                )
                stacked = d_q_blocks.stack()  # (full, B, H, size, D)
                dims = self.shape(q)
                d_q = [tf.reshape(tf.transpose(stacked, [1, 2, 0, 3, 4]),
                                  [dims[0], dims[1], full * size, dims[3]])]
                d_kv = list(d_kv)
                for i, (q0, qn) in enumerate(tail):
                    grads = block_grads(full + i, q[:, :, q0 : q0 + qn], k_parts, v_parts,
                                        d_out[:, :, q0 : q0 + qn])
                    d_q.append(grads[0])
                    d_kv = [s + g for s, g in zip(d_kv, grads[1:], strict=True)]
                return (_joined(d_q, 2), _joined(d_kv[: len(sizes)], 2),
                        _joined(d_kv[len(sizes) :], 2))

            return out, backward

        return attend(queries, keys, values)

    @contextlib.contextmanager
    def _unrolled_folds(self) -> Iterator[None]:
        """While it is open, ``fold`` loops in Python (the key blocks get Python indices)."""
        _UNROLL.depth = getattr(_UNROLL, "depth", 0) + 1
        try:
            yield
        finally:
            _UNROLL.depth -= 1

    def dropout(self, x: Any, rate: float) -> tf.Tensor:
        if self.seed_generator is None:
            return tf.nn.dropout(x, rate)
        return keras.random.dropout(x, rate, seed=self.seed_generator)

    def cumsum(self, x: Any, axis: int) -> tf.Tensor:
        return tf.math.cumsum(x, axis=axis)

    # -- sampling (attention_core.ops.SamplingOps): a Keras SeedGenerator is the state -------

    def argmax(self, x: Any) -> tf.Tensor:
        return tf.argmax(x, axis=-1, output_type=tf.int32)

    def sort_descending(self, x: Any) -> tuple[tf.Tensor, tf.Tensor]:
        values, indices = tf.math.top_k(x, k=self.shape(x)[-1])  # every entry, largest first
        return values, indices

    def new_sampling_state(self, seed: int, like: Any = None) -> keras.random.SeedGenerator:
        """A Keras ``SeedGenerator``: made eagerly, it draws inside ``tf.function`` and XLA too."""
        return keras.random.SeedGenerator(seed)

    def uniform(self, shape: tuple[Any, ...],
                state: keras.random.SeedGenerator) -> tuple[tf.Tensor, keras.random.SeedGenerator]:
        if not all(isinstance(d, int) for d in shape):
            shape = tf.stack([tf.cast(d, tf.int32) for d in shape])  # run-time sizes
        return tf.convert_to_tensor(keras.random.uniform(shape, seed=state)), state


    def silu(self, x: Any) -> tf.Tensor:
        return tf.nn.silu(x)

    def erf(self, x: Any) -> tf.Tensor:
        return tf.math.erf(x)

#: The default TensorFlow ops (used by the functional API for TensorFlow tensors).
OPS = TensorFlowOps()


# TensorFlow's blockwise loops (``tf.while_loop``) run one tile after another, while the direct
# kernel with ``tf.nn.softmax`` uses both cores on one large kernel: in the benchmark's
# ``tf.function`` (MHA 512/8, n = 1024 and 4096) direct was the faster, so blockwise is taken
# only from 2**28 scores (1 GiB of float32), where memory decides.
register_kernel("blockwise", blockwise.blockwise, blockwise.CAPABILITIES, backend="tensorflow",
                priority=10, prefers=lambda ops, request: blockwise.enough_scores(request, 2**28))
