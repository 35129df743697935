"""What every framework's adapter does alike, tested once over the harness hooks.

Each test here replaces a test that tests/test_{torch,tensorflow,jax,mxnet}.py each had in
their own words: dropout only in training (the attention weights taken before it), the
encoder's weights kept per block, a training step that moves only the embedding rows and the
relative offsets in use, the framework's own weights files, layers that keep no weights, and
the blockwise path equal to the direct one, gradients included. The hooks
(``tests/hooks/<backend>_hooks.py``, see tests/harness.py) say how each framework trains,
steps, saves and compiles; the expected values come from the float64 reference files, the
same layer with dropout 0, or the direct path.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import attention_core as ac
from attention_core import kernels
from attention_core.kernels import blockwise
from tests.harness import (
    AUTODIFF,
    DTYPES,
    FASTEST_GRADIENT_MODE,
    QUICK_COMPILED_MODES,
    TOLERANCE,
    Harness,
    max_diff,
)
from tests.matrix import FULL_MODES
from tests.reference.cases import CASES, MASK_KINDS, mask_arguments
from tests.reference.generate import RETURNS_ATTENTION, record

#: These tests run on the columns too (conftest.py; tests.harness.COLUMNS).
COLUMN_TESTS = True

TOL = TOLERANCE["float32"]
#: A small encoder: 11 token ids, width 12, FFN 16, 3 heads, 2 blocks.
ENCODER = {"vocab_size": 11, "num_hiddens": 12, "ffn_num_hiddens": 16, "num_heads": 3,
           "num_blks": 2}


def draw(*shapes: tuple[int, ...], seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


def example(name: str) -> tuple[dict[str, Any], list[np.ndarray], dict[str, np.ndarray]]:
    """A layer's config, positional inputs and keyword arrays for the tests below."""
    if name == "DotProductAttention":  # values = the identity: the output is the weights
        q, k = draw((2, 4, 3), (2, 6, 3))
        return {}, [q, k, np.broadcast_to(np.eye(6, dtype=np.float32), (2, 6, 6)).copy()], {}
    if name == "MultiHeadAttention":
        q, kv = draw((2, 5, 12), (2, 7, 10))
        return {"num_hiddens": 16, "num_heads": 4}, [q, kv, kv], {"valid_lens": np.array([3, 7])}
    if name == "RelativeMultiHeadAttention":
        q, k, v = draw((2, 4, 10), (2, 6, 7), (2, 6, 9), seed=2)
        config = {"num_hiddens": 12, "num_heads": 3, "max_relative_position": 2, "bias": True}
        return config, [q, k, v], {"valid_lens": np.array([[1, 2, 3, 4], [6, 6, 5, 2]])}
    if name == "TransformerEncoderBlock":
        (X,) = draw((2, 5, 12), seed=1)
        return {"num_hiddens": 12, "ffn_num_hiddens": 20, "num_heads": 3}, [X], {
            "valid_lens": np.array([5, 3])}
    if name == "TransformerEncoder":
        tokens = np.array([[1, 3, 3, 7, 2], [4, 1, 7, 7, 0]], np.int32)
        return dict(ENCODER), [tokens], {"valid_lens": np.array([5, 3])}
    assert name == "PositionalEncoding"
    return {"num_hiddens": 16, "max_len": 20}, draw((4, 10, 16)), {}


def weights_of(layer: Any) -> dict[str, np.ndarray]:
    return {name: np.asarray(w) for name, w in layer.get_weights().items()}


def unkept(h: Harness, blocks: int | None = None) -> Any:
    """What a layer that keeps no weights holds: None (the encoder: one None per block); Flax
    (linen and NNX) sows nothing, so its handle holds None."""
    return [None] * blocks if blocks and not getattr(h.hooks, "SOWS_WEIGHTS", False) else None


# -- dropout only in training --------------------------------------------------------------

#: Layers with dropout; for two of them the output shows each kept or dropped entry (the bounds
#: on the kept fraction suit their sizes: 48 and 640 entries).
DROPOUT = ("DotProductAttention", "MultiHeadAttention", "MultiHeadAttention-unkept",
           "RelativeMultiHeadAttention", "TransformerEncoder", "PositionalEncoding")
