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
from attention_core import kernels
from attention_core.kernels import Request
from attention_core.modifiers import Call
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


# -- vmap (jit and grad: tests/test_compiled.py) ----------------------------------------------


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


@pytest.mark.parametrize("which", ["dot", "mha", "block", "relative", "encoder"])
def test_training_draws_dropout_from_the_dropout_rng(which: str, request: pytest.FixtureRequest) -> None:
    """Jitted training calls: the same key the same output, another key another; inference
    ignores the rng; the weights are kept before dropout, each dropped or scaled by 1 / (1 - p)
    (dot: ``V = I``, the output rows are the dropped weights); no 'dropout' rng, no training."""
    layer, variables, *rest = (bj.DotProductAttention(dropout=0.25), {}) if which == "dot" else (
        request.getfixturevalue(which))
    args = ([*draw((1, 3, 4), (1, 6, 4), seed=8), jnp.eye(6)[None]] if which == "dot" else
            [TOKENS] if which == "encoder" else rest if which == "block" else [*rest[0], rest[0][1]])
    asks = {"return_attention": True} if which in ("dot", "mha") else {}

    def run(key: jax.Array, training: bool = True) -> tuple[Any, Any]:
        out = layer.apply(variables, *args, rngs={"dropout": key}, training=training, **asks)
        return out if asks else (out, None)

    train, infer = jax.jit(run), jax.jit(lambda: layer.apply(variables, *args, **asks))
    (a, w_a), (b, _), (plain, w_plain) = train(KEY), train(jax.random.PRNGKey(2)), jax.jit(
        run, static_argnums=1)(KEY, False)
    np.testing.assert_array_equal(np.asarray(train(KEY)[0]), np.asarray(a))
    assert diff(a, b) > 1e-3 and diff(a, plain) > 1e-3
    evaluated = infer()  # no rng: the same as with one
    np.testing.assert_array_equal(np.asarray(evaluated[0] if asks else evaluated), np.asarray(plain))
    if asks:
        assert diff(w_a, w_plain) <= 1e-6
    if which == "dot":
        ratio = np.asarray(a, np.float64)[0] / np.asarray(w_a, np.float64)[0, 0]
        dropped, kept = np.isclose(ratio, 0.0, atol=1e-6), np.isclose(ratio, 1 / 0.75, rtol=1e-5)
        assert np.all(dropped | kept) and dropped.any() and kept.any()
    with pytest.raises(flax.errors.InvalidRngError, match="dropout"):
        layer.apply(variables, *args, training=True)


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


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the rule measured on CPU")
def test_the_automatic_choice_on_cpu_never_takes_the_measured_slower_kernel() -> None:
    def chosen(shape: tuple[int, ...]) -> tuple[str, dict[str, str]]:
        entry, passed = kernels.choose(bj.OPS, Request(Call(bj.OPS, shape)))
        return entry.name, passed

    for shape in [(1, 1, 8, 8), (1, 8, 512, 512), (1, 8, 4096, 4096)]:
        assert chosen(shape)[1]["fused"] == "not preferred for this call"
    assert chosen((1, 8, 128, 128))[0] == "direct"
    assert chosen((1, 4, 16384, 16384))[0] == "blockwise"


@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_training_the_blockwise_path_keeps_no_tile_of_scores(dropout: float) -> None:
    """The gradient of the blockwise loops recomputes the tiles (jax.checkpoint on the loop
    bodies), so the compiled training step's temporaries grow at most linearly in n.

    Measured (MiB, H = 4, n = 4096 -> 8192): 82 -> 104 (dropout 0), 139 -> 160 (0.5); without
    the recomputation 696 -> 2584 and 796 -> 2823, the (B, H, Q, K) tiles kept.
    """
    def temporaries(n: int) -> int:
        q = k = v = jnp.ones((1, 4, n, 64), jnp.float32)
        lens = jnp.array([n - n // 4])

        def loss(q: Any, k: Any, v: Any, key: Any) -> Any:
            out = ac.dot_product_attention(q, k, v, lens, dropout=dropout,
                                           implementation="blockwise", ops=bj.JaxOps(rng=key))
            return jnp.sum(out)

        step = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v, KEY).compile()
        return int(step.memory_analysis().temp_size_in_bytes)

    small, large = temporaries(4096), temporaries(8192)
    assert large / small <= 2.2, (small / 2**20, large / 2**20)


@pytest.mark.parametrize(("dropout", "dv", "lacks"), [
    (0.5, 4, "does not take dropout"), (0.0, 3, "needs values as deep as the keys")])
def test_fused_is_refused_where_the_kernel_cannot_do_the_call(dropout: float, dv: int,
                                                              lacks: str) -> None:
    """jax.nn.dot_product_attention has no dropout and needs Dv == D: forcing it is refused,
    saying so; the automatic choice pools on the direct kernel, with the same dropout draws."""
    q, k, v = draw((2, 2, 5, 4), (2, 2, 6, 4), (2, 2, 6, dv), seed=9)

    def run(implementation: str | None) -> Any:
        return jax.jit(lambda key: ac.dot_product_attention(
            q, k, v, jnp.array([2, 6]), dropout=dropout, implementation=implementation,
            ops=bj.JaxOps(rng=key)))(jax.random.PRNGKey(3))

    with pytest.raises(ValueError) as err:
        run("fused")
    assert str(err.value) == (f"implementation='fused' {lacks}: this call needs "
                              "implementation=None or 'blockwise' or 'direct'")
    np.testing.assert_array_equal(np.asarray(run(None)), np.asarray(run("direct")))


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
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False", "True", "float64", "True"]


@pytest.mark.parametrize("layer", ["block", "addnorm", "encoder"])
def test_numpy_inputs_are_taken_as_flax_layers_take_them(layer: str) -> None:
    """NumPy float inputs are taken as JAX arrays (a block's residual once mixed a NumPy input
    with a JAX one and raised), and NumPy lengths are still checked on the host."""
    rng = np.random.default_rng(0)
    X = rng.standard_normal((2, 3, 8)).astype(np.float32)
    module, args = {
        "block": (bj.TransformerEncoderBlock(8, 16, 2), (X, np.array([3, 2]))),
        "addnorm": (bj.AddNorm(8), (X, X[:, ::-1].copy())),
        "encoder": (bj.TransformerEncoder(11, 8, 16, 2, 1), (rng.integers(0, 11, (2, 3)),
                                                             np.array([3, 2]))),
    }[layer]
    variables = module.init(jax.random.PRNGKey(0), *args)
    got = module.apply(variables, *args)
    want = module.apply(variables, *(jnp.asarray(a) for a in args))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    if layer != "addnorm":
        with pytest.raises(ValueError, match="valid_lens must be <= the number of keys"):
            module.apply(variables, args[0], np.array([3, 2**32 + 1]))
