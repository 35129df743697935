"""Flax habits of the JAX backend: jit, grad, vmap, the 'dropout' rng, sow, functional weights.

The cross-backend files (test_reference_matrix, test_errors, test_weights, test_adapters, ...)
already run on this backend through tests/hooks/jax_hooks.py; these tests use the Flax API directly
(``init``/``apply``, params pytrees) and cover what only JAX has.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import test_backends

if "jax" not in test_backends():
    pytest.skip("the jax backend is not tested in this env", allow_module_level=True)

import flax
import jax
import jax.numpy as jnp

import attention_core as ac
import backends.jax as bj
import backends.numpy as numpy_layers
from attention_core import blockwise
from attention_core.attention import choose_implementation
from tests import naive
from tests.harness import TOLERANCE, max_diff

REPO = Path(__file__).resolve().parent.parent
TOL = TOLERANCE["float32"]
KEY = jax.random.PRNGKey(0)


def draw(*shapes: tuple[int, ...], seed: int = 0) -> list[jax.Array]:
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes]


def diff(a: Any, b: Any) -> float:
    """max |a - b| of two arrays of any framework."""
    return max_diff(np.asarray(a), np.asarray(b))


def tree_diff(a: Any, b: Any) -> float:
    leaves = jax.tree_util.tree_leaves(jax.tree_util.tree_map(diff, a, b))
    return float(max(leaves, default=0.0))


@pytest.fixture(scope="module")
def mha() -> tuple[bj.MultiHeadAttention, dict[str, Any], list[jax.Array]]:
    """A built MHA with bias, its variables, and inputs ``q (2, 4, 6)``, ``kv (2, 5, 7)``."""
    layer = bj.MultiHeadAttention(8, 2, dropout=0.5, bias=True)
    q, kv = draw((2, 4, 6), (2, 5, 7))
    return layer, jax.jit(layer.init)(KEY, q, kv, kv), [q, kv]


@pytest.fixture(scope="module")
def block() -> tuple[bj.TransformerEncoderBlock, dict[str, Any], jax.Array]:
    layer = bj.TransformerEncoderBlock(8, 16, 2, dropout=0.3, bias=True)
    (X,) = draw((2, 5, 8), seed=1)
    return layer, jax.jit(layer.init)(KEY, X), X


# -- jit, grad, vmap ----------------------------------------------------------------------------


def test_jit_equals_eager_multi_head(mha: Any) -> None:
    layer, variables, (q, kv) = mha
    lens = jnp.array([[1, 2, 3, 5], [5, 4, 0, 2]])
    mask = jnp.asarray(np.random.default_rng(3).random((4, 5)) < 0.7)

    def run(variables: Any, q: jax.Array, kv: jax.Array, lens: jax.Array, mask: jax.Array) -> Any:
        return layer.apply(variables, q, kv, kv, lens, mask=mask, causal=True, return_attention=True)

    eager = run(variables, q, kv, lens, mask)
    jitted = jax.jit(run)(variables, q, kv, lens, mask)
    assert tree_diff(eager, jitted) <= 1e-6
    assert np.all(np.asarray(eager[1])[1, :, 2] == 0.0)  # valid length 0: nothing visible


def test_jit_equals_eager_encoder_block(block: Any) -> None:
    layer, variables, X = block
    lens = jnp.array([3, 5])
    eager = layer.apply(variables, X, lens)
    jitted = jax.jit(lambda v, x, n: layer.apply(v, x, n))(variables, X, lens)
    assert diff(jitted, eager) <= 1e-6


def loss(layer: Any, ct: jax.Array, **kwargs: Any) -> Any:
    def f(params: Any, *inputs: jax.Array) -> jax.Array:
        return jnp.sum(layer.apply({"params": params}, *inputs, **kwargs) * ct)
    return f


def test_grad_under_jit_equals_eager_grad(mha: Any) -> None:
    layer, variables, (q, kv) = mha
    (ct,) = draw((2, 4, 8), seed=5)
    f = loss(layer, ct, valid_lens=jnp.array([2, 5]))
    grad = jax.grad(f, argnums=(0, 1, 2))
    assert tree_diff(grad(variables["params"], q, kv, kv),
                     jax.jit(grad)(variables["params"], q, kv, kv)) <= 1e-6


def central_difference(f: Any, x: np.ndarray, idx: tuple[int, ...], eps: float = 1e-6) -> float:
    up, down = x.copy(), x.copy()
    up[idx] += eps
    down[idx] -= eps
    return float(f(up) - f(down)) / (2 * eps)


def test_encoder_block_jitted_grad_matches_finite_differences(block: Any) -> None:
    layer, variables, X = block
    w = {k: v.astype(np.float64) for k, v in bj.get_weights(variables).items()}
    x, (ct,) = np.asarray(X, np.float64), draw((2, 5, 8), seed=6)
    mask = np.tril(np.ones((5, 5), bool))
    vis = naive.visible(2, 2, 5, 5, mask=mask)

    def loss64(w: dict[str, np.ndarray], x: np.ndarray) -> float:
        return float(np.sum(naive.encoder_block(x, w, 2, vis)[0] * np.asarray(ct, np.float64)))

    grad = jax.jit(jax.grad(loss(layer, ct, mask=jnp.asarray(mask)), argnums=(0, 1)))
    d_params, d_x = grad(variables["params"], X)
    d_w = bj.get_weights(d_params)
    for name, idx in [("attention.W_q.kernel", (1, 2)), ("attention.W_v.bias", (3,)),
                      ("addnorm1.ln.gamma", (4,)), ("ffn.dense1.kernel", (5, 9))]:
        fd = central_difference(lambda a, name=name: loss64({**w, name: a}, x), w[name], idx)
        assert abs(float(d_w[name][idx]) - fd) <= 1e-4 * max(1.0, abs(fd)), name
    fd = central_difference(lambda a: loss64(w, a), x, (1, 3, 6))
    assert abs(float(d_x[1, 3, 6]) - fd) <= 1e-4 * max(1.0, abs(fd))


def test_grad_matches_finite_differences_of_the_naive_float64_implementation() -> None:
    rng = np.random.default_rng(7)
    q, k, v, ct = (rng.standard_normal(s) for s in [(2, 3, 5), (2, 4, 6), (2, 4, 3), (2, 3, 4)])
    w = {"W_q.kernel": rng.standard_normal((5, 4)), "W_k.kernel": rng.standard_normal((6, 4)),
         "W_v.kernel": rng.standard_normal((3, 4)), "W_o.kernel": rng.standard_normal((4, 4))}
    lens = np.array([2, 4])
    vis = naive.visible(2, 2, 3, 4, lens)

    def loss64(w: dict[str, np.ndarray], q: np.ndarray) -> float:
        return float(np.sum(naive.multi_head(q, k, v, w, 2, vis)[0] * ct))

    layer = bj.MultiHeadAttention(4, 2)
    variables = bj.init_from_weights(layer, w)
    f = loss(layer, jnp.asarray(ct, jnp.float32), valid_lens=jnp.asarray(lens))
    as32 = [jnp.asarray(x, jnp.float32) for x in (q, k, v)]
    d_params, d_q = jax.grad(f, argnums=(0, 1))(variables["params"], *as32)
    for name, idx in [("W_q.kernel", (1, 2)), ("W_k.kernel", (4, 0)), ("W_v.kernel", (2, 3)),
                      ("W_o.kernel", (3, 1))]:
        fd = central_difference(lambda a, name=name: loss64({**w, name: a}, q), w[name], idx)
        got = float(bj.get_weights(d_params)[name][idx])
        assert abs(got - fd) <= 1e-4 * max(1.0, abs(fd)), name
    fd = central_difference(lambda a: loss64(w, a), q, (1, 2, 3))
    assert abs(float(d_q[1, 2, 3]) - fd) <= 1e-4 * max(1.0, abs(fd))


def test_grad_through_fully_masked_rows_is_finite(mha: Any) -> None:
    layer, variables, (q, kv) = mha
    mask = jnp.ones((2, 4, 5), bool).at[0, 1].set(False)
    f = loss(layer, jnp.ones((2, 4, 8)), mask=mask)
    grads = jax.jit(jax.grad(f, argnums=(0, 1, 2)))(variables["params"], q, kv, kv)
    assert all(bool(jnp.isfinite(g).all()) for g in jax.tree_util.tree_leaves(grads))
    # query 1 of example 0 sees no key: its output is the W_o bias alone, whatever it asks
    d_q = grads[1]
    np.testing.assert_array_equal(np.asarray(d_q[0, 1]), 0.0)


def test_vmap_over_an_extra_axis_equals_a_loop(mha: Any, block: Any) -> None:
    layer, variables, (q, kv) = mha
    qs = jnp.stack([q, q * 2.0, -q])
    lens = jnp.array([3, 5])
    mapped = jax.vmap(lambda x: layer.apply(variables, x, kv, kv, lens))(qs)
    looped = jnp.stack([layer.apply(variables, x, kv, kv, lens) for x in qs])
    assert diff(mapped, looped) <= 1e-6
    blayer, bvars, X = block
    Xs = jnp.stack([X, X + 1.0])
    mapped = jax.jit(jax.vmap(lambda x: blayer.apply(bvars, x, lens)))(Xs)
    looped = jnp.stack([blayer.apply(bvars, x, lens) for x in Xs])
    assert diff(mapped, looped) <= 1e-5


# -- dropout and the 'dropout' rng ------------------------------------------------------------


def test_training_draws_dropout_from_the_dropout_rng(mha: Any) -> None:
    layer, variables, (q, kv) = mha

    @jax.jit
    def train(key: jax.Array) -> Any:
        return layer.apply(variables, q, kv, kv, rngs={"dropout": key}, training=True,
                           return_attention=True)

    plain, w_plain = layer.apply(variables, q, kv, kv, return_attention=True)
    a, w_a = train(jax.random.PRNGKey(1))
    a_again, _ = train(jax.random.PRNGKey(1))
    b, _ = train(jax.random.PRNGKey(2))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(a_again))
    assert diff(a, b) > 1e-3 and diff(a, plain) > 1e-3
    assert diff(w_a, w_plain) <= 1e-6  # the weights are kept before dropout
    evaluated = layer.apply(variables, q, kv, kv, rngs={"dropout": jax.random.PRNGKey(2)})
    np.testing.assert_array_equal(np.asarray(evaluated), np.asarray(plain))  # rng unused
    with pytest.raises(flax.errors.InvalidRngError, match="dropout"):
        layer.apply(variables, q, kv, kv, training=True)


def test_dropout_keeps_or_scales_each_weight() -> None:
    """DotProductAttention's output with dropout is (w * keep / (1 - p)) @ V for a 0/1 keep."""
    layer = bj.DotProductAttention(dropout=0.25)
    q, k = draw((1, 3, 4), (1, 6, 4), seed=8)
    v = jnp.eye(6)[None]  # the output rows are then the dropped weights themselves
    out, w = jax.jit(lambda key: layer.apply({}, q, k, v, rngs={"dropout": key}, training=True,
                                             return_attention=True))(jax.random.PRNGKey(3))
    ratio = np.asarray(out, np.float64)[0] / np.asarray(w, np.float64)[0, 0]
    dropped, kept = np.isclose(ratio, 0.0, atol=1e-6), np.isclose(ratio, 1 / 0.75, rtol=1e-5)
    assert np.all(dropped | kept) and dropped.any() and kept.any()


