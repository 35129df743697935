"""Test glue for the Flax NNX modules (``backends.jax.nnx``): the ``nnx`` column.

NNX modules are made eagerly, with their input widths (``q_in`` ...) and an ``nnx.Rngs``. The
shared tests make a layer from its declared arguments alone, then set its weights or call it:
:class:`NnxLayer` holds the class and arguments and makes the module when the widths are first
known (from the weights given to ``set_weights``, or from the inputs of the first call), with
``nnx.Rngs(params=0, dropout=1)``. A layer whose weights need no input width is made at once.
Every check and error message comes from the library; the handle keeps the module only when
it was made without error.

Calls run under ``nnx.capture(module, nnx.Intermediate)``, so the layers sow their attention
weights (formed in the call, as the linen layers sow them); the handle keeps the last call's.
Gradients by ``nnx.value_and_grad`` (``nnx.Param`` and the floating inputs), the compiled mode
is ``nnx.jit``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from backends.jax import nnx as bn
from tests.hooks import eager
from tests.hooks.jax_hooks import compiled_function as compiled_function
from tests.hooks.jax_hooks import count_fused_calls as count_fused_calls
from tests.hooks.jax_hooks import dropout_program as dropout_program
from tests.hooks.jax_hooks import fused_kernel_takes as fused_kernel_takes
from tests.hooks.jax_hooks import loop_program as loop_program

#: The layers sow their attention weights in the call (tests/test_fused.py, test_adapters.py).
SOWS_WEIGHTS = True

#: NNX keywords of a call, not the declared call's.
_NNX_CALL = ("deterministic", "training", "rngs")


def _rngs() -> nnx.Rngs:
    return nnx.Rngs(params=0, dropout=1)


def widths(cls: type[bn.Layer], args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, int]:
    """The input widths (``q_in`` ...) of a call's inputs, for the layer's declared sizes."""
    given = {k: v for k, v in kwargs.items() if k not in _NNX_CALL}
    bound = cls.call_signature().bind_partial(*args, **given).arguments
    return {dim: int(np.shape(bound[size.argument])[-1]) for dim, size in cls.sizes.items()
            if size.argument in bound}


class NnxLayer:
    """An NNX module made once its input widths are known, and its last sown attention weights.

    Args:
        cls: A layer class of ``backends.jax.nnx``.
        config: Its declared arguments.
        dtype: Its ``param_dtype``.
    """

    def __init__(self, cls: type[bn.Layer], config: Mapping[str, Any], dtype: str = "float32",
                 module: bn.Layer | None = None) -> None:
        self.cls, self.config, self.dtype = cls, dict(config), dtype
        self.module = module
        self.attention_weights: Any = None
        if module is None:  # the arguments' errors now, as every backend's constructor
            cls.declared()(**self.config).check()
        if module is None and not cls.sizes:
            self.module = self.build({})

    def build(self, dims: Mapping[str, int]) -> bn.Layer:
        return self.cls(**self.config, **dims, param_dtype=self.dtype, rngs=_rngs())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        if module is None:
            module = self.build(widths(self.cls, args, kwargs))
        out, sown = nnx.capture(module, nnx.Intermediate)(*args, **kwargs)
        self.module = module  # only reached when the call succeeded
        found = sown.get("attention_weights")
        if found is not None:
            self.attention_weights = last_call(module, found.get_value())
        return out

    def get_weights(self) -> dict[str, np.ndarray]:
        if self.module is None:
            raise ValueError(f"{self.cls.__name__}: weights are created on the first call; "
                             "call the layer or set_weights first")
        return self.module.get_weights()

    def set_weights(self, weights: Mapping[str, Any]) -> None:
        module = self.module
        if module is None:
            module = self.build(self.cls.declared()(**self.config).dims_from_weights(weights))
        module.set_weights(weights)
        self.module = module

    @property
    def P(self) -> jax.Array:
        assert self.module is not None
        P: jax.Array = getattr(self.module, "P")  # noqa: B009 - only some layers have it
        return P


def last_call(module: bn.Layer, sown: tuple[Any, ...]) -> Any:
    """What one call sowed: the last entry, or the encoder's last ``num_blks`` (one per block)."""
    if isinstance(module, bn.TransformerEncoder):
        return list(sown[-module.num_blks:])
    return sown[-1]


def make(cls: Any, config: dict[str, Any], dtype: str) -> NnxLayer:
    return NnxLayer(cls, config, dtype)


#: Handles of modules the tests construct directly, keyed by id (each keeps its module alive).
_HANDLES: dict[int, NnxLayer] = {}


