"""Scale-out on the frameworks' own engines: the layers give the same numbers distributed.

Each test runs worker scripts from ``tests/distributed/`` in fresh interpreters, so that what
must be set before a framework starts (process ranks, host device counts, logical devices)
takes effect, and compares in float64 against the same computation in one process on one
device, within the float64 tolerance of ``tests/harness.py`` (times the gradients' size):

* torch: ``DistributedDataParallel``, gloo, 2 processes on 127.0.0.1, one SGD step of a
  ``TransformerEncoderBlock``, each rank on half the batch: outputs, gradients and updated
  weights equal those of one process on the whole batch;
* JAX: 4 host devices, a ``jax.sharding.Mesh``, a batch-sharded ``MultiHeadAttention`` under
  ``jax.jit`` (params replicated): forward and gradient equal the unsharded ones, the output
  stays sharded along the batch and the forward program has no cross-device communication;
* TensorFlow: ``MirroredStrategy`` over 2 logical CPU devices, ``MultiHeadAttention`` built in
  its scope, ``strategy.run`` on per-replica halves: the gathered outputs and the reduced
  gradients equal the single-device ones.

Each runs in the env of its framework; NumPy and MXNet have none of these engines.
What each measured goes to the report (``"scale_out"`` in ``<backend>.json``).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from typing import Any

import pytest

from tests.distributed.common import parse, to_report
from tests.harness import TOLERANCE

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 300  # seconds per worker; each takes a few

BOUND = TOLERANCE["float64"]


def only(backend: str, wanted: str) -> None:
    if backend != wanted:
        pytest.skip(f"runs in the {wanted} env")


def worker_env(**extra: str) -> dict[str, str]:
    """This process's environment for a worker, without the backend choice and without the
    state torch.compile leaves in it (``TORCHINDUCTOR_*``): a worker starts from a clean one."""
    env = {k: v for k, v in os.environ.items() if k != "ATTENTION_CORE_BACKEND"
           and not k.lstrip("_").startswith("TORCHINDUCTOR")}
    env.update(extra)
    return env


def run_worker(script: str, env: dict[str, str], args: tuple[str, ...] = ()) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", f"tests.distributed.{script}", *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, f"{script} failed:\n{done.stdout}\n{done.stderr[-4000:]}"
    return parse(done.stdout)


def gradient_bound(result: dict[str, Any]) -> float:
    return BOUND * max(1.0, result["gradient_scale"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def run_ranks(world: int, script: str = "ddp_torch",
              args: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Runs ``script`` as ``world`` processes (``env://`` rendezvous on a free local port)."""
    for _attempt in range(3):  # the port may be taken between choosing it and binding it
        env = worker_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                         WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
        if os.path.exists("/sys/class/net/lo"):
            env["GLOO_SOCKET_IFNAME"] = "lo"  # talk over loopback, whatever the host name is
        # each rank writes to files, never to a pipe that is not being read while the test
        # waits for another rank (a full pipe would stop that rank, and the group with it)
        with tempfile.TemporaryDirectory() as tmp:
            logs = [(open(os.path.join(tmp, f"{r}.out"), "w+"),  # noqa: SIM115
                     open(os.path.join(tmp, f"{r}.err"), "w+")) for r in range(world)]  # noqa: SIM115
            ranks = [subprocess.Popen([sys.executable, "-m", f"tests.distributed.{script}",
                                       *args],
                                      cwd=REPO, env={**env, "RANK": str(r)}, stdout=out,
                                      stderr=err, text=True)
                     for r, (out, err) in enumerate(logs)]
            try:
                for p in ranks:
                    p.wait(timeout=TIMEOUT)
            finally:
                for p in ranks:
                    if p.poll() is None:
                        p.kill()
                        p.wait()
                outputs = []
                for out, err in logs:
                    out.seek(0)
                    err.seek(0)
                    outputs.append((out.read(), err.read()))
                    out.close()
                    err.close()
        if any("address already in use" in err.lower() for _, err in outputs):
            continue
        for p, (out, err) in zip(ranks, outputs, strict=True):
            assert p.returncode == 0, f"a rank failed:\n{out}\n{err[-4000:]}"
        return [parse(out) for out, _ in outputs]
    pytest.fail("no free port for the rendezvous in 3 attempts")


