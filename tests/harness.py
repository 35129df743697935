"""What the cross-backend tests need to know about a backend, in one place.

Tolerances per dtype live here and nowhere else. Backend-specific test glue lives in
``tests/hooks/<backend>_hooks.py`` (optional), which may define:

* ``make(cls, config, dtype) -> layer``: build a layer computing in ``dtype`` (a NumPy name);
* ``call(layer, *args, **kwargs)``: call a layer (default: ``layer(*args, **kwargs)``);
* ``attention_weights(layer)``: the weights kept by the layer's last call
  (default: ``layer.attention_weights``);
* ``gradients(layer, inputs, kwargs, cotangent) -> dict``: gradients of
  ``sum(output * cotangent)`` with respect to each input (``"input.<i>"``, by position) and
  each weight (``"weight.<canonical name>"``), as NumPy arrays;
* ``forward_and_gradients(layer, forward, inputs, cotangent) -> (result, gradients)``: runs
  ``forward(layer, *inputs)`` (a dict of arrays with an ``"out"`` entry) and differentiates
  ``sum(result["out"] * cotangent)`` as ``gradients`` does, returning the backend's arrays so
  that it also runs inside a compiled mode (every backend of :data:`AUTODIFF` must have it);
* ``call_mode(layer, training, *args, **kwargs)``: call a layer in training mode (dropout on,
  a fresh mask each call) or in inference mode, the framework's way (``training=``,
  ``.train()``/``.eval()``, a ``'dropout'`` rng, ``autograd.record()``);
* ``sgd_step(layer, args, kwargs, target, lr)``: one plain gradient-descent step, in inference
  mode, on ``mean((layer(*args, **kwargs) - target) ** 2)``, by the framework's own optimiser
  or autodiff (every backend of :data:`AUTODIFF` must have it);
* ``save_load_native(layer, make_fresh, args, path) -> (layer, names)``: the layer written to a
  file of the framework's own format (``state_dict``, a ``.keras`` model, Flax msgpack, Gluon
  ``.params``) under ``path`` and read into ``make_fresh()``; returns the layer read and the
  weight names the file holds (``args``: example inputs, for formats that need a call first);
* ``SETUPS``: name -> ``setup(layer)``, the ways a layer can be set up before it is called
  that stay on it (Gluon's ``hybridize()``); default: the layer as built;
* ``MODES``: mode name -> ``mode(layer, fn, arrays)``, which returns ``fn(layer, *arrays)``
  run in that mode (``torch.compile``, ``tf.function(jit_compile=True)``, ``jax.jit``,
  ``hybridize()``); the names are those of :data:`MODES` below.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from attention_core import registry


@dataclass(frozen=True)
class Column:
    """A column of the matrix beside the registry's backends: a second set of native layers
    computing on one backend's arrays (``backends.keras`` under Keras' JAX or torch backend).

    Attributes:
        module: The layers' module.
        arrays: The registry backend whose arrays and ops the layers compute on.
        keras_backend: The ``KERAS_BACKEND`` the column needs (None: any).
    """

    module: str
    arrays: str
    keras_backend: str | None = None

    def load(self) -> ModuleType:
        """The layers' module; ImportError if the environment cannot run it."""
        if self.keras_backend and os.environ.get("KERAS_BACKEND") != self.keras_backend:
            raise ImportError(f"set KERAS_BACKEND={self.keras_backend} to test {self.module} "
                              f"on {self.arrays} (it is {os.environ.get('KERAS_BACKEND')!r})")
        return importlib.import_module(self.module)


#: The columns by test backend name (``ATTENTION_CORE_TEST_BACKENDS``), each in its own tox env.
COLUMNS = {
    "keras-jax": Column("backends.keras", "jax", keras_backend="jax"),
    "keras-torch": Column("backends.keras", "torch", keras_backend="torch"),
    "nnx": Column("backends.jax.nnx", "jax"),
}


def load(name: str) -> ModuleType:
    """A test backend's layers module: a registry backend's adapter, or a column's module.

    Raises:
        ImportError: It cannot be loaded here. ValueError: an unknown name.
    """
    if name in COLUMNS:
        registry.load(COLUMNS[name].arrays)
        return COLUMNS[name].load()
    return registry.load(name)


