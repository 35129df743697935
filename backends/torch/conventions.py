"""torch's call keywords, which the torch layers take beside the library's, with torch's meaning.

Listed as :class:`~attention_core.conventions.Keyword` values, named by
:class:`backends.torch.layers.Layer` (``convention = TORCH``); :mod:`attention_core.conventions`
binds and converts them. Inputs are batch-first ``(B, T, D)``.

=================================  =================================================================
``query``, ``key``, ``value``      the queries, keys and values (``src``: the encoder block's X)
``attn_mask``, ``src_mask``        bool ``(Q, K)`` or ``(B*H, Q, K)``, True = may **not** attend;
                                   or float, added to the scores (``score_bias``)
``key_padding_mask``,              bool ``(B, K)``, True = padding (hidden); or float ``(B, K)``,
``src_key_padding_mask``           added to every query's scores
``is_causal``                      query i sees keys j <= i; given with ``attn_mask`` (torch's
                                   "hint"), both apply (AND)
``need_weights``,                  return torch's ``(out, weights)``: weights averaged over the
``average_attn_weights``           heads ``(B, Q, K)`` unless ``average_attn_weights=False``
                                   ``(B, H, Q, K)``; ``(out, None)`` for ``need_weights=False``
=================================  =================================================================

torch aligns its causal mask at the first key, the library's ``causal=True`` at the last: for
Q != K ``is_causal`` is refused. torch returns weights after dropout; here they are before
dropout. A bool and a float mask together are a TypeError (torch deprecates the mix).
"""

from __future__ import annotations

from attention_core.conventions import (
    ALIAS,
    AVERAGE,
    BLOCKED,
    CAUSAL,
    ENCODER_BLOCK,
    PADDING,
    QKV,
    WEIGHTS,
    Keyword,
    aliases,
)

_MASK = "torch's attention mask: True = may not attend, or a float added to the scores"
_PADDING = "torch's padding mask: True = a padded key, or a float added to its scores"
_BLOCK = ("X", "mask")

#: torch's keywords (``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer``).
TORCH: tuple[Keyword, ...] = (
    *aliases("torch's", ("query", "key", "value")),
    Keyword("attn_mask", BLOCKED, "mask", _MASK, QKV, also=("score_bias",)),
    Keyword("key_padding_mask", PADDING, "valid_lens", _PADDING, QKV),
    Keyword("src", ALIAS, "X", "torch's name for X", _BLOCK, ENCODER_BLOCK),
    Keyword("src_mask", BLOCKED, "mask", _MASK, _BLOCK, ENCODER_BLOCK, also=("score_bias",)),
    Keyword("src_key_padding_mask", PADDING, "valid_lens", _PADDING, _BLOCK, ENCODER_BLOCK),
    Keyword("is_causal", CAUSAL, "causal", "torch's causal flag", ("causal",)),
    Keyword("need_weights", WEIGHTS, "return_attention", "torch's return form",
            ("return_attention",)),
    Keyword("average_attn_weights", AVERAGE, "return_attention", "torch's return form",
            ("return_attention",)),
)
