"""The newer attention options against the frameworks' own implementations.

Given the same inputs (and, for layers, the same weights), in float32, this library's
grouped-query heads, sliding windows, additive score biases, rotary positions and ALiBi must
give what each framework's own code gives, within 1e-5:

- torch: ``F.scaled_dot_product_attention`` with fewer key/value heads (``enable_gqa``),
  ``is_causal``, a lower-right ``CausalBias``, and boolean and float ``attn_mask``;
- Keras: ``keras.layers.GroupQueryAttention`` (``use_causal_mask``, ``attention_mask``,
  ``sliding_window``), its weights given to this library in the canonical mapping;
- KerasHub: ``keras_hub.layers.RotaryEmbedding`` and ``keras_hub.layers.AlibiBias``;
- JAX: ``jax.nn.dot_product_attention`` (``bias``, ``mask``, ``is_causal``,
  ``local_window_size``, ``key_value_seq_lengths``, fewer key/value heads), eagerly and under
  ``jax.jit``.

Where the peers' conventions differ from this library's, the tests stay where they meet:

- torch's ``is_causal``, Keras' ``use_causal_mask`` and ``sliding_window`` and JAX's
  ``is_causal`` and ``local_window_size`` put query ``i`` at position ``i`` (top-left
  aligned); this library puts it at ``i + (K - Q)``. The two agree when Q == K, which those
  comparisons use; with Q < K torch's ``causal_lower_right`` is the peer, and windows are
  given to torch as boolean masks built from the documented rule ``|p_i - j| < window``.
- JAX's ``local_window_size=(l, r)`` lets query ``i`` see keys ``i - l .. i + r``:
  ``window=w`` is ``(w - 1, w - 1)``.
- KerasHub's ALiBi bias is ``slope_h * (j - (K - 1))``, this library's
  ``-slope_h * |p_i - j|``: under a causal mask they differ by a constant per row, which the
  softmax removes, so the attention outputs are compared.
- A row with no visible key is all zeros here, uniform (Keras, JAX) or NaN elsewhere: no
  comparison has one.

Each framework's tests run only where its backend is tested (``ATTENTION_CORE_TEST_BACKENDS``).
The blockwise path runs in tiles of 2 queries by 3 keys, so the windows skip tiles and the
biases are cut into tiles.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import attention_core as ac
from attention_core.kernels import blockwise
from conftest import test_backends
from tests.harness import max_diff

TESTED = test_backends()

if "torch" in TESTED:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

if "tensorflow" in TESTED:
    import keras
    import keras_hub
    import tensorflow as tf

    import backends.tensorflow as tf_layers

if "jax" in TESTED:
    import jax
    import jax.numpy as jnp

needs_torch = pytest.mark.skipif("torch" not in TESTED,
                                 reason="the torch backend is not tested in this env")
needs_tensorflow = pytest.mark.skipif("tensorflow" not in TESTED,
                                      reason="Keras and KerasHub run in the tensorflow env")
needs_jax = pytest.mark.skipif("jax" not in TESTED,
                               reason="the jax backend is not tested in this env")

TOL = 1e-5
B, H, HKV, D = 2, 4, 2, 8
WINDOW = 3
IMPLEMENTATIONS = [None, "direct", "blockwise"]


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blockwise calls cut the keys into blocks of 3 and the queries into blocks of 2."""
    monkeypatch.setattr(blockwise, "KEY_BLOCK", 3)
    monkeypatch.setattr(blockwise, "TILE_SCORES", 1)
    monkeypatch.setattr(blockwise, "MIN_QUERY_BLOCK", 2)


