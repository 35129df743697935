"""Writes ``docs/api/layers.md``: every layer's arguments, call and one example, for users.

The page is generated from the layer declarations (their signatures and docstrings), so it
cannot drift from the code; ``tests/test_docs.py`` checks that the file equals what this
module writes. Run ``python -m tools.layer_reference`` after changing a layer's arguments or
docstring (``--check`` only compares).
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
import textwrap
from pathlib import Path

from attention_core import declarations as D

PAGE = Path(__file__).resolve().parent.parent / "docs" / "api" / "layers.md"

#: One short NumPy example per layer; each prints what it computed (the page's fences run in
#: the numpy env of the test suite, as every page's do).
EXAMPLES = {
    "DotProductAttention": """\
        import numpy as np
        from backends.numpy import DotProductAttention

        attention = DotProductAttention()
        queries = np.ones((2, 1, 4), "float32")                      # (B, Q, D)
        keys = values = np.arange(48, dtype="float32").reshape(2, 6, 4)  # (B, K, D)
        out = attention(queries, keys, values, valid_lens=np.array([2, 6]))
        print(out.shape, attention.attention_weights.shape)  # (2, 1, 4) (2, 1, 1, 6)
        """,
    "AdditiveAttention": """\
        import numpy as np
        from backends.numpy import AdditiveAttention

        attention = AdditiveAttention(num_hiddens=8, seed=0)
        queries, keys = np.ones((2, 3, 5), "float32"), np.ones((2, 4, 6), "float32")
        values = np.ones((2, 4, 7), "float32")
        print(attention(queries, keys, values, valid_lens=np.array([1, 4])).shape)  # (2, 3, 7)
        """,
    "MultiHeadAttention": """\
        import numpy as np
        from backends.numpy import MultiHeadAttention

        mha = MultiHeadAttention(num_hiddens=16, num_heads=4, seed=0)
        X = np.random.default_rng(0).standard_normal((2, 5, 16)).astype("float32")
        out = mha(X, causal=True)                # self-attention: keys and values are X
        print(out.shape, mha.attention_weights.shape)  # (2, 5, 16) (2, 4, 5, 5)
        """,
    "RelativeMultiHeadAttention": """\
        import numpy as np
        from backends.numpy import RelativeMultiHeadAttention

        mha = RelativeMultiHeadAttention(num_hiddens=16, num_heads=4, max_relative_position=3,
                                         seed=0)
        X = np.ones((2, 5, 16), "float32")
        print(mha(X, X, X).shape)  # (2, 5, 16)
        """,
    "PositionalEncoding": """\
        import numpy as np
        from backends.numpy import PositionalEncoding

        encoding = PositionalEncoding(num_hiddens=32, max_len=60)
        print(encoding(np.zeros((1, 60, 32), "float32")).shape, encoding.P.shape)
        # (1, 60, 32) (1, 60, 32)
        """,
    "LearnedPositionalEncoding": """\
        import numpy as np
        from backends.numpy import LearnedPositionalEncoding

        encoding = LearnedPositionalEncoding(num_hiddens=8, max_len=16, seed=0)
        print(encoding(np.zeros((2, 10, 8), "float32")).shape)  # (2, 10, 8)
        """,
    "RotaryEmbedding": """\
        import numpy as np
        from backends.numpy import RotaryEmbedding

        rotary = RotaryEmbedding()
        X = np.ones((2, 5, 4, 8), "float32")       # (B, T, H, d): positions on axis 1
        print(rotary(X, start_index=3).shape)    # (2, 5, 4, 8), positions 3 .. 7
        """,
    "PositionWiseFFN": """\
        import numpy as np
        from backends.numpy import PositionWiseFFN

        ffn = PositionWiseFFN(ffn_num_hiddens=32, ffn_num_outputs=8, seed=0)
        print(ffn(np.ones((2, 3, 4), "float32")).shape)  # (2, 3, 8)
        """,
    "AddNorm": """\
        import numpy as np
        from backends.numpy import AddNorm

        add_norm = AddNorm(num_hiddens=4, dropout=0.5)
        X = np.ones((2, 3, 4), "float32")
        print(add_norm(X, X).shape)  # (2, 3, 4)
        """,
    "TransformerEncoderBlock": """\
        import numpy as np
        from backends.numpy import TransformerEncoderBlock

        block = TransformerEncoderBlock(num_hiddens=24, ffn_num_hiddens=48, num_heads=8,
                                        seed=0)
        X = np.ones((2, 100, 24), "float32")
        print(block(X, valid_lens=np.array([3, 2])).shape)  # (2, 100, 24)
        """,
    "TransformerEncoder": """\
        import numpy as np
        from backends.numpy import TransformerEncoder

        encoder = TransformerEncoder(vocab_size=200, num_hiddens=24, ffn_num_hiddens=48,
                                     num_heads=8, num_blks=2, seed=0)
        tokens = np.ones((2, 100), "int64")
        print(encoder(tokens, valid_lens=np.array([3, 2])).shape)  # (2, 100, 24)
        """,
    "TransformerDecoderBlock": """\
        import numpy as np
        from backends.numpy import TransformerDecoderBlock

        block = TransformerDecoderBlock(num_hiddens=24, ffn_num_hiddens=48, num_heads=8,
                                        seed=0)
        X, enc_outputs = np.ones((2, 7, 24), "float32"), np.ones((2, 9, 24), "float32")
        print(block(X, enc_outputs, enc_valid_lens=np.array([9, 4])).shape)  # (2, 7, 24)
        """,
    "TransformerDecoder": """\
        import numpy as np
        from backends.numpy import TransformerDecoder

        decoder = TransformerDecoder(vocab_size=50, num_hiddens=16, ffn_num_hiddens=32,
                                     num_heads=4, num_blks=2, decoder_only=True, seed=0)
        tokens = np.array([[1, 5, 7, 2]])
        print(decoder(tokens).shape)  # (1, 4, 50): the logits
        """,
    "Transformer": """\
        import numpy as np
        from backends.numpy import Transformer

        model = Transformer(src_vocab_size=30, tgt_vocab_size=40, num_hiddens=16,
                            ffn_num_hiddens=32, num_heads=4, num_blks=2, seed=0)
        src, tgt = np.ones((2, 6), "int64"), np.ones((2, 5), "int64")
        print(model(src, tgt, src_valid_lens=np.array([6, 3])).shape)  # (2, 5, 40)
        """,
    "NadarayaWatson": """\
        import numpy as np
        from backends.numpy import NadarayaWatson

        pooling = NadarayaWatson(parametric=True, seed=0)
        x_train = np.sort(np.random.default_rng(0).uniform(0, 5, 50)).astype("float32")
        y_train = np.sin(x_train)
        queries = np.arange(0, 5, 0.5, dtype="float32")
        print(pooling(queries, x_train, y_train).shape)  # (10,)
        """,
}

#: What each framework adds to every layer: its class, its own keyword arguments and how a
#: call trains.
FRAMEWORKS = (
    ("NumPy", "backends.numpy", "`seed`, `dtype`", "`training=True` in the call"),
    ("PyTorch", "backends.torch", "`q_in`, `k_in`, `v_in`, `d_in` (input sizes, else learnt "
     "on the first call), `device`, `dtype`", "`module.train()`"),
    ("Keras 3", "backends.keras", "Keras' own: `name`, `dtype`, `trainable`, ...",
     "`training=True` in the call, or `fit`"),
    ("Flax linen", "backends.jax", "`param_dtype`, `dtype`",
     "`training=True` in the call, with a `dropout` rng"),
    ("Flax NNX", "backends.jax.nnx", "`q_in`, `k_in`, `v_in`, `d_in`, `param_dtype`, "
     "`dtype`, `deterministic`, `rngs`", "`model.train()`"),
    ("Gluon", "backends.mxnet", "`dtype`, `prefix`, `params`",
     "`autograd.record()`"),
)

#: The call arguments the attention layers share, in the order of their call signature.
CALL_ARGUMENTS = (
    ("valid_lens", "`(B,)` or `(B, Q)` integers: each example (or query row) sees its first "
     "`valid_lens` keys."),
    ("mask", "Boolean, broadcastable to `(B, H, Q, K)`; True keeps a key (see "
     "[Masks](../masks.md)). Combined with `valid_lens` and `causal` by *and*."),
    ("causal", "Each query sees the keys at its position and before."),
    ("score_bias", "Float, broadcastable to `(B, H, Q, K)`, added to the scores."),
    ("segment_ids", "`(B, Q)` integers, or a pair for queries and keys: packed sequences "
     "attend within their own segment."),
    ("mask_mod, score_mod", "Your own functions of the positions (and the score): see "
     "[The attention of current models](../current-models.md)."),
    ("cache, start, capacity, lengths, padding, padding_mask", "Cached decoding: see "
     "[Decoding and generation](../decoding.md)."),
    ("return_attention", "Also return the attention weights `(B, H, Q, K)`."),
)


def _markdown(text: str) -> str:
    """A docstring's inline markup as Markdown, this page's layer names linked."""
    text = re.sub(r":(?:class|func|meth|attr|data|mod|obj):`~?([^`]+)`", r"`\1`", text)
    text = text.replace("``", "`")
    return re.sub(r"`(" + "|".join(D.library_layers()) + r")`",
                  lambda m: f"[`{m.group(1)}`](#{m.group(1).lower()})", text)


def _arguments(doc: str) -> tuple[str, list[tuple[str, str]]]:
    """A Google docstring's text before ``Args:``, and its arguments with their descriptions."""
    head, _, args = doc.partition("\nArgs:\n")
    entries: list[tuple[str, str]] = []
    for line in args.splitlines():
        match = re.match(r"    (\w+): (.*)", line)
        if match:
            entries.append((match.group(1), match.group(2).strip()))
        elif line.startswith("        ") and entries:
            name, text = entries[-1]
            entries[-1] = (name, f"{text} {line.strip()}")
    return head.strip(), entries


