"""What only Keras on TensorFlow has: tf.function and XLA, tf.GradientTape, the refusal of
another Keras backend by backends.tensorflow.

The cross-backend files (test_reference_matrix, test_errors, test_weights, test_adapters, ...)
already run on this backend; these tests cover what only Keras has. Layers traced for unknown
shapes in every masking, and the blockwise loops' gradients in a ``tf.function``, are in
tests/test_compiled.py (hooks ``unknown_shape_function`` and ``graph_gradients``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import test_backends

if "tensorflow" not in test_backends():
    pytest.skip("the tensorflow backend is not tested in this env", allow_module_level=True)

import keras
import tensorflow as tf

import attention_core as ac
import backends.numpy as numpy_layers
import backends.tensorflow as keras_layers
from attention_core import attention
from attention_core.kernels import blockwise
from backends.tensorflow.ops import OPS
from tests.harness import TOLERANCE, max_diff, tolerance
from tests.reference.cases import MASK_KINDS, mask_arguments

REPO = Path(__file__).resolve().parent.parent
B, Q, K = 2, 4, 6


def draw(*shapes: tuple[int, ...], seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


# -- tf.function and XLA (every layer in every masking, unknown shapes: tests/test_compiled.py) --


def test_functional_api_under_xla() -> None:
    q, k, v = draw((B, 3, Q, 4), (B, 3, K, 4), (B, 3, K, 2))
    lens = np.array([[1, 2, 3, 6], [0, 6, 5, 4]])

    @tf.function(jit_compile=True)
    def fn(a: Any, b: Any, c: Any, lengths: Any) -> Any:
        return ac.dot_product_attention(a, b, c, lengths, causal=True, return_weights=True)

    out, weights = fn(q, k, v, lens)
    expected, expected_w = ac.dot_product_attention(
        q.astype(float), k.astype(float), v.astype(float), lens, causal=True, return_weights=True
    )
    assert max_diff(out.numpy(), expected) <= TOLERANCE["float32"]
    assert max_diff(weights.numpy(), expected_w) <= TOLERANCE["float32"]
    assert np.all(weights.numpy()[1, :, 0] == 0.0)  # valid length 0: the row is all zeros


def test_other_keras_backend_is_refused() -> None:
    code = ("import keras; keras.backend.backend = lambda: 'jax'\n"
            "try:\n    import backends.tensorflow\n"
            "except ImportError as err:\n    print(err)\n")
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert ("backends.tensorflow needs the TensorFlow backend of Keras, but Keras is set to 'jax'"
            in out.stdout)
    assert "KERAS_BACKEND=tensorflow" in out.stdout


# -- the blockwise path: tf.while_loop under tf.function and XLA, equal to the direct path ----

#: Ragged blocks: 13 queries in blocks of 4 (3 full and 1), 19 keys in blocks of 5 (3 and 4).
BQ, BH, BLQ, BLK, DEPTH = 2, 3, 13, 19, 8


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of 4 queries and 5 keys, so the loops run several times with a ragged tail."""
    monkeypatch.setattr(blockwise, "KEY_BLOCK", 5)
    monkeypatch.setattr(blockwise, "MIN_QUERY_BLOCK", 1)
    monkeypatch.setattr(blockwise, "TILE_SCORES", BQ * BH * 4 * 5)


def block_inputs(q: int = BLQ, k: int = BLK) -> list[tf.Tensor]:
    shapes = (BQ, BH, q, DEPTH), (BQ, BH, k, DEPTH), (BQ, BH, k, 5)
    return [tf.constant(x) for x in draw(*shapes, seed=q + k)]


def pooled(implementation: str, q: Any, k: Any, v: Any, masks: dict[str, Any]) -> tf.Tensor:
    return attention.dot_product_attention(q, k, v, implementation=implementation, ops=OPS,
                                           **masks)


def test_blockwise_with_an_unknown_batch(small_blocks: None) -> None:
    q, k, v = block_inputs()
    lens = tf.constant([7, BLK], tf.int32)
    specs = [tf.TensorSpec([None, *x.shape[1:]], x.dtype) for x in (q, k, v)]
    traced = tf.function(lambda q, k, v, lens: pooled("blockwise", q, k, v, {"valid_lens": lens}),
                         input_signature=[*specs, tf.TensorSpec([None], tf.int32)])
    direct = pooled("direct", q, k, v, {"valid_lens": lens}).numpy()
    assert max_diff(traced(q, k, v, lens).numpy(), direct) <= TOLERANCE["float32"]


def test_blockwise_dropout_in_a_layer_under_tf_function(small_blocks: None) -> None:
    keras.utils.set_random_seed(0)
    layer = keras_layers.DotProductAttention(0.5, keep_attention_weights=False,
                                             implementation="blockwise")
    q, k, v = draw((BQ, BLQ, DEPTH), (BQ, BLK, DEPTH), (BQ, BLK, 1), seed=1)
    v = np.ones_like(v)  # each output is then the sum of the kept weights, 0 or 2 each
    step = tf.function(lambda: layer(q, k, v, training=True))
    outs = [step().numpy() for _ in range(2)]
    assert not np.allclose(outs[0], outs[1])
    assert 0.5 < float(np.mean(outs[0])) < 1.5  # inverted dropout keeps the mean near 1


