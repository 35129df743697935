"""PyTorch-specific behaviour: the fused path (SDPA), torch.compile and fullgraph, jit.trace,
export, autocast, state_dict and buffers, dtypes and ``.to()``. What every framework does alike
(dropout, kept weights, training steps, files, the blockwise path) is in tests/test_adapters.py.

Expected values come from the float64 reference files, the NumPy backend, tests/naive.py or
the reference gradients, never from the torch code under test.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from conftest import test_backends

if "torch" not in test_backends():
    pytest.skip("the torch backend is not tested in this env", allow_module_level=True)

import torch
from torch.nn.parameter import UninitializedParameter

import attention_core as ac
import backends.torch as torch_layers
from backends.torch import OPS, TorchOps
from tests import naive
from tests.harness import LOW_PRECISION_UNBOUNDED_GRADIENTS, TOLERANCE, Harness, max_diff, tolerance
from tests.reference.cases import CASES, INTEGER_INPUTS, Case
from tests.reference.generate import record
from tests.reference.gradients import case_data, gradient_cases, key, load_gradients

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
          "float64": torch.float64}
FUSABLE = ("DotProductAttention", "MultiHeadAttention", "TransformerEncoderBlock")


def reference(case: Case, dtype: str) -> tuple[list[torch.Tensor], dict[str, np.ndarray],
                                               dict[str, Any], dict[str, np.ndarray]]:
    """A case's inputs (as torch tensors of ``dtype``), weights, call arguments and record."""
    ref = record(case)
    inputs = [torch.tensor(ref[f"input.{name}"]) if name in INTEGER_INPUTS  # token ids stay int64
              else torch.tensor(ref[f"input.{name}"], dtype=DTYPES[dtype]) for name in case.inputs]
    weights = {k[len("weight."):]: v for k, v in ref.items() if k.startswith("weight.")}
    call = {k[len("call."):]: (bool(v) if k == "call.causal" else torch.from_numpy(v))
            for k, v in ref.items() if k.startswith("call.")}
    return inputs, weights, call, ref


def build(case: Case, dtype: str, **kwargs: Any) -> Any:
    """The case's torch layer in ``dtype``, holding the reference weights."""
    layer = getattr(torch_layers, case.layer)(**case.config, **kwargs, dtype=DTYPES[dtype])
    _, weights, _, _ = reference(case, dtype)
    if weights:
        layer.set_weights(weights)
    return layer


def base_case(layer_name: str, name: str) -> Case:
    return next(c for c in CASES if c.layer == layer_name and c.name == name)


def fusable_cases() -> list[Any]:
    return [pytest.param(c, id=f"{c.layer}-{c.name}") for c in CASES if c.layer in FUSABLE]


class CountSDPA:
    """Counts calls of torch's scaled_dot_product_attention (to prove the fused path ran)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        real = torch.nn.functional.scaled_dot_product_attention

        def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)


def out_of(result: Any) -> np.ndarray:
    return result.detach().double().numpy()


# -- the fused path -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("case", fusable_cases())
def test_fused_path_matches_reference(case: Case, dtype: str,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Every mask kind, fully masked rows included, through SDPA equals the float64 files."""
    layer = build(case, dtype, keep_attention_weights=False)
    inputs, _, call, ref = reference(case, dtype)
    sdpa = CountSDPA(monkeypatch)
    out = layer(*inputs, **call)
    assert sdpa.calls == 1
    assert layer.attention_weights is None
    assert max_diff(out_of(out), ref["output.out"]) <= TOLERANCE[dtype]


@pytest.mark.parametrize("layer_name", FUSABLE)
def test_weights_kept_or_asked_for_use_the_direct_path(layer_name: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    case = next(c for c in CASES if c.layer == layer_name and c.name == "valid_lens_2d")
    inputs, _, call, ref = reference(case, "float32")
    sdpa = CountSDPA(monkeypatch)
    kept = build(case, "float32")
    kept(*inputs, **call)
    assert max_diff(out_of(kept.attention_weights), ref["output.attention"]) <= 1e-5
    if layer_name != "TransformerEncoderBlock":  # the block has no return_attention
        fused = build(case, "float32", keep_attention_weights=False)
        _, weights = fused(*inputs, **call, return_attention=True)
        assert max_diff(out_of(weights), ref["output.attention"]) <= 1e-5
    assert sdpa.calls == 0


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fully_masked_rows_are_zero_on_both_paths(dtype: str) -> None:
    case = next(c for c in CASES if c.layer == "DotProductAttention" and c.name == "fully_masked_row")
    inputs, _, call, _ = reference(case, dtype)
    for keep in (True, False):
        layer = build(case, dtype, keep_attention_weights=keep)
        inputs = [x.requires_grad_(True) for x in inputs]
        out = layer(*inputs, **call)
        assert torch.all(out[0, 1] == 0) and torch.all(out[1, 2] == 0)
        out.sum().backward()
        assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in inputs)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("keep", [True, False], ids=["direct", "fused"])
