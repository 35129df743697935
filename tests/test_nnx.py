"""Flax NNX habits of ``backends.jax.nnx``: split/merge, nnx.jit and nnx.grad, optax, dropout
from ``nnx.Rngs`` and train/eval, sown attention weights, linen's numbers, ``jax.export``.

The cross-backend files (the matrix and every module with ``COLUMN_TESTS``) run the NNX
modules through tests/hooks/nnx_hooks.py; these tests use the NNX API directly.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from conftest import test_backends

if "nnx" not in test_backends():
    pytest.skip("the nnx column is not tested in this env", allow_module_level=True)

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import backends.jax as linen
from backends.jax import nnx as bn
from tests import naive
from tests.harness import TOLERANCE, max_diff

TOL = TOLERANCE["float32"]


def draw(*shapes: tuple[int, ...], seed: int = 0) -> list[jax.Array]:
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal(s).astype(np.float32)) for s in shapes]


Q, K, V = draw((2, 4, 10), (2, 6, 7), (2, 6, 9))
LENS = jnp.array([3, 6])


def mha(**kwargs: Any) -> bn.MultiHeadAttention:
    options = {"q_in": 10, "k_in": 7, "v_in": 9, "bias": True, "rngs": nnx.Rngs(0), **kwargs}
    return bn.MultiHeadAttention(12, 3, **options)


def test_output_equals_the_float64_computation_and_the_state_is_canonical() -> None:
    layer = mha()
    weights = {n: np.asarray(w, np.float64) for n, w in layer.get_weights().items()}
    want, _ = naive.multi_head(np.asarray(Q), np.asarray(K), np.asarray(V), weights, 3,
                               naive.visible(2, 3, 4, 6, np.asarray(LENS)))
    assert max_diff(np.asarray(layer(Q, K, V, LENS)), want) <= TOL
    state = nnx.state(layer, nnx.Param)
    assert set(state) == {"W_q", "W_k", "W_v", "W_o"}
    assert {".".join(map(str, p)) for p, _ in nnx.to_flat_state(state)} == set(weights)
    assert layer.W_q["kernel"][...].shape == (10, 12)


def test_widths_default_to_num_hiddens_and_a_wrong_width_is_refused() -> None:
    layer = bn.MultiHeadAttention(8, 2, rngs=nnx.Rngs(0))
    assert {n: w.shape for n, w in layer.get_weights().items()} == {
        f"W_{x}.kernel": (8, 8) for x in "qkvo"}
    X = draw((2, 3, 5))[0]
    with pytest.raises(ValueError) as err:
        layer(X, X, X)
    assert str(err.value) == "queries last dimension (5) must be 8, the size this layer was built for"
    with pytest.raises(TypeError, match="PositionWiseFFN needs the width of X: pass d_in="):
        bn.PositionWiseFFN(16, 8, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="draws its weights from rngs"):
        bn.AddNorm(8)
    assert bn.DotProductAttention(dropout=0.5).get_weights() == {}  # nothing to draw


def test_split_merge_round_trip() -> None:
    layer = mha()
    layer.eval()
    graphdef, state = nnx.split(layer)
    copy = nnx.merge(graphdef, state)
    np.testing.assert_array_equal(np.asarray(copy(Q, K, V, LENS)), np.asarray(layer(Q, K, V, LENS)))
    for name, value in layer.get_weights().items():
        np.testing.assert_array_equal(copy.get_weights()[name], value)


def test_constants_are_no_state() -> None:
    """``P`` is an attribute, not in ``nnx.state``: nothing to train or to save."""
    encoding = bn.PositionalEncoding(8, max_len=20)
    assert encoding.P.shape == (1, 20, 8)
    assert not jax.tree.leaves(nnx.state(encoding))
    encoder = bn.TransformerEncoder(11, 8, 12, 2, 1, max_len=20, rngs=nnx.Rngs(0))
    assert "P" not in nnx.state(encoder)
    tokens = jnp.array([[1, 2, 3]])
    jitted = nnx.jit(lambda m, t: m(t))(nnx.merge(*nnx.split(encoder)), tokens)
    np.testing.assert_allclose(np.asarray(jitted), np.asarray(encoder(tokens)), atol=1e-6)


def test_jit_and_grad_of_a_loss() -> None:
    layer = mha()

    def loss(model: bn.MultiHeadAttention, q: jax.Array) -> jax.Array:
        return jnp.sum(model(q, K, V, LENS) ** 2)

    eager = loss(layer, Q)
    assert abs(float(nnx.jit(loss)(layer, Q)) - float(eager)) <= 1e-4
    grads = nnx.jit(nnx.grad(loss))(layer, Q)
    flat = {".".join(map(str, p)): g.get_value() for p, g in nnx.to_flat_state(grads)}
    assert set(flat) == set(layer.get_weights())
    # d/dW_o.bias of sum(out ** 2) is sum over B, Q of 2 * out
    out = np.asarray(layer(Q, K, V, LENS), np.float64)
    assert max_diff(np.asarray(flat["W_o.bias"]), 2 * out.sum((0, 1))) <= 1e-4


class Tagger(nnx.Module):
    """A small encoder and a readout: predicts at each position the token there."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.encoder = bn.TransformerEncoder(8, 16, 32, 2, 1, max_len=16, rngs=rngs)
        self.readout = nnx.Linear(16, 8, rngs=rngs)

    def __call__(self, tokens: jax.Array, valid_lens: jax.Array) -> jax.Array:
        return self.readout(self.encoder(tokens, valid_lens))


