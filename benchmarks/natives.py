"""Per backend: this library's layer and the framework's own, with the same weights and mask.

Each :class:`Harness` imports its framework only when built (:func:`harness`), after the
thread environment of :func:`benchmarks.thread_env` is in place, and gives the
benchmark calls that wait for their result:

* :meth:`Harness.mha_pair`: ``MultiHeadAttention(512, 8, bias=True)`` of this library, as
  constructed by default and with ``keep_attention_weights=False``, against the native layer
  holding the same
  canonical weights (converted by ``backends.<fw>.convert``), self-attention on one input
  ``X (1, n, 512)`` with ``valid_lens = [n - n // 4]`` (the native layer gets the equivalent
  key padding mask). torch: ``torch.nn.MultiheadAttention(batch_first=True)`` in eval mode,
  ``need_weights=False``, both under ``torch.inference_mode()``. TensorFlow: both layers are
  called inside one ``tf.function`` each (``autograph=False``: neither has tensor-dependent
  Python control flow); the native one is ``keras.layers.MultiHeadAttention``
  with ``attention_mask`` of shape ``(1, 1, n)``. JAX: both ``apply`` functions are
  ``jax.jit``-ed; the native one is ``flax.linen.MultiHeadDotProductAttention`` with ``mask``
  ``(1, 1, 1, n)``. NumPy and MXNet (imperative Gluon): a plain direct implementation in the
  same framework (:func:`plain_mha`: projections, scores, masked softmax, pooling, output
  projection).
* :meth:`Harness.attention_call`: ``attention_core.dot_product_attention`` on ``(1, H, n, 64)``
  by one path (``default`` = the automatic choice, ``direct``, ``blockwise``, ``fused``), or
  the framework's own attention function (``native``): torch's
  ``scaled_dot_product_attention``, ``jax.nn.dot_product_attention`` and
  ``keras.ops.dot_product_attention`` (both given their ``(B, n, H, D)`` layout, jitted /
  in a ``tf.function``), and :func:`plain_attention` on NumPy and MXNet.
* :meth:`Harness.gemm_call`: a square fp32 matrix product in the framework.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from attention_core import registry
from benchmarks import BATCH, DEPTH

Call = Callable[[], Any]

#: num_hiddens and heads of the MultiHeadAttention of the speed suite.
NUM_HIDDENS, NUM_HEADS = 512, 8

#: What ``native`` is on each backend, for tables and plots.
NATIVE_LAYER = {
    "numpy": "plain NumPy MHA", "torch": "torch.nn.MultiheadAttention",
    "tensorflow": "keras.layers.MultiHeadAttention", "jax": "flax MultiHeadDotProductAttention",
    "mxnet": "plain Gluon MHA",
}
NATIVE_ATTENTION = {
    "numpy": "plain NumPy", "torch": "F.scaled_dot_product_attention",
    "tensorflow": "keras.ops.dot_product_attention", "jax": "jax.nn.dot_product_attention",
    "mxnet": "plain mx.np",
}


def canonical_weights(seed: int = 0, h: int = NUM_HIDDENS) -> dict[str, np.ndarray]:
    """Random canonical MultiHeadAttention weights with biases (as every native layer has)."""
    rng = np.random.default_rng(seed)
    weights = {f"{n}.kernel": rng.normal(0.0, h**-0.5, (h, h)).astype(np.float32)
               for n in ("W_q", "W_k", "W_v", "W_o")}
    weights.update({f"{n}.bias": rng.normal(0.0, 0.1, h).astype(np.float32)
                    for n in ("W_q", "W_k", "W_v", "W_o")})
    return weights


def valid_length(n: int) -> int:
    """The benchmark's ``valid_lens`` entry for n keys: a quarter of them padded."""
    return n - n // 4