ENTRYWISE = {"DotProductAttention": (0.2, 0.8), "PositionalEncoding": (0.4, 0.6)}


@pytest.mark.parametrize("name", DROPOUT)
def test_dropout_only_in_training(backend: str, name: str) -> None:
    """Inference calls are deterministic and equal the layer with dropout 0; training calls
    drop (a new mask each call, eager and in the quick compiled modes), the attention weights
    taken before dropout; kept entries are scaled by 1 / (1 - p)."""
    h = Harness(backend)
    name, _, variant = name.partition("-")  # unkept: keep_attention_weights=False (torch: SDPA)
    config, inputs, call = example(name)
    if variant:
        config["keep_attention_weights"] = False
    layer = h.make(name, {**config, "dropout": 0.5})
    args = [h.array(x) for x in inputs]
    kwargs = {k: h.array(v) for k, v in call.items()}
    asks = {"return_attention": True} if name in RETURNS_ATTENTION and not variant else {}

    def run(training: bool) -> tuple[np.ndarray, Any]:
        result = h.call_mode(layer, training, *args, **kwargs, **asks)
        out, weights = result if asks else (result, None)
        return h.numpy(out), weights

    inference, weights = run(False)
    np.testing.assert_array_equal(run(False)[0], inference)
    called = h.call(layer, *args, **kwargs, **asks)  # a plain call is an inference call
    np.testing.assert_array_equal(h.numpy(called[0] if asks else called), inference)
    plain = h.make(name, config)
    h.call(plain, *args, **kwargs)
    if weights_of(layer):
        plain.set_weights(weights_of(layer))
    assert max_diff(h.numpy(h.call_mode(plain, False, *args, **kwargs)), inference) <= 1e-6

    first, kept = run(True)
    second, _ = run(True)
    assert not np.allclose(first, second) and not np.allclose(first, inference)
    if asks:  # taken before dropout, and the ones kept
        if backend in ("numpy", "torch"):  # the very object returned is the one kept
            _, returned = h.call_mode(layer, True, *args, **kwargs, **asks)
            assert returned is layer.attention_weights
        np.testing.assert_array_equal(h.numpy(kept), h.numpy(weights))
        np.testing.assert_array_equal(h.numpy(h.attention_weights(layer)), h.numpy(kept))
        np.testing.assert_allclose(h.numpy(kept).sum(-1), 1.0, atol=1e-6)
    if name in ENTRYWISE:
        low, high = ENTRYWISE[name]
        entries = first != 0
        assert low < entries.mean() < high
        np.testing.assert_allclose(first[entries], 2 * inference[entries], rtol=1e-6)

    def training(layer: Any, *arrays: Any) -> Any:
        result = h.call_mode(layer, True, *arrays[:len(args)],
                             **dict(zip(kwargs, arrays[len(args):], strict=True)), **asks)
        return result if asks else (result, result)

    for mode in QUICK_COMPILED_MODES.get(backend, ()):
        a, kept = h.run(mode, layer, training, [*args, *kwargs.values()])
        b, _ = h.run(mode, layer, training, [*args, *kwargs.values()])
        a, b = h.numpy(a), h.numpy(b)
        assert not np.allclose(a, b) and not np.allclose(a, inference), mode
        if asks:
            assert max_diff(h.numpy(kept), h.numpy(weights)) <= TOL, mode
        if name in ENTRYWISE:
            np.testing.assert_allclose(a[a != 0], 2 * inference[a != 0], rtol=1e-6)


# -- the encoder keeps one attention map per block ----------------------------------------------


def reference_layer(h: Harness, layer: str, name: str,
                    **options: Any) -> tuple[Any, list[Any], dict[str, Any], dict[str, np.ndarray]]:
    """A reference case's layer (with the file's weights), inputs, call arguments and record."""
    case = next(c for c in CASES if c.layer == layer and c.name == name)
    ref = record(case)
    built = h.make(layer, {**case.config, **options})
    built.set_weights({k[len("weight."):]: v.astype(np.float32)
                       for k, v in ref.items() if k.startswith("weight.")})
    inputs = [h.array(ref[f"input.{n}"]) for n in case.inputs]
    call = {k[len("call."):]: (bool(v) if k == "call.causal" else h.array(v))
            for k, v in ref.items() if k.startswith("call.")}
    return built, inputs, call, ref


