"""PyTorch's FlexAttention as the kernel ``"flex"`` (where ``torch.nn.attention.flex_attention`` imports).

The request's modifiers are lowered by evaluating them, not re-written: a user's
``mask_mod``/``score_mod`` and the modifiers that need only the indices (causal, window,
soft-capping, ALiBi) are asked about one score at a time, at the index tensors FlexAttention
passes; the other mask modifiers (lengths, masks, segments, prefix-LM, OR-ed masks) are asked
once about the whole call, and FlexAttention's ``mask_mod`` reads their answer. The masks become
one ``BlockMask`` (``B`` and ``H`` broadcast where the masks do not depend on them); sinks are
folded in through the log-sum-exp. FlexAttention gives a row with no visible key zeros and a
log-sum-exp of ``-inf`` (natural log, float32 for half inputs), as the library's policy has it.

Shape legend: B batch, H query heads, Hkv key/value heads, Q queries, K keys, Dv value depth.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from attention_core.kernels import Capabilities, Request, Result, register_kernel
from attention_core.modifiers import (
    Alibi,
    AllMasks,
    AnyMask,
    BooleanMask,
    Call,
    Causal,
    Lengths,
    MaskFunction,
    MaskMod,
    PrefixLM,
    ScoreFunction,
    Segments,
    Softcap,
    Tile,
    Window,
)

try:
    from torch.nn.attention import flex_attention as _flex
except ImportError:  # torch before 2.5
    _flex = None  # type: ignore[assignment]

#: Mask modifiers asked one score at a time (their answer needs only the indices).
POINTWISE_MASKS = (MaskFunction, Causal, Window)

CAPABILITIES = Capabilities(
    masks=frozenset({*POINTWISE_MASKS, Lengths, BooleanMask, Segments, PrefixLM, AnyMask}),
    scores=frozenset({ScoreFunction, Softcap, Alibi}), lse=True, sinks=True, dropout=False,
    run_time_lengths=False)


@dataclass(frozen=True)
class Point(Tile):
    """One score of a call, at the index tensors FlexAttention passes (0-d under its ``vmap``).

    ``q0`` and ``k0`` are the query's and key's indices in the call (``qn = kn = 1``).
    """

    b_idx: Any = None
    h_idx: Any = None

    def b(self) -> torch.Tensor:
        return self.b_idx

    def h(self) -> torch.Tensor:
        return self.h_idx

    def q_idx(self) -> torch.Tensor:
        return _plus(self.q0, self.call.start)

    def kv_idx(self) -> torch.Tensor:
        return self.k0

    def distances(self) -> torch.Tensor:
        return self.k0 - _plus(self.q0, self.call.offset)

    def first_position(self) -> int | None:
        return None


def _plus(x: torch.Tensor, start: Any) -> torch.Tensor:
    """``x + start``, skipping a start of 0 known now."""
    return x if isinstance(start, int) and start == 0 else x + start


def _rank4(x: torch.Tensor) -> torch.Tensor:
    """``x`` with size-1 axes in front up to rank 4 (a modifier's answer broadcasts so)."""
    return x.reshape((1,) * (4 - x.dim()) + tuple(x.shape))


def _at(x: torch.Tensor, b: Any, h: Any, q: Any, kv: Any) -> torch.Tensor:
    """The entry of a broadcastable ``(B|1, H|1, Q|1, K|1)`` answer at one score (a 0-d one as is)."""
    if x.dim() == 0:
        return x
    x = x if x.dim() == 4 else _rank4(x)
    return x[tuple(i if n != 1 else 0 for i, n in zip((b, h, q, kv), x.shape, strict=True))]


def flex(ops: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, request: Request) -> Result:
    """Pools with FlexAttention: ``(B, H, Q, Dv)``, and the log-sum-exp ``(B, H, Q)`` if asked."""
    assert _flex is not None
    if q.device.type == "cpu":  # FlexAttention refuses CPU tensors that want gradients
        _check_gradients((q, k, v, request.sinks))
        q, k, v = q.detach(), k.detach(), v.detach()  # none are recorded (no_grad)
    scale = request.scale
    if isinstance(scale, torch.Tensor):  # a depth traced as a tensor
        q, scale = q * scale, 1.0
    gqa = bool(q.shape[1] != k.shape[1])  # a branch on sizes traced as symbols (guarded)
    lse_wanted = request.lse or request.sinks is not None
    out, lse = _attend(q, k, v, _score_mod(request), _block_mask(request, q.device), scale,
                       lse_wanted, gqa)
    if request.sinks is not None:
        out, lse = _sunk(out, lse, request.sinks)
    return Result(out, None, lse.float() if request.lse else None)


def _check_gradients(inputs: Sequence[Any]) -> None:
    """Refuses a call that records gradients on CPU, where FlexAttention has no backward.

    Raises:
        ValueError: Gradients are being recorded for one of ``inputs``.
    """
    if torch.is_grad_enabled() and any(
            isinstance(x, torch.Tensor) and x.requires_grad for x in inputs):
        raise ValueError("implementation='flex' computes no gradients on CPU (torch's "
                         "FlexAttention has no CPU backward): this call needs "
                         "implementation=None or another kernel, or torch.no_grad()")


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, score_mod: Any, block_mask: Any,
            scale: float, lse: bool, gqa: bool) -> tuple[torch.Tensor, Any]:
    """One FlexAttention call: the output, and the log-sum-exp when asked (else None)."""
    assert _flex is not None
    aux = getattr(_flex, "AuxRequest", None)
    if not lse:
        return _flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                    scale=scale, enable_gqa=gqa), None
    if aux is None:  # torch before the auxiliary outputs
        return _flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                    scale=scale, enable_gqa=gqa, return_lse=True)
    out, found = _flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                      scale=scale, enable_gqa=gqa,
                                      return_aux=aux(lse=True))
    return out, found.lse


