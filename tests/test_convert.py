"""Converters between the frameworks' own multi-head attention layers and canonical weights.

``torch.nn.MultiheadAttention``, ``keras.layers.MultiHeadAttention`` and
``flax.linen.MultiHeadDotProductAttention`` with random weights (biases included) are the
expected values: their own outputs and per-head attention weights, computed by the framework's
own code. Converted to canonical weights, this library's layer on the same backend and the
NumPy layer must give them within the fp32 tolerance, for no mask, a key padding mask (our
``valid_lens``), a causal mask and a boolean mask, each written the framework's way here. And
back: canonical weights -> native layer -> the NumPy layer's numbers.

Each framework's tests run in the env of its backend (``ATTENTION_CORE_TEST_BACKENDS``); the
framework is imported unconditionally there, so a missing one fails.
"""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

import attention_core as ac
import backends.numpy as numpy_layers
from attention_core import convert as C
from attention_core import weights as W
from conftest import test_backends
from tests.harness import TOLERANCE, max_diff

TESTED = test_backends()
TOL = TOLERANCE["float32"]
B, T, H, D = 2, 5, 2, 4  # batch, sequence length (queries = keys), heads, head size
h = H * D
LENS = np.array([3, 5], np.int32)
MASK_KINDS = ["none", "valid_lens", "causal", "boolean"]

if "torch" in TESTED:
    import torch

    import backends.torch as torch_layers
    from backends.torch import convert as torch_convert
if "tensorflow" in TESTED:
    import keras

    import backends.tensorflow as tf_layers
    from backends.tensorflow import convert as keras_convert
if "jax" in TESTED:
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    import backends.jax as jax_layers
    from backends.jax import convert as flax_convert

needs_numpy = pytest.mark.skipif("numpy" not in TESTED, reason="core layout checks run in the numpy env")
needs_torch = pytest.mark.skipif("torch" not in TESTED, reason="torch is not tested in this env")
needs_tf = pytest.mark.skipif("tensorflow" not in TESTED, reason="tensorflow is not tested in this env")
needs_jax = pytest.mark.skipif("jax" not in TESTED, reason="jax is not tested in this env")


def inputs(seed: int, q_in: int, k_in: int, v_in: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((B, T, d)).astype(np.float32) for d in (q_in, k_in, v_in)]


def boolean_mask() -> np.ndarray:
    """(Q, K), True = may attend; every query sees at least one key."""
    mask = np.random.default_rng(7).random((T, T)) < 0.6
    mask[:, 0] = True
    return mask


def our_call(kind: str) -> dict[str, Any]:
    """This library's arguments for a mask kind."""
    calls: dict[str, dict[str, Any]] = {"none": {}, "valid_lens": {"valid_lens": LENS},
                                        "causal": {"causal": True}, "boolean": {"mask": boolean_mask()}}
    return calls[kind]


def canonical(seed: int, q_in: int, k_in: int, v_in: int, bias: bool) -> dict[str, np.ndarray]:
    """Random canonical MHA weights (biases not zero)."""
    rng = np.random.default_rng(seed)
    shapes = {"W_q": (q_in, h), "W_k": (k_in, h), "W_v": (v_in, h), "W_o": (h, h)}
    weights = {f"{n}.kernel": rng.normal(0, 0.4, s).astype(np.float32) for n, s in shapes.items()}
    if bias:
        weights.update({f"{n}.bias": rng.normal(0, 0.4, h).astype(np.float32) for n in shapes})
    return weights


def numpy_mha(weights: dict[str, np.ndarray], num_heads: int = H) -> Any:
    layer = numpy_layers.MultiHeadAttention(weights["W_o.kernel"].shape[1], num_heads,
                                            bias="W_q.bias" in weights)
    layer.set_weights(weights)
    return layer


def check(got: Any, expected: Any, what: str) -> None:
    diff = max_diff(np.asarray(got), np.asarray(expected))
    assert diff <= TOL, f"{what}: max |diff| {diff:.3g} > {TOL}"


# -- the framework-free layout ----------------------------------------------------------------


@needs_numpy
def test_einsum_layout_puts_head_i_in_columns_i() -> None:
    """Per-head kernels flatten so that head i is columns i*d:(i+1)*d (built by hand here)."""
    q_in = 3
    heads = {i: np.full((q_in, D), float(i + 1), np.float32) for i in range(H)}
    kernel = np.stack([heads[i] for i in range(H)], axis=1)  # (in, H, d)
    params = {"query": {"kernel": kernel}, "key": {"kernel": kernel},
              "value": {"kernel": kernel}, "out": {"kernel": np.zeros((H, D, h), np.float32)}}
    weights = C.from_einsum(params)
    for i in range(H):
        assert (weights["W_q.kernel"][:, i * D:(i + 1) * D] == i + 1).all()
    assert C.to_einsum(weights, H)["query"]["kernel"].tobytes() == kernel.tobytes()


@needs_numpy
@pytest.mark.parametrize("bias", [True, False])
def test_einsum_round_trip_is_exact(bias: bool) -> None:
    weights = canonical(0, 5, 6, 3, bias)
    back = C.from_einsum(C.to_einsum(weights, H))
    assert sorted(back) == sorted(weights)
    for name, value in weights.items():
        np.testing.assert_array_equal(back[name], value)


def _einsum(q_depth: int = D, v_depth: int = D, out: int = h, bias: bool = True) -> dict[str, Any]:
    tree: dict[str, dict[str, np.ndarray]] = {
        "query": {"kernel": np.zeros((5, H, q_depth))}, "key": {"kernel": np.zeros((6, H, q_depth))},
        "value": {"kernel": np.zeros((3, H, v_depth))}, "out": {"kernel": np.zeros((H, v_depth, out))}}
    if bias:
        for name in ("query", "key", "value"):
            tree[name]["bias"] = np.zeros((H, tree[name]["kernel"].shape[2]))
        tree["out"]["bias"] = np.zeros(out)
    return tree


