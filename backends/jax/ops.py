"""The JAX implementation of the ops protocol, over ``jax.numpy``.

Every method is traceable: the core runs unchanged under ``jax.jit``, ``jax.grad`` and
``jax.vmap``. Importing this module does not touch JAX's configuration (64-bit mode stays as
the user set it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from attention_core.kernels import Capabilities, Request, Result, register_kernel
from attention_core.kernels.direct import visible
from attention_core.modifiers import Window
from attention_core.ops import NamespaceOps

#: Largest ``B * H * Q * K`` for which the automatic choice takes the fused kernel off CPU
#: (16 MiB of float32 logits); see :func:`prefers_fused`.
FUSED_MAX_SCORES = 2**22


class JaxOps(NamespaceOps):
    """``jax.Array`` primitives; dropout draws from the PRNG key the instance is bound to.

    Args:
        rng: A JAX PRNG key (``jax.random.key(0)`` or ``jax.random.PRNGKey(0)``) for dropout.
            The n-th dropout call on this instance uses ``jax.random.fold_in(rng, n)``, so one
            instance gives different masks to the different dropouts of one forward pass, and
            the same key gives the same masks again. A compiled loop takes one ``n`` and
            folds the iteration's index into it, so every block draws its own mask. Without a
            key, dropout raises.

    Beyond the protocol it has the optional hooks of :class:`attention_core.ops.LoopOps`
    (``fold`` as ``jax.lax.fori_loop``, ``map_concat`` as ``jax.lax.map``), so the blockwise
    path compiles to loops instead of unrolling. ``jax.nn.dot_product_attention`` is
    registered as the ``"fused"`` kernel (:func:`fused`).

    Example:
        ``ac.dot_product_attention(q, k, v, dropout=0.1, ops=JaxOps(rng=jax.random.key(0)))``
    """

    name = "jax"
    xp = jnp

    def __init__(self, rng: jax.Array | None = None) -> None:
        self.rng = rng
        self._draws = 0

    def from_numpy(self, x: np.ndarray, like: Any = None) -> jax.Array:
        x = np.asarray(x)
        return jnp.asarray(x, dtype=like.dtype if like is not None and x.dtype.kind == "f" else None)

    def to_numpy(self, x: Any) -> np.ndarray:
        return np.asarray(x)

    def concrete(self, x: Any) -> np.ndarray | None:
        """None: a JAX array's values are never read (reading one waits for its device)."""
        return None

    def traced(self, x: Any) -> bool:
        return isinstance(x, jax.core.Tracer)

    def shape(self, x: Any) -> tuple[int, ...]:
        return tuple(jnp.shape(x))

    def dtype_name(self, x: Any) -> str:
        return str(np.dtype(x.dtype).name)

    def astype(self, x: Any, dtype: str) -> jax.Array:
        return jnp.asarray(x).astype(dtype)

    def relu(self, x: jax.Array) -> jax.Array:
        return jax.nn.relu(x)

    def where(self, cond: Any, x: jax.Array, y: Any) -> jax.Array:
        return jnp.where(cond, x, jnp.asarray(y, dtype=x.dtype))

    def slice(self, x: jax.Array, axis: int, start: Any, size: int) -> jax.Array:
        return jax.lax.dynamic_slice_in_dim(x, start, size, axis)

    def arange(self, n: Any) -> jax.Array:
        return jnp.arange(n, dtype=jnp.int32)

    # -- compiled loops for the blockwise path (attention_core.ops.LoopOps) ------------------
    #
    # Both loop bodies are rematerialised (jax.checkpoint): differentiating a loop otherwise
    # keeps every iteration's intermediates, which for the blockwise path is every tile of
    # scores, O(Q * K) memory. With the bodies recomputed in the backward pass, a key-block
    # step keeps only its carry (the running max, sum and output of its query block) and a
    # query block only its index, so training needs O((Q + K) * D) memory, as the forward
    # does (the checkpointing of Rabe & Staats, 2021). A forward without a gradient is
    # unchanged. Dropout draws the same mask when recomputed: its keys come from the
    # iteration's index (``_iteration``).

    @contextmanager
    def _iteration(self, index: Any, draw: int) -> Iterator[None]:
        """Makes the dropout calls of one loop iteration draw from its own key.

        A loop body is traced once, so the per-call counter alone would give every iteration
        the same mask. Inside, the n-th call draws from
        ``fold_in(fold_in(fold_in(rng, draw), index), n)``; the state is restored after.
        """
        rng, draws = self.rng, self._draws
        if rng is not None:
            self.rng, self._draws = jax.random.fold_in(jax.random.fold_in(rng, draw), index), 0
        try:
            yield
        finally:
            self.rng, self._draws = rng, draws

    def _reserve_draw(self) -> int:
        """Takes one draw number for a whole loop; its iterations derive their keys from it."""
        self._draws += 1
        return self._draws - 1

    def fold(self, body: Callable[[Any, Any], Any], init: Any, n: int) -> Any:
        draw = self._reserve_draw()

        @jax.checkpoint
        def step(i: Any, carry: Any) -> Any:
            with self._iteration(i, draw):
                return body(i, carry)

        return jax.lax.fori_loop(0, n, step, init)

    def map_concat(self, fn: Callable[[Any], jax.Array], n: int, axis: int) -> jax.Array:
        draw = self._reserve_draw()

        @jax.checkpoint
        def one(i: Any) -> jax.Array:
            with self._iteration(i, draw):
                return fn(i)

        stacked = jax.lax.map(one, jnp.arange(n, dtype=jnp.int32))  # (n, ..., size, ...)
        moved = jnp.moveaxis(stacked, 0, axis)  # (..., n, size, ...): block i before i + 1
        shape = moved.shape
        return jnp.reshape(moved, (*shape[:axis], n * shape[axis + 1], *shape[axis + 2 :]))

    def stop_gradient(self, x: jax.Array) -> jax.Array:
        return jax.lax.stop_gradient(x)

    def dropout(self, x: jax.Array, rate: float) -> jax.Array:
        if self.rng is None:
            raise ValueError(
                "dropout on JAX arrays needs a PRNG key: pass ops=JaxOps(rng=jax.random.key(0)) "
                "to the functional API; Flax layers draw it from the 'dropout' rng when called "
                "with training=True"
            )
        key = jax.random.fold_in(self.rng, self._draws)
        self._draws += 1
        keep = jax.random.bernoulli(key, 1.0 - rate, jnp.shape(x))
        return jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros((), x.dtype))

    def cumsum(self, x: jax.Array, axis: int) -> jax.Array:
        return jnp.cumsum(x, axis=axis)

    # -- sampling (attention_core.ops.SamplingOps): a PRNG key is the state, split per draw --

    def argmax(self, x: jax.Array) -> jax.Array:
        return jnp.argmax(x, axis=-1)

    def sort_descending(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        values, indices = jax.lax.top_k(x, x.shape[-1])  # every entry, largest first
        return values, indices

    def new_sampling_state(self, seed: int, like: Any = None) -> jax.Array:
        return jax.random.key(seed)

    def uniform(self, shape: tuple[int, ...], state: jax.Array) -> tuple[jax.Array, jax.Array]:
        state, key = jax.random.split(state)
        return jax.random.uniform(key, shape), state


    def silu(self, x: jax.Array) -> jax.Array:
        return jax.nn.silu(x)

    def erf(self, x: jax.Array) -> jax.Array:
        return jax.lax.erf(x)

#: The default JAX ops (used by the functional API for JAX arrays); it has no key, so dropout
#: through it raises: bind a key with ``JaxOps(rng=key)``.
OPS = JaxOps()


def floats_on_device(arguments: Mapping[str, Any]) -> dict[str, Any]:
    """A call's floating NumPy arrays as JAX arrays, as Flax's own layers take them.

    Integer and boolean ones (lengths, token ids, masks) stay on the host, where the core
    checks them before they are narrowed (JAX without x64 holds no int64).
    """
    return {name: jnp.asarray(x) if isinstance(x, np.ndarray) and x.dtype.kind == "f" else x
            for name, x in arguments.items()}


def fused(ops: Any, q: jax.Array, k: jax.Array, v: jax.Array, request: Request) -> Result:
    """Pools with ``jax.nn.dot_product_attention`` (XLA's kernel on CPU): ``(B, H, Q, Dv)``.

    The call's masks go in as one boolean mask; a window also as ``local_window_size``, so that
    the kernel may skip the keys outside it (not with positions per example: the mask alone).
    The kernel gives a row with no visible key the mean of the values (its softmax over
    all-masked logits is uniform): those rows are zeroed, found from the mask.
    """
    windows = [m for m in request.masks if isinstance(m, Window)]
    local = windows[0].local(request.call) if len(windows) == 1 else None
    mask = visible(request)
    while mask is not None and mask.ndim < 4:
        mask = mask[None]
    qt, kt, vt = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))  # (B, N, H, D)
    out = jnp.swapaxes(jax.nn.dot_product_attention(
        qt, kt, vt, mask=mask, scale=request.scale, local_window_size=local), 1, 2)
    return Result(out if mask is None else jnp.where(jnp.any(mask, -1, keepdims=True), out, 0))


