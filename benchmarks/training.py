"""One training step of the default layers against each framework's own, in one process.

The training benchmark. A training step is the forward of a layer on ``X (1, n, 512)``
with ``valid_lens = [n - n // 4]`` (the framework's layer gets the equivalent key padding
mask), then the gradients of the output's sum by every weight; dropout 0 on both sides, so
that both do the same arithmetic. Ours are constructed with their defaults (they keep their
attention weights: formed on read in eager calls, in the program when traced). Contenders,
timed in interleaved rounds (:mod:`benchmarks.timing`), each ``ours ÷ native`` with the A/A
control ``native' ÷ native``:

* ``mha``: ``MultiHeadAttention(512, 8, bias=True)`` against the framework's multi-head
  attention holding the same weights (``backends.<fw>.convert``): torch
  ``nn.MultiheadAttention(batch_first=True)``, ``keras.layers.MultiHeadAttention``, Flax
  ``MultiHeadDotProductAttention``;
* ``block``: ``TransformerEncoderBlock(512, 2048, 8, bias=True)`` against torch's
  ``nn.TransformerEncoderLayer(512, 8, 2048, dropout=0, batch_first=True)`` (post-norm, ReLU,
  as the block), or a post-norm block composed of the framework's own layers (Keras: its
  multi-head attention, ``LayerNormalization`` and ``Dense``; Flax likewise), each with its own
  initial weights (same shapes and arithmetic; the outputs are not compared).

On MXNet, as in suite (a), the native side is written with MXNet's own pieces: the plain
``mxnet.numpy`` multi-head attention of :func:`benchmarks.natives.plain_mha` holding our
layer's weights, and a post-norm block of Gluon's ``nn.Dense`` and ``nn.LayerNorm`` around it.

torch runs eagerly; TensorFlow steps are one ``tf.function`` each (``tf.GradientTape``
inside, as ``fit`` does); JAX steps are ``jax.jit(jax.grad(...))``; MXNet runs imperatively
(neither side hybridized) under ``autograd.record()``, then ``backward()``.

Usage: ``python -m benchmarks.training --backend torch [--sizes 128,1024] [--rounds 15]
[--min-time 0.2]``, from the repository, one backend per process; ``python -m benchmarks
--suite train`` writes the same points into ``bench-<backend>.json``.
"""

from __future__ import annotations

import importlib
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent

HIDDEN, HEADS, FFN = 512, 8, 2048
Steps = dict[str, Callable[[], Any]]


