"""PyTorch-specific behaviour: torch.compile and fullgraph, jit.trace, the path exported
programs take, autocast's output dtypes, state_dict and buffers, dtypes and ``.to()``. What
every framework does alike is in tests/test_adapters.py; torch.export and ONNX round trips in
tests/test_export.py; the fused path (SDPA here) in tests/test_fused.py; layers, paths and
training under autocast in tests/test_mixed_precision.py; compiled ``check_numerics`` NaN rows
in tests/test_compiled.py.

Expected values come from the float64 reference files, the NumPy backend, tests/naive.py or
the reference gradients, never from the torch code under test.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, cast

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
from tests.harness import max_diff

DTYPES = {name: getattr(torch, name) for name in ("float16", "bfloat16", "float32", "float64")}


def out_of(result: Any) -> np.ndarray:
    return result.detach().double().numpy()


# -- torch.compile --------------------------------------------------------------------------

def mha_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, 5, 12, generator=g), torch.randn(2, 7, 10, generator=g), torch.tensor([3, 7])


def relative_inputs() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(2)
    return tuple(torch.randn(2, n, d, generator=g) for n, d in ((4, 10), (6, 7), (6, 9)))


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
         (torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.tensor([3, 1])), {}),
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


# -- state_dict, buffers, lazy parameters, dtype and device moves -------------------------------

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


# -- the ops, torch.func -------------------------------------------------------------------

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


# -- unknown sequence lengths: torch.export and ONNX are in tests/test_export.py ----------------

# -- torch.autocast -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
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
    with torch.autocast("cpu", dtype=DTYPES[dtype]):
        assert block(X).dtype == ours(X).dtype
        assert mha(X, X, X).dtype == theirs(X, X, X)[0].dtype == DTYPES[dtype]
        assert ffn(X).dtype == torch.nn.Linear(12, 20)(X).dtype == DTYPES[dtype]
        wider = torch.promote_types(X.dtype, DTYPES[dtype])  # torch's promotion, as in X + Y
        assert torch_layers.AddNorm(12)(X, X.to(DTYPES[dtype])).dtype == wider


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


def _attention_args(t: int, key_width: int = 10) -> tuple[torch.Tensor, ...]:
    return _x(2, t, 12), _x(2, t + 1, key_width), _x(2, t + 1, 9), torch.tensor([2, t + 1])


_causal = functools.partial(Calling, causal=True)
_Args = Callable[[int], tuple[torch.Tensor, ...]]
_seq: _Args = lambda t: (_x(2, t, 12),)  # noqa: E731
_ids: _Args = lambda t: (torch.arange(2 * t).reshape(2, t) % 11, torch.tensor([t, 2]))  # noqa: E731
TRACED: dict[str, tuple[Callable[[], torch.nn.Module], _Args]] = {
    "DotProductAttention": (torch_layers.DotProductAttention, lambda t: _attention_args(t, 12)),
    "DotProductAttention-fused-causal": (
        lambda: _causal(torch_layers.DotProductAttention(keep_attention_weights=False)),
        lambda t: _attention_args(t, 12)[:3]),
    "AdditiveAttention-causal": (lambda: _causal(torch_layers.AdditiveAttention(8)), _attention_args),
    "MultiHeadAttention": (lambda: torch_layers.MultiHeadAttention(12, 3, bias=True), _attention_args),
    "MultiHeadAttention-fused-causal": (lambda: _causal(torch_layers.MultiHeadAttention(
        12, 3, keep_attention_weights=False)), _attention_args),
    "RelativeMultiHeadAttention-causal": (
        lambda: _causal(torch_layers.RelativeMultiHeadAttention(12, 3, 2)), _attention_args),
    "TransformerEncoderBlock": (lambda: torch_layers.TransformerEncoderBlock(12, 20, 3),
                                lambda t: (_x(2, t, 12), torch.tensor([2, t]))),
    "TransformerEncoderBlock-fused-lens2d": (
        lambda: torch_layers.TransformerEncoderBlock(12, 20, 3, keep_attention_weights=False),
        lambda t: (_x(2, t, 12), torch.arange(2 * t).reshape(2, t) % (t + 1))),
    "PositionalEncoding": (lambda: torch_layers.PositionalEncoding(12), _seq),
    "LearnedPositionalEncoding": (lambda: torch_layers.LearnedPositionalEncoding(12), _seq),
    "PositionWiseFFN": (lambda: torch_layers.PositionWiseFFN(20, 12), _seq),
    "AddNorm": (lambda: torch_layers.AddNorm(12), lambda t: (_x(2, t, 12), _x(2, t, 12) + 1)),
    "NadarayaWatson": (lambda: torch_layers.NadarayaWatson(True),
                       lambda t: (_x(2, t), _x(2, t + 1), _x(2, t + 1))),
    "TransformerEncoder": (lambda: torch_layers.TransformerEncoder(11, 12, 16, 3, 2), _ids),
}


def traced(module: Any, args: tuple[torch.Tensor, ...], check: bool = True) -> Any:
    """``torch.jit.trace(module, args)``, failing on any TracerWarning (a value fixed by the trace;
    with ``check``, an output the eager call does not give)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", torch.jit.TracerWarning)
        warnings.filterwarnings("ignore", "`torch.jit.trace", FutureWarning)
        warnings.filterwarnings("ignore", "`torch.jit.trace", DeprecationWarning)
        return torch.jit.trace(module, args, check_trace=check)


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
        # float32 rounding of the traced path, scaled by the outputs' magnitude where above 1
        scale = max(1.0, float(np.max(np.abs(out_of(want)))))
        assert max_diff(out_of(got), out_of(want)) <= 1e-6 * scale, t
    return len(graphs)


