"""Files saved by older code still load, with the outputs they were saved with.

``tests/fixtures/compat_v1/`` holds what the code before the layers-once refactor saved for a
tiny config of each of the 11 layers (made by ``tools/make_compat_fixtures.py``, whose docstring
describes the layout): a torch ``state_dict``, a ``.keras`` model, Flax msgpack params, a Gluon
``.params`` file and a safetensors file, with the inputs and each backend's outputs. Here a
fresh layer of the same config, on the tested backend, loads the old file the framework's own
way and must give the recorded output within :data:`TOL`; its ``state_dict`` keys and shapes,
Flax param paths and canonical weight names must be the recorded ones. The recorded outputs are
themselves checked against an independent float64 computation (``tests/naive.py``).
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import attention_core as ac
from attention_core import registry
from conftest import test_backends
from tests.harness import TOLERANCE, max_diff
from tests.reference.cases import Case
from tests.test_reference_files import naive_outputs

FIXTURES = Path(__file__).parent / "fixtures" / "compat_v1"

#: Max |diff| between an output after loading and the one recorded by the same framework: the
#: same weights and the same arithmetic, so float32 rounding at most.
TOL = 1e-6

LAYERS: dict[str, dict[str, Any]] = json.loads((FIXTURES / "layers.json").read_text())
BACKENDS = ("numpy", "torch", "tensorflow", "jax", "mxnet")


@cache
def _npz(name: str) -> dict[str, np.ndarray]:
    with np.load(FIXTURES / name) as data:
        return dict(data)


def inputs(layer: str) -> list[np.ndarray]:
    return [_npz("inputs.npz")[f"{layer}/{name}"] for name in LAYERS[layer]["inputs"]]


def weights(layer: str) -> dict[str, np.ndarray]:
    prefix = f"{layer}/"
    return {k[len(prefix):]: v for k, v in _npz("weights.npz").items() if k.startswith(prefix)}


def recorded(backend: str, layer: str) -> np.ndarray:
    return _npz(f"{backend}/outputs.npz")[layer]


def keys(backend: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((FIXTURES / backend / "keys.json").read_text())
    return loaded


def shapes(mapping: dict[str, Any]) -> dict[str, list[int]]:
    return {name: [int(n) for n in value.shape] for name, value in mapping.items()}


# -- the files themselves -----------------------------------------------------------------------

numpy_env = pytest.mark.skipif("numpy" not in test_backends(),
                               reason="the fixture files are checked in the numpy env")


@numpy_env
@pytest.mark.parametrize("producer", BACKENDS)
@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_recorded_outputs_agree_with_independent_computation(layer: str, producer: str) -> None:
    """Every backend's recorded output is the float64 NumPy computation within fp32 tolerance."""
    x = dict(zip(LAYERS[layer]["inputs"], inputs(layer), strict=True))
    config = LAYERS[layer]["config"]
    case = Case(layer, "compat_v1", config, {k: v.shape for k, v in x.items()},
                heads=config.get("num_heads", 1))
    ref = {f"input.{k}": v.astype(np.float64) if v.dtype.kind == "f" else v for k, v in x.items()}
    ref.update({f"weight.{k}": v.astype(np.float64) for k, v in weights(layer).items()})
    expected = naive_outputs(case, ref)["output.out"]
    assert max_diff(recorded(producer, layer), expected) <= TOLERANCE["float32"]


@numpy_env
def test_every_layer_has_its_files() -> None:
    """11 layers; every framework's file for each layer that has weights (and torch, Keras
    for all)."""
    assert len(LAYERS) == 11
    weighted = {layer for layer in LAYERS if weights(layer)}
    assert weighted == set(LAYERS) - {"DotProductAttention", "PositionalEncoding"}
    for backend in BACKENDS:
        expected = set(LAYERS) if backend in ("torch", "tensorflow") else weighted
        assert set(keys(backend)) == expected, backend
        assert sorted(_npz(f"{backend}/outputs.npz")) == sorted(LAYERS), backend
        for entry in keys(backend).values():
            assert (FIXTURES / backend / entry["file"]).is_file()


