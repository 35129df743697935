"""The worked examples: the Nadaraya-Watson fit and the Bahdanau seq2seq, and the
encoder-decoder Transformer.

The examples live in the repository's ``examples/`` (run from its root, not installed). The
framework-free helpers (``examples.seq2seq``, ``examples.nadaraya_watson``) are tested in every
env. On the backend under test, ``examples/<example>_<backend>.py`` is trained for real:

* Nadaraya-Watson (torch, tensorflow, jax, mxnet): the loss falls, the first loss is the
  leave-one-out loss at ``w = 1`` computed here by a plain loop, the learned ``w`` lowers the
  leave-one-out loss, and the predictions are the kernel formula's and beat the mean predictor.
* Seq2seq with Bahdanau attention (torch, tensorflow, jax): trained once per backend on the
  reversal task (200 steps, the default); the loss falls, held-out sequences are reversed well
  above chance, and the attention on padded source positions is exactly 0.

* The Transformer (torch, tensorflow, jax): trained once per backend (400 steps, seed 0) in
  one test; at least 95 % of the held-out sequences come back exact with greedy search, beam
  search is no more than 1 % below, the cross-attention on padded source positions is exactly
  0, and the weights saved as safetensors decode on NumPy to the trainer's tokens. Every env
  (Gluon and NumPy too) decodes the torch-trained ``tests/fixtures/transformer_reverse.safetensors``
  the same way, to NumPy's tokens.

The seq2seq bounds hold with a margin on seeds 0-4 of every backend (token accuracy measured
0.94-0.996 against the bound 0.8; last-10 loss at most 0.07 against 0.5 x about 2.3). The
Transformer's too: exact match measured 0.998-1.000 greedy and by beam search on seeds 0-4 of
torch, Keras and Flax, against the bound 0.95.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import attention_core as ac
from attention_core.demo import leave_one_out_loss
from examples import nadaraya_watson as nw
from examples import seq2seq
from examples import transformer as tx
from examples import transformer_decode as decode_script

#: Backends with a trainable Nadaraya-Watson example, and those with the seq2seq example.
NW_BACKENDS = ("torch", "tensorflow", "jax", "mxnet")
SEQ2SEQ_BACKENDS = ("torch", "tensorflow", "jax")


def example_module(backend: str, which: tuple[str, ...], example: str) -> Any:
    if backend not in which:
        pytest.skip(f"no such example on {backend}")
    return importlib.import_module(f"examples.{example}_{backend}")


@contextlib.contextmanager
def one_torch_thread(backend: str) -> Iterator[None]:
    """On torch, one thread inside: for tiny ops, OpenMP's thread sync costs more than it gains."""
    if backend != "torch":
        yield
        return
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


# -- framework-free helpers -----------------------------------------------------------------------


def test_toy_task_reverse_layout() -> None:
    data = seq2seq.toy_task(50, vocab_size=9, min_len=2, max_len=5, seed=3)
    assert data.source.shape == data.targets.shape == data.decoder_inputs.shape == (50, 6)
    assert data.source.dtype == np.int32
    for n in range(50):
        length = int(data.source_lens[n])
        assert 3 <= length <= 6 and data.target_lens[n] == length
        tokens = data.source[n, : length - 1]
        assert ((tokens >= seq2seq.FIRST_TOKEN) & (tokens < 9)).all()
        assert data.source[n, length - 1] == seq2seq.EOS
        assert (data.source[n, length:] == seq2seq.PAD).all()
        assert list(data.targets[n, : length - 1]) == list(tokens[::-1])
        assert data.targets[n, length - 1] == seq2seq.EOS
        assert (data.targets[n, length:] == seq2seq.PAD).all()
        # teacher forcing: <bos>, then the targets shifted right by one
        assert data.decoder_inputs[n, 0] == seq2seq.BOS
        assert list(data.decoder_inputs[n, 1:length]) == list(data.targets[n, : length - 1])
        assert (data.decoder_inputs[n, length:] == seq2seq.PAD).all()