def test_encoder_keeps_each_blocks_attention_weights(backend: str) -> None:
    """A list of one (B, H, T, T) map per block, the file's values, zero beyond the valid
    lengths, in eager and the quick compiled modes; without kept weights (blockwise), one None
    per block and the same output."""
    h = Harness(backend)
    encoder, inputs, call, ref = reference_layer(h, "TransformerEncoder", "valid_lens_1d")
    out = h.numpy(h.call(encoder, *inputs, **call))
    kept = h.attention_weights(encoder)
    assert isinstance(kept, list) and len(kept) == 2
    stacked = np.stack([h.numpy(w) for w in kept])
    assert max_diff(stacked, ref["output.attention"]) <= TOL
    assert max_diff(out, ref["output.out"]) <= TOL
    np.testing.assert_array_equal(stacked[ref["output.attention"] == 0], 0.0)
    assert max_diff(stacked[0], stacked[1]) > 1e-3  # two blocks, two maps

    def traced(layer: Any, *arrays: Any) -> tuple[Any, Any]:
        return h.call(layer, *arrays[:1], **dict(zip(call, arrays[1:], strict=True))), list(
            h.attention_weights(layer))

    for mode in QUICK_COMPILED_MODES.get(backend, ()):
        got, maps = h.run(mode, encoder, traced, [*inputs, *call.values()])
        assert max_diff(h.numpy(got), out) <= TOL, mode
        assert max_diff(np.stack([h.numpy(w) for w in maps]), stacked) <= TOL, mode

    light, inputs, call, ref = reference_layer(h, "TransformerEncoder", "valid_lens_1d",
                                               keep_attention_weights=False,
                                               implementation="blockwise")
    assert max_diff(h.numpy(h.call(light, *inputs, **call)), out) <= TOL
    assert h.attention_weights(light) == unkept(h, 2)


# -- one training step moves only what the inputs use ---------------------------------------


def offsets_seen(q: int, k: int, m: int) -> list[int]:
    """Rows ``offset + m`` of the relative tables that ``q`` queries at the end of ``k`` keys
    use: query i sits at position ``i + k - q``, offsets clipped to [-m, m]."""
    return sorted({int(np.clip(j - (i + k - q), -m, m)) + m for i in range(q) for j in range(k)})


#: (queries, keys, m) of the relative layer: rows 0..5 (offsets -4..1 and -3..2) and 2..6.
RELATIVE_STEPS = {"q2-k5-m4": (2, 5, 4), "q3-k3-m4": (3, 3, 4), "q3-k4-m3": (3, 4, 3)}


@pytest.mark.parametrize("which", ["encoder", *RELATIVE_STEPS])
def test_one_step_moves_only_the_rows_in_use(backend: str, which: str) -> None:
    """One SGD step on a squared error: the loss falls, the embedding rows of the tokens used
    (the relative rows of the offsets that occur) move, the others keep their values exactly,
    and every other weight moves; in each way a layer can be set up (Gluon: hybridized)."""
    h = Harness(backend)
    if backend not in AUTODIFF:
        pytest.skip(f"the {backend} backend has no autodiff")
    for setup in h.setups():
        step_and_check(h, which, setup)


