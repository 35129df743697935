"""Test glue for the PyTorch backend."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def make(cls: Any, config: dict[str, Any], dtype: str) -> Any:
    return cls(**config, dtype=getattr(torch, dtype))


def gradients(layer: Any, inputs: list[Any], kwargs: dict[str, Any], cotangent: Any) -> dict[str, np.ndarray]:
    """Gradients of ``sum(layer(*inputs, **kwargs) * cotangent)`` by torch autograd."""
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    names = [f"input.{i}" for i in range(len(leaves))]
    params = dict(layer.named_parameters())
    names += [f"weight.{name}" for name in params]
    out = layer(*leaves, **kwargs)
    loss = (out * torch.as_tensor(np.asarray(cotangent), dtype=out.dtype)).sum()
    grads = torch.autograd.grad(loss, [*leaves, *params.values()], allow_unused=True)
    wrt = [*leaves, *params.values()]
    return {name: (torch.zeros_like(x) if g is None else g).detach().cpu().double().numpy()
            for name, g, x in zip(names, grads, wrt, strict=True)}