def inputs(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``X (1, n, 512)``, ``valid_lens (1,)`` and the key padding ``(1, n)`` (True = a key)."""
    X = np.random.default_rng(n).standard_normal((1, n, HIDDEN)).astype(np.float32)
    lens = np.array([n - n // 4], np.int32)
    return X, lens, np.arange(n)[None, :] < lens[:, None]


def torch_steps(kind: str, n: int) -> Steps:
    """The torch contenders: eager steps, ``zero_grad`` then forward and backward."""
    import torch

    from backends.torch import MultiHeadAttention, TransformerEncoderBlock
    from backends.torch.convert import to_torch

    x, lens_np, keys = inputs(n)
    X, lens, padding = torch.from_numpy(x), torch.from_numpy(lens_np), torch.from_numpy(~keys)

    def step(module: torch.nn.Module, forward: Callable[[], torch.Tensor]) -> Callable[[], Any]:
        def call() -> Any:
            module.zero_grad(set_to_none=True)
            out = forward()
            out.sum().backward()  # type: ignore[no-untyped-call]
            return out
        return call

    if kind == "mha":
        ours = MultiHeadAttention(HIDDEN, HEADS, bias=True).train()
        ours(X, X, X, lens)  # sizes inferred
        native = to_torch(ours.get_weights(), HEADS, batch_first=True).train()
        return {"ours": step(ours, lambda: ours(X, X, X, lens)),
                "native": step(native, lambda: native(X, X, X, key_padding_mask=padding,
                                                      need_weights=False)[0])}
    block = TransformerEncoderBlock(HIDDEN, FFN, HEADS, bias=True).train()
    layer = torch.nn.TransformerEncoderLayer(HIDDEN, HEADS, FFN, dropout=0.0,
                                             batch_first=True).train()
    return {"ours": step(block, lambda: block(X, lens)),
            "native": step(layer, lambda: layer(X, src_key_padding_mask=padding))}


def tensorflow_steps(kind: str, n: int) -> Steps:
    """The Keras contenders: a ``tf.function`` step each, gradients by ``tf.GradientTape``."""
    import keras
    import tensorflow as tf

    from backends.tensorflow import MultiHeadAttention, TransformerEncoderBlock
    from backends.tensorflow.convert import to_keras

    x, lens_np, keys = inputs(n)
    X, lens = tf.constant(x), tf.constant(lens_np)
    mask = tf.constant(keys[:, None, :])  # (B, 1, K), True = may attend

    class Block(keras.layers.Layer):  # type: ignore[misc]
        """A post-norm encoder block of Keras' own layers."""

        def __init__(self) -> None:
            super().__init__()
            self.attention = keras.layers.MultiHeadAttention(HEADS, HIDDEN // HEADS)
            self.norm1 = keras.layers.LayerNormalization(epsilon=1e-5)
            self.dense1 = keras.layers.Dense(FFN, activation="relu")
            self.dense2 = keras.layers.Dense(HIDDEN)
            self.norm2 = keras.layers.LayerNormalization(epsilon=1e-5)

        def call(self, x: Any, mask: Any) -> Any:
            y = self.norm1(x + self.attention(x, x, x, attention_mask=mask))
            return self.norm2(y + self.dense2(self.dense1(y)))

    def step(layer: Any, forward: Callable[[], Any]) -> Callable[[], Any]:
        forward()  # builds the weights

        def gradients() -> Any:
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(forward())
            return tape.gradient(loss, layer.trainable_variables)

        train = tf.function(gradients, autograph=False)
        return lambda: [g.numpy() for g in train()][-1]

    if kind == "mha":
        ours = MultiHeadAttention(HIDDEN, HEADS, bias=True)
        ours(X, X, X, lens)
        native = to_keras(ours.get_weights(), HEADS)
        return {"ours": step(ours, lambda: ours(X, X, X, lens, training=True)),
                "native": step(native, lambda: native(X, X, X, attention_mask=mask,
                                                      training=True))}
    block, composed = TransformerEncoderBlock(HIDDEN, FFN, HEADS, bias=True), Block()
    return {"ours": step(block, lambda: block(X, lens, training=True)),
            "native": step(composed, lambda: composed(X, mask))}


def jax_steps(kind: str, n: int) -> Steps:
    """The Flax contenders: ``jax.jit(jax.grad(...))`` of the sum, by the params."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from backends.jax import MultiHeadAttention, TransformerEncoderBlock, get_weights
    from backends.jax.convert import to_flax

    x, lens_np, keys = inputs(n)
    X, lens, mask = jnp.asarray(x), jnp.asarray(lens_np), jnp.asarray(keys[:, None, None, :])

    class Block(nn.Module):
        """A post-norm encoder block of Flax's own layers."""

        @nn.compact
        def __call__(self, x: Any, mask: Any) -> Any:
            y = nn.LayerNorm(epsilon=1e-5)(x + nn.MultiHeadDotProductAttention(HEADS)(
                x, x, mask=mask))
            return nn.LayerNorm(epsilon=1e-5)(y + nn.Dense(HIDDEN)(nn.relu(nn.Dense(FFN)(y))))

    def step(apply: Callable[..., Any], variables: Any) -> Callable[[], Any]:
        grad = jax.jit(jax.grad(lambda v: jnp.sum(apply(v))))
        return lambda: jax.block_until_ready(grad(variables))  # type: ignore[no-untyped-call]

    key = jax.random.PRNGKey(0)
    if kind == "mha":
        ours = MultiHeadAttention(HIDDEN, HEADS, bias=True)
        variables = ours.init(key, X, X, X, lens)
        native, native_vars = to_flax(get_weights(variables), HEADS)
        return {"ours": step(lambda v: ours.apply(v, X, X, X, lens, training=True), variables),
                "native": step(lambda v: native.apply(v, X, X, mask=mask), native_vars)}
    block, composed = TransformerEncoderBlock(HIDDEN, FFN, HEADS, bias=True), Block()
    return {"ours": step(lambda v: block.apply(v, X, lens, training=True),
                         block.init(key, X, lens)),
            "native": step(lambda v: composed.apply(v, X, mask), composed.init(key, X, mask))}


def mxnet_steps(kind: str, n: int) -> Steps:
    """The MXNet contenders: imperative Gluon under ``autograd.record()``, then ``backward()``.

    The native side is written with MXNet's own pieces, as suite (a) does: the plain
    multi-head attention of :func:`benchmarks.natives.plain_mha` in ``mxnet.numpy`` holding
    our layer's weights, and for the block a post-norm block of Gluon's ``nn.Dense`` and
    ``nn.LayerNorm`` around that plain attention (its own initial weights). Neither side is
    hybridized. Each step returns the gradient of every parameter, copied to NumPy.
    """
    import mxnet as mx
    from mxnet.gluon import nn

    from backends.mxnet import MultiHeadAttention, TransformerEncoderBlock
    from benchmarks.natives import canonical_weights, plain_mha

    x, lens_np, _ = inputs(n)
    X, lens = mx.np.array(x), mx.np.array(lens_np, dtype="int32")

    def attention_weights(seed: int) -> dict[str, Any]:
        weights = {k: mx.np.array(v) for k, v in canonical_weights(seed).items()}
        for w in weights.values():
            w.attach_grad()
        return weights

    class Block(nn.Block):  # type: ignore[misc]
        """A post-norm encoder block: plain attention, Gluon's ``Dense`` and ``LayerNorm``."""

        def __init__(self) -> None:
            super().__init__()
            self.weights = attention_weights(1)
            self.norm1 = nn.LayerNorm(epsilon=1e-5, in_channels=HIDDEN)
            self.dense1 = nn.Dense(FFN, activation="relu", flatten=False, in_units=HIDDEN)
            self.dense2 = nn.Dense(HIDDEN, flatten=False, in_units=FFN)
            self.norm2 = nn.LayerNorm(epsilon=1e-5, in_channels=HIDDEN)

        def forward(self, x: Any) -> Any:
            y = self.norm1(x + plain_mha(mx.np, x, lens, self.weights, HEADS))
            return self.norm2(y + self.dense2(self.dense1(y)))

    def step(forward: Callable[[], Any], grads: Callable[[], list[Any]]) -> Callable[[], Any]:
        # ``grads`` gives the gradient arrays: reading them waits for the backward pass
        # (MXNet's engine runs it asynchronously; reading the weights would not wait)
        def call() -> Any:
            with mx.autograd.record():
                out = forward()
            out.backward()
            return [g.asnumpy() for g in grads()]
        return call

    def parameter_grads(block: Any) -> Callable[[], list[Any]]:
        params = list(block.collect_params().values())
        return lambda: [p.grad() for p in params]

    if kind == "mha":
        ours = MultiHeadAttention(HIDDEN, HEADS, bias=True)
        ours.initialize()
        ours(X, X, X, lens)  # sizes inferred
        weights = {k: mx.np.array(v) for k, v in ours.get_weights().items()}
        for w in weights.values():
            w.attach_grad()
        return {"ours": step(lambda: ours(X, X, X, lens), parameter_grads(ours)),
                "native": step(lambda: plain_mha(mx.np, X, lens, weights, HEADS),
                               lambda: [w.grad for w in weights.values()])}
    block, composed = TransformerEncoderBlock(HIDDEN, FFN, HEADS, bias=True), Block()
    block.initialize()
    composed.initialize()
    block(X, lens)
    return {"ours": step(lambda: block(X, lens), parameter_grads(block)),
            "native": step(lambda: composed(X), lambda: [
                *parameter_grads(composed)(), *(w.grad for w in composed.weights.values())])}


STEPS = {"torch": torch_steps, "tensorflow": tensorflow_steps, "jax": jax_steps,
         "mxnet": mxnet_steps}
#: The layers timed, in order.
KINDS = ("mha", "block")
#: What the native contender of each kind is, per backend (for the tables).
NATIVES = {
    "torch": {"mha": "torch.nn.MultiheadAttention",
              "block": "torch.nn.TransformerEncoderLayer (post-norm)"},
    "tensorflow": {"mha": "keras.layers.MultiHeadAttention",
                   "block": "post-norm block of Keras layers"},
    "jax": {"mha": "flax MultiHeadDotProductAttention",
            "block": "post-norm block of Flax layers"},
    "mxnet": {"mha": "plain mx.np MHA",
              "block": "post-norm block: plain mx.np MHA, Gluon Dense and LayerNorm"},
}


def time_point(backend: str, kind: str, n: int, rounds: int, min_time: float) -> dict[str, Any]:
    """Times ours against the native contender for one kind and n, in interleaved rounds.

    Returns:
        ``{"kind", "n", "ratio", "aa", "ours_ms", "native_ms"}``: ``ratio`` is ours ÷ native,
        ``aa`` native ÷ itself (the noise control), both as :meth:`timing.Ratio.as_dict`.
    """
    from benchmarks import timing

    made = STEPS[backend](kind, n)
    for call in made.values():
        call()  # compiled (or warmed up) here
    times = timing.interleaved({"ours": made["ours"], "native": made["native"],
                                "native'": made["native"]}, rounds, min_time)
    return {"kind": kind, "n": n, "ratio": timing.ratio(times, "ours", "native").as_dict(),
            "aa": timing.ratio(times, "native'", "native").as_dict(),
            "ours_ms": 1e3 * statistics.median(times["ours"]),
            "native_ms": 1e3 * statistics.median(times["native"])}


def main() -> None:
    """Parses the arguments, times each kind and size, prints one line each."""
    timing = importlib.import_module("benchmarks.timing")
    parser = timing.ab_parser(__doc__.splitlines()[0], "128,1024")
    parser.add_argument("--backend", choices=sorted(STEPS), required=True)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {head}; {args.backend}, "
          f"{os.cpu_count()} CPUs; {args.rounds} interleaved rounds, median [95% interval]",
          flush=True)
    for kind in KINDS:
        for n in sizes:
            p = time_point(args.backend, kind, n, args.rounds, args.min_time)
            r, aa = p["ratio"], p["aa"]
            print(f"{kind:5s} n={n:5d}: ours/native {r['median']:.3f} [{r['low']:.3f}, "
                  f"{r['high']:.3f}]   A/A {aa['median']:.3f} [{aa['low']:.3f}, {aa['high']:.3f}]"
                  f"   native {p['native_ms']:.1f} ms", flush=True)


if __name__ == "__main__":
    main()
