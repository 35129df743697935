"""Smoke test of ``python -m benchmarks``: tiny sizes, checks the machinery, not speed.

Runs the CLI with ``--quick`` (n = 16 and 32, seven rounds, one memory path) for the backend(s)
of this env, in a child process per backend as the CLI always does, and checks the JSON
schema, the A/A control, the outputs agreeing with the native layer, the screen table, and the
page markers that ``--merge`` writes between. Speed targets are never asserted here.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import pytest

from benchmarks import Config, cli, report, timing
from benchmarks.memory import slope

#: backend -> (results directory, screen output) of its quick run, shared by the tests.
_RUNS: dict[str, tuple[Path, str]] = {}


def quick_run(backend: str, factory: pytest.TempPathFactory,
              capsys: pytest.CaptureFixture[str]) -> tuple[Path, str]:
    if backend not in _RUNS:
        out = factory.mktemp(f"bench-{backend}")
        status = cli.main(["--backend", backend, "--quick", "--rounds", "7", "--min-time", "0.02",
                           "--memory-sizes", "64,128", "--out", str(out), "--no-progress"])
        captured = capsys.readouterr().out
        assert status == 0, captured
        _RUNS[backend] = out, captured
    return _RUNS[backend]


def test_quick_bench(backend: str, tmp_path_factory: pytest.TempPathFactory,
                     capsys: pytest.CaptureFixture[str]) -> None:
    out, screen = quick_run(backend, tmp_path_factory, capsys)
    assert f"== {backend}:" in screen and "ours/native" in screen and "--quick" in screen
    doc = json.loads((out / f"bench-{backend}.json").read_text())
    assert doc["schema"] == "attention-core-bench/1" and doc["backend"] == backend
    machine = doc["machine"]
    assert {"cpu", "cores", "ram_gib", "python", "date", "git_commit"} <= set(machine)
    assert doc["threads"]["env"]["OMP_NUM_THREADS"] == str(doc["threads"]["count"])
    # (a) speed: both contenders ran, agree, and the A/A control is sane
    points = doc["speed"]["points"]
    assert [p["n"] for p in points] == [16, 32]
    for p in points:
        assert p["ours_ms"] > 0 and p["native_ms"] > 0
        assert p["max_abs_diff"] < 1e-4, "ours and the native layer must have the same weights"
        assert p["ratio"]["rounds"] == 7 and p["ratio"]["low"] <= p["ratio"]["median"] <= p["ratio"]["high"]
        # the A/A control (the same call against itself) is reported like any ratio; its value
        # is a property of the machine's noise, not of the code, so no bound is asserted on it
        assert p["aa"]["rounds"] == 7 and p["aa"]["low"] <= p["aa"]["median"] <= p["aa"]["high"]
    # (b) flops: every path has a rate and a GEMM fraction
    assert doc["flops"]["gemm"]["gflops"] > 0
    for p in doc["flops"]["points"]:
        assert {"default", "direct", "blockwise", "native"} <= set(p["paths"])
        assert all(r["gflops"] > 0 and r["fraction_of_gemm"] > 0 for r in p["paths"].values())
    # (c) memory: one subprocess per point, extra memory measured
    mem = doc["memory"]["points"]
    assert [(p["path"], p["n"]) for p in mem] == [("default", 64), ("default", 128)]
    assert all(p["ok"] and p["extra_mib"] >= 0 for p in mem), mem


def test_merge_writes_between_markers(backend: str, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    out, _ = quick_run(backend, tmp_path_factory, capsys)
    page = tmp_path / "docs" / "speed.md"
    page.parent.mkdir()
    page.write_text(f"# x\n\nbefore\n{report.BENCH_START}\nold\n{report.BENCH_END}\nafter\n")
    assert cli.main(["--merge", str(out), "--page", str(page)]) == 0
    text = page.read_text()
    assert "old" not in text and text.startswith("# x\n\nbefore\n") and text.endswith("after\n")
    body = text.split(report.BENCH_START)[1].split(report.BENCH_END)[0]
    assert "÷ native" in body and "as constructed by default" in body
    assert f"`{backend}`" in body and "--quick" in body
    if (out / "bench.png").exists():  # drawn where matplotlib is installed; linked from the page's folder
        assert f"]({Path(os.path.relpath(out / 'bench.png', page.parent)).as_posix()})" in body
    assert cli.main(["--merge", str(out), "--stdout"]) == 0
    assert "÷ native" in capsys.readouterr().out


def test_merge_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--merge", str(tmp_path)]) == 2
    assert "no benchmark results" in capsys.readouterr().err
    with pytest.raises(ValueError, match="no <!-- bench:start -->"):
        (tmp_path / "R.md").write_text("no markers\n")
        report.write_between_markers(tmp_path / "R.md", "x")


def test_median_interval() -> None:
    r = timing.median_interval(list(range(1, 101)))
    assert r.median == 50.5 and r.confidence >= 0.95
    assert 40 <= r.low < 50.5 < r.high <= 61  # order statistics 40 and 61 for n = 100
    few = timing.median_interval([3.0, 1.0])
    assert (few.low, few.high, few.confidence) == (1.0, 3.0, 0.5)
    same = timing.interleaved({"a": lambda: None, "b": lambda: None}, rounds=3, min_time=0.0)
    assert [len(v) for v in same.values()] == [3, 3]


def test_slope() -> None:
    assert math.isclose(slope([(1024, 4.0), (2048, 16.0), (4096, 64.0)]) or 0, 2.0)
    assert slope([(1024, 0.1), (2048, 0.2)]) is None  # below 1 MiB: noise


# -- the training suites: report code on documents built here ----------------------


def _ratio_dict(median: float) -> dict[str, float | int]:
    return {"median": median, "low": median - 0.05, "high": median + 0.05, "confidence": 0.96,
            "rounds": 15}


def _run(commit: str = "abc123", quick: bool = False) -> dict[str, object]:
    machine = {"cpu": "Test CPU", "cores": 2, "ram_gib": 8.0, "system": "Linux", "python": "3.11",
               "git_commit": commit, "date": "2026-01-01T00:00:00+00:00"}
    return {"machine": machine, "versions": {"torch": "9.9"}, "threads": {"count": 2},
            "config": {"quick": quick}}


def _mem_point(n: int, mib: float, heads: int = 4, ok: bool = True) -> dict[str, object]:
    if not ok:
        return {"path": "default", "n": n, "heads": heads, "ok": False, "error": "killed"}
    return {"path": "default", "n": n, "heads": heads, "ok": True, "extra_mib": mib,
            "peak_mib": mib + 300.0, "seconds": 12.0, "implementation": "blockwise"}


def _train_doc(backend: str, step_ratios: dict[tuple[str, int], float],
               mem: list[dict[str, object]]) -> dict[str, object]:
    from benchmarks.run import SCHEMA, train_memory_section

    points = [{"kind": kind, "n": n, "ratio": _ratio_dict(r), "aa": _ratio_dict(1.0),
               "ours_ms": 10.0 * r, "native_ms": 10.0} for (kind, n), r in step_ratios.items()]
    return {"schema": SCHEMA, "backend": backend, "config": {"suites": ["train", "train-memory"]},
            "train": {"natives": {"mha": f"{backend} native mha", "block": f"{backend} block"},
                      "points": points, "run": _run()},
            "train_memory": train_memory_section(mem, "default", _run())}


def test_train_memory_slope_uses_the_four_head_points() -> None:
    from benchmarks.run import train_memory_section

    mem = [_mem_point(1024, 4.0), _mem_point(2048, 8.0), _mem_point(4096, 16.0),
           _mem_point(65536, 9999.0, heads=8), _mem_point(8192, 0.0, ok=False)]
    assert math.isclose(train_memory_section(mem, "default", {})["slope"], 1.0)
    quadratic = [_mem_point(1024, 4.0), _mem_point(2048, 16.0), _mem_point(4096, 64.0)]
    assert math.isclose(train_memory_section(quadratic, "default", {})["slope"], 2.0)


def test_train_targets_met_and_not_met() -> None:
    doc = _train_doc("torch", {("mha", 128): 1.10, ("mha", 1024): 1.02, ("block", 128): 1.20,
                               ("block", 2048): 0.97, ("block", 512): 3.0},
                     [_mem_point(1024, 10.0), _mem_point(16384, 257.0),
                      _mem_point(65536, 900.0, heads=8)])
    rows = {(r[0], r[1]): (r[2], r[3]) for r in report.train_target_rows([doc])}
    assert rows[("mha training step ours/native <= 1.15 at n=128", "torch")] == ("1.10", "yes")
    assert rows[("mha training step ours/native <= 1.00 at n=1024", "torch")] == ("1.02", "**no**")
    assert rows[("block training step ours/native <= 1.15 at n=128", "torch")] == ("1.20", "**no**")
    assert rows[("block training step ours/native <= 1.00 at n=2048", "torch")][1] == "yes"
    assert not any("n=512" in r[0] for r in rows)  # no target at n = 512
    mem_row = "forward+backward extra memory at n=16384, H=4 <= 256 MiB"
    assert rows[(mem_row, "torch")] == ("257.0 MiB", "**no**")
    assert rows[("n=65536, H=8 trains one step within 24 GiB", "torch")] == (
        "peak 1200 MiB, 12 s", "yes")
    within = _train_doc("jax", {}, [_mem_point(16384, 255.9), _mem_point(65536, 0.0, 8, ok=False)])
    rows = {(r[0], r[1]): (r[2], r[3]) for r in report.train_target_rows([within])}
    assert rows[(mem_row, "jax")] == ("255.9 MiB", "yes")
    assert rows[("n=65536, H=8 trains one step within 24 GiB", "jax")] == ("killed", "**no**")
    unmeasured = _train_doc("mxnet", {}, [_mem_point(16384, 100.0)])
    rows = {(r[0], r[1]): (r[2], r[3]) for r in report.train_target_rows([unmeasured])}
    assert rows[("n=65536, H=8 trains one step within 24 GiB", "mxnet")] == ("not measured", "n/a")


def test_train_page_renders_from_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    docs = [_train_doc("torch", {("mha", 128): 1.10, ("block", 1024): 0.93},
                       [_mem_point(1024, 4.0), _mem_point(16384, 64.0),
                        _mem_point(65536, 300.0, heads=8)]),
            _train_doc("mxnet", {("mha", 128): 0.80},
                       [_mem_point(1024, 8.0), _mem_point(2048, 16.0)])]
    text = report.train_markdown(docs)
    assert "| `torch` | mha | 128 | 1.10 [1.05, 1.15] | 1.00 [0.95, 1.05] | 11.0 | 10.0 |" in text
    assert "| `torch` | default (blockwise) | 4.0 |  | 64.0 | 1.00 |" in text  # 2048 not run
    assert "| `mxnet` | default (blockwise) | 8.0 | 16.0 |  | 1.00 |" in text
    docs[1]["train_memory"]["points"][0]["implementation"] = "direct"
    assert "| `mxnet` | default (direct, blockwise) | 8.0 (direct) | 16.0 (blockwise) |  | 1.00 |" in (
        report.train_markdown(docs))
    docs[1]["train_memory"]["points"][0]["implementation"] = "blockwise"
    assert "| `torch` | (1, 8, 65536, 64) | blockwise | 300.0 | 600.0 | 12 |" in text
    assert "commit abc123" in text and "--quick" not in text
    assert "| forward+backward extra memory at n=16384, H=4 <= 256 MiB | torch | 64.0 MiB | yes |" in text
    # --merge writes the page between its markers, and leaves the speed page's part alone
    for d in docs:
        d.update({"machine": _run()["machine"], "versions": {}, "threads": {"count": 2},
                  "config": {"suites": ["train"]}})
        (tmp_path / f"bench-{d['backend']}.json").write_text(json.dumps(d))
    speed, train = tmp_path / "speed.md", tmp_path / "training.md"
    speed.write_text(f"{report.BENCH_START}\n{report.BENCH_END}\n")
    train.write_text(f"# T\n{report.TRAIN_START}\nold\n{report.TRAIN_END}\nend\n")
    assert cli.main(["--merge", str(tmp_path), "--page", str(speed), "--train-page", str(train)]) == 0
    written = train.read_text()
    assert written.startswith("# T\n") and written.endswith("end\n") and "old" not in written
    assert "| `mxnet` | mha | 128 | 0.80" in written and "training" in capsys.readouterr().out


def test_train_runs_keep_the_other_sections() -> None:
    from benchmarks.run import keep_previous

    old = _train_doc("torch", {("mha", 128): 1.1}, [_mem_point(1024, 4.0), _mem_point(2048, 8.0)])
    old.update({"machine": {"date": "old"}, "speed": {"points": []},
                "config": {"suites": ["speed", "train", "train-memory"]}})
    large = _train_doc("torch", {}, [_mem_point(65536, 300.0, heads=8), _mem_point(2048, 9.0)])
    del large["train"]
    large.update({"machine": {"date": "new"}, "config": {"suites": ["train-memory"]}})
    doc = keep_previous(old, large)
    assert doc["machine"] == {"date": "old"} and doc["speed"] == old["speed"]  # main run kept
    assert doc["train"] == old["train"]  # a suite not run now: kept
    got = [(p["heads"], p["n"], p["extra_mib"]) for p in doc["train_memory"]["points"]]
    assert got == [(4, 1024, 4.0), (4, 2048, 9.0), (8, 65536, 300.0)]  # 2048 measured again
    assert math.isclose(doc["train_memory"]["slope"], math.log2(9.0 / 4.0))
    for i, p in enumerate(doc["train_memory"]["points"]):
        p.update({"git_commit": "new" if i else "old", "date": "d"})
    line = report._run_line(doc, "train_memory")
    assert "passes: n = 1024 at commit old, d; n = 2048, 65536 x 8 at commit new, d" in line
    assert doc["config"]["suites"] == ["speed", "train", "train-memory"]
    main = {**old, "machine": {"date": "main"}, "config": {"suites": ["speed"]}}
    for section in ("train", "train_memory"):
        del main[section]
    doc = keep_previous(old, main)
    assert doc["machine"] == {"date": "main"} and doc["train"] == old["train"]
    assert keep_previous(None, main) is main


def test_training_suites_only_when_asked() -> None:
    parser = argparse.ArgumentParser()
    cli.configure(parser)
    args = parser.parse_args([])
    assert "train" not in cli.config_from(args).suites
    args = parser.parse_args(["--suite", "train-memory,train", "--train-memory-sizes", "none",
                              "--train-large-point", "8,65536"])
    config = cli.config_from(args)
    assert config.suites == ("train", "train-memory") and config.train_memory_sizes == ()
    assert config.train_large_point == (8, 65536)
    config = cli.config_from(parser.parse_args(["--train-large-point", "none"]))
    assert config.train_large_point is None
    assert Config.from_dict(json.loads(json.dumps(config.as_dict()))) == config


def test_decoding_benchmark_small(backend: str, tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """``benchmarks.decoding`` on a tiny model: both ways generate the same tokens, the JSON
    has its fields, and ``--merge`` writes the table between the page's markers."""
    from benchmarks import decoding

    monkeypatch.setattr(decoding, "MODEL", {"vocab_size": 13, "num_hiddens": 8,
                                            "ffn_num_hiddens": 12, "num_heads": 2, "num_blks": 1})
    monkeypatch.setattr(decoding, "TOKENS", 6)
    assert decoding.main(["--backend", backend, "--rounds", "2", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / f"decode-{backend}.json").read_text())
    assert result["same_tokens"] is True and result["tokens"] == 6
    assert [len(result["seconds"][w]) for w in ("cached", "uncached")] == [2, 2]
    assert result["speedup"]["rounds"] == 2 and result["speedup"]["median"] > 0
    page = tmp_path / "page.md"
    page.write_text(f"before\n{decoding.START}\nold\n{decoding.END}\nafter\n")
    assert decoding.main(["--merge", str(tmp_path), "--page", str(page)]) == 0
    text = page.read_text()
    assert "old" not in text and f"| {backend} |" in text and text.endswith("after\n")
    if backend == "torch":  # the benchmark's no_grad() does not outlive it
        import torch

        assert torch.is_grad_enabled()


