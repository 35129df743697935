"""The table of reference cases: every layer and every mask kind, one place.

The generator (``python -m tests.reference.generate``) draws inputs and weights for each case
from a seeded generator, computes outputs in float64 with the NumPy core, and writes one
``.npz`` per layer. Every backend's tests read the same files.

The decoder layers attend more than once per call. Their mask kinds name the attention they
restrict by a prefix (:data:`MASK_SIDES`): ``enc_mask_3d`` is ``mask_3d`` drawn for the
cross-attention (queries the decoder's input, keys the encoder outputs) and passed as
``enc_mask``; a kind joins several with ``+`` (``valid_lens_2d+enc_fully_masked_row``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Shapes: B batch, Q queries, K keys (K > Q so "causal" tests the end alignment).
B, Q, K = 2, 4, 6

#: Mask kinds shared by every attention layer. Each maps to call keyword arguments built by
#: :func:`mask_arguments`.
MASK_KINDS = (
    "none",
    "valid_lens_1d",
    "valid_lens_2d",
    "mask_2d",
    "mask_3d",
    "mask_4d",
    "causal",
    "causal_valid_lens",
    "fully_masked_row",
)

#: Edge shapes of the attention layers, ``(batch, queries, keys)``; each runs with every mask
#: kind. The cases named by the mask kind alone use ``(B, Q, K)``: keys longer than queries.
#: With keys shorter than queries, ``causal`` aligns at the end, so the first ``Q - K`` queries
#: see no key at all (fully masked rows made by the causal rule alone).
EDGE_SHAPES = {
    "keys_shorter": (2, 5, 2),
    "batch_1": (1, 4, 6),
    "length_1": (2, 1, 1),
}

#: Edge head layouts of ``MultiHeadAttention`` and ``TransformerEncoderBlock``,
#: ``(num_hiddens, num_heads)``, with every mask kind and the ``(B, Q, K)`` shapes.
EDGE_HEADS = {
    "single_head": (6, 1),
    "head_depth_1": (3, 3),
}


def mask_arguments(kind: str, rng: np.random.Generator, heads: int, q: int = Q,
                   k: int = K, b: int = B) -> dict[str, Any]:
    """Draws the masking arguments of one kind for ``b`` examples of ``q`` queries and ``k``
    keys; every row keeps a visible key except in ``fully_masked_row`` (and where ``causal``
    with fewer keys than queries hides every key from the first queries)."""
    def random_mask(shape: tuple[int, ...]) -> np.ndarray:
        m = rng.random(shape) < 0.6
        m[..., 0] = True  # keep one visible key per row
        return m

    if kind == "none":
        return {}
    if kind == "valid_lens_1d":
        return {"valid_lens": np.array(([min(3, k), k] + [k] * b)[:b], dtype=np.int64)}
    if kind == "valid_lens_2d":
        return {"valid_lens": rng.integers(1, k + 1, size=(b, q)).astype(np.int64)}
    if kind == "mask_2d":
        return {"mask": random_mask((q, k))}
    if kind == "mask_3d":
        return {"mask": random_mask((b, q, k))}
    if kind == "mask_4d":
        return {"mask": random_mask((b, heads, q, k))}
    if kind == "causal":
        return {"causal": True}
    if kind == "causal_valid_lens":
        return {"causal": True,
                "valid_lens": np.array(([k - 1, min(2, k)] + [k] * b)[:b], dtype=np.int64)}
    if kind == "valid_lens_1d_zero":  # example 0 sees no key at all (not in MASK_KINDS)
        return {"valid_lens": np.array(([0, min(3, k)] + [k] * b)[:b], dtype=np.int64)}
    if kind == "fully_masked_row":
        lens = rng.integers(1, k + 1, size=(b, q)).astype(np.int64)
        lens[0, min(1, q - 1)] = 0  # example 0, query 1 sees nothing
        mask = random_mask((b, q, k))
        mask[b - 1, min(2, q - 1)] = False  # the last example, query 2 sees nothing
        return {"valid_lens": lens, "mask": mask}
    raise ValueError(kind)


#: Prefixes of a decoder layer's mask kinds: the attention they restrict, as the inputs whose
#: lengths its queries and keys have (None: the case's first input for the queries; for the keys
#: its ``keys`` input, else the queries). The prefix is also that of the call's arguments
#: (``enc_`` + ``valid_lens``: ``enc_valid_lens``).
MASK_SIDES: dict[str, tuple[str | None, str | None]] = {
    "": (None, None),  # the self-attention (or the attention layer's only one)
    "enc_": (None, "enc_outputs"),  # a decoder's cross-attention over the encoder outputs
    "src_": ("src_tokens", "src_tokens"),  # the encoder-decoder's source lengths
    "tgt_": ("tgt_tokens", "tgt_tokens"),  # the encoder-decoder's target lengths
}


def mask_parts(kind: str) -> list[tuple[str, str]]:
    """The ``(prefix, kind)`` parts of a mask kind: ``"mask_2d+enc_valid_lens_1d"`` ->
    ``[("", "mask_2d"), ("enc_", "valid_lens_1d")]``."""
    parts = []
    for part in kind.split("+"):
        prefix = next((p for p in MASK_SIDES if p and part.startswith(p)), "")
        parts.append((prefix, part[len(prefix):]))
    return parts


def case_masks(kind: str, inputs: dict[str, tuple[int, ...]], rng: np.random.Generator,
               heads: int) -> dict[str, Any]:
    """Draws the call's masking arguments of a mask kind (see :func:`mask_parts`), each part
    for the lengths of its attention's queries and keys in ``inputs`` (name -> shape)."""
    first = next(iter(inputs.values()))
    out: dict[str, Any] = {}
    for prefix, part in mask_parts(kind):
        queries, keys = MASK_SIDES[prefix]
        q = inputs[queries][1] if queries else first[1]
        k = inputs[keys][1] if keys else inputs["keys"][1] if "keys" in inputs else q
        drawn = mask_arguments(part, rng, heads, q=q, k=k, b=first[0])
        out.update({prefix + name: value for name, value in drawn.items()})
    return out


