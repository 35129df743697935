"""Attention over a sequence split across devices, on the frameworks' own engines, equals one
device: torch's ring and Ulysses over gloo processes on 127.0.0.1, JAX's ring inside
``shard_map`` over 4 host devices. Outputs and the gradients of q, k and v, float64 inputs,
every mask kind the workers run (``tests/distributed/ring_*.py``)."""

from __future__ import annotations

import os

import pytest

from tests.test_distributed import only, run_ranks, run_worker, worker_env

BOUND = 1e-5


@pytest.mark.parametrize(("world", "layout", "strategy"), [
    (2, "zigzag", "ring"), (4, "contiguous", "ring"), (2, "zigzag", "ulysses")])
def test_torch_shards_equal_one_process(backend: str, world: int, layout: str,
                                        strategy: str) -> None:
    only(backend, "torch")
    for rank in run_ranks(world, "ring_torch", (layout, strategy)):
        assert max(rank.values()) <= BOUND, rank


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_jax_ring_equals_one_device(backend: str, layout: str) -> None:
    only(backend, "jax")
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip()
    env = worker_env(XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    result = run_worker("ring_jax", env, (layout,))
    assert max(result.values()) <= BOUND, result
