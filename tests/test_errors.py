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
from tests.harness import COLUMNS, Harness

#: These tests run on the columns too (conftest.py; tests.harness.COLUMNS).
COLUMN_TESTS = True

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


def encode(h: Harness, tokens: np.ndarray | list[Any]) -> Any:
    """The functional encoder (vocabulary of 11, one block) on ``tokens``.

    Token ids given as a list are checked by value on every backend: as the backend's array
    where its values are read, else (JAX) as NumPy, on the host.
    """
    spec = W.transformer_encoder_spec(11, 12, 16, 3, 1)
    weights = {k: h.array(v) for k, v in W.init_weights(spec, R).items()}
    ids = h.array(np.array(tokens))
    if isinstance(tokens, list) and h.ops.concrete(ids) is None:
        ids = np.array(tokens)
    return ac.transformer_encoder(ids, weights, 3)


# -- the layers rows act on: made, and called once with good input where ``built`` ----------


def call(h: Harness, layer: Any, *arrays: np.ndarray | list[Any], **kwargs: Any) -> Any:
    """``layer`` called on backend arrays made from the NumPy ones; lists stay on the host."""
    return h.call(layer, *(h.array(a) if isinstance(a, np.ndarray) else a for a in arrays),
                  **backend_kwargs(h, kwargs))


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


def rotary(h: Harness) -> Any:
    layer = h.make("RotaryEmbedding", {})
    call(h, layer, arr((2, 3, 4)))
    return layer


def add_norm(h: Harness) -> Any:
    layer = h.make("AddNorm", {"num_hiddens": 8})
    call(h, layer, arr((2, 3, 8)), arr((2, 3, 8)))
    return layer


def ffn(h: Harness) -> Any:
    layer = h.make("PositionWiseFFN", {"ffn_num_hiddens": 6, "ffn_num_outputs": 4})
    call(h, layer, arr((2, 3, 5)))
    return layer


def learned_positional(h: Harness) -> Any:
    layer = h.make("LearnedPositionalEncoding", {"num_hiddens": 4, "max_len": 5})
    call(h, layer, arr((1, 5, 4)))
    return layer


def weights_of(h: Harness, spec: Any) -> dict[str, Any]:
    """Random weights of a spec as backend arrays, for the functional API."""
    return {k: h.array(v.astype(F32)) for k, v in W.init_weights(spec, R).items()}


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


# -- weights mappings of the functional API, set_weights conversions, files ----------


def fn_weights(h: Harness, shapes: dict[str, tuple[int, ...]], drop: tuple[str, ...] = (),
               **changes: np.ndarray) -> dict[str, Any]:
    """Random weights of the given shapes, less ``drop``, with ``changes`` replacing or adding
    entries (dotted names: pass ``**{"W_q.kernel": a}``), as backend arrays."""
    base = {name: arr(shape) for name, shape in shapes.items() if name not in drop}
    return {name: h.array(value) for name, value in {**base, **changes}.items()}


ADDITIVE = {"W_q.kernel": (3, 6), "W_k.kernel": (8, 6), "w_v.kernel": (6, 1)}
MHA = {"W_q.kernel": (8, 8), "W_k.kernel": (8, 8), "W_v.kernel": (5, 8), "W_o.kernel": (8, 8)}
RELATIVE = {"W_q.kernel": (12, 12), "W_k.kernel": (12, 12), "W_v.kernel": (12, 12),
            "W_o.kernel": (12, 12), "rel_k.embedding": (5, 4), "rel_v.embedding": (5, 4)}
FFN = {"dense1.kernel": (5, 6), "dense1.bias": (6,), "dense2.kernel": (6, 4), "dense2.bias": (4,)}
LN = {"ln.gamma": (8,), "ln.beta": (8,)}
BLOCK = {name: tuple(int(d) for d in shape if d is not None)
         for name, shape in W.encoder_block_spec(12, 16, 3).items()}
ENCODER = {name: tuple(int(d) for d in shape if d is not None)
           for name, shape in W.transformer_encoder_spec(11, 12, 16, 3, 2).items()}
TOKENS = np.array([[1, 2, 3, 4, 5], [6, 7, 8, 0, 0]])


def fn_additive(c: Ctx, drop: tuple[str, ...] = (), **changes: np.ndarray) -> Any:
    return ac.additive_attention(*(c.h.array(a) for a in qkv(q=(2, 4, 3))),
                                 fn_weights(c.h, ADDITIVE, drop, **changes))


def fn_mha(c: Ctx, drop: tuple[str, ...] = (), **changes: np.ndarray) -> Any:
    return ac.multi_head_attention(*(c.h.array(a) for a in qkv()), fn_weights(c.h, MHA, drop, **changes), 2)


def fn_relative(c: Ctx, drop: tuple[str, ...] = (), **changes: np.ndarray) -> Any:
    x = c.h.array(arr((2, 4, 12)))
    return ac.relative_multi_head_attention(x, x, x, fn_weights(c.h, RELATIVE, drop, **changes), 3)


def fn_ffn(c: Ctx, width: int = 5, **changes: np.ndarray) -> Any:
    return ac.position_wise_ffn(c.h.array(arr((2, 3, width))), fn_weights(c.h, FFN, **changes))


def fn_add_norm(c: Ctx, drop: tuple[str, ...] = (), **changes: np.ndarray) -> Any:
    x = c.h.array(arr((2, 3, 8)))
    return ac.add_norm(x, x, fn_weights(c.h, LN, drop, **changes))


def fn_block(c: Ctx, width: int = 12, **changes: np.ndarray) -> Any:
    return ac.transformer_encoder_block(c.h.array(arr((2, 5, width))),
                                        fn_weights(c.h, BLOCK, **changes), 3)


def fn_encoder(c: Ctx, drop: tuple[str, ...] = (), rename: tuple[str, str] | None = None,
               **changes: np.ndarray) -> Any:
    weights = fn_weights(c.h, ENCODER, drop, **changes)
    if rename is not None:
        weights = {name.replace(*rename): value for name, value in weights.items()}
    return ac.transformer_encoder(c.h.array(TOKENS), weights, 3)


def names_message(where: str, missing: list[str], unexpected: list[str], expected: Any) -> str:
    return (f"{where}: missing weights {missing}, unexpected weights {unexpected}; expected "
            f"exactly {sorted(expected)}")


def as_dtype(c: Ctx, dtype: Any, **changes: np.ndarray) -> dict[str, np.ndarray]:
    """The layer's weights in ``dtype`` (a big-endian or extended one), with ``changes``."""
    return {**{name: value.astype(dtype) for name, value in c.layer.get_weights().items()},
            **changes}


def unbuilt_mha_weights(dtype: Any, **changes: np.ndarray) -> dict[str, np.ndarray]:
    """Weights for an unbuilt MultiHeadAttention(8, 2): queries 3, keys 4, values 5 wide."""
    shapes = {"W_q.kernel": (3, 8), "W_k.kernel": (4, 8), "W_v.kernel": (5, 8), "W_o.kernel": (8, 8)}
    return {**{name: arr(shape).astype(dtype) for name, shape in shapes.items()}, **changes}


def fail_conversion(c: Ctx, at: int) -> None:
    """Makes the backend's ``OPS.from_numpy`` raise on its ``at``-th call from now on."""
    real, calls = c.h.ops.from_numpy, [0]

    def failing(x: Any, like: Any = None) -> Any:
        calls[0] += 1
        if calls[0] == at:
            raise RuntimeError(f"conversion {at} failed (forced by the test)")
        return real(x, like)

    c.monkeypatch.setattr(c.h.ops, "from_numpy", failing)


def with_file_size_limit(limit: int, act: Callable[[], Any]) -> Any:
    """Runs ``act`` with writes past ``limit`` bytes of any file failing (EFBIG, as when a disk
    fills up), then lifts the limit."""
    import resource
    import signal

    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old_limit[1]))
    try:
        return act()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)


def appended(path: Path, extra: bytes) -> Path:
    good_file(path)
    path.write_bytes(path.read_bytes() + extra)
    return path