def _sunk(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and log-sum-exp with each head's sink in the denominator.

    ``out * exp(lse) / (exp(lse) + exp(sink))`` and ``logaddexp(lse, sink)``: a row with no
    visible key stays zeros, its log-sum-exp the sink.
    """
    sunk = torch.logaddexp(lse, sinks.to(lse.dtype).reshape(1, -1, 1))
    kept = torch.exp(lse - sunk).unsqueeze(-1)
    return (out.to(kept.dtype) * kept).to(out.dtype), sunk


def _score_mod(request: Request) -> Callable[..., torch.Tensor] | None:
    """The score modifiers as one FlexAttention ``score_mod``, each asked at one score."""
    mods, call = request.scores, request.call
    if not mods:
        return None

    def score_mod(score: torch.Tensor, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> torch.Tensor:
        point = Point(call, q_idx, 1, kv_idx, 1, b, h)
        for mod in mods:
            score = _at(mod.apply(score, point), b, h, 0, 0)  # ALiBi answers for every head
        return score

    return score_mod


def _block_mask(request: Request, device: torch.device) -> Any:
    """The mask modifiers as one FlexAttention ``BlockMask``; None when nothing is hidden."""
    assert _flex is not None
    call, (B, H, Q, K) = request.call, request.call.shape
    point = [m for m in request.masks if isinstance(m, POINTWISE_MASKS)]
    table = AllMasks([m for m in request.masks if not isinstance(m, POINTWISE_MASKS)]
                     ).visible(call.whole())
    if table is None and not point:
        return None
    table = None if table is None else _rank4(table)

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> torch.Tensor:
        tile = Point(call, q_idx, 1, kv_idx, 1, b, h)
        seen = [s for s in (m.visible(tile) for m in point) if s is not None]
        if table is not None:
            seen.append(_at(table, b, h, q_idx, kv_idx))
        out = seen[0]
        for s in seen[1:]:
            out = out & s
        return out

    per_b, per_h = _depends(call, point, table)
    return _flex.create_block_mask(mask_mod, B if per_b else None, H if per_h else None, Q, K,
                                   device=device)


def _depends(call: Call, point: Sequence[MaskMod], table: torch.Tensor | None) -> tuple[bool, bool]:
    """Whether the masks depend on the example and on the head (from their answers' shapes)."""
    shapes = [] if table is None else [_rank4(table).shape]
    probe = call.tile(0, 1, 0, 1)
    shapes += [_rank4(s).shape for s in (m.visible(probe) for m in point) if s is not None]
    return any(s[0] != 1 for s in shapes), any(s[1] != 1 for s in shapes)


def prefers_flex(ops: Any, request: Request) -> bool:
    """Only where SDPA cannot take the call's user functions: compiled, on CUDA.

    Eager FlexAttention forms every score (no faster than the direct kernel, slower on CPU);
    compiled on CUDA it runs as one fused kernel. A user's ``mask_mod`` or ``score_mod`` is
    what the fused SDPA kernel does not take (scores) or takes only as a dense mask.
    """
    device = getattr(ops, "device", None)
    if device is None or device.type != "cuda":
        return False
    user = any(isinstance(m, (MaskFunction, ScoreFunction))
               for m in (*request.masks, *request.scores))
    return user and torch.compiler.is_compiling() and not torch.compiler.is_exporting()


def register() -> None:
    """Registers ``"flex"`` for the torch backend where this torch has FlexAttention."""
    if _flex is not None:
        register_kernel("flex", flex, CAPABILITIES, backend="torch", priority=30,
                        prefers=prefers_flex)