def test_encoder_block_dropout_follows_the_key(block: Any) -> None:
    layer, variables, X = block
    train = jax.jit(lambda key: layer.apply(variables, X, rngs={"dropout": key}, training=True))
    a, b = train(jax.random.PRNGKey(4)), train(jax.random.PRNGKey(4))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert diff(a, train(jax.random.PRNGKey(5))) > 1e-3
    assert diff(a, jax.jit(layer.apply)(variables, X)) > 1e-3


def test_functional_dropout_needs_a_key() -> None:
    q, k, v = draw((2, 3, 4), (2, 5, 4), (2, 5, 2))
    with pytest.raises(ValueError, match=re.escape("dropout on JAX arrays needs a PRNG key")):
        ac.dot_product_attention(q, k, v, dropout=0.5)

    @jax.jit
    def twice(key: jax.Array) -> tuple[Any, Any]:
        ops = bj.JaxOps(rng=key)
        first = ac.dot_product_attention(q, k, v, dropout=0.5, ops=ops)
        return first, ac.dot_product_attention(q, k, v, dropout=0.5, ops=ops)  # the next draw

    first, second = twice(jax.random.PRNGKey(0))
    assert diff(first, second) > 1e-3
    np.testing.assert_array_equal(np.asarray(twice(jax.random.PRNGKey(0))[0]), np.asarray(first))
    assert diff(twice(jax.random.PRNGKey(1))[0], first) > 1e-3