def test_an_encoder_trains_with_optax() -> None:
    """``nnx.Optimizer`` with ``optax.adam`` over the encoder's ``nnx.Param``: the loss falls."""
    model = Tagger(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 8, (16, 6)))
    lens = jnp.full((16,), 6)

    def loss_fn(m: Tagger) -> jax.Array:
        logits = m(tokens, lens)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean()

    @nnx.jit
    def step(m: Tagger, opt: nnx.Optimizer[Tagger]) -> jax.Array:
        loss, grads = nnx.value_and_grad(loss_fn)(m)
        opt.update(m, grads)
        return loss

    losses = [float(step(model, optimizer)) for _ in range(30)]
    assert np.isfinite(losses).all()
    assert losses[-1] < 0.5 * losses[0], losses


def test_dropout_from_rngs_in_training_and_off_after_eval() -> None:
    layer = bn.DotProductAttention(dropout=0.5, rngs=nnx.Rngs(dropout=3))
    q, k, v = draw((2, 3, 4), (2, 5, 4), (2, 5, 6))
    assert not layer.deterministic  # NNX modules are made in training mode
    a, b = layer(q, k, v), layer(q, k, v)
    assert max_diff(np.asarray(a), np.asarray(b)) > 0  # a new mask each call
    jitted = nnx.jit(lambda m: m(q, k, v))
    assert max_diff(np.asarray(jitted(layer)), np.asarray(jitted(layer))) > 0  # also jitted
    layer.eval()
    c = layer(q, k, v)
    np.testing.assert_array_equal(np.asarray(layer(q, k, v)), np.asarray(c))
    want = bn.DotProductAttention()(q, k, v)
    assert max_diff(np.asarray(c), np.asarray(want)) == 0
    assert max_diff(np.asarray(layer(q, k, v, training=True)), np.asarray(c)) > 0  # per call
    assert max_diff(np.asarray(layer(q, k, v, deterministic=False)), np.asarray(c)) > 0
    layer.train()
    np.testing.assert_array_equal(np.asarray(layer(q, k, v, training=False)), np.asarray(c))
    np.testing.assert_array_equal(np.asarray(nnx.view(layer, deterministic=True)(q, k, v)),
                                  np.asarray(c))
    with pytest.raises(ValueError, match="training=True and deterministic=True disagree: "
                                         "deterministic means training=False; give one of them"):
        layer(q, k, v, deterministic=True, training=True)


def test_a_failed_call_changes_nothing() -> None:
    """Not the weights, not the dropout stream's count."""
    layer = mha(dropout=0.5)
    weights, count = layer.get_weights(), int(layer.rngs.count[...])
    with pytest.raises(ValueError, match="valid_lens must be <= the number of keys"):
        layer(Q, K, V, np.array([3, 9]))  # on the host: a JAX array is never read
    with pytest.raises(ValueError, match="mask"):  # found by the forward, after the draw
        layer(Q, K, V, mask=jnp.ones((3, 5), bool))
    assert int(layer.rngs.count[...]) == count
    for name, value in layer.get_weights().items():
        np.testing.assert_array_equal(value, weights[name])
    layer(Q, K, V)
    assert int(layer.rngs.count[...]) == count + 1


