"""The fused path, tested once over the backends that register a ``"fused"`` kernel
(:mod:`attention_core.kernels`: torch's ``scaled_dot_product_attention``,
``jax.nn.dot_product_attention``); the others refuse the path (tests/test_adapters.py) and skip
these tests.

Two hooks of tests/hooks/<backend>_hooks.py tell the kernel's calls apart:
``count_fused_calls(monkeypatch)`` counts them (returning a function giving the count), and
``fused_kernel_takes(depth, value_depth, dtype)`` says which calls the kernel takes (JAX's needs
equal query and value depths; a call forcing it on the others is refused).
Expected values come from the float64 reference files and reference gradients.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import attention_core as ac
from attention_core import kernels
from attention_core.kernels import Request
from attention_core.modifiers import BooleanMask, Call
from tests.harness import DTYPES, FASTEST_GRADIENT_MODE, TOLERANCE, Harness, max_diff
from tests.matrix import weight_array
from tests.reference.cases import CASES, Case, has_score_terms
from tests.reference.generate import record
from tests.reference.gradients import gradient_cases, key, stored_gradients

FUSABLE = ("DotProductAttention", "MultiHeadAttention", "TransformerEncoderBlock")
TOL = TOLERANCE["float32"]
#: A layer on the fused path: the automatic choice may prefer another (JAX on CPU does).
FUSED = {"keep_attention_weights": False, "implementation": "fused"}
#: Backends on which every new shape compiles for seconds (JAX's eager mode compiles each
#: primitive): there the tests below take the cases of :data:`FEW_CASE_NAMES`, and of those the
#: calls the kernel takes (the others are refused; the reference matrix covers them on the
#: other kernels).
FEW_CASES = ("jax",)
#: The cases of :data:`FEW_CASES`, by layer: three to nine mask kinds and options each.
FEW_CASE_NAMES = {
    "DotProductAttention": ("mask_4d", "causal_valid_lens", "keys_shorter-causal",
                            "softcap_bias-fully_masked_row"),
    "MultiHeadAttention": ("mask_4d_bias", "causal_valid_lens_bias", "fully_masked_row_bias",
                           "llama-causal_valid_lens", "gqa-mask_3d", "alibi-fully_masked_row",
                           "window-causal", "score_bias-mask_4d", "softcap-valid_lens_2d"),
    "TransformerEncoderBlock": ("valid_lens_1d", "mask_3d", "fully_masked_row"),
    "TransformerEncoder": ("mask_2d",),
}


def fused_entry(h: Harness) -> kernels.Entry | None:
    """The backend's registered ``"fused"`` kernel, or None."""
    return next((e for e in kernels.kernels(h.ops.name) if e.name == "fused"), None)


def fused(backend: str, dtype: str = "float32") -> Harness:
    """The backend's harness; skips the test where the backend has no kernel or no ``dtype``."""
    h = Harness(backend)
    if fused_entry(h) is None:
        pytest.skip(f"the {backend} backend has no fused attention kernel")
    if dtype not in DTYPES[backend]:
        pytest.skip(f"the {backend} backend is not tested in {dtype}")
    return h


def case_of(layer: str, name: str) -> Case:
    return next(c for c in CASES if c.layer == layer and c.name == name)


def reference_layer(h: Harness, case: Case, dtype: str = "float32",
                    **options: Any) -> tuple[Any, list[Any], dict[str, Any], dict[str, np.ndarray]]:
    """The case's layer in ``dtype`` holding the file's weights, its inputs, call arguments and
    record."""
    ref = record(case)
    layer = h.make(case.layer, {**case.config, **options}, dtype)
    weights = {k[len("weight."):]: weight_array(v, dtype)
               for k, v in ref.items() if k.startswith("weight.")}
    if weights:
        layer.set_weights(weights)
    inputs = [h.array(ref[f"input.{name}"], dtype) for name in case.inputs]  # token ids stay int
    call = {k[len("call."):]: (bool(v) if k == "call.causal" else h.array(v))
            for k, v in ref.items() if k.startswith("call.")}
    return layer, inputs, call, ref


