"""Weights that move between frameworks: files saved on one backend load on every other.

Each framework runs in its own tox env (its own process), so the backends meet through files:

* **Produce.** Every tested backend trains its layers a few steps with its own autodiff (torch
  ``optim.SGD``, ``tf.GradientTape`` with Keras' SGD, ``jax.grad``, Gluon's ``Trainer``;
  NumPy, which has no autodiff, perturbs its weights with seeded noise instead), saves them
  with ``attention_core.save_weights`` (Flax: the variables pytree) and writes the inputs and
  its own outputs next to them. Backends with a native multi-head attention layer (torch,
  Keras, Flax) also train that layer, convert it with their ``convert`` module and save the
  native layer's outputs (its masks written the framework's way).
* **Consume.** Every tested backend, and NumPy in every env, loads every file it finds with
  ``attention_core.load_weights`` into a fresh layer (Flax: ``init_from_weights``) and must
  give the producer's outputs within the fp32 tolerance.

So a single env is self-contained too: its own backend and NumPy produce, and both consume.

Exchange directory
    ``$ATTENTION_CORE_EXCHANGE_DIR`` (default ``<system temp>/attention-core-exchange``), then
    a subdirectory ``v<FORMAT>-<fingerprint>``: the fingerprint hashes the sources of
    ``attention_core``, ``backends`` and this file, so files written by other code are never
    read. Inside::

        <backend>.json                      the manifest, written last and atomically
        <backend>/<case>.weights.<sha>.safetensors   save_weights(), canonical names
        <backend>/<case>.io.<sha>.safetensors        input.<name>, output.<call> (float32)

    Files are named by the first 16 hex digits of their SHA-256, so a file is never rewritten in
    place while another env reads it. The manifest records the format, the producing backend,
    the fingerprint, Python and framework versions, how the weights were trained, and per case
    the layer, its config and each file's SHA-256, which the consumer checks.

Order
    A consumer can only see producers that ran before it. ``ATTENTION_CORE_EXCHANGE_REQUIRE``
    (a comma list of backends, or ``all``) turns a missing producer from a skip into a
    failure: a second pass run with it after every env has produced (``-k exchange``) closes
    the gap, so that every backend loads every other backend's files.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import os
import platform
import re
import tempfile
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import attention_core as ac
import backends
from attention_core import registry
from attention_core import weights as W
from conftest import test_backends
from tests.harness import TOLERANCE, max_diff

EXCHANGE_ENV = "ATTENTION_CORE_EXCHANGE_DIR"
REQUIRE_ENV = "ATTENTION_CORE_EXCHANGE_REQUIRE"
FORMAT = 1
TOL = TOLERANCE["float32"]
LEARNING_RATE = 0.1
STEPS = 3


# -- the cases ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """A layer, its inputs and the calls whose outputs are exchanged.

    Attributes:
        name: File stem.
        layer: The layer class of every backend.
        config: Constructor arguments.
        inputs: Positional inputs, name -> shape (float32, drawn from the case's seed).
        calls: Call name -> keyword arguments (``valid_lens`` lists, ``causal``).
        native: Produced from the framework's own multi-head attention layer (torch, Keras,
            Flax) converted to canonical weights, instead of from this library's layer.
    """

    name: str
    layer: str
    config: dict[str, Any]
    inputs: Mapping[str, tuple[int, ...]]
    calls: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    native: bool = False

    @property
    def seed(self) -> int:
        return zlib.crc32(self.name.encode())

    def arrays(self) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(self.seed)
        return {name: rng.standard_normal(shape).astype(np.float32)
                for name, shape in self.inputs.items()}

    @property
    def train_call(self) -> str:
        return "valid_lens" if "valid_lens" in self.calls else "plain"


QKV: dict[str, tuple[int, ...]] = {"queries": (2, 4, 5), "keys": (2, 6, 6), "values": (2, 6, 3)}
ATTENTION_CALLS: dict[str, dict[str, Any]] = {"plain": {}, "valid_lens": {"valid_lens": [3, 6]},
                                              "causal": {"causal": True}}
CASES = {case.name: case for case in [
    Case("mha", "MultiHeadAttention", {"num_hiddens": 8, "num_heads": 2}, QKV, ATTENTION_CALLS),
    Case("mha_bias", "MultiHeadAttention", {"num_hiddens": 8, "num_heads": 2, "bias": True}, QKV,
         ATTENTION_CALLS),
    Case("encoder", "TransformerEncoderBlock",
         {"num_hiddens": 8, "ffn_num_hiddens": 12, "num_heads": 2, "bias": True}, {"X": (2, 5, 8)},
         {"plain": {}, "valid_lens": {"valid_lens": [5, 2]}}),
    Case("additive", "AdditiveAttention", {"num_hiddens": 7}, QKV,
         {"plain": {}, "valid_lens": {"valid_lens": [3, 6]}}),
    # The native layers need queries of width num_hiddens (torch) and have causal masks aligned
    # at the first key (ours: at the last), so Q = K here.
    Case("native_mha", "MultiHeadAttention", {"num_hiddens": 8, "num_heads": 2, "bias": True},
         {"queries": (2, 5, 8), "keys": (2, 5, 6), "values": (2, 5, 3)},
         {"plain": {}, "valid_lens": {"valid_lens": [3, 5]}, "causal": {"causal": True}},
         native=True),
]}


# -- the backends: build, call, train, save, load --------------------------------------------------


class Driver:
    """One backend's way to build, call, train, save and load a case's layer (NumPy here)."""

    name = "numpy"
    optimizer = "none: seeded noise added to the initial weights (NumPy has no autodiff)"

    def __init__(self) -> None:
        self.module = registry.load(self.name)
        self.ops = self.module.OPS

    def versions(self) -> dict[str, str]:
        out = {"attention_core": ac.__version__, "numpy": np.__version__}
        for name in registry.FRAMEWORKS[self.name]:
            out[name] = str(importlib.import_module(name).__version__)
        return out

    def build(self, case: Case) -> Any:
        return getattr(self.module, case.layer)(**case.config, seed=case.seed)

    def args(self, case: Case, xs: dict[str, np.ndarray], call: str) -> tuple[list[Any], dict[str, Any]]:
        """The call's positional and keyword arguments as this backend's arrays."""
        kwargs = {k: self.ops.from_numpy(np.asarray(v, np.int32)) if k == "valid_lens" else v
                  for k, v in case.calls[call].items()}
        return [self.ops.from_numpy(xs[name]) for name in case.inputs], kwargs

    def call(self, layer: Any, case: Case, xs: dict[str, np.ndarray], call: str) -> np.ndarray:
        args, kwargs = self.args(case, xs, call)
        return np.asarray(self.ops.to_numpy(layer(*args, **kwargs)))

    def get_weights(self, layer: Any) -> dict[str, np.ndarray]:
        weights: dict[str, np.ndarray] = layer.get_weights()
        return weights

    def set_weights(self, layer: Any, weights: dict[str, np.ndarray]) -> Any:
        layer.set_weights(weights)
        return layer

    def train(self, layer: Any, case: Case, xs: dict[str, np.ndarray], target: np.ndarray) -> Any:
        """A few SGD steps on mean((output - target)^2); returns ``(layer, losses)``."""
        return layer, []

    def save(self, path: Path, layer: Any) -> None:
        ac.save_weights(path, layer)

    def load(self, path: Path, case: Case) -> Any:
        layer = self.build(case)
        ac.load_weights(path, layer)  # before the first call: input sizes come from the file
        return layer

    def native(self, case: Case, xs: dict[str, np.ndarray], target: np.ndarray) -> Any:
        """``(canonical weights, outputs per call, losses)`` of the trained native layer, or None."""
        return None


class TorchDriver(Driver):
    name = "torch"
    optimizer = f"torch.optim.SGD(lr={LEARNING_RATE}), {STEPS} steps"

    def build(self, case: Case) -> Any:
        import torch

        torch.manual_seed(case.seed)  # the initial weights
        return getattr(self.module, case.layer)(**case.config).eval()

    def call(self, layer: Any, case: Case, xs: dict[str, np.ndarray], call: str) -> np.ndarray:
        import torch

        with torch.no_grad():
            return super().call(layer, case, xs, call)

    def train(self, layer: Any, case: Case, xs: dict[str, np.ndarray], target: np.ndarray) -> Any:
        args, kwargs = self.args(case, xs, case.train_call)
        return layer, torch_sgd(layer, lambda: layer(*args, **kwargs), target)

    def native(self, case: Case, xs: dict[str, np.ndarray], target: np.ndarray) -> Any:
        import torch

        from backends.torch.convert import from_torch

        q, k, v = (torch.from_numpy(xs[n]) for n in ("queries", "keys", "values"))
        torch.manual_seed(case.seed)
        module = torch.nn.MultiheadAttention(8, 2, kdim=6, vdim=3, batch_first=True)
        with torch.no_grad():
            for p in module.parameters():
                p.normal_(0.0, 0.3)  # torch starts biases at zero
        lens = torch.tensor(case.calls["valid_lens"]["valid_lens"])
        masks = {"plain": {}, "valid_lens": {"key_padding_mask": torch.arange(5)[None] >= lens[:, None]},
                 "causal": {"attn_mask": torch.ones(5, 5, dtype=torch.bool).triu(1)}}  # True = blocked
        losses = torch_sgd(module, lambda: module(q, k, v, need_weights=False,
                                                  **masks[case.train_call])[0], target)
        module.eval()
        with torch.no_grad():
            outputs = {c: module(q, k, v, need_weights=False, **m)[0].numpy() for c, m in masks.items()}
        return from_torch(module), outputs, losses


def torch_sgd(module: Any, forward: Callable[[], Any], target: np.ndarray) -> list[float]:
    import torch

    optimizer = torch.optim.SGD(module.parameters(), lr=LEARNING_RATE)
    goal = torch.from_numpy(target)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = ((forward() - goal) ** 2).mean()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    with torch.no_grad():
        losses.append(float(((forward() - goal) ** 2).mean()))
    return losses


class TensorFlowDriver(Driver):
    name = "tensorflow"
    optimizer = f"tf.GradientTape + keras.optimizers.SGD({LEARNING_RATE}), {STEPS} steps"

    def build(self, case: Case) -> Any:
        import keras

        keras.utils.set_random_seed(case.seed)  # the initial weights
        return getattr(self.module, case.layer)(**case.config)

    def train(self, layer: Any, case: Case, xs: dict[str, np.ndarray], target: np.ndarray) -> Any:
        args, kwargs = self.args(case, xs, case.train_call)
        return layer, keras_sgd(layer, lambda: layer(*args, **kwargs), target)

    def native(self, case: Case, xs: dict[str, np.ndarray], target: np.ndarray) -> Any:
        import keras

        from backends.tensorflow.convert import from_keras

        q, k, v = (xs[n] for n in ("queries", "keys", "values"))
        layer = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)
        layer.build(q.shape, v.shape, k.shape)
        rng = np.random.default_rng(case.seed)
        layer.set_weights([rng.normal(0.0, 0.3, w.shape).astype(np.float32)
                           for w in layer.get_weights()])  # Keras starts biases at zero
        lens = np.asarray(case.calls["valid_lens"]["valid_lens"])
        padding = np.broadcast_to(np.arange(5)[None, None] < lens[:, None, None], (2, 5, 5))
        masks: dict[str, dict[str, Any]] = {  # True = may attend
            "plain": {}, "valid_lens": {"attention_mask": padding}, "causal": {"use_causal_mask": True}}
        losses = keras_sgd(layer, lambda: layer(q, v, k, **masks[case.train_call]), target)
        outputs = {c: np.asarray(layer(q, v, k, **m)) for c, m in masks.items()}
        return from_keras(layer), outputs, losses


def keras_sgd(layer: Any, forward: Callable[[], Any], target: np.ndarray) -> list[float]:
    import keras
    import tensorflow as tf

    optimizer = keras.optimizers.SGD(LEARNING_RATE)
    losses = []
    for _ in range(STEPS):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((forward() - target) ** 2)
        grads = tape.gradient(loss, layer.trainable_variables)
        optimizer.apply_gradients(zip(grads, layer.trainable_variables, strict=True))
        losses.append(float(loss))
    losses.append(float(tf.reduce_mean((forward() - target) ** 2)))
    return losses


@dataclass
class FlaxLayer:
    """A Flax module and its variables (Flax layers hold no state)."""

    module: Any
    variables: Any = None


class JaxDriver(Driver):
    name = "jax"
    optimizer = f"jax.grad, params -= {LEARNING_RATE} * grads, {STEPS} steps"

    def build(self, case: Case) -> Any:
        return FlaxLayer(getattr(self.module, case.layer)(**case.config))  # no variables yet

    def call(self, layer: Any, case: Case, xs: dict[str, np.ndarray], call: str) -> np.ndarray:
        args, kwargs = self.args(case, xs, call)
        if layer.variables is None:  # drawn on the host, seeded (eager init compiles op by op)
            sizes = layer.module.sizes.items()
            dims = {dim: xs[s.argument].shape[-1] for dim, s in sizes if s.argument in xs}
            layer.variables = self.module.init_weights(layer.module, case.seed, **dims)
        return np.asarray(layer.module.apply(layer.variables, *args, **kwargs))

    def get_weights(self, layer: Any) -> dict[str, np.ndarray]:
        weights: dict[str, np.ndarray] = self.module.get_weights(layer.variables)
        return weights

    def set_weights(self, layer: Any, weights: dict[str, np.ndarray]) -> Any:
        layer.variables = self.module.set_weights(layer.variables, weights)
        return layer

    def train(self, layer: Any, case: Case, xs: dict[str, np.ndarray], target: np.ndarray) -> Any:
        args, kwargs = self.args(case, xs, case.train_call)
        layer.variables, losses = flax_sgd(
            lambda v: layer.module.apply(v, *args, **kwargs), layer.variables, target)
        return layer, losses

    def save(self, path: Path, layer: Any) -> None:
        ac.save_weights(path, layer.variables)  # the Flax form: the variables pytree

    def load(self, path: Path, case: Case) -> Any:
        layer = self.build(case)
        layer.variables = self.module.init_from_weights(layer.module, ac.load_weights(path))
        return layer

    def native(self, case: Case, xs: dict[str, np.ndarray], target: np.ndarray) -> Any:
        import flax.linen as nn
        import jax
        import jax.numpy as jnp

        from backends.jax.convert import from_flax

        q, k, v = (jnp.asarray(xs[n]) for n in ("queries", "keys", "values"))
        module = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8, out_features=8)
        variables = module.init(jax.random.key(case.seed), q, k, v)
        rng = np.random.default_rng(case.seed)
        variables = jax.tree_util.tree_map(  # Flax starts biases at zero
            lambda a: jnp.asarray(rng.normal(0.0, 0.3, a.shape), a.dtype), variables)
        lens = np.asarray(case.calls["valid_lens"]["valid_lens"])
        masks = {"plain": None,  # True = may attend, (B, 1, Q, K)
                 "valid_lens": jnp.asarray((np.arange(5)[None] < lens[:, None])[:, None, None, :]),
                 "causal": nn.make_causal_mask(jnp.ones((2, 5)))}
        variables, losses = flax_sgd(
            lambda var: module.apply(var, q, k, v, mask=masks[case.train_call]), variables, target)
        outputs = {c: np.asarray(module.apply(variables, q, k, v, mask=m)) for c, m in masks.items()}
        return from_flax(variables, module), outputs, losses


def flax_sgd(forward: Callable[[Any], Any], variables: Any, target: np.ndarray) -> tuple[Any, list[float]]:
    import jax
    import jax.numpy as jnp

    def loss(v: Any) -> Any:
        return jnp.mean((forward(v) - target) ** 2)

    step = jax.jit(jax.value_and_grad(loss))
    losses = []
    for _ in range(STEPS):
        value, grads = step(variables)
        variables = jax.tree_util.tree_map(lambda p, g: p - LEARNING_RATE * g, variables, grads)
        losses.append(float(value))
    losses.append(float(loss(variables)))
    return variables, losses


class MXNetDriver(Driver):
    name = "mxnet"
    optimizer = f"gluon.Trainer('sgd', learning_rate={LEARNING_RATE}) under autograd.record(), {STEPS} steps"

    def build(self, case: Case) -> Any:
        import mxnet as mx

        mx.random.seed(case.seed)  # the initial weights
        layer = getattr(self.module, case.layer)(**case.config)
        layer.initialize()
        return layer

    def train(self, layer: Any, case: Case, xs: dict[str, np.ndarray], target: np.ndarray) -> Any:
        from mxnet import autograd, gluon

        args, kwargs = self.args(case, xs, case.train_call)
        goal = self.ops.from_numpy(target)
        trainer = gluon.Trainer(layer.collect_params(), "sgd", {"learning_rate": LEARNING_RATE})
        losses = []
        for _ in range(STEPS):
            with autograd.record():
                loss = ((layer(*args, **kwargs) - goal) ** 2).mean()
            loss.backward()
            trainer.step(1)
            losses.append(float(loss.item()))
        losses.append(float(((layer(*args, **kwargs) - goal) ** 2).mean().item()))
        return layer, losses


DRIVERS: dict[str, type[Driver]] = {d.name: d for d in
                                    (Driver, TorchDriver, TensorFlowDriver, JaxDriver, MXNetDriver)}


# -- files --------------------------------------------------------------------------------------


def fingerprint() -> str:
    """SHA-256 of the sources whose behaviour the files depend on (the same in every env)."""
    digest = hashlib.sha256()
    roots = [Path(ac.__file__).parent, Path(next(iter(backends.__path__)))]
    files = [(f"{root.name}/{p.relative_to(root).as_posix()}", p)
             for root in roots for p in root.rglob("*.py")]
    files.append(("tests/test_weights_exchange.py", Path(__file__)))
    for name, path in sorted(files):
        digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def exchange_dir() -> Path:
    root = os.environ.get(EXCHANGE_ENV) or os.path.join(tempfile.gettempdir(), "attention-core-exchange")
    return Path(root) / f"v{FORMAT}-{fingerprint()[:16]}"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _store(directory: Path, stem: str, write: Callable[[Path], None]) -> dict[str, str]:
    """Writes a file under a temporary name, then renames it after its content hash."""
    tmp = directory / f".{stem}.{os.getpid()}.tmp"
    write(tmp)
    digest = sha256(tmp)
    final = directory / f"{stem}.{digest[:16]}.safetensors"
    os.replace(tmp, final)
    return {"file": f"{directory.name}/{final.name}", "sha256": digest}


def _perturb(weights: dict[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: (w + rng.normal(0.0, 0.2, w.shape)).astype(w.dtype) for n, w in weights.items()}


def produce(backend: str, directory: Path) -> dict[str, Any]:
    """Trains, saves and writes every case of ``backend`` into ``directory``; returns the manifest."""
    driver = DRIVERS[backend]()
    own = directory / backend
    own.mkdir(parents=True, exist_ok=True)
    manifest: dict[str, Any] = {
        "format": FORMAT, "backend": backend, "fingerprint": fingerprint(),
        "versions": driver.versions(), "python": platform.python_version(),
        "optimizer": driver.optimizer, "cases": {},
    }
    for case in CASES.values():
        xs = case.arrays()
        rng = np.random.default_rng(case.seed + 1)
        if case.native:
            target = rng.standard_normal((2, 5, 8)).astype(np.float32)
            result = driver.native(case, xs, target)
            if result is None:
                continue
            weights, outputs, losses = result
            source: Any = weights
        else:
            layer = driver.build(case)
            first = driver.call(layer, case, xs, case.train_call)  # creates the weights
            start = _perturb(driver.get_weights(layer), case.seed)
            layer = driver.set_weights(layer, start)
            target = rng.standard_normal(first.shape).astype(np.float32)
            layer, losses = driver.train(layer, case, xs, target)
            trained = driver.get_weights(layer)
            if losses:
                moved = max(float(np.max(np.abs(trained[n] - start[n]))) for n in start)
                assert moved > 1e-4, f"{backend}/{case.name}: training did not change the weights"
            outputs = {call: driver.call(layer, case, xs, call) for call in case.calls}
            source = layer
        if losses:
            assert losses[-1] < losses[0], f"{backend}/{case.name}: the loss did not fall: {losses}"
        io = {f"input.{n}": x for n, x in xs.items()}
        io.update({f"output.{c}": np.asarray(o, np.float32) for c, o in outputs.items()})
        manifest["cases"][case.name] = {
            "layer": case.layer, "config": case.config, "native": case.native,
            "losses": losses,
            "weights": _store(own, f"{case.name}.weights", functools.partial(
                ac.save_weights if case.native else driver.save, layer=source)),
            "io": _store(own, f"{case.name}.io", functools.partial(W.write_safetensors, tensors=io)),
        }
    path = directory / f"{backend}.json"
    tmp = directory / f".{backend}.json.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    os.replace(tmp, path)  # written last: a manifest names only complete files
    return manifest


def read_manifest(directory: Path, producer: str) -> tuple[dict[str, Any] | None, str]:
    """The producer's manifest, or None and why there is none."""
    path = directory / f"{producer}.json"
    if not path.exists():
        return None, f"no files from {producer} in {directory} (its env has not run yet)"
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT or manifest.get("fingerprint") != fingerprint():
        return None, (f"{path} is stale: written by other sources (fingerprint "
                      f"{str(manifest.get('fingerprint'))[:16]}, format {manifest.get('format')})")
    return manifest, ""


