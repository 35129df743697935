"""The NumPy implementation of the ops protocol."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from attention_core.kernels import blockwise, register_kernel
from attention_core.ops import NamespaceOps


class NumpyOps(NamespaceOps):
    """NumPy arrays; dropout draws from the ``numpy.random.Generator`` given (or a fresh one)."""

    name = "numpy"
    xp = np

    def __init__(self, rng: np.random.Generator | None = None) -> None:
        self.rng = rng if rng is not None else np.random.default_rng()

    def from_numpy(self, x: np.ndarray, like: Any = None) -> np.ndarray:
        x = np.asarray(x)
        if like is not None and x.dtype.kind == "f":
            return x.astype(like.dtype)
        return x

    def to_numpy(self, x: Any) -> np.ndarray:
        return np.asarray(x)

    def concrete(self, x: Any) -> np.ndarray:
        return np.asarray(x)

    def traced(self, x: Any) -> bool:
        return False

    def log(self, x: Any) -> np.ndarray:
        with np.errstate(divide="ignore"):  # log 0 = -inf, the lse of a row with nothing visible
            return np.log(x)

    def shape(self, x: Any) -> tuple[int, ...]:
        return tuple(np.shape(x))

    def dtype_name(self, x: Any) -> str:
        return np.asarray(x).dtype.name

    def astype(self, x: Any, dtype: str) -> np.ndarray:
        return np.asarray(x).astype(dtype, copy=False)

    def relu(self, x: np.ndarray) -> np.ndarray:
        return np.maximum(x, np.zeros((), x.dtype))

    def where(self, cond: Any, x: np.ndarray, y: Any) -> np.ndarray:
        return np.where(cond, x, np.asarray(y, dtype=x.dtype))

    def exp_diff(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        # in place (see ops.InPlaceOps); a masked score's fill minus a positive maximum overflows
        # to -inf in float16, whose exponential is the 0 wanted: no warning for it
        with np.errstate(over="ignore"):
            return np.exp(np.subtract(x, y, out=x), out=x)

    def slice(self, x: np.ndarray, axis: int, start: Any, size: int) -> np.ndarray:
        return x[(slice(None),) * axis + (slice(start, start + size),)]

    def arange(self, n: Any) -> np.ndarray:
        return np.arange(n, dtype=np.int32)

    def dropout(self, x: np.ndarray, rate: float) -> np.ndarray:
        keep = self.rng.random(x.shape) >= rate
        return np.where(keep, x / np.asarray(1.0 - rate, x.dtype), np.zeros((), x.dtype))

    def cumsum(self, x: np.ndarray, axis: int) -> np.ndarray:
        return np.cumsum(x, axis=axis)

    # -- sampling (attention_core.ops.SamplingOps): a NumPy Generator is the state -----------

    def argmax(self, x: np.ndarray) -> np.ndarray:
        return np.argmax(x, axis=-1)

    def sort_descending(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        indices = np.flip(np.argsort(x, axis=-1, kind="stable"), axis=-1)
        return np.take_along_axis(x, indices, axis=-1), indices

    def new_sampling_state(self, seed: int, like: Any = None) -> np.random.Generator:
        return np.random.default_rng(seed)

    def uniform(self, shape: tuple[int, ...],
                state: np.random.Generator) -> tuple[np.ndarray, np.random.Generator]:
        return state.random(shape), state  # the Generator advances in place


    def silu(self, x: np.ndarray) -> np.ndarray:
        e = np.exp(-np.abs(x))  # no overflow: the sigmoid of either sign from exp(-|x|)
        return x * np.where(x >= 0, 1 / (1 + e), e / (1 + e))

    def erf(self, x: np.ndarray) -> np.ndarray:
        # no SciPy here: math.erf, exact to float64, over every entry
        return np.asarray(_ERF(x), dtype=np.float64).astype(x.dtype, copy=False)

#: ``math.erf`` over an array (float64 results).
_ERF = np.vectorize(math.erf, otypes=[np.float64])

#: The default NumPy ops (used by the functional API for NumPy arrays).
OPS = NumpyOps()


# The blockwise kernel is the faster one here from the smallest sizes measured on (n = 128,
# 8 heads: 49 against 34 GFLOP/s, see docs/speed.md), because its tiles stay in cache and it
# exponentiates them in place; so it is taken whenever the call allows it.
register_kernel("blockwise", blockwise.blockwise, blockwise.CAPABILITIES, backend="numpy",
                priority=10, prefers=lambda ops, request: blockwise.enough_scores(request, 0))
