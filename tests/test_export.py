"""Export and deployment paths, each round-tripped against the eager layer.

One section per framework, each run only in the env whose backend it is
(``ATTENTION_CORE_TEST_BACKENDS``): ``torch.export`` and ONNX in onnxruntime; a Keras model's
``export()`` reloaded with ``tf.saved_model.load``, and its TFLite conversion; ``jax.export`` of
a pure function ``f(params, *inputs)``, serialised and deserialised (Flax NNX modules too, in
the nnx env, their state as plain arrays); Gluon's ``export()`` and ``SymbolBlock.imports``. A
backend that is named is imported at collection, so a missing one fails loudly; it is never
skipped.

Every path runs the same four cases: ``MultiHeadAttention(12, 3, bias=True)`` as self-attention
with ``valid_lens`` as an input, with a boolean ``(B, Q, K)`` mask as an input, with
``causal=True``, and ``TransformerEncoderBlock`` with ``valid_lens``. One example of each batch
has no visible key (valid length 0, an all-False mask), so its rows must come out as zeros.
torch adds grouped-query heads (plain and rotary; a decoder too). Where the format has a
dynamic sequence length, the program is traced at length 5 and run at 3 and 9; the expected
values are the eager layer's on the same inputs, in float32, within ``TOLERANCE["float32"]``
(1e-5). Each check prints its max |diff| (``pytest -s``): the figures
of docs/export.md come from these lines.

The decode section exports a Llama-style decoder's cached calls, the cache and positions as
plain inputs and outputs: a prefill of left-padded prompts and a one-token step, on each
framework's exporter, and decodes greedily through them (docs/export.md, "Exporting a decode
step").
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from attention_core.cache import flat_cache, nested_cache
from conftest import test_backends
from tests import naive
from tests.harness import TOLERANCE, max_diff

TESTED = test_backends()

# A named backend's framework is imported here: if it is missing, collecting this file fails.
if "torch" in TESTED:
    import torch

    import attention_core as ac
    import backends.torch as torch_layers
    from backends.torch import export as torch_export
if "tensorflow" in TESTED:
    import keras
    import tensorflow as tf

    import backends.tensorflow as keras_layers
if "jax" in TESTED or "nnx" in TESTED:
    import jax
    import jax.numpy as jnp
if "jax" in TESTED:
    import backends.jax as flax_layers
if "nnx" in TESTED:
    from flax import nnx

    import backends.jax.nnx as nnx_layers
if "mxnet" in TESTED:
    import mxnet as mx

    import backends.mxnet as gluon_layers

#: Batch, width, the length a program is traced at, and the lengths it is then run at.
B, WIDTH, TRACED, LENGTHS = 3, 12, 5, (3, 9)
BOUND = TOLERANCE["float32"]
#: The cases of every path: what the layer is called with besides ``x``.
CASES = ("valid_lens", "mask", "causal", "block")
#: torch's extra cases: ``MultiHeadAttention(12, 6, bias=True, num_kv_heads=2)`` (grouped-query
#: heads, three query heads per key/value head), plain and with rotary positions, with ``valid_lens``.
GROUPED = {"grouped": None, "grouped_rotary": "rotary"}
#: The cases whose last example sees no key (its output rows are zeros).
EMPTY_ROW = ("valid_lens", "mask", *GROUPED)


def section(name: str) -> pytest.MarkDecorator:
    """Runs a framework's section only in the env that tests that backend."""
    return pytest.mark.skipif(name not in TESTED, reason=f"the {name} backend is not tested in this env")


def draw(length: int) -> dict[str, np.ndarray]:
    """``x (B, T, WIDTH)`` float32, ``valid_lens`` ``[T, 2, 0]`` and a ``(B, T, T)`` mask whose
    last example is all False (True = may attend)."""
    rng = np.random.default_rng(length)
    mask = rng.random((B, length, length)) < 0.6
    mask[-1] = False
    return {"x": rng.standard_normal((B, length, WIDTH)).astype(np.float32),
            "valid_lens": np.array([length, 2, 0], np.int32), "mask": mask}


def inputs_of(case: str, length: int) -> list[np.ndarray]:
    """The inputs a program of ``case`` takes, in order: ``x``, then its mask input if any."""
    given = draw(length)
    return [given["x"]] + ([given["mask"]] if case == "mask" else
                           [] if case == "causal" else [given["valid_lens"]])