def step_and_check(h: Harness, which: str, setup: Callable[[Any], None]) -> None:
    if which == "encoder":
        name, config = "TransformerEncoder", dict(ENCODER)
        inputs = [np.array([[1, 3, 3, 7], [4, 1, 7, 7]], np.int32)]
        tables = {"token.embedding": [1, 3, 4, 7]}
        rows = 11
    else:
        q, k, m = RELATIVE_STEPS[which]
        name = "RelativeMultiHeadAttention"
        config = {"num_hiddens": 12, "num_heads": 3, "max_relative_position": m, "bias": True}
        inputs = draw((2, q, 10), (2, k, 7), (2, k, 9), seed=q + k)
        tables = dict.fromkeys(("rel_k.embedding", "rel_v.embedding"), offsets_seen(q, k, m))
        rows = 2 * m + 1
    layer = h.make(name, config)
    args = [h.array(x) for x in inputs]
    setup(layer)
    (target,) = draw((2, inputs[0].shape[1], 12), seed=3)
    h.call_mode(layer, False, *args)  # input sizes are inferred first

    def loss() -> float:
        return float(np.mean((h.numpy(h.call_mode(layer, False, *args)) - target) ** 2))

    before, loss_before = weights_of(layer), loss()
    h.sgd_step(layer, args, {}, target, 0.1)
    after = weights_of(layer)
    assert loss() < loss_before
    for table, used in tables.items():
        moved = np.abs(after[table] - before[table]).max(axis=1)
        assert (moved[used] > 0).all(), table
        unused = [r for r in range(rows) if r not in used]
        np.testing.assert_array_equal(after[table][unused], before[table][unused])
    for weight in set(before) - set(tables):
        assert not np.array_equal(after[weight], before[weight]), weight


# -- the framework's own weights files ------------------------------------------------------


SAVED = ("MultiHeadAttention", "RelativeMultiHeadAttention", "TransformerEncoderBlock",
         "TransformerEncoder")


@pytest.mark.parametrize("name", SAVED)
def test_native_file_round_trip(backend: str, name: str, tmp_path: Path) -> None:
    """The framework's own file (state_dict, .keras, Flax msgpack, Gluon .params, NumPy .npz)
    holds the canonical names and moves the layer to a fresh one: the same outputs (each way
    the fresh layer can be set up) and weights."""
    h = Harness(backend)
    config, inputs, call = example(name)
    args = [h.array(x) for x in [*inputs, *call.values()]]
    src = h.make(name, config)
    out = h.numpy(h.call_mode(src, False, *args))
    fresh, names = h.save_load_native(src, lambda: getattr(h.module, name)(**config), args,
                                      tmp_path)  # as constructed: Gluon's never initialised
    assert sorted(names) == sorted(weights_of(src))
    for setup in h.setups():
        setup(fresh)
        for _ in range(2):  # hybridized: builds the graph, then runs the cached one
            # (a graph forms the kept weights in the call, on the direct path: the eager call
            # forms them on read, pooling blockwise where that is the backend's choice)
            assert max_diff(h.numpy(h.call_mode(fresh, False, *args)), out) <= 1e-6
    for weight, value in weights_of(src).items():
        np.testing.assert_array_equal(weights_of(fresh)[weight], value)
    ac.save_weights(tmp_path / "w.safetensors", src)  # and the library's own file
    by_file = h.make(name, config)
    ac.load_weights(tmp_path / "w.safetensors", by_file)
    np.testing.assert_array_equal(h.numpy(h.call_mode(by_file, False, *args)), out)


def test_encoder_token_ids_are_checked_on_every_call(backend: str) -> None:
    """Ids past the vocabulary, negative ids and float tokens are refused with the core's
    messages, after earlier calls too (Gluon: by the cached graph), and change nothing. Where
    the backend's arrays are never read on the host (JAX), ids out of range are checked on the
    device: their example's output is NaN, never another token's row."""
    h = Harness(backend)
    if h.ops.concrete(h.array(np.zeros(1, np.int32))) is None:
        encoder = h.make("TransformerEncoder", {**ENCODER, "vocab_size": 9})
        ids = np.array([[1, 2, 3, 4, 5], [0, 0, 5, 8, 8]])
        good = h.numpy(h.call(encoder, h.array(ids)))
        for bad in (9, -1):
            tokens = ids.copy()
            tokens[1, 2] = bad
            out = h.numpy(h.call(encoder, h.array(tokens)))
            assert np.isnan(out[1]).all() and np.array_equal(out[0], good[0])
        with pytest.raises(TypeError, match="tokens must be integer token ids, got dtype float32"):
            h.call(encoder, h.array(ids.astype(np.float32)))
        return
    for setup in h.setups():
        encoder = h.make("TransformerEncoder", {**ENCODER, "vocab_size": 9})
        setup(encoder)
        ids = np.array([[1, 2, 3, 4, 5], [0, 0, 5, 8, 8]])
        for _ in range(2):
            out = h.numpy(h.call(encoder, h.array(ids)))
        before = weights_of(encoder)
        refusals = {9: (ValueError, "tokens must be in [0, vocab_size) = [0, 9), got 9"),
                    -1: (ValueError, "tokens must be in [0, vocab_size) = [0, 9), got -1"),
                    0.5: (TypeError, "tokens must be integer token ids, got dtype float32")}
        for bad, (error, message) in refusals.items():
            tokens = ids.astype(np.float32) if bad == 0.5 else ids.copy()
            tokens[1, 2] = bad
            with pytest.raises(error) as info:  # str(): Keras adds the arguments as a note
                h.call(encoder, h.array(tokens))
            assert str(info.value) == message
        np.testing.assert_array_equal(h.numpy(h.call(encoder, h.array(ids))), out)
        for weight, value in before.items():
            np.testing.assert_array_equal(weights_of(encoder)[weight], value)


