"""The canonical layout, set/get round trips, and safetensors files."""

from __future__ import annotations

import errno
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import numpy as np
import pytest

import attention_core as ac
from attention_core import files
from attention_core import weights as W
from tests.harness import Harness

#: These tests run on the columns too (conftest.py; tests.harness.COLUMNS).
COLUMN_TESTS = True

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


# -- set_weights takes every real float dtype; strict files; atomic saves -------------

FLOAT_DTYPES = [">f4", "<f8", ">f8", "float16", "longdouble"]
try:
    import ml_dtypes

    FLOAT_DTYPES.append("bfloat16")
except ImportError:  # pragma: no cover - ml_dtypes comes with jax and tensorflow
    ml_dtypes = None


def _numpy_dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


@pytest.mark.parametrize("built", [True, False], ids=["built", "unbuilt"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_set_weights_takes_every_float_dtype(backend: str, dtype: str, built: bool) -> None:
    """Big-endian, wider, narrower and extended floats are converted to the layer's float32,
    on a built layer and on one never called (which they build)."""
    h = Harness(backend)
    rng = np.random.default_rng(3)
    shapes = {"W_q.kernel": (3, 8), "W_k.kernel": (4, 8), "W_v.kernel": (5, 8), "W_o.kernel": (8, 8)}
    given = {name: rng.standard_normal(shape).astype(_numpy_dtype(dtype))
             for name, shape in shapes.items()}
    layer = h.make("MultiHeadAttention", {"num_hiddens": 8, "num_heads": 2})
    q, k, v = (h.array(rng.standard_normal((2, 4, n)).astype(np.float32)) for n in (3, 4, 5))
    if built:
        h.call(layer, q, k, v)
    layer.set_weights(given)
    got = layer.get_weights()
    for name, value in given.items():
        assert got[name].dtype == np.float32, name
        # float64 holds every value of these dtypes exactly; NumPy rounds it once to float32
        np.testing.assert_array_equal(got[name], value.astype(np.float64).astype(np.float32))
    reference = h.make("MultiHeadAttention", {"num_hiddens": 8, "num_heads": 2})
    reference.set_weights({name: value.astype(np.float64).astype(np.float32)
                           for name, value in given.items()})
    np.testing.assert_array_equal(h.numpy(h.call(layer, q, k, v)), h.numpy(h.call(reference, q, k, v)))


def test_set_weights_converts_everything_before_writing(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A conversion that fails on the last weight leaves every weight as it was."""
    h = Harness(backend)
    layer = h.make("TransformerEncoderBlock", {"num_hiddens": 8, "ffn_num_hiddens": 10, "num_heads": 2})
    X = h.array(np.random.default_rng(1).standard_normal((2, 3, 8)).astype(np.float32))
    h.call(layer, X)
    before = layer.get_weights()
    new = {name: (value + 1).astype(">f8") for name, value in before.items()}
    real, calls = h.ops.from_numpy, []

    def failing(x: np.ndarray, like: object = None) -> object:
        calls.append(1)
        if len(calls) == len(new):
            raise RuntimeError("last conversion failed")
        return real(x, like)

    monkeypatch.setattr(h.ops, "from_numpy", failing)
    with pytest.raises(RuntimeError, match="last conversion failed"):
        layer.set_weights(new)
    monkeypatch.undo()
    assert len(calls) == len(new)
    after = layer.get_weights()
    for name, value in before.items():
        np.testing.assert_array_equal(after[name], value, err_msg=name)


@pytest.mark.parametrize("layout", ["reversed", "zero_size", "metadata", "package_order"])
def test_files_the_package_writes_load(tmp_path: Path, layout: str) -> None:
    """Tensors in any order, empty tensors and the package's own metadata are all fine."""
    st = pytest.importorskip("safetensors.numpy")
    tensors = {"b": np.arange(4, dtype=np.float32), "a": np.ones((2, 2), np.float64),
               "z": np.zeros((0, 3), np.float16)}
    path = tmp_path / "theirs.safetensors"
    if layout == "metadata":
        st.save_file(tensors, str(path), metadata={"format": "pt", "note": "x"})
    elif layout == "reversed":  # data offsets in reverse name order, written byte by byte
        blobs, header, offset = [], {}, 0
        for name in sorted(tensors, reverse=True):
            raw = np.ascontiguousarray(tensors[name]).tobytes()
            code = {"float32": "F32", "float64": "F64", "float16": "F16"}[tensors[name].dtype.name]
            header[name] = {"dtype": code, "shape": list(tensors[name].shape),
                            "data_offsets": [offset, offset + len(raw)]}
            blobs.append(raw)
            offset += len(raw)
        head = json.dumps(header).encode()
        path.write_bytes(len(head).to_bytes(8, "little") + head + b"".join(blobs))
    else:
        st.save_file(tensors, str(path))
    got = W.read_safetensors(path)
    assert sorted(got) == sorted(tensors)
    for name, value in tensors.items():
        np.testing.assert_array_equal(got[name], value)


@pytest.mark.parametrize("header, body", [
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, 12),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [12, 20]}}, 20),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, 9),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, 12),
    ({"__metadata__": {"k": ["v"]}, "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, 8),
    ({"__metadata__": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, 8),
    ({}, 1),
], ids=["overlap", "gap", "trailing", "not_from_start", "metadata_list", "metadata_tensor",
        "bytes_without_tensors"])
def test_we_refuse_what_the_package_refuses(tmp_path: Path, header: dict, body: int) -> None:
    """Each fault is refused by the package too: we are at least as strict."""
    st = pytest.importorskip("safetensors.numpy")
    head = json.dumps(header).encode()
    content = len(head).to_bytes(8, "little") + head + bytes(body)
    with pytest.raises(Exception):  # noqa: B017 - the package's own error type
        st.load(content)
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="is not a valid safetensors file"):
        W.read_safetensors(path)