# -- sow and the seeds' usage -------------------------------------------------------------------


def test_attention_weights_are_sown_into_intermediates(mha: Any, block: Any) -> None:
    layer, variables, (q, kv) = mha
    lens = jnp.array([3, 1])
    (_, w), state = layer.apply(variables, q, kv, kv, lens, return_attention=True,
                                  mutable=["intermediates"])
    sown = state["intermediates"]["attention_weights"]
    assert isinstance(sown, tuple) and len(sown) == 1
    np.testing.assert_array_equal(np.asarray(sown[0]), np.asarray(w))
    vis = naive.visible(2, 2, 4, 5, np.asarray(lens))
    assert np.all(np.asarray(w)[~vis] == 0.0)
    np.testing.assert_allclose(np.asarray(w).sum(-1), 1.0, atol=1e-6)
    assert layer.apply(variables, q, kv, kv, lens).shape == (2, 4, 8)  # not mutable: not kept
    blayer, bvars, X = block
    _, bstate = blayer.apply(bvars, X, lens, mutable=["intermediates"])
    assert bstate["intermediates"]["attention_weights"][0].shape == (2, 2, 5, 5)


# -- functional weights -------------------------------------------------------------------------


def test_set_weights_returns_a_new_tree_and_leaves_the_old_one(mha: Any) -> None:
    layer, variables, (q, kv) = mha
    before = bj.get_weights(variables)
    fresh = {name: value + 1.0 for name, value in before.items()}
    updated = bj.set_weights(variables, fresh)
    for name, value in bj.get_weights(variables).items():
        np.testing.assert_array_equal(value, before[name])
    for name, value in bj.get_weights(updated).items():
        np.testing.assert_array_equal(value, fresh[name])
    bare = bj.set_weights(variables["params"], fresh)  # bare params in, bare params out
    assert "params" not in bare
    assert tree_diff(bare, updated["params"]) == 0.0
    assert tree_diff(bj.init_from_weights(layer, fresh), updated) == 0.0
    expected = ac.multi_head_attention(q, kv, kv, {k: jnp.asarray(v) for k, v in fresh.items()}, 2)
    assert diff(layer.apply(updated, q, kv, kv), expected) <= 1e-6
    got = bj.get_weights(updated)
    got["W_q.kernel"][0, 0] = 123.0  # a copy: the params do not change
    assert float(updated["params"]["W_q"]["kernel"][0, 0]) != 123.0


