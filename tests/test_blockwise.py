"""The three ways of pooling (direct, blockwise, fused) give the float64 reference's numbers.

Every reference case of ``DotProductAttention`` and ``MultiHeadAttention`` (every mask kind,
fully masked rows and the edge shapes included) runs through the functional API with each
implementation the backend has, with blocks made small enough that every case spans several
query and key blocks with ragged tails. The reference files come from the direct float64
path and are confirmed by the loop-by-loop code of ``tests/naive.py``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import attention_core as ac
from attention_core import kernels
from attention_core.kernels import blockwise
from attention_core.modifiers import AllMasks, BooleanMask, Call, Causal, Lengths
from backends.numpy.ops import OPS as NP
from tests.harness import TOLERANCE, Harness, max_diff, tolerance
from tests.reference.cases import (
    CASES,
    MASK_KINDS,
    Case,
    function_options,
    has_score_terms,
    mask_arguments,
)
from tests.reference.generate import record

#: ``(KEY_BLOCK, TILE_SCORES)``: one key and one query per tile; ragged key blocks of 4 with one
#: query per tile; key blocks of 4 with all queries in one block.
BLOCKINGS = {"1x1": (1, 1), "1x4": (4, 1), "Qx4": (4, 10**6)}
#: Backends that run the one-by-one tiles too. The tiles' loop is the core's on every backend,
#: and "1x4" already cuts every query into its own tile; one key per tile costs eager JAX and
#: TensorFlow a compiled op per primitive and tile shape (4 of the jax env's 12 minutes).
EVERY_BLOCKING = ("numpy", "torch")
#: The other backends run "1x4" on the DotProductAttention cases (every mask kind, edge and
#: score term): a multi-head case adds projections around the same tiles, which "Qx4" and the
#: backends above run in every case.
SMALL_TILE_LAYERS = ("DotProductAttention",)


def attention_cases() -> list[Any]:
    return [pytest.param(c, id=f"{c.layer}-{c.name}") for c in CASES
            if c.layer in ("DotProductAttention", "MultiHeadAttention")]


def _inputs(h: Harness, case: Case) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    ref = record(case)
    x = {k[6:]: h.array(v, "float32") for k, v in ref.items() if k.startswith("input.")}
    w = {k[7:]: h.array(v, "float32") for k, v in ref.items() if k.startswith("weight.")}
    kw = {k[5:]: (bool(v) if k == "call.causal" else h.array(v))
          for k, v in ref.items() if k.startswith("call.")}
    return x, w, kw


def kernel_names(h: Harness) -> set[str]:
    """The names of the kernels the harness's backend has."""
    return {entry.name for entry in kernels.kernels(h.ops.name)}


#: Why a fused kernel may refuse a reference case: what the case asks that it cannot do.
FUSED_REFUSALS = ("does not take the score modifiers", "needs values as deep as the keys")


def _run(case: Case, x: dict[str, Any], w: dict[str, Any], kw: dict[str, Any], impl: str) -> Any:
    if case.layer == "DotProductAttention":
        return ac.dot_product_attention(x["queries"], x["keys"], x["values"], implementation=impl,
                                        **kw, **function_options(case))
    return ac.multi_head_attention(x["queries"], x["keys"], x["values"], w,
                                   case.config["num_heads"], implementation=impl, **kw,
                                   **function_options(case))


