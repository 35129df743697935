"""Greedy and beam search (issue 18): against an exhaustive search of a small Markov model, and
with a cached decoder on each backend, whose tokens equal those of recomputing the prefix."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

import attention_core as ac
from attention_core import generation as G
from attention_core import transformer as T
from attention_core.registry import ops_for
from tests.harness import Harness
from tests.test_decoder import H, S, on, stack_weights

EOS = 3


class Markov:
    """A step whose logits depend on the position and the last token only: a table
    ``(steps, V, V)``, so that every sequence's probability is known exactly."""

    def __init__(self, rng: np.random.Generator, vocab: int = 4, steps: int = 3) -> None:
        self.table = 2.0 * rng.standard_normal((steps, vocab, vocab))
        self.calls: list[int] = []

    def __call__(self, ids: Any, cache: Any, start: int) -> tuple[np.ndarray, Any]:
        self.calls.append(start)
        last = np.asarray(ids)[:, -1]
        return self.table[start][last][:, None, :], cache

    def log_prob(self, bos: int, sequence: tuple[int, ...]) -> float:
        total, last = 0.0, bos
        for t, token in enumerate(sequence):
            total += G.log_softmax(self.table[t][last])[token]
            last = token
        return float(total)


def exhaustive(model: Markov, bos: int, steps: int, alpha: float) -> tuple[tuple[int, ...], float]:
    """The best sequence by ``log P / L ** alpha`` among all that end at EOS or run ``steps``."""
    vocab = model.table.shape[1]
    best: tuple[tuple[int, ...], float] = ((), -np.inf)
    for n in range(1, steps + 1):
        for seq in itertools.product(range(vocab), repeat=n):
            if EOS in seq[:-1] or (n < steps and seq[-1] != EOS):
                continue
            score = model.log_prob(bos, seq) / n ** alpha
            if score > best[1]:
                best = (seq, score)
    return best


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("alpha", [0.0, 0.75])
def test_wide_beam_search_finds_the_best_sequence(seed: int, alpha: float) -> None:
    """With a beam as wide as every hypothesis, beam search is the exhaustive search."""
    model = Markov(np.random.default_rng(seed))
    bos = np.array([0, 1, 2])
    got = G.beam_search(model, bos, 3, beam_size=64, eos=EOS, length_penalty=alpha)
    for b in range(3):
        seq, score = exhaustive(model, int(bos[b]), 3, alpha)
        n = int(got.lengths[b])
        assert tuple(got.tokens[b, :n]) == seq
        assert np.all(got.tokens[b, n:] == EOS)
        assert got.scores[b] == pytest.approx(score, abs=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_beam_of_one_is_greedy(seed: int) -> None:
    model = Markov(np.random.default_rng(10 + seed), vocab=5, steps=6)
    bos = np.array([0, 4])
    greedy = G.greedy_search(model, bos, 6, eos=EOS)
    beam = G.beam_search(model, bos, 6, beam_size=1, eos=EOS, length_penalty=0.0)
    assert np.array_equal(greedy.tokens, beam.tokens)
    assert np.array_equal(greedy.lengths, beam.lengths)
    assert np.allclose(greedy.scores, beam.scores)
    for b in range(2):  # the greedy score is the log-probability of what it generated
        n = int(greedy.lengths[b])
        want = model.log_prob(int(bos[b]), tuple(greedy.tokens[b, :n]))
        assert greedy.scores[b] == pytest.approx(want, abs=1e-12)


def test_search_stops_when_every_sequence_ended() -> None:
    model = Markov(np.random.default_rng(20), vocab=4, steps=8)
    model.table[:, :, EOS] = 50.0  # EOS is by far the most likely token everywhere
    got = G.greedy_search(model, np.array([0, 1]), 8, eos=EOS)
    assert got.tokens.tolist() == [[EOS], [EOS]] and got.lengths.tolist() == [1, 1]
    assert model.calls == [0]


def test_search_errors_name_the_argument() -> None:
    model = Markov(np.random.default_rng(21))
    with pytest.raises(ValueError, match=r"bos must be integer start tokens of shape \(B,\)"):
        G.greedy_search(model, np.zeros((2, 1), int), 3)
    with pytest.raises(ValueError, match="max_steps must be a positive int, got 0"):
        G.greedy_search(model, np.array([0]), 0)
    with pytest.raises(ValueError, match="beam_size must be a positive int, got 0"):
        G.beam_search(model, np.array([0]), 3, beam_size=0)
    with pytest.raises(ValueError, match="length_penalty must be a finite number >= 0"):
        G.beam_search(model, np.array([0]), 3, length_penalty=-1.0)
    with pytest.raises(ValueError, match="eos must be None or a token id >= 0, got -1"):
        G.greedy_search(model, np.array([0]), 3, eos=-1)
    with pytest.raises(ValueError, match=r"logits of shape \(N, t, V\) with N = 3"):
        G.greedy_search(lambda ids, c, s: (np.zeros((2, 1, 4)), c), np.array([0, 1, 2]), 3)


@pytest.mark.parametrize("search", ["greedy", "beam"])
def test_cached_search_equals_recomputing_the_prefix(backend: str, search: str) -> None:
    """On each backend: the search with the decoder's cache generates the same tokens as the
    search that recomputes the whole prefix at every step (the d2l book's way)."""
    rng = np.random.default_rng(22)
    hb = Harness(backend)
    w = on(hb, stack_weights(rng, True))
    P = hb.array(ac.sinusoidal_encoding(16, w["token.embedding"].shape[1])[None], "float32")
    beams = 3 if search == "beam" else 1
    enc = G.repeat_rows(hb.array(rng.standard_normal((2, S, 8)), "float32"), beams)
    lens = G.repeat_rows(hb.array(np.array([S, 2])), beams)
    prefix: list[Any] = []

    def cached(ids: Any, cache: Any, start: int) -> Any:
        capacity = None if cache is not None else 10
        return T.cached_decoder(ids, w, H, cache, start, enc, lens, capacity=capacity,
                                positions=P)

    def recomputed(ids: Any, cache: Any, start: int) -> Any:
        if cache is not None:  # the rows of the prefix, reordered like a cache
            prefix[:] = [cache]
        rows = ids if start == 0 else ops_for(ids).concatenate([prefix[0], ids], 1)
        return ac.transformer_decoder(rows, w, H, enc, lens, positions=P), rows

    run = (G.greedy_search if search == "greedy"
           else lambda *a, **k: G.beam_search(*a, beam_size=beams, **k))
    bos = hb.array(np.array([1, 2], np.int32))
    want = run(recomputed, bos, 8, eos=0)
    got = run(cached, bos, 8, eos=0)
    assert np.array_equal(got.tokens, want.tokens)
    assert np.array_equal(got.lengths, want.lengths)
    assert np.allclose(got.scores, want.scores, atol=1e-4)
    assert got.tokens.shape[0] == 2 and got.tokens.shape[1] >= 1