def consume(manifest: dict[str, Any], directory: Path, consumer: str) -> dict[str, float]:
    """Loads every case of a manifest into ``consumer``; returns max |diff| per case/call."""
    driver = DRIVERS[consumer]()
    producer = manifest["backend"]
    versions = ", ".join(f"{k} {v}" for k, v in manifest["versions"].items())
    diffs, failures = {}, []
    assert manifest["cases"], f"{producer} wrote no cases"
    for name, entry in manifest["cases"].items():
        case = CASES[name]
        assert (entry["layer"], entry["config"]) == (case.layer, case.config), name
        if producer != "numpy":  # trained by the producer's own autodiff, as the manifest says
            losses = entry["losses"]
            assert len(losses) == STEPS + 1 and losses[-1] < losses[0], (name, losses)
        for part in ("weights", "io"):
            path = directory / entry[part]["file"]
            got = sha256(path)
            assert got == entry[part]["sha256"], (
                f"{path}: SHA-256 {got[:16]} does not match the manifest's {entry[part]['sha256'][:16]}")
        io = W.read_safetensors(directory / entry["io"]["file"])
        xs = {n: io[f"input.{n}"] for n in case.inputs}
        layer = driver.load(directory / entry["weights"]["file"], case)
        for call in case.calls:
            diff = max_diff(driver.call(layer, case, xs, call), io[f"output.{call}"])
            diffs[f"{name}/{call}"] = diff
            if not diff <= TOL:
                failures.append(f"{name}/{call}: max |diff| {diff:.3g}")
    assert not failures, (f"{producer} ({versions}) -> {consumer}: outputs differ by more than "
                          f"{TOL}: {'; '.join(failures)}")
    return diffs