def check(path: str, case: str, length: int, got: Any, want: Any) -> None:
    """Exported ``got`` against eager ``want``: within the bound, and zeros where no key is seen."""
    got, want = np.asarray(got), np.asarray(want)
    diff = max_diff(got, want)
    print(f"max |diff| {path} {case} T={length}: {diff:.1e}")
    assert got.shape == (B, length, WIDTH) and got.dtype == np.float32
    assert np.abs(want).max() > 0.1  # the comparison is not between zeros
    assert diff <= BOUND, (path, case, length, diff)
    if case in EMPTY_ROW:
        np.testing.assert_array_equal(got[-1], 0.0)


# -- torch: torch.export and ONNX ---------------------------------------------------------------


def torch_module(case: str) -> Any:
    """The case as a ``torch.nn.Module`` of tensors in, one tensor out (built, in eval mode)."""

    class SelfAttention(torch.nn.Module):
        """``x`` and the case's mask input (none for ``causal``) -> the layer's output."""

        def __init__(self) -> None:
            super().__init__()
            self.layer = (torch_layers.TransformerEncoderBlock(WIDTH, 20, 3, bias=True) if case == "block"
                          else torch_layers.MultiHeadAttention(WIDTH, 6, bias=True, num_kv_heads=2,
                                                               positional=GROUPED[case])
                          if case in GROUPED else torch_layers.MultiHeadAttention(WIDTH, 3, bias=True))

        def forward(self, x: torch.Tensor, given: torch.Tensor | None = None) -> torch.Tensor:
            if case == "block":
                return self.layer(x, given)
            if case == "mask":
                return self.layer(x, x, x, mask=given)
            return self.layer(x, x, x, given, causal=case == "causal")

    torch.manual_seed(0)
    module = SelfAttention().eval()
    module(*torch_inputs(case, TRACED))  # input sizes are inferred on the first call
    return module


def torch_inputs(case: str, length: int) -> tuple[torch.Tensor, ...]:
    return tuple(torch.from_numpy(a) for a in inputs_of(case, length))


def torch_dynamic_shapes(case: str) -> dict[str, Any]:
    """The sequence axis of every input dynamic (the batch stays as traced)."""
    t = torch.export.Dim("t", min=2, max=512)
    return {"x": {1: t}, **({"given": {1: t, 2: t}} if case == "mask" else
                            {} if case == "causal" else {"given": None})}


@section("torch")
@pytest.mark.parametrize("case", CASES + tuple(GROUPED))
def test_torch_export_with_a_dynamic_length(case: str) -> None:
    """``torch.export.export`` with a dynamic length; the layer keeps nothing of the export (no
    "tensor attribute assigned during export" warning). Grouped-query heads too: their
    reshapes once guarded the length to its traced value ("Constraints violated")."""
    module = torch_module(case)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "The tensor attribute", UserWarning)
        program = torch.export.export(module, torch_inputs(case, TRACED),
                                      dynamic_shapes=torch_dynamic_shapes(case))
    with torch.no_grad():
        for length in LENGTHS:
            args = torch_inputs(case, length)
            check("torch.export", case, length, program.module()(*args).numpy(), module(*args).numpy())


@section("torch")
@pytest.mark.parametrize("case", [*CASES, "grouped_rotary"])
def test_torch_onnx_export_in_onnxruntime(tmp_path: Path, case: str) -> None:
    """``torch.onnx.export`` (the dynamo exporter), the masks as inputs, run in onnxruntime."""
    pytest.importorskip("onnxscript", reason="onnxscript is in the torch tox env's deps")
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime is in the torch tox env's deps")
    module, path = torch_module(case), tmp_path / f"{case}.onnx"
    names = ["x"] if case == "causal" else ["x", "mask" if case == "mask" else "valid_lens"]
    torch.onnx.export(module, torch_inputs(case, TRACED), str(path), input_names=names,
                      output_names=["out"], dynamic_shapes=torch_dynamic_shapes(case), dynamo=True,
                      verbose=False)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == names
    assert session.get_inputs()[0].shape[1] == "t"  # the length is a named, free dimension
    with torch.no_grad():
        for length in LENGTHS:
            args = inputs_of(case, length)
            (got,) = session.run(None, dict(zip(names, args, strict=True)))
            check("onnx", case, length, got, module(*map(torch.from_numpy, args)).numpy())