@pytest.mark.parametrize("blocking", list(BLOCKINGS))
@pytest.mark.parametrize("case", attention_cases())
def test_every_implementation_matches_reference(backend: str, case: Case, blocking: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    if blocking == "1x1" and backend not in EVERY_BLOCKING:
        pytest.skip(f"one key per tile runs on {', '.join(EVERY_BLOCKING)} (the same loop)")
    if (blocking == "1x4" and backend not in EVERY_BLOCKING
            and case.layer not in SMALL_TILE_LAYERS):
        pytest.skip(f"one query per tile runs the {', '.join(SMALL_TILE_LAYERS)} cases here")
    key_block, tile = BLOCKINGS[blocking]
    monkeypatch.setattr(blockwise, "KEY_BLOCK", key_block)
    monkeypatch.setattr(blockwise, "TILE_SCORES", tile)
    monkeypatch.setattr(blockwise, "MIN_QUERY_BLOCK", 1)
    h = Harness(backend)
    x, w, kw = _inputs(h, case)
    expected = record(case)["output.out"]
    impls = ["direct", "blockwise"] + (["fused"] if "fused" in kernel_names(h) else [])
    for impl in impls:
        try:
            out = h.numpy(_run(case, x, w, kw, impl))
        except ValueError as err:  # the call asks what the kernel cannot do: refused, saying so
            assert impl == "fused" and any(r in str(err) for r in FUSED_REFUSALS), err
            assert str(err).startswith("implementation='fused' "), err
            assert has_score_terms(case) or "values as deep" in str(err), err
            continue
        assert not np.isnan(out).any(), impl
        assert max_diff(out, expected) <= TOLERANCE["float32"], impl


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64"])
def test_blockwise_in_every_dtype(backend: str, dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(backend)
    if dtype == "float64" and backend in ("jax", "mxnet"):
        pytest.skip(f"{backend} runs float32 here")
    if dtype != "float64" and backend not in ("numpy", "torch"):
        pytest.skip("half precisions are exercised on numpy and torch")
    if dtype == "bfloat16" and backend == "numpy":
        pytest.skip("NumPy has no bfloat16 matmul")
    monkeypatch.setattr(blockwise, "KEY_BLOCK", 3)
    monkeypatch.setattr(blockwise, "MIN_QUERY_BLOCK", 1)
    monkeypatch.setattr(blockwise, "TILE_SCORES", 2 * 2 * 3)
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, 2, n, 8)) for n in (7, 10, 10))
    lens = np.array([0, 9])  # the first example sees nothing: zero rows, no NaN
    expected = ac.dot_product_attention(q, k, v, lens, causal=True)
    args = [h.array(a, dtype) for a in (q, k, v)]
    out = h.numpy(ac.dot_product_attention(*args, h.array(lens), causal=True,
                                           implementation="blockwise"))
    assert not np.isnan(out).any()
    assert np.all(out[0] == 0)
    assert max_diff(out, expected) <= TOLERANCE[dtype] * 4


def test_large_scores_and_far_apart_blocks(backend: str) -> None:
    """Scores of a few hundred (exp overflows without the running max), the largest in the
    last key block, so every earlier block is rescaled by exp(m - m') << 1."""
    h = Harness(backend)
    rng = np.random.default_rng(2)
    q = rng.standard_normal((1, 2, 5, 4)) * 10
    k = rng.standard_normal((1, 2, 2100, 4)) * 10
    k[..., -1, :] = q[..., 0:1, :].mean(axis=2) * 3  # a dominant key at the very end
    v = rng.standard_normal((1, 2, 2100, 3))
    expected = ac.dot_product_attention(q, k, v, scale=1.0)
    out = ac.dot_product_attention(*(h.array(a, "float32") for a in (q, k, v)), scale=1.0,
                                   implementation="blockwise")
    assert max_diff(h.numpy(out), expected) <= TOLERANCE["float32"] * 10


def bound(shape: tuple[int, ...], *mods: Any) -> tuple[Call, AllMasks]:
    """NumPy mask modifiers bound to a plain call of scores ``shape`` (queries on the last keys)."""
    call = Call(NP, shape, 0, shape[3] - shape[2])
    return call, AllMasks([m.bind(call) for m in mods])


def test_tiles_equal_slices_of_the_full_mask() -> None:
    rng = np.random.default_rng(3)
    B, H, Q, K = 2, 3, 9, 11
    user = rng.random((B, 1, Q, K)) < 0.7
    lens = rng.integers(0, K + 1, (B, Q))
    call, mask = bound((B, H, Q, K), Lengths(lens), BooleanMask(user), Causal())
    full = np.broadcast_to(mask.visible(call.whole()), (B, H, Q, K))
    for q0, qn, k0, kn in [(0, Q, 0, K), (2, 3, 4, 5), (8, 1, 0, 1), (0, 4, 7, 4), (5, 4, 0, 11)]:
        tile = np.broadcast_to(mask.visible(call.tile(q0, qn, k0, kn)), (B, H, qn, kn))
        np.testing.assert_array_equal(tile, full[:, :, q0:q0 + qn, k0:k0 + kn])


