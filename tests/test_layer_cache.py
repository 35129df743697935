"""A key/value cache on the attention layers: ``cache=``, ``start=``, ``capacity=`` in the call.

``MultiHeadAttention``, ``DotProductAttention`` and ``RelativeMultiHeadAttention`` run a
prompt, single tokens and a chunk against their cache and give the full causal pass, with
grouped-query heads, rotary and ALiBi positions, a window, soft-capping and sinks; the
functional ``multi_head_attention`` takes the same cache and the layer's own
``get_weights()``; one compiled step serves every position.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import attention_core as ac
from tests import naive
from tests.harness import Harness, max_diff

#: These tests run on the columns too (conftest.py; tests.harness.COLUMNS).
COLUMN_TESTS = True

B, STEPS, WIDTH, HEADS = 2, 7, 16, 4
BOUND = 1e-5
#: A prompt of 3, then 1, 1, a chunk of 2.
CHUNKS = ((0, 3), (3, 1), (4, 1), (5, 2))

LAYERS: dict[str, tuple[str, dict[str, Any]]] = {
    "mha_gqa_rotary": ("MultiHeadAttention", {"num_hiddens": WIDTH, "num_heads": HEADS,
                                              "num_kv_heads": 2, "positional": "rotary"}),
    "mha_alibi_window_sinks": ("MultiHeadAttention", {
        "num_hiddens": WIDTH, "num_heads": HEADS, "positional": "alibi", "window": 3,
        "softcap": 5.0, "sinks": True, "scale": 0.3, "bias": True}),
    "dpa_rotary": ("DotProductAttention", {"positional": "rotary"}),
    "dpa_window_softcap": ("DotProductAttention", {"window": 2, "softcap": 4.0}),
    "relative": ("RelativeMultiHeadAttention", {"num_hiddens": WIDTH, "num_heads": HEADS,
                                                "max_relative_position": 2, "bias": True}),
}


def _layer(hb: Harness, name: str, x: Any) -> Any:
    """The layer, built by one call, with random sinks where it learns them."""
    kind, config = LAYERS[name]
    layer = hb.make(kind, config)
    hb.call(layer, x, x, x)
    if config.get("sinks"):
        rng = np.random.default_rng(3)
        weights = {n: (rng.uniform(-2, 2, w.shape).astype(w.dtype) if n == "sink_logits" else w)
                   for n, w in layer.get_weights().items()}
        layer.set_weights(weights)
    return layer


@pytest.mark.parametrize("name", list(LAYERS))
def test_cached_layer_equals_the_causal_pass(backend: str, name: str) -> None:
    """Chunks against the cache, ``start`` an int or an integer scalar array by turns."""
    hb = Harness(backend)
    X = np.random.default_rng(21).standard_normal((B, STEPS, WIDTH)).astype(np.float32)
    layer = _layer(hb, name, hb.array(X))
    full = hb.numpy(hb.call(layer, *[hb.array(X)] * 3, causal=True))
    for setup in hb.setups():
        setup(layer)
    pieces, cache = [], None
    for start, n in CHUNKS:
        x = hb.array(X[:, start:start + n])
        at: Any = start if start % 2 else hb.array(np.array(start, np.int32))
        extra = {"capacity": STEPS} if cache is None else {"cache": cache, "start": at}
        out, cache = hb.call(layer, x, x, x, **extra)
        pieces.append(hb.numpy(out))
    assert max_diff(np.concatenate(pieces, axis=1), full) <= BOUND
    kind, config = LAYERS[name]
    heads = (config.get("num_kv_heads") or HEADS,) if "MultiHead" in kind else ()
    depth = WIDTH // HEADS if heads else WIDTH
    rows = min(STEPS, config.get("window") or STEPS)  # a windowed layer's ring: the window
    assert [tuple(c.shape) for c in cache] == [(B, *heads, rows, depth)] * 2


def test_cached_relative_attention_equals_the_float64_reference(backend: str) -> None:
    """Relative positions against a cache: each query's offsets measured from its position
    ``start + i``, the chunks of :data:`CHUNKS` equal to Shaw et al.'s causal attention in
    float64, one pair of positions at a time."""
    hb = Harness(backend)
    X = np.random.default_rng(23).standard_normal((B, STEPS, WIDTH)).astype(np.float32)
    layer = _layer(hb, "relative", hb.array(X))
    w = {n: x.astype(np.float64) for n, x in layer.get_weights().items()}
    causal = np.broadcast_to(np.tril(np.ones((STEPS, STEPS), bool)), (B, HEADS, STEPS, STEPS))
    expected, _ = naive.relative_multi_head(*[X.astype(np.float64)] * 3, w, HEADS, causal)
    pieces, cache = [], None
    for start, n in CHUNKS:
        x = hb.array(X[:, start:start + n])
        extra = {"capacity": STEPS} if cache is None else {"cache": cache, "start": start}
        out, cache = hb.call(layer, x, **extra)
        pieces.append(hb.numpy(out))
    assert max_diff(np.concatenate(pieces, axis=1), expected) <= BOUND


def test_the_cache_a_layer_makes(backend: str) -> None:
    """``capacity`` makes a cache of the key/value heads; the call returns ``(output, cache)``."""
    hb = Harness(backend)
    x = hb.array(np.random.default_rng(22).standard_normal((B, 3, 64)).astype(np.float32))
    layer = hb.make("MultiHeadAttention", {"num_hiddens": 64, "num_heads": 8,
                                           "num_kv_heads": 2, "positional": "rotary"})
    out, cache = hb.call(layer, x, x, x, cache=None, start=0, capacity=16)
    assert tuple(out.shape) == (B, 3, 64)
    assert [tuple(c.shape) for c in cache] == [(B, 2, 16, 8)] * 2


def test_functional_cache_takes_the_layers_weights(backend: str) -> None:
    """``multi_head_attention(..., cache=, capacity=)`` with ``layer.get_weights()`` gives the
    layer's cached outputs."""
    hb = Harness(backend)
    X = np.random.default_rng(23).standard_normal((B, STEPS, WIDTH)).astype(np.float32)
    layer = _layer(hb, "mha_gqa_rotary", hb.array(X))
    weights = layer.get_weights()
    options = {"num_kv_heads": 2, "positional": "rotary"}
    by_layer, by_function, cache_l, cache_f = [], [], None, None
    for start, n in CHUNKS:
        x = hb.array(X[:, start:start + n])
        extra_l = {"capacity": STEPS} if cache_l is None else {"cache": cache_l, "start": start}
        extra_f = {"capacity": STEPS} if cache_f is None else {"cache": cache_f, "start": start}
        out, cache_l = hb.call(layer, x, x, x, **extra_l)
        by_layer.append(hb.numpy(out))
        if backend in ("keras-jax", "keras-torch", "nnx"):
            continue  # the functional API on the column's arrays runs in its backend's env
        out, cache_f = ac.multi_head_attention(x, x, x, weights, HEADS, **options, **extra_f)
        by_function.append(hb.numpy(out))
    if by_function:
        assert max_diff(np.concatenate(by_function, 1), np.concatenate(by_layer, 1)) <= BOUND