def plain_attention(xp: Any, q: Any, k: Any, v: Any, lens: Any) -> Any:
    """Direct masked attention written plainly in a NumPy-like module ``xp`` (NumPy, mx.np).

    Args:
        xp: ``numpy`` or ``mxnet.numpy``.
        q: ``(B, H, Q, D)``.
        k: ``(B, H, K, D)``.
        v: ``(B, H, K, Dv)``.
        lens: ``(B,)`` int32, keys ``>= lens[b]`` are masked (d2l's ``-1e6`` fill).
    """
    scores = xp.matmul(q, xp.swapaxes(k, -1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    visible = xp.arange(k.shape[2], dtype="int32").reshape(1, 1, 1, -1) < lens.reshape(-1, 1, 1, 1)
    scores = xp.where(visible, scores, xp.array(-1e6, dtype=scores.dtype))
    e = xp.exp(scores - scores.max(axis=-1, keepdims=True))
    return xp.matmul(e / e.sum(axis=-1, keepdims=True), v)


def plain_mha(xp: Any, X: Any, lens: Any, weights: Mapping[str, Any], num_heads: int) -> Any:
    """Multi-head self-attention written plainly: projections, :func:`plain_attention`, output."""
    B, n, _ = X.shape

    def heads(name: str) -> Any:
        t = xp.matmul(X, weights[f"{name}.kernel"]) + weights[f"{name}.bias"]
        return t.reshape(B, n, num_heads, -1).transpose(0, 2, 1, 3)  # (B, H, n, d)

    out = plain_attention(xp, heads("W_q"), heads("W_k"), heads("W_v"), lens)
    out = out.transpose(0, 2, 1, 3).reshape(B, n, -1)
    return xp.matmul(out, weights["W_o.kernel"]) + weights["W_o.bias"]


def our_mha(module: Any, keep: bool = True) -> Any:
    """This library's ``MultiHeadAttention(512, 8, bias=True)`` from a backend module.

    With ``keep`` (the constructor's default) it keeps its attention weights, as a user gets
    it; without, the tuned configuration ``keep_attention_weights=False``.
    """
    return module.MultiHeadAttention(num_hiddens=NUM_HIDDENS, num_heads=NUM_HEADS, bias=True,
                                     keep_attention_weights=keep)


class Harness:
    """One backend's contenders. Subclasses import their framework in ``__init__``."""

    name = "numpy"
    #: Whether calls are compiled for a shape (warm up at the same shape before measuring).
    compiles = False

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.module = registry.load(self.name)
        self.ops = self.module.OPS

    # -- framework specifics (overridden) ------------------------------------------------------

    def to_array(self, x: np.ndarray) -> Any:
        """A NumPy array as the framework's array."""
        return self.ops.from_numpy(x)

    def to_numpy(self, x: Any) -> np.ndarray:
        """The framework's array as NumPy."""
        return np.asarray(self.ops.to_numpy(x))

    def sync(self, x: Any) -> Any:
        """Waits until ``x`` is computed; returns it."""
        return x

    def thread_settings(self) -> dict[str, Any]:
        """Applies the thread count the framework's way (after import); returns what was set."""
        return {}

    def versions(self) -> dict[str, str]:
        """Versions of the framework's distributions."""
        versions = {m: registry.module_version(m) for m in registry.FRAMEWORKS[self.name]}
        return {m: v for m, v in versions.items() if v is not None}

    def ours(self, weights: Mapping[str, np.ndarray], X: Any, lens: Any, keep: bool = True
             ) -> Call:
        """This library's MultiHeadAttention, called on ``(X, X, X, lens)``."""
        layer = our_mha(self.module, keep)
        layer.set_weights(weights)
        return lambda: self.sync(layer(X, X, X, lens))

    def native(self, weights: Mapping[str, np.ndarray], X: Any, lens: Any) -> Call:
        """The native layer (or :func:`plain_mha`) with the same weights and mask."""
        w = {k: self.to_array(v) for k, v in weights.items()}
        return lambda: self.sync(plain_mha(np, X, lens, w, NUM_HEADS))

    def native_attention(self, q: Any, k: Any, v: Any, lens: Any) -> Call:
        """The framework's own attention on ``(B, H, n, D)`` inputs (see the module doc)."""
        return lambda: self.sync(plain_attention(np, q, k, v, lens))

    def gemm_call(self, size: int) -> Call:
        """A ``(size, size) @ (size, size)`` fp32 product."""
        a, b = (self.to_array(np.random.default_rng(i).standard_normal((size, size))
                              .astype(np.float32)) for i in (1, 2))
        return lambda: self.sync(a @ b)

    # -- shared ---------------------------------------------------------------------------------

    def lens(self, n: int) -> Any:
        """``valid_lens`` ``[n - n // 4]`` as the framework's int32 array."""
        return self.to_array(np.array([valid_length(n)] * BATCH, np.int32))

    def mha_pair(self, n: int, seed: int = 0) -> tuple[Call, Call, Call, float]:
        """``(ours, tuned, native, max |ours - native|)``: self-attention on ``X (1, n, 512)``.

        ``ours`` is the default layer, ``tuned`` the one with ``keep_attention_weights=False``.
        """
        weights = canonical_weights(seed)
        X = self.to_array(np.random.default_rng(seed + 1).standard_normal(
            (BATCH, n, NUM_HIDDENS)).astype(np.float32))
        lens = self.lens(n)
        ours, native = self.ours(weights, X, lens), self.native(weights, X, lens)
        tuned = self.ours(weights, X, lens, keep=False)
        got, want = self.to_numpy(ours()), self.to_numpy(native())
        if not np.allclose(got, self.to_numpy(tuned()), rtol=1e-5, atol=1e-5):
            raise AssertionError(f"n={n}: the default and the tuned layer give other outputs")
        diff = float(np.max(np.abs(got - want)))
        return ours, tuned, native, diff

    def paths(self) -> list[str]:
        """The paths :meth:`attention_call` knows on this backend."""
        from attention_core import kernels

        fused = ["fused"] if any(e.name == "fused" for e in kernels.kernels(self.ops.name)) else []
        return ["default", "direct", "blockwise", *fused, "native"]

    def resolved(self, path: str, heads: int, n: int) -> str:
        """The implementation a path runs at this shape (``default`` -> the automatic choice)."""
        if path != "default":
            return path
        from attention_core import kernels
        from attention_core.modifiers import Call

        request = kernels.Request(Call(self.ops, (BATCH, heads, n, n)))
        return kernels.choose(self.ops, request)[0].name

    def linear_memory(self, path: str, heads: int, n: int) -> bool:
        """Whether the path needs memory linear in n (it never forms the ``(n, n)`` scores)."""
        resolved = self.resolved(path, heads, n)  # only torch's fused kernel is flash-style
        return resolved == "blockwise" or (self.name == "torch" and resolved in ("fused", "native"))

    def qkv(self, heads: int, n: int, seed: int = 0) -> tuple[Any, Any, Any, Any]:
        """Random ``(1, heads, n, 64)`` queries, keys, values and ``valid_lens``."""
        rng = np.random.default_rng(seed)
        q, k, v = (self.to_array(rng.standard_normal((BATCH, heads, n, DEPTH)).astype(np.float32))
                   for _ in range(3))
        return q, k, v, self.lens(n)

    def core(self, implementation: str | None) -> Callable[..., Any]:
        """``dot_product_attention`` with an implementation, compiled the framework's way."""
        from attention_core.attention import dot_product_attention

        def run(q: Any, k: Any, v: Any, lens: Any) -> Any:
            return dot_product_attention(q, k, v, lens, implementation=implementation)

        return run

    def attention_call(self, path: str, q: Any, k: Any, v: Any, lens: Any) -> Call:
        """A call of one attention path on ``(B, H, n, D)`` inputs."""
        if path == "native":
            return self.native_attention(q, k, v, lens)
        fn = self.core(None if path == "default" else path)
        return lambda: self.sync(fn(q, k, v, lens))


class TorchHarness(Harness):
    """torch: eval mode and ``torch.inference_mode()`` for every contender."""

    name = "torch"

    def __init__(self, threads: int) -> None:
        import torch

        self.torch = torch
        super().__init__(threads)

    def thread_settings(self) -> dict[str, Any]:
        """Sets the framework's thread pools (see the base class)."""
        torch = self.torch
        torch.set_num_threads(self.threads)
        with contextlib.suppress(RuntimeError):  # already set, or parallel work started
            torch.set_num_interop_threads(1)
        return {"torch.get_num_threads()": torch.get_num_threads(),
                "torch.get_num_interop_threads()": torch.get_num_interop_threads()}

    def _infer(self, fn: Callable[[], Any]) -> Call:
        torch = self.torch

        def call() -> Any:
            with torch.inference_mode():
                return fn()

        return call

    def ours(self, weights: Mapping[str, np.ndarray], X: Any, lens: Any, keep: bool = True
             ) -> Call:
        """This library's layer (see the base class)."""
        layer = our_mha(self.module, keep)
        layer.set_weights(weights)
        layer.eval()
        return self._infer(lambda: layer(X, X, X, lens))

    def native(self, weights: Mapping[str, np.ndarray], X: Any, lens: Any) -> Call:
        """The native layer with the same weights and mask (see the base class)."""
        from backends.torch.convert import to_torch

        torch = self.torch
        module = to_torch(weights, NUM_HEADS, batch_first=True).eval()
        padding = torch.arange(X.shape[1])[None, :] >= lens[:, None]  # True = blocked
        return self._infer(lambda: module(X, X, X, key_padding_mask=padding, need_weights=False)[0])

    def native_attention(self, q: Any, k: Any, v: Any, lens: Any) -> Call:
        """The framework's own attention function (see the base class)."""
        torch = self.torch
        visible = (torch.arange(k.shape[2]) < lens[:, None])[:, None, None, :]  # (B, 1, 1, K)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        return self._infer(lambda: sdpa(q, k, v, attn_mask=visible))

    def attention_call(self, path: str, q: Any, k: Any, v: Any, lens: Any) -> Call:
        """One attention path (see the base class)."""
        return self._infer(super().attention_call(path, q, k, v, lens))

    def gemm_call(self, size: int) -> Call:
        """A square fp32 matrix product (see the base class)."""
        torch = self.torch
        a, b = (torch.randn(size, size) for _ in range(2))
        return self._infer(lambda: torch.mm(a, b))


class TensorFlowHarness(Harness):
    """TensorFlow: every contender is one ``tf.function`` (traced once per shape)."""

    name = "tensorflow"
    compiles = True

    def __init__(self, threads: int) -> None:
        import tensorflow as tf

        self.tf = tf
        self._threads: dict[str, Any] = {}
        try:  # must come before TensorFlow's runtime starts
            tf.config.threading.set_intra_op_parallelism_threads(threads)
            tf.config.threading.set_inter_op_parallelism_threads(1)
        except RuntimeError as err:
            self._threads["error"] = str(err)
        super().__init__(threads)

    def thread_settings(self) -> dict[str, Any]:
        """Sets the framework's thread pools (see the base class)."""
        threading = self.tf.config.threading
        return {**self._threads,
                "intra_op_parallelism_threads": threading.get_intra_op_parallelism_threads(),
                "inter_op_parallelism_threads": threading.get_inter_op_parallelism_threads()}

    def ours(self, weights: Mapping[str, np.ndarray], X: Any, lens: Any, keep: bool = True
             ) -> Call:
        """This library's layer (see the base class)."""
        layer = our_mha(self.module, keep)
        layer(X[:, :2], X[:, :2], X[:, :2])  # builds the weights
        layer.set_weights(weights)
        fn = self.tf.function(lambda x, lens: layer(x, x, x, lens), autograph=False)
        return lambda: fn(X, lens)

    def native(self, weights: Mapping[str, np.ndarray], X: Any, lens: Any) -> Call:
        """The native layer with the same weights and mask (see the base class)."""
        from backends.tensorflow.convert import to_keras

        tf = self.tf
        layer = to_keras(weights, NUM_HEADS)
        mask = tf.range(X.shape[1])[None, None, :] < lens[:, None, None]  # (B, 1, K)
        fn = tf.function(lambda x, mask: layer(x, x, x, attention_mask=mask), autograph=False)
        return lambda: fn(X, mask)

    def native_attention(self, q: Any, k: Any, v: Any, lens: Any) -> Call:
        """The framework's own attention function (see the base class)."""
        import keras

        tf = self.tf
        mask = (tf.range(k.shape[2]) < lens[:, None])[:, None, None, :]  # (B, 1, 1, K)
        layout = (0, 2, 1, 3)  # (B, H, n, D) -> keras' (B, n, H, D)
        qt, kt, vt = (tf.transpose(x, layout) for x in (q, k, v))
        fn = tf.function(lambda q, k, v, m: keras.ops.dot_product_attention(q, k, v, mask=m),
                         autograph=False)
        return lambda: fn(qt, kt, vt, mask)

    def core(self, implementation: str | None) -> Callable[..., Any]:
        """``dot_product_attention``, compiled (see the base class)."""
        return self.tf.function(super().core(implementation), autograph=False)

    def gemm_call(self, size: int) -> Call:
        """A square fp32 matrix product (see the base class)."""
        tf = self.tf
        a, b = (tf.random.normal((size, size)) for _ in range(2))
        return lambda: tf.linalg.matmul(a, b)


class JaxHarness(Harness):
    """JAX: every contender is ``jax.jit``-ed; calls wait with ``block_until_ready``."""

    name = "jax"
    compiles = True

    def __init__(self, threads: int) -> None:
        import jax

        self.jax = jax
        super().__init__(threads)

    def sync(self, x: Any) -> Any:
        """Waits until ``x`` is computed (see the base class)."""
        return self.jax.block_until_ready(x)  # type: ignore[no-untyped-call]

    def ours(self, weights: Mapping[str, np.ndarray], X: Any, lens: Any, keep: bool = True
             ) -> Call:
        """This library's layer (see the base class)."""
        layer = our_mha(self.module, keep)
        variables = self.module.init_from_weights(layer, weights)
        fn = self.jax.jit(lambda variables, x, lens: layer.apply(variables, x, x, x, lens))
        return lambda: self.sync(fn(variables, X, lens))

    def native(self, weights: Mapping[str, np.ndarray], X: Any, lens: Any) -> Call:
        """The native layer with the same weights and mask (see the base class)."""
        import jax.numpy as jnp

        from backends.jax.convert import to_flax

        module, variables = to_flax(weights, NUM_HEADS)
        mask = (jnp.arange(X.shape[1]) < lens[:, None])[:, None, None, :]  # (B, 1, 1, K)
        fn = self.jax.jit(lambda variables, x, mask: module.apply(variables, x, x, x, mask=mask))
        return lambda: self.sync(fn(variables, X, mask))

    def native_attention(self, q: Any, k: Any, v: Any, lens: Any) -> Call:
        """The framework's own attention function (see the base class)."""
        jax = self.jax
        qt, kt, vt = (x.transpose(0, 2, 1, 3) for x in (q, k, v))  # jax's (B, n, H, D)
        fn = jax.jit(lambda q, k, v, lens: jax.nn.dot_product_attention(
            q, k, v, key_value_seq_lengths=lens, implementation="xla"))
        return lambda: self.sync(fn(qt, kt, vt, lens))

    def core(self, implementation: str | None) -> Callable[..., Any]:
        """``dot_product_attention``, compiled (see the base class)."""
        return self.jax.jit(super().core(implementation))

    def gemm_call(self, size: int) -> Call:
        """A square fp32 matrix product (see the base class)."""
        import jax.numpy as jnp

        a, b = (self.to_array(np.random.default_rng(i).standard_normal((size, size))
                              .astype(np.float32)) for i in (1, 2))
        fn = self.jax.jit(jnp.matmul)
        return lambda: self.sync(fn(a, b))


class MXNetHarness(Harness):
    """MXNet: imperative Gluon (not hybridized) against a plain ``mx.np`` implementation."""

    name = "mxnet"

    def __init__(self, threads: int) -> None:
        import mxnet

        self.mx = mxnet
        super().__init__(threads)

    def sync(self, x: Any) -> Any:
        """Waits until ``x`` is computed (see the base class)."""
        x.wait_to_read()
        return x

    def native(self, weights: Mapping[str, np.ndarray], X: Any, lens: Any) -> Call:
        """The native layer with the same weights and mask (see the base class)."""
        w = {k: self.to_array(v) for k, v in weights.items()}
        return lambda: self.sync(plain_mha(self.mx.np, X, lens, w, NUM_HEADS))

    def native_attention(self, q: Any, k: Any, v: Any, lens: Any) -> Call:
        """The framework's own attention function (see the base class)."""
        return lambda: self.sync(plain_attention(self.mx.np, q, k, v, lens))

    def gemm_call(self, size: int) -> Call:
        """A square fp32 matrix product (see the base class)."""
        a, b = (self.to_array(np.random.default_rng(i).standard_normal((size, size))
                              .astype(np.float32)) for i in (1, 2))
        return lambda: self.sync(self.mx.np.matmul(a, b))


HARNESSES: dict[str, type[Harness]] = {
    "numpy": Harness, "torch": TorchHarness, "tensorflow": TensorFlowHarness,
    "jax": JaxHarness, "mxnet": MXNetHarness,
}


def harness(name: str, threads: int) -> Harness:
    """The harness of a backend (imports its framework).

    Raises:
        ValueError: An unknown backend name.
        ImportError: The backend's framework is not installed.
    """
    key = registry.canonical_name(name)
    registry.load(key)  # raises BackendNotInstalledError saying what to install
    return HARNESSES[key](threads)