def test_tensor_named_metadata_is_refused_on_save(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'__metadata__': the safetensors format reserves"):
        ac.save_weights(tmp_path / "w.safetensors", {"__metadata__": np.ones(2, np.float32)})
    assert list(tmp_path.iterdir()) == []


class _FailingWrites:
    """A file whose writes fail (disk full) once ``limit`` bytes have been written."""

    def __init__(self, file: BinaryIO, limit: int) -> None:
        self.file, self.left = file, limit

    def write(self, data: bytes) -> int:
        if len(data) > self.left:
            self.file.write(data[: self.left])
            self.file.flush()
            raise OSError(errno.ENOSPC, "No space left on device")
        self.left -= len(data)
        return self.file.write(data)

    def __getattr__(self, name: str) -> object:
        return getattr(self.file, name)

    def __enter__(self) -> _FailingWrites:
        return self

    def __exit__(self, *exc: object) -> None:
        self.file.close()


def _raising(code: int) -> Callable[..., None]:
    def fail(*args: object) -> None:
        raise OSError(code, os.strerror(code))

    return fail


@pytest.mark.parametrize("fault", ["write", "fsync", "rename"])
def test_failed_overwrite_keeps_the_previous_file(
    backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    """A save that fails midway (some bytes written), at the fsync or at the rename leaves the
    previous file byte-identical and no temporary file behind."""
    h = Harness(backend)
    layer = h.make("PositionWiseFFN", {"ffn_num_hiddens": 5, "ffn_num_outputs": 4})
    h.call(layer, h.array(np.ones((1, 2, 4), np.float32)))
    path = tmp_path / "ffn.safetensors"
    ac.save_weights(path, {"old.kernel": np.arange(6, dtype=np.float32)})
    previous = path.read_bytes()
    if fault == "write":
        real = files.os.fdopen
        monkeypatch.setattr(files.os, "fdopen", lambda fd, mode: _FailingWrites(real(fd, mode), 100))
    elif fault == "fsync":
        monkeypatch.setattr(files.os, "fsync", _raising(errno.EIO))
    else:
        monkeypatch.setattr(files.os, "replace", _raising(errno.EXDEV))
    with pytest.raises(OSError):
        ac.save_weights(path, layer)
    monkeypatch.undo()
    assert path.read_bytes() == previous
    assert [p.name for p in tmp_path.iterdir()] == ["ffn.safetensors"]
    ac.save_weights(path, layer)  # and a save that succeeds replaces it
    assert sorted(ac.load_weights(path)) == sorted(layer.get_weights())


def test_atomic_write_gives_the_usual_permissions(tmp_path: Path) -> None:
    """The renamed file has the mode ``open`` would give (0o666 less the umask), not 0o600."""
    files.write_bytes(tmp_path / "a.bin", b"x")
    (tmp_path / "b.bin").write_bytes(b"x")
    assert (tmp_path / "a.bin").stat().st_mode == (tmp_path / "b.bin").stat().st_mode


def test_other_writers_are_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Generated page sections (markdown.write_between_markers) and figures go through the atomic writer."""
    from tools import markdown

    page = tmp_path / "speed.md"
    page.write_text("a\n<!-- s -->\nold\n<!-- e -->\nb\n")
    previous = page.read_bytes()
    real = files.os.fdopen
    monkeypatch.setattr(files.os, "fdopen", lambda fd, mode: _FailingWrites(real(fd, mode), 5))
    with pytest.raises(OSError):
        markdown.write_between_markers(page, "new", "<!-- s -->", "<!-- e -->")
    assert page.read_bytes() == previous
    assert [p.name for p in tmp_path.iterdir()] == ["speed.md"]


def test_header_larger_than_the_package_reads_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The package refuses headers over 100 MB; so do we (the limit lowered here to test it)."""
    path = tmp_path / "w.safetensors"
    W.write_safetensors(path, {"a": np.ones(2, np.float32)})
    n = int.from_bytes(path.read_bytes()[:8], "little")
    monkeypatch.setattr(W, "MAX_HEADER_BYTES", n - 1)
    with pytest.raises(ValueError, match=re.escape(f"header of {n} bytes is larger than {n - 1} bytes")):
        W.read_safetensors(path)
