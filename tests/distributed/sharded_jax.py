"""``backends.jax.MultiHeadAttention`` with the batch sharded over 4 host devices.

Run with ``XLA_FLAGS=--xla_force_host_platform_device_count=4`` (set before JAX starts, which is
why this is a script of its own). In float64 (``jax_enable_x64``, switched on here only): the
queries, keys, values, ``valid_lens`` and targets are split along the batch over a
``jax.sharding.Mesh`` of the 4 CPU devices, the params replicated, and ``jax.jit`` computes the
forward and the gradient of a loss (the mean over the examples) with respect to the params.
Reports how far they are from the same computation run eagerly on one device with nothing
sharded, and how the results are laid out: the output split along the batch over the 4
devices, the gradients replicated.
"""

from __future__ import annotations

import time
from typing import Any

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from backends.jax import MultiHeadAttention, init_weights  # noqa: E402
from backends.jax.layers import flatten  # noqa: E402
from tests.distributed.common import attention_inputs, emit, max_abs_diff  # noqa: E402

B, Q, K, D, H, HEADS = 8, 5, 7, 12, 16, 4


def collectives(hlo: str) -> dict[str, int]:
    """How often each cross-device operation occurs in a compiled program's HLO text."""
    ops = ("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter")
    return {op: hlo.count(f" {op}(") for op in ops}


def main() -> None:
    devices = jax.devices()
    inputs = attention_inputs(B, Q, K, D, H)
    layer = MultiHeadAttention(H, HEADS, bias=True, param_dtype=jnp.float64)
    params = init_weights(layer, seed=0, q_in=D, k_in=D, v_in=D)["params"]

    def forward(params: Any, queries: Any, keys: Any, values: Any, valid_lens: Any) -> Any:
        return layer.apply({"params": params}, queries, keys, values, valid_lens)

    def loss(params: Any, queries: Any, keys: Any, values: Any, valid_lens: Any, target: Any) -> Any:
        out = forward(params, queries, keys, values, valid_lens)
        return jnp.mean(jnp.sum((out - target) ** 2, axis=(1, 2)))

    # one device, nothing sharded, eager
    one = devices[0]
    local = {name: jax.device_put(value, one) for name, value in inputs.items()}
    args = [local[n] for n in ("queries", "keys", "values", "valid_lens")]
    ref_out = forward(jax.device_put(params, one), *args)
    ref_grads = jax.grad(loss)(jax.device_put(params, one), *args, local["target"])

    # 4 devices: the batch split over the mesh, the params replicated, one jit'd program
    mesh = Mesh(np.array(devices), ("batch",))
    by_batch, replicated = NamedSharding(mesh, P("batch")), NamedSharding(mesh, P())
    sharded = {name: jax.device_put(value, by_batch) for name, value in inputs.items()}
    params_r = jax.device_put(params, replicated)
    args = [sharded[n] for n in ("queries", "keys", "values", "valid_lens")]
    began = time.perf_counter()
    forward_program = jax.jit(forward).lower(params_r, *args).compile()
    gradient_program = jax.jit(jax.grad(loss)).lower(params_r, *args, sharded["target"]).compile()
    out = forward_program(params_r, *args)
    grads = gradient_program(params_r, *args, sharded["target"])
    jax.block_until_ready((out, grads))
    seconds = time.perf_counter() - began

    flat_ref, flat = flatten(ref_grads), flatten(grads)
    emit({
        "devices": [str(d) for d in devices],
        "seconds": seconds,
        "dtype": str(out.dtype),
        "forward": max_abs_diff(out, ref_out),
        "gradient": max(max_abs_diff(flat[n], flat_ref[n]) for n in flat_ref),
        "gradient_scale": max(float(np.abs(g).max()) for g in flat_ref.values()),
        "parameters": sorted(flat_ref),
        "input_sharded": sharded["queries"].sharding.is_equivalent_to(by_batch, 3),
        "output_sharded": out.sharding.is_equivalent_to(by_batch, 3),
        "output_shards": sorted([str(s.device), list(s.data.shape), s.index[0].start or 0]
                                for s in out.addressable_shards),
        "gradients_replicated": all(g.sharding.is_fully_replicated for g in flat.values()),
        "gradient_devices": min(len(g.sharding.device_set) for g in flat.values()),
        "reference_devices": len(ref_out.sharding.device_set),
        # what XLA's SPMD partitioner made of the programs: the forward needs no communication
        # (each device attends within its own examples), the gradient sums over the devices
        "forward_collectives": collectives(forward_program.as_text() or ""),
        "gradient_collectives": collectives(gradient_program.as_text() or ""),
    })


if __name__ == "__main__":
    main()
