"""Decodes with Transformer weights trained elsewhere: one script for every backend.

The weights file is what a training script saved (``python -m examples.transformer_torch --save
w.safetensors``); by default, the tests' ``tests/fixtures/transformer_reverse.safetensors``. The
backend's ``TransformerEncoder`` and ``TransformerDecoder`` take them (Flax: its params) and
decode the held-out sequences greedily and by beam search, e.g. on Gluon:
``python -m examples.transformer_decode w.safetensors --backend mxnet``; ``--plot FILE.png``
draws the cross-attention of one example (needs matplotlib).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import attention_core as ac
from examples import transformer as example

#: How the report names each backend's framework.
FRAMEWORKS = {"numpy": "NumPy", "torch": "PyTorch", "tensorflow": "Keras (TensorFlow)",
              "jax": "Flax (JAX)", "mxnet": "Gluon (MXNet)"}


def main(argv: Sequence[str] | None = None) -> int:
    """Loads the weights into the chosen backend's layers, decodes and prints the exact match."""
    args = example.arguments(argv, trains=False)
    decoding = example.from_weights(args.backend, ac.load_weights(args.weights))
    print(f"Transformer (encoder-decoder) weights {args.weights}")
    print("\n".join(example.evaluate(FRAMEWORKS[args.backend], decoding, args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