def draw(*shapes: tuple[int, ...], seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


def heads(Q: int, K: int, seed: int, kv_heads: int = HKV,
          num_heads: int = H) -> list[np.ndarray]:
    """``q (B, H, Q, D)``, ``k``, ``v`` ``(B, Hkv, K, D)``."""
    return draw((B, num_heads, Q, D), (B, kv_heads, K, D), (B, kv_heads, K, D), seed=seed)


def positions(Q: int, K: int) -> tuple[np.ndarray, np.ndarray]:
    """``(p (Q, 1), j (1, K))``: the queries' positions ``i + K - Q`` and the keys'."""
    return np.arange(Q)[:, None] + (K - Q), np.arange(K)[None, :]


def causal_mask(Q: int, K: int) -> np.ndarray:
    """``(Q, K)``, True where ``j <= p_i``."""
    p, j = positions(Q, K)
    return j <= p


def window_mask(Q: int, K: int, window: int) -> np.ndarray:
    """``(Q, K)``, True where ``|p_i - j| < window``."""
    p, j = positions(Q, K)
    return np.abs(p - j) < window


def padding_mask(Q: int, K: int, lens: np.ndarray) -> np.ndarray:
    """``(B, Q, K)``, True where key ``j`` is within its row's length."""
    return np.broadcast_to(np.arange(K)[None, None, :] < lens[:, None, None], (len(lens), Q, K))


def random_mask(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """A random boolean mask in which every row sees at least one key."""
    mask = np.random.default_rng(seed).random(shape) < 0.6
    first = np.random.default_rng(seed + 1).integers(0, shape[-1], shape[:-1])
    np.put_along_axis(mask, first[..., None], True, -1)
    return mask


# -- torch: F.scaled_dot_product_attention ------------------------------------------------------


def torch_tensors(*arrays: np.ndarray) -> list[Any]:
    return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]


def torch_diff(got: Any, expected: Any) -> float:
    return max_diff(got.detach().numpy(), expected.detach().numpy())


@needs_torch
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_torch_is_causal_with_grouped_heads(implementation: str | None) -> None:
    """``is_causal`` (top-left) on self-attention (Q == K), four query heads over two."""
    q, k, v = torch_tensors(*heads(6, 6, seed=1))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    got = ac.dot_product_attention(q, k, v, causal=True, implementation=implementation)
    assert torch_diff(got, expected) <= TOL


@needs_torch
@pytest.mark.parametrize("kv_heads", [1, 2, 4], ids=["mqa", "gqa", "mha"])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_torch_causal_lower_right(implementation: str | None, kv_heads: int) -> None:
    """Fewer queries than keys: ``causal_lower_right(Q, K)`` is this library's ``causal``."""
    Q, K = 3, 8
    q, k, v = torch_tensors(*heads(Q, K, seed=2, kv_heads=kv_heads))
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(Q, K),
                                              enable_gqa=True)
    got = ac.dot_product_attention(q, k, v, causal=True, implementation=implementation)
    assert torch_diff(got, expected) <= TOL


@needs_torch
@pytest.mark.parametrize("causal", [False, True], ids=["padding", "padding+causal"])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_torch_boolean_padding_mask(implementation: str | None, causal: bool) -> None:
    """A boolean ``attn_mask`` of padded keys (and the causal triangle) is ``valid_lens``."""
    Q = K = 6
    lens = np.array([6, 3])
    q, k, v = torch_tensors(*heads(Q, K, seed=3))
    visible = padding_mask(Q, K, lens) & (causal_mask(Q, K) if causal else True)
    (mask,) = torch_tensors(visible[:, None])  # (B, 1, Q, K)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    got = ac.dot_product_attention(q, k, v, torch.tensor(lens), causal=causal,
                                   implementation=implementation)
    assert torch_diff(got, expected) <= TOL


#: ``score_bias`` shapes and the shape torch's ``attn_mask`` takes for the same bias: a
#: ``(B, Q, K)`` bias is the batch's, shared by the heads (``(B, 1, Q, K)`` for torch).
BIAS_FORMS = {"qk": lambda b: b[0, 0], "bqk": lambda b: b[:, 0], "bhqk": lambda b: b}


def torch_form(bias: np.ndarray) -> np.ndarray:
    return bias[:, None] if bias.ndim == 3 else bias


