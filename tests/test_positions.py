"""Positions per example (a ragged batch), on every backend, against float64 NumPy.

:func:`attention_core.cache.positions_of` places each example's real tokens; the mask and
score modifiers see explicit ``(B, Q)`` positions; ``dot_product_attention`` given a position
per example equals one call per example at its own offset, on every kernel that declares
``ragged``; rotary heads take ``(B, t)`` positions.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import attention_core as ac
from attention_core import kernels
from attention_core import modifiers as mods
from attention_core.cache import positions_of
from attention_core.positional import rotated_heads
from tests.harness import TOLERANCE, Harness, max_diff

TOL = TOLERANCE["float32"]
B, H, Q, K, D = 3, 4, 4, 12, 8
#: Each example's queries at its own positions, some not consecutive (padding clamped).
POSITIONS = np.array([[0, 1, 2, 3], [3, 4, 5, 6], [0, 0, 7, 8]], np.int32)
KEY_VALID = np.arange(K)[None, :] < np.array([4, 7, 9])[:, None]  # (B, K)
WINDOW = 3


def host_int(h: Harness, x: Any) -> np.ndarray:
    return np.asarray(h.ops.to_numpy(x)).astype(np.int64)


# -- positions_of ----------------------------------------------------------------------------


@pytest.mark.parametrize(("padding", "query", "valid"), [
    ("right", [[2, 3, 4, 5], [5, 6, 7, 8], [1, 2, 3, 4]],
     [[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]]),
    ("left", [[2, 3, 4, 5], [3, 4, 5, 6], [0, 0, 0, 0]],  # padding clamped to >= 0
     [[1, 1, 1, 1], [0, 0, 1, 1], [0, 0, 0, 0]]),
])
def test_positions_of_lengths(backend: str, padding: str, query: list[list[int]],
                              valid: list[list[int]]) -> None:
    """Starts [2, 5, 1], lengths [4, 2, 0] of t = 4: the real tokens at start_b .., in the
    columns the padding leaves them; the bound is known where the starts are."""
    h = Harness(backend)
    host = np.array([2, 5, 1], np.int32)
    lengths = h.array(np.array([4, 2, 0], np.int32))
    for start in (host, h.array(host)):
        got = positions_of(h.ops, start, 4, lengths=lengths, padding=padding)
        assert host_int(h, got.query).tolist() == query
        assert np.asarray(h.ops.to_numpy(got.valid)).tolist() == np.array(valid, bool).tolist()
        assert host_int(h, got.start).tolist() == [2, 5, 1]
        known = start is host or h.ops.concrete(start) is not None
        assert got.bound == (9 if known else None)


def test_positions_of_padding_mask(backend: str) -> None:
    """``start + cumsum(mask) - 1`` at the real tokens (Hugging Face's rule), clamped to >= 0."""
    h = Harness(backend)
    mask = np.array([[0, 0, 1, 1], [1, 1, 1, 1], [0, 1, 0, 1]], bool)
    got = positions_of(h.ops, np.array([0, 3, 6], np.int32), 4, padding_mask=h.array(mask))
    assert host_int(h, got.query).tolist() == [[0, 0, 0, 1], [3, 4, 5, 6], [5, 6, 6, 7]]
    assert np.asarray(h.ops.to_numpy(got.valid)).tolist() == mask.tolist()
    assert got.bound == 10


def test_positions_of_one_start_keeps_the_fast_path(backend: str) -> None:
    h = Harness(backend)
    got = positions_of(h.ops, 5, 3)
    assert (got.start, got.query, got.valid, got.bound) == (5, 5, None, 8)
    per_example = positions_of(h.ops, [1, 4], 2)
    assert host_int(h, per_example.query).tolist() == [[1, 2], [4, 5]]
    assert (per_example.valid, per_example.bound) == (None, 6)


# -- the modifiers from explicit (B, Q) positions --------------------------------------------


def call_at(h: Harness, key_valid: bool) -> mods.Call:
    return mods.Call.at(h.ops, (B, H, Q, K), h.array(POSITIONS),
                        key_valid=h.array(KEY_VALID) if key_valid else None)


def whole(h: Harness, mask: Any) -> np.ndarray:
    """A mask modifier's answer broadcast to ``(B, H, Q, K)`` (None: all visible)."""
    got = np.ones((B, H, Q, K), bool) if mask is None else np.asarray(h.ops.to_numpy(mask))
    return np.broadcast_to(got, (B, H, Q, K))


def user_mask(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return kv_idx + h != q_idx + b + 1


#: Each mask modifier, and its float64 reference from (B, 1, Q, 1) positions p and keys j.
MASKS: dict[str, tuple[Any, Any]] = {
    "causal": (lambda h: mods.Causal(), lambda p, j, b, hd: j <= p),
    "window": (lambda h: mods.Window(WINDOW), lambda p, j, b, hd: abs(p - j) < WINDOW),
    "lengths": (lambda h: mods.Lengths(h.array(np.array([5, 12, 2], np.int32))),
                lambda p, j, b, hd: j < np.array([5, 12, 2])[:, None, None, None]),
    "mask_mod": (lambda h: mods.MaskFunction(user_mask),
                 lambda p, j, b, hd: j + hd != p + b + 1),
}


@pytest.mark.parametrize("key_valid", [False, True], ids=["all_keys", "key_valid"])
@pytest.mark.parametrize("name", list(MASKS))
def test_mask_from_positions(backend: str, name: str, key_valid: bool) -> None:
    """Each query sees the keys its own position lets it see; causal and window also only the
    keys that hold a token."""
    h = Harness(backend)
    make, rule = MASKS[name]
    call = call_at(h, key_valid)
    got = whole(h, make(h).bind(call).visible(call.whole()))
    p = POSITIONS[:, None, :, None].astype(np.float64)
    j, b, hd = np.arange(K)[None, None, None], np.arange(B)[:, None, None, None], \
        np.arange(H)[None, :, None, None]
    expected = np.broadcast_to(rule(p, j, b, hd), (B, H, Q, K))
    if key_valid and name in ("causal", "window"):
        expected = expected & KEY_VALID[:, None, None, :]
    assert got.tolist() == expected.tolist()


def test_alibi_and_score_mod_from_positions(backend: str) -> None:
    """ALiBi's ``-slope_h |p - j|`` and a user's score_mod at each example's positions."""
    h = Harness(backend)
    call = call_at(h, False)
    zeros = h.array(np.zeros((B, H, Q, K), np.float32))
    got = h.numpy(mods.Alibi().bind(call).apply(zeros, call.whole()))
    slopes = 2.0 ** (-8.0 * np.arange(1, H + 1) / H)  # H a power of 2
    d = (POSITIONS[:, None, :, None] - np.arange(K)[None, None, None]).astype(np.float64)
    assert max_diff(got, -slopes[None, :, None, None] * np.abs(d)) <= TOL
    relative = mods.ScoreFunction(lambda s, b, hd, q, kv: s + h.ops.astype(q - kv, "float32"))
    got = h.numpy(relative.bind(call).apply(zeros, call.whole()))
    assert max_diff(got, np.broadcast_to(d, (B, H, Q, K))) <= TOL


@pytest.mark.parametrize("name", ["prefix_lens", "segment_ids"])
def test_modifiers_needing_one_offset_refuse_positions(backend: str, name: str) -> None:
    h = Harness(backend)
    ids = h.array(np.zeros((B, K), np.int32))
    mod = mods.PrefixLM(h.array(np.ones(B, np.int32))) if name == "prefix_lens" else (
        mods.Segments(ids))
    with pytest.raises(ValueError) as err:
        mod.bind(call_at(h, False))
    assert str(err.value) == (f"{name} needs every example at the same positions; this call "
                              "gives positions per example (a ragged batch)")


# -- dot_product_attention with a start per example ------------------------------------------

OFFSETS = [0, 3, 7]
#: Calls of each per-example check (fused kernels take no score modifiers).
OPTIONS: dict[str, dict[str, Any]] = {
    "causal": {"causal": True},
    "window": {"causal": True, "window": WINDOW},
    "alibi": {"causal": True, "positional": "alibi"},
    "rotary": {"causal": True, "positional": "rotary"},
    "mask_mod": {"mask_mod": lambda b, h, q_idx, kv_idx: kv_idx + h != q_idx + 1},
}


def ragged_kernels(h: Harness) -> list[str]:
    return [e.name for e in kernels.kernels(h.ops.name) if e.capabilities.ragged]


@pytest.mark.parametrize("option", list(OPTIONS))
def test_a_start_per_example_equals_one_call_each(backend: str, option: str) -> None:
    """Offsets [0, 3, 7]: the batch's rows equal three single-example calls at those offsets,
    on every kernel that takes positions per example (small blocks for the blockwise one)."""
    h = Harness(backend)
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((B, 2, n, D)).astype(np.float32) for n in (Q, K, K))
    kwargs = OPTIONS[option]
    positions = positions_of(h.ops, np.array(OFFSETS, np.int32), Q)
    names = ragged_kernels(h)
    assert {"direct", "blockwise"} <= set(names)
    for name in names:
        if name == "fused" and option in ("alibi", "mask_mod"):
            continue  # no score modifiers; a mask_mod only in the direct kernel's mask
        one = [h.numpy(ac.dot_product_attention(
            *(h.array(x[b:b + 1]) for x in (q, k, v)), implementation="direct",
            _offset=OFFSETS[b], **kwargs))[0] for b in range(B)]
        got = h.numpy(ac.dot_product_attention(*(h.array(x) for x in (q, k, v)),
                                               implementation=name, _positions=positions,
                                               **kwargs))
        assert max_diff(got, np.stack(one)) <= TOL, name


def test_kernels_without_ragged_are_passed_over(backend: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel that takes one offset for every example is passed over, with the reason."""
    h = Harness(backend)
    monkeypatch.setattr(kernels, "_REGISTRY", dict(kernels._REGISTRY))
    monkeypatch.setattr(kernels, "_BY_BACKEND", {})
    kernels.register_kernel("narrow", lambda *a: None, kernels.Capabilities(),  # type: ignore
                            priority=100)
    call = call_at(h, False)
    entry, passed = kernels.choose(h.ops, kernels.Request(call))
    assert entry.capabilities.ragged
    assert passed["narrow"] == "takes one offset for every example"
    x = h.array(np.ones((B, 1, Q, D), np.float32))
    with pytest.raises(ValueError) as err:
        ac.dot_product_attention(x, x, x, implementation="narrow",
                                 _positions=positions_of(h.ops, [0, 1, 2], Q))
    assert str(err.value).startswith("implementation='narrow' takes one offset for every "
                                     "example: this call needs implementation=None or ")


# -- rotary positions per example ------------------------------------------------------------


def test_rotary_heads_take_positions_per_example(backend: str) -> None:
    """Heads rotated at ``(B, t)`` positions equal each example rotated from its own start."""
    h = Harness(backend)
    x = np.random.default_rng(3).standard_normal((B, 2, 5, D)).astype(np.float32)
    starts = [0, 9, 40000]
    positions = np.array(starts)[:, None] + np.arange(5)
    got = h.numpy(rotated_heads(h.ops, h.array(x), None, 10000.0,
                                positions=h.array(positions.astype(np.int32))))
    for b, start in enumerate(starts):
        one = ac.rotary_embedding(h.array(np.swapaxes(x[b:b + 1], 1, 2)), start=start)
        assert max_diff(got[b], np.swapaxes(h.numpy(one)[0], 0, 1)) <= TOL, start