# -- loading them, the framework's way ----------------------------------------------------------


def load_numpy(layer: str, entry: dict[str, Any] | None) -> np.ndarray:
    """NumPy's own format is the safetensors file (tested for every backend below)."""
    bn = registry.load("numpy")
    module = getattr(bn, layer)(**LAYERS[layer]["config"], seed=0)
    if entry is not None:
        ac.load_weights(FIXTURES / "numpy" / entry["file"], module)
        assert shapes(module.get_weights()) == entry["keys"]
    return np.asarray(module(*inputs(layer)))


def load_torch(layer: str, entry: dict[str, Any] | None) -> np.ndarray:
    import torch

    bt = registry.load("torch")
    assert entry is not None
    module = getattr(bt, layer)(**LAYERS[layer]["config"]).eval()  # unbuilt: sizes from the file
    state = torch.load(FIXTURES / "torch" / entry["file"], weights_only=True)
    assert shapes(state) == entry["keys"]
    module.load_state_dict(state)  # strict: every key of the old file, and no other
    assert list(module.state_dict()) == list(entry["keys"])
    assert shapes(module.state_dict()) == entry["keys"]
    with torch.no_grad():
        out = module(*[torch.from_numpy(a) for a in inputs(layer)])
    return out.numpy()


def load_tensorflow(layer: str, entry: dict[str, Any] | None) -> np.ndarray:
    import keras

    btf = registry.load("tensorflow")
    assert entry is not None
    model = keras.saving.load_model(FIXTURES / "tensorflow" / entry["file"])  # no custom_objects
    (found,) = [m for m in model.layers if isinstance(m, getattr(btf, layer))]
    config = found.get_config()
    for name, value in LAYERS[layer]["config"].items():
        assert config[name] == value, name
    assert shapes(found.get_weights()) == entry["keys"]
    return np.asarray(model(inputs(layer)))


def flax_paths(params: Any) -> dict[str, list[int]]:
    import jax

    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    return {"/".join(str(k.key) for k in path): [int(n) for n in leaf.shape]
            for path, leaf in leaves}


def load_jax(layer: str, entry: dict[str, Any] | None) -> np.ndarray:
    import flax.serialization
    import jax
    import jax.numpy as jnp

    bj = registry.load("jax")
    module = getattr(bj, layer)(**LAYERS[layer]["config"])
    x = [jnp.asarray(a) for a in inputs(layer)]
    rngs = {"params": jax.random.PRNGKey(0), "dropout": jax.random.PRNGKey(1)}
    params = jax.eval_shape(module.init, rngs, *x).get("params", {})  # shapes only: quick
    if entry is not None:
        assert flax_paths(params) == entry["keys"]  # a fresh init has the old paths and shapes
        data = (FIXTURES / "jax" / entry["file"]).read_bytes()
        params = flax.serialization.from_bytes(params, data)
        assert flax_paths(params) == entry["keys"]
    return np.asarray(module.apply({"params": params}, *x, rngs=rngs))


#: Layers whose only parameter names have no dot (``P``, ``w``): MXNet 1.9.1's
#: ``load_parameters`` then takes its legacy path, which reads ``mx.nd`` arrays and cannot assign
#: them to the ``mx.np`` parameters of ``npx.set_np()`` (a plain ``nn.Dense`` fails the same way).
#: Their files are read with ``mx.npx.load`` and set by ``set_weights`` instead.
GLUON_LEGACY_LOAD = ("LearnedPositionalEncoding", "NadarayaWatson")


