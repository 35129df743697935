"""Cached incremental decoding: a decoder run a chunk or a token at a time against
its key/value cache equals one full causal pass, on each backend, eager and compiled; the d2l
book's loop, which passes a block its earlier inputs, does too; bad caches and positions are
refused by name."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import attention_core as ac
from attention_core import declarations as D
from attention_core import transformer as T
from attention_core import weights as W
from tests.harness import Harness, max_diff
from tests.test_decoder import H, S, V, block_weights, h, on, stack_weights

#: These tests run on the columns too (conftest.py; tests.harness.COLUMNS).
COLUMN_TESTS = True

B, STEPS = 2, 7
#: The target: step by step equals the full pass within 1e-5 in float32.
BOUND = 1e-5
#: How the positions are fed: a prompt of 3, then 1, 1, a chunk of 2, and 1.
CHUNKS = ((0, 3), (3, 1), (4, 1), (5, 2))


def _inputs(rng: np.random.Generator, crossed: bool) -> tuple[np.ndarray, Any, Any]:
    tokens = rng.integers(0, V, (B, STEPS))
    enc = rng.standard_normal((B, S, h)) if crossed else None
    lens = np.array([S, 2]) if crossed else None
    return tokens, enc, lens


@pytest.mark.parametrize("crossed", [True, False], ids=["cross", "decoder_only"])
def test_cached_decoder_layer_equals_the_full_pass(backend: str, crossed: bool) -> None:
    """The layer's cached calls (a prompt, single tokens, a chunk) give the full pass's logits,
    with ``start`` an int or an integer scalar array."""
    rng = np.random.default_rng(11)
    hb = Harness(backend)
    layer = hb.make("TransformerDecoder", {"vocab_size": V, "num_hiddens": h,
                                           "ffn_num_hiddens": 12, "num_heads": H, "num_blks": 2,
                                           "decoder_only": not crossed, "max_len": 16})
    tokens, enc, lens = _inputs(rng, crossed)
    ids = hb.array(tokens.astype(np.int32))
    cross = [] if enc is None else [hb.array(enc, "float32"), hb.array(lens)]
    full = hb.numpy(hb.call(layer, ids, *cross))
    logits, _ = _chunked(hb, layer, tokens, cross)
    assert max_diff(logits, full) <= BOUND


def _chunked(hb: Harness, layer: Any, tokens: np.ndarray, cross: list[Any]) -> tuple[Any, Any]:
    """The layer's logits over ``tokens`` by cached calls in :data:`CHUNKS` (after the harness's
    setups, e.g. Gluon's hybridize()), ``start`` an int or an integer scalar array by turns;
    and the last cache."""
    for setup in hb.setups():
        setup(layer)
    pieces, cache = [], None
    for start, n in CHUNKS:
        chunk = hb.array(tokens[:, start:start + n].astype(np.int32))
        at: Any = start if start % 2 else hb.array(np.array(start, np.int32))
        extra = {"capacity": STEPS} if cache is None else {"cache": cache, "start": at}
        logits, cache = hb.call(layer, chunk, *cross, **extra)
        pieces.append(hb.numpy(logits))
    return np.concatenate(pieces, axis=1), cache


def test_cached_multi_head_attention_equals_causal_attention(backend: str) -> None:
    """Self-attention in chunks against the cache: the causal attention of the whole sequence,
    and the returned weights its rows, zero on the rows not written yet."""
    rng = np.random.default_rng(16)
    hb = Harness(backend)
    w = {f"{n}.{leaf}": hb.array(rng.standard_normal((h, h) if leaf == "kernel" else (h,)),
                                 "float32")
         for n in ("W_q", "W_k", "W_v", "W_o") for leaf in ("kernel", "bias")}
    X = rng.standard_normal((B, STEPS, h))
    full, attn = ac.multi_head_attention(*[hb.array(X, "float32")] * 3, w, H, causal=True,
                                         return_weights=True)
    rows, weights, cache = [], [], None
    for start, n in CHUNKS:
        x = hb.array(X[:, start:start + n], "float32")
        (out, a), cache = ac.multi_head_attention(x, x, x, w, H, cache=cache, start=start,
                                                  capacity=STEPS, return_weights=True)
        rows.append(hb.numpy(out))
        weights.append(hb.numpy(a))
    assert max_diff(np.concatenate(rows, axis=1), hb.numpy(full)) <= BOUND
    assert max_diff(np.concatenate(weights, axis=2), hb.numpy(attn)) <= BOUND


@pytest.mark.parametrize("way", ["cache", "past"])
def test_cached_block_and_the_d2l_loop_equal_the_full_pass(backend: str, way: str) -> None:
    """A block one position at a time: against its cache, or given its earlier inputs as the
    d2l book's prediction loop keeps them (``past``)."""
    rng = np.random.default_rng(12)
    hb = Harness(backend)
    w = on(hb, block_weights(rng, True))
    X = rng.standard_normal((B, STEPS, h))
    enc, lens = hb.array(rng.standard_normal((B, S, h)), "float32"), hb.array(np.array([3, S]))
    full = hb.numpy(ac.transformer_decoder_block(hb.array(X, "float32"), w, H, enc, lens))
    rows, cache = [], None
    for t in range(STEPS):
        x = hb.array(X[:, t:t + 1], "float32")
        if way == "past":
            past = None if t == 0 else hb.array(X[:, :t], "float32")
            rows.append(hb.numpy(ac.transformer_decoder_block(x, w, H, enc, lens, past=past)))
        else:  # the encoder outputs are read once, by the call that makes the cache
            out, cache = T.cached_decoder_block(x, w, H, cache, t, enc if t == 0 else None, lens,
                                                capacity=STEPS)
            rows.append(hb.numpy(out))
    assert max_diff(np.concatenate(rows, axis=1), full) <= BOUND