@pytest.mark.parametrize("change", [
    lambda w: {k: v for k, v in w.items() if k != "W_o.bias"},
    lambda w: {**w, "extra": w["W_o.bias"]},
    lambda w: {**w, "W_k.kernel": w["W_k.kernel"][:, :3]},
    lambda w: {**w, "W_v.bias": w["W_v.bias"].astype(np.int32)},
    lambda w: list(w.values()),
], ids=["missing", "unexpected", "shape", "integer", "not_mapping"])
def test_set_weights_errors_are_the_numpy_backends(mha: Any, change: Any) -> None:
    layer, variables, (q, kv) = mha
    weights = bj.get_weights(variables)
    numpy_layer = numpy_layers.MultiHeadAttention(8, 2, bias=True, seed=0)
    numpy_layer(*(np.asarray(x) for x in (q, kv, kv)))
    with pytest.raises((TypeError, ValueError)) as numpy_error:
        numpy_layer.set_weights(change(weights))
    with pytest.raises(numpy_error.type, match="^" + re.escape(str(numpy_error.value)) + "$"):
        bj.set_weights(variables, change(weights))
    fresh = numpy_layers.MultiHeadAttention(8, 2, bias=True, seed=0)  # input sizes not known
    with pytest.raises((TypeError, ValueError)) as fresh_error:
        fresh.set_weights(change(weights))
    with pytest.raises(fresh_error.type, match="^" + re.escape(str(fresh_error.value)) + "$"):
        bj.init_from_weights(layer, change(weights))


def test_bfloat16_fully_masked_row_is_zero_under_jit() -> None:
    layer = bj.MultiHeadAttention(8, 2, param_dtype=jnp.bfloat16)
    q, kv = (x.astype(jnp.bfloat16) for x in draw((2, 3, 8), (2, 4, 8)))
    lens = jnp.array([0, 4])
    variables = jax.jit(layer.init)(KEY, q, kv, kv, lens)
    out, w = jax.jit(lambda v: layer.apply(v, q, kv, kv, lens, return_attention=True))(variables)
    assert out.dtype == jnp.bfloat16 and w.dtype == jnp.bfloat16
    assert bool(jnp.isfinite(out).all())
    np.testing.assert_array_equal(np.asarray(w[0], np.float32), 0.0)


# -- implementations: blockwise loops, the fused kernel, the layers' choice ---------------------

