"""Attention over a sequence split across processes, on ``torch.distributed``.

Shape legend: B batch, H query heads, Hkv key/value heads, n/P the rows of one shard, D depth.

:func:`ring_attention`: each rank holds its shard of the queries, keys and values (in the
layout of :mod:`attention_core.parallel`); the keys and values travel the ring of ranks, one
step per rank, each partial result merged by its log-sum-exp. The keys and values go round in
chunks, and the forward and the backward (which recomputes) go tile by tile (:class:`_Ring`),
so a rank holds little more than its own rows; under dropout or a ``score_mod`` autograd
records a ring of whole blocks instead, whose shift is differentiable (its backward shifts
the gradient the other way). Every kernel and mask modifier of ``dot_product_attention`` works.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import attention_core as ac
from attention_core import parallel as par
from attention_core.cache import Positions
from attention_core.kernels import blockwise
from attention_core.kernels.rows import accumulation_dtype
from backends.torch.ops import TorchOps


def _exchange(x: torch.Tensor, to: int, source: int, group: Any) -> torch.Tensor:
    """Sends ``x`` to rank ``to`` and receives a tensor of its shape from ``source``."""
    got = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    ops = [dist.P2POp(dist.isend, x.contiguous(), to, group),
           dist.P2POp(dist.irecv, got, source, group)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return got


class _Shift(torch.autograd.Function):
    """``x`` of the previous rank (each rank sends its own to the next); backward: the reverse."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        ctx.ranks = ((rank + 1) % world, (rank - 1) % world)
        ctx.group = group
        return _exchange(x, ctx.ranks[0], ctx.ranks[1], group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        forward_to, forward_from = ctx.ranks
        return _exchange(grad, forward_from, forward_to, ctx.group), None


def _global_rank(group: Any) -> tuple[int, int]:
    """This process's rank in ``group`` and the group's size."""
    if not dist.is_initialized():
        raise ValueError("context parallel attention runs across the ranks of a process group: "
                         "call torch.distributed.init_process_group first")
    return dist.get_rank(group), dist.get_world_size(group)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: Any = None,
                   layout: str = "zigzag", valid_lens: Any = None, segment_ids: Any = None,
                   mask: Any = None, sinks: Any = None, **attention: Any) -> torch.Tensor:
    """This rank's queries ``(B, H, n/P, D)`` over every rank's keys and values, by a ring.

    Args:
        q: This rank's shard of the queries, in ``layout``.
        k: This rank's shard of the keys ``(B, Hkv, n/P, D)``.
        v: This rank's shard of the values ``(B, Hkv, n/P, Dv)``.
        group: The process group of the shards (None: the default group).
        layout: ``"zigzag"`` or ``"contiguous"`` (:mod:`attention_core.parallel`).
        valid_lens: The whole sequence's lengths ``(B,)`` or ``(B, n)`` (every rank the same).
        segment_ids: The whole sequence's ids ``(B, n)``, or a pair (queries', keys').
        mask: The whole sequence's boolean mask ``(n, n)``, ``(B, n, n)`` or ``(B, H, n, n)``.
        sinks: Per-head sink logits ``(H,)``, counted once (in the first step).
        **attention: Keywords of :func:`attention_core.dot_product_attention` that the
            positions decide (``causal``, ``window``, ``scale``, ``implementation``...).

    Returns:
        This rank's rows of the output ``(B, H, n/P, Dv)``, as one device would give them.

    The keys and values travel in chunks of :data:`RING_CHUNK` rows, one chunk's round of the
    ring after the other, so one chunk is in flight. Each step pools one tile of queries and
    keys at a time (:data:`RING_TILE_SCORES` scores), merging it into its rows by the
    log-sum-exp; a tile that ``causal`` or ``window`` rules out whole is not computed (its keys
    and values still pass on). The backward pass recomputes the same tiles from the output and
    its log-sum-exp, passing the key and value gradients around the ring with their keys and
    values. Under dropout (which a recomputation would draw again) or a ``score_mod`` (which
    may hold learned arrays), autograd records a ring of whole blocks instead.
    """
    blocks = _Blocks(q, group, layout, {"valid_lens": valid_lens, "segment_ids": segment_ids,
                                        "mask": mask}, attention)
    if attention.get("dropout", 0.0) or attention.get("score_mod") is not None:
        return _recorded_ring(blocks, q, k, v, sinks)
    out: torch.Tensor = _Ring.apply(q, k, v, sinks, blocks)  # type: ignore[no-untyped-call]
    return out


