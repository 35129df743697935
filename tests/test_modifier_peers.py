"""The open attention core's modifiers against peers: FlexAttention and gpt-oss's attention.

First the float64 reference of tests/reference/attention64.py is confirmed by the peers:

- ``torch.nn.attention.flex_attention.flex_attention`` (eager, float64) with score mods
  (soft-capping, a relative bias, ALiBi, a score bias) and mask mods (causal, a document mask
  from segment ids, prefix-LM, a sliding window, padding) built by ``create_block_mask``:
  its output and log-sum-exp;
- Hugging Face's gpt-oss ``eager_attention_forward`` with sinks, masks made by transformers'
  own mask functions (causal, sliding window, padding): its output and weights;
- packed sequences: the reference with segment ids equals each document run alone;
- tests/naive.py on the options the two share.

Then the library against the same peers, given the same callables (``mask_mod``,
``score_mod``), ``sinks`` and ``segment_ids``; those tests skip until ``attention_core.modifiers``
exists. FlexAttention's ``q_idx`` is the query's index, as the library's ``q_idx`` in a plain
call; its causal mod ``q_idx >= kv_idx`` is top-left, so cases with fewer queries than keys
shift it by ``K - Q`` themselves. Blockwise calls run in tiles of 2 queries by 3 keys.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

import attention_core as ac
from attention_core.kernels import blockwise
from conftest import test_backends
from tests import naive
from tests.harness import max_diff
from tests.reference.attention64 import alibi_slopes, attention64

TESTED = test_backends()
if "torch" in TESTED:
    import torch
    from torch.nn.attention.flex_attention import (
        AuxRequest,
        and_masks,
        create_block_mask,
        flex_attention,
    )

needs_torch = pytest.mark.skipif("torch" not in TESTED,
                                 reason="the torch backend is not tested in this env")
try:
    from attention_core import modifiers
except ImportError:  # the open core is not there yet
    modifiers = None
needs_core = pytest.mark.skipif(modifiers is None, reason="attention_core.modifiers is not there yet")
pytestmark = pytest.mark.filterwarnings(
    "ignore:flex_attention called without torch.compile:UserWarning")

B, H, HKV, D = 2, 4, 2, 8
TOL = {"float32": 1e-5, "float64": 1e-10}
IMPLEMENTATIONS = [None, "direct", "blockwise"]


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blockwise calls cut the keys into blocks of 3 and the queries into blocks of 2."""
    for name, value in (("KEY_BLOCK", 3), ("TILE_SCORES", 1), ("MIN_QUERY_BLOCK", 2)):
        if hasattr(blockwise, name):
            monkeypatch.setattr(blockwise, name, value)


def draw(Q: int, K: int, seed: int, kv_heads: int = HKV) -> list[np.ndarray]:
    """``q (B, H, Q, D)``, ``k``, ``v`` ``(B, kv_heads, K, D)``, float64 of float32 values."""
    rng = np.random.default_rng(seed)
    shapes = ((B, H, Q, D), (B, kv_heads, K, D), (B, kv_heads, K, D))
    return [rng.standard_normal(s).astype(np.float32).astype(np.float64) for s in shapes]


def lse_diff(got: np.ndarray, expected: np.ndarray) -> float:
    """max |diff| of two log-sum-exps; inf unless their ``-inf`` entries are the same."""
    got, expected = np.asarray(got, np.float64), np.asarray(expected, np.float64)
    empty = np.isneginf(expected)
    if not np.array_equal(np.isneginf(got), empty):
        return math.inf
    return max_diff(np.where(empty, 0.0, got), np.where(empty, 0.0, expected))


def test_alibi_slopes_are_the_papers() -> None:
    """8 heads: 1/2 ... 1/256; 6 heads: the 4-head slopes, then every other 8-head slope."""
    assert alibi_slopes(8) == [2.0 ** -n for n in range(1, 9)]
    assert alibi_slopes(6) == [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8, 2.0 ** -1, 2.0 ** -3]
    assert alibi_slopes(5) == pytest.approx(naive.alibi_slopes(5), abs=0)


