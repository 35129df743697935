"""Attention over a sequence split across devices: the layouts and the merge of partial results.

Shape legend: B batch, H query heads, Hkv key/value heads, Q queries, K keys, D depth, Dv
value depth, P the number of shards (devices), n the whole sequence's length.

A device holds one shard of the queries, keys and values. It attends its queries to every
shard of keys in turn (ring attention: the keys and values travel around the devices) and
merges the partial results by their log-sum-exp: with ``o_i`` the output over shard ``i``
and ``l_i`` its log-sum-exp,

``o = sum_i exp(l_i - l) o_i``, ``l = log sum_i exp(l_i)``,

exactly the softmax over all the keys. The frameworks' engines move the shards
(``torch.distributed``, ``jax.lax.ppermute``); this module holds what does not depend on them.

Layouts: ``"contiguous"`` gives shard ``r`` the rows ``r n/P .. (r+1) n/P - 1``. Under a
causal mask its last device does P times the work of its first; ``"zigzag"`` cuts the sequence
into 2P chunks and gives shard ``r`` the chunks ``r`` and ``2P - 1 - r``, so every device sees
as many visible pairs.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np

from attention_core.ops import Array, Ops

#: The layouts of :func:`shard_positions`.
LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout: Any) -> str:
    """Checks a layout's name."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be 'contiguous' or 'zigzag', got {layout!r}")
    return str(layout)


def shard_positions(n: int, shards: int, rank: int, layout: str = "zigzag") -> np.ndarray:
    """The positions in the whole sequence of shard ``rank``'s rows, int32 ``(n / P,)``.

    Raises:
        ValueError: A length that the layout cannot cut evenly (``zigzag``: ``2P`` chunks).
    """
    layout = check_layout(layout)
    pieces = shards if layout == "contiguous" else 2 * shards
    if n % pieces:
        raise ValueError(f"a sequence of {n} cannot be cut into {pieces} equal chunks "
                         f"({layout} layout over {shards} shards)")
    size = n // pieces
    chunks = [rank] if layout == "contiguous" else [rank, 2 * shards - 1 - rank]
    return np.concatenate([np.arange(c * size, (c + 1) * size) for c in chunks]).astype(np.int32)


def position_table(n: int, shards: int, layout: str = "zigzag") -> np.ndarray:
    """Every shard's positions (:func:`shard_positions`), int32 ``(P, n / P)``."""
    return np.stack([shard_positions(n, shards, r, layout) for r in range(shards)])


def shard(ops: Ops, x: Array, shards: int, rank: int, axis: int,
          layout: str = "zigzag") -> Array:
    """Shard ``rank``'s rows of ``x`` along ``axis`` (the sequence), in the layout's order."""
    n = ops.shape(x)[axis]
    positions = shard_positions(n, shards, rank, layout)
    size = n // (shards if layout == "contiguous" else 2 * shards)
    starts = positions[::size]
    parts = [ops.slice(x, axis, int(s), size) for s in starts]
    return parts[0] if len(parts) == 1 else ops.concatenate(parts, axis)


def unshard(ops: Ops, parts: list[Array], axis: int, layout: str = "zigzag") -> Array:
    """The whole sequence from every shard's rows (``parts[r]`` of shard ``r``)."""
    if check_layout(layout) == "contiguous":
        return ops.concatenate(parts, axis)
    half = ops.shape(parts[0])[axis] // 2
    first = [ops.slice(p, axis, 0, half) for p in parts]
    second = [ops.slice(p, axis, half, half) for p in reversed(parts)]
    return ops.concatenate(first + second, axis)


def merge(ops: Ops, done: tuple[Array, Array] | None, part: tuple[Array, Array]
          ) -> tuple[Array, Array]:
    """Two partial results over disjoint keys as one: ``(out, lse)``.

    ``out`` ``(B, H, Q, Dv)`` and ``lse`` ``(B, H, Q)``; a row that sees no key has lse
    ``-inf`` and output 0, and merging it changes nothing (no NaN: its weight is 0).
    """
    if done is None:
        return part
    (out_a, lse_a), (out_b, lse_b) = done, part
    top = ops.maximum(lse_a, lse_b)
    finite = top > -np.inf
    top = ops.where(finite, top, 0.0)  # both -inf: weights exp(-inf) = 0, no inf - inf
    w_a, w_b = ops.exp(lse_a - top), ops.exp(lse_b - top)
    total = w_a + w_b
    safe = ops.where(total > 0, total, 1.0)
    out = (ops.expand_dims(w_a / safe, -1) * out_a + ops.expand_dims(w_b / safe, -1) * out_b)
    lse = ops.where(total > 0, top + ops.log(safe), lse_a)  # -inf stays -inf
    return out, lse