@pytest.mark.parametrize("layer_name", FUSABLE)
def test_low_precision_never_nan_and_close(layer_name: str, keep: bool, dtype: str) -> None:
    """Every mask kind in fp16/bf16: finite outputs and gradients, within the dtype's tolerance."""
    for case in (c for c in CASES if c.layer == layer_name):
        layer = build(case, dtype, keep_attention_weights=keep)
        inputs, _, call, ref = reference(case, dtype)
        inputs = [x.requires_grad_(True) for x in inputs]
        out = layer(*inputs, **call)
        assert max_diff(out_of(out), ref["output.out"]) <= TOLERANCE[dtype], case.name
        out.float().square().sum().backward()
        grads = [x.grad for x in inputs] + [p.grad for p in layer.parameters()]
        assert all(g is not None and torch.isfinite(g).all() for g in grads), case.name


@pytest.mark.parametrize("case", [c for c in gradient_cases() if c.layer in FUSABLE], ids=key)
def test_fused_path_gradients_match_reference(case: Case) -> None:
    h = Harness("torch")
    layer = build(case, "float32", keep_attention_weights=False)
    inputs, _, call = case_data(case)
    ref = load_gradients()[key(case)]
    kwargs = {k: (v if k == "causal" else torch.from_numpy(v)) for k, v in call.items()}
    got = h.hooks.gradients(layer, [torch.tensor(x, dtype=torch.float32) for x in inputs], kwargs,
                            ref["cotangent"].astype(np.float32))
    assert layer.attention_weights is None  # the fused path ran
    for name, value in got.items():
        assert max_diff(value, ref[name]) <= TOLERANCE["float32"], name


def test_gradient_cases_include_fused_layers() -> None:
    assert {"MultiHeadAttention", "TransformerEncoderBlock"} <= {c.layer for c in gradient_cases()}


# -- torch.compile --------------------------------------------------------------------------


def mha_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, 5, 12, generator=g), torch.randn(2, 7, 10, generator=g), torch.tensor([3, 7])


@pytest.mark.parametrize("keep", [True, False], ids=["direct", "fused"])
def test_no_graph_breaks(keep: bool) -> None:
    q, kv, lens = mha_inputs()
    mha = torch_layers.MultiHeadAttention(16, 4, keep_attention_weights=keep)
    mha(q, kv, kv)  # input sizes are inferred eagerly
    explained = torch._dynamo.explain(mha)(q, kv, kv, lens, causal=True)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    block = torch_layers.TransformerEncoderBlock(12, 20, 3, keep_attention_weights=keep)
    explained = torch._dynamo.explain(block)(q, torch.tensor([[1, 2, 3, 4, 5], [0, 5, 5, 1, 1]]))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)


def test_compiled_multi_head_attention_fullgraph() -> None:
    torch._dynamo.reset()
    q, kv, lens = mha_inputs()
    mha = torch_layers.MultiHeadAttention(16, 4, bias=True, keep_attention_weights=False).eval()
    expected = mha(q, kv, kv, lens, causal=True)
    compiled = torch.compile(mha, fullgraph=True)  # raises on any graph break
    out = compiled(q, kv, kv, lens, causal=True)
    assert max_diff(out_of(out), out_of(expected)) <= 1e-5


def test_compiled_encoder_block_fullgraph_keeps_weights() -> None:
    torch._dynamo.reset()
    X = torch.randn(2, 6, 12, generator=torch.Generator().manual_seed(1))
    lens = torch.tensor([[1, 2, 3, 4, 5, 6], [0, 1, 1, 6, 6, 6]])  # a fully masked row
    block = torch_layers.TransformerEncoderBlock(12, 20, 3).eval()
    expected = out_of(block(X, lens))
    expected_weights = out_of(block.attention_weights)
    block.attention_weights = None
    out = torch.compile(block, fullgraph=True)(X, lens)
    assert max_diff(out_of(out), expected) <= 1e-5
    assert max_diff(out_of(block.attention_weights), expected_weights) <= 1e-6


def test_unbuilt_layer_under_fullgraph_says_what_to_do() -> None:
    q, kv, _ = mha_inputs()
    mha = torch_layers.MultiHeadAttention(16, 4)
    with pytest.raises(Exception, match="call the layer once, or set_weights"):
        torch.compile(mha, fullgraph=True, backend="eager")(q, kv, kv)


# -- state_dict, buffers, dtype and device moves ------------------------------------------------


def test_positional_table_is_a_non_persistent_buffer() -> None:
    layer = torch_layers.PositionalEncoding(16, max_len=50)
    assert "P" in dict(layer.named_buffers())
    assert layer.state_dict() == {}
    assert list(layer.parameters()) == []
    layer.load_state_dict({})


