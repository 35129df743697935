"""Hugging Face Llama, Mistral and Qwen2 checkpoints in this library's decoder.

In the env with ``transformers`` (torch), tiny random models are built from configs, saved
with ``save_pretrained``, converted, and their logits compared with the torch layer's. On every
backend, the converted weights of the tiny Llama and Mistral in ``tests/fixtures/hf_tiny/``
(written by ``tests/fixtures/make_hf_tiny.py``) give the logits ``transformers`` recorded.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import attention_core as ac
from attention_core import convert_hf
from attention_core.weights import read_safetensors
from conftest import test_backends
from tests.harness import Harness

#: These tests run on the columns too (conftest.py; tests.harness.COLUMNS).
COLUMN_TESTS = True

FIXTURES = Path(__file__).parent / "fixtures" / "hf_tiny"
TOL = 1e-4


@cache
def cases() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((FIXTURES / "cases.json").read_text())
    return loaded


@cache
def outputs() -> dict[str, np.ndarray]:
    with np.load(FIXTURES / "outputs.npz") as data:
        return dict(data)


def max_diff(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(np.asarray(got, np.float64) - want)))


# -- every backend: the recorded logits ----------------------------------------------------------


@pytest.mark.parametrize("model", ["llama", "mistral"])
def test_fixture_logits(backend: str, model: str) -> None:
    """The converted weights give transformers' logits on this backend (Mistral: window 4)."""
    h = Harness(backend)
    layer = h.make("TransformerDecoder", cases()[model]["kwargs"])
    ac.load_weights(FIXTURES / f"{model}.safetensors", layer)
    tokens = outputs()[f"{model}/tokens"]
    got = h.numpy(h.call(layer, h.array(tokens)))
    assert max_diff(got, outputs()[f"{model}/logits"]) <= TOL


@pytest.mark.parametrize("model", ["llama", "mistral"])
def test_generate_gives_the_tokens_of_transformers(backend: str, model: str) -> None:
    """The left-padded batch (lengths 6, 3 and 5) through ``generate``: the greedy tokens that
    transformers' ``generate(do_sample=False)`` gave (its top-2 margins all above 1e-3)."""
    h = Harness(backend)
    layer = h.make("TransformerDecoder", cases()[model]["kwargs"])
    ac.load_weights(FIXTURES / f"{model}.safetensors", layer)
    prompts, mask = outputs()[f"{model}/prompts"], outputs()[f"{model}/attention_mask"]
    lengths = mask.sum(1).astype(np.int32)
    assert (mask[:, ::-1].cumprod(1).sum(1) == lengths).all(), "the batch is left-padded"
    step = ac.decoder_step(lambda *a, **k: h.call(layer, *a, **k), 16)
    got = ac.generate(step, h.array(prompts), max_new_tokens=8, lengths=lengths, padding="left")
    np.testing.assert_array_equal(got.tokens, outputs()[f"{model}/generated"])


numpy_env = pytest.mark.skipif("numpy" not in test_backends(),
                               reason="the fixture files are checked in the numpy env")


@numpy_env
@pytest.mark.parametrize("model", ["llama", "mistral"])
def test_fixture_config_and_round_trip(model: str) -> None:
    """The recorded config converts to the recorded arguments; HF names and back, unchanged."""
    case = cases()[model]
    assert convert_hf.hf_config(case["hf_config"]) == case["kwargs"]
    weights = read_safetensors(FIXTURES / f"{model}.safetensors")
    state = convert_hf.to_hf_llama(weights, case["kwargs"])
    assert state["model.layers.1.self_attn.k_proj.weight"].shape == (32, 64)
    back, kwargs = convert_hf.from_hf_llama(state, case["hf_config"])
    assert kwargs == case["kwargs"] and sorted(back) == sorted(weights)
    for name, value in weights.items():
        assert back[name].tobytes() == value.tobytes(), name


@numpy_env
def test_fixture_generation_margins() -> None:
    """The recorded greedy tokens were picked with every step's top-2 margin above 1e-3."""
    for model, case in cases().items():
        margins = outputs()[f"{model}/margins"]
        assert margins.shape == (case["generate"]["max_new_tokens"], 3)
        assert margins.min() > 1e-3
        assert outputs()[f"{model}/generated"].shape == (3, 8)