# -- the same weights as NumPy --------------------------------------------------------------

MHA_CASES = [f"{kind}{suffix}" for kind in MASK_KINDS for suffix in ("", "_bias")]
#: Compiled modes run on every case here: JAX's jit (the matrix runs three multi-head cases).
EVERY_CASE_MODES = {"jax": ("jit",)}


@pytest.mark.parametrize("case_name", MHA_CASES)
def test_multi_head_equals_numpy_with_the_same_weights(backend: str, case_name: str) -> None:
    """The reference weights, set before the first call (sizes from the kernels), give the
    NumPy layer's output and weights and the file's: keeping the weights, and not (torch: the
    fused path), in each way a layer can be set up and in the modes of EVERY_CASE_MODES."""
    h = Harness(backend)
    case = next(c for c in CASES if c.layer == "MultiHeadAttention" and c.name == case_name)
    ref = record(case)
    weights = {k[len("weight."):]: v.astype(np.float32)
               for k, v in ref.items() if k.startswith("weight.")}
    inputs = [ref[f"input.{n}"].astype(np.float32) for n in case.inputs]
    call = {k[len("call."):]: v for k, v in ref.items() if k.startswith("call.")}
    static = {"causal": bool(call.pop("causal"))} if "causal" in call else {}
    reference = Harness("numpy").make("MultiHeadAttention", case.config, "float32")
    reference.set_weights(weights)
    expected, expected_w = reference(*inputs, **call, **static, return_attention=True)
    arrays = [h.array(x) for x in [*inputs, *call.values()]]

    def attend(layer: Any, *a: Any) -> Any:
        asks = {"return_attention": True} if keep else {}
        return h.call(layer, *a[:3], **dict(zip(call, a[3:], strict=True)), **static, **asks)

    for keep, setup in ((keep, setup) for keep in (True, False) for setup in h.setups()):
        layer = h.make("MultiHeadAttention", {**case.config, "keep_attention_weights": keep})
        layer.set_weights(weights)
        setup(layer)
        for mode in ("eager", *EVERY_CASE_MODES.get(backend, ())):
            result = h.run(mode, layer, attend, arrays)
            out = result[0] if keep else result
            assert max_diff(h.numpy(out), expected) <= TOL, (keep, mode)
            assert max_diff(h.numpy(out), ref["output.out"]) <= TOL, (keep, mode)
            if keep:
                assert max_diff(h.numpy(result[1]), ref["output.attention"]) <= TOL, mode
                assert max_diff(h.numpy(result[1]), expected_w) <= TOL, mode
        if keep:  # the last eager call's kept weights
            h.call(layer, *arrays[:3], **dict(zip(call, arrays[3:], strict=True)), **static)
            assert max_diff(h.numpy(h.attention_weights(layer)), reference.attention_weights) <= TOL


# -- keep_attention_weights=False and the implementation argument ------------------------------

#: Ragged blocks: 13 queries in blocks of 4 (3 full and 1), 19 keys in blocks of 5 (3 and 4).
BB, BH, BQ, BK = 2, 3, 13, 19
BLOCK_KINDS = (*MASK_KINDS, "combined")
#: Kinds run in the compiled modes that cost seconds (all kinds run in hybridize()).
COMPILED_BLOCK_KINDS = ("valid_lens_2d", "mask_4d", "combined")
NOT_KEEPING = {"DotProductAttention": {}, "MultiHeadAttention": {"num_hiddens": 8, "num_heads": 2},
               "TransformerEncoderBlock": {"num_hiddens": 8, "ffn_num_hiddens": 6, "num_heads": 2}}


