"""Smoke test of ``python -m benchmarks``: tiny sizes, checks the machinery, not speed.

Runs the CLI with ``--quick`` (n = 16 and 32, seven rounds, one memory path) for the backend(s)
of this env, in a child process per backend as the CLI always does, and checks the JSON
schema, the A/A control, the outputs agreeing with the native layer, the screen table, and the
page markers that ``--merge`` writes between. Speed targets are never asserted here.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from benchmarks import cli, report, timing
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
    # (c) flops: every path has a rate and a GEMM fraction
    assert doc["flops"]["gemm"]["gflops"] > 0
    for p in doc["flops"]["points"]:
        assert {"default", "direct", "blockwise", "native"} <= set(p["paths"])
        assert all(r["gflops"] > 0 and r["fraction_of_gemm"] > 0 for r in p["paths"].values())
    # (b) memory: one subprocess per point, extra memory measured
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
