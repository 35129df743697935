"""Dense projection and layer normalisation, the two building blocks around attention."""

from __future__ import annotations

from attention_core.ops import Array, Ops

#: LayerNorm epsilon, the same on every backend.
LAYER_NORM_EPS = 1e-5
#: RMSNorm epsilon (that of Llama, Mistral and Qwen2).
RMS_NORM_EPS = 1e-6


def dense(ops: Ops, x: Array, kernel: Array, bias: Array | None = None) -> Array:
    """Returns ``x @ kernel + bias`` over the last axis.

    Args:
        ops: The backend's ops.
        x: ``(..., in)``.
        kernel: ``(in, out)``, the canonical layout.
        bias: ``(out,)`` or None; added in the product's dtype, which differs from the
            bias's only under mixed precision (``ops.mixes_dtypes``), as in ``F.linear``.
    """
    linear = getattr(ops, "linear", None)  # one kernel for both (LinearOps)
    if linear is not None and bias is not None:
        return linear(x, kernel, bias)
    y = ops.matmul(x, kernel)
    if bias is None:
        return y
    dtype = ops.dtype_name(y)
    return y + (bias if ops.dtype_name(bias) == dtype else ops.astype(bias, dtype))


def layer_norm(
    ops: Ops, x: Array, gamma: Array, beta: Array, eps: float = LAYER_NORM_EPS
) -> Array:
    """Normalises the last axis to zero mean and unit variance, then scales and shifts.

    ``y = (x - mean) / sqrt(var + eps) * gamma + beta`` with the biased variance, as
    ``torch.nn.LayerNorm`` and ``keras.layers.LayerNormalization`` compute it. Float16 and
    bfloat16 inputs are normalised in float32, as those layers do: the squares of
    ``|x - mean| > 256`` overflow float16. The result has the dtype of ``x``.
    """
    kernel = getattr(ops, "layer_norm", None)  # one kernel where the backend has it (LinearOps)
    normed = None if kernel is None else kernel(x, gamma, beta, eps)
    if normed is not None:
        return normed
    dtype = ops.dtype_name(x)
    narrow = dtype in _NARROW_FLOATS
    wide = ops.astype(x, "float32") if narrow else x
    centred = wide - ops.mean(wide, -1)
    var = ops.mean(centred * centred, -1)
    normed = centred / ops.sqrt(var + eps)
    return (ops.astype(normed, dtype) if narrow else normed) * gamma + beta


def rms_norm(ops: Ops, x: Array, gamma: Array, eps: float = RMS_NORM_EPS) -> Array:
    """Scales the last axis to unit root mean square: ``gamma * x / sqrt(mean(x^2) + eps)``.

    No centring, no shift and no ``1 + gamma``, as Llama's ``RMSNorm``. Float16 and bfloat16
    inputs are normalised in float32 and cast back before ``gamma`` multiplies them, as there.
    """
    dtype = ops.dtype_name(x)
    narrow = dtype in _NARROW_FLOATS
    wide = ops.astype(x, "float32") if narrow else x
    normed = wide / ops.sqrt(ops.mean(wide * wide, -1) + eps)
    return (ops.astype(normed, dtype) if narrow else normed) * gamma


def norm_eps(norm: str, eps: float | None) -> float:
    """The epsilon of ``norm`` (``"layer"`` or ``"rms"``): ``eps``, or the norm's default."""
    if eps is not None:
        return eps
    return RMS_NORM_EPS if norm == "rms" else LAYER_NORM_EPS


#: Dtypes whose LayerNorm statistics are computed in float32.
_NARROW_FLOATS = ("float16", "bfloat16")
