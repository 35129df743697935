"""A sliding-window layer's cache is a ring of ``min(capacity, window)`` rows.

Position ``p`` sits at slot ``p mod R``; a call attends to the ring's rows, then its own new
ones, before it writes them. Decoding far past the ring, a prefill in chunks longer than the
window, and a ragged batch each equal the full windowed causal pass (computed uncached, with
no cache in it); one compiled step serves every position.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import attention_core as ac
from tests.harness import Harness, max_diff

#: Not on the columns (conftest.py): the ring is the core's; the columns' cached calls are
#: tested in tests/test_layer_cache.py.
COLUMN_TESTS = False

B, WIDTH, HEADS, W = 2, 16, 4, 4
BOUND = 1e-5

LAYERS: dict[str, tuple[str, dict[str, Any]]] = {
    "mha_gqa_rotary": ("MultiHeadAttention", {"num_hiddens": WIDTH, "num_heads": HEADS,
                                              "num_kv_heads": 2, "positional": "rotary",
                                              "window": W}),
    "mha_alibi": ("MultiHeadAttention", {"num_hiddens": WIDTH, "num_heads": HEADS,
                                         "positional": "alibi", "window": W, "softcap": 5.0}),
    "dpa_rotary": ("DotProductAttention", {"positional": "rotary", "window": W}),
}


def _layer(hb: Harness, name: str, window: int = W) -> tuple[Any, tuple[int, ...]]:
    """The layer, built by one call, and the shape of a cache row block ``(B, [Hkv])``."""
    kind, config = LAYERS[name]
    layer = hb.make(kind, {**config, "window": window})
    x = hb.array(np.zeros((B, 2, WIDTH), np.float32))
    hb.call(layer, x, x, x)
    heads = (config.get("num_kv_heads") or HEADS,) if kind == "MultiHeadAttention" else ()
    return layer, heads


def _full(hb: Harness, layer: Any, X: np.ndarray) -> np.ndarray:
    """The uncached windowed causal pass: the reference."""
    return hb.numpy(hb.call(layer, *[hb.array(X)] * 3, causal=True))


def test_a_long_capacity_keeps_the_window(backend: str) -> None:
    """capacity 8192 with window 256: each cache holds 256 positions, on the attention layers
    and on a windowed decoder's blocks."""
    hb = Harness(backend)
    x = hb.array(np.random.default_rng(30).standard_normal((B, 3, WIDTH)).astype(np.float32))
    for name in ("mha_gqa_rotary", "dpa_rotary"):
        layer, heads = _layer(hb, name, 256)
        _, cache = hb.call(layer, x, x, x, capacity=8192)
        depth = WIDTH // HEADS if heads else WIDTH
        assert [tuple(c.shape) for c in cache] == [(B, *heads, 256, depth)] * 2, name
        _, cache = hb.call(layer, x, x, x, cache=cache, start=3, capacity=8192)
        assert [tuple(c.shape) for c in cache] == [(B, *heads, 256, depth)] * 2, name
    decoder = hb.make("TransformerDecoder", {
        "vocab_size": 10, "num_hiddens": WIDTH, "ffn_num_hiddens": 8, "num_heads": HEADS,
        "num_blks": 2, "decoder_only": True, "num_kv_heads": 2, "positional": "rotary",
        "window": 256})
    _, cache = hb.call(decoder, hb.array(np.ones((B, 3), np.int32)), capacity=8192)
    assert [tuple(x.shape) for block in cache for pair in block for x in pair] == [
        (B, 2, 256, WIDTH // HEADS)] * 4


@pytest.mark.parametrize("name", list(LAYERS))
def test_decoding_past_the_ring_equals_the_windowed_pass(backend: str, name: str) -> None:
    """A prompt of 6 (longer than the ring of 4), then 14 single tokens (the ring turned over
    3 times more), ``start`` an int or an integer scalar array by turns: the full windowed
    causal pass, row for row."""
    hb = Harness(backend)
    X = np.random.default_rng(31).standard_normal((B, 20, WIDTH)).astype(np.float32)
    layer, heads = _layer(hb, name)
    full = _full(hb, layer, X)
    for setup in hb.setups():
        setup(layer)
    x = hb.array(X[:, :6])
    out, cache = hb.call(layer, x, x, x, capacity=64)
    pieces = [hb.numpy(out)]
    for t in range(6, 20):
        x = hb.array(X[:, t:t + 1])
        at: Any = t if t % 2 else hb.array(np.array(t, np.int32))
        out, cache = hb.call(layer, x, x, x, cache=cache, start=at)
        pieces.append(hb.numpy(out))
    assert max_diff(np.concatenate(pieces, axis=1), full) <= BOUND
    assert tuple(cache[0].shape)[:-1] == (B, *heads, W)


@pytest.mark.parametrize("name", ["mha_gqa_rotary", "dpa_rotary"])
def test_chunks_longer_than_the_window(backend: str, name: str) -> None:
    """A prefill in chunks of 5 with a window of 3: each chunk sees the ring's keys and its
    own, so the chunks give the full pass."""
    hb = Harness(backend)
    X = np.random.default_rng(32).standard_normal((B, 17, WIDTH)).astype(np.float32)
    layer, _ = _layer(hb, name, 3)
    full = _full(hb, layer, X)
    pieces, cache = [], None
    for start in range(0, 17, 5):
        x = hb.array(X[:, start:start + 5])
        extra = {"capacity": 8} if cache is None else {"cache": cache, "start": start}
        out, cache = hb.call(layer, x, x, x, **extra)
        pieces.append(hb.numpy(out))
    assert max_diff(np.concatenate(pieces, axis=1), full) <= BOUND


#: A ragged batch: prompts of lengths 3, 8, 5 and 1 padded to 8 (longer than the ring), then
#: 6 single tokens.
LENGTHS, PROMPT, MORE = np.array([3, 8, 5, 1]), 8, 6


@pytest.mark.parametrize(("name", "padding"), [("mha_gqa_rotary", "left"),
                                                ("mha_gqa_rotary", "right"),
                                                ("dpa_rotary", "left")])
def test_ragged_batch_with_a_ring(backend: str, name: str, padding: str) -> None:
    """Padded prompts prefill a ring in one call (``start`` per example, ``lengths``) and
    decode together: each example's rows equal its own windowed pass."""
    hb = Harness(backend)
    X = np.random.default_rng(33).standard_normal((4, PROMPT + MORE, WIDTH)).astype(np.float32)
    layer, _ = _layer(hb, name)
    alone = _full(hb, layer, X)  # each row's causal pass sees no later token
    prompt = np.zeros((4, PROMPT, WIDTH), np.float32)
    for b, n in enumerate(LENGTHS):
        if padding == "left":
            prompt[b, PROMPT - n:] = X[b, :n]
        else:
            prompt[b, :n] = X[b, :n]
    x = hb.array(prompt)
    out, cache = hb.call(layer, x, x, x, capacity=64, start=np.zeros(4, np.int32),
                         lengths=LENGTHS, padding=padding)
    out = hb.numpy(out)
    worst = max(max_diff(out[b, PROMPT - n:] if padding == "left" else out[b, :n], alone[b][:n])
                for b, n in enumerate(LENGTHS))
    start = LENGTHS.astype(np.int32)
    for s in range(MORE):
        x = hb.array(np.stack([X[b, n + s] for b, n in enumerate(LENGTHS)])[:, None])
        step, cache = hb.call(layer, x, x, x, cache=cache,
                              start=hb.array(start) if s % 2 else start)
        step = hb.numpy(step)
        worst = max(worst, *(max_diff(step[b, 0], alone[b][n + s])
                             for b, n in enumerate(LENGTHS)))
        start = start + 1
    assert worst <= BOUND
    assert tuple(cache[0].shape)[-2] == W


def test_one_compiled_step_serves_every_position_of_a_ring(backend: str) -> None:
    """One compiled step of ``multi_head_attention`` with a ring (grouped-query heads, rotary,
    a window of 3), its position a run-time array, traced once, past the ring many times."""
    from tests.test_cache import _compiled

    hb = Harness(backend)
    if not hasattr(hb.hooks, "compiled_step") and not hasattr(hb.hooks, "compiled_function"):
        pytest.skip(f"{backend} compiles no plain function")
    if backend == "torch":  # 30 s of Inductor; tests/test_cache.py compiles the same path
        pytest.skip("torch.compile of the cached heads runs in tests/test_cache.py")
    X = np.random.default_rng(34).standard_normal((B, 12, WIDTH)).astype(np.float32)
    layer, _ = _layer(hb, "mha_gqa_rotary", 3)
    w = {n: hb.array(v) for n, v in layer.get_weights().items()}
    options = {"num_kv_heads": 2, "positional": "rotary", "window": 3}
    full = hb.numpy(ac.multi_head_attention(*[hb.array(X)] * 3, w, HEADS, causal=True,
                                            **options))

    def step(x: Any, start: Any, cache: Any) -> Any:
        return ac.multi_head_attention(x, x, x, w, HEADS, cache=cache, start=start, **options)

    compiled, traces = _compiled(hb, step)
    x0 = hb.array(X[:, :2])
    first, cache = ac.multi_head_attention(x0, x0, x0, w, HEADS, capacity=4096, **options)
    rows = [hb.numpy(first)]
    for t in range(2, 12):
        out, cache = compiled(hb.array(X[:, t:t + 1]), hb.array(np.array(t, np.int32)), cache)
        rows.append(hb.numpy(out))
    assert max_diff(np.concatenate(rows, axis=1), full) <= BOUND
    assert traces() == 1, f"the step was traced {traces()} times"
    assert tuple(cache[0].shape) == (B, 2, 3, WIDTH // HEADS)