def test_torch_ddp_step_equals_one_process(backend: str) -> None:
    only(backend, "torch")
    ranks = run_ranks(2)
    assert [r["rank"] for r in ranks] == [0, 1]
    assert [r["share"] for r in ranks] == [[0, 4], [4, 8]]  # half of the 8 examples each
    for r in ranks:
        assert len(r["parameters"]) == 16  # every weight of the block (with biases)
        assert r["forward"] <= BOUND, r
        assert r["gradient"] <= gradient_bound(r), r
        assert r["updated_weights"] <= BOUND, r
        # the rank's own half alone gives other gradients: DDP's averaging is what matches
        assert r["local_gradient"] > 1e-3, r
    to_report(backend, "scale_out", {
        "engine": "torch.nn.parallel.DistributedDataParallel, gloo, 2 processes on 127.0.0.1",
        "layer": "TransformerEncoderBlock", "dtype": "float64", "check": "one SGD step",
        "forward": max(r["forward"] for r in ranks),
        "gradient": max(r["gradient"] for r in ranks),
        "updated_weights": max(r["updated_weights"] for r in ranks),
        "tolerance": BOUND, "gradient_scale": ranks[0]["gradient_scale"],
    })


def test_jax_batch_sharded_equals_unsharded(backend: str) -> None:
    only(backend, "jax")
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip()
    result = run_worker("sharded_jax", worker_env(XLA_FLAGS=flags, JAX_PLATFORMS="cpu"))
    assert len(result["devices"]) == 4
    assert result["dtype"] == "float64"
    assert result["forward"] <= BOUND, result
    assert result["gradient"] <= gradient_bound(result), result
    assert len(result["parameters"]) == 8  # W_q, W_k, W_v, W_o: kernel and bias
    assert result["input_sharded"] and result["output_sharded"]
    # the output is split along the batch, 2 of the 8 examples on each device
    assert [(d, shape, start) for d, shape, start in result["output_shards"]] == [
        (f"cpu:{i}", [2, 5, 16], 2 * i) for i in range(4)]
    assert result["gradients_replicated"] and result["gradient_devices"] == 4
    assert result["reference_devices"] == 1
    # each device attends within its own examples; only the gradient is summed across devices
    assert sum(result["forward_collectives"].values()) == 0, result["forward_collectives"]
    assert result["gradient_collectives"]["all-reduce"] >= 1, result["gradient_collectives"]
    to_report(backend, "scale_out", {
        "engine": "jax.sharding.Mesh over 4 host devices (--xla_force_host_platform_device_count=4), "
                  "jax.jit",
        "layer": "MultiHeadAttention", "dtype": "float64", "check": "forward and gradient",
        "forward": result["forward"], "gradient": result["gradient"],
        "tolerance": BOUND, "gradient_scale": result["gradient_scale"],
    })


def test_tensorflow_mirrored_equals_one_device(backend: str) -> None:
    only(backend, "tensorflow")
    env = worker_env(KERAS_BACKEND="tensorflow",
                     TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"))
    result = run_worker("mirrored_tf", env)
    assert result["replicas"] == 2
    devices = result["devices"]
    assert [d.rsplit(":", 2)[-2:] for d in devices] == [["CPU", "0"], ["CPU", "1"]]
    assert result["replica_devices"] == devices  # each replica's ops on its own device
    assert result["replica_rows"] == [4, 4]
    assert result["variable_types"] == ["MirroredVariable"] and result["variable_copies"] == [2]
    assert result["dtype"] == "float64"
    assert result["forward"] <= BOUND, result
    assert result["gradient"] <= gradient_bound(result), result
    assert len(result["parameters"]) == 8
    assert result["local_gradient"] > 1e-3, result  # one replica's share alone is not the gradient
    to_report(backend, "scale_out", {
        "engine": "tf.distribute.MirroredStrategy over 2 logical CPU devices",
        "layer": "MultiHeadAttention", "dtype": "float64", "check": "forward and gradient",
        "forward": result["forward"], "gradient": result["gradient"],
        "tolerance": BOUND, "gradient_scale": result["gradient_scale"],
    })