@needs_torch
@pytest.mark.parametrize("causal", [False, True], ids=["bias", "bias+causal"])
@pytest.mark.parametrize("form", list(BIAS_FORMS))
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_torch_float_mask_is_score_bias(implementation: str | None, form: str,
                                        causal: bool) -> None:
    """A float ``attn_mask`` is added to the scores: ``score_bias``, ``-inf`` entries included.

    With ``causal``, torch's float mask carries the lower-right triangle as ``-inf``.
    """
    Q, K = 4, 7
    q, k, v = heads(Q, K, seed=4)
    (full,) = draw((B, H, Q, K), seed=5)
    full[..., 1, 2] = -np.inf  # a key a row must not see, whatever the mask
    full[1, :, 3, K - 1] = -np.inf
    bias = BIAS_FORMS[form](full)
    theirs = torch_form(bias)
    if causal:
        theirs = theirs + np.where(causal_mask(Q, K), 0.0, -np.inf).astype(np.float32)
    tq, tk, tv, tbias, tmask = torch_tensors(q, k, v, bias, theirs)
    expected = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=tmask, enable_gqa=True)
    assert torch.isfinite(expected).all()
    got = ac.dot_product_attention(tq, tk, tv, causal=causal, score_bias=tbias,
                                   implementation=implementation)
    assert torch_diff(got, expected) <= TOL


@needs_torch
@pytest.mark.parametrize("causal", [False, True], ids=["window", "window+causal"])
@pytest.mark.parametrize(("Q", "K"), [(7, 7), (4, 10)], ids=["self", "fewer-queries"])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_torch_sliding_window_mask(implementation: str | None, Q: int, K: int,
                                   causal: bool) -> None:
    """A boolean ``attn_mask`` of the band ``|p_i - j| < w`` (ANDed with the lower-right
    triangle) is ``window=w``; the blockwise path skips the key blocks outside it."""
    q, k, v = torch_tensors(*heads(Q, K, seed=6))
    visible = window_mask(Q, K, WINDOW) & (causal_mask(Q, K) if causal else True)
    (mask,) = torch_tensors(visible)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    got = ac.dot_product_attention(q, k, v, causal=causal, window=WINDOW,
                                   implementation=implementation)
    assert torch_diff(got, expected) <= TOL


# -- Keras: keras.layers.GroupQueryAttention -----------------------------------------------------

HEAD_DIM = 3
WIDTH = H * HEAD_DIM  # the query width: Keras' output width, which W_o (h, h) needs to be h


def keras_gqa(key_width: int, value_width: int, seed: int,
              sliding_window: int | None = None) -> Any:
    """A built ``GroupQueryAttention`` with biases, every weight random.

    Keras exports the class ``GroupedQueryAttention`` as ``keras.layers.GroupQueryAttention``.
    """
    layer = keras.layers.GroupQueryAttention(HEAD_DIM, H, HKV, sliding_window=sliding_window)
    layer.build((None, None, WIDTH), (None, None, value_width), (None, None, key_width))
    rng = np.random.default_rng(seed)
    layer.set_weights([rng.normal(0.0, 0.5, tuple(w.shape)).astype(np.float32)
                       for w in layer.weights])
    return layer


def canonical_weights(layer: Any) -> dict[str, np.ndarray]:
    """The Keras layer's kernels in the canonical mapping.

    ``query (Dq, H, d)``, ``key``/``value`` ``(Dk, Hkv, d)`` and ``attention_output (H, d, h)``
    flatten their head axes in C order, head ``i`` taking columns (rows of ``W_o``)
    ``i*d : (i+1)*d``, as ``W_q``, ``W_k``, ``W_v`` and ``W_o`` have them.
    """
    out: dict[str, np.ndarray] = {}
    for name, dense in (("W_q", layer._query_dense), ("W_k", layer._key_dense),
                        ("W_v", layer._value_dense)):
        kernel = np.asarray(dense.kernel.numpy())
        out[f"{name}.kernel"] = kernel.reshape(kernel.shape[0], -1)
        out[f"{name}.bias"] = np.asarray(dense.bias.numpy()).reshape(-1)
    kernel = np.asarray(layer._output_dense.kernel.numpy())
    out["W_o.kernel"] = kernel.reshape(-1, kernel.shape[-1])
    out["W_o.bias"] = np.asarray(layer._output_dense.bias.numpy())
    return out


