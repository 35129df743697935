"""No default eager call reads a device array's values on the host.

torch: layers made on ``meta`` (``with torch.device("meta")`` or ``.to("meta")``), as large
models are, run on ``meta`` inputs, lengths, token ids and positions, as
``torch.nn.MultiheadAttention`` does. A meta tensor has no values, so any host read (``.item()``,
``int(t)``, ``bool(t)``, ``.tolist()``, ``.numpy()``) raises: a call that passes read nothing.

JAX: on CPU a JAX array lives on the host already (``jax.transfer_guard`` sees no transfer), so
the host conversions of JAX arrays are counted instead (:func:`host_reads`) and must be none.
"""

from __future__ import annotations

import contextlib
import functools
import operator
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import attention_core as ac
from attention_core import modifiers
from conftest import test_backends

TESTED = test_backends()
ON_TORCH = pytest.mark.skipif("torch" not in TESTED, reason="the torch backend is not tested")
ON_JAX = pytest.mark.skipif("jax" not in TESTED, reason="the jax backend is not tested")
ON_NNX = pytest.mark.skipif("nnx" not in TESTED, reason="the nnx column is not tested")

if "torch" in TESTED:
    import torch
    from torch.nn.parameter import UninitializedParameter

    import backends.torch as torch_layers
if "jax" in TESTED or "nnx" in TESTED:
    import jax
    import jax.numpy as jnp

    import backends.jax as linen
if "nnx" in TESTED:
    from flax import nnx

    from backends.jax import nnx as bn

B, Q, K, D, HEADS, WIDTH = 2, 5, 6, 8, 4, 16
#: A decoder stack as in tests/test_cache.py (vocabulary, width, blocks, cache capacity).
DECODER = {"vocab_size": 11, "num_hiddens": WIDTH, "ffn_num_hiddens": 12, "num_heads": HEADS,
           "num_blks": 1, "max_len": 16}
CAPACITY = 7


def functional_calls(q: Any, k: Any, v: Any, lens: Any, ints: Callable[..., Any],
                     floats: Callable[..., Any]) -> dict[str, Callable[[], Any]]:
    """Default calls of ``dot_product_attention`` over the masks and options that take arrays.

    ``ints(shape)`` and ``floats(shape)`` make the backend's arrays; ``q`` is ``(B, H, Q, D)``,
    ``k`` and ``v`` ``(B, H, K, D)``, ``lens`` ``(B,)``.
    """
    dpa = ac.dot_product_attention
    segments = ints((B, K))
    return {
        "valid_lens": lambda: dpa(q, k, v, lens),
        "valid_lens_per_query": lambda: dpa(q, k, v, ints((B, Q))),
        "mask": lambda: dpa(q, k, v, mask=ints((B, 1, Q, K)) > 0),
        "causal_window_softcap": lambda: dpa(q, k, v, lens, causal=True, window=2, softcap=5.0),
        "weights_lse": lambda: dpa(q, k, v, lens, return_weights=True, return_lse=True),
        "alibi": lambda: dpa(q, k, v, lens, positional="alibi"),
        "rotary": lambda: dpa(q, k, v, lens, positional="rotary"),
        "segment_ids": lambda: dpa(q, k, v, segment_ids=segments),
        "segment_pair": lambda: dpa(q, k, v, segment_ids=(ints((B, Q)), segments)),
        "prefix_lm": lambda: dpa(q, k, v, mask_mod=modifiers.prefix_lm(lens)),
        "mask_mod": lambda: dpa(q, k, v, mask_mod=lambda b, h, i, j: j <= i),
        "score_mod_bias": lambda: dpa(q, k, v, score_bias=floats((B, HEADS, Q, K)),
                                      score_mod=lambda s, b, h, i, j: s * 0.5),
        "sinks": lambda: dpa(q, k, v, lens, sinks=floats((HEADS,))),
        "grouped_heads": lambda: dpa(q, k[:, :2], v[:, :2], lens),
        "blockwise": lambda: dpa(q, k, v, lens, causal=True, implementation="blockwise"),
        "check_numerics": lambda: dpa(q, k, v, lens, check_numerics=True),
    }


