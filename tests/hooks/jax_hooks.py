"""Test glue for the JAX backend: a stateful handle on a functional Flax module.

The cross-backend tests use layers statefully (call, then ``get_weights()``,
``attention_weights``, ...). :class:`FlaxLayer` holds a module and its variables: the first
call initialises them (``PRNGKey(0)``), later calls apply them. Every check and error message
comes from the library (``backends.jax``); the handle only keeps state, and keeps it only when
a call succeeds.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np

import backends.jax as bj
from attention_core.weights import flatten_tree as flatten
from backends.jax.layers import Layer
from tests.hooks import eager

RNGS = {"params": 0, "dropout": 1}
#: Flax sows the attention weights in the call (arrays, formed by the direct path), where the
#: other backends keep them to be formed on read (tests/test_fused.py).
SOWS_WEIGHTS = True


def _rngs() -> dict[str, jax.Array]:
    return {name: jax.random.PRNGKey(seed) for name, seed in RNGS.items()}


def last_call(module: Layer, sown: tuple[Any, ...]) -> Any:
    """What one call sowed as ``attention_weights``: the last array, or for
    :class:`~backends.jax.TransformerEncoder` (one sow per block) the list of the last
    ``num_blks``, as the other backends keep them."""
    if isinstance(module, bj.TransformerEncoder):
        return list(sown[-module.num_blks:])
    return sown[-1]


class FlaxLayer:
    """A Flax module with its variables and the last call's sown attention weights.

    Args:
        module: An unbound ``flax.linen`` layer of ``backends.jax``.
    """

    def __init__(self, module: Layer) -> None:
        self.module = module
        self.variables: dict[str, Any] | None = None
        self.attention_weights: jax.Array | list[jax.Array] | None = None

    def __call__(self, *args: Any, rngs: dict[str, jax.Array] | None = None, **kwargs: Any) -> Any:
        rngs = _rngs() if rngs is None else rngs
        if self.variables is None:
            out, state = self.module.init_with_output(rngs, *args, mutable=True, **kwargs)
            variables = {"params": state.get("params", {})}
        else:
            variables = self.variables
            out, state = self.module.apply(variables, *args, rngs=rngs,
                                           mutable=["intermediates"], **kwargs)
        self.variables = variables  # only reached when the call succeeded
        sown = state.get("intermediates", {}).get("attention_weights")
        if sown is not None:
            self.attention_weights = last_call(self.module, sown)
        return out

    def get_weights(self) -> dict[str, np.ndarray]:
        return bj.get_weights(self.variables, layer=self.module)

    def set_weights(self, weights: Mapping[str, Any]) -> None:
        self.variables = bj.set_weights(self.variables, weights, layer=self.module)

    @property
    def P(self) -> jax.Array:
        P: jax.Array = getattr(self.module, "P")  # noqa: B009 - only PositionalEncoding has it
        return P


def make(cls: Any, config: dict[str, Any], dtype: str) -> FlaxLayer:
    """Builds a handle; weights whose shapes the constructor fixes exist at once, as on numpy."""
    layer = FlaxLayer(cls(**config, param_dtype=dtype))
    if all(None not in shape for shape in layer.module.spec().values()):
        layer.variables = bj.init_weights(layer.module, seed=0)
    return layer


#: Handles of modules the tests construct directly (``h.module.MultiHeadAttention(...)``),
#: keyed by id; each entry keeps its module alive so the id is not reused.
_HANDLES: dict[int, tuple[Layer, FlaxLayer]] = {}


def handle(layer: FlaxLayer | Layer) -> FlaxLayer:
    """The stateful handle of a layer: itself, or one kept for a bare Flax module."""
    if isinstance(layer, FlaxLayer):
        return layer
    return _HANDLES.setdefault(id(layer), (layer, FlaxLayer(layer)))[1]


def call(layer: FlaxLayer | Layer, *args: Any, **kwargs: Any) -> Any:
    return handle(layer)(*args, **kwargs)


def attention_weights(layer: FlaxLayer | Layer) -> Any:
    """What the layer's last call sowed into ``'intermediates'``."""
    return handle(layer).attention_weights