def ours(via: str, weights: dict[str, np.ndarray], xs: tuple[np.ndarray, ...],
         window: int | None = None, **call: Any) -> np.ndarray:
    """This library on TensorFlow tensors: the functional core, or the Keras layer."""
    q, k, v = (tf.constant(x) for x in xs)
    if via == "functional":
        return np.asarray(ac.multi_head_attention(q, k, v, weights, H, num_kv_heads=HKV,
                                                  window=window, **call))
    layer = tf_layers.MultiHeadAttention(WIDTH, H, bias=True, num_kv_heads=HKV, window=window)
    layer.set_weights(weights)
    return np.asarray(layer(q, k, v, **call))


VIAS = ["functional", "layer"]


@needs_tensorflow
@pytest.mark.parametrize("via", VIAS)
@pytest.mark.parametrize("masking", ["causal", "padding", "causal+padding"])
def test_keras_gqa_self_attention(masking: str, via: str) -> None:
    """``use_causal_mask`` and a padding ``attention_mask`` ``(B, Q, K)``, Q == K."""
    T = 6
    layer = keras_gqa(WIDTH, WIDTH, seed=10)
    (X,) = draw((B, T, WIDTH), seed=11)
    causal = "causal" in masking
    pad = padding_mask(T, T, np.array([4, T])) if "padding" in masking else None
    expected = np.asarray(layer(X, X, X, attention_mask=pad, use_causal_mask=causal))
    got = ours(via, canonical_weights(layer), (X, X, X), causal=causal,
               mask=None if pad is None else tf.constant(pad))
    assert max_diff(got, expected) <= TOL


@needs_tensorflow
@pytest.mark.parametrize("via", VIAS)
def test_keras_gqa_cross_attention_with_a_mask(via: str) -> None:
    """Queries, keys and values of three widths, a random ``attention_mask`` ``(B, Q, K)``.

    Keras' call takes ``(query, value, key)``.
    """
    Q, K, key_width, value_width = 4, 7, 5, 9
    layer = keras_gqa(key_width, value_width, seed=12)
    xq, xk, xv = draw((B, Q, WIDTH), (B, K, key_width), (B, K, value_width), seed=13)
    mask = random_mask((B, Q, K), seed=14)
    expected = np.asarray(layer(xq, xv, xk, attention_mask=mask))
    got = ours(via, canonical_weights(layer), (xq, xk, xv), mask=tf.constant(mask))
    assert max_diff(got, expected) <= TOL


@needs_tensorflow
@pytest.mark.parametrize("via", VIAS)
@pytest.mark.parametrize("causal", [False, True], ids=["window", "window+causal"])
def test_keras_gqa_sliding_window(causal: bool, via: str) -> None:
    """``sliding_window=w`` (the band ``|i - j| < w``, Q == K) is ``window=w``."""
    T = 8
    layer = keras_gqa(WIDTH, WIDTH, seed=15, sliding_window=WINDOW)
    (X,) = draw((B, T, WIDTH), seed=16)
    expected = np.asarray(layer(X, X, X, use_causal_mask=causal))
    got = ours(via, canonical_weights(layer), (X, X, X), window=WINDOW, causal=causal)
    assert max_diff(got, expected) <= TOL


# -- KerasHub: RotaryEmbedding, AlibiBias --------------------------------------------------------


@needs_tensorflow
@pytest.mark.parametrize("base", [10000.0, 500.0])
@pytest.mark.parametrize("start", [0, 5])
@pytest.mark.parametrize("shape", [(B, 7, 3, D), (B, 7, D)], ids=["BTHd", "BTd"])
def test_kerashub_rotary_embedding(shape: tuple[int, ...], start: int, base: float) -> None:
    (X,) = draw(shape, seed=20)
    layer = keras_hub.layers.RotaryEmbedding(max_wavelength=base)
    expected = np.asarray(layer(X, start_index=start))
    got = np.asarray(ac.rotary_embedding(tf.constant(X), start, base=base))
    assert max_diff(got, expected) <= TOL


@needs_tensorflow
@pytest.mark.parametrize("shape", [(B, 6, 3, D), (B, 6, D)], ids=["BTHd", "BTd"])
def test_kerashub_rotary_embedding_positions(shape: tuple[int, ...]) -> None:
    """Positions ``(B, T)`` of their own, not a range: KerasHub's ``positions``."""
    (X,) = draw(shape, seed=21)
    where = np.random.default_rng(22).integers(0, 30, shape[:2]).astype(np.int32)
    expected = np.asarray(keras_hub.layers.RotaryEmbedding()(X, positions=where))
    got = np.asarray(ac.rotary_embedding(tf.constant(X), positions=tf.constant(where)))
    assert max_diff(got, expected) <= TOL


