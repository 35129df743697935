"""Gluon habits of the MXNet backend: hybridize(), parameters files, autograd.record(), deferred init.

The cross-backend files (test_reference_matrix, test_errors, test_weights, test_adapters, ...)
already run on this backend, imperatively and hybridized; these tests cover what only Gluon has.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import test_backends

if "mxnet" not in test_backends():
    pytest.skip("the mxnet backend is not tested in this env", allow_module_level=True)

import mxnet as mx
from mxnet import autograd

import attention_core as ac
import backends.mxnet as gluon_layers
from attention_core.declarations import leaves
from tests.harness import TOLERANCE, max_diff
from tests.hooks import mxnet_hooks
from tests.matrix import kept_references
from tests.reference.cases import CASES, Case
from tests.reference.generate import RETURNS_ATTENTION, record
from tests.reference.gradients import case_data, gradient_cases, key

ATTENTION = RETURNS_ATTENTION
REPO = Path(__file__).resolve().parents[1]
reference = record


def arr(x: Any, dtype: str | None = None) -> Any:
    x = np.asarray(x)
    return mx.np.array(x, dtype=dtype if dtype and x.dtype.kind == "f" else x.dtype)


def draw(*shapes: tuple[int, ...], seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


def built(cls_name: str, config: dict[str, Any], weights: dict[str, np.ndarray], dtype: str,
          hybridize: bool) -> Any:
    """A Gluon layer built the Gluon way: initialize(), cast(), then the given weights."""
    layer = getattr(gluon_layers, cls_name)(**config)
    layer.initialize()
    layer.cast(dtype)
    if weights:
        layer.set_weights({n: w.astype(dtype) for n, w in weights.items()})
    if hybridize:
        layer.hybridize()
    return layer


def run(layer: Any, case: Case, ref: dict[str, np.ndarray], dtype: str) -> dict[str, np.ndarray]:
    """Calls a layer on a case's inputs; returns its output and attention weights as NumPy."""
    inputs = [arr(ref[f"input.{name}"], dtype) for name in case.inputs]
    kwargs = {k[5:]: (bool(v) if k == "call.causal" else arr(v))
              for k, v in ref.items() if k.startswith("call.")}
    got: dict[str, np.ndarray] = {}
    if case.layer in ATTENTION:
        out, attn = layer(*inputs, return_attention=True, **kwargs)
        got["attention"] = attn.asnumpy()
    else:
        out = layer(*inputs, **kwargs)
    kept = layer.attention_weights
    if layer.attention_kind == "nested":  # the decoder layers: one quantity per array
        got.update({f"attention_attr.{i}": w.asnumpy() for i, w in enumerate(leaves(kept))})
    elif isinstance(kept, list):  # the encoder: one array per block
        got["attention_attr"] = np.stack([w.asnumpy() for w in kept])
    elif kept is not None:
        got["attention_attr"] = kept.asnumpy()
    got["out"] = out.asnumpy()
    return got


# -- hybridize(): the same numbers as imperative calls and the reference files -------------


@pytest.mark.parametrize("case", [pytest.param(c, id=f"{c.layer}-{c.name}") for c in CASES])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_hybridized_matches_imperative_and_reference(case: Case, dtype: str) -> None:
    ref = reference(case)
    weights = {k[7:]: v for k, v in ref.items() if k.startswith("weight.")}
    imperative = built(case.layer, case.config, weights, dtype, hybridize=False)
    hybrid = built(case.layer, case.config, weights, dtype, hybridize=True)
    expected = run(imperative, case, ref, dtype)
    run(hybrid, case, ref, dtype)
    got = run(hybrid, case, ref, dtype)  # the second call runs the cached graph
    assert hybrid._cached_op is not None, "hybridize() built no graph"
    assert set(got) == set(expected)
    for name in expected:
        assert max_diff(got[name], expected[name]) <= TOLERANCE[dtype], name
    assert max_diff(got["out"], ref["output.out"]) <= TOLERANCE[dtype]
    for quantity, value in kept_references(ref).items():
        assert max_diff(got[quantity], value) <= TOLERANCE[dtype], quantity