#: ``(B, H, Q, K, D)`` spanning two full query blocks and a tail, and a first key block, two
#: more in the compiled loop and a tail, with the blocks of :func:`small_blocks`.
SHAPE = (2, 2, 7, 15, 4)


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of 3 queries and 4 keys for ``B * H = 4``, so small inputs span several."""
    monkeypatch.setattr(blockwise, "KEY_BLOCK", 4)
    monkeypatch.setattr(blockwise, "TILE_SCORES", 4 * 3 * 4)
    monkeypatch.setattr(blockwise, "MIN_QUERY_BLOCK", 1)


def masking(kind: str) -> dict[str, Any]:
    """Call arguments of one mask kind for :data:`SHAPE` (the fully masked rows included)."""
    B, H, Q, K, _ = SHAPE
    rng = np.random.default_rng(11)
    lens_2d = jnp.asarray(rng.integers(0, K + 1, (B, Q)).astype(np.int32)).at[0, 3].set(0)
    row_mask = jnp.asarray(rng.random((B, Q, K)) < 0.6).at[1, 2].set(False)
    return {
        "none": {},
        "valid_lens_1d": {"valid_lens": jnp.array([0, 9])},
        "valid_lens_2d": {"valid_lens": lens_2d},
        "mask_2d": {"mask": jnp.asarray(rng.random((Q, K)) < 0.5).at[4].set(False)},
        "mask_3d": {"mask": row_mask},
        "mask_4d": {"mask": jnp.asarray(rng.random((B, H, Q, K)) < 0.5).at[0, 1, 6].set(False)},
        "causal": {"causal": True},
        "combined": {"valid_lens": lens_2d, "mask": row_mask, "causal": True},
    }[kind]


MASKINGS = ["none", "valid_lens_1d", "valid_lens_2d", "mask_2d", "mask_3d", "mask_4d", "causal",
            "combined"]


def attend_jitted(implementation: str, **kwargs: Any) -> Any:
    """``dot_product_attention`` under ``jax.jit``, masks as traced arguments."""
    causal = kwargs.pop("causal", False)

    @jax.jit
    def run(q: jax.Array, k: jax.Array, v: jax.Array, kw: dict[str, Any]) -> Any:
        return ac.dot_product_attention(q, k, v, causal=causal, implementation=implementation,
                                        **kw)
    return lambda q, k, v: run(q, k, v, kwargs)


@pytest.mark.usefixtures("small_blocks")
@pytest.mark.parametrize("kind", MASKINGS)
def test_jitted_blockwise_and_fused_equal_direct(kind: str) -> None:
    B, H, Q, K, D = SHAPE
    q, k, v = draw((B, H, Q, D), (B, H, K, D), (B, H, K, 3 * D), seed=6)
    kw = masking(kind)
    direct = attend_jitted("direct", **kw)(q, k, v)
    vis = naive.visible(B, H, Q, K, kw.get("valid_lens"), kw.get("mask"), kw.get("causal", False))
    assert np.all(np.asarray(direct)[~vis.any(-1)] == 0.0)
    for implementation, dv in (("blockwise", 3 * D), ("fused", D)):  # the kernel needs Dv == D
        got = attend_jitted(implementation, **kw)(q, k, v[..., :dv])
        assert bool(jnp.isfinite(got).all())
        assert diff(got, direct[..., :dv]) <= TOL, implementation


def test_the_blockwise_loops_are_compiled_not_unrolled(small_blocks: None) -> None:
    def jaxpr(n: int) -> str:
        q, k = draw((1, 4, n, 4), (1, 4, n, 4))

        def f(q: jax.Array, k: jax.Array) -> Any:
            return ac.dot_product_attention(q, k, k, causal=True, implementation="blockwise")
        return str(jax.make_jaxpr(f)(q, k))

    short, long = jaxpr(13), jaxpr(61)  # 4 query x 3 key blocks, then 20 x 15
    assert "scan" in long or "while" in long
    assert long.count("dot_general") == short.count("dot_general") <= 12


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the rule measured on CPU")
def test_the_automatic_choice_on_cpu_never_takes_the_measured_slower_kernel() -> None:
    for shape in [(1, 1, 8, 8), (1, 8, 512, 512), (1, 8, 4096, 4096)]:
        assert not bj.OPS.prefers_fused(shape)
    assert choose_implementation(bj.OPS, None, False, (1, 8, 128, 128)) == "direct"
    assert choose_implementation(bj.OPS, None, False, (1, 4, 16384, 16384)) == "blockwise"


@pytest.mark.parametrize(("dropout", "dv"), [(0.5, 4), (0.0, 3)])
def test_fused_without_a_kernel_for_the_call_is_the_direct_path(dropout: float, dv: int) -> None:
    """jax.nn.dot_product_attention has no dropout and needs Dv == D: the direct path then,
    with the same dropout draws."""
    q, k, v = draw((2, 2, 5, 4), (2, 2, 6, 4), (2, 2, 6, dv), seed=9)

    def run(implementation: str) -> Any:
        return jax.jit(lambda key: ac.dot_product_attention(
            q, k, v, jnp.array([2, 6]), dropout=dropout, implementation=implementation,
            ops=bj.JaxOps(rng=key)))(jax.random.PRNGKey(3))

    np.testing.assert_array_equal(np.asarray(run("fused")), np.asarray(run("direct")))


def test_loop_hooks_equal_python_loops() -> None:
    ops = bj.JaxOps()
    parts = draw((2, 3, 4), (2, 3, 4), (2, 3, 4), seed=2)
    stacked = jnp.stack(parts)
    for axis in range(3):
        got = jax.jit(lambda s, a=axis: ops.map_concat(lambda i: s[i], 3, a))(stacked)
        np.testing.assert_array_equal(np.asarray(got), np.concatenate(parts, axis))
    total = jax.jit(lambda s: ops.fold(lambda i, c: (c[0] + s[i] * i,), (jnp.zeros((2, 3, 4)),),
                                       3))(stacked)
    assert diff(total[0], parts[1] + 2 * parts[2]) <= TOL


def test_dropout_inside_the_loops_draws_a_new_mask_per_block(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With ``V = I`` the output rows are the dropped weights ``w * keep / (1 - p)``."""
    monkeypatch.setattr(blockwise, "KEY_BLOCK", 8)
    monkeypatch.setattr(blockwise, "TILE_SCORES", 8 * 8)
    Q = K = 64  # 8 query blocks (compiled map) x 8 key blocks (the first, then a compiled fold)
    q, k = draw((1, 1, Q, 4), (1, 1, K, 4), seed=10)
    v = jnp.eye(K)[None, None]

    @jax.jit
    def run(key: jax.Array) -> jax.Array:
        ops = bj.JaxOps(rng=key)
        return ac.dot_product_attention(q, k, v, dropout=0.5, implementation="blockwise", ops=ops)

    w = ac.dot_product_attention(q, k, v, return_weights=True)[1]
    out = run(jax.random.PRNGKey(0))
    ratio = np.asarray(out, np.float64)[0, 0] / np.asarray(w)[0, 0]
    keep = np.isclose(ratio, 2.0, rtol=1e-4)
    assert np.all(keep | np.isclose(ratio, 0.0, atol=1e-6))
    tiles = keep.reshape(8, 8, 8, 8).transpose(0, 2, 1, 3).reshape(64, 64)  # one row per tile
    assert len({t.tobytes() for t in tiles}) == 64  # every tile its own mask
    assert abs(keep.mean() - 0.5) < 0.03 and abs(ratio.mean() - 1.0) < 0.06
    np.testing.assert_array_equal(np.asarray(run(jax.random.PRNGKey(0))), np.asarray(out))
    assert diff(run(jax.random.PRNGKey(1)), out) > 1e-3


