"""Writes the compatibility fixtures into ``tests/fixtures/compat_v1/``.

The files are what the code *before* the layers-once refactor saved, so that
``tests/test_compat_files.py`` can prove the code after it still loads them with equal outputs.
They were made by running, from the repository root::

    /work/venvs/all/bin/python tools/make_compat_fixtures.py numpy torch tensorflow jax
    /work/venvs/mx/bin/python tools/make_compat_fixtures.py mxnet

(``numpy`` first: it writes the shared inputs and weights that the other backends read.) For
TensorFlow, set ``KERAS_BACKEND=tensorflow``. Do not rerun it on changed code: the point of the
files is that they are old.

Every layer gets a tiny config (``num_hiddens`` 8, 2 heads, vocabulary 11, 2 blocks, batch 2,
length 5). Its canonical weights (the layout of the Weights page) are drawn once from a
seeded generator, in
float32, and set into the layer of every backend, which is then called on fixed inputs and saved
the framework's own way. Layout::

    layers.json              layer -> {"config": ..., "inputs": [input names, in call order]}
    inputs.npz               "<layer>/<input>": the call's inputs (float32; token ids int32)
    weights.npz              "<layer>/<canonical name>": the weights every backend was given
    <backend>/outputs.npz    "<layer>": that backend's float32 output on those inputs
    <backend>/keys.json      layer -> {"file": ..., "keys": {name: shape}} (see below)
    numpy/<layer>.safetensors        attention_core.save_weights (the safetensors format)
    torch/<layer>.pt                 torch.save(layer.state_dict()); keys: the state_dict's
    tensorflow/<layer>.keras         a functional keras.Model holding the layer; keys: canonical
    jax/<layer>.msgpack              flax.serialization.to_bytes(params); keys: the param paths
    mxnet/<layer>.params             layer.save_parameters(...); keys: the file's names

Layers without weights (``DotProductAttention``, ``PositionalEncoding``, a plain
``NadarayaWatson``) have no safetensors, Flax or Gluon file (there is nothing to save); torch
still saves their (empty) ``state_dict`` and Keras their model, whose config is what matters.
"""

from __future__ import annotations

import json
import os
import sys
import zlib
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

OUT = ROOT / "tests" / "fixtures" / "compat_v1"

#: Batch, length and width of every input.
B, T, D = 2, 5, 8

#: Constructor arguments and input shapes (in call order) of each of the 11 layers.
LAYERS: dict[str, tuple[dict[str, Any], dict[str, tuple[int, ...]]]] = {
    "DotProductAttention": ({"dropout": 0.0},
                            {"queries": (B, T, D), "keys": (B, T, D), "values": (B, T, D)}),
    "AdditiveAttention": ({"num_hiddens": D, "dropout": 0.0},
                          {"queries": (B, T, D), "keys": (B, T, D), "values": (B, T, D)}),
    "MultiHeadAttention": ({"num_hiddens": D, "num_heads": 2, "dropout": 0.0, "bias": True},
                           {"queries": (B, T, D), "keys": (B, T, D), "values": (B, T, D)}),
    "RelativeMultiHeadAttention": (
        {"num_hiddens": D, "num_heads": 2, "max_relative_position": 2, "dropout": 0.0,
         "bias": True},
        {"queries": (B, T, D), "keys": (B, T, D), "values": (B, T, D)}),
    "PositionalEncoding": ({"num_hiddens": D, "dropout": 0.0, "max_len": 20}, {"X": (B, T, D)}),
    "LearnedPositionalEncoding": ({"num_hiddens": D, "dropout": 0.0, "max_len": 20},
                                  {"X": (B, T, D)}),
    "PositionWiseFFN": ({"ffn_num_hiddens": 16, "ffn_num_outputs": D}, {"X": (B, T, D)}),
    "AddNorm": ({"num_hiddens": D, "dropout": 0.0}, {"X": (B, T, D), "Y": (B, T, D)}),
    "TransformerEncoderBlock": (
        {"num_hiddens": D, "ffn_num_hiddens": 16, "num_heads": 2, "dropout": 0.0},
        {"X": (B, T, D)}),
    "TransformerEncoder": (
        {"vocab_size": 11, "num_hiddens": D, "ffn_num_hiddens": 16, "num_heads": 2,
         "num_blks": 2, "dropout": 0.0},
        {"tokens": (B, T)}),
    "NadarayaWatson": ({"parametric": True},
                       {"queries": (B, T), "keys": (B, T), "values": (B, T)}),
}