def forward_and_gradients(layer: FlaxLayer | Layer, forward: Callable[..., dict[str, Any]],
                          inputs: Sequence[Any], cotangent: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """``forward(layer, *inputs)`` (a dict with ``"out"``) and, by ``jax.value_and_grad``, the
    gradients of ``sum(out * cotangent)`` by input (``input.<i>``) and param
    (``weight.<canonical name>``). Works eagerly and under ``jax.jit``. Integer inputs (token
    ids) have no gradient: they are held fixed and get no ``input.<i>`` entry."""
    wrapper = handle(layer)
    variables = wrapper.variables
    assert variables is not None, "call the layer once (or set its weights) first"
    ct = jnp.asarray(np.asarray(cotangent))
    xs = [jnp.asarray(x) for x in inputs]
    floating = [i for i, x in enumerate(xs) if jnp.issubdtype(x.dtype, jnp.inexact)]

    def loss(params: Any, moving: list[Any]) -> tuple[jax.Array, dict[str, Any]]:
        args = list(xs)
        for i, x in zip(floating, moving, strict=True):
            args[i] = x
        wrapper.variables = {**variables, "params": params}
        try:
            result = forward(wrapper, *args)
        finally:
            wrapper.variables = variables
        out = result["out"]
        return jnp.sum(out * ct.astype(out.dtype)), result

    (_, result), (d_params, d_inputs) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
        variables["params"], [xs[i] for i in floating])
    wrapper.attention_weights = result.get("attention_attr")  # not the tracer seen by the trace
    grads = {f"input.{i}": g for i, g in zip(floating, d_inputs, strict=True)}
    grads.update({f"weight.{name}": g for name, g in flatten(d_params).items()})
    return result, grads


def gradients(layer: FlaxLayer | Layer, inputs: list[Any], kwargs: dict[str, Any],
              cotangent: Any) -> dict[str, np.ndarray]:
    """Gradients of ``sum(output * cotangent)`` by ``jax.grad``, keyed ``input.<i>``/``weight.<name>``."""
    wrapper = handle(layer)
    if wrapper.variables is None:
        wrapper(*inputs, **kwargs)

    def forward(m: FlaxLayer, *xs: Any) -> dict[str, Any]:
        out = m(*xs, **kwargs)
        return {"out": out[0] if isinstance(out, tuple) else out}

    _, grads = forward_and_gradients(wrapper, forward, inputs, cotangent)
    return {name: np.asarray(g) for name, g in grads.items()}


def jit(layer: FlaxLayer | Layer, fn: Callable[..., Any], arrays: Sequence[Any]) -> Any:
    """``fn(layer, *arrays)`` under ``jax.jit``, the variables and the arrays (inputs, lengths,
    masks) as traced arguments: one XLA program, gradients included."""
    wrapper = handle(layer)
    variables = wrapper.variables
    assert variables is not None, "call the layer once (or set its weights) first"

    def traced(variables: Any, *arrays: Any) -> Any:
        wrapper.variables = variables
        return fn(wrapper, *arrays)

    try:
        return jax.jit(traced)(variables, *arrays)
    finally:  # nothing traced may stay in the handle
        wrapper.variables = variables
        wrapper.attention_weights = None


#: Keys of the ``'dropout'`` rng for training calls: a new one per call, as a training loop
#: would split them.
_DROPOUT_KEYS = itertools.count(100)


def call_mode(layer: FlaxLayer | Layer, training: bool, *args: Any, **kwargs: Any) -> Any:
    """Inference as ``call``; training with ``training=True`` and a fresh ``'dropout'`` key."""
    if not training:
        return handle(layer)(*args, **kwargs)
    rngs = {"params": jax.random.PRNGKey(0), "dropout": jax.random.PRNGKey(next(_DROPOUT_KEYS))}
    return handle(layer)(*args, training=True, rngs=rngs, **kwargs)


