"""Choosing the next token from logits on the device: greedy, temperature, top-k, top-p.

:func:`choose` takes a batch of logits ``(B, V)`` and returns one token per row, computed with
the backend's ops and never read on the host, so it runs inside ``jax.jit``,
``tf.function`` and ``torch.compile`` too. Sampling draws from the framework's own generator,
which the caller keeps as a *state*: ``ops.new_sampling_state(seed)`` makes one (see
:class:`~attention_core.ops.SamplingOps`), and each call returns the state to pass next. The
same seed gives the same tokens on one backend; the streams differ between backends.

The order of the filters is the usual one (Hugging Face's): the logits are divided by the
temperature, top-k keeps the logits ``>=`` the k-th largest, top-p keeps the smallest set of
most likely tokens whose probability reaches ``p`` (a token is kept when the probability of
the tokens before it, in descending order, is ``< p``; at least one), and the token is drawn
among the kept ones by the Gumbel-max trick, ``argmax(l - log(-log u))`` with ``u`` uniform.
Tokens tied with the last kept logit are kept too.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from attention_core import checks
from attention_core.host import plain
from attention_core.ops import Array, Ops, SamplingOps


class Sampling(NamedTuple):
    """Checked sampling settings; ``temperature`` None means greedy (argmax)."""

    temperature: float | None
    top_k: int | None
    top_p: float | None


def check_sampling(temperature: Any, top_k: Any, top_p: Any, vocab_size: int | None) -> Sampling:
    """Checks the sampling settings by name; ``top_k`` against ``vocab_size`` when known.

    Raises:
        TypeError: A setting of the wrong type (a string, a bool).
        ValueError: A setting out of its range.
    """
    return Sampling(_temperature(temperature), _top_k(top_k, vocab_size), _top_p(top_p))


def _real(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float))


def _temperature(value: Any) -> float | None:
    value = plain(value)
    if value is None:
        return None
    if not _real(value):
        raise TypeError(f"temperature must be None or a real number >= 0, got "
                        f"{type(value).__name__}")
    if not 0 <= value < math.inf:
        raise ValueError(f"temperature must be None or a finite number >= 0, got {value!r}")
    return float(value) or None  # 0: greedy


def _top_k(value: Any, vocab_size: int | None) -> int | None:
    value = plain(value)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"top_k must be None or a positive int, got {type(value).__name__}")
    if value < 1 or (vocab_size is not None and value > vocab_size):
        bound = "a positive int" if vocab_size is None else f"an int in [1, V] = [1, {vocab_size}]"
        raise ValueError(f"top_k must be None or {bound}, got {value}")
    return value


def _top_p(value: Any) -> float | None:
    value = plain(value)
    if value is None:
        return None
    if not _real(value):
        raise TypeError(f"top_p must be None or a number in (0, 1], got {type(value).__name__}")
    if not 0 < value <= 1:
        raise ValueError(f"top_p must be None or a number in (0, 1], got {value!r}")
    return float(value)


def check_logits(ops: Ops, logits: Array) -> int:
    """Checks that ``logits`` are floating ``(B, V)`` with V >= 1; returns V."""
    checks.check_floating(ops, "logits", logits)
    shape = ops.shape(logits)
    if len(shape) != 2 or shape[1] == 0:
        raise ValueError(f"logits must have shape (B, V) with V >= 1, got shape "
                         f"{checks.fmt_shape(shape)}")
    vocab: int = shape[1]
    return vocab


def choose(ops: SamplingOps, logits: Array, *, temperature: float | None = 0.0, top_k: int | None = None,
           top_p: float | None = None, state: Any = None) -> tuple[Array, Any]:
    """One token per row of ``logits``: the argmax, or a sample, on the device.

    Args:
        ops: The logits' ops (``attention_core.registry.ops_for(logits)``), with the methods of
            :class:`~attention_core.ops.SamplingOps`.
        logits: ``(B, V)`` floating logits (float16 and bfloat16 are sampled in float32).
        temperature: 0 or None for the argmax (``top_k``, ``top_p`` and ``state`` unused);
            else a finite number > 0 that divides the logits.
        top_k: None, or an int in ``[1, V]``: keep the ``top_k`` largest logits (and ties).
        top_p: None, or a number in ``(0, 1]``: keep the most likely tokens up to this mass.
        state: The generator to draw from when sampling: ``ops.new_sampling_state(seed)`` or
            the state a previous call returned.

    Returns:
        ``(tokens, state)``: int32 token ids ``(B,)``, and the state to pass to the next call.

    Raises:
        TypeError: A setting of the wrong type, or logits that are not floating point.
        ValueError: A setting out of its range, logits not ``(B, V)``, or no state to sample.
    """
    vocab = check_logits(ops, logits)
    settings = check_sampling(temperature, top_k, top_p, vocab)
    if settings.temperature is None:
        return ops.astype(ops.argmax(logits), "int32"), state
    if state is None:
        raise ValueError("sampling (temperature > 0) needs state=: a generator from "
                         "ops.new_sampling_state(seed), or the state the last call returned")
    dtype = "float64" if ops.dtype_name(logits) == "float64" else "float32"
    x = filtered(ops, ops.astype(logits, dtype) / settings.temperature, settings, vocab)
    u, state = ops.uniform(ops.shape(x), state)
    u = ops.astype(u, dtype)
    u = ops.where(u > 0, u, _TINY)  # log(-log 0) would be -inf: never drawn, but keep it finite
    return ops.astype(ops.argmax(x - ops.log(-ops.log(u))), "int32"), state


#: The least uniform draw used (a float32 normal number).
_TINY = 2.0**-126


def filtered(ops: SamplingOps, x: Array, settings: Sampling, vocab: int) -> Array:
    """``x (B, V)`` with the tokens top-k and top-p drop set to ``-inf``.

    One sort serves both: top-k's threshold is the k-th sorted logit; top-p sums the softmax
    of the sorted logits that top-k kept. The kept tokens are those ``>=`` the least kept
    sorted logit, so no scatter back to the vocabulary's order is needed.
    """
    top_k = settings.top_k if settings.top_k is not None and settings.top_k < vocab else None
    top_p = settings.top_p if settings.top_p is not None and settings.top_p < 1 else None
    if top_k is None and top_p is None:
        return x
    values, _ = ops.sort_descending(x)
    threshold = None
    if top_k is not None:
        threshold = ops.slice(values, 1, top_k - 1, 1)  # (B, 1): the k-th largest
        values = ops.where(values >= threshold, values, -math.inf)
    if top_p is not None:
        shifted = ops.exp(values - ops.slice(values, 1, 0, 1))  # the first is the largest
        probs = shifted / ops.sum(shifted, 1)
        before = ops.cumsum(probs, 1) - probs
        kept = ops.logical_and(before < top_p, values > -math.inf)  # the first always is
        threshold = -ops.max(ops.where(kept, -values, -math.inf), 1)  # the least kept
    return ops.where(x >= threshold, x, -math.inf)