@dataclass(frozen=True)
class Case:
    """One reference case: a layer, its constructor arguments and its call's inputs.

    ``extra`` holds call arguments other than masks: ``score_bias`` (its rank, 2 to 4; drawn
    from N(0, 1), with one visible score given ``-inf`` in the rank-4 ones), ``start_index``
    (an int) or ``positions`` (their shape, ``(T,)`` or ``(B, T)``; drawn in ``[0, 100)``).
    """

    layer: str
    name: str
    config: dict[str, Any]
    inputs: dict[str, tuple[int, ...]]  # input name -> shape (drawn from N(0, 1))
    mask_kind: str | None = None
    heads: int = 1
    extra: dict[str, Any] = field(default_factory=dict)
    edge: str | None = None  # the edge shape or head layout (EDGE_SHAPES, EDGE_HEADS), if any


#: Inputs holding integer token ids, by the constructor argument giving their number of ids
#: (drawn in ``[0, that)``; they have no gradient).
INTEGER_INPUTS = {"tokens": "vocab_size", "src_tokens": "src_vocab_size",
                  "tgt_tokens": "tgt_vocab_size"}

#: Constructor arguments of the relative-position attention cases: with 6 keys and 4 queries,
#: offsets run from -5 to 2, so m = 2 clips on both sides.
RELATIVE = {"num_hiddens": 12, "num_heads": 3, "max_relative_position": 2, "dropout": 0.0}

#: Constructor arguments of the encoder cases: two blocks, so a block's input is another's output.
ENCODER = {"vocab_size": 11, "num_hiddens": 12, "ffn_num_hiddens": 16, "num_heads": 3,
           "num_blks": 2, "dropout": 0.0}


#: Constructor arguments of the decoder block cases (width 12, so the encoder outputs' too).
DECODER_BLOCK = {"num_hiddens": 12, "ffn_num_hiddens": 16, "num_heads": 3, "dropout": 0.0}

#: Constructor arguments of the decoder cases: two blocks, as the encoder's.
DECODER = ENCODER

#: Constructor arguments of the encoder-decoder cases: two blocks each side, target ids other
#: than the source's (13 and 11), so that each embedding is checked against its own tokens.
TRANSFORMER = {"src_vocab_size": 11, "tgt_vocab_size": 13, "num_hiddens": 12,
               "ffn_num_hiddens": 16, "num_heads": 3, "num_blks": 2, "dropout": 0.0}

