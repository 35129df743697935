"""``python -m benchmarks complexity``: the machinery, never the speed.

A ``--quick`` run (n = 8 and 16, two rounds) on the backend under test, in the child process
the command always starts, must write a JSON file with every contender at every size and (where
matplotlib is installed) the PNG. The three contenders are checked against NumPy computations
written here in float64 from their definitions, with the same weights; the operation model and
the crossover interpolation against values worked out by hand; the argument errors by message.
No timing is asserted.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest

from attention_core import registry
from benchmarks import cli, complexity
from benchmarks.complexity_natives import builder, layer_weights

#: backend -> (results directory, screen output) of its quick run, shared by the tests.
_RUNS: dict[str, tuple[Path, str]] = {}
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def quick_run(backend: str, factory: pytest.TempPathFactory,
              capsys: pytest.CaptureFixture[str]) -> tuple[Path, str]:
    if backend not in _RUNS:
        out = factory.mktemp(f"complexity-{backend}")
        status = cli.main(["complexity", "--backend", backend, "--quick", "--out", str(out),
                           "--no-progress"])
        screen = capsys.readouterr().out
        assert status == 0, screen
        _RUNS[backend] = out, screen
    return _RUNS[backend]


def flops_by_hand(n: int, d: int, k: int, heads: int) -> dict[str, int]:
    """2 per multiply-add of every matrix product each layer makes, batch 1."""

    def mm(rows: int, inner: int, cols: int) -> int:
        return 2 * rows * inner * cols

    depth = d // heads
    return {
        "conv": n * mm(1, k * d, d),  # each position: its k neighbours' d channels -> d outputs
        "rnn": n * (mm(1, d, d) + mm(1, d, d)),  # x_t W and h U at each step
        "attention": 4 * mm(n, d, d) + heads * (mm(n, depth, n) + mm(n, n, depth)),
    }


def test_quick_run(backend: str, tmp_path_factory: pytest.TempPathFactory,
                   capsys: pytest.CaptureFixture[str]) -> None:
    out, screen = quick_run(backend, tmp_path_factory, capsys)
    doc = json.loads((out / f"complexity-{backend}.json").read_text())
    assert doc["schema"] == complexity.SCHEMA and doc["backend"] == backend
    assert {"cpu", "cores", "date", "python", "git_commit"} <= set(doc["machine"])
    assert registry.FRAMEWORKS[backend][0] in doc["versions"]
    assert doc["threads"]["env"]["OMP_NUM_THREADS"] == str(doc["threads"]["count"])
    assert doc["config"]["quick"] and doc["config"]["sizes"] == [8, 16]
    assert set(doc["layers"]) == {"conv", "rnn", "attention"}
    assert [p["n"] for p in doc["points"]] == [8, 16]
    for p in doc["points"]:
        for name in ("conv", "rnn", "attention"):
            assert p["ms"][name] > 0 and len(p["rounds_ms"][name]) == 2
            low, high = p["interval_ms"][name]
            assert low <= p["ms"][name] <= high
        for key in ("attention/conv", "attention/rnn"):
            r = p["ratios"][key]
            assert r["rounds"] == 2 and r["low"] <= r["median"] <= r["high"]
        assert p["flops"] == flops_by_hand(p["n"], 64, 3, 1)
    assert set(doc["crossovers"]) == {"conv", "rnn"}
    # the screen: the table, one crossover sentence per other layer, where the files went
    assert "attn/conv" in screen and "attn/rnn" in screen and "--quick" in screen
    assert screen.count("self-attention is") == 2
    png = out / f"complexity-{backend}.png"
    if HAS_MATPLOTLIB:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert not png.exists() and "no plot: matplotlib is not installed" in screen


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="the plot needs matplotlib (the plot extra)")
def test_replot(backend: str, tmp_path_factory: pytest.TempPathFactory,
                capsys: pytest.CaptureFixture[str]) -> None:
    out, _ = quick_run(backend, tmp_path_factory, capsys)
    png = out / f"complexity-{backend}.png"
    png.unlink()
    assert cli.main(["complexity", "--replot", str(out / f"complexity-{backend}.json")]) == 0
    assert "attn/rnn" in capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_replot_without_results(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["complexity", "--replot", str(tmp_path)]) == 2
    assert "no complexity results" in capsys.readouterr().err


# -- the contenders compute what they claim ----------------------------------------------------


def conv_by_definition(x: np.ndarray, kernel: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """y[t] = b + sum_j x[t + j - (k-1)/2] K[j], zeros outside the sequence."""
    B, n, _ = x.shape
    k = kernel.shape[0]
    y = np.tile(bias.astype(np.float64), (B, n, 1))
    for t in range(n):
        for j in range(k):
            s = t + j - (k - 1) // 2
            if 0 <= s < n:
                y[:, t] += x[:, s].astype(np.float64) @ kernel[j].astype(np.float64)
    return y


def rnn_by_definition(x: np.ndarray, W: np.ndarray, U: np.ndarray, b: np.ndarray) -> np.ndarray:
    x, W, U, b = (a.astype(np.float64) for a in (x, W, U, b))
    h = np.zeros((x.shape[0], U.shape[0]))
    out = []
    for t in range(x.shape[1]):
        h = np.tanh(x[:, t] @ W + h @ U + b)
        out.append(h)
    return np.stack(out, axis=1)


def attention_by_definition(x: np.ndarray, weights: dict[str, np.ndarray], heads: int) -> np.ndarray:
    """Multi-head self-attention: head i uses columns i*d/H ... of each projection."""
    x = x.astype(np.float64)
    w = {k: v.astype(np.float64) for k, v in weights.items()}
    B, n, d = x.shape
    depth = d // heads

    def project(name: str) -> np.ndarray:
        t = x @ w[f"attention.{name}.kernel"] + w[f"attention.{name}.bias"]
        return t.reshape(B, n, heads, depth)

    q, k, v = project("W_q"), project("W_k"), project("W_v")
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(depth)
    e = np.exp(scores - scores.max(-1, keepdims=True))
    pooled = np.einsum("bhqk,bkhd->bqhd", e / e.sum(-1, keepdims=True), v).reshape(B, n, d)
    return pooled @ w["attention.W_o.kernel"] + w["attention.W_o.bias"]


@pytest.mark.parametrize(("kernel_size", "heads"), [(3, 2), (5, 1)])
def test_contenders_match_their_definitions(backend: str, kernel_size: int, heads: int) -> None:
    d, n = 8, 7
    weights = layer_weights(d, kernel_size, seed=3)
    x = np.random.default_rng(4).standard_normal((2, n, d)).astype(np.float32)
    b = builder(backend, threads=1)
    expected = {
        "conv": conv_by_definition(x, weights["conv.kernel"], weights["conv.bias"]),
        "rnn": rnn_by_definition(x, weights["rnn.W"], weights["rnn.U"], weights["rnn.b"]),
        "attention": attention_by_definition(x, weights, heads),
    }
    contenders = {"conv": b.conv(x, weights), "rnn": b.rnn(x, weights),
                  "attention": b.attention(x, weights, heads)}
    for name, contender in contenders.items():
        got = contender.to_numpy(contender.call())
        assert got.shape == (2, n, d), name
        np.testing.assert_allclose(got, expected[name], rtol=1e-4, atol=1e-5, err_msg=name)


# -- the operation model and the crossovers ------------------------------------------------------


@pytest.mark.parametrize(("n", "d", "k", "heads"), [(10, 4, 3, 1), (100, 64, 3, 8), (33, 12, 5, 4)])
def test_flop_model(n: int, d: int, k: int, heads: int) -> None:
    assert complexity.flop_model(n, d, k) == flops_by_hand(n, d, k, heads)
    assert complexity.flop_model(n, d, k, batch=3) == {
        name: 3 * value for name, value in flops_by_hand(n, d, k, heads).items()}


def test_flop_model_values() -> None:
    # n = 10, d = 4, k = 3: conv 2*3*10*16, RNN 4*10*16, attention 8*10*16 + 4*100*4
    assert complexity.flop_model(10, 4, 3) == {"conv": 960, "rnn": 640, "attention": 2880}


def test_crossovers() -> None:
    (one,) = complexity.crossovers([100, 400], [0.5, 2.0])  # log ratio -ln2 .. ln2: the middle
    assert one["between"] == [100, 400] and one["attention"] == "slower"
    assert one["n"] == pytest.approx(200.0)
    down, up = complexity.crossovers([16, 32, 64, 128], [2.0, 0.5, 0.5, 4.0])
    assert down["attention"] == "faster" and down["n"] == pytest.approx(math.sqrt(16 * 32))
    # ln 0.5 .. ln 4: a third of the way from 64 to 128 in log n
    assert up["attention"] == "slower" and up["n"] == pytest.approx(64 * 2 ** (1 / 3))
    assert complexity.crossovers([16, 32], [2.0, 3.0]) == []
    text = complexity.crossover_text("RNN", [100, 400], [0.5, 2.0], [one])
    assert "faster at n = 100" in text and "slower than the RNN at n ≈ 200" in text


# -- argument errors ---------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "message"), [
    (["--kernel-size", "4"], "--kernel-size must be an odd positive integer"),
    (["--kernel-size", "0"], "--kernel-size must be an odd positive integer"),
    (["--width", "10", "--heads", "4"], "--heads (4) must divide --width (10)"),
    (["--width", "0"], "--width must be a positive integer, got 0"),
    (["--rounds", "0"], "--rounds must be a positive integer, got 0"),
    (["--min-time", "-1"], "--min-time must be a number of seconds >= 0"),
    (["--backend", "nosuch"], "unknown backend 'nosuch'; expected one of numpy, torch"),
])
def test_argument_errors(args: list[str], message: str, tmp_path: Path,
                         capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["complexity", *args, "--quick", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("sizes", ["abc", "0,8", ""])
def test_bad_sizes(sizes: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["complexity", "--sizes", sizes])
    assert exit_info.value.code == 2
    assert "--sizes" in capsys.readouterr().err


def test_backend_not_installed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = [name for name in registry.BACKENDS if not registry.is_installed(name)]
    if not missing:
        pytest.skip("every backend is installed here")
    assert cli.main(["complexity", "--backend", missing[0], "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"backend {missing[0]!r} is not installed here: {registry.PIP[missing[0]]}" in err
