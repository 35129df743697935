"""Every modifier of tests/test_modifiers.py differentiated and compiled, against float64.

Gradients: each modifier alone, as its keyword and as its object, on every path the backend
has, differentiated by the backend's autodiff: the gradients of ``sum(out * W)`` by the
queries, keys and values (and by ``sinks`` and ``score_bias``, the modifiers' floating
arrays) must agree with central differences of the float64 reference
(tests/reference/attention64.py) along random directions and at sampled entries. Keys no
query sees, and queries that see nothing, get a gradient of exactly zero, never NaN.

Compiled modes: each modifier alone and with the ``fully_masked_row`` mask kind (lengths per
query, a mask, rows that see nothing), every path in one program, the modifiers' arrays as
the program's arguments: ``jax.jit``, ``tf.function`` (a subset also with
``jit_compile=True``) and, for a subset (:data:`TORCH_COMPILED`, seconds per graph),
``torch.compile``; their outputs and log-sum-exps equal the float64 reference's. A few
modifiers are also differentiated inside ``jax.jit`` and ``tf.function`` and through
``torch.compile``. MXNet's
``hybridize()`` compiles layers, not functions: its layers are in tests/test_compiled.py.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np
import pytest

import attention_core as ac
from attention_core.kernels import blockwise
from tests.harness import AUTODIFF, TOLERANCE, Harness, max_diff
from tests.reference.attention64 import attention64
from tests.reference.cases import mask_arguments
from tests.test_modifiers import (
    DV,
    HKV,
    MASK,
    MODIFIERS,
    SINKS,
    SLOW_EAGER,
    B,
    D,
    H,
    K,
    Modifier,
    Q,
    implementations,
    lse_diff,
    reference,
    refused,
    user_score,
)

modifiers: Any = pytest.importorskip("attention_core.modifiers")

TOL = TOLERANCE["float32"]

#: Rows that see nothing: example 0 sees no key; example 1, query 2 sees none (alone, and
#: with a sink, which then takes the whole row, and with a score modifier).
EMPTY_LENS = np.array([0, 4])
EMPTY_MASK = MASK.copy()
EMPTY_MASK[1, 2] = False
EDGES: dict[str, Modifier] = {
    "empty_lens": Modifier(lambda h: {"valid_lens": h.array(EMPTY_LENS)},
                           lambda h: {"mask_mod": modifiers.lengths(h.array(EMPTY_LENS))},
                           {"valid_lens": EMPTY_LENS}),
    "empty_mask_row": Modifier(lambda h: {"mask": h.array(EMPTY_MASK)},
                               lambda h: {"mask_mod": modifiers.boolean(h.array(EMPTY_MASK))},
                               {"mask": EMPTY_MASK}),
    "empty_lens_sinks": Modifier(lambda h: {"valid_lens": h.array(EMPTY_LENS),
                                            "sinks": h.array(SINKS)}, None,
                                 {"valid_lens": EMPTY_LENS, "sinks": SINKS}),
    "empty_lens_score_mod": Modifier(lambda h: {"valid_lens": h.array(EMPTY_LENS),
                                                "score_mod": user_score}, None,
                                     {"valid_lens": EMPTY_LENS,
                                      "score_fn": lambda s, b, h, i, j: s - 0.25 * s * s}),
}
ALL = {**MODIFIERS, **EDGES}

#: The reference's floating keywords a modifier may take from its arrays: differentiated too.
FLOATING = ("sinks", "score_bias")

#: The mask kind each modifier is also compiled with.
COMPILED_KIND = "fully_masked_row"


@pytest.fixture(autouse=True)
def small_blocks(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Blockwise calls (and recomputed backward passes) in blocks of 4 keys and 2 queries;
    all the queries in one block on :data:`SLOW_EAGER`, as tests/test_modifiers.py has it."""
    tile = 10**6 if backend in SLOW_EAGER else 1
    for name, value in (("KEY_BLOCK", 4), ("TILE_SCORES", tile), ("MIN_QUERY_BLOCK", 2),
                        ("RECOMPUTE_SCORES", tile)):
        monkeypatch.setattr(blockwise, name, value)


# --- the call, its arrays as arguments ---