# -- relative positions and the Transformer encoder ---------------------------------------------

#: A small encoder: 10 token ids, width 8, FFN 12, 2 heads, 2 blocks.
ENC = {"vocab_size": 10, "num_hiddens": 8, "ffn_num_hiddens": 12, "num_heads": 2, "num_blks": 2}


def test_relative_attention_with_unknown_lengths_under_xla() -> None:
    """One trace with unknown batch and lengths serves several (Q, K), equal to NumPy."""
    reference = numpy_layers.RelativeMultiHeadAttention(12, 3, 2, bias=True, seed=0, dtype="float64")
    ours = keras_layers.RelativeMultiHeadAttention(12, 3, 2, bias=True)
    signature = [tf.TensorSpec((None, None, 10)), tf.TensorSpec((None, None, 7)),
                 tf.TensorSpec((None, None, 9)), tf.TensorSpec((None,), tf.int32)]
    fn = tf.function(lambda q, k, v, lens: ours(q, k, v, lens, causal=True, return_attention=True),
                     input_signature=signature, jit_compile=True)
    for q_len, k_len in ((4, 6), (5, 2)):  # keys after and before the queries' end: both clipped
        q, k, v = draw((B, q_len, 10), (B, k_len, 7), (B, k_len, 9), seed=q_len)
        lens = np.array([k_len, 1], np.int32)
        expected, expected_w = reference(*(x.astype(np.float64) for x in (q, k, v)), lens,
                                         causal=True, return_attention=True)
        if not ours.built:
            ours.set_weights({n: w.astype(np.float32) for n, w in reference.get_weights().items()})
        out, weights = fn(q, k, v, lens)
        assert max_diff(out.numpy(), expected) <= TOLERANCE["float32"]
        assert max_diff(weights.numpy(), expected_w) <= TOLERANCE["float32"]
    assert fn.experimental_get_tracing_count() == 1


def test_additive_attention_with_one_query_and_a_large_batch() -> None:
    """A Bahdanau decoder step's shapes: queries (64, 1, h). TF 2.21's oneDNN batch matmul
    corrupted the heap on the (B, 1, K, h) @ (h, 1) score product (tensorflow#117700); the ops
    now contract dense kernels with tensordot. Same numbers as the NumPy layer."""
    rng = np.random.default_rng(7)
    q = rng.standard_normal((64, 1, 64)).astype(np.float32)
    kv = rng.standard_normal((64, 9, 64)).astype(np.float32)
    lens = rng.integers(1, 10, 64)
    layer = keras_layers.AdditiveAttention(64)
    out = layer(tf.constant(q), tf.constant(kv), tf.constant(kv), tf.constant(lens))
    reference = numpy_layers.AdditiveAttention(64, dtype="float64")
    reference.set_weights(layer.get_weights())
    expected = reference(q.astype(np.float64), kv.astype(np.float64), kv.astype(np.float64), lens)
    assert max_diff(out.numpy(), expected) <= TOLERANCE["float32"]


# -- unknown sequence lengths -------------------------------------------------


