"""Per backend: the three sequence layers of ``python -m benchmarks complexity``, each the framework's own.

For one backend, a :class:`Builder` makes the contenders that map a sequence ``X (B, n, d)``
to a sequence of the same shape, all with weights given as NumPy arrays (:func:`layer_weights`)
so that tests can check each one against an independent computation:

* ``conv``: a 1-D convolution of ``d`` to ``d`` channels, kernel ``k`` (odd), ``same`` padding
  (``(k - 1) / 2`` zeros at each end), bias. torch ``nn.Conv1d``, keras ``Conv1D``, flax
  ``nn.Conv``, gluon ``nn.Conv1D``; NumPy: im2col (the ``k`` shifted copies side by side, one
  ``(n, k d) @ (k d, d)`` product), :func:`conv_numpy`.
* ``rnn``: a recurrent layer of width ``d``, ``h_t = tanh(x_t W + h_{t-1} U + b)``, ``h_0 = 0``,
  every ``h_t`` returned. torch ``nn.RNN``, keras ``SimpleRNN``, flax ``nn.RNN(nn.SimpleCell)``
  (a ``lax.scan``), gluon ``rnn.RNN``; NumPy: :func:`rnn_numpy`, a Python loop over the steps.
* ``attention``: this library's ``MultiHeadAttention(d, heads, bias=True,
  keep_attention_weights=False)`` of the backend, self-attention ``(X, X, X)`` without a mask.

Each contender gets its input in the layout its layer expects, made before timing (torch's and
Gluon's convolutions take channels first, ``(B, d, n)``). Every call runs in inference mode
and waits for its result: torch under ``torch.inference_mode()`` with the modules in eval
mode; TensorFlow inside one ``tf.function`` per contender (``autograph=False``); JAX through
``jax.jit`` and ``block_until_ready``; MXNet imperative (not hybridized) and ``wait_to_read``,
as in :mod:`benchmarks.natives`. A framework is imported only inside the builder of
its backend, which :func:`builder` makes after the thread environment is in place.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from attention_core import registry
from benchmarks import natives

Call = Callable[[], Any]


@dataclass(frozen=True)
class Contender:
    """One timed layer.

    Attributes:
        call: Runs the layer once on the prepared input and waits for the result.
        to_numpy: The result of ``call`` as a NumPy ``(B, n, d)`` array.
    """

    call: Call
    to_numpy: Callable[[Any], np.ndarray]


def layer_weights(width: int, kernel_size: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights of the three contenders.

    Args:
        width: d, the channels of the convolution, the RNN's state and the attention's width.
        kernel_size: k, taps of the convolution.
        seed: Seed of the draw.

    Returns:
        ``conv.kernel (k, d_in, d_out)`` (tap ``j`` multiplies input position ``t + j - (k - 1) / 2``),
        ``conv.bias (d,)``, ``rnn.W (d_in, d)``, ``rnn.U (d, d)``, ``rnn.b (d,)``, and the
        canonical ``MultiHeadAttention`` weights ``attention.W_q.kernel`` ... with biases.
    """
    rng = np.random.default_rng(seed)
    d, k = width, kernel_size

    def normal(scale: float, *shape: int) -> np.ndarray:
        return rng.normal(0.0, scale, shape).astype(np.float32)

    weights = {"conv.kernel": normal((k * d) ** -0.5, k, d, d), "conv.bias": normal(0.1, d),
               "rnn.W": normal(d**-0.5, d, d), "rnn.U": normal(0.5 * d**-0.5, d, d),
               "rnn.b": normal(0.1, d)}
    for name, value in natives.canonical_weights(seed + 1, h=d).items():
        weights[f"attention.{name}"] = value
    return weights