#: The calls' names (the calls made of no arrays: only their names are read).
CALLS = list(functional_calls(*[None] * 4, ints=lambda s: None, floats=lambda s: None))


# -- torch: everything on meta ----------------------------------------------------------------


def meta_ints(shape: tuple[int, ...] = (B,)) -> Any:
    return torch.empty(shape, dtype=torch.int64, device="meta")


def meta_floats(shape: tuple[int, ...]) -> Any:
    return torch.empty(shape, device="meta")


def on_meta(make: Callable[[], Any], way: str) -> Any:
    """A layer made under ``with torch.device("meta")``, or made on the CPU then moved."""
    if way == "context":
        with torch.device("meta"):
            return make()
    return make().to("meta")


WAYS = ["context", "to_meta"]


@ON_TORCH
@pytest.mark.parametrize("call", CALLS)
def test_torch_functional_calls_on_meta(call: str) -> None:
    q, kv = meta_floats((B, HEADS, Q, D)), meta_floats((B, HEADS, K, D))
    out = functional_calls(q, kv, kv, meta_ints(), meta_ints, meta_floats)[call]()
    first = out[0] if isinstance(out, tuple) else out
    assert first.device.type == "meta" and tuple(first.shape) == (B, HEADS, Q, D)


@ON_TORCH
def test_torch_blockwise_by_default_on_meta() -> None:
    """A call large enough for the blockwise kernel (chosen by size), its lengths on meta."""
    x = meta_floats((1, 1, 4096, D))
    out = ac.dot_product_attention(x, x, x, meta_ints((1,)), causal=True)
    assert out.device.type == "meta" and tuple(out.shape) == (1, 1, 4096, D)


@ON_TORCH
@pytest.mark.parametrize("options", [{}, {"sinks": True, "num_kv_heads": 2}],
                         ids=["plain", "sinks_grouped"])
@pytest.mark.parametrize("way", WAYS)
def test_torch_multi_head_attention_on_meta(way: str, options: dict[str, Any]) -> None:
    """Lengths, torch's masks and the weights asked for, input sizes inferred on meta."""
    layer = on_meta(lambda: torch_layers.MultiHeadAttention(WIDTH, HEADS, **options), way)
    x = meta_floats((B, Q, WIDTH))
    calls = [
        layer(x, x, x, meta_ints()),
        layer(x, x, x, key_padding_mask=meta_ints((B, Q)) > 0, need_weights=True)[0],
        layer(x, x, x, attn_mask=meta_floats((Q, Q))),
        layer(x, x, x, is_causal=True, attn_mask=meta_ints((Q, Q)) > 0),
    ]
    assert all(out.device.type == "meta" and tuple(out.shape) == (B, Q, WIDTH) for out in calls)
    assert all(p.device.type == "meta" for p in layer.parameters())


@ON_TORCH
@pytest.mark.parametrize("way", WAYS)
def test_torch_encoder_block_on_meta(way: str) -> None:
    layer = on_meta(lambda: torch_layers.TransformerEncoderBlock(WIDTH, 32, HEADS), way)
    layer.eval()
    out = layer(meta_floats((B, Q, WIDTH)), meta_ints())
    assert out.device.type == "meta" and tuple(out.shape) == (B, Q, WIDTH)