def handle(layer: NnxLayer | bn.Layer) -> NnxLayer:
    """The handle of a layer: itself, or one kept for a module made directly."""
    if isinstance(layer, NnxLayer):
        return layer
    if id(layer) not in _HANDLES:
        _HANDLES[id(layer)] = NnxLayer(type(layer), layer.arguments(), module=layer)
    return _HANDLES[id(layer)]


def call(layer: NnxLayer | bn.Layer, *args: Any, **kwargs: Any) -> Any:
    return handle(layer)(*args, **kwargs)


def attention_weights(layer: NnxLayer | bn.Layer) -> Any:
    return handle(layer).attention_weights


def _swapped(wrapper: NnxLayer, module: bn.Layer, fn: Callable[[], Any]) -> Any:
    """``fn()`` with the handle holding ``module`` (a transform's copy), then the original."""
    original = wrapper.module
    wrapper.module = module
    try:
        return fn()
    finally:
        wrapper.module = original


def forward_and_gradients(layer: NnxLayer | bn.Layer, forward: Callable[..., dict[str, Any]],
                          inputs: Sequence[Any], cotangent: Any
                          ) -> tuple[dict[str, Any], dict[str, Any]]:
    """``forward(layer, *inputs)`` and, by ``nnx.value_and_grad`` (``nnx.Param`` and the floating
    inputs), the gradients of ``sum(out * cotangent)``: ``input.<i>``, ``weight.<name>``."""
    wrapper = handle(layer)
    xs = [jnp.asarray(x) for x in inputs]
    if wrapper.module is None:
        forward(wrapper, *xs)
    assert wrapper.module is not None
    ct = jnp.asarray(np.asarray(cotangent))
    floating = [i for i, x in enumerate(xs) if jnp.issubdtype(x.dtype, jnp.inexact)]

    def loss(module: bn.Layer, moving: list[Any]) -> tuple[jax.Array, dict[str, Any]]:
        args = list(xs)
        for i, x in zip(floating, moving, strict=True):
            args[i] = x
        result = _swapped(wrapper, module, lambda: forward(wrapper, *args))
        out = result["out"]
        return jnp.sum(out * ct.astype(out.dtype)), result

    (_, result), (d_params, d_inputs) = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
        wrapper.module, [xs[i] for i in floating])
    wrapper.attention_weights = result.get("attention_attr")  # not the tracer the trace saw
    grads = {f"input.{i}": g for i, g in zip(floating, d_inputs, strict=True)}
    grads.update({f"weight.{'.'.join(map(str, path))}": g
                  for path, g in nnx.to_flat_state(nnx.state(d_params, nnx.Param))})
    grads = {name: g.get_value() if isinstance(g, nnx.Variable) else g
             for name, g in grads.items()}
    return result, grads


def gradients(layer: NnxLayer | bn.Layer, inputs: list[Any], kwargs: dict[str, Any],
              cotangent: Any) -> dict[str, np.ndarray]:
    """Gradients of ``sum(output * cotangent)`` (see :func:`forward_and_gradients`)."""

    def forward(m: NnxLayer, *xs: Any) -> dict[str, Any]:
        out = m(*xs, **kwargs)
        return {"out": out[0] if isinstance(out, tuple) else out}

    _, grads = forward_and_gradients(layer, forward, inputs, cotangent)
    return {name: np.asarray(g) for name, g in grads.items()}


def jit(layer: NnxLayer | bn.Layer, fn: Callable[..., Any], arrays: Sequence[Any]) -> Any:
    """``fn(layer, *arrays)`` under ``nnx.jit``, the module and the arrays traced."""
    wrapper = handle(layer)
    assert wrapper.module is not None, "call the layer once (or set its weights) first"

    @nnx.jit
    def traced(module: bn.Layer, *arrays: Any) -> Any:
        return _swapped(wrapper, module, lambda: fn(wrapper, *arrays))

    try:
        return traced(wrapper.module, *arrays)
    finally:  # nothing traced may stay in the handle
        wrapper.attention_weights = None


MODES = {"eager": eager, "jit": jit}


def call_mode(layer: NnxLayer | bn.Layer, training: bool, *args: Any, **kwargs: Any) -> Any:
    """``model.train()`` or ``model.eval()``, then the call: NNX's modes are attributes."""
    wrapper = handle(layer)
    if wrapper.module is None:
        wrapper.module = wrapper.build(widths(wrapper.cls, args, kwargs))
    if training:
        wrapper.module.train()
    else:
        wrapper.module.eval()
    return wrapper(*args, **kwargs)


