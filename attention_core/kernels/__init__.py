"""Kernels: the ways to pool attention, registered by name with what each can do.

Every kernel has one signature, ``kernel(ops, queries, keys, values, request) -> Result``, and
declares its :class:`Capabilities`. The core registers ``"direct"`` (forms the weights) and
``"blockwise"`` (an online softmax over key blocks) for every backend; an adapter registers its
framework's fused kernel as ``"fused"``; a user may register their own. :func:`choose` is the
one rule that picks: the kernel named by ``implementation=`` (refused with the reason when it
cannot do what the call asks), else the first kernel, by priority, that can do everything the
call asks and prefers the call's shape. Which kernel ran, and why the others were passed over,
is logged at DEBUG level on the ``attention_core.kernels`` logger (eager calls), and
:func:`choose` says it for a :class:`Request` without running it.

Shape legend: B batch, H query heads, Hkv key/value heads, Q queries, K keys, D depth, Dv value
depth.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from attention_core.modifiers import Call, MaskMod, ScoreMod
from attention_core.ops import FLOAT_DTYPES, Array, Ops

LOG = logging.getLogger("attention_core.kernels")


@dataclass(frozen=True)
class Request:
    """What one call of attention asks of a kernel, its modifiers bound to the call.

    Attributes:
        call: The backend, the scores' shape ``(B, H, Q, K)`` and the queries' positions.
        masks: The mask modifiers, ANDed (empty for none).
        scores: The score modifiers, in order (empty for none).
        scale: Multiplies ``q . k``; a float, or a run-time scalar.
        dropout: Rate of dropout on the weights (0 for none).
        sinks: Per-head sink logits ``(H,)``, or None.
        weights: Whether the weights ``(B, H, Q, K)`` are wanted.
        lse: Whether each row's log-sum-exp ``(B, H, Q)`` is wanted.
        dtype: The inputs' dtype.
        traced: Whether the call is being traced into a program.
        value_depth: Whether Dv differs from D.
        check_numerics: Whether NaN and inf must reach exactly the rows that see them.
    """

    call: Call
    masks: tuple[MaskMod, ...] = ()
    scores: tuple[ScoreMod, ...] = ()
    scale: Any = 1.0
    dropout: float = 0.0
    sinks: Array | None = None
    weights: bool = False
    lse: bool = False
    dtype: str = "float32"
    traced: bool = False
    value_depth: bool = False
    check_numerics: bool = False


@dataclass(frozen=True)
class Result:
    """A kernel's answer: the output ``(B, H, Q, Dv)``, and the weights and log-sum-exp if asked."""

    out: Array
    weights: Array | None = None
    lse: Array | None = None


@dataclass(frozen=True)
class Capabilities:
    """What a kernel can do; anything a call asks beyond it passes the kernel over.

    Attributes:
        masks: The mask modifier types it takes (None: any).
        scores: The score modifier types it takes (None: any).
        weights: Returns the attention weights.
        lse: Returns each row's log-sum-exp.
        sinks: Takes per-head sink logits.
        dropout: Takes dropout on the weights.
        dtypes: The input dtypes it takes.
        traceable: Runs in a traced program.
        value_depth: Takes values deeper or shallower than the keys (Dv != D).
        exact_non_finite: NaN and inf reach exactly the rows that see them.
        run_time_lengths: Takes numbers of queries and keys known only at run time (traced).
        ragged: Takes positions per example (:attr:`~attention_core.modifiers.Call.per_example`:
            a ragged batch), not only one offset shared by every example.
    """

    masks: frozenset[type] | None = None
    scores: frozenset[type] | None = None
    weights: bool = False
    lse: bool = False
    sinks: bool = False
    dropout: bool = True
    dtypes: frozenset[str] = frozenset(FLOAT_DTYPES)
    traceable: bool = True
    value_depth: bool = True
    exact_non_finite: bool = False
    run_time_lengths: bool = True
    ragged: bool = False

    def missing(self, request: Request) -> list[str]:
        """What ``request`` asks that this kernel cannot do, in words (empty: nothing)."""
        r = request
        why = [w for w in (_untaken("mask", self.masks, r.masks),
                           _untaken("score", self.scores, r.scores)) if w]
        if not self.weights and _asked(r.weights):
            why.append("never forms the attention weights")
        if not self.lse and _asked(r.lse):
            why.append("does not return the log-sum-exp")
        if not self.sinks and r.sinks is not None:
            why.append("does not take sinks")
        if not self.dropout and _asked(r.dropout > 0):
            why.append("does not take dropout")
        if r.dtype not in self.dtypes:
            why.append(f"does not take {r.dtype} inputs")
        if not self.traceable and r.traced:
            why.append("does not run in a traced program")
        if not self.value_depth and _asked(r.value_depth):
            why.append("needs values as deep as the keys")
        if not self.exact_non_finite and r.check_numerics:
            why.append("does not check numerics")
        if not self.run_time_lengths and not all(isinstance(n, int) for n in r.call.shape[2:]):
            why.append("needs the numbers of queries and keys to be known when the call is traced")
        if not self.ragged and r.call.per_example:
            why.append("takes one offset for every example")
        return why


