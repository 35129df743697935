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
from tests import naive
from tests.harness import Harness, max_diff

B, H, N, D, SHARDS = 2, 3, 16, 4, 4
BOUND = 1e-5

MASKS: dict[str, dict[str, Any]] = {
    "none": {}, "causal": {"causal": True}, "causal_window": {"causal": True, "window": 3},
    "window": {"window": 5},
}


def _ring(hb: Harness, q: Any, k: Any, v: Any, layout: str, **masks: Any) -> np.ndarray:
    """Every shard's queries over every shard's keys in turn, merged; the whole sequence."""
    ops = ops_for(q, "q")
    outs = []
    for r in range(SHARDS):
        at = Positions(0, hb.array(par.shard_positions(N, SHARDS, r, layout)[None]))
        done = None
        for s in range(SHARDS):
            keys_at = hb.array(par.shard_positions(N, SHARDS, s, layout)[None])
            part = ac.dot_product_attention(
                par.shard(ops, q, SHARDS, r, 2, layout), par.shard(ops, k, SHARDS, s, 2, layout),
                par.shard(ops, v, SHARDS, s, 2, layout), return_lse=True, _positions=at,
                _key_positions=keys_at, **masks)
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
    got = _ring(hb, *(hb.array(x) for x in (q, k, v)), layout, **MASKS[mask])
    i, j = np.arange(N)[:, None], np.arange(N)[None]
    visible = np.ones((N, N), bool)
    if MASKS[mask].get("causal"):
        visible &= j <= i
    if MASKS[mask].get("window"):
        visible &= np.abs(i - j) < MASKS[mask]["window"]
    want, _ = naive.attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                              np.broadcast_to(visible, (B, H, N, N)),
                              lambda a, b: float(a @ b) / np.sqrt(D))
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