def block_masks(ops: Ops, query_at: Any, key_at: Any, *, valid_lens: Any = None,
                segment_ids: Any = None, mask: Any = None) -> Any:
    """The masks of one block of a sharded call as one boolean mask, or None.

    A sharded call takes its masks for the whole sequence: ``valid_lens`` ``(B,)`` (or
    ``(B, n)``, per query), ``segment_ids`` ``(B, n)`` (or a pair ``(query_ids, key_ids)``)
    and ``mask`` ``(n, n)``, ``(B, n, n)`` or ``(B, H, n, n)``. A block of queries at
    positions ``query_at`` ``(Q,)`` over keys at ``key_at`` ``(K,)`` (integer arrays of the
    backend, maybe traced) sees the part of each at those positions.

    Returns:
        Boolean ``(B, Q, K)`` or ``(B, H, Q, K)`` (``(Q, K)`` for a plain mask alone), True
        where the query may see the key; None when no mask is given.
    """
    parts = []
    if valid_lens is not None:
        lens = ops.astype(valid_lens, ops.dtype_name(key_at))  # compared with the positions
        lens = (ops.expand_dims(_taken(ops, lens, query_at, 1), 2) if len(ops.shape(lens)) == 2
                else ops.expand_dims(ops.expand_dims(lens, 1), 2))
        parts.append(ops.expand_dims(ops.expand_dims(key_at, 0), 0) < lens)  # (B, Q, K)
    if segment_ids is not None:
        ids_q, ids_k = segment_ids if isinstance(segment_ids, tuple) else (segment_ids,) * 2
        parts.append(ops.expand_dims(_taken(ops, ids_q, query_at, 1), 2)
                     == ops.expand_dims(_taken(ops, ids_k, key_at, 1), 1))
    if mask is not None:
        rank = len(ops.shape(mask))
        parts.append(_taken(ops, _taken(ops, mask, query_at, rank - 2), key_at, rank - 1))
    if not parts:
        return None
    rank = max(len(ops.shape(p)) for p in parts)
    parts = [p if len(ops.shape(p)) == rank else _lifted(ops, p, rank) for p in parts]
    combined = parts[0]
    for p in parts[1:]:
        combined = ops.logical_and(combined, p)
    return combined


def _taken(ops: Ops, x: Any, at: Any, axis: int) -> Any:
    """The entries of ``x`` at positions ``at`` along ``axis`` (a gather every backend has)."""
    if axis == 0:
        return ops.take(x, at)
    order = list(range(len(ops.shape(x))))
    order[0], order[axis] = axis, 0  # swapping two axes is its own inverse
    return ops.transpose(ops.take(ops.transpose(x, tuple(order)), at), tuple(order))


def _lifted(ops: Ops, m: Any, rank: int) -> Any:
    """A mask ``(Q, K)`` or ``(B, Q, K)`` given the axes of rank ``rank`` (heads at axis 1)."""
    while len(ops.shape(m)) < 3:
        m = ops.expand_dims(m, 0)
    return ops.expand_dims(m, 1) if rank == 4 else m


def block_visible(query_at: np.ndarray, key_at: np.ndarray, causal: bool = False,
                  window: int | None = None) -> bool:
    """Whether ``causal`` and ``window`` leave a pair of a block visible (positions known now).

    A block without one adds nothing to the merged result: it is skipped.
    """
    if causal and int(key_at.min()) > int(query_at.max()):
        return False
    if window is not None:  # a key in (q - window, q], or (q - window, q + window): searched
        keys, queries = np.sort(key_at.astype(np.int64)), query_at.astype(np.int64)
        last = queries if causal else queries + window - 1
        found = (np.searchsorted(keys, last, side="right")
                 - np.searchsorted(keys, queries - window + 1, side="left"))
        return bool((found > 0).any())
    return True


@runtime_checkable
class ContextParallel(Protocol):
    """How a layer whose inputs are sequence shards attends across the devices.

    Each framework's engine gives one (``backends.torch.ContextParallel``,
    ``backends.jax.ContextParallel``); a layer made with ``context_parallel=`` holds it.
    """

    def size(self) -> int:
        """P, the devices the sequence is split over."""

    def positions(self, ops: Ops, rows: int) -> Array:
        """The whole-sequence positions of this device's ``rows`` rows, int32 ``(n/P,)``."""

    def attend(self, q: Array, k: Array, v: Array, **attention: Any) -> Array:
        """This device's queries ``(B, H, n/P, D)`` over every device's keys and values.

        ``attention``: the keywords of :func:`attention_core.dot_product_attention`, with the
        whole sequence's ``valid_lens``, ``mask`` and ``segment_ids``.

        An engine whose layers a saved config holds (Keras') also gives ``config()``: its
        arguments as plain values, which its reader of ``context_parallel=`` takes back.
        """
        ...


def saved_config(config: dict[str, Any], keys: tuple[str, ...], engine: str
                 ) -> dict[str, Any]:
    """A saved ``context_parallel`` config for ``engine``; refused by name if another wrote it."""
    if not set(config) <= set(keys):
        raise ValueError(f"context_parallel: a config with keys {sorted(config)} is another "
                         f"engine's (a layer saved on another framework); {engine}'s has "
                         f"{', '.join(keys)}")
    return config


def refuse_in_split_call(**given: Any) -> None:
    """Refuses the arguments a context-parallel call cannot take, by name."""
    for name, value in given.items():
        if value is not None and value is not False:
            raise ValueError(f"{name} is not available with context_parallel (the sequence "
                             f"is split across devices), got {value!r}"[:300])