def _asked(asked: Any) -> bool:
    """Whether a call asks for something; one known only at run time counts as asked.

    A traced size's comparison (``Dv != D`` under ``torch.jit.trace``) has no value now.
    """
    known = isinstance(asked, (bool, int, float)) or type(asked).__module__ == "numpy"
    return bool(asked) if known else True


def _untaken(kind: str, taken: frozenset[type] | None, mods: tuple[Any, ...]) -> str:
    """Words for the modifiers of ``mods`` outside ``taken`` ('' when it takes them all)."""
    left = [] if taken is None else sorted({type(m).__name__ for m in mods if type(m) not in taken})
    return f"does not take the {kind} modifiers {', '.join(left)}" if left else ""


Kernel = Callable[[Ops, Array, Array, Array, Request], Result]
Prefers = Callable[[Ops, Request], bool]


@dataclass(frozen=True)
class Entry:
    """A registered kernel."""

    name: str
    kernel: Kernel
    capabilities: Capabilities
    backend: str | None = None
    priority: int = 0
    prefers: Prefers = field(default=lambda ops, request: True)


_REGISTRY: dict[tuple[str, str | None], Entry] = {}
#: :func:`kernels`' answers, by backend, until the next registration.
_BY_BACKEND: dict[str, list[Entry]] = {}
#: Taken by writers only: a reader copies the dict, which CPython does atomically, and takes no
#: lock, which a traced program (``torch.compile``) could not enter.
_LOCK = threading.Lock()


def register_kernel(name: str, kernel: Kernel, capabilities: Capabilities, *,
                    backend: str | None = None, priority: int = 0,
                    prefers: Prefers | None = None) -> None:
    """Registers ``kernel`` under ``name`` for one backend (None: every backend).

    A backend's own entry of a name shadows the entry for every backend. The automatic choice
    tries kernels by descending ``priority``, each only where ``prefers(ops, request)`` holds.

    Raises:
        TypeError: ``capabilities`` is not a :class:`Capabilities`, or ``kernel`` not callable.
    """
    if not isinstance(capabilities, Capabilities):
        raise TypeError(f"capabilities must be a Capabilities, got {type(capabilities).__name__}")
    if not callable(kernel):
        raise TypeError(f"kernel must be callable, got {type(kernel).__name__}")
    entry = Entry(name, kernel, capabilities, backend, priority,
                  prefers or (lambda ops, request: True))
    with _LOCK:
        _REGISTRY[name, backend] = entry
        _BY_BACKEND.clear()


def registered_names() -> set[str]:
    """The names of every registered kernel, of any backend."""
    return {name for name, _ in _snapshot()}


def kernels(backend: str) -> list[Entry]:
    """The kernels a backend can run, by descending priority."""
    found = _BY_BACKEND.get(backend)
    if found is None:
        entries = _snapshot()
        names = {name for name, owner in entries if owner in (None, backend)}
        found = sorted((entries.get((n, backend)) or entries[n, None] for n in names),
                       key=lambda e: (-e.priority, e.name))
        _BY_BACKEND[backend] = found  # emptied by register_kernel
    return list(found)


def _snapshot() -> dict[tuple[str, str | None], Entry]:
    """A copy of the registry, taken without the lock (one C-level copy under the GIL).

    Every call reads the registry, also where ``torch.compile`` traces it, and Dynamo cannot
    enter a lock: only registering takes it.
    """
    return dict(_REGISTRY)