class _Blocks:
    """One rank's ring: its rows' positions and each step's block of attention."""

    def __init__(self, q: torch.Tensor, group: Any, layout: str, masks: dict[str, Any],
                 attention: dict[str, Any]) -> None:
        self.group, self.attention = group, attention
        self.rank, self.world = _global_rank(group)
        n = q.shape[2] * self.world
        self.at = par.position_table(n, self.world, layout)
        self.device = q.device
        self.masks = {name: x for name, x in masks.items() if x is not None}
        self.ops = TorchOps(q.device)

    def source(self, step: int) -> int:
        """The rank whose keys and values this rank holds at ``step``."""
        return (self.rank - step) % self.world

    def visible(self, step: int, rows: slice = slice(None), cols: slice = slice(None)) -> bool:
        """Whether the block of ``step``, its query ``rows`` and key ``cols``, has a visible pair.

        The whole first block always counts: it starts the merge.
        """
        if step == 0 and rows == cols == slice(None):
            return True
        return par.block_visible(
            self.at[self.rank][rows], self.at[self.source(step)][cols],
            bool(self.attention.get("causal")), self.attention.get("window"))

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, step: int,
               rows: slice = slice(None), sinks: Any = None, cols: slice = slice(None)
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)`` of this rank's query ``rows`` over the keys ``cols`` of ``step``'s block.

        ``q``, ``keys`` and ``values`` are those rows and keys already.
        """
        mine = torch.from_numpy(self.at[self.rank][rows]).to(self.device)
        theirs = torch.from_numpy(self.at[self.source(step)][cols]).to(self.device)
        first = {"sinks": sinks} if sinks is not None else {}
        out, lse = ac.dot_product_attention(
            q, keys, values, return_lse=True,
            mask=par.block_masks(self.ops, mine, theirs, **self.masks),
            _positions=Positions(0, mine[None]), _key_positions=theirs[None], ops=self.ops,
            **self.attention, **first)
        return out, lse


def _recorded_ring(blocks: _Blocks, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   sinks: Any) -> torch.Tensor:
    """The ring with autograd recording every step (the shifts' backward shifts back)."""
    done = None
    keys, values = k, v
    skipped: list[torch.Tensor] = []
    for step in range(blocks.world):
        if blocks.visible(step):
            done = par.merge(blocks.ops, done, blocks.attend(
                q, keys, values, step, sinks=sinks if step == 0 else None))
        else:  # its shifts' backward must still run on every rank: kept in the graph, times 0
            skipped.append(keys.sum() * 0 + values.sum() * 0)
        if step + 1 < blocks.world:
            keys, values = _Shift.apply(keys, blocks.group), _Shift.apply(values, blocks.group)  # type: ignore[no-untyped-call]
    assert done is not None
    return done[0] + sum(skipped) if skipped else done[0]


def _pass_on(blocks: _Blocks, *xs: torch.Tensor) -> list[torch.Tensor]:
    """Each of ``xs`` sent to the next rank, the previous rank's received."""
    return _received(_send_on(blocks, *xs))


Sending = tuple[list[Any], list[torch.Tensor]]


def _send_on(blocks: _Blocks, *xs: torch.Tensor) -> Sending:
    """Starts sending ``xs`` to the next rank and receiving the previous rank's (no wait)."""
    if blocks.world == 1:
        return [], list(xs)
    to, source = (blocks.rank + 1) % blocks.world, (blocks.rank - 1) % blocks.world
    got = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in xs]
    ops = [op for x, g in zip(xs, got, strict=True)
           for op in (dist.P2POp(dist.isend, x.contiguous(), to, blocks.group),
                      dist.P2POp(dist.irecv, g, source, blocks.group))]
    return dist.batch_isend_irecv(ops), got


def _received(sending: Sending) -> list[torch.Tensor]:
    """What :func:`_send_on` receives, once it has arrived."""
    for request in sending[0]:
        request.wait()
    return sending[1]


#: Keys (rows of a shard) that travel the ring at a time: each shard's keys and values go
#: round in chunks of this many, one chunk's round after the other, so the blocks in flight
#: (and their gradients in the backward) are chunks, not whole shards.
RING_CHUNK = 512

#: Scores in one tile of the ring's forward and backward, ``B * H * rows * keys``. A tile's
#: backward holds about six arrays of that size; 2**18 float32 scores are 1 MiB each.
RING_TILE_SCORES = 2**18