@pytest.mark.parametrize("crossed", [True, False], ids=["cross", "decoder_only"])
def test_cached_steps_compile_once(backend: str, crossed: bool) -> None:
    """One compiled step (``jax.jit``, ``tf.function(jit_compile=True)``, ``torch.compile``),
    traced once, serves every position: the cache has a fixed capacity and the position is an
    array. Its logits equal the eager full pass."""
    hb = Harness(backend)
    if not hasattr(hb.hooks, "compiled_step") and not hasattr(hb.hooks, "compiled_function"):
        pytest.skip(f"{backend} compiles no plain function")
    rng = np.random.default_rng(13)
    w = on(hb, stack_weights(rng, crossed))
    tokens, enc, lens = _inputs(rng, crossed)
    P = hb.array(ac.sinusoidal_encoding(16, h)[None], "float32")
    cross = [] if enc is None else [hb.array(enc, "float32"), hb.array(lens)]
    full = hb.numpy(ac.transformer_decoder(hb.array(tokens.astype(np.int32)), w, H, *cross,
                                           positions=P))
    def step(ids: Any, start: Any, cache: Any, *lens_: Any) -> Any:
        return T.cached_decoder(ids, w, H, cache, start, None, *lens_, positions=P)

    compiled, traces = _compiled(hb, step)
    first, cache = T.cached_decoder(hb.array(tokens[:, :1].astype(np.int32)), w, H, None, 0,
                                    *cross, capacity=STEPS, positions=P)
    rows = [hb.numpy(first)]
    for t in range(1, STEPS):
        ids = hb.array(tokens[:, t:t + 1].astype(np.int32))
        logits, cache = compiled(ids, hb.array(np.array(t, np.int32)), cache, *cross[1:])
        rows.append(hb.numpy(logits))
    assert max_diff(np.concatenate(rows, axis=1), full) <= BOUND
    assert traces() == 1, f"the step was traced {traces()} times"


def _compiled(hb: Harness, fn: Any) -> tuple[Any, Any]:
    """``fn`` compiled by the backend's hook, and the number of times it has been traced."""
    if hasattr(hb.hooks, "compiled_step"):
        return hb.hooks.compiled_step(fn)
    traces = []

    def counted(*args: Any) -> Any:
        traces.append(1)  # runs when the function is traced, not when the program runs
        return fn(*args)

    return hb.hooks.compiled_function(counted), lambda: len(traces)