def test_flax_decode_keeps_an_attention_cache_in_its_collection(backend: str) -> None:
    """Flax's convention on ``MultiHeadAttention``: ``decode=True`` on inputs as long as the
    decoding makes the ``'cache'`` collection; each jitted step feeds the next position."""
    if backend != "jax":
        pytest.skip("the 'cache' collection is Flax's convention")
    import jax
    import jax.numpy as jnp

    from backends.jax import MultiHeadAttention

    X = jnp.asarray(np.random.default_rng(24).standard_normal((B, STEPS, WIDTH)), jnp.float32)
    layer = MultiHeadAttention(WIDTH, HEADS, num_kv_heads=2, positional="rotary")
    params = layer.init(jax.random.PRNGKey(0), X, X, X)["params"]
    full = np.asarray(layer.apply({"params": params}, X, X, X, causal=True))
    _, made = layer.apply({"params": params}, X, X, X, decode=True, mutable=["cache"])
    cache, traces = made["cache"], []

    def step(cache: Any, x: Any) -> Any:
        traces.append(1)
        return layer.apply({"params": params, "cache": cache}, x, x, x, decode=True,
                           mutable=["cache"])

    compiled, rows = jax.jit(step), []
    for t in range(STEPS):
        out, mutated = compiled(cache, X[:, t:t + 1])
        cache = mutated["cache"]
        rows.append(np.asarray(out))
    assert max_diff(np.concatenate(rows, axis=1), full) <= BOUND
    assert int(cache["index"]) == STEPS and len(traces) == 1


