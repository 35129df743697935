"""The bad-input catalogue: one exception type and one message on every backend, no state change.

:data:`CATALOGUE` is the one table. Each row makes one bad call (a functional call, a
constructor, a layer call, ``set_weights``/``load_weights``, a backend lookup) and names the
exception type and the exact message every backend must raise. A row that involves a layer
builds it first (``layer``); the layer's state (its canonical weights, or the error saying it
has none yet, and the attention weights its last call kept) must be the same after the error.

Each backend env records how many rows it ran and passed in its ``<backend>.json`` report
(key ``"bad_input"``, see :func:`tests.report.count`).
"""

from __future__ import annotations

import importlib.util
import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import attention_core as ac
from attention_core import registry
from attention_core import weights as W
from tests import report
from tests.harness import Harness

R = np.random.default_rng(0)
F32 = "float32"
FLOATS = "(float16, bfloat16, float32, float64)"
BACKENDS = "numpy, torch, tensorflow, jax, mxnet"
ALIASES = "pytorch->torch, tf->tensorflow, keras->tensorflow, flax->jax, gluon->mxnet"
MHA_NAMES = "['W_k.kernel', 'W_o.kernel', 'W_q.kernel', 'W_v.kernel']"


def arr(shape: tuple[int, ...], dtype: str = F32) -> np.ndarray:
    """Random data of a shape and dtype (complex ones get an imaginary part too)."""
    x = R.standard_normal(shape)
    if dtype.startswith("complex"):
        x = x + 1j * R.standard_normal(shape)
    return x.astype(dtype)


def qkv(q: tuple[int, ...] = (2, 4, 8), k: tuple[int, ...] = (2, 6, 8),
        v: tuple[int, ...] = (2, 6, 5), dtypes: tuple[str, ...] = (F32, F32, F32)) -> list[np.ndarray]:
    return [arr(s, d) for s, d in zip((q, k, v), dtypes, strict=True)]


def backend_kwargs(h: Harness, kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: (h.array(v) if isinstance(v, np.ndarray) else v) for k, v in kwargs.items()}


def dpa(h: Harness, arrays: list[np.ndarray], **kwargs: Any) -> Any:
    return ac.dot_product_attention(*(h.array(a) for a in arrays), **backend_kwargs(h, kwargs))


def encode(h: Harness, tokens: np.ndarray) -> Any:
    """The functional encoder (vocabulary of 11, one block) on ``tokens``."""
    spec = W.transformer_encoder_spec(11, 12, 16, 3, 1)
    weights = {k: h.array(v) for k, v in W.init_weights(spec, R).items()}
    return ac.transformer_encoder(h.array(tokens), weights, 3)


# -- the layers rows act on: made, and called once with good input where ``built`` ----------


def call(h: Harness, layer: Any, *arrays: np.ndarray, **kwargs: Any) -> Any:
    return h.call(layer, *(h.array(a) for a in arrays), **backend_kwargs(h, kwargs))


def mha(h: Harness, built: bool = True) -> Any:
    layer = h.make("MultiHeadAttention", {"num_hiddens": 8, "num_heads": 2})
    if built:
        call(h, layer, *qkv())
    return layer


def fresh_mha(h: Harness) -> Any:
    return mha(h, built=False)


def dot(h: Harness) -> Any:
    layer = h.make("DotProductAttention", {})
    call(h, layer, *qkv())
    return layer


def additive(h: Harness) -> Any:
    layer = h.make("AdditiveAttention", {"num_hiddens": 6})
    call(h, layer, *qkv(q=(2, 4, 3)))
    return layer


def relative(h: Harness) -> Any:
    layer = h.make("RelativeMultiHeadAttention",
                   {"num_hiddens": 12, "num_heads": 3, "max_relative_position": 2})
    x = arr((2, 4, 12))
    call(h, layer, x, x, x)
    return layer


def block(h: Harness) -> Any:
    layer = h.make("TransformerEncoderBlock", {"num_hiddens": 12, "ffn_num_hiddens": 16, "num_heads": 3})
    call(h, layer, arr((2, 5, 12)), np.array([5, 3]))
    return layer


def encoder(h: Harness) -> Any:
    layer = h.make("TransformerEncoder", {"vocab_size": 11, "num_hiddens": 12, "ffn_num_hiddens": 16,
                                          "num_heads": 3, "num_blks": 2})
    call(h, layer, np.array([[1, 2, 3, 4, 5], [6, 7, 8, 0, 0]]), np.array([5, 3]))
    return layer


def short_encoder(h: Harness) -> Any:
    """An encoder whose sinusoidal table has 5 rows (``max_len=5``), called once."""
    layer = h.make("TransformerEncoder", {"vocab_size": 11, "num_hiddens": 12, "ffn_num_hiddens": 16,
                                          "num_heads": 3, "num_blks": 1, "max_len": 5})
    call(h, layer, np.array([[1, 2, 3, 4, 5], [6, 7, 8, 0, 0]]))
    return layer


