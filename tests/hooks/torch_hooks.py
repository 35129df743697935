"""Test glue for the PyTorch backend."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from tests.hooks import eager


def make(cls: Any, config: dict[str, Any], dtype: str) -> Any:
    return cls(**config, dtype=getattr(torch, dtype))


def forward_and_gradients(layer: Any, forward: Callable[..., dict[str, Any]], inputs: Sequence[Any],
                          cotangent: np.ndarray) -> tuple[dict[str, Any], dict[str, Any]]:
    """``forward(layer, *inputs)`` (a dict with ``"out"``) and, by torch autograd, the gradients
    of ``sum(out * cotangent)`` by input (``input.<i>``) and weight (``weight.<name>``)."""
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    module = getattr(layer, "_orig_mod", layer)  # torch.compile wraps the layer
    result = forward(layer, *leaves)
    params = dict(module.named_parameters())  # after the call: the first one creates them
    out = result["out"]
    loss = (out * torch.as_tensor(np.asarray(cotangent), dtype=out.dtype)).sum()
    wrt = [*leaves, *params.values()]
    grads = torch.autograd.grad(loss, wrt, allow_unused=True)
    names = [f"input.{i}" for i in range(len(leaves))] + [f"weight.{name}" for name in params]
    return ({k: v.detach() for k, v in result.items()},
            {name: (torch.zeros_like(x) if g is None else g)
             for name, g, x in zip(names, grads, wrt, strict=True)})


def gradients(layer: Any, inputs: list[Any], kwargs: dict[str, Any], cotangent: Any) -> dict[str, np.ndarray]:
    """Gradients of ``sum(layer(*inputs, **kwargs) * cotangent)`` by torch autograd, as NumPy."""
    _, grads = forward_and_gradients(layer, lambda m, *xs: {"out": m(*xs, **kwargs)}, inputs,
                                     cotangent)
    return {name: g.detach().cpu().double().numpy() for name, g in grads.items()}


def compiled(layer: Any, fn: Callable[..., Any], arrays: Sequence[Any]) -> Any:
    """``fn`` given ``torch.compile(layer, fullgraph=True)``: forward compiled by Inductor,
    backward through the compiled graph's autograd.

    Dynamo's caches are reset first: a layer class compiled for many shapes would otherwise hit
    the recompile limit and silently run eagerly.
    """
    torch._dynamo.reset()
    result = fn(torch.compile(layer, fullgraph=True), *arrays)
    assert counters["stats"]["unique_graphs"] >= 1, "torch.compile captured no graph"
    return result


MODES = {"eager": eager, "compile": compiled}