def test_known_lengths_and_the_causal_edge_span_the_visited_keys() -> None:
    """Keys past the longest valid length, or past the causal edge, are outside the span."""
    call, lengths = bound((2, 1, 8, 100), Lengths(np.array([30, 70])))
    assert lengths.span(call, 0, 8) == (0, 70)
    call, causal = bound((1, 1, 8, 8), Causal())
    assert [causal.span(call, q0, 2) for q0 in (0, 2, 6)] == [(0, 2), (0, 4), (0, 8)]
    call, empty = bound((1, 1, 4, 6), Lengths(np.array([0])))
    assert empty.span(call, 0, 4) == (0, 1)  # at least one key: the block's zero rows
    # a tile wholly inside every length and below the causal edge needs no mask at all
    call, both = bound((2, 1, 8, 8), Lengths(np.array([6, 8])), Causal())
    assert both.visible(call.tile(4, 4, 0, 4)) is None
    assert both.visible(call.tile(0, 4, 0, 4)) is not None


def test_bad_implementation_names_are_refused(backend: str) -> None:
    h = Harness(backend)
    x = h.array(np.ones((1, 2, 3)), "float32")
    with pytest.raises(ValueError) as err:
        ac.dot_product_attention(x, x, x, implementation="flash")
    assert str(err.value) == ("implementation must be None, 'direct', 'blockwise', 'fused' or a "
                              "registered kernel's name, got 'flash'")


def test_fused_on_a_backend_without_a_kernel(backend: str) -> None:
    h = Harness(backend)
    if "fused" in kernel_names(h):
        pytest.skip(f"{backend} has a fused kernel")
    x = h.array(np.ones((1, 2, 3)), "float32")
    with pytest.raises(ValueError) as err:
        ac.dot_product_attention(x, x, x, implementation="fused")
    assert str(err.value) == (f"implementation='fused': the {h.ops.name} backend has no kernel "
                              "of that name; its kernels are 'blockwise', 'direct'")


def test_block_sizes_respect_the_tile_budget() -> None:
    for bh, q, k in [(1, 128, 128), (8, 4096, 4096), (4, 65536, 65536), (64, 10, 100000)]:
        qb, kb = blockwise.block_sizes(bh, q, k)
        assert 1 <= qb <= q and 1 <= kb <= k
        assert bh * qb * kb <= max(blockwise.TILE_SCORES, bh * blockwise.MIN_QUERY_BLOCK * kb)


def test_recomputed_blocks_respect_their_budget() -> None:
    """A recomputed query block's tiles hold at most ``RECOMPUTE_SCORES`` scores, and it has
    at least ``MIN_QUERY_BLOCK`` queries; when its whole row of keys fits, it is one tile."""
    budget, fewest = blockwise.RECOMPUTE_SCORES, blockwise.MIN_QUERY_BLOCK
    for bh, q, k in [(1, 128, 128), (4, 16384, 16384), (8, 65536, 65536), (64, 10, 100000),
                     (2, 3, 5)]:
        qb, kb = blockwise.recompute_sizes(bh, q, k)
        assert min(q, fewest) <= qb <= q and 1 <= kb <= k
        assert bh * qb * kb <= max(budget, bh * qb)
        if bh * qb * k <= budget:
            assert kb == k
    assert blockwise.recompute_sizes(4, 16384, 16384) == (16, 16384)
    assert blockwise.recompute_sizes(8, 65536, 65536) == (16, 8192)


