"""A sequence split into shards: each shard's queries over every shard's keys, merged by their
log-sum-exp, give one device's attention (the engine-free part of ring attention).

The shards are made and visited in one process here; the frameworks' engines only move them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import attention_core as ac
from attention_core import parallel as par
from attention_core.cache import Positions
from attention_core.registry import ops_for
from conftest import test_backends
from tests import naive
from tests.harness import Harness, max_diff

B, H, N, D, SHARDS = 2, 3, 16, 4, 4
BOUND = 1e-5

LENGTHS = np.array([5, 13])
SEGMENTS = np.array([[0] * 6 + [1] * 7 + [2] * 3, [0] * 2 + [1] * 14], np.int32)
MASKS: dict[str, dict[str, Any]] = {
    "none": {}, "causal": {"causal": True}, "causal_window": {"causal": True, "window": 3},
    "window": {"window": 5}, "lengths": {"valid_lens": LENGTHS},
    "causal_segments": {"causal": True, "segment_ids": SEGMENTS},
}


def _ring(hb: Harness, q: Any, k: Any, v: Any, layout: str, **masks: Any) -> np.ndarray:
    """Every shard's queries over every shard's keys in turn, merged; the whole sequence.

    Lengths, segment ids and a mask for the whole sequence become each block's mask
    (:func:`~attention_core.parallel.block_masks`); sinks count once, in the first block.
    """
    ops = ops_for(q, "q")
    given = {n: masks.pop(n) for n in ("valid_lens", "segment_ids", "mask") if n in masks}
    sinks = masks.pop("sinks", None)
    outs = []
    for r in range(SHARDS):
        query_at = par.shard_positions(N, SHARDS, r, layout)
        done = None
        for s in range(SHARDS):
            key_at = par.shard_positions(N, SHARDS, s, layout)
            extra = {} if sinks is None or s else {"sinks": sinks}
            part = ac.dot_product_attention(
                par.shard(ops, q, SHARDS, r, 2, layout), par.shard(ops, k, SHARDS, s, 2, layout),
                par.shard(ops, v, SHARDS, s, 2, layout), return_lse=True,
                mask=par.block_masks(ops, hb.array(query_at), hb.array(key_at), **given),
                _positions=Positions(0, hb.array(query_at[None])),
                _key_positions=hb.array(key_at[None]), **masks, **extra)
            done = par.merge(ops, done, part)
        outs.append(done[0])
    return hb.numpy(par.unshard(ops, outs, 2, layout))


@pytest.mark.parametrize("layout", par.LAYOUTS)
@pytest.mark.parametrize("mask", list(MASKS))
def test_shards_merged_equal_one_device(backend: str, layout: str, mask: str) -> None:
    """Against the float64 reference, every mask kind the positions decide."""
    hb = Harness(backend)
    rng = np.random.default_rng(41)
    q, k, v = (rng.standard_normal((B, H, N, D)).astype(np.float32) for _ in range(3))
    given = {n: hb.array(x) if isinstance(x, np.ndarray) else x for n, x in MASKS[mask].items()}
    got = _ring(hb, *(hb.array(x) for x in (q, k, v)), layout, **given)
    i, j = np.arange(N)[:, None], np.arange(N)[None]
    visible = np.ones((B, H, N, N), bool)
    if MASKS[mask].get("causal"):
        visible &= j <= i
    if MASKS[mask].get("window"):
        visible &= np.abs(i - j) < MASKS[mask]["window"]
    if "valid_lens" in MASKS[mask]:
        visible &= (j < LENGTHS[:, None, None, None])
    if "segment_ids" in MASKS[mask]:
        visible &= (SEGMENTS[:, None, :, None] == SEGMENTS[:, None, None, :])
    want, _ = naive.attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                              visible, lambda a, b: float(a @ b) / np.sqrt(D))
    assert max_diff(got, want) <= BOUND


def test_zigzag_balances_causal_work() -> None:
    """Under a causal mask every zigzag shard sees as many (query, key) pairs."""
    i, j = np.arange(64)[:, None], np.arange(64)[None]
    for layout, even in (("zigzag", True), ("contiguous", False)):
        pairs = [int((j <= i)[par.shard_positions(64, 4, r, layout)].sum()) for r in range(4)]
        assert (len(set(pairs)) == 1) == even, (layout, pairs)


def test_layouts_round_trip_and_refuse_uneven_lengths() -> None:
    x = np.arange(2 * 24).reshape(2, 24)
    ops = ops_for(x, "x")
    for layout in par.LAYOUTS:
        parts = [par.shard(ops, x, 3, r, 1, layout) for r in range(3)]
        np.testing.assert_array_equal(par.unshard(ops, parts, 1, layout), x)
    with pytest.raises(ValueError, match="cannot be cut into 8 equal chunks"):
        par.shard_positions(20, 4, 0, "zigzag")



@pytest.mark.skipif("numpy" not in test_backends(), reason="framework-free; runs in the numpy env")
def test_block_visible_finds_exactly_the_blocks_with_a_visible_pair() -> None:
    """Against every pair, on random position sets (zigzag-like: two runs each): a block is
    skipped only when causal and window masking hide all its pairs."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        runs = [rng.integers(0, 60, 2) for _ in range(4)]
        q, k = (np.concatenate([np.arange(a, a + rng.integers(1, 6)) for a in pair])
                for pair in (runs[0], runs[1]))
        causal, window = bool(rng.integers(2)), [None, 1, 3, 8][rng.integers(4)]
        d = q[:, None] - k[None, :]
        pairs = np.ones_like(d, bool)
        if causal:
            pairs &= d >= 0
        if window is not None:
            pairs &= np.abs(d) < window
        assert par.block_visible(q, k, causal, window) == bool(pairs.any()), (q, k, causal,
                                                                              window)