@section("torch")
@pytest.mark.parametrize("kind", ["weights", "fused", "functional"])
def test_encoder_torch_export_with_a_dynamic_length(kind: str) -> None:
    """The layer, keeping its weights or not, and the functional API over its parameters (which
    under a symbolic length slices a table of max_len (1000) rows)."""

    class FunctionalEncoder(torch.nn.Module):
        """The functional ``transformer_encoder`` over a layer's parameters (no table held)."""

        def __init__(self, encoder: torch_layers.TransformerEncoder) -> None:
            super().__init__()
            self.encoder = encoder

        def forward(self, tokens: torch.Tensor) -> Any:
            return ac.transformer_encoder(tokens, dict(self.encoder.named_parameters()), 3)

    torch.manual_seed(1 if kind == "functional" else 0)
    encoder = torch_layers.TransformerEncoder(11, 12, 16, 3, 2,
                                              keep_attention_weights=kind != "fused").eval()
    module = FunctionalEncoder(encoder).eval() if kind == "functional" else encoder
    program = torch.export.export(module, (torch.randint(0, 11, (2, 5)),), dynamic_shapes={
        "tokens": {1: torch.export.Dim("steps", min=2, max=64)}})
    for length in (3, 17):
        tokens = torch.randint(0, 11, (2, length))
        got = program.module()(tokens).detach().numpy()
        assert max_diff(got, naive.encoder_of(encoder, tokens.numpy())) <= 1e-4


@section("torch")
def test_grouped_decoder_torch_export_with_a_dynamic_length() -> None:
    """A decoder-only ``TransformerDecoder`` with grouped-query heads and rotary positions."""
    torch.manual_seed(0)
    decoder = torch_layers.TransformerDecoder(11, 12, 16, 6, 2, decoder_only=True, num_kv_heads=2,
                                              positional="rotary").eval()
    program = torch.export.export(decoder, (torch.randint(0, 11, (2, TRACED)),), dynamic_shapes={
        "tokens": {1: torch.export.Dim("steps", min=2, max=64)}})
    with torch.no_grad():
        for length in (3, 17):
            tokens = torch.randint(0, 11, (2, length))
            diff = max_diff(program.module()(tokens).numpy(), decoder(tokens).numpy())
            print(f"max |diff| torch.export grouped decoder T={length}: {diff:.1e}")
            assert diff <= BOUND


@section("torch")
def test_encoder_onnx_export_with_a_dynamic_axis(tmp_path: Path) -> None:
    pytest.importorskip("onnxscript", reason="onnxscript is in the torch tox env's deps")
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime is in the torch tox env's deps")
    torch.manual_seed(0)
    encoder = torch_layers.TransformerEncoder(11, 12, 16, 3, 2, keep_attention_weights=False).eval()
    path = tmp_path / "encoder.onnx"
    torch.onnx.export(encoder, (torch.randint(0, 11, (2, 5)),), str(path), input_names=["tokens"],
                      output_names=["out"], dynamic_shapes={"tokens": {
                          0: torch.export.Dim("B", max=64), 1: torch.export.Dim("T", max=64)}},
                      dynamo=True, verbose=False)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for batch, length in ((2, 3), (3, 17)):
        tokens = np.random.default_rng(length).integers(0, 11, (batch, length))
        (got,) = session.run(None, {"tokens": tokens})
        assert max_diff(got, naive.encoder_of(encoder, tokens)) <= 1e-4


# -- Keras: SavedModel and TFLite ----------------------------------------------------------------


def keras_model(case: str) -> tuple[Any, Callable[..., Any]]:
    """The case as a functional ``keras.Model`` over named inputs of unknown batch and length,
    and the eager call of its layer."""
    keras.utils.set_random_seed(0)
    x = keras.Input((None, WIDTH), name="x")
    if case == "block":
        block = keras_layers.TransformerEncoderBlock(WIDTH, 20, 3, bias=True)
        lens = keras.Input((), dtype="int32", name="valid_lens")
        return keras.Model([x, lens], block(x, lens)), lambda x, lens: block(x, lens)
    mha = keras_layers.MultiHeadAttention(WIDTH, 3, bias=True)
    if case == "mask":
        mask = keras.Input((None, None), dtype="bool", name="mask")
        return keras.Model([x, mask], mha(x, x, x, mask=mask)), lambda x, m: mha(x, x, x, mask=m)
    if case == "causal":
        return keras.Model(x, mha(x, x, x, causal=True)), lambda x: mha(x, x, x, causal=True)
    lens = keras.Input((), dtype="int32", name="valid_lens")
    return keras.Model([x, lens], mha(x, x, x, lens)), lambda x, lens: mha(x, x, x, lens)