def load_mxnet(layer: str, entry: dict[str, Any] | None) -> np.ndarray:
    import mxnet as mx

    bm = registry.load("mxnet")
    module = getattr(bm, layer)(**LAYERS[layer]["config"])
    if entry is None:
        module.initialize()
    elif layer in GLUON_LEGACY_LOAD:  # see test_gluon_legacy_load_path_still_fails
        stored = mx.npx.load(str(FIXTURES / "mxnet" / entry["file"]))
        assert shapes(stored) == entry["keys"]
        module.initialize()
        module.set_weights({name: value.asnumpy() for name, value in stored.items()})
    else:  # not initialized: the file does it, input sizes included
        module.load_parameters(str(FIXTURES / "mxnet" / entry["file"]))
        assert shapes(module.get_weights()) == entry["keys"]
    out = module(*[mx.np.array(a, dtype=a.dtype) for a in inputs(layer)])
    return np.asarray(out.asnumpy())


LOADERS = {"numpy": load_numpy, "torch": load_torch, "tensorflow": load_tensorflow,
           "jax": load_jax, "mxnet": load_mxnet}


def close(got: np.ndarray, want: np.ndarray) -> bool:
    """Within :data:`TOL` of the recorded output, scaled by its magnitude where that exceeds 1:
    a few float32 ulps, which a kernel of the same formula may round differently (torch's
    ``F.layer_norm`` for the core's elementwise chain gave 1.07e-6 on outputs up to ~4)."""
    return max_diff(got, want) <= TOL * max(1.0, float(np.max(np.abs(want))))


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_old_native_file_loads_with_equal_outputs(backend: str, layer: str) -> None:
    """The framework's own file (or, without weights, a fresh layer) gives the recorded output."""
    got = LOADERS[backend](layer, keys(backend).get(layer))
    assert got.dtype == np.float32
    assert close(got, recorded(backend, layer))


@pytest.mark.parametrize("layer", sorted(layer for layer in LAYERS if weights(layer)))
def test_old_safetensors_file_loads_with_equal_outputs(backend: str, layer: str) -> None:
    """The safetensors file saved by the old NumPy layer loads into a fresh layer of the tested
    backend (``load_weights``; Flax: ``init_from_weights``), giving that backend's recorded
    output and NumPy's."""
    entry = keys("numpy")[layer]
    path = FIXTURES / "numpy" / entry["file"]
    config = LAYERS[layer]["config"]
    module = registry.load(backend)
    x = inputs(layer)
    if backend == "jax":
        import jax.numpy as jnp

        fresh = getattr(module, layer)(**config)
        variables = module.init_from_weights(fresh, ac.load_weights(path))
        assert shapes(module.get_weights(variables)) == entry["keys"]
        got = np.asarray(fresh.apply(variables, *[jnp.asarray(a) for a in x]))
    else:
        fresh = getattr(module, layer)(**config)
        if backend == "torch":
            fresh.eval()
        if backend == "mxnet":
            fresh.initialize()
        ac.load_weights(path, fresh)
        assert shapes(fresh.get_weights()) == entry["keys"]
        ops = module.OPS
        got = np.asarray(ops.to_numpy(fresh(*[ops.from_numpy(a) for a in x])))
    assert close(got, recorded(backend, layer))
    assert max_diff(got, recorded("numpy", layer)) <= TOLERANCE["float32"]


@pytest.mark.parametrize("layer", GLUON_LEGACY_LOAD)
@pytest.mark.xfail(strict=True, raises=TypeError,
                   reason="MXNet 1.9.1 load_parameters: legacy path for undotted names (mx.nd)")
def test_gluon_legacy_load_path_still_fails(backend: str, layer: str) -> None:
    """Records the limitation above: when a change makes these load, this fails (XPASS), and
    :data:`GLUON_LEGACY_LOAD` should be emptied so that they load the Gluon way."""
    if backend != "mxnet":
        pytest.skip("only MXNet's load_parameters is concerned")
    import mxnet as mx

    module = getattr(registry.load("mxnet"), layer)(**LAYERS[layer]["config"])
    module.load_parameters(str(FIXTURES / "mxnet" / keys("mxnet")[layer]["file"]))
    out = module(*[mx.np.array(a, dtype=a.dtype) for a in inputs(layer)])  # TypeError here
    assert max_diff(out.asnumpy(), recorded("mxnet", layer)) <= TOL