@pytest.mark.parametrize("kind", MASK_KINDS)
def test_recomputed_blocks_in_a_tf_function_give_the_direct_gradients(
    kind: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In a ``tf.function`` (as Keras' ``train_step`` runs it), the blockwise path under a tape
    is recomputed one query block at a time (``recompute_blocks`` returns its output, blocks of
    4 queries in a ``tf.while_loop`` and a tail of 1, ragged key blocks of 5), and the gradients
    of q, k and v equal the direct path's eager ones. A tape outside the function is seen too."""
    B, H, Q, K = 2, 3, 13, 19
    # 4 queries a block (4, 4, 4, 1), the fewest allowed, each over ragged key blocks (5, 5, 5, 4)
    monkeypatch.setattr(blockwise, "MIN_QUERY_BLOCK", 4)
    monkeypatch.setattr(blockwise, "RECOMPUTE_SCORES", B * H * 4 * 5)
    calls: list[tuple[list[tuple[int, int]], bool]] = []
    hook = OPS.recompute_blocks

    def counting(fn: Any, blocks: list[tuple[int, int]], *arrays: Any) -> Any:
        out = hook(fn, blocks, *arrays)
        calls.append((blocks, out is not None))
        return out

    monkeypatch.setattr(OPS, "recompute_blocks", counting)
    rng = np.random.default_rng(len(kind))
    arrays = [tf.constant(rng.standard_normal((B, H, n, d)), tf.float32)
              for n, d in ((Q, 8), (K, 8), (K, 5))]
    masks = {name: x if name == "causal" else tf.constant(x)
             for name, x in mask_arguments(kind, rng, H, Q, K, B).items()}
    cotangent = tf.constant(rng.standard_normal((B, H, Q, 5)), tf.float32)

    def pooled(implementation: str, *xs: Any) -> Any:
        return ac.dot_product_attention(*xs, implementation=implementation, **masks)

    def gradients(implementation: str, *xs: Any) -> list[Any]:
        with tf.GradientTape() as tape:
            tape.watch(xs)
            out = pooled(implementation, *xs)
        return list(tape.gradient(out, list(xs), cotangent))

    want = [g.numpy() for g in gradients("direct", *arrays)]
    got = [g.numpy() for g in tf.function(lambda *xs: gradients("blockwise", *xs))(*arrays)]
    with tf.GradientTape() as tape:  # the tape outside, the function differentiated as one op
        tape.watch(arrays)
        out = tf.function(lambda *xs: pooled("blockwise", *xs))(*arrays)
    outside = [g.numpy() for g in tape.gradient(out, arrays, cotangent)]
    assert calls == [([(0, 4), (4, 4), (8, 4), (12, 1)], True)] * 2
    for i, w in enumerate(want):
        bound = tolerance(f"grad.{i}", "float32", w)
        for g in (got[i], outside[i]):
            assert np.isfinite(g).all(), i
            assert max_diff(g, w) <= bound, i
    calls.clear()
    tf.function(lambda *xs: pooled("blockwise", *xs))(*arrays)  # no tape: the loops as before
    assert calls == [([(0, 4), (4, 4), (8, 4), (12, 1)], False)]


#: The measurement of :func:`test_recomputed_backward_memory`, run in a fresh process.
_BACKWARD_MEMORY = """
import gc, json, sys
from pathlib import Path
import numpy as np
import tensorflow as tf
import attention_core as ac
import backends.tensorflow

def status(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

def step(n):
    rng = np.random.default_rng(0)
    q, k, v = (tf.constant(rng.standard_normal((1, 1, n, 4096)).astype(np.float32))
               for _ in range(3))
    def run():
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            loss = tf.reduce_sum(ac.dot_product_attention(q, k, v, implementation="blockwise"))
        return tape.gradient(loss, [q, k, v])
    return run

step(16)()
run = step(2048)
gc.collect()
Path("/proc/self/clear_refs").write_text("5")
base = status("VmRSS")
grads = run()
print(json.dumps({"extra": status("VmHWM") - base}))
"""


def _extra_memory(script: str) -> int:
    """The extra memory (bytes) a measuring script prints, run in a fresh process."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "KERAS_BACKEND": "tensorflow",
           "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         cwd=REPO, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(json.loads(out.stdout.strip().splitlines()[-1])["extra"])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_recomputed_backward_memory() -> None:
    """The eager recomputed backward sums the key and value blocks' gradients one block at a
    time and joins each result while the others' blocks are gone. At (1, 1, 2048, 4096) fp32,
    where the (n, D) arrays (A = 32 MiB each) outweigh the score tiles, forward + backward took
    14.0 A of extra memory when a whole second set of sums was formed next to the old one and
    the three results were joined with every block alive (commit e132585), and 12.3 A after
    (both measured by this code); the bound lies between."""
    extra = _extra_memory(_BACKWARD_MEMORY)
    array = 2048 * 4096 * 4
    assert extra <= 13 * array, f"{extra / array:.1f} arrays of extra memory"


#: The measurement of :func:`test_recomputed_backward_memory_in_a_tf_function`, in a fresh process.
_GRAPH_BACKWARD_MEMORY = """
import gc, json, sys
from pathlib import Path
import numpy as np
import tensorflow as tf
import attention_core as ac
import backends.tensorflow

def status(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

@tf.function
def step(q, k, v):
    with tf.GradientTape() as tape:
        tape.watch([q, k, v])
        loss = tf.reduce_sum(ac.dot_product_attention(q, k, v, implementation="blockwise"))
    return tape.gradient(loss, [q, k, v])

def inputs(n):
    rng = np.random.default_rng(0)
    return [tf.constant(rng.standard_normal((1, 4, n, 64)).astype(np.float32)) for _ in range(3)]

step(*inputs(64))
arrays = inputs(4096)
step.get_concrete_function(*arrays)
gc.collect()
Path("/proc/self/clear_refs").write_text("5")
base = status("VmRSS")
grads = step(*arrays)
print(json.dumps({"extra": status("VmHWM") - base}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_recomputed_backward_memory_in_a_tf_function() -> None:
    """A ``tf.function`` training step through the blockwise path recomputes its query blocks
    in the backward pass. At (1, 4, 4096, 64) fp32 (A = 4 MiB per input), the first call of
    the step's gradient took 162.4 A of extra memory when the plain loops were differentiated
    (every tile kept; commit eb35b35) and 20.3 A after (both measured by this code); the bound
    lies between."""
    extra = _extra_memory(_GRAPH_BACKWARD_MEMORY)
    array = 4 * 4096 * 64 * 4
    assert extra <= 40 * array, f"{extra / array:.1f} arrays of extra memory"