@pytest.mark.parametrize("options", [
    {"valid_lens": np.array([[3, 0, 7, 1, 7], [7, 2, 5, 5, 6]]), "causal": True},
    {"mask": np.random.default_rng(7).random((B, H, 5, 7)) < 0.6, "window": 2},
    {"softcap": 1.5, "alibi": True, "score_bias": np.random.default_rng(8).standard_normal((5, 7))},
], ids=["lens_2d+causal", "mask_4d+window", "softcap+alibi+bias"])
def test_reference_equals_naive_on_the_old_options(options: dict[str, Any]) -> None:
    """On what tests/naive.py knows (lengths, masks, causal, window, soft-capping, ALiBi, a
    score bias), the two plain computations agree."""
    q, k, v = draw(5, 7, seed=6)
    out, weights, _ = attention64(q, k, v, **options)
    vis = naive.visible(B, H, 5, 7, options.get("valid_lens"), options.get("mask"),
                        options.get("causal", False), window=options.get("window"))
    n_out, n_weights = naive.dot_product(
        q, k, v, vis, positional="alibi" if options.get("alibi") else None,
        softcap=options.get("softcap"), score_bias=options.get("score_bias"))
    assert max_diff(out, n_out) <= 1e-12 and max_diff(weights, n_weights) <= 1e-12


# -- FlexAttention -----------------------------------------------------------------------------


@dataclass
class FlexCase:
    """One comparison with FlexAttention: the mods (torch callables, which the library takes
    as they are) and the reference's arguments for the same rules."""

    Q: int
    K: int
    mask_mod: Callable[..., Any] | None = None
    score_mod: Callable[..., Any] | None = None
    reference: dict[str, Any] = field(default_factory=dict)
    scale: float | None = None


DOCS = np.array([[0, 0, 0, 1, 1, 2, 2], [0, 1, 1, 1, 1, 1, 3]])  # (B, 7) segment ids
PREFIX = np.array([3, 1])
LENS = np.array([0, 5])  # example 0 sees no key: empty rows
SOFTCAP, WINDOW = 1.5, 3


def causal_mod(offset: int) -> Callable[..., Any]:
    """FlexAttention's causal mask, query ``i`` at ``i + offset``."""
    return lambda b, h, q_idx, kv_idx: kv_idx <= q_idx + offset


