"""Keras' call keywords, which the Keras layers take beside the library's, with Keras' meaning.

Listed as :class:`~attention_core.conventions.Keyword` values, named by
:class:`backends.keras.layers.Layer` (``convention = KERAS``), so ``backends.keras`` and
``backends.tensorflow`` take them alike; :mod:`attention_core.conventions` binds and converts
them. Inputs are batch-first ``(B, T, D)``.

=============================  ====================================================================
``query``, ``value``, ``key``  Keras' names (``key`` defaults to ``value``; without ``value=``,
                               as the shorthand: keys = queries)
``attention_mask``             bool, True = may attend: the canonical ``mask`` (its errors name
                               ``attention_mask``)
``use_causal_mask``            query i sees keys j <= i
``return_attention_scores``    return ``(out, scores)``, scores ``(B, H, Q, K)``
``padding_mask``               the encoder block's ``(B, T)``, True = a real token (KerasHub's
                               ``TransformerEncoder``)
``value_mask``, ``key_mask``   ``(B, K)``, True = a real key: padded keys are hidden
``query_mask``                 ``(B, Q)``, True = a real query: a padded query sees no key, its
                               attention weights are 0 (Keras' own layer spreads them evenly);
                               Keras also fills these three from the inputs' padding masks
                               (``_keras_mask``)
=============================  ====================================================================

Keras aligns its causal mask at the first key, the library's ``causal=True`` at the last: for
Q != K ``use_causal_mask`` is refused.
"""

from __future__ import annotations

from attention_core.conventions import (
    ALIAS,
    ALLOWED,
    CAUSAL,
    ENCODER_BLOCK,
    KEPT,
    QKV,
    ROWS,
    Keyword,
    aliases,
)

#: Keras' keywords (``keras.layers.MultiHeadAttention``, KerasHub's ``TransformerEncoder``).
KERAS: tuple[Keyword, ...] = (
    *aliases("Keras'", ("query", "key", "value"), value_fills="keys"),
    Keyword("attention_mask", ALLOWED, "mask", "Keras' name for mask", ("mask",)),
    Keyword("padding_mask", KEPT, "valid_lens",
            "KerasHub's padding mask, True = a real token", ("X", "mask"), ENCODER_BLOCK),
    Keyword("query_mask", ROWS, "", "Keras' padding mask of the queries, True = a real "
            "query", QKV),
    Keyword("value_mask", KEPT, "valid_lens", "Keras' padding mask of the values, True = "
            "a real value", QKV),
    Keyword("key_mask", KEPT, "valid_lens", "Keras' padding mask of the keys, True = a "
            "real key", QKV),
    Keyword("use_causal_mask", CAUSAL, "causal", "Keras' causal flag", ("causal",)),
    Keyword("return_attention_scores", ALIAS, "return_attention",
            "Keras' name for return_attention", ("return_attention",)),
)