#: Backends whose blockwise layers, asked for the weights, compute them on the direct path; the
#: others refuse with the core's message. (Found while merging the per-framework tests: the
#: adapters differ here, and should agree.)
@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of 4 queries and 5 keys, so the loops run several times with a ragged tail."""
    monkeypatch.setattr(blockwise, "KEY_BLOCK", 5)
    monkeypatch.setattr(blockwise, "MIN_QUERY_BLOCK", 1)
    monkeypatch.setattr(blockwise, "TILE_SCORES", BB * BH * 4 * 5)


@pytest.mark.parametrize("name", list(NOT_KEEPING))
def test_layers_not_keeping_weights(backend: str, name: str, small_blocks: None) -> None:
    """A blockwise layer that keeps no weights gives the keeping layer's output, eagerly and in
    the quick compiled modes; asked for, its weights are the direct path's, exactly."""
    h = Harness(backend)
    kept = h.make(name, NOT_KEEPING[name])
    light = h.make(name, {**NOT_KEEPING[name], "keep_attention_weights": False,
                          "implementation": "blockwise"})
    (X,) = draw((BB, BK, 8))
    args = [h.array(X)] * (1 if name == "TransformerEncoderBlock" else 3)
    lens = h.array(np.array([5, BK], np.int32))
    want = h.numpy(h.call(kept, *args, lens))
    if weights_of(kept):
        light.set_weights(weights_of(kept))
    assert h.attention_weights(kept) is not None
    assert max_diff(h.numpy(h.call(light, *args, lens)), want) <= TOL
    assert h.attention_weights(light) is None
    for mode in QUICK_COMPILED_MODES.get(backend, ()):
        got = h.run(mode, light, lambda m, *a: h.call(m, *a), [*args, lens])
        assert max_diff(h.numpy(got), want) <= TOL, mode
    if name == "TransformerEncoderBlock":  # it has no return_attention
        return
    plain = h.make(name, {**NOT_KEEPING[name], "keep_attention_weights": False})
    if weights_of(kept):
        plain.set_weights(weights_of(kept))
    # asked for, the weights come from the direct path on every backend: a layer's
    # implementation is how calls that do not need the weights pool
    for layer in (plain, light):
        _, weights = h.call(layer, *args, lens, return_attention=True)
        assert max_diff(h.numpy(weights), h.numpy(h.attention_weights(kept))) == 0.0


@pytest.mark.parametrize("name", ["DotProductAttention", "MultiHeadAttention"])
def test_a_default_call_forms_its_weights_when_they_are_read(backend: str, name: str) -> None:
    """A default call keeps what forms its weights, O((Q + K) D), not the ``(B, H, Q, K)``
    weights, where the framework keeps them as an attribute (Flax sows arrays instead). Read,
    they are exactly those of a call that returns them, with lengths, a mask and causal
    masking; read twice, the same object; and a new call replaces them."""
    h = Harness(backend)
    layer = h.make(name, NOT_KEEPING[name])
    q, kv = draw((BB, BQ, 8), (BB, BK, 8))
    args = [h.array(q), h.array(kv), h.array(kv), h.array(np.array([5, BK], np.int32))]
    options = {"mask": h.array(draw((BQ, BK), seed=1)[0] > -0.5), "causal": True}
    h.call(layer, *args, **options)
    if not getattr(h.hooks, "SOWS_WEIGHTS", False):
        assert isinstance(layer._attention_kept, ac.attention.WeightsOnRead)
    read = h.attention_weights(layer)
    assert h.attention_weights(layer) is read
    _, returned = h.call(layer, *args, **options, return_attention=True)
    assert h.numpy(read).shape == (BB, 2 if name == "MultiHeadAttention" else 1, BQ, BK)
    assert max_diff(h.numpy(read), h.numpy(returned)) == 0.0
    h.call(layer, *args)
    assert max_diff(h.numpy(h.attention_weights(layer)), h.numpy(read)) > 0


