"""Every modifier of the open attention core, on every backend and path, against float64.

Each modifier (lengths, a boolean mask, causal, a window, segment ids alone or as a
(query, key) pair, prefix-LM, soft-capping, ALiBi, a score bias, a user ``mask_mod`` and
``score_mod`` written with plain operators, lists of them, sinks) runs alone, as its keyword
and as its :mod:`attention_core.modifiers` object, and with every mask kind of the reference
cases (tests/reference/cases.py), through ``dot_product_attention`` with ``return_lse=True`` on
the direct path (which also returns the weights), the blockwise path in small tiles and the
fused kernel where the backend has one (which may refuse what it is not given, by a ValueError
naming the fused path), and alone also on the automatic choice (see :data:`SLOW_EAGER` for
JAX). Output, weights and log-sum-exp must equal the float64 reference of
tests/reference/attention64.py within 1e-5 (float32 inputs).

A float16 case checks the numeric policy: ``|q| = |k| = 100`` in every element at depth 64
(scores of tens of thousands, far beyond float16), a padded batch: the output equals the
float64 answer within float16's rounding.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

import attention_core as ac
from attention_core import kernels
from attention_core.kernels import blockwise
from tests.harness import DTYPES, TOLERANCE, Harness, max_diff
from tests.reference.attention64 import attention64, visible
from tests.reference.cases import MASK_KINDS, mask_arguments

modifiers: Any = pytest.importorskip("attention_core.modifiers")

B, H, HKV, Q, K, D, DV = 2, 4, 2, 5, 7, 8, 6
TOL = TOLERANCE["float32"]
RULES = ("valid_lens", "mask", "causal", "window", "segment_ids", "prefix_lens", "mask_fn")

LENS = np.array([7, 4])
MASK = np.random.default_rng(50).random((B, Q, K)) < 0.6
MASK[..., 0] = True
WINDOW, SOFTCAP = 3, 1.5
SEGMENTS = np.array([[0, 0, 1, 1, 1, 2, 2], [0, 0, 0, 0, 1, 1, 1]])  # (B, K)
QUERY_SEGMENTS = np.array([[0, 1, 1, 2, 2], [1, 1, 0, 0, 1]])  # (B, Q), with SEGMENTS as keys
PREFIX = np.array([3, 6])
SCORE_BIAS = np.random.default_rng(51).standard_normal((B, H, Q, K)).astype(np.float32)
SINKS = np.array([0.5, -1.0, 2.0, 0.0], np.float32)


def user_mask(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    """A user mask in plain operators: hides one diagonal per (example, head)."""
    return kv_idx + h != q_idx + b + 1


def user_score(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    """A user score modifier in plain operators."""
    return score - 0.25 * score * score


@dataclass(frozen=True)
class Modifier:
    """One modifier: its keyword form and object form (each a function of the harness giving
    ``dot_product_attention`` keywords; None where it has none) and the reference's keywords."""

    keyword: Callable[[Harness], dict[str, Any]] | None
    modifier: Callable[[Harness], dict[str, Any]] | None
    reference: dict[str, Any] = field(default_factory=dict)


def relative(h: Harness) -> Callable[..., Any]:
    """``score + (q_idx - kv_idx) / 8``, the indices cast by the backend's ops."""
    return lambda s, b, hd, q, kv: s + h.ops.astype(q - kv, "float32") * 0.125