def sgd_step(layer: FlaxLayer | Layer, args: Sequence[Any], kwargs: dict[str, Any],
             target: np.ndarray, lr: float) -> None:
    """``params - lr * jax.grad(loss)(params)`` over the params pytree (the gradient jitted)."""
    wrapper = handle(layer)
    if wrapper.variables is None:
        wrapper(*args, **kwargs)
    variables = wrapper.variables
    assert variables is not None

    def loss(params: Any) -> jax.Array:
        out: jax.Array = wrapper.module.apply({**variables, "params": params}, *args, **kwargs)  # type: ignore[assignment]
        return jnp.mean((out - jnp.asarray(target, out.dtype)) ** 2)

    grads = jax.jit(jax.grad(loss))(variables["params"])  # one compilation, not one per primitive
    params = jax.tree_util.tree_map(lambda p, g: p - lr * g, variables["params"], grads)
    wrapper.variables = {**variables, "params": params}


def save_load_native(layer: FlaxLayer | Layer, make_fresh: Callable[[], Any], args: Sequence[Any],
                     path: Path) -> tuple[Any, list[str]]:
    """Flax's msgpack serialization of the variables, read into a template of zeros."""
    wrapper = handle(layer)
    (path / "variables.msgpack").write_bytes(flax.serialization.to_bytes(wrapper.variables))
    template = jax.tree_util.tree_map(jnp.zeros_like, wrapper.variables)
    fresh = handle(make_fresh())
    fresh.variables = flax.serialization.from_bytes(template,
                                                    (path / "variables.msgpack").read_bytes())
    return fresh, list(flatten(fresh.variables["params"]))


MODES = {"eager": eager, "jit": jit}


# --- building (lazy sizes) ---


def first_call_compiled(layer: FlaxLayer | Layer, *args: Any, **kwargs: Any) -> Any:
    """The layer's first call under ``jax.jit``: ``init_with_output`` traced and compiled."""
    wrapper = handle(layer)
    out, state = jax.jit(lambda *a: wrapper.module.init_with_output(_rngs(), *a, mutable=True,
                                                                    **kwargs))(*args)
    wrapper.variables = {"params": state.get("params", {})}
    return out


def native_shapes(layer: FlaxLayer | Layer) -> dict[str, tuple[int | None, ...] | None]:
    """The params tree by canonical name and shape: none before the first call."""
    variables = handle(layer).variables
    return {} if variables is None else {name: tuple(np.shape(p))
                                         for name, p in flatten(variables["params"]).items()}


def seeded_weights(cls: Any, config: dict[str, Any], seed: int, args: Sequence[Any]) -> dict[str, Any]:
    """The initial weights ``init`` draws from the params rng ``PRNGKey(seed)``."""
    module = cls(**config)
    return dict(bj.get_weights(module.init(jax.random.PRNGKey(seed), *args), layer=module))


def weights_from_sizes(cls: Any, config: dict[str, Any], seed: int,
                       sizes: dict[str, int]) -> dict[str, Any]:
    """The weights ``bj.init_weights`` makes from the input sizes, before any call."""
    return bj.get_weights(bj.init_weights(cls(**config), seed=seed, **sizes))


# --- native weights, names, config ---


def native_weights(layer: FlaxLayer | Layer) -> dict[tuple[str, ...], np.ndarray]:
    """The ``'params'`` pytree, each leaf by its path of nested dicts, in the tree's order."""
    variables = handle(layer).variables
    assert variables is not None, "call the layer once (or set its weights) first"
    nested: dict[tuple[str, ...], np.ndarray] = {}

    def walk(tree: Mapping[str, Any], prefix: tuple[str, ...]) -> None:
        for key, value in tree.items():  # insertion order: the order Flax created them in
            if isinstance(value, Mapping):
                walk(value, (*prefix, key))
            else:
                nested[(*prefix, key)] = np.asarray(value)

    walk(variables["params"], ())
    return nested