@needs_numpy
@pytest.mark.parametrize("tree, message", [
    (_einsum(v_depth=3), "value heads have size 3 and key heads 4, but query heads 4"),
    (_einsum(out=5), "the output width (5) must equal num_heads * head size (2 * 4 = 8)"),
    ({**_einsum(bias=False), "query": {"kernel": np.zeros((5, H, D)),
                                       "bias": np.zeros((H, D))}}, "biases on ['query.bias'] only"),
    ({**_einsum(), "query_ln": {"scale": np.zeros(D)}},
     "missing params [], unexpected params ['query_ln.scale']"),
    ({k: v for k, v in _einsum().items() if k != "out"},
     "missing params ['out.bias', 'out.kernel'], unexpected params []"),
], ids=["value_dim", "out_width", "partial_bias", "extra", "missing"])
def test_einsum_layout_errors(tree: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"from_native: {message}")):
        C.from_native(tree)


@needs_numpy
def test_from_native_refuses_other_objects() -> None:
    with pytest.raises(TypeError, match=re.escape("expected a torch.nn.MultiheadAttention, a keras.layers")):
        C.from_native(numpy_layers.MultiHeadAttention(8, 2))


@needs_numpy
def test_converters_import_no_framework() -> None:
    code = ("import sys, attention_core.convert; "
            "print(sorted(m for m in ('torch', 'tensorflow', 'keras', 'jax', 'flax', 'mxnet') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# -- torch.nn.MultiheadAttention -------------------------------------------------------------

#: (kdim, vdim, bias, batch_first): stacked in_proj_weight when kdim = vdim = embed_dim.
TORCH_VARIANTS = {"stacked_bias": (None, None, True, True), "stacked_nobias": (None, None, False, True),
                  "separate_bias": (6, 3, True, True), "separate_nobias": (6, 3, False, False)}


def torch_native(variant: str, seed: int = 0) -> Any:
    kdim, vdim, bias, batch_first = TORCH_VARIANTS[variant]
    torch.manual_seed(seed)
    module = torch.nn.MultiheadAttention(h, H, bias=bias, kdim=kdim, vdim=vdim,
                                         batch_first=batch_first)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.4)  # torch initialises biases to zero: make them count
    return module.eval()


def torch_run(module: Any, xs: list[np.ndarray], kind: str) -> tuple[np.ndarray, np.ndarray]:
    """The native module's output and per-head weights; masks written torch's way (True = blocked)."""
    kwargs: dict[str, Any] = {}
    if kind == "valid_lens":
        kwargs["key_padding_mask"] = torch.arange(T)[None, :] >= torch.from_numpy(LENS)[:, None]
    elif kind == "causal":
        kwargs["attn_mask"] = torch.ones(T, T, dtype=torch.bool).triu(1)
    elif kind == "boolean":
        kwargs["attn_mask"] = ~torch.from_numpy(boolean_mask())
    args = [torch.from_numpy(x) for x in xs]
    if not module.batch_first:
        args = [x.transpose(0, 1) for x in args]
    out, attn = module(*args, need_weights=True, average_attn_weights=False, **kwargs)
    if not module.batch_first:
        out = out.transpose(0, 1)
    return out.detach().numpy(), attn.detach().numpy()


@needs_torch
@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("variant", list(TORCH_VARIANTS))
def test_torch_native_to_ours(variant: str, kind: str) -> None:
    module = torch_native(variant)
    kdim, vdim = module.kdim, module.vdim
    xs = inputs(1, h, kdim, vdim)
    expected, expected_attn = torch_run(module, xs, kind)
    weights = torch_convert.from_torch(module)
    config = torch_convert.torch_config(module)
    assert config == {"num_hiddens": h, "num_heads": H, "dropout": 0.0,
                      "bias": TORCH_VARIANTS[variant][2]}
    ours = numpy_mha(weights)
    check(ours(*xs, **our_call(kind)), expected, "numpy layer")
    check(ours.attention_weights, expected_attn, "numpy layer, attention weights")
    layer = torch_layers.MultiHeadAttention(**config).eval()
    layer.set_weights(weights)
    call = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in our_call(kind).items()}
    with torch.no_grad():
        check(layer(*(torch.from_numpy(x) for x in xs), **call).numpy(), expected, "torch layer")


@needs_torch
@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("variant", list(TORCH_VARIANTS))
def test_ours_to_torch_native(variant: str, kind: str) -> None:
    kdim, vdim, bias, batch_first = TORCH_VARIANTS[variant]
    weights = canonical(2, h, kdim or h, vdim or h, bias)
    xs = inputs(3, h, kdim or h, vdim or h)
    module = torch_convert.to_torch(weights, H, batch_first=batch_first).eval()
    assert module._qkv_same_embed_dim == (kdim is None)
    assert (module.in_proj_bias is not None) == bias
    ours = numpy_mha(weights)
    expected = ours(*xs, **our_call(kind))
    out, attn = torch_run(module, xs, kind)
    check(out, expected, "to_torch module")
    check(attn, ours.attention_weights, "to_torch module, attention weights")


@needs_torch
def test_torch_round_trip_is_exact_and_keeps_dtype() -> None:
    weights = canonical(4, h, 6, 3, True)
    module = torch_convert.to_torch(weights, H, dtype=torch.float64)
    assert module.q_proj_weight.dtype == torch.float64
    back = torch_convert.from_torch(module)
    for name, value in weights.items():
        assert back[name].dtype == np.float64
        np.testing.assert_array_equal(back[name], value)
    assert C.from_native(module).keys() == back.keys()
    assert C.native_config(module) == {"num_hiddens": h, "num_heads": H, "dropout": 0.0, "bias": True}


