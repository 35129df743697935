"""``backends.tensorflow.MultiHeadAttention`` under ``tf.distribute.MirroredStrategy``.

The one CPU is split into 2 logical devices before TensorFlow initialises (hence a script of
its own). The layer is created in ``strategy.scope()`` (its variables mirrored) with the same
float64 weights as a layer outside any strategy. ``strategy.run`` (inside ``tf.function``)
gives each replica its half of the batch (queries, keys, values, ``valid_lens``, targets); each
computes its output and the gradient of its share of the loss (its examples' losses summed and
divided by the global batch size, so the shares add up to the mean over the batch);
``strategy.reduce(SUM)`` adds the gradients across the replicas and ``strategy.gather`` joins
the outputs. Reports how far those are from the single-device forward and gradient of the whole
batch, and (``local_gradient``) how far one replica's unreduced gradient is: far, so the
comparison can fail.
"""

from __future__ import annotations

import time
from typing import Any

import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()])

import keras  # noqa: E402
import numpy as np  # noqa: E402

from backends.tensorflow import MultiHeadAttention  # noqa: E402
from tests.distributed.common import attention_inputs, emit, max_abs_diff  # noqa: E402

B, Q, K, D, H, HEADS = 8, 5, 7, 12, 16, 4
NAMES = ("queries", "keys", "values", "valid_lens", "target")


def per_example_loss(out: Any, target: Any) -> Any:
    """Each example's summed squared error, ``(B,)``."""
    return tf.reduce_sum((out - target) ** 2, axis=[1, 2])


def main() -> None:
    keras.utils.set_random_seed(0)
    inputs = attention_inputs(B, Q, K, D, H)
    tensors = {name: tf.constant(value) for name, value in inputs.items()}
    args = [tensors[n] for n in NAMES[:4]]

    # one device, the whole batch
    single = MultiHeadAttention(H, HEADS, bias=True, dtype="float64")
    single(*args)
    weights = single.get_weights()
    with tf.GradientTape() as tape:
        ref_out = single(*args)
        loss = tf.reduce_mean(per_example_loss(ref_out, tensors["target"]))
    names = list(single.canonical_variables)
    ref_grads = tape.gradient(loss, list(single.canonical_variables.values()))

    # two replicas, half the batch each
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        layer = MultiHeadAttention(H, HEADS, bias=True, dtype="float64")
        layer.build((None, None, D), (None, None, D), (None, None, D))
        layer.set_weights(weights)
    assert list(layer.canonical_variables) == names
    half = B // strategy.num_replicas_in_sync

    def shard(context: tf.distribute.InputContext) -> tuple[Any, ...]:
        i = context.replica_id_in_sync_group
        return tuple(tensors[n][i * half:(i + 1) * half] for n in NAMES)

    shards = strategy.experimental_distribute_values_from_function(shard)
    placed: list[str] = []

    def replica_step(queries: Any, keys: Any, values: Any, valid_lens: Any,
                     target: Any) -> tuple[Any, list[Any]]:
        variables = list(layer.canonical_variables.values())
        with tf.GradientTape() as tape:
            out = layer(queries, keys, values, valid_lens)
            share = tf.nn.compute_average_loss(per_example_loss(out, target), global_batch_size=B)
        placed.append(out.device)  # where this replica's ops are placed (seen while tracing)
        return out, tape.gradient(share, variables)

    @tf.function
    def step(shards: Any) -> tuple[Any, list[Any], Any, list[Any]]:
        outs, grads = strategy.run(replica_step, args=shards)
        summed = [strategy.reduce(tf.distribute.ReduceOp.SUM, g, axis=None) for g in grads]
        return strategy.gather(outs, axis=0), summed, outs, grads

    began = time.perf_counter()
    out, grads, outs, per_replica_grads = step(shards)
    seconds = time.perf_counter() - began
    first_share = [strategy.experimental_local_results(g)[0] for g in per_replica_grads]
    emit({
        "replicas": strategy.num_replicas_in_sync,
        "devices": list(strategy.extended.worker_devices),
        "replica_devices": placed,
        "replica_rows": [int(t.shape[0]) for t in strategy.experimental_local_results(outs)],
        "variable_types": sorted({type(v.value).__name__ for v in layer.canonical_variables.values()}),
        "variable_copies": sorted({len(v.value.values) for v in layer.canonical_variables.values()}),
        "seconds": seconds,
        "dtype": out.dtype.name,
        "forward": max_abs_diff(out, ref_out),
        "gradient": max(max_abs_diff(g, r) for g, r in zip(grads, ref_grads, strict=True)),
        "gradient_scale": max(float(np.abs(g).max()) for g in ref_grads),
        "local_gradient": max(max_abs_diff(g, r) for g, r in zip(first_share, ref_grads, strict=True)),
        "parameters": sorted(names),
    })


if __name__ == "__main__":
    main()