def test_to_float64_moves_P_and_keeps_it_exact() -> None:
    layer = torch_layers.PositionalEncoding(16, max_len=50)
    assert layer.P.dtype == torch.float32
    layer.to(torch.float64)
    assert layer.P.dtype == torch.float64
    assert max_diff(layer.P[0].numpy(), naive.pe_table(50, 16)) <= 1e-12
    out = layer(torch.zeros(1, 7, 16, dtype=torch.float64))
    assert out.dtype == torch.float64


def test_dtype_factory_argument() -> None:
    layer = torch_layers.MultiHeadAttention(8, 2, dtype=torch.float64, q_in=5, k_in=5, v_in=5)
    assert {p.dtype for p in layer.parameters()} == {torch.float64}
    assert layer.built and layer.get_weights()["W_q.kernel"].shape == (5, 8)
    out = layer(torch.ones(1, 2, 5), torch.ones(1, 2, 5), torch.ones(1, 2, 5))
    assert out.dtype == torch.float64  # float32 inputs cast to the layer's dtype (the dtype rule)


# -- lazy input sizes ---------------------------------------------------------------------


def test_lazy_parameters_are_materialised_in_place() -> None:
    """Placeholders (``UninitializedParameter``) until the first call fills them in place, so an
    optimizer made before it trains them; an unbuilt ``state_dict`` loads into an unbuilt layer.
    Input sizes and failed first calls, on every backend: tests/test_building.py."""
    torch.manual_seed(0)  # fixed initial weights: with unlucky ones every ReLU could be off
    layer = torch_layers.PositionWiseFFN(6, 4)
    torch_layers.PositionWiseFFN(6, 4).load_state_dict(layer.state_dict())  # unbuilt into unbuilt
    before = list(layer.parameters())
    optimizer = torch.optim.SGD(before, lr=0.1)
    assert isinstance(layer.dense1.kernel, UninitializedParameter) and not layer.built
    out = layer(torch.randn(2, 3, 5))
    assert [id(p) for p in layer.parameters()] == [id(p) for p in before]
    initial = layer.get_weights()["dense1.kernel"]
    out.sum().backward()
    optimizer.step()
    assert before[0].grad is not None and before[0].grad.shape == (5, 6)
    assert not np.allclose(layer.get_weights()["dense1.kernel"], initial)


# -- the ops --------------------------------------------------------------------------------


def test_ops_dtype_names_and_conversion() -> None:
    for name, dtype in DTYPES.items():
        assert OPS.dtype_name(torch.zeros(1, dtype=dtype)) == name
    assert OPS.dtype_name(torch.tensor([1])) == "int64"
    assert OPS.dtype_name(torch.tensor([True])) == "bool"
    like = torch.zeros(1, dtype=torch.float64)
    assert OPS.from_numpy(np.ones(2, np.float32), like=like).dtype == torch.float64
    assert OPS.from_numpy(np.ones(2, np.int32), like=like).dtype == torch.int32
    assert isinstance(OPS, TorchOps) and OPS.name == "torch"


def test_concrete_is_none_under_compile() -> None:
    def probe(x: torch.Tensor) -> torch.Tensor:
        return x + (1.0 if OPS.concrete(x) is None else 0.0)

    x = torch.zeros(2)
    assert probe(x).tolist() == [0.0, 0.0]
    assert torch.compile(probe, fullgraph=True, backend="eager")(x).tolist() == [1.0, 1.0]


def test_concrete_is_none_under_jit_trace() -> None:
    seen = []

    def probe(x: torch.Tensor) -> torch.Tensor:
        seen.append(OPS.concrete(x) is None)
        return x * 2

    torch.jit.trace(probe, torch.zeros(2), check_trace=False)
    assert seen == [True]


@pytest.mark.parametrize("implementation", ["direct", "blockwise", "fused"])
def test_torch_func_grad_and_vmap(implementation: str) -> None:
    """``torch.func`` tensors have no storage to read: the core treats them as traced."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, n, 8, generator=gen, dtype=torch.float64) for n in (4, 5, 5))
    lens = torch.tensor([5, 2])

    def total(q: torch.Tensor) -> torch.Tensor:
        return ac.dot_product_attention(q, k, v, lens, implementation=implementation).sum()

    eager = q.clone().requires_grad_()
    total(eager).backward()
    assert max_diff(torch.func.grad(total)(q).numpy(), eager.grad.numpy()) <= 1e-12
    one = torch.func.vmap(lambda x, kk, vv: ac.dot_product_attention(
        x, kk, vv, implementation=implementation))(q, k, v)
    want = ac.dot_product_attention(q, k, v, implementation=implementation)
    assert max_diff(one.numpy(), want.numpy()) <= 1e-12


def _compiled_fused_equals_direct(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                  lens: torch.Tensor, nan_rows: int) -> None:
    """The fused path under ``torch.compile`` gives the eager direct path's rows, NaN ones
    included (``nan_rows`` of them)."""

    def fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor) -> Any:
        return ac.dot_product_attention(q, k, v, lens, implementation="fused", ops=OPS)

    got = torch.compile(fused, fullgraph=True, backend="eager")(q, k, v, lens)
    want = ac.dot_product_attention(q, k, v, lens, implementation="direct")
    assert torch.equal(got.isnan(), want.isnan()) and int(want.isnan().any(-1).sum()) == nan_rows
    assert max_diff(got.nan_to_num().numpy(), want.nan_to_num().numpy()) <= TOLERANCE["float32"]


def test_compiled_fused_path_puts_nan_where_eager_does() -> None:
    """Under ``torch.compile`` the inputs cannot be probed, so the mending is always traced:
    NaN in a query, a masked key and a masked value give the eager direct path's rows."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, n, 8, generator=gen) for n in (4, 6, 6))
    q[1, 0, 2, 3] = k[0, 1, 5, 0] = v[1, 1, 4, 2] = float("nan")
    lens = torch.tensor([5, 4])
    _compiled_fused_equals_direct(q, k, v, lens, nan_rows=1)


