"""Attention over a sequence split across devices, on the frameworks' own engines, equals one
device: torch's ring and Ulysses over gloo processes on 127.0.0.1, JAX's ring inside
``shard_map`` over 4 host devices. In float64: outputs and the gradients of q, k and v for
every mask kind the workers run (``tests/distributed/ring_*.py``), and a rotary grouped-query
``MultiHeadAttention`` and a decoder-only stack made with ``context_parallel=``: their outputs
and the gradients of their inputs and weights (summed over the devices)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.harness import TOLERANCE, Harness
from tests.test_distributed import only, run_ranks, run_worker, worker_env

BOUND = TOLERANCE["float64"]
COLUMN_TESTS = True  # the layers of every column read or refuse context_parallel=


@pytest.mark.parametrize(("world", "layout", "strategy"), [
    (2, "zigzag", "ring"), (4, "contiguous", "ring"), (2, "zigzag", "ulysses")])
def test_torch_shards_equal_one_process(backend: str, world: int, layout: str,
                                        strategy: str) -> None:
    only(backend, "torch")
    for rank in run_ranks(world, "ring_torch", (layout, strategy)):
        assert max(rank.values()) <= BOUND, rank


# the contiguous layout differs only in its table of positions (tested in test_parallel.py
# and by torch's 4 ranks): JAX's compiles run once, in the zigzag layout. The two parts run in
# two processes, which the test workers share out.
@pytest.mark.parametrize("part", ["masks", "layers"])
@pytest.mark.parametrize("layout", ["zigzag"])
def test_jax_ring_equals_one_device(backend: str, layout: str, part: str) -> None:
    only(backend, "jax")
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip()
    env = worker_env(XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    result = run_worker("ring_jax", env, (layout, part))
    assert max(result.values()) <= BOUND, result


def test_keras_shards_equal_one_device(backend: str) -> None:
    """Keras on JAX inside ``shard_map`` (4 host devices), on torch over 2 gloo ranks: a
    rotary grouped-query layer in float32, its output and gradients against one device."""
    if backend not in {"keras-jax", "keras-torch"}:
        pytest.skip("runs in the keras-jax and keras-torch envs")
    if backend == "keras-jax":
        flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4"
        results = [run_worker("ring_keras", worker_env(XLA_FLAGS=flags.strip(),
                                                       JAX_PLATFORMS="cpu"))]
    else:
        results = run_ranks(2, "ring_keras")
    for result in results:
        assert len(result) == 6 and max(result.values()) <= TOLERANCE["float32"], result


#: The backends whose layers take ``context_parallel=`` (a framework's exchange between devices).
ENGINES = {"torch", "jax", "nnx", "keras-jax", "keras-torch"}
#: Those that take a process group (``True``: the default one); the others a mesh axis name.
GROUPS = {"torch", "keras-torch"}


@pytest.mark.parametrize(("name", "config"), [
    ("MultiHeadAttention", {"num_hiddens": 16, "num_heads": 4}), ("DotProductAttention", {})])
def test_context_parallel_is_refused_where_no_engine_runs_it(backend: str, name: str,
                                                             config: dict) -> None:
    """Frameworks without one refuse it by name when the layer is made; the others read it."""
    hb = Harness(backend)
    split = {**config, "context_parallel": True if backend in GROUPS else "seq"}
    if backend in ENGINES:
        if backend == "nnx":  # the tests' wrapper checks the arguments on a bare declaration
            from flax import nnx
            layer = getattr(hb.module, name)(**split, rngs=nnx.Rngs(0))
        else:
            made = hb.make(name, split)
            layer = getattr(made, "module", made)  # linen's module in the tests' wrapper
        assert type(layer.context_parallel).__name__ == "ContextParallel"
        assert layer.keep_attention_weights is False
        if backend.startswith("keras"):  # saved as plain values, read back the same
            config = layer.get_config()
            assert isinstance(config["context_parallel"], dict)
            again = type(layer).from_config(config)
            assert again.context_parallel == layer.context_parallel
            del config["context_parallel"]  # a config saved before the option: one device
            assert type(layer).from_config(config).context_parallel is None
        return
    framework = type(hb.make(name, config)).__module__.split(".")[1]
    where = "Keras' tensorflow backend" if framework == "keras" else f"the {framework} backend"
    with pytest.raises(ValueError, match=f"^context_parallel is not available on {where}: "
                                         ".*got str$"):
        hb.make(name, {**config, "context_parallel": "seq"})


def test_a_saved_config_is_read_back_or_refused_by_name(backend: str) -> None:
    """Each engine reads its own config back; another engine's, or a torch group, by name."""
    if backend not in {"torch", "jax"}:
        pytest.skip("the engines' readers: torch and jax envs")
    if backend == "torch":
        from backends.torch.parallel import ContextParallel, context_parallel
        own, other = ContextParallel(None, "ulysses", "contiguous"), {"axis_name": "seq"}
        with pytest.raises(ValueError, match="process group cannot save"):
            ContextParallel(group=object()).config()
    else:
        from backends.jax.parallel import ContextParallel, context_parallel  # type: ignore[assignment]
        own, other = ContextParallel("seq", "contiguous"), {"strategy": "ring"}
    assert context_parallel(own.config()) == own
    with pytest.raises(ValueError, match=r"^context_parallel: a config with keys .* is another "
                                         "engine's"):
        context_parallel(other)


def test_a_call_outside_its_engine_says_what_it_needs(backend: str) -> None:
    """torch with no process group, Flax outside ``shard_map``: the library's error, by name."""
    if backend not in {"torch", "jax", "keras-torch", "keras-jax"}:
        pytest.skip("torch, linen and Keras layers only")
    hb = Harness(backend)
    config = {"num_hiddens": 16, "num_heads": 4,
              "context_parallel": True if backend in GROUPS else "seq"}
    X = hb.array(np.ones((2, 8, 16), np.float32))
    need = "init_process_group" if backend in GROUPS else "inside jax.shard_map"
    with pytest.raises(ValueError, match=need):
        hb.call(hb.make("MultiHeadAttention", config), X, X, X)
    with pytest.raises(ValueError, match=need):
        hb.call(hb.make("DotProductAttention", {"context_parallel": config["context_parallel"]}),
                X, X, X)