@pytest.mark.parametrize("name", ["DotProductAttention", "MultiHeadAttention"])
def test_layers_form_the_weights_only_where_they_are_kept(name: str) -> None:
    """A blockwise layer runs wherever the weights are not needed; where they are (returned,
    or kept in a mutable 'intermediates'), it takes the direct path and gives its weights."""
    q, kv = draw((2, 4, 8), (2, 5, 8), seed=12)
    lens = jnp.array([2, 5])

    def make(**kw: Any) -> Any:
        return getattr(bj, name)(*((8, 2) if name == "MultiHeadAttention" else ()), **kw)

    plain = make()
    variables = plain.init(KEY, q, kv, kv, lens)
    reference = plain.apply(variables, q, kv, kv, lens)
    kept = plain.apply(variables, q, kv, kv, lens, mutable=["intermediates"])[1]
    assert kept["intermediates"]["attention_weights"][0].shape == (2, 2 if len(variables) else 1, 4, 5)
    fast = make(implementation="blockwise")
    assert diff(jax.jit(lambda v: fast.apply(v, q, kv, kv, lens))(variables), reference) <= TOL
    out, state = fast.apply(variables, q, kv, kv, lens, mutable=["intermediates"])
    sown = state["intermediates"]["attention_weights"][0]
    assert diff(out, reference) <= TOL
    assert diff(sown, kept["intermediates"]["attention_weights"][0]) == 0.0
    out, w = fast.apply(variables, q, kv, kv, lens, return_attention=True)
    assert diff(out, reference) <= TOL and diff(w, sown) == 0.0
    unkept = make(implementation="blockwise", keep_attention_weights=False)
    out, state = unkept.apply(variables, q, kv, kv, lens, mutable=["intermediates"])
    assert diff(out, reference) <= TOL and "intermediates" not in state
    out, w = make(keep_attention_weights=False).apply(variables, q, kv, kv, lens,
                                                      return_attention=True)
    assert diff(out, reference) <= TOL and w.shape[-2:] == (4, 5)