def attention_weights(weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The canonical ``MultiHeadAttention`` weights among :func:`layer_weights`."""
    return {k.removeprefix("attention."): v for k, v in weights.items() if k.startswith("attention.")}


def conv_numpy(x: np.ndarray, kernel: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """1-D convolution (cross-correlation, ``same`` padding) as one im2col matrix product.

    Args:
        x: ``(B, n, d_in)``.
        kernel: ``(k, d_in, d_out)``, k odd.
        bias: ``(d_out,)``.

    Returns:
        ``(B, n, d_out)``.
    """
    B, n, d_in = x.shape
    k = kernel.shape[0]
    pad = (k - 1) // 2
    padded = np.pad(x, ((0, 0), (pad, k - 1 - pad), (0, 0)))
    windows = np.lib.stride_tricks.sliding_window_view(padded, k, axis=1)  # (B, n, d_in, k)
    columns = windows.transpose(0, 1, 3, 2).reshape(B, n, k * d_in)  # row: tap-major, then channel
    return columns @ kernel.reshape(k * d_in, -1) + bias


def rnn_numpy(x: np.ndarray, W: np.ndarray, U: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``h_t = tanh(x_t W + h_{t-1} U + b)`` over the steps of ``x (B, n, d_in)``, ``h_0 = 0``.

    The input term of every step is one product before the loop (as the frameworks' RNN
    layers do); the loop makes the n sequential ``h U`` products.

    Returns:
        ``(B, n, d)``: every ``h_t``.
    """
    B, n, _ = x.shape
    inputs = x @ W + b
    h = np.zeros((B, U.shape[0]), x.dtype)
    out = np.empty((B, n, U.shape[1]), x.dtype)
    for t in range(n):
        h = np.tanh(inputs[:, t] + h @ U)
        out[:, t] = h
    return out


class Builder:
    """The NumPy backend's contenders; the subclasses import their framework in ``__init__``.

    Args:
        threads: Threads of the framework's intra-op pool (see
            :meth:`benchmarks.natives.Harness.thread_settings`).
    """

    name = "numpy"
    #: What each contender is, for the JSON file and the speed page.
    layers: ClassVar[dict[str, str]] = {"conv": "im2col: one (n, k*d) @ (k*d, d) NumPy matmul",
              "rnn": "Python loop of tanh(x_t W + h U + b) (x W for all steps in one matmul)",
              "attention": "attention_core MultiHeadAttention (numpy backend)"}
    #: Short names of conv and rnn for the plot's legend.
    short: ClassVar[dict[str, str]] = {"conv": "NumPy im2col", "rnn": "NumPy loop"}

    def __init__(self, threads: int) -> None:
        self.harness = natives.harness(self.name, threads)
        self.module = self.harness.module

    def thread_settings(self) -> dict[str, Any]:
        """Applies the thread count the framework's way; returns what was set."""
        return self.harness.thread_settings()

    def versions(self) -> dict[str, str]:
        """Versions of the framework's distributions."""
        return self.harness.versions()

    def attention_path(self, heads: int, n: int, batch: int) -> str:
        """The kernel the attention layer takes at this shape (the core's automatic rule)."""
        from attention_core import kernels
        from attention_core.modifiers import Call

        ops = self.harness.ops
        return kernels.choose(ops, kernels.Request(Call(ops, (batch, heads, n, n))))[0].name

    def _numpy(self, out: Any) -> np.ndarray:
        return self.harness.to_numpy(out)

    def _channels_first(self, out: Any) -> np.ndarray:
        return self.harness.to_numpy(out).transpose(0, 2, 1)

    def _our_layer(self, weights: Mapping[str, np.ndarray], heads: int) -> Any:
        d = weights["attention.W_q.kernel"].shape[0]
        return self.module.MultiHeadAttention(d, heads, bias=True, keep_attention_weights=False)

    # -- the contenders (overridden) -------------------------------------------------------------

    def conv(self, x: np.ndarray, weights: Mapping[str, np.ndarray]) -> Contender:
        """The 1-D convolution on ``x (B, n, d)``."""
        kernel, bias = weights["conv.kernel"], weights["conv.bias"]
        return Contender(lambda: conv_numpy(x, kernel, bias), self._numpy)

    def rnn(self, x: np.ndarray, weights: Mapping[str, np.ndarray]) -> Contender:
        """The recurrent layer on ``x (B, n, d)``."""
        W, U, b = weights["rnn.W"], weights["rnn.U"], weights["rnn.b"]
        return Contender(lambda: rnn_numpy(x, W, U, b), self._numpy)

    def attention(self, x: np.ndarray, weights: Mapping[str, np.ndarray], heads: int) -> Contender:
        """This library's ``MultiHeadAttention`` on ``(x, x, x)``."""
        layer = self._our_layer(weights, heads)
        layer.set_weights(attention_weights(weights))
        X = self.harness.to_array(x)
        sync = self.harness.sync
        return Contender(lambda: sync(layer(X, X, X)), self._numpy)


class TorchBuilder(Builder):
    """torch: modules in eval mode, every call under ``torch.inference_mode()``."""

    name = "torch"
    layers: ClassVar[dict[str, str]] = {"conv": "torch.nn.Conv1d(d, d, k, padding='same'), input (B, d, n)",
              "rnn": "torch.nn.RNN(d, d, nonlinearity='tanh', batch_first=True)",
              "attention": "attention_core MultiHeadAttention (torch backend)"}
    short: ClassVar[dict[str, str]] = {"conv": "nn.Conv1d", "rnn": "nn.RNN"}

    def __init__(self, threads: int) -> None:
        import torch

        self.torch = torch
        super().__init__(threads)

    def _infer(self, fn: Call) -> Call:
        torch = self.torch

        def call() -> Any:
            with torch.inference_mode():
                return fn()

        return call

    def _set(self, param: Any, value: np.ndarray) -> None:
        with self.torch.no_grad():
            param.copy_(self.torch.from_numpy(np.ascontiguousarray(value)))

    def conv(self, x: np.ndarray, weights: Mapping[str, np.ndarray]) -> Contender:
        """The 1-D convolution (see the base class)."""
        torch = self.torch
        k, d_in, d_out = weights["conv.kernel"].shape
        layer = torch.nn.Conv1d(d_in, d_out, k, padding="same").eval()
        self._set(layer.weight, weights["conv.kernel"].transpose(2, 1, 0))  # (out, in, k)
        self._set(layer.bias, weights["conv.bias"])
        X = torch.from_numpy(np.ascontiguousarray(x.transpose(0, 2, 1)))
        return Contender(self._infer(lambda: layer(X)), self._channels_first)

    def rnn(self, x: np.ndarray, weights: Mapping[str, np.ndarray]) -> Contender:
        """The recurrent layer (see the base class)."""
        torch = self.torch
        W, U, b = weights["rnn.W"], weights["rnn.U"], weights["rnn.b"]
        layer = torch.nn.RNN(W.shape[0], W.shape[1], nonlinearity="tanh", batch_first=True).eval()
        self._set(layer.weight_ih_l0, W.T)
        self._set(layer.weight_hh_l0, U.T)
        self._set(layer.bias_ih_l0, b)
        self._set(layer.bias_hh_l0, np.zeros_like(b))
        X = torch.from_numpy(np.ascontiguousarray(x))
        return Contender(self._infer(lambda: layer(X)[0]), self._numpy)

    def attention(self, x: np.ndarray, weights: Mapping[str, np.ndarray], heads: int) -> Contender:
        """This library's layer (see the base class)."""
        layer = self._our_layer(weights, heads)
        layer.set_weights(attention_weights(weights))
        layer.eval()
        X = self.torch.from_numpy(np.ascontiguousarray(x))
        return Contender(self._infer(lambda: layer(X, X, X)), self._numpy)


class TensorFlowBuilder(Builder):
    """TensorFlow: each contender is one ``tf.function`` (traced once per shape)."""

    name = "tensorflow"
    layers: ClassVar[dict[str, str]] = {"conv": "keras.layers.Conv1D(d, k, padding='same')",
              "rnn": "keras.layers.SimpleRNN(d, return_sequences=True)",
              "attention": "attention_core MultiHeadAttention (tensorflow backend)"}
    short: ClassVar[dict[str, str]] = {"conv": "keras Conv1D", "rnn": "keras SimpleRNN"}

    def __init__(self, threads: int) -> None:
        import tensorflow as tf

        self.tf = tf
        super().__init__(threads)

    def _compiled(self, layer: Any, X: Any) -> Call:
        fn = self.tf.function(lambda x: layer(x, training=False), autograph=False)
        return lambda: fn(X)

    def conv(self, x: np.ndarray, weights: Mapping[str, np.ndarray]) -> Contender:
        """The 1-D convolution (see the base class)."""
        import keras

        k, _, d_out = weights["conv.kernel"].shape
        layer = keras.layers.Conv1D(d_out, k, padding="same")
        layer.build(x.shape)
        layer.set_weights([weights["conv.kernel"], weights["conv.bias"]])
        return Contender(self._compiled(layer, self.tf.constant(x)), self._numpy)

    def rnn(self, x: np.ndarray, weights: Mapping[str, np.ndarray]) -> Contender:
        """The recurrent layer (see the base class)."""
        import keras

        W, U, b = weights["rnn.W"], weights["rnn.U"], weights["rnn.b"]
        layer = keras.layers.SimpleRNN(W.shape[1], activation="tanh", return_sequences=True)
        layer.build(x.shape)
        layer.set_weights([W, U, b])  # kernel (in, units), recurrent_kernel, bias
        return Contender(self._compiled(layer, self.tf.constant(x)), self._numpy)

    def attention(self, x: np.ndarray, weights: Mapping[str, np.ndarray], heads: int) -> Contender:
        """This library's layer (see the base class)."""
        layer = self._our_layer(weights, heads)
        X = self.tf.constant(x)
        layer(X[:, :1], X[:, :1], X[:, :1])  # builds the weights
        layer.set_weights(attention_weights(weights))
        fn = self.tf.function(lambda x: layer(x, x, x), autograph=False)
        return Contender(lambda: fn(X), self._numpy)


class JaxBuilder(Builder):
    """JAX: each contender's ``apply`` is ``jax.jit``-ed; calls wait with ``block_until_ready``."""

    name = "jax"
    layers: ClassVar[dict[str, str]] = {"conv": "flax.linen.Conv(d, (k,), padding='SAME')",
              "rnn": "flax.linen.RNN(flax.linen.SimpleCell(d)) (a lax.scan)",
              "attention": "attention_core MultiHeadAttention (jax backend)"}
    short: ClassVar[dict[str, str]] = {"conv": "flax nn.Conv", "rnn": "flax nn.RNN(SimpleCell)"}

    def __init__(self, threads: int) -> None:
        import jax

        self.jax = jax
        super().__init__(threads)

    def _compiled(self, module: Any, params: Mapping[str, Any], x: np.ndarray) -> Contender:
        import jax.numpy as jnp

        variables = {"params": self.jax.tree_util.tree_map(jnp.asarray, dict(params))}
        fn = self.jax.jit(module.apply)
        X = jnp.asarray(x)
        sync = self.harness.sync
        return Contender(lambda: sync(fn(variables, X)), self._numpy)

    def conv(self, x: np.ndarray, weights: Mapping[str, np.ndarray]) -> Contender:
        """The 1-D convolution (see the base class)."""
        import flax.linen as nn

        k, _, d_out = weights["conv.kernel"].shape
        module = nn.Conv(features=d_out, kernel_size=(k,), padding="SAME")
        return self._compiled(module, {"kernel": weights["conv.kernel"], "bias": weights["conv.bias"]}, x)

    def rnn(self, x: np.ndarray, weights: Mapping[str, np.ndarray]) -> Contender:
        """The recurrent layer (see the base class)."""
        import flax.linen as nn

        W, U, b = weights["rnn.W"], weights["rnn.U"], weights["rnn.b"]
        module = nn.RNN(nn.SimpleCell(features=W.shape[1]))
        params = {"cell": {"i": {"kernel": W, "bias": b}, "h": {"kernel": U}}}
        return self._compiled(module, params, x)

    def attention(self, x: np.ndarray, weights: Mapping[str, np.ndarray], heads: int) -> Contender:
        """This library's layer (see the base class)."""
        import jax.numpy as jnp

        layer = self._our_layer(weights, heads)
        variables = self.module.init_from_weights(layer, attention_weights(weights))
        fn = self.jax.jit(lambda variables, x: layer.apply(variables, x, x, x))
        X = jnp.asarray(x)
        sync = self.harness.sync
        return Contender(lambda: sync(fn(variables, X)), self._numpy)


class MXNetBuilder(Builder):
    """MXNet: imperative Gluon blocks (not hybridized); calls wait with ``wait_to_read``."""

    name = "mxnet"
    layers: ClassVar[dict[str, str]] = {"conv": "gluon.nn.Conv1D(d, k, padding=(k-1)//2), input (B, d, n)",
              "rnn": "gluon.rnn.RNN(d, activation='tanh', layout='NTC')",
              "attention": "attention_core MultiHeadAttention (mxnet backend)"}
    short: ClassVar[dict[str, str]] = {"conv": "gluon Conv1D", "rnn": "gluon rnn.RNN"}

    def __init__(self, threads: int) -> None:
        import mxnet

        self.mx = mxnet
        super().__init__(threads)

    def _set(self, block: Any, values: Mapping[str, np.ndarray]) -> None:
        """Sets a block's parameters by the end of their (prefixed) names."""
        params = block.collect_params()
        for suffix, value in values.items():
            (param,) = [p for name, p in params.items() if name.endswith(suffix)]
            param.set_data(self.mx.np.array(value, dtype="float32"))

    def _call(self, layer: Any, X: Any, to_numpy: Callable[[Any], np.ndarray]) -> Contender:
        sync = self.harness.sync
        return Contender(lambda: sync(layer(X)), to_numpy)

    def conv(self, x: np.ndarray, weights: Mapping[str, np.ndarray]) -> Contender:
        """The 1-D convolution (see the base class)."""
        from mxnet.gluon import nn

        k, d_in, d_out = weights["conv.kernel"].shape
        layer = nn.Conv1D(d_out, k, padding=(k - 1) // 2, in_channels=d_in)
        layer.initialize()
        self._set(layer, {"weight": weights["conv.kernel"].transpose(2, 1, 0),  # (out, in, k)
                          "bias": weights["conv.bias"]})
        X = self.mx.np.array(np.ascontiguousarray(x.transpose(0, 2, 1)), dtype="float32")
        return self._call(layer, X, self._channels_first)

    def rnn(self, x: np.ndarray, weights: Mapping[str, np.ndarray]) -> Contender:
        """The recurrent layer (see the base class)."""
        from mxnet.gluon import rnn

        W, U, b = weights["rnn.W"], weights["rnn.U"], weights["rnn.b"]
        layer = rnn.RNN(W.shape[1], activation="tanh", layout="NTC", input_size=W.shape[0])
        layer.initialize()
        self._set(layer, {"i2h_weight": W.T, "h2h_weight": U.T, "i2h_bias": b,
                          "h2h_bias": np.zeros_like(b)})
        return self._call(layer, self.mx.np.array(x, dtype="float32"), self._numpy)


BUILDERS: dict[str, type[Builder]] = {
    "numpy": Builder, "torch": TorchBuilder, "tensorflow": TensorFlowBuilder,
    "jax": JaxBuilder, "mxnet": MXNetBuilder,
}


def builder(name: str, threads: int) -> Builder:
    """The contenders' builder of a backend (imports its framework).

    Raises:
        ValueError: An unknown backend name.
        ImportError: The backend's framework is not installed.
    """
    key = registry.canonical_name(name)
    registry.load(key)  # raises BackendNotInstalledError saying what to install
    return BUILDERS[key](threads)


__all__ = ["BUILDERS", "Builder", "Contender", "attention_weights", "builder", "conv_numpy",
           "layer_weights", "rnn_numpy"]