def test_sown_attention_weights_equal_the_returned_ones() -> None:
    layer = mha()
    (_, returned), sown = nnx.capture(layer, nnx.Intermediate)(Q, K, V, LENS,
                                                                  return_attention=True)
    (kept,) = sown["attention_weights"].get_value()
    np.testing.assert_array_equal(np.asarray(kept), np.asarray(returned))
    assert np.asarray(returned).shape == (2, 3, 4, 6)
    encoder = bn.TransformerEncoder(11, 12, 16, 3, 2, rngs=nnx.Rngs(0))
    tokens = jnp.array([[1, 2, 3, 4], [5, 6, 0, 0]])
    _, sown = nnx.jit(nnx.capture(lambda m, t: m(t, jnp.array([4, 2])), nnx.Intermediate))(
        encoder, tokens)
    blocks = sown["attention_weights"].get_value()
    assert len(blocks) == 2 and all(np.asarray(b).shape == (2, 3, 4, 4) for b in blocks)
    np.testing.assert_array_equal(np.asarray(blocks[0])[1, :, :, 2:], 0.0)
    quiet = bn.MultiHeadAttention(12, 3, keep_attention_weights=False, rngs=nnx.Rngs(0))
    _, none = nnx.capture(quiet, nnx.Intermediate)(*draw((2, 4, 12), (2, 6, 12), (2, 6, 12)))
    assert "attention_weights" not in none


@pytest.mark.parametrize("name", ["MultiHeadAttention", "TransformerEncoderBlock"])
def test_same_weights_as_linen_same_numbers(name: str) -> None:
    config: dict[str, Any] = ({"num_hiddens": 12, "num_heads": 3, "bias": True}
                              if name == "MultiHeadAttention"
                              else {"num_hiddens": 12, "ffn_num_hiddens": 16, "num_heads": 3})
    sizes = {"q_in": 10, "k_in": 7, "v_in": 9} if name == "MultiHeadAttention" else {}
    args = (Q, K, V, LENS) if name == "MultiHeadAttention" else (draw((2, 6, 12))[0], LENS)
    ours = getattr(bn, name)(**config, **sizes, rngs=nnx.Rngs(1))
    module = getattr(linen, name)(**config)
    variables = linen.set_weights(None, ours.get_weights(), layer=module)
    want = module.apply(variables, *args)
    assert max_diff(np.asarray(ours(*args)), np.asarray(want)) <= 1e-6


def test_set_weights_checks_everything_first() -> None:
    layer = mha()
    before = layer.get_weights()
    bad = {**before, "W_o.kernel": np.zeros((12, 11), np.float32)}
    with pytest.raises(ValueError, match=r"W_o.kernel has shape \(12, 11\), expected \(12, 12\)"):
        layer.set_weights({name: value * 2 for name, value in bad.items()})
    for name, value in layer.get_weights().items():
        np.testing.assert_array_equal(value, before[name])
    layer.set_weights({name: value * 2 for name, value in before.items()})
    np.testing.assert_array_equal(layer.get_weights()["W_q.kernel"], before["W_q.kernel"] * 2)


def test_dtypes() -> None:
    """``param_dtype`` holds the weights; ``dtype`` computes; None computes in ``param_dtype``."""
    half = mha(param_dtype=jnp.bfloat16)
    assert {w.dtype for w in jax.tree.leaves(nnx.state(half, nnx.Param))} == {jnp.dtype("bfloat16")}
    assert half(Q, K, V).dtype == jnp.bfloat16
    mixed = mha(dtype="bfloat16")
    assert mixed.get_weights()["W_q.kernel"].dtype == np.float32
    assert mixed(Q, K, V).dtype == jnp.bfloat16
    assert max_diff(np.asarray(mixed(Q, K, V), np.float32), np.asarray(mha()(Q, K, V))) <= 0.1


def test_jax_export_of_multi_head_attention() -> None:
    """``nnx.split``, a pure function of (params as a pure dict, inputs), ``jax.export``:
    serialized, deserialized and called, the same numbers; other params, other numbers."""
    layer = mha()
    layer.eval()
    graphdef, state = nnx.split(layer)
    params = nnx.to_pure_dict(state)

    def pure(params: Any, q: jax.Array, k: jax.Array, v: jax.Array, lens: jax.Array) -> jax.Array:
        copy = jax.tree.map(lambda x: x, state)
        nnx.replace_by_pure_dict(copy, params)
        out: jax.Array = nnx.merge(graphdef, copy)(q, k, v, lens)
        return out

    exported = jax.export.export(jax.jit(pure))(params, Q, K, V, LENS)
    restored = jax.export.deserialize(exported.serialize())
    got = restored.call(params, Q, K, V, LENS)
    assert max_diff(np.asarray(got), np.asarray(layer(Q, K, V, LENS))) <= 1e-5
    doubled = jax.tree.map(lambda x: 2 * x, params)
    layer.set_weights({name: 2 * w for name, w in layer.get_weights().items()})
    got = restored.call(doubled, Q, K, V, LENS)
    assert max_diff(np.asarray(got), np.asarray(layer(Q, K, V, LENS))) <= 1e-5