K256 = entry("F32", [8, 8], 0, 256)


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
    bad input cannot even be made on, as ``(backend, reason)`` pairs. ``files(ctx.file())``
    writes the files the call finds in place (a file to load, one to overwrite); every file
    in ``ctx.tmp`` must be byte-identical after the failed call, and no file may appear.
    """

    name: str
    category: str
    act: Callable[[Ctx], Any]
    exc: type[Exception]
    message: str
    layer: Callable[[Harness], Any] | None = None
    without: tuple[tuple[str, str], ...] = ()
    files: Callable[[Path], Any] | None = None


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


def load_into_layer(c: Ctx) -> Any:
    """Loads ``ctx.file()`` (made by the row's ``files``) into the row's layer."""
    return ac.load_weights(c.file(), c.layer)


#: JAX arrays hold no int64 (without ``jax_enable_x64``): int64 ids would be cut when the array
#: is made, before any library code runs.
NO_INT64 = (("jax", "JAX arrays hold no int64 without jax_enable_x64"),)


def int64_tokens(c: Ctx, tokens: np.ndarray) -> Any:
    """int64 token ids as a user gives them: a backend array, or NumPy to a Flax module."""
    return tokens if c.h.arrays == "jax" else c.h.array(tokens)


def host_dpa(c: Ctx, **kwargs: Any) -> Any:
    """dot-product attention on backend arrays with ``kwargs`` passed as given (host data)."""
    return ac.dot_product_attention(*(c.h.array(a) for a in qkv()), **kwargs)


def host_call(c: Ctx, inputs: list[np.ndarray], *host: Any, **kwargs: Any) -> Any:
    """Calls the row's layer on ``inputs`` as backend arrays and ``host`` (lengths, masks)
    and ``kwargs`` as given."""
    return c.h.call(c.layer, *(c.h.array(a) for a in inputs), *host, **kwargs)


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
        "keys heads size (3) must divide queries heads size (2): each key/value head serves an "
        "equal group of query heads"),
    Bad("layer_no_queries", "mismatch", lambda c: c.h.call(c.layer), TypeError,
        "missing a required argument: 'queries'", mha),
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
    # -- the attention of current models: its constructor options and the score bias
    Bad("kv_heads_not_dividing", "heads",
        lambda c: c.h.module.MultiHeadAttention(8, 4, num_kv_heads=3), ValueError,
        "num_kv_heads (3) must divide num_heads (4)"),
    Bad("functional_kv_heads_not_dividing", "heads",
        lambda c: ac.multi_head_attention(*(c.h.array(a) for a in qkv()),
                                          fn_weights(c.h, MHA), 2, num_kv_heads=3),
        ValueError, "num_kv_heads (3) must divide num_heads (2)"),
    Bad("functional_kv_width", "heads",
        lambda c: ac.multi_head_attention(*(c.h.array(a) for a in qkv()),
                                          fn_weights(c.h, MHA), 2, num_kv_heads=1),
        ValueError, "multi_head_attention: W_k.kernel has shape (8, 8), expected (8, 4)"),
    Bad("unknown_positional", "sizes",
        lambda c: c.h.module.MultiHeadAttention(8, 2, positional="sinusoidal"), ValueError,
        "positional must be None, 'rotary' or 'alibi', got 'sinusoidal'"),
    Bad("rotary_odd_depth", "sizes",
        lambda c: c.h.module.MultiHeadAttention(6, 2, positional="rotary"), ValueError,
        "rotary positions need an even depth per head, got 3: the rotation turns pairs of "
        "features"),
    Bad("zero_window", "sizes", lambda c: c.h.module.DotProductAttention(window=0), ValueError,
        "window must be a positive int, got 0"),
    Bad("negative_softcap", "sizes", lambda c: c.h.module.DotProductAttention(softcap=-1.0),
        ValueError, "softcap must be None or a positive finite number, got -1.0"),
    Bad("rotary_base_one", "sizes", lambda c: c.h.module.RotaryEmbedding(base=1.0), ValueError,
        "base must be a finite number > 1, got 1.0"),
    Bad("layer_rotary_odd_width", "mismatch", lambda c: call(c.h, c.layer, arr((2, 3, 5))),
        ValueError, "rotary positions need an even depth per head, got 5: the rotation turns "
        "pairs of features", rotary),
    Bad("layer_rotary_negative_start", "mismatch",
        lambda c: call(c.h, c.layer, arr((2, 3, 4)), start_index=-1), ValueError,
        "start_index must be >= 0, got -1", rotary),
    Bad("layer_score_bias_shape", "mismatch",
        lambda c: call(c.h, c.layer, *qkv(), score_bias=arr((3, 4, 6))), ValueError,
        "score_bias must have shape (Q, K), (B, Q, K) or (B, H, Q, K), broadcastable to "
        "(B, H, Q, K) = (2, 2, 4, 6), got (3, 4, 6)", mha),
    Bad("layer_score_bias_integer", "dtype",
        lambda c: call(c.h, c.layer, *qkv(), score_bias=arr((4, 6), "int32")), TypeError,
        "score_bias must be floating point (float16, bfloat16, float32, float64), got int32",
        mha),
    Bad("blockwise_weights", "sizes",
        lambda c: dpa(c.h, qkv(), return_weights=True, implementation="blockwise"),
        ValueError, "implementation='blockwise' never forms the attention weights: this call "
        "needs implementation=None or 'direct'"),
    Bad("zero_hiddens", "sizes", lambda c: c.h.module.AdditiveAttention(0), ValueError,
        "num_hiddens must be a positive int, got 0"),
    Bad("relative_zero_offsets", "sizes", lambda c: c.h.module.RelativeMultiHeadAttention(12, 3, 0),
        ValueError, "max_relative_position must be a positive int, got 0"),
    Bad("encoder_zero_blocks", "sizes", lambda c: c.h.module.TransformerEncoder(11, 12, 16, 3, 0),
        ValueError, "num_blks must be a positive int, got 0"),
    Bad("unknown_implementation", "sizes",
        lambda c: c.h.module.DotProductAttention(implementation="flash"), ValueError,
        "implementation must be None, 'direct', 'blockwise', 'fused' or a registered kernel's "
        "name, got 'flash'"),
    Bad("scale_negative", "sizes", lambda c: dpa(c.h, qkv(), scale=-1.0), ValueError,
        "scale must be a positive finite float or None, got -1.0"),
    # -- valid_lens
    Bad("valid_lens_shape", "valid_lens", lambda c: dpa(c.h, qkv(), valid_lens=np.array([1, 2, 3])),
        ValueError, "valid_lens must have shape (B,) or (B, Q) = (2,) or (2, 4), got (3,)"),
    Bad("valid_lens_per_query_shape", "valid_lens",
        lambda c: dpa(c.h, qkv(), valid_lens=np.ones((2, 5), np.int32)), ValueError,
        "valid_lens must have shape (B,) or (B, Q) = (2,) or (2, 4), got (2, 5)"),
    Bad("valid_lens_float", "valid_lens",
        lambda c: dpa(c.h, qkv(), valid_lens=np.array([1.0, 2.0], F32)), TypeError,
        "valid_lens must have an integer dtype, got float32"),
    Bad("valid_lens_negative", "valid_lens", lambda c: dpa(c.h, qkv(), valid_lens=[-1, 2]),
        ValueError, "valid_lens must be >= 0, got -1"),
    Bad("valid_lens_too_long", "valid_lens", lambda c: dpa(c.h, qkv(), valid_lens=[7, 2]),
        ValueError, "valid_lens must be <= the number of keys (6), got 7"),
    Bad("layer_valid_lens_too_long", "valid_lens",
        lambda c: call(c.h, c.layer, *qkv(), [7, 2]), ValueError,
        "valid_lens must be <= the number of keys (6), got 7", mha),
    Bad("layer_first_call_valid_lens", "valid_lens",
        lambda c: call(c.h, c.layer, *qkv(), [9, 9]), ValueError,
        "valid_lens must be <= the number of keys (6), got 9", fresh_mha),
    Bad("layer_additive_valid_lens_negative", "valid_lens",
        lambda c: call(c.h, c.layer, *qkv(q=(2, 4, 3)), [3, -4]), ValueError,
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
        TypeError, "queries must be an array of numpy, torch, tensorflow, jax or mxnet, got list"),
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
    Bad("tokens_too_large", "tokens", lambda c: encode(c.h, [[1, 2, 11], [0, 0, 0]]),
        ValueError, "tokens must be in [0, vocab_size) = [0, 11), got 11"),
    Bad("tokens_negative", "tokens", lambda c: encode(c.h, [[1, -2, 3]]), ValueError,
        "tokens must be in [0, vocab_size) = [0, 11), got -2"),
    # more than a decode step's few ids: read by NumPy's reductions, not Python's (as lists:
    # host data, whose values every backend reads, as for the short ones above)
    Bad("tokens_too_large_long", "tokens",
        lambda c: encode(c.h, np.where(np.arange(80).reshape(2, 40) == 77, 12, 1).tolist()),
        ValueError, "tokens must be in [0, vocab_size) = [0, 11), got 12"),
    Bad("tokens_negative_long", "tokens",
        lambda c: encode(c.h, np.where(np.arange(80).reshape(2, 40) == 5, -3, 1).tolist()),
        ValueError, "tokens must be in [0, vocab_size) = [0, 11), got -3"),
    Bad("tokens_rank", "tokens", lambda c: encode(c.h, np.array([1, 2, 3])), ValueError,
        "tokens must have shape (B, T) token ids, got (3,)"),
    Bad("layer_encoder_tokens_too_large", "tokens",
        lambda c: call(c.h, c.layer, [[1, 2, 30]]), ValueError,
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
        load_into_layer,
        ValueError, does_not_fit(f"missing weights {MHA_NAMES}, unexpected weights "
                                 "['embeddings.weight']; expected exactly " + MHA_NAMES), mha,
        files=lambda p: raw_file(p, {"embeddings.weight": entry("F32", [2], 0, 8)}, bytes(8))),
    Bad("load_wrong_shape", "load_weights",
        load_into_layer, ValueError,
        does_not_fit("W_q.kernel has shape (3, 8), expected (8, 8)"), mha,
        files=lambda p: good_file(p, **{"W_q.kernel": arr((3, 8))})),
    Bad("load_integer", "load_weights",
        load_into_layer,
        TypeError, does_not_fit("W_k.kernel must be floating point, got int32"), mha,
        files=lambda p: good_file(p, **{"W_k.kernel": np.ones((8, 8), np.int32)})),
    Bad("load_truncated", "load_weights", load_into_layer, ValueError,
        not_valid("data of 'W_v.kernel' is truncated or misplaced"), mha,
        files=truncated),
    Bad("load_too_short", "load_weights", load_into_layer,
        ValueError, not_valid("only 3 bytes"), mha,
        files=lambda p: (p.write_bytes(b"\x08\x00\x00"), p)[1]),
    Bad("load_header_past_end", "load_weights",
        load_into_layer, ValueError,
        not_valid("header of 100 bytes runs past the end of the file"), mha,
        files=lambda p: (p.write_bytes(struct.pack("<Q", 100) + b"{}"), p)[1]),
    Bad("load_png", "load_weights", load_into_layer, ValueError,
        not_valid(f"header of {int.from_bytes(PNG[:8], 'little')} bytes runs past the end of the file"),
        mha,
        files=lambda p: (p.write_bytes(PNG), p)[1]),
    Bad("load_header_not_json", "load_weights",
        load_into_layer, ValueError,
        not_valid("header is not JSON"), mha,
        files=lambda p: raw_file(p, b"\xff\xfe{not json")),
    Bad("load_header_not_object", "load_weights", load_into_layer,
        ValueError, not_valid("header is not a JSON object"), mha,
        files=lambda p: raw_file(p, [1, 2])),
    Bad("load_unsupported_dtype", "load_weights",
        load_into_layer,
        ValueError, not_valid("entry 'W_q.kernel' has unsupported dtype C64"), mha,
        files=lambda p: raw_file(p, {"W_q.kernel": entry("C64", [8, 8], 0, 512)}, bytes(512))),
    Bad("load_entry_without_offsets", "load_weights",
        load_into_layer,
        ValueError, not_valid("entry 'W_q.kernel' is malformed: expected an object with dtype, shape and "
                              "data_offsets"), mha,
        files=lambda p: raw_file(p, {"W_q.kernel": {"dtype": "F32", "shape": [8, 8]}})),
    Bad("load_entry_bad_shape", "load_weights",
        load_into_layer,
        ValueError, not_valid("entry 'W_q.kernel' has shape ['8', 8], expected a list of non-negative ints"),
        mha,
        files=lambda p: raw_file(p, {"W_q.kernel": entry("F32", ["8", 8], 0, 256)}, bytes(256))),
    Bad("load_entry_bad_offsets", "load_weights",
        load_into_layer,
        ValueError, not_valid("entry 'W_q.kernel' has data_offsets [256], expected [start, end], two "
                              "non-negative ints"), mha,
        files=lambda p: raw_file(
            p, {"W_q.kernel": {"dtype": "F32", "shape": [8, 8], "data_offsets": [256]}}, bytes(256))),
    Bad("load_data_misplaced", "load_weights",
        load_into_layer,
        ValueError, not_valid("data of 'W_q.kernel' is truncated or misplaced"), mha,
        files=lambda p: raw_file(p, {"W_q.kernel": entry("F32", [8, 8], 0, 100)}, bytes(256))),
    Bad("load_missing_file", "load_weights", lambda c: ac.load_weights(c.file("absent.safetensors"), c.layer),
        FileNotFoundError, "[Errno 2] No such file or directory: {absent}", mha),
    # -- empty inputs (every layer and functional entry point refuses them up front)
    Bad("layer_add_norm_empty", "empty", lambda c: call(c.h, c.layer, arr((2, 0, 8)), arr((2, 0, 8))),
        ValueError, "X must not have an empty dimension, got (2, 0, 8)", add_norm),
    Bad("layer_add_norm_empty_batch", "empty",
        lambda c: call(c.h, c.layer, arr((0, 3, 8)), arr((0, 3, 8))), ValueError,
        "X must not have an empty dimension, got (0, 3, 8)", add_norm),
    Bad("functional_add_norm_empty", "empty",
        lambda c: ac.add_norm(c.h.array(arr((2, 0, 8))), c.h.array(arr((2, 0, 8))),
                              weights_of(c.h, W.add_norm_spec(8))), ValueError,
        "X must not have an empty dimension, got (2, 0, 8)"),
    Bad("layer_ffn_empty", "empty", lambda c: call(c.h, c.layer, arr((2, 0, 5))), ValueError,
        "X must not have an empty dimension, got (2, 0, 5)", ffn),
    Bad("functional_ffn_empty", "empty",
        lambda c: ac.position_wise_ffn(c.h.array(arr((2, 0, 5))), weights_of(c.h, W.ffn_spec(6, 4, 5))),
        ValueError, "X must not have an empty dimension, got (2, 0, 5)"),
    Bad("layer_positional_empty_batch", "empty", lambda c: call(c.h, c.layer, arr((0, 5, 4))),
        ValueError, "X must not have an empty dimension, got (0, 5, 4)", positional),
    Bad("layer_learned_positional_empty", "empty", lambda c: call(c.h, c.layer, arr((1, 0, 4))),
        ValueError, "X must not have an empty dimension, got (1, 0, 4)", learned_positional),
    Bad("layer_nadaraya_empty_queries", "empty", lambda c: call(c.h, c.layer, arr((2, 0)), arr((2, 5)),
                                                                arr((2, 5))),
        ValueError, "queries must not have an empty dimension, got (2, 0)", nadaraya),
    Bad("layer_nadaraya_empty_keys", "empty", lambda c: call(c.h, c.layer, arr((2, 3)), arr((2, 0)),
                                                             arr((2, 0))),
        ValueError, "keys must not have an empty dimension, got (2, 0)", nadaraya),
    Bad("layer_block_empty", "empty", lambda c: call(c.h, c.layer, arr((2, 0, 12))), ValueError,
        "X must not have an empty dimension, got (2, 0, 12)", block),
    Bad("layer_encoder_empty_batch", "empty",
        lambda c: call(c.h, c.layer, np.zeros((0, 5), np.int32)), ValueError,
        "tokens must not have an empty dimension, got (0, 5)", encoder),
    Bad("masked_softmax_empty_keys", "empty",
        lambda c: ac.masked_softmax(c.h.array(arr((2, 3, 0))), valid_lens=c.h.array(np.array([0, 0]))),
        ValueError, "scores must not have an empty dimension, got (2, 3, 0)"),
    # -- argument types and dtypes, one rule everywhere
    # lengths and token ids are checked as given, before any cast (JAX holds no int64)
    Bad("valid_lens_beyond_int32", "valid_lens",
        lambda c: host_dpa(c, valid_lens=np.array([2**32 + 3, 2])), ValueError,
        "valid_lens must be <= the number of keys (6), got 4294967299"),
    Bad("valid_lens_list_beyond_int32", "valid_lens", lambda c: host_dpa(c, valid_lens=[2, 2**32 + 3]),
        ValueError, "valid_lens must be <= the number of keys (6), got 4294967299"),
    Bad("valid_lens_below_int32", "valid_lens", lambda c: host_dpa(c, valid_lens=np.array([2, -2**32])),
        ValueError, "valid_lens must be >= 0, got -4294967296"),
    Bad("valid_lens_uint64_beyond_int64", "valid_lens",
        lambda c: host_dpa(c, valid_lens=np.array([2**63 + 5, 1], np.uint64)), ValueError,
        "valid_lens must be <= the number of keys (6), got 9223372036854775813"),
    Bad("layer_valid_lens_beyond_int32", "valid_lens",
        lambda c: host_call(c, qkv(), np.array([3, 2**32 + 3])), ValueError,
        "valid_lens must be <= the number of keys (6), got 4294967299", mha),
    Bad("layer_block_valid_lens_uint16_too_long", "valid_lens",
        lambda c: host_call(c, [arr((2, 5, 12))], np.array([5, 6], np.uint16)), ValueError,
        "valid_lens must be <= the number of keys (5), got 6", block,
        without=(("keras-jax", "Keras makes NumPy inputs JAX arrays, whose values are never "
                  "read: out-of-range lengths are then all or none of the keys"),)),
    Bad("layer_encoder_valid_lens_beyond_int32", "valid_lens",
        lambda c: host_call(c, [np.array([[1, 2, 3]])], np.array([2**32 + 1])), ValueError,
        "valid_lens must be <= the number of keys (3), got 4294967297", encoder),
    Bad("tokens_beyond_int32", "tokens", lambda c: encode(c.h, np.array([[1, 2**32 + 3]])), ValueError,
        "tokens must be in [0, vocab_size) = [0, 11), got 4294967299", without=NO_INT64),
    Bad("layer_encoder_tokens_beyond_int32", "tokens",
        lambda c: c.h.call(c.layer, int64_tokens(c, np.array([[1, 2**33], [3, 4]]))), ValueError,
        "tokens must be in [0, vocab_size) = [0, 11), got 8589934592", encoder),
    # Python scalars as lengths or masks are read as NumPy reads them: a 0-d array
    Bad("valid_lens_python_int", "valid_lens", lambda c: host_dpa(c, valid_lens=3), ValueError,
        "valid_lens must have shape (B,) or (B, Q) = (2,) or (2, 4), got ()"),
    Bad("valid_lens_python_float", "valid_lens", lambda c: host_dpa(c, valid_lens=3.0), TypeError,
        "valid_lens must have an integer dtype, got float64"),
    Bad("valid_lens_str", "valid_lens", lambda c: host_dpa(c, valid_lens="3"), TypeError,
        "valid_lens must have an integer dtype, got str32"),
    Bad("valid_lens_python_floats", "valid_lens", lambda c: host_dpa(c, valid_lens=[3.0, 2.0]),
        TypeError, "valid_lens must have an integer dtype, got float64"),
    Bad("mask_python_bool", "mask", lambda c: host_dpa(c, mask=True), ValueError,
        mask_message("(2, 1, 4, 6)", "()")),
    Bad("mask_nested_lists_of_ints", "mask", lambda c: host_dpa(c, mask=[[1] * 6] * 4), TypeError,
        "mask must be boolean (True = may attend), got int64"),
    Bad("masked_softmax_valid_lens_python_float", "valid_lens",
        lambda c: ac.masked_softmax(c.h.array(arr((2, 3, 4))), 2.0), TypeError,
        "valid_lens must have an integer dtype, got float64"),
    Bad("layer_mask_python_bool", "mask", lambda c: host_call(c, qkv(), mask=False), ValueError,
        mask_message("(2, 2, 4, 6)", "()"), mha),
    Bad("layer_valid_lens_python_float", "valid_lens", lambda c: host_call(c, qkv(), 4.0), TypeError,
        "valid_lens must have an integer dtype, got float64", mha),
    Bad("layer_block_valid_lens_str", "valid_lens", lambda c: host_call(c, [arr((2, 5, 12))], "5"),
        TypeError, "valid_lens must have an integer dtype, got str32", block),
    Bad("layer_encoder_mask_python_bool", "mask",
        lambda c: host_call(c, [np.array([[1, 2, 3]])], mask=True), ValueError,
        mask_message("(1, 3, 3, 3)", "()"), encoder),
    # scale and dropout: finite, NumPy scalars read as the Python numbers they hold
    Bad("scale_inf", "sizes", lambda c: dpa(c.h, qkv(), scale=float("inf")), ValueError,
        "scale must be a positive finite float or None, got inf"),
    Bad("scale_nan", "sizes", lambda c: dpa(c.h, qkv(), scale=float("nan")), ValueError,
        "scale must be a positive finite float or None, got nan"),
    Bad("scale_numpy_inf", "sizes", lambda c: dpa(c.h, qkv(), scale=np.float32(np.inf)), ValueError,
        "scale must be a positive finite float or None, got inf"),
    Bad("scale_numpy_negative", "sizes", lambda c: dpa(c.h, qkv(), scale=np.float64(-0.5)), ValueError,
        "scale must be a positive finite float or None, got -0.5"),
    Bad("scale_str", "sizes", lambda c: dpa(c.h, qkv(), scale="0.5"), ValueError,
        "scale must be a positive finite float or None, got '0.5'"),
    Bad("functional_dropout_inf", "dropout", lambda c: dpa(c.h, qkv(), dropout=float("inf")), ValueError,
        "dropout must be in [0, 1), got inf"),
    Bad("functional_dropout_numpy_nan", "dropout", lambda c: dpa(c.h, qkv(), dropout=np.float32(np.nan)),
        ValueError, "dropout must be in [0, 1), got nan"),
    Bad("layer_dropout_numpy_one", "dropout",
        lambda c: c.h.module.MultiHeadAttention(8, 2, dropout=np.float64(1.0)), ValueError,
        "dropout must be in [0, 1), got 1.0"),
    Bad("layer_dropout_inf", "dropout", lambda c: c.h.module.AddNorm(8, dropout=float("inf")), ValueError,
        "dropout must be in [0, 1), got inf"),
    Bad("numpy_zero_heads", "heads", lambda c: c.h.module.MultiHeadAttention(np.int64(8), np.int64(0)),
        ValueError, "num_heads must be a positive int, got 0"),
    Bad("numpy_heads_not_dividing", "heads",
        lambda c: c.h.module.TransformerEncoderBlock(np.int32(12), 16, np.int64(5)), ValueError,
        "num_hiddens (12) must be divisible by num_heads (5)"),
    Bad("numpy_float_heads", "heads", lambda c: c.h.module.MultiHeadAttention(8, np.float32(2)),
        ValueError, "num_heads must be a positive int, got 2.0"),
    Bad("functional_numpy_heads_not_dividing", "heads",
        lambda c: ac.multi_head_attention(*(c.h.array(a) for a in qkv()),
                                          {"W_q.kernel": c.h.array(arr((8, 9)))}, np.int64(2)),
        ValueError, "num_hiddens (9) must be divisible by num_heads (2)"),
    Bad("numpy_zero_max_len", "sizes", lambda c: c.h.module.PositionalEncoding(4, max_len=np.int64(0)),
        ValueError, "max_len must be a positive int, got 0"),
    Bad("numpy_zero_relative_offsets", "sizes",
        lambda c: c.h.module.RelativeMultiHeadAttention(12, 3, np.uint8(0)), ValueError,
        "max_relative_position must be a positive int, got 0"),
    Bad("causal_numpy_int", "mask", lambda c: dpa(c.h, qkv(), causal=np.int64(1)), TypeError,
        "causal must be a bool, got int"),
    # the main inputs of a call are arrays of one framework (host-side ones may be of any)
    Bad("keys_list", "dtype", lambda c: ac.dot_product_attention(c.h.array(arr((2, 4, 8))),
                                                                  arr((2, 6, 8)).tolist(),
                                                                  c.h.array(arr((2, 6, 5)))),
        TypeError, "keys must be a {backend} array like queries, got list"),
    Bad("layer_values_list", "dtype", lambda c: c.h.call(c.layer, c.h.array(arr((2, 4, 8))),
                                                         c.h.array(arr((2, 6, 8))), [[[1.0] * 5] * 6] * 2),
        TypeError, "values must be a {backend} array like queries, got list", mha),
    Bad("add_norm_y_list", "dtype",
        lambda c: ac.add_norm(c.h.array(arr((2, 3, 8))), arr((2, 3, 8)).tolist(),
                              {"ln.gamma": c.h.array(arr((8,))), "ln.beta": c.h.array(arr((8,)))}),
        TypeError, "Y must be a {backend} array like X, got list"),
    Bad("keys_of_another_framework", "dtype",
        lambda c: ac.dot_product_attention(c.h.array(arr((2, 4, 8))), arr((2, 6, 8)),
                                           c.h.array(arr((2, 6, 5)))),
        TypeError, "keys must be a {backend} array like queries, got a numpy array",
        without=(("numpy", "NumPy arrays are the numpy backend's own"),)),
    # -- weights and files
    # the functional API's weights mappings: checked like set_weights, sizes read off the mapping
    Bad("fn_additive_w_v_columns", "functional_weights",
        lambda c: fn_additive(c, **{"w_v.kernel": arr((6, 2))}), ValueError,
        "additive_attention: w_v.kernel has shape (6, 2), expected (6, 1)"),
    Bad("fn_additive_missing", "functional_weights", lambda c: fn_additive(c, drop=("w_v.kernel",)),
        ValueError, names_message("additive_attention", ["w_v.kernel"], [], ADDITIVE)),
    Bad("fn_additive_keys_width", "functional_weights",
        lambda c: fn_additive(c, **{"W_k.kernel": arr((4, 6))}), ValueError,
        "keys last dimension (8) must be 4, as W_k.kernel has shape (4, 6)"),
    Bad("fn_additive_integer", "functional_weights",
        lambda c: fn_additive(c, **{"w_v.kernel": np.ones((6, 1), np.int32)}), TypeError,
        "additive_attention: w_v.kernel must be floating point, got int32"),
    Bad("fn_mha_unexpected", "functional_weights",
        lambda c: fn_mha(c, **{"W_x.kernel": arr((8, 8))}), ValueError,
        names_message("multi_head_attention", [], ["W_x.kernel"], MHA)),
    Bad("fn_mha_values_width", "functional_weights",
        lambda c: fn_mha(c, **{"W_v.kernel": arr((4, 8))}), ValueError,
        "values last dimension (5) must be 4, as W_v.kernel has shape (4, 8)"),
    Bad("fn_mha_output_shape", "functional_weights",
        lambda c: fn_mha(c, **{"W_o.kernel": arr((8, 6))}), ValueError,
        "multi_head_attention: W_o.kernel has shape (8, 6), expected (8, 8)"),
    Bad("fn_mha_kernel_rank", "functional_weights",
        lambda c: fn_mha(c, **{"W_q.kernel": arr((8,))}), ValueError,
        "multi_head_attention: W_q.kernel has shape (8,), expected (?, ?)"),
    Bad("fn_mha_one_bias", "functional_weights",
        lambda c: fn_mha(c, **{"W_q.bias": arr((8,))}), ValueError,
        names_message("multi_head_attention", ["W_k.bias", "W_o.bias", "W_v.bias"], [],
                      W.multi_head_spec(8, 2, True))),
    Bad("fn_mha_not_mapping", "functional_weights",
        lambda c: ac.multi_head_attention(*(c.h.array(a) for a in qkv()), [arr((8, 8))], 2),
        TypeError, "multi_head_attention: weights must be a mapping of name -> array, got list"),
    Bad("fn_relative_even_table", "functional_weights",
        lambda c: fn_relative(c, **{"rel_k.embedding": arr((4, 4)), "rel_v.embedding": arr((4, 4))}),
        ValueError, "relative_multi_head_attention: rel_k.embedding has shape (4, 4), expected (5, 4)"),
    Bad("fn_relative_value_table", "functional_weights",
        lambda c: fn_relative(c, **{"rel_v.embedding": arr((5, 3))}), ValueError,
        "relative_multi_head_attention: rel_v.embedding has shape (5, 3), expected (5, 4)"),
    Bad("fn_ffn_bias", "functional_weights", lambda c: fn_ffn(c, **{"dense2.bias": arr((5,))}),
        ValueError, "position_wise_ffn: dense2.bias has shape (5,), expected (4,)"),
    Bad("fn_ffn_width", "functional_weights", lambda c: fn_ffn(c, width=7), ValueError,
        "X last dimension (7) must be 5, as dense1.kernel has shape (5, 6)"),
    Bad("fn_add_norm_missing", "functional_weights", lambda c: fn_add_norm(c, drop=("ln.beta",)),
        ValueError, names_message("add_norm", ["ln.beta"], [], LN)),
    Bad("fn_add_norm_width", "functional_weights",
        lambda c: fn_add_norm(c, **{"ln.gamma": arr((6,)), "ln.beta": arr((6,))}), ValueError,
        "X last dimension (8) must be 6, as ln.gamma has shape (6,)"),
    Bad("fn_add_norm_beta", "functional_weights", lambda c: fn_add_norm(c, **{"ln.beta": arr((7,))}),
        ValueError, "add_norm: ln.beta has shape (7,), expected (8,)"),
    Bad("fn_block_ffn_output", "functional_weights",
        lambda c: fn_block(c, **{"ffn.dense2.kernel": arr((16, 8))}), ValueError,
        "transformer_encoder_block: ffn.dense2.kernel has shape (16, 8), expected (16, 12)"),
    Bad("fn_block_width", "functional_weights", lambda c: fn_block(c, width=8), ValueError,
        "X last dimension (8) must be 12, as attention.W_q.kernel has shape (12, 12)"),
    Bad("fn_encoder_block_shape", "functional_weights",
        lambda c: fn_encoder(c, **{"blks.1.addnorm1.ln.gamma": arr((8,))}), ValueError,
        "transformer_encoder: blks.1.addnorm1.ln.gamma has shape (8,), expected (12,)"),
    Bad("fn_encoder_missing_embedding", "functional_weights",
        lambda c: fn_encoder(c, drop=("token.embedding",)), ValueError,
        names_message("transformer_encoder", ["token.embedding"], [], ENCODER)),
    Bad("fn_encoder_block_numbering", "functional_weights",
        lambda c: fn_encoder(c, rename=("blks.1.", "blks.2.")), ValueError,
        names_message("transformer_encoder", sorted(n for n in ENCODER if n.startswith("blks.1.")),
                      sorted(n.replace("blks.1.", "blks.2.") for n in ENCODER if n.startswith("blks.1.")),
                      ENCODER)),
    # set_weights: every value checked and converted before the first write
    Bad("set_weights_big_endian_last_bad", "set_weights",
        lambda c: c.layer.set_weights(as_dtype(c, ">f4", **{"W_o.kernel": arr((8, 7)).astype(">f4")})),
        ValueError, "set_weights: W_o.kernel has shape (8, 7), expected (8, 8)", mha),
    Bad("set_weights_longdouble_last_integer", "set_weights",
        lambda c: c.layer.set_weights(as_dtype(c, np.longdouble,
                                               **{"W_o.kernel": np.ones((8, 8), np.int64)})),
        TypeError, "set_weights: W_o.kernel must be floating point, got int64", mha),
    Bad("set_weights_complex", "set_weights",
        lambda c: c.layer.set_weights(as_dtype(c, F32, **{"W_v.kernel": arr((5, 8), "complex64")})),
        TypeError, "set_weights: W_v.kernel must be floating point, got complex64", mha),
    Bad("set_weights_unbuilt_last_bad", "set_weights",
        lambda c: c.layer.set_weights(unbuilt_mha_weights(">f8", **{"W_o.kernel": arr((8, 7))})),
        ValueError, "set_weights: W_o.kernel has shape (8, 7), expected (8, 8)", fresh_mha),
    Bad("set_weights_conversion_fails_last", "set_weights",
        lambda c: (fail_conversion(c, 4), c.layer.set_weights(as_dtype(c, ">f4"))), RuntimeError,
        "conversion 4 failed (forced by the test)", mha),
    Bad("set_weights_unbuilt_conversion_fails_last", "set_weights",
        lambda c: (fail_conversion(c, 4), c.layer.set_weights(unbuilt_mha_weights(np.longdouble))),
        RuntimeError, "conversion 4 failed (forced by the test)", fresh_mha),
    # save_weights: a failed save leaves the previous file as it was, and no temporary file
    Bad("save_unbuilt_creates_no_file", "save_weights", lambda c: ac.save_weights(c.file(), c.layer),
        ValueError, "MultiHeadAttention: weights are created on the first call; call the layer or "
        "set_weights first", fresh_mha),
    Bad("save_overwrite_disk_full", "save_weights",
        lambda c: with_file_size_limit(512, lambda: ac.save_weights(c.file(), c.layer)), OSError,
        "[Errno 27] File too large", mha, files=good_file),
    Bad("save_reserved_name", "save_weights",
        lambda c: ac.save_weights(c.file(), {"W_q.kernel": arr((2, 2)), "__metadata__": arr((2,))}),
        ValueError, "save_weights: a weight may not be named '__metadata__': the safetensors format "
        "reserves that key for the file's metadata", files=good_file),
    Bad("save_unsupported_dtype_keeps_file", "save_weights",
        lambda c: ac.save_weights(c.file(), {"w": np.ones(2, np.int8)}), TypeError,
        "save_weights: w has unsupported dtype int8", files=good_file),
    # load_weights: the tensors' data must tile the data area exactly; a strict header
    Bad("load_overlapping_offsets", "load_weights", load_into_layer, ValueError,
        not_valid("data of 'W_q.kernel' (bytes 0 to 256) overlaps data of 'W_k.kernel' (ending at "
                  "byte 256)"), mha,
        files=lambda p: raw_file(p, {"W_q.kernel": K256, "W_k.kernel": K256}, bytes(256))),
    Bad("load_gap_between_tensors", "load_weights", load_into_layer, ValueError,
        not_valid("4 bytes between data of 'W_k.kernel' and data of 'W_q.kernel' belong to no tensor"),
        mha, files=lambda p: raw_file(p, {"W_k.kernel": K256, "W_q.kernel": entry("F32", [8, 8], 260, 516)},
                                      bytes(516))),
    Bad("load_data_not_from_start", "load_weights", load_into_layer, ValueError,
        not_valid("8 bytes between the start of the data and data of 'W_q.kernel' belong to no tensor"),
        mha, files=lambda p: raw_file(p, {"W_q.kernel": entry("F32", [8, 8], 8, 264)}, bytes(264))),
    Bad("load_trailing_bytes", "load_weights", load_into_layer, ValueError,
        not_valid("8 bytes after the last tensor's data belong to no tensor"), mha,
        files=lambda p: appended(p, bytes(8))),
    Bad("load_duplicate_key", "load_weights", load_into_layer, ValueError,
        not_valid("key 'W_q.kernel' appears twice in the header"), mha,
        files=lambda p: raw_file(p, b'{"W_q.kernel": ' + json.dumps(K256).encode() + b', "W_q.kernel": '
                                 + json.dumps(K256).encode() + b"}", bytes(256))),
    Bad("load_metadata_not_str", "load_weights", load_into_layer, ValueError,
        not_valid("__metadata__ must be an object of str -> str, got {{'format': 1}}"), mha,
        files=lambda p: raw_file(p, {"__metadata__": {"format": 1}, "W_q.kernel": K256}, bytes(256))),
    Bad("load_tensor_named_metadata", "load_weights", load_into_layer, ValueError,
        not_valid("__metadata__ must be an object of str -> str, got {{'dtype': 'F32', 'shape': [8, 8], "
                  "'data_offsets': [0, 256]}}"), mha,
        files=lambda p: raw_file(p, {"__metadata__": K256}, bytes(256))),
    # -- the encoders' sinusoidal table (max_len rows, sliced by the length)
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
        'pip install ".[torch]" in a checkout of attention-core, or pip install '
        '"attention-core[torch]" from the package index; it takes torch==2.13.0'),
]


# -- the decoder, the cache, generation, converters and export: one list per area, each with
#    the helpers it needs above it, all added to the catalogue below


# -- batch sizes that must match, and the decoder's and cache's messages

DEC_TOKENS = np.array([[1, 2, 3], [4, 5, 6]])


def decoder(h: Harness) -> Any:
    """A TransformerDecoder (vocabulary 11, width 8, 2 heads, 1 block), called once."""
    layer = h.make("TransformerDecoder", {"vocab_size": 11, "num_hiddens": 8, "ffn_num_hiddens": 16,
                                          "num_heads": 2, "num_blks": 1})
    call(h, layer, DEC_TOKENS, arr((2, 4, 8)))
    return layer


def decoder_block(h: Harness) -> Any:
    layer = h.make("TransformerDecoderBlock", {"num_hiddens": 8, "ffn_num_hiddens": 16, "num_heads": 2})
    call(h, layer, arr((2, 3, 8)), arr((2, 4, 8)))
    return layer


def transformer(h: Harness) -> Any:
    layer = h.make("Transformer", {"src_vocab_size": 11, "tgt_vocab_size": 11, "num_hiddens": 8,
                                   "ffn_num_hiddens": 16, "num_heads": 2, "num_blks": 1})
    call(h, layer, DEC_TOKENS, DEC_TOKENS)
    return layer


def block_cache(h: Harness, batch: int = 2, cross: bool = True, rows: int = 5) -> list[Any]:
    """A well-formed cache of one decoder block of :func:`decoder` (capacity ``rows``, 4
    encoder positions), made here of random numbers: ``[self_pair, cross_pair]``."""
    pairs = [(arr((batch, 2, rows, 4)), arr((batch, 2, rows, 4)))]
    if cross:
        pairs.append((arr((batch, 2, 4, 4)), arr((batch, 2, 4, 4))))
    return [tuple(h.array(x) for x in pair) for pair in pairs]


def cached(c: Ctx, tokens: np.ndarray, cache: Any, *enc: np.ndarray, **kwargs: Any) -> Any:
    """A cached call of the row's decoder at position 1."""
    return call(c.h, c.layer, tokens, *enc, cache=cache, start=1, **kwargs)


def fn_decoder_weights(h: Harness, layer: str, *args: np.ndarray, **config: int) -> dict[str, Any]:
    """The weights of a NumPy layer (built by a call on ``args``), as the backend's arrays."""
    from backends import numpy as numpy_layers

    made = getattr(numpy_layers, layer)(**config, seed=0)
    made(*args)
    return {name: h.array(value) for name, value in made.get_weights().items()}


def fn_decoder(c: Ctx, enc_batch: int) -> Any:
    weights = fn_decoder_weights(c.h, "TransformerDecoder", DEC_TOKENS, arr((2, 4, 8)), vocab_size=11,
                                 num_hiddens=8, ffn_num_hiddens=16, num_heads=2, num_blks=1)
    return ac.transformer_decoder(c.h.array(DEC_TOKENS), weights, 2, c.h.array(arr((enc_batch, 4, 8))))


def fn_transformer(c: Ctx, tgt: np.ndarray) -> Any:
    weights = fn_decoder_weights(c.h, "Transformer", DEC_TOKENS, DEC_TOKENS, src_vocab_size=11,
                                 tgt_vocab_size=11, num_hiddens=8, ffn_num_hiddens=16, num_heads=2,
                                 num_blks=1)
    return ac.transformer_encoder_decoder(c.h.array(DEC_TOKENS), c.h.array(tgt), weights, 2)


def ragged_positions(c: Ctx, start: Any, own: bool = False, **kwargs: Any) -> Any:
    """The positions of one token of each of 2 examples from ``start`` (host data, or made the
    backend's array when ``own``), as a cached call of a ragged batch has them."""
    from attention_core.cache import positions_of

    return positions_of(c.h.ops, c.h.array(start) if own else start, 1, batch=2, **kwargs)


BATCH_ROWS: list[Bad] = [
    Bad("fn_decoder_enc_outputs_batch", "batch", lambda c: fn_decoder(c, 1), ValueError,
        "enc_outputs batch size (1) must equal tokens batch size (2)"),
    Bad("fn_transformer_batch", "batch", lambda c: fn_transformer(c, DEC_TOKENS[:1]), ValueError,
        "tgt_tokens batch size (1) must equal src_tokens batch size (2)"),
    Bad("decoder_enc_outputs_batch", "batch", lambda c: call(c.h, c.layer, DEC_TOKENS, arr((1, 4, 8))),
        ValueError, "enc_outputs batch size (1) must equal tokens batch size (2)", decoder),
    Bad("decoder_enc_outputs_bigger_batch", "batch",
        lambda c: call(c.h, c.layer, DEC_TOKENS, arr((3, 4, 8))),
        ValueError, "enc_outputs batch size (3) must equal tokens batch size (2)", decoder),
    Bad("decoder_block_enc_outputs_batch", "batch",
        lambda c: call(c.h, c.layer, arr((2, 3, 8)), arr((1, 4, 8))),
        ValueError, "enc_outputs batch size (1) must equal X batch size (2)", decoder_block),
    Bad("decoder_block_past_batch", "batch",
        lambda c: call(c.h, c.layer, arr((2, 1, 8)), arr((2, 4, 8)), past=arr((1, 2, 8))),
        ValueError, "past batch size (1) must equal X batch size (2)", decoder_block),
    Bad("transformer_batch", "batch", lambda c: call(c.h, c.layer, DEC_TOKENS, DEC_TOKENS[:1]),
        ValueError, "tgt_tokens batch size (1) must equal src_tokens batch size (2)", transformer),
    Bad("decoder_enc_valid_lens_shape", "batch",
        lambda c: call(c.h, c.layer, DEC_TOKENS, arr((2, 4, 8)), np.array([1, 2, 3])), ValueError,
        "enc_valid_lens must have shape (B,) or (B, Q) = (2,) or (2, 3), got (3,)", decoder),
    Bad("decoder_enc_valid_lens_range", "batch",
        lambda c: call(c.h, c.layer, DEC_TOKENS, arr((2, 4, 8)), [1, 9]), ValueError,
        "enc_valid_lens must be <= the number of keys (4), got 9", decoder),
    Bad("decoder_enc_valid_lens_dtype", "batch",
        lambda c: call(c.h, c.layer, DEC_TOKENS, arr((2, 4, 8)), np.array([1.0, 2.0], F32)),
        TypeError, "enc_valid_lens must have an integer dtype, got float32", decoder),
    Bad("decoder_enc_mask_shape", "batch",
        lambda c: call(c.h, c.layer, DEC_TOKENS, arr((2, 4, 8)), enc_mask=np.ones((3, 3, 4), bool)),
        ValueError, mask_message("(2, 2, 3, 4)", "(3, 3, 4)").replace("mask", "enc_mask", 1),
        decoder),
    Bad("decoder_enc_mask_dtype", "batch",
        lambda c: call(c.h, c.layer, DEC_TOKENS, arr((2, 4, 8)), enc_mask=np.ones((3, 4), "int32")),
        TypeError, "enc_mask must be boolean (True = may attend), got int32", decoder),
    Bad("transformer_src_valid_lens", "batch",
        lambda c: call(c.h, c.layer, DEC_TOKENS, DEC_TOKENS, np.array([1, 2, 3])), ValueError,
        "src_valid_lens must have shape (B,) or (B, Q) = (2,) or (2, 3), got (3,)", transformer),
    Bad("transformer_tgt_valid_lens", "batch",
        lambda c: call(c.h, c.layer, DEC_TOKENS, DEC_TOKENS, tgt_valid_lens=np.array([1, 2, 3])),
        ValueError, "tgt_valid_lens must have shape (B,) or (B, Q) = (2,) or (2, 3), got (3,)",
        transformer),
    Bad("cache_batch", "cache", lambda c: cached(c, DEC_TOKENS[:1, :1], [block_cache(c.h)]),
        ValueError, "cache[0] self pair keys batch size (2) must equal tokens batch size (1)",
        decoder),
    Bad("cache_cross_batch", "cache",
        lambda c: cached(c, DEC_TOKENS[:, :1], [[block_cache(c.h)[0], block_cache(c.h, 1)[1]]]),
        ValueError, "cache[0] cross pair keys batch size (1) must equal tokens batch size (2)",
        decoder),
    Bad("cache_enc_outputs_batch", "cache",
        lambda c: cached(c, DEC_TOKENS[:, :1], [block_cache(c.h)], arr((1, 4, 8))),
        ValueError, "enc_outputs batch size (1) must equal tokens batch size (2)", decoder),
    Bad("cache_entry_none", "cache", lambda c: cached(c, DEC_TOKENS[:, :1], [None]), TypeError,
        "cache[0] must be a block's cache, (self_pair,) or (self_pair, cross_pair), got NoneType",
        decoder),
    Bad("cache_missing_cross_pair", "cache",
        lambda c: cached(c, DEC_TOKENS[:, :1], [block_cache(c.h, cross=False)]), ValueError,
        "cache[0] must hold 2 pairs (self, cross) for this block, got 1", decoder),
    Bad("block_cache_pairs_none", "cache",
        lambda c: cached(c, arr((2, 1, 8)), [None, None]), TypeError,
        "cache self pair must be a pair (keys, values) of arrays, got NoneType", decoder_block),
    Bad("cache_enc_valid_lens", "cache",
        lambda c: cached(c, DEC_TOKENS[:, :1], [block_cache(c.h)], enc_valid_lens=np.array([1, 2, 3])),
        ValueError, "enc_valid_lens must have shape (B,) or (B, Q) = (2,) or (2, 1), got (3,)",
        decoder),
    Bad("ragged_start_batch", "batch",
        lambda c: ragged_positions(c, np.array([0, 1, 2], np.int32), own=True), ValueError,
        "start must be an int or have shape (B,) = (2,), got (3,)"),
    Bad("ragged_start_rank", "batch",
        lambda c: ragged_positions(c, np.zeros((2, 1), np.int32), own=True), ValueError,
        "start must be an int or have shape (B,) = (2,), got (2, 1)"),
    Bad("ragged_start_float", "batch",
        lambda c: ragged_positions(c, np.array([0.0, 1.0], F32), own=True), TypeError,
        "start must be an integer position, got dtype float32"),
    Bad("ragged_start_negative", "batch", lambda c: ragged_positions(c, np.array([3, -2])),
        ValueError, "start must be >= 0, got -2"),
    Bad("ragged_start_negative_list", "batch", lambda c: ragged_positions(c, [-1, 4]),
        ValueError, "start must be >= 0, got -1"),
    Bad("ragged_lengths_batch", "batch",
        lambda c: ragged_positions(c, [0, 1], lengths=np.array([1, 1, 1])), ValueError,
        "lengths must have shape (B,) = (2,), got (3,)"),
    Bad("ragged_lengths_range", "batch",
        lambda c: ragged_positions(c, [0, 1], lengths=np.array([1, 2])), ValueError,
        "lengths must be in [0, 1] (the call's positions), got 2"),
    Bad("ragged_padding", "batch", lambda c: ragged_positions(c, [0, 1], padding="middle"),
        ValueError, "padding must be 'left' or 'right', got 'middle'"),
    Bad("ragged_padding_mask_dtype", "batch",
        lambda c: ragged_positions(c, [0, 1], padding_mask=np.ones((2, 1), np.int32)), TypeError,
        "padding_mask must be boolean (True = a real token), got int32"),
]


# -- scale and attention sinks

#: The envs of the converters to native layers, by converter.
_SINK_CONVERTERS = {"to_torch": ("torch", "backends.torch.convert"),
                    "to_keras": ("tensorflow", "backends.keras.convert"),
                    "to_flax": ("jax", "backends.jax.convert")}


def scale_message(got: str) -> str:
    return f"scale must be a positive finite float or None, got {got}"


def sinks_mha(h: Harness) -> Any:
    """MultiHeadAttention(8, 2, sinks=True), given weights (queries 3, keys 4, values 5 wide)."""
    layer = h.make("MultiHeadAttention", {"num_hiddens": 8, "num_heads": 2, "sinks": True})
    layer.set_weights(unbuilt_mha_weights(F32, sink_logits=arr((2,))))
    return layer


def to_native_with_sinks(converter: str) -> Any:
    module = importlib.import_module(_SINK_CONVERTERS[converter][1])
    weights = {name: arr(shape) for name, shape in {**MHA, "W_v.kernel": (8, 8)}.items()}
    return getattr(module, converter)({**weights, "sink_logits": arr((2,))}, 2)


def converter_env(converter: str) -> tuple[tuple[str, str], ...]:
    """``without`` for a converter row: it runs in its framework's env alone."""
    env = _SINK_CONVERTERS[converter][0]
    return tuple((other, f"{converter} runs in the {env} env")
                 for other in ("numpy", "torch", "tensorflow", "jax", "mxnet") if other != env)


SCALE_SINK_ROWS: list[Bad] = [
    Bad("dot_scale_zero", "sizes", lambda c: c.h.module.DotProductAttention(scale=0), ValueError,
        scale_message("0")),
    Bad("mha_scale_infinite", "sizes",
        lambda c: c.h.module.MultiHeadAttention(8, 2, scale=float("inf")), ValueError,
        scale_message("inf")),
    Bad("block_scale_string", "sizes",
        lambda c: c.h.module.TransformerEncoderBlock(8, 16, 2, scale="0.5"), ValueError,
        scale_message("'0.5'")),
    Bad("decoder_scale_negative", "sizes",
        lambda c: c.h.module.TransformerDecoder(11, 8, 16, 2, 1, scale=-1.0), ValueError,
        scale_message("-1.0")),
    Bad("transformer_scale_flag", "sizes",
        lambda c: c.h.module.Transformer(11, 11, 8, 16, 2, 1, scale=True), ValueError,
        scale_message("True")),
    Bad("fn_mha_scale_nan", "sizes", lambda c: ac.multi_head_attention(
        *(c.h.array(a) for a in qkv()), fn_weights(c.h, MHA), 2, scale=float("nan")),
        ValueError, scale_message("nan")),
    Bad("mha_sinks_not_flag", "sizes",
        lambda c: c.h.module.MultiHeadAttention(8, 2, sinks=1), TypeError,
        "sinks must be True or False, got 1"),
    Bad("set_weights_without_sinks", "set_weights",
        lambda c: c.layer.set_weights({k: v for k, v in c.layer.get_weights().items()
                                       if k != "sink_logits"}), ValueError,
        names_message("set_weights", ["sink_logits"], [], [*MHA, "sink_logits"]), sinks_mha),
    Bad("set_weights_sinks_shape", "set_weights",
        lambda c: c.layer.set_weights({**c.layer.get_weights(), "sink_logits": arr((3,))}), ValueError,
        "set_weights: sink_logits has shape (3,), expected (2,)", sinks_mha),
    Bad("set_weights_sinks_without_sinks", "set_weights",
        lambda c: c.layer.set_weights({**c.layer.get_weights(), "sink_logits": arr((2,))}), ValueError,
        names_message("set_weights", [], ["sink_logits"], MHA), mha),
    Bad("fn_mha_sinks_shape", "functional_weights", lambda c: fn_mha(c, sink_logits=arr((3,))),
        ValueError, "multi_head_attention: sink_logits has shape (3,), expected (2,)"),
    Bad("fn_relative_sinks", "functional_weights", lambda c: fn_relative(c, sink_logits=arr((3,))),
        ValueError, names_message("relative_multi_head_attention", [], ["sink_logits"], RELATIVE)),
    Bad("fn_block_sinks_shape", "functional_weights",
        lambda c: fn_block(c, **{"attention.sink_logits": arr((2,))}), ValueError,
        "transformer_encoder_block: attention.sink_logits has shape (2,), expected (3,)"),
    *[Bad(f"{converter}_sinks", "converter", lambda c, converter=converter:
          to_native_with_sinks(converter), ValueError,
          names_message(converter, [], ["sink_logits"], MHA), without=converter_env(converter))
      for converter in _SINK_CONVERTERS],
]


# -- greedy and beam search, rotary options

#: The decoder the search rows decode with (V = 11), made and called once.
SEARCH_DECODER = {"vocab_size": 11, "num_hiddens": 8, "ffn_num_hiddens": 8, "num_heads": 2,
                  "num_blks": 1, "decoder_only": True, "keep_attention_weights": False}


def search_decoder(h: Harness) -> Any:
    layer = h.make("TransformerDecoder", SEARCH_DECODER)
    call(h, layer, np.array([[1, 2, 3], [4, 5, 6]]))
    return layer


def search(c: Ctx, bos: Any = (1, 2), *, beam: bool = False, **kwargs: Any) -> Any:
    """A greedy (or, with ``beam``, a beam) search of 3 tokens with the row's decoder and its
    cache; ``bos`` as the backend's array when a tuple, else as given."""
    def step(ids: Any, cache: Any, start: int) -> Any:
        if cache is None:
            return c.h.call(c.layer, ids, capacity=4)
        return c.h.call(c.layer, ids, cache=cache, start=start)

    first = c.h.array(np.array(bos)) if isinstance(bos, tuple) else bos
    if beam:
        return ac.beam_search(step, first, kwargs.pop("max_steps", 3), **kwargs)
    return ac.greedy_search(step, first, kwargs.pop("max_steps", 3), **kwargs)


def made(c: Ctx, name: str, config: dict[str, Any]) -> Any:
    """A layer made by the backend's class itself (its ``check`` runs at construction)."""
    return getattr(c.h.module, name)(**config)


ODD_ROTARY = {"num_hiddens": 6, "ffn_num_hiddens": 8, "num_heads": 2, "positional": "rotary"}
ODD_ROTARY_MESSAGE = ("rotary positions need an even depth per head, got 3: the rotation turns "
                      "pairs of features")
VOCAB = "[0, vocab_size) = [0, 11)"


def choosing(c: Ctx, logits: Any = None, **settings: Any) -> Any:
    """``choose`` on the backend's logits ``(4, 8)`` (or ``logits``), sampling by default."""
    x = c.h.array(arr((4, 8))) if logits is None else logits
    if "state" not in settings:
        settings["state"] = c.h.ops.new_sampling_state(0, like=x)
    return ac.choose(c.h.ops, x, **{"temperature": 1.0, **settings})


def generating(c: Ctx, prompts: Any = ((1, 2), (3, 4)), **kwargs: Any) -> Any:
    """``generate`` of 3 tokens with the row's decoder; ``prompts`` as the backend's array
    when a tuple, else as given."""
    def step(ids: Any, cache: Any, start: int) -> Any:
        if cache is None:
            return c.h.call(c.layer, ids, capacity=6)
        return c.h.call(c.layer, ids, cache=cache, start=start)

    given = c.h.array(np.array(prompts)) if isinstance(prompts, tuple) else prompts
    return ac.generate(step, given, **{"max_new_tokens": 3, **kwargs})


SAMPLING_STATE = ("sampling (temperature > 0) needs state=: a generator from "
                  "ops.new_sampling_state(seed), or the state the last call returned")


def windowed_mha(h: Harness) -> Any:
    """A built rotary MultiHeadAttention with a window of 4: its caches are rings of 4 rows."""
    layer = h.make("MultiHeadAttention", {"num_hiddens": 8, "num_heads": 2,
                                          "positional": "rotary", "window": 4})
    call(h, layer, *qkv())
    return layer


def ring_call(c: Ctx, **kwargs: Any) -> Any:
    """A cached call of 3 positions of the row's windowed layer on a ring of its 4 rows."""
    ring = tuple(c.h.array(np.zeros((2, 2, 4, 4), np.float32)) for _ in range(2))
    return call(c.h, c.layer, *qkv(q=(2, 3, 8), k=(2, 3, 8), v=(2, 3, 5)), cache=ring, **kwargs)


def two_block_decoder(h: Harness) -> Any:
    """A :func:`decoder` of two blocks, called once."""
    layer = h.make("TransformerDecoder", {"vocab_size": 11, "num_hiddens": 8, "ffn_num_hiddens": 16,
                                          "num_heads": 2, "num_blks": 2})
    call(h, layer, DEC_TOKENS, arr((2, 4, 8)))
    return layer


GENERATION_ROWS: list[Bad] = [
    # a stack places a call's tokens once for all its blocks: their caches hold the same rows
    Bad("cache_blocks_rows", "cache",
        lambda c: cached(c, DEC_TOKENS[:, :1], [block_cache(c.h), block_cache(c.h, rows=3)]),
        ValueError, "cache[1] self pair keys must have cache[0]'s 5 rows (C), got 3",
        two_block_decoder),
    # a cached attention layer: its keys are the cache's rows
    Bad("cached_layer_valid_lens", "mask",
        lambda c: call(c.h, c.layer, *qkv(q=(2, 3, 8), k=(2, 3, 8), v=(2, 3, 5)),
                       np.array([1, 2]), capacity=4), ValueError,
        "valid_lens must be None in a cached call (cache or capacity given): the cache's rows "
        "up to each query's position are its keys", mha),
    Bad("cached_layer_segment_ids", "mask",
        lambda c: call(c.h, c.layer, *qkv(q=(2, 3, 8), k=(2, 3, 8), v=(2, 3, 5)),
                       segment_ids=np.zeros((2, 3), np.int32), capacity=4), ValueError,
        "segment_ids must be None in a cached call (cache or capacity given): the cache's rows "
        "up to each query's position are its keys", dot),
    Bad("uncached_layer_lengths", "mask",
        lambda c: call(c.h, c.layer, *qkv(q=(2, 3, 8), k=(2, 3, 8), v=(2, 3, 5)),
                       lengths=np.array([1, 2])), ValueError,
        "lengths is an argument of a cached call: give cache or capacity too (uncached calls "
        "take valid_lens or mask)", mha),
    Bad("cached_layer_start_batch", "sizes",
        lambda c: call(c.h, c.layer, *qkv(q=(2, 3, 8), k=(2, 3, 8), v=(2, 3, 5)),
                       start=np.array([0, 0, 0]), capacity=4), ValueError,
        "start must be an int or have shape (B,) = (2,), got (3,)", mha),
    Bad("generate_lengths_past_prompts", "sizes",
        lambda c: generating(c, lengths=np.array([2, 3])), ValueError,
        "lengths must be in [1, T] = [1, 2], got [2, 3]", search_decoder),
    Bad("generate_lengths_float", "dtype",
        lambda c: generating(c, lengths=np.array([1.0, 2.0])), TypeError,
        "lengths must have an integer dtype, got float64", search_decoder),
    Bad("generate_padding_unknown", "sizes",
        lambda c: generating(c, lengths=np.array([1, 2]), padding="middle"), ValueError,
        "padding must be 'left' or 'right', got 'middle'", search_decoder),
    Bad("cached_decoder_lengths_shape", "sizes",
        lambda c: call(c.h, c.layer, np.array([[1, 2], [3, 4]]), capacity=4,
                       start=np.zeros(2, np.int32), lengths=np.array([1, 2, 2])), ValueError,
        "lengths must have shape (B,) = (2,), got (3,)", search_decoder),
    Bad("cached_layer_other_width", "mismatch",
        lambda c: call(c.h, c.layer, *qkv(q=(2, 3, 8), k=(2, 3, 8), v=(2, 3, 8)), capacity=4),
        ValueError, "values last dimension (8) must be 5, the size this layer was built for",
        mha),
    Bad("cached_layer_start_past_capacity", "sizes",
        lambda c: call(c.h, c.layer, *qkv(q=(2, 3, 8), k=(2, 3, 8), v=(2, 3, 5)), start=2,
                       capacity=4), ValueError,
        "start + positions must be <= the cache's capacity (4), got start 2 + 3 positions = 5",
        mha),
    # a windowed layer's ring: positions past its rows, but within the rotary tables
    Bad("ring_past_rotary_positions", "sizes",
        lambda c: call(c.h, c.layer, *qkv(q=(2, 3, 8), k=(2, 3, 8), v=(2, 3, 5)),
                       start=2 ** 22 - 2, capacity=8), ValueError,
        "rotary positions must be in [0, 4194304), got [4194302, 4194304]", windowed_mha),
    Bad("ring_other_capacity", "mismatch", lambda c: ring_call(c, start=3, capacity=2),
        ValueError, "capacity (2) must make the given cache's 4 rows: a windowed layer keeps "
        "min(capacity, window) = min(2, 4) = 2", windowed_mha),
    # ids against the vocabulary: the step's V, or vocab_size before any step
    Bad("search_eos_past_vocabulary", "tokens", lambda c: search(c, eos=11), ValueError,
        f"eos must be in {VOCAB}, got 11", search_decoder),
    Bad("beam_eos_past_vocabulary", "tokens", lambda c: search(c, beam=True, beam_size=2, eos=11),
        ValueError, f"eos must be in {VOCAB}, got 11", search_decoder),
    Bad("search_eos_past_vocab_size", "tokens", lambda c: search(c, eos=11, vocab_size=11),
        ValueError, f"eos must be in {VOCAB}, got 11", search_decoder),
    Bad("search_eos_negative", "tokens", lambda c: search(c, eos=-1), ValueError,
        "eos must be in [0, vocab_size), got -1", search_decoder),
    Bad("search_eos_float", "tokens", lambda c: search(c, eos=2.0), TypeError,
        "eos must be None or an int token id, got float", search_decoder),
    Bad("search_eos_bool", "tokens", lambda c: search(c, beam=True, eos=True), TypeError,
        "eos must be None or an int token id, got bool", search_decoder),
    Bad("search_bos_past_vocab_size", "tokens", lambda c: search(c, (1, 12), vocab_size=11),
        ValueError, f"bos must be in {VOCAB}, got 12", search_decoder),
    Bad("search_bos_list_past_vocab_size", "tokens",
        lambda c: search(c, [1, 12], beam=True, vocab_size=11), ValueError,
        f"bos must be in {VOCAB}, got 12", search_decoder),
    Bad("search_bos_negative", "tokens", lambda c: search(c, (1, -1)), ValueError,
        "bos must be in [0, vocab_size), got -1", search_decoder),
    Bad("search_bos_float", "dtype", lambda c: search(c, [1.0, 2.0]), TypeError,
        "bos must be integer start tokens of shape (B,), got dtype float64", search_decoder),
    Bad("search_bos_matrix", "tokens", lambda c: search(c, [[1], [2]]), ValueError,
        "bos must be integer start tokens of shape (B,) with B >= 1, got shape (2, 1)",
        search_decoder),
    Bad("search_bos_ragged", "tokens", lambda c: search(c, [1, [2, 3]]), TypeError,
        "bos must be integer start tokens of shape (B,), got list", search_decoder),
    # the other arguments, each by type and range
    Bad("search_length_penalty_str", "sizes",
        lambda c: search(c, beam=True, length_penalty="0.75"), TypeError,
        "length_penalty must be a real number >= 0, got str", search_decoder),
    Bad("search_length_penalty_bool", "sizes",
        lambda c: search(c, beam=True, length_penalty=True), TypeError,
        "length_penalty must be a real number >= 0, got bool", search_decoder),
    Bad("search_vocab_size_zero", "sizes", lambda c: search(c, vocab_size=0), ValueError,
        "vocab_size must be a positive int, got 0", search_decoder),
    Bad("search_vocab_size_not_the_steps", "sizes", lambda c: search(c, vocab_size=12),
        ValueError, "the step must return logits of shape (N, t, V) with V = vocab_size = 12, "
        "got V = 11", search_decoder),
    # rotary: odd heads refused when made, as MultiHeadAttention does; names as passed
    Bad("decoder_rotary_odd_depth", "sizes",
        lambda c: made(c, "TransformerDecoder", {"vocab_size": 11, "num_blks": 1, **ODD_ROTARY}),
        ValueError, ODD_ROTARY_MESSAGE, search_decoder),
    Bad("decoder_block_rotary_odd_depth", "sizes",
        lambda c: made(c, "TransformerDecoderBlock", ODD_ROTARY), ValueError, ODD_ROTARY_MESSAGE,
        search_decoder),
    Bad("functional_rotary_base_one", "sizes",
        lambda c: ac.rotary_embedding(c.h.array(arr((2, 3, 4))), base=1.0), ValueError,
        "base must be a finite number > 1, got 1.0"),
    # sampling settings, on the device's logits and through generate
    Bad("choose_temperature_negative", "sizes", lambda c: choosing(c, temperature=-1.0),
        ValueError, "temperature must be None or a finite number >= 0, got -1.0"),
    Bad("choose_temperature_nan", "sizes", lambda c: choosing(c, temperature=float("nan")),
        ValueError, "temperature must be None or a finite number >= 0, got nan"),
    Bad("choose_temperature_str", "sizes", lambda c: choosing(c, temperature="1"), TypeError,
        "temperature must be None or a real number >= 0, got str"),
    Bad("choose_top_k_zero", "sizes", lambda c: choosing(c, top_k=0), ValueError,
        "top_k must be None or an int in [1, V] = [1, 8], got 0"),
    Bad("choose_top_k_past_vocabulary", "sizes", lambda c: choosing(c, top_k=9), ValueError,
        "top_k must be None or an int in [1, V] = [1, 8], got 9"),
    Bad("choose_top_k_float", "sizes", lambda c: choosing(c, top_k=4.0), TypeError,
        "top_k must be None or a positive int, got float"),
    Bad("choose_top_p_zero", "sizes", lambda c: choosing(c, top_p=0), ValueError,
        "top_p must be None or a number in (0, 1], got 0"),
    Bad("choose_top_p_above_one", "sizes", lambda c: choosing(c, top_p=1.5), ValueError,
        "top_p must be None or a number in (0, 1], got 1.5"),
    Bad("choose_top_p_str", "sizes", lambda c: choosing(c, top_p="0.9"), TypeError,
        "top_p must be None or a number in (0, 1], got str"),
    Bad("choose_without_state", "sizes", lambda c: choosing(c, state=None), ValueError,
        SAMPLING_STATE),
    Bad("choose_logits_rank_3", "rank", lambda c: choosing(c, c.h.array(arr((2, 3, 8)))),
        ValueError, "logits must have shape (B, V) with V >= 1, got shape (2, 3, 8)"),
    Bad("choose_logits_int", "dtype",
        lambda c: choosing(c, c.h.array(np.ones((2, 8), np.int32)), temperature=0), TypeError,
        "logits must be floating point (float16, bfloat16, float32, float64), got int32"),
    Bad("generate_temperature_negative", "sizes", lambda c: generating(c, temperature=-0.5),
        ValueError, "temperature must be None or a finite number >= 0, got -0.5", search_decoder),
    Bad("generate_top_k_past_vocabulary", "sizes",
        lambda c: generating(c, temperature=1.0, top_k=12), ValueError,
        "top_k must be None or an int in [1, V] = [1, 11], got 12", search_decoder),
    Bad("generate_top_k_past_vocab_size", "sizes",
        lambda c: generating(c, top_k=12, vocab_size=11), ValueError,
        "top_k must be None or an int in [1, V] = [1, 11], got 12", search_decoder),
    Bad("generate_max_new_tokens_zero", "sizes", lambda c: generating(c, max_new_tokens=0),
        ValueError, "max_new_tokens must be a positive int, got 0", search_decoder),
    Bad("generate_seed_negative", "sizes", lambda c: generating(c, temperature=1.0, seed=-1),
        ValueError, "seed must be an int in [0, 2**31), got -1", search_decoder),
    Bad("generate_seed_float", "sizes", lambda c: generating(c, seed=1.0), TypeError,
        "seed must be an int in [0, 2**31), got float", search_decoder),
    Bad("generate_pad_id_past_vocabulary", "tokens", lambda c: generating(c, eos=0, pad_id=11),
        ValueError, f"pad_id must be in {VOCAB}, got 11", search_decoder),
    Bad("generate_pad_id_none", "tokens", lambda c: generating(c, pad_id=None), TypeError,
        "pad_id must be an int token id, got NoneType", search_decoder),
    Bad("generate_prompts_float", "dtype",
        lambda c: generating(c, c.h.array(np.ones((2, 3), np.float32))), TypeError,
        "prompts must be integer token ids of shape (B, T), got dtype float32", search_decoder),
    Bad("generate_prompts_vector", "tokens", lambda c: generating(c, (1, 2)), ValueError,
        "prompts must be integer token ids of shape (B, T) with B, T >= 1, got shape (2,)",
        search_decoder),
    Bad("generate_prompts_ragged", "tokens", lambda c: generating(c, [[1, 2], [3]]), TypeError,
        "prompts must be integer token ids of shape (B, T), got list", search_decoder),
    Bad("generate_prompts_past_vocab_size", "tokens",
        lambda c: generating(c, [[1, 2], [3, 12]], vocab_size=11), ValueError,
        f"prompts must be in {VOCAB}, got 12", search_decoder),
]


# -- token ids and other inputs as NumPy arrays or Python lists, keys and paths of weights


def save_in_tmp(c: Ctx, path: str, layer: Any) -> None:
    """``save_weights`` to ``path`` relative to the row's directory (as a user types it)."""
    c.monkeypatch.chdir(c.tmp)
    ac.save_weights(path, layer)


def with_bad_keys(weights: dict[str, Any], *keys: Any) -> dict[Any, Any]:
    """``weights`` with entries under keys that are not names (the first entry's value)."""
    first = next(iter(weights.values()))
    return {**weights, **dict.fromkeys(keys, first)}


def ids_call(c: Ctx, tokens: Any, *host: Any) -> Any:
    """Calls the row's layer on token ids (and lengths) as the user gives them: lists, NumPy."""
    return c.h.call(c.layer, tokens, *host)


HOST_ROWS: list[Bad] = [
    # token ids as nested lists or NumPy arrays on every backend: read as given, then checked
    Bad("tokens_ragged_lists", "tokens", lambda c: ids_call(c, [[1, 2, 3], [4, 5]]), ValueError,
        "tokens must have shape (B, T) token ids, got nested lists whose rows differ in length",
        encoder),
    Bad("tokens_float_lists", "tokens", lambda c: ids_call(c, [[1.0, 2.0], [3.0, 4.0]]), TypeError,
        "tokens must be integer token ids, got dtype float64", encoder),
    Bad("tokens_list_out_of_range", "tokens", lambda c: ids_call(c, [[1, 2], [3, 11]], [2, 1]),
        ValueError, "tokens must be in [0, vocab_size) = [0, 11), got 11", encoder),
    Bad("tokens_list_rank", "tokens", lambda c: ids_call(c, [1, 2, 3]), ValueError,
        "tokens must have shape (B, T) token ids, got (3,)", encoder),
    Bad("tokens_numpy_beyond_int32", "tokens", lambda c: ids_call(c, np.array([[1, 2**32 + 3]])),
        ValueError, "tokens must be in [0, vocab_size) = [0, 11), got 4294967299", encoder),
    # inputs computed on must be arrays: nested lists are refused by name, before any weight
    Bad("queries_nested_lists_unbuilt", "framework",
        lambda c: c.h.call(c.layer, arr((2, 4, 8)).tolist(), *(c.h.array(a) for a in qkv()[1:])),
        TypeError, f"queries must be an array of {BACKENDS.replace(', mxnet', ' or mxnet')}, "
        "got list", fresh_mha),
    Bad("keys_nested_lists_unbuilt", "framework",
        lambda c: c.h.call(c.layer, c.h.array(arr((2, 4, 8))), arr((2, 6, 8)).tolist(),
                           c.h.array(arr((2, 6, 5)))),
        TypeError, "keys must be a {backend} array like queries, got list", fresh_mha),
    # weights files: the path the user gave is named, not the library's temporary file
    Bad("save_to_directory", "save_weights", lambda c: save_in_tmp(c, "sub", c.layer),
        IsADirectoryError, "save_weights: path 'sub' is a directory, expected a file path", mha,
        files=lambda p: (p.parent / "sub").mkdir()),
    Bad("save_into_missing_directory", "save_weights",
        lambda c: save_in_tmp(c, "missing/w.safetensors", c.layer), FileNotFoundError,
        "save_weights: cannot write 'missing/w.safetensors': the directory 'missing' does not "
        "exist", mha),
    Bad("save_under_a_file", "save_weights",
        lambda c: save_in_tmp(c, "w.safetensors/w.safetensors", c.layer), NotADirectoryError,
        "save_weights: cannot write 'w.safetensors/w.safetensors': 'w.safetensors' is not a "
        "directory", mha, files=good_file),
    # weights mappings: keys must be names
    Bad("set_weights_keys_not_str", "set_weights",
        lambda c: c.layer.set_weights(with_bad_keys(c.layer.get_weights(), None, 1)), TypeError,
        "set_weights: weight names must be str, got None, 1", mha),
    Bad("fn_weights_keys_not_str", "functional_weights",
        lambda c: ac.multi_head_attention(*(c.h.array(a) for a in qkv()),
                                          with_bad_keys(fn_weights(c.h, MHA), None, b"W_q"), 2),
        TypeError, "multi_head_attention: weight names must be str, got None, b'W_q'"),
    Bad("save_weights_keys_not_str", "save_weights",
        lambda c: ac.save_weights(c.file(), with_bad_keys({"w": arr((2,))}, 3)), TypeError,
        "save_weights: weight names must be str, got 3", files=good_file),
]


# -- converters of native layers

#: The backends whose envs have the native layers' frameworks.
_NATIVE_ENVS = ("numpy", "torch", "tensorflow", "jax", "mxnet")


def _only(backend: str) -> tuple[tuple[str, str], ...]:
    """``without`` for a converter row: it runs in the env of ``backend`` alone."""
    return tuple((other, f"the converter of {backend}'s layers runs in the {backend} env")
                 for other in _NATIVE_ENVS if other != backend)


def _torch_mha(removed: str) -> Any:
    """A torch MultiheadAttention (8 wide, 2 heads) with the parameter ``removed`` set to None."""
    import torch

    module = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    owner, _, leaf = removed.rpartition(".")
    setattr(module.get_submodule(owner), leaf, None)
    return module


def _torch_encoder_layer(removed: str) -> Any:
    import torch

    layer = torch.nn.TransformerEncoderLayer(8, 2, 12, batch_first=True)
    owner, _, leaf = removed.rpartition(".")
    setattr(layer.get_submodule(owner), leaf, None)
    return layer


def _keras_mha_without_output_bias() -> Any:
    import keras

    layer = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)
    layer.build((None, None, 8), (None, None, 8))
    layer._output_dense.bias = None
    return layer


