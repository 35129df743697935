"""Ragged batches through the decoder stacks and ``generate``: prompts of lengths 3, 8, 5 and 1,
left- or right-padded to 8, prefilled in one cached call (``start`` per example, ``lengths``)
and decoded together, each example equal to running it alone: logits within 1e-5, the same
greedy tokens; one compiled step serves every position."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import attention_core as ac
from attention_core import transformer as T
from attention_core import weights as W
from attention_core.declarations import TransformerDecoder
from tests.harness import Harness, max_diff

#: Not on the columns (conftest.py): the columns' ragged cached calls are tested in
#: tests/test_layer_cache.py.
COLUMN_TESTS = False

V, WIDTH, LENGTHS, PROMPT, STEPS = 23, 16, np.array([3, 8, 5, 1]), 8, 6
BOUND = 1e-5
#: A Llama-style decoder and the classic one (sinusoidal table, post-norm).
DECODERS = {
    "llama": {"num_kv_heads": 2, "positional": "rotary", "norm_first": True, "norm": "rms",
              "activation": "swiglu", "ffn_bias": False, "output_bias": False,
              "tie_output": True, "scale_embeddings": False, "bias": "qkv"},
    "classic": {},
}


def _decoder(hb: Harness, name: str) -> Any:
    return hb.make("TransformerDecoder", {"vocab_size": V, "num_hiddens": WIDTH,
                                          "ffn_num_hiddens": 24, "num_heads": 4, "num_blks": 2,
                                          "decoder_only": True, "max_len": 32,
                                          **DECODERS[name]})


def _padded(tokens: np.ndarray, padding: str) -> np.ndarray:
    """Each example's first ``LENGTHS[b]`` tokens in a row of :data:`PROMPT`, padded with 0."""
    rows = np.zeros((len(LENGTHS), PROMPT), np.int32)
    for b, n in enumerate(LENGTHS):
        if padding == "left":
            rows[b, PROMPT - n:] = tokens[b, :n]
        else:
            rows[b, :n] = tokens[b, :n]
    return rows


@pytest.mark.parametrize(("name", "padding"), [("llama", "left"), ("llama", "right"),
                                             ("classic", "left")])
def test_ragged_decoder_equals_each_example_alone(backend: str, name: str, padding: str) -> None:
    hb = Harness(backend)
    tokens = np.random.default_rng(1).integers(1, V, (4, PROMPT + STEPS)).astype(np.int32)
    layer = _decoder(hb, name)
    alone = hb.numpy(hb.call(layer, hb.array(tokens)))  # a causal row sees no later token
    for setup in hb.setups():
        setup(layer)
    out, cache = hb.call(layer, hb.array(_padded(tokens, padding)), capacity=20,
                         start=np.zeros(4, np.int32), lengths=LENGTHS, padding=padding)
    out = hb.numpy(out)
    worst = max(max_diff(out[b, PROMPT - n:] if padding == "left" else out[b, :n], alone[b][:n])
                for b, n in enumerate(LENGTHS))
    start = LENGTHS.astype(np.int32)
    for s in range(STEPS):
        step = hb.array(np.array([tokens[b, n + s] for b, n in enumerate(LENGTHS)], np.int32)[:, None])
        logits, cache = hb.call(layer, step, cache=cache, start=hb.array(start) if s % 2 else start)
        logits = hb.numpy(logits)
        worst = max(worst, *(max_diff(logits[b, 0], alone[b][n + s])
                             for b, n in enumerate(LENGTHS)))
        start = start + 1
    assert worst <= BOUND


def test_ragged_generate_equals_each_prompt_alone(backend: str) -> None:
    """16 greedy tokens of the left-padded batch (generation's usual side; the decoder test
    above runs both sides) are each prompt's own, scores within 1e-4."""
    hb, padding = Harness(backend), "left"
    tokens = np.random.default_rng(2).integers(1, V, (4, PROMPT)).astype(np.int32)
    layer = _decoder(hb, "llama")
    step = ac.decoder_step(lambda *a, **k: hb.call(layer, *a, **k), 32)
    batch = ac.generate(step, hb.array(_padded(tokens, padding)), max_new_tokens=16,
                        lengths=LENGTHS, padding=padding)
    for b, n in enumerate(LENGTHS):
        alone = ac.generate(step, hb.array(tokens[b:b + 1, :n]), max_new_tokens=16)
        np.testing.assert_array_equal(batch.tokens[b], alone.tokens[0])
        assert abs(batch.scores[b] - alone.scores[0]) <= 1e-4


def test_ragged_steps_compile_once(backend: str) -> None:
    """One compiled step with a per-example start ``(B,)`` serves every position."""
    from tests.test_cache import _compiled

    hb = Harness(backend)
    if not hasattr(hb.hooks, "compiled_step") and not hasattr(hb.hooks, "compiled_function"):
        pytest.skip(f"{backend} compiles no plain function")
    rng = np.random.default_rng(3)
    config = {"num_kv_heads": 2, "positional": "rotary"}
    options = ac.HeadOptions(**config)
    spec = TransformerDecoder(V, WIDTH, 24, 4, 2, decoder_only=True, **config).weight_shapes()
    w = {n: hb.array(x, "float32") for n, x in W.init_weights(spec, rng).items()}
    tokens = rng.integers(1, V, (4, PROMPT + STEPS)).astype(np.int32)
    alone = hb.numpy(ac.transformer_decoder(hb.array(tokens), w, 4, options=options))

    def step(ids: Any, start: Any, cache: Any) -> Any:
        return T.cached_decoder(ids, w, 4, cache, start, options=options)

    if backend == "torch":  # Dynamo's one graph, run without Inductor's minute of code
        compiled, traces = hb.hooks.compiled_step(step, compiler="aot_eager")
    else:
        compiled, traces = _compiled(hb, step)
    _, cache = T.cached_decoder(hb.array(_padded(tokens, "left")), w, 4, None,
                                np.zeros(4, np.int32), capacity=20, options=options,
                                lengths=LENGTHS, padding="left")
    worst = 0.0
    for s in range(STEPS):
        ids = hb.array(np.array([tokens[b, n + s] for b, n in enumerate(LENGTHS)], np.int32)[:, None])
        logits, cache = compiled(ids, hb.array((LENGTHS + s).astype(np.int32)), cache)
        logits = hb.numpy(logits)
        worst = max(worst, *(max_diff(logits[b, 0], alone[b][n + s])
                             for b, n in enumerate(LENGTHS)))
    assert worst <= BOUND
    assert traces() == 1, f"the step was traced {traces()} times"