def sgd_step(layer: NnxLayer | bn.Layer, args: Sequence[Any], kwargs: dict[str, Any],
             target: np.ndarray, lr: float) -> None:
    """``p - lr * nnx.grad(loss)`` for every ``nnx.Param``, in one ``nnx.jit`` program."""
    wrapper = handle(layer)
    if wrapper.module is None:
        wrapper(*args, **kwargs)
    assert wrapper.module is not None

    @nnx.jit
    def step(module: bn.Layer) -> None:
        def loss(m: bn.Layer) -> jax.Array:
            out = m(*args, **kwargs)
            return jnp.mean((out - jnp.asarray(target, out.dtype)) ** 2)

        grads = nnx.grad(loss)(module)
        params = nnx.state(module, nnx.Param)
        nnx.update(module, jax.tree.map(lambda p, g: p - lr * g, params, grads))

    step(wrapper.module)


def save_load_native(layer: NnxLayer | bn.Layer, make_fresh: Callable[[], Any], args: Sequence[Any],
                     path: Path) -> tuple[Any, list[str]]:
    """``nnx.state`` as Flax msgpack (a pure dict), read into an abstract module of the same
    class, arguments and widths (``nnx.eval_shape``; ``make_fresh`` would draw weights
    without ``rngs``, which NNX modules need) and merged back."""
    wrapper = handle(layer)
    module = wrapper.module
    assert module is not None
    state = nnx.to_pure_dict(nnx.state(module, nnx.Param))
    (path / "state.msgpack").write_bytes(flax.serialization.msgpack_serialize(state))
    abstract = nnx.eval_shape(lambda: wrapper.build(module.dims))
    graphdef, fresh_state = nnx.split(abstract)
    read = flax.serialization.msgpack_restore((path / "state.msgpack").read_bytes())
    params = nnx.state(abstract, nnx.Param)
    nnx.replace_by_pure_dict(params, read)
    fresh_state = nnx.merge_state(fresh_state, params)
    fresh = nnx.merge(graphdef, fresh_state)
    if isinstance(fresh, bn.Layer) and getattr(fresh, "rngs", None) is not None:
        fresh.rngs = module.rngs  # the abstract stream has no key to draw from
    names = [".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(fresh, nnx.Param))]
    return NnxLayer(wrapper.cls, wrapper.config, wrapper.dtype, module=fresh), names


# --- building ---


def seeded_weights(cls: Any, config: dict[str, Any], seed: int, args: Sequence[Any]) -> dict[str, Any]:
    """The initial weights of ``nnx.Rngs(seed)``, the widths those of ``args``."""
    return cls(**config, **widths(cls, args, {}), rngs=nnx.Rngs(seed)).get_weights()  # type: ignore[no-any-return]


def weights_from_sizes(cls: Any, config: dict[str, Any], seed: int,
                       sizes: dict[str, int]) -> dict[str, Any]:
    """The weights made from the given input widths, before any call."""
    return cls(**config, **sizes, rngs=nnx.Rngs(seed)).get_weights()  # type: ignore[no-any-return]


# --- native weights, names, config ---


def native_weights(layer: NnxLayer | bn.Layer) -> dict[tuple[str, ...], np.ndarray]:
    """``nnx.state(module, nnx.Param)``, each leaf by its path."""
    module = handle(layer).module
    assert module is not None, "call the layer once (or set its weights) first"
    return {tuple(map(str, p)): np.asarray(v.get_value())
            for p, v in nnx.to_flat_state(nnx.state(module, nnx.Param))}


def set_native_weights(layer: NnxLayer | bn.Layer, values: dict[tuple[str, ...], np.ndarray]) -> None:
    """``nnx.update`` with a state of those paths."""
    module = handle(layer).module
    assert module is not None
    params = nnx.state(module, nnx.Param)
    flat = {path: v for path, v in nnx.to_flat_state(params)}
    assert set(flat) == set(values)
    for path, value in values.items():
        flat[path].set_value(jnp.asarray(value))
    nnx.update(module, params)


def config(layer: NnxLayer | bn.Layer) -> dict[str, Any]:
    """The declared arguments of the module."""
    wrapper = handle(layer)
    module = wrapper.module
    return module.arguments() if module is not None else dict(wrapper.config)


def rebuild(layer: NnxLayer | bn.Layer) -> NnxLayer:
    wrapper = handle(layer)
    return NnxLayer(wrapper.cls, config(layer), wrapper.dtype)

