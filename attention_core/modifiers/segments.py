"""``segment_ids``: packed sequences; query ``i`` sees key ``j`` only within its own segment.

Several documents packed into one row of the batch keep apart: each position carries the id of
its document, and a query sees the keys of the same id. Ids of shape ``(B, K)`` give each key
its segment, and each query that of its position ``p_i``; a pair ``(query_ids (B, Q),
key_ids (B, K))`` gives both. Where the ids are on the host and sorted along each row (as
packed documents are), each block of queries also says which keys it can see, so the
blockwise path visits only its own documents' keys.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from attention_core.checks import fmt_shape
from attention_core.host import host_array
from attention_core.masks import (
    check_integer_dtype,
    fits,
    own,
    segment_parts,
    tile_columns,
    tile_rows,
)
from attention_core.modifiers.base import Call, MaskMod, Span, Tile, refuse_per_example
from attention_core.ops import Array, Ops


class Segments(MaskMod):
    """Hides the keys of other segments.

    Args:
        segment_ids: Integer ids ``(B, K)``, or a pair ``(query_ids (B, Q), key_ids (B, K))``
            given as a tuple.
    """

    def __init__(self, segment_ids: Any) -> None:
        self.ids = segment_ids
        self.rows: tuple[np.ndarray, np.ndarray] | None = None  # sorted host ids (q, kv)

    def bind(self, call: Call) -> Segments:
        refuse_per_example(call, "segment_ids")
        ops, (B, _, Q, K) = call.ops, call.shape
        parts = segment_parts(self.ids)
        kv, kv_host = _checked(ops, *parts[-1], (B, K))
        if len(parts) == 2:
            q, q_host = _checked(ops, *parts[0], (B, Q))
        else:
            q = ops.slice(kv, 1, call.offset, Q) if not (isinstance(Q, int) and Q == K) else kv
            q_host = None if kv_host is None or not isinstance(call.offset, int) else (
                kv_host[:, call.offset:call.offset + Q])
        bound = Segments(None)
        bound.ids = (ops.expand_dims(ops.expand_dims(q, 1), -1),  # (B, 1, Q, 1)
                     ops.expand_dims(ops.expand_dims(kv, 1), 1))  # (B, 1, 1, K)
        if q_host is not None and kv_host is not None and _sorted(q_host) and _sorted(kv_host):
            bound.rows = (q_host, kv_host)
        return bound

    def visible(self, tile: Tile) -> Array:
        ops, (_, _, Q, K) = tile.ops, tile.call.shape
        q, kv = self.ids
        return tile_rows(ops, q, tile.q0, tile.qn, Q) == tile_columns(ops, kv, tile.k0, tile.kn, K)

    def span(self, call: Call, q0: Any, qn: int) -> Span | None:
        if self.rows is None or not isinstance(q0, int):
            return None
        q, kv = self.rows
        first = min(int(np.searchsorted(kv[b], q[b, q0], "left")) for b in range(len(q)))
        end = max(int(np.searchsorted(kv[b], q[b, q0 + qn - 1], "right")) for b in range(len(q)))
        first = min(first, kv.shape[1] - 1)
        return first, max(1, end - first)


def _checked(ops: Ops, name: str, ids: Any, want: tuple[Any, ...]) -> tuple[Array, np.ndarray | None]:
    """Checks integer ids of shape ``want``.

    Returns:
        The ids as a backend array, and their values when they are on the host, else None.
    """
    host = None if own(ops, ids) else host_array(ids)
    check_integer_dtype(ops.dtype_name(ids) if host is None else host.dtype.name, name)
    shape = ops.shape(ids) if host is None else host.shape
    if not fits(shape, want, broadcast=False):
        raise ValueError(f"{name} must have shape {fmt_shape(want)}, got {fmt_shape(shape)}")
    if host is None:
        return ops.astype(ids, "int32"), ops.concrete(ids)
    return ops.from_numpy(host.astype(np.int64)), host


def _sorted(ids: np.ndarray) -> bool:
    """Whether every row is non-decreasing."""
    return bool(ids.ndim == 2 and (ids.shape[1] < 2 or (np.diff(ids, axis=1) >= 0).all()))