def test_cached_attention_steps_compile_once(backend: str) -> None:
    """One compiled step of ``multi_head_attention`` with its cache (grouped-query heads,
    rotary, a window) serves every position, the position a run-time array."""
    from tests.test_cache import _compiled

    hb = Harness(backend)
    if not hasattr(hb.hooks, "compiled_step") and not hasattr(hb.hooks, "compiled_function"):
        pytest.skip(f"{backend} compiles no plain function")
    if backend == "torch":  # 30 s of Inductor; tests/test_cache.py compiles the same path
        pytest.skip("torch.compile of the cached heads runs in tests/test_cache.py")
    X = np.random.default_rng(25).standard_normal((B, STEPS, WIDTH)).astype(np.float32)
    layer = _layer(hb, "mha_gqa_rotary", hb.array(X))
    w = {n: hb.array(v) for n, v in layer.get_weights().items()}
    options = {"num_kv_heads": 2, "positional": "rotary", "window": 3}
    full = hb.numpy(ac.multi_head_attention(*[hb.array(X)] * 3, w, HEADS, causal=True,
                                            **options))

    def step(x: Any, start: Any, cache: Any) -> Any:
        return ac.multi_head_attention(x, x, x, w, HEADS, cache=cache, start=start, **options)

    compiled, traces = _compiled(hb, step)
    x0 = hb.array(X[:, :1])
    first, cache = ac.multi_head_attention(x0, x0, x0, w, HEADS, capacity=STEPS, **options)
    rows = [hb.numpy(first)]
    for t in range(1, STEPS):
        out, cache = compiled(hb.array(X[:, t:t + 1]), hb.array(np.array(t, np.int32)), cache)
        rows.append(hb.numpy(out))
    assert max_diff(np.concatenate(rows, axis=1), full) <= BOUND
    assert traces() == 1, f"the step was traced {traces()} times"


#: A ragged batch: 4 prompts of lengths 3, 8, 5 and 1 padded to 8, then 4 single tokens.
LENGTHS, PROMPT, MORE = np.array([3, 8, 5, 1]), 8, 4


@pytest.mark.parametrize(("name", "padding"), [("mha_gqa_rotary", "left"),
                                                ("mha_alibi_window_sinks", "right"),
                                                ("dpa_rotary", "left"), ("relative", "left")])
def test_ragged_batch_equals_each_example_alone(backend: str, name: str, padding: str) -> None:
    """Prompts of different lengths, padded, prefill in one call (``start`` per example,
    ``lengths``) and decode together: each example's rows equal its own causal pass (the
    first rows of the unpadded causal pass: a causal row sees no later token)."""
    hb = Harness(backend)
    X = np.random.default_rng(26).standard_normal((4, PROMPT + MORE, WIDTH)).astype(np.float32)
    layer = _layer(hb, name, hb.array(X[:1, :2]))
    alone = hb.numpy(hb.call(layer, hb.array(X), causal=True))
    prompt = np.zeros((4, PROMPT, WIDTH), np.float32)
    for b, n in enumerate(LENGTHS):
        if padding == "left":
            prompt[b, PROMPT - n:] = X[b, :n]
        else:
            prompt[b, :n] = X[b, :n]
    out, cache = hb.call(layer, hb.array(prompt), capacity=16, start=np.zeros(4, np.int32),
                         lengths=LENGTHS, padding=padding)
    out = hb.numpy(out)
    worst = max(max_diff(out[b, PROMPT - n:] if padding == "left" else out[b, :n], alone[b][:n])
                for b, n in enumerate(LENGTHS))
    start = LENGTHS.astype(np.int32)
    for s in range(MORE):
        x = hb.array(np.stack([X[b, n + s] for b, n in enumerate(LENGTHS)])[:, None])
        step, cache = hb.call(layer, x, cache=cache, start=hb.array(start) if s % 2 else start)
        step = hb.numpy(step)
        worst = max(worst, *(max_diff(step[b, 0], alone[b][n + s])
                             for b, n in enumerate(LENGTHS)))
        start = start + 1
    assert worst <= BOUND
