"""The canonical layout, set/get round trips, and safetensors files."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import attention_core as ac
from attention_core import weights as W
from tests.harness import Harness

SPEC_CASES = [
    ("MultiHeadAttention", {"num_hiddens": 6, "num_heads": 2, "bias": True},
     {"W_q.kernel": (4, 6), "W_q.bias": (6,), "W_k.kernel": (5, 6), "W_k.bias": (6,),
      "W_v.kernel": (3, 6), "W_v.bias": (6,), "W_o.kernel": (6, 6), "W_o.bias": (6,)}),
    ("AdditiveAttention", {"num_hiddens": 6},
     {"W_q.kernel": (4, 6), "W_k.kernel": (5, 6), "w_v.kernel": (6, 1)}),
    ("RelativeMultiHeadAttention", {"num_hiddens": 6, "num_heads": 2, "max_relative_position": 3},
     {"W_q.kernel": (4, 6), "W_k.kernel": (5, 6), "W_v.kernel": (3, 6), "W_o.kernel": (6, 6),
      "rel_k.embedding": (7, 3), "rel_v.embedding": (7, 3)}),
    ("RelativeMultiHeadAttention", {"num_hiddens": 6, "num_heads": 3, "max_relative_position": 1,
                                    "relative_values": False},
     {"W_q.kernel": (4, 6), "W_k.kernel": (5, 6), "W_v.kernel": (3, 6), "W_o.kernel": (6, 6),
      "rel_k.embedding": (3, 2)}),
]


@pytest.mark.parametrize("layer, config, expected", SPEC_CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(SPEC_CASES)])
def test_layout_after_first_call(backend: str, layer: str, config: dict, expected: dict) -> None:
    h = Harness(backend)
    obj = h.make(layer, config)
    q, k, v = (np.zeros(s, np.float32) for s in [(1, 2, 4), (1, 3, 5), (1, 3, 3)])
    h.call(obj, h.array(q), h.array(k), h.array(v))
    got = {name: value.shape for name, value in obj.get_weights().items()}
    assert got == expected


def test_encoder_layout(backend: str) -> None:
    h = Harness(backend)
    encoder = h.make("TransformerEncoder", {"vocab_size": 7, "num_hiddens": 4, "ffn_num_hiddens": 5,
                                            "num_heads": 2, "num_blks": 2})
    h.call(encoder, h.array(np.zeros((1, 3), np.int32)))
    got = {name: value.shape for name, value in encoder.get_weights().items()}
    block = {"attention.W_q.kernel": (4, 4), "attention.W_k.kernel": (4, 4),
             "attention.W_v.kernel": (4, 4), "attention.W_o.kernel": (4, 4),
             "addnorm1.ln.gamma": (4,), "addnorm1.ln.beta": (4,),
             "ffn.dense1.kernel": (4, 5), "ffn.dense1.bias": (5,),
             "ffn.dense2.kernel": (5, 4), "ffn.dense2.bias": (4,),
             "addnorm2.ln.gamma": (4,), "addnorm2.ln.beta": (4,)}
    assert got == {"token.embedding": (7, 4), **{f"blks.{i}.{n}": s for i in range(2)
                                                  for n, s in block.items()}}


def test_encoder_block_layout(backend: str) -> None:
    h = Harness(backend)
    block = h.make("TransformerEncoderBlock",
                   {"num_hiddens": 8, "ffn_num_hiddens": 10, "num_heads": 2})
    h.call(block, h.array(np.zeros((1, 3, 8), np.float32)))
    got = {name: value.shape for name, value in block.get_weights().items()}
    assert got == {
        "attention.W_q.kernel": (8, 8), "attention.W_k.kernel": (8, 8),
        "attention.W_v.kernel": (8, 8), "attention.W_o.kernel": (8, 8),
        "addnorm1.ln.gamma": (8,), "addnorm1.ln.beta": (8,),
        "ffn.dense1.kernel": (8, 10), "ffn.dense1.bias": (10,),
        "ffn.dense2.kernel": (10, 8), "ffn.dense2.bias": (8,),
        "addnorm2.ln.gamma": (8,), "addnorm2.ln.beta": (8,),
    }


def test_set_weights_before_first_call_infers_input_sizes(backend: str) -> None:
    h = Harness(backend)
    rng = np.random.default_rng(0)
    weights = {"W_q.kernel": rng.standard_normal((4, 6)), "W_k.kernel": rng.standard_normal((5, 6)),
               "W_v.kernel": rng.standard_normal((3, 6)), "W_o.kernel": rng.standard_normal((6, 6))}
    layer = h.make("MultiHeadAttention", {"num_hiddens": 6, "num_heads": 3})
    layer.set_weights({k: v.astype(np.float32) for k, v in weights.items()})
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in [(2, 2, 4), (2, 3, 5), (2, 3, 3)])
    out = h.numpy(h.call(layer, h.array(q), h.array(k), h.array(v)))
    expected = ac.multi_head_attention(q.astype(float), k.astype(float), v.astype(float), weights, 3)
    assert np.max(np.abs(out - expected)) <= 1e-5
    got = layer.get_weights()
    for name in weights:
        np.testing.assert_array_equal(got[name], weights[name].astype(np.float32))


def test_save_and_load_round_trip(backend: str, tmp_path: Path) -> None:
    h = Harness(backend)
    src = h.make("TransformerEncoderBlock", {"num_hiddens": 8, "ffn_num_hiddens": 10, "num_heads": 2})
    X = h.array(np.random.default_rng(1).standard_normal((2, 3, 8)).astype(np.float32))
    out = h.numpy(h.call(src, X))
    ac.save_weights(tmp_path / "block.safetensors", src)
    dst = h.make("TransformerEncoderBlock", {"num_hiddens": 8, "ffn_num_hiddens": 10, "num_heads": 2})
    ac.load_weights(tmp_path / "block.safetensors", dst)
    np.testing.assert_array_equal(h.numpy(h.call(dst, X)), out)


def test_files_are_standard_safetensors(tmp_path: Path) -> None:
    st = pytest.importorskip("safetensors.numpy")
    tensors = {"a.kernel": np.arange(6, dtype=np.float32).reshape(2, 3),
               "b": np.array([1.5], np.float64), "c": np.zeros((0, 2), np.float16)}
    ours = tmp_path / "ours.safetensors"
    W.write_safetensors(ours, tensors)
    for name, value in st.load_file(str(ours)).items():
        np.testing.assert_array_equal(value, tensors[name])
        assert value.dtype == tensors[name].dtype
    theirs = tmp_path / "theirs.safetensors"
    st.save_file(tensors, str(theirs))
    for name, value in W.read_safetensors(theirs).items():
        np.testing.assert_array_equal(value, tensors[name])


def test_bfloat16_is_widened_exactly(tmp_path: Path) -> None:
    bits = np.array([0x3F80, 0xC000, 0x3E20], np.uint16)  # 1.0, -2.0, 0.15625
    path = tmp_path / "bf16.safetensors"
    header = b'{"x":{"dtype":"BF16","shape":[3],"data_offsets":[0,6]}}'
    path.write_bytes(len(header).to_bytes(8, "little") + header + bits.tobytes())
    np.testing.assert_array_equal(W.read_safetensors(path)["x"].astype(np.float32), [1.0, -2.0, 0.15625])


def with_header(header: bytes, body: bytes = b"") -> bytes:
    return len(header).to_bytes(8, "little") + header + body


@pytest.mark.parametrize("content, reason", [
    (b"\x01\x02", "only 2 bytes"),
    ((1000).to_bytes(8, "little") + b"{}", "header of 1000 bytes runs past the end of the file"),
    ((4).to_bytes(8, "little") + b"nope", "header is not JSON"),
    ((2).to_bytes(8, "little") + b"[]", "header is not a JSON object"),
    (with_header(b'{"x":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}', b"\0" * 8),
     "data of 'x' is truncated or misplaced"),
    (with_header(b'{"x":{"dtype":"Q9","shape":[1],"data_offsets":[0,1]}}', b"\0"),
     "entry 'x' has unsupported dtype Q9"),
    (with_header(b'{"x":{"dtype":"F32"}}'), "entry 'x' is malformed"),
], ids=["tiny", "long_header", "not_json", "not_object", "truncated", "foreign_dtype", "malformed"])
def test_bad_files_are_refused(tmp_path: Path, content: bytes, reason: str) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=re.escape(f"load_weights: {str(path)!r} is not a valid "
                                                   f"safetensors file: {reason}")):
        ac.load_weights(path)


def test_load_into_wrong_layer_changes_nothing(backend: str, tmp_path: Path) -> None:
    h = Harness(backend)
    ffn = h.make("PositionWiseFFN", {"ffn_num_hiddens": 5, "ffn_num_outputs": 4})
    h.call(ffn, h.array(np.ones((1, 2, 4), np.float32)))
    before = ffn.get_weights()
    norm = h.make("AddNorm", {"num_hiddens": 4})
    ac.save_weights(tmp_path / "norm.safetensors", norm)
    with pytest.raises(ValueError, match="set_weights: missing weights"):
        ac.load_weights(tmp_path / "norm.safetensors", ffn)
    for name, value in ffn.get_weights().items():
        np.testing.assert_array_equal(value, before[name])