def positional(h: Harness) -> Any:
    layer = h.make("PositionalEncoding", {"num_hiddens": 4, "max_len": 5})
    call(h, layer, arr((1, 5, 4)))
    return layer


def add_norm(h: Harness) -> Any:
    layer = h.make("AddNorm", {"num_hiddens": 8})
    call(h, layer, arr((2, 3, 8)), arr((2, 3, 8)))
    return layer


def ffn(h: Harness) -> Any:
    layer = h.make("PositionWiseFFN", {"ffn_num_hiddens": 6, "ffn_num_outputs": 4})
    call(h, layer, arr((2, 3, 5)))
    return layer


def nadaraya(h: Harness) -> Any:
    layer = h.make("NadarayaWatson", {"parametric": True})
    call(h, layer, arr((2, 3)), arr((2, 5)), arr((2, 5)))
    return layer


# -- safetensors files ------------------------------------------------------------------------


def good_file(path: Path, **changes: np.ndarray) -> Path:
    """A well-formed file of a MultiHeadAttention(8, 2) built on queries/keys of width 8 and
    values of width 5, with ``changes`` replacing or adding tensors."""
    tensors = {"W_q.kernel": arr((8, 8)), "W_k.kernel": arr((8, 8)), "W_v.kernel": arr((5, 8)),
               "W_o.kernel": arr((8, 8))}
    W.write_safetensors(path, {**tensors, **changes})
    return path


def raw_file(path: Path, header: bytes | object, body: bytes = b"") -> Path:
    """A file of an 8-byte little-endian header length, the header (JSON-encoded unless bytes)
    and ``body``, written here byte by byte (not by the library)."""
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + body)
    return path


def entry(dtype: str, shape: list[int], start: int, end: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [start, end]}


def truncated(path: Path) -> Path:
    good_file(path)
    path.write_bytes(path.read_bytes()[:-10])
    return path


PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR"


# -- the catalogue ----------------------------------------------------------------------------


@dataclass
class Ctx:
    """What a row's call gets: the backend, the layer it set up, a directory, monkeypatch."""

    h: Harness
    layer: Any
    tmp: Path
    monkeypatch: pytest.MonkeyPatch

    def file(self, name: str = "w.safetensors") -> Path:
        return self.tmp / name


@dataclass(frozen=True)
class Bad:
    """One bad call: ``act(ctx)`` must raise ``exc`` with exactly ``message``.

    ``message`` may hold ``{path}``: the repr of ``ctx.file()``. ``layer(h)`` makes the layer
    whose state must not change (None: no layer involved). ``without`` names the backends the
    bad input cannot even be made on, as ``(backend, reason)`` pairs.
    """

    name: str
    category: str
    act: Callable[[Ctx], Any]
    exc: type[Exception]
    message: str
    layer: Callable[[Harness], Any] | None = None
    without: tuple[tuple[str, str], ...] = ()


#: MXNet has no complex dtype: ``mx.np.array`` refuses complex data (KeyError), ``mx.nd.array``
#: drops the imaginary part, so no complex array can reach the library there.
NO_COMPLEX = (("mxnet", "MXNet has no complex dtype: no complex array can be made"),)


def mask_message(shape: str, got: str) -> str:
    return ("mask must have shape (Q, K), (B, Q, K) or (B, H, Q, K), broadcastable to (B, H, Q, K) "
            f"= {shape}, got {got}")


def unknown_backend(name: str) -> str:
    return f"unknown backend {name!r}; expected one of {BACKENDS} (aliases: {ALIASES})"


def hide_torch(c: Ctx) -> None:
    """Makes torch look uninstalled to the registry, whichever env runs."""
    real = importlib.util.find_spec
    c.monkeypatch.setattr(importlib.util, "find_spec",
                          lambda name, *a: None if name.partition(".")[0] == "torch" else real(name, *a))


def env_backend(c: Ctx, value: str) -> str:
    c.monkeypatch.setattr(registry, "_process_default", None)
    c.monkeypatch.setenv(registry.ENV_VAR, value)
    return registry.backend()


def use(name: Any) -> None:
    with ac.use_backend(name):
        pass


def not_valid(why: str) -> str:
    return f"load_weights: {{path}} is not a valid safetensors file: {why}"


def does_not_fit(why: str) -> str:
    return f"load_weights: {{path}} does not fit the layer: set_weights: {why}"


def load(c: Ctx, make: Callable[[Path], Path]) -> Any:
    return ac.load_weights(make(c.file()), c.layer)