def test_compiled_fused_path_treats_inf_in_queries_and_keys_as_nan() -> None:
    """Under ``torch.compile``: +inf in a query, -inf in a visible key and +inf in a masked key
    give the eager direct path's rows (NaN for the query's row and the rows that see the key)."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 2, n, 8, generator=gen) for n in (4, 6, 6))
    q[1, 0, 2, 3] = k[0, 1, 1, 0] = float("inf")
    k[0, 1, 1, 0] = -float("inf")
    k[1, 0, 5, 2] = float("inf")  # past example 1's length
    lens = torch.tensor([6, 4])
    _compiled_fused_equals_direct(q, k, v, lens, nan_rows=5)


# -- RelativeMultiHeadAttention and TransformerEncoder -----------------------------------------

def relative_inputs(q: int = 4, k: int = 6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return torch.randn(2, q, 10, generator=g), torch.randn(2, k, 7, generator=g), torch.randn(
        2, k, 9, generator=g)


def tokens(*rows: list[int]) -> torch.Tensor:
    return torch.tensor(rows)


def test_unkept_relative_weights_use_the_fused_path() -> None:
    case = base_case("RelativeMultiHeadAttention", "valid_lens_2d")
    inputs, _, call, ref = reference(case, "float32")
    unkept = build(case, "float32", keep_attention_weights=False)
    out = unkept(*inputs, **call)
    assert unkept.attention_weights is None
    assert max_diff(out_of(out), ref["output.out"]) <= 1e-5


def test_encoder_keeps_weights_on_its_blocks_by_the_direct_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kept maps (tests/test_adapters.py) are formed on the direct path, each block's own."""
    case = base_case("TransformerEncoder", "valid_lens_1d")
    inputs, _, call, _ = reference(case, "float32")
    sdpa = CountSDPA(monkeypatch)
    encoder = build(case, "float32")
    encoder(*inputs, **call)
    assert sdpa.calls == 0
    kept = encoder.attention_weights
    assert all(block.attention_weights is w for block, w in zip(encoder.blks, kept, strict=True))


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_encoder_fused_path_matches_reference(dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without kept weights every block goes through SDPA: every mask kind against the files,
    gradients (float32, by weight; the tokens have none) against the reference gradients."""
    h = Harness("torch")
    sdpa = CountSDPA(monkeypatch)
    reference_gradients = load_gradients()
    for case in (c for c in CASES if c.layer == "TransformerEncoder" and c.edge is None):
        layer = build(case, dtype, keep_attention_weights=False)
        inputs, _, call, ref = reference(case, dtype)
        calls = sdpa.calls
        out = layer(*inputs, **call)
        assert sdpa.calls - calls == 2, case.name
        assert layer.attention_weights == [None, None]
        assert max_diff(out_of(out), ref["output.out"]) <= TOLERANCE[dtype], case.name
        grads = reference_gradients[key(case)]
        got = h.hooks.gradients(layer, inputs, call, grads["cotangent"])
        assert set(got) == {k for k in grads if k != "cotangent"}  # no input.0: token ids
        assert all(np.isfinite(g).all() for g in got.values()), case.name
        if dtype in ("float32", "float64"):  # low precision: ReLUs may flip (tests/harness.py)
            for name, value in got.items():
                bound = TOLERANCE[dtype] * max(1.0, float(np.abs(grads[name]).max()))
                assert max_diff(value, grads[name]) <= bound, (case.name, name)


@pytest.mark.parametrize("keep", [True, False], ids=["direct", "fused"])
def test_new_layers_trace_without_graph_breaks(keep: bool) -> None:
    q, k, v = relative_inputs()
    relative = torch_layers.RelativeMultiHeadAttention(12, 3, 2, keep_attention_weights=keep)
    relative(q, k, v)  # input sizes are inferred eagerly
    explained = torch._dynamo.explain(relative)(q, k, v, torch.tensor([2, 6]), causal=True)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    encoder = torch_layers.TransformerEncoder(11, 12, 16, 3, 2, keep_attention_weights=keep)
    explained = torch._dynamo.explain(encoder)(tokens([1, 2, 3], [4, 5, 6]), torch.tensor([3, 1]))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)


# -- unknown sequence lengths: torch.export and ONNX (issue 14, item 16) --------------------------


@pytest.mark.parametrize("keep", [True, False], ids=["weights", "fused"])
def test_encoder_torch_export_with_a_dynamic_length(keep: bool) -> None:
    torch.manual_seed(0)
    encoder = torch_layers.TransformerEncoder(11, 12, 16, 3, 2, keep_attention_weights=keep).eval()
    steps = torch.export.Dim("steps", min=2, max=64)
    program = torch.export.export(encoder, (torch.randint(0, 11, (2, 5)),),
                                  dynamic_shapes={"tokens": {1: steps}})
    for length in (3, 17):
        tokens = torch.randint(0, 11, (2, length))
        got = program.module()(tokens).detach().numpy()
        assert max_diff(got, naive.encoder_of(encoder, tokens.numpy())) <= 1e-4


def test_encoder_onnx_export_with_a_dynamic_axis(tmp_path: Any) -> None:
    pytest.importorskip("onnxscript")
    ort = pytest.importorskip("onnxruntime")
    torch.manual_seed(0)
    encoder = torch_layers.TransformerEncoder(11, 12, 16, 3, 2, keep_attention_weights=False).eval()
    path = tmp_path / "encoder.onnx"
    torch.onnx.export(encoder, (torch.randint(0, 11, (2, 5)),), str(path), input_names=["tokens"],
                      output_names=["out"], dynamic_axes={"tokens": {0: "B", 1: "T"}},
                      dynamo=True, verbose=False)
    session = ort.InferenceSession(str(path))
    for batch, length in ((2, 3), (3, 17)):
        tokens = np.random.default_rng(length).integers(0, 11, (batch, length))
        (got,) = session.run(None, {"tokens": tokens})
        assert max_diff(got, naive.encoder_of(encoder, tokens)) <= 1e-4


class _FunctionalEncoder(torch.nn.Module):
    """The functional ``transformer_encoder`` over a layer's parameters (no table held)."""

    def __init__(self, encoder: torch_layers.TransformerEncoder) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, tokens: torch.Tensor) -> Any:
        return ac.transformer_encoder(tokens, dict(self.encoder.named_parameters()), 3)