def test_graph_is_rebuilt_for_new_shapes_and_options() -> None:
    """One hybridized layer, calls alternating shapes, masks and causal: each as imperative."""
    rng = np.random.default_rng(3)
    weights = {n: rng.standard_normal((6, 8) if n != "W_o.kernel" else (8, 8))
               for n in ("W_q.kernel", "W_k.kernel", "W_v.kernel", "W_o.kernel")}
    imperative = built("MultiHeadAttention", {"num_hiddens": 8, "num_heads": 2}, weights, "float32",
                       hybridize=False)
    hybrid = built("MultiHeadAttention", {"num_hiddens": 8, "num_heads": 2}, weights, "float32",
                   hybridize=True)
    small, large = draw((2, 3, 6)), draw((3, 5, 6), seed=1)
    calls = [(small, {}), (large, {}), (small, {"causal": True}), (small, {"valid_lens": [1, 3]}),
             (large, {"mask": np.tril(np.ones((5, 5), bool))}), (small, {})]
    for (x,), kwargs in calls:
        kw = {k: (arr(v) if isinstance(v, np.ndarray) else v) for k, v in kwargs.items()}
        a = imperative(arr(x), arr(x), arr(x), **kw).asnumpy()
        b = hybrid(arr(x), arr(x), arr(x), **kw).asnumpy()
        assert b.shape == (x.shape[0], x.shape[1], 8)
        # float32 rounding, relative to the outputs' scale: the graph forms the kept weights
        # on the direct path, the imperative call pools blockwise and forms them on read
        assert max_diff(b, a) <= 1e-6 * max(1.0, np.abs(a).max()), kwargs


# -- the seeds' own usage ----------------------------------------------------------------------


@pytest.mark.parametrize("hybridize", [False, True], ids=["imperative", "hybridized"])
def test_float_valid_lens_are_refused(hybridize: bool) -> None:
    """The d2l MXNet chapter passes float valid_lens; this library asks for integers."""
    attention = gluon_layers.MultiHeadAttention(100, 5, 0.5)
    attention.initialize()
    if hybridize:
        attention.hybridize()
    X = mx.np.ones((2, 4, 100))
    with pytest.raises(TypeError, match=r"^valid_lens must have an integer dtype, got float32$"):
        attention(X, X, X, mx.np.array([3.0, 2.0]))


# -- deferred initialisation -------------------------------------------------------------------


def test_uninitialized_layer_raises_gluons_error() -> None:
    layer = gluon_layers.AddNorm(4)
    x = mx.np.ones((1, 2, 4))
    with pytest.raises(RuntimeError, match="has not been initialized"):
        layer(x, x)


def test_symbol_inputs_are_refused_with_a_reason() -> None:
    layer = gluon_layers.DotProductAttention()
    x = mx.sym.var("x").as_np_ndarray()
    with pytest.raises(TypeError, match="build their graph from arrays of known shapes"):
        layer(x, x, x)
    parent = mx.gluon.nn.HybridSequential()
    parent.add(gluon_layers.PositionalEncoding(8, max_len=10))
    parent.initialize()
    parent.hybridize()
    with pytest.raises(TypeError, match=r"^PositionalEncoding was called with Symbols"):
        parent(mx.np.zeros((2, 5, 8)))


def test_hybridized_children_of_an_imperative_parent() -> None:
    net = mx.gluon.nn.Sequential()
    net.add(gluon_layers.PositionalEncoding(8, max_len=10), gluon_layers.PositionWiseFFN(12, 8))
    net.initialize()
    X = arr(draw((2, 5, 8))[0])
    expected = net(X).asnumpy()
    net.hybridize()  # hybridizes the children
    for _ in range(2):
        got = net(X).asnumpy()
    assert all(child._cached_op is not None for child in net)
    assert max_diff(got, expected) <= 1e-6


# -- parameters files and export -------------------------------------------------------------