def test_weights_read_after_the_inputs_change_in_place_are_the_calls(backend: str) -> None:
    """A default call to a layer without projections keeps copies of the caller's arrays:
    changing them in place afterwards (torch, NumPy, MXNet) does not change the weights read."""
    h = Harness(backend)
    layer, other = h.make("DotProductAttention", {}), h.make("DotProductAttention", {})
    q, kv = draw((BB, BQ, 8), (BB, BK, 8))
    args = [h.array(q), h.array(kv), h.array(kv), h.array(np.array([5, BK], np.int32))]
    _, want = h.call(other, *args, return_attention=True)
    h.call(layer, *args)
    before = np.array(h.numpy(args[0]), copy=True)
    try:
        args[0][:] = args[0] * 3 + 1  # in place, where the framework's arrays allow it
        args[1][:] = args[1] * -2
    except TypeError:
        pytest.skip(f"{backend} arrays cannot change in place")
    assert max_diff(h.numpy(args[0]), before * 3 + 1) <= 1e-5  # they did change
    assert max_diff(h.numpy(h.attention_weights(layer)), h.numpy(want)) == 0.0



def has_fused_kernel(h: Harness) -> bool:
    """Whether the backend registers a ``"fused"`` kernel."""
    return any(entry.name == "fused" for entry in kernels.kernels(h.ops.name))

@pytest.mark.parametrize("name", list(NOT_KEEPING))
def test_invalid_implementation_gives_the_core_message(backend: str, name: str) -> None:
    with pytest.raises(ValueError) as err:
        Harness(backend).make(name, {**NOT_KEEPING[name], "implementation": "flash"})
    assert str(err.value) == ("implementation must be None, 'direct', 'blockwise', 'fused' or a "
                              "registered kernel's name, got 'flash'")


def test_fused_runs_where_the_backend_has_a_kernel_and_is_refused_elsewhere(backend: str) -> None:
    """A fused layer gives the direct path's output on a backend with a kernel (torch: SDPA,
    JAX: jax.nn.dot_product_attention); elsewhere the core refuses it on the first call."""
    h = Harness(backend)
    fused = h.make("DotProductAttention", {"keep_attention_weights": False,
                                           "implementation": "fused"})
    q, k, v = (h.array(x) for x in draw((2, 3, 4), (2, 5, 4), (2, 5, 4)))
    if not has_fused_kernel(h):
        with pytest.raises(ValueError) as err:
            h.call(fused, q, k, v)
        assert str(err.value) == (f"implementation='fused': the {h.ops.name} backend has no "
                                  "kernel of that name; its kernels are 'blockwise', 'direct'")
        return
    direct = h.make("DotProductAttention", {})
    assert max_diff(h.numpy(h.call(fused, q, k, v)), h.numpy(h.call(direct, q, k, v))) <= TOL


# -- the blockwise path equals the direct one ----------------------------------------------


def block_masks(h: Harness, kind: str) -> dict[str, Any]:
    rng = np.random.default_rng(len(kind))
    if kind == "combined":  # every way of masking at once, ANDed
        drawn = {**mask_arguments("valid_lens_2d", rng, BH, BQ, BK, BB),
                 **mask_arguments("mask_3d", rng, BH, BQ, BK, BB), "causal": True}
    else:
        drawn = mask_arguments(kind, rng, BH, BQ, BK, BB)
    return {name: x if name == "causal" else h.array(x) for name, x in drawn.items()}