def _flax_params_for(use_bias: bool) -> tuple[Any, Any]:
    """Params of a biased Flax attention layer, and a module with ``use_bias``."""
    import flax.linen as nn
    import jax

    x = np.zeros((1, 3, 8), np.float32)
    variables = nn.MultiHeadDotProductAttention(num_heads=2).init(jax.random.key(0), x, x)
    return variables, nn.MultiHeadDotProductAttention(num_heads=2, use_bias=use_bias)


_PARTIAL = "; this library's MultiHeadAttention has biases on all four projections or none"

#: A tiny Hugging Face Llama config (width 8, 2 heads, 1 key/value head, 2 layers).
_HF = {"model_type": "llama", "vocab_size": 11, "hidden_size": 8, "intermediate_size": 12,
       "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1}


def _hf(**changes: Any) -> Any:
    """``hf_config`` of :data:`_HF` with ``changes``."""
    from attention_core import convert_hf

    return convert_hf.hf_config({**_HF, **changes})


def _hf_state(c: Ctx, **changes: Any) -> dict[str, Any]:
    """A state dict of :data:`_HF` in the backend's arrays, ``changes`` applied (None: removed)."""
    from attention_core import convert_hf

    state = {hf: arr(shape[::-1] if transposed else shape)
             for hf, shape, transposed in convert_hf.hf_names(convert_hf.hf_config(_HF)).values()}
    state.update(changes)
    return {key: c.h.array(value) for key, value in state.items() if value is not None}


def _from_hf(c: Ctx, config: Any = None, **changes: Any) -> Any:
    from attention_core import convert_hf

    return convert_hf.from_hf_llama(_hf_state(c, **changes), config or _HF)


def _to_hf(**changes: Any) -> Any:
    from attention_core import convert_hf

    return convert_hf.to_hf_llama({}, {**convert_hf.hf_config(_HF), **changes})


_HF_KEY = "model.layers.0.self_attn.k_proj.weight"

CONVERTER_ROWS: list[Bad] = [
    Bad("from_torch_in_proj_bias_none", "converter",
        lambda c: importlib.import_module("backends.torch.convert").from_torch(
            _torch_mha("in_proj_bias")), ValueError,
        "from_torch: biases on ['out_proj.bias'] only, none on ['in_proj_bias']" + _PARTIAL,
        without=_only("torch")),
    Bad("torch_config_out_proj_bias_none", "converter",
        lambda c: importlib.import_module("backends.torch.convert").torch_config(
            _torch_mha("out_proj.bias")), ValueError,
        "torch_config: biases on ['in_proj_bias'] only, none on ['out_proj.bias']" + _PARTIAL,
        without=_only("torch")),
    Bad("from_torch_out_proj_weight_none", "converter",
        lambda c: importlib.import_module("backends.torch.convert").from_torch(
            _torch_mha("out_proj.weight")), ValueError,
        "from_torch: out_proj.weight is None, but this library's layer has it (W_o.kernel)",
        without=_only("torch")),
    Bad("from_torch_encoder_layer_linear_weight_none", "converter",
        lambda c: importlib.import_module("backends.torch.convert").from_torch_encoder_layer(
            _torch_encoder_layer("linear2.weight")), ValueError,
        "from_torch_encoder_layer: linear2.weight is None, but this library's layer has it "
        "(ffn.dense2.kernel)", without=_only("torch")),
    Bad("from_keras_output_bias_none", "converter",
        lambda c: importlib.import_module("backends.keras.convert").from_keras(
            _keras_mha_without_output_bias()), ValueError,
        "from_keras: biases on ['query.bias', 'key.bias', 'value.bias'] only, none on "
        "['out.bias']" + _PARTIAL, without=_only("tensorflow")),
    Bad("from_flax_module_without_bias", "converter",
        lambda c: importlib.import_module("backends.jax.convert").from_flax(
            *_flax_params_for(use_bias=False)), ValueError,
        "from_flax: the params are those of 2 heads with biases, but the module has "
        "num_heads=2, use_bias=False: pass the module that made them", without=_only("jax")),
    Bad("hf_unknown_key", "converter",
        lambda c: _from_hf(c, **{"model.layers.2.mlp.up_proj.weight": arr((12, 8))}), ValueError,
        "from_hf_llama: unexpected key 'model.layers.2.mlp.up_proj.weight': the config's model "
        "has no such weight"),
    Bad("hf_missing_key", "converter",
        lambda c: _from_hf(c, **{"model.layers.1.post_attention_layernorm.weight": None}),
        ValueError, "from_hf_llama: missing key 'model.layers.1.post_attention_layernorm.weight'"),
    Bad("hf_misshapen_key", "converter", lambda c: _from_hf(c, **{_HF_KEY: arr((8, 8))}),
        ValueError, f"from_hf_llama: {_HF_KEY!r} has shape (8, 8), expected (4, 8)"),
    Bad("hf_integer_weight", "converter",
        lambda c: _from_hf(c, **{"model.norm.weight": np.ones(8, np.int32)}), TypeError,
        "from_hf_llama: 'model.norm.weight' must be floating point, got int32"),
    Bad("hf_untied_without_lm_head", "converter",
        lambda c: _from_hf(c, {**_HF, "tie_word_embeddings": False}, **{"lm_head.weight": None}),
        ValueError,
        "from_hf_llama: missing key 'lm_head.weight' (the config has tie_word_embeddings: "
        "false)"),
    Bad("hf_tied_lm_head_differs", "converter",
        lambda c: _from_hf(c, {**_HF, "tie_word_embeddings": True},
                           **{"lm_head.weight": arr((11, 8))}), ValueError,
        "from_hf_llama: lm_head.weight differs from model.embed_tokens.weight, but the config "
        "has tie_word_embeddings: true"),
    Bad("hf_both_prefixes", "converter",
        lambda c: _from_hf(c, **{"norm.weight": arr((8,))}), ValueError,
        "from_hf_llama: state has both 'model.norm.weight' and 'norm.weight'"),
    Bad("hf_config_head_dim", "converter", lambda c: _hf(head_dim=8), ValueError,
        "hf_config: head_dim is 8, but hidden_size / num_attention_heads is 8 / 2; this "
        "library's heads are num_hiddens / num_heads wide"),
    Bad("hf_config_rope_type", "converter",
        lambda c: _hf(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}),
        ValueError, "hf_config: rope_parameters['rope_type'] is 'llama3'; only 'default' "
        "rotary positions are supported (no rope scaling)"),
    Bad("hf_config_rope_scaling", "converter",
        lambda c: _hf(rope_scaling={"type": "linear", "factor": 2.0}), ValueError,
        "hf_config: rope_scaling['type'] is 'linear'; only 'default' rotary positions are "
        "supported (no rope scaling)"),
    Bad("hf_config_hidden_act", "converter", lambda c: _hf(hidden_act="gelu"), ValueError,
        "hf_config: hidden_act 'gelu' is not supported; expected 'silu' (SwiGLU)"),
    Bad("hf_config_gemma", "converter", lambda c: _hf(model_type="gemma"), ValueError,
        "hf_config: model_type 'gemma' is not supported; expected one of ('llama', 'mistral', "
        "'qwen2'); Gemma's RMSNorm scales by 1 + weight and its embeddings by "
        "sqrt(hidden_size), which a Llama-family decoder does not"),
    Bad("hf_config_mixed_layer_types", "converter",
        lambda c: _hf(model_type="qwen2", sliding_window=4,
                      layer_types=["full_attention", "sliding_attention"]), ValueError,
        "hf_config: layer_types mixes ['full_attention', 'sliding_attention']; this library's "
        "decoder gives every block the same attention"),
    Bad("hf_config_qwen2_max_window_layers", "converter",
        lambda c: _hf(model_type="qwen2", use_sliding_window=True, sliding_window=4,
                      max_window_layers=1), ValueError,
        "hf_config: layer_types (from use_sliding_window and max_window_layers) mixes "
        "['full_attention', 'sliding_attention']; this library's decoder gives every block "
        "the same attention"),
    Bad("hf_config_missing_key", "converter",
        lambda c: _hf(intermediate_size=None), ValueError,
        "hf_config: config has no 'intermediate_size'"),
    Bad("hf_config_not_a_mapping", "converter",
        lambda c: importlib.import_module("attention_core.convert_hf").hf_config(3), TypeError,
        "hf_config: config must be a mapping or the path of a config.json, got int"),
    Bad("to_hf_layer_norm", "converter", lambda c: _to_hf(norm="layer"), ValueError,
        "to_hf_llama: kwargs['norm'] is 'layer'; a Llama-family model has 'rms'"),
    Bad("to_hf_sinks", "converter", lambda c: _to_hf(sinks=True), ValueError,
        "to_hf_llama: kwargs['sinks'] is True; a Llama-family model has False"),
]


