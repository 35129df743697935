"""The table of reference cases: every layer and every mask kind, one place.

The generator (``python -m tests.reference.generate``) draws inputs and weights for each case
from a seeded generator, computes outputs in float64 with the NumPy core, and writes one
``.npz`` per layer. Every backend's tests read the same files.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Shapes: B batch, Q queries, K keys (K > Q so "causal" tests the end alignment).
B, Q, K = 2, 4, 6

#: Mask kinds shared by every attention layer. Each maps to call keyword arguments built by
#: :func:`mask_arguments`.
MASK_KINDS = (
    "none",
    "valid_lens_1d",
    "valid_lens_2d",
    "mask_2d",
    "mask_3d",
    "mask_4d",
    "causal",
    "causal_valid_lens",
    "fully_masked_row",
)


def mask_arguments(kind: str, rng: np.random.Generator, heads: int, q: int = Q,
                   k: int = K) -> dict[str, Any]:
    """Draws the masking arguments of one kind; every row keeps a visible key except in
    ``fully_masked_row``."""
    def random_mask(shape: tuple[int, ...]) -> np.ndarray:
        m = rng.random(shape) < 0.6
        m[..., 0] = True  # keep one visible key per row
        return m

    if kind == "none":
        return {}
    if kind == "valid_lens_1d":
        return {"valid_lens": np.array([3, k][:B] + [k] * (B - 2), dtype=np.int64)}
    if kind == "valid_lens_2d":
        return {"valid_lens": rng.integers(1, k + 1, size=(B, q)).astype(np.int64)}
    if kind == "mask_2d":
        return {"mask": random_mask((q, k))}
    if kind == "mask_3d":
        return {"mask": random_mask((B, q, k))}
    if kind == "mask_4d":
        return {"mask": random_mask((B, heads, q, k))}
    if kind == "causal":
        return {"causal": True}
    if kind == "causal_valid_lens":
        return {"causal": True, "valid_lens": np.array([k - 1, 2][:B], dtype=np.int64)}
    if kind == "fully_masked_row":
        lens = rng.integers(1, k + 1, size=(B, q)).astype(np.int64)
        lens[0, 1] = 0  # example 0, query 1 sees nothing
        mask = random_mask((B, q, k))
        mask[1, 2] = False  # example 1, query 2 sees nothing
        return {"valid_lens": lens, "mask": mask}
    raise ValueError(kind)


@dataclass(frozen=True)
class Case:
    """One reference case: a layer, its constructor arguments and its call's inputs."""

    layer: str
    name: str
    config: dict[str, Any]
    inputs: dict[str, tuple[int, ...]]  # input name -> shape (drawn from N(0, 1))
    mask_kind: str | None = None
    heads: int = 1
    extra: dict[str, Any] = field(default_factory=dict)


def build_cases() -> list[Case]:
    """Every reference case, in a fixed order."""
    cases: list[Case] = []
    for kind in MASK_KINDS:
        cases.append(Case("DotProductAttention", kind, {"dropout": 0.0},
                          {"queries": (B, Q, 8), "keys": (B, K, 8), "values": (B, K, 5)}, kind))
        cases.append(Case("AdditiveAttention", kind, {"num_hiddens": 7, "dropout": 0.0},
                          {"queries": (B, Q, 10), "keys": (B, K, 6), "values": (B, K, 5)}, kind))
        for bias in (False, True):
            cases.append(Case(
                "MultiHeadAttention", f"{kind}{'_bias' if bias else ''}",
                {"num_hiddens": 12, "num_heads": 3, "dropout": 0.0, "bias": bias},
                {"queries": (B, Q, 10), "keys": (B, K, 7), "values": (B, K, 9)}, kind, heads=3,
            ))
        if not kind.startswith("causal"):  # the encoder block's call has no causal argument
            cases.append(Case(
                "TransformerEncoderBlock", kind,
                {"num_hiddens": 12, "ffn_num_hiddens": 16, "num_heads": 3, "dropout": 0.0},
                {"X": (B, K, 12)}, kind, heads=3,
            ))
    cases.append(Case("MultiHeadAttention", "single_head_depth_1",
                      {"num_hiddens": 1, "num_heads": 1, "dropout": 0.0, "bias": False},
                      {"queries": (1, 1, 3), "keys": (1, 2, 3), "values": (1, 2, 3)}, "none"))
    cases.append(Case("MultiHeadAttention", "keys_shorter",
                      {"num_hiddens": 8, "num_heads": 4, "dropout": 0.0, "bias": True},
                      {"queries": (B, 5, 8), "keys": (B, 2, 8), "values": (B, 2, 8)}, "none"))
    for width in (16, 7):
        cases.append(Case("PositionalEncoding", f"width_{width}",
                          {"num_hiddens": width, "dropout": 0.0, "max_len": 20},
                          {"X": (B, 5, width)}))
    cases.append(Case("LearnedPositionalEncoding", "basic",
                      {"num_hiddens": 16, "dropout": 0.0, "max_len": 20}, {"X": (B, 5, 16)}))
    cases.append(Case("PositionWiseFFN", "basic", {"ffn_num_hiddens": 16, "ffn_num_outputs": 9},
                      {"X": (B, 5, 12)}))
    cases.append(Case("AddNorm", "basic", {"num_hiddens": 12, "dropout": 0.0},
                      {"X": (B, 5, 12), "Y": (B, 5, 12)}))
    for parametric in (False, True):
        tag = "parametric" if parametric else "plain"
        cases.append(Case("NadarayaWatson", tag, {"parametric": parametric},
                          {"queries": (B, 5), "keys": (B, 7), "values": (B, 7)}))
        cases.append(Case("NadarayaWatson", f"{tag}_unbatched", {"parametric": parametric},
                          {"queries": (9,), "keys": (11,), "values": (11,)}))
    return cases


CASES = build_cases()
LAYERS = sorted({c.layer for c in CASES})