@needs_tensorflow
@pytest.mark.parametrize("num_heads", [1, 2, 4, 6, 8, 12])
def test_kerashub_alibi_slopes(num_heads: int) -> None:
    """KerasHub's bias on key ``K - 2`` (one before the last) is ``-slope_h``."""
    bias = np.asarray(keras_hub.layers.AlibiBias()(np.zeros((1, num_heads, 1, 2), np.float32)))
    assert max_diff(-bias[0, :, 0, 0], ac.alibi_slopes(num_heads)) <= 1e-7


@needs_tensorflow
@pytest.mark.parametrize("padded", [False, True], ids=["causal", "causal+padding"])
@pytest.mark.parametrize(("Q", "K"), [(6, 6), (3, 8)], ids=["self", "fewer-queries"])
@pytest.mark.parametrize("kv_heads", [6, 3], ids=["mha", "gqa"])
def test_kerashub_alibi_attention(kv_heads: int, Q: int, K: int, padded: bool) -> None:
    """``softmax(q k^T / sqrt(d) + AlibiBias)`` under the lower-right causal mask (Keras'
    masked ``Softmax``) is ``positional="alibi"``, six heads (slopes not a power of 2's)."""
    num_heads = 6
    lens = np.array([K, K - 2]) if padded else None
    q, k, v = heads(Q, K, seed=23, kv_heads=kv_heads, num_heads=num_heads)
    G = num_heads // kv_heads
    k_all, v_all = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)  # query head h: kv h // G
    scores = keras.ops.einsum("bhqd,bhkd->bhqk", q, k_all) / np.sqrt(np.float32(D))
    scores = keras_hub.layers.AlibiBias()(scores)
    visible = np.broadcast_to(causal_mask(Q, K), (B, num_heads, Q, K))
    if lens is not None:
        visible = visible & padding_mask(Q, K, lens)[:, None]
    weights = keras.layers.Softmax()(scores, mask=visible)
    expected = np.asarray(keras.ops.einsum("bhqk,bhkd->bhqd", weights, v_all))
    got = ac.dot_product_attention(tf.constant(q), tf.constant(k), tf.constant(v),
                                   None if lens is None else tf.constant(lens), causal=True,
                                   positional="alibi")
    assert max_diff(np.asarray(got), expected) <= TOL


# -- JAX: jax.nn.dot_product_attention -----------------------------------------------------------


def btnh(x: np.ndarray) -> Any:
    """``(B, H, T, D)`` -> JAX's ``(B, T, N, H)`` layout."""
    return jnp.asarray(np.swapaxes(x, 1, 2))