CATALOGUE: list[Bad] = [
    # -- ranks
    Bad("queries_rank", "rank", lambda c: dpa(c.h, qkv(q=(4, 8))), ValueError,
        "queries must have shape (B, Q, D) or (B, H, Q, D), got (4, 8)"),
    Bad("keys_rank", "rank", lambda c: dpa(c.h, qkv(k=(2, 1, 6, 8))), ValueError,
        "keys must have shape (B, K, D) or (B, H, K, D) like queries, got (2, 1, 6, 8)"),
    Bad("masked_softmax_rank", "rank", lambda c: ac.masked_softmax(c.h.array(arr((3, 4)))),
        ValueError, "scores must have shape (B, Q, K) or (B, H, Q, K), got (3, 4)"),
    Bad("layer_queries_rank", "rank", lambda c: call(c.h, c.layer, *qkv(q=(4, 8))), ValueError,
        "queries must have shape (B, Q, Dq), got (4, 8)", mha),
    Bad("layer_positional_rank", "rank", lambda c: call(c.h, c.layer, arr((5, 4))), ValueError,
        "X must have shape (B, T, num_hiddens), got (5, 4)", positional),
    Bad("layer_nadaraya_rank", "rank", lambda c: call(c.h, c.layer, arr((2, 3)), arr((5,)), arr((5,))),
        ValueError, "keys must have shape (B, K) or (K,) like queries, got (5,)", nadaraya),
    # -- depth, length, batch and width mismatches
    Bad("depth_mismatch", "mismatch", lambda c: dpa(c.h, qkv(k=(2, 6, 7))), ValueError,
        "queries depth (8) must equal keys depth (7)"),
    Bad("length_mismatch", "mismatch", lambda c: dpa(c.h, qkv(v=(2, 5, 5))), ValueError,
        "keys and values must have the same length, got 6 keys and 5 values"),
    Bad("batch_mismatch", "mismatch", lambda c: dpa(c.h, qkv(k=(3, 6, 8), v=(3, 6, 5))), ValueError,
        "keys batch size (3) must equal queries batch size (2)"),
    Bad("heads_size_mismatch", "mismatch",
        lambda c: dpa(c.h, qkv(q=(2, 2, 4, 8), k=(2, 3, 6, 8), v=(2, 3, 6, 5))), ValueError,
        "keys heads size (3) must equal queries heads size (2)"),
    Bad("layer_length_mismatch", "mismatch", lambda c: call(c.h, c.layer, *qkv(v=(2, 5, 5))),
        ValueError, "keys and values must have the same length, got 6 keys and 5 values", mha),
    Bad("layer_other_width", "mismatch", lambda c: call(c.h, c.layer, *qkv(q=(2, 4, 5))), ValueError,
        "queries last dimension (5) must be 8, the size this layer was built for", mha),
    Bad("layer_block_width", "mismatch", lambda c: call(c.h, c.layer, arr((2, 5, 8))), ValueError,
        "X last dimension (8) must be 12", block),
    Bad("layer_add_norm_shapes", "mismatch",
        lambda c: call(c.h, c.layer, arr((2, 3, 8)), arr((2, 4, 8))), ValueError,
        "X and Y must have the same shape, got (2, 3, 8) and (2, 4, 8)", add_norm),
    Bad("layer_positional_width", "mismatch", lambda c: call(c.h, c.layer, arr((1, 2, 3))), ValueError,
        "X last dimension (3) must be num_hiddens (4)", positional),
    Bad("layer_positional_too_long", "mismatch", lambda c: call(c.h, c.layer, arr((1, 6, 4))),
        ValueError, "X has 6 positions, more than max_len (5)", positional),
    # -- heads that do not divide the width, and other constructor sizes
    Bad("heads_not_dividing", "heads", lambda c: c.h.module.MultiHeadAttention(100, 3), ValueError,
        "num_hiddens (100) must be divisible by num_heads (3)"),
    Bad("relative_heads_not_dividing", "heads",
        lambda c: c.h.module.RelativeMultiHeadAttention(12, 5, 2), ValueError,
        "num_hiddens (12) must be divisible by num_heads (5)"),
    Bad("block_heads_not_dividing", "heads", lambda c: c.h.module.TransformerEncoderBlock(12, 16, 5),
        ValueError, "num_hiddens (12) must be divisible by num_heads (5)"),
    Bad("functional_heads_not_dividing", "heads",
        lambda c: ac.multi_head_attention(*(c.h.array(a) for a in qkv()),
                                          {"W_q.kernel": c.h.array(arr((8, 9)))}, 2),
        ValueError, "num_hiddens (9) must be divisible by num_heads (2)"),
    Bad("zero_heads", "heads", lambda c: c.h.module.MultiHeadAttention(8, 0), ValueError,
        "num_heads must be a positive int, got 0"),
    Bad("zero_hiddens", "sizes", lambda c: c.h.module.AdditiveAttention(0), ValueError,
        "num_hiddens must be a positive int, got 0"),
    Bad("relative_zero_offsets", "sizes", lambda c: c.h.module.RelativeMultiHeadAttention(12, 3, 0),
        ValueError, "max_relative_position must be a positive int, got 0"),
    Bad("encoder_zero_blocks", "sizes", lambda c: c.h.module.TransformerEncoder(11, 12, 16, 3, 0),
        ValueError, "num_blks must be a positive int, got 0"),
    Bad("unknown_implementation", "sizes",
        lambda c: c.h.module.DotProductAttention(implementation="flash"), ValueError,
        "implementation must be None, 'direct', 'blockwise' or 'fused', got 'flash'"),
    Bad("scale_negative", "sizes", lambda c: dpa(c.h, qkv(), scale=-1.0), ValueError,
        "scale must be a positive float or None, got -1.0"),
    # -- valid_lens
    Bad("valid_lens_shape", "valid_lens", lambda c: dpa(c.h, qkv(), valid_lens=np.array([1, 2, 3])),
        ValueError, "valid_lens must have shape (B,) or (B, Q) = (2,) or (2, 4), got (3,)"),
    Bad("valid_lens_per_query_shape", "valid_lens",
        lambda c: dpa(c.h, qkv(), valid_lens=np.ones((2, 5), np.int32)), ValueError,
        "valid_lens must have shape (B,) or (B, Q) = (2,) or (2, 4), got (2, 5)"),
    Bad("valid_lens_float", "valid_lens",
        lambda c: dpa(c.h, qkv(), valid_lens=np.array([1.0, 2.0], F32)), TypeError,
        "valid_lens must have an integer dtype, got float32"),
    Bad("valid_lens_negative", "valid_lens", lambda c: dpa(c.h, qkv(), valid_lens=np.array([-1, 2])),
        ValueError, "valid_lens must be >= 0, got -1"),
    Bad("valid_lens_too_long", "valid_lens", lambda c: dpa(c.h, qkv(), valid_lens=np.array([7, 2])),
        ValueError, "valid_lens must be <= the number of keys (6), got 7"),
    Bad("layer_valid_lens_too_long", "valid_lens",
        lambda c: call(c.h, c.layer, *qkv(), np.array([7, 2])), ValueError,
        "valid_lens must be <= the number of keys (6), got 7", mha),
    Bad("layer_first_call_valid_lens", "valid_lens",
        lambda c: call(c.h, c.layer, *qkv(), np.array([9, 9])), ValueError,
        "valid_lens must be <= the number of keys (6), got 9", fresh_mha),
    Bad("layer_additive_valid_lens_negative", "valid_lens",
        lambda c: call(c.h, c.layer, *qkv(q=(2, 4, 3)), np.array([3, -4])), ValueError,
        "valid_lens must be >= 0, got -4", additive),
    Bad("layer_block_valid_lens_float", "valid_lens",
        lambda c: call(c.h, c.layer, arr((2, 5, 12)), np.array([5.0, 3.0], F32)), TypeError,
        "valid_lens must have an integer dtype, got float32", block),
    # -- masks
    Bad("mask_shape", "mask", lambda c: dpa(c.h, qkv(), mask=np.ones((3, 6), bool)), ValueError,
        mask_message("(2, 1, 4, 6)", "(3, 6)")),
    Bad("mask_heads", "mask", lambda c: dpa(c.h, qkv(), mask=np.ones((2, 3, 4, 6), bool)), ValueError,
        mask_message("(2, 1, 4, 6)", "(2, 3, 4, 6)")),
    Bad("mask_rank", "mask", lambda c: dpa(c.h, qkv(), mask=np.ones((6,), bool)), ValueError,
        mask_message("(2, 1, 4, 6)", "(6,)")),
    Bad("mask_not_bool", "mask", lambda c: dpa(c.h, qkv(), mask=np.ones((4, 6), F32)), TypeError,
        "mask must be boolean (True = may attend), got float32"),
    # host data (NumPy) is checked before it is converted: MXNet cannot hold complex numbers
    Bad("mask_complex_host", "mask",
        lambda c: ac.dot_product_attention(*(c.h.array(a) for a in qkv()),
                                           mask=np.ones((4, 6), np.complex64)), TypeError,
        "mask must be boolean (True = may attend), got complex64"),
    Bad("valid_lens_complex_host", "valid_lens",
        lambda c: ac.dot_product_attention(*(c.h.array(a) for a in qkv()),
                                           valid_lens=np.array([1, 2], np.complex64)), TypeError,
        "valid_lens must have an integer dtype, got complex64"),
    Bad("mask_integer", "mask", lambda c: dpa(c.h, qkv(), mask=np.ones((4, 6), np.int32)), TypeError,
        "mask must be boolean (True = may attend), got int32"),
    Bad("causal_not_bool", "mask", lambda c: dpa(c.h, qkv(), causal="yes"), TypeError,
        "causal must be a bool, got str"),
    Bad("layer_mask_not_bool", "mask",
        lambda c: call(c.h, c.layer, *qkv(), mask=np.ones((4, 6), F32)), TypeError,
        "mask must be boolean (True = may attend), got float32", mha),
    Bad("layer_mask_shape", "mask", lambda c: call(c.h, c.layer, *qkv(), mask=np.ones((3, 6), bool)),
        ValueError, mask_message("(2, 2, 4, 6)", "(3, 6)"), mha),
    Bad("layer_relative_mask_shape", "mask",
        lambda c: call(c.h, c.layer, *[arr((2, 4, 12))] * 3, mask=np.ones((5, 5), bool)), ValueError,
        mask_message("(2, 3, 4, 4)", "(5, 5)"), relative),
    Bad("layer_encoder_mask_not_bool", "mask",
        lambda c: call(c.h, c.layer, np.array([[1, 2, 3, 4, 5]]), mask=np.ones((5, 5), np.int32)),
        TypeError, "mask must be boolean (True = may attend), got int32", encoder),
    # -- integer and complex inputs, and dtypes that differ
    # int32: a dtype every backend has (JAX has no 64-bit types unless x64 is on)
    Bad("integer_queries", "dtype", lambda c: dpa(c.h, qkv(dtypes=("int32", F32, F32))), TypeError,
        f"queries must be floating point {FLOATS}, got int32"),
    Bad("complex_queries", "dtype", lambda c: dpa(c.h, qkv(dtypes=("complex64", F32, F32))), TypeError,
        f"queries must be real floating point {FLOATS}, got complex64: complex inputs are not "
        "supported", without=NO_COMPLEX),
    Bad("complex_keys", "dtype", lambda c: dpa(c.h, qkv(dtypes=(F32, "complex64", F32))), TypeError,
        f"keys must be real floating point {FLOATS}, got complex64: complex inputs are not "
        "supported", without=NO_COMPLEX),
    Bad("dtype_mismatch", "dtype", lambda c: dpa(c.h, qkv(dtypes=(F32, "float16", F32))), TypeError,
        "keys dtype (float16) must match queries dtype (float32)"),
    Bad("layer_integer_queries", "dtype",
        lambda c: call(c.h, c.layer, *qkv(dtypes=("int32", F32, F32))), TypeError,
        f"queries must be floating point {FLOATS}, got int32", fresh_mha),
    Bad("layer_complex_values", "dtype",
        lambda c: call(c.h, c.layer, *qkv(dtypes=(F32, F32, "complex64"))), TypeError,
        f"values must be real floating point {FLOATS}, got complex64: complex inputs are not "
        "supported", dot, NO_COMPLEX),
    Bad("layer_block_complex", "dtype", lambda c: call(c.h, c.layer, arr((2, 5, 12), "complex64")),
        TypeError, f"X must be real floating point {FLOATS}, got complex64: complex inputs are not "
        "supported", block, NO_COMPLEX),
    Bad("layer_ffn_integer", "dtype", lambda c: call(c.h, c.layer, np.ones((2, 3, 5), np.int32)),
        TypeError, f"X must be floating point {FLOATS}, got int32", ffn),
    Bad("layer_add_norm_integer", "dtype",
        lambda c: call(c.h, c.layer, np.ones((2, 3, 8), np.int32), np.ones((2, 3, 8), np.int32)),
        TypeError, f"X must be floating point {FLOATS}, got int32", add_norm),
    Bad("layer_positional_integer", "dtype", lambda c: call(c.h, c.layer, np.ones((1, 5, 4), np.int32)),
        TypeError, f"X must be floating point {FLOATS}, got int32", positional),
    Bad("list_inputs", "dtype", lambda c: ac.dot_product_attention([[[1.0]]], [[[1.0]]], [[[1.0]]]),
        TypeError, "expected an array of numpy, torch, tensorflow, jax or mxnet, got list"),
    # -- zero-length sequences and empty batches
    Bad("empty_keys", "empty", lambda c: dpa(c.h, qkv(k=(2, 0, 8), v=(2, 0, 5))), ValueError,
        "keys must not have an empty dimension, got (2, 0, 8)"),
    Bad("empty_queries", "empty", lambda c: dpa(c.h, qkv(q=(2, 0, 8))), ValueError,
        "queries must not have an empty dimension, got (2, 0, 8)"),
    Bad("empty_batch", "empty", lambda c: dpa(c.h, qkv(q=(0, 4, 8), k=(0, 6, 8), v=(0, 6, 5))),
        ValueError, "queries must not have an empty dimension, got (0, 4, 8)"),
    Bad("layer_empty_keys", "empty", lambda c: call(c.h, c.layer, *qkv(k=(2, 0, 8), v=(2, 0, 5))),
        ValueError, "keys must not have an empty dimension, got (2, 0, 8)", mha),
    Bad("layer_positional_empty", "empty", lambda c: call(c.h, c.layer, arr((1, 0, 4))), ValueError,
        "X must not have an empty dimension, got (1, 0, 4)", positional),
    Bad("layer_encoder_empty_tokens", "empty", lambda c: call(c.h, c.layer, np.zeros((2, 0), np.int32)),
        ValueError, "tokens must not have an empty dimension, got (2, 0)", encoder),
    # -- dropout outside [0, 1)
    Bad("functional_dropout", "dropout", lambda c: dpa(c.h, qkv(), dropout=1.0), ValueError,
        "dropout must be in [0, 1), got 1.0"),
    Bad("layer_dropout", "dropout", lambda c: c.h.module.DotProductAttention(dropout=1.5), ValueError,
        "dropout must be in [0, 1), got 1.5"),
    Bad("layer_dropout_negative", "dropout", lambda c: c.h.module.AddNorm(8, dropout=-0.1), ValueError,
        "dropout must be in [0, 1), got -0.1"),
    Bad("mha_dropout_one", "dropout", lambda c: c.h.module.MultiHeadAttention(8, 2, dropout=1.0),
        ValueError, "dropout must be in [0, 1), got 1.0"),
    Bad("encoder_dropout_nan", "dropout",
        lambda c: c.h.module.TransformerEncoder(11, 12, 16, 3, 1, dropout=float("nan")), ValueError,
        "dropout must be in [0, 1), got nan"),
    Bad("dropout_str", "dropout", lambda c: c.h.module.PositionalEncoding(4, dropout="0.1"), TypeError,
        "dropout must be a float in [0, 1), got str"),
    # -- token ids
    Bad("tokens_float", "tokens", lambda c: encode(c.h, np.ones((2, 5), F32)), TypeError,
        "tokens must be integer token ids, got dtype float32"),
    Bad("tokens_too_large", "tokens", lambda c: encode(c.h, np.array([[1, 2, 11], [0, 0, 0]])),
        ValueError, "tokens must be in [0, vocab_size) = [0, 11), got 11"),
    Bad("tokens_negative", "tokens", lambda c: encode(c.h, np.array([[1, -2, 3]])), ValueError,
        "tokens must be in [0, vocab_size) = [0, 11), got -2"),
    Bad("tokens_rank", "tokens", lambda c: encode(c.h, np.array([1, 2, 3])), ValueError,
        "tokens must have shape (B, T) token ids, got (3,)"),
    Bad("layer_encoder_tokens_too_large", "tokens",
        lambda c: call(c.h, c.layer, np.array([[1, 2, 30]])), ValueError,
        "tokens must be in [0, vocab_size) = [0, 11), got 30", encoder),
    # -- get_weights / set_weights
    Bad("get_weights_before_first_call", "set_weights", lambda c: c.layer.get_weights(), ValueError,
        "MultiHeadAttention: weights are created on the first call; call the layer or set_weights first",
        fresh_mha),
    Bad("set_weights_missing", "set_weights",
        lambda c: c.layer.set_weights({k: v for k, v in c.layer.get_weights().items() if k != "W_o.kernel"}),
        ValueError, f"set_weights: missing weights ['W_o.kernel'], unexpected weights []; expected "
        f"exactly {MHA_NAMES}", mha),
    Bad("set_weights_unexpected", "set_weights",
        lambda c: c.layer.set_weights({**c.layer.get_weights(), "W_x.kernel": arr((8, 8))}), ValueError,
        f"set_weights: missing weights [], unexpected weights ['W_x.kernel']; expected exactly "
        f"{MHA_NAMES}", mha),
    Bad("set_weights_shape", "set_weights",
        lambda c: c.layer.set_weights({**c.layer.get_weights(), "W_q.kernel": arr((3, 8))}), ValueError,
        "set_weights: W_q.kernel has shape (3, 8), expected (8, 8)", mha),
    Bad("set_weights_integer", "set_weights",
        lambda c: c.layer.set_weights({**c.layer.get_weights(), "W_k.kernel": np.ones((8, 8), np.int64)}),
        TypeError, "set_weights: W_k.kernel must be floating point, got int64", mha),
    Bad("set_weights_not_mapping", "set_weights",
        lambda c: c.layer.set_weights(list(c.layer.get_weights().values())), TypeError,
        "set_weights: weights must be a mapping of name -> array, got list", mha),
    Bad("set_weights_unbuilt_shape", "set_weights",
        lambda c: c.layer.set_weights({"W_q.kernel": arr((3, 8)), "W_k.kernel": arr((4, 8)),
                                       "W_v.kernel": arr((5, 8)), "W_o.kernel": arr((8, 7))}),
        ValueError, "set_weights: W_o.kernel has shape (8, 7), expected (8, 8)", fresh_mha),
    # -- load_weights: files that do not fit the layer, and files that are not safetensors
    Bad("load_other_names", "load_weights",
        lambda c: load(c, lambda p: raw_file(p, {"embeddings.weight": entry("F32", [2], 0, 8)}, bytes(8))),
        ValueError, does_not_fit(f"missing weights {MHA_NAMES}, unexpected weights "
                                 "['embeddings.weight']; expected exactly " + MHA_NAMES), mha),
    Bad("load_wrong_shape", "load_weights",
        lambda c: load(c, lambda p: good_file(p, **{"W_q.kernel": arr((3, 8))})), ValueError,
        does_not_fit("W_q.kernel has shape (3, 8), expected (8, 8)"), mha),
    Bad("load_integer", "load_weights",
        lambda c: load(c, lambda p: good_file(p, **{"W_k.kernel": np.ones((8, 8), np.int32)})),
        TypeError, does_not_fit("W_k.kernel must be floating point, got int32"), mha),
    Bad("load_truncated", "load_weights", lambda c: load(c, truncated), ValueError,
        not_valid("data of 'W_v.kernel' is truncated or misplaced"), mha),
    Bad("load_too_short", "load_weights", lambda c: load(c, lambda p: (p.write_bytes(b"\x08\x00\x00"), p)[1]),
        ValueError, not_valid("only 3 bytes"), mha),
    Bad("load_header_past_end", "load_weights",
        lambda c: load(c, lambda p: (p.write_bytes(struct.pack("<Q", 100) + b"{}"), p)[1]), ValueError,
        not_valid("header of 100 bytes runs past the end of the file"), mha),
    Bad("load_png", "load_weights", lambda c: load(c, lambda p: (p.write_bytes(PNG), p)[1]), ValueError,
        not_valid(f"header of {int.from_bytes(PNG[:8], 'little')} bytes runs past the end of the file"),
        mha),
    Bad("load_header_not_json", "load_weights",
        lambda c: load(c, lambda p: raw_file(p, b"\xff\xfe{not json")), ValueError,
        not_valid("header is not JSON"), mha),
    Bad("load_header_not_object", "load_weights", lambda c: load(c, lambda p: raw_file(p, [1, 2])),
        ValueError, not_valid("header is not a JSON object"), mha),
    Bad("load_unsupported_dtype", "load_weights",
        lambda c: load(c, lambda p: raw_file(p, {"W_q.kernel": entry("C64", [8, 8], 0, 512)}, bytes(512))),
        ValueError, not_valid("entry 'W_q.kernel' has unsupported dtype C64"), mha),
    Bad("load_entry_without_offsets", "load_weights",
        lambda c: load(c, lambda p: raw_file(p, {"W_q.kernel": {"dtype": "F32", "shape": [8, 8]}})),
        ValueError, not_valid("entry 'W_q.kernel' is malformed: expected an object with dtype, shape and "
                              "data_offsets"), mha),
    Bad("load_entry_bad_shape", "load_weights",
        lambda c: load(c, lambda p: raw_file(p, {"W_q.kernel": entry("F32", ["8", 8], 0, 256)}, bytes(256))),
        ValueError, not_valid("entry 'W_q.kernel' has shape ['8', 8], expected a list of non-negative ints"),
        mha),
    Bad("load_entry_bad_offsets", "load_weights",
        lambda c: load(c, lambda p: raw_file(
            p, {"W_q.kernel": {"dtype": "F32", "shape": [8, 8], "data_offsets": [256]}}, bytes(256))),
        ValueError, not_valid("entry 'W_q.kernel' has data_offsets [256], expected [start, end], two "
                              "non-negative ints"), mha),
    Bad("load_data_misplaced", "load_weights",
        lambda c: load(c, lambda p: raw_file(p, {"W_q.kernel": entry("F32", [8, 8], 0, 100)}, bytes(256))),
        ValueError, not_valid("data of 'W_q.kernel' is truncated or misplaced"), mha),
    Bad("load_missing_file", "load_weights", lambda c: ac.load_weights(c.file("absent.safetensors"), c.layer),
        FileNotFoundError, "[Errno 2] No such file or directory: {absent}", mha),
    # -- issue 14: the encoders' sinusoidal table (max_len rows, sliced by the length)
    Bad("encoder_max_len_zero", "sizes",
        lambda c: c.h.module.TransformerEncoder(11, 12, 16, 3, 1, max_len=0), ValueError,
        "max_len must be a positive int, got 0"),
    Bad("encoder_max_len_float", "sizes",
        lambda c: c.h.module.TransformerEncoder(11, 12, 16, 3, 1, max_len=5.0), ValueError,
        "max_len must be a positive int, got 5.0"),
    Bad("layer_encoder_longer_than_max_len", "tokens",
        lambda c: call(c.h, c.layer, np.array([[1, 2, 3, 4, 5, 6]])), ValueError,
        "tokens have 6 positions, more than max_len (5)", short_encoder),
    # -- backends: unknown, uninstalled, badly named
    Bad("unknown_backend", "backend", lambda c: use("caffe"), ValueError, unknown_backend("caffe")),
    Bad("unknown_backend_set", "backend", lambda c: ac.set_backend("theano"), ValueError,
        unknown_backend("theano")),
    Bad("backend_name_not_str", "backend", lambda c: use(3), TypeError,
        "backend name must be a str, got int"),
    Bad("unknown_backend_env", "backend", lambda c: env_backend(c, "caffe"), ValueError,
        f"ATTENTION_CORE_BACKEND='caffe': {unknown_backend('caffe')}"),
    Bad("uninstalled_backend", "backend", lambda c: (hide_torch(c), use("pytorch")),
        registry.BackendNotInstalledError,
        "backend 'torch' needs torch, which is not installed; install it with: "
        'pip install "attention-core[torch]"  (torch==2.13.0)'),
]