#: The mask kinds of the decoder cases (base shapes only: the decoder's inputs are Q = 4 long,
#: the encoder outputs' and the source K = 6, so the cross-attention's keys are the longer).
#: The block's self-attention (always causal) and cross-attention each with every kind their
#: call takes (a 1-D length of 0 too: an example that sees no encoder output), both at once,
#: two with biases; then the decoder-only block, the decoder stack with and without
#: cross-attention, and the encoder-decoder with source and target lengths. Names:
#: ``<mask kind>[_bias]``, decoder-only ones ``decoder_only-<mask kind>``.
SELF_KINDS = tuple(k for k in MASK_KINDS if not k.startswith("causal"))
DECODER_BLOCK_KINDS = (
    *SELF_KINDS,
    *(f"enc_{k}" for k in ("valid_lens_1d", "valid_lens_1d_zero", *SELF_KINDS[2:])),
)
DECODER_BLOCK_BIAS_KINDS = ("mask_3d+enc_valid_lens_2d", "fully_masked_row+enc_fully_masked_row")
DECODER_ONLY_BLOCK_KINDS = {"none": False, "mask_4d": True, "fully_masked_row": False}
DECODER_KINDS = ("none", "enc_valid_lens_1d", "valid_lens_2d+enc_fully_masked_row",
                 "mask_3d+enc_mask_4d")
DECODER_ONLY_KINDS = ("valid_lens_1d", "mask_2d")
TRANSFORMER_KINDS = ("none", "src_valid_lens_1d", "src_valid_lens_1d+tgt_valid_lens_2d",
                     "src_valid_lens_1d_zero+tgt_valid_lens_1d")


def _attention_inputs(layer: str, b: int, q: int, k: int) -> dict[str, tuple[int, ...]]:
    """Input shapes of an attention layer for ``b`` examples, ``q`` queries and ``k`` keys."""
    if layer == "DotProductAttention":
        return {"queries": (b, q, 8), "keys": (b, k, 8), "values": (b, k, 5)}
    multihead = layer in ("MultiHeadAttention", "RelativeMultiHeadAttention")
    return {"queries": (b, q, 10), "keys": (b, k, 7 if multihead else 6),
            "values": (b, k, 9 if multihead else 5)}


def _decoder_cases() -> list[Case]:
    """The cases of the decoder block, the decoder and the encoder-decoder (base shapes)."""
    X, enc = (B, Q, 12), (B, K, 12)
    block, decoder, heads = "TransformerDecoderBlock", "TransformerDecoder", 3
    cases = [Case(block, kind, DECODER_BLOCK, {"X": X, "enc_outputs": enc}, kind, heads)
             for kind in DECODER_BLOCK_KINDS]
    cases += [Case(block, f"{kind}_bias", {**DECODER_BLOCK, "bias": True},
                   {"X": X, "enc_outputs": enc}, kind, heads) for kind in DECODER_BLOCK_BIAS_KINDS]
    cases += [Case(block, f"decoder_only-{kind}{'_bias' if bias else ''}",
                   {**DECODER_BLOCK, "bias": bias, "decoder_only": True}, {"X": X}, kind, heads)
              for kind, bias in DECODER_ONLY_BLOCK_KINDS.items()]
    cases += [Case(decoder, kind, DECODER, {"tokens": (B, Q), "enc_outputs": enc}, kind, heads)
              for kind in DECODER_KINDS]
    cases += [Case(decoder, f"decoder_only-{kind}", {**DECODER, "decoder_only": True},
                   {"tokens": (B, Q)}, kind, heads) for kind in DECODER_ONLY_KINDS]
    cases += [Case("Transformer", kind, TRANSFORMER, {"src_tokens": (B, K), "tgt_tokens": (B, Q)},
                   kind, heads) for kind in TRANSFORMER_KINDS]
    return cases