def jax_pair(theirs: Callable[..., Any], mine: Callable[..., Any], jit: bool,
             *arrays: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(expected, got)``: the two functions of the same arrays, eagerly or under ``jax.jit``;
    JAX's output back in ``(B, H, T, D)``."""
    if jit:
        theirs, mine = jax.jit(theirs), jax.jit(mine)
    expected = np.swapaxes(np.asarray(theirs(*arrays)), 1, 2)
    return expected, np.asarray(mine(*arrays))


MODES = [pytest.param(False, id="eager"), pytest.param(True, id="jit")]
#: One length for every JAX test: its eager mode compiles each primitive for each new shape.
T_JAX = 8


@needs_jax
@pytest.mark.parametrize("jit", MODES)
@pytest.mark.parametrize("kv_heads", [1, 2], ids=["mqa", "gqa"])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_jax_is_causal_with_grouped_heads(implementation: str | None, kv_heads: int,
                                          jit: bool) -> None:
    """``is_causal`` (top-left) on self-attention (Q == K), fewer key/value heads."""
    q, k, v = heads(T_JAX, T_JAX, seed=30, kv_heads=kv_heads)
    expected, got = jax_pair(
        lambda q, k, v: jax.nn.dot_product_attention(btnh(q), btnh(k), btnh(v), is_causal=True),
        lambda q, k, v: ac.dot_product_attention(q, k, v, causal=True,
                                                 implementation=implementation),
        jit, *(jnp.asarray(x) for x in (q, k, v)))
    assert max_diff(got, expected) <= TOL


@needs_jax
@pytest.mark.parametrize("jit", MODES)
@pytest.mark.parametrize("form", ["qk", "bhqk"])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_jax_bias_mask_and_key_lengths(implementation: str | None, form: str,
                                       jit: bool) -> None:
    """``bias`` is ``score_bias``, a boolean ``mask`` ``(B, 1, Q, K)`` is ``mask (B, Q, K)`` and
    ``key_value_seq_lengths`` is ``valid_lens``; grouped heads, no causal mask."""
    Q = K = T_JAX
    q, k, v = heads(Q, K, seed=31)
    (full,) = draw((B, H, Q, K), seed=32)
    bias = full[0, 0] if form == "qk" else full
    lens = np.array([K, 5], np.int32)
    mask = random_mask((B, Q, K), seed=33)
    mask[:, :, 0] = True  # each row sees a key within the lengths

    def theirs(q: Any, k: Any, v: Any, bias: Any, mask: Any, lens: Any) -> Any:
        return jax.nn.dot_product_attention(
            btnh(q), btnh(k), btnh(v), bias=bias if bias.ndim == 4 else bias[None, None],
            mask=mask[:, None], key_value_seq_lengths=lens)

    def mine(q: Any, k: Any, v: Any, bias: Any, mask: Any, lens: Any) -> Any:
        return ac.dot_product_attention(q, k, v, lens, mask=mask, score_bias=bias,
                                        implementation=implementation)

    expected, got = jax_pair(theirs, mine, jit, *(jnp.asarray(x) for x in
                                                  (q, k, v, bias, mask, lens)))
    assert max_diff(got, expected) <= TOL


@needs_jax
@pytest.mark.parametrize("jit", MODES)
@pytest.mark.parametrize("causal", [False, True], ids=["window", "window+causal"])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_jax_local_window(implementation: str | None, causal: bool, jit: bool) -> None:
    """``local_window_size=(w - 1, w - 1)`` is ``window=w`` (Q == K), grouped heads."""
    q, k, v = heads(T_JAX, T_JAX, seed=34)
    expected, got = jax_pair(
        lambda q, k, v: jax.nn.dot_product_attention(
            btnh(q), btnh(k), btnh(v), is_causal=causal,
            local_window_size=(WINDOW - 1, WINDOW - 1)),
        lambda q, k, v: ac.dot_product_attention(q, k, v, causal=causal, window=WINDOW,
                                                 implementation=implementation),
        jit, *(jnp.asarray(x) for x in (q, k, v)))
    assert max_diff(got, expected) <= TOL


@needs_jax
@pytest.mark.parametrize(("queries", "keys", "told"), [(8, 8, (2, 2)), (6, 8, (0, 4)),
                                                      (2, 8, None)])
def test_jax_fused_path_tells_the_kernel_of_the_window(monkeypatch: pytest.MonkeyPatch,
                                                       queries: int, keys: int,
                                                       told: tuple[int, int] | None) -> None:
    """``implementation="fused"`` with ``window=3`` gives ``jax.nn.dot_product_attention`` the
    window as ``local_window_size`` (query index ``i`` at position ``i + K - Q``: ``(2 - (K -
    Q), 2 + (K - Q))``, none when a side is negative), and equals the direct path."""
    import jax
    import jax.numpy as jnp

    seen: list[Any] = []
    kernel = jax.nn.dot_product_attention

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs.get("local_window_size"))
        return kernel(*args, **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", spy)
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((2, 4, queries, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, 2, keys, 8)), jnp.float32) for _ in range(2))
    fused = ac.dot_product_attention(q, k, v, causal=True, window=3, implementation="fused")
    direct = ac.dot_product_attention(q, k, v, causal=True, window=3, implementation="direct")
    assert seen == [told]
    assert max_diff(np.asarray(fused), np.asarray(direct)) <= 1e-6