@section("tensorflow")
@pytest.mark.parametrize("case", CASES)
def test_keras_export_to_a_saved_model(tmp_path: Path, case: str) -> None:
    """``model.export()`` (a SavedModel, its length and batch ``None``) reloaded with
    ``tf.saved_model.load``."""
    model, eager = keras_model(case)
    model.export(str(tmp_path), verbose=False)
    loaded = tf.saved_model.load(str(tmp_path))
    specs = tf.nest.flatten(loaded.serve.input_signature)
    assert specs[0].shape.as_list() == [None, None, WIDTH]
    for length in LENGTHS:
        args = inputs_of(case, length)
        got = loaded.serve(args if len(args) > 1 else args[0])
        check("saved_model", case, length, got, eager(*args))


@section("tensorflow")
@pytest.mark.filterwarnings("ignore:.*tf.lite.Interpreter is deprecated:UserWarning")
@pytest.mark.parametrize("case", CASES)
def test_tflite_conversion_of_the_saved_model(tmp_path: Path, case: str) -> None:
    """The SavedModel converted to TFLite with the builtin ops alone (no ``SELECT_TF_OPS``),
    float32, no optimisation, run by ``tf.lite.Interpreter`` at lengths it was not traced at."""
    model, eager = keras_model(case)
    model.export(str(tmp_path), verbose=False)
    converter = tf.lite.TFLiteConverter.from_saved_model(str(tmp_path))
    converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS]
    converter.optimizations = []
    runner = tf.lite.Interpreter(model_content=converter.convert()).get_signature_runner()
    names = [i.name for i in model.inputs]
    assert sorted(runner.get_input_details()) == sorted(names)
    for length in LENGTHS:
        args = inputs_of(case, length)
        (got,) = runner(**dict(zip(names, args, strict=True))).values()
        check("tflite", case, length, got, eager(*args))


# -- JAX: jax.export ----------------------------------------------------------------------------


def exported(f: Callable[..., Any], params: Any, *inputs: Any) -> Callable[..., Any]:
    """``jax.export`` of a pure function ``f(params, *inputs)``, serialised and deserialised.

    Args:
        f: The function; the params are an input of the program, not constants in it.
        params: A pytree of arrays (or ``jax.ShapeDtypeStruct``s): their shapes are fixed.
        *inputs: ``jax.ShapeDtypeStruct``s of the other inputs, whose shapes may be symbolic
            (``jax.export.symbolic_shape("b, t")``).

    Returns:
        The deserialised program's ``call(params, *inputs)``.
    """
    spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)  # noqa: E731
    program = jax.export.export(jax.jit(f))(jax.tree.map(spec, params), *inputs)
    return jax.export.deserialize(program.serialize()).call


def linen_case(case: str) -> tuple[Callable[..., Any], Any]:
    """The case as a pure ``f(params, *inputs)`` over a linen layer, and its params."""
    x, given = (jnp.asarray(a) for a in (inputs_of("valid_lens", TRACED)))
    if case == "block":
        block = flax_layers.TransformerEncoderBlock(WIDTH, 20, 3, bias=True)
        params = block.init(jax.random.key(0), x, given)["params"]
        return (lambda p, x, lens: block.apply({"params": p}, x, lens)), params
    mha = flax_layers.MultiHeadAttention(WIDTH, 3, bias=True)
    params = mha.init(jax.random.key(0), x, x, x, given)["params"]
    if case == "mask":
        return (lambda p, x, m: mha.apply({"params": p}, x, x, x, mask=m)), params
    if case == "causal":
        return (lambda p, x: mha.apply({"params": p}, x, x, x, causal=True)), params
    return (lambda p, x, lens: mha.apply({"params": p}, x, x, x, lens)), params