def required() -> set[str]:
    raw = os.environ.get(REQUIRE_ENV, "").strip()
    if raw == "all":
        return set(registry.BACKENDS)
    return {registry.canonical_name(p) for p in raw.split(",") if p.strip()}


#: The registry backends tested here (a column's env, e.g. keras-jax, exchanges .keras files
#: instead: tests/test_keras.py; its arrays' backend exchanges weights files in its own env).
TESTED = [name for name in test_backends() if name in registry.BACKENDS]
CONSUMERS = list(dict.fromkeys(["numpy", *TESTED])) if TESTED else []


def load_consumer(name: str) -> None:
    try:
        registry.load(name)
    except (ImportError, ValueError) as err:
        pytest.fail(f"backend {name!r} was asked for in ATTENTION_CORE_TEST_BACKENDS: {err}")


# -- tests --------------------------------------------------------------------------------------


def test_produce(backend: str) -> None:
    """This env's backend trains, saves and writes its files into the exchange directory."""
    directory = exchange_dir()
    manifest = produce(backend, directory)
    expected = {n for n, c in CASES.items() if not c.native or backend in ("torch", "tensorflow", "jax")}
    assert set(manifest["cases"]) == expected
    assert read_manifest(directory, backend)[0] == manifest


@pytest.fixture(scope="session")
def numpy_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Deterministic files from the NumPy backend, made in this process (every env has NumPy)."""
    directory = tmp_path_factory.mktemp("exchange")
    produce("numpy", directory)
    return directory


@pytest.mark.parametrize("consumer", CONSUMERS)
def test_numpy_files_load(consumer: str, numpy_files: Path) -> None:
    """Files made by NumPy in this process load into this env's backend with equal outputs."""
    load_consumer(consumer)
    manifest, reason = read_manifest(numpy_files, "numpy")
    assert manifest is not None, reason
    consume(manifest, numpy_files, consumer)


