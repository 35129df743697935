"""Layers and the core's loops in each framework's compiled mode, tested once over the hooks.

A layer compiled (``jax.jit``, ``tf.function(jit_compile=True)``, ``hybridize()``) gives its
eager output, attention weights and gradients, and the float64 reference's; gradients also
match central differences of the reference. A compiled encoder serves two input lengths. The
blockwise loops compile to loops (the program does not grow with the length), equal the direct
path under compilation, and draw a fresh dropout mask in every block. ``torch.compile`` with
Inductor costs seconds per graph: its cases stay in tests/test_torch.py and the matrix; here
torch runs only ``check_numerics``' NaN rows, captured by ``torch.compile(backend="eager")``.

Hooks used besides the harness's (``tests/hooks/<backend>_hooks.py``), for backends whose ops
run the blockwise loops as the framework's own loops (the others skip, saying why):

* ``compiled_function(fn) -> fn``: a plain function compiled as one program;
* ``loop_program(fn, arrays) -> (has_loop, size)``: whether the program of ``fn(*arrays)``
  holds a loop primitive, and a measure of its length;
* ``dropout_program(fn, seed) -> run``: ``run()`` is ``fn(ops)`` compiled, ``ops`` drawing
  dropout from a generator seeded by ``seed``, a new draw at each call of ``run``;
* ``unknown_shape_function(fn, arrays, widths, jit_compile) -> (fn, traces)``: ``fn`` traced
  once for ``arrays`` of any shape (the last dimension of the first ``widths`` kept), and its
  number of traces (TensorFlow's ``input_signature``);
* ``graph_gradients(fn, arrays, cotangent, traced) -> list``: the gradients of
  ``sum(fn(*arrays) * cotangent)`` by each array, eagerly or differentiated in a graph.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import attention_core as ac
import backends.numpy as numpy_layers
from attention_core import kernels
from attention_core.kernels import blockwise
from tests import naive
from tests.harness import (
    FASTEST_GRADIENT_MODE,
    QUICK_COMPILED_MODES,
    TOLERANCE,
    Harness,
    max_diff,
)
from tests.reference.cases import MASK_KINDS, mask_arguments

#: These tests run on the columns too (conftest.py; tests.harness.COLUMNS).
COLUMN_TESTS = True

TOL = TOLERANCE["float32"]
#: The compiled modes run here: the quick ones, and JAX's jit (seconds per trace, so only here
#: and in the matrix).
COMPILED = {**QUICK_COMPILED_MODES, "jax": ("jit",)}
#: Compiled and eager runs of a float32 program agree to this (arithmetic reordered): the
#: float32 tolerance, and JAX's jit to 1e-6 as tests/test_jax.py had it (TensorFlow's XLA
#: reorders gradient sums by up to 2e-6).
SAME = {"jax": 1e-6}
#: Backends where every masking runs through the compiled blockwise and fused paths; XLA on
#: TensorFlow compiles the loops in seconds: 'combined' holds every masking at once there (and
#: tests/test_adapters.py runs three kinds of compiled blockwise layers).
EVERY_MASKING = ("jax",)
#: Backends whose compiled functional encoder runs at two lengths here (TensorFlow's: the
#: unknown-length tf.function of tests/test_tensorflow.py, one trace for both).
FUNCTIONAL_ENCODER = ("jax",)


def draw(*shapes: tuple[int, ...], seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


def has_fused_kernel(h: Harness) -> bool:
    """Whether the backend registers a ``"fused"`` kernel."""
    return any(entry.name == "fused" for entry in kernels.kernels(h.ops.name))


def compiled_modes(h: Harness) -> tuple[str, ...]:
    if not COMPILED.get(h.name):
        pytest.skip(f"no compiled mode of {h.name} runs here (torch.compile: tests/test_torch.py)")
    return COMPILED[h.name]


def function_hook(h: Harness, name: str) -> Any:
    hook = getattr(h.hooks, name, None)
    if hook is None:
        pytest.skip(f"{h.name} has no {name}: its ops run the blockwise loops in Python")
    return hook


# -- a compiled layer equals the eager one and the reference, gradients included ------------

LENS_2D = np.array([[1, 2, 3, 5], [5, 4, 0, 2]])  # example 1, query 2: nothing visible
#: name: (config, input shapes, call arrays, causal, (weight, index) and input index whose
#: gradients are checked against central differences of the float64 reference).
LAYERS: dict[str, Any] = {
    "MultiHeadAttention": (
        {"num_hiddens": 8, "num_heads": 2, "bias": True}, [(2, 4, 6), (2, 5, 7), (2, 5, 3)],
        {"valid_lens": LENS_2D, "mask": np.random.default_rng(3).random((4, 5)) < 0.7}, True,
        [("W_q.kernel", (1, 2)), ("W_k.kernel", (4, 0)), ("W_v.kernel", (2, 3)),
         ("W_o.kernel", (3, 1)), ("W_o.bias", (5,))], (1, 3, 4)),
    "RelativeMultiHeadAttention": (
        {"num_hiddens": 8, "num_heads": 2, "max_relative_position": 3, "bias": True},
        [(2, 4, 6), (2, 5, 7), (2, 5, 7)], {"valid_lens": LENS_2D}, True,
        [("rel_k.embedding", (2, 1)), ("rel_v.embedding", (4, 3)), ("W_q.kernel", (1, 2))],
        (0, 2, 5)),
    "TransformerEncoderBlock": (
        {"num_hiddens": 8, "ffn_num_hiddens": 16, "num_heads": 2, "bias": True}, [(2, 5, 8)],
        {"valid_lens": np.array([3, 5]), "mask": np.tril(np.ones((5, 5), bool))}, False,
        [("attention.W_q.kernel", (1, 2)), ("attention.W_v.bias", (3,)),
         ("addnorm1.ln.gamma", (4,)), ("ffn.dense1.kernel", (5, 9))], (1, 3, 6)),
}


#: The layers whose eager gradients are compared with the compiled ones on a backend of
#: FASTEST_GRADIENT_MODE (JAX: an eager backward pass compiles each primitive on its own, for
#: seconds); elsewhere every layer's are. The compiled gradients of every layer are checked
#: against central differences of the reference in any case.
EAGER_GRADIENTS = ("MultiHeadAttention",)


def reference(name: str, inputs: list[np.ndarray], w: dict[str, np.ndarray],
              call: dict[str, np.ndarray], causal: bool) -> tuple[np.ndarray, np.ndarray]:
    """The float64 output and attention weights of layer ``name``."""
    x = inputs[0]
    H = LAYERS[name][0]["num_heads"]
    vis = naive.visible(x.shape[0], H, x.shape[1], inputs[-1].shape[1], call.get("valid_lens"),
                        call.get("mask"), causal)
    if name == "TransformerEncoderBlock":
        return naive.encoder_block(x, w, H, vis)
    pool = naive.multi_head if name == "MultiHeadAttention" else naive.relative_multi_head
    return pool(*inputs, w, H, vis)


def central_difference(f: Any, x: np.ndarray, idx: tuple[int, ...], eps: float = 1e-6) -> float:
    up, down = x.copy(), x.copy()
    up[idx] += eps
    down[idx] -= eps
    return float(f(up) - f(down)) / (2 * eps)


@pytest.mark.parametrize("name", list(LAYERS))
def test_compiled_layer_equals_eager_and_the_reference(backend: str, name: str) -> None:
    """Output, returned and kept attention weights, and the gradients by every input and
    weight, compiled and eager (eager gradients: see EAGER_GRADIENTS): equal to each other, the
    outputs to the float64 reference, the gradients to its central differences; a query that
    sees no key has weights 0, an input gradient 0 and finite gradients elsewhere."""
    h = Harness(backend)
    modes = compiled_modes(h)
    config, shapes, call, causal, entries, entry = LAYERS[name]
    asks = {} if name == "TransformerEncoderBlock" else {"return_attention": True}
    static = {"causal": True} if causal else {}
    inputs = draw(*shapes, seed=len(name))
    (ct,) = draw((*shapes[0][:2], config["num_hiddens"]), seed=5)
    layer = h.make(name, config)
    arrays = [h.array(x) for x in [*inputs, *call.values()]]
    h.call(layer, *arrays[:len(inputs)])  # sizes inferred
    w = {k: np.asarray(v, np.float64) for k, v in layer.get_weights().items()}
    x64 = [x.astype(np.float64) for x in inputs]
    out64, attn64 = reference(name, x64, w, call, causal)

    def forward(m: Any, *xs: Any) -> dict[str, Any]:
        result = h.call(m, *xs[:len(inputs)], **dict(zip(call, xs[len(inputs):], strict=True)),
                        **static, **asks)
        if not asks:
            return {"out": result}
        return {"out": result[0], "attention": result[1], "kept": h.attention_weights(m)}

    def differentiated(m: Any, *xs: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        return h.forward_and_gradients(m, forward, list(xs), ct)

    if h.name not in FASTEST_GRADIENT_MODE or name in EAGER_GRADIENTS:
        eager, eager_grads = ({k: h.numpy(v) for k, v in part.items()}
                              for part in h.run("eager", layer, differentiated, arrays))
    else:
        eager, eager_grads = {k: h.numpy(v) for k, v in forward(layer, *arrays).items()}, {}
    vis = naive.visible(2, config["num_heads"], *attn64.shape[-2:], call.get("valid_lens"),
                        call.get("mask"), causal)
    hidden = ~vis.any(-1)[:, 0]  # (B, Q): queries that see no key
    if name == "MultiHeadAttention":
        assert hidden[1, 2]

    def loss64(weights: dict[str, np.ndarray], xs: list[np.ndarray]) -> float:
        return float(np.sum(reference(name, xs, weights, call, causal)[0] * ct))

    fd = {n: central_difference(lambda a, n=n: loss64({**w, n: a}, x64), w[n], idx)
          for n, idx in entries}
    fd_input = central_difference(lambda a: loss64(w, [a, *x64[1:]]), x64[0], entry)
    same = SAME.get(h.name, TOL)
    for mode in modes:
        result, grads = ({k: h.numpy(v) for k, v in part.items()}
                         for part in h.run(mode, layer, differentiated, arrays))
        assert max_diff(result["out"], out64) <= TOL, mode
        for key, value in result.items():
            assert max_diff(value, eager[key]) <= same, (mode, key)
        if asks:
            assert max_diff(result["attention"], attn64) <= TOL, mode
            np.testing.assert_array_equal(result["kept"], result["attention"])
            np.testing.assert_array_equal(result["attention"][~vis], 0.0)
        inputs_wrt = {f"input.{i}" for i in range(len(inputs))}
        assert set(grads) == inputs_wrt | {f"weight.{n}" for n in w}
        assert set(eager_grads) in (set(), set(grads))
        for key, g in grads.items():
            assert np.isfinite(g).all(), (mode, key)
            if eager_grads:
                assert max_diff(g, eager_grads[key]) <= same, (mode, key)
        np.testing.assert_array_equal(grads["input.0"][hidden], 0.0)
        for n, idx in entries:
            got = grads[f"weight.{n}"][idx]
            assert abs(got - fd[n]) <= 1e-4 * max(1.0, abs(fd[n])), (mode, n)
        assert abs(grads["input.0"][entry] - fd_input) <= 1e-4 * max(1.0, abs(fd_input)), mode


# -- a compiled encoder at two lengths ------------------------------------------------------

ENCODER = {"vocab_size": 11, "num_hiddens": 12, "ffn_num_hiddens": 16, "num_heads": 3,
           "num_blks": 2}


def test_compiled_encoder_at_two_lengths(backend: str) -> None:
    """One compiled layer at 4 and 13 tokens: the eager output and the float64 reference at
    each; so is the functional API compiled (JAX), and both as one function of any length
    traced once (``unknown_length_function``, TensorFlow). Ids of the wrong rank are refused by
    the shape check, which runs while compiling."""
    h = Harness(backend)
    modes = compiled_modes(h)
    encoder = h.make("TransformerEncoder", ENCODER)
    tokens = np.random.default_rng(7).integers(0, 11, (2, 13)).astype(np.int32)
    h.call(encoder, h.array(tokens[:, :4]))
    w = {k: np.asarray(v, np.float64) for k, v in encoder.get_weights().items()}

    def functional(t: Any) -> Any:
        return ac.transformer_encoder(t, {k: h.array(v, "float32") for k, v in w.items()}, 3)

    functions = {}
    if h.name in FUNCTIONAL_ENCODER:
        functions["functional"] = (h.hook("compiled_function")(functional), None)
    any_length = getattr(h.hooks, "unknown_length_function", None)
    if any_length is not None:
        functions["layer, any length"] = any_length(lambda t: h.call(encoder, t))
        functions["functional, any length"] = any_length(functional)
    for steps in (4, 13):
        part = tokens[:, :steps]
        want, _ = naive.transformer_encoder(part, w, 3, np.ones((2, 3, steps, steps), bool))
        eager = h.numpy(h.call(encoder, h.array(part)))
        assert max_diff(eager, want) <= 1e-4
        for mode in modes:
            got = h.numpy(h.run(mode, encoder, lambda m, t: h.call(m, t), [h.array(part)]))
            assert max_diff(got, want) <= 1e-4 and max_diff(got, eager) <= SAME.get(h.name, TOL)
        for name, (fn, _) in functions.items():
            assert max_diff(h.numpy(fn(h.array(part))), want) <= 1e-4, name
    for name, (_, traces) in functions.items():
        assert traces is None or traces() == 1, name  # one trace served both lengths
    for mode in modes:
        with pytest.raises(ValueError, match="tokens"):
            h.run(mode, encoder, lambda m, t: h.call(m, t), [h.array(tokens[0])])


# -- a layer traced once for inputs of unknown shape, in every masking ----------------------

#: layer: (config, input shapes, whether ``causal`` may be given).
UNKNOWN = {
    "MultiHeadAttention": ({"num_hiddens": 12, "num_heads": 3, "bias": True},
                           [(2, 4, 10), (2, 6, 7), (2, 6, 9)], True),
    "TransformerEncoderBlock": ({"num_hiddens": 12, "ffn_num_hiddens": 16, "num_heads": 3,
                                 "bias": True}, [(2, 6, 12)], False),
}
#: Mask kinds also traced for XLA with unknown shapes (each XLA compile takes seconds).
UNKNOWN_XLA_KINDS = ("valid_lens_1d", "valid_lens_2d", "mask_4d", "causal_valid_lens",
                     "fully_masked_row")
UNKNOWN_CASES = [pytest.param(layer, kind, id=f"{layer}-{kind}")
                 for layer, (_, _, causal) in UNKNOWN.items() for kind in MASK_KINDS
                 if causal or not kind.startswith("causal")]


def doubled(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The masking arguments for the inputs repeated twice along the batch axis."""
    out = dict(kwargs)
    if "valid_lens" in out:
        out["valid_lens"] = np.concatenate([out["valid_lens"]] * 2)
    if "mask" in out and out["mask"].ndim >= 3:
        out["mask"] = np.concatenate([out["mask"]] * 2)
    return out


