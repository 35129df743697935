"""The kernel registry (attention_core.kernels): registering, forcing, the automatic choice, its
log, and the blockwise kernel's skipping of the key blocks a call's masks hide.

References are float64 NumPy computed here (``tests/naive.py``'s dense masks), never the
kernel under test.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import attention_core as ac
from attention_core import kernels
from attention_core.kernels import Capabilities, Request, Result, blockwise, direct
from attention_core.modifiers import Call, Causal, MaskMod, Softcap, Tile
from backends.numpy.ops import OPS as NP
from tests import naive
from tests.harness import TOLERANCE, Harness, max_diff

TOL = TOLERANCE["float32"]


@pytest.fixture(autouse=True)
def registry(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Kernels registered by a test stay in that test (the backend's own, registered when it
    loads, are registered before)."""
    if "backend" in request.fixturenames:
        request.getfixturevalue("backend")
    monkeypatch.setattr(kernels, "_REGISTRY", dict(kernels._REGISTRY))
    monkeypatch.setattr(kernels, "_BY_BACKEND", {})  # the answers of kernels(), kept per registry
    yield


def names(ops: Any) -> list[str]:
    """The backend's kernel names, in the order the automatic choice tries them."""
    return [entry.name for entry in kernels.kernels(ops.name)]


def draw(seed: int = 0, shape: tuple[int, int, int, int] = (2, 2, 3, 5)
         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float32 queries ``(B, H, Q, 4)``, keys and values ``(B, H, K, 4)``."""
    B, H, Q, K = shape
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((B, H, n, 4)).astype(np.float32) for n in (Q, K, K))
    return q, k, v


def reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, visible: np.ndarray | None = None
              ) -> np.ndarray:
    """float64 softmax attention over the visible keys (rows seeing nothing: zeros)."""
    s = q.astype(np.float64) @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    visible = np.ones(s.shape, bool) if visible is None else np.broadcast_to(visible, s.shape)
    s = np.where(visible, s, -np.inf)
    top = np.where(visible.any(-1, keepdims=True), s.max(-1, keepdims=True), 0.0)
    e = np.exp(s - top)
    total = e.sum(-1, keepdims=True)
    return (e / np.where(total > 0, total, 1.0)) @ v


class Counted:
    """A user kernel: the direct one, counting its calls and keeping their requests."""

    def __init__(self) -> None:
        self.requests: list[Request] = []

    def __call__(self, ops: Any, q: Any, k: Any, v: Any, request: Request) -> Result:
        self.requests.append(request)
        return direct.direct(ops, q, k, v, request)


# -- a user's kernel ---------------------------------------------------------------------------


def test_a_registered_kernel_is_run_by_name(backend: str) -> None:
    """Registered for every backend, ``implementation=`` runs it, in a call and in a layer."""
    h = Harness(backend)
    mine = Counted()
    kernels.register_kernel("mine", mine, Capabilities())
    q, k, v = draw()
    lens = np.array([2, 5])
    out = ac.dot_product_attention(*(h.array(x) for x in (q, k, v)), h.array(lens),
                                   implementation="mine")
    assert len(mine.requests) == 1
    assert [type(m) for m in mine.requests[0].masks] == [ac.modifiers.Lengths]
    visible = np.arange(5)[None, None, None, :] < lens[:, None, None, None]
    assert max_diff(h.numpy(out), reference(q, k, v, visible)) <= TOL
    layer = h.make("MultiHeadAttention", {"num_hiddens": 8, "num_heads": 2,  # weights kept:
                                          "implementation": "mine",  # the direct kernel's
                                          "keep_attention_weights": False})
    x = h.array(np.random.default_rng(1).standard_normal((2, 3, 8)), "float32")
    h.call(layer, x, x, x, h.array(np.array([2, 3])))
    assert len(mine.requests) > 1


def test_a_backends_own_kernel_shadows_the_shared_one(backend: str) -> None:
    """A kernel registered for one backend under a shared name runs there, and only there."""
    h = Harness(backend)
    mine, other = Counted(), Counted()
    kernels.register_kernel("direct", mine, direct.CAPABILITIES, backend=h.ops.name)
    kernels.register_kernel("direct", other, direct.CAPABILITIES, backend="no such backend")
    q, k, v = draw(2)
    out = ac.dot_product_attention(*(h.array(x) for x in (q, k, v)), implementation="direct")
    assert (len(mine.requests), len(other.requests)) == (1, 0)
    assert max_diff(h.numpy(out), reference(q, k, v)) <= TOL


def test_a_kernel_of_another_backend_is_not_found(backend: str) -> None:
    h = Harness(backend)
    kernels.register_kernel("elsewhere", Counted(), Capabilities(), backend="no such backend")
    x = h.array(np.ones((1, 2, 3)), "float32")
    with pytest.raises(ValueError) as err:
        ac.dot_product_attention(x, x, x, implementation="elsewhere")
    assert str(err.value) == (
        f"implementation='elsewhere': the {h.ops.name} backend has no kernel of that name; its "
        f"kernels are {', '.join(repr(n) for n in names(h.ops))}")


def test_the_automatic_choice_takes_a_preferred_kernel_first(backend: str) -> None:
    h = Harness(backend)
    mine = Counted()
    kernels.register_kernel("mine", mine, Capabilities(), priority=100,
                            prefers=lambda ops, request: request.call.shape[2] == 3)
    q, k, v = draw(3)
    ac.dot_product_attention(*(h.array(x) for x in (q, k, v)))
    ac.dot_product_attention(*(h.array(x) for x in (q[:, :, :2], k, v)))  # not preferred
    assert [r.call.shape[2] for r in mine.requests] == [3]


@pytest.mark.parametrize("bad", ["capabilities", "kernel"])
def test_registering_a_bad_kernel_is_refused(bad: str) -> None:
    before = dict(kernels._REGISTRY)
    with pytest.raises(TypeError) as err:
        if bad == "capabilities":
            kernels.register_kernel("mine", Counted(), {"weights": True})  # type: ignore[arg-type]
        else:
            kernels.register_kernel("mine", "direct", Capabilities())  # type: ignore[arg-type]
    expected = {"capabilities": "capabilities must be a Capabilities, got dict",
                "kernel": "kernel must be callable, got str"}
    assert str(err.value) == expected[bad]
    assert before == kernels._REGISTRY


# -- a forced kernel that cannot do the call ---------------------------------------------------

#: Capabilities of a narrow kernel, what a call asks of it, and the words for what it lacks.
REFUSALS: dict[str, tuple[Capabilities, dict[str, Any], str]] = {
    "weights": (Capabilities(), {"return_weights": True}, "never forms the attention weights"),
    "lse": (Capabilities(), {"return_lse": True}, "does not return the log-sum-exp"),
    "sinks": (Capabilities(), {"sinks": np.zeros(1, np.float32)}, "does not take sinks"),
    "dropout": (Capabilities(dropout=False), {"dropout": 0.5}, "does not take dropout"),
    "dtype": (Capabilities(dtypes=frozenset({"float64"})), {}, "does not take float32 inputs"),
    "depth": (Capabilities(value_depth=False), {"values": 5}, "needs values as deep as the keys"),
    "numerics": (Capabilities(), {"check_numerics": True}, "does not check numerics"),
    "mask": (Capabilities(masks=frozenset({Causal})), {"causal": True, "valid_lens": 1},
             "does not take the mask modifiers Lengths"),
    "score": (Capabilities(scores=frozenset()), {"softcap": 5.0},
              "does not take the score modifiers Softcap"),
    "two": (Capabilities(scores=frozenset()), {"softcap": 5.0, "return_weights": True},
            "does not take the score modifiers Softcap; never forms the attention weights"),
}


def _able(ops: Any, capability: str) -> str:
    """The kernels of the backend a call asking for ``capability`` can run on, as the message
    lists them."""
    lacking = {"weights": ("fused", "flex", "blockwise", "narrow"), "lse": ("fused", "narrow"),
               "sinks": ("fused", "narrow"), "numerics": ("fused", "flex", "narrow"),
               "score": ("fused", "narrow"), "two": ("fused", "flex", "blockwise", "narrow")}
    own_lacks = {"jax": {"dropout": ("fused",), "depth": ("fused",)},
                 "torch": {"dropout": ("flex",)}}
    skip = lacking.get(capability, ("narrow",)) + own_lacks.get(ops.name, {}).get(capability, ())
    return " or ".join(repr(n) for n in names(ops) if n not in skip)


@pytest.mark.parametrize("capability", list(REFUSALS))
def test_a_forced_kernel_lacking_a_capability_is_refused(backend: str, capability: str) -> None:
    """The message names what the kernel lacks and the kernels that can do the call, the same
    on every backend but for those lists."""
    h = Harness(backend)
    capabilities, asked, words = REFUSALS[capability]
    narrow = Counted()
    kernels.register_kernel("narrow", narrow, capabilities)
    q, k, v = draw(4, (1, 1, 2, 3))
    kw = dict(asked)
    if "values" in kw:
        v = np.concatenate([v, v[..., :kw.pop("values") - 4]], -1)
    if "valid_lens" in kw:
        kw["valid_lens"] = h.array(np.array([kw["valid_lens"]]))
    if "sinks" in kw:
        kw["sinks"] = h.array(kw["sinks"])
    with pytest.raises(ValueError) as err:
        ac.dot_product_attention(*(h.array(x) for x in (q, k, v)), implementation="narrow", **kw)
    assert str(err.value) == (f"implementation='narrow' {words}: this call needs "
                              f"implementation=None or {_able(h.ops, capability)}")
    assert not narrow.requests


def test_a_fused_kernel_refuses_score_modifiers(backend: str) -> None:
    h = Harness(backend)
    if "fused" not in names(h.ops):
        pytest.skip(f"the {backend} backend has no fused kernel")
    x = h.array(np.ones((1, 2, 3)), "float32")
    with pytest.raises(ValueError) as err:
        ac.dot_product_attention(x, x, x, implementation="fused", softcap=5.0)
    able = " or ".join(repr(n) for n in names(h.ops) if n != "fused")  # torch's 'flex' takes it
    assert str(err.value) == ("implementation='fused' does not take the score modifiers Softcap: "
                              f"this call needs implementation=None or {able}")


def test_a_returned_weights_call_forcing_blockwise_is_refused(backend: str) -> None:
    h = Harness(backend)
    x = h.array(np.ones((1, 2, 3)), "float32")
    with pytest.raises(ValueError) as err:
        ac.dot_product_attention(x, x, x, implementation="blockwise", return_weights=True)
    assert str(err.value) == ("implementation='blockwise' never forms the attention weights: "
                              "this call needs implementation=None or 'direct'")


#: What torch's FlexAttention kernel is refused for, and the words of the refusal.
FLEX_REFUSALS = {
    "weights": ({"return_weights": True}, "never forms the attention weights",
                "'direct'"),
    "score_bias": ({"score_bias": np.zeros((2, 2), np.float32)},
                   "does not take the score modifiers ScoreBias", "'blockwise' or 'direct'"),
    "dropout": ({"dropout": 0.5}, "does not take dropout", "'fused' or 'blockwise' or 'direct'"),
}


@pytest.mark.parametrize("asked", list(FLEX_REFUSALS))
def test_flex_forced_with_what_it_cannot_do_is_refused(backend: str, asked: str) -> None:
    if "flex" not in names(Harness(backend).ops):
        pytest.skip(f"the {backend} backend has no FlexAttention kernel")
    kw, words, able = FLEX_REFUSALS[asked]
    x = torch_tensor(np.ones((1, 2, 3), np.float32))
    with pytest.raises(ValueError) as err:
        ac.dot_product_attention(x, x, x, implementation="flex",
                                 **{n: torch_tensor(a) if isinstance(a, np.ndarray) else a
                                    for n, a in kw.items()})
    assert str(err.value) == (f"implementation='flex' {words}: this call needs "
                              f"implementation=None or {able}")


def test_flex_refuses_gradients_on_cpu(backend: str) -> None:
    """torch's FlexAttention has no CPU backward: a forced call recording gradients is
    refused by the library, naming the way out; without gradients it runs."""
    if "flex" not in names(Harness(backend).ops):
        pytest.skip(f"the {backend} backend has no FlexAttention kernel")
    import torch

    x = torch_tensor(np.ones((1, 2, 3), np.float32)).requires_grad_(True)
    with pytest.raises(ValueError) as err:
        ac.dot_product_attention(x, x, x, implementation="flex")
    assert str(err.value) == (
        "implementation='flex' computes no gradients on CPU (torch's FlexAttention has no CPU "
        "backward): this call needs implementation=None or another kernel, or torch.no_grad()")
    with torch.no_grad():
        out = ac.dot_product_attention(x, x, x, implementation="flex")
    assert max_diff(out.numpy(), np.ones((1, 2, 3))) <= TOL


def test_flex_is_taken_by_name_only_on_cpu(backend: str, caplog: pytest.LogCaptureFixture) -> None:
    """Eager FlexAttention on CPU is slower than SDPA and the core's kernels: a user's
    ``mask_mod`` and ``score_mod`` pass it over, and by name it gives the float64 answer."""
    if "flex" not in names(Harness(backend).ops):
        pytest.skip(f"the {backend} backend has no FlexAttention kernel")
    q, k, v = draw(7, (1, 2, 3, 5))
    arrays = [torch_tensor(x) for x in (q, k, v)]
    mods = {"mask_mod": lambda b, h, i, j: j <= i + 2, "score_mod": lambda s, b, h, i, j: s}
    logged = _logged(caplog, lambda: ac.dot_product_attention(*arrays, **mods))
    assert "; passed over 'flex': not preferred for this call" in logged[0]
    out = ac.dot_product_attention(*arrays, **mods, implementation="flex")
    visible = np.arange(5)[None, :] <= np.arange(3)[:, None] + 2
    assert max_diff(out.numpy(), reference(q, k, v, visible)) <= TOL


def test_flex_compiles_in_one_graph(backend: str) -> None:
    """A user's ``score_mod`` and causal masking on FlexAttention under ``torch.compile``
    (fullgraph; AOT eager: Inductor's CPU FlexAttention costs about 20 s to build)."""
    if "flex" not in names(Harness(backend).ops):
        pytest.skip(f"the {backend} backend has no FlexAttention kernel")
    import torch

    q, k, v = draw(8, (1, 2, 4, 4))
    score_mod = lambda s, b, h, i, j: s + (i - j).to(s.dtype) * 0.125  # noqa: E731

    def attend(q: Any, k: Any, v: Any) -> Any:
        return ac.dot_product_attention(q, k, v, causal=True, score_mod=score_mod,
                                        implementation="flex", return_lse=True)

    out, lse = torch.compile(attend, fullgraph=True, backend="aot_eager")(
        *(torch_tensor(x) for x in (q, k, v)))
    s = q.astype(np.float64) @ np.swapaxes(k, -1, -2) / 2.0
    s = np.where(np.tril(np.ones((4, 4), bool)), s + (np.arange(4)[:, None] - np.arange(4)) / 8,
                 -np.inf)
    assert max_diff(out.numpy(), np.exp(s - s.max(-1, keepdims=True)) / np.exp(
        s - s.max(-1, keepdims=True)).sum(-1, keepdims=True) @ v) <= TOL
    assert max_diff(lse.numpy(), np.log(np.exp(s).sum(-1))) <= TOL


def torch_tensor(x: np.ndarray) -> Any:
    """A torch tensor of ``x`` (the flex tests run on the torch backend only)."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(x))


# -- the automatic choice ----------------------------------------------------------------------


class Plain:
    """Ops of a backend that registered no kernel of its own."""

    name = "plain"


def request(shape: tuple[Any, ...], ops: Any = None, **kw: Any) -> Request:
    return Request(Call(ops or Plain(), shape), **kw)


def test_the_rule() -> None:
    """Direct, until the scores are many (blockwise); what a call asks passes kernels over."""
    plain: Any = Plain()
    small, large = (1, 1, 4, 4), (1, 8, 1024, 1024)
    assert blockwise.MIN_SCORES <= 8 * 1024 * 1024

    def chosen(shape: tuple[Any, ...], implementation: str | None = None, ops: Any = plain,
               **kw: Any) -> tuple[str, dict[str, str]]:
        entry, passed = kernels.choose(ops, request(shape, ops, **kw), implementation)
        return entry.name, passed

    assert chosen(small) == ("direct", {"blockwise": "not preferred for this call"})
    assert chosen(large) == ("blockwise", {})
    assert chosen(large, weights=True) == (
        "direct", {"blockwise": "never forms the attention weights"})
    assert chosen((None, 8, 1024, 1024))[0] == "direct"  # a run-time batch: not known large
    assert chosen(small, "blockwise") == ("blockwise", {})
    assert chosen(small, ops=NP) == ("blockwise", {})  # NumPy: always
    assert chosen(small, ops=NP, weights=True)[0] == "direct"
    kernels.register_kernel("fused", Counted(), Capabilities(scores=frozenset()),
                            backend="plain", priority=20)
    assert chosen(small)[0] == "fused"
    assert chosen(small, scores=(Softcap(5.0),)) == (
        "direct", {"fused": "does not take the score modifiers Softcap",
                   "blockwise": "not preferred for this call"})


def test_no_kernel_for_the_call() -> None:
    """With the direct kernel gone (a backend's own registration may shadow it), a call no
    kernel can do is refused, with every kernel's reason."""
    kernels.register_kernel("direct", Counted(), Capabilities(), backend="plain")
    with pytest.raises(ValueError) as err:
        kernels.choose(Plain(), request((1, 1, 4, 4), weights=True))  # type: ignore[arg-type]
    assert str(err.value) == ("no kernel of the plain backend can run this call: blockwise: "
                              "never forms the attention weights; direct: never forms the "
                              "attention weights")


def _logged(caplog: pytest.LogCaptureFixture, run: Any) -> list[str]:
    with caplog.at_level(logging.DEBUG, logger="attention_core.kernels"):
        run()
    return [r.getMessage() for r in caplog.records if r.name == "attention_core.kernels"]


def test_the_log_names_the_kernel_and_the_ones_passed_over(
    backend: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """Asked for the weights, every backend pools directly; the DEBUG log says so, and why each
    kernel tried before it was passed over."""
    h = Harness(backend)
    q, k, v = draw(5, (1, 1, 2, 3))
    arrays = [h.array(x) for x in (q, k, v)]
    got: list[Any] = []
    logged = _logged(caplog, lambda: got.extend(ac.dot_product_attention(*arrays,
                                                                         return_weights=True)))
    tried = names(h.ops)[:names(h.ops).index("direct")]
    assert logged == [f"{h.ops.name} kernel 'direct' for (B, H, Q, K) = (1, 1, 2, 3)" + "".join(
        f"; passed over {n!r}: never forms the attention weights" for n in tried)]
    assert max_diff(h.numpy(got[0]), reference(q, k, v)) <= TOL


def test_the_automatic_choice_passes_a_fused_kernel_over_for_a_softcap(
    backend: str, caplog: pytest.LogCaptureFixture,
) -> None:
    h = Harness(backend)
    q, k, v = draw(6, (1, 2, 3, 3))
    out: list[Any] = []
    logged = _logged(caplog, lambda: out.append(ac.dot_product_attention(
        *(h.array(x) for x in (q, k, v)), softcap=0.5)))
    assert len(logged) == 1 and "kernel 'fused'" not in logged[0]
    if "fused" in names(h.ops):
        assert "; passed over 'fused': does not take the score modifiers Softcap" in logged[0]
    s = q.astype(np.float64) @ np.swapaxes(k, -1, -2) / 2.0
    w = np.exp(0.5 * np.tanh(s / 0.5))
    assert max_diff(h.numpy(out[0]), w / w.sum(-1, keepdims=True) @ v) <= TOL


def test_nothing_is_logged_above_debug(backend: str, caplog: pytest.LogCaptureFixture) -> None:
    h = Harness(backend)
    x = h.array(np.ones((1, 2, 3)), "float32")
    with caplog.at_level(logging.INFO, logger="attention_core.kernels"):
        ac.dot_product_attention(x, x, x)
    assert not [r for r in caplog.records if r.name == "attention_core.kernels"]


# -- the blockwise kernel visits only the key blocks the masks leave ---------------------------


class Visits(MaskMod):
    """A mask modifier hiding nothing, recording each tile of keys the kernel visits."""

    def __init__(self) -> None:
        self.tiles: list[tuple[int, int, int, int]] = []

    def visible(self, tile: Tile) -> None:
        self.tiles.append((tile.q0, tile.qn, tile.k0, tile.kn))
        return None


B, H, N, BLOCK = 2, 2, 16, 4
#: Per example, sorted segment ids of the 16 positions (packed documents).
SEGMENTS = np.array([[0] * 6 + [1] * 5 + [2] * 5, [0] * 3 + [1] * 9 + [2] * 4])
LENGTHS = np.array([5, 11])
#: Call arguments (host lengths and ids: their values are known now on every backend).
MASKINGS: dict[str, dict[str, Any]] = {
    "none": {},
    "causal": {"causal": True},
    "window": {"window": 3},
    "causal_window": {"causal": True, "window": 3},
    "lengths": {"valid_lens": LENGTHS},
    "segments": {"segment_ids": SEGMENTS},
    "causal_segments": {"causal": True, "segment_ids": SEGMENTS},
}


def dense(kw: dict[str, Any]) -> np.ndarray:
    """The masking's visible keys ``(B, 1, N, N)``, from the positions alone (Q = K)."""
    visible = naive.visible(B, 1, N, N, kw.get("valid_lens"), None, kw.get("causal", False),
                            window=kw.get("window"))
    if "segment_ids" in kw:
        ids = kw["segment_ids"]
        visible = visible & (ids[:, None, :, None] == ids[:, None, None, :])
    return visible


@pytest.mark.parametrize("kind", list(MASKINGS))
def test_blockwise_visits_only_the_key_blocks_the_masks_leave(
    backend: str, kind: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Blocks of 4 queries and 4 keys: each query block visits exactly the keys from the first
    to the last any of its queries sees (in the backend's Python loop: its compiled loops are
    set aside, which record a tile once per trace), and gives the reference's output."""
    h = Harness(backend)
    for loop in ("fold", "map_concat", "recompute_blocks"):
        monkeypatch.delattr(type(h.ops), loop, raising=False)
    monkeypatch.setattr(blockwise, "KEY_BLOCK", BLOCK)
    monkeypatch.setattr(blockwise, "MIN_QUERY_BLOCK", 1)
    monkeypatch.setattr(blockwise, "TILE_SCORES", B * H * BLOCK * BLOCK)
    q, k, v = draw(7, (B, H, N, N))
    visits = Visits()
    kw = MASKINGS[kind]
    out = ac.dot_product_attention(*(h.array(x) for x in (q, k, v)), implementation="blockwise",
                                   mask_mod=visits, **kw)
    visible = dense(kw)
    assert max_diff(h.numpy(out), reference(q, k, v, visible)) <= TOL
    seen: dict[int, list[tuple[int, int]]] = {}
    for q0, qn, k0, kn in visits.tiles:
        assert qn == BLOCK and 0 < kn <= BLOCK
        seen.setdefault(q0, []).append((k0, kn))
    for q0, tiles in seen.items():
        assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(tiles)), tiles  # contiguous
        keys = np.flatnonzero(visible[:, :, q0:q0 + BLOCK].any((0, 1, 2)))
        assert (tiles[0][0], tiles[-1][0] + tiles[-1][1]) == (keys[0], keys[-1] + 1), q0
    assert sorted(seen) == list(range(0, N, BLOCK))
    if kind != "none":
        assert sum(kn for *_, kn in visits.tiles) < N * N // BLOCK  # some blocks were skipped