def _chunks(num_keys: int) -> list[slice]:
    """The chunks of a shard's ``num_keys`` keys that travel the ring one after the other."""
    return [slice(c, min(c + RING_CHUNK, num_keys)) for c in range(0, num_keys, RING_CHUNK)]


def _tiles(batch_heads: int, num_queries: int, num_keys: int) -> list[tuple[slice, slice]]:
    """The ``(rows, cols)`` tiles of one chunk's block, computed one at a time.

    Each holds about :data:`RING_TILE_SCORES` scores over at most
    :data:`~attention_core.kernels.blockwise.KEY_BLOCK` keys, so that its temporaries (and,
    in the backward, its keys' gradients) are the tile's, and a tile that the positions rule
    out is skipped.
    """
    q_block, k_block = blockwise.block_sizes(batch_heads, num_queries, num_keys,
                                             RING_TILE_SCORES)
    return [(slice(q0, min(q0 + q_block, num_queries)), slice(k0, min(k0 + k_block, num_keys)))
            for q0 in range(0, num_queries, q_block) for k0 in range(0, num_keys, k_block)]


def _visible_tiles(blocks: _Blocks, step: int, chunk: slice, tiles: list[tuple[slice, slice]],
                   sinks: Any) -> list[tuple[slice, slice, slice, bool]]:
    """``(rows, cols, at, with_sinks)`` of the tiles of ``chunk`` at ``step`` that run.

    ``cols`` index the chunk, ``at`` the shard (the keys' positions). A tile runs where a pair
    is visible, or where it takes the sinks: the first tile of each row at step 0.
    """
    found = []
    for rows, cols in tiles:
        at = slice(chunk.start + cols.start, chunk.start + cols.stop)
        with_sinks = sinks is not None and step == 0 and at.start == 0
        if with_sinks or blocks.visible(step, rows, at):
            found.append((rows, cols, at, with_sinks))
    return found


