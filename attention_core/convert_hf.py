"""Hugging Face Llama-family checkpoints (Llama, Mistral, Qwen2) to and from canonical weights.

With NumPy alone (no ``transformers``, no ``torch``): :func:`hf_config` reads a ``config.json``
into the keyword arguments of a decoder-only :class:`TransformerDecoder`, :func:`from_hf_llama`
maps a state dict (or ``.safetensors`` files) onto the canonical names of the Weights page, and
:func:`to_hf_llama` maps them back.

The map, for block ``N`` (``model.`` prefix optional on the way in, written on the way out):

===========================================  ==========================================
Hugging Face                                 canonical
===========================================  ==========================================
``model.embed_tokens.weight (V, h)``         ``token.embedding (V, h)``
``model.layers.N.self_attn.q_proj.weight``   ``blks.N.self_attention.W_q.kernel`` (transposed)
``...k_proj``, ``v_proj``, ``o_proj``        ``W_k``, ``W_v``, ``W_o`` (and ``.bias``)
``model.layers.N.mlp.gate_proj.weight``      ``blks.N.ffn.gate.kernel`` (transposed)
``...up_proj``, ``down_proj``                ``ffn.dense1``, ``ffn.dense2``
``model.layers.N.input_layernorm.weight``    ``blks.N.addnorm1.ln.gamma``
``...post_attention_layernorm.weight``       ``blks.N.addnorm2.ln.gamma``
``model.norm.weight``                        ``final_norm.ln.gamma``
``lm_head.weight (V, h)``                    ``dense.kernel (h, V)``; absent when tied
===========================================  ==========================================

Every ``nn.Linear`` weight is ``(out, in)`` and every canonical kernel ``(in, out)``: each is
transposed, and nothing else changes. The query and key rows need no permutation: Hugging
Face's rotary embedding rotates the two halves of each head (``rotate_half``), as this library
does. Meta's original ``.pth`` checkpoints rotate interleaved pairs instead; they are not
supported (convert them to the Hugging Face layout first).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from attention_core import checks, declarations
from attention_core import weights as W
from attention_core.host import host_array

#: The ``model_type`` values read here: their weights and blocks are the same.
MODEL_TYPES = ("llama", "mistral", "qwen2")

#: The keyword arguments every Llama-family model gets (the rest come from its config).
FIXED = {"decoder_only": True, "positional": "rotary", "norm_first": True, "norm": "rms",
         "activation": "swiglu", "output_bias": False, "scale_embeddings": False}

#: Arguments of the stack that a Llama-family model leaves at their defaults.
DEFAULTS = {"softcap": None, "scale": None, "sinks": False}

#: Canonical name in a block -> (Hugging Face name in a layer, transposed).
_BLOCK_NAMES = {
    **{f"self_attention.W_{p}.{kind}": (f"self_attn.{p}_proj.{hf}", kind == "kernel")
       for p in "qkvo" for kind, hf in (("kernel", "weight"), ("bias", "bias"))},
    **{f"ffn.{ours}.{kind}": (f"mlp.{theirs}_proj.{hf}", kind == "kernel")
       for ours, theirs in (("gate", "gate"), ("dense1", "up"), ("dense2", "down"))
       for kind, hf in (("kernel", "weight"), ("bias", "bias"))},
    "addnorm1.ln.gamma": ("input_layernorm.weight", False),
    "addnorm2.ln.gamma": ("post_attention_layernorm.weight", False),
}
_STACK_NAMES = {"token.embedding": ("model.embed_tokens.weight", False),
                "final_norm.ln.gamma": ("model.norm.weight", False),
                "dense.kernel": ("lm_head.weight", True)}

#: Buffers older checkpoints hold beside the weights; derived from the config, so skipped.
_DERIVED = ("rotary_emb.inv_freq",)


# -- the config -------------------------------------------------------------------------------


def read_config(config: Mapping[str, Any] | str | os.PathLike[str], where: str
                ) -> dict[str, Any]:
    """A config as a dict: the mapping itself, or a ``config.json`` (or its directory) read."""
    if isinstance(config, Mapping):
        return dict(config)
    if not isinstance(config, (str, os.PathLike)):
        raise TypeError(f"{where}: config must be a mapping or the path of a config.json, got "
                        f"{type(config).__name__}")
    path = Path(config)
    path = path / "config.json" if path.is_dir() else path
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: {os.fspath(path)!r} is not JSON: {err}") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"{where}: {os.fspath(path)!r} does not hold a JSON object")
    return loaded


def hf_config(config: Mapping[str, Any] | str | os.PathLike[str]) -> dict[str, Any]:
    """The keyword arguments of the decoder-only ``TransformerDecoder`` of a Hugging Face model.

    Args:
        config: A Llama, Mistral or Qwen2 config: its dict (``model.config.to_dict()``), or the
            path of its ``config.json`` or of the directory holding it.

    Returns:
        ``vocab_size``, ``num_hiddens``, ``ffn_num_hiddens``, ``num_heads``, ``num_blks``,
        ``num_kv_heads``, ``rotary_base``, ``window`` (Mistral's ``sliding_window``; Qwen2's
        only with ``use_sliding_window``), ``norm_eps``, ``bias`` (Qwen2: ``"qkv"``; else
        ``attention_bias``), ``ffn_bias`` (``mlp_bias``), ``tie_output``
        (``tie_word_embeddings``) and the fixed Llama choices (pre-norm RMSNorm, SwiGLU,
        rotary, unscaled embeddings, no output bias). ``max_position_embeddings`` is not a
        bound here: rotary positions need no table.

    Raises:
        TypeError: ``config`` is neither a mapping nor a path.
        ValueError: A key is missing, or names what this library's blocks do not compute (the
            message names the key): another ``model_type`` (Gemma's norms, for one, scale by
            ``1 + weight``), ``head_dim`` other than ``hidden_size / num_attention_heads``, a
            rope type other than ``"default"`` or a partial rotary factor, ``hidden_act`` other
            than ``"silu"``, or ``layer_types`` mixing full and sliding attention.
    """
    c = read_config(config, "hf_config")
    model_type = _required(c, "model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"hf_config: model_type {model_type!r} is not supported; expected one "
                         f"of {MODEL_TYPES}{_why_not(str(model_type))}")
    h, heads = _required(c, "hidden_size"), _required(c, "num_attention_heads")
    if c.get("head_dim") is not None and (not isinstance(h, int) or not isinstance(heads, int)
                                          or c["head_dim"] * heads != h):
        raise ValueError(f"hf_config: head_dim is {c['head_dim']!r}, but hidden_size / "
                         f"num_attention_heads is {h!r} / {heads!r}; this library's heads are "
                         "num_hiddens / num_heads wide")
    if c.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hf_config: hidden_act {c['hidden_act']!r} is not supported; expected "
                         "'silu' (SwiGLU)")
    layers = _required(c, "num_hidden_layers")
    kwargs = {"vocab_size": _required(c, "vocab_size"), "num_hiddens": h,
              "ffn_num_hiddens": _required(c, "intermediate_size"), "num_heads": heads,
              "num_blks": layers,
              "num_kv_heads": c.get("num_key_value_heads") or heads,
              "rotary_base": _rope_theta(c), "window": _window(c, model_type, layers),
              "norm_eps": c.get("rms_norm_eps", 1e-6),
              "bias": "qkv" if model_type == "qwen2" else bool(c.get("attention_bias", False)),
              "ffn_bias": bool(c.get("mlp_bias", False)),
              "tie_output": bool(c.get("tie_word_embeddings", False)), **FIXED}
    stack = declarations.LAYERS["TransformerDecoder"](**kwargs)
    stack.check()
    return kwargs


def _required(c: Mapping[str, Any], key: str) -> Any:
    if c.get(key) is None:
        raise ValueError(f"hf_config: config has no {key!r}")
    return c[key]


def _why_not(model_type: str) -> str:
    if model_type.startswith("gemma"):
        return ("; Gemma's RMSNorm scales by 1 + weight and its embeddings by "
                "sqrt(hidden_size), which a Llama-family decoder does not")
    return ""


def _rope_theta(c: Mapping[str, Any]) -> float:
    """``rope_theta`` (``rope_parameters["rope_theta"]`` in transformers 5), default rope only."""
    for key in ("rope_parameters", "rope_scaling"):
        rope = c.get(key)
        if rope is None:
            continue
        if not isinstance(rope, Mapping):
            raise ValueError(f"hf_config: {key} must be an object, got {rope!r}")
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            name = "rope_type" if "rope_type" in rope else "type"
            raise ValueError(f"hf_config: {key}[{name!r}] is {kind!r}; only 'default' rotary "
                             "positions are supported (no rope scaling)")
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"hf_config: {key}['partial_rotary_factor'] is "
                             f"{rope['partial_rotary_factor']!r}; only 1.0 is supported")
    rope = c.get("rope_parameters") or {}
    theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
    return float(theta)


def _window(c: Mapping[str, Any], model_type: str, layers: Any) -> int | None:
    """Every block's window; ValueError when the layers differ."""
    types = c.get("layer_types")
    key = "layer_types"
    if types is None and model_type == "qwen2" and isinstance(layers, int):
        sliding = c.get("use_sliding_window") and c.get("sliding_window") is not None
        first = c.get("max_window_layers", 0)
        types = ["sliding_attention" if sliding and i >= first else "full_attention"
                 for i in range(layers)]
        key = "layer_types (from use_sliding_window and max_window_layers)"
    if types is None:
        return c.get("sliding_window") if model_type == "mistral" else None
    kinds = sorted(set(types))
    if len(kinds) > 1:
        raise ValueError(f"hf_config: {key} mixes {kinds}; this library's decoder gives every "
                         "block the same attention")
    if kinds and kinds[0] not in ("full_attention", "sliding_attention"):
        raise ValueError(f"hf_config: {key} holds {kinds[0]!r}; expected 'full_attention' or "
                         "'sliding_attention'")
    return c.get("sliding_window") if kinds == ["sliding_attention"] else None