@ON_TORCH
@pytest.mark.parametrize("crossed", [True, False], ids=["cross", "decoder_only"])
@pytest.mark.parametrize("way", WAYS)
def test_torch_cached_decoder_steps_on_meta(way: str, crossed: bool) -> None:
    """A prompt that makes the cache, then steps at a position given as a meta scalar and as
    an int; the encoder's outputs and lengths on meta too."""
    config = {**DECODER, "decoder_only": not crossed}
    layer = on_meta(lambda: torch_layers.TransformerDecoder(**config), way)
    layer.eval()
    cross = [meta_floats((B, 4, WIDTH)), meta_ints()] if crossed else []
    logits, cache = layer(meta_ints((B, 3)), *cross, capacity=CAPACITY)
    for start in (torch.empty((), dtype=torch.int32, device="meta"), 4):
        logits, cache = layer(meta_ints((B, 1)), *cross, cache=cache, start=start)
    assert logits.device.type == "meta" and tuple(logits.shape) == (B, 1, DECODER["vocab_size"])
    keys = cache[0][0][0]  # block 0's self-attention keys
    assert keys.device.type == "meta" and tuple(keys.shape) == (B, HEADS, CAPACITY, 4)


@ON_TORCH
def test_torch_meta_layer_materialises_as_made_on_the_device() -> None:
    """``to_empty`` then ``reset_parameters`` under a seed: the weights and fixed tables of a
    layer made on the CPU under that seed (torch's way to initialise a model made on meta)."""
    torch.manual_seed(0)
    made = torch_layers.TransformerDecoder(**DECODER)
    with torch.device("meta"):
        layer = torch_layers.TransformerDecoder(**DECODER)
    assert {b.device.type for b in layer.buffers()} == {"meta"}  # the positions' table too
    layer.to_empty(device="cpu")
    torch.manual_seed(0)
    layer.reset_parameters()
    want = {**dict(made.named_parameters()), **dict(made.named_buffers())}
    got = {**dict(layer.named_parameters()), **dict(layer.named_buffers())}
    assert set(got) == set(want)
    assert all(torch.equal(got[name], want[name]) for name in want)


@ON_TORCH
def test_torch_sizes_still_unknown_survive_a_move_to_meta_and_to_empty() -> None:
    """Kernels of input sizes not known yet stay placeholders when the layer is moved, and
    take the sizes of the first call on the new device."""
    layer = torch_layers.MultiHeadAttention(WIDTH, HEADS).to("meta")
    kernels = [layer.W_q.kernel, layer.W_k.kernel, layer.W_v.kernel]
    assert all(isinstance(k, UninitializedParameter) and k.device.type == "meta" for k in kernels)
    layer.to_empty(device="cpu")
    x = torch.randn(B, Q, 10)
    assert tuple(layer(x, x, x).shape) == (B, Q, WIDTH)
    assert tuple(layer.W_q.kernel.shape) == (10, WIDTH)


# -- JAX: host conversions counted -----------------------------------------------------------