def test_functional_encoder_torch_export_with_a_dynamic_length() -> None:
    """Under a symbolic length the functional API slices a table of max_len (1000) rows."""
    torch.manual_seed(1)
    encoder = torch_layers.TransformerEncoder(11, 12, 16, 3, 2).eval()
    steps = torch.export.Dim("steps", min=2, max=64)
    program = torch.export.export(_FunctionalEncoder(encoder).eval(),
                                  (torch.randint(0, 11, (2, 5)),),
                                  dynamic_shapes={"tokens": {1: steps}})
    for length in (3, 17):
        tokens = torch.randint(0, 11, (2, length))
        got = program.module()(tokens).detach().numpy()
        assert max_diff(got, naive.encoder_of(encoder, tokens.numpy())) <= 1e-4
# -- torch.autocast -------------------------------------------------------------------------

AUTOCAST = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def autocast_cases() -> list[Any]:
    """One gradient case per layer and mask kind (no edge-shape variants), on the direct path
    and, for the layers that have one, the fused path."""
    cases = [c for c in gradient_cases()
             if "-" not in c.name or c.layer in ("PositionalEncoding", "NadarayaWatson")]
    return [pytest.param(c, keep, id=f"{key(c)}-{'direct' if keep else 'fused'}")
            for c in cases for keep in (True, False) if keep or c.layer in FUSABLE]


@pytest.mark.parametrize("dtype", list(AUTOCAST))
@pytest.mark.parametrize(("case", "keep"), autocast_cases())
def test_every_layer_under_autocast_matches_reference(case: Case, keep: bool, dtype: str) -> None:
    """A float32 layer under ``torch.autocast("cpu", dtype)``, forward and backward: outputs
    and gradients within the autocast dtype's tolerance of the float64 files (the encoder's
    gradients finite only, tests/harness.py), the gradients in float32 like the parameters."""
    options = {} if case.layer not in FUSABLE else {"keep_attention_weights": keep}
    layer = build(case, "float32", **options)
    inputs, _, call = case_data(case)
    ref = load_gradients()[key(case)]
    leaves = [torch.tensor(x) if x.dtype.kind in "iu"
              else torch.tensor(x, dtype=torch.float32, requires_grad=True) for x in inputs]
    kwargs = {k: (v if k == "causal" else torch.from_numpy(v)) for k, v in call.items()}
    with torch.autocast("cpu", dtype=AUTOCAST[dtype]):
        out = layer(*leaves, **kwargs)
        loss = (out.float() * torch.from_numpy(ref["cotangent"]).float()).sum()
    loss.backward()
    _, _, _, record_ = reference(case, "float32")
    assert max_diff(out_of(out), record_["output.out"]) <= TOLERANCE[dtype]
    grads = {f"input.{i}": x.grad for i, x in enumerate(leaves) if x.is_floating_point()}
    grads.update({f"weight.{n}": p.grad for n, p in layer.named_parameters()})
    for name, grad in grads.items():
        assert grad is not None and grad.dtype == torch.float32, name
        assert torch.isfinite(grad).all(), name
        if case.layer not in LOW_PRECISION_UNBOUNDED_GRADIENTS:
            bound = tolerance("grad." + name, dtype, ref[name])
            assert max_diff(grad.double().numpy(), ref[name]) <= bound, name