#: Layers to export and the inputs a caller gives them (the names SymbolBlock.imports takes).
EXPORTS = {
    "mha": (lambda: gluon_layers.MultiHeadAttention(8, 2, bias=True),
            lambda: [*(arr(x) for x in draw((2, 4, 8), (2, 6, 8), (2, 6, 5))),
                     mx.np.array([3, 6], dtype="int32")]),
    "dot": (lambda: gluon_layers.DotProductAttention(),
            lambda: [arr(x) for x in draw((2, 4, 8), (2, 6, 8), (2, 6, 5))]),
    "additive": (lambda: gluon_layers.AdditiveAttention(6),
                 lambda: [*(arr(x) for x in draw((2, 4, 3), (2, 6, 8), (2, 6, 5))),
                          mx.np.array([3, 6], dtype="int32")]),
    "relative": (lambda: gluon_layers.RelativeMultiHeadAttention(8, 2, 2),
                 lambda: [arr(x) for x in draw((2, 4, 8), (2, 4, 8), (2, 4, 8))]),
    "block": (lambda: gluon_layers.TransformerEncoderBlock(8, 12, 2),
              lambda: [arr(draw((2, 5, 8))[0]), mx.np.array([3, 5], dtype="int32")]),
    "positional": (lambda: gluon_layers.PositionalEncoding(8, max_len=20),
                   lambda: [arr(draw((2, 5, 8))[0])]),
    "encoder": (lambda: gluon_layers.TransformerEncoder(10, 8, 12, 2, 2),
                lambda: [mx.np.array([[1, 2, 3, 9, 0], [4, 5, 0, 0, 0]], dtype="int32")]),
    "encoder_lens": (lambda: gluon_layers.TransformerEncoder(10, 8, 12, 2, 2),
                     lambda: [mx.np.array([[1, 2, 3, 9, 0], [4, 5, 0, 0, 0]], dtype="int32"),
                              mx.np.array([4, 2], dtype="int32")]),
}


@pytest.mark.parametrize("kind", list(EXPORTS))
def test_export_takes_only_the_callers_inputs_and_returns_the_output(
    tmp_path: Path, kind: str
) -> None:
    """``SymbolBlock.imports`` with the caller's inputs alone gives the block's one output."""
    make, inputs = EXPORTS[kind]
    layer = make()
    layer.initialize()
    layer.hybridize()
    args = inputs()
    out = layer(*args).asnumpy()
    layer.export(str(tmp_path / kind))
    names = ["data"] if len(args) == 1 else [f"data{i}" for i in range(len(args))]
    symbol = mx.sym.load(str(tmp_path / f"{kind}-symbol.json"))
    assert len(symbol.list_outputs()) == 1
    params = set(mx.npx.load(str(tmp_path / f"{kind}-0000.params")))
    assert set(symbol.list_inputs()) == set(names) | {name.partition(":")[2] for name in params}
    imported = mx.gluon.SymbolBlock.imports(str(tmp_path / f"{kind}-symbol.json"), names,
                                            str(tmp_path / f"{kind}-0000.params"))
    got = imported(*args)
    assert isinstance(got, mx.np.ndarray)  # one output, not a list
    np.testing.assert_array_equal(got.asnumpy(), out)


# -- gradients: hybridized graphs and a fully masked row ------------------------------------


@pytest.mark.parametrize("case", gradient_cases(), ids=key)
def test_hybridized_gradients_equal_imperative(case: Case) -> None:
    inputs, weights, call = case_data(case)
    kwargs = {k: (v if k == "causal" else arr(v)) for k, v in call.items()}
    ct = np.random.default_rng(0).standard_normal(reference(case)["output.out"].shape)
    grads = []
    for hybridize in (False, True):
        layer = built(case.layer, case.config, weights, "float64", hybridize)
        grads.append(mxnet_hooks.gradients(layer, [arr(x) for x in inputs], kwargs, ct))
    assert set(grads[0]) == set(grads[1])
    for name, g in grads[0].items():
        assert max_diff(grads[1][name], g) <= TOLERANCE["float64"], name