def test_toy_task_copy_and_bad_arguments() -> None:
    data = seq2seq.toy_task(5, task="copy", seed=1)
    np.testing.assert_array_equal(data.targets, data.source)
    with pytest.raises(ValueError, match="task must be one of 'reverse', 'copy', got 'sort'"):
        seq2seq.toy_task(5, task="sort")
    with pytest.raises(ValueError, match="vocab_size must be > 3"):
        seq2seq.toy_task(5, vocab_size=3)
    with pytest.raises(ValueError, match="min_len=4, max_len=2"):
        seq2seq.toy_task(5, min_len=4, max_len=2)


def test_pad_and_loss_weights() -> None:
    np.testing.assert_array_equal(seq2seq.pad([[5, 6], [7]], 3), [[5, 6, 0], [7, 0, 0]])
    with pytest.raises(ValueError, match="sequence 0 has 3 tokens, more than length=2"):
        seq2seq.pad([[1, 2, 3]], 2)
    np.testing.assert_array_equal(seq2seq.loss_weights([2, 0, 4], 4),
                                  [[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])


def test_minibatches_cover_each_pass_once() -> None:
    batches = list(seq2seq.minibatches(10, 3, steps=7, seed=0))
    assert len(batches) == 7 and all(b.shape == (3,) for b in batches)
    # 3 full batches per pass of 10 (the 10th example of each pass is dropped)
    for start in (0, 3):
        seen = np.concatenate(batches[start : start + 3])
        assert len(set(seen.tolist())) == 9
    with pytest.raises(ValueError, match="batch_size must be in"):
        next(seq2seq.minibatches(2, 3, 1))


def test_greedy_decode_feeds_back_and_pads_after_eos() -> None:
    # A fake decoder: row 0 counts up from its input token, row 1 says <eos> at once.
    fed = []

    def step(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        fed.append(tokens.copy())
        logits = np.zeros((2, 16))
        logits[0, tokens[0] + 3] = 1.0
        logits[1, seq2seq.EOS] = 1.0
        return logits, np.full((2, 4), len(fed), dtype=float)

    tokens, weights = seq2seq.greedy_decode(step, batch_size=2, num_steps=3)
    np.testing.assert_array_equal(fed[0], [seq2seq.BOS, seq2seq.BOS])
    np.testing.assert_array_equal(fed[1], [4, seq2seq.EOS])
    np.testing.assert_array_equal(tokens, [[4, 7, 10], [seq2seq.EOS, seq2seq.PAD, seq2seq.PAD]])
    assert weights.shape == (2, 3, 4)
    np.testing.assert_array_equal(weights[0, :, 0], [1, 2, 3])


def test_token_accuracy() -> None:
    targets = np.array([[5, 6, seq2seq.EOS, 0], [7, seq2seq.EOS, 0, 0]], np.int32)  # 5 scored positions
    lens = np.array([3, 2], np.int32)
    data = seq2seq.Seq2SeqData(targets, lens, targets, targets, lens, vocab_size=8)
    predicted = targets.copy()
    assert seq2seq.token_accuracy(predicted, data) == 1.0
    predicted[0, 0] = 6  # one wrong token
    predicted[1, 2:] = 5  # padding is not scored
    assert seq2seq.token_accuracy(predicted, data) == 4 / 5
    assert seq2seq.token_accuracy(targets[:, :1], data) == 2 / 5  # missing steps are wrong


def test_training_arrays_leave_each_point_out() -> None:
    data = nw.nadaraya_watson_data(n_train=6, seed=2)
    queries, keys, values, targets = nw.training_arrays(data)
    assert queries.shape == (6, 1) and keys.shape == values.shape == (6, 5)
    for i in range(6):
        assert queries[i, 0] == data.x_train[i] and targets[i] == data.y_train[i]
        np.testing.assert_array_equal(keys[i], np.delete(data.x_train, i))
        np.testing.assert_array_equal(values[i], np.delete(data.y_train, i))


# -- Nadaraya-Watson, trained on the backend --------------------------------------------------------


def kernel_predict(w: float, x: np.ndarray, x_keys: np.ndarray, y_keys: np.ndarray) -> np.ndarray:
    """The Gaussian-kernel regression formula, one query at a time (float64)."""
    out = []
    for q in np.asarray(x, np.float64):
        k = np.exp(-0.5 * ((q - x_keys.astype(np.float64)) * w) ** 2)
        out.append(k @ y_keys.astype(np.float64) / k.sum())
    return np.array(out)


def loo_loss(w: float, data: nw.RegressionData) -> float:
    """Mean of (f(x_i) - y_i)^2 / 2, each point predicted from the others (a plain loop)."""
    n = len(data.x_train)
    errors = [
        (kernel_predict(w, data.x_train[i : i + 1], np.delete(data.x_train, i),
                        np.delete(data.y_train, i))[0] - data.y_train[i]) ** 2 / 2
        for i in range(n)
    ]
    return float(np.mean(errors))


def learned_w(backend: str, fitted: Any) -> float:
    if backend == "jax":
        from backends.jax import get_weights

        return float(get_weights(fitted)["w"][0])
    return float(fitted.get_weights()["w"][0])


def test_nadaraya_watson_fit(backend: str) -> None:
    module = example_module(backend, NW_BACKENDS, "nadaraya_watson")
    data = nw.nadaraya_watson_data()
    fitted, losses = module.fit_nadaraya_watson(data)
    assert len(losses) == 10
    # the first loss is that of the starting w = 1, computed independently
    assert losses[0] == pytest.approx(loo_loss(1.0, data), rel=1e-5)
    assert losses[-1] < 0.75 * losses[0], losses
    w = learned_w(backend, fitted)
    assert w > 1.0
    assert leave_one_out_loss(w, data) < 0.75 * leave_one_out_loss(1.0, data)
    assert loo_loss(w, data) < 0.75 * loo_loss(1.0, data)
    # predictions at x_test use every training point as keys and values
    predicted = module.predict_nadaraya_watson(fitted, data)
    np.testing.assert_allclose(predicted, kernel_predict(w, data.x_test, data.x_train, data.y_train),
                               rtol=1e-5, atol=1e-5)
    fit_error = np.mean((predicted - data.y_truth) ** 2)
    mean_error = np.mean((data.y_train.mean() - data.y_truth) ** 2)
    assert fit_error < 0.5 * mean_error, (fit_error, mean_error)


def test_nadaraya_watson_script(backend: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m examples.nadaraya_watson_<backend>`` fits and says what it learned."""
    module = example_module(backend, NW_BACKENDS, "nadaraya_watson")
    assert module.main() == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("Nadaraya-Watson pooling, w fitted with ") and "(10 SGD steps)" in lines[0]
    assert len(lines[1].split(":")[1].split()) == 10
    data = nw.nadaraya_watson_data()
    w = learned_w(backend, module.fit_nadaraya_watson(data)[0])
    assert f"learned w = {w:.4f}" in lines[2]
    assert f"(at w = 1: {loo_loss(1.0, data):.4f})" in lines[2]


# -- Bahdanau seq2seq, trained on the backend -----------------------------------------------------

STEPS = 200


@functools.cache
def trained(backend: str) -> tuple[list[float], np.ndarray, np.ndarray, seq2seq.Seq2SeqData]:
    """Trains the backend's seq2seq once; returns the losses and the greedy decoding of held-out data."""
    module = example_module(backend, SEQ2SEQ_BACKENDS, "seq2seq")
    test = seq2seq.toy_task(200, seed=1000)
    num_steps = test.targets.shape[1]
    if backend == "torch":
        with one_torch_thread(backend):
            model, losses = module.train_seq2seq(steps=STEPS)
            tokens, attention = model.predict(test.source, test.source_lens, num_steps)
    elif backend == "tensorflow":
        model, losses = module.train_seq2seq(steps=STEPS)
        tokens, attention = model.translate(test.source, test.source_lens, num_steps)
    else:
        model, params, losses = module.train_seq2seq(steps=STEPS)
        tokens, attention = module.translate(model, params, test.source, test.source_lens, num_steps)
    return losses, tokens, attention, test


def test_seq2seq_loss_falls(backend: str) -> None:
    losses = trained(backend)[0]
    assert len(losses) == STEPS and np.isfinite(losses).all()
    first, last = np.mean(losses[:10]), np.mean(losses[-10:])
    assert last < 0.5 * first, (first, last)


def test_seq2seq_reverses_held_out_sequences(backend: str) -> None:
    _, tokens, _, test = trained(backend)
    assert tokens.shape == test.targets.shape
    # chance is about 1 / 10 (10 ordinary tokens); measured 0.94-0.996 over seeds 0-4
    assert seq2seq.token_accuracy(tokens, test) > 0.8


def test_seq2seq_attention_skips_padding(backend: str) -> None:
    _, _, attention, test = trained(backend)
    B, S = test.source.shape
    assert attention.shape == (B, test.targets.shape[1], S)
    padded = np.arange(S)[None, None, :] >= test.source_lens[:, None, None]  # (B, 1, S)
    padded = np.broadcast_to(padded, attention.shape)
    assert (attention[padded] == 0).all()
    assert (attention[~padded] > 0).all()
    np.testing.assert_allclose(attention.sum(-1), 1.0, rtol=1e-5)


def test_seq2seq_script(backend: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m examples.seq2seq_<backend> --steps 3`` trains, decodes and reports."""
    module = example_module(backend, SEQ2SEQ_BACKENDS, "seq2seq")
    assert module.main(["--steps", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("Seq2seq with Bahdanau attention in ") and "3 training steps" in lines[0]
    assert "held-out token accuracy" in lines[2] and "(200 sequences)" in lines[2]
    accuracy = float(lines[2].split("accuracy ")[1].split()[0])
    assert 0.0 <= accuracy <= 1.0


def test_seq2seq_report_counts_what_it_says() -> None:
    data = seq2seq.toy_task(4, seed=5)
    predicted = data.targets.copy()
    predicted[:, 0] = seq2seq.PAD  # the first position wrong in every row
    text = seq2seq.report("X", [4.0] * 10 + [1.0] * 10, predicted, data)
    scored = int(data.target_lens.sum())
    assert f"held-out token accuracy {(scored - 4) / scored:.3f} (4 sequences)" in text
    assert "first 10 steps 4.0000, of the last 10 1.0000" in text
    assert "in X, 20 training steps" in text


# -- the encoder-decoder Transformer ---------------------------------------------------

#: Backends with a training script; every backend decodes (examples.transformer.from_weights).
TRANSFORMER_BACKENDS = ("torch", "tensorflow", "jax")
#: Weights trained once by torch (seed 0, 400 steps): every env decodes the held-out set with
#: them, Gluon and NumPy included.
FIXTURE = tx.TRAINED_WEIGHTS


def test_learning_rates_warm_up_then_decay() -> None:
    rates = tx.learning_rates(400, peak=0.01, warmup=50)
    assert rates.shape == (400,) and rates.dtype == np.float32
    assert rates[0] == pytest.approx(0.01 / 50) and rates[9] == pytest.approx(0.01 * 10 / 50)
    assert rates[49] == pytest.approx(0.01) and (np.diff(rates[:50]) > 0).all()
    assert (np.diff(rates[49:]) < 0).all()
    # a cosine from the peak to 0 (one step after the last) is symmetric about its middle
    k = np.arange(1, 351)
    np.testing.assert_allclose(rates[49 + k] + rates[400 - k], 0.01, rtol=1e-5)
    assert 0 < rates[-1] < 0.01 * 1e-4


def test_held_out_leaves_the_training_sources_out() -> None:
    train = tx.training_data(seed=3)
    test = tx.held_out(train)
    seen = {row.tobytes() for row in train.source}
    assert 0 < len(test) < tx.HELD_OUT_SIZE  # short sequences repeat: some are dropped
    assert not any(row.tobytes() in seen for row in test.source)
    assert len(tx.held_out(seq2seq.toy_task(1, seed=99))) == tx.HELD_OUT_SIZE


def test_exact_match_counts_whole_sequences() -> None:
    E = seq2seq.EOS
    targets = np.array([[5, 6, E, 0], [7, E, 0, 0], [8, 9, E, 0]], np.int32)
    lens = np.array([3, 2, 3], np.int32)
    data = seq2seq.Seq2SeqData(targets, lens, targets, targets, lens, vocab_size=13)
    # row 0 right (eos repeated after its end), row 1 goes on past the target, row 2 wrong
    tokens = np.array([[5, 6, E, E], [7, 4, E, E], [8, 5, E, E]])
    generated = ac.Generated(tokens, np.array([3, 3, 3]), np.zeros(3))
    np.testing.assert_array_equal(tx.padded(generated, 4), [[5, 6, E, 0], [7, 4, E, 0], [8, 5, E, 0]])
    np.testing.assert_array_equal(tx.exact_match(generated, data), [True, False, False])
    never_ends = ac.Generated(np.array([[5, 6]] * 3), np.array([2, 2, 2]), np.zeros(3))
    assert not tx.exact_match(never_ends, data).any()


def test_token_names() -> None:
    assert tx.token_names([0, 1, 2, 3, 12]) == ["<pad>", "<bos>", "<eos>", "0", "9"]


def check_decoding(decoding: tx.Decoding, test: seq2seq.Seq2SeqData) -> ac.Generated:
    """Greedy and beam search on the held-out set: at least 95 % exact, beam no worse than
    greedy by more than 1 %; the cross-attention weights are 0 over padded source positions."""
    greedy = tx.search(decoding, test.source, test.source_lens)
    beam = tx.search(decoding, test.source, test.source_lens, beam_size=tx.BEAM_SIZE)
    exact = tx.exact_match(greedy, test).mean()
    assert exact >= 0.95, exact
    assert tx.exact_match(beam, test).mean() >= exact - 0.01
    weights = tx.cross_attention(decoding, test.source, test.source_lens, greedy)
    S = test.source.shape[1]
    padded = np.arange(S)[None, None, None, :] >= test.source_lens[:, None, None, None]
    assert len(weights) == tx.CONFIG.num_blks
    for block in weights:
        assert block.shape == (len(test), tx.CONFIG.num_heads, S, S)
        assert (block[np.broadcast_to(padded, block.shape)] == 0).all()
        np.testing.assert_allclose(block.sum(-1), 1.0, rtol=1e-5)
    return greedy


def test_transformer_fixture_decodes_on_every_backend(backend: str) -> None:
    """Weights trained by torch, read from safetensors by the backend's layers (Flax: params),
    decode as well as the trainer did, and to the tokens NumPy decodes."""
    weights = ac.load_weights(FIXTURE)
    test = tx.held_out(tx.training_data(seed=0))
    with one_torch_thread(backend):
        greedy = check_decoding(tx.from_weights(backend, weights), test)
    if backend != "numpy":
        on_numpy = tx.search(tx.from_weights("numpy", weights), test.source, test.source_lens)
        np.testing.assert_array_equal(greedy.tokens, on_numpy.tokens)


def test_transformer_trains_and_exchanges(backend: str, tmp_path: Path) -> None:
    """The backend's script trains the Transformer (400 steps): the loss falls, held-out
    sequences are reversed exactly, and its weights, saved as safetensors, decode on NumPy to
    the trainer's own tokens. One test, so that one worker trains (pytest-xdist)."""
    module = example_module(backend, TRANSFORMER_BACKENDS, "transformer")
    with one_torch_thread(backend):
        *_, trained, losses = module.train_transformer()
        assert len(losses) == tx.STEPS and np.isfinite(losses).all()
        # measured on seeds 0-4 of each backend: first 10 steps' mean 2.61-3.39, last 10's 0.0016-0.0031
        assert np.mean(losses[-10:]) < 0.02 < 2.0 < np.mean(losses[:10])
        test = tx.held_out(tx.training_data(seed=0))
        greedy = check_decoding(module.decoding(trained), test)
    ac.save_weights(tmp_path / "trained.safetensors", trained)
    on_numpy = tx.from_weights("numpy", ac.load_weights(tmp_path / "trained.safetensors"))
    np.testing.assert_array_equal(tx.search(on_numpy, test.source, test.source_lens).tokens,
                                  greedy.tokens)


def test_transformer_script(backend: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m examples.transformer_<backend> --steps 3 --save FILE`` trains, decodes,
    reports and saves weights that every backend's layers take."""
    module = example_module(backend, TRANSFORMER_BACKENDS, "transformer")
    path = tmp_path / "w.safetensors"
    with one_torch_thread(backend):
        assert module.main(["--steps", "3", "--save", str(path), "--beam", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("Transformer (encoder-decoder) in ") and ": 3 training steps in " in lines[0]
    count = len(tx.held_out(tx.training_data(seed=0)))
    assert f"held-out exact match ({count} sequences): greedy " in lines[2]
    assert "beam search (2 beams)" in lines[2] and lines[3].startswith("  source ")
    saved = ac.load_weights(path)
    assert saved.keys() == ac.load_weights(FIXTURE).keys()
    tx.from_weights("numpy", saved)  # names and shapes fit the NumPy layers


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                    reason="needs matplotlib (the plot extra)")
def test_transformer_decode_script_plots(backend: str, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m examples.transformer_decode FIXTURE --backend numpy --plot out.png``, in the
    numpy env (which has matplotlib; the other backends decode the fixture above)."""
    if backend != "numpy":
        pytest.skip("the decoding script is run in the numpy env")
    png = tmp_path / "cross.png"
    assert decode_script.main(["--backend", backend, "--plot", str(png), "--example", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"Transformer (encoder-decoder) weights {FIXTURE}"
    assert lines[1].startswith(f"  {decode_script.FRAMEWORKS[backend]}, held-out exact match (")
    greedy = float(lines[1].split("greedy ")[1].split(",")[0])
    assert greedy >= 0.95
    assert png.read_bytes().startswith(b"\x89PNG")
    assert lines[-1] == f"  wrote {png.resolve()}: the cross-attention of held-out example 3"


# -- the command lines ----------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m`` ``args``, from the repository root, as a user runs the examples."""
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, check=False)


def test_examples_lists_every_script(backend: str) -> None:
    """``python -m examples`` lists each script with its line, and the shared parts."""
    if backend != "numpy":
        pytest.skip("framework-free: run in the numpy env")
    done = _run("examples")
    assert done.returncode == 0, done.stderr
    shared = ("nadaraya_watson", "seq2seq", "transformer")
    scripts = sorted(p.stem for p in (ROOT / "examples").glob("*.py")
                     if not p.stem.startswith("_") and p.stem not in shared)
    listed = [line.split()[0] for line in done.stdout.splitlines() if line.startswith("  ")]
    assert listed == scripts
    assert "examples.nadaraya_watson, examples.seq2seq, examples.transformer" in done.stdout


def test_every_example_says_what_it_does(backend: str) -> None:
    """``--help`` of each script this env can run (and of the shared parts and the decoding
    script, in the numpy env) exits 0, prints the usage and says which files it writes."""
    names = [p.stem for p in (ROOT / "examples").glob(f"*_{backend}.py")]
    if backend == "numpy":
        names = ["nadaraya_watson", "seq2seq", "transformer", "transformer_decode"]
    if not names:
        pytest.skip(f"no example script for {backend}")
    for name in names:
        done = _run(f"examples.{name}", "--help")
        assert done.returncode == 0 and done.stdout.startswith("usage: "), (name, done.stderr)
        if name.startswith(("nadaraya_watson_", "seq2seq_")):
            assert "Writes no file." in " ".join(done.stdout.split()), name
        if name.startswith("transformer_"):
            assert "--plot PNG" in done.stdout, name