# -- the names ----------------------------------------------------------------------------------


def hf_names(kwargs: Mapping[str, Any], where: str = "hf_names"
             ) -> dict[str, tuple[str, tuple[int, ...], bool]]:
    """Canonical name -> (Hugging Face name, canonical shape, transposed) of a stack's weights.

    Args:
        kwargs: A decoder-only ``TransformerDecoder``'s keyword arguments (:func:`hf_config`).
        where: The caller's name, for the messages.
    """
    try:
        stack = declarations.LAYERS["TransformerDecoder"](**kwargs)
    except TypeError as err:
        raise TypeError(f"{where}: kwargs are not TransformerDecoder arguments: {err}") from None
    stack.check()
    out = {}
    for name, shape in stack.weight_shapes().items():
        if name.startswith("blks."):
            _, block, rest = name.split(".", 2)
            hf, transposed = _BLOCK_NAMES[rest]
            hf = f"model.layers.{block}.{hf}"
        else:
            hf, transposed = _STACK_NAMES[name]
        out[name] = (hf, W._known_dims(name, shape), transposed)
    return out


def _check_kwargs(kwargs: Any, where: str) -> None:
    """ValueError unless ``kwargs`` make a stack a Llama-family checkpoint can hold."""
    if not isinstance(kwargs, Mapping):
        raise TypeError(f"{where}: kwargs must be a mapping of TransformerDecoder arguments, "
                        f"got {type(kwargs).__name__}")
    for key, want in {**FIXED, **DEFAULTS}.items():
        got = kwargs.get(key, DEFAULTS.get(key))
        if got != want or type(got) is not type(want):
            raise ValueError(f"{where}: kwargs[{key!r}] is {got!r}; a Llama-family model has "
                             f"{want!r}")