def _counted(hits: list[str], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, noting ``name`` in ``hits`` whenever its first argument is a JAX array."""
    @functools.wraps(fn)
    def counted(*args: Any, **kwargs: Any) -> Any:
        if args and isinstance(args[0], jax.Array):
            hits.append(name)
        return fn(*args, **kwargs)
    return counted


@contextlib.contextmanager
def host_reads() -> Iterator[list[str]]:
    """Notes each host conversion of a JAX array in the block, by the hook it went through.

    ``_value`` serves ``int``, ``bool``, ``float``, ``operator.index``, ``.tolist()``, printing
    and ``jax.device_get``; NumPy reads a CPU array by the buffer protocol, so NumPy's
    converters are counted where they are called. Device-to-host transfers are refused too
    (what an accelerator's arrays would need; on CPU there are none).
    """
    array, hits = type(jnp.zeros(())), []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(array, "_value", property(_counted(hits, "_value", array._value.fget)))
        for name in ("__array__", "__iter__", "item", "tolist"):
            patch.setattr(array, name, _counted(hits, name, getattr(array, name)))
        for name in ("asarray", "array", "asanyarray", "ascontiguousarray"):
            patch.setattr(np, name, _counted(hits, f"np.{name}", getattr(np, name)))
        with jax.transfer_guard_device_to_host("disallow"):
            yield hits


#: Ways to read a JAX array on the host (called by name: NumPy's are looked up when called).
READS: dict[str, Callable[[Any], Any]] = {
    "np.asarray": lambda x: np.asarray(x), "np.array": lambda x: np.array(x), "int": int,
    "bool": bool, "float": float, "index": operator.index, "tolist": lambda x: x.tolist(),
    "item": lambda x: x.item(), "iter": lambda x: list(x[None]), "format": "{}".format,
    "device_get": lambda x: jax.device_get(x),
}


@pytest.mark.skipif("jax" not in TESTED and "nnx" not in TESTED, reason="jax is not tested")
@pytest.mark.parametrize("read", list(READS))
def test_host_reads_are_counted(read: str) -> None:
    """The counter sees each way of reading a JAX array (else a zero below proves nothing)."""
    x = jnp.ones((), jnp.int32)
    with host_reads() as hits:
        READS[read](x)
    assert hits


def jax_arrays(seed: int = 0) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``ints(shape)`` (in ``[0, 3)``) and ``floats(shape)``: JAX arrays drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    return (lambda s: jnp.asarray(rng.integers(0, 3, s), jnp.int32),
            lambda s: jnp.asarray(rng.standard_normal(s), jnp.float32))


@ON_JAX
@pytest.mark.parametrize("call", CALLS)
def test_jax_functional_calls_read_nothing(call: str) -> None:
    ints, floats = jax_arrays()
    q, k, v = floats((B, HEADS, Q, D)), floats((B, HEADS, K, D)), floats((B, HEADS, K, D))
    calls = functional_calls(q, k, v, jnp.array([3, K]), ints, floats)
    with host_reads() as hits:
        calls[call]()
    assert hits == []


@ON_JAX
def test_linen_layers_read_nothing() -> None:
    """Flax linen's ``apply`` of multi-head attention, an encoder block and cached decoder
    steps (an explicit cache at a position given as a JAX scalar, and ``decode=True``)."""
    ints, floats = jax_arrays()
    x, lens, key = floats((B, Q, WIDTH)), jnp.array([3, Q]), jax.random.PRNGKey(0)
    mha = linen.MultiHeadAttention(WIDTH, HEADS)
    block = linen.TransformerEncoderBlock(WIDTH, 32, HEADS)
    decoder = linen.TransformerDecoder(**DECODER, decoder_only=True)
    ids = ints((B, 3))
    params = [m.init(key, *a) for m, a in ((mha, (x, x, x, lens)), (block, (x, lens)),
                                          (decoder, (ids,)))]
    with host_reads() as hits:
        mha.apply(params[0], x, x, x, lens)
        block.apply(params[1], x, lens)
        _, cache = decoder.apply(params[2], ids, capacity=CAPACITY)
        decoder.apply(params[2], ids[:, :1], cache=cache, start=jnp.array(3, jnp.int32))
        _, state = decoder.apply(params[2], ids, decode=True, mutable=["cache"])
        decoder.apply({**params[2], **state}, ids[:, :1], decode=True, mutable=["cache"])
    assert hits == []


@ON_NNX
def test_nnx_layers_read_nothing() -> None:
    ints, floats = jax_arrays()
    x, lens = floats((B, Q, WIDTH)), jnp.array([3, Q])
    mha = bn.MultiHeadAttention(WIDTH, HEADS, rngs=nnx.Rngs(0))
    block = bn.TransformerEncoderBlock(WIDTH, 32, HEADS, rngs=nnx.Rngs(0))
    decoder = bn.TransformerDecoder(**DECODER, decoder_only=True, rngs=nnx.Rngs(0))
    block.eval()
    decoder.eval()
    ids = ints((B, 3))
    with host_reads() as hits:
        mha(x, x, x, lens)
        block(x, lens)
        _, cache = decoder(ids, capacity=CAPACITY)
        decoder(ids[:, :1], cache=cache, start=jnp.array(3, jnp.int32))
    assert hits == []
