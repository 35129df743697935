"""Joins two passes of ``python -m benchmarks`` into one file per backend.

The speed and flops suites want a quiet machine and the memory suite a long time, so they may
run in separate passes (``--suite speed,flops --out A`` and ``--suite memory --out B``). This
writes ``OUT/bench-<backend>.json`` with the first pass's document and the second pass's
``memory`` section, which keeps its own machine record under ``memory.run`` (the speed page's table
names its commit and date). A file combined before may serve as the memory pass: its memory
section keeps the run it already records.

Usage: ``python benchmarks/combine_runs.py SPEED_DIR MEMORY_DIR OUT_DIR``
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

MEMORY_KEYS = ("memory_sizes", "memory_quadratic_max", "memory_paths", "large_point",
               "memory_timeout")


def combine(speed: dict[str, Any], memory: dict[str, Any]) -> dict[str, Any]:
    """The speed/flops document with the memory document's ``memory`` section."""
    if speed["backend"] != memory["backend"]:
        raise ValueError(f"backends differ: {speed['backend']} and {memory['backend']}")
    out = dict(speed)
    run = {"machine": memory["machine"], "config": memory["config"]}
    out["memory"] = {"run": run, **memory["memory"]}  # a combined file keeps its memory run
    config = dict(speed["config"])
    config["suites"] = sorted(set(speed["config"]["suites"]) | set(memory["config"]["suites"]))
    config.update({k: memory["config"][k] for k in MEMORY_KEYS if k in memory["config"]})
    out["config"] = config
    return out


def main(argv: list[str]) -> int:
    """Combines every backend found in both directories."""
    speed_dir, memory_dir, out_dir = (Path(a) for a in argv)
    out_dir.mkdir(parents=True, exist_ok=True)
    for path in sorted(speed_dir.glob("bench-*.json")):
        other = memory_dir / path.name
        if not other.exists():
            print(f"{path.name}: no memory run, skipped")
            continue
        doc = combine(json.loads(path.read_text()), json.loads(other.read_text()))
        (out_dir / path.name).write_text(json.dumps(doc, indent=1))
        print(f"{path.name}: combined")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