def _signature(name: str, signature: inspect.Signature) -> str:
    """``name(a, b=1, *, c=None)`` without annotations, wrapped at 92 characters."""
    parts, star = [], False
    for p in signature.parameters.values():
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        parts.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
    lines = textwrap.wrap(", ".join(parts), 88, break_on_hyphens=False)
    if len(lines) == 1 and len(name) + len(lines[0]) < 90:
        return f"{name}({lines[0]})"
    return f"{name}(\n" + "\n".join(f"    {line}" for line in lines) + "\n)"


def layer_section(name: str) -> str:
    """One layer's section: summary, constructor, arguments, call and example."""
    declared = D.library_layers()[name]
    head, args = _arguments(inspect.getdoc(declared) or "")
    call_doc = inspect.getdoc(declared.compute) or ""
    rows = "\n".join(f"| `{arg}` | {_markdown(text)} |" for arg, text in args)
    table = f"| argument | meaning |\n|---|---|\n{rows}\n\n" if args else ""
    call = _signature("layer", declared.call_signature())
    return (f"## {name}\n\n{_markdown(head)}\n\n"
            f"```text\n{_signature(name, inspect.signature(declared))}\n```\n\n{table}"
            f"**Call.** {_markdown(call_doc)}\n\n```text\n{call}\n```\n\n"
            f"```python\n{textwrap.dedent(EXAMPLES[name]).rstrip()}\n```\n")


