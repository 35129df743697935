"""Test glue for the PyTorch backend."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from tests.hooks import eager, repr_arguments


def make(cls: Any, config: dict[str, Any], dtype: str) -> Any:
    return cls(**config, dtype=getattr(torch, dtype))


def forward_and_gradients(layer: Any, forward: Callable[..., dict[str, Any]], inputs: Sequence[Any],
                          cotangent: np.ndarray) -> tuple[dict[str, Any], dict[str, Any]]:
    """``forward(layer, *inputs)`` (a dict with ``"out"``) and, by torch autograd, the gradients
    of ``sum(out * cotangent)`` by floating input (``input.<i>``; integer inputs such as token
    ids have none) and weight (``weight.<name>``). A result entry may be a list of tensors (the
    encoder's weights, one per block) or a nested list (a decoder's)."""
    leaves = [x.detach().clone().requires_grad_(True) if x.is_floating_point() else x
              for x in inputs]
    module = getattr(layer, "_orig_mod", layer)  # torch.compile wraps the layer
    result = forward(layer, *leaves)
    params = dict(module.named_parameters())  # after the call: the first one creates them
    out = result["out"]
    loss = (out * torch.tensor(np.asarray(cotangent), dtype=out.dtype)).sum()
    floating = {f"input.{i}": x for i, x in enumerate(leaves) if x.is_floating_point()}
    wrt = {**floating, **{f"weight.{name}": p for name, p in params.items()}}
    grads = torch.autograd.grad(loss, list(wrt.values()), allow_unused=True)
    return ({k: _detached(v) for k, v in result.items()},
            {name: (torch.zeros_like(x) if g is None else g)
             for (name, x), g in zip(wrt.items(), grads, strict=True)})


def _detached(value: Any) -> Any:
    """A tensor, or a (nested) list of tensors (None where a block kept none), out of the
    autograd graph."""
    if isinstance(value, (list, tuple)):
        return [_detached(v) for v in value]
    return None if value is None else value.detach()


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


def call_mode(layer: Any, training: bool, *args: Any, **kwargs: Any) -> Any:
    """``layer.train(training)``, then the call: torch keeps the mode on the module."""
    layer.train(training)
    return layer(*args, **kwargs)


def sgd_step(layer: Any, args: Sequence[Any], kwargs: dict[str, Any], target: np.ndarray,
             lr: float) -> None:
    layer.eval()
    optimizer = torch.optim.SGD(layer.parameters(), lr=lr)
    optimizer.zero_grad()
    out = layer(*args, **kwargs)
    ((out - torch.as_tensor(target, dtype=out.dtype)) ** 2).mean().backward()
    optimizer.step()


def save_load_native(layer: Any, make_fresh: Callable[[], Any], args: Sequence[Any],
                     path: Path) -> tuple[Any, list[str]]:
    """``torch.save`` of the ``state_dict``, loaded into a fresh (unbuilt) layer."""
    torch.save(layer.state_dict(), path / "state.pt")
    state = torch.load(path / "state.pt", weights_only=True)
    fresh = make_fresh()
    fresh.load_state_dict(state)
    return fresh, list(state)


# --- building (lazy sizes) ---


def native_shapes(layer: Any) -> dict[str, tuple[int | None, ...] | None]:
    """The ``state_dict`` by key and shape; a placeholder (``UninitializedParameter``) is None."""
    from torch.nn.parameter import UninitializedParameter

    return {name: None if isinstance(p, UninitializedParameter) else tuple(p.shape)
            for name, p in layer.state_dict().items()}


def seeded_weights(cls: Any, config: dict[str, Any], seed: int, args: Sequence[Any]) -> dict[str, Any]:
    """The initial weights after ``torch.manual_seed(seed)`` and a first call."""
    torch.manual_seed(seed)
    layer = cls(**config)
    layer(*args)
    return dict(layer.get_weights())


def weights_from_sizes(cls: Any, config: dict[str, Any], seed: int,
                       sizes: dict[str, int]) -> dict[str, Any]:
    """The weights of a layer given its input sizes (``q_in=`` ...), before any call."""
    torch.manual_seed(seed)
    return dict(cls(**config, **sizes).get_weights())


# --- native weights, names, config ---


def native_weights(layer: Any) -> dict[tuple[str, ...], np.ndarray]:
    """The ``state_dict``, each key split into its path of submodules; ``named_parameters``
    must list the same names in the same order (the buffers it leaves out are not persistent)."""
    state = layer.state_dict()
    assert [name for name, _ in layer.named_parameters()] == list(state)
    return {tuple(name.split(".")): value.detach().cpu().numpy() for name, value in state.items()}


def set_native_weights(layer: Any, values: dict[tuple[str, ...], np.ndarray]) -> None:
    layer.load_state_dict({".".join(path): torch.from_numpy(v) for path, v in values.items()})


def config(layer: Any) -> dict[str, Any]:
    """The arguments ``extra_repr`` shows, in order."""
    name = type(layer).__name__
    return repr_arguments(f"{name}({layer.extra_repr()})", name)


def rebuild(layer: Any) -> Any:
    return type(layer)(**config(layer))


# --- fused kernels ---


def count_fused_calls(monkeypatch: Any) -> Callable[[], int]:
    """Counts the calls of ``F.scaled_dot_product_attention`` (SDPA, the fused path's kernel)
    from now on, by way of ``monkeypatch``; returns a function giving the count so far."""
    calls = [0]
    real = torch.nn.functional.scaled_dot_product_attention

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
    return lambda: calls[0]


def fused_kernel_takes(depth: int, value_depth: int, dtype: str) -> bool:
    """Whether the kernel takes a fused call of these per-head depths and dtype: SDPA takes all."""
    return True


# --- mixed precision ---


def mixed_precision(dtype: str) -> Any:
    """``torch.autocast`` on the CPU in ``dtype``: float32 parameters, computations in ``dtype``."""
    return torch.autocast("cpu", dtype=getattr(torch, dtype))


def graph_captured(fn: Any) -> Any:
    """``torch.compile(fn, fullgraph=True, backend="eager")`` (a layer or a function): Dynamo's
    whole-graph capture without Inductor, its caches reset first."""
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend="eager")


def adam_steps(make_layer: Callable[[], Any], args: Sequence[Any], target: np.ndarray, steps: int,
               mixed: str | None) -> tuple[list[float], dict[str, Any], bool]:
    """``steps`` Adam steps (lr 0.01) of ``make_layer()``, made after ``torch.manual_seed(0)``,
    on ``mean((layer(*args) - target) ** 2)``, the forward under autocast in ``mixed`` unless
    None. Returns the losses, the first step's gradients by weight, and whether every weight
    moved at every step."""
    torch.manual_seed(0)
    layer = make_layer()
    optimizer = torch.optim.Adam(layer.parameters(), lr=1e-2)
    losses, first, moved = [], {}, True
    for step in range(steps):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=getattr(torch, mixed or "bfloat16"), enabled=bool(mixed)):
            loss = ((layer(*args) - torch.as_tensor(target)) ** 2).mean()
        loss.backward()
        if step == 0:
            first = {n: p.grad.clone() for n, p in layer.named_parameters()}
        before = {n: p.detach().clone() for n, p in layer.named_parameters()}
        optimizer.step()
        moved = moved and all(not torch.equal(p, before[n]) for n, p in layer.named_parameters())
        losses.append(loss.item())
    return losses, first, moved


def compiled_step(fn: Callable[..., Any], compiler: str = "inductor"
                  ) -> tuple[Callable[..., Any], Callable[[], int]]:
    """A decoding step as one graph, ``torch.compile(fn, fullgraph=True)`` (Dynamo's caches
    reset first), and the number of graphs Dynamo has compiled since (a counter in ``fn``
    would itself be guarded on, and force a recompilation per call). ``compiler``: the
    ``backend`` of ``torch.compile`` (``"aot_eager"``: Dynamo's graph run by torch's own
    operators, without Inductor's code generation, for a test of the graph alone)."""
    torch._dynamo.reset()
    counters.clear()
    return (torch.compile(fn, fullgraph=True, backend=compiler),
            lambda: int(counters["stats"]["unique_graphs"]))