@pytest.mark.parametrize("dtype", list(AUTOCAST))
@pytest.mark.parametrize("input_dtype", ["float32", "bfloat16"])
def test_autocast_output_dtypes_are_torchs(dtype: str, input_dtype: str) -> None:
    """Under autocast the block gives the dtype ``nn.TransformerEncoderLayer`` gives, and the
    projections the dtype of ``nn.Linear`` / ``nn.MultiheadAttention`` (the autocast dtype)."""
    X = torch.randn(2, 5, 12, generator=torch.Generator().manual_seed(3)).to(DTYPES[input_dtype])
    block = torch_layers.TransformerEncoderBlock(12, 20, 3, bias=True)
    mha = torch_layers.MultiHeadAttention(12, 3, bias=True, keep_attention_weights=False)
    ffn = torch_layers.PositionWiseFFN(20, 12, d_in=12)
    ours = torch.nn.TransformerEncoderLayer(12, 3, 20, dropout=0.0, batch_first=True)
    theirs = torch.nn.MultiheadAttention(12, 3, batch_first=True)
    with torch.autocast("cpu", dtype=AUTOCAST[dtype]):
        assert block(X).dtype == ours(X).dtype
        assert mha(X, X, X).dtype == theirs(X, X, X)[0].dtype == AUTOCAST[dtype]
        assert ffn(X).dtype == torch.nn.Linear(12, 20)(X).dtype == AUTOCAST[dtype]
        wider = torch.promote_types(X.dtype, AUTOCAST[dtype])  # torch's promotion, as in X + Y
        assert torch_layers.AddNorm(12)(X, X.to(AUTOCAST[dtype])).dtype == wider


@pytest.mark.parametrize("dtype", list(AUTOCAST))
def test_encoder_training_step_under_autocast(dtype: str) -> None:
    """loss.backward and an optimizer step under autocast: float32 gradients within the autocast
    dtype's reach of the float32 ones, every parameter moved, the loss lower after a few steps."""
    def losses_and_grads(autocast: bool, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
        torch.manual_seed(0)
        encoder = torch_layers.TransformerEncoder(11, 12, 16, 3, 2)
        ids = tokens([1, 3, 3, 7, 2], [4, 1, 7, 7, 0])
        target = torch.randn(2, 5, 12, generator=torch.Generator().manual_seed(1))
        optimizer = torch.optim.Adam(encoder.parameters(), lr=1e-2)
        losses, first = [], {}
        for step in range(steps):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=AUTOCAST[dtype], enabled=autocast):
                loss = ((encoder(ids, torch.tensor([5, 3])) - target) ** 2).mean()
            loss.backward()
            if step == 0:
                first = {n: p.grad.clone() for n, p in encoder.named_parameters()}
            before = {n: p.detach().clone() for n, p in encoder.named_parameters()}
            optimizer.step()
            assert all(not torch.equal(p, before[n]) for n, p in encoder.named_parameters())
            losses.append(loss.item())
        return losses, first

    mixed, grads = losses_and_grads(True, 5)
    _, exact = losses_and_grads(False, 1)
    assert mixed[-1] < mixed[0]
    for name, grad in grads.items():
        assert grad.dtype == torch.float32 and torch.isfinite(grad).all(), name
        scale = max(1.0, float(exact[name].abs().max()))
        assert float((grad - exact[name]).abs().max()) <= 4 * TOLERANCE[dtype] * scale, name


# -- torch.jit.trace ------------------------------------------------------------------------


class Calling(torch.nn.Module):
    """Calls a layer with fixed keyword arguments (``torch.jit.trace`` passes tensors only)."""

    def __init__(self, layer: torch.nn.Module, **kwargs: Any) -> None:
        super().__init__()
        self.layer, self.kwargs = layer, kwargs

    def forward(self, *args: torch.Tensor) -> Any:
        return self.layer(*args, **self.kwargs)


def _x(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))


def _attention_args(t: int) -> tuple[torch.Tensor, ...]:
    return _x(2, t, 12), _x(2, t + 1, 10), _x(2, t + 1, 9), torch.tensor([2, t + 1])


