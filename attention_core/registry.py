"""Backend names, aliases, lazy loading, the environment variable and ``use_backend``.

Nothing here imports a framework until a backend is asked for by name or by array type.
The active backend is looked up in this order: :func:`use_backend` (context-local, so threads
and asyncio tasks each keep their own), then :func:`set_backend`, then the environment variable
``ATTENTION_CORE_BACKEND``, then ``"numpy"``.
"""

from __future__ import annotations

import contextvars
import importlib
import importlib.util
import json
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata
from types import ModuleType
from typing import Any

from attention_core.ops import Ops

ENV_VAR = "ATTENTION_CORE_BACKEND"
DEFAULT = "numpy"

#: Canonical backend names, in display order.
BACKENDS = ("numpy", "torch", "tensorflow", "jax", "mxnet")

ALIASES = {
    "pytorch": "torch",
    "tf": "tensorflow",
    "keras": "tensorflow",
    "flax": "jax",
    "gluon": "mxnet",
}

#: The framework modules each backend needs (the first is the one whose version is shown).
FRAMEWORKS = {
    "numpy": ("numpy",),
    "torch": ("torch",),
    "tensorflow": ("tensorflow", "keras"),
    "jax": ("jax", "flax"),
    "mxnet": ("mxnet",),
}

def install_hint(extra: str) -> str:
    """The command that installs the package's ``extra``: from a checkout, or from the index."""
    return (f'pip install ".[{extra}]" in a checkout of attention-core, or '
            f'pip install "attention-core[{extra}]" from the package index')


#: What to install for each backend.
PIP = {
    "numpy": "pip install numpy",
    "torch": f"{install_hint('torch')}; it takes torch==2.13.0",
    "tensorflow": install_hint("tensorflow"),
    "jax": install_hint("jax"),
    "mxnet": f"{install_hint('mxnet')}; it takes mxnet==1.9.1, with numpy<1.24",
}

#: Top-level module of an array's type -> backend that owns it.
_ARRAY_MODULES = {
    "numpy": "numpy",
    "torch": "torch",
    "tensorflow": "tensorflow",
    "keras": "tensorflow",
    "jax": "jax",
    "jaxlib": "jax",
    "mxnet": "mxnet",
}


class BackendNotInstalledError(ImportError):
    """A known backend was asked for, but its framework is not installed."""


_context: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "attention_core_backend", default=None
)
_process_default: str | None = None
_lock = threading.Lock()
#: Adapter packages whose import has finished (filled under ``_lock``, read without it).
_loaded: dict[str, ModuleType] = {}


def canonical_name(name: str) -> str:
    """Resolves a backend name or alias.

    Args:
        name: A backend name (``"torch"``) or alias (``"pytorch"``), any case.

    Returns:
        The canonical backend name.

    Raises:
        ValueError: The name is not a backend or alias.
    """
    if not isinstance(name, str):
        raise TypeError(f"backend name must be a str, got {type(name).__name__}")
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in BACKENDS:
        aliases = ", ".join(f"{a}->{c}" for a, c in ALIASES.items())
        raise ValueError(
            f"unknown backend {name!r}; expected one of {', '.join(BACKENDS)} "
            f"(aliases: {aliases})"
        )
    return key


def is_installed(name: str) -> bool:
    """Tells whether a backend's frameworks are installed, without importing them."""
    return all(importlib.util.find_spec(m) is not None for m in FRAMEWORKS[canonical_name(name)])


def module_version(module: str) -> str | None:
    """The installed version of the distribution providing ``module`` (read, not imported).

    ``tensorflow`` may come from ``tensorflow-cpu``, for instance. None when not installed.
    """
    for dist in metadata.packages_distributions().get(module, [module]):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def available_backends() -> list[str]:
    """Returns the canonical names of the backends whose frameworks are installed.

    ``tensorflow`` is left out while Keras is set to another of its backends (its layers are
    Keras layers on TensorFlow; ``backends.keras`` serves the others).
    """
    return [b for b in BACKENDS if is_installed(b) and importlib.util.find_spec(f"backends.{b}")
            and not (b == "tensorflow" and keras_backend() not in (None, "tensorflow"))]


