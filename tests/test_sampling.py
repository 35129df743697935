"""Sampling on the device (``choose``) and ``generate``, on every backend.

The frequencies of 10,000 draws in one batched call are compared with probabilities computed
here in float64 (a chi-square test at the 0.999 level); filtered tokens never appear; the same
seed gives the same tokens; ``generate`` pads each row after its own ``eos`` and stops when all
have ended, and greedy ``generate`` is the host search's greedy decoding.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import attention_core as ac
from tests.harness import Harness

#: Probabilities of the test distribution, shuffled so that the kept tokens are not the first.
PROBS = np.array([0.32, 0.24, 0.15, 0.12, 0.07, 0.05, 0.03, 0.02])[[3, 0, 6, 1, 7, 2, 5, 4]]
#: Chi-square critical values at 0.999 by degrees of freedom (the numpy env has no scipy).
CRITICAL = {3: 16.27, 7: 24.32}
ROWS = 10_000


def expected(temperature: float, top_k: int | None, top_p: float | None) -> np.ndarray:
    """The sampling distribution over the 8 tokens, in float64, by sorting on the host."""
    logits = np.log(PROBS) / temperature
    order = np.argsort(-logits, kind="stable")
    keep = np.zeros(len(logits), bool)
    keep[order[: top_k or len(logits)]] = True
    p = np.where(keep, np.exp(logits - logits.max()), 0.0)
    p /= p.sum()
    if top_p is not None:
        sorted_p = p[order]
        before = np.cumsum(sorted_p) - sorted_p
        keep[order[before >= top_p]] = False
        p = np.where(keep, p, 0.0) / p[keep].sum()
    return p


def draw(hb: Harness, seed: int, rows: int = ROWS, **settings: Any) -> np.ndarray:
    """Tokens of one batched ``choose`` over ``rows`` copies of the test logits."""
    logits = hb.array(np.tile(np.log(PROBS), (rows, 1)), "float32")
    state = hb.ops.new_sampling_state(seed, like=logits)
    tokens, _ = ac.choose(hb.ops, logits, state=state, **settings)
    assert hb.ops.dtype_name(tokens) == "int32" and hb.ops.shape(tokens) == (rows,)
    return np.asarray(hb.ops.to_numpy(tokens))


@pytest.mark.parametrize("settings", [{"temperature": 1.5, "top_k": 4},
                                      {"temperature": 1.0, "top_p": 0.8},
                                      {"temperature": 0.7}], ids=["top_k", "top_p", "temperature"])
def test_draws_follow_the_distribution(backend: str, settings: dict[str, Any]) -> None:
    """10,000 draws in one call: chi-square below the 0.999 critical value, none filtered."""
    want = expected(settings["temperature"], settings.get("top_k"), settings.get("top_p"))
    counts = np.bincount(draw(Harness(backend), 5, **settings), minlength=len(PROBS))
    kept = want > 0
    assert kept.sum() == (8 if len(settings) == 1 else 4)
    assert np.all(counts[~kept] == 0), counts
    chi2 = float(np.sum((counts[kept] - ROWS * want[kept]) ** 2 / (ROWS * want[kept])))
    assert chi2 < CRITICAL[int(kept.sum()) - 1], (chi2, counts, ROWS * want)


def test_the_same_seed_draws_the_same_tokens(backend: str) -> None:
    """Two states of one seed draw the same tokens; another seed, or the next draw, differ."""
    hb = Harness(backend)
    logits = hb.array(np.random.default_rng(0).standard_normal((64, 8)), "float32")
    settings = {"temperature": 1.0, "top_k": 6, "top_p": 0.95}

    def two_draws(seed: int) -> list[np.ndarray]:
        state = hb.ops.new_sampling_state(seed, like=logits)
        first, state = ac.choose(hb.ops, logits, state=state, **settings)
        second, _ = ac.choose(hb.ops, logits, state=state, **settings)
        return [np.asarray(hb.ops.to_numpy(t)) for t in (first, second)]

    a, b, c = two_draws(3), two_draws(3), two_draws(4)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    assert not np.array_equal(a[0], c[0])
    assert not np.array_equal(a[0], a[1])


def test_temperature_zero_is_the_argmax(backend: str) -> None:
    """Temperature 0 (or None) is the argmax, whatever top_k and top_p say; no state needed."""
    hb = Harness(backend)
    x = np.random.default_rng(1).standard_normal((32, 11)).astype(np.float32)
    for settings in ({"temperature": 0}, {"temperature": None, "top_k": 3}, {"top_p": 0.5}):
        tokens, state = ac.choose(hb.ops, hb.array(x), **settings)
        assert state is None
        assert np.array_equal(np.asarray(hb.ops.to_numpy(tokens)), x.argmax(axis=1))


def test_choose_compiles(backend: str) -> None:
    """Under ``jax.jit`` (the key passed in and returned) and ``torch.compile``, ``choose``
    draws what it draws eagerly from the same seed."""
    if backend not in ("jax", "torch"):
        pytest.skip("jax.jit and torch.compile are tested on their own backends")
    hb = Harness(backend)
    logits = hb.array(np.random.default_rng(2).standard_normal((16, 8)), "float32")
    settings = {"temperature": 0.9, "top_k": 5, "top_p": 0.9}

    def sample(x: Any, state: Any) -> Any:
        return ac.choose(hb.ops, x, state=state, **settings)

    if backend == "jax":
        import jax

        compiled = jax.jit(sample)
    else:
        import torch

        torch._dynamo.reset()
        compiled = torch.compile(sample, backend="aot_eager")
    want, _ = sample(logits, hb.ops.new_sampling_state(7, like=logits))
    got, state = compiled(logits, hb.ops.new_sampling_state(7, like=logits))
    again, _ = compiled(logits, state)
    assert np.array_equal(hb.ops.to_numpy(got), hb.ops.to_numpy(want))
    assert not np.array_equal(hb.ops.to_numpy(again), hb.ops.to_numpy(want))


# -- generate ---------------------------------------------------------------------------------

EOS, PAD = 3, 9
#: The token each row's step makes certain at each new position: row 0 ends at its second
#: token, row 1 at its fourth.
SCRIPT = np.array([[5, EOS, 6, 6, 6], [4, 4, 4, EOS, 6]])


class Scripted:
    """A step on one backend whose logits make each row emit its ``SCRIPT`` (V = 10)."""

    def __init__(self, hb: Harness) -> None:
        self.hb, self.starts, self.ids = hb, [], []

    def __call__(self, ids: Any, cache: Any, start: int) -> Any:
        self.starts.append(start)
        self.ids.append(ids if isinstance(ids, np.ndarray) else self.hb.ops.to_numpy(ids))
        t = self.ids[-1].shape[1]
        logits = np.zeros((2, t, 10), np.float32)
        logits[np.arange(2), -1, SCRIPT[:, start + t - 3]] = 50.0  # prompts of 3 tokens
        return self.hb.array(logits), cache


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_generate_pads_after_each_rows_eos(backend: str, temperature: float) -> None:
    """Each row ends at its own eos and gets pad_id after it; the search stops when all have
    ended, feeding each step the chosen tokens (pads included) at the next position."""
    hb = Harness(backend)
    step = Scripted(hb)
    got = ac.generate(step, hb.array(np.array([[1, 2, 0], [2, 1, 0]])), max_new_tokens=5,
                      eos=EOS, pad_id=PAD, temperature=temperature, top_k=3, seed=1)
    assert np.array_equal(got.tokens, [[5, EOS, PAD, PAD], [4, 4, 4, EOS]])
    assert np.array_equal(got.lengths, [2, 4])
    assert step.starts == [0, 3, 4, 5]
    assert np.array_equal(step.ids[3][:, 0], [PAD, 4])
    assert np.allclose(got.scores, 0.0, atol=1e-5)  # each chosen token had probability ~1
    short = ac.generate(Scripted(hb), [[1, 2, 0], [2, 1, 0]], max_new_tokens=2, eos=EOS)
    assert np.array_equal(short.tokens, [[5, EOS], [4, 4]])
    assert np.array_equal(short.lengths, [2, 2])


def decoder(hb: Harness) -> Any:
    """A step of a small cached decoder-only Transformer."""
    layer = hb.make("TransformerDecoder", {"vocab_size": 9, "num_hiddens": 8, "ffn_num_hiddens": 8,
                                           "num_heads": 2, "num_blks": 1, "decoder_only": True})
    hb.call(layer, hb.array(np.array([[1, 2]])))

    def step(ids: Any, cache: Any, start: int) -> Any:
        if cache is None:
            return hb.call(layer, ids, capacity=12)
        return hb.call(layer, ids, cache=cache, start=start)
    return step


def test_greedy_generate_is_greedy_search(backend: str) -> None:
    """Greedy ``generate`` of one-token prompts (device argmax) is ``greedy_search`` from those
    tokens (host float64 argmax), with pad_id = eos; sampling is reproducible by seed."""
    hb = Harness(backend)
    step = decoder(hb)
    bos = np.array([1, 5, 7])
    want = ac.greedy_search(step, hb.array(bos), 8, eos=0)
    got = ac.generate(step, hb.array(bos[:, None]), max_new_tokens=8, eos=0, pad_id=0)
    assert np.array_equal(got.tokens, want.tokens)
    assert np.array_equal(got.lengths, want.lengths)
    assert np.allclose(got.scores, want.scores, atol=1e-4)
    sampled = [ac.generate(step, bos[:, None], max_new_tokens=8, temperature=1.0, seed=s).tokens
               for s in (2, 2, 3)]
    assert np.array_equal(sampled[0], sampled[1])
    assert not np.array_equal(sampled[0], sampled[2])