MODIFIERS: dict[str, Modifier] = {
    "none": Modifier(lambda h: {}, None),
    "valid_lens": Modifier(lambda h: {"valid_lens": h.array(LENS)},
                           lambda h: {"mask_mod": modifiers.lengths(h.array(LENS))},
                           {"valid_lens": LENS}),
    "mask": Modifier(lambda h: {"mask": h.array(MASK)},
                     lambda h: {"mask_mod": modifiers.boolean(h.array(MASK))}, {"mask": MASK}),
    "causal": Modifier(lambda h: {"causal": True}, lambda h: {"mask_mod": modifiers.causal()},
                       {"causal": True}),
    "window": Modifier(lambda h: {"window": WINDOW},
                       lambda h: {"mask_mod": modifiers.window(WINDOW)}, {"window": WINDOW}),
    "segment_ids": Modifier(lambda h: {"segment_ids": h.array(SEGMENTS)},
                            lambda h: {"mask_mod": modifiers.segments(h.array(SEGMENTS))},
                            {"segment_ids": SEGMENTS}),
    "segment_pair": Modifier(
        lambda h: {"segment_ids": (h.array(QUERY_SEGMENTS), h.array(SEGMENTS))},
        lambda h: {"mask_mod": modifiers.segments((h.array(QUERY_SEGMENTS), h.array(SEGMENTS)))},
        {"segment_ids": (QUERY_SEGMENTS, SEGMENTS)}),
    "prefix_lm": Modifier(None, lambda h: {"mask_mod": modifiers.prefix_lm(h.array(PREFIX))},
                          {"prefix_lens": PREFIX}),
    "mask_mod": Modifier(lambda h: {"mask_mod": user_mask}, None,
                         {"mask_fn": lambda b, h, i, j: j + h != i + b + 1}),
    "mask_list": Modifier(lambda h: {"mask_mod": [modifiers.window(WINDOW), user_mask]}, None,
                          {"window": WINDOW, "mask_fn": lambda b, h, i, j: j + h != i + b + 1}),
    "softcap": Modifier(lambda h: {"softcap": SOFTCAP},
                        lambda h: {"score_mod": modifiers.softcap(SOFTCAP)}, {"softcap": SOFTCAP}),
    "alibi": Modifier(lambda h: {"positional": "alibi"},
                      lambda h: {"score_mod": modifiers.alibi()}, {"alibi": True}),
    "score_bias": Modifier(lambda h: {"score_bias": h.array(SCORE_BIAS)},
                           lambda h: {"score_mod": modifiers.score_bias(h.array(SCORE_BIAS))},
                           {"score_bias": SCORE_BIAS}),
    "score_mod": Modifier(lambda h: {"score_mod": user_score}, None,
                          {"score_fn": lambda s, b, h, i, j: s - 0.25 * s * s}),
    "score_mod_relative": Modifier(lambda h: {"score_mod": relative(h)}, None,
                                   {"score_fn": lambda s, b, h, i, j: s + (i - j) * 0.125}),
    "score_list": Modifier(lambda h: {"score_mod": [modifiers.softcap(SOFTCAP), user_score]},
                           None, {"softcap": SOFTCAP,
                                  "score_fn": lambda s, b, h, i, j: s - 0.25 * s * s}),
    "sinks": Modifier(lambda h: {"sinks": h.array(SINKS)}, None, {"sinks": SINKS}),
}


def cells() -> list[Any]:
    """(modifier, mask kind, form): each modifier alone in each of its forms, then with every
    other mask kind, as the form whose keywords the kind leaves free."""
    params = []
    for name, m in MODIFIERS.items():
        for form in ("keyword", "modifier"):
            if getattr(m, form) is not None:
                params.append(pytest.param(name, "none", form, id=f"{name}-alone-{form}"))
    for name, m in MODIFIERS.items():
        for kind in MASK_KINDS[1:]:
            if name != "none":
                params.append(pytest.param(name, kind, free_form(m, kind), id=f"{name}-{kind}"))
    return params


def free_form(m: Modifier, kind: str) -> str:
    """The modifier's form whose keywords the mask kind does not use."""
    taken = set(mask_arguments(kind, np.random.default_rng(0), H, Q, K, B))
    if m.keyword is None or (m.modifier is not None and taken & set(m.keyword(_NO_HARNESS))):
        return "modifier"
    return "keyword"


class _Shapes:
    """Stands for a harness where only the keywords' names are needed."""

    ops = None

    def array(self, x: Any, dtype: str | None = None) -> Any:
        return x


_NO_HARNESS: Any = _Shapes()


def reference(m: Modifier, kind_args: dict[str, Any]) -> dict[str, Any]:
    """The reference's keywords: the mask kind's, the modifier's score terms, and the
    modifier's masking rules as one ``mask_fn`` (so that two lengths or masks both hold)."""
    ref = dict(kind_args)
    rules = {r: m.reference[r] for r in RULES if r in m.reference}
    ref.update({k: v for k, v in m.reference.items() if k not in RULES})
    if rules:
        full = {r: rules.get(r, False if r == "causal" else None) for r in RULES}
        ref["mask_fn"] = lambda b, h, i, j: visible(b, h, i, j, i + K - Q, **full)
    return ref


#: Backends whose eager mode compiles every primitive for each new shape or closure (JAX: a
#: blockwise call in tiles of 2 queries costs about 0.6 s there, against 8 ms with all the queries
#: in one tile). There the blockwise path keeps the queries in one tile, and the modifiers
#: combined with a mask kind run on the automatic choice only; alone, on every path.
SLOW_EAGER = ("jax",)