def test_masked_scores_get_no_gradient() -> None:
    """Keys a query cannot see do not move its output: d out / d keys is zero for them.

    MXNet 1.9's ``where(cond, x, scalar)`` sends the gradient to the wrong branch; the ops
    avoid it, and this would catch it coming back.
    """
    q, k, v = draw((1, 2, 3), (1, 4, 3), (1, 4, 2))
    keys = arr(k, "float64")
    keys.attach_grad()
    with autograd.record():
        out = ac.dot_product_attention(arr(q, "float64"), keys, arr(v, "float64"),
                                       mx.np.array([2], dtype="int32"))
    out.backward()
    grad = keys.grad.asnumpy()
    np.testing.assert_array_equal(grad[0, 2:], 0.0)
    assert np.all(np.abs(grad[0, :2]) > 0)


@pytest.mark.parametrize("wanted", ["q", "k", "v", "qv", "same"])
def test_recomputed_gradients_reach_the_inputs_that_ask(wanted: str) -> None:
    """The recomputed blockwise backward (an ``autograd.Function``) gives each input that has a
    gradient the direct path's, whichever others are plain arrays (MXNet routes a Function's
    gradients wrongly to inputs outside the recorded graph unless they are tied into it), and
    when one array is the queries, keys and values at once."""
    q, k, v = draw((2, 2, 7, 4), (2, 2, 9, 4), (2, 2, 9, 3), seed=3)
    if wanted == "same":
        q = k = v = draw((2, 2, 7, 4), seed=4)[0]
    ct = arr(np.random.default_rng(5).standard_normal((2, 2, 7, v.shape[-1])), "float64")
    grads = {}
    for impl in ("direct", "blockwise"):
        arrays = [arr(x, "float64") for x in (q, k, v)]
        if wanted == "same":
            arrays = [arrays[0]] * 3
        asking = [arrays[0]] if wanted == "same" else [arrays["qkv".index(c)] for c in wanted]
        for x in asking:
            x.attach_grad()
        with autograd.record():
            out = ac.dot_product_attention(*arrays, mx.np.array([5, 7], dtype="int32"),
                                           implementation=impl)
        out.backward(ct)
        grads[impl] = [x.grad.asnumpy() for x in asking]
    for got, want in zip(grads["blockwise"], grads["direct"], strict=True):
        assert np.abs(want).max() > 0
        assert max_diff(got, want) <= TOLERANCE["float64"]


# -- RelativeMultiHeadAttention and TransformerEncoder: the Gluon habits ----------------------

ENCODER = {"vocab_size": 9, "num_hiddens": 8, "ffn_num_hiddens": 10, "num_heads": 2, "num_blks": 2}


def tokens(*shape: int, high: int = 9, seed: int = 0, dtype: str = "int64") -> Any:
    return mx.np.array(np.random.default_rng(seed).integers(0, high, shape), dtype=dtype)


def new_layer(name: str, hybridize: bool = False, **config: Any) -> Any:
    layer = getattr(gluon_layers, name)(**config)
    layer.initialize()
    if hybridize:
        layer.hybridize()
    return layer


def test_hybridized_encoder_rebuilds_its_graph_and_table() -> None:
    """New lengths need a new sinusoidal table (an input of the graph), a cast a new graph:
    each call as imperative."""
    imperative = new_layer("TransformerEncoder", **ENCODER)
    hybrid = gluon_layers.TransformerEncoder(**ENCODER)
    ids5, ids3 = tokens(2, 5), tokens(3, 3, seed=1, dtype="int32")
    imperative(ids5)
    hybrid.set_weights(imperative.get_weights())
    hybrid.hybridize()
    for ids in (ids5, ids3, ids5, ids3):
        assert max_diff(hybrid(ids).asnumpy(), imperative(ids).asnumpy()) <= 1e-6
    for layer in (imperative, hybrid):
        layer.cast("float64")
    want = imperative(ids3)
    got = hybrid(ids3)
    assert got.dtype == np.float64
    assert max_diff(got.asnumpy(), want.asnumpy()) <= 1e-12


# -- what MXNet cannot compute is refused up front -------------------------------------

