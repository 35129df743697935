"""Packed sequences: documents packed into one row with ``segment_ids`` attend as each alone.

Long enough (4 documents of 256 tokens) that the kernels cut the call by the segments' key
spans: the blockwise kernel skips the other documents' key blocks, torch's fused kernel runs
SDPA once per query block on its own keys. Each path must equal the separate calls.
"""

from __future__ import annotations

import numpy as np
import pytest

import attention_core as ac
from attention_core import kernels
from tests.harness import TOLERANCE, Harness, max_diff

DOCS, TOKENS = 4, 256


def _paths(h: Harness) -> list[str | None]:
    return [None, *sorted(e.name for e in kernels.kernels(h.ops.name))]


@pytest.mark.parametrize("causal", [False, True])
def test_packed_documents_equal_separate_calls(backend: str, causal: bool) -> None:
    h = Harness(backend)
    rng = np.random.default_rng(5)
    n = DOCS * TOKENS
    q, k, v = (rng.standard_normal((1, 2, n, 16)).astype(np.float32) for _ in range(3))
    ids = np.repeat(np.arange(DOCS, dtype=np.int32), TOKENS)[None]
    alone = np.concatenate([
        h.numpy(ac.dot_product_attention(*(h.array(x[:, :, d * TOKENS:(d + 1) * TOKENS])
                                           for x in (q, k, v)), causal=causal,
                                         implementation="direct"))
        for d in range(DOCS)], 2)
    problems = []
    for path in _paths(h):
        packed = h.numpy(ac.dot_product_attention(h.array(q), h.array(k), h.array(v),
                                                  segment_ids=ids, causal=causal,
                                                  implementation=path))
        if max_diff(packed, alone) > TOLERANCE["float32"]:
            problems.append(f"{path}: off by {max_diff(packed, alone):.3g}")
    assert not problems, "\n".join(problems)