def nnx_case(case: str) -> tuple[Callable[..., Any], Any, Callable[..., Any]]:
    """The case as a pure ``f(params, *inputs)`` over an NNX module (in eval mode), its params
    as a pure dict (plain arrays, as docs/export.md gives them), and the module's eager call."""
    rngs = nnx.Rngs(0)
    module = (nnx_layers.TransformerEncoderBlock(WIDTH, 20, 3, bias=True, rngs=rngs) if case == "block"
              else nnx_layers.MultiHeadAttention(WIDTH, 3, bias=True, rngs=rngs))
    module.eval()
    graphdef, state = nnx.split(module)
    call: Callable[..., Any] = {
        "block": lambda m, x, lens: m(x, lens), "mask": lambda m, x, mask: m(x, x, x, mask=mask),
        "causal": lambda m, x: m(x, x, x, causal=True)}.get(case, lambda m, x, lens: m(x, x, x, lens))
    return ((lambda p, *inputs: call(nnx.merge(graphdef, p), *inputs)), nnx.to_pure_dict(state),
            lambda *inputs: call(module, *inputs))


def symbolic_inputs(case: str) -> list[Any]:
    """The case's input specs, of any batch ``b`` and length ``t``."""
    b, t = jax.export.symbolic_shape("b, t")
    given = {"mask": [jax.ShapeDtypeStruct((b, t, t), jnp.bool_)], "causal": []}.get(
        case, [jax.ShapeDtypeStruct((b,), jnp.int32)])
    return [jax.ShapeDtypeStruct((b, t, WIDTH), jnp.float32), *given]


@section("jax")
@pytest.mark.parametrize("case", CASES)
def test_jax_export_of_linen_with_symbolic_shapes(case: str) -> None:
    """Exported for any batch ``b`` and length ``t``, called at lengths not traced."""
    f, params = linen_case(case)
    call = exported(f, params, *symbolic_inputs(case))
    for length in LENGTHS:
        args = [jnp.asarray(a) for a in inputs_of(case, length)]
        check("jax.export", case, length, call(params, *args), f(params, *args))


@section("nnx")
@pytest.mark.parametrize("case", CASES)
def test_jax_export_of_nnx_with_symbolic_shapes(case: str) -> None:
    """The same for an NNX module, through ``nnx.split`` and its state as a pure dict (the
    ``nnx.Param`` nodes of ``nnx.State`` do not serialise); the eager module is the reference."""
    f, params, eager = nnx_case(case)
    call = exported(f, params, *symbolic_inputs(case))
    for length in LENGTHS:
        args = [jnp.asarray(a) for a in inputs_of(case, length)]
        check("jax.export nnx", case, length, call(params, *args), eager(*args))


# -- decode: a prefill and a cached step, exported --------------------------------------------

#: A tiny Llama-style decoder (its output head untied, so the greedy tokens vary).
DECODER = {"vocab_size": 23, "num_hiddens": 16, "ffn_num_hiddens": 24, "num_heads": 4,
           "num_blks": 2, "decoder_only": True, "max_len": 32, "num_kv_heads": 2,
           "positional": "rotary", "norm_first": True, "norm": "rms", "activation": "swiglu",
           "ffn_bias": False, "output_bias": False, "tie_output": False,
           "scale_embeddings": False, "bias": "qkv"}
#: The cache's rows, and the greedy steps after the prefill.
CAPACITY, NEW_TOKENS = 16, 8
#: Prompts of lengths 3 and 5, left-padded to 5 (0 is the padding).
PROMPTS = np.array([[0, 0, 4, 5, 6], [7, 8, 9, 10, 11]], np.int32)
PROMPT_LENGTHS = np.array([3, 5], np.int32)
#: ``f(tokens, positions, *cache) -> [logits, *cache]`` over NumPy arrays: ``positions`` are
#: the prefill's lengths or the step's starts.
Program = Callable[..., list[np.ndarray]]