class _Ring(torch.autograd.Function):
    """The ring's forward without a graph, and a backward that recomputes it; both by tiles.

    Each chunk of the keys and values (:data:`RING_CHUNK`) makes its own round of the ring;
    within a step each tile's result merges into its rows by the log-sum-exp, which holds for
    any split of the keys.
    """

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: Any,
                blocks: _Blocks) -> torch.Tensor:
        B, H, Q, _ = q.shape
        out = q.new_zeros(B, H, Q, v.shape[-1])
        lse = torch.full((B, H, Q), -torch.inf, device=q.device,  # the kernels' lse dtype
                         dtype=getattr(torch, accumulation_dtype(blocks.ops.dtype_name(q))))
        for chunk in _chunks(k.shape[2]):
            keys, values = k[:, :, chunk], v[:, :, chunk]
            tiles = _tiles(B * H, Q, keys.shape[2])
            for step in range(blocks.world):  # the next chunk travels while this one is computed
                sending = _send_on(blocks, keys, values) if step + 1 < blocks.world else None
                for rows, cols, at, with_sinks in _visible_tiles(blocks, step, chunk, tiles, sinks):
                    part = blocks.attend(q[:, :, rows], keys[:, :, cols], values[:, :, cols],
                                         step, rows, sinks if with_sinks else None, at)
                    out[:, :, rows], lse[:, :, rows] = par.merge(
                        blocks.ops, (out[:, :, rows], lse[:, :, rows]), part)
                if sending is not None:
                    keys, values = _received(sending)
        ctx.blocks = blocks
        ctx.save_for_backward(q, k, v, sinks, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, sinks, out, lse = ctx.saved_tensors
        blocks: _Blocks = ctx.blocks
        whole = (d_out * out).sum(-1)  # <dO, out> per row
        finite = torch.isfinite(lse)
        d_q, d_sinks = torch.zeros_like(q), None if sinks is None else torch.zeros_like(sinks)
        d_k, d_v = torch.empty_like(k), torch.empty_like(v)
        for chunk in _chunks(k.shape[2]):
            keys, values = k[:, :, chunk], v[:, :, chunk]
            tiles = _tiles(q.shape[0] * q.shape[1], q.shape[2], keys.shape[2])
            d_keys, d_values = torch.zeros_like(keys), torch.zeros_like(values)
            for step in range(blocks.world):
                sending = _send_on(blocks, keys, values) if step + 1 < blocks.world else None
                for rows, cols, at, with_sinks in _visible_tiles(blocks, step, chunk, tiles, sinks):
                    grads = _tile_grads(blocks, step, rows, at, q, keys[:, :, cols],
                                        values[:, :, cols], sinks if with_sinks else None,
                                        d_out[:, :, rows], lse[:, :, rows], whole[:, :, rows],
                                        finite[:, :, rows])
                    d_q[:, :, rows] += grads[0]
                    d_keys[:, :, cols] += grads[1]
                    d_values[:, :, cols] += grads[2]
                    if grads[3] is not None:
                        d_sinks = grads[3] if d_sinks is None else d_sinks + grads[3]
                if sending is not None:  # the gradients travel with their keys and values
                    keys, values = _received(sending)
                    d_keys, d_values = _pass_on(blocks, d_keys, d_values)
            # one more step: each chunk's gradients back to their own rank
            d_k[:, :, chunk], d_v[:, :, chunk] = _pass_on(blocks, d_keys, d_values)
        return d_q, d_k, d_v, d_sinks, None


def _tile_grads(blocks: _Blocks, step: int, rows: slice, cols: slice, q: torch.Tensor,
                keys: torch.Tensor, values: torch.Tensor, sinks: Any, d_out: torch.Tensor,
                lse: torch.Tensor, whole: torch.Tensor, finite: torch.Tensor) -> tuple[Any, ...]:
    """The gradients of one tile: its query ``rows``, its ``keys`` and ``values``, and sinks.

    ``cols``: where the tile's keys stand in their shard (their positions).

    The merged output is ``sum_j w_j o_j`` over any split of the keys into tiles, with
    ``w_j = exp(lse_j - lse)``: tile j's output gets ``w_j dO`` and its log-sum-exp
    ``w_j (<dO, o_j> - <dO, out>)``.
    """
    leaves = [x.detach().requires_grad_() for x in (q[:, :, rows], keys, values)]
    if sinks is not None:
        leaves.append(sinks.detach().requires_grad_())
    with torch.enable_grad():
        o_j, lse_j = blocks.attend(leaves[0], leaves[1], leaves[2], step, rows,
                                   leaves[3] if sinks is not None else None, cols)
        w = torch.where(finite, torch.exp(lse_j.detach() - torch.where(finite, lse, 0.0)), 0.0)
        g_lse = w * ((d_out * o_j.detach()).sum(-1) - whole)
        grads = torch.autograd.grad((o_j, lse_j), leaves, (w[..., None] * d_out, g_lse),
                                    allow_unused=True)
    found = [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads, strict=True)]
    return (*found[:3], found[3] if sinks is not None else None)