#: The attention of current models: ``MultiHeadAttention`` options, each with every mask kind
#: (:data:`MODERN_KINDS` for the few with fewer). Width 16 over 4 heads (depth 4: rotary
#: pairs), biases on. ``score_bias`` is a call argument (its rank cycles through 2, 3 and 4
#: over the mask kinds); ``llama`` joins grouped-query heads, rotary positions, a window,
#: soft-capping and a score bias.
MODERN: dict[str, dict[str, Any]] = {
    "gqa": {"num_kv_heads": 2},
    "mqa": {"num_kv_heads": 1},
    "rotary": {"positional": "rotary"},
    "alibi": {"positional": "alibi"},
    "window": {"window": 2},
    "softcap": {"softcap": 0.5},
    "score_bias": {},
    "llama": {"num_kv_heads": 2, "positional": "rotary", "rotary_base": 500.0, "window": 3,
              "softcap": 2.0},
}
MODERN_MULTI_HEAD = {"num_hiddens": 16, "num_heads": 4, "dropout": 0.0, "bias": True}
#: Options with a score bias drawn for the call.
MODERN_BIASED = ("score_bias", "llama")
#: Mask kinds of the options that do not take every one.
MODERN_KINDS = {"mqa": ("none", "causal", "fully_masked_row")}
#: ``DotProductAttention`` with the score options (one head: ALiBi's slope is 2**-8).
MODERN_DOT_PRODUCT = {
    "window-causal": {"window": 3},
    "rotary-mask_3d": {"positional": "rotary"},
    "alibi-valid_lens_2d": {"positional": "alibi"},
    "softcap_bias-fully_masked_row": {"softcap": 1.0},
}


#: Constructor arguments of the attention layers that are keyword arguments of the functions.
FUNCTION_OPTIONS = ("num_kv_heads", "positional", "rotary_base", "window", "softcap")


def function_options(case: Case) -> dict[str, Any]:
    """The case's constructor arguments that the core's attention functions take as keywords."""
    return {name: case.config[name] for name in FUNCTION_OPTIONS if name in case.config}


def has_score_terms(case: Case) -> bool:
    """Whether the case's scores get soft-capping, ALiBi or a score bias (never fused)."""
    config = case.config
    return (config.get("softcap") is not None or config.get("positional") == "alibi"
            or "score_bias" in case.extra)


def _modern_cases() -> list[Case]:
    """The cases of :data:`MODERN`, :data:`MODERN_DOT_PRODUCT` and ``RotaryEmbedding``."""
    cases = []
    inputs = _attention_inputs("MultiHeadAttention", B, Q, K)
    for option, config in MODERN.items():
        for i, kind in enumerate(MODERN_KINDS.get(option, MASK_KINDS)):
            extra = {"score_bias": 2 + i % 3} if option in MODERN_BIASED else {}
            cases.append(Case("MultiHeadAttention", f"{option}-{kind}",
                              {**MODERN_MULTI_HEAD, **config}, inputs, kind, heads=4,
                              extra=extra))
    for name, config in MODERN_DOT_PRODUCT.items():
        kind = name.split("-", 1)[1]
        extra = {"score_bias": 4} if "bias" in name else {}
        cases.append(Case("DotProductAttention", name, {"dropout": 0.0, **config},
                          _attention_inputs("DotProductAttention", B, Q, K), kind, extra=extra))
    # decoders of current models: grouped-query heads, rotary or ALiBi positions, a window
    X, enc = (B, Q, 16), (B, K, 16)
    block = {**DECODER_BLOCK, "num_hiddens": 16, "num_heads": 4, "bias": True}
    llama = {k: v for k, v in MODERN["llama"].items()}
    for kind in ("none", "valid_lens_1d", "mask_4d", "fully_masked_row"):
        cases.append(Case("TransformerDecoderBlock", f"decoder_only-llama-{kind}",
                          {**block, "decoder_only": True, **llama}, {"X": X}, kind, 4))
    cases.append(Case("TransformerDecoderBlock", "alibi-mask_3d+enc_valid_lens_2d",
                      {**block, "positional": "alibi", "num_kv_heads": 1},
                      {"X": X, "enc_outputs": enc}, "mask_3d+enc_valid_lens_2d", 4))
    stack = {**DECODER, "num_hiddens": 16, "num_heads": 4}
    cases.append(Case("TransformerDecoder", "decoder_only-llama-valid_lens_1d",
                      {**stack, "decoder_only": True, **llama}, {"tokens": (B, Q)},
                      "valid_lens_1d", 4))
    cases.append(Case("TransformerDecoder", "alibi-enc_valid_lens_1d",
                      {**stack, "positional": "alibi", "num_kv_heads": 2, "window": 2},
                      {"tokens": (B, Q), "enc_outputs": enc}, "enc_valid_lens_1d", 4))
    cases.append(Case("RotaryEmbedding", "basic", {}, {"X": (B, 5, 8)}))
    cases.append(Case("RotaryEmbedding", "heads-start", {"base": 500.0}, {"X": (B, 5, 3, 6)},
                      extra={"start_index": 7}))
    cases.append(Case("RotaryEmbedding", "positions_1d", {}, {"X": (B, 5, 8)},
                      extra={"positions": (5,)}))
    cases.append(Case("RotaryEmbedding", "positions_2d", {}, {"X": (B, 5, 2, 8)},
                      extra={"positions": (B, 5)}))
    return cases


