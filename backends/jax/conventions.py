"""Flax's call keywords, which the linen and NNX layers take beside the library's.

Listed as :class:`~attention_core.conventions.Keyword` values, named by
:class:`backends.jax.layers.Layer` and :class:`backends.jax.nnx.Layer` (``convention = FLAX``);
:mod:`attention_core.conventions` binds them.

=================================  ================================================================
``inputs_q``, ``inputs_k``,        linen's names (``inputs_k`` defaults to ``inputs_q``,
``inputs_v``                       ``inputs_v`` to ``inputs_k``)
``deterministic``                  ``not training`` (linen's ``mask`` is the canonical ``mask``
                                   already)
=================================  ================================================================
"""

from __future__ import annotations

from attention_core.conventions import DETERMINISTIC, Keyword, aliases

#: Flax's keywords (``flax.linen.MultiHeadDotProductAttention``).
FLAX: tuple[Keyword, ...] = (
    *aliases("Flax's", ("inputs_q", "inputs_k", "inputs_v")),
    Keyword("deterministic", DETERMINISTIC, "training", "Flax's deterministic = not training",
            ()),
)
