"""Shows how each installed framework's own attention treats a query row with no visible key.

Run it in an environment that has the framework (e.g. a tox env):
``python tools/mask_conventions.py``. It prints one line per framework it can import; the
table of fully masked rows in docs/masks.md was made from its output.
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def row(values: object) -> str:
    return np.array2string(np.asarray(values, dtype=np.float64), precision=3)


def torch_lines() -> list[str]:
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    q, k, v = torch.randn(1, 1, 2, 4), torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4)
    allowed = torch.tensor([[True, False, True], [False, False, False]])  # True = may attend
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)[0, 0, 1]
    mha = torch.nn.MultiheadAttention(4, 1, batch_first=True)
    x = torch.randn(1, 2, 4)
    blocked = torch.tensor([[False, True], [True, True]])  # True = may NOT attend
    out, w = mha(x, x, x, attn_mask=blocked)
    return [
        f"torch {torch.__version__}: F.scaled_dot_product_attention output {row(sdpa)}",
        f"torch {torch.__version__}: nn.MultiheadAttention output {row(out[0, 1].detach())}, "
        f"weights {row(w[0, 1].detach())}",
    ]


def keras_lines() -> list[str]:
    import keras

    layer = keras.layers.MultiHeadAttention(num_heads=1, key_dim=4)
    x = np.random.default_rng(0).standard_normal((1, 2, 4)).astype("float32")
    mask = np.array([[[True, True], [False, False]]])  # True = may attend
    out, w = layer(x, x, attention_mask=mask, return_attention_scores=True)
    return [f"keras {keras.__version__}: MultiHeadAttention output {row(out[0, 1])}, "
            f"weights {row(w[0, 0, 1])}"]


def flax_lines() -> list[str]:
    import flax
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    x = jax.random.normal(jax.random.PRNGKey(0), (1, 2, 4))
    mask = jnp.array([[[[True, True], [False, False]]]])  # True = may attend
    module = nn.MultiHeadDotProductAttention(num_heads=1)
    params = module.init(jax.random.PRNGKey(1), x, mask=mask)
    w = nn.dot_product_attention_weights(x[:, :, None], x[:, :, None], mask=mask)
    return [f"flax {flax.__version__}: MultiHeadDotProductAttention output "
            f"{row(np.asarray(module.apply(params, x, mask=mask))[0, 1])}, weights {row(w[0, 0, 1])}"]


def main() -> None:
    for module, lines in (("torch", torch_lines), ("keras", keras_lines), ("flax", flax_lines)):
        if importlib.util.find_spec(module) is None:
            print(f"{module}: not installed")
            continue
        for line in lines():
            print(line)


if __name__ == "__main__":
    main()
