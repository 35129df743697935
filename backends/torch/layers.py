"""PyTorch layers: every declared layer (:mod:`attention_core.declarations`) as a ``nn.Module``.

Parameters are kept in the canonical layout (the Weights page), kernels ``(in, out)``, in
submodules named like the canonical names (``W_q`` holds ``kernel`` and ``bias``); a composite
is made of child layers named like its sublayers (``attention``, ``blks.0``). So
``state_dict()`` has exactly the keys and shapes of ``get_weights()``. Fixed tables (the
sinusoidal ``P``) are non-persistent buffers; ``.double()`` recomputes them exactly.

Input sizes are inferred on the first call, like ``torch.nn.LazyLinear``: a kernel whose input
size is unknown is a :class:`torch.nn.UninitializedParameter`, materialised in place. They may
also be given (``q_in=`` etc.), or come from ``set_weights`` or ``load_state_dict``. A call
that raises changes nothing: kernels it materialised are turned back into placeholders.

Layers made under ``with torch.device("meta")`` (or moved there) run on meta inputs, as no
call reads a tensor's values; ``to_empty(device=...)`` then ``reset_parameters()`` gives them
the weights a layer made on that device draws under the same seed.

Inputs are batch-first ``(B, T, D)`` (torch's ``batch_first=True``). Calls also take torch's
keywords (``attn_mask``, ``key_padding_mask``, ``is_causal``, ``need_weights``,
``average_attn_weights``; ``src_mask``, ``src_key_padding_mask`` for the encoder block), with
torch's meaning (:mod:`backends.torch.conventions`).

Dropout follows ``module.train()`` / ``module.eval()``. ``attention_weights`` keeps the last
call's attention weights, before dropout (the encoder's: a list, one per block, also kept by
each block); with ``keep_attention_weights=False`` calls that do not ask for them may go
through ``torch.nn.functional.scaled_dot_product_attention``, and they are then None.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.parameter import Parameter, UninitializedParameter, is_lazy

from attention_core import checks
from attention_core import declarations as D
from attention_core import weights as W
from backends.torch.conventions import TORCH
from backends.torch.ops import OPS, TorchOps, _tracing, autocasting
from backends.torch.parallel import context_parallel

Tensor = torch.Tensor


@dataclass(eq=False)
class TorchArguments:
    """The torch layers' own constructor arguments, after the declared ones.

    Args:
        q_in: Queries' size, or None to learn it on the first call (layers that learn it).
        k_in: Keys' size, likewise.
        v_in: Values' size, likewise.
        d_in: The input's size, likewise.
        device: Device of the parameters and buffers.
        dtype: Dtype of the parameters and buffers; torch's default dtype when None.
    """

    _: KW_ONLY
    q_in: int | None = None
    k_in: int | None = None
    v_in: int | None = None
    d_in: int | None = None
    device: torch.device | str | None = None
    dtype: torch.dtype | None = None


class Holder(LazyModuleMixin, nn.Module):
    """Holds parameters under canonical names (``W_q`` holds ``kernel``); never called.

    :class:`~torch.nn.modules.lazy.LazyModuleMixin` lets ``state_dict`` and
    ``load_state_dict`` handle a kernel whose input size is not known yet.
    """

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> Holder:
        """Moves or casts like any module; kernels of unknown size stay placeholders."""
        apply = super()._apply
        return _keeping_placeholders(self, fn, lambda: apply(fn, recurse))  # type: ignore[no-untyped-call]

    def extra_repr(self) -> str:
        return ", ".join(f"{name}: {checks.fmt_shape(p.shape)}" if not is_lazy(p) else f"{name}: ?"
                         for name, p in self._parameters.items() if p is not None)


#: The torch class of each declaration (to make a composite's children).
CLASSES: dict[type[D.Declaration], type[Layer]] = {}


@D.dataclass_transform()
class Layer(TorchArguments, D.KeptAttention, D.Declaration, nn.Module):
    """Holds a declared layer's weights as ``Parameter``s and calls its forward.

    Attributes:
        attention_weights: The last call's attention weights ``(B, H, Q, K)``, before dropout
            (a list, one per block, for the encoder); None when not formed.
    """

    __repr__ = nn.Module.__repr__
    convention = TORCH  # torch's call keywords too (backends.torch.conventions)
    context_parallel_reader = staticmethod(context_parallel)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        own = {p.name: p for p in D.keyword_parameters(TorchArguments)}
        cls.extras = tuple(own[name] for name in (*cls.sizes, "device", "dtype"))
        super().__init_subclass__(**kwargs)
        if cls.declared_or_none():
            CLASSES.setdefault(cls.declared(), cls)
            forward = D.with_call_signature(cls, Layer.forward, "forward")
            cls.forward = forward  # type: ignore[method-assign]

    if not TYPE_CHECKING:  # type checkers see the declared signature (dataclass_transform)

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            nn.Module.__init__(self)
            self._setup(args, kwargs)

    def _setup(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        declared, extras = self.bind_arguments(args, kwargs, *self.extras)
        vars(self).update(declared)
        self.check()
        factory = {"device": extras.pop("device"), "dtype": extras.pop("dtype")}
        spec = self.own_weight_shapes(**extras)
        for name, shape in spec.items():
            dims = [d for d in shape if d is not None]
            self._attach(name, Parameter(torch.empty(dims, **factory)) if len(dims) == len(shape)
                         else cast(Parameter, UninitializedParameter(**factory)))
        for name, sub in self.sublayers().items():
            arguments: dict[str, Any] = {**sub.layer.arguments(), **sub.dims, **factory}
            self._attach(name, CLASSES[type(sub.layer)](**arguments))
        tables = self.constants("float64")
        # the default device is the one of ``with torch.device(...)`` (meta for a model's shape)
        device = factory["device"] or torch.get_default_device()
        dtype = factory["dtype"] or torch.get_default_dtype()
        for name, table in tables.items():
            self.register_buffer(name, torch.from_numpy(table).to(device, dtype), persistent=False)
        self._tables = tuple(tables)
        self._attention_kept = self.finish(None, False, False)[1]
        self._init([name for name, shape in spec.items() if None not in shape])

    def _attach(self, name: str, value: nn.Module | Parameter) -> None:
        """Adds a parameter or a child layer under its canonical name.

        The module that holds it (``W_q`` for ``W_q.kernel``, ``blks`` for ``blks.0``) is made
        if needed.
        """
        path, _, leaf = name.rpartition(".")
        if path and path not in self._modules:
            self.add_module(path, nn.ModuleList() if leaf.isdigit() else Holder())
        owner = self.get_submodule(path) if path else self
        if isinstance(value, nn.Module):
            owner.add_module(leaf, value)
        else:
            owner.register_parameter(leaf, value)

    def spec(self) -> W.Spec:
        """Canonical names and shapes of this layer's weights (None = not known yet)."""
        return self.weight_shapes(**self._dims())

    def _dims(self, params: Mapping[str, Tensor] | None = None) -> dict[str, int]:
        """The input sizes known from the kernels (``q_in`` ...) of ``params`` (the layer's)."""
        params = dict(self.named_parameters()) if params is None else params
        return {dim: OPS.fixed_shape(params[s.weight])[0] for dim, s in self.sizes.items()
                if not isinstance(params[s.weight], UninitializedParameter)}

    @property
    def built(self) -> bool:
        """Whether every weight's shape is known."""
        return not any(is_lazy(p) for p in self.parameters())

    def reset_parameters(self) -> None:
        """Draws initial values for every weight whose shape is known.

        By each weight's rule (:func:`attention_core.weights.init_rule`), from torch's
        generator, in the order the constructor draws them, so under the same
        ``torch.manual_seed`` a layer made on ``meta``, then ``to_empty(device=...)`` and
        ``reset_parameters()``, holds the weights of one made on that device.
        """
        children = self.sublayers()
        for name in children:
            cast(Layer, self.get_submodule(name)).reset_parameters()
        inner = tuple(f"{name}." for name in children)
        self._init([name for name, p in self.named_parameters()
                    if not name.startswith(inner) and not is_lazy(p)])

    def _init(self, names: list[str]) -> None:
        params = dict(self.named_parameters())
        with torch.no_grad():
            for name in names:
                rule = W.init_rule(name, tuple(params[name].shape))
                if rule.kind == "uniform":
                    params[name].uniform_(rule.a, rule.b)
                elif rule.kind == "normal":
                    params[name].normal_(rule.a, rule.b)
                else:
                    params[name].fill_(rule.a)

    def _build(self, dims: Mapping[str, int], params: Mapping[str, Tensor]) -> list[Tensor]:
        """Checks input sizes against the known ones; materialises the kernels of unknown ones.

        Args:
            dims: The input sizes of this call.
            params: The layer's parameters by name.

        Returns:
            The kernels materialised now, to turn back into placeholders if the call fails.
        """
        known = self._dims(params)
        for dim, size in dims.items():
            checks.check_built_size(self.sizes[dim].argument, size, known.get(dim))
        fresh = {dim: size for dim, size in dims.items() if dim not in known}
        if not fresh:
            return []
        self._materialize(fresh)
        params = dict(self.named_parameters())
        return [params[self.sizes[dim].weight] for dim in fresh]

    @torch.compiler.disable(  # type: ignore[untyped-decorator, no-untyped-call]
        reason="input sizes are inferred eagerly: call the layer once, or set_weights, "
        "before compiling with fullgraph=True"
    )
    def _materialize(self, dims: dict[str, int]) -> None:
        """Gives the kernels of the unknown input sizes their shapes and initial values."""
        spec, params = self.weight_shapes(**dims), dict(self.named_parameters())
        names = [self.sizes[dim].weight for dim in dims]
        for name in names:
            kernel = params[name]
            assert isinstance(kernel, UninitializedParameter)
            kernel.materialize(tuple(d for d in spec[name] if d is not None))  # all known
        self._init(names)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Calls the declared forward (see the class's call signature)."""
        bound = self.bind_call(args, kwargs)
        params = _parameters(self)
        param = next(iter(params.values()), None)
        first = next((a for a in bound.values() if isinstance(a, Tensor)), None)
        if first is None:  # host data only (NumPy token ids): the layer's device
            first = param
        ops = TorchOps(None if first is None else first.device)
        bound = self._numpy_inputs(ops, bound)
        state = None if self.id_inputs else _state(params)  # token ids: no plans (prepare)
        prepared = self.prepare(ops, _compute_dtype(param), bound, state)
        fresh = [] if prepared.planned else self._build(prepared.dims, params)
        self.keep_plan(prepared)
        try:
            need = self.needs_attention(prepared.return_attention)
            rate = getattr(self, "dropout", 0.0) if self.training else 0.0
            constants = {name: self.get_buffer(name) for name in self._tables}
            # the parameters hold the declared shapes (set_weights checks them, _build the
            # inputs' widths), so the core does not check them again
            run = D.Run(ops, self._checked_weights(params), constants, rate, need)
            returned, kept = self.finish(
                self.compute(run, **prepared.arguments), need, prepared.return_attention
            )
        except BaseException:
            for kernel in fresh:  # undoes _materialize, in place
                kernel.grad = None
                kernel.data = torch.empty(0, device=kernel.device, dtype=kernel.dtype)
                kernel.__class__ = UninitializedParameter
            raise
        # torch.export's values are symbolic: the layer keeps nothing of the traced call (a
        # tensor attribute set while exporting is undone afterwards, with a UserWarning)
        if self.attention_kind and not torch.compiler.is_exporting():
            self._keep(kept)
        return returned

    def _checked_weights(self, params: dict[str, Tensor]) -> W.CheckedWeights:
        """The parameters as the core takes them, the last call's mapping where it can be.

        While it holds the same parameter objects its parts, grouped once, are kept; else, and
        in a traced call (which keeps nothing), a new one is made.
        """
        if _tracing():
            return W.CheckedWeights(params)
        last = self.__dict__.get("_checked")
        if (last is not None and list(last) == list(params)
                and all(map(operator.is_, last.values(), params.values()))):
            return cast(W.CheckedWeights, last)
        made = self.__dict__["_checked"] = W.CheckedWeights(params)  # never a module's attribute
        return made

    def _numpy_inputs(self, ops: TorchOps, bound: dict[str, Any]) -> dict[str, Any]:
        """Inputs computed on that are all NumPy arrays, as tensors on the layer's device.

        As the other backends' layers take them; NumPy beside torch stays refused by name.
        """
        given = [bound[n] for n in self.cast_inputs if bound.get(n) is not None]
        if given and all(isinstance(x, np.ndarray) and x.dtype.kind in "fciub" for x in given):
            bound.update({n: ops.from_numpy(bound[n]) for n in self.cast_inputs
                          if bound.get(n) is not None})
        return bound

    def _keep(self, kept: Any) -> None:
        """Keeps a call's attention weights, and each part in the sublayer it belongs to.

        A stack's blocks keep theirs: ``decoder.blks[0].attention_weights``.
        """
        self.__dict__["_attention_kept"] = kept  # a plain attribute, never a module's buffer
        for name, part in self.kept_parts(kept).items():
            sub: Any = self
            for step in name.split("."):  # get_submodule's walk, without its checks
                sub = sub._modules[step]
            cast(Layer, sub)._keep(part)


    def get_weights(self) -> dict[str, np.ndarray]:
        """Returns a copy of the weights in the canonical layout (the Weights page)."""
        if not self.built:
            raise checks.not_built(type(self).__name__)
        return {name: OPS.to_numpy(p).copy() for name, p in self.named_parameters()}

    def set_weights(self, weights: Mapping[str, Any]) -> None:
        """Sets every weight from a canonical mapping; checks all names and shapes first.

        Values may be arrays of any framework and of any real float dtype (read on the host
        by :func:`attention_core.host.host_array`); they are cast to the parameters' dtype.
        Every value is checked and converted before the first parameter changes. Setting the
        weights of a layer not called yet fixes its input sizes.
        """
        params = dict(self.named_parameters())
        dtypes = {name: OPS.dtype_name(p) for name, p in params.items()}
        checked = W.check_weights(self.spec(), weights, dtype=dtypes)
        staged = {name: OPS.from_numpy(value, like=params[name]) for name, value in checked.items()}
        with torch.no_grad():
            for name, value in staged.items():
                param = params[name]
                if isinstance(param, UninitializedParameter):
                    param.materialize(value.shape)
                param.copy_(value)

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> Layer:
        """Moves or casts like any module, then recomputes fixed tables from float64.

        A table cast from float32 to float64 would keep float32 digits.
        """
        apply = super()._apply
        _keeping_placeholders(self, fn, lambda: apply(fn, recurse))  # type: ignore[no-untyped-call]
        for name, table in (self.constants("float64") if self._tables else {}).items():
            old = self.get_buffer(name)
            if old.is_floating_point():
                setattr(self, name, torch.from_numpy(table).to(old.device, old.dtype))
        return self

    def extra_repr(self) -> str:
        return self.describe()


def _keeping_placeholders(module: nn.Module, fn: Callable[[Tensor], Tensor],
                          apply: Callable[[], Any]) -> Any:
    """Runs ``apply`` (``module``'s ``_apply(fn)``) with its placeholder kernels set aside.

    Each placeholder is then made again where ``fn`` sends an empty tensor (device, dtype).
    ``nn.Module._apply`` would make one a plain parameter of size 0 on ``meta``, and
    ``to_empty`` refuses it.
    """
    own = module._parameters
    lazy: dict[str, Any] = {name: p for name, p in own.items() if p is not None and is_lazy(p)}
    own.update(dict.fromkeys(lazy))  # None: passed over, and the order of the names is kept
    try:
        applied = apply()
    except BaseException:
        own.update(lazy)
        raise
    for name, p in lazy.items():
        probe = fn(torch.empty(0, device=p.device, dtype=p.dtype))
        made: dict[str, Any] = {"device": probe.device, "dtype": probe.dtype}
        own[name] = cast(Parameter, UninitializedParameter(requires_grad=p.requires_grad, **made))
    return applied


class DotProductAttention(Layer, D.DotProductAttention): ...
class AdditiveAttention(Layer, D.AdditiveAttention): ...
class MultiHeadAttention(Layer, D.MultiHeadAttention): ...
class RelativeMultiHeadAttention(Layer, D.RelativeMultiHeadAttention): ...
class PositionalEncoding(Layer, D.PositionalEncoding): ...
class RotaryEmbedding(Layer, D.RotaryEmbedding): ...
class LearnedPositionalEncoding(Layer, D.LearnedPositionalEncoding): ...
class PositionWiseFFN(Layer, D.PositionWiseFFN): ...
class AddNorm(Layer, D.AddNorm): ...
class TransformerEncoderBlock(Layer, D.TransformerEncoderBlock): ...
class TransformerEncoder(Layer, D.TransformerEncoder): ...
class TransformerDecoderBlock(Layer, D.TransformerDecoderBlock): ...
class TransformerDecoder(Layer, D.TransformerDecoder): ...
class Transformer(Layer, D.Transformer): ...
class NadarayaWatson(Layer, D.NadarayaWatson): ...

__all__ = [  # the declared layers (attention_core.declarations.LAYERS), one class each
    "AddNorm", "AdditiveAttention", "DotProductAttention", "LearnedPositionalEncoding",
    "MultiHeadAttention", "NadarayaWatson", "PositionWiseFFN", "PositionalEncoding",
    "RelativeMultiHeadAttention", "RotaryEmbedding", "Transformer", "TransformerDecoder",
    "TransformerDecoderBlock", "TransformerEncoder", "TransformerEncoderBlock",
]


def _parameters(module: nn.Module) -> dict[str, Tensor]:
    """``dict(module.named_parameters())``, by one walk of the modules (every call makes it)."""
    found: dict[str, Tensor] = {}
    _walk(module, "", found, set())
    return found


def _walk(module: nn.Module, prefix: str, found: dict[str, Tensor], seen: set[int]) -> None:
    """Adds the parameters of ``module`` and of its submodules, each once, as named_parameters."""
    for name, p in module._parameters.items():
        if p is not None and id(p) not in seen:
            seen.add(id(p))
            found[prefix + name] = p
    for name, child in module._modules.items():
        if child is not None:
            _walk(child, f"{prefix}{name}.", found, seen)


def _state(params: Mapping[str, Tensor]) -> tuple[Any, ...] | None:
    """The parameters' shapes, dtypes and devices: the state a call plan is kept for.

    None, to keep no plan, while a kernel's size is not known or while the call is traced.
    """
    if _tracing():
        return None
    state = []
    for p in params.values():
        if type(p) is UninitializedParameter:
            return None
        state.append((p.shape, p.dtype, p.device))
    return tuple(state)


def _compute_dtype(param: Tensor | None) -> str | None:
    """The dtype of a layer whose first parameter is ``param`` (the dtype rule), or None.

    None for a layer without parameters, and under ``torch.autocast``, whose dtype then
    governs the computation: the inputs are checked but not cast.
    """
    if param is None or autocasting(param.device.type):
        return None
    return OPS.dtype_name(param)