TRACED: dict[str, tuple[Callable[[], torch.nn.Module], Callable[[int], tuple[torch.Tensor, ...]]]] = {
    "DotProductAttention": (lambda: torch_layers.DotProductAttention(),
                            lambda t: (_x(2, t, 12), _x(2, t + 1, 12), _x(2, t + 1, 9),
                                       torch.tensor([2, t + 1]))),
    "DotProductAttention-fused-causal": (
        lambda: Calling(torch_layers.DotProductAttention(keep_attention_weights=False), causal=True),
        lambda t: (_x(2, t, 12), _x(2, t + 1, 12), _x(2, t + 1, 9))),
    "AdditiveAttention-causal": (lambda: Calling(torch_layers.AdditiveAttention(8), causal=True),
                                 _attention_args),
    "MultiHeadAttention": (lambda: torch_layers.MultiHeadAttention(12, 3, bias=True),
                           _attention_args),
    "MultiHeadAttention-fused-causal": (
        lambda: Calling(torch_layers.MultiHeadAttention(12, 3, keep_attention_weights=False),
                        causal=True), _attention_args),
    "RelativeMultiHeadAttention-causal": (
        lambda: Calling(torch_layers.RelativeMultiHeadAttention(12, 3, 2), causal=True),
        _attention_args),
    "TransformerEncoderBlock": (lambda: torch_layers.TransformerEncoderBlock(12, 20, 3),
                                lambda t: (_x(2, t, 12), torch.tensor([2, t]))),
    "TransformerEncoderBlock-fused-lens2d": (
        lambda: torch_layers.TransformerEncoderBlock(12, 20, 3, keep_attention_weights=False),
        lambda t: (_x(2, t, 12), torch.arange(2 * t).reshape(2, t) % (t + 1))),
    "PositionalEncoding": (lambda: torch_layers.PositionalEncoding(12), lambda t: (_x(2, t, 12),)),
    "LearnedPositionalEncoding": (lambda: torch_layers.LearnedPositionalEncoding(12),
                                  lambda t: (_x(2, t, 12),)),
    "PositionWiseFFN": (lambda: torch_layers.PositionWiseFFN(20, 12), lambda t: (_x(2, t, 12),)),
    "AddNorm": (lambda: torch_layers.AddNorm(12), lambda t: (_x(2, t, 12), _x(2, t, 12) + 1)),
    "NadarayaWatson": (lambda: torch_layers.NadarayaWatson(True),
                       lambda t: (_x(2, t), _x(2, t + 1), _x(2, t + 1))),
}


