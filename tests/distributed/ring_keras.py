"""A Keras ``MultiHeadAttention`` with ``context_parallel=`` on sequence shards, against one device.

Keras runs on the framework's own engine: with ``KERAS_BACKEND=jax`` the layer's
``stateless_call`` runs inside ``jax.shard_map`` over 4 host devices (run with
``XLA_FLAGS=--xla_force_host_platform_device_count=4``); with ``KERAS_BACKEND=torch`` each of 2
gloo ranks (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set) calls the layer on
its shard. A rotary grouped-query layer, causal with lengths, in float32 (Keras' default): the
output rows, the input's gradient, and the weights' gradients (summed over the ranks).
"""

from __future__ import annotations

import faulthandler
import os

import keras
import numpy as np

from attention_core import parallel as par
from backends.keras import MultiHeadAttention
from tests.distributed.common import HKV, LENGTHS, B, H, N, emit, max_abs_diff

WIDTH = 16
OPTIONS = {"num_kv_heads": HKV, "positional": "rotary"}


def _data() -> tuple[np.ndarray, np.ndarray]:
    X = np.random.default_rng(9).standard_normal((B, N, WIDTH)).astype(np.float32)
    cot = np.random.default_rng(10).standard_normal((B, N, WIDTH)).astype(np.float32)
    return X, cot


def _layers(split: object) -> tuple[MultiHeadAttention, MultiHeadAttention]:
    """The layer on the whole sequence, and the same weights in the context-parallel one."""
    whole = MultiHeadAttention(WIDTH, H, **OPTIONS)
    whole.set_weights(_initial())
    other = MultiHeadAttention(WIDTH, H, **OPTIONS, context_parallel=split)
    other.set_weights(whole.get_weights())
    return whole, other


def _initial() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    depth = WIDTH // H
    shapes = {"W_q.kernel": (WIDTH, WIDTH), "W_k.kernel": (WIDTH, HKV * depth),
              "W_v.kernel": (WIDTH, HKV * depth), "W_o.kernel": (WIDTH, WIDTH)}
    return {k: (0.3 * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()}


def on_jax() -> dict[str, float]:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from backends.jax.ops import JaxOps

    devices = jax.devices()
    world, ops = len(devices), JaxOps()
    mesh = Mesh(np.array(devices), ("seq",))
    whole, split = _layers("seq")
    X, cot = (jnp.asarray(a) for a in _data())
    lens = jnp.asarray(LENGTHS)

    def laid(x: jax.Array) -> jax.Array:
        return jnp.concatenate([par.shard(ops, x, world, r, 1, layout="zigzag")
                                for r in range(world)], 1)

    def unlaid(x: jax.Array) -> jax.Array:
        rows = x.shape[1] // world
        return par.unshard(ops, [x[:, r * rows:(r + 1) * rows] for r in range(world)], 1)

    def call(layer: MultiHeadAttention, weights: list, x: jax.Array) -> jax.Array:
        out, _ = layer.stateless_call(weights, [], x, x, x, lens, causal=True)
        return out

    rows = P(None, "seq", None)
    sharded = jax.shard_map(lambda w, x: call(split, w, x), mesh=mesh, in_specs=(P(), rows),
                            out_specs=rows)
    weights = [v.value for v in whole.trainable_variables]

    def sharded_loss(w: list, x: jax.Array) -> jax.Array:
        return jnp.sum(unlaid(sharded(w, laid(x))) * cot)

    def one_loss(w: list, x: jax.Array) -> jax.Array:
        return jnp.sum(call(whole, w, x) * cot)

    got = jax.jit(jax.grad(sharded_loss, argnums=(0, 1)))(weights, X)
    want = jax.grad(one_loss, argnums=(0, 1))(weights, X)
    result = {"out": max_abs_diff(unlaid(jax.jit(sharded)(weights, laid(X))),
                                  call(whole, weights, X)),
              "dX": max_abs_diff(got[1], want[1])}
    for variable, g, w in zip(whole.trainable_variables, got[0], want[0], strict=True):
        result[f"d{variable.path}"] = max_abs_diff(g, w)
    return result


def on_torch() -> dict[str, float]:
    import torch
    import torch.distributed as dist

    from backends.torch.ops import TorchOps

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        ops = TorchOps()
        whole, split = _layers(True)
        X, cot = (torch.from_numpy(a) for a in _data())
        lens = torch.from_numpy(LENGTHS)
        full = X.clone().requires_grad_()
        out = whole(full, full, full, lens, causal=True)
        (out * cot).sum().backward()
        mine_x = par.shard(ops, X, world, rank, 1, "zigzag").requires_grad_()
        mine = split(mine_x, mine_x, mine_x, lens, causal=True)
        (mine * par.shard(ops, cot, world, rank, 1, "zigzag")).sum().backward()
        result = {"out": max_abs_diff(mine.detach(), par.shard(ops, out.detach(), world, rank,
                                                              1, "zigzag")),
                  "dX": max_abs_diff(mine_x.grad, par.shard(ops, full.grad, world, rank, 1,
                                                            "zigzag"))}
        for ours, theirs in zip(split.trainable_variables, whole.trainable_variables,
                                strict=True):
            grad = ours.value.grad.clone()
            dist.all_reduce(grad)
            result[f"d{theirs.path}"] = max_abs_diff(grad, theirs.value.grad)
    finally:
        dist.destroy_process_group()
    return result


def main() -> None:
    faulthandler.dump_traceback_later(240, exit=True)
    emit(on_jax() if keras.backend.backend() == "jax" else on_torch())


if __name__ == "__main__":
    main()