@pytest.mark.parametrize("layer, kind", UNKNOWN_CASES)
def test_a_layer_traced_for_unknown_shapes_serves_two_batch_sizes(
    backend: str, layer: str, kind: str,
) -> None:
    """A float32 layer holding the float64 NumPy layer's weights, traced once with every
    dimension unknown but the input widths (``unknown_shape_function``; XLA too for
    :data:`UNKNOWN_XLA_KINDS`), and compiled with every shape known for ``valid_lens_1d``: the
    eager output, which equals the reference; the traces serve twice the batch, unretraced."""
    h = Harness(backend)
    trace = getattr(h.hooks, "unknown_shape_function", None)
    if trace is None:
        pytest.skip(f"{h.name} has no unknown_shape_function: no mode traces unknown shapes")
    config, shapes, _ = UNKNOWN[layer]
    inputs = draw(*shapes, seed=len(kind))
    masking = mask_arguments(kind, np.random.default_rng(1), 3, q=shapes[0][1], k=shapes[-1][1])
    reference = getattr(numpy_layers, layer)(**config, seed=0, dtype="float64")
    reference(*[x.astype(np.float64) for x in inputs])  # infers the input sizes
    ours = h.make(layer, config)
    ours.set_weights({n: w.astype(np.float32) for n, w in reference.get_weights().items()})
    causal = bool(masking.pop("causal", False))
    extra = {"causal": causal} if layer == "MultiHeadAttention" else {}
    names = sorted(masking)  # tensors passed to the traced function, by keyword

    def call(*args: Any) -> Any:
        tensors = dict(zip(names, args[len(inputs):], strict=True))
        return h.call(ours, *args[: len(inputs)], **tensors, **extra)

    def arrays(xs: list[np.ndarray], masks: dict[str, Any]) -> list[Any]:
        return [h.array(a) for a in [*xs, *(masks[n] for n in names)]]

    first = arrays(inputs, masking)
    unknown = [trace(call, first, len(inputs), False)]
    if kind in UNKNOWN_XLA_KINDS:
        unknown.append(trace(call, first, len(inputs), True))
    graphs = [fn for fn, _ in unknown]
    if kind == "valid_lens_1d":  # XLA with every shape known, once per layer
        graphs.append(h.hook("compiled_function")(call))
    eager = h.numpy(call(*first))
    expected = reference(*[x.astype(np.float64) for x in inputs], **masking, **extra)
    assert max_diff(eager, expected) <= TOL
    for fn in graphs:
        assert max_diff(h.numpy(fn(*first)), eager) <= TOL
    twice, masking2 = [np.concatenate([x, x]) for x in inputs], doubled(masking)
    expected2 = reference(*[x.astype(np.float64) for x in twice], **masking2, **extra)
    for fn, traces in unknown:
        assert max_diff(h.numpy(fn(*arrays(twice, masking2))), expected2) <= TOL
        assert traces() == 1