#: Decoders of current models: grouped-query heads, rotary or ALiBi positions, a
#: sliding window, soft-capping; the cache holds the key/value heads, the keys rotated.
MODERN = {
    "gqa_rotary_window": {"num_kv_heads": 2, "positional": "rotary", "window": 3,
                          "softcap": 5.0},
    "mqa_alibi": {"num_kv_heads": 1, "positional": "alibi", "window": 4},
}


@pytest.mark.parametrize("options", list(MODERN))
def test_cached_modern_decoder_equals_the_full_pass(backend: str, options: str) -> None:
    """A decoder-only stack with the options of current models: its cached calls (a prompt,
    single tokens, a chunk) give the full pass's logits; the cache holds Hkv heads, and the
    window's rows (tests/test_ring_cache.py)."""
    rng = np.random.default_rng(17)
    hb = Harness(backend)
    config = {"vocab_size": V, "num_hiddens": 16, "ffn_num_hiddens": 12, "num_heads": 4,
              "num_blks": 2, "decoder_only": True, "max_len": 16, **MODERN[options]}
    layer = hb.make("TransformerDecoder", config)
    tokens = rng.integers(0, V, (B, STEPS))
    full = hb.numpy(hb.call(layer, hb.array(tokens.astype(np.int32))))
    logits, cache = _chunked(hb, layer, tokens, [])
    assert max_diff(logits, full) <= BOUND
    keys = cache[0][0][0]  # block 0's self-attention keys: a ring of the window's rows
    rows = min(STEPS, MODERN[options]["window"])
    assert tuple(keys.shape) == (B, MODERN[options]["num_kv_heads"], rows, 4)


def test_cached_modern_steps_compile_once(backend: str) -> None:
    """One compiled step of a grouped-query, rotary, windowed decoder serves every position (a
    run-time position: rotary angles from the two-level tables, the window's and ALiBi's
    offsets in the program); its logits equal the eager full pass."""
    hb = Harness(backend)
    if not hasattr(hb.hooks, "compiled_step") and not hasattr(hb.hooks, "compiled_function"):
        pytest.skip(f"{backend} compiles no plain function")
    rng = np.random.default_rng(19)
    options = ac.HeadOptions(**MODERN["gqa_rotary_window"])
    spec = D.TransformerDecoder(V, 16, 12, 4, 2, decoder_only=True,
                                **options.kwargs()).weight_shapes()
    w = on(hb, W.init_weights(spec, rng))
    tokens = rng.integers(0, V, (B, STEPS))
    full = hb.numpy(ac.transformer_decoder(hb.array(tokens.astype(np.int32)), w, 4,
                                           options=options))

    def step(ids: Any, start: Any, cache: Any) -> Any:
        return T.cached_decoder(ids, w, 4, cache, start, options=options)

    compiled, traces = _compiled(hb, step)
    first, cache = T.cached_decoder(hb.array(tokens[:, :1].astype(np.int32)), w, 4, None, 0,
                                    capacity=STEPS, options=options)
    rows = [hb.numpy(first)]
    for t in range(1, STEPS):
        ids = hb.array(tokens[:, t:t + 1].astype(np.int32))
        logits, cache = compiled(ids, hb.array(np.array(t, np.int32)), cache)
        rows.append(hb.numpy(logits))
    assert max_diff(np.concatenate(rows, axis=1), full) <= BOUND
    assert traces() == 1, f"the step was traced {traces()} times"