def _block(c: Ctx, name: str = "TransformerEncoderBlock", **changes: Any) -> Any:
    """A block or stack of width 8 made with ``changes`` to its arguments."""
    sizes = {"num_hiddens": 8, "ffn_num_hiddens": 16, "num_heads": 2}
    if name != "TransformerEncoderBlock" and "Block" not in name:
        sizes = {"vocab_size": 11, "num_blks": 1, **sizes}
    return getattr(c.h.module, name)(**sizes, **changes)


_BIAS = "bias must be True, False or 'qkv' (biases on W_q, W_k and W_v only), got "

#: The options of current-model blocks and stacks: norms, activations, biases.
BLOCK_ROWS: list[Bad] = [
    Bad("block_unknown_norm", "sizes", lambda c: _block(c, norm="batch"), ValueError,
        "norm must be 'layer' or 'rms', got 'batch'"),
    Bad("decoder_unknown_activation", "sizes",
        lambda c: _block(c, "TransformerDecoder", activation="silu"), ValueError,
        "activation must be 'relu', 'gelu' or 'swiglu', got 'silu'"),
    Bad("decoder_block_bias_string", "sizes",
        lambda c: _block(c, "TransformerDecoderBlock", bias="qk"), ValueError, _BIAS + "'qk'"),
    Bad("encoder_bias_number", "sizes", lambda c: _block(c, "TransformerEncoder", bias=1),
        TypeError, _BIAS + "1"),
    Bad("block_norm_eps_zero", "sizes", lambda c: _block(c, norm="rms", norm_eps=0.0),
        ValueError, "norm_eps must be None or a positive finite number, got 0.0"),
    Bad("add_norm_eps_negative", "sizes", lambda c: c.h.module.AddNorm(8, eps=-1e-5),
        ValueError, "eps must be None or a positive finite number, got -1e-05"),
    Bad("ffn_bias_qkv", "sizes",
        lambda c: c.h.module.PositionWiseFFN(8, 4, bias="qkv"), TypeError,
        "bias must be True or False, got 'qkv'"),
    Bad("transformer_norm_first_string", "sizes",
        lambda c: c.h.module.Transformer(11, 11, 8, 16, 2, 1, norm_first="yes"), TypeError,
        "norm_first must be True or False, got 'yes'"),
    Bad("fn_ffn_unknown_activation", "sizes", lambda c: ac.position_wise_ffn(
        c.h.array(arr((2, 3, 5))), fn_weights(c.h, FFN), activation="tanh"), ValueError,
        "activation must be 'relu', 'gelu' or 'swiglu', got 'tanh'"),
    Bad("fn_ffn_swiglu_without_gate", "functional_weights", lambda c: ac.position_wise_ffn(
        c.h.array(arr((2, 3, 5))), fn_weights(c.h, FFN), activation="swiglu"), ValueError,
        names_message("position_wise_ffn", ["gate.bias", "gate.kernel"], [],
                      [*FFN, "gate.bias", "gate.kernel"])),
    Bad("fn_add_norm_rms_with_beta", "functional_weights",
        lambda c: ac.add_norm(c.h.array(arr((2, 3, 8))), c.h.array(arr((2, 3, 8))),
                              fn_weights(c.h, LN), norm="rms"), ValueError,
        names_message("add_norm", [], ["ln.beta"], ["ln.gamma"])),
    Bad("fn_decoder_block_options_not_options", "sizes",
        lambda c: ac.transformer_decoder_block(c.h.array(arr((2, 3, 8))), {}, 2,
                                               block={"norm": "rms"}), TypeError,
        "block must be a BlockOptions, got dict"),
    Bad("fn_decoder_block_options_bad_norm", "sizes",
        lambda c: ac.transformer_decoder_block(c.h.array(arr((2, 3, 8))), {}, 2,
                                               block=ac.BlockOptions(norm="Rms")), ValueError,
        "norm must be 'layer' or 'rms', got 'Rms'"),
]