# -- the blockwise loops under compilation --------------------------------------------------

#: ``(B, H, Q, K, D)`` spanning two full query blocks and a tail, and a first key block, two
#: more in the compiled loop and a tail, with the blocks of :func:`small_blocks`.
SHAPE = (2, 2, 7, 15, 4)


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of 3 queries and 4 keys for ``B * H = 4``, so small inputs span several."""
    monkeypatch.setattr(blockwise, "KEY_BLOCK", 4)
    monkeypatch.setattr(blockwise, "TILE_SCORES", 4 * 3 * 4)
    monkeypatch.setattr(blockwise, "MIN_QUERY_BLOCK", 1)


def masking(kind: str) -> dict[str, Any]:
    """Call arguments of one mask kind for :data:`SHAPE` (the fully masked rows included)."""
    B, H, Q, K, _ = SHAPE
    rng = np.random.default_rng(11)
    lens_2d = rng.integers(0, K + 1, (B, Q)).astype(np.int32)
    lens_2d[0, 3] = 0
    row_mask = rng.random((B, Q, K)) < 0.6
    row_mask[1, 2] = False
    mask_2d, mask_4d = rng.random((Q, K)) < 0.5, rng.random((B, H, Q, K)) < 0.5
    mask_2d[4], mask_4d[0, 1, 6] = False, False
    return {
        "none": {},
        "valid_lens_1d": {"valid_lens": np.array([0, 9], np.int32)},
        "valid_lens_2d": {"valid_lens": lens_2d},
        "mask_2d": {"mask": mask_2d},
        "mask_3d": {"mask": row_mask},
        "mask_4d": {"mask": mask_4d},
        "causal": {"causal": True},
        "combined": {"valid_lens": lens_2d, "mask": row_mask, "causal": True},
    }[kind]


MASKINGS = ["none", "valid_lens_1d", "valid_lens_2d", "mask_2d", "mask_3d", "mask_4d", "causal",
            "combined"]


@pytest.mark.usefixtures("small_blocks")
@pytest.mark.parametrize("kind", MASKINGS)
def test_compiled_blockwise_and_fused_equal_direct(backend: str, kind: str) -> None:
    """``dot_product_attention`` compiled, masks as arguments: the blockwise loops (and the
    fused kernel, where there is one) give the direct path's values, finite, and zero rows."""
    h = Harness(backend)
    compile_function = function_hook(h, "compiled_function")
    if h.name not in EVERY_MASKING and kind != "combined":
        pytest.skip("compiled in seconds per masking: 'combined' holds every masking")
    B, H, Q, K, D = SHAPE
    q, k, v = (h.array(x) for x in draw((B, H, Q, D), (B, H, K, D), (B, H, K, 3 * D), seed=6))
    kw = masking(kind)
    causal = kw.pop("causal", False)

    paths = {"direct": 3 * D, "blockwise": 3 * D}
    if has_fused_kernel(h):
        paths["fused"] = D  # JAX's kernel needs Dv == D

    def attend(q: Any, k: Any, v: Any, masks: dict[str, Any]) -> dict[str, Any]:
        return {path: ac.dot_product_attention(q, k, v[..., :dv], causal=causal,
                                               implementation=path, ops=h.ops, **masks)
                for path, dv in paths.items()}  # one program for every path

    got = {path: h.numpy(x) for path, x in compile_function(attend)(
        q, k, v, {n: h.array(x) for n, x in kw.items()}).items()}
    vis = naive.visible(B, H, Q, K, kw.get("valid_lens"), kw.get("mask"), causal)
    np.testing.assert_array_equal(got["direct"][~vis.any(-1)], 0.0)
    for path, dv in paths.items():
        assert np.isfinite(got[path]).all(), path
        assert max_diff(got[path], got["direct"][..., :dv]) <= TOL, path