def _rng(layer: str, what: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(f"compat_v1/{layer}/{what}".encode()))


def draw_inputs() -> dict[str, np.ndarray]:
    """The fixed inputs, ``"<layer>/<input>"``: N(0, 1) in float32, token ids in int32."""
    out = {}
    for layer, (config, shapes) in LAYERS.items():
        rng = _rng(layer, "inputs")
        for name, shape in shapes.items():
            if name == "tokens":
                out[f"{layer}/{name}"] = rng.integers(0, config["vocab_size"], shape).astype(np.int32)
            else:
                out[f"{layer}/{name}"] = rng.standard_normal(shape).astype(np.float32)
    return out


def inputs_of(inputs: dict[str, np.ndarray], layer: str) -> list[np.ndarray]:
    return [inputs[f"{layer}/{name}"] for name in LAYERS[layer][1]]


def weights_of(weights: dict[str, np.ndarray], layer: str) -> dict[str, np.ndarray]:
    prefix = f"{layer}/"
    return {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}


def draw_weights(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Canonical weights, ``"<layer>/<name>"``, shaped by a NumPy layer built on the inputs.

    Every value is random (no zero bias or unit gamma hides a term); the Nadaraya-Watson width
    stays positive.
    """
    import backends.numpy as bn

    out = {}
    for layer, (config, _) in LAYERS.items():
        built = getattr(bn, layer)(**config, seed=0)
        built(*inputs_of(inputs, layer))
        rng = _rng(layer, "weights")
        for name, value in built.get_weights().items():
            leaf = name.rpartition(".")[2]
            if leaf == "gamma":
                drawn = 1.0 + 0.1 * rng.standard_normal(value.shape)
            elif leaf == "w":
                drawn = 0.5 + rng.random(value.shape)
            else:
                drawn = 0.5 * rng.standard_normal(value.shape)
            out[f"{layer}/{name}"] = drawn.astype(np.float32)
    return out


def shapes(mapping: dict[str, Any]) -> dict[str, list[int]]:
    return {name: [int(n) for n in value.shape] for name, value in mapping.items()}


def produce_numpy(inputs: dict[str, np.ndarray], weights: dict[str, np.ndarray],
                  folder: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    import attention_core as ac
    import backends.numpy as bn

    outputs, keys = {}, {}
    for layer, (config, _) in LAYERS.items():
        module = getattr(bn, layer)(**config, seed=0)
        x = inputs_of(inputs, layer)
        module(*x)
        w = weights_of(weights, layer)
        if w:
            module.set_weights(w)
            ac.save_weights(folder / f"{layer}.safetensors", module)
            keys[layer] = {"file": f"{layer}.safetensors", "keys": shapes(module.get_weights())}
        outputs[layer] = np.asarray(module(*x), dtype=np.float32)
    return outputs, keys


def produce_torch(inputs: dict[str, np.ndarray], weights: dict[str, np.ndarray],
                  folder: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    import torch

    import backends.torch as bt

    torch.manual_seed(0)
    outputs, keys = {}, {}
    for layer, (config, _) in LAYERS.items():
        module = getattr(bt, layer)(**config).eval()
        x = [torch.from_numpy(a) for a in inputs_of(inputs, layer)]
        with torch.no_grad():
            module(*x)
            w = weights_of(weights, layer)
            if w:
                module.set_weights(w)
            outputs[layer] = module(*x).numpy().astype(np.float32)
        state = module.state_dict()
        torch.save(state, folder / f"{layer}.pt")
        keys[layer] = {"file": f"{layer}.pt", "keys": shapes(state)}
    return outputs, keys


def produce_tensorflow(inputs: dict[str, np.ndarray], weights: dict[str, np.ndarray],
                       folder: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    import keras

    import backends.tensorflow as btf

    keras.utils.set_random_seed(0)
    outputs, keys = {}, {}
    for layer, (config, _) in LAYERS.items():
        x = inputs_of(inputs, layer)
        module = getattr(btf, layer)(**config)
        symbols = [keras.Input(a.shape[1:], dtype=str(a.dtype)) for a in x]
        model = keras.Model(symbols, module(*symbols))
        w = weights_of(weights, layer)
        if w:
            module.set_weights(w)
        outputs[layer] = np.asarray(model(x), dtype=np.float32)
        model.save(folder / f"{layer}.keras")
        keys[layer] = {"file": f"{layer}.keras", "keys": shapes(module.get_weights())}
    return outputs, keys


def flax_paths(params: Any) -> dict[str, list[int]]:
    """``"a/b/c"`` -> shape of each leaf of a Flax params tree."""
    import jax

    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    return {"/".join(str(k.key) for k in path): [int(n) for n in leaf.shape]
            for path, leaf in leaves}


def produce_jax(inputs: dict[str, np.ndarray], weights: dict[str, np.ndarray],
                folder: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    import flax.serialization
    import jax
    import jax.numpy as jnp

    import backends.jax as bj

    outputs, keys = {}, {}
    rngs = {"params": jax.random.PRNGKey(0), "dropout": jax.random.PRNGKey(1)}
    for layer, (config, _) in LAYERS.items():
        module = getattr(bj, layer)(**config)
        x = [jnp.asarray(a) for a in inputs_of(inputs, layer)]
        variables = {"params": module.init(rngs, *x).get("params", {})}
        w = weights_of(weights, layer)
        if w:
            variables = bj.set_weights(variables, w, layer=module)
            params = variables["params"]
            (folder / f"{layer}.msgpack").write_bytes(flax.serialization.to_bytes(params))
            keys[layer] = {"file": f"{layer}.msgpack", "keys": flax_paths(params)}
        outputs[layer] = np.asarray(module.apply(variables, *x, rngs=rngs), dtype=np.float32)
    return outputs, keys


def produce_mxnet(inputs: dict[str, np.ndarray], weights: dict[str, np.ndarray],
                  folder: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    import mxnet as mx

    import backends.mxnet as bm

    mx.random.seed(0)
    outputs, keys = {}, {}
    for layer, (config, _) in LAYERS.items():
        module = getattr(bm, layer)(**config)
        module.initialize()
        x = [mx.np.array(a, dtype=a.dtype) for a in inputs_of(inputs, layer)]
        module(*x)
        w = weights_of(weights, layer)
        if w:
            module.set_weights(w)
            path = folder / f"{layer}.params"
            module.save_parameters(str(path))
            keys[layer] = {"file": f"{layer}.params",
                           "keys": shapes({k: v for k, v in mx.npx.load(str(path)).items()})}
        outputs[layer] = module(*x).asnumpy().astype(np.float32)
    return outputs, keys


PRODUCERS = {"numpy": produce_numpy, "torch": produce_torch, "tensorflow": produce_tensorflow,
             "jax": produce_jax, "mxnet": produce_mxnet}


def save_npz(path: Path, arrays: dict[str, Any]) -> None:
    np.savez(path, **arrays)


def main(backends: list[str]) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    if "numpy" in backends:
        inputs = draw_inputs()
        weights = draw_weights(inputs)
        save_npz(OUT / "inputs.npz", inputs)
        save_npz(OUT / "weights.npz", weights)
        layers = {name: {"config": config, "inputs": list(shapes_)}
                  for name, (config, shapes_) in LAYERS.items()}
        (OUT / "layers.json").write_text(json.dumps(layers, indent=1) + "\n")
    inputs = dict(np.load(OUT / "inputs.npz"))
    weights = dict(np.load(OUT / "weights.npz"))
    for backend in backends:
        folder = OUT / backend
        folder.mkdir(exist_ok=True)
        outputs, keys = PRODUCERS[backend](inputs, weights, folder)
        save_npz(folder / "outputs.npz", outputs)
        (folder / "keys.json").write_text(json.dumps(keys, indent=1) + "\n")
        print(f"{backend}: {len(outputs)} layers, {len(keys)} files")


if __name__ == "__main__":
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    main(sys.argv[1:] or ["numpy"])