# -- the config ----------------------------------------------------------------------------------

LLAMA = {"model_type": "llama", "vocab_size": 11, "hidden_size": 8, "intermediate_size": 12,
         "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
         "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": True}


def test_config_of_each_family() -> None:
    llama = convert_hf.hf_config(LLAMA)
    assert (llama["rotary_base"], llama["norm_eps"], llama["num_kv_heads"], llama["bias"],
            llama["tie_output"], llama["window"]) == (500000.0, 1e-5, 1, False, True, None)
    new_rope = {**LLAMA, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    assert convert_hf.hf_config(new_rope)["rotary_base"] == 1e6
    mistral = {**LLAMA, "model_type": "mistral", "sliding_window": 4}
    assert convert_hf.hf_config(mistral)["window"] == 4
    qwen2 = {**LLAMA, "model_type": "qwen2", "sliding_window": 4, "max_window_layers": 0}
    assert convert_hf.hf_config(qwen2)["window"] is None
    assert convert_hf.hf_config(qwen2)["bias"] == "qkv"
    assert convert_hf.hf_config({**qwen2, "use_sliding_window": True})["window"] == 4
    assert convert_hf.hf_config({**LLAMA, "attention_bias": True, "mlp_bias": True})[
        "bias"] is True


def test_config_from_a_file(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    assert convert_hf.hf_config(tmp_path) == convert_hf.hf_config(tmp_path / "config.json") \
        == convert_hf.hf_config(LLAMA)


def test_names_cover_the_layer() -> None:
    """Every canonical weight has its HF name, and each HF name is used once."""
    names = convert_hf.hf_names({**convert_hf.hf_config(LLAMA), "bias": True, "ffn_bias": True,
                                 "tie_output": False})
    hf = [name for name, _, _ in names.values()]
    assert len(set(hf)) == len(hf) == 2 * 16 + 3
    assert names["dense.kernel"] == ("lm_head.weight", (8, 11), True)
    assert names["blks.1.ffn.dense1.kernel"] == ("model.layers.1.mlp.up_proj.weight", (8, 12), True)


def random_state(config: dict[str, Any], seed: int = 0, prefix: str = "model.",
                 dtype: Any = np.float32) -> dict[str, np.ndarray]:
    """An HF state dict for ``config``, drawn at random (``lm_head`` as the config says)."""
    rng = np.random.default_rng(seed)
    names = convert_hf.hf_names(convert_hf.hf_config(config))
    state = {}
    for hf, shape, transposed in names.values():
        key = hf if hf.startswith("lm_head") else prefix + hf[len("model."):]
        state[key] = rng.standard_normal(shape[::-1] if transposed else shape).astype(dtype)
    return state


@pytest.mark.parametrize("prefix", ["model.", ""])
@pytest.mark.parametrize("tied", [False, True])
def test_round_trip_is_byte_identical(prefix: str, tied: bool) -> None:
    """from_hf_llama then to_hf_llama gives the state back, with or without ``model.``."""
    config = {**LLAMA, "tie_word_embeddings": tied, "attention_bias": True}
    state = random_state(config, prefix=prefix)
    weights, kwargs = convert_hf.from_hf_llama(state, config)
    assert kwargs["tie_output"] == tied and ("dense.kernel" in weights) == (not tied)
    np.testing.assert_array_equal(weights["blks.0.self_attention.W_k.kernel"],
                                  state[prefix + "layers.0.self_attn.k_proj.weight"].T)
    back = convert_hf.to_hf_llama(weights, kwargs)
    assert sorted(back) == sorted("model." + k if not k.startswith(("model.", "lm_head")) else k
                                  for k in state)
    for key, value in state.items():
        name = key if key.startswith(("model.", "lm_head")) else "model." + key
        assert back[name].dtype == value.dtype and back[name].tobytes() == value.tobytes()


def test_a_tied_head_copy_and_buffers_are_accepted() -> None:
    """A tied checkpoint that still holds lm_head (equal to the embedding), old inv_freq."""
    state = random_state(LLAMA)
    state["lm_head.weight"] = state["model.embed_tokens.weight"].copy()
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(2, np.float32)
    weights, kwargs = convert_hf.from_hf_llama(state, LLAMA)
    assert kwargs["tie_output"] and "dense.kernel" not in weights


def test_safetensors_file_and_directory(tmp_path: Path) -> None:
    state = random_state({**LLAMA, "tie_word_embeddings": False})
    names = sorted(state)
    first = {k: state[k] for k in names[:5]}
    rest = {k: state[k] for k in names[5:]}
    ac.save_weights(tmp_path / "model-1.safetensors", first)
    ac.save_weights(tmp_path / "model-2.safetensors", rest)
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "tie_word_embeddings": False}))
    from_dir, _ = convert_hf.from_hf_llama(tmp_path)
    whole = tmp_path / "whole"
    whole.mkdir()
    ac.save_weights(whole / "model.safetensors", state)
    from_file, _ = convert_hf.from_hf_llama(whole / "model.safetensors", tmp_path / "config.json")
    want, _ = convert_hf.from_hf_llama(state, LLAMA | {"tie_word_embeddings": False})
    for name, value in want.items():
        np.testing.assert_array_equal(from_dir[name], value)
        np.testing.assert_array_equal(from_file[name], value)