def set_native_weights(layer: FlaxLayer | Layer, values: dict[tuple[str, ...], np.ndarray]) -> None:
    """New params, a nested dict built from the paths."""
    wrapper = handle(layer)
    assert wrapper.variables is not None
    tree: dict[str, Any] = {}
    for path, value in values.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = jnp.asarray(value)
    wrapper.variables = {**wrapper.variables, "params": tree}


def config(layer: FlaxLayer | Layer) -> dict[str, Any]:
    """The module's dataclass fields (Flax's own ``parent`` and ``name`` left out), in order."""
    module = handle(layer).module
    return {f.name: getattr(module, f.name) for f in dataclasses.fields(module)
            if f.name not in ("parent", "name")}


def rebuild(layer: FlaxLayer | Layer) -> FlaxLayer:
    return FlaxLayer(type(handle(layer).module)(**config(layer)))


def build(layer: FlaxLayer | Layer, *args: Any, **kwargs: Any) -> None:
    """The params a first call ``call(layer, *args)`` creates, quickly: their tree (names,
    nesting, shapes, dtypes) is Flax's own, from ``init`` traced by ``jax.eval_shape`` (nothing
    compiled); their values are drawn on the host as :func:`backends.jax.init_weights` draws
    them (:func:`initialise` draws them as ``init`` does)."""
    wrapper = handle(layer)
    shapes = jax.eval_shape(wrapper.module.init, _rngs(), *args, **kwargs)["params"]
    dims = wrapper.module.dims_from_weights(flatten(shapes))
    variables = bj.init_weights(wrapper.module, seed=0, **dims)
    structure = jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), variables["params"])
    assert structure == jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), shapes)
    wrapper.variables = variables


def initialise(layer: FlaxLayer | Layer, *args: Any, **kwargs: Any) -> None:
    """The params a first call ``call(layer, *args)`` creates, drawn by ``init`` under
    ``jax.jit`` (one compilation instead of one per primitive of an eager first call)."""
    wrapper = handle(layer)
    wrapper.variables = {"params": jax.jit(wrapper.module.init)(_rngs(), *args, **kwargs)["params"]}


# --- fused kernels ---


def count_fused_calls(monkeypatch: Any) -> Callable[[], int]:
    """Counts the calls of ``jax.nn.dot_product_attention`` (the fused path's kernel) from now
    on, by way of ``monkeypatch``; returns a function giving the count so far (calls made while
    a function is traced count once per trace)."""
    calls = [0]
    real = jax.nn.dot_product_attention

    def counted(*args: Any, **kwargs: Any) -> jax.Array:
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", counted)
    return lambda: calls[0]


def fused_kernel_takes(depth: int, value_depth: int, dtype: str) -> bool:
    """Whether the kernel takes a fused call (no dropout) of these per-head depths and dtype:
    ``jax.nn.dot_product_attention`` needs equal query and value depths, and XLA on CPU has no
    float16 product accumulating in float32; a call forcing the kernel is refused then."""
    return depth == value_depth and not (dtype == "float16" and jax.default_backend() == "cpu")


# --- compiled modes ---


def compiled_function(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A plain function as one XLA program: ``jax.jit``."""
    return jax.jit(fn)


def loop_program(fn: Callable[..., Any], arrays: Sequence[Any]) -> tuple[bool, int]:
    """Whether the jaxpr of ``fn(*arrays)`` holds a ``scan`` or ``while``, and its number of
    matrix products (``dot_general``), which the loops hold once each: at most 12."""
    text = str(jax.make_jaxpr(fn)(*arrays))
    products = text.count("dot_general")
    assert products <= 12, f"{products} matrix products: the loops were unrolled"
    return "scan" in text or "while" in text, products


def dropout_program(fn: Callable[[Any], Any], seed: int) -> Callable[[], Any]:
    """``fn(ops)`` jitted once, ``ops`` drawing dropout from the key ``seed`` folded with the
    number of the call (a new key per call, as a training loop splits them)."""
    run = jax.jit(lambda key: fn(bj.JaxOps(rng=key)))
    calls = itertools.count()
    return lambda: run(jax.random.fold_in(jax.random.PRNGKey(seed), next(calls)))