FP16_REFUSAL = ("dtype float16 is not supported by the mxnet backend: MXNet multiplies float16 "
                "matrices on GPU only; use float32 or float64 on CPU")


@pytest.mark.parametrize("hybridize", [False, True], ids=["imperative", "hybridized"])
def test_float16_matrix_products_on_cpu_are_refused_before_any_work(hybridize: bool) -> None:
    """float16 inputs of what multiplies matrices (no weights to cast them to) get the
    library's TypeError, not MXNetError from inside the graph; a float32 layer casts them."""
    x = mx.np.array(np.ones((2, 3, 8)), dtype="float16")
    for call in (lambda: ac.dot_product_attention(x, x, x),
                 lambda: ac.position_wise_ffn(x, {}),
                 lambda: ac.nadaraya_watson(x[:, 0], x[:, 1], x[:, 2])):
        with pytest.raises(TypeError) as info:
            call()
        assert str(info.value).endswith(FP16_REFUSAL)
    layer = gluon_layers.DotProductAttention()
    layer.initialize()
    if hybridize:
        layer.hybridize()
    with pytest.raises(TypeError) as info:
        layer(x, x, x)
    assert str(info.value) == "queries " + FP16_REFUSAL
    weighted = gluon_layers.MultiHeadAttention(8, 2)
    weighted.initialize()
    if hybridize:
        weighted.hybridize()
    assert weighted(x, x, x).dtype == np.float32


@pytest.mark.parametrize("dtype", ["int16", "uint16", "uint32", "uint64"])
def test_integer_dtypes_mxnet_lacks_are_taken(dtype: str) -> None:
    """Lengths and token ids of integer dtypes MXNet has no arrays of (uint64, int16, ...)."""
    layer = gluon_layers.TransformerEncoder(11, 12, 16, 3, 1)
    layer.initialize()
    tokens = np.array([[1, 2, 3, 4], [5, 6, 0, 0]])
    expected = layer(arr(tokens), arr(np.array([4, 2]))).asnumpy()
    got = layer(tokens.astype(dtype), np.array([4, 2], dtype))
    np.testing.assert_array_equal(got.asnumpy(), expected)
    assert layer([[1, 2, 3]]).shape == (1, 3, 12)  # a Python list of ids is fine


_TRAINING_MEMORY = """
import gc, json
from pathlib import Path
import numpy as np
import mxnet as mx
import attention_core as ac
import backends.mxnet

def status(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

def step(n, d):
    rng = np.random.default_rng(0)
    data = [rng.standard_normal((1, 1, n, d)).astype(np.float32) for _ in range(3)]
    def run():
        arrays = [mx.np.array(x) for x in data]
        for x in arrays:
            x.attach_grad()
        with mx.autograd.record():
            out = ac.dot_product_attention(*arrays, implementation="blockwise")
        out.backward()
        mx.nd.waitall()
        return [x.grad for x in arrays]
    return run

step(16, 16)()
run = step(8192, 256)
gc.collect()
Path("/proc/self/clear_refs").write_text("5")
base = status("VmRSS")
grads = run()
print(json.dumps({"extra": status("VmHWM") - base}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_recomputed_training_memory() -> None:
    """Forward + backward of the blockwise path under ``autograd.record()`` at (1, 1, 8192, 256)
    fp32 (A = 8 MiB, the size of each input; 32 query blocks of 8 key blocks) holds the inputs,
    their gradients, the output, its incoming gradient, key and value blocks and their
    gradients, the queries' gradient and one query block's tiles. Measured by this code: 52.3 A
    with the recomputation of commit a061946 (the inputs tied into the graph by copies, sums
    beside the new gradients, and the forward queueing every block's operators at once), 19.6 A
    with only the forward's queueing left, 16.0-16.6 A now."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", _TRAINING_MEMORY], capture_output=True, text=True,
                         cwd=REPO, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    extra = json.loads(out.stdout.strip().splitlines()[-1])["extra"]
    array = 8192 * 256 * 4
    assert extra <= 18.5 * array, f"{extra / array:.1f} arrays of extra memory"
