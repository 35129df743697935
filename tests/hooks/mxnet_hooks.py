"""Test glue for the MXNet/Gluon backend.

Layers are built the Gluon way: constructed with their parameter dtype, then ``initialize()``
(input sizes deferred to the first call). Layers the tests construct directly are initialised
on their first call by :func:`backends.mxnet.call_layer`.
"""

from __future__ import annotations

from typing import Any

import mxnet as mx
import numpy as np
from mxnet import autograd

import backends.mxnet as bm


def make(cls: Any, config: dict[str, Any], dtype: str) -> Any:
    layer = cls(**config, dtype=dtype)
    layer.initialize()
    return layer


def call(layer: Any, *args: Any, **kwargs: Any) -> Any:
    return bm.call_layer(layer, *args, **kwargs)


def gradients(layer: Any, inputs: list[Any], kwargs: dict[str, Any], cotangent: Any) -> dict[str, np.ndarray]:
    """Gradients of ``sum(layer(*inputs, **kwargs) * cotangent)`` by ``autograd``."""
    xs = [x.copy() if isinstance(x, mx.np.ndarray) else mx.np.array(np.asarray(x)) for x in inputs]
    for x in xs:
        x.attach_grad()
    weights = layer.canonical_params()
    with autograd.record(train_mode=False):
        out = bm.call_layer(layer, *xs, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        ct = mx.np.array(np.asarray(cotangent), dtype=out.dtype)
        loss = (out * ct).sum()
    loss.backward()
    result = {f"input.{i}": x.grad.asnumpy() for i, x in enumerate(xs)}
    result.update({f"weight.{name}": p.grad().asnumpy() for name, p in weights.items()})
    return result