def test_encoder_block_keeps_weights_only_when_mutable_and_asked(block: Any) -> None:
    layer, variables, X = block
    lens = jnp.array([3, 5])
    reference, state = layer.apply(variables, X, lens, mutable=["intermediates"])
    assert state["intermediates"]["attention_weights"][0].shape == (2, 2, 5, 5)
    for kw in ({"implementation": "blockwise"}, {"implementation": "fused"},
               {"keep_attention_weights": False}):
        other = bj.TransformerEncoderBlock(8, 16, 2, dropout=0.3, bias=True, **kw)
        assert diff(jax.jit(lambda v, o=other: o.apply(v, X, lens))(variables), reference) <= TOL
    unkept = bj.TransformerEncoderBlock(8, 16, 2, bias=True, keep_attention_weights=False)
    assert "intermediates" not in unkept.apply(variables, X, lens, mutable=["intermediates"])[1]


# -- RelativeMultiHeadAttention and TransformerEncoder -------------------------------------------

#: Token ids ``(2, 5)`` over a vocabulary of 9.
TOKENS = jnp.array([[1, 4, 4, 2, 0], [3, 6, 1, 1, 5]])


@pytest.fixture(scope="module")
def relative() -> tuple[bj.RelativeMultiHeadAttention, dict[str, Any], list[jax.Array]]:
    """A built relative MHA (h 8, H 2, m 3) with bias, ``q (2, 4, 6)``, ``kv (2, 5, 7)``."""
    layer = bj.RelativeMultiHeadAttention(8, 2, 3, dropout=0.5, bias=True)
    q, kv = draw((2, 4, 6), (2, 5, 7), seed=13)
    return layer, jax.jit(layer.init)(KEY, q, kv, kv), [q, kv]


@pytest.fixture(scope="module")
def encoder() -> tuple[bj.TransformerEncoder, dict[str, Any]]:
    """Two blocks of width 8 over a vocabulary of 9, dropout 0.3, built on :data:`TOKENS`."""
    layer = bj.TransformerEncoder(9, 8, 16, 2, 2, dropout=0.3, bias=True)
    return layer, jax.jit(layer.init)(KEY, TOKENS)


def test_relative_matches_the_naive_loops_eagerly_and_under_jit(relative: Any) -> None:
    layer, variables, (q, kv) = relative
    lens = jnp.array([[1, 2, 3, 5], [5, 4, 0, 2]])
    w = {k: v.astype(np.float64) for k, v in bj.get_weights(variables).items()}
    vis = naive.visible(2, 2, 4, 5, np.asarray(lens), causal=True)
    out64, w64 = naive.relative_multi_head(*(np.asarray(x, np.float64) for x in (q, kv, kv)), w, 2, vis)

    def run(variables: Any, q: jax.Array, kv: jax.Array, lens: jax.Array) -> Any:
        return layer.apply(variables, q, kv, kv, lens, causal=True, return_attention=True,
                           mutable=["intermediates"])

    for (out, attn), state in (run(variables, q, kv, lens), jax.jit(run)(variables, q, kv, lens)):
        assert diff(out, out64) <= TOL and diff(attn, w64) <= TOL
        np.testing.assert_array_equal(np.asarray(state["intermediates"]["attention_weights"][0]),
                                      np.asarray(attn))
    assert np.all(np.asarray(attn)[1, :, 2] == 0.0)  # valid length 0: nothing visible


def test_encoder_sows_one_weight_array_per_block(encoder: Any) -> None:
    layer, variables = encoder
    lens = jnp.array([3, 5])
    w = {k: v.astype(np.float64) for k, v in bj.get_weights(variables).items()}
    out64, per_block = naive.transformer_encoder(np.asarray(TOKENS), w, 2,
                                                 naive.visible(2, 2, 5, 5, np.asarray(lens)))
    run = jax.jit(lambda v, t, n: layer.apply(v, t, n, mutable=["intermediates"]))
    for out, state in (layer.apply(variables, TOKENS, lens, mutable=["intermediates"]),
                       run(variables, TOKENS, lens)):
        sown = state["intermediates"]["attention_weights"]
        assert isinstance(sown, tuple) and len(sown) == 2  # one per block, in order
        assert diff(out, out64) <= TOL
        for got, expected in zip(sown, per_block, strict=True):
            assert got.shape == (2, 2, 5, 5) and diff(got, expected) <= TOL
    assert diff(sown[0], sown[1]) > 1e-3  # each block its own weights
    plain = layer.apply(variables, TOKENS, lens)  # 'intermediates' not mutable: nothing formed
    assert diff(plain, out64) <= TOL
    for kw in ({"keep_attention_weights": False}, {"implementation": "blockwise"}):
        other = bj.TransformerEncoder(9, 8, 16, 2, 2, bias=True, **kw)
        assert diff(jax.jit(lambda v, o=other: o.apply(v, TOKENS, lens))(variables), out64) <= TOL
    unkept = bj.TransformerEncoder(9, 8, 16, 2, 2, bias=True, keep_attention_weights=False)
    assert "intermediates" not in unkept.apply(variables, TOKENS, lens, mutable=["intermediates"])[1]


