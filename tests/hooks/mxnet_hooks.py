"""Test glue for the MXNet/Gluon backend.

Layers are built the Gluon way: constructed with their parameter dtype, then ``initialize()``
(input sizes deferred to the first call). Layers the tests construct directly are initialised
on their first call by :func:`backends.mxnet.call_layer`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import mxnet as mx
import numpy as np
from mxnet import autograd

import backends.mxnet as bm
from tests.hooks import eager, repr_arguments


def make(cls: Any, config: dict[str, Any], dtype: str) -> Any:
    layer = cls(**config, dtype=dtype)
    layer.initialize()
    return layer


def call(layer: Any, *args: Any, **kwargs: Any) -> Any:
    return bm.call_layer(layer, *args, **kwargs)


def forward_and_gradients(layer: Any, forward: Callable[..., dict[str, Any]], inputs: Sequence[Any],
                          cotangent: np.ndarray) -> tuple[dict[str, Any], dict[str, Any]]:
    """``forward(layer, *inputs)`` (a dict with ``"out"``) and, by ``autograd``, the gradients
    of ``sum(out * cotangent)`` by input (``input.<i>``, floating inputs only: integer token
    ids have none) and weight (``weight.<name>``). ``result`` holds what ``forward`` returned
    (e.g. a list of per-block attention weights)."""
    xs = [x.copy() if isinstance(x, mx.np.ndarray) else mx.np.array(np.asarray(x)) for x in inputs]
    floating = [i for i, x in enumerate(xs) if np.dtype(x.dtype).kind == "f"]
    for i in floating:
        xs[i].attach_grad()
    weights = layer.canonical_params()
    with autograd.record(train_mode=False):
        result = forward(layer, *xs)
        out = result["out"]
        ct = mx.np.array(np.asarray(cotangent), dtype=out.dtype)
        loss = (out * ct).sum()
    loss.backward()
    grads = {f"input.{i}": xs[i].grad for i in floating}
    grads.update({f"weight.{name}": p.grad() for name, p in weights.items()})
    return result, grads


def gradients(layer: Any, inputs: list[Any], kwargs: dict[str, Any], cotangent: Any) -> dict[str, np.ndarray]:
    """Gradients of ``sum(layer(*inputs, **kwargs) * cotangent)`` by ``autograd``."""
    def forward(m: Any, *xs: Any) -> dict[str, Any]:
        out = bm.call_layer(m, *xs, **kwargs)
        return {"out": out[0] if isinstance(out, tuple) else out}

    _, grads = forward_and_gradients(layer, forward, inputs, cotangent)
    return {name: g.asnumpy() for name, g in grads.items()}


def hybridized(layer: Any, fn: Callable[..., Any], arrays: Sequence[Any]) -> Any:
    """``fn(layer, *arrays)`` after ``layer.hybridize()``: the first call builds the graph, the
    second (whose results are returned) runs the cached graph again."""
    layer.hybridize()
    fn(layer, *arrays)
    result = fn(layer, *arrays)
    assert layer._cached_op is not None, "hybridize() built no graph"
    return result


MODES = {"eager": eager, "hybridize": hybridized}


def call_mode(layer: Any, training: bool, *args: Any, **kwargs: Any) -> Any:
    """Gluon's training mode is ``autograd.record()``; inference here is recording with
    ``train_mode=False`` (a plain call is inference too)."""
    with autograd.record(train_mode=training):
        return bm.call_layer(layer, *args, **kwargs)


def sgd_step(layer: Any, args: Sequence[Any], kwargs: dict[str, Any], target: np.ndarray,
             lr: float) -> None:
    """A ``gluon.Trainer`` step (``sgd``, batch size 1) after ``backward()`` in inference mode."""
    trainer = mx.gluon.Trainer(layer.collect_params(), "sgd", {"learning_rate": lr})
    with autograd.record(train_mode=False):
        out = bm.call_layer(layer, *args, **kwargs)
        loss = ((out - mx.np.array(target, dtype=out.dtype)) ** 2).mean()
    loss.backward()
    trainer.step(1)


def save_load_native(layer: Any, make_fresh: Callable[[], Any], args: Sequence[Any],
                     path: Path) -> tuple[Any, list[str]]:
    """``save_parameters``, then ``load_parameters`` into a fresh layer never initialised (the
    file does it)."""
    layer.save_parameters(str(path / "layer.params"))
    fresh = make_fresh()
    fresh.load_parameters(str(path / "layer.params"))
    return fresh, list(mx.npx.load(str(path / "layer.params")))


#: A Gluon layer runs imperatively as built, or hybridized (its graph built on the first call).
SETUPS = {"hybridized": lambda layer: layer.hybridize()}


# --- building (lazy sizes) ---


def first_call_compiled(layer: Any, *args: Any, **kwargs: Any) -> Any:
    """The layer's first call after ``hybridize()``: the call that builds the graph."""
    layer.hybridize()
    return bm.call_layer(layer, *args, **kwargs)


def native_shapes(layer: Any) -> dict[str, tuple[int | None, ...] | None]:
    """The Gluon parameters that train (``grad_req`` not ``"null"``: not a constant table), by
    canonical name (else Gluon's) and shape, a deferred dimension (-1) as None."""
    canonical = {id(p): name for name, p in layer.canonical_params().items()}
    return {canonical.get(id(p), key): tuple(None if d == -1 else d for d in p.shape)
            for key, p in layer.collect_params().items() if p.grad_req != "null"}


def seeded_weights(cls: Any, config: dict[str, Any], seed: int, args: Sequence[Any]) -> dict[str, Any]:
    """The initial weights after ``mx.random.seed(seed)`` and a first call."""
    mx.random.seed(seed)
    layer = cls(**config)
    layer.initialize()
    layer(*args)
    return dict(layer.get_weights())


# --- native weights, names, config ---


def native_weights(layer: Any) -> dict[tuple[str, ...], np.ndarray]:
    """``collect_params()`` without its ``Constant`` s (fixed tables, not trained), each by its
    name after the block's prefix: Gluon registers the dotted names on the block itself."""
    params = [p for p in layer.collect_params().values()
              if not isinstance(p, mx.gluon.Constant)]
    assert all(p.name.startswith(layer.prefix) for p in params)
    return {(p.name[len(layer.prefix):],): p.data().asnumpy() for p in params}


def set_native_weights(layer: Any, values: dict[tuple[str, ...], np.ndarray]) -> None:
    params = {(p.name[len(layer.prefix):],): p for p in layer.collect_params().values()}
    for path, value in values.items():
        params[path].set_data(mx.np.array(value, dtype=params[path].dtype))


def config(layer: Any) -> dict[str, Any]:
    """The arguments the repr shows, ``Name(a=1, ...)``, in order."""
    return repr_arguments(repr(layer), type(layer).__name__)


def rebuild(layer: Any) -> Any:
    return type(layer)(**config(layer))
