"""Ring attention inside ``jax.shard_map`` over 4 host devices, against one device.

Run with ``XLA_FLAGS=--xla_force_host_platform_device_count=4``. In float64: q, k, v laid out
in the layout's order and split along the sequence over a mesh axis ``"seq"``; the output and
the gradients of q, k, v are compared with one device's over the whole sequence.

Arguments: the layout (default ``zigzag``) and the part, ``masks`` (the functional ring under
every mask kind) or ``layers`` (linen and NNX layers and a decoder stack).
"""

from __future__ import annotations

import sys
from typing import Any

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import attention_core as ac  # noqa: E402
from attention_core import parallel as par  # noqa: E402
from backends.jax import DotProductAttention, MultiHeadAttention, TransformerDecoder  # noqa: E402
from backends.jax.ops import JaxOps  # noqa: E402
from backends.jax.parallel import ring_attention  # noqa: E402
from tests.distributed.common import HKV, LENGTHS, MASKS, B, D, H, N, emit, max_abs_diff  # noqa: E402


def main() -> None:
    layout = sys.argv[1] if len(sys.argv) > 1 else "zigzag"
    part = sys.argv[2] if len(sys.argv) > 2 else "masks"
    devices = jax.devices()
    world = len(devices)
    mesh = Mesh(np.array(devices), ("seq",))
    rng = np.random.default_rng(5)
    q, k, v, cot = (jnp.asarray(rng.standard_normal(s)) for s in
                    ((B, H, N, D), (B, HKV, N, D), (B, HKV, N, D), (B, H, N, D)))
    ops = JaxOps()

    def laid(x: jax.Array) -> jax.Array:  # the shards one after another, in the layout's rows
        return jnp.concatenate([par.shard(ops, x, world, r, 2, layout) for r in range(world)], 2)

    def unlaid(x: jax.Array) -> jax.Array:
        rows = x.shape[2] // world
        return par.unshard(ops, [x[:, :, r * rows:(r + 1) * rows] for r in range(world)], 2,
                           layout)

    spec = P(None, None, "seq", None)
    if part == "layers":
        emit({**_layer(mesh, world, layout), **_stack(mesh, world, layout)})
        return
    result = {}
    for name, given in MASKS.items():
        masks = {key: jnp.asarray(x) if isinstance(x, np.ndarray) else x
                 for key, x in given.items()}
        ring = jax.shard_map(lambda a, b, c, m=masks: ring_attention(a, b, c, axis_name="seq",
                                                                     layout=layout, **m),
                             mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)

        def sharded_loss(a: jax.Array, b: jax.Array, c: jax.Array, ring: object = ring) -> jax.Array:
            return jnp.sum(unlaid(ring(laid(a), laid(b), laid(c))) * cot)  # type: ignore[operator]

        def one_loss(a: jax.Array, b: jax.Array, c: jax.Array, m: dict = masks) -> jax.Array:
            return jnp.sum(ac.dot_product_attention(a, b, c, **m) * cot)

        got = jax.jit(jax.value_and_grad(sharded_loss, argnums=(0, 1, 2)))(q, k, v)
        want = jax.value_and_grad(one_loss, argnums=(0, 1, 2))(q, k, v)
        out = unlaid(jax.jit(ring)(laid(q), laid(k), laid(v)))
        result[f"{name}.out"] = max_abs_diff(out, ac.dot_product_attention(q, k, v, **masks))
        for label, g, w in zip("qkv", got[1], want[1], strict=True):
            result[f"{name}.d{label}"] = max_abs_diff(g, w)
    emit(result)


def _layer(mesh: Mesh, world: int, layout: str) -> dict[str, float]:
    """A rotary grouped-query linen layer (float64) on the shards against the whole sequence.

    Causal, with lengths: the output, and the gradients of the input and of the weights.
    """
    ops, width = JaxOps(), 16
    options = {"num_kv_heads": HKV, "positional": "rotary", "param_dtype": jnp.float64}
    whole = MultiHeadAttention(width, H, **options)
    split = MultiHeadAttention(width, H, **options, context_parallel="seq")
    X = jnp.asarray(np.random.default_rng(9).standard_normal((B, N, width)))
    cot = jnp.asarray(np.random.default_rng(10).standard_normal((B, N, width)))
    lens = jnp.asarray(LENGTHS)
    variables = whole.init(jax.random.key(0), X, X, X, lens, causal=True)

    def laid(x: jax.Array) -> jax.Array:
        return jnp.concatenate([par.shard(ops, x, world, r, 1, layout) for r in range(world)], 1)

    def unlaid(x: jax.Array) -> jax.Array:
        rows = x.shape[1] // world
        return par.unshard(ops, [x[:, r * rows:(r + 1) * rows] for r in range(world)], 1, layout)

    rows = P(None, "seq", None)
    sharded = jax.shard_map(lambda v, x: split.apply(v, x, x, x, lens, causal=True), mesh=mesh,
                            in_specs=(P(), rows), out_specs=rows)

    def sharded_loss(v: dict, x: jax.Array) -> jax.Array:
        return jnp.sum(unlaid(sharded(v, laid(x))) * cot)

    def one_loss(v: dict, x: jax.Array) -> jax.Array:
        return jnp.sum(whole.apply(v, x, x, x, lens, causal=True) * cot)

    got = jax.jit(jax.grad(sharded_loss, argnums=(0, 1)))(variables, X)
    want = jax.grad(one_loss, argnums=(0, 1))(variables, X)
    out = unlaid(jax.jit(sharded)(variables, laid(X)))
    result = {"layer.out": max_abs_diff(out, whole.apply(variables, X, X, X, lens, causal=True)),
              "layer.dX": max_abs_diff(got[1], want[1])}
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got[0]),
                            jax.tree_util.tree_leaves(want[0]), strict=True):
        result[f"layer.d{jax.tree_util.keystr(path)}"] = max_abs_diff(g, w)
    # a rotary, windowed DotProductAttention layer (no weights) on the same rows
    dpa_whole = DotProductAttention(positional="rotary", window=5)
    dpa_split = DotProductAttention(positional="rotary", window=5, context_parallel="seq")
    dpa = jax.shard_map(lambda x: dpa_split.apply({}, x, x, x, lens, causal=True), mesh=mesh,
                        in_specs=(rows,), out_specs=rows)

    def dpa_one(x: jax.Array) -> jax.Array:
        return dpa_whole.apply({}, x, x, x, lens, causal=True)

    got_x = jax.jit(jax.grad(lambda x: jnp.sum(unlaid(dpa(laid(x))) * cot)))(X)
    result["dpa.out"] = max_abs_diff(unlaid(jax.jit(dpa)(laid(X))), dpa_one(X))
    result["dpa.dX"] = max_abs_diff(got_x, jax.grad(lambda x: jnp.sum(dpa_one(x) * cot))(X))
    return {**result, **_nnx_layer(mesh, X, cot, lens, laid, unlaid)}


