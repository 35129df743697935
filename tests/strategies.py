"""Shared by tests/test_numerics.py and tests/test_properties.py: a float64 reference, a runner
that compiles JAX calls, and the Hypothesis strategies and settings.

The reference (:func:`visible`, :func:`attention`, :func:`multi_head`) is vectorised NumPy in
float64, written from the formulas and importing nothing from ``attention_core``: masked scores
become ``-inf``, each row is shifted by its largest visible score, rows with no visible key
are all zeros. ``tests/naive.py`` says the same thing with explicit loops.

Hypothesis runs derandomized (``derandomize=True``: the examples are a fixed function of each
test, the same on every run and machine) without a database or deadline. Continuous data comes
from a NumPy seed that Hypothesis draws; shapes, heads, masks, lengths and permutations are
drawn by Hypothesis itself, so a failure shrinks to a small structure. On JAX, every call runs
under ``jax.jit`` and the shapes come from a few buckets (:data:`JAX_BUCKETS`), so the
examples share a few dozen compiled programs instead of compiling one each.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from attention_core import kernels

# -- the float64 reference -------------------------------------------------------------------


def visible(B: int, H: int, Q: int, K: int, valid_lens: Any = None, mask: Any = None,
            causal: bool = False) -> np.ndarray:
    """Boolean ``(B, H, Q, K)``: may query ``i`` of example ``b``, head ``h``, see key ``j``.

    ``valid_lens`` ``(B,)`` or ``(B, Q)``: ``j < len``; ``mask`` ``(Q, K)``, ``(B, Q, K)`` or
    ``(B, H, Q, K)`` with size-1 axes broadcasting; ``causal``: ``j <= i + (K - Q)``.
    """
    out = np.ones((B, H, Q, K), dtype=bool)
    keys = np.arange(K)
    if valid_lens is not None:
        lens = np.asarray(valid_lens)
        lens = lens[:, None, None, None] if lens.ndim == 1 else lens[:, None, :, None]
        out &= keys < lens
    if mask is not None:
        m = np.asarray(mask, dtype=bool)
        m = m[None, None] if m.ndim == 2 else (m[:, None] if m.ndim == 3 else m)
        out &= np.broadcast_to(m, out.shape)
    if causal:
        out &= keys[None, :] <= np.arange(Q)[:, None] + (K - Q)
    return out


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, vis: np.ndarray,
              scale: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(output (B, H, Q, Dv), weights (B, H, Q, K))`` of rank-4 float64 inputs."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = np.where(vis, np.einsum("bhqd,bhkd->bhqk", q, k) * scale, -np.inf)
    top = scores.max(-1, keepdims=True, initial=-np.inf)
    top = np.where(np.isfinite(top), top, 0.0)  # rows with no visible key
    e = np.where(vis, np.exp(scores - top), 0.0)
    total = e.sum(-1, keepdims=True)
    weights = np.divide(e, total, out=np.zeros_like(e), where=total > 0)
    return np.einsum("bhqk,bhkv->bhqv", weights, v), weights


def multi_head(queries: np.ndarray, keys: np.ndarray, values: np.ndarray,
               w: dict[str, np.ndarray], H: int, vis: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Projections, H heads on consecutive column blocks, attention, output projection."""
    def dense(x: np.ndarray, name: str) -> np.ndarray:
        return x @ w[f"{name}.kernel"] + w.get(f"{name}.bias", 0.0)

    def heads(x: np.ndarray) -> np.ndarray:  # (B, N, h) -> (B, H, N, h / H)
        B, N, h = x.shape
        return x.reshape(B, N, H, h // H).transpose(0, 2, 1, 3)

    out, weights = attention(heads(dense(queries, "W_q")), heads(dense(keys, "W_k")),
                             heads(dense(values, "W_v")), vis)
    B, _, Q, d = out.shape
    return dense(out.transpose(0, 2, 1, 3).reshape(B, Q, H * d), "W_o"), weights


# -- running on a backend ----------------------------------------------------------------------


def implementations(h: Any) -> list[str]:
    """The pooling paths a backend has: direct and blockwise, and fused where it has a kernel."""
    fused = any(entry.name == "fused" for entry in kernels.kernels(h.ops.name))
    return ["direct", "blockwise"] + (["fused"] if fused else [])


_JITTED: dict[Any, Any] = {}


def run(h: Any, fn: Callable[..., Any], *arrays: Any, **static: Any) -> Any:
    """``fn(*arrays, **static)``; on JAX under ``jax.jit`` (one program per shape, kept).

    ``static`` holds the Python values (``causal``, ``implementation``, ``num_heads``, ...);
    ``arrays`` may hold None and dicts of arrays.
    """
    if h.name != "jax":
        return fn(*arrays, **static)
    import jax

    key = (fn, tuple(sorted(static.items())))
    if key not in _JITTED:
        _JITTED[key] = jax.jit(functools.partial(fn, **static))
    return _JITTED[key](*arrays)


# -- Hypothesis --------------------------------------------------------------------------------

#: Multiplies every test's ``max_examples`` (e.g. 10 for a longer local search); CI leaves it 1.
SCALE = float(os.environ.get("ATTENTION_CORE_HYPOTHESIS_SCALE", "1"))


def profile(max_examples: int) -> settings:
    """The settings of one property test: derandomized, no database, no deadline (no timed
    assertion), ``max_examples`` times :data:`SCALE`."""
    return settings(
        max_examples=max(1, round(max_examples * SCALE)),
        derandomize=True,
        database=None,
        deadline=None,
        print_blob=False,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


#: The shapes JAX draws from, ``(B, Q, K, D, Dv)``: keys longer than queries, and fewer keys
#: than queries (where ``causal`` hides every key from the first queries).
JAX_BUCKETS = ((2, 3, 5, 4, 3), (1, 4, 2, 2, 5))

#: Mask kinds, each a combination of ``valid_lens`` (1-D, 2-D), ``mask`` (rank 2, 3, 4) and
#: ``causal``; all combine with AND.
MASK_KINDS = {
    "none": (None, None, False),
    "lens_1d": (1, None, False),
    "lens_2d": (2, None, False),
    "mask_2d": (None, 2, False),
    "mask_3d": (None, 3, False),
    "mask_4d": (None, 4, False),
    "causal": (None, None, True),
    "causal_lens_1d": (1, None, True),
    "lens_2d_mask_3d": (2, 3, False),
    "mask_4d_causal": (None, 4, True),
}

#: The kinds that permuting the keys (and the mask's key axis with them) maps to themselves:
#: lengths and the causal rule depend on the order of the keys.
PERMUTABLE_KINDS = ("none", "mask_2d", "mask_3d", "mask_4d")


@dataclass
class Problem:
    """One attention call: shapes, masks and the seed of the continuous data.

    ``H`` is None for rank-3 inputs ``(B, N, D)`` (one head), else the heads of rank-4 inputs.
    """

    B: int
    H: int | None
    Q: int
    K: int
    D: int
    Dv: int
    seed: int
    kind: str = "none"
    valid_lens: np.ndarray | None = None
    mask: np.ndarray | None = None
    causal: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def heads(self) -> int:
        return 1 if self.H is None else self.H

    def inputs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Queries, keys and values drawn from N(0, 1), float64, rank 3 or 4."""
        rng = np.random.default_rng(self.seed)
        lead = (self.B,) if self.H is None else (self.B, self.H)
        return (rng.standard_normal((*lead, self.Q, self.D)),
                rng.standard_normal((*lead, self.K, self.D)),
                rng.standard_normal((*lead, self.K, self.Dv)))

    def visible(self) -> np.ndarray:
        return visible(self.B, self.heads, self.Q, self.K, self.valid_lens, self.mask, self.causal)

    def call_arguments(self, h: Any) -> tuple[Any, Any]:
        """``(valid_lens, mask)`` as backend arrays (or None)."""
        lens = None if self.valid_lens is None else h.array(self.valid_lens)
        return lens, (None if self.mask is None else h.array(self.mask))


def _mask_shape(draw: Any, rank: int, B: int, H: int, Q: int, K: int, broadcast: bool) -> tuple[int, ...]:
    full = {2: (Q, K), 3: (B, Q, K), 4: (B, H, Q, K)}[rank]
    if not broadcast:
        return full
    ones = draw(st.lists(st.booleans(), min_size=rank, max_size=rank))
    return tuple(1 if one else n for one, n in zip(ones, full, strict=True))


@st.composite
def problems(draw: Any, backend: str, kinds: tuple[str, ...] = tuple(MASK_KINDS),
             heads: tuple[int | None, ...] = (None, 1, 2, 3), max_dim: int = 8) -> Problem:
    """Shapes, heads, a mask kind with its masks and lengths, and a data seed.

    On JAX the shapes come from :data:`JAX_BUCKETS`, rank-4 inputs have 2 heads and masks have
    full shapes (no size-1 axes), to keep the number of compiled programs small.
    """
    jax = backend == "jax"
    if jax:
        B, Q, K, D, Dv = draw(st.sampled_from(JAX_BUCKETS))
        H = draw(st.sampled_from((None, 2)))
    else:
        B, Q, K = draw(st.integers(1, 3)), draw(st.integers(1, 6)), draw(st.integers(1, 7))
        D, Dv = draw(st.integers(1, max_dim)), draw(st.integers(1, 5))
        H = draw(st.sampled_from(heads))
    problem = Problem(B, H, Q, K, D, Dv, seed=draw(st.integers(0, 2**32 - 1)))
    problem.kind = draw(st.sampled_from(kinds))
    lens_rank, mask_rank, problem.causal = MASK_KINDS[problem.kind]
    lens_dtype = np.int32 if jax else draw(st.sampled_from((np.int32, np.int64)))
    if lens_rank is not None:
        shape = (B,) if lens_rank == 1 else (B, Q)
        problem.valid_lens = draw(hnp.arrays(lens_dtype, shape, elements=st.integers(0, K)))
    if mask_rank is not None:
        shape = _mask_shape(draw, mask_rank, B, problem.heads, Q, K, broadcast=not jax)
        problem.mask = draw(hnp.arrays(np.bool_, shape))
    return problem