def _not_bool(b: Any, h: Any, q: Any, k: Any) -> Any:
    """A mask_mod that returns integers, not booleans."""
    return q - k


#: The open core's arguments: segment ids, sinks, user modifiers, the new flags.
MODIFIER_ROWS: list[Bad] = [
    Bad("segment_ids_float", "dtype",
        lambda c: dpa(c.h, qkv(), segment_ids=arr((2, 6))), TypeError,
        "segment_ids must have an integer dtype, got float32"),
    Bad("segment_ids_shape", "sizes",
        lambda c: dpa(c.h, qkv(), segment_ids=np.zeros((2, 5), np.int32)), ValueError,
        "segment_ids must have shape (2, 6), got (2, 5)"),
    Bad("segment_ids_pair_shape", "sizes",
        lambda c: dpa(c.h, qkv(), segment_ids=(np.zeros((2, 6), np.int32),
                                               np.zeros((2, 6), np.int32))), ValueError,
        "segment_ids[0] must have shape (2, 4), got (2, 6)"),
    Bad("layer_segment_ids_float", "dtype",
        lambda c: call(c.h, c.layer, *qkv(), segment_ids=arr((2, 6))), TypeError,
        "segment_ids must have an integer dtype, got float32", mha),
    Bad("layer_segment_ids_shape", "sizes",
        lambda c: call(c.h, c.layer, *qkv(), segment_ids=np.zeros((2, 4), np.int32)),
        ValueError, "segment_ids must have shape (2, 6), got (2, 4)", dot),
    Bad("sinks_shape", "sizes",
        lambda c: dpa(c.h, [arr((2, 3, 4, 8)), arr((2, 3, 6, 8)), arr((2, 3, 6, 5))],
                      sinks=arr((2,))), ValueError,
        "sinks must have shape (H,) = (3,), got (2,)"),
    Bad("sinks_integer", "dtype",
        lambda c: dpa(c.h, qkv(), sinks=np.zeros((1,), np.int32)), TypeError,
        "sinks must be floating point, got int32"),
    Bad("mask_mod_not_callable", "mask",
        lambda c: dpa(c.h, qkv(), mask_mod="causal"), TypeError,
        "mask_mod must be a callable mask_mod(b, h, q_idx, kv_idx), a mask modifier or a list "
        "of them, got str"),
    Bad("mask_mod_not_boolean", "mask", lambda c: dpa(c.h, qkv(), mask_mod=_not_bool), TypeError,
        "mask_mod must return a boolean array (True = may attend), got int32"),
    Bad("score_mod_not_callable", "sizes", lambda c: dpa(c.h, qkv(), score_mod=3.0), TypeError,
        "score_mod must be a callable score_mod(score, b, h, q_idx, kv_idx), a score modifier "
        "or a list of them, got float"),
    Bad("return_lse_not_bool", "sizes", lambda c: dpa(c.h, qkv(), return_lse="yes"), TypeError,
        "return_lse must be True or False, got 'yes'"),
    Bad("check_numerics_not_bool", "sizes", lambda c: dpa(c.h, qkv(), check_numerics=1),
        TypeError, "check_numerics must be True or False, got 1"),
    Bad("lse_from_a_weightless_kernel", "sizes",
        lambda c: dpa(c.h, qkv(), return_weights=True, return_lse=True,
                      implementation="blockwise"), ValueError,
        "implementation='blockwise' never forms the attention weights: this call needs "
        "implementation=None or 'direct'"),
]