def greedy(prefill: Program, step: Program, alone: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """The prompts' next tokens, the prefill's then :data:`NEW_TOKENS` steps', and their logits.

    With ``alone``, the first step is also run on the last example alone (batch 1, not the
    traced one): its logits must be the batch's.
    """
    logits, *cache = prefill(PROMPTS, PROMPT_LENGTHS)
    rows, start = [logits[:, -1]], PROMPT_LENGTHS.copy()
    tokens = [rows[0].argmax(-1).astype(np.int32)]
    for s in range(NEW_TOKENS):
        logits, *cache_next = step(tokens[-1][:, None], start, *cache)
        if alone and s == 0:
            single = step(tokens[-1][-1:, None], start[-1:], *(c[-1:] for c in cache))[0]
            assert max_diff(single, logits[-1:]) <= BOUND
        rows.append(logits[:, 0])
        tokens.append(rows[-1].argmax(-1).astype(np.int32))
        cache, start = cache_next, start + 1
    return np.stack(tokens, 1), np.stack(rows, 1)


def check_decode(path: str, got: tuple[np.ndarray, np.ndarray],
                 want: tuple[np.ndarray, np.ndarray]) -> None:
    """The same greedy tokens, and logits within the bound."""
    diff = max_diff(got[1], want[1])
    print(f"max |diff| {path} decode, {NEW_TOKENS} steps: {diff:.1e}")
    assert len(set(want[0].ravel().tolist())) > 2  # the tokens are not one repeated id
    np.testing.assert_array_equal(got[0], want[0])
    assert diff <= BOUND, (path, diff)


def torch_decoder() -> Any:
    torch.manual_seed(0)
    decoder = torch_layers.TransformerDecoder(**DECODER).eval()
    decoder(torch.from_numpy(PROMPTS))  # builds it
    return decoder


def torch_eager(decoder: Any) -> tuple[np.ndarray, np.ndarray]:
    """Greedy decoding by the layer's own cached calls."""

    def prefill(tokens: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
        logits, cache = decoder(torch.from_numpy(tokens), capacity=CAPACITY,
                                start=np.zeros_like(lengths), lengths=lengths, padding="left")
        return [x.numpy() for x in (logits, *flat_cache(cache))]

    def step(tokens: np.ndarray, start: np.ndarray, *cache: np.ndarray) -> list[np.ndarray]:
        logits, new = decoder(torch.from_numpy(tokens), start=start,
                              cache=nested_cache([torch.from_numpy(c) for c in cache]))
        return [x.numpy() for x in (logits, *flat_cache(new))]

    with torch.no_grad():
        return greedy(prefill, step, alone=False)


@pytest.fixture(scope="module")
def torch_programs() -> tuple[Any, Any, Any, tuple[np.ndarray, np.ndarray]]:
    """The decoder, its prefill and step programs (exported once for the torch tests), and the
    eager layer's greedy tokens and logits."""
    decoder = torch_decoder()
    return decoder, *torch_export.export_decoder(decoder, CAPACITY), torch_eager(decoder)


@section("torch")
def test_torch_export_of_a_decode_step(torch_programs: tuple[Any, ...]) -> None:
    """``torch.export`` of the prefill (any batch, 2 to C tokens) and of the step (any batch):
    the positions are inputs, read by no value under tracing."""
    _, *programs, want = torch_programs
    for program in programs:
        assert "_local_scalar_dense" not in program.graph_module.code  # no host read
    prefill, step = (program.module() for program in programs)

    def numpy(program: Any) -> Program:
        return lambda *arrays: [x.numpy() for x in program(*map(torch.from_numpy, arrays))]

    with torch.no_grad():
        check_decode("torch.export", greedy(numpy(prefill), numpy(step)), want)


@section("torch")
def test_decode_step_wrappers_refuse_what_they_cannot_export(
        torch_programs: tuple[Any, ...]) -> None:
    """An encoder-decoder's decoder (its cache needs the encoder's outputs), and a flat cache
    that is not whole blocks, each with the library's error."""
    crossed = torch_layers.TransformerDecoder(11, 12, 16, 3, 2)
    with pytest.raises(TypeError, match=r"^decoder must be a TransformerDecoder with "
                       r"decoder_only=True, got TransformerDecoder with decoder_only=False$"):
        torch_export.DecodeStep(crossed)
    decoder = torch_programs[0]
    cache = torch_export.Prefill(decoder, CAPACITY)(torch.from_numpy(PROMPTS),
                                                     torch.from_numpy(PROMPT_LENGTHS))[1:]
    with pytest.raises(ValueError, match=r"^a flat cache must hold 2 arrays per block \(keys "
                       r"and values of 1 pair\(s\)\), got 3$"):
        torch_export.DecodeStep(decoder)(torch.ones(2, 1, dtype=torch.int32),
                                         torch.from_numpy(PROMPT_LENGTHS), *cache[:3])


@section("torch")
@pytest.mark.filterwarnings("ignore:# The axis name.*shares the same shape constraints:UserWarning")
def test_onnx_export_of_a_decode_step(tmp_path: Path, torch_programs: tuple[Any, ...]) -> None:
    """The two programs to ONNX (the dynamo exporter, from the exported programs), run in
    onnxruntime, their inputs, outputs and dynamic axes named as the wrappers name them."""
    pytest.importorskip("onnxscript", reason="onnxscript is in the torch tox env's deps")
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime is in the torch tox env's deps")
    decoder, *programs, want = torch_programs
    wrappers = torch_export.Prefill(decoder, CAPACITY), torch_export.DecodeStep(decoder)
    runs = []
    for wrapper, program in zip(wrappers, programs, strict=True):
        path = tmp_path / f"{type(wrapper).__name__}.onnx"
        torch.onnx.export(program, input_names=wrapper.input_names,
                          output_names=wrapper.output_names, dynamic_shapes=wrapper.axis_names,
                          dynamo=True, verbose=False).save(str(path))
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        assert [i.name for i in session.get_inputs()] == wrapper.input_names
        assert [i.shape[0] for i in session.get_inputs()] == ["batch"] * len(wrapper.input_names)
        runs.append(lambda *arrays, session=session, names=wrapper.input_names: session.run(
            None, dict(zip(names, (arrays[0].astype(np.int64), *arrays[1:]), strict=True))))
    check_decode("onnx", greedy(*runs), want)


@section("jax")
def test_jax_export_of_a_decode_step() -> None:
    """``jax.export`` of a jitted prefill (symbolic batch ``b`` and length ``t``) and step
    (symbolic ``b``) over the linen decoder's apply, serialised and deserialised."""
    decoder = flax_layers.TransformerDecoder(**DECODER)
    params = decoder.init(jax.random.key(0), jnp.asarray(PROMPTS))["params"]

    def prefill(p: Any, tokens: Any, lengths: Any) -> Any:
        logits, cache = decoder.apply({"params": p}, tokens, capacity=CAPACITY,
                                      start=jnp.zeros_like(lengths), lengths=lengths,
                                      padding="left")
        return logits, flat_cache(cache)

    def step(p: Any, tokens: Any, start: Any, cache: list[Any]) -> Any:
        logits, new = decoder.apply({"params": p}, tokens, cache=nested_cache(cache), start=start)
        return logits, flat_cache(new)

    b, t = jax.export.symbolic_shape("b, t")
    ints = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    heads = (b, DECODER["num_kv_heads"], CAPACITY, DECODER["num_hiddens"] // DECODER["num_heads"])
    cache = [jax.ShapeDtypeStruct(heads, jnp.float32)] * (2 * DECODER["num_blks"])

    def numpy(f: Callable[..., Any]) -> Program:
        def run(tokens: np.ndarray, positions: np.ndarray, *flat: np.ndarray) -> list[np.ndarray]:
            logits, new = f(params, tokens, positions, *([list(flat)] if flat else []))
            return [np.asarray(x) for x in (logits, *new)]
        return run

    exported_programs = (exported(prefill, params, ints(b, t), ints(b)),
                         exported(step, params, ints(b, 1), ints(b), cache))
    check_decode("jax.export", greedy(*map(numpy, exported_programs)),
                 greedy(numpy(prefill), numpy(step), alone=False))


@section("tensorflow")
def test_keras_export_archive_of_a_decode_step(tmp_path: Path) -> None:
    """A Keras ``ExportArchive`` with two serving endpoints, ``prefill`` and ``step`` (the
    cache flattened), reloaded with ``tf.saved_model.load``."""
    keras.utils.set_random_seed(0)
    decoder = keras_layers.TransformerDecoder(**DECODER)
    decoder(PROMPTS)  # builds it

    def prefill(tokens: Any, lengths: Any) -> list[Any]:
        logits, cache = decoder(tokens, capacity=CAPACITY, start=tf.zeros_like(lengths),
                                lengths=lengths, padding="left")
        return [logits, *flat_cache(cache)]

    def step(tokens: Any, start: Any, *cache: Any) -> list[Any]:
        logits, new = decoder(tokens, cache=nested_cache(cache), start=start)
        return [logits, *flat_cache(new)]

    ints = lambda *shape, name: tf.TensorSpec(shape, tf.int32, name=name)  # noqa: E731
    heads = (None, DECODER["num_kv_heads"], CAPACITY, DECODER["num_hiddens"] // DECODER["num_heads"])
    archive = keras.export.ExportArchive()
    archive.track(decoder)
    archive.add_endpoint("prefill", prefill, input_signature=[
        ints(None, None, name="tokens"), ints(None, name="lengths")])
    archive.add_endpoint("step", step, input_signature=[
        ints(None, 1, name="tokens"), ints(None, name="start"),
        *(tf.TensorSpec(heads, tf.float32, name=f"cache.{i // 2}.{('keys', 'values')[i % 2]}")
          for i in range(2 * DECODER["num_blks"]))])
    archive.write_out(str(tmp_path), verbose=False)
    loaded = tf.saved_model.load(str(tmp_path))

    def numpy(f: Callable[..., Any]) -> Program:
        return lambda *arrays: [np.asarray(x) for x in f(*map(tf.constant, arrays))]

    check_decode("keras serving", greedy(numpy(loaded.prefill), numpy(loaded.step)),
                 greedy(numpy(prefill), numpy(step), alone=False))


# -- Gluon: export() and SymbolBlock.imports ------------------------------------------------------


def gluon_layer(case: str) -> Any:
    layer = (gluon_layers.TransformerEncoderBlock(WIDTH, 20, 3, bias=True) if case == "block"
             else gluon_layers.MultiHeadAttention(WIDTH, 3, bias=True))
    layer.initialize(mx.init.Xavier())
    return layer


def gluon_call(case: str, length: int) -> tuple[list[Any], dict[str, Any]]:
    """A call's arrays and keywords."""
    x, *given = (mx.np.array(a, dtype=a.dtype) for a in inputs_of(case, length))
    if case == "block":
        return [x, *given], {}
    if case == "mask":
        return [x, x, x], {"mask": given[0]}
    return [x, x, x, *given], {"causal": case == "causal"}


def gluon_data(arrays: list[Any], options: dict[str, Any]) -> list[Any]:
    """The exported graph's inputs: the call's arrays in order, the mask after them."""
    return [*arrays, *([options["mask"]] if "mask" in options else [])]


def gluon_exported(layer: Any, arrays: list[Any], prefix: Path) -> Any:
    """``layer.export`` of its last graph, read back by ``SymbolBlock.imports``."""
    layer.export(str(prefix))
    names = ["data"] if len(arrays) == 1 else [f"data{i}" for i in range(len(arrays))]
    with warnings.catch_warnings():  # the data inputs' types are unknown until a call
        warnings.filterwarnings("ignore", "Cannot decide type", UserWarning)
        return mx.gluon.SymbolBlock.imports(f"{prefix}-symbol.json", names, f"{prefix}-0000.params")


@section("mxnet")
@pytest.mark.parametrize("case", CASES)
def test_gluon_export_and_imports(tmp_path: Path, case: str) -> None:
    """A hybridized layer exports the graph of its last call; each length is its own graph
    (the graph's shapes are fixed, see the next test), compared with an imperative twin."""
    layer, eager = gluon_layer(case), gluon_layer(case)
    arrays, options = gluon_call(case, TRACED)
    eager(*arrays, **options)
    layer(*arrays, **options)
    eager.set_weights(layer.get_weights())
    layer.hybridize()
    for length in LENGTHS:
        arrays, options = gluon_call(case, length)
        layer(*arrays, **options)
        imported = gluon_exported(layer, gluon_data(arrays, options), tmp_path / f"length{length}")
        got = imported(*gluon_data(arrays, options)).asnumpy()
        check("gluon", case, length, got, eager(*arrays, **options).asnumpy())


@section("mxnet")
def test_gluon_exported_graph_has_the_shapes_of_its_call(tmp_path: Path) -> None:
    """The limit docs/export.md states: the graph is built from the call's shapes (reshapes to
    ``(B, T, H, D)`` with numbers in them), so another length needs another export."""
    layer = gluon_layer("valid_lens")
    layer.hybridize()
    arrays, _ = gluon_call("valid_lens", TRACED)
    layer(*arrays)
    imported = gluon_exported(layer, arrays, tmp_path / "layer")
    np.testing.assert_allclose(imported(*arrays).asnumpy(), layer(*arrays).asnumpy(), rtol=0, atol=BOUND)
    with pytest.raises(mx.base.MXNetError, match="reshape"):
        imported(*gluon_call("valid_lens", LENGTHS[0])[0]).asnumpy()