assert len({row.name for row in CATALOGUE}) == len(CATALOGUE), "row names must be unique"


# -- state of a layer -----------------------------------------------------------------------------


def state(h: Harness, layer: Any) -> tuple[dict[str, np.ndarray] | str, list[np.ndarray | None]]:
    """The canonical weights (or the error saying there are none yet) and the kept attention
    weights (a list: the encoder keeps one per block)."""
    try:
        weights: dict[str, np.ndarray] | str = layer.get_weights()
    except ValueError as err:
        weights = f"not built: {err}"
    kept = h.attention_weights(layer)
    kept_list = kept if isinstance(kept, list) else [kept]
    return weights, [None if a is None else h.numpy(a) for a in kept_list]


def assert_same_state(before: Any, after: Any) -> None:
    (w0, a0), (w1, a1) = before, after
    if isinstance(w0, str) or isinstance(w1, str):
        assert w1 == w0
    else:
        assert sorted(w1) == sorted(w0)
        for name in w0:
            np.testing.assert_array_equal(w1[name], w0[name], err_msg=name)
    assert len(a1) == len(a0)
    for x, y in zip(a0, a1, strict=True):
        assert (x is None) == (y is None)
        if x is not None:
            np.testing.assert_array_equal(y, x)


@pytest.mark.parametrize("row", CATALOGUE, ids=[row.name for row in CATALOGUE])
def test_bad_call(backend: str, row: Bad, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reason = dict(row.without).get(backend)
    if reason is not None:
        pytest.skip(reason)
    cases = sum(backend not in dict(r.without) for r in CATALOGUE)
    passed = False
    try:
        h = Harness(backend)
        layer = row.layer(h) if row.layer is not None else None
        before = state(h, layer) if layer is not None else None
        ctx = Ctx(h, layer, tmp_path, monkeypatch)
        message = row.message.format(path=repr(str(ctx.file())),
                                     absent=repr(str(ctx.file("absent.safetensors"))))
        with pytest.raises(row.exc) as info:
            row.act(ctx)
        assert type(info.value) is row.exc, f"{type(info.value).__name__}: {info.value}"
        assert str(info.value) == message
        if layer is not None:
            assert_same_state(before, state(h, layer))
        passed = True
    finally:
        report.count("bad_input", backend, row.name, passed, cases)


def test_catalogue_covers_every_category() -> None:
    categories = {row.category for row in CATALOGUE}
    assert categories == {"rank", "mismatch", "heads", "sizes", "valid_lens", "mask", "dtype", "empty",
                          "dropout", "tokens", "set_weights", "load_weights", "backend"}
    assert len(CATALOGUE) >= 45
    assert sum(row.layer is not None for row in CATALOGUE) >= 30


def test_failed_first_call_leaves_input_sizes_open(backend: str) -> None:
    """A first call that fails builds nothing: the next good call may choose any input width."""
    h = Harness(backend)
    layer = fresh_mha(h)
    for bad in (lambda: call(h, layer, *qkv(), np.array([9, 9])),
                lambda: call(h, layer, *qkv(dtypes=("int32", F32, F32)))):
        with pytest.raises((ValueError, TypeError)):
            bad()
    out = call(h, layer, *qkv(q=(2, 4, 3)))
    assert tuple(h.ops.shape(out)) == (2, 4, 8)
    assert layer.get_weights()["W_q.kernel"].shape == (3, 8)
