"""Test glue for ``backends.keras`` under ``KERAS_BACKEND=torch``: Keras' shared hooks
(tests/hooks/keras_hooks.py), torch autograd over the Keras variables (torch parameters), and
``torch.compile`` of the layer."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
import torch
import torch._dynamo

from tests.hooks import eager
from tests.hooks.keras_hooks import call_mode as call_mode
from tests.hooks.keras_hooks import config as config
from tests.hooks.keras_hooks import first_call_compiled as first_call_compiled
from tests.hooks.keras_hooks import make as make
from tests.hooks.keras_hooks import native_shapes as native_shapes
from tests.hooks.keras_hooks import native_weights as native_weights
from tests.hooks.keras_hooks import rebuild as rebuild
from tests.hooks.keras_hooks import save_load_native as save_load_native
from tests.hooks.keras_hooks import seeded_weights as seeded_weights
from tests.hooks.keras_hooks import set_native_weights as set_native_weights


def forward_and_gradients(layer: Any, forward: Callable[..., dict[str, Any]], inputs: Sequence[Any],
                          cotangent: np.ndarray) -> tuple[dict[str, Any], dict[str, Any]]:
    """``forward(layer, *inputs)`` (a dict with ``"out"``) and, by torch autograd, the gradients
    of ``sum(out * cotangent)`` by floating input (``input.<i>``) and weight
    (``weight.<name>``, the Keras variables' torch parameters)."""
    leaves = [x.detach().clone().requires_grad_(True) if x.is_floating_point() else x
              for x in map(torch.as_tensor, inputs)]
    module = getattr(layer, "_orig_mod", layer)  # torch.compile wraps the layer
    result = forward(layer, *leaves)
    out = result["out"]
    loss = (out * torch.tensor(np.asarray(cotangent), dtype=out.dtype)).sum()
    floating = {f"input.{i}": x for i, x in enumerate(leaves) if x.is_floating_point()}
    weights = {f"weight.{name}": v.value for name, v in module.canonical_variables.items()}
    wrt = {**floating, **weights}
    grads = torch.autograd.grad(loss, list(wrt.values()), allow_unused=True)
    return ({k: _detached(v) for k, v in result.items()},
            {name: (torch.zeros_like(x) if g is None else g)
             for (name, x), g in zip(wrt.items(), grads, strict=True)})


def _detached(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_detached(v) for v in value]
    return None if value is None else value.detach()


def gradients(layer: Any, inputs: list[Any], kwargs: dict[str, Any], cotangent: Any) -> dict[str, np.ndarray]:
    """Gradients of ``sum(layer(*inputs, **kwargs) * cotangent)`` by torch autograd, as NumPy."""
    def forward(m: Any, *xs: Any) -> dict[str, Any]:
        out = m(*xs, **kwargs)
        return {"out": out[0] if isinstance(out, tuple) else out}

    _, grads = forward_and_gradients(layer, forward, inputs, cotangent)
    return {name: g.detach().cpu().double().numpy() for name, g in grads.items()}


def compiled(layer: Any, fn: Callable[..., Any], arrays: Sequence[Any]) -> Any:
    """``fn`` given ``torch.compile(layer)`` (Keras' ``jit_compile=True`` on torch): forward
    compiled by Inductor, backward through the compiled graph's autograd. Dynamo's caches are
    reset first (the recompile limit would otherwise run a much-compiled class eagerly)."""
    torch._dynamo.reset()
    return fn(torch.compile(layer), *arrays)


MODES = {"eager": eager, "compile": compiled}


def sgd_step(layer: Any, args: Sequence[Any], kwargs: dict[str, Any], target: np.ndarray,
             lr: float) -> None:
    """One step of Keras' SGD on torch autograd's gradients of the trainable variables."""
    out = layer(*args, **kwargs)
    loss = ((out - torch.as_tensor(target, dtype=out.dtype)) ** 2).mean()
    trainable = list(layer.trainable_variables)
    grads = torch.autograd.grad(loss, [v.value for v in trainable])
    keras.optimizers.SGD(lr).apply_gradients(zip(grads, trainable, strict=True))