# -- transformers itself (the torch env) ----------------------------------------------------------

COMMON = {"vocab_size": 50, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "initializer_range": 0.15}
FAMILIES = {"llama": ("LlamaConfig", "LlamaForCausalLM", {}),
            "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 4}),
            "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True})}


@pytest.fixture
def hf() -> Any:
    if "torch" not in test_backends():
        pytest.skip("transformers is compared in the torch env")
    return pytest.importorskip("transformers")


def interleaved(weights: dict[str, np.ndarray], heads: dict[str, int]) -> dict[str, np.ndarray]:
    """W_q and W_k with each head's columns in Meta's interleaved rotary order (a wrong load)."""
    out = dict(weights)
    for name, value in weights.items():
        part = name.split(".")[-2]
        if part in heads:
            n, d = heads[part], value.shape[-1] // heads[part]
            order = np.arange(d).reshape(2, d // 2).T.reshape(-1)
            out[name] = value.reshape(-1, n, d)[..., order].reshape(value.shape)
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_transformers_logits(hf: Any, family: str, tmp_path: Path) -> None:
    """save_pretrained, convert, and the torch layer gives transformers' logits (≤ 1e-4)."""
    import torch

    config_class, model_class, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(hf, config_class)(**COMMON, **extra, attn_implementation="eager")
    model = getattr(hf, model_class)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.copy_(float(name.endswith("norm.weight")) + 0.2 * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    weights, kwargs = convert_hf.from_hf_llama(tmp_path)
    assert kwargs["window"] == extra.get("sliding_window")
    # the module's own state dict (torch tensors; a tied lm_head is there too) and config
    from_module = convert_hf.from_hf_llama(model.state_dict(), model.config.to_dict())
    assert from_module[1] == kwargs and sorted(from_module[0]) == sorted(weights)
    assert all(np.array_equal(from_module[0][name], w) for name, w in weights.items())
    tokens = np.random.default_rng(1).integers(0, 50, (2, 12))
    with torch.no_grad():
        want = model(torch.from_numpy(tokens)).logits.double().numpy()
    h = Harness("torch")

    def logits(w: dict[str, np.ndarray], **changes: Any) -> np.ndarray:
        layer = h.make("TransformerDecoder", {**kwargs, **changes})
        layer.set_weights(w)
        return h.numpy(h.call(layer, h.array(tokens.astype(np.int32))))

    assert max_diff(logits(weights), want) <= TOL
    # the check can tell a wrong rotary layout, and Mistral's window
    assert max_diff(logits(interleaved(weights, {"W_q": 4, "W_k": 2})), want) > 1e-2
    if family == "mistral":
        assert max_diff(logits(weights, window=None), want) > 1e-2
    state = read_safetensors(tmp_path / "model.safetensors")
    back = convert_hf.to_hf_llama(weights, kwargs)
    assert sorted(back) == sorted(state)
    assert all(back[k].tobytes() == v.tobytes() and back[k].dtype == v.dtype
               for k, v in state.items())
