"""Mixed precision: float32 weights, computations in float16 or bfloat16, tested once over the
hooks against the float64 reference files and tests/naive.py.

Hooks used besides the harness's (``tests/hooks/<backend>_hooks.py``; a backend without them
skips, saying why):

* ``mixed_precision(dtype) -> context manager``: inside it, the calls of float32 layers compute
  in ``dtype`` where the framework's mixed precision does (torch: ``torch.autocast``), their
  weights and weight gradients staying float32;
* ``graph_captured(layer) -> callable``: the layer under the framework's whole-graph capture,
  without code generation (torch: ``torch.compile(fullgraph=True, backend="eager")``);
* ``adam_steps(make_layer, args, target, steps, mixed) -> (losses, first_gradients, moved)``:
  ``steps`` Adam steps (lr 0.01) of a layer made by ``make_layer()`` after seeding the
  framework with 0, on ``mean((layer(*args) - target) ** 2)``, in mixed precision ``mixed``
  unless None; the losses, the first step's gradients by weight name (the framework's arrays),
  and whether every weight moved at every step.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests import naive
from tests.harness import LOW_PRECISION_UNBOUNDED_GRADIENTS, TOLERANCE, Harness, max_diff, tolerance
from tests.reference.cases import Case
from tests.reference.generate import record
from tests.reference.gradients import case_data, gradient_cases, key, stored_gradients

MIXED = ("bfloat16", "float16")
FUSABLE = ("DotProductAttention", "MultiHeadAttention", "TransformerEncoderBlock")


def hook(h: Harness, name: str) -> Any:
    found = getattr(h.hooks, name, None)
    if found is None:
        pytest.skip(f"tests/hooks/{h.name}_hooks.py has no {name}: no mixed precision tested "
                    f"there (TensorFlow's mixed_float16 policy: tests/test_tensorflow.py)")
    return found


def mixed_cases() -> list[Any]:
    """One gradient case per layer and mask kind (no edge-shape variants), on the direct path
    and, for the layers that have one, the fused path."""
    cases = [c for c in gradient_cases()
             if "-" not in c.name or c.layer in ("PositionalEncoding", "NadarayaWatson")]
    return [pytest.param(c, keep, id=f"{key(c)}-{'direct' if keep else 'fused'}")
            for c in cases for keep in (True, False) if keep or c.layer in FUSABLE]


@pytest.mark.parametrize("dtype", MIXED)
@pytest.mark.parametrize(("case", "keep"), mixed_cases())
def test_every_layer_in_mixed_precision_matches_reference(
    backend: str, case: Case, keep: bool, dtype: str,
) -> None:
    """A float32 layer called in mixed precision, forward and backward (the loss in float32):
    outputs and gradients within ``dtype``'s tolerance of the float64 files (the encoder's
    gradients finite only, tests/harness.py), the gradients float32 like the weights."""
    h = Harness(backend)
    mixed = hook(h, "mixed_precision")
    keeps = {"keep_attention_weights": keep} if case.layer in FUSABLE else {}
    layer = h.make(case.layer, {**case.config, **keeps}, "float32")
    rec = record(case)
    weights = {k[len("weight."):]: v for k, v in rec.items() if k.startswith("weight.")}
    if weights:
        layer.set_weights(weights)
    inputs, _, call = case_data(case)
    ref = stored_gradients(case)
    kwargs = {k: (v if k == "causal" else h.array(v)) for k, v in call.items()}

    def forward(m: Any, *xs: Any) -> dict[str, Any]:
        with mixed(dtype):
            out = h.call(m, *xs, **kwargs)
        return {"out": h.ops.astype(out, "float32")}

    result, grads = h.forward_and_gradients(
        layer, forward, [h.array(x, "float32") for x in inputs], ref["cotangent"])
    assert max_diff(h.numpy(result["out"]), rec["output.out"]) <= TOLERANCE[dtype]
    floating = {f"input.{i}" for i, x in enumerate(inputs) if x.dtype.kind == "f"}
    assert set(grads) == floating | {f"weight.{n}" for n in layer.get_weights()}
    for name, grad in grads.items():
        assert h.ops.dtype_name(grad) == "float32", name
        got = h.numpy(grad)
        assert np.isfinite(got).all(), name
        bound = tolerance("grad." + name, dtype, ref[name])
        assert np.any(got != 0) or np.abs(ref[name]).max() <= bound, name  # the gradient flows
        if case.layer not in LOW_PRECISION_UNBOUNDED_GRADIENTS:
            assert max_diff(got, ref[name]) <= bound, name


@pytest.mark.parametrize("captured", [False, True], ids=["eager", "captured"])
@pytest.mark.parametrize("implementation", ["direct", "blockwise", "fused"])
def test_mixed_precision_every_path_over_many_key_blocks(
    backend: str, implementation: str, captured: bool,
) -> None:
    """float32 inputs in bfloat16, keys over three blocks of the blockwise path and rows with no
    visible key: every path, eager and graph-captured, gives bfloat16 within its tolerance of
    float64 NumPy (the fill is the scores' dtype's, not the queries'; the mended NaN rows keep
    the kernel's dtype)."""
    h = Harness(backend)
    mixed = hook(h, "mixed_precision")
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal(shape) for shape in ((2, 4, 8), (2, 2100, 8), (2, 2100, 8)))
    lens = np.array([[0, 5, 2100, 1500], [2100, 1100, 0, 3]])  # (B, Q)
    expected = naive.dot_product(q[:, None], k[:, None], v[:, None],
                                 naive.visible(2, 1, 4, 2100, lens))[0][:, 0]
    layer = h.make("DotProductAttention", {"keep_attention_weights": False,
                                           "implementation": implementation})
    call = hook(h, "graph_captured")(layer) if captured else layer
    with mixed("bfloat16"):
        out = call(*(h.array(x, "float32") for x in (q, k, v)), h.array(lens))
    assert h.ops.dtype_name(out) == "bfloat16"
    assert max_diff(h.numpy(out), expected) <= TOLERANCE["bfloat16"]


@pytest.mark.parametrize("dtype", MIXED)
def test_encoder_training_steps_in_mixed_precision(backend: str, dtype: str) -> None:
    """Adam steps on an encoder in mixed precision: float32 gradients within four times
    ``dtype``'s reach of the float32 run's, every weight moved at every step, the loss lower
    after five steps."""
    h = Harness(backend)
    adam_steps = hook(h, "adam_steps")
    args = [h.array(np.array([[1, 3, 3, 7, 2], [4, 1, 7, 7, 0]])), h.array(np.array([5, 3]))]
    target = np.random.default_rng(1).standard_normal((2, 5, 12)).astype(np.float32)
    config = {"vocab_size": 11, "num_hiddens": 12, "ffn_num_hiddens": 16, "num_heads": 3,
              "num_blks": 2}

    def make() -> Any:
        return h.make("TransformerEncoder", config, "float32")

    losses, grads, moved = adam_steps(make, args, target, 5, dtype)
    _, exact, exact_moved = adam_steps(make, args, target, 1, None)
    assert moved and exact_moved and losses[-1] < losses[0]
    assert set(grads) == set(exact) == set(make().get_weights())
    for name, grad in grads.items():
        assert h.ops.dtype_name(grad) == "float32", name
        got, want = h.numpy(grad), h.numpy(exact[name])
        assert np.isfinite(got).all(), name
        assert max_diff(got, want) <= 4 * TOLERANCE[dtype] * max(1.0, float(np.abs(want).max())), name