def _nnx_layer(mesh: Mesh, X: jax.Array, cot: jax.Array, lens: jax.Array, laid: Any,
               unlaid: Any) -> dict[str, float]:
    """The same rotary grouped-query layer in NNX: its state split off, merged inside shard_map."""
    from flax import nnx

    from backends.jax import nnx as bnnx

    options = {"num_kv_heads": HKV, "positional": "rotary", "param_dtype": jnp.float64}
    whole = bnnx.MultiHeadAttention(16, H, **options, rngs=nnx.Rngs(0))
    graph = nnx.graphdef(bnnx.MultiHeadAttention(16, H, **options, context_parallel="seq",
                                                 rngs=nnx.Rngs(1)))
    state = nnx.state(whole)  # the whole layer's weights, in the split layer's graph

    def call(st: Any, x: jax.Array) -> jax.Array:
        return nnx.merge(graph, st)(x, x, x, lens, causal=True)

    rows = P(None, "seq", None)
    sharded = jax.shard_map(call, mesh=mesh, in_specs=(P(), rows), out_specs=rows)

    def one_loss(st: Any, x: jax.Array) -> jax.Array:
        return jnp.sum(nnx.merge(nnx.graphdef(whole), st)(x, x, x, lens, causal=True) * cot)

    got = jax.jit(jax.grad(lambda st, x: jnp.sum(unlaid(sharded(st, laid(x))) * cot),
                           argnums=(0, 1)))(state, X)
    want = jax.grad(one_loss, argnums=(0, 1))(state, X)
    result = {"nnx.out": max_abs_diff(unlaid(jax.jit(sharded)(state, laid(X))), whole(
        X, X, X, lens, causal=True)), "nnx.dX": max_abs_diff(got[1], want[1])}
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got[0]),
                            jax.tree_util.tree_leaves(want[0]), strict=True):
        result[f"nnx.d{jax.tree_util.keystr(path)}"] = max_abs_diff(g, w)
    return result



def _stack(mesh: Mesh, world: int, layout: str) -> dict[str, float]:
    """A linen decoder-only stack (sinusoidal positions, grouped heads, lengths) on token shards.

    The logits, and the weights' gradients, against one device.
    """
    ops = JaxOps()
    config = {"vocab_size": 30, "num_hiddens": 16, "ffn_num_hiddens": 24, "num_heads": H,
              "num_blks": 2, "decoder_only": True, "num_kv_heads": HKV,
              "param_dtype": jnp.float64}
    whole = TransformerDecoder(**config)
    split = TransformerDecoder(**config, context_parallel="seq")
    tokens = jnp.asarray(np.random.default_rng(11).integers(0, 30, (B, N)), jnp.int32)
    cot = jnp.asarray(np.random.default_rng(12).standard_normal((B, N, 30)))
    lens = jnp.asarray(LENGTHS)
    variables = whole.init(jax.random.key(0), tokens, valid_lens=lens)

    def laid(x: jax.Array) -> jax.Array:
        return jnp.concatenate([par.shard(ops, x, world, r, 1, layout) for r in range(world)], 1)

    def unlaid(x: jax.Array) -> jax.Array:
        rows = x.shape[1] // world
        return par.unshard(ops, [x[:, r * rows:(r + 1) * rows] for r in range(world)], 1, layout)

    rows = P(None, "seq")
    sharded = jax.shard_map(lambda v, t: split.apply(v, t, valid_lens=lens), mesh=mesh,
                            in_specs=(P(), rows), out_specs=P(None, "seq", None))
    got = jax.jit(jax.grad(lambda v: jnp.sum(unlaid(sharded(v, laid(tokens))) * cot)))(variables)
    want = jax.grad(lambda v: jnp.sum(whole.apply(v, tokens, valid_lens=lens) * cot))(variables)
    out = unlaid(jax.jit(sharded)(variables, laid(tokens)))
    result = {"stack.out": max_abs_diff(out, whole.apply(variables, tokens, valid_lens=lens))}
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got),
                            jax.tree_util.tree_leaves(want), strict=True):
        result[f"stack.d{jax.tree_util.keystr(path)}"] = max_abs_diff(g, w)
    return result


if __name__ == "__main__":
    main()
