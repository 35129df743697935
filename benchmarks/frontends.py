"""The Keras layers on each Keras backend and the Flax NNX modules against the frameworks' own.

``python -m benchmarks.frontends --frontend keras --out benchmarks/results`` (run with
``KERAS_BACKEND`` set: ``tensorflow``, ``jax`` or ``torch``) or ``--frontend nnx`` times the
forward pass of this library's ``MultiHeadAttention(512, 8, bias=True)`` (default
construction, attention weights kept as they are by default) against the framework's own
layer holding the same weights:

* ``keras``: :class:`backends.keras.MultiHeadAttention` against ``keras.layers.MultiHeadAttention
  (num_heads=8, key_dim=64)``, the weights converted by :mod:`backends.keras.convert`, on the
  same Keras backend. Each layer is called the way Keras' ``predict`` runs it on that
  backend: one ``jax.jit`` of the layer's ``stateless_call`` (JAX), one ``tf.function``
  (TensorFlow), eager under ``torch.inference_mode()`` (torch, where Keras compiles only when
  asked).
* ``nnx``: ``backends.jax.nnx.MultiHeadAttention`` against ``flax.nnx.MultiHeadAttention
  (num_heads=8, in_features=512, decode=False)``, the same weights, both under ``nnx.jit``.

Self-attention on ``X (1, n, 512)`` with ``valid_lens = [n - n // 4]`` (the native layers get
the equivalent key padding mask, ``(1, 1, n)`` for Keras, ``(1, 1, 1, n)`` for NNX), at
n = 1024 and 4096 (``--sizes``). The two layers and a second copy of the native one (the A/A
control) run in interleaved rounds (:func:`benchmarks.timing.interleaved`); the ratio ours ÷
native is taken in each round (median and its interval). Target: <= 1.00 at every n >= 1024.

It writes ``frontends-<frontend>-<backend>.json``; ``--merge DIR --page FILE`` renders every
such file into the part of ``FILE`` between ``<!-- frontends: begin -->`` and
``<!-- frontends: end -->``. ``--quick`` runs tiny sizes (the smoke test). Run from the
repository root.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.run import machine_info
from benchmarks.timing import interleaved, ratio
from tools import markdown

SCHEMA = "attention-core-frontends/1"
NUM_HIDDENS, NUM_HEADS = 512, 8
SIZES = (1024, 4096)
QUICK_HIDDENS, QUICK_HEADS = 32, 4
QUICK_SIZES: tuple[int, ...] = (16, 32)
TARGET = 1.0
START, END = "<!-- frontends: begin -->", "<!-- frontends: end -->"


def inputs(n: int, h: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``X (1, n, h)``, ``valid_lens = [n - n // 4]`` and the key padding mask ``(1, n)``."""
    X = np.random.default_rng(n).standard_normal((1, n, h)).astype(np.float32)
    length = n - n // 4
    return X, np.array([length], np.int32), (np.arange(n) < length)[None]


def _ready(x: Any) -> Any:
    """Waits until a JAX result is computed (JAX dispatches asynchronously)."""
    import jax

    return jax.block_until_ready(x)  # type: ignore[no-untyped-call]


# -- Keras ---------------------------------------------------------------------------------------