def flex_case(name: str, dtype: Any) -> FlexCase:
    """The case ``name``, its tensors (bias, ids) in ``dtype`` or int64."""
    docs = torch.tensor(DOCS)
    prefix, lens = torch.tensor(PREFIX), torch.tensor(LENS)
    slopes = torch.tensor(alibi_slopes(H), dtype=dtype)
    bias_np = np.random.default_rng(11).standard_normal((B, H, 7, 7)).astype(np.float32)
    bias = torch.tensor(bias_np, dtype=dtype)

    def softcap(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return SOFTCAP * torch.tanh(score / SOFTCAP)

    def relative(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return score + (q_idx - kv_idx) * 0.125  # exact in float32, which int * float gives

    def alibi(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return score - slopes[h] * torch.abs(q_idx + 2 - kv_idx)  # Q = 5, K = 7

    def add_bias(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return score + bias[b, h, q_idx, kv_idx]

    def document(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return docs[b, q_idx] == docs[b, kv_idx]

    def prefix_lm(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (kv_idx < prefix[b]) | (kv_idx <= q_idx)

    def window(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return torch.abs(q_idx - kv_idx) < WINDOW

    def padding(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return kv_idx < lens[b]

    def rel_fn(s: float, b: int, h: int, i: int, j: int) -> float:
        return s + (i - j) * 0.125

    cases = {
        "softcap": FlexCase(5, 7, score_mod=softcap, reference={"softcap": SOFTCAP}),
        "relative_bias": FlexCase(5, 7, score_mod=relative, reference={"score_fn": rel_fn},
                                  scale=0.3),
        "alibi": FlexCase(5, 7, causal_mod(2), alibi, {"alibi": True, "causal": True}),
        "score_bias": FlexCase(7, 7, score_mod=add_bias, reference={"score_bias": bias_np}),
        "causal": FlexCase(7, 7, causal_mod(0), reference={"causal": True}),
        "causal_end": FlexCase(5, 7, causal_mod(2), reference={"causal": True}),
        "document": FlexCase(7, 7, document, reference={"segment_ids": DOCS}),
        "document_causal": FlexCase(7, 7, and_masks(causal_mod(0), document),
                                    reference={"segment_ids": DOCS, "causal": True}),
        "prefix_lm": FlexCase(7, 7, prefix_lm, reference={"prefix_lens": PREFIX}),
        "window": FlexCase(7, 7, window, reference={"window": WINDOW}),
        "window_causal": FlexCase(7, 7, and_masks(window, causal_mod(0)),
                                  reference={"window": WINDOW, "causal": True}),
        "padding": FlexCase(7, 7, padding, reference={"valid_lens": LENS}),
        "softcap+document_causal": FlexCase(
            7, 7, and_masks(causal_mod(0), document), softcap,
            {"softcap": SOFTCAP, "segment_ids": DOCS, "causal": True}),
        "relative_bias+prefix_lm": FlexCase(7, 7, prefix_lm, relative,
                                            {"score_fn": rel_fn, "prefix_lens": PREFIX}),
    }
    return cases[name]


FLEX_CASES = ["softcap", "relative_bias", "alibi", "score_bias", "causal", "causal_end",
              "document", "document_causal", "prefix_lm", "window", "window_causal", "padding",
              "softcap+document_causal", "relative_bias+prefix_lm"]


def run_flex(case: FlexCase, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> tuple[Any, Any]:
    """FlexAttention's output and log-sum-exp, in float64, eagerly."""
    block_mask = None
    if case.mask_mod is not None:
        block_mask = create_block_mask(case.mask_mod, B, H, case.Q, case.K, device="cpu")
    out, aux = flex_attention(*[torch.from_numpy(a) for a in (q, k, v)], score_mod=case.score_mod,
                              block_mask=block_mask, scale=case.scale, enable_gqa=True,
                              return_aux=AuxRequest(lse=True))
    return out.numpy(), aux.lse.numpy()


@needs_torch
@pytest.mark.parametrize("name", FLEX_CASES)
def test_reference_equals_flex_attention(name: str) -> None:
    """The float64 reference's output and log-sum-exp equal FlexAttention's (float64)."""
    case = flex_case(name, torch.float64)
    q, k, v = draw(case.Q, case.K, seed=20)
    expected, expected_lse = run_flex(case, q, k, v)
    out, _, lse = attention64(q, k, v, scale=case.scale, **case.reference)
    assert max_diff(out, expected) <= 1e-12
    assert lse_diff(lse, expected_lse) <= 1e-12


@needs_torch
@needs_core
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", FLEX_CASES)
def test_library_equals_flex_attention(name: str, dtype: str) -> None:
    """The library given FlexAttention's own mods gives its output and log-sum-exp."""
    case = flex_case(name, getattr(torch, dtype))
    q, k, v = draw(case.Q, case.K, seed=21)
    expected, expected_lse = run_flex(flex_case(name, torch.float64), q, k, v)
    tensors = [torch.tensor(a, dtype=getattr(torch, dtype)) for a in (q, k, v)]
    for implementation in IMPLEMENTATIONS:
        out, lse = ac.dot_product_attention(
            *tensors, mask_mod=case.mask_mod, score_mod=case.score_mod, scale=case.scale,
            return_lse=True, implementation=implementation)
        # float32 at least, as FlexAttention's; float64 inputs keep theirs (its is float32)
        assert lse.dtype == (torch.float64 if dtype == "float64" else torch.float32)
        assert max_diff(out.numpy(), expected) <= TOL[dtype], implementation
        assert lse_diff(lse.numpy(), expected_lse) <= TOL["float32"], implementation


# -- gpt-oss attention sinks (Hugging Face transformers) -------------------------------------


SINKS = np.array([0.5, -1.0, 2.0, 0.0])
GPT_OSS_WINDOW = 3


def hf_visible(kind: str, Q: int, lens: np.ndarray) -> np.ndarray:
    """(B, 1, Q, Q) visibility from transformers' own mask functions, evaluated on the grid."""
    from transformers import masking_utils as mu

    rule = (mu.causal_mask_function if kind == "causal"
            else mu.sliding_window_causal_mask_function(GPT_OSS_WINDOW))
    keep = torch.arange(Q)[None, :] < torch.tensor(lens)[:, None]  # (B, K) padding
    fn = mu.and_masks(rule, mu.padding_mask_function(keep))
    grid = [torch.arange(n).reshape(shape) for n, shape in
            ((B, (B, 1, 1, 1)), (1, (1, 1, 1, 1)), (Q, (1, 1, Q, 1)), (Q, (1, 1, 1, Q)))]
    return np.broadcast_to(fn(*grid).numpy(), (B, 1, Q, Q))


def gpt_oss(q: np.ndarray, k: np.ndarray, v: np.ndarray, visible: np.ndarray,
            dtype: Any) -> tuple[np.ndarray, np.ndarray]:
    """``eager_attention_forward`` of a tiny ``GptOssAttention`` holding :data:`SINKS`:
    output ``(B, H, Q, D)`` and weights, masked the transformers way (the dtype's minimum)."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss import modeling_gpt_oss as m

    config = GptOssConfig(hidden_size=H * D, num_attention_heads=H, num_key_value_heads=HKV,
                          head_dim=D, num_hidden_layers=1, num_local_experts=2,
                          num_experts_per_tok=1, intermediate_size=8, vocab_size=8)
    module = m.GptOssAttention(config, layer_idx=0).to(dtype).eval()
    with torch.no_grad():
        module.sinks.copy_(torch.tensor(SINKS))
    hidden = ~torch.from_numpy(np.array(visible))
    mask = torch.zeros(hidden.shape, dtype=dtype).masked_fill(hidden, torch.finfo(dtype).min)
    with torch.no_grad():
        out, weights = m.eager_attention_forward(
            module, *(torch.tensor(a, dtype=dtype) for a in (q, k, v)), mask, scaling=D ** -0.5)
    return out.transpose(1, 2).double().numpy(), weights.double().numpy()


GPT_OSS_CASES = {"causal": np.array([6, 4]), "sliding": np.array([6, 6]),
                 "sliding_padded": np.array([6, 0])}


@needs_torch
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", list(GPT_OSS_CASES))
def test_reference_sinks_equal_gpt_oss(name: str, dtype: str) -> None:
    """gpt-oss's attention with sinks (and a padded example that sees nothing: zeros) is the
    reference's with ``sinks``."""
    pytest.importorskip("transformers")
    Q, lens = 6, GPT_OSS_CASES[name]
    q, k, v = draw(Q, Q, seed=30)
    expected, expected_weights = gpt_oss(q, k, v, hf_visible(name.split("_")[0], Q, lens),
                                         getattr(torch, dtype))
    window = None if name == "causal" else GPT_OSS_WINDOW
    out, weights, _ = attention64(q, k, v, causal=True, window=window, valid_lens=lens,
                                  sinks=SINKS)
    assert max_diff(out, expected) <= TOL[dtype]
    assert max_diff(weights, expected_weights) <= TOL[dtype]


@needs_torch
@needs_core
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", list(GPT_OSS_CASES))
def test_library_sinks_equal_gpt_oss(name: str, dtype: str) -> None:
    """``sinks=`` gives gpt-oss's output on every path, and its weights on the direct one."""
    pytest.importorskip("transformers")
    Q, lens = 6, GPT_OSS_CASES[name]
    q, k, v = draw(Q, Q, seed=31)
    expected, expected_weights = gpt_oss(q, k, v, hf_visible(name.split("_")[0], Q, lens),
                                         torch.float64)
    t = getattr(torch, dtype)
    args = [torch.tensor(a, dtype=t) for a in (q, k, v)]
    kw: dict[str, Any] = {"valid_lens": torch.tensor(lens), "causal": True,
                          "sinks": torch.tensor(SINKS, dtype=t),
                          "window": None if name == "causal" else GPT_OSS_WINDOW}
    out, weights = ac.dot_product_attention(*args, **kw, return_weights=True,
                                            implementation="direct")
    assert max_diff(weights.numpy(), expected_weights) <= TOL[dtype]
    for implementation in IMPLEMENTATIONS:
        out = ac.dot_product_attention(*args, **kw, implementation=implementation)
        assert max_diff(out.numpy(), expected) <= TOL[dtype], implementation


# -- packed sequences ---------------------------------------------------------------------------


PACKED = np.array([[0, 0, 0, 1, 1, 2, 2, 2], [0, 0, 0, 0, 0, 1, 1, 1]])


def documents(ids: np.ndarray) -> list[tuple[int, int, int]]:
    """``(example, start, stop)`` of every run of equal ids."""
    runs = []
    for b, row in enumerate(ids):
        start = 0
        for t in range(1, len(row) + 1):
            if t == len(row) or row[t] != row[start]:
                runs.append((b, start, t))
                start = t
    return runs


@pytest.mark.parametrize("pair", [False, True], ids=["ids", "query_and_key_ids"])
@pytest.mark.parametrize("causal", [False, True])
def test_reference_packed_equals_each_document_alone(causal: bool, pair: bool) -> None:
    q, k, v = draw(8, 8, seed=40)
    ids = (PACKED, PACKED) if pair else PACKED
    out, _, lse = attention64(q, k, v, segment_ids=ids, causal=causal, alibi=True)
    for b, start, stop in documents(PACKED):
        part = slice(start, stop)
        alone, _, alone_lse = attention64(q[b:b + 1, :, part], k[b:b + 1, :, part],
                                          v[b:b + 1, :, part], causal=causal, alibi=True)
        assert max_diff(out[b:b + 1, :, part], alone) <= 1e-12
        assert max_diff(lse[b:b + 1, :, part], alone_lse) <= 1e-12


@needs_torch
@needs_core
@pytest.mark.parametrize("form", ["keyword", "pair", "modifier"])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_library_packed_equals_separate_calls(implementation: str | None, form: str) -> None:
    """Packed documents (causal, with ALiBi) give what each document gives in a call of its own."""
    q, k, v = (torch.tensor(a, dtype=torch.float32) for a in draw(8, 8, seed=41))
    ids = torch.tensor(PACKED)
    forms: dict[str, dict[str, Any]] = {"keyword": {"segment_ids": ids},
                                        "pair": {"segment_ids": (ids, ids)},
                                        "modifier": {"mask_mod": modifiers.segments(ids)}}
    packing = forms[form]
    out, lse = ac.dot_product_attention(q, k, v, causal=True, positional="alibi", return_lse=True,
                                        implementation=implementation, **packing)
    for b, start, stop in documents(PACKED):
        part = slice(start, stop)
        alone, alone_lse = ac.dot_product_attention(
            q[b:b + 1, :, part], k[b:b + 1, :, part], v[b:b + 1, :, part], causal=True,
            positional="alibi", return_lse=True, implementation=implementation)
        assert max_diff(out[b:b + 1, :, part].numpy(), alone.numpy()) <= TOL["float32"]
        assert lse_diff(lse[b:b + 1, :, part].numpy(), alone_lse.numpy()) <= TOL["float32"]