def canonical_name(name: str) -> str:
    """A test backend's name: a column's as given, a registry backend's canonical name."""
    return name if name in COLUMNS else registry.canonical_name(name)


#: Spacing of the floating-point numbers just above 1.0 (2**-mantissa bits), per dtype.
EPS = {"float64": 2.0**-52, "float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}

#: Largest allowed max |difference| from the float64 reference, per compute dtype: for outputs
#: and attention weights as it is; for gradients, times max(1, max |reference gradient|) of the
#: array (gradients reach about 13 here, and their rounding error grows with their size).
#:
#: float64 (1e-10) and float32 (1e-5, about 84 eps) are the design's. float16 and bfloat16 get
#: 16 eps (0.0156 and 0.125): inputs and weights are rounded to the dtype once (eps/2
#: relative), outputs reach about 4 in size (LayerNorm; one rounding there costs 2 eps), and
#: about five rounded stages lie between an input and an output (projections, scores,
#: softmax, pooling, output projection or normalisation). The measured worst cases on NumPy,
#: torch, Keras and Flax are 5.4 eps for outputs and 4.3 eps for gradients (relative): 16 eps
#: leaves a margin of about three. (A masking mistake moves outputs by far more, and float32
#: bounds the same code at 1e-5.)
TOLERANCE = {
    "float64": 1e-10,
    "float32": 1e-5,
    "float16": 16 * EPS["float16"],
    "bfloat16": 16 * EPS["bfloat16"],
}

#: Layers whose gradients in float16 and bfloat16 are measured and must be finite, but are not
#: bounded by :data:`TOLERANCE`: a ReLU (the encoder block's FFN) follows rounded stages, and
#: its pre-activations come within 1e-3 of zero in the reference cases, closer than the
#: forward error of those dtypes (~0.005 in float16, ~0.04 in bfloat16). A ReLU that flips
#: changes the gradients by a whole term, however right the arithmetic is (measured: up to 1.2
#: in float16, 660 eps relative, and up to 2 in bfloat16). Their outputs are bounded, and so
#: are their float32 and float64 gradients. ``TransformerEncoder`` stacks two such blocks: on
#: TensorFlow its failing low-precision cells each had one or two FFN pre-activations (as small
#: as 9e-5 in float64) whose sign flipped, the gradient of the first dense layer and what lies
#: before it then off by up to 11x the bound in float16 and 4.4x in bfloat16; the cells without
#: a flip passed, and the outputs stayed within 0.44 of the bound. The decoder layers have the
#: same FFN: on torch, the failing low-precision cells of the decoder block each had one FFN
#: pre-activation whose sign flipped (3e-4 in float64, against a float16 forward error of
#: 2.5e-3; 5e-3 against 2.5e-2 in bfloat16), the gradients of ``ffn.dense1`` then off by up to
#: 21x the bound; a cell without a flip passed.
LOW_PRECISION_UNBOUNDED_GRADIENTS = ("TransformerEncoderBlock", "TransformerEncoder",
                                     "TransformerDecoderBlock", "TransformerDecoder", "Transformer")


def tolerance(quantity: str, dtype: str, reference: np.ndarray) -> float:
    """The bound on max |diff| of one compared quantity (``grad.*`` are gradients)."""
    if quantity.startswith("grad."):
        scale = float(np.max(np.abs(reference), initial=0.0))
        return TOLERANCE[dtype] * max(1.0, scale)
    return TOLERANCE[dtype]


#: Whether this process runs JAX with 64-bit types (``JAX_ENABLE_X64``, read by JAX at import):
#: a process-wide switch the library leaves alone. The keras-jax env runs its float64 cells in
#: a second process with it set (tox.ini).
JAX_X64 = os.environ.get("JAX_ENABLE_X64", "").strip().lower() in {"1", "true", "yes", "on"}
_JAX_FLOAT64 = ("float64",) if JAX_X64 else ()

#: Compute dtypes each backend is tested in against the reference files: float32 on all,
#: float64 where the framework computes in it (JAX only with ``jax_enable_x64``), float16 and
#: bfloat16 where the layers take them (NumPy has no bfloat16; MXNet's CPU matrix product has
#: neither).
DTYPES = {
    "numpy": ("float32", "float64", "float16"),
    "torch": ("float32", "float64", "float16", "bfloat16"),
    "tensorflow": ("float32", "float64", "float16", "bfloat16"),
    "jax": ("float32", *_JAX_FLOAT64, "float16", "bfloat16"),
    "mxnet": ("float32", "float64"),
    "keras-jax": ("float32", *_JAX_FLOAT64, "float16", "bfloat16"),
    "keras-torch": ("float32", "float64", "float16", "bfloat16"),
    "nnx": ("float32", *_JAX_FLOAT64, "float16", "bfloat16"),
}

#: Ways each backend runs a layer (``MODES`` of its hooks): ``eager`` everywhere, then the
#: framework's compiled form.
MODES = {
    "numpy": ("eager",),
    "torch": ("eager", "compile"),
    "tensorflow": ("eager", "xla"),
    "jax": ("eager", "jit"),
    "mxnet": ("eager", "hybridize"),
    "keras-jax": ("eager", "jit"),
    "keras-torch": ("eager", "compile"),
    "nnx": ("eager", "jit"),
}

#: What each mode name stands for, for reports.
MODE_NAMES = {
    "eager": "eager",
    "compile": "torch.compile(fullgraph=True)",
    "xla": "tf.function(jit_compile=True)",
    "jit": "jax.jit",
    "hybridize": "hybridize()",
}

#: A backend's own names for its modes, where they are not :data:`MODE_NAMES`'.
OWN_MODE_NAMES = {"nnx": {"jit": "nnx.jit"}, "keras-jax": {"jit": "jax.jit(stateless_call)"},
                  "keras-torch": {"compile": "torch.compile"}}


def mode_name(backend: str, mode: str) -> str:
    """What a backend's mode stands for, for reports."""
    return OWN_MODE_NAMES.get(backend, {}).get(mode, MODE_NAMES[mode])

#: Compiled modes cheap enough for the shared behaviour tests (about a second per small layer).
#: ``torch.compile`` costs seconds per graph under Inductor: it runs the matrix's compiled cells
#: and the fullgraph tests of tests/test_torch.py, not these; likewise
#: ``jax.jit`` is left to the matrix and tests/test_jax.py: each new trace compiles for seconds.
QUICK_COMPILED_MODES = {"tensorflow": ("xla",), "mxnet": ("hybridize",)}

#: The mode a backend differentiates a whole layer fastest in: JAX's eager mode compiles every
#: primitive of the forward and backward pass on its own (loops included), ``jax.jit`` once.
FASTEST_GRADIENT_MODE = {"jax": "jit", "keras-jax": "jit", "nnx": "jit"}

#: Backends with automatic differentiation: their gradients are compared with the file too.
AUTODIFF = ("torch", "tensorflow", "jax", "mxnet", "keras-jax", "keras-torch", "nnx")


class Harness:
    """Converts arrays, builds layers and calls them on one backend."""

    def __init__(self, name: str) -> None:
        self.name = canonical_name(name)
        #: The registry backend whose arrays the layers compute on (a column's, or its own).
        self.arrays = COLUMNS[self.name].arrays if self.name in COLUMNS else self.name
        self.module = load(self.name)
        self.ops = registry.load(self.arrays).OPS
        try:
            hooks = self.name.replace("-", "_")
            self.hooks: Any = importlib.import_module(f"tests.hooks.{hooks}_hooks")
        except ModuleNotFoundError:
            self.hooks = None
        default: Callable[..., Any] = lambda layer, *a, **k: layer(*a, **k)  # noqa: E731
        self._call = getattr(self.hooks, "call", default)

    @property
    def layer_base(self) -> type:
        """The adapter's generic ``Layer`` class (in its module, or its ``layers`` module)."""
        module = self.module
        if not hasattr(module, "Layer"):
            module = importlib.import_module(f"{module.__name__}.layers")
        base: type = module.Layer
        return base

    def array(self, x: Any, dtype: str | None = None) -> Any:
        """A backend array from NumPy data; floating data is cast to ``dtype`` if given
        (bfloat16, which NumPy lacks, by way of float32)."""
        x = np.asarray(x)
        if dtype is not None and x.dtype.kind == "f":
            if dtype == "bfloat16":
                return self.ops.astype(self.ops.from_numpy(x.astype(np.float32)), dtype)
            x = x.astype(dtype)
        return self.ops.from_numpy(x)

    def numpy(self, x: Any) -> np.ndarray:
        return np.asarray(self.ops.to_numpy(x), dtype=np.float64)

    def make(self, layer: str | type, config: dict[str, Any], dtype: str = "float32") -> Any:
        """A layer of this backend, by name or class, computing in ``dtype``."""
        cls = layer if isinstance(layer, type) else getattr(self.module, layer)
        if self.hooks is not None and hasattr(self.hooks, "make"):
            return self.hooks.make(cls, config, dtype)
        return cls(**config)

    def call(self, layer: Any, *args: Any, **kwargs: Any) -> Any:
        return self._call(layer, *args, **kwargs)

    def run(self, mode: str, layer: Any, fn: Callable[..., Any], arrays: list[Any]) -> Any:
        """``fn(layer, *arrays)`` run in one of the backend's :data:`MODES`."""
        modes = getattr(self.hooks, "MODES", None)
        if not modes or mode not in modes:
            raise AssertionError(f"tests/hooks/{self.name}_hooks.py has no mode {mode!r} in MODES")
        return modes[mode](layer, fn, arrays)

    def forward_and_gradients(
        self, layer: Any, forward: Callable[..., dict[str, Any]], inputs: list[Any],
        cotangent: np.ndarray,
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """See the module docstring; fails for an autodiff backend without the hook."""
        hook = getattr(self.hooks, "forward_and_gradients", None)
        if hook is None:
            raise AssertionError(f"backend {self.name!r} has autodiff but tests/hooks/"
                                 f"{self.name}_hooks.py has no forward_and_gradients")
        return hook(layer, forward, inputs, cotangent)

    def call_mode(self, layer: Any, training: bool, *args: Any, **kwargs: Any) -> Any:
        """Calls the layer in training mode (dropout on) or inference mode (see the module
        docstring)."""
        return self.hook("call_mode")(layer, training, *args, **kwargs)

    def sgd_step(self, layer: Any, args: list[Any], kwargs: dict[str, Any], target: np.ndarray,
                 lr: float) -> None:
        """One gradient-descent step on the mean squared error to ``target``."""
        self.hook("sgd_step")(layer, args, kwargs, target, lr)

    def save_load_native(self, layer: Any, make_fresh: Callable[[], Any], args: list[Any],
                         path: Any) -> tuple[Any, list[str]]:
        """The layer through a file of the framework's own format (see the module docstring)."""
        result: tuple[Any, list[str]] = self.hook("save_load_native")(layer, make_fresh, args, path)
        return result

    def setups(self) -> list[Callable[[Any], None]]:
        """The ways a layer can be set up before its calls (``SETUPS`` of the hooks)."""
        setups: dict[str, Callable[[Any], None]] = getattr(self.hooks, "SETUPS", {})
        return [lambda layer: None, *setups.values()]

    def hook(self, name: str) -> Callable[..., Any]:
        """The hook ``name`` of this backend's tests/hooks module; fails the test if missing.

        Shared tests call hooks that have no method here through this (``harness.hook("x")``).
        """
        hook = getattr(self.hooks, name, None)
        if hook is None:
            raise AssertionError(f"tests/hooks/{self.name}_hooks.py has no {name}")
        result: Callable[..., Any] = hook
        return result

    def attention_weights(self, layer: Any) -> Any:
        """The attention weights the layer's last call kept."""
        if self.hooks is not None and hasattr(self.hooks, "attention_weights"):
            return self.hooks.attention_weights(layer)
        return layer.attention_weights


def max_diff(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b|, after checking the shapes agree; inf if either has a NaN."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, f"shape {a.shape} != reference shape {b.shape}"
    if np.isnan(a).any() or np.isnan(b).any():
        return float("inf")
    return float(np.max(np.abs(a - b))) if a.size else 0.0