def keras_backend() -> str | None:
    """The backend Keras runs on, or will when first imported; None when nothing says.

    Read without importing Keras: Keras' own answer once imported, else ``KERAS_BACKEND``,
    else ``"backend"`` in ``$KERAS_HOME/keras.json`` (``~/.keras`` by default).
    """
    if "keras" in sys.modules and hasattr(sys.modules["keras"], "backend"):
        return str(sys.modules["keras"].backend.backend())
    if os.environ.get("KERAS_BACKEND"):
        return os.environ["KERAS_BACKEND"]
    home = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    try:
        with open(os.path.join(home, "keras.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    value = config.get("backend") if isinstance(config, dict) else None
    return value if isinstance(value, str) else None


def load(name: str) -> ModuleType:
    """Imports a backend's adapter package (and so its framework), once.

    Args:
        name: A backend name or alias.

    Returns:
        The module ``backends.<name>``.

    Raises:
        ValueError: Unknown name.
        BackendNotInstalledError: The framework is not installed.
    """
    key = canonical_name(name)
    if not is_installed(key):
        missing = [m for m in FRAMEWORKS[key] if importlib.util.find_spec(m) is None]
        raise BackendNotInstalledError(
            f"backend {key!r} needs {', '.join(missing)}, which is not installed; "
            f"install it with: {PIP[key]}"
        )
    if importlib.util.find_spec(f"backends.{key}") is None:
        raise BackendNotInstalledError(
            f"backend {key!r}: its framework is installed, but this version of attention-core "
            "has no adapter for it yet"
        )
    # a backend imported already, by the registry or by the user, is returned without the lock
    # (which torch.compile cannot trace), so its users never wait for another thread's load
    module = _loaded.get(key) or _imported(f"backends.{key}")
    if module is None:
        # First loads run strictly one at a time.
        with _lock:
            module = _loaded[key] = importlib.import_module(f"backends.{key}")
    return module


def _imported(name: str) -> ModuleType | None:
    """The module ``name`` if its import has finished (by whoever imported it), else None."""
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None)
    return None if module is None or getattr(spec, "_initializing", False) else module


def _env_default() -> str:
    raw = os.environ.get(ENV_VAR, "").strip()
    if not raw:
        return DEFAULT
    try:
        return canonical_name(raw)
    except ValueError as err:
        raise ValueError(f"{ENV_VAR}={raw!r}: {err}") from None


def backend() -> str:
    """Returns the active backend's canonical name."""
    return _context.get() or _process_default or _env_default()


def set_backend(name: str) -> None:
    """Sets the process-wide default backend (overridden inside :func:`use_backend`).

    Raises:
        ValueError: Unknown name.
        BackendNotInstalledError: The framework is not installed.
    """
    global _process_default
    key = canonical_name(name)
    load(key)
    _process_default = key


@contextmanager
def use_backend(name: str) -> Iterator[str]:
    """Makes ``name`` the active backend inside a ``with`` block, for this context only.

    The override is held in a :class:`contextvars.ContextVar`, so other threads and tasks
    keep their own backend.

    Yields:
        The canonical backend name.
    """
    key = canonical_name(name)
    load(key)
    token = _context.set(key)
    try:
        yield key
    finally:
        _context.reset(token)


def backend_of(x: Any, name: str | None = None) -> str:
    """Names the backend that owns an array, from its type alone (no framework import).

    Args:
        x: The array.
        name: The argument ``x`` was given as, for the message.

    Raises:
        TypeError: ``x`` is not an array of a supported framework.
    """
    for cls in type(x).__mro__:
        owner = _ARRAY_MODULES.get(cls.__module__.partition(".")[0])
        if owner is not None:
            return owner
    frameworks = "numpy, torch, tensorflow, jax or mxnet"
    raise TypeError(f"expected an array of {frameworks}, got {type(x).__name__}" if name is None
                    else f"{name} must be an array of {frameworks}, got {type(x).__name__}")


def get_ops(name: str | None = None) -> Ops:
    """Returns the default :class:`~attention_core.ops.Ops` of a backend.

    Args:
        name: A backend name or alias; the active backend when None.
    """
    module = load(name or backend())
    ops: Ops = module.OPS
    return ops


def ops_for(x: Any, name: str | None = None) -> Ops:
    """Returns the Ops of the backend that owns the array ``x`` (argument ``name``).

    The backend's default ops, or, where it has ``OPS.placed(x)``, ops that make new arrays
    where ``x`` lives (torch's device).
    """
    ops = get_ops(backend_of(x, name))
    placed = getattr(ops, "placed", None)
    return ops if placed is None else placed(x)