# -- the weights --------------------------------------------------------------------------------


def read_state(state: Any, where: str) -> dict[str, Any]:
    """A state dict as given, or read from a ``.safetensors`` file or a directory of them."""
    if isinstance(state, Mapping):
        W.check_keys(state, where)
        return dict(state)
    if not isinstance(state, (str, os.PathLike)):
        raise TypeError(f"{where}: state must be a mapping of name -> array or the path of a "
                        f".safetensors file, got {type(state).__name__}")
    path = Path(state)
    if not path.is_dir():
        return W.read_safetensors(path)
    found: dict[str, Any] = {}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{where}: no .safetensors file in {os.fspath(state)!r}")
    for file in files:
        for name, array in W.read_safetensors(file).items():
            if name in found:
                raise ValueError(f"{where}: {name!r} is in two files of {os.fspath(state)!r}")
            found[name] = array
    return found


def from_hf_llama(
    state: Mapping[str, Any] | str | os.PathLike[str],
    config: Mapping[str, Any] | str | os.PathLike[str] | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Canonical weights and ``TransformerDecoder`` arguments of a Llama, Mistral or Qwen2 model.

    Args:
        state: The ``LlamaForCausalLM`` (or ``LlamaModel``) state dict, arrays of any framework
            (``model.state_dict()``); or the path of a ``.safetensors`` file, or of a directory
            whose ``.safetensors`` files together hold it (what ``save_pretrained`` writes).
            The ``model.`` prefix is optional. Without ``lm_head.weight`` the logits are tied
            to the embedding (unless the config says ``tie_word_embeddings: false``).
        config: What :func:`hf_config` takes; None to read ``config.json`` beside ``state``
            (a directory).

    Returns:
        ``(weights, kwargs)``: ``TransformerDecoder(**kwargs)`` takes ``weights`` in
        ``set_weights`` or :func:`attention_core.save_weights`. Each keeps its dtype.

    Raises:
        TypeError: ``state`` is neither a mapping nor a path, or a weight is not floating
            point.
        ValueError: The config is refused (see :func:`hf_config`), or a key of ``state`` is
            unexpected, missing or of the wrong shape (the first such key is named).
    """
    if config is None:
        if not isinstance(state, (str, os.PathLike)) or not Path(state).is_dir():
            raise TypeError("from_hf_llama: config is required unless state is a directory "
                            "holding config.json")
        config = state
    raw = read_config(config, "from_hf_llama")
    kwargs = hf_config(raw)
    given = _plain_names(read_state(state, "from_hf_llama"))
    kwargs["tie_output"] = _tied(given, raw)
    names = hf_names(kwargs, "from_hf_llama")
    _check_keys(given, {hf for hf, _, _ in names.values()})
    weights = {}
    for name, (hf, shape, transposed) in names.items():
        key, value = given[hf]
        array = host_array(value)
        if not W.is_float_dtype(array.dtype.name):
            raise TypeError(f"from_hf_llama: {key!r} must be floating point, got "
                            f"{array.dtype.name}")
        want = shape[::-1] if transposed else shape
        if array.shape != want:
            raise ValueError(f"from_hf_llama: {key!r} has shape {checks.fmt_shape(array.shape)}, "
                             f"expected {checks.fmt_shape(want)}")
        weights[name] = np.array(array.T if transposed else array, order="C", copy=True)
    return weights, kwargs


def _plain_names(state: Mapping[str, Any]) -> dict[str, tuple[str, Any]]:
    """HF name with the ``model.`` prefix -> (the key as given, its array); buffers dropped."""
    out: dict[str, tuple[str, Any]] = {}
    for key, value in state.items():
        if key.endswith(_DERIVED):
            continue
        name = key if key.startswith(("model.", "lm_head.")) else f"model.{key}"
        if name in out:
            raise ValueError(f"from_hf_llama: state has both {out[name][0]!r} and {key!r}")
        out[name] = (key, value)
    return out


def _tied(given: Mapping[str, tuple[str, Any]], config: Mapping[str, Any]) -> bool:
    """Whether the logits use the embedding: no ``lm_head.weight``, or a copy of it."""
    said = config.get("tie_word_embeddings")
    if "lm_head.weight" not in given:
        if said is False:
            raise ValueError("from_hf_llama: missing key 'lm_head.weight' (the config has "
                             "tie_word_embeddings: false)")
        return True
    if said and "model.embed_tokens.weight" in given:
        head = host_array(given["lm_head.weight"][1])
        if not np.array_equal(head, host_array(given["model.embed_tokens.weight"][1])):
            raise ValueError("from_hf_llama: lm_head.weight differs from "
                             "model.embed_tokens.weight, but the config has "
                             "tie_word_embeddings: true")
    return bool(said)


def _check_keys(given: Mapping[str, tuple[str, Any]], expected: set[str]) -> None:
    tied_copy = {"lm_head.weight"} if "lm_head.weight" not in expected else set()
    for name, (key, _) in given.items():
        if name not in expected | tied_copy:
            raise ValueError(f"from_hf_llama: unexpected key {key!r}: the config's model has "
                             "no such weight")
    for name in sorted(expected, key=_order):
        if name not in given:
            raise ValueError(f"from_hf_llama: missing key {name!r}")


def _order(name: str) -> tuple[int, str]:
    """Layers in numeric order, then the stack's names."""
    parts = name.split(".")
    return (int(parts[2]), name) if parts[1] == "layers" else (-1, name)


def to_hf_llama(weights: Mapping[str, Any], kwargs: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """A Hugging Face state dict (``model.`` names, ``(out, in)`` matrices) of canonical weights.

    Args:
        weights: A decoder-only ``TransformerDecoder``'s canonical weights (``get_weights()``,
            :func:`attention_core.load_weights`, or :func:`from_hf_llama`).
        kwargs: Its keyword arguments (what :func:`hf_config` returns).

    Returns:
        Hugging Face name -> NumPy array, each of the dtype given; no ``lm_head.weight`` when
        ``tie_output``. ``to_hf_llama(*from_hf_llama(state, config))`` equals ``state`` byte for
        byte (with the ``model.`` prefix).

    Raises:
        TypeError: ``kwargs`` is not a mapping, or a weight is not floating point.
        ValueError: ``kwargs`` describe a stack no Llama-family checkpoint holds (the argument
            is named), or the weights' names or shapes do not fit it.
    """
    _check_kwargs(kwargs, "to_hf_llama")
    names = hf_names(kwargs, "to_hf_llama")
    checked = W.check_weights({name: shape for name, (_, shape, _) in names.items()}, weights,
                              "to_hf_llama")
    return {hf: np.ascontiguousarray(checked[name].T) if transposed else checked[name]
            for name, (hf, _, transposed) in names.items()}