def keras_pair(n: int, h: int, heads: int) -> tuple[Callable[[], Any], Callable[[], Any], str]:
    """``(ours, native, how)``: the two layers' forward calls on the current Keras backend."""
    import keras

    from backends.keras import MultiHeadAttention
    from backends.keras.convert import from_keras

    backend = keras.backend.backend()
    X, lens, padding = inputs(n, h)
    native = keras.layers.MultiHeadAttention(num_heads=heads, key_dim=h // heads)
    Xt = keras.ops.convert_to_tensor(X)
    mask = keras.ops.convert_to_tensor(padding[:, None, :])
    native(Xt, Xt, attention_mask=mask)  # builds it
    ours = MultiHeadAttention(h, heads, bias=True)
    ours.set_weights(from_keras(native))
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(ours(Xt, Xt, Xt, lens)),
        keras.ops.convert_to_numpy(native(Xt, Xt, attention_mask=mask)), rtol=1e-4, atol=1e-4)
    if backend == "jax":
        import jax

        def jitted(layer: Any, *args: Any, **kwargs: Any) -> Callable[[], Any]:
            values = [v.value for v in layer.trainable_variables]
            others = [v.value for v in layer.non_trainable_variables]
            fn = jax.jit(lambda t, o, *a: layer.stateless_call(t, o, *a, **kwargs)[0])
            return lambda: _ready(fn(values, others, *args))

        return (jitted(ours, Xt, Xt, Xt, keras.ops.convert_to_tensor(lens)),
                jitted(native, Xt, Xt, attention_mask=mask), "jax.jit(stateless_call)")
    if backend == "tensorflow":
        import tensorflow as tf

        lens_t = tf.constant(lens)
        mine = tf.function(lambda: ours(Xt, Xt, Xt, lens_t))
        theirs = tf.function(lambda: native(Xt, Xt, attention_mask=mask))
        return (lambda: mine().numpy()), (lambda: theirs().numpy()), "tf.function"
    import torch

    def eager(call: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            with torch.inference_mode():
                return call()
        return run

    lens_t = torch.as_tensor(lens)
    return (eager(lambda: ours(Xt, Xt, Xt, lens_t)),
            eager(lambda: native(Xt, Xt, attention_mask=mask)), "eager, torch.inference_mode()")


# -- Flax NNX ------------------------------------------------------------------------------------


def nnx_pair(n: int, h: int, heads: int) -> tuple[Callable[[], Any], Callable[[], Any], str]:
    """``(ours, native, how)``: the NNX modules' forward calls, each under ``nnx.jit``."""
    import jax.numpy as jnp
    from flax import nnx

    ours_nnx: Any = importlib.import_module("backends.jax.nnx")
    from backends.jax.convert import from_flax

    X, lens, padding = inputs(n, h)
    native = nnx.MultiHeadAttention(num_heads=heads, in_features=h, decode=False,
                                    rngs=nnx.Rngs(0))
    params = {k: v for k, v in nnx.to_pure_dict(nnx.state(native, nnx.Param)).items()}
    ours = ours_nnx.MultiHeadAttention(h, heads, bias=True, rngs=nnx.Rngs(0))
    ours.set_weights(from_flax(params))
    Xj, lens_j = jnp.asarray(X), jnp.asarray(lens)
    mask = jnp.asarray(padding[:, None, None, :])
    mine = nnx.jit(lambda m, x, v: m(x, x, x, v))
    theirs = nnx.jit(lambda m, x, k: m(x, mask=k, deterministic=True))
    np.testing.assert_allclose(np.asarray(mine(ours, Xj, lens_j)),
                               np.asarray(theirs(native, Xj, mask)), rtol=1e-4, atol=1e-4)
    return ((lambda: _ready(mine(ours, Xj, lens_j))),
            (lambda: _ready(theirs(native, Xj, mask))), "nnx.jit")


# -- runs ----------------------------------------------------------------------------------------


def run(frontend: str, sizes: Sequence[int], h: int, heads: int, rounds: int,
        min_time: float) -> dict[str, Any]:
    """Times ours against the native layer at each n; the result document."""
    pair = keras_pair if frontend == "keras" else nnx_pair
    if frontend == "keras":
        import keras

        backend, version = keras.backend.backend(), f"keras {keras.__version__}"
    else:
        import flax

        backend, version = "jax", f"flax {flax.__version__}"
    rows = []
    for n in sizes:
        ours, native, how = pair(n, h, heads)
        times = interleaved({"ours": ours, "native": native, "native'": native}, rounds, min_time)
        r, aa = ratio(times, "ours", "native"), ratio(times, "native'", "native")
        rows.append({"n": n, "how": how, "ratio": r.as_dict(), "aa": aa.as_dict(),
                     "ours_ms": 1e3 * statistics.median(times["ours"]),
                     "native_ms": 1e3 * statistics.median(times["native"])})
        print(f"{frontend}/{backend} n={n}: ours/native {r.median:.3f} [{r.low:.3f}, {r.high:.3f}]"
              f"  A/A {aa.median:.3f}  ours {rows[-1]['ours_ms']:.1f} ms  ({how})", flush=True)
    return {"schema": SCHEMA, "frontend": frontend, "backend": backend, "version": version,
            "num_hiddens": h, "num_heads": heads, "rounds": rounds, "machine": machine_info(),
            "rows": rows}


NATIVES = {"keras": "keras.layers.MultiHeadAttention", "nnx": "flax.nnx.MultiHeadAttention"}
OURS = {"keras": "backends.keras.MultiHeadAttention", "nnx": "backends.jax.nnx.MultiHeadAttention"}


def render(results: Sequence[Mapping[str, Any]]) -> str:
    """The table of every result: one row per frontend, backend and n."""
    lines = ["| layers | backend | called as | n | ours ÷ native (95% interval) | A/A | ours ms |",
             "|---|---|---|---|---|---|---|"]
    for doc in results:
        for row in doc["rows"]:
            r, aa = row["ratio"], row["aa"]
            mark = "" if r["median"] <= TARGET else " ✗"
            lines.append(
                f"| {OURS[doc['frontend']]} ÷ {NATIVES[doc['frontend']]} | {doc['backend']} "
                f"({doc['version']}) | {row['how']} | {row['n']} | {r['median']:.2f} "
                f"[{r['low']:.2f}, {r['high']:.2f}]{mark} | {aa['median']:.2f} | "
                f"{row['ours_ms']:.1f} |")
    machines = sorted({f"{d['machine'].get('cpu', '?')}, {d['machine'].get('cores', '?')} cores"
                       for d in results})
    return ("\n".join(lines) + "\n\n"
            f"`MultiHeadAttention({results[0]['num_hiddens']}, {results[0]['num_heads']})`, "
            f"self-attention on `(1, n, {results[0]['num_hiddens']})` with a padding mask, "
            f"interleaved rounds ({results[0]['rounds']} each); target ≤ {TARGET:.2f}. "
            f"Machine: {'; '.join(machines)}. Written by `python -m benchmarks.frontends "
            "--merge benchmarks/results --page docs/speed.md` from the files of "
            "`python -m benchmarks.frontends`.\n")


def merge(directory: Path, page: Path) -> None:
    """Renders every ``frontends-*.json`` of ``directory`` into ``page``."""
    results = [json.loads(p.read_text()) for p in sorted(directory.glob("frontends-*.json"))]
    results = [r for r in results if r.get("schema") == SCHEMA]
    if not results:
        raise SystemExit(f"no frontends-*.json in {directory}")
    markdown.write_between_markers(page, render(results), START, END)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--frontend", choices=("keras", "nnx"), default="keras")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)))
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--min-time", type=float, default=0.2)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (the smoke test)")
    parser.add_argument("--out", type=Path, help="write frontends-<frontend>-<backend>.json here")
    parser.add_argument("--merge", type=Path, help="render the files of this directory")
    parser.add_argument("--page", type=Path, help="the page --merge writes into")
    args = parser.parse_args(argv)
    if args.merge is not None:
        merge(args.merge, args.page or Path("docs/speed.md"))
        return 0
    if args.quick:
        h, heads, sizes, rounds, min_time = QUICK_HIDDENS, QUICK_HEADS, QUICK_SIZES, 3, 0.01
    else:
        h, heads, rounds, min_time = NUM_HIDDENS, NUM_HEADS, args.rounds, args.min_time
        sizes = tuple(int(s) for s in args.sizes.split(","))
    result = run(args.frontend, sizes, h, heads, rounds, min_time)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"frontends-{args.frontend}-{result['backend']}.json"
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