def test_cache_errors_name_the_argument() -> None:
    rng = np.random.default_rng(14)
    w = {k: v.astype(np.float32) for k, v in stack_weights(rng, True).items()}
    enc = rng.standard_normal((B, S, h)).astype(np.float32)
    ids = rng.integers(0, V, (B, 2))
    _, cache = T.cached_decoder(ids, w, H, None, 0, enc, capacity=4, max_len=8)
    with pytest.raises(ValueError, match=r"capacity is required"):
        T.cached_decoder(ids, w, H, None, 0, enc)
    with pytest.raises(ValueError, match=r"start \+ positions must be <= the cache's capacity "
                                         r"\(4\), got start 3 \+ 2 positions = 5"):
        T.cached_decoder(ids, w, H, cache, 3, max_len=8)
    with pytest.raises(ValueError, match="start must be >= 0, got -1"):
        T.cached_decoder(ids, w, H, cache, -1, max_len=8)
    with pytest.raises(TypeError, match="start must be an integer position"):
        T.cached_decoder(ids, w, H, cache, 1.0, max_len=8)
    with pytest.raises(ValueError, match=r"capacity \(5\) must equal the given cache's \(4\)"):
        T.cached_decoder(ids, w, H, cache, 0, capacity=5, max_len=8)
    with pytest.raises(ValueError, match=r"one block cache per block \(2\), got 1"):
        T.cached_decoder(ids, w, H, cache[:1], 0, max_len=8)
    with pytest.raises(ValueError, match=r"cache keys must have shape \(B, H, C, D\) = "
                                         r"\(2, 2, C, 4\), got \(2, 2, 4, 3\)"):
        broken = [((k[..., :3], v), cross) for (k, v), cross in cache]
        T.cached_decoder(ids, w, H, broken, 0, max_len=8)
    with pytest.raises(TypeError, match="cache keys must have dtype float32, got float64"):
        wide = [((k.astype(np.float64), v), cross) for (k, v), cross in cache]
        T.cached_decoder(ids, w, H, wide, 0, max_len=8)
    with pytest.raises(ValueError, match=r"beyond max_len \(3\)"):
        T.cached_decoder(ids, w, H, cache, 2, max_len=3)


def test_cached_layer_refuses_masks_of_its_keys() -> None:
    """A cached call's keys are the cache's rows: ``valid_lens``, ``mask`` and ``past`` are
    refused by name; the layer's weights are unchanged by the failed call."""
    import backends.numpy as L

    layer = L.TransformerDecoderBlock(h, 12, H, decoder_only=True)
    X = np.random.default_rng(15).standard_normal((B, 3, h)).astype(np.float32)
    layer(X)
    before = layer.get_weights()
    for name, value in (("valid_lens", np.array([1, 2])), ("mask", np.ones((3, 3), bool)),
                        ("past", X)):
        with pytest.raises(ValueError, match=f"{name} must be None in a cached call"):
            layer(X, capacity=4, **{name: value})
    assert all(np.array_equal(before[k], v) for k, v in layer.get_weights().items())


def test_flax_decode_keeps_the_cache_in_its_collection(backend: str) -> None:
    """Flax's convention: a first ``apply(..., decode=True, mutable=["cache"])`` on inputs as
    long as the decoding makes the ``'cache'`` collection (with the trained params: it holds
    the encoder outputs' projections); each jitted ``apply`` with it feeds the next position,
    and the outputs are the full pass's."""
    if backend != "jax":
        pytest.skip("the 'cache' collection is Flax's convention")
    import jax
    import jax.numpy as jnp

    from backends.jax import TransformerDecoder

    rng = np.random.default_rng(17)
    layer = TransformerDecoder(V, h, 12, H, 2, max_len=16)
    tokens, enc, lens = _inputs(rng, True)
    ids, enc, lens = jnp.asarray(tokens, jnp.int32), jnp.asarray(enc, jnp.float32), jnp.asarray(lens)
    params = layer.init(jax.random.PRNGKey(0), ids, enc, lens)["params"]
    full = np.asarray(layer.apply({"params": params}, ids, enc, lens))
    _, made = layer.apply({"params": params}, jnp.zeros_like(ids), enc, lens, decode=True,
                          mutable=["cache"])
    cache = made["cache"]
    traces = []

    def step(cache: Any, ids: Any) -> Any:
        traces.append(1)
        return layer.apply({"params": params, "cache": cache}, ids, None, lens, decode=True,
                           mutable=["cache"])

    compiled = jax.jit(step)
    rows = []
    for t in range(STEPS):
        out, mutated = compiled(cache, ids[:, t:t + 1])
        cache = mutated["cache"]
        rows.append(np.asarray(out))
    assert max_diff(np.concatenate(rows, axis=1), full) <= BOUND
    assert int(cache["index"]) == STEPS and len(traces) == 1
    with pytest.raises(ValueError, match=r"decode=True keeps the cache .*: capacity must not"):
        layer.apply({"params": params, "cache": cache}, ids, enc, lens, decode=True, capacity=4,
                    mutable=["cache"])
    from backends.jax import AdditiveAttention

    with pytest.raises(TypeError, match="AdditiveAttention has no key/value cache"):
        AdditiveAttention(8).init(jax.random.PRNGKey(0), enc, enc, enc, decode=True)