@needs_torch
def test_torch_trained_module_converts() -> None:
    """A module after real SGD steps (torch's own autograd) still converts exactly."""
    module = torch_native("separate_bias").train()
    xs = [torch.from_numpy(x) for x in inputs(5, h, 6, 3)]
    target = torch.from_numpy(np.random.default_rng(6).standard_normal((B, T, h)).astype(np.float32))
    opt = torch.optim.SGD(module.parameters(), lr=0.2)
    losses = []
    for _ in range(4):
        opt.zero_grad()
        loss = ((module(*xs, need_weights=False)[0] - target) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0]
    module.eval()
    expected, _ = torch_run(module, [x.numpy() for x in xs], "valid_lens")
    check(numpy_mha(torch_convert.from_torch(module))(*[x.numpy() for x in xs], LENS), expected,
          "numpy layer after training")


@needs_torch
@pytest.mark.parametrize("make, error, message", [
    (lambda: torch.nn.MultiheadAttention(8, 2, add_bias_kv=True), ValueError,
     "from_torch: add_bias_kv=True is not supported"),
    (lambda: torch.nn.MultiheadAttention(8, 2, add_zero_attn=True), ValueError,
     "from_torch: add_zero_attn=True is not supported"),
    (lambda: torch.nn.Linear(2, 2), TypeError,
     "from_torch: expected a torch.nn.MultiheadAttention, got Linear"),
], ids=["bias_kv", "zero_attn", "not_mha"])
def test_from_torch_errors(make: Any, error: type, message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        torch_convert.from_torch(make())


@needs_torch
def test_to_torch_errors() -> None:
    with pytest.raises(ValueError, match=re.escape(
            "to_torch: W_q.kernel has shape (5, 8), but torch.nn.MultiheadAttention needs "
            "queries of width embed_dim = num_hiddens (8)")):
        torch_convert.to_torch(canonical(0, 5, 6, 3, True), H)
    weights = canonical(0, h, h, h, True)
    del weights["W_o.bias"]
    with pytest.raises(ValueError, match=re.escape("to_torch: missing weights ['W_o.bias']")):
        torch_convert.to_torch(weights, H)
    with pytest.raises(ValueError, match=re.escape("num_hiddens (8) must be divisible by num_heads (3)")):
        torch_convert.to_torch(canonical(0, h, h, h, False), 3)


# -- torch.nn.TransformerEncoderLayer <-> TransformerEncoderBlock ----------------------------

FFN = 12


def torch_encoder_layer(seed: int = 0, **kwargs: Any) -> Any:
    """A batch-first torch encoder layer with every parameter random (biases, norms too)."""
    layer = torch.nn.TransformerEncoderLayer(h, H, FFN, 0.0, batch_first=True, **kwargs)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in layer.parameters():
            param.add_(0.3 * torch.randn(param.shape, generator=generator))
    return layer.eval()


def torch_encoder_masks() -> list[dict[str, Any]]:
    padded = torch.from_numpy(np.arange(T)[None, :] >= LENS[:, None])
    return [{}, {"src_key_padding_mask": padded},
            {"src_mask": torch.from_numpy(~boolean_mask())},
            {"src_mask": torch.nn.Transformer.generate_square_subsequent_mask(T), "is_causal": True}]


@needs_torch
def test_torch_encoder_layer_to_ours() -> None:
    native = torch_encoder_layer()
    weights = torch_convert.from_torch_encoder_layer(native)
    config = torch_convert.encoder_layer_config(native)
    assert config == {"num_hiddens": h, "ffn_num_hiddens": FFN, "num_heads": H, "dropout": 0.0,
                      "bias": True}
    ours = torch_layers.TransformerEncoderBlock(**config).eval()
    ours.set_weights(weights)
    X = torch.from_numpy(inputs(1, h, h, h)[0])
    for masks in torch_encoder_masks():
        expected = native(X, **masks).detach().numpy()
        check(ours(X, **masks).detach(), expected, f"block with {sorted(masks)}")
    # the functional core on NumPy, masked the library's way
    expected = native(X, src_key_padding_mask=torch_encoder_masks()[1]["src_key_padding_mask"])
    check(ac.transformer_encoder_block(X.numpy(), weights, H, LENS), expected.detach().numpy(),
          "functional core")


@needs_torch
def test_ours_to_torch_encoder_layer() -> None:
    ours = torch_layers.TransformerEncoderBlock(h, FFN, H, bias=True).eval()
    X = torch.from_numpy(inputs(2, h, h, h)[0])
    ours(X)
    rng = np.random.default_rng(3)
    ours.set_weights({name: (1.0 if name.endswith("gamma") else 0.0)
                      + rng.normal(0, 0.3, value.shape).astype(np.float32)
                      for name, value in ours.get_weights().items()})
    weights = ours.get_weights()
    native = torch_convert.to_torch_encoder_layer(weights, H).eval()
    assert native.self_attn.batch_first and not native.norm_first
    for masks in torch_encoder_masks():
        check(ours(X, **masks).detach(), native(X, **masks).detach().numpy(),
              f"torch layer with {sorted(masks)}")
    back = torch_convert.from_torch_encoder_layer(native)
    assert set(back) == set(weights)
    for name, value in weights.items():
        np.testing.assert_array_equal(back[name], value, err_msg=name)


@needs_torch
@pytest.mark.parametrize("kwargs, error, message", [
    ({"norm_first": True}, ValueError, "from_torch_encoder_layer: norm_first=True is not "
                                       "supported: this library's TransformerEncoderBlock is "
                                       "post-norm (norm_first=False)"),
    ({"activation": "gelu"}, ValueError, "from_torch_encoder_layer: the activation must be ReLU"),
    ({"layer_norm_eps": 1e-6}, ValueError, "from_torch_encoder_layer: norm1 must be a LayerNorm "
                                           "with a weight, a bias and eps=1e-05 (layer_norm_eps)"),
    ({"bias": False}, ValueError, "from_torch_encoder_layer: norm1 must be a LayerNorm with a "
                                  "weight, a bias"),
], ids=["norm_first", "gelu", "eps", "no_bias"])
def test_from_torch_encoder_layer_refusals(kwargs: dict[str, Any], error: type,
                                           message: str) -> None:
    layer = torch.nn.TransformerEncoderLayer(h, H, FFN, batch_first=True, **kwargs)
    with pytest.raises(error, match=re.escape(message)):
        torch_convert.from_torch_encoder_layer(layer)
    with pytest.raises(error, match=re.escape(message.replace("from_torch_encoder_layer",
                                                              "encoder_layer_config"))):
        torch_convert.encoder_layer_config(layer)


@needs_torch
def test_to_torch_encoder_layer_refusals() -> None:
    with pytest.raises(TypeError, match=re.escape(
            "from_torch_encoder_layer: expected a torch.nn.TransformerEncoderLayer, got Linear")):
        torch_convert.from_torch_encoder_layer(torch.nn.Linear(2, 2))
    unbiased = torch_layers.TransformerEncoderBlock(h, FFN, H)
    unbiased(torch.from_numpy(inputs(4, h, h, h)[0]))
    with pytest.raises(ValueError, match=re.escape(
            "to_torch_encoder_layer: the attention projections must have biases (bias=True): "
            "torch.nn.TransformerEncoderLayer's bias covers them, the FFN and the layer norms "
            "alike")):
        torch_convert.to_torch_encoder_layer(unbiased.get_weights(), H)
    good = torch_convert.from_torch_encoder_layer(torch_encoder_layer())
    missing = {k: v for k, v in good.items() if k != "addnorm2.ln.beta"}
    with pytest.raises(ValueError, match=re.escape(
            "to_torch_encoder_layer: missing weights ['addnorm2.ln.beta']")):
        torch_convert.to_torch_encoder_layer(missing, H)
    with pytest.raises(TypeError, match="to_torch_encoder_layer: weights must be a mapping"):
        torch_convert.to_torch_encoder_layer([1], H)


# -- keras.layers.MultiHeadAttention ---------------------------------------------------------

#: (query width, output_shape, use_bias)
KERAS_VARIANTS = {"square_bias": (h, None, True), "square_nobias": (h, None, False),
                  "narrow_query_bias": (5, h, True), "narrow_query_nobias": (5, h, False)}


def keras_native(variant: str, seed: int = 0, **kwargs: Any) -> Any:
    q_in, output_shape, bias = KERAS_VARIANTS[variant]
    layer = keras.layers.MultiHeadAttention(num_heads=H, key_dim=D, use_bias=bias,
                                            output_shape=output_shape, **kwargs)
    layer.build((None, None, q_in), (None, None, 3), (None, None, 6))
    rng = np.random.default_rng(seed)
    layer.set_weights([rng.normal(0, 0.4, w.shape).astype(np.float32) for w in layer.get_weights()])
    return layer


def keras_run(layer: Any, xs: list[np.ndarray], kind: str) -> tuple[np.ndarray, np.ndarray]:
    """Keras' output and weights; Keras takes (query, value, key), masks True = may attend."""
    kwargs: dict[str, Any] = {}
    if kind == "valid_lens":
        kwargs["attention_mask"] = np.broadcast_to(
            np.arange(T)[None, None, :] < LENS[:, None, None], (B, T, T))
    elif kind == "causal":
        kwargs["use_causal_mask"] = True
    elif kind == "boolean":
        kwargs["attention_mask"] = np.broadcast_to(boolean_mask(), (B, T, T))
    q, k, v = xs
    out, scores = layer(q, v, k, return_attention_scores=True, **kwargs)
    return np.asarray(out), np.asarray(scores)


@needs_tf
@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("variant", list(KERAS_VARIANTS))
def test_keras_native_to_ours(variant: str, kind: str) -> None:
    layer = keras_native(variant)
    xs = inputs(1, KERAS_VARIANTS[variant][0], 6, 3)
    expected, expected_attn = keras_run(layer, xs, kind)
    weights = keras_convert.from_keras(layer)
    config = keras_convert.keras_config(layer)
    assert config == {"num_hiddens": h, "num_heads": H, "dropout": 0.0,
                      "bias": KERAS_VARIANTS[variant][2]}
    ours = numpy_mha(weights)
    check(ours(*xs, **our_call(kind)), expected, "numpy layer")
    check(ours.attention_weights, expected_attn, "numpy layer, attention weights")
    mine = tf_layers.MultiHeadAttention(**config)
    mine.set_weights(weights)
    check(mine(*xs, **our_call(kind)), expected, "Keras layer of this library")


@needs_tf
@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("variant", list(KERAS_VARIANTS))
def test_ours_to_keras_native(variant: str, kind: str) -> None:
    q_in, _, bias = KERAS_VARIANTS[variant]
    weights = canonical(2, q_in, 6, 3, bias)
    xs = inputs(3, q_in, 6, 3)
    layer = keras_convert.to_keras(weights, H)
    ours = numpy_mha(weights)
    expected = ours(*xs, **our_call(kind))
    out, attn = keras_run(layer, xs, kind)
    check(out, expected, "to_keras layer")
    check(attn, ours.attention_weights, "to_keras layer, attention weights")
    back = keras_convert.from_keras(layer)
    for name, value in weights.items():
        np.testing.assert_array_equal(back[name], value)
    assert C.native_config(layer) == {"num_hiddens": h, "num_heads": H, "dropout": 0.0, "bias": bias}


@needs_tf
def test_keras_trained_layer_converts() -> None:
    """A layer after real SGD steps (tf.GradientTape, Keras' SGD) still converts exactly."""
    import tensorflow as tf

    layer = keras_native("narrow_query_bias")
    q, k, v = inputs(5, 5, 6, 3)
    target = np.random.default_rng(6).standard_normal((B, T, h)).astype(np.float32)
    opt = keras.optimizers.SGD(0.2)
    losses = []
    for _ in range(4):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((layer(q, v, k) - target) ** 2)
        opt.apply_gradients(zip(tape.gradient(loss, layer.trainable_variables),
                                layer.trainable_variables, strict=True))
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    expected, _ = keras_run(layer, [q, k, v], "valid_lens")
    check(numpy_mha(C.from_native(layer))(q, k, v, LENS), expected, "numpy layer after training")


@needs_tf
@pytest.mark.parametrize("kwargs, message", [
    ({"value_dim": 3}, "from_keras: value_dim (3) must equal key_dim (4)"),
    ({"use_gate": True}, "from_keras: use_gate=True is not supported"),
    ({"sliding_window": 2}, "from_keras: sliding_window is not supported"),
    ({"attention_axes": (1, 2)}, "from_keras: attention_axes=(1, 2) is not supported"),
], ids=["value_dim", "gate", "sliding_window", "attention_axes"])
def test_from_keras_refuses_features_without_counterpart(kwargs: dict[str, Any], message: str) -> None:
    layer = keras.layers.MultiHeadAttention(num_heads=H, key_dim=D, **kwargs)
    with pytest.raises(ValueError, match=re.escape(message)):
        keras_convert.from_keras(layer)


@needs_tf
def test_from_keras_errors() -> None:
    unbuilt = keras.layers.MultiHeadAttention(num_heads=H, key_dim=D)
    with pytest.raises(ValueError, match="from_keras: the Keras layer has no weights yet"):
        keras_convert.from_keras(unbuilt)
    narrow = keras.layers.MultiHeadAttention(num_heads=H, key_dim=D)  # output = query width 5
    narrow.build((None, None, 5), (None, None, 3))
    with pytest.raises(ValueError, match=re.escape(
            "from_keras: the output width (5) must equal num_heads * head size (2 * 4 = 8)")):
        keras_convert.from_keras(narrow)
    with pytest.raises(TypeError, match=re.escape("from_keras: expected a keras.layers.MultiHeadAttention")):
        keras_convert.from_keras(keras.layers.Dense(2))


# -- flax.linen.MultiHeadDotProductAttention -------------------------------------------------

#: (query width, qkv_features, use_bias); qkv_features None = the query's width (Flax's default).
FLAX_VARIANTS = {"default_width_bias": (h, None, True), "default_width_nobias": (h, None, False),
                 "narrow_query_bias": (5, h, True), "narrow_query_nobias": (5, h, False)}


def flax_native(variant: str, seed: int = 0) -> tuple[Any, Any]:
    q_in, features, bias = FLAX_VARIANTS[variant]
    module = nn.MultiHeadDotProductAttention(num_heads=H, qkv_features=features,
                                             out_features=features, use_bias=bias)
    xs = inputs(0, q_in, 6, 3)
    variables = module.init(jax.random.key(seed), *xs)
    rng = np.random.default_rng(seed)
    variables = jax.tree_util.tree_map(lambda a: jnp.asarray(rng.normal(0, 0.4, a.shape), a.dtype),
                                       variables)
    return module, variables


def flax_run(module: Any, variables: Any, xs: list[np.ndarray], kind: str) -> tuple[np.ndarray, np.ndarray]:
    """Flax's output and sown weights; masks (B, 1, Q, K), True = may attend."""
    mask: Any = None
    if kind == "valid_lens":
        mask = (np.arange(T)[None, :] < LENS[:, None])[:, None, None, :]
    elif kind == "causal":
        mask = nn.make_causal_mask(jnp.ones((B, T)))
    elif kind == "boolean":
        mask = boolean_mask()[None, None]
    out, state = module.apply(variables, *xs, mask=mask, sow_weights=True, mutable=["intermediates"])
    (attn,) = jax.tree_util.tree_leaves(state["intermediates"])
    return np.asarray(out), np.asarray(attn)


@needs_jax
@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("variant", list(FLAX_VARIANTS))
def test_flax_native_to_ours(variant: str, kind: str) -> None:
    module, variables = flax_native(variant)
    xs = inputs(1, FLAX_VARIANTS[variant][0], 6, 3)
    expected, expected_attn = flax_run(module, variables, xs, kind)
    weights = flax_convert.from_flax(variables, module)
    config = flax_convert.flax_config(variables, module)
    assert config == {"num_hiddens": h, "num_heads": H, "dropout": 0.0,
                      "bias": FLAX_VARIANTS[variant][2]}
    ours = numpy_mha(weights)
    check(ours(*xs, **our_call(kind)), expected, "numpy layer")
    check(ours.attention_weights, expected_attn, "numpy layer, attention weights")
    mine = jax_layers.MultiHeadAttention(**config)
    mine_vars = jax_layers.init_from_weights(mine, weights)
    check(mine.apply(mine_vars, *xs, **our_call(kind)), expected, "Flax layer of this library")


@needs_jax
@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("variant", list(FLAX_VARIANTS))
def test_ours_to_flax_native(variant: str, kind: str) -> None:
    q_in, _, bias = FLAX_VARIANTS[variant]
    weights = canonical(2, q_in, 6, 3, bias)
    xs = inputs(3, q_in, 6, 3)
    module, variables = flax_convert.to_flax(weights, H)
    ours = numpy_mha(weights)
    expected = ours(*xs, **our_call(kind))
    out, attn = flax_run(module, variables, xs, kind)
    check(out, expected, "to_flax module")
    check(attn, ours.attention_weights, "to_flax module, attention weights")
    back = flax_convert.from_flax(variables["params"])
    for name, value in weights.items():
        np.testing.assert_array_equal(back[name], value)
    assert C.native_config(variables) == {"num_hiddens": h, "num_heads": H, "dropout": 0.0, "bias": bias}


@needs_jax
def test_flax_trained_params_convert() -> None:
    """Params after real SGD steps (jax.grad) still convert exactly."""
    module, variables = flax_native("narrow_query_bias")
    xs = inputs(5, 5, 6, 3)
    target = np.random.default_rng(6).standard_normal((B, T, h)).astype(np.float32)

    def loss(v: Any) -> Any:
        return jnp.mean((module.apply(v, *xs) - target) ** 2)

    losses = []
    for _ in range(4):
        value, grads = jax.value_and_grad(loss)(variables)
        variables = jax.tree_util.tree_map(lambda p, g: p - 0.2 * g, variables, grads)
        losses.append(float(value))
    assert losses[-1] < losses[0]
    expected, _ = flax_run(module, variables, xs, "valid_lens")
    check(numpy_mha(C.from_native(variables))(*xs, LENS), expected, "numpy layer after training")


@needs_jax
def test_flax_errors() -> None:
    module, variables = flax_native("default_width_bias")
    with pytest.raises(TypeError, match="from_flax: a Flax module holds no weights"):
        flax_convert.from_flax(module)
    with pytest.raises(ValueError, match="from_flax: normalize_qk is not supported"):
        flax_convert.from_flax(variables, nn.MultiHeadDotProductAttention(num_heads=H, normalize_qk=True))
    wide = nn.MultiHeadDotProductAttention(num_heads=H, qkv_features=h, out_features=6)
    wide_vars = wide.init(jax.random.key(0), *inputs(0, h, 6, 3))
    with pytest.raises(ValueError, match=re.escape(
            "from_flax: the output width (6) must equal num_heads * head size (2 * 4 = 8)")):
        flax_convert.from_flax(wide_vars, wide)


# -- every native parameter counts, and what a converter returns is a copy -------------------
#
# A converter that drops a weight gives a silent wrong answer only when that weight is not
# zero: these tests add an offset to each parameter of the source in turn (in place), and the
# converted layer must move exactly as the source does. The source's earlier conversion must
# not move at all: it is a copy. Then each parameter is removed in turn (set to None, or made
# zero-size): the converter must represent what is left exactly or refuse it by name.

#: A key bias adds the same amount to every score of a query, which softmax ignores: offsets
#: on these names leave every output as it was, in each framework alike.
KEY_BIASES = ("W_k.bias", "key/bias", "key.bias", "key_dense.bias")


def offset(shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(0.0, 0.5, shape).astype(np.float32)


def assert_follows(source: Any, convert: Any, run: Any, bumps: dict[str, Any]) -> None:
    """Adds an offset to each parameter of the source in turn, in place.

    Args:
        source: ``() -> output`` of the source layer (native, or this library's).
        convert: ``() -> converted`` (canonical weights, or a native layer).
        run: ``(converted) -> output``, on the same inputs.
        bumps: Parameter name -> ``()`` adding an offset to it in place.
    """
    first = convert()
    before = run(first)
    new = source()
    check(before, new, "as converted")
    for name, bump in bumps.items():
        old = new
        bump()
        new = source()
        if not name.endswith(KEY_BIASES):
            assert max_diff(new, old) > 1e-3, f"{name}: the offset moved nothing"
        np.testing.assert_array_equal(run(first), before,
                                      err_msg=f"{name}: the earlier conversion shares its memory")
        check(run(convert()), new, f"converted after an offset on {name}")


def assert_exact_or_refused(where: str, source: Any, convert_and_run: Any, what: str) -> None:
    """The converter represents the source exactly, or refuses it with its own message."""
    try:
        got = convert_and_run()
    except (ValueError, TypeError) as err:
        assert str(err).startswith(f"{where}: "), f"{what}: {type(err).__name__}: {err}"
        return
    check(got, source(), f"{what}: converted")


def assert_each_refused(where: str, weights: dict[str, np.ndarray], convert: Any) -> None:
    """Canonical weights without any one of them are refused by name (none is optional)."""
    for name in weights:
        with pytest.raises(ValueError, match=f"^{re.escape(where)}: "):
            convert({k: v for k, v in weights.items() if k != name})


def torch_bumps(module: Any) -> dict[str, Any]:
    def bump(param: Any, seed: int) -> None:
        with torch.no_grad():
            param.add_(torch.from_numpy(offset(tuple(param.shape), seed)))

    return {name: (lambda p=p, i=i: bump(p, i))
            for i, (name, p) in enumerate(module.named_parameters())}


def array_bumps(arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    """Offsets added in place to NumPy arrays (canonical weights, or Flax leaves)."""
    def bump(name: str, seed: int) -> None:
        arrays[name] += offset(arrays[name].shape, seed)

    return {name: (lambda n=name, i=i: bump(n, i)) for i, name in enumerate(arrays)}


def torch_removals(make: Any) -> dict[str, Any]:
    """Name -> a fresh module from ``make()`` with that parameter set to None or zero-size."""
    def removed(name: str, empty: bool) -> Any:
        module = make()
        owner, _, leaf = name.rpartition(".")
        parent = module.get_submodule(owner)
        setattr(parent, leaf, torch.nn.Parameter(torch.zeros(0)) if empty else None)
        return module

    names = [name for name, _ in make().named_parameters()]
    return {f"{name} {how}": (lambda n=name, e=empty: removed(n, e))
            for name in names for how, empty in (("None", False), ("zero-size", True))}


@needs_torch
@pytest.mark.parametrize("variant", ["stacked_bias", "separate_bias", "separate_nobias"])
def test_torch_mha_converters_follow_every_parameter(variant: str) -> None:
    """from_torch: an offset on each torch parameter moves our layer alike; to_torch: an
    offset on each canonical weight moves torch's module alike, each one removed is refused."""
    module = torch_native(variant)
    xs = inputs(1, h, module.kdim, module.vdim)
    assert_follows(lambda: torch_run(module, xs, "valid_lens")[0],
                   lambda: torch_convert.from_torch(module),
                   lambda weights: numpy_mha(weights)(*xs, LENS), torch_bumps(module))
    weights = torch_convert.from_torch(torch_native(variant, seed=2))
    assert_follows(lambda: numpy_mha(weights)(*xs, LENS),
                   lambda: torch_convert.to_torch(weights, H, batch_first=module.batch_first),
                   lambda native: torch_run(native.eval(), xs, "valid_lens")[0],
                   array_bumps(weights))
    assert_each_refused("to_torch", weights, lambda w: torch_convert.to_torch(w, H))


def _from_torch_run(module: Any, xs: list[np.ndarray]) -> np.ndarray:
    config = torch_convert.torch_config(module)
    weights = torch_convert.from_torch(module)
    assert config["bias"] == ("W_q.bias" in weights)
    return numpy_mha(weights)(*xs, LENS)


@needs_torch
@pytest.mark.parametrize("variant", ["stacked_bias", "separate_bias"])
def test_from_torch_refuses_what_it_cannot_represent(variant: str) -> None:
    """Each parameter set to None or made zero-size: exact, or refused by name (a bias on
    the input projections or the output one only is refused: biases are on all four or
    none here); the module is left as it was."""
    xs = inputs(1, h, *(d or h for d in TORCH_VARIANTS[variant][:2]))
    for what, make in torch_removals(lambda: torch_native(variant)).items():
        module = make()
        before = {k: v.clone() for k, v in module.state_dict().items()}
        assert_exact_or_refused("torch_config", lambda m=module: torch_run(m, xs, "valid_lens")[0],
                                lambda m=module: _from_torch_run(m, xs), what)
        after = module.state_dict()
        assert all(torch.equal(after[k], v) for k, v in before.items()), what
    partial = torch_native(variant)
    partial.in_proj_bias = None
    with pytest.raises(ValueError, match=re.escape(
            "from_torch: biases on ['out_proj.bias'] only, none on ['in_proj_bias']; this "
            "library's MultiHeadAttention has biases on all four projections or none")):
        torch_convert.from_torch(partial)


def torch_encoder_run(layer: Any, X: np.ndarray) -> np.ndarray:
    padded = torch.from_numpy(np.arange(T)[None, :] >= LENS[:, None])
    with torch.no_grad():
        return layer(torch.from_numpy(X), src_key_padding_mask=padded).numpy()


def torch_decoder_layer(seed: int = 0) -> Any:
    """A batch-first torch decoder layer with every parameter random (biases, norms too)."""
    layer = torch.nn.TransformerDecoderLayer(h, H, FFN, 0.0, batch_first=True)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in layer.parameters():
            param.add_(0.3 * torch.randn(param.shape, generator=generator))
    return layer.eval()


def torch_decoder_run(layer: Any, X: np.ndarray, memory: np.ndarray) -> np.ndarray:
    causal = torch.ones(T, T, dtype=torch.bool).triu(1)
    with torch.no_grad():
        return layer(torch.from_numpy(X), torch.from_numpy(memory), tgt_mask=causal).numpy()


#: torch's Transformer layers: (make, run the native layer on X and memory, the converter,
#: its config function, run the canonical weights on NumPy).
TORCH_LAYERS: dict[str, Any] = {
    "encoder": (lambda: torch_encoder_layer(),
                lambda layer, X, memory: torch_encoder_run(layer, X),
                "from_torch_encoder_layer", "encoder_layer_config",
                lambda w, X, memory: ac.transformer_encoder_block(X, w, H, LENS)),
    "decoder": (lambda: torch_decoder_layer(),
                torch_decoder_run, "from_torch_decoder_layer", "decoder_layer_config",
                lambda w, X, memory: ac.transformer_decoder_block(X, w, H, memory)),
}


def _read_torch_layer(layer: Any, where: str, X: np.ndarray, memory: np.ndarray) -> np.ndarray:
    """The output of what ``where`` (a reader or a config function) accepts of ``layer``."""
    _, _, reader, config, run_ours = TORCH_LAYERS["decoder" if "decoder" in where else "encoder"]
    if where == config:
        getattr(torch_convert, config)(layer)
    return np.asarray(run_ours(getattr(torch_convert, reader)(layer), X, memory))


@needs_torch
@pytest.mark.parametrize("kind", list(TORCH_LAYERS))
def test_torch_layer_converters_follow_every_parameter(kind: str) -> None:
    """torch's Transformer layers -> canonical weights -> back: an offset on each parameter
    (attention, FFN, layer norms) moves both sides alike; each one removed is refused."""
    make, run_native, reader, config, run_ours = TORCH_LAYERS[kind]
    convert = getattr(torch_convert, reader)
    X, memory = inputs(4, h, h, h)[:2]
    native = make()
    assert_follows(lambda: run_native(native, X, memory), lambda: convert(native),
                   lambda w: run_ours(w, X, memory), torch_bumps(native))
    for what, fresh in torch_removals(make).items():
        layer = fresh()
        for where in (reader, config):
            assert_exact_or_refused(where, lambda m=layer: run_native(m, X, memory),
                                    lambda m=layer, w=where: _read_torch_layer(m, w, X, memory),
                                    what)
    # the other way: canonical weights -> torch's layer, each weight moved, each removed
    weights = {k: np.array(v) for k, v in convert(make()).items()}
    writer = getattr(torch_convert, reader.replace("from_", "to_"))
    assert_follows(lambda: np.asarray(run_ours(weights, X, memory)),
                   lambda: writer(weights, H).eval(), lambda m: run_native(m, X, memory),
                   array_bumps(weights))
    assert_each_refused(writer.__name__, weights, lambda w: writer(w, H))


def keras_bumps(layer: Any) -> dict[str, Any]:
    def bump(variable: Any, seed: int) -> None:
        variable.assign(np.asarray(variable.numpy()) + offset(tuple(variable.shape), seed))

    return {v.path: (lambda v=v, i=i: bump(v, i)) for i, v in enumerate(layer.weights)}


def keras_removals(make: Any) -> dict[str, Any]:
    """Sublayer attribute -> a fresh layer from ``make()`` with that bias, scale or offset
    set to None (Keras' Dense, EinsumDense and LayerNormalization then compute without it)."""
    def removed(index: int, attr: str) -> Any:
        layer = make()
        setattr(list(layer._flatten_layers(include_self=False))[index], attr, None)
        return layer

    subs = list(make()._flatten_layers(include_self=False))
    return {f"{sub.name}.{attr}": (lambda i=i, a=attr: removed(i, a))
            for i, sub in enumerate(subs) for attr in ("bias", "gamma", "beta")
            if getattr(sub, attr, None) is not None}


def keras_lora(seed: int = 0) -> Any:
    """A Keras MultiHeadAttention whose four projections have LoRA kernels (random)."""
    layer = keras_native("square_bias", seed)
    rng = np.random.default_rng(seed + 100)
    for name in ("query", "key", "value", "output"):
        dense = getattr(layer, f"_{name}_dense")
        dense.enable_lora(2)
        for v in (dense.lora_kernel_a, dense.lora_kernel_b):
            v.assign(rng.normal(0, 0.3, tuple(v.shape)).astype(np.float32))
    return layer


KERAS_MAKERS: dict[str, Any] = {"square_bias": lambda seed=0: keras_native("square_bias", seed),
                                "narrow_query_nobias": lambda seed=0: keras_native(
                                    "narrow_query_nobias", seed),
                                "lora": keras_lora}


@needs_tf
@pytest.mark.parametrize("variant", list(KERAS_MAKERS))
def test_keras_mha_converters_follow_every_parameter(variant: str) -> None:
    """from_keras: an offset on each Keras variable (LoRA kernels too) moves our layer alike,
    each bias removed is represented or refused; to_keras: an offset on each canonical weight
    moves Keras' layer alike, each one removed is refused."""
    make = KERAS_MAKERS[variant]
    layer = make()
    q_in = int(layer._query_dense.kernel.shape[0])
    xs = inputs(1, q_in, 6, 3)
    assert_follows(lambda: keras_run(layer, xs, "valid_lens")[0],
                   lambda: keras_convert.from_keras(layer),
                   lambda weights: numpy_mha(weights)(*xs, LENS), keras_bumps(layer))
    for what, fresh in keras_removals(make).items():
        native = fresh()
        for where in ("from_keras", "keras_config"):
            assert_exact_or_refused(
                where, lambda n=native: keras_run(n, xs, "valid_lens")[0],
                lambda n=native, w=where: numpy_mha(keras_convert.from_keras(n))(*xs, LENS)
                if getattr(keras_convert, w)(n) else None, what)
    weights = keras_convert.from_keras(make(seed=2))
    assert_follows(lambda: numpy_mha(weights)(*xs, LENS), lambda: keras_convert.to_keras(weights, H),
                   lambda native: keras_run(native, xs, "valid_lens")[0], array_bumps(weights))
    assert_each_refused("to_keras", weights, lambda w: keras_convert.to_keras(w, H))


@needs_tf
def test_from_keras_refuses_partial_biases_and_quantized_projections() -> None:
    layer = keras_native("square_bias")
    layer._output_dense.bias = None
    with pytest.raises(ValueError, match=re.escape(
            "from_keras: biases on ['query.bias', 'key.bias', 'value.bias'] only, none on "
            "['out.bias']; this library's MultiHeadAttention has biases on all four "
            "projections or none")):
        keras_convert.from_keras(layer)
    quantized = keras_native("square_bias")
    quantized._value_dense.quantize("int8")
    with pytest.raises(ValueError, match=re.escape(
            "keras_config: value is quantized (int8): this library's weights are floating point; "
            "convert the layer before quantizing it")):
        keras_convert.keras_config(quantized)


def flax_leaves(variables: Any) -> dict[str, np.ndarray]:
    """Writable NumPy copies of Flax params, by dotted name (Flax applies NumPy params too)."""
    return {name: np.array(value) for name, value in W.flatten_tree(variables["params"]).items()}


def flax_variables(leaves: dict[str, np.ndarray]) -> dict[str, Any]:
    """``{"params": ...}`` nested from dotted names, holding the same arrays."""
    params: dict[str, dict[str, np.ndarray]] = {}
    for name, value in leaves.items():
        part, _, leaf = name.partition(".")
        params.setdefault(part, {})[leaf] = value
    return {"params": params}


@needs_jax
@pytest.mark.parametrize("variant", ["default_width_bias", "narrow_query_nobias"])
def test_flax_converters_follow_every_parameter(variant: str) -> None:
    """from_flax: an offset on each Flax param moves our layer alike (params held as NumPy
    arrays, offset in place: what was converted before must not move); each one removed, or
    the module's biases switched off, is refused; to_flax: an offset on each canonical weight
    moves Flax's module alike (the variables it returned are copies), each one removed is
    refused."""
    module, variables = flax_native(variant)
    xs = inputs(1, FLAX_VARIANTS[variant][0], 6, 3)
    leaves = flax_leaves(variables)
    native = flax_variables(leaves)  # shares the leaves: offsets in place reach it
    assert_follows(lambda: flax_run(module, native, xs, "valid_lens")[0],
                   lambda: flax_convert.from_flax(native, module),
                   lambda weights: numpy_mha(weights)(*xs, LENS), array_bumps(leaves))
    for name in leaves:
        fewer = flax_variables({k: v for k, v in leaves.items() if k != name})
        for where in ("from_flax", "flax_config"):
            with pytest.raises(ValueError, match=f"^{where}: "):
                getattr(flax_convert, where)(fewer, module)
    other = module.clone(use_bias=not module.use_bias)
    for where in ("from_flax", "flax_config"):
        with pytest.raises(ValueError, match=re.escape(
                f"{where}: the params are those of {H} heads "
                f"{'with' if module.use_bias else 'without'} biases, but the module has "
                f"num_heads={H}, use_bias={not module.use_bias}: pass the module that made them")):
            getattr(flax_convert, where)(variables, other)
    weights = flax_convert.from_flax(flax_native(variant, seed=2)[1])
    assert_follows(lambda: numpy_mha(weights)(*xs, LENS), lambda: flax_convert.to_flax(weights, H),
                   lambda made: flax_run(*made, xs, "valid_lens")[0], array_bumps(weights))
    assert_each_refused("to_flax", weights, lambda w: flax_convert.to_flax(w, H))