def kernel_calls(h: Harness, case: Case, dtype: str) -> int:
    """How many kernel calls one call of the case's layer, keeping no weights, makes."""
    config = case.config
    if case.layer == "DotProductAttention":
        depths = case.inputs["queries"][-1], case.inputs["values"][-1]
    else:
        depths = (config["num_hiddens"] // config["num_heads"],) * 2
    return int(h.hook("fused_kernel_takes")(*depths, dtype)) * config.get("num_blks", 1)


def runs(h: Harness, case: Case, dtype: str) -> bool:
    """Whether the backend runs the case here (see :data:`FEW_CASES`)."""
    return h.name not in FEW_CASES or (case.name in FEW_CASE_NAMES.get(case.layer, ())
                                       and kernel_calls(h, case, dtype) > 0)


def gradients(h: Harness, layer: Any, inputs: list[Any], call: dict[str, Any],
              cotangent: np.ndarray) -> dict[str, np.ndarray]:
    """Gradients of ``sum(output * cotangent)`` by input and weight (the ``forward_and_gradients``
    hook), as float64, in the backend's fastest mode for them."""
    static = {k: v for k, v in call.items() if isinstance(v, bool)}
    names = [k for k in call if k not in static]

    def differentiated(layer: Any, *arrays: Any) -> Any:
        kwargs = dict(zip(names, arrays[len(inputs):], strict=True), **static)
        return h.forward_and_gradients(layer, lambda m, *xs: {"out": h.call(m, *xs, **kwargs)},
                                       list(arrays[:len(inputs)]), cotangent)[1]

    got = h.run(FASTEST_GRADIENT_MODE.get(h.name, "eager"), layer, differentiated,
                [*inputs, *(call[k] for k in names)])
    return {name: h.numpy(g) for name, g in got.items()}


def unkept(h: Harness, blocks: int) -> Any:
    """What an encoder keeping no weights holds: one None per block; Flax sows nothing."""
    return None if h.name == "jax" else [None] * blocks


def fusable_cases() -> list[Any]:
    """The cases of the layers with a fused path, but those whose scores get terms added
    (soft-capping, ALiBi, a score bias), which are never given to a fused kernel."""
    return [pytest.param(c, id=f"{c.layer}-{c.name}") for c in CASES
            if c.layer in FUSABLE and not has_score_terms(c)]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("case", fusable_cases())
def test_fused_path_matches_reference(backend: str, case: Case, dtype: str,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Every mask kind, fully masked rows included, through the kernel equals the float64 files."""
    h = fused(backend, dtype)
    if not runs(h, case, dtype):
        pytest.skip(f"{case.layer}-{case.name} in {dtype}: not a case of {backend}'s (FEW_CASES)")
    layer, inputs, call, ref = reference_layer(h, case, dtype, **FUSED)
    count = h.hook("count_fused_calls")(monkeypatch)
    out = h.call(layer, *inputs, **call)
    assert count() == kernel_calls(h, case, dtype)
    assert h.attention_weights(layer) is None
    assert max_diff(h.numpy(out), ref["output.out"]) <= TOLERANCE[dtype]


def prefers(h: Harness, shape: tuple[int, ...]) -> bool:
    """Whether the automatic choice prefers the kernel for scores of ``shape`` (what it can do
    aside)."""
    entry = fused_entry(h)
    return entry is not None and bool(entry.prefers(h.ops, Request(Call(h.ops, shape))))


def kernel_expected(h: Harness, implementation: str | None) -> bool:
    """Whether a call that keeps its weights runs the kernel: where the weights are formed on
    read (not where the framework sows them in the call, tests/hooks' ``SOWS_WEIGHTS``), when
    the layer asks for the kernel or the automatic choice prefers it."""
    if getattr(h.hooks, "SOWS_WEIGHTS", False):
        return False
    return implementation == "fused" or prefers(h, (2, 1, 4, 4))


@pytest.mark.parametrize("implementation", [None, "fused"])
@pytest.mark.parametrize("layer_name", FUSABLE)
def test_kept_weights_are_formed_on_read_and_returned_ones_by_the_direct_path(
    backend: str, layer_name: str, implementation: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kept (the default), the weights are formed when read: the call pools on its own path
    (the kernel, where chosen), and reading gives the file's weights. Returned, they come from
    the direct path and the kernel never runs."""
    h = fused(backend)
    case = case_of(layer_name, "valid_lens_2d")
    options = {"implementation": implementation}
    count = h.hook("count_fused_calls")(monkeypatch)
    kept, inputs, call, ref = reference_layer(h, case, **options)
    h.call(kept, *inputs, **call)
    assert (count() > 0) == kernel_expected(h, implementation)
    assert max_diff(h.numpy(h.attention_weights(kept)), ref["output.attention"]) <= 1e-5
    if layer_name != "TransformerEncoderBlock":  # the block has no return_attention
        before = count()
        unkept_layer, inputs, call, _ = reference_layer(h, case, keep_attention_weights=False,
                                                        **options)
        _, weights = h.call(unkept_layer, *inputs, **call, return_attention=True)
        assert max_diff(h.numpy(weights), ref["output.attention"]) <= 1e-5
        assert count() == before


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_fully_masked_rows_are_zero_on_both_paths(backend: str, dtype: str) -> None:
    """Rows with no visible key are exactly zero, kept weights or not, with finite gradients."""
    h = fused(backend, dtype)
    case = case_of("DotProductAttention", "fully_masked_row")
    if not runs(h, case, dtype):
        pytest.skip(f"the case in {dtype} is not a case of {backend}'s (FEW_CASES)")
    for keep in (True, False):
        layer, inputs, call, _ = reference_layer(h, case, dtype, **({} if keep else FUSED))
        out = h.numpy(h.call(layer, *inputs, **call))
        assert np.all(out[0, 1] == 0) and np.all(out[1, 2] == 0), keep
        got = gradients(h, layer, inputs, call, np.ones(out.shape, np.float32))
        assert {"input.0", "input.1", "input.2"} <= set(got), keep
        assert all(np.isfinite(g).all() for g in got.values()), keep


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("keep", [True, False], ids=["direct", "fused"])
@pytest.mark.parametrize("layer_name", FUSABLE)
def test_low_precision_never_nan_and_close(backend: str, layer_name: str, keep: bool,
                                           dtype: str) -> None:
    """Every case in fp16/bf16: within the dtype's tolerance of the files, and the gradients of
    ``sum(out ** 2)`` by every input and weight finite."""
    h = fused(backend, dtype)
    if keep and h.name in FEW_CASES:
        pytest.skip("the direct path in low precision is the reference matrix's (FEW_CASES)")
    cases = [c for c in CASES if c.layer == layer_name and runs(h, c, dtype)
             and (keep or not has_score_terms(c))]
    if not cases:
        pytest.skip(f"no {layer_name} case in {dtype} is a case of {backend}'s (FEW_CASES)")
    for case in cases:
        layer, inputs, call, ref = reference_layer(h, case, dtype, **({} if keep else FUSED))
        out = h.numpy(h.call(layer, *inputs, **call))
        assert max_diff(out, ref["output.out"]) <= TOLERANCE[dtype], case.name
        got = gradients(h, layer, inputs, call, (2 * out).astype(np.float32))
        weights = {f"weight.{name}" for name in layer.get_weights()}
        assert set(got) == {f"input.{i}" for i in range(len(inputs))} | weights, case.name
        assert all(np.isfinite(g).all() for g in got.values()), case.name


@pytest.mark.parametrize("case", [c for c in gradient_cases()
                                  if c.layer in FUSABLE and not has_score_terms(c)], ids=key)
def test_fused_path_gradients_match_reference(backend: str, case: Case) -> None:
    h = fused(backend)
    if not runs(h, case, "float32"):
        pytest.skip(f"{case.layer}-{case.name} is not a case of {backend}'s (FEW_CASES)")
    layer, inputs, call, _ = reference_layer(h, case, **FUSED)
    ref = stored_gradients(case)
    got = gradients(h, layer, inputs, call, ref["cotangent"].astype(np.float32))
    assert h.attention_weights(layer) is None  # the fused path ran
    assert set(got) == {k for k in ref if k != "cotangent"}
    for name, value in got.items():
        assert max_diff(value, ref[name]) <= TOL, name


@pytest.mark.parametrize("layer_name", FUSABLE)
def test_the_automatic_choice_takes_the_kernel_where_the_backend_prefers_it(
    backend: str, layer_name: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A layer keeping no weights, its implementation left to the core, calls the kernel where
    the kernel's registered ``prefers`` (torch: always, eagerly) says so for its scores."""
    h = fused(backend)
    case = case_of(layer_name, "valid_lens_2d")
    layer, inputs, call, ref = reference_layer(h, case, keep_attention_weights=False)
    count = h.hook("count_fused_calls")(monkeypatch)
    out = h.call(layer, *inputs, **call)
    B, Q, K = len(ref["output.out"]), inputs[0].shape[1], inputs[-1].shape[1]
    assert count() == kernel_calls(h, case, "float32") * prefers(h, (B, case.heads, Q, K))
    assert max_diff(h.numpy(out), ref["output.out"]) <= TOL


def test_gradient_cases_include_fused_layers() -> None:
    assert {"MultiHeadAttention", "TransformerEncoderBlock"} <= {c.layer for c in gradient_cases()}


def test_unkept_relative_weights_match_reference(backend: str) -> None:
    """Keeping no weights, the relative layer (which has no kernel) gives the file's output."""
    h = Harness(backend)
    case = case_of("RelativeMultiHeadAttention", "valid_lens_2d")
    layer, inputs, call, ref = reference_layer(h, case, keep_attention_weights=False)
    out = h.call(layer, *inputs, **call)
    assert h.attention_weights(layer) is None
    assert max_diff(h.numpy(out), ref["output.out"]) <= 1e-5


@pytest.mark.parametrize("implementation", [None, "fused"])
def test_encoder_keeps_weights_on_its_blocks_formed_on_read(
    backend: str, implementation: str | None, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The kept maps (tests/test_adapters.py), each block's own (where the encoder holds its
    blocks: Flax sows them instead), are the file's when read; the call pools on its own path
    (the kernel, where chosen)."""
    h = fused(backend)
    count = h.hook("count_fused_calls")(monkeypatch)
    encoder, inputs, call, ref = reference_layer(h, case_of("TransformerEncoder", "valid_lens_1d"),
                                                 implementation=implementation)
    h.call(encoder, *inputs, **call)
    assert (count() > 0) == kernel_expected(h, implementation)
    kept = h.attention_weights(encoder)
    assert max_diff(np.stack([h.numpy(w) for w in kept]), ref["output.attention"]) <= TOL
    blocks = getattr(encoder, "blks", None)
    if blocks is not None:
        assert all(block.attention_weights is w for block, w in zip(blocks, kept, strict=True))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_encoder_fused_path_matches_reference(backend: str, dtype: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Without kept weights every block goes through the kernel: every mask kind against the
    files, gradients (by weight; the tokens have none) finite, and against the reference
    gradients in float32 and float64 (low precision: ReLUs may flip, tests/harness.py)."""
    h = fused(backend, dtype)
    count = h.hook("count_fused_calls")(monkeypatch)
    cases = [c for c in CASES if c.layer == "TransformerEncoder" and c.edge is None
             and runs(h, c, dtype)]
    if not cases:
        pytest.skip(f"no encoder case in {dtype} is a case of {backend}'s here (FEW_CASES)")
    for case in cases:
        layer, inputs, call, ref = reference_layer(h, case, dtype, **FUSED)
        calls = count()
        out = h.call(layer, *inputs, **call)
        assert count() - calls == kernel_calls(h, case, dtype), case.name
        assert h.attention_weights(layer) == unkept(h, 2)
        assert max_diff(h.numpy(out), ref["output.out"]) <= TOLERANCE[dtype], case.name
        grads = stored_gradients(case)
        got = gradients(h, layer, inputs, call, grads["cotangent"])
        assert set(got) == {k for k in grads if k != "cotangent"}  # no input.0: token ids
        assert all(np.isfinite(g).all() for g in got.values()), case.name
        if dtype in ("float32", "float64"):  # the encoder is in LOW_PRECISION_UNBOUNDED_GRADIENTS
            for name, value in got.items():
                bound = TOLERANCE[dtype] * max(1.0, float(np.abs(grads[name]).max()))
                assert max_diff(value, grads[name]) <= bound, (case.name, name)


def test_the_kernel_on_rows_with_no_visible_key(backend: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The registered kernel itself gives a row that sees no key zeros (SDPA does; JAX's
    kernel gives the mean of the values, its softmax over all-masked scores being uniform, and
    the registered kernel zeroes the row). A row that sees keys is softmax-weighted, as float64
    NumPy computes it."""
    h = fused(backend)
    entry = fused_entry(h)
    assert entry is not None
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((1, 1, 2, 4), (1, 1, 3, 4),
                                                                   (1, 1, 3, 4)))
    seen = np.array([[True, False, True], [False, False, False]])
    count = h.hook("count_fused_calls")(monkeypatch)
    call = Call(h.ops, (1, 1, 2, 3), 0, 1)
    request = Request(call, (BooleanMask(h.array(seen[None, None])).bind(call),), scale=0.5)
    out = h.numpy(entry.kernel(h.ops, *(h.array(x) for x in (q, k, v)), request).out)
    scores = np.where(seen[0], 0.5 * q[0, 0, 0].astype(np.float64) @ k[0, 0].T, -np.inf)
    weights = np.exp(scores - scores.max())
    assert max_diff(out[0, 0, 0], weights / weights.sum() @ v[0, 0]) <= TOL
    np.testing.assert_array_equal(out[0, 0, 1], 0.0)
    got = ac.dot_product_attention(*(h.array(x) for x in (q, k, v)), h.array(np.array([0])),
                                   implementation="fused", ops=h.ops)
    assert count() == 2
    np.testing.assert_array_equal(h.numpy(got), 0.0)