def build_cases() -> list[Case]:
    """Every reference case, in a fixed order."""
    cases: list[Case] = []
    for kind in MASK_KINDS:
        cases.append(Case("DotProductAttention", kind, {"dropout": 0.0},
                          _attention_inputs("DotProductAttention", B, Q, K), kind))
        cases.append(Case("AdditiveAttention", kind, {"num_hiddens": 7, "dropout": 0.0},
                          _attention_inputs("AdditiveAttention", B, Q, K), kind))
        for bias in (False, True):
            cases.append(Case(
                "MultiHeadAttention", f"{kind}{'_bias' if bias else ''}",
                {"num_hiddens": 12, "num_heads": 3, "dropout": 0.0, "bias": bias},
                _attention_inputs("MultiHeadAttention", B, Q, K), kind, heads=3,
            ))
        cases.append(Case("RelativeMultiHeadAttention", kind, {**RELATIVE, "bias": True},
                          _attention_inputs("RelativeMultiHeadAttention", B, Q, K), kind, heads=3))
        if not kind.startswith("causal"):  # the encoder block's call has no causal argument
            cases.append(Case(
                "TransformerEncoderBlock", kind,
                {"num_hiddens": 12, "ffn_num_hiddens": 16, "num_heads": 3, "dropout": 0.0},
                {"X": (B, K, 12)}, kind, heads=3,
            ))
            cases.append(Case("TransformerEncoder", kind, ENCODER, {"tokens": (B, K)}, kind,
                              heads=3))
    for kind in ("none", "causal", "fully_masked_row"):  # keys only, no bias, m = 1
        cases.append(Case(
            "RelativeMultiHeadAttention", f"keys_only-{kind}",
            {**RELATIVE, "max_relative_position": 1, "relative_values": False},
            _attention_inputs("RelativeMultiHeadAttention", B, Q, K), kind, heads=3,
        ))
    cases.append(Case("MultiHeadAttention", "single_head_depth_1",
                      {"num_hiddens": 1, "num_heads": 1, "dropout": 0.0, "bias": False},
                      {"queries": (1, 1, 3), "keys": (1, 2, 3), "values": (1, 2, 3)}, "none",
                      edge="single_head_depth_1"))
    cases.append(Case("MultiHeadAttention", "keys_shorter",
                      {"num_hiddens": 8, "num_heads": 4, "dropout": 0.0, "bias": True},
                      {"queries": (B, 5, 8), "keys": (B, 2, 8), "values": (B, 2, 8)}, "none",
                      edge="keys_shorter"))
    # Edge shapes and head layouts, each with every mask kind.
    for shape, (b, q, k) in EDGE_SHAPES.items():
        for kind in MASK_KINDS:
            name = f"{shape}-{kind}"
            cases.append(Case("DotProductAttention", name, {"dropout": 0.0},
                              _attention_inputs("DotProductAttention", b, q, k), kind, edge=shape))
            cases.append(Case("AdditiveAttention", name, {"num_hiddens": 7, "dropout": 0.0},
                              _attention_inputs("AdditiveAttention", b, q, k), kind, edge=shape))
            cases.append(Case("MultiHeadAttention", name,
                              {"num_hiddens": 12, "num_heads": 3, "dropout": 0.0, "bias": True},
                              _attention_inputs("MultiHeadAttention", b, q, k), kind, heads=3,
                              edge=shape))
            cases.append(Case("RelativeMultiHeadAttention", name, RELATIVE,
                              _attention_inputs("RelativeMultiHeadAttention", b, q, k), kind,
                              heads=3, edge=shape))
            # self-attention has one length for queries and keys, and no causal argument
            if shape != "keys_shorter" and not kind.startswith("causal"):
                cases.append(Case(
                    "TransformerEncoderBlock", name,
                    {"num_hiddens": 12, "ffn_num_hiddens": 16, "num_heads": 3, "dropout": 0.0},
                    {"X": (b, k, 12)}, kind, heads=3, edge=shape,
                ))
                cases.append(Case("TransformerEncoder", name, ENCODER, {"tokens": (b, k)}, kind,
                                  heads=3, edge=shape))
    for shape, (h, heads) in EDGE_HEADS.items():
        for kind in MASK_KINDS:
            name = f"{shape}-{kind}"
            cases.append(Case("MultiHeadAttention", name,
                              {"num_hiddens": h, "num_heads": heads, "dropout": 0.0, "bias": True},
                              _attention_inputs("MultiHeadAttention", B, Q, K), kind, heads=heads,
                              edge=shape))
            cases.append(Case("RelativeMultiHeadAttention", name,
                              {**RELATIVE, "num_hiddens": h, "num_heads": heads},
                              _attention_inputs("RelativeMultiHeadAttention", B, Q, K), kind,
                              heads=heads, edge=shape))
            if not kind.startswith("causal"):
                cases.append(Case(
                    "TransformerEncoderBlock", name,
                    {"num_hiddens": h, "ffn_num_hiddens": 5, "num_heads": heads, "dropout": 0.0},
                    {"X": (B, K, h)}, kind, heads=heads, edge=shape,
                ))
    for width in (16, 7):
        cases.append(Case("PositionalEncoding", f"width_{width}",
                          {"num_hiddens": width, "dropout": 0.0, "max_len": 20},
                          {"X": (B, 5, width)}))
    cases.append(Case("PositionalEncoding", "batch_1-length_1",
                      {"num_hiddens": 16, "dropout": 0.0, "max_len": 20}, {"X": (1, 1, 16)},
                      edge="batch_1-length_1"))
    cases.append(Case("LearnedPositionalEncoding", "basic",
                      {"num_hiddens": 16, "dropout": 0.0, "max_len": 20}, {"X": (B, 5, 16)}))
    cases.append(Case("LearnedPositionalEncoding", "batch_1-length_1",
                      {"num_hiddens": 16, "dropout": 0.0, "max_len": 20}, {"X": (1, 1, 16)},
                      edge="batch_1-length_1"))
    cases.append(Case("PositionWiseFFN", "basic", {"ffn_num_hiddens": 16, "ffn_num_outputs": 9},
                      {"X": (B, 5, 12)}))
    cases.append(Case("PositionWiseFFN", "batch_1-length_1",
                      {"ffn_num_hiddens": 16, "ffn_num_outputs": 9}, {"X": (1, 1, 12)},
                      edge="batch_1-length_1"))
    cases.append(Case("AddNorm", "basic", {"num_hiddens": 12, "dropout": 0.0},
                      {"X": (B, 5, 12), "Y": (B, 5, 12)}))
    cases.append(Case("AddNorm", "batch_1-length_1", {"num_hiddens": 12, "dropout": 0.0},
                      {"X": (1, 1, 12), "Y": (1, 1, 12)}, edge="batch_1-length_1"))
    for parametric in (False, True):
        tag = "parametric" if parametric else "plain"
        cases.append(Case("NadarayaWatson", tag, {"parametric": parametric},
                          {"queries": (B, 5), "keys": (B, 7), "values": (B, 7)}))
        cases.append(Case("NadarayaWatson", f"{tag}_unbatched", {"parametric": parametric},
                          {"queries": (9,), "keys": (11,), "values": (11,)}))
        cases.append(Case("NadarayaWatson", f"{tag}_batch_1-one_key", {"parametric": parametric},
                          {"queries": (1, 3), "keys": (1, 1), "values": (1, 1)},
                          edge="batch_1-one_key"))
    return cases + _decoder_cases() + _modern_cases()


CASES = build_cases()
LAYERS = sorted({c.layer for c in CASES})