CATALOGUE += (BATCH_ROWS + SCALE_SINK_ROWS + GENERATION_ROWS + HOST_ROWS + CONVERTER_ROWS
              + MODIFIER_ROWS)
CATALOGUE += BLOCK_ROWS

assert len({row.name for row in CATALOGUE}) == len(CATALOGUE), "row names must be unique"


# -- state of a layer -----------------------------------------------------------------------------


def state(h: Harness, layer: Any) -> tuple[dict[str, np.ndarray] | str, list[np.ndarray | None]]:
    """The canonical weights (or the error saying there are none yet) and the kept attention
    weights (a list: the encoder keeps one per block, a decoder one per kind and block)."""
    try:
        weights: dict[str, np.ndarray] | str = layer.get_weights()
    except ValueError as err:
        weights = f"not built: {err}"
    return weights, [None if a is None else h.numpy(a) for a in flat(h.attention_weights(layer))]


def flat(kept: Any) -> list[Any]:
    """Kept attention weights as one list (a decoder keeps lists of lists)."""
    return [a for part in kept for a in flat(part)] if isinstance(kept, (list, tuple)) else [kept]


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


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` (hidden and temporary ones too) and its bytes."""
    return {str(p.relative_to(directory)): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _without(row: Bad, backend: str) -> str | None:
    """Why a row does not run on a backend (None: it runs). A column (tests.harness.COLUMNS)
    runs the rows of its arrays' backend that call a layer."""
    column = COLUMNS.get(backend)
    if column is not None and row.layer is None:
        return f"the functional API on {column.arrays} arrays runs in the {column.arrays} env"
    reasons = dict(row.without)
    return reasons.get(backend) or reasons.get(column.arrays if column else backend)


@pytest.mark.parametrize("row", CATALOGUE, ids=[row.name for row in CATALOGUE])
def test_bad_call(backend: str, row: Bad, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reason = _without(row, backend)
    if reason is not None:
        pytest.skip(reason)
    cases = sum(_without(r, backend) is None for r in CATALOGUE)
    passed = False
    try:
        h = Harness(backend)
        layer = row.layer(h) if row.layer is not None else None
        before = state(h, layer) if layer is not None else None
        ctx = Ctx(h, layer, tmp_path, monkeypatch)
        if row.files is not None:
            row.files(ctx.file())
        files_before = snapshot(tmp_path)
        message = row.message.format(path=repr(str(ctx.file())), backend=h.arrays,
                                     absent=repr(str(ctx.file("absent.safetensors"))))
        with pytest.raises(row.exc) as info:
            row.act(ctx)
        assert type(info.value) is row.exc, f"{type(info.value).__name__}: {info.value}"
        assert str(info.value) == message
        if layer is not None:
            assert_same_state(before, state(h, layer))
        assert snapshot(tmp_path) == files_before, "the failed call changed the files"
        passed = True
    finally:
        report.count("bad_input", backend, row.name, passed, cases)


def test_catalogue_covers_every_category() -> None:
    categories = {row.category for row in CATALOGUE}
    assert categories == {"rank", "mismatch", "heads", "sizes", "valid_lens", "mask", "dtype", "empty",
                          "dropout", "tokens", "set_weights", "load_weights", "backend",
                          "functional_weights", "save_weights", "batch", "cache", "converter",
                          "framework"}
    assert len(CATALOGUE) >= 45
    assert sum(row.layer is not None for row in CATALOGUE) >= 30


def _loads(name: str) -> bool:
    """Whether an installed backend loads here (``backends.tensorflow`` needs Keras on TF)."""
    try:
        registry.load(name)
    except ImportError:
        return False
    return True


def test_inputs_of_two_frameworks_are_refused(backend: str) -> None:
    """Queries of the backend with keys of any other installed framework: a TypeError naming
    the argument and both frameworks, from the functional API and from a layer (not from a
    Keras layer, which converts its arguments to tensors first, as every Keras layer does)."""
    h = Harness(backend)
    others = [name for name in registry.available_backends()
              if name not in (h.arrays, "numpy") and _loads(name)]
    layer = mha(h)
    keras_layer = h.module.__name__ in ("backends.tensorflow", "backends.keras")
    for other in others:
        foreign = Harness(other)
        q, _, v = (h.array(a) for a in qkv())
        bad = foreign.array(arr((2, 6, 8)))
        message = f"keys must be a {h.arrays} array like queries, got a {other} array"
        with pytest.raises(TypeError) as info:
            ac.dot_product_attention(q, bad, v)
        assert str(info.value) == message
        if not keras_layer:  # Keras converts every array argument before call()
            with pytest.raises(TypeError) as info:
                h.call(layer, q, bad, v)
            assert str(info.value) == message


def test_foreign_lengths_and_masks_get_numpy_dtype_names(backend: str) -> None:
    """Lengths and masks of another framework are checked as given, their dtypes named as
    NumPy names them (``bfloat16``, ``float64``; never ``<dtype: 'float64'>``)."""
    h = Harness(backend)
    q, k, v = (h.array(a) for a in qkv())
    cases: list[tuple[str, Any, str]] = []
    if importlib.util.find_spec("torch") is not None:
        import torch

        cases += [("valid_lens", torch.tensor([1.0, 2.0], dtype=torch.bfloat16), "bfloat16"),
                  ("mask", torch.ones(4, 6, dtype=torch.int16), "int16")]
    if importlib.util.find_spec("tensorflow") is not None:
        import tensorflow as tf

        cases += [("valid_lens", tf.constant([1.0, 2.0], tf.float64), "float64"),
                  ("mask", tf.ones((4, 6), tf.int64), "int64")]
    for name, value, dtype in cases:
        want = ("valid_lens must have an integer dtype, got " if name == "valid_lens"
                else "mask must be boolean (True = may attend), got ") + dtype
        with pytest.raises(TypeError) as info:
            ac.dot_product_attention(q, k, v, **{name: value})
        assert str(info.value) == want


def test_failed_first_call_leaves_input_sizes_open(backend: str) -> None:
    """A first call that fails builds nothing: the next good call may choose any input width."""
    h = Harness(backend)
    layer = fresh_mha(h)
    for bad in (lambda: call(h, layer, *qkv(), [9, 9]),
                lambda: call(h, layer, *qkv(dtypes=("int32", F32, F32)))):
        with pytest.raises((ValueError, TypeError)):
            bad()
    out = call(h, layer, *qkv(q=(2, 4, 3)))
    assert tuple(h.ops.shape(out)) == (2, 4, 8)
    assert layer.get_weights()["W_q.kernel"].shape == (3, 8)


def _refusal(fn: Callable[[], Any]) -> tuple[type, str]:
    with pytest.raises((ValueError, TypeError)) as info:
        fn()
    return info.type, str(info.value)


@pytest.mark.parametrize("bad", [
    {"arrays": qkv(dtypes=("int32", F32, F32))},  # a dtype
    {"arrays": qkv(q=(2, 8))},  # a rank
    {"arrays": qkv(q=(2, 4, 3))},  # a width
    {"arrays": qkv(), "mask": arr((2, 4, 6))},  # a float mask
    {"arrays": qkv(), "mask": np.ones((2, 5, 6), dtype=bool)},  # a mask's shape
], ids=["dtype", "rank", "width", "float-mask", "mask-shape"])
def test_repeated_calls_refuse_as_a_first_call(backend: str, bad: dict[str, Any]) -> None:
    """A layer called well again and again refuses a changed input as one never called so.

    Layers keep the checks of a call's signature (``Declaration.prepare``): a plan must not
    let a changed input through.
    """
    h = Harness(backend)
    arrays, kwargs = bad["arrays"], {k: v for k, v in bad.items() if k != "arrays"}
    planned = mha(h)
    for _ in range(3):
        call(h, planned, *qkv())
    expected = _refusal(lambda: call(h, mha(h), *arrays, **kwargs))
    assert _refusal(lambda: call(h, planned, *arrays, **kwargs)) == expected
    assert _refusal(lambda: call(h, planned, *arrays, **kwargs)) == expected  # and again
    call(h, planned, *qkv())  # the good call still runs