@pytest.mark.parametrize("consumer", CONSUMERS)
@pytest.mark.parametrize("producer", registry.BACKENDS)
def test_exchange(producer: str, consumer: str) -> None:
    """Files saved by ``producer`` (in its own env) load into ``consumer`` with equal outputs."""
    load_consumer(consumer)
    directory = exchange_dir()
    manifest, reason = read_manifest(directory, producer)
    if manifest is None:
        if producer in required():
            pytest.fail(f"{REQUIRE_ENV} names {producer}, but {reason}")
        pytest.skip(reason)
    consume(manifest, directory, consumer)


# -- save_weights / load_weights in the Flax form, and their errors ------------------------------


@pytest.mark.skipif("numpy" not in test_backends(), reason="framework-free; runs in the numpy env")
def test_nested_mappings_and_flax_variables_are_saved_flat(tmp_path: Path) -> None:
    a, b = np.arange(6, dtype=np.float32).reshape(2, 3), np.ones(3, np.float32)
    flat = {"attention.W_q.kernel": a, "attention.W_q.bias": b}
    nested = {"attention": {"W_q": {"kernel": a, "bias": b}}}
    variables = {"params": nested, "intermediates": {"attention_weights": (np.zeros(2),)}}
    files = []
    sources: list[dict[str, Any]] = [flat, nested, variables]
    for i, source in enumerate(sources):
        ac.save_weights(tmp_path / f"{i}.safetensors", source)
        files.append((tmp_path / f"{i}.safetensors").read_bytes())
    assert files[0] == files[1] == files[2]
    loaded = ac.load_weights(tmp_path / "2.safetensors")
    assert sorted(loaded) == sorted(flat)
    np.testing.assert_array_equal(loaded["attention.W_q.kernel"], a)


