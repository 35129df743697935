"""Host-side arguments of any framework, read as NumPy arrays before any cast.

Lengths, masks and weights to set are small and read on the host: they are accepted from any
framework (and as Python lists and scalars), converted here by one rule, and checked on the
NumPy array, whose dtype and values are exactly those given (no truncation to the computing
backend's int32, no drop of a bfloat16 to float32). No framework is imported: an array's
framework is told from its type, as :func:`attention_core.registry.backend_of` does.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import numpy as np

from attention_core.registry import backend_of


def framework_of(x: Any) -> str | None:
    """The backend that owns an array (``"torch"``, ...), or None for anything else."""
    try:
        return backend_of(x)
    except TypeError:
        return None


def _bfloat16(values: np.ndarray) -> np.ndarray:
    """float32 values of a bfloat16 tensor as NumPy bfloat16 (exact) when ml_dtypes is there."""
    try:
        import ml_dtypes
    except ImportError:  # no NumPy bfloat16 type: the exact float32 widening
        return values
    return values.astype(ml_dtypes.bfloat16)


def host_array(x: Any) -> np.ndarray:
    """Returns the values of ``x`` as a NumPy array, of the dtype they have.

    NumPy arrays and scalars, Python lists and scalars: ``numpy.asarray``. torch tensors
    (also ones that require grad, or on a device) are detached and copied to the host;
    bfloat16 ones become NumPy bfloat16 (``ml_dtypes``). TensorFlow tensors and Keras
    variables: ``.numpy()``. MXNet arrays: ``.asnumpy()``. JAX arrays and anything else with
    ``__array__``: ``numpy.asarray``.

    Args:
        x: The argument as given.

    Raises:
        TypeError: ``x`` is a traced tensor whose values are not known now.
    """
    if isinstance(x, np.ndarray):
        return x
    owner = framework_of(x)
    if owner == "torch":
        t = x.detach().cpu()
        if str(t.dtype) == "torch.bfloat16":
            return _bfloat16(t.float().numpy())
        return np.asarray(t.numpy())
    if owner == "mxnet" and callable(getattr(x, "asnumpy", None)):
        return np.asarray(x.asnumpy())
    if owner == "tensorflow" and callable(getattr(x, "numpy", None)):
        return np.asarray(x.numpy())
    return np.asarray(x)


def plain(value: Any) -> Any:
    """A NumPy scalar (``np.float32(0.25)``, ``np.int64(8)``, ``np.bool_``) as the Python number.

    Anything else is returned unchanged, so the checks that follow see Python numbers only.
    """
    if isinstance(value, np.generic) and value.dtype.kind in "biuf":
        return value.item()
    return value


def plain_arguments(init: Callable[..., None]) -> Callable[..., None]:
    """Wraps a constructor so that it gets NumPy scalar arguments as Python numbers."""

    @functools.wraps(init)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *(plain(a) for a in args), **{k: plain(v) for k, v in kwargs.items()})

    wrapper.__signature__ = inspect.signature(init)  # type: ignore[attr-defined]  # Keras reads it
    return wrapper


class PlainArguments:
    """Mixin of the adapters' layer bases: constructors take NumPy scalars as Python numbers.

    ``num_heads=np.int64(8)`` or ``dropout=np.float32(0.1)`` are then checked and stored as
    ``8`` and ``0.1`` (the float32 value, widened), so configs, reprs and saved files hold
    Python numbers only.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "__init__" in cls.__dict__:
            cls.__init__ = plain_arguments(cls.__init__)  # type: ignore[method-assign]
