"""Ring attention over ``torch.distributed``: each rank's memory and work, against one process.

``python -m benchmarks.context_parallel --out benchmarks/results`` (torch env) runs a causal
forward and backward of ``dot_product_attention`` over ``n`` positions (B 1, H 4, D 64,
float32, one thread per process):

* in one process on the whole sequence;
* on ``P`` gloo processes on 127.0.0.1, each holding its shard (``ring_attention``), in the
  zigzag layout and in the contiguous one.

Each process first runs the same call on a short sequence (``WARM_UP`` positions): the first
call of a path faults in the code pages of torch's kernels and fills one-time buffers, which
are resident memory but not the call's. It then reports the peak of its resident memory
during the measured call above what it held just before (its inputs made: the extra memory of
the forward and backward) and the CPU time the call took (``time.process_time``: the rank's
own work, not its waits). It writes
``context-parallel-torch.json``; ``--merge DIR --page FILE`` renders it into the table between
``<!-- context-parallel:start -->`` and ``<!-- context-parallel:end -->`` of ``FILE``. Run
from the repository root. The ranks share the machine's cores: the CPU times, not the wall
time, say how the work is spread.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.run import machine_info
from tools import markdown

MARKERS = ("<!-- context-parallel:start -->", "<!-- context-parallel:end -->")
B, H, D = 1, 4, 64
#: Positions of the warm-up call that each process makes before the measured one.
WARM_UP = 8192
#: The environment of every measured process.
MEASURED_ENV = {"OMP_NUM_THREADS": "1"}


def _status_bytes(field: str) -> int:
    """A memory figure of this process from ``/proc/self/status`` (``VmRSS``, ``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024  # kB
    raise RuntimeError(f"no {field} in /proc/self/status")


def _measured(call: Any) -> dict[str, float]:
    """Runs ``call()`` and reports its extra peak memory (MiB) and its CPU seconds.

    The peak is reset first (``clear_refs`` 5, Linux), so it is this call's own.
    """
    Path("/proc/self/clear_refs").write_text("5")
    before, cpu = _status_bytes("VmRSS"), time.process_time()
    call()
    return {"extra_mib": (_status_bytes("VmHWM") - before) / 2**20,
            "cpu_s": time.process_time() - cpu}


def _inputs(n: int, seed: int = 0) -> list[Any]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, n, D, generator=gen) for _ in range(4)]  # q, k, v, cotangent


def one_process(n: int) -> dict[str, Any]:
    """The whole sequence's causal forward and backward in this process."""
    import torch

    import attention_core as ac

    torch.set_num_threads(1)

    def call(length: int) -> Any:
        q, k, v, cot = _inputs(length)
        leaves = [x.requires_grad_() for x in (q, k, v)]

        def run() -> None:
            out = ac.dot_product_attention(*leaves, causal=True)
            (out * cot).sum().backward()

        return run

    call(WARM_UP)()
    return _measured(call(n))


def rank_main(n: int, layout: str) -> None:
    """One rank: its shard's causal forward and backward by the ring; prints what it measured."""
    import torch
    import torch.distributed as dist

    from attention_core import parallel as par
    from backends.torch import TorchOps, ring_attention

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ops = TorchOps()

    def call(length: int) -> Any:
        q, k, v, cot = (par.shard(ops, x, world, rank, 2, layout).contiguous()
                        for x in _inputs(length))
        leaves = [x.requires_grad_() for x in (q, k, v)]

        def run() -> None:
            out = ring_attention(*leaves, causal=True, layout=layout)
            (out * cot).sum().backward()

        return run

    call(min(n, 2 * world * max(1, WARM_UP // (2 * world))))()  # whole chunks of the layout
    measured = call(n)
    dist.barrier()
    got = _measured(measured)
    dist.barrier()
    dist.destroy_process_group()
    print("RESULT " + json.dumps({"rank": rank, **got}), flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ranks(n: int, world: int, layout: str) -> list[dict[str, Any]]:
    """Runs ``world`` ranks of :func:`rank_main` and gathers what each measured."""
    env = {**os.environ, **MEASURED_ENV, "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(world), "GLOO_SOCKET_IFNAME": "lo"}
    procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.context_parallel", "--rank",
                               "--n", str(n), "--layout", layout],
                              env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, text=True)
             for r in range(world)]
    found = []
    for p in procs:
        out, _ = p.communicate(timeout=1800)
        if p.returncode:
            raise RuntimeError(f"a rank failed (exit {p.returncode})")
        found += [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
    return sorted(found, key=lambda r: r["rank"])


def run(n: int, world: int) -> dict[str, Any]:
    """One process, then the ring in both layouts."""
    import torch

    whole = _in_child(n)
    layouts = {layout: ranks(n, world, layout) for layout in ("zigzag", "contiguous")}
    return {"machine": machine_info(), "torch": torch.__version__, "n": n, "world": world,
            "B": B, "H": H, "D": D, "one_process": whole, "ring": layouts}


def _in_child(n: int) -> dict[str, Any]:
    """:func:`one_process` in a fresh interpreter (a clean peak of its own)."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.context_parallel", "--one",
                          "--n", str(n)], check=True, capture_output=True, text=True,
                         env={**os.environ, **MEASURED_ENV}).stdout
    return json.loads(next(line[7:] for line in out.splitlines() if line.startswith("RESULT ")))


def table(result: dict[str, Any]) -> str:
    """The Markdown table of one result file."""
    whole = result["one_process"]
    rows = ["| run | extra memory per process (MiB) | ÷ one process | CPU s per process "
            "(min-max) | slowest ÷ fastest |", "|---|---|---|---|---|",
            f"| one process, n = {result['n']} | {whole['extra_mib']:.0f} | 1.00 | "
            f"{whole['cpu_s']:.1f} | - |"]
    for layout, per_rank in result["ring"].items():
        peak = max(r["extra_mib"] for r in per_rank)
        cpu = [r["cpu_s"] for r in per_rank]
        share = f"{peak / whole['extra_mib']:.2f}" if whole["extra_mib"] > 0 else "-"
        balance = f"{max(cpu) / min(cpu):.2f}" if min(cpu) > 0 else "-"
        rows.append(f"| ring, {result['world']} ranks, {layout} | {peak:.0f} (largest rank) | "
                    f"{share} | {min(cpu):.1f}-{max(cpu):.1f} | {balance} |")
    m = result["machine"]
    rows += ["", f"Causal, B {result['B']}, H {result['H']}, D {result['D']}, float32, one "
             f"thread per process; torch {result['torch']}, gloo, {m.get('cpu', '?')}, "
             f"{m.get('cores', '?')} cores, {m.get('date', '?')[:10]}."]
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmark (or one of its processes) or merges its file into a page."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.context_parallel",
                                     description=__doc__)
    parser.add_argument("--n", type=int, default=32768)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--merge", type=Path, metavar="DIR")
    parser.add_argument("--page", type=Path, default=Path("docs/long-sequences.md"))
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--layout", default="zigzag", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank:
        rank_main(args.n, args.layout)
        return 0
    if args.one:
        print("RESULT " + json.dumps(one_process(args.n)), flush=True)
        return 0
    if args.merge:
        result = json.loads((args.merge / "context-parallel-torch.json").read_text())
        markdown.write_between_markers(args.page, table(result), *MARKERS)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    result = run(args.n, args.world)
    (args.out / "context-parallel-torch.json").write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