def test_blockwise_gradients_in_a_graph_equal_the_direct_ones(
    backend: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The blockwise loops differentiated in a graph (``graph_gradients``: TensorFlow's
    ``tf.while_loop`` in a ``tf.function``) give the direct path's eager gradients, every
    masking at once, 13 queries in blocks of 4 and 19 keys in blocks of 5 (ragged tails; eager
    blockwise gradients in each masking: tests/test_adapters.py)."""
    h = Harness(backend)
    graph_gradients = getattr(h.hooks, "graph_gradients", None)
    if graph_gradients is None:
        pytest.skip(f"{h.name} has no graph_gradients: no graph mode differentiates the loops")
    B, H, Q, K = 2, 3, 13, 19
    monkeypatch.setattr(blockwise, "KEY_BLOCK", 5)
    monkeypatch.setattr(blockwise, "MIN_QUERY_BLOCK", 1)
    monkeypatch.setattr(blockwise, "TILE_SCORES", B * H * 4 * 5)
    rng = np.random.default_rng(len("combined"))
    masks = {**mask_arguments("valid_lens_2d", rng, H, Q, K, B),
             **mask_arguments("mask_3d", rng, H, Q, K, B)}
    arrays = [h.array(x) for x in draw((B, H, Q, 8), (B, H, K, 8), (B, H, K, 5), seed=Q + K)]
    (ct,) = draw((B, H, Q, 5), seed=9)

    def pooled(implementation: str) -> Any:
        return lambda q, k, v: ac.dot_product_attention(
            q, k, v, causal=True, implementation=implementation, ops=h.ops,
            **{n: h.array(x) for n, x in masks.items()})

    want = graph_gradients(pooled("direct"), arrays, ct, False)
    got = graph_gradients(pooled("blockwise"), arrays, ct, True)
    assert len(got) == len(want) == 3
    for g, w in zip(got, want, strict=True):
        assert max_diff(g, w) <= TOL


def test_the_blockwise_loops_are_compiled_not_unrolled(backend: str, small_blocks: None) -> None:
    """The program holds a loop and is no longer for 13 or 61 tokens (4 x 3 blocks, 20 x 15)."""
    h = Harness(backend)
    program = function_hook(h, "loop_program")
    sizes = []
    for n in (13, 61):
        q, k = (h.array(x) for x in draw((1, 4, n, 4), (1, 4, n, 4)))
        looped, size = program(lambda q, k, lens: ac.dot_product_attention(
            q, k, k, lens, causal=True, implementation="blockwise", ops=h.ops),
            [q, k, h.array(np.array([n - 3], np.int32))])
        assert looped, n
        sizes.append(size)
    assert sizes[0] == sizes[1]


def test_loop_ops_equal_python_loops(backend: str) -> None:
    """The ops' ``map_concat`` along each axis and ``fold``, compiled, against Python loops."""
    h = Harness(backend)
    compile_function = function_hook(h, "compiled_function")
    parts = draw((2, 3, 4), (2, 3, 4), (2, 3, 4), seed=2)
    stacked = h.array(np.stack(parts))
    for axis in range(3):
        got = compile_function(lambda s, a=axis: h.ops.map_concat(lambda i: s[i], 3, a))(stacked)
        np.testing.assert_array_equal(h.numpy(got), np.concatenate(parts, axis))
    total = compile_function(lambda s: h.ops.fold(lambda i, c: (c[0] + s[i] * h.ops.astype(
        i, "float32"),), (s[0] * 0.0,), 3))(stacked)
    assert max_diff(h.numpy(total[0]), parts[1] + 2 * parts[2]) <= TOL


def test_dropout_inside_the_loops_draws_a_new_mask_per_block(
    backend: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With ``V = I`` the output rows are the dropped weights ``w * keep / (1 - p)``: every one
    of the 8 x 8 tiles has its own mask, about half kept; the same seed gives the same masks,
    the next call or another seed new ones."""
    h = Harness(backend)
    dropout_program = function_hook(h, "dropout_program")
    monkeypatch.setattr(blockwise, "KEY_BLOCK", 8)
    monkeypatch.setattr(blockwise, "TILE_SCORES", 8 * 8)
    Q = K = 64  # 8 query blocks (compiled map) x 8 key blocks (the first, then a compiled fold)
    q, k = (h.array(x) for x in draw((1, 1, Q, 4), (1, 1, K, 4), seed=10))
    v = h.array(np.eye(K, dtype=np.float32)[None, None])

    def attend(ops: Any) -> Any:
        return ac.dot_product_attention(q, k, v, dropout=0.5, implementation="blockwise", ops=ops)

    w = h.numpy(ac.dot_product_attention(q, k, v, return_weights=True, ops=h.ops)[1])
    run = dropout_program(attend, 0)
    out = h.numpy(run())
    ratio = out[0, 0] / w[0, 0]
    keep = np.isclose(ratio, 2.0, rtol=1e-4)
    assert np.all(keep | np.isclose(ratio, 0.0, atol=1e-6))
    tiles = keep.reshape(8, 8, 8, 8).transpose(0, 2, 1, 3).reshape(64, 64)  # one row per tile
    assert len({t.tobytes() for t in tiles}) == 64  # every tile its own mask
    assert abs(keep.mean() - 0.5) < 0.03 and abs(ratio.mean() - 1.0) < 0.06
    assert max_diff(h.numpy(run()), out) > 1e-3  # the next call: new masks
    np.testing.assert_array_equal(h.numpy(dropout_program(attend, 0)()), out)
    assert max_diff(h.numpy(dropout_program(attend, 1)()), out) > 1e-3


# -- check_numerics, compiled -------------------------------------------------------------

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
def test_compiled_check_numerics_puts_nan_where_eager_does(
    backend: str, name: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Compiled (torch: hook ``graph_captured``, ``torch.compile`` without Inductor; JAX:
    ``compiled_function``), ``check_numerics=True`` passes the fused kernel over and gives the
    eager direct kernel's rows, NaN ones included (inf in a query or key counts as NaN)."""
    h = Harness(backend)
    if not has_fused_kernel(h):
        pytest.skip(f"{h.name} has no fused kernel to pass over")
    capture = getattr(h.hooks, "graph_captured", None) or function_hook(h, "compiled_function")
    seed, entries, lens, nan_rows = NON_FINITE[name]
    arrays = dict(zip("qkv", draw((2, 2, 4, 8), (2, 2, 6, 8), (2, 2, 6, 8), seed=seed), strict=True))
    for part, x in arrays.items():
        for index, value in entries[part]:
            x[index] = value
    q, k, v = (h.array(arrays[part]) for part in "qkv")

    def checked(q: Any, k: Any, v: Any, lens: Any) -> Any:
        return ac.dot_product_attention(q, k, v, lens, check_numerics=True, ops=h.ops)

    count = h.hook("count_fused_calls")(monkeypatch)
    got = h.numpy(capture(checked)(q, k, v, h.array(np.array(lens))))
    assert count() == 0
    want = h.numpy(ac.dot_product_attention(q, k, v, h.array(np.array(lens)), check_numerics=True,
                                            implementation="direct"))
    assert (np.isnan(got) == np.isnan(want)).all() and int(np.isnan(want).any(-1).sum()) == nan_rows
    assert max_diff(np.nan_to_num(got), np.nan_to_num(want)) <= TOL
