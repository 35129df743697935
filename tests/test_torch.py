"""PyTorch-specific behaviour: torch.compile and fullgraph, jit.trace, export, autocast,
state_dict and buffers, dtypes and ``.to()``. What every framework does alike is in
tests/test_adapters.py; the fused path (SDPA here) in tests/test_fused.py.

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
from tests.harness import LOW_PRECISION_UNBOUNDED_GRADIENTS, TOLERANCE, max_diff, tolerance
from tests.reference.cases import Case
from tests.reference.generate import record
from tests.reference.gradients import case_data, gradient_cases, key, load_gradients

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
          "float64": torch.float64}
FUSABLE = ("DotProductAttention", "MultiHeadAttention", "TransformerEncoderBlock")


def build(case: Case, dtype: str, **kwargs: Any) -> Any:
    """The case's torch layer in ``dtype``, holding the reference weights."""
    layer = getattr(torch_layers, case.layer)(**case.config, **kwargs, dtype=DTYPES[dtype])
    weights = {k[len("weight."):]: v for k, v in record(case).items() if k.startswith("weight.")}
    if weights:
        layer.set_weights(weights)
    return layer


def out_of(result: Any) -> np.ndarray:
    return result.detach().double().numpy()


# -- torch.compile --------------------------------------------------------------------------


def mha_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, 5, 12, generator=g), torch.randn(2, 7, 10, generator=g), torch.tensor([3, 7])


@pytest.mark.parametrize("keep", [True, False], ids=["direct", "fused"])
def test_no_graph_breaks(keep: bool) -> None:
    """One graph, no break, for the attention layers (input sizes inferred eagerly first), the
    block and the encoder."""
    (q, kv, lens), (rq, rk, rv) = mha_inputs(), relative_inputs()
    mha = torch_layers.MultiHeadAttention(16, 4, keep_attention_weights=keep)
    relative = torch_layers.RelativeMultiHeadAttention(12, 3, 2, keep_attention_weights=keep)
    mha(q, kv, kv), relative(rq, rk, rv)
    for layer, args, kwargs in [
        (mha, (q, kv, kv, lens), {"causal": True}),
        (relative, (rq, rk, rv, torch.tensor([2, 6])), {"causal": True}),
        (torch_layers.TransformerEncoderBlock(12, 20, 3, keep_attention_weights=keep),
         (q, torch.tensor([[1, 2, 3, 4, 5], [0, 5, 5, 1, 1]])), {}),
        (torch_layers.TransformerEncoder(11, 12, 16, 3, 2, keep_attention_weights=keep),
         (tokens([1, 2, 3], [4, 5, 6]), torch.tensor([3, 1])), {}),
    ]:
        explained = torch._dynamo.explain(layer)(*args, **kwargs)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), type(layer)


def test_compiled_fullgraph_equals_eager_and_keeps_weights() -> None:
    """Compiled with fullgraph (which raises on any graph break), a fused multi-head layer and
    a block keeping its weights, over a fully masked row, give eager's numbers."""
    torch._dynamo.reset()
    q, kv, lens = mha_inputs()
    mha = torch_layers.MultiHeadAttention(16, 4, bias=True, keep_attention_weights=False).eval()
    expected = out_of(mha(q, kv, kv, lens, causal=True))  # input sizes are inferred eagerly
    out = torch.compile(mha, fullgraph=True)(q, kv, kv, lens, causal=True)
    assert max_diff(out_of(out), expected) <= 1e-5
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


def test_positional_table_is_a_non_persistent_buffer_moved_by_to() -> None:
    layer = torch_layers.PositionalEncoding(16, max_len=50)
    assert "P" in dict(layer.named_buffers()) and layer.P.dtype == torch.float32
    assert layer.state_dict() == {} and list(layer.parameters()) == []
    layer.load_state_dict({})
    layer.to(torch.float64)
    assert layer.P.dtype == torch.float64
    assert max_diff(layer.P[0].numpy(), naive.pe_table(50, 16)) <= 1e-12  # exact in float64
    assert layer(torch.zeros(1, 7, 16, dtype=torch.float64)).dtype == torch.float64


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


def test_concrete_is_none_under_compile_and_jit_trace() -> None:
    def probe(x: torch.Tensor) -> torch.Tensor:
        return x + (1.0 if OPS.concrete(x) is None else 0.0)

    x = torch.zeros(2)
    assert probe(x).tolist() == [0.0, 0.0]
    assert torch.compile(probe, fullgraph=True, backend="eager")(x).tolist() == [1.0, 1.0]
    assert torch.jit.trace(probe, x, check_trace=False)(x).tolist() == [1.0, 1.0]


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


NAN, INF = float("nan"), float("inf")
#: Seed, the non-finite entries of q, k, v (2, 2, n, 8), lengths, and the rows left NaN.
NON_FINITE = {  # NaN in a query, a masked key and a masked value:
    "nan": (1, {"q": [((1, 0, 2, 3), NAN)], "k": [((0, 1, 5, 0), NAN)],
                "v": [((1, 1, 4, 2), NAN)]}, [5, 4], 1),
    # +inf in a query, -inf in a visible key, +inf in a key past example 1's length
    "inf": (2, {"q": [((1, 0, 2, 3), INF)], "k": [((0, 1, 1, 0), -INF), ((1, 0, 5, 2), INF)],
                "v": []}, [6, 4], 5),
}


