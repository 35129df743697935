"""TensorFlow under ``tf.function``: this checkout against an older commit, in one process.

The target: no fix may cost more than 3% at n >= 512. Its fix for masks that leak (rows
whose visible scores are all ``-inf`` or the dtype's lowest value) made TensorFlow's kernel
softmax path read the scores once more under tracing. This script times the traced calls of
this checkout (``new``) against those of another commit (``old``, by default ``20d67e8``, the
last commit before those fixes) in interleaved rounds (:mod:`benchmarks.timing`), in one
process, with the same inputs:

* ``mha``: ``multi_head_attention`` with the weights of ``MultiHeadAttention(512, 8,
  bias=True)``, self-attention, batch 1, ``valid_lens = [n - n // 4]``: benchmark (a)'s call;
* ``dpa``: ``dot_product_attention``, ``(B, H, n, D) = (1, 8, n, 64)``, the same lengths.

Both packages are imported in turn under the same name (the other one's modules taken out of
``sys.modules``), and each call is traced (``tf.function(autograph=False)``) while its package
is the imported one; the traced graphs run no Python. ``old`` runs twice per round: ``old'/old``
is the A/A control, which should be 1 within the noise. Prints, per call and size, the median
ratio ``new/old`` over rounds with its 95% interval, and the control.

Usage: ``python benchmarks/tf_traced_softmax.py [--old COMMIT] [--sizes 512,1024,2048]
[--rounds 15] [--min-time 0.2]``, from the repository (the old tree is read by ``git archive``).
"""

from __future__ import annotations

import importlib
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("attention_core", "backends")
HIDDEN, HEADS, DEPTH = 512, 8, 64


def extract(commit: str, into: Path) -> Path:
    """Writes ``attention_core/`` and ``backends/`` of ``commit`` under ``into``."""
    data = subprocess.run(["git", "-C", str(ROOT), "archive", commit, *PACKAGES],
                          check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        archive.extractall(into, filter="data")
    return into


def load(root: Path) -> Any:
    """Imports ``attention_core`` and the TensorFlow ops from ``root``; returns the package.

    Any copy imported before is forgotten first (taken out of ``sys.modules``).
    """
    for name in list(sys.modules):
        if name.split(".")[0] in PACKAGES:
            del sys.modules[name]
    sys.path.insert(0, str(root))
    try:
        package = importlib.import_module("attention_core")
        importlib.import_module("backends.tensorflow.ops")
    finally:
        sys.path.remove(str(root))
    return package


def traced_calls(ac: Any, n: int, inputs: dict[str, Any]) -> dict[str, Callable[[], Any]]:
    """The two calls of the module docstring, traced now with ``ac``'s code."""
    ops = importlib.import_module("backends.tensorflow.ops").OPS

    def mha(x: Any, lens: Any) -> Any:
        return ac.multi_head_attention(x, x, x, inputs["weights"], HEADS, lens, ops=ops)

    def dpa(q: Any, k: Any, v: Any, lens: Any) -> Any:
        return ac.dot_product_attention(q, k, v, lens, ops=ops)

    graphs = {"mha": (tf.function(mha, autograph=False), (inputs["x"], inputs["lens"])),
              "dpa": (tf.function(dpa, autograph=False), (*inputs["qkv"], inputs["lens"]))}
    calls: dict[str, Callable[[], Any]] = {}
    for name, (fn, args) in graphs.items():
        concrete = fn.get_concrete_function(*args)  # traced here, with this package

        def call(concrete: Any = concrete, args: tuple[Any, ...] = args) -> Any:
            return concrete(*args).numpy()  # waits for the result

        calls[name] = call
    return calls


def make_inputs(n: int, rng: np.random.Generator) -> dict[str, Any]:
    """Inputs of one size: random float32, biases included, lengths ``[n - n // 4]``."""
    def normal(*shape: int, scale: float = 1.0) -> tf.Tensor:
        return tf.constant((rng.standard_normal(shape) * scale).astype(np.float32))

    weights = {}
    for name in ("W_q", "W_k", "W_v", "W_o"):
        weights[f"{name}.kernel"] = normal(HIDDEN, HIDDEN, scale=HIDDEN**-0.5)
        weights[f"{name}.bias"] = normal(HIDDEN, scale=0.1)
    return {"x": normal(1, n, HIDDEN), "weights": weights,
            "qkv": [normal(1, HEADS, n, DEPTH) for _ in range(3)],
            "lens": tf.constant(np.array([n - n // 4], np.int32))}


def main() -> None:
    """Parses the arguments, traces both packages' calls per size, times them, prints."""
    timing = importlib.import_module("benchmarks.timing")
    parser = timing.ab_parser(__doc__.splitlines()[0], "512,1024,2048")
    parser.add_argument("--old", default="20d67e8", help="the commit to compare against")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    rng = np.random.default_rng(0)
    inputs = {n: make_inputs(n, rng) for n in sizes}
    with tempfile.TemporaryDirectory() as tmp:
        old = {n: traced_calls(load(extract(args.old, Path(tmp))), n, inputs[n]) for n in sizes}
    ac = load(ROOT)
    new = {n: traced_calls(ac, n, inputs[n]) for n in sizes}
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", *PACKAGES],
                           capture_output=True, text=True).stdout.strip()
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; new = {head}"
          f"{' + uncommitted changes' if dirty else ''}, old = {args.old}; tf {tf.__version__}, "
          f"{os.cpu_count()} CPUs; {args.rounds} interleaved rounds, median [95% interval]",
          flush=True)
    for n in sizes:
        for name in ("mha", "dpa"):
            line = timing.new_against_old(f"n={n:5d} {name}", new[n][name], old[n][name],
                                          args.rounds, args.min_time)
            print(line, flush=True)


if __name__ == "__main__":
    main()