def test_new_layers_draw_dropout_from_the_dropout_rng(relative: Any, encoder: Any) -> None:
    layer, variables, (q, kv) = relative
    elayer, evariables = encoder
    runs = {
        "relative": (lambda key, training=True: layer.apply(
            variables, q, kv, kv, rngs={"dropout": key}, training=training)),
        "encoder": (lambda key, training=True: elayer.apply(
            evariables, TOKENS, rngs={"dropout": key}, training=training)),
    }
    for name, run in runs.items():
        train = jax.jit(run)
        a, again, b = train(jax.random.PRNGKey(1)), train(jax.random.PRNGKey(1)), train(jax.random.PRNGKey(2))
        plain = run(jax.random.PRNGKey(1), training=False)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(again), err_msg=name)
        assert diff(a, b) > 1e-3 and diff(a, plain) > 1e-3, name
        np.testing.assert_array_equal(np.asarray(run(jax.random.PRNGKey(2), training=False)),
                                      np.asarray(plain), err_msg=name)  # eval: the rng is unused
    with pytest.raises(flax.errors.InvalidRngError, match="dropout"):
        elayer.apply(evariables, TOKENS, training=True)


def test_encoder_token_shapes_are_checked_under_jit(encoder: Any) -> None:
    """Under jit the ids' values are unknown (their checks: tests/test_adapters.py), the
    shape check still runs."""
    layer, variables = encoder
    with pytest.raises(ValueError, match="tokens"):
        jax.jit(lambda t: layer.apply(variables, t))(TOKENS[0])


# -- configuration ------------------------------------------------------------------------------


def test_importing_and_using_the_backend_leaves_x64_alone() -> None:
    """In a fresh process: x64 stays off through import and use, and stays on once the user
    turns it on, when float64 layers then match the NumPy core in float64."""
    code = (
        "import jax, jax.numpy as jnp, numpy as np; seen = [jax.config.jax_enable_x64]\n"
        "import backends.jax as bj, attention_core as ac\n"
        "x = np.random.default_rng(0).standard_normal((2, 3, 4))\n"
        "w = {n: np.random.default_rng(i).standard_normal((4, 4))\n"
        "     for i, n in enumerate(['W_q.kernel', 'W_k.kernel', 'W_v.kernel', 'W_o.kernel'])}\n"
        "def use(dtype):\n"
        "    layer = bj.MultiHeadAttention(4, 2, param_dtype=dtype); X = jnp.asarray(x, dtype)\n"
        "    bj.call_layer(layer, X, X, X); ac.dot_product_attention(X, X, X)\n"
        "    out = layer.apply(bj.init_from_weights(layer, w), X, X, X, jnp.array([2, 3]))\n"
        "    seen.append(jax.config.jax_enable_x64); return out\n"
        "use(jnp.float32); jax.config.update('jax_enable_x64', True); out = use(jnp.float64)\n"
        "diff = np.abs(np.asarray(out) - ac.multi_head_attention(x, x, x, w, 2, [2, 3])).max()\n"
        "print(*seen, out.dtype, diff < 1e-12)"
    )
    env = {k: v for k, v in os.environ.items() if k != "JAX_ENABLE_X64"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False", "True", "float64", "True"]


# -- sequence lengths under jax.jit (issue 14, item 16) -------------------------------------------


def test_encoder_under_jit_at_two_lengths() -> None:
    """One jitted apply (and the functional API) at two lengths, against the float64 reference."""
    layer = bj.TransformerEncoder(11, 12, 16, 3, 2)
    tokens = np.random.default_rng(7).integers(0, 11, (2, 13))
    variables = layer.init(KEY, jnp.asarray(tokens[:, :4]))
    weights = {k: np.asarray(v, np.float64) for k, v in bj.get_weights(variables, layer=layer).items()}
    apply = jax.jit(layer.apply)
    functional = jax.jit(lambda t: ac.transformer_encoder(t, bj.get_weights(variables, layer=layer), 3))
    for steps in (4, 13):
        part = tokens[:, :steps]
        want, _ = naive.transformer_encoder(part, weights, 3, np.ones((2, 3, steps, steps), bool))
        assert max_diff(np.asarray(apply(variables, jnp.asarray(part))), want) <= 1e-4
        assert max_diff(np.asarray(functional(jnp.asarray(part))), want) <= 1e-4