def test_modern_benchmark_quick(tmp_path: Path) -> None:
    """``benchmarks.modern --quick`` on numpy: both suites write their fields, the ratios are
    positive numbers, and ``--merge`` makes the page or writes only between its markers."""
    from benchmarks import modern

    assert modern.main(["--backend", "numpy", "--quick", "--rounds", "2", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "modern-numpy.json").read_text())
    assert doc["schema"] == modern.SCHEMA and doc["backend"] == "numpy" and doc["quick"] is True
    window = doc["window"]
    assert {"config", "rounds", "points", "ratios", "machine", "versions"} <= set(window)
    assert [(p["kind"], p["n"]) for p in window["points"]] == [
        ("window", 128), ("window", 512), ("full", 128), ("full", 256)]
    assert all(len(p["seconds"]) == 2 and p["us_per_token_median"] > 0 for p in window["points"])
    for kind in ("window", "full"):
        ratio = window["ratios"][kind]
        assert ratio["per_round"]["median"] > 0 and ratio["best"] > 0
    assert isinstance(window["ratios"]["window"]["met"], bool)
    gqa = doc["gqa"]
    assert {"config", "implementation", "kv_weights", "cache", "points"} <= set(gqa)
    assert gqa["kv_weights"]["ratio"] > 0 and gqa["cache"]["ratio"] > 0
    assert gqa["cache"]["gqa"]["shape"][1] == 2 and gqa["cache"]["mha"]["shape"][1] == 8
    assert gqa["implementation"]["gqa"]["16"]  # the path the call took was recorded
    assert [p["n"] for p in gqa["points"]] == [16, 32]
    assert all(p["ratio"]["median"] > 0 and p["best_ratio"] > 0 for p in gqa["points"])
    page = tmp_path / "docs" / "current-models.md"
    assert modern.main(["--merge", str(tmp_path), "--page", str(page)]) == 0  # made
    text = page.read_text()
    assert text.startswith(modern.TITLE + "\n") and "## Measured" in text and "| numpy |" in text
    page.write_text(text.replace(modern.START, f"prose\n{modern.START}\nSTALE TABLE").replace(
        modern.END, f"{modern.END}\nmore prose\n"))
    assert modern.main(["--merge", str(tmp_path), "--page", str(page)]) == 0  # rewritten between
    again = page.read_text()
    assert "STALE TABLE" not in again and "prose\n" in again
    assert again.endswith(f"{modern.END}\nmore prose\n\n")
    assert again.count(modern.START) == 1 and "--quick" in again
    page.write_text("no markers\n")
    with pytest.raises(ValueError, match="markers"):
        modern.merge(tmp_path, page)