class _AllToAll(torch.autograd.Function):
    """``x (P, ...)``: chunk ``j`` to rank ``j``, which keeps it as chunk ``rank``.

    Its own inverse for equal chunks, so the backward is the same exchange of the gradient.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        got = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        dist.all_to_all_single(got, x.contiguous(), group=group)
        return got

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _AllToAll.apply(grad, ctx.group), None  # type: ignore[no-untyped-call]


def _to_heads(x: torch.Tensor, world: int, group: Any) -> torch.Tensor:
    """``(B, G, n/P, D)`` sequence shards -> ``(B, G/P, n, D)``: every rank's rows, its heads."""
    B, G, rows, D = x.shape
    parts = x.reshape(B, world, G // world, rows, D).permute(1, 0, 2, 3, 4)  # (P, B, G/P, ., D)
    # chunk s: rank s's rows of this rank's heads
    got = _AllToAll.apply(parts, group)  # type: ignore[no-untyped-call]
    return got.permute(1, 2, 0, 3, 4).reshape(B, G // world, world * rows, D)


def _to_rows(x: torch.Tensor, world: int, group: Any) -> torch.Tensor:
    """The inverse of :func:`_to_heads`: ``(B, G/P, n, D)`` -> ``(B, G, n/P, D)``."""
    B, g, n, D = x.shape
    parts = x.reshape(B, g, world, n // world, D).permute(2, 0, 1, 3, 4)  # (P, B, G/P, n/P, D)
    # chunk j: head group j of this rank's rows
    got = _AllToAll.apply(parts, group)  # type: ignore[no-untyped-call]
    return got.permute(1, 0, 2, 3, 4).reshape(B, world * g, n // world, D)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: Any = None,
                      layout: str = "zigzag", valid_lens: Any = None, segment_ids: Any = None,
                      mask: Any = None, sinks: Any = None, **attention: Any) -> torch.Tensor:
    """This rank's queries over every rank's keys, the heads split across the ranks instead.

    An all-to-all turns the sequence shards into head shards (each rank: ``H/P`` heads of the
    whole sequence), one attention call runs (any kernel, the fused one included), and a
    second all-to-all turns the output back. The arguments are those of
    :func:`ring_attention`.

    Raises:
        ValueError: Heads (or, with grouped-query heads, key/value heads) that the world size
            does not divide.
    """
    rank, world = _global_rank(group)
    if q.shape[1] == 1 and world > 1:
        raise ValueError(f"ulysses attention splits the heads over the {world} ranks, and the "
                         "queries have one head (a DotProductAttention layer's): use "
                         "strategy='ring'")
    for name, heads in (("num_heads", q.shape[1]), ("num_kv_heads", k.shape[1])):
        if heads % world:
            raise ValueError(f"ulysses attention splits the heads over the {world} ranks: "
                             f"{name} ({heads}) must be divisible by it")
    n, ops = q.shape[2] * world, TorchOps(q.device)
    at = torch.from_numpy(par.position_table(n, world, layout).reshape(-1)).to(q.device)
    mine = slice(rank * q.shape[1] // world, (rank + 1) * q.shape[1] // world)  # its heads
    if mask is not None and len(mask.shape) == 4 and mask.shape[1] != 1:
        mask = mask[:, mine]
    if sinks is not None:
        attention["sinks"] = sinks[mine]
    masks = par.block_masks(ops, at, at, valid_lens=valid_lens, segment_ids=segment_ids,
                            mask=mask)
    qh, kh, vh = (_to_heads(x, world, group) for x in (q, k, v))
    out = ac.dot_product_attention(qh, kh, vh, mask=masks, _positions=Positions(0, at[None]),
                                   _key_positions=at[None], ops=ops, **attention)
    return _to_rows(out, world, group)


#: The strategies of :class:`ContextParallel`.
STRATEGIES = ("ring", "ulysses")


@dataclass(frozen=True)
class ContextParallel:
    """A layer's attention across the ranks of a process group (``context_parallel=``).

    The layer's inputs are each rank's shard of the sequence, in ``layout``
    (:func:`attention_core.parallel.shard`); its output is the rank's rows of what one device
    gives for the whole sequence.

    Args:
        group: The process group the sequence is split over (None: the default group).
        strategy: ``"ring"`` (:func:`ring_attention`) or ``"ulysses"``
            (:func:`ulysses_attention`).
        layout: ``"zigzag"`` or ``"contiguous"``.
    """

    group: Any = None
    strategy: str = "ring"
    layout: str = "zigzag"

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be 'ring' or 'ulysses', got {self.strategy!r}")
        par.check_layout(self.layout)

    def size(self) -> int:
        return _global_rank(self.group)[1]

    def positions(self, ops: Any, rows: int) -> torch.Tensor:
        rank, world = _global_rank(self.group)
        at = par.shard_positions(rows * world, world, rank, self.layout)
        return torch.from_numpy(at).to(getattr(ops, "device", None) or "cpu")

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               **attention: Any) -> torch.Tensor:
        pool = ring_attention if self.strategy == "ring" else ulysses_attention
        return pool(q, k, v, group=self.group, layout=self.layout, **attention)

    def config(self) -> dict[str, Any]:
        if self.group is not None:
            raise ValueError("a layer whose context_parallel holds a process group cannot save "
                             "its config (a group is made by each run); use the default group "
                             "(group=None) in a layer that is saved")
        return {"strategy": self.strategy, "layout": self.layout}


def context_parallel(value: Any) -> ContextParallel | None:
    """Reads a layer's ``context_parallel=``: True (the default group), a group, or a config.

    A config is the plain dict of :meth:`ContextParallel.config` (a saved layer's).
    """
    if value is None or isinstance(value, ContextParallel):
        return value
    if value is True:
        return ContextParallel()
    if isinstance(value, dict):
        return ContextParallel(**par.saved_config(value, ("strategy", "layout"), "torch"))
    if isinstance(value, dist.ProcessGroup):
        return ContextParallel(value)
    raise TypeError("context_parallel must be None, True, a torch.distributed ProcessGroup, "
                    f"a ContextParallel or its config, got {type(value).__name__}")