def page() -> str:
    """The whole page."""
    frameworks = "\n".join(f"| {fw} | `{module}.<Layer>` | {extra} | {train} |"
                           for fw, module, extra, train in FRAMEWORKS)
    calls = "\n".join(f"| `{arg}` | {text} |" for arg, text in CALL_ARGUMENTS)
    index = ", ".join(f"[`{name}`](#{name.lower()})" for name in D.library_layers())
    sections = "\n".join(layer_section(name) for name in D.library_layers())
    return f"""# Layers

<!-- Written by `python -m tools.layer_reference` from the layer declarations: edit those. -->

The fifteen layers, with the arguments they take on every framework, what a call takes and
returns, and one example each (on NumPy; the other frameworks' classes take the same
arguments). Shapes use B (batch), H (heads), Q (queries), K (keys), D (depth), T (positions)
and h (width). {index}.

## On each framework

Each framework has the same classes, native to it. A class takes the arguments listed below
for its layer, in the same order and with the same defaults, then its framework's own
keyword arguments:

| framework | class | own keyword arguments | dropout on |
|---|---|---|---|
{frameworks}

`help()` and your editor show each class's full signature. The backend pages
([numpy](backends/numpy.md), [torch](backends/torch.md), [keras](backends/keras.md),
[jax](backends/jax.md), [nnx](backends/nnx.md), [mxnet](backends/mxnet.md)) document the
framework's own arguments and methods.

## What an attention call takes

The attention layers (`DotProductAttention`, `AdditiveAttention`, `MultiHeadAttention`,
`RelativeMultiHeadAttention`) take `queries`, `keys` and `values`, and these keywords; the
blocks and stacks pass the ones they list on to their attention.

| argument | meaning |
|---|---|
{calls}

{sections}"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.layer_reference",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help=f"only compare {PAGE.name} with what would be written")
    args = parser.parse_args(argv)
    text = page()
    if args.check:
        if PAGE.read_text() != text:
            print(f"{PAGE} is out of date: run python -m tools.layer_reference", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