def prefers_fused(ops: Any, request: Request) -> bool:
    """Whether the automatic choice should take :func:`fused` for these scores.

    The rule: never on CPU; elsewhere when ``B * H * Q * K <= FUSED_MAX_SCORES`` (16 MiB
    of float32 scores). ``jax.nn.dot_product_attention`` without cuDNN is XLA's plain
    attention: it forms the ``(B, H, Q, K)`` logits like the direct kernel, so above that
    size the blockwise kernel, whose memory stays flat, is taken instead.

    Measured under ``jax.jit`` on a 2-core CPU (jax 0.10.2, fp32, B=1, H=8, D=64,
    ``valid_lens`` on; best of 3 interleaved rounds, ms; temporary memory from XLA's
    ``memory_analysis``):

    ===== ====== ========= ====== ===========================
    n     fused  blockwise direct temp MiB fused/block/direct
    ===== ====== ========= ====== ===========================
    128   0.65   0.58      0.52   1 / 1 / 1
    256   3.0    2.2       2.1    4 / 4 / 4
    512   12.0   9.2       9.9    16 / 16 / 16
    1024  88     46        85     64 / 20 / 64
    2048  305    182       271    256 / 44 / 256
    4096  726    354       647    1024 / 35 / 1024
    ===== ====== ========= ====== ===========================

    The fused kernel was slower than the direct one at every size on CPU, so on CPU the
    core's own rule decides. GPU and TPU were not measured: there the bound keeps the fused
    kernel to the sizes whose logits fit comfortably.
    """
    shape = request.call.shape
    if jax.default_backend() == "cpu" or not all(isinstance(d, int) for d in shape):
        return False
    return bool(math.prod(shape) <= FUSED_MAX_SCORES)


# XLA on CPU has no float16 dot_general accumulating in float32, which the kernel asks for
# under jax.jit ("The precision 'F16_F16_F32' is not supported by dot_general on CPU"); the
# kernel has no dropout and needs values as deep as the keys.
_DTYPES = frozenset({"bfloat16", "float32", "float64"} | (
    set() if jax.default_backend() == "cpu" else {"float16"}))
register_kernel("fused", fused, Capabilities(scores=frozenset(), dropout=False, dtypes=_DTYPES,
                                             value_depth=False, ragged=True),
                backend="jax", priority=20, prefers=prefers_fused)