def test_layers_without_kept_weights_pool_blockwise(backend: str) -> None:
    """A layer told not to keep its weights gives the same output and keeps None."""
    h = Harness(backend)
    layer_kw: dict[str, Any] = {"keep_attention_weights": False, "implementation": "blockwise"}
    try:
        fast = h.make("MultiHeadAttention", {"num_hiddens": 8, "num_heads": 2, **layer_kw})
    except TypeError as err:
        pytest.fail(f"{backend}: MultiHeadAttention has no keep_attention_weights/implementation: {err}")
    slow = h.make("MultiHeadAttention", {"num_hiddens": 8, "num_heads": 2})
    rng = np.random.default_rng(4)
    x = h.array(rng.standard_normal((2, 5, 8)), "float32")
    lens = h.array(np.array([2, 5]))
    out_slow = h.call(slow, x, x, x, lens)
    h.call(fast, x, x, x, lens)  # builds it
    fast.set_weights(slow.get_weights())
    out_fast = h.call(fast, x, x, x, lens)
    assert max_diff(h.numpy(out_fast), h.numpy(out_slow)) <= TOLERANCE["float32"]
    assert h.attention_weights(fast) is None
    assert h.attention_weights(slow) is not None


#: Why a backend has no ``checkpoint`` hook: its blockwise backward is O(n) in memory already.
NO_CHECKPOINT = {
    "numpy": "NumPy has no autodiff",
    "torch": "torch trains on SDPA by default, whose backward recomputes the weights itself",
    "jax": "JAX differentiates the blockwise loops as compiled loops (lax.scan, lax.map)",
}


@pytest.mark.parametrize("kind", MASK_KINDS)
def test_recomputed_blocks_give_the_direct_gradients(backend: str, kind: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Gradients of q, k and v through the blockwise path, each query block recomputed in the
    backward pass (``ops.recompute_blocks``), equal the direct path's; the hook gets the
    blocks the budget allows, and is not used under dropout, whose recomputation would draw
    another mask."""
    h = Harness(backend)
    if not hasattr(h.ops, "recompute_blocks"):
        pytest.skip(NO_CHECKPOINT.get(backend, f"{backend} has no recompute_blocks hook"))
    B, H, Q, K = 2, 3, 13, 19
    # 4 queries a block (4, 4, 4, 1), the fewest allowed, each over ragged key blocks (5, 5, 5, 4)
    monkeypatch.setattr(blockwise, "MIN_QUERY_BLOCK", 4)
    monkeypatch.setattr(blockwise, "RECOMPUTE_SCORES", B * H * 4 * 5)
    calls: list[tuple[list[tuple[int, int]], bool]] = []
    hook = h.ops.recompute_blocks

    def counting(fn: Any, blocks: list[tuple[int, int]], *arrays: Any) -> Any:
        out = hook(fn, blocks, *arrays)
        calls.append((blocks, out is not None))
        return out

    monkeypatch.setattr(h.ops, "recompute_blocks", counting)
    rng = np.random.default_rng(len(kind))
    arrays = [rng.standard_normal((B, H, n, d)) for n, d in ((Q, 8), (K, 8), (K, 5))]
    masks = {name: x if name == "causal" else h.array(x)
             for name, x in mask_arguments(kind, rng, H, Q, K, B).items()}
    cotangent = rng.standard_normal((B, H, Q, 5))
    layer = h.make("DotProductAttention", {"dropout": 0.0})
    grads = {}
    for impl in ("direct", "blockwise"):
        def forward(_: Any, q: Any, k: Any, v: Any, impl: str = impl) -> dict[str, Any]:
            return {"out": ac.dot_product_attention(q, k, v, implementation=impl, ops=h.ops,
                                                    **masks)}

        _, got = h.forward_and_gradients(layer, forward, [h.array(x, "float32") for x in arrays],
                                         cotangent)
        grads[impl] = {name: h.numpy(g) for name, g in got.items()}
    assert calls == [([(0, 4), (4, 4), (8, 4), (12, 1)], True)]
    assert set(grads["blockwise"]) == {"input.0", "input.1", "input.2"}
    for name, want in grads["direct"].items():
        assert np.isfinite(grads["blockwise"][name]).all(), name
        bound = tolerance(f"grad.{name}", "float32", want)
        assert max_diff(grads["blockwise"][name], want) <= bound, name
    calls.clear()
    ac.dot_product_attention(*(h.array(x, "float32") for x in arrays), implementation="blockwise",
                             dropout=0.5, ops=h.ops, **masks)
    assert not calls