@pytest.mark.skipif("numpy" not in test_backends(), reason="framework-free; runs in the numpy env")
@pytest.mark.parametrize("source, error, message", [
    ({"params": {"W": {"kernel": np.ones(2)}}, "batch_stats": {"m": np.ones(2)}}, ValueError,
     "save_weights: the Flax variables hold collections ['batch_stats'] besides 'params'"),
    ({"W.kernel": None}, TypeError, "save_weights: W.kernel must be an array, got NoneType"),
    (object(), TypeError, "save_weights: expected a layer with get_weights() or a mapping"),
], ids=["other_collection", "none_leaf", "no_get_weights"])
def test_save_weights_errors(tmp_path: Path, source: Any, error: type, message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        ac.save_weights(tmp_path / "x.safetensors", source)
    assert not (tmp_path / "x.safetensors").exists()


@pytest.mark.skipif("numpy" not in test_backends(), reason="framework-free; runs in the numpy env")
def test_load_weights_refuses_objects_without_set_weights(tmp_path: Path) -> None:
    ac.save_weights(tmp_path / "w.safetensors", {"w": np.ones(1, np.float32)})
    with pytest.raises(TypeError, match=re.escape("load_weights: object has no set_weights(); for a "
                                                "Flax module, use backends.jax.init_from_weights")):
        ac.load_weights(tmp_path / "w.safetensors", object())  # type: ignore[arg-type]


@pytest.mark.skipif("numpy" not in test_backends(), reason="framework-free; runs in the numpy env")
def test_a_changed_file_is_refused(tmp_path: Path) -> None:
    manifest = produce("numpy", tmp_path)
    entry = manifest["cases"]["mha"]["weights"]
    path = tmp_path / entry["file"]
    weights = W.read_safetensors(path)
    weights["W_q.kernel"] = weights["W_q.kernel"] + 1
    W.write_safetensors(path, weights)
    with pytest.raises(AssertionError, match="does not match the manifest"):
        consume(manifest, tmp_path, "numpy")


@pytest.mark.skipif("numpy" not in test_backends(), reason="framework-free; runs in the numpy env")
def test_different_outputs_fail(tmp_path: Path) -> None:
    """The comparison can fail: a producer's outputs off by 1e-4 are caught."""
    manifest = produce("numpy", tmp_path)
    entry = manifest["cases"]["encoder"]["io"]
    io = W.read_safetensors(tmp_path / entry["file"])
    io["output.plain"] = io["output.plain"] + np.float32(1e-4)
    W.write_safetensors(tmp_path / entry["file"], io)
    entry["sha256"] = sha256(tmp_path / entry["file"])
    with pytest.raises(AssertionError, match=r"numpy \(.*\) -> numpy: outputs differ .* encoder/plain"):
        consume(manifest, tmp_path, "numpy")


@pytest.mark.skipif("jax" not in test_backends(), reason="jax is not tested in this env")
def test_flax_variables_save_and_load(tmp_path: Path) -> None:
    """save_weights takes Flax variables or params; load_weights gives init_from_weights' mapping."""
    import jax
    import jax.numpy as jnp

    import backends.jax as bj

    module = bj.TransformerEncoderBlock(8, 12, 2, bias=True)
    X = jnp.asarray(np.random.default_rng(0).standard_normal((2, 5, 8)), jnp.float32)
    variables = module.init(jax.random.key(3), X)
    ac.save_weights(tmp_path / "variables.safetensors", variables)
    ac.save_weights(tmp_path / "params.safetensors", variables["params"])
    assert ((tmp_path / "variables.safetensors").read_bytes()
            == (tmp_path / "params.safetensors").read_bytes())
    loaded = ac.load_weights(tmp_path / "variables.safetensors")
    assert sorted(loaded) == sorted(W.encoder_block_spec(8, 12, 2, True))
    again = bj.init_from_weights(module, loaded)
    np.testing.assert_array_equal(np.asarray(module.apply(again, X, jnp.array([5, 2]))),
                                  np.asarray(module.apply(variables, X, jnp.array([5, 2]))))
    with pytest.raises(TypeError, match=re.escape("save_weights: expected a layer with get_weights()")):
        ac.save_weights(tmp_path / "module.safetensors", module)
    with pytest.raises(TypeError, match="load_weights: TransformerEncoderBlock has no set_weights"):
        ac.load_weights(tmp_path / "variables.safetensors", module)