def test_cached_call_of_a_gluon_layer_given_weights_only(backend: str) -> None:
    """A Gluon decoder given ``set_weights`` but never ``initialize()``d serves a cached call
    (its fixed table ``P`` gets its values then, as in an uncached first call)."""
    if backend != "mxnet":
        pytest.skip("Gluon's initialize() convention")
    import mxnet as mx

    from backends.mxnet import TransformerDecoder
    from backends.numpy import TransformerDecoder as NumpyDecoder

    rng = np.random.default_rng(18)
    tokens, enc, lens = _inputs(rng, True)
    reference = NumpyDecoder(V, h, 12, H, 1, max_len=8, seed=0)
    full = reference(tokens, enc.astype(np.float32), lens)
    layer = TransformerDecoder(V, h, 12, H, 1, max_len=8)
    layer.set_weights(reference.get_weights())
    logits, _ = layer(mx.np.array(tokens[:, :3], dtype="int32"),
                      mx.np.array(enc, dtype="float32"), mx.np.array(lens), capacity=STEPS)
    assert max_diff(logits.asnumpy(), full[:, :3]) <= BOUND


def test_failed_cached_call_changes_nothing(backend: str) -> None:
    """Cached calls refused for a bad position, batch, length or token leave the cache they
    were given and the layer as they were: the next good call with that cache gives the
    logits it gave before the failures."""
    rng = np.random.default_rng(20)
    hb = Harness(backend)
    layer = hb.make("TransformerDecoder", {"vocab_size": V, "num_hiddens": h,
                                           "ffn_num_hiddens": 12, "num_heads": H, "num_blks": 2,
                                           "max_len": 16})
    tokens, enc, lens = _inputs(rng, True)
    cross = [hb.array(enc, "float32"), hb.array(lens)]
    _, cache = hb.call(layer, hb.array(tokens[:, :3].astype(np.int32)), *cross, capacity=STEPS)
    held = [hb.numpy(x) for block in cache for pair in block for x in pair]
    weights = {k: np.array(v) for k, v in layer.get_weights().items()}
    step = hb.array(tokens[:, 3:4].astype(np.int32))
    good, _ = hb.call(layer, step, *cross, cache=cache, start=3)
    bad_calls = {
        r"start \+ positions must be <= the cache's capacity":
            lambda: hb.call(layer, step, *cross, cache=cache, start=STEPS),
        r"enc_outputs batch size \(2\) must equal tokens batch size \(1\)":
            lambda: hb.call(layer, hb.array(tokens[:1, 3:4].astype(np.int32)), *cross,
                            cache=cache, start=3),
        r"enc_valid_lens must have shape \(B,\) or \(B, Q\)":
            lambda: hb.call(layer, step, cross[0], hb.array(np.array([1, 2, 3])), cache=cache,
                            start=3),
    }
    if hb.name != "keras-jax":  # Keras makes NumPy inputs JAX arrays, whose values are not read
        bad_calls[r"tokens must be in \[0, vocab_size\)"] = lambda: hb.call(
            layer, np.full((B, 1), V, np.int32), *cross, cache=cache, start=3)
    for what, bad in bad_calls.items():
        with pytest.raises(ValueError, match=what):
            bad()
        now = [hb.numpy(x) for block in cache for pair in block for x in pair]
        assert all(np.array_equal(a, b) for a, b in zip(held, now, strict=True)), what
    assert all(np.array_equal(weights[k], v) for k, v in layer.get_weights().items())
    again, _ = hb.call(layer, step, *cross, cache=cache, start=3)
    assert max_diff(hb.numpy(again), hb.numpy(good)) == 0
