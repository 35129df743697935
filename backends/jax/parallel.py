"""Attention over a sequence split across devices, inside ``jax.shard_map``.

Shape legend: B batch, H query heads, Hkv key/value heads, n/P the rows of one shard, D depth.

:func:`ring_attention` runs inside ``shard_map`` over a mesh axis of P devices: each device
holds its shard of the queries, keys and values (in the layout of
:mod:`attention_core.parallel`); ``lax.ppermute`` passes the keys and values around the axis,
one step per device, and each step's partial result is merged by its log-sum-exp. ``jax.grad``
differentiates it (a permutation's transpose is the reverse permutation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

import attention_core as ac
from attention_core import parallel as par
from attention_core.cache import Positions
from backends.jax.ops import JaxOps


def ring_attention(q: Any, k: Any, v: Any, *, axis_name: str, layout: str = "zigzag",
                   valid_lens: Any = None, segment_ids: Any = None, mask: Any = None,
                   sinks: Any = None, **attention: Any) -> Any:
    """This device's queries ``(B, H, n/P, D)`` over every device's keys and values.

    Args:
        q: This device's shard of the queries, in ``layout``.
        k: Its shard of the keys ``(B, Hkv, n/P, D)``.
        v: Its shard of the values ``(B, Hkv, n/P, Dv)``.
        axis_name: The mesh axis the sequence is split over (``shard_map``'s).
        layout: ``"zigzag"`` or ``"contiguous"`` (:mod:`attention_core.parallel`).
        valid_lens: The whole sequence's lengths ``(B,)`` or ``(B, n)`` (replicated).
        segment_ids: The whole sequence's ids ``(B, n)``, or a pair (queries', keys').
        mask: The whole sequence's boolean mask ``(n, n)``, ``(B, n, n)`` or ``(B, H, n, n)``.
        sinks: Per-head sink logits ``(H,)``, counted once (in the first step).
        **attention: Keywords of :func:`attention_core.dot_product_attention` that the
            positions decide (``causal``, ``window``, ``scale``...).

    Returns:
        This device's rows of the output ``(B, H, n/P, Dv)``, as one device would give them.
    """
    world = jax.lax.axis_size(axis_name)
    rank = jax.lax.axis_index(axis_name)
    n = q.shape[2] * world
    table = jnp.asarray(par.position_table(n, world, layout))  # (P, n/P)
    ops = JaxOps()
    given = {name: x for name, x in (("valid_lens", valid_lens), ("segment_ids", segment_ids),
                                     ("mask", mask)) if x is not None}
    at = Positions(0, table[rank][None])
    ring = [(i, (i + 1) % world) for i in range(world)]
    done = None
    keys, values = k, v
    for step in range(world):
        source = (rank - step) % world
        first = {"sinks": sinks} if sinks is not None and step == 0 else {}
        part = ac.dot_product_attention(
            q, keys, values, return_lse=True,
            mask=par.block_masks(ops, table[rank], table[source], **given), _positions=at,
            _key_positions=table[source][None], ops=ops, **attention, **first)
        done = par.merge(ops, done, part)
        if step + 1 < world:
            keys = jax.lax.ppermute(keys, axis_name, ring)  # type: ignore[no-untyped-call]
            values = jax.lax.ppermute(values, axis_name, ring)  # type: ignore[no-untyped-call]
    assert done is not None
    return done[0]


@dataclass(frozen=True)
class ContextParallel:
    """A layer's attention across the devices of a mesh axis (``context_parallel=``).

    The layer runs inside ``jax.shard_map`` with its inputs split along the sequence over
    ``axis_name``, each device's shard in ``layout`` (:func:`attention_core.parallel.shard`);
    its output is the device's rows of what one device gives for the whole sequence.

    Args:
        axis_name: The mesh axis the sequence is split over.
        layout: ``"zigzag"`` or ``"contiguous"``.
    """

    axis_name: str
    layout: str = "zigzag"

    def __post_init__(self) -> None:
        if not isinstance(self.axis_name, str) or not self.axis_name:
            raise TypeError(f"axis_name must be a mesh axis name, got {self.axis_name!r}")
        par.check_layout(self.layout)

    def size(self) -> int:
        try:
            return int(jax.lax.axis_size(self.axis_name))
        except NameError:  # "unbound axis name": called outside shard_map
            raise ValueError(f"context_parallel={self.axis_name!r}: the layer attends across "
                             "the devices of that mesh axis, so it must run inside "
                             f"jax.shard_map over a mesh with an axis {self.axis_name!r}"
                             ) from None

    def positions(self, ops: Any, rows: int) -> Any:
        world = self.size()
        table = par.position_table(rows * world, world, self.layout)  # (P, n/P)
        return jnp.asarray(table)[jax.lax.axis_index(self.axis_name)]

    def attend(self, q: Any, k: Any, v: Any, **attention: Any) -> Any:
        return ring_attention(q, k, v, axis_name=self.axis_name, layout=self.layout,
                              **attention)

    def config(self) -> dict[str, Any]:
        return {"axis_name": self.axis_name, "layout": self.layout}


def context_parallel(value: Any) -> ContextParallel | None:
    """Reads a layer's ``context_parallel=``: a mesh axis name, a ContextParallel, or a config.

    A config is the plain dict of :meth:`ContextParallel.config` (a saved layer's).
    """
    if value is None or isinstance(value, ContextParallel):
        return value
    if isinstance(value, str):
        return ContextParallel(value)
    if isinstance(value, dict):
        return ContextParallel(**par.saved_config(value, ("axis_name", "layout"), "JAX"))
    raise TypeError("context_parallel must be None, a mesh axis name, a ContextParallel or "
                    f"its config, got {type(value).__name__}")