@functools.cache
def torch_encoder_compilations(dynamic: bool | None) -> int:
    """The bar: how often ``nn.TransformerEncoder`` compiles over the same four lengths."""
    layer = torch.nn.TransformerEncoderLayer(12, 3, 20, dropout=0.0, batch_first=True)
    encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    return compilations(encoder, lambda t: (_x(2, t, 12),), dynamic)


@pytest.mark.parametrize("dynamic", [True, None], ids=["dynamic", "default"])
@pytest.mark.parametrize("name", list(TRACED))
def test_compile_does_not_recompile_per_length(name: str, dynamic: bool | None) -> None:
    """Over four lengths a layer compiles no more often than ``nn.TransformerEncoder`` (once with
    ``dynamic=True``; twice by default: static, then dynamic), with eager's outputs."""
    bar = torch_encoder_compilations(dynamic)
    make, args = TRACED[name]
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


# -- a compiled training step --------------------------------------------------------------

def _training_gradients(fn: Callable[..., torch.Tensor], arrays: list[np.ndarray],
                        cotangent: np.ndarray, **kwargs: Any) -> list[np.ndarray]:
    """The output and the gradients of ``sum(fn(q, k, v, **kwargs) * cotangent)``."""
    q, k, v = (torch.tensor(a, requires_grad=True) for a in arrays)
    out = fn(q, k, v, **kwargs)
    (out * torch.tensor(cotangent)).sum().backward()
    return [out_of(out)] + [out_of(x.grad) for x in (q, k, v)]


def _compiled(dynamic: bool | None = None, **static: Any) -> Callable[..., torch.Tensor]:
    torch._dynamo.reset()
    return torch.compile(functools.partial(ac.dot_product_attention, **static),
                         fullgraph=True, dynamic=dynamic, backend="aot_eager")


@pytest.mark.parametrize("dynamic", [None, True], ids=["static", "dynamic"])
def test_compiled_training_step_gives_the_reference_gradients(dynamic: bool | None) -> None:
    """The fused kernel in a compiled training step (autograd recording, sizes static or
    symbolic): the output and the gradients of the queries, keys and values are the float64
    reference's, for lengths, a mask and causal masking together."""
    rng = np.random.default_rng(14)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in ((2, 3, 5, 8), (2, 3, 6, 8),
                                                                  (2, 3, 6, 4))]
    cotangent = rng.standard_normal((2, 3, 5, 4)).astype(np.float32)
    masking = {"valid_lens": torch.tensor([4, 6]), "causal": True,
               "mask": torch.tensor(rng.random((5, 6)) < 0.8)}
    got = _training_gradients(_compiled(dynamic, implementation="fused"), arrays, cotangent,
                              **masking)
    wide = [a.astype(np.float64) for a in arrays]
    want = _training_gradients(functools.partial(ac.dot_product_attention,
                                                 implementation="direct"),
                               wide, cotangent.astype(np.float64), **masking)
    for name, g, w in zip(("output", "dq", "dk", "dv"), got, want, strict=True):
        assert max_diff(g, w) <= 1e-5, name


