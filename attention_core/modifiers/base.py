"""What every modifier shares: the tile it is asked about, and the ways modifiers combine.

A *mask modifier* says which keys each query may see, ``mask_mod(b, h, q_idx, kv_idx) -> bool``
(True = may attend); a *score modifier* changes the scores before the softmax,
``score_mod(score, b, h, q_idx, kv_idx) -> score``, as PyTorch's FlexAttention has them. Both
are asked about one tile of the scores at a time: the direct path asks for the whole
``(B, H, Q, K)`` tile once, the blockwise path for one block of queries and keys at a time.

A mask modifier may also say, from the positions alone, which keys a block of queries can see
at all (:meth:`MaskMod.span`): the blockwise path then skips the other key blocks.

Shape legend: B batch, H query heads, Q queries, K keys.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from attention_core.ops import FLOAT_DTYPES, Array, Ops

#: ``(first, count)``: the keys a block of queries may see are ``first .. first + count - 1``;
#: ``count`` is an int, ``first`` an int or a run-time scalar.
Span = tuple[Any, int]


@dataclass(frozen=True)
class Call:
    """What a call's modifiers are bound to: its backend, scores' shape and query positions.

    A call whose examples stand at different positions (a ragged batch) gives them per
    example: ``start`` and ``offset`` are then None and ``query_positions`` is set.

    Attributes:
        ops: The backend's ops.
        shape: ``(B, H, Q, K)``; B and H may be run-time sizes under tracing.
        start: The index ``q_idx`` of query 0 as modifiers see it: 0, or a cached call's
            first position.
        offset: The position of query 0 among the keys (``p_i = i + offset``): ``K - Q`` in a
            plain call (queries aligned with the last keys), a cached call's first position.
        query_positions: int32 ``(B, Q)`` (or ``(1, Q)``): each query's position, or None.
        key_positions: int32 ``(B, K)``: each key's position, or None for ``j``.
        key_valid: Boolean ``(B, K)``: the keys that hold a token (the causal and window
            masks hide the others), or None for all.
        bound: Known now: every query position is below it (lets spans skip keys), or None.
    """

    ops: Ops
    shape: tuple[Any, ...]
    start: Any = 0
    offset: Any = 0
    query_positions: Any = None
    key_positions: Any = None
    key_valid: Any = None
    bound: int | None = None

    @classmethod
    def of(cls, ops: Ops, shape: tuple[Any, ...], start: Any = None) -> Call:
        """A plain call (``start`` None: queries aligned with the last keys) or a cached one."""
        _, _, Q, K = shape
        return cls(ops, tuple(shape), 0, K - Q) if start is None else cls(ops, tuple(shape),
                                                                          start, start)

    @classmethod
    def at(cls, ops: Ops, shape: tuple[Any, ...], query: Any, key_positions: Any = None,
           key_valid: Any = None, bound: int | None = None) -> Call:
        """A call whose queries stand at ``query``, maybe per example.

        ``query`` is a first position that every example shares (an int or a scalar array:
        :meth:`of`'s fast path, unless key positions or validity are given), or int32
        positions ``(B, Q)``.
        """
        shared = isinstance(query, int) or tuple(ops.shape(query)) == ()
        if shared and key_positions is None and key_valid is None:
            return cls.of(ops, shape, query)
        if shared:
            query = ops.expand_dims(ops.arange(shape[2]) + query, 0)  # (1, Q)
        return cls(ops, tuple(shape), None, None, query, key_positions, key_valid, bound)

    @property
    def per_example(self) -> bool:
        """Whether positions are given per example (``query_positions`` and the rest)."""
        return self.query_positions is not None

    def tile(self, q0: Any, qn: int, k0: Any, kn: int) -> Tile:
        """The tile of queries ``q0 : q0 + qn`` and keys ``k0 : k0 + kn``."""
        return Tile(self, q0, qn, k0, kn)

    def whole(self) -> Tile:
        """The tile of every query and key."""
        _, _, Q, K = self.shape
        return Tile(self, 0, Q, 0, K)


@dataclass(frozen=True)
class Tile:
    """Queries ``q0 : q0 + qn`` and keys ``k0 : k0 + kn`` of a call; ``q0``, ``k0`` may be run-time."""

    call: Call
    q0: Any
    qn: Any
    k0: Any
    kn: Any

    @property
    def ops(self) -> Ops:
        """The call's backend ops."""
        return self.call.ops

    def b(self) -> Array:
        """int32 ``(B, 1, 1, 1)``: the example index."""
        return _shaped(self.ops, self.ops.arange(self.call.shape[0]), 0)

    def h(self) -> Array:
        """int32 ``(1, H, 1, 1)``: the query head index."""
        return _shaped(self.ops, self.ops.arange(self.call.shape[1]), 1)

    def q_idx(self) -> Array:
        """int32 ``(1, 1, qn, 1)``: each query's index, ``i + start``.

        Per example, each query's position, ``(B, 1, qn, 1)``.
        """
        ops, positions = self.ops, self.call.query_positions
        if positions is not None:
            return ops.expand_dims(ops.expand_dims(ops.slice(positions, 1, self.q0, self.qn), 1),
                                   -1)
        return _shaped(ops, _plus(ops.arange(self.qn), _plus(self.q0, self.call.start)), 2)

    def kv_idx(self) -> Array:
        """int32 ``(1, 1, 1, kn)``: each key's index ``j``.

        Its position, ``(B, 1, 1, kn)``, where the call gives key positions.
        """
        positions = self.call.key_positions
        if positions is not None:
            ops = self.ops
            return ops.expand_dims(ops.expand_dims(ops.slice(positions, 1, self.k0, self.kn), 1),
                                   1)
        return self.key_index()

    def key_index(self) -> Array:
        """int32 ``(1, 1, 1, kn)``: each key's index ``j`` among the call's keys."""
        return _shaped(self.ops, _plus(self.ops.arange(self.kn), self.k0), 3)

    def key_valid(self) -> Array | None:
        """Boolean ``(B, 1, 1, kn)``: the keys that hold a token; None when all do."""
        valid = self.call.key_valid
        if valid is None:
            return None
        ops = self.ops
        return ops.expand_dims(ops.expand_dims(ops.slice(valid, 1, self.k0, self.kn), 1), 1)

    def distances(self) -> Array:
        """int32 ``(qn, kn)``: ``j - p_i``, key position minus query position.

        Per example, ``(B, 1, qn, kn)``.
        """
        ops = self.ops
        if self.call.per_example:
            return self.kv_idx() - self.q_idx()
        rows = ops.expand_dims(_plus(ops.arange(self.qn), _plus(self.q0, self.call.offset)), -1)
        return ops.expand_dims(_plus(ops.arange(self.kn), self.k0), 0) - rows

    def first_position(self) -> int | None:
        """The position of the tile's first query when it is known now, else None."""
        if self.call.per_example:
            return None
        first = _plus(self.q0, self.call.offset)
        return first if isinstance(first, int) and isinstance(self.k0, int) else None


def of_valid_keys(tile: Tile, visible: Array) -> Array:
    """``visible`` ANDed with the keys that hold a token (:meth:`Tile.key_valid`)."""
    valid = tile.key_valid()
    return visible if valid is None else tile.ops.logical_and(visible, valid)


def refuse_per_example(call: Call, name: str) -> None:
    """Refuses a modifier that needs every example at the same positions, per example.

    Raises:
        ValueError: The call gives positions per example.
    """
    if call.per_example:
        raise ValueError(f"{name} needs every example at the same positions; this call gives "
                         "positions per example (a ragged batch)")


def _plus(x: Any, start: Any) -> Any:
    """``x + start``, skipping the addition for a start of 0 (known now)."""
    return x if isinstance(start, int) and start == 0 else x + start


def _shaped(ops: Ops, index: Array, axis: int) -> Array:
    """A 1-d index placed on ``axis`` of a rank-4 array, size 1 elsewhere."""
    for a in range(4):
        if a != axis:
            index = ops.expand_dims(index, a)
    return index


class MaskMod:
    """A mask modifier. Subclasses answer :meth:`visible`, and :meth:`span` where they can."""

    def bind(self, call: Call) -> MaskMod:
        """This modifier checked and made ready for one call (arrays converted)."""
        return self

    def visible(self, tile: Tile) -> Array | None:
        """Boolean, broadcastable to ``(B, H, qn, kn)``; None when the tile hides nothing."""
        raise NotImplementedError

    def span(self, call: Call, q0: Any, qn: int) -> Span | None:
        """The keys queries ``q0 : q0 + qn`` may see, or None for all (or not known now)."""
        return None

    def parts(self) -> tuple[MaskMod, ...]:
        """The modifiers ANDed in this one (itself, unless it is an AND)."""
        return (self,)


class ScoreMod:
    """A score modifier: :meth:`apply` changes one tile of scores."""

    def bind(self, call: Call) -> ScoreMod:
        """This modifier checked and made ready for one call."""
        return self

    def apply(self, scores: Array, tile: Tile) -> Array:
        """The tile's scores ``(B, H, qn, kn)``, changed."""
        raise NotImplementedError

    def parts(self) -> tuple[ScoreMod, ...]:
        """The modifiers composed in this one, in order."""
        return (self,)


class MaskFunction(MaskMod):
    """A user's ``mask_mod(b, h, q_idx, kv_idx) -> bool`` over the tile's index arrays."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def visible(self, tile: Tile) -> Array:
        out = self.fn(tile.b(), tile.h(), tile.q_idx(), tile.kv_idx())
        dtype = tile.ops.dtype_name(out) if hasattr(out, "dtype") else type(out).__name__
        if dtype != "bool":
            raise TypeError(f"mask_mod must return a boolean array (True = may attend), got {dtype}")
        return out


class ScoreFunction(ScoreMod):
    """A user's ``score_mod(score, b, h, q_idx, kv_idx) -> score`` over the tile's index arrays."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def apply(self, scores: Array, tile: Tile) -> Array:
        out = self.fn(scores, tile.b(), tile.h(), tile.q_idx(), tile.kv_idx())
        ops, dtype = tile.ops, tile.ops.dtype_name(scores)
        got = ops.dtype_name(out) if hasattr(out, "dtype") else type(out).__name__
        if got not in FLOAT_DTYPES:
            raise TypeError(f"score_mod must return floating-point scores, got {got}")
        return out if got == dtype else ops.astype(out, dtype)  # NumPy promotes to float64


class AllMasks(MaskMod):
    """Keys visible to every one of the modifiers (AND)."""

    def __init__(self, mods: Sequence[MaskMod]) -> None:
        self.mods = tuple(m for mod in mods for m in mod.parts())

    def parts(self) -> tuple[MaskMod, ...]:
        return self.mods

    def bind(self, call: Call) -> MaskMod:
        return AllMasks([m.bind(call) for m in self.mods])

    def visible(self, tile: Tile) -> Array | None:
        return _combined(tile.ops, [m.visible(tile) for m in self.mods], tile.ops.logical_and)

    def span(self, call: Call, q0: Any, qn: int) -> Span | None:
        spans = [s for s in (m.span(call, q0, qn) for m in self.mods) if s is not None]
        if not spans:
            return None
        if all(isinstance(s[0], int) for s in spans):  # the intersection, at least one key
            first = max(s[0] for s in spans)
            end = min(s[0] + s[1] for s in spans)
            return (first, max(1, end - first)) if end > first else (min(first, call.shape[3] - 1), 1)
        return min(spans, key=lambda s: s[1])  # any one holds every visible key


class AnyMask(MaskMod):
    """Keys visible to any of the modifiers (OR)."""

    def __init__(self, mods: Sequence[MaskMod]) -> None:
        self.mods = tuple(mods)

    def bind(self, call: Call) -> MaskMod:
        return AnyMask([m.bind(call) for m in self.mods])

    def visible(self, tile: Tile) -> Array | None:
        parts = [m.visible(tile) for m in self.mods]
        if any(p is None for p in parts):
            return None
        return _combined(tile.ops, parts, lambda a, b: tile.ops.where(a, a, b))  # a or b

    def span(self, call: Call, q0: Any, qn: int) -> Span | None:
        spans = [m.span(call, q0, qn) for m in self.mods]
        if any(s is None or not isinstance(s[0], int) for s in spans):
            return None
        first = min(s[0] for s in spans if s is not None)
        end = max(s[0] + s[1] for s in spans if s is not None)
        return first, end - first


class Composed(ScoreMod):
    """Score modifiers applied one after another, in order."""

    def __init__(self, mods: Sequence[ScoreMod]) -> None:
        self.mods = tuple(m for mod in mods for m in mod.parts())

    def parts(self) -> tuple[ScoreMod, ...]:
        return self.mods

    def bind(self, call: Call) -> ScoreMod:
        return Composed([m.bind(call) for m in self.mods])

    def apply(self, scores: Array, tile: Tile) -> Array:
        for mod in self.mods:
            scores = mod.apply(scores, tile)
        return scores


def _combined(ops: Ops, parts: list[Array | None], join: Callable[[Array, Array], Array]
              ) -> Array | None:
    """The parts that are not None joined pairwise; None when there are none."""
    kept = [p for p in parts if p is not None]
    if not kept:
        return None
    out = kept[0]
    for part in kept[1:]:
        out = join(out, part)
    return out


def as_mask_mod(mod: Any) -> MaskMod | None:
    """A user's ``mask_mod`` as a :class:`MaskMod`: a modifier, a callable, or a list of them."""
    if mod is None or isinstance(mod, MaskMod):
        return mod
    if isinstance(mod, (list, tuple)):
        return AllMasks([m for m in (as_mask_mod(x) for x in mod) if m is not None])
    if callable(mod):
        return MaskFunction(mod)
    raise TypeError(f"mask_mod must be a callable mask_mod(b, h, q_idx, kv_idx), a mask "
                    f"modifier or a list of them, got {type(mod).__name__}")


def as_score_mod(mod: Any) -> ScoreMod | None:
    """A user's ``score_mod`` as a :class:`ScoreMod`: a modifier, a callable, or a list of them."""
    if mod is None or isinstance(mod, ScoreMod):
        return mod
    if isinstance(mod, (list, tuple)):
        return Composed([m for m in (as_score_mod(x) for x in mod) if m is not None])
    if callable(mod):
        return ScoreFunction(mod)
    raise TypeError(f"score_mod must be a callable score_mod(score, b, h, q_idx, kv_idx), a "
                    f"score modifier or a list of them, got {type(mod).__name__}")