def traced(module: Any, args: tuple[torch.Tensor, ...]) -> Any:
    """``torch.jit.trace(module, args)``, failing on any TracerWarning (a value fixed by the trace)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", torch.jit.TracerWarning)
        warnings.filterwarnings("ignore", "`torch.jit.trace", FutureWarning)
        warnings.filterwarnings("ignore", "`torch.jit.trace", DeprecationWarning)
        return torch.jit.trace(module, args)


@pytest.mark.parametrize("name", list(TRACED))
def test_jit_trace_every_layer_equals_eager_at_any_length(name: str) -> None:
    """Traced at one length, the module equals eager there and at two other lengths: no
    dimension of an input is fixed by the trace (only the weights' shapes are)."""
    make, args = TRACED[name]
    module = make().eval()
    module(*args(4))  # input sizes are inferred eagerly
    trace = traced(module, args(5))
    for t in (5, 3, 9):
        expected = module(*args(t))
        assert max_diff(out_of(trace(*args(t))), out_of(expected)) <= 1e-6, t


def test_jit_trace_functional_api() -> None:
    """The functions trace too, the weights passed as inputs of the trace."""
    mha = torch_layers.MultiHeadAttention(12, 3, bias=True)
    mha(*_attention_args(3)[:3])
    names = list(dict(mha.named_parameters()))
    params = tuple(p.detach() for p in mha.parameters())

    def functional(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor,
                   *weights: torch.Tensor) -> torch.Tensor:
        return ac.multi_head_attention(q, k, v, dict(zip(names, weights, strict=True)), 3, lens,
                                       causal=True)

    trace = traced(functional, (*_attention_args(5), *params))
    for t in (5, 8):
        got, want = trace(*_attention_args(t), *params), functional(*_attention_args(t), *params)
        assert max_diff(out_of(got), out_of(want)) <= 1e-6
    dot = traced(lambda q, k, v: ac.dot_product_attention(q, k, v, causal=True),
                 (_x(2, 5, 12), _x(2, 6, 12), _x(2, 6, 9)))
    q, k, v = _x(2, 7, 12), _x(2, 8, 12), _x(2, 8, 9)
    assert max_diff(out_of(dot(q, k, v)), out_of(ac.dot_product_attention(q, k, v, causal=True))) <= 1e-6


def test_jit_trace_blockwise_needs_known_lengths() -> None:
    """The blockwise path's blocks are Python loops over the lengths: under jit.trace, where
    lengths are run-time sizes, it says so (the automatic choice never takes it there)."""
    mha = torch_layers.MultiHeadAttention(12, 3, keep_attention_weights=False,
                                          implementation="blockwise")
    mha(*_attention_args(3))
    with pytest.raises(ValueError, match=r"^implementation='blockwise' needs the numbers of "
                       r"queries and keys to be known when the call is traced"):
        traced(mha, _attention_args(5))


def test_jit_trace_encoder_equals_eager_at_any_length() -> None:
    encoder = torch_layers.TransformerEncoder(11, 12, 16, 3, 2).eval()
    ids = lambda t: (torch.arange(2 * t).reshape(2, t) % 11, torch.tensor([t, 2]))  # noqa: E731
    trace = traced(encoder, ids(5))
    for t in (5, 3, 9):
        assert max_diff(out_of(trace(*ids(t))), out_of(encoder(*ids(t)))) <= 1e-6, t


# -- torch.compile with symbolic lengths ------------------------------------------------------


def compilations(module: torch.nn.Module, args: Callable[[int], tuple[torch.Tensor, ...]],
                 dynamic: bool | None, lengths: tuple[int, ...] = (5, 7, 9, 12)) -> int:
    """How many graphs ``torch.compile(module, dynamic=dynamic)`` makes over calls at
    ``lengths``, checking each call's output against eager."""
    torch._dynamo.reset()
    graphs = []

    def counting(gm: torch.fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(module, dynamic=dynamic, backend=counting)
    for t in lengths:
        got, want = compiled(*args(t)), module(*args(t))
        assert max_diff(out_of(got), out_of(want)) <= 1e-6, t
    return len(graphs)


COMPILED = {**TRACED, "TransformerEncoder": (
    lambda: torch_layers.TransformerEncoder(11, 12, 16, 3, 2),
    lambda t: (torch.arange(2 * t).reshape(2, t) % 11, torch.tensor([t, 2])))}


@functools.cache
def torch_encoder_compilations(dynamic: bool | None) -> int:
    """The bar: how often ``nn.TransformerEncoder`` compiles over the same four lengths."""
    layer = torch.nn.TransformerEncoderLayer(12, 3, 20, dropout=0.0, batch_first=True)
    encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    return compilations(encoder, lambda t: (_x(2, t, 12),), dynamic)


@pytest.mark.parametrize("dynamic", [True, None], ids=["dynamic", "default"])
@pytest.mark.parametrize("name", list(COMPILED))
def test_compile_does_not_recompile_per_length(name: str, dynamic: bool | None) -> None:
    """Over four lengths a layer compiles no more often than ``nn.TransformerEncoder`` (once with
    ``dynamic=True``; twice by default: static, then dynamic), with eager's outputs."""
    bar = torch_encoder_compilations(dynamic)
    make, args = COMPILED[name]
    module = make().eval()
    module(*args(4))  # input sizes are inferred eagerly
    assert compilations(module, args, dynamic) <= bar


def test_compiled_blockwise_path_has_no_graph_break() -> None:
    """The blockwise path's blocks are Python loops over the lengths, so it compiles per length
    (documented), but each length in one graph."""
    mha = torch_layers.MultiHeadAttention(12, 3, keep_attention_weights=False,
                                          implementation="blockwise").eval()
    mha(*_attention_args(3))
    torch._dynamo.reset()
    compiled = torch.compile(mha, fullgraph=True, backend="eager")
    for t in (5, 9):
        got = compiled(*_attention_args(t), causal=True)
        assert max_diff(out_of(got), out_of(mha(*_attention_args(t), causal=True))) <= 1e-6


@pytest.mark.parametrize("compile_", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("implementation", ["direct", "blockwise", "fused"])
def test_autocast_every_path_over_many_key_blocks(implementation: str, compile_: bool) -> None:
    """float32 inputs under bfloat16 autocast, keys over three blocks of the blockwise path and
    rows with no visible key: every path within bfloat16's tolerance of float64 NumPy (the fill
    is the scores' dtype's, not the queries'; the mended NaN rows keep the kernel's dtype)."""
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal(shape) for shape in ((2, 4, 8), (2, 2100, 8), (2, 2100, 8)))
    lens = np.array([[0, 5, 2100, 1500], [2100, 1100, 0, 3]])  # (B, Q)
    scores = q @ k.transpose(0, 2, 1) / np.sqrt(8)  # (B, Q, K)
    seen = np.arange(2100)[None, None, :] < lens[:, :, None]
    weights = np.where(seen, np.exp(scores - np.where(seen, scores, -np.inf).max(-1, keepdims=True,
                                                                                  initial=0.0)), 0)
    total = weights.sum(-1, keepdims=True)
    expected = (weights / np.where(total > 0, total, 1)) @ v
    layer = torch_layers.DotProductAttention(keep_attention_weights=False,
                                             implementation=implementation)
    call = torch.compile(layer, fullgraph=True, backend="eager") if compile_ else layer
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = call(*(torch.tensor(x, dtype=torch.float32) for x in (q, k, v)),
                   torch.from_numpy(lens))
    assert out.dtype == torch.bfloat16
    assert max_diff(out_of(out), expected) <= TOLERANCE["bfloat16"]