@pytest.fixture(autouse=True)
def small_blocks(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Blockwise calls cut the keys into blocks of 4 and the queries into blocks of 2 (all the
    queries in one block on :data:`SLOW_EAGER`)."""
    tile = 10**6 if backend in SLOW_EAGER else 1
    for name, value in (("KEY_BLOCK", 4), ("TILE_SCORES", tile), ("MIN_QUERY_BLOCK", 2)):
        if hasattr(blockwise, name):
            monkeypatch.setattr(blockwise, name, value)


def implementations(h: Harness, kind: str = "none") -> list[str | None]:
    """The paths a cell runs: alone, the automatic choice and every path the backend has;
    with a mask kind, every path (the automatic choice only on :data:`SLOW_EAGER`)."""
    names = {e.name for e in kernels.kernels(h.ops.name)}
    fused = [n for n in ("fused", "flex") if n in names]
    if kind == "none":
        return [None, "direct", "blockwise", *fused]
    return [None] if h.name in SLOW_EAGER else ["direct", "blockwise", *fused]


def refused(implementation: str | None, err: ValueError) -> bool:
    """Whether the error is a fused kernel (SDPA, FlexAttention) refusing what it is not given."""
    return implementation in ("fused", "flex") and f"implementation={implementation!r}" in str(err)


def lse_diff(got: np.ndarray, expected: np.ndarray) -> float:
    """max |diff| of two log-sum-exps; inf unless their ``-inf`` entries are the same."""
    empty = np.isneginf(expected)
    if not np.array_equal(np.isneginf(got), empty):
        return math.inf
    return max_diff(np.where(empty, 0.0, got), np.where(empty, 0.0, expected))


def attend(h: Harness, arrays: list[Any], kwargs: dict[str, Any],
           implementation: str | None) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """Output, weights (direct path only, else None) and log-sum-exp as float64 NumPy; the
    log-sum-exp must be float32."""
    weights = None
    if implementation == "direct":
        out, weights, lse = ac.dot_product_attention(*arrays, **kwargs, return_weights=True,
                                                     return_lse=True, implementation="direct")
    else:
        out, lse = ac.dot_product_attention(*arrays, **kwargs, return_lse=True,
                                            implementation=implementation)
    assert h.ops.dtype_name(lse) == "float32"
    return h.numpy(out), None if weights is None else h.numpy(weights), h.numpy(lse)


@pytest.mark.parametrize(("name", "kind", "form"), cells())
def test_modifier_matches_reference(backend: str, name: str, kind: str, form: str) -> None:
    h = Harness(backend)
    rng = np.random.default_rng(60)
    q, k, v = (rng.standard_normal(s).astype(np.float32)
               for s in ((B, H, Q, D), (B, HKV, K, D), (B, HKV, K, DV)))
    kind_args = mask_arguments(kind, rng, H, Q, K, B)
    m = MODIFIERS[name]
    make = m.keyword if form == "keyword" else m.modifier
    assert make is not None
    kwargs = {**{n: (x if isinstance(x, bool) else h.array(x)) for n, x in kind_args.items()},
              **make(h)}
    expected, expected_weights, expected_lse = attention64(q, k, v, **reference(m, kind_args))
    arrays = [h.array(x) for x in (q, k, v)]
    for implementation in implementations(h, kind):
        try:
            out, weights, lse = attend(h, arrays, kwargs, implementation)
        except ValueError as err:
            if refused(implementation, err):
                continue
            raise
        assert max_diff(out, expected) <= TOL, implementation
        assert lse_diff(lse, expected_lse) <= TOL, implementation
        if weights is not None:
            assert max_diff(weights, expected_weights) <= TOL, implementation


@pytest.mark.parametrize("scale", [None, 2.0 ** -13], ids=["default_scale", "small_scale"])
def test_float16_large_scores_padded(backend: str, scale: float | None) -> None:
    """|q| = |k| = 100 at depth 64 (q . k up to 640000, beyond float16's 65504), a padded
    batch: every path gives the float64 answer within float16's rounding, its log-sum-exp
    in float32."""
    if "float16" not in DTYPES[backend]:
        pytest.skip(f"the {backend} backend is not tested in float16")
    h = Harness(backend)
    rng = np.random.default_rng(70)
    q, k = (100.0 * rng.choice([-1.0, 1.0], size=s) for s in ((2, 2, 6, 64), (2, 2, 9, 64)))
    v = rng.standard_normal((2, 2, 9, 16)).astype(np.float16).astype(np.float64)
    lens = np.array([9, 5])
    expected, _, expected_lse = attention64(q, k, v, valid_lens=lens, scale=scale)
    arrays = [h.array(x, "float16") for x in (q, k, v)]
    kwargs = {"valid_lens": h.array(lens), "scale": scale}
    for implementation in implementations(h):
        try:
            out, lse = ac.dot_product_attention(*arrays, **kwargs, return_lse=True,
                                                implementation=implementation)
        except ValueError as err:
            if refused(implementation, err):
                continue
            raise
        assert h.ops.dtype_name(out) == "float16", implementation
        assert h.ops.dtype_name(lse) == "float32", implementation
        np.testing.assert_allclose(h.numpy(out), expected, rtol=2e-3, atol=1e-4,
                                   err_msg=str(implementation))
        np.testing.assert_allclose(h.numpy(lse), expected_lse, rtol=1e-6,
                                   err_msg=str(implementation))