@pytest.mark.parametrize("kind", BLOCK_KINDS)
def test_blockwise_equals_direct(backend: str, small_blocks: None, kind: str) -> None:
    """The core's blockwise loops on the backend's arrays: finite, the direct path's values,
    zero rows where no key is visible; a blockwise multi-head layer the same in the quick
    compiled modes."""
    h = Harness(backend)
    q, k, v = (h.array(x) for x in draw((BB, BH, BQ, 8), (BB, BH, BK, 8), (BB, BH, BK, 5)))
    masks = block_masks(h, kind)
    got = h.numpy(ac.dot_product_attention(q, k, v, implementation="blockwise", ops=h.ops, **masks))
    direct, weights = ac.dot_product_attention(q, k, v, return_weights=True, ops=h.ops, **masks)
    assert np.isfinite(got).all()
    assert max_diff(got, h.numpy(direct)) <= TOL
    empty = h.numpy(weights).sum(axis=-1) == 0  # (B, H, Q): rows with no visible key
    assert empty.any() or kind != "fully_masked_row"
    np.testing.assert_array_equal(got[empty], 0.0)

    x, y = (h.array(a) for a in draw((BB, BQ, 10), (BB, BK, 10), seed=1))
    kept = h.make("MultiHeadAttention", {"num_hiddens": 12, "num_heads": BH})
    light = h.make("MultiHeadAttention", {"num_hiddens": 12, "num_heads": BH,
                                          "keep_attention_weights": False,
                                          "implementation": "blockwise"})
    static = {"causal": masks["causal"]} if "causal" in masks else {}
    arrays = {n: a for n, a in masks.items() if n != "causal"}
    want = h.numpy(h.call(kept, x, y, y, **masks))
    light.set_weights(weights_of(kept))

    def pooled(layer: Any, *a: Any) -> Any:
        return h.call(layer, *a[:3], **dict(zip(arrays, a[3:], strict=True)), **static)

    for mode in QUICK_COMPILED_MODES.get(backend, ()):
        if mode not in FULL_MODES and kind not in COMPILED_BLOCK_KINDS:
            continue  # XLA compiles the loops in seconds: three kinds cover them
        out = h.numpy(h.run(mode, light, pooled, [x, y, y, *arrays.values()]))
        assert np.isfinite(out).all() and max_diff(out, want) <= TOL, mode


GRADIENT_KINDS = ("fully_masked_row", "mask_4d", "combined")


@pytest.mark.parametrize("kind", GRADIENT_KINDS)
def test_blockwise_and_fused_gradients_equal_direct(backend: str, small_blocks: None,
                                                    kind: str) -> None:
    """Gradients of a multi-head layer by its inputs and weights: the blockwise path (and the
    fused kernel, where the backend has one) equal the direct path's, in float64 where the
    backend computes in it, and have no NaN; in each way a layer can be set up."""
    h = Harness(backend)
    if backend not in AUTODIFF:
        pytest.skip(f"the {backend} backend has no autodiff")
    dtype = "float64" if "float64" in DTYPES[backend] else "float32"
    mode = FASTEST_GRADIENT_MODE.get(backend, "eager")
    if mode != "eager" and kind != "combined":
        pytest.skip("compiled per kind and path (seconds each): 'combined' holds every masking")
    masks = block_masks(h, kind)
    static = {"causal": masks.pop("causal")} if "causal" in masks else {}
    x, y, ct = draw((BB, BQ, 10), (BB, BK, 10), (BB, BQ, 12), seed=2)
    inputs = [h.array(a, dtype) for a in (x, y, y)]
    paths = ["blockwise", *(["fused"] if has_fused_kernel(h) else [])]
    grads: dict[str, dict[str, np.ndarray]] = {}
    weights: dict[str, np.ndarray] = {}

    def differentiated(layer: Any, *arrays: Any) -> Any:
        return h.forward_and_gradients(layer, lambda m, *xs: {"out": h.call(
            m, *xs, **dict(zip(masks, arrays[3:], strict=True)), **static)}, list(arrays[:3]),
            ct.astype(dtype))[1]

    for setup, path in ((setup, path) for setup in h.setups() for path in ["direct", *paths]):
        layer = h.make("MultiHeadAttention", {"num_hiddens": 12, "num_heads": BH,
                                              "keep_attention_weights": path == "direct",
                                              "implementation": path}, dtype)
        if weights:
            layer.set_weights(weights)
        else:
            h.call(layer, *inputs)
            weights = weights_of(layer)
        setup(layer)
        got = h.run(mode, layer, differentiated, [*inputs, *masks.values()])
        grads[path] = {n: h.numpy(g) for n, g in got.items()}
        if path == "direct":
            continue
        assert set(grads[path]) == set(grads["direct"])
        for name, g in grads[path].items():
            assert not np.isnan(g).any(), (path, name)
            assert max_diff(g, grads["direct"][name]) <= TOLERANCE[dtype], (path, name)