class Arrays:
    """Stands for the harness in a modifier's keywords: records the NumPy arrays asked for, or
    hands out ``given`` (backend arrays, traced ones included) in the order they are asked."""

    def __init__(self, h: Harness, given: Sequence[Any] | None = None) -> None:
        self.ops = h.ops
        self.asked: list[np.ndarray] = []
        self._h, self._given = h, given

    def array(self, x: Any, dtype: str | None = None) -> Any:
        self.asked.append(x)
        return self._h.array(x, dtype) if self._given is None else self._given[len(self.asked) - 1]

    def harness(self) -> Harness:
        """Itself, as the harness the modifiers' keywords are built from."""
        return cast(Harness, self)


def inputs() -> list[np.ndarray]:
    """The queries, keys and values: float32 (the reference reads them as float64)."""
    rng = np.random.default_rng(60)
    return [rng.standard_normal(s).astype(np.float32)
            for s in ((B, H, Q, D), (B, HKV, K, D), (B, HKV, K, DV))]


class Cell:
    """One modifier in one form with one mask kind: its NumPy arrays (q, k, v, the modifier's
    arrays, the kind's) and the attention as a function of their backend arrays."""

    def __init__(self, h: Harness, name: str, form: str, kind: str = "none") -> None:
        self.h, self.m = h, ALL[name]
        make = self.m.keyword if form == "keyword" else self.m.modifier
        assert make is not None
        self.make = make
        qkv = inputs()
        self.kind_args = mask_arguments(kind, np.random.default_rng(62), H, Q, K, B)
        recorder = Arrays(h)
        make(recorder.harness())
        self.own = len(recorder.asked)
        kind_arrays = {n: x for n, x in self.kind_args.items() if not isinstance(x, bool)}
        self.kind_names = list(kind_arrays)
        self.numpy = [*qkv, *recorder.asked, *kind_arrays.values()]
        self.ref = reference(self.m, self.kind_args)
        floating = {id(x): n for n, x in self.ref.items() if n in FLOATING}
        #: Names of the differentiated arrays, by their index in :attr:`numpy`.
        self.wrt = {0: "q", 1: "k", 2: "v"}
        self.wrt.update({3 + i: floating[id(x)] for i, x in enumerate(recorder.asked)
                         if id(x) in floating})

    def arrays(self) -> list[Any]:
        return [self.h.array(x) for x in self.numpy]

    def kwargs(self, arrays: Sequence[Any]) -> dict[str, Any]:
        """The call's keywords built from its arrays (backend or traced)."""
        own = arrays[3:3 + self.own]
        kind = dict(zip(self.kind_names, arrays[3 + self.own:], strict=True))
        fixed = {n: x for n, x in self.kind_args.items() if isinstance(x, bool)}
        return {**fixed, **kind, **self.make(Arrays(self.h, own).harness())}

    def function(self, implementation: str | None, lse: bool = False) -> Callable[..., Any]:
        """``f(*arrays) -> out`` (``(out, lse)`` if ``lse``) on one path."""
        def attend(*arrays: Any) -> Any:
            return ac.dot_product_attention(*arrays[:3], **self.kwargs(arrays), return_lse=lse,
                                            implementation=implementation, ops=self.h.ops)
        return attend

    def expected(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return attention64(*self.numpy[:3], **self.ref)

    def paths(self, lse: bool = False, gradients: bool = False) -> dict[str, bool]:
        """The backend's paths, each with whether it returns the log-sum-exp here (if
        ``lse``): a fused kernel that refuses it runs without it, one that refuses the cell
        not at all (tried eagerly). With ``gradients``, not torch's FlexAttention, which
        computes none on CPU (its refusal is tested in tests/test_kernels.py)."""
        skipped = (None, "fused", "flex") if gradients else (None, "fused")
        paths = {p: lse for p in implementations(self.h) if p not in skipped}
        if "fused" in implementations(self.h):
            takes = [ask for ask in dict.fromkeys((lse, False)) if self.takes("fused", ask)]
            paths.update({"fused": takes[0]} if takes else {})
        return paths

    def takes(self, path: str, lse: bool) -> bool:
        """Whether the path runs the cell (a fused kernel may refuse it)."""
        try:
            self.function(path, lse)(*self.arrays())
        except ValueError as err:
            if not refused(path, err):
                raise
            return False
        return True


# --- gradients by the backend's autodiff ---


def _torch(fn: Callable[..., Any], arrays: list[Any], wrt: list[int],
           cotangent: np.ndarray) -> tuple[Any, list[Any]]:
    import torch

    xs = [x.detach().clone().requires_grad_(True) if i in wrt else x for i, x in enumerate(arrays)]
    out = fn(*xs)
    loss = (out * torch.as_tensor(cotangent, dtype=out.dtype)).sum()
    grads = torch.autograd.grad(loss, [xs[i] for i in wrt], allow_unused=True)
    return out.detach(), [torch.zeros_like(xs[i]) if g is None else g
                          for i, g in zip(wrt, grads, strict=True)]


def _tensorflow(fn: Callable[..., Any], arrays: list[Any], wrt: list[int],
                cotangent: np.ndarray) -> tuple[Any, list[Any]]:
    import tensorflow as tf

    with tf.GradientTape() as tape:
        tape.watch([arrays[i] for i in wrt])
        out = fn(*arrays)
        loss = tf.reduce_sum(out * tf.cast(cotangent, out.dtype))
    grads = tape.gradient(loss, [arrays[i] for i in wrt],
                          unconnected_gradients=tf.UnconnectedGradients.ZERO)
    return out, grads


def _jax(fn: Callable[..., Any], arrays: list[Any], wrt: list[int],
         cotangent: np.ndarray) -> tuple[Any, list[Any]]:
    import jax
    import jax.numpy as jnp

    def loss(moving: list[Any]) -> tuple[Any, Any]:
        xs = list(arrays)
        for i, x in zip(wrt, moving, strict=True):
            xs[i] = x
        out = fn(*xs)
        return jnp.sum(out * jnp.asarray(cotangent, out.dtype)), out

    (_, out), grads = jax.value_and_grad(loss, has_aux=True)([arrays[i] for i in wrt])
    return out, grads


def _mxnet(fn: Callable[..., Any], arrays: list[Any], wrt: list[int],
           cotangent: np.ndarray) -> tuple[Any, list[Any]]:
    import mxnet as mx

    xs = [x.copy() for x in arrays]
    for i in wrt:
        xs[i].attach_grad()
    with mx.autograd.record(train_mode=False):
        out = fn(*xs)
        loss = (out * mx.np.array(cotangent, dtype=out.dtype)).sum()
    loss.backward()
    return out, [xs[i].grad for i in wrt]


#: ``(fn, arrays, wrt, cotangent) -> (out, gradients by wrt)``: ``fn(*arrays)`` and the
#: gradients of ``sum(out * cotangent)`` by the arrays at the indices ``wrt``.
GRADIENTS: dict[str, Callable[..., tuple[Any, list[Any]]]] = {
    "torch": _torch, "tensorflow": _tensorflow, "jax": _jax, "mxnet": _mxnet}


def autodiff(h: Harness) -> Callable[..., tuple[Any, list[Any]]]:
    if h.name not in AUTODIFF:
        pytest.skip(f"{h.name} has no autodiff")
    return GRADIENTS[h.name]


# --- the reference: central differences of the float64 reference ---

STEP = 1e-6
#: Random unit directions (over every differentiated array at once) and sampled entries per
#: array.
DIRECTIONS, ENTRIES = 3, 2


def cotangent() -> np.ndarray:
    return np.random.default_rng(61).standard_normal((B, H, Q, DV)).astype(np.float32)


@functools.cache
def derivatives(name: str) -> tuple[tuple[dict[str, np.ndarray], float], ...]:
    """Directions over the modifier's differentiated arrays (``q``, ``k``, ``v`` and those of
    :data:`FLOATING` it takes), each with the float64 reference's derivative of
    ``sum(out * W)`` along it by central differences."""
    m = ALL[name]
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    base = {n: x.astype(np.float64) for n, x in zip("qkv", inputs(), strict=True)}
    ref = reference(m, {})
    base.update({n: np.asarray(ref[n], np.float64) for n in FLOATING if n in ref})
    W = cotangent().astype(np.float64)

    def loss(x: dict[str, np.ndarray]) -> float:
        extra = {n: x[n] for n in FLOATING if n in x}
        return float(np.sum(attention64(x["q"], x["k"], x["v"], **{**ref, **extra})[0] * W))

    directions = []
    for _ in range(DIRECTIONS):
        u = {n: rng.standard_normal(x.shape) for n, x in base.items()}
        norm = np.sqrt(sum(float(np.sum(a * a)) for a in u.values()))
        directions.append({n: a / norm for n, a in u.items()})
    for n, x in base.items():
        for j in rng.choice(x.size, size=min(ENTRIES, x.size), replace=False):
            e = {p: np.zeros_like(a) for p, a in base.items()}
            e[n].flat[j] = 1.0
            directions.append(e)
    return tuple((u, (loss({n: base[n] + STEP * u[n] for n in base})
                      - loss({n: base[n] - STEP * u[n] for n in base})) / (2 * STEP))
                 for u in directions)


#: Bound on ``|<grad, u> - fd| / max(1, |fd|)`` for float32 gradients: the float32 tolerance
#: (measured worst 2.7e-7 on every backend and path; central differences themselves agree with
#: exact float64 gradients to about 3e-9, tests/test_gradients.py).
GRAD_TOL = TOL


def check_gradients(cell: Cell, name: str, grads: dict[str, np.ndarray], label: str) -> float:
    """Finite gradients agreeing with :func:`derivatives`, exactly zero for the queries that
    see nothing and the keys and values no query sees; returns the worst relative error."""
    for n, g in grads.items():
        assert np.isfinite(g).all(), f"{label}: non-finite gradient of {n}"
    _, weights, _ = cell.expected()
    seen = weights > 0
    np.testing.assert_array_equal(grads["q"][~seen.any(-1)], 0.0, err_msg=label)
    keys_seen = seen.reshape(B, HKV, H // HKV, Q, K).any(axis=(2, 3))
    for n in "kv":
        np.testing.assert_array_equal(grads[n][~keys_seen], 0.0, err_msg=f"{label}: {n}")
    worst = 0.0
    for u, fd in derivatives(name):
        exact = sum(float(np.sum(grads[n] * u[n])) for n in u)
        error = abs(exact - fd) / max(1.0, abs(fd))
        assert error <= GRAD_TOL, f"{label}: <grad, u> = {exact:.9g}, differences {fd:.9g}"
        worst = max(worst, error)
    return worst


def gradient_cells() -> list[Any]:
    return [pytest.param(name, form, id=f"{name}-{form}") for name, m in ALL.items()
            for form in ("keyword", "modifier") if getattr(m, form) is not None]


@pytest.mark.parametrize(("name", "form"), gradient_cells())
def test_gradients_match_finite_differences(backend: str, name: str, form: str) -> None:
    h = Harness(backend)
    differentiate = autodiff(h)
    cell = Cell(h, name, form)
    expected = cell.expected()[0]
    wrt, ct, paths = list(cell.wrt), cotangent(), cell.paths(gradients=True)
    for path in paths:
        out, grads = differentiate(cell.function(path), cell.arrays(), wrt, ct)
        assert max_diff(h.numpy(out), expected) <= TOL, path
        got = {cell.wrt[i]: h.numpy(g) for i, g in zip(wrt, grads, strict=True)}
        assert set(got) == set(derivatives(name)[0][0]), path
        check_gradients(cell, name, got, f"{name}-{form} on {path}")


# --- compiled modes ---

#: The modifiers ``torch.compile`` runs, with ``backend="aot_eager"`` (Dynamo's whole graph
#: and AOTAutograd's, in about 2 s): a mask array, a user mask, a score modifier using the
#: ops, a score list and sinks; and with Inductor (15 to 20 s per graph): :data:`INDUCTOR`.
TORCH_COMPILED = ("valid_lens", "mask_mod", "score_mod_relative", "score_list", "sinks")
INDUCTOR = ("score_mod_relative",)
#: The modifiers ``tf.function(jit_compile=True)`` runs (``tf.function`` runs them all).
XLA_COMPILED = ("valid_lens", "mask_list", "score_mod", "sinks")


def compilers(h: Harness, name: str, kind: str) -> dict[str, Callable[[Any], Any]]:
    """The backend's compilers of a plain function that run this cell, by name."""
    if h.name == "jax":
        import jax

        return {"jax.jit": jax.jit}
    if h.name == "tensorflow":
        import tensorflow as tf

        modes = {"tf.function": tf.function}
        if name in XLA_COMPILED and kind == "none":
            modes["xla"] = functools.partial(tf.function, jit_compile=True)
        return modes
    if h.name == "torch" and kind == "none":
        backends = {"aot_eager": name in TORCH_COMPILED, "inductor": name in INDUCTOR}
        return {f"torch.compile({b})": functools.partial(torch_compiled, backend=b)
                for b, wanted in backends.items() if wanted}
    return {}


def torch_compiled(fn: Callable[..., Any], backend: str) -> Any:
    """``torch.compile(fn, fullgraph=True)``, Dynamo's caches reset first."""
    import torch

    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend=backend)


def compiled_cells() -> list[Any]:
    """Each modifier alone as its keyword (its object where it has none), and with
    :data:`COMPILED_KIND` as its object (its keyword where it has none), the object built
    inside the program."""
    alone = [pytest.param(name, "modifier" if m.keyword is None else "keyword", "none",
                          id=f"{name}-alone") for name, m in MODIFIERS.items()]
    return alone + [pytest.param(name, "keyword" if m.modifier is None else "modifier",
                                 COMPILED_KIND,
                                 id=f"{name}-{COMPILED_KIND}")
                    for name, m in MODIFIERS.items() if name != "none"]


@pytest.mark.parametrize(("name", "form", "kind"), compiled_cells())
def test_compiled_modifier_matches_reference(backend: str, name: str, form: str,
                                             kind: str) -> None:
    """Every path in one compiled program, the arrays as its arguments."""
    h = Harness(backend)
    modes = compilers(h, name, kind)
    if not modes:
        pytest.skip(f"no compiled mode of {h.name} runs this cell")
    cell = Cell(h, name, form, kind)
    paths = cell.paths(lse=True)
    if "flex" in paths:  # torch's Inductor gives FlexAttention no log-sum-exp on CPU
        paths["flex"] = False
    expected, _, expected_lse = cell.expected()

    def attend(*arrays: Any) -> dict[str, Any]:
        return {p: cell.function(p, lse)(*arrays) for p, lse in paths.items()}

    for mode, compile_function in modes.items():
        got = compile_function(attend)(*cell.arrays())
        assert set(got) == set(paths)
        for path, lse in paths.items():
            out = got[path][0] if lse else got[path]
            assert max_diff(h.numpy(out), expected) <= TOL, (mode, path)
            if lse:
                assert lse_diff(h.numpy(got[path][1]), expected_lse) <= TOL, (mode, path)


#: Modifiers differentiated inside ``jax.jit`` and ``tf.function`` and through
#: ``torch.compile(backend="aot_eager")``.
COMPILED_GRADIENTS = ("valid_lens", "score_bias", "score_mod_relative", "empty_lens_sinks")


@pytest.mark.parametrize("name", COMPILED_GRADIENTS)
def test_compiled_gradients_match_finite_differences(backend: str, name: str) -> None:
    """Every path's gradients from one compiled program (torch: one compiled forward of every
    path, differentiated path by path through its compiled graph)."""
    h = Harness(backend)
    if h.name not in ("jax", "tensorflow", "torch"):
        pytest.skip(f"{h.name}: gradients in a compiled mode run on JAX, TensorFlow and torch")
    cell = Cell(h, name, "keyword")
    paths, wrt = list(cell.paths(gradients=True)), list(cell.wrt)
    differentiate = GRADIENTS[h.name]
    arrays, ct = cell.arrays(), cotangent()
    if h.name == "torch":
        forward = torch_compiled(lambda *xs: {p: cell.function(p)(*xs) for p in paths},
                                 "aot_eager")
        results = {p: differentiate(lambda *xs, p=p: forward(*xs)[p], arrays, wrt, ct)[1]
                   for p in paths}
    else:
        compile_function = compilers(h, name, "none")[
            "jax.jit" if h.name == "jax" else "tf.function"]
        results = compile_function(lambda *xs: {
            p: differentiate(cell.function(p), list(xs), wrt, ct)[1] for p in paths})(*arrays)
    for path, grads in results.items():
        got = {cell.wrt[i]: h.numpy(g) for i, g in zip(wrt, grads, strict=True)}
        check_gradients(cell, name, got, f"{name} compiled, on {path}")