@pytest.mark.parametrize("case", ["overflow", "inf-key", "nan-value"])
def test_compiled_check_numerics_training_step_gives_eager_gradients(case: str) -> None:
    """Inputs out of range (scores that overflow, an inf key, a NaN value) with
    ``check_numerics=True``, compiled: the output and the gradients are eager's, NaN where
    eager's are."""
    rng = np.random.default_rng(16)
    q, k, v = (rng.standard_normal((2, 2, n, 8)).astype(np.float32) for n in (3, 4, 4))
    if case == "overflow":
        q[0], k[0] = 1e19, -1e19  # example 0's scores overflow to -inf
    elif case == "inf-key":
        k[1, 0, 3] = np.inf  # a padding key of example 1
    else:
        v[0, 1, 2, 0] = np.nan  # a visible value of example 0
    cotangent = rng.standard_normal((2, 2, 3, 8)).astype(np.float32)
    lens = torch.tensor([3, 3])
    got = _training_gradients(_compiled(check_numerics=True), [q, k, v], cotangent,
                              valid_lens=lens)
    want = _training_gradients(functools.partial(ac.dot_product_attention, check_numerics=True),
                               [q, k, v], cotangent, valid_lens=lens)
    for name, g, w in zip(("output", "dq", "dk", "dv"), got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6, err_msg=name)


def test_compiled_training_step_draws_one_dropout_mask_for_both_passes() -> None:
    """With dropout, the backward pass uses the forward pass's mask: values of one-hot rows
    make the output the dropped weights ``P``, whose transpose times the cotangent is then the
    values' gradient; and two steps draw different masks."""
    rng = np.random.default_rng(15)
    q, k = (rng.standard_normal((2, 2, 6, 8)).astype(np.float32) for _ in range(2))
    v = np.broadcast_to(np.eye(6, dtype=np.float32), (2, 2, 6, 6)).copy()
    cotangent = rng.standard_normal((2, 2, 6, 6)).astype(np.float32)
    compiled = _compiled(implementation="fused", dropout=0.5)
    outs = []
    for _ in range(2):
        out, _, _, dv = _training_gradients(compiled, [q, k, v], cotangent,
                                            valid_lens=torch.tensor([5, 5]))
        assert np.count_nonzero(out == 0) > np.count_nonzero(out[..., 5:] == 0)
        assert max_diff(dv, np.swapaxes(out, -1, -2) @ cotangent) <= 1e-5
        outs.append(out)
    assert not np.array_equal(*outs)


def _overflowing(big: float) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """Queries and keys of magnitude ``big``, depth 64, whose scores overflow: example 0's two
    visible keys score -inf and its padding keys +inf; example 1 sees keys 0-2, of which key 1
    alone scores finitely (4), key 3 (padding) +inf. Returns the inputs, the lengths and the
    expected output (zeros for example 0, key 1's value for example 1)."""
    q = np.full((2, 3, 64), big)
    k = np.full((2, 4, 64), -big)
    k[0, 2:] = k[1, 3] = big
    k[1, 1] = 0.5 / big
    v = np.random.default_rng(24).integers(-8, 8, size=(2, 4, 64)).astype(np.float64)
    expected = np.zeros((2, 3, 64))
    expected[1] = v[1, 1]
    return [q, k, v], np.array([2, 3]), expected


@pytest.mark.parametrize("recorder", ["export", "export-no-grad", "jit.trace"])
def test_exported_programs_never_leak_by_default(recorder: str) -> None:
    """In a program recorded for export the automatic choice takes the direct kernel (plain
    operators), which selects the hidden scores away: overflowing scores in a padded batch
    never put weight on padding (see tests/test_numerics.py), where the eager call's SDPA,
    which adds the mask to the scores, may (outside the guarantee of the numeric policy)."""
    class Attend(torch.nn.Module):
        def forward(self, *args: torch.Tensor) -> torch.Tensor:
            return cast(torch.Tensor, ac.dot_product_attention(*args))

    for dtype, big in (("float32", 1e19), ("float64", 1e154)):
        x, lens, expected = _overflowing(big)
        args = (*(torch.tensor(a, dtype=DTYPES[dtype]) for a in x), torch.tensor(lens))
        if recorder == "jit.trace":  # not checked against an eager call, which takes SDPA
            program = traced(Attend(), args, check=False)
            assert "scaled_dot_product" not in str(program.graph)
        else:
            with torch.set_grad_enabled(recorder == "export"):
                program = torch.export.export(Attend(), args).module()
            assert "scaled_dot_product" not in str(program.graph)
        np.testing.assert_array_equal(out_of(program(*args)), expected, err_msg=dtype)


def test_repeated_calls_follow_changed_weights() -> None:
    """A layer's kept call plans follow its weights: a new width, dtype or parameter."""
    layer = torch_layers.MultiHeadAttention(8, 2).eval()
    x = torch.randn(2, 4, 8)
    for _ in range(3):
        layer(x, x, x)
    layer.W_q.kernel = torch.nn.Parameter(torch.randn(3, 8))  # queries of width 3 now
    with pytest.raises(ValueError, match=r"queries last dimension \(8\) must be 3"):
        layer(x, x, x)
    assert layer(x[..., :3], x, x).shape == (2, 4, 8)
    layer.double()
    assert layer(x[..., :3], x, x).dtype == torch.float64  # cast to the layer's dtype