def choose(ops: Ops, request: Request, implementation: str | None = None, *,
           explain: bool = True) -> tuple[Entry, dict[str, str]]:
    """The kernel for ``request``, and why each kernel tried before it was passed over.

    ``explain=False`` leaves the reasons out (an empty dict): finding them costs a capability
    test of every kernel passed over, which the choice itself skips where one is not preferred.

    Raises:
        ValueError: ``implementation`` names no kernel of this backend, or one that cannot do
            what the call asks (the message says what).
    """
    available = kernels(ops.name)
    if implementation is not None:
        entry = next((e for e in available if e.name == implementation), None)
        if entry is None:
            names = ", ".join(repr(e.name) for e in available)
            raise ValueError(f"implementation={implementation!r}: the {ops.name} backend has "
                             f"no kernel of that name; its kernels are {names}")
        why = entry.capabilities.missing(request)
        if why:
            able = [repr(e.name) for e in available if not e.capabilities.missing(request)]
            raise ValueError(f"implementation={implementation!r} {'; '.join(why)}: this call "
                             f"needs implementation=None or {' or '.join(able)}")
        return entry, {}
    for i, entry in enumerate(available):
        if entry.prefers(ops, request) and not entry.capabilities.missing(request):
            return entry, _reasons(available[:i], request) if explain else {}
    raise ValueError(f"no kernel of the {ops.name} backend can run this call: "
                     + "; ".join(f"{k}: {v}" for k, v in _reasons(available, request).items()))


def _reasons(passed: list[Entry], request: Request) -> dict[str, str]:
    """Why each kernel was passed over: what it cannot do, else that it is not preferred."""
    return {e.name: "; ".join(e.capabilities.missing(request)) or "not preferred for this call"
            for e in passed}


def run(ops: Ops, q: Array, k: Array, v: Array, request: Request,
        implementation: str | None = None) -> Result:
    """Chooses the kernel for ``request`` and runs it, logged at DEBUG level in eager calls.

    A traced call logs nothing: ``torch.compile`` cannot trace a call of the logger.
    """
    explain = not request.traced and LOG.isEnabledFor(logging.DEBUG)
    entry, passed = choose(ops, request, implementation, explain=explain)
    if explain:
        LOG.debug("%s kernel %r for (B, H, Q, K) = %s%s", ops.name, entry.name,
                  request.call.shape, "".join(f"; passed over {n!r}: {w}" for n, w in passed.items()))
    return entry.kernel(ops, q, k, v, request)


def query_spans(request: Request, block: int) -> list[tuple[int, int, int, int]] | None:
    """``(q0, qn, k0, kn)`` per block of ``block`` queries: the keys each block may see.

    From the mask modifiers' spans (:meth:`~attention_core.modifiers.MaskMod.span`); None when
    the sizes are not known now or when the spans leave more than half of the scores, where
    cutting the call into blocks is not worth its overhead. One block of queries (``Q <=
    block``) is one call either way: its span is taken whenever it leaves out a key (a cached
    step's keys not written yet), and often leaves no mask to form. A kernel that forms whole calls
    (a fused one) can then run one call per block on its keys alone: every key a block may see
    is in its span, so the blocks' outputs need no merging.
    """
    from attention_core.modifiers import AllMasks

    call, mask = request.call, AllMasks(request.masks)
    _, _, Q, K = call.shape
    if not (isinstance(Q, int) and isinstance(K, int) and request.masks):
        return None
    spans = []
    for q0 in range(0, Q, block):
        qn = min(block, Q - q0)
        found = mask.span(call, q0, qn)
        if found is None or not isinstance(found[0], int):
            return None
        spans.append((q0, qn, found[0], found[1]))
    kept = sum(qn * kn for _, qn, _, kn in spans)
    if len(spans) == 1:
        return spans if kept < Q * K else None
    return spans if 2 * kept <= Q * K else None


def _register_core() -> None:
    """The kernels every backend has: the direct one last, as it can do everything."""
    from attention_core.kernels import blockwise, direct

    register_kernel("direct", direct.direct, direct.CAPABILITIES, priority=0)
    register_kernel("blockwise", blockwise.blockwise, blockwise.CAPABILITIES, priority=10,
                    prefers=blockwise.prefers)


_register_core()