@pytest.mark.parametrize("name", list(NON_FINITE))
def test_compiled_fused_path_puts_nan_where_eager_does(name: str) -> None:
    """Under ``torch.compile`` the inputs cannot be probed, so the mending is always traced:
    the fused path gives the eager direct path's rows, NaN ones included (inf in a query or
    key counts as NaN)."""
    seed, entries, lens, nan_rows = NON_FINITE[name]
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 2, n, 8, generator=gen) for n in (4, 6, 6))
    for x, name_ in ((q, "q"), (k, "k"), (v, "v")):
        for index, value in entries[name_]:
            x[index] = value

    def fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor) -> Any:
        return ac.dot_product_attention(q, k, v, lens, implementation="fused", ops=OPS)

    got = torch.compile(fused, fullgraph=True, backend="eager")(q, k, v, torch.tensor(lens))
    want = ac.dot_product_attention(q, k, v, torch.tensor(lens), implementation="direct")
    assert torch.equal(got.isnan(), want.isnan()) and int(want.isnan().any(-1).sum()) == nan_rows
    assert max_diff(got.nan_to_num().numpy(), want.nan_to_num().numpy()) <= TOLERANCE["float32"]


# -- RelativeMultiHeadAttention and TransformerEncoder -----------------------------------------

def relative_inputs(q: int = 4, k: int = 6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return torch.randn(2, q, 10, generator=g), torch.randn(2, k, 7, generator=g), torch.randn(
        2, k, 9, generator=g)


def tokens(*rows: list[int]) -> torch.Tensor:
    return torch.tensor(rows)


# -- unknown sequence lengths: torch.export and ONNX (issue 14, item 16) --------------------------


class _FunctionalEncoder(torch.nn.Module):
    """The functional ``transformer_encoder`` over a layer's parameters (no table held)."""

    def __init__(self, encoder: torch_layers.TransformerEncoder) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, tokens: torch.Tensor) -> Any:
        return ac.transformer_encoder(tokens, dict(self.encoder.named_parameters()), 3)


@pytest.mark.parametrize("kind", ["weights", "fused", "functional"])
def test_encoder_torch_export_with_a_dynamic_length(kind: str) -> None:
    """The layer, keeping its weights or not, and the functional API over its parameters (which
    under a symbolic length slices a table of max_len (1000) rows)."""
    torch.manual_seed(1 if kind == "functional" else 0)
    encoder = torch_layers.TransformerEncoder(11, 12, 16, 3, 2,
                                              keep_attention_weights=kind != "fused").eval()
    module = _FunctionalEncoder(encoder).eval() if kind == "functional" else encoder
    program = torch.export.export(module, (torch.randint(0, 11, (2, 5)),), dynamic_shapes={
        "tokens": {1: torch.export.Dim("steps", min=2, max=64)}})
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
    layer = build(case, "float32", **({"keep_attention_weights": keep} if case.layer in FUSABLE
                                      else {}))
    inputs, _, call = case_data(case)
    ref = load_gradients()[key(case)]
    leaves = [torch.tensor(x) if x.dtype.kind in "iu"
              else torch.tensor(x, dtype=torch.float32, requires_grad=True) for x in inputs]
    with torch.autocast("cpu", dtype=AUTOCAST[dtype]):
        out = layer(*leaves, **{k: (v if k == "causal" else torch.from_numpy(v))
                                for k, v in call.items()})
    (out.float() * torch.from_numpy(ref["cotangent"]).float()).sum().backward()
    assert max_diff(out_of(out), record(case)["output.out"]) <= TOLERANCE[dtype]
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


def test_compiled_blockwise_path_has_no_graph_break_and_jit_trace_refuses_it() -> None:
    """The blockwise path's blocks are Python loops over the lengths, so it compiles per length
    (documented), but each length in one graph; under jit.trace, where lengths are run-time
    sizes, it says so (the automatic choice never takes it there)."""
    mha = torch_layers.MultiHeadAttention(12, 3, keep_attention_weights=False,
                                          implementation="blockwise").eval()
    mha(*_attention_args(3))
    torch._dynamo.reset()
    compiled = torch.compile(mha, fullgraph=True, backend="eager")
    for t in (5, 9):
        got = compiled(*_attention_args(t), causal=True)
        assert max_diff(out_of(got), out_of(mha(*_attention_args(t), causal=True))) <= 1e-6
    with pytest.raises(ValueError, match=r"^implementation='blockwise' needs the numbers of "
                       r"queries and keys to be known when the call is traced"):
        traced(mha, _attention_args(5))


@pytest.mark.parametrize("compile_", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("implementation", ["direct", "blockwise", "fused"])
def test_autocast_every_path_over_many_key_blocks(implementation: str, compile_: bool) -> None:
    """float32 inputs under bfloat16 autocast, keys over three blocks of the blockwise path and
    rows with no visible key: every path within bfloat16's tolerance of float64 NumPy (the fill
    is the scores' dtype's, not the queries'; the mended NaN rows keep the kernel's dtype)."""
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal(shape) for shape in ((2, 4, 8), (2, 2100, 8), (2, 2100, 8)))
    lens = np.array([[0, 5, 2100, 1500], [2100, 1100, 0, 3]])  # (B, Q)
    expected = naive.dot_product(q[:, None], k[:, None], v[:, None],
                                 naive.visible(2, 1, 4, 2100, lens))[0][:, 0]
    layer = torch_layers.DotProductAttention(keep_attention_weights=False,
                                             implementation=implementation)
    call = torch.compile(layer, fullgraph=True, backend="eager") if compile_ else layer
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = call(*(torch.tensor(x, dtype=torch.float32) for x in (q, k, v)),
                   torch.from_numpy(lens))
    assert out.dtype == torch.bfloat16
    assert max_diff(out_of(out), expected) <= TOLERANCE["bfloat16"]
