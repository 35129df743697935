"""A decoder's cached calls as programs of plain tensors, for ``torch.export`` and ONNX.

A :class:`~backends.torch.TransformerDecoder` (``decoder_only=True``) keeps its cache in the
call's inputs and outputs; these wrappers make them tensors in a fixed order, with the
positions as inputs, so that an exported program carries no state:

- :class:`Prefill`: ``forward(tokens (B, t), lengths (B,)) -> (logits (B, t, V), *cache)``,
  left-padded prompts (example b's ``lengths[b]`` real tokens are the last columns), written
  at positions ``0 .. lengths[b] - 1`` of a cache of ``capacity`` rows made now.
- :class:`DecodeStep`: ``forward(tokens (B, t), start (B,), *cache) -> (logits (B, t, V),
  *cache)``, example b's tokens at positions ``start[b] ..``; after a prefill ``start`` is
  ``lengths``, then it grows by t each step.

``cache`` is :func:`attention_core.cache.flat_cache`'s list: per block, its keys then its
values, each ``(B, Hkv, C, D)``. Each wrapper's ``input_names`` and ``output_names`` name
them, and its ``axis_names`` (``torch.onnx.export``'s ``dynamic_shapes``) the dynamic axes,
``batch`` and the prefill's ``steps``.
:func:`export_decoder` exports both; two programs because ``torch.export`` specialises a
dimension of size 1, so one traced at t = 1 (a decode step) does not serve a prompt.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from attention_core.cache import flat_cache, nested_cache
from backends.torch.layers import TransformerDecoder

Tensor = torch.Tensor


def _checked(decoder: Any) -> TransformerDecoder:
    """The decoder, when it is a decoder-only ``TransformerDecoder``."""
    if not isinstance(decoder, TransformerDecoder) or not decoder.decoder_only:
        got = (f"{type(decoder).__name__} with decoder_only=False"
               if isinstance(decoder, TransformerDecoder) else type(decoder).__name__)
        raise TypeError(f"decoder must be a TransformerDecoder with decoder_only=True, got {got}")
    return decoder


def cache_names(blocks: int, prefix: str = "cache") -> list[str]:
    """The flat cache's names: ``cache.0.keys``, ``cache.0.values``, ``cache.1.keys``, ..."""
    return [f"{prefix}.{i}.{part}" for i in range(blocks) for part in ("keys", "values")]


class Prefill(nn.Module):
    """A decoder's first call on left-padded prompts, making the cache (see the module).

    Args:
        decoder: A decoder-only :class:`~backends.torch.TransformerDecoder`.
        capacity: C, the rows of the cache made: the longest sequence the steps reach.
    """

    def __init__(self, decoder: TransformerDecoder, capacity: int) -> None:
        super().__init__()
        self.decoder = _checked(decoder)
        self.capacity = capacity
        self.input_names = ["tokens", "lengths"]
        self.output_names = ["logits", *cache_names(decoder.num_blks, "new_cache")]
        self.axis_names = {"tokens": {0: "batch", 1: "steps"}, "lengths": {0: "batch"}}
        self.train(decoder.training)

    def forward(self, tokens: Tensor, lengths: Tensor) -> tuple[Tensor, ...]:
        logits, cache = self.decoder(tokens, capacity=self.capacity, start=torch.zeros_like(lengths),
                                     lengths=lengths, padding="left")
        return (logits, *flat_cache(cache))


class DecodeStep(nn.Module):
    """A decoder's cached call at one start per example (see the module).

    Args:
        decoder: A decoder-only :class:`~backends.torch.TransformerDecoder`.
    """

    def __init__(self, decoder: TransformerDecoder) -> None:
        super().__init__()
        self.decoder = _checked(decoder)
        self.input_names = ["tokens", "start", *cache_names(decoder.num_blks)]
        self.output_names = ["logits", *cache_names(decoder.num_blks, "new_cache")]
        self.axis_names = {"tokens": {0: "batch"}, "start": {0: "batch"},
                           "cache": tuple({0: "batch"} for _ in range(2 * decoder.num_blks))}
        self.train(decoder.training)

    def forward(self, tokens: Tensor, start: Tensor, *cache: Tensor) -> tuple[Tensor, ...]:
        logits, new = self.decoder(tokens, cache=nested_cache(cache), start=start)
        return (logits, *flat_cache(new))


def export_decoder(decoder: TransformerDecoder, capacity: int
                   ) -> tuple[torch.export.ExportedProgram, torch.export.ExportedProgram]:
    """``torch.export`` of a decoder's :class:`Prefill` and :class:`DecodeStep`.

    Both take any batch (``Dim("batch")``); the prefill any prompt length from 2 to
    ``capacity`` (``Dim("steps")``), the step one token (t = 1).

    Args:
        decoder: A decoder-only :class:`~backends.torch.TransformerDecoder`, built.
        capacity: C of the cache the prefill makes.

    Returns:
        The prefill's and the step's programs.
    """
    prefill, step = Prefill(decoder, capacity), DecodeStep(decoder)
    batch, steps = torch.export.Dim("batch"), torch.export.Dim("steps", min=2, max=capacity)
    device = next(decoder.parameters()).device
    tokens = torch.zeros((2, 3), dtype=torch.long, device=device)
    lengths = torch.full((2,), 3, dtype=torch.int32, device=device)
    with torch.no_grad():
        cache = prefill(tokens, lengths)[1:]  # example inputs of the step
    first = torch.export.export(prefill, (tokens, lengths), dynamic_shapes={
        "tokens": {0: batch, 1: steps}, "lengths": {0: batch}})
    later = torch.export.export(step, (tokens[:, :1], lengths, *cache), dynamic_shapes={
        "tokens": {0: batch}, "start": {0: batch}, "cache": tuple({0: batch} for _ in cache)})
    return first, later
