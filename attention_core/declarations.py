"""Every layer, declared once: its arguments, weights, sublayers, inputs and forward.

A declaration is a dataclass whose fields are the layer's constructor arguments (their order,
defaults and keyword-only marks are the public signature). Its class attributes and methods say
the rest, over :class:`~attention_core.ops.Ops` only:

- :meth:`Declaration.check` validates and normalises the arguments;
- :meth:`Declaration.weight_shapes` names the weights and gives their shapes from the arguments
  and the input sizes (``q_in`` ...; None while unknown); the initial values follow
  :func:`attention_core.weights.init_weights`' rule for each name;
- :meth:`Declaration.sublayers` names the declared layers a composite is made of (their weights
  are its weights, under the sublayer's name);
- :meth:`Declaration.constants` gives fixed tables (the sinusoidal ``P``), held but not trained;
- :attr:`Declaration.sizes` maps each input size to the call argument whose last axis gives it
  and the weight whose first axis holds it;
- :meth:`Declaration.compute` is the forward: its signature after ``run`` is the layer's call
  signature, and it returns the output, with the attention weights when ``run.need`` is True.

Each framework's adapter (``backends/<name>/layers.py``) turns any declaration into a native
layer with one generic base class: a backend's ``MultiHeadAttention`` is
``class MultiHeadAttention(Layer, declarations.MultiHeadAttention)``. The call sequence the
adapters share (bind the call, cast, check, size, compute, keep the attention weights) is
:meth:`Declaration.bind_call`, :meth:`Declaration.prepare` and :meth:`Declaration.finish`;
an adapter that gives ``prepare`` its weights' state keeps a :class:`Plan` of the checks of
each call signature (:meth:`Declaration.keep_plan`), so repeated calls are not checked again.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
from collections.abc import Callable, Hashable, Mapping
from dataclasses import KW_ONLY, dataclass
from typing import Any, ClassVar, NamedTuple, TypeVar

import numpy as np

from attention_core import attention, checks, conventions, masks, multihead, positional, transformer
from attention_core import weights as W
from attention_core.host import plain
from attention_core.ops import Array, Ops, fixed_shape

_T = TypeVar("_T")
_D = TypeVar("_D", bound="Declaration")

if sys.version_info >= (3, 11):
    from typing import dataclass_transform as dataclass_transform
else:  # the decorator only informs type checkers

    def dataclass_transform(**_: Any) -> Callable[[_T], _T]:
        """Python 3.10: a decorator that changes nothing (see PEP 681)."""
        return lambda cls: cls


def keyword_parameters(arguments: type) -> tuple[inspect.Parameter, ...]:
    """A dataclass's fields as keyword-only parameters (a backend's :attr:`Declaration.extras`)."""
    return tuple(
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default)
        for f in dataclasses.fields(arguments)
    )



#: The yes/no arguments of the Transformer blocks and stacks (:class:`~attention_core.weights.BlockOptions`).
BLOCK_FLAGS = ("norm_first", "ffn_bias", "output_bias", "tie_output", "scale_embeddings")

#: The declared layers, by their public name, in the order declared: every public declaration
#: of this module (see :meth:`Declaration.__init_subclass__`) and those given to :func:`register`.
LAYERS: dict[str, type[Declaration]] = {}


def library_layers() -> dict[str, type[Declaration]]:
    """The layers this library declares, by name, in the order declared.

    That is :data:`LAYERS` less the declarations given to :func:`register`.
    """
    return {name: cls for name, cls in LAYERS.items() if cls.__module__ == __name__}


@dataclass(frozen=True)
class Run:
    """What a forward needs besides its inputs.

    Attributes:
        ops: The backend's ops for this call (with its dropout randomness).
        weights: The weights by canonical name, in the compute dtype.
        constants: The fixed tables of :meth:`Declaration.constants`, as the backend holds them.
        dropout: The dropout rate of this call (0.0 outside training).
        need: Whether to return the attention weights too: True, False, or ``"on read"``
            (the core's ``return_weights``; see :meth:`Declaration.needs_attention`).
    """

    ops: Ops
    weights: Mapping[str, Array]
    constants: Mapping[str, Array]
    dropout: float
    need: bool | str


class Binding(NamedTuple):
    """A call signature of plain parameters, bound without :mod:`inspect` (every call binds).

    Attributes:
        positional: The names that may be given by position, in order.
        defaults: Every name, in order, with its default (``inspect.Parameter.empty`` when
            required).
        required: The names without default.
    """

    positional: tuple[str, ...]
    defaults: dict[str, Any]
    required: tuple[str, ...] = ()

    @classmethod
    def of(cls, signature: inspect.Signature) -> Binding | None:
        """The binding of ``signature``.

        None when it has ``*args``, ``**kwargs`` or positional-only parameters.
        """
        kinds = {p.kind for p in signature.parameters.values()}
        if kinds - {inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY}:
            return None
        positional = tuple(name for name, p in signature.parameters.items()
                           if p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD)
        return cls(positional, {name: p.default for name, p in signature.parameters.items()},
                   tuple(name for name, p in signature.parameters.items() if p.default is p.empty))

    def bind(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any] | None:
        """The arguments by name, defaults applied, as ``Signature.bind`` gives them.

        None for a call it would refuse: the caller then binds by :mod:`inspect`, whose
        TypeError is Python's.
        """
        if len(args) > len(self.positional):
            return None
        bound = self.defaults.copy()  # every name, in order
        bound.update(zip(self.positional, args, strict=False))
        given = self.positional[:len(args)]
        for name in kwargs:
            if name in given or name not in bound:
                return None
        bound.update(kwargs)
        for name in self.required:
            if bound[name] is inspect.Parameter.empty:
                return None
        return bound


class Size(NamedTuple):
    """An input size a layer learns on its first call (``q_in`` ...).

    Attributes:
        argument: The call argument whose last axis gives it.
        weight: The weight whose first axis holds it (it is read back off that weight).
    """

    argument: str
    weight: str


class Sublayer(NamedTuple):
    """A declared layer inside a composite, with the input sizes the composite fixes."""

    layer: Declaration
    dims: Mapping[str, int] = {}


class Plan(NamedTuple):
    """What the checks of a call found, kept for the calls of the same signature.

    See :meth:`Declaration.prepare`: a call whose inputs have the types, shapes, dtypes and
    devices of a call that passed, with the same other arguments, against weights in the same
    state, passes the same checks of shapes and dtypes and has the same input sizes.

    Attributes:
        cast: The inputs cast to the compute dtype (:func:`attention_core.checks.compute_inputs`).
        dims: The input sizes read off the inputs (``q_in`` ...).
    """

    cast: tuple[str, ...]
    dims: dict[str, int]


#: The plans a layer keeps (one per call signature); all are dropped when there would be more.
MAX_PLANS = 8
#: Call arguments a plan's key holds by value (with their type): the ones not arrays.
_PLAIN = frozenset({type(None), bool, int, float, str, conventions.Returned})


def call_key(ops: Ops, arguments: Mapping[str, Any]) -> tuple[Any, ...] | None:
    """The signature of a bound call, the key of its :class:`Plan`; None to plan nothing.

    The backend's arrays by what ``ops.array_key`` gives (their types, shapes, dtypes,
    devices; never their values), other arguments by type and value; None when the ops have
    no ``array_key``, or for another value (host data, functions, caches).
    """
    array_key = getattr(ops, "array_key", None)
    if array_key is None:
        return None
    key = []
    for name, value in arguments.items():
        kind = type(value)
        item = (kind, value) if kind in _PLAIN else array_key(value)
        if item is None:
            return None
        key.append((name, item))
    return tuple(key)


@dataclass(frozen=True)
class Prepared:
    """A bound, cast and checked call (see :meth:`Declaration.prepare`).

    Attributes:
        arguments: The call's arguments by name (array inputs cast to the compute dtype),
            without ``return_attention``.
        return_attention: Whether the caller asked for ``(output, attention_weights)``; the
            ``(out, weights)`` return form (:class:`~attention_core.conventions.Returned`) when
            a framework's ``WEIGHTS`` keyword gave it.
        dims: The input sizes read off the inputs (``q_in`` ...), those known before run time.
        training: ``not deterministic`` when a call gave a ``DETERMINISTIC`` keyword, else None.
        planned: Whether the checks were those of a kept :class:`Plan`: the adapter's checks of
            the input sizes against its weights passed for them too.
        plan: The plan this call's checks make, with its key, for :meth:`Declaration.keep_plan`.
    """

    arguments: dict[str, Any]
    return_attention: bool | conventions.Returned
    dims: dict[str, int]
    training: bool | None = None
    planned: bool = False
    plan: tuple[Hashable, Plan] | None = None

    def training_mode(self, training: bool | None) -> bool:
        """The call's training mode, from the adapter's keyword and the convention's.

        The adapter's ``training`` (None when not given) and a ``DETERMINISTIC`` keyword must
        agree (:func:`attention_core.conventions.training_mode`).
        """
        return conventions.training_mode(training, self.training)


@dataclass(eq=False)
class Declaration:
    """Base of the layer declarations (see the module's docstring).

    Attributes:
        cast_inputs: The array inputs that follow the dtype rule of
            :func:`attention_core.checks.compute_inputs` (token ids do not).
        id_inputs: The token ids among the inputs: host data like lengths and masks (NumPy,
            nested lists, another framework's arrays), checked as given, then converted.
        sizes: Input sizes learnt on the first call (``q_in`` ...), each with the call argument
            and the weight that hold it (:class:`Size`).
        sequences: Inputs whose second axis is a sequence (Keras padding masks apply to them).
        attention_kind: The attention weights a call forms: None, ``"single"`` (one array
            ``(B, H, Q, K)``, kept in ``attention_weights``), ``"blocks"`` (a list, one per
            block), or ``"nested"`` (lists of lists, e.g. a decoder's ``[self, cross]``, one
            list of per-block weights for each kind of attention; see :meth:`unkept`).
            Not named ``attention``: that is the encoder block's sublayer.
        returns_attention: Whether the call takes ``return_attention``.
        always_keeps: Whether the attention weights are kept whatever
            ``keep_attention_weights`` says (layers without that argument).
        cache_arguments: The call arguments of a cached call (a nested key/value cache, its
            position and capacity): not array inputs of a graph; a call that gives one runs
            imperatively where a framework builds graphs of array inputs (Gluon).
        function_arguments: Call arguments that take functions (``mask_mod``, ``score_mod``),
            not arrays: where a framework builds graphs of array inputs (Gluon) they are
            options of the graph, as the flags are.
        pair_arguments: Call arguments that may be a pair of arrays, a tuple of two
            (``segment_ids``): a framework that takes flat array inputs (Gluon) takes both.
        shorthand: Call arguments that default to another's value when not given: the
            self-attention shorthand (``mha(X)`` is ``mha(X, X, X)``, ``mha(Q, KV)`` is
            ``mha(Q, KV, KV)``).
        context_parallel_reader: Reads a layer's ``context_parallel=`` into a
            :class:`~attention_core.parallel.ContextParallel` (set by an adapter whose
            framework can exchange between devices; None: refused).
        runs_on: Where the layer runs, as messages name it (``"Keras' tensorflow
            backend"``); empty for its adapter's package (``"the mxnet backend"``).
        convention: The framework's call keywords a backend's layers also take
            (:class:`attention_core.conventions.Keyword`, listed by the adapter, e.g.
            ``backends.torch.conventions.TORCH``); set by the adapter's base class, empty for
            none.
    """

    cast_inputs: ClassVar[tuple[str, ...]] = ()
    id_inputs: ClassVar[tuple[str, ...]] = ()
    sizes: ClassVar[Mapping[str, Size]] = {}
    sequences: ClassVar[tuple[str, ...]] = ()
    attention_kind: ClassVar[str | None] = None
    returns_attention: ClassVar[bool] = False
    always_keeps: ClassVar[bool] = False
    context_parallel_reader: ClassVar[Any] = None  # a function, or None
    runs_on: ClassVar[str] = ""
    cache_arguments: ClassVar[tuple[str, ...]] = ()
    function_arguments: ClassVar[tuple[str, ...]] = ()
    pair_arguments: ClassVar[tuple[str, ...]] = ()
    shorthand: ClassVar[Mapping[str, str]] = {}
    convention: ClassVar[tuple[conventions.Keyword, ...]] = ()

    #: A backend's own keyword-only constructor arguments, after the declared ones.
    extras: ClassVar[tuple[inspect.Parameter, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Registers a declaration; gives a backend's layer class its constructor's signature.

        The public declarations of this module go into :data:`LAYERS` when made (others by
        :func:`register`); a backend's class gets ``__signature__``, for ``help`` and IDEs.
        """
        super().__init_subclass__(**kwargs)
        if cls.__module__ == __name__ and not cls.__name__.startswith("_"):
            LAYERS[cls.__name__] = cls
        elif cls.declared_or_none():
            cls.__signature__ = ClassSignature(cls.signature(*cls.extras))  # type: ignore[attr-defined]
            canonical = cls.call_signature()
            offered = conventions.keywords(cls.convention, cls.declared().__name__,
                                           frozenset(canonical.parameters))
            setattr(cls, "_call_keywords", offered)  # noqa: B010
            setattr(cls, "_declared_call", cls.call_signature())  # noqa: B010
            setattr(cls, "_call_binding", Binding.of(cls.call_signature()))  # noqa: B010
            required = tuple(name for name, p in canonical.parameters.items()
                             if p.default is p.empty)
            setattr(cls, "_call_rules", (  # noqa: B010
                {name: None if name in required else p.default
                 for name, p in canonical.parameters.items()}, required))
            if "__doc__" not in cls.__dict__ or cls.__doc__ is None:
                cls.__doc__ = cls.declared().__doc__

    # -- arguments ---------------------------------------------------------------------------

    def check(self) -> None:
        """Validates the arguments (raising as every backend does) and normalises them."""
        self.normalise("dropout", checks.check_dropout)
        self.normalise("implementation", checks.check_implementation)
        self.normalise("scale", checks.check_scale)
        for name in ("keep_attention_weights", "relative_values", "parametric", "sinks",
                     *BLOCK_FLAGS):
            self.normalise(name, functools.partial(checks.check_flag, name))
        self.normalise("bias", checks.check_bias)
        self.normalise("norm", checks.check_norm)
        self.normalise("activation", checks.check_activation)
        self.normalise("norm_eps", checks.check_eps)
        self.normalise("eps", functools.partial(checks.check_eps, name="eps"))
        self.weight_shapes()  # the shape rules check the sizes

    def normalise(self, name: str, rule: Callable[[Any], Any]) -> None:
        """Replaces argument ``name``, if the layer has it, by ``rule(value)``.

        The attribute is set as on a plain object, which every framework's layer allows
        for a constructor argument (Flax modules are frozen dataclasses after init).
        """
        if name in self.argument_names():
            object.__setattr__(self, name, rule(getattr(self, name)))

    @classmethod
    def declared_or_none(cls) -> type[Declaration] | None:
        """The declaration among this class's bases (the class itself for a declaration)."""
        return next((c for c in cls.__mro__ if c in LAYERS.values()), None)

    @classmethod
    def declared(cls) -> type[Declaration]:
        """The declaration among this class's bases (the class itself for a declaration)."""
        found = cls.declared_or_none()
        assert found is not None, f"{cls.__name__} has no declared layer among its bases"
        return found

    @classmethod
    def argument_names(cls) -> tuple[str, ...]:
        """The constructor arguments, in order."""
        return tuple(f.name for f in dataclasses.fields(cls.declared()))

    @classmethod
    def signature(cls, *extras: inspect.Parameter) -> inspect.Signature:
        """The constructor's signature, with a framework's keyword-only ``extras`` after it."""
        params = list(inspect.signature(cls.declared()).parameters.values())
        return inspect.Signature([*params, *extras])

    @classmethod
    def bind_arguments(
        cls, args: tuple[Any, ...], kwargs: Mapping[str, Any], *extras: inspect.Parameter
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Binds constructor arguments like Python would: ``(declared, framework extras)``.

        NumPy scalars become Python numbers (:func:`attention_core.host.plain`).
        """
        bound = cls.signature(*extras).bind(*args, **kwargs)
        bound.apply_defaults()
        names = set(cls.argument_names())
        values = {k: plain(v) for k, v in bound.arguments.items()}
        return (
            {k: v for k, v in values.items() if k in names},
            {k: v for k, v in values.items() if k not in names},
        )

    def arguments(self) -> dict[str, Any]:
        """The constructor arguments and their values (a layer's config)."""
        return {name: getattr(self, name) for name in self.argument_names()}

    def describe(self) -> str:
        """The arguments as ``name=value, ...`` for reprs: keyword-only ones when not default."""
        shown = [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in dataclasses.fields(self.declared())
            if not f.kw_only or getattr(self, f.name) != f.default
        ]
        return ", ".join(shown)

    # -- weights -----------------------------------------------------------------------------

    def own_weight_shapes(self, **dims: int | None) -> W.Spec:
        """The layer's own weights (not its sublayers'), for the given input sizes."""
        return {}

    def sublayers(self) -> dict[str, Sublayer]:
        """The declared layers this one is made of, by name (their weights go under it)."""
        return {}

    def has_weights(self) -> bool:
        """Whether the layer, or one of its sublayers, has weights (found once, then kept)."""
        known = self.__dict__.get("_has_weights")
        if known is None:
            known = bool(self.own_weight_shapes()) or any(
                sub.layer.has_weights() for sub in self.sublayers().values())
            self.__dict__["_has_weights"] = known  # set as on a plain object (see keep_plan)
        return bool(known)

    def weight_shapes(self, **dims: int | None) -> W.Spec:
        """Every weight's canonical name and shape (None = an input size not known yet)."""
        spec = self.own_weight_shapes(**dims)
        for name, sub in self.sublayers().items():
            spec.update(W.prefixed(sub.layer.weight_shapes(**sub.dims), name))
        return spec

    def constants(self, dtype: str) -> dict[str, np.ndarray]:
        """Fixed tables the layer holds but does not train (e.g. ``P``), in ``dtype``."""
        return {}

    # -- calls -------------------------------------------------------------------------------

    @classmethod
    def call_signature(cls) -> inspect.Signature:
        """The call's signature: :meth:`compute`'s after ``run``, plus ``return_attention``.

        Then the keywords of the class's :attr:`convention` that the layer takes
        (:func:`attention_core.conventions.parameters`). A backend's layer class holds it,
        made once when the class is made (every call binds its arguments to it).
        """
        made: inspect.Signature | None = cls.__dict__.get("_declared_call")
        if made is not None:
            return made
        params = list(inspect.signature(cls.compute).parameters.values())[2:]
        if cls.returns_attention:
            params.append(inspect.Parameter(
                "return_attention", inspect.Parameter.KEYWORD_ONLY, default=False
            ))
        offered = cls.__dict__.get("_call_keywords")
        if offered:
            params = conventions.parameters(cls.convention, cls.declared().__name__, params)
        return inspect.Signature(params)

    def bind_call(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """Binds a call's arguments to :meth:`call_signature` (a TypeError like Python's).

        The framework's keywords get their canonical names and the :attr:`shorthand` is
        filled in (:func:`attention_core.conventions.bind`); masks that are arrays are
        converted by :meth:`prepare`.
        """
        binding: Binding | None = getattr(type(self), "_call_binding", None)
        quick = None if binding is None else binding.bind(args, kwargs)
        if quick is None:
            bound = self.call_signature().bind(*args, **kwargs)
            bound.apply_defaults()
            quick = dict(bound.arguments)
        defaults, required = getattr(type(self), "_call_rules", ({}, ()))
        return conventions.bind(self, quick, defaults, required, self.shorthand)

    def canonical_call(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]
                       ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """A call with its framework's names made canonical, as positional and keyword arguments.

        For frameworks that bind a call to the layer's signature before the layer sees it
        (Keras makes the weights from the shapes of the inputs by their canonical names).
        Keywords the call signature does not name (the framework's own, ``training``) pass
        through; array keywords stay for :meth:`prepare`.
        """
        names = self.call_signature().parameters
        native = {k.name for k in getattr(type(self), "_call_keywords", ())}
        positional = [n for n, p in names.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
        short = any(n not in kwargs and i >= len(args) for i, n in enumerate(positional)
                    if n in self.shorthand)
        if not short and native.isdisjoint(kwargs):
            return args, dict(kwargs)
        bound = self.bind_call(args, {k: v for k, v in kwargs.items() if k in names})
        while positional and bound[positional[-1]] is None:  # trailing defaults stay unsaid
            positional.pop()
        keywords = {k: v for k, v in bound.items()
                    if k not in positional and v is not names[k].default}
        own = {k: v for k, v in kwargs.items() if k not in names}
        return tuple(bound[n] for n in positional), {**keywords, **own}

    def prepare(self, ops: Ops, dtype: str | None, arguments: Mapping[str, Any],
                state: Hashable | None = None) -> Prepared:
        """Casts the array inputs (the dtype rule), checks them and reads the input sizes.

        An adapter that gives ``state`` gets the checks of shapes and dtypes and the input
        sizes of a call of the same signature (:func:`call_key`) from the :class:`Plan` it
        kept (:meth:`keep_plan`); the conversions (casts, masks) are made on every call. Token
        ids' values are checked on every call: layers that take them keep no plans.

        Args:
            ops: The backend's ops.
            dtype: The layer's compute dtype; None to compute in the inputs' own dtype.
            arguments: The bound call (:meth:`bind_call`).
            state: The weights' state (their shapes, dtypes, devices), which the adapter's
                checks read; None to keep no plan (a layer being built, a call being traced).
        """
        key = None
        if state is not None and not self.id_inputs:
            key = call_key(ops, arguments)
        if key is not None:
            key = (dtype, bool(getattr(ops, "mixes_dtypes", False)), state, key)
            plan = self.__dict__.get("_call_plans", {}).get(key)
            if plan is not None:
                return self._planned(ops, dtype, arguments, plan)
        arguments = dict(arguments)
        ids = [n for n in self.id_inputs if arguments.get(n) is not None]
        for name in ids:  # token ids from the host: read as given, checked by check_inputs
            if not masks.own(ops, arguments[name]):
                arguments[name] = transformer.host_ids(name, arguments[name])
        arguments, training = conventions.convert(self, ops, arguments)
        return_attention = _return_form(ops, arguments.pop("return_attention", False))
        names = [n for n in self.cast_inputs if n in arguments]
        weighted = dtype if self.has_weights() else None
        given = {n: arguments[n] for n in names}
        cast = checks.compute_inputs(ops, weighted, **given)
        arguments.update(zip(names, cast, strict=True))
        self.check_inputs(ops, **arguments)
        arguments.update({name: transformer.backend_ids(ops, arguments[name]) for name in ids})
        # an input's width is fixed by the weights, also under tracing (ops.fixed_shape); a
        # width unknown until run time (a traced Keras layer) is left to the built weights
        sizes = {dim: fixed_shape(ops, arguments[size.argument])[-1]
                 for dim, size in self.sizes.items()}
        dims = {dim: int(size) for dim, size in sizes.items() if isinstance(size, (int, np.integer))}
        plan = None if key is None else (key, Plan(tuple(
            name for name, x in zip(names, cast, strict=True) if x is not given[name]), dims))
        return Prepared(arguments, return_attention, dims, training, plan=plan)

    def _planned(self, ops: Ops, dtype: str | None, arguments: Mapping[str, Any],
                 plan: Plan) -> Prepared:
        """:meth:`prepare` of a call whose checks a kept plan made (no token ids)."""
        arguments, training = conventions.convert(self, ops, dict(arguments))
        return_attention = _return_form(ops, arguments.pop("return_attention", False))
        for name in plan.cast:
            arguments[name] = ops.astype(arguments[name], dtype)  # type: ignore[arg-type]
        return Prepared(arguments, return_attention, plan.dims, training, planned=True)

    def keep_plan(self, prepared: Prepared) -> None:
        """Keeps the plan of a call whose checks passed, the adapter's included.

        The layer keeps at most :data:`MAX_PLANS`, in ``_call_plans`` (set as on a plain
        object); the next call of the same signature reuses its checks (:meth:`prepare`).
        """
        if prepared.plan is None:
            return
        plans = self.__dict__.setdefault("_call_plans", {})
        if len(plans) >= MAX_PLANS:
            plans.clear()
        key, plan = prepared.plan
        plans[key] = plan

    def check_inputs(self, ops: Ops, **arguments: Any) -> None:
        """Checks the inputs before any weight is made for them (ranks, widths)."""

    def is_cached(self, arguments: Mapping[str, Any]) -> bool:
        """Whether a bound call runs against a key/value cache.

        It does when it gives a cache, or a capacity to make one; ``start`` alone (default 0)
        does not make a call cached.
        """
        return bool(self.cache_arguments) and any(
            arguments.get(name) is not None for name in ("cache", "capacity"))

    def padding_masks(self, ops: Ops, arguments: Mapping[str, Any], paddings: Mapping[str, Any]
                      ) -> dict[str, Any]:
        """The mask arguments that take a call's padding masks (Keras' ``_keras_mask``).

        ``paddings`` holds a ``(B, T)`` mask (True = a real position) per
        :attr:`sequences` input that has one. By default they all go into ``mask``
        (:func:`with_padding_masks`); a layer with more attentions says where each goes.
        """
        return {"mask": with_padding_masks(self, ops, arguments, paddings)}

    def dims_from_weights(self, weights: Mapping[str, Any]) -> dict[str, int]:
        """The input sizes read off the weights that hold them (those present in ``weights``)."""
        return {dim: int(np.shape(weights[size.weight])[0])
                for dim, size in self.sizes.items() if size.weight in weights}

    def needs_attention(
        self, return_attention: bool | conventions.Returned, keeping: bool = True,
        on_read: bool = True,
    ) -> bool | str:
        """Whether a call forms the attention weights: True, False, or ``"on read"``.

        ``"on read"`` (:data:`attention_core.attention.ON_READ`) when they are kept but not
        returned: an eager call then pools on its fast path and keeps what forms them when
        ``attention_weights`` is read (:class:`KeptAttention`).

        Args:
            return_attention: The caller asked for them.
            keeping: The framework can keep them now (False e.g. for Flax without a mutable
                ``'intermediates'``).
            on_read: The framework keeps them as an attribute read later (False for Flax,
                whose ``sow`` takes arrays).
        """
        if self.attention_kind is None:
            return False
        keep = self.always_keeps or bool(getattr(self, "keep_attention_weights", True))
        if return_attention:
            return True
        if keep and keeping:
            return attention.ON_READ if on_read else True
        return False

    def unkept(self) -> Any:
        """What a call that forms no attention weights keeps.

        The structure a call that forms them keeps, with None for each array: None, or a list
        of None per block.
        """
        return [None] * len(self.sublayers()) if self.attention_kind == "blocks" else None

    def kept_parts(self, kept: Any) -> dict[str, Any]:
        """The kept weights of each sublayer that keeps its own (a stack's blocks), by name.

        For adapters whose sublayers are layers of their own (torch).
        """
        if self.attention_kind != "blocks":
            return {}
        return dict(zip(self.sublayers(), kept, strict=True))

    def finish(self, result: Any, need: bool | str,
               return_attention: bool | conventions.Returned) -> tuple[Any, Any]:
        """Splits a forward's result: ``(what the call returns, the attention weights to keep)``.

        The weights to keep are :meth:`unkept` when not formed; lists (a framework's output
        tree may give tuples) otherwise. A ``WEIGHTS`` keyword's return form shapes what
        the call returns (:meth:`attention_core.conventions.Returned.form`).
        """
        if not need:
            returned, kept = result, self.unkept()
        else:
            out, kept = result
            kept = as_lists(kept)
            returned = result if return_attention else out
        if isinstance(return_attention, conventions.Returned):
            returned = return_attention.form(returned)
        return returned, kept

    def compute(self, run: Run, *args: Any, **kwargs: Any) -> Any:
        """The forward (see the module's docstring)."""
        raise NotImplementedError

    def pooling(self, run: Run) -> str | None:
        """The ``implementation`` a call pools by.

        The layer's own, or None (the core's rule, which takes the direct path) when the call
        returns the attention weights: only the direct path gives them. Weights formed on read
        leave the call its own path.
        """
        return None if run.need is True else getattr(self, "implementation", None)


def _return_form(ops: Ops, given: Any) -> bool | conventions.Returned:
    """A call's ``return_attention``: a bool, or the ``WEIGHTS`` return form with the ops."""
    if isinstance(given, conventions.Returned):
        return dataclasses.replace(given, ops=ops)
    return bool(given)


def as_lists(kept: Any) -> Any:
    """``kept`` with every tuple in it made a list (the leaves are left as they are)."""
    return [as_lists(k) for k in kept] if isinstance(kept, (list, tuple)) else kept


def leaves(kept: Any) -> list[Any]:
    """The arrays of a kept structure (:meth:`Declaration.unkept`'s shape), in order."""
    if isinstance(kept, (list, tuple)):
        return [leaf for k in kept for leaf in leaves(k)]
    return [] if kept is None else [kept]


#: The input sizes of the layers with query, key and value projections.
QKV_SIZES = {"q_in": Size("queries", "W_q.kernel"), "k_in": Size("keys", "W_k.kernel"),
             "v_in": Size("values", "W_v.kernel")}


# -- attention -------------------------------------------------------------------------------


@dataclass(eq=False)
class _Attention(Declaration):
    """Shared by the attention layers: their inputs, checks and call."""

    cast_inputs: ClassVar[tuple[str, ...]] = ("queries", "keys", "values")
    sequences: ClassVar[tuple[str, ...]] = ("queries", "keys", "values")
    attention_kind: ClassVar[str | None] = "single"
    returns_attention: ClassVar[bool] = True
    shorthand: ClassVar[Mapping[str, str]] = {"keys": "queries", "values": "keys"}

    def check_inputs(self, ops: Ops, **arguments: Any) -> None:
        # prepare has checked their framework and dtypes (checks.compute_inputs)
        attention.check_projected_shapes(
            ops, arguments["queries"], arguments["keys"], arguments["values"]
        )

    def compute(
        self, run: Run, queries: Array, keys: Array | None = None, values: Array | None = None,
        valid_lens: Any = None, *, mask: Any = None, causal: bool = False,
    ) -> Any:
        """Attends ``queries (B, Q, Dq)`` to ``keys (B, K, Dk)`` over ``values (B, K, Dv)``.

        Keys default to the queries and values to the keys (``mha(X)``: self-attention).
        """
        options = {
            "mask": mask, "causal": causal, "dropout": run.dropout, "return_weights": run.need,
            "ops": run.ops,
        }
        return self.attend(run, queries, keys, values, valid_lens, **options)

    def attend(self, run: Run, *args: Any, **options: Any) -> Any:
        """Calls the core's attention function with the layer's weights."""
        raise NotImplementedError


#: The call arguments of a cached call (:attr:`Declaration.cache_arguments`).
CACHE_ARGUMENTS = ("cache", "start", "capacity", "lengths", "padding", "padding_mask")

#: The score options of the scaled dot-product layers (:class:`_ScoredAttention`).
SCORE_OPTIONS = tuple(checks.SCORE_OPTION_CHECKS)


@dataclass(eq=False)
class _ScoredAttention(_Attention):
    """The scaled dot-product layers: their score options and their modifier call arguments.

    Their declarations carry the fields :data:`SCORE_OPTIONS` (keyword-only).
    """

    function_arguments: ClassVar[tuple[str, ...]] = ("mask_mod", "score_mod")
    pair_arguments: ClassVar[tuple[str, ...]] = ("segment_ids",)
    cache_arguments: ClassVar[tuple[str, ...]] = CACHE_ARGUMENTS

    def check(self) -> None:
        _normalise_score_options(self)
        super().check()

    def compute(
        self, run: Run, queries: Array, keys: Array | None = None, values: Array | None = None,
        valid_lens: Any = None, *, mask: Any = None, causal: bool = False,
        score_bias: Any = None, segment_ids: Any = None, mask_mod: Any = None,
        score_mod: Any = None, cache: Any = None, start: Any = 0, capacity: int | None = None,
        lengths: Any = None, padding: str = "right", padding_mask: Any = None,
    ) -> Any:
        """Attends ``queries (B, Q, Dq)`` to ``keys (B, K, Dk)`` over ``values (B, K, Dv)``.

        Keys default to the queries and values to the keys (``mha(X)``: self-attention).
        ``score_bias``, float and broadcastable to ``(B, H, Q, K)``, is added to the scores
        before masking. ``segment_ids``, ``mask_mod`` and ``score_mod`` go to
        :func:`~attention_core.attention.dot_product_attention` as they are. With ``cache`` or
        ``capacity`` the call is causal over a key/value cache, its new positions ``start ..
        start + Q - 1`` (per example with ``lengths`` or ``padding_mask``, see
        :func:`~attention_core.multihead.multi_head_attention`), and returns ``(output, cache)``.
        """
        ragged = multihead.ragged_arguments(cache, capacity, lengths, padding, padding_mask)
        modifiers = {"segment_ids": segment_ids, "mask_mod": mask_mod, "score_mod": score_mod}
        options = {
            "mask": mask, "causal": causal, "dropout": run.dropout, "return_weights": run.need,
            "score_bias": score_bias, "ops": run.ops,
            **{name: getattr(self, name) for name in SCORE_OPTIONS},
            **{name: value for name, value in modifiers.items() if value is not None},
        }
        if cache is None and capacity is None:
            return self.attend(run, queries, keys, values, valid_lens, **options)
        cached = {"cache": cache, "start": start, "capacity": capacity, **ragged}
        return _with_cache(run, self.attend(run, queries, keys, values, valid_lens, **options,
                                            **cached))


def _normalise_score_options(layer: Declaration) -> None:
    """Checks and normalises the :data:`SCORE_OPTIONS` and ``num_kv_heads`` a layer has."""
    for name, rule in checks.SCORE_OPTION_CHECKS.items():
        layer.normalise(name, rule)
    arguments = layer.arguments()
    if arguments.get("num_kv_heads") is not None:
        heads = checks.check_positive_int("num_heads", arguments["num_heads"])
        layer.normalise("num_kv_heads", functools.partial(checks.check_kv_heads, heads))


def _normalise_context_parallel(layer: Declaration) -> None:
    """Reads a layer's ``context_parallel=`` by its framework's rule; refused where none."""
    value = getattr(layer, "context_parallel", None)
    if value is None:
        return
    layer.normalise("keep_attention_weights", lambda _: False)  # no device holds them whole
    reader = type(layer).context_parallel_reader
    if reader is None:
        where = type(layer).runs_on or f"the {type(layer).__module__.split('.')[1]} backend"
        raise ValueError(f"context_parallel is not available on {where}: "
                         "it takes a framework's collective exchange between devices "
                         "(torch.distributed, or JAX's shard_map); got "
                         f"{type(value).__name__}")
    layer.normalise("context_parallel", reader)


def _check_rotary_heads(layer: Any) -> None:
    """Refuses rotary positions on heads of odd depth ``num_hiddens / num_heads``, when made.

    The rotation turns pairs of features (the multi-head layers and the decoders).
    """
    if layer.positional == "rotary":
        h, heads = checks.check_heads(layer.num_hiddens, layer.num_heads)
        positional.check_rotary(h // heads, layer.rotary_base)


#: The fields of :class:`~attention_core.weights.BlockOptions` (read in a compiled forward,
#: where ``dataclasses.fields`` breaks torch's graph).
_BLOCK_OPTIONS = ("norm_first", "norm", "norm_eps", "activation", "ffn_bias", "output_bias",
                  "tie_output", "scale_embeddings")


def _block_options(layer: Any) -> W.BlockOptions:
    """The norms, FFN and stack options of a block or stack layer (those it has)."""
    return W.BlockOptions(**{name: getattr(layer, name) for name in _BLOCK_OPTIONS
                             if hasattr(layer, name)})


def _block_arguments(layer: Any) -> dict[str, Any]:
    """The arguments a stack passes to its blocks: the norms and the FFN."""
    return {name: getattr(layer, name)
            for name in ("norm_first", "norm", "norm_eps", "activation", "ffn_bias")}


def _norm_part(layer: Any) -> Sublayer:
    """A block's norm per its arguments: an :class:`AddNorm` (``ln.gamma`` and maybe ``ln.beta``)."""
    return Sublayer(AddNorm(layer.num_hiddens, layer.dropout, norm=layer.norm,
                            eps=layer.norm_eps))


def _ffn_part(layer: Any) -> Sublayer:
    """A block's FFN per its arguments, from and to its width h."""
    h = layer.num_hiddens
    ffn = PositionWiseFFN(layer.ffn_num_hiddens, h, activation=layer.activation,
                          bias=layer.ffn_bias)
    return Sublayer(ffn, {"d_in": h})


def _final_norm(layer: Any) -> dict[str, Sublayer]:
    """A pre-norm stack's last norm ``final_norm.*`` (none for a post-norm stack)."""
    if not layer.norm_first:
        return {}
    return {"final_norm": Sublayer(AddNorm(layer.num_hiddens, norm=layer.norm,
                                           eps=layer.norm_eps))}


def _head_options(layer: Any) -> multihead.HeadOptions:
    """The self-attention options of a decoder layer (its ``num_kv_heads`` and score options)."""
    return multihead.HeadOptions(layer.num_kv_heads, layer.positional, layer.rotary_base,
                                 layer.window, layer.softcap, layer.scale,
                                 getattr(layer, "context_parallel", None))


@dataclass(eq=False)
class DotProductAttention(_ScoredAttention):
    """Scaled dot-product attention (no weights).

    Args:
        dropout: Dropout rate on the attention weights in training.
        keep_attention_weights: Keep each call's weights (``attention_weights``, or a sow into
            ``'intermediates'`` on Flax). When False, calls without ``return_attention`` never
            form them, so the core may pool blockwise or with the framework's fused kernel.
        implementation: How calls that do not need the weights pool: ``"direct"``,
            ``"blockwise"`` or ``"fused"``; None lets the core choose
            (:func:`attention_core.kernels.choose`).
        positional: ``"rotary"`` (queries and keys rotated by their positions), ``"alibi"``
            (linear biases by distance, the standard slopes), or None.
        rotary_base: The base of the rotary frequencies ``base^(-2t/D)``.
        window: Each query sees only the keys less than ``window`` positions from its own
            (with ``causal``, the ``window`` keys ending at it); None for all.
        softcap: Soft-caps the scores: ``softcap * tanh(s / softcap)``; None for none.
        scale: Multiplies the scores ``Q K^T``: a finite number > 0; None for
            ``1 / sqrt(D)``, D the depth of the queries (of a head).
        context_parallel: See :class:`MultiHeadAttention`: the queries, keys and values are
            this device's shard of one sequence.
    """

    dropout: float = 0.0
    _: KW_ONLY
    keep_attention_weights: bool = True
    implementation: str | None = None
    positional: str | None = None
    rotary_base: float = 10000.0
    window: int | None = None
    softcap: float | None = None
    scale: float | None = None
    context_parallel: Any = None

    def check(self) -> None:
        super().check()
        _normalise_context_parallel(self)

    def attend(self, run: Run, *args: Any, **options: Any) -> Any:
        cached = options.get("cache") is not None or options.get("capacity") is not None
        if cached:
            multihead.refuse_in_cached_call(context_parallel=self.context_parallel)
            return _cached_dot_product(self, run, *args, **options)
        if self.context_parallel is not None:
            return multihead.split_dot_product(self.context_parallel, *args,
                                               implementation=self.pooling(run), **options)
        return attention.dot_product_attention(
            *args, implementation=self.pooling(run), **options
        )


def _cached_dot_product(layer: DotProductAttention, run: Run, queries: Array, keys: Array,
                        values: Array, valid_lens: Any, *, cache: Any, start: Any,
                        capacity: int | None, padding: str = "right", lengths: Any = None,
                        padding_mask: Any = None, **options: Any) -> Any:
    """A :class:`DotProductAttention` call against a key/value cache."""
    ragged = multihead.ragged_arguments(cache, capacity, lengths, padding, padding_mask)
    multihead.refuse_in_cached_call(valid_lens=valid_lens, mask=options["mask"],
                                    score_bias=options["score_bias"],
                                    segment_ids=options.get("segment_ids"))
    return multihead.cached_attention(
        run.ops, queries, keys, values, cache, start, capacity=capacity,
        ragged=ragged,
        options=multihead.HeadOptions(None, layer.positional, layer.rotary_base, layer.window,
                                      layer.softcap, layer.scale),
        dropout=options["dropout"], return_weights=options["return_weights"],
        implementation=layer.pooling(run), mask_mod=options.get("mask_mod"),
        score_mod=options.get("score_mod"))


@dataclass(eq=False)
class AdditiveAttention(_Attention):
    """Additive (Bahdanau) attention: ``w_v^T tanh(W_q q + W_k k)`` scores.

    Args:
        num_hiddens: h, the size of the hidden layer scoring each query-key pair.
        dropout: Dropout rate on the attention weights in training.
    """

    num_hiddens: int
    dropout: float = 0.0
    sizes: ClassVar[Mapping[str, Size]] = {d: QKV_SIZES[d] for d in ("q_in", "k_in")}
    always_keeps: ClassVar[bool] = True

    def own_weight_shapes(self, **dims: int | None) -> W.Spec:
        return W.additive_spec(self.num_hiddens, dims.get("q_in"), dims.get("k_in"))

    def attend(self, run: Run, *args: Any, **options: Any) -> Any:
        q, k, v, valid_lens = args
        return attention.additive_attention(q, k, v, run.weights, valid_lens, **options)


@dataclass(eq=False)
class MultiHeadAttention(_ScoredAttention):
    """Multi-head attention: ``num_heads`` heads over ``num_hiddens`` projected features.

    Args:
        num_hiddens: h, the width of the projections and of the output.
        num_heads: H; must divide ``num_hiddens``.
        dropout: Dropout rate on the attention weights in training.
        bias: Whether the four projections have biases: True, False, or ``"qkv"`` for
            ``W_q``, ``W_k`` and ``W_v`` only (Qwen2).
        keep_attention_weights: See :class:`DotProductAttention`.
        implementation: See :class:`DotProductAttention`.
        num_kv_heads: Hkv, the key/value heads, each shared by H/Hkv query heads
            (grouped-query attention; 1: multi-query); None for H. ``W_k`` and ``W_v`` then
            project to ``Hkv * h/H`` features.
        positional: See :class:`DotProductAttention` (rotary positions turn each head).
        rotary_base: See :class:`DotProductAttention`.
        window: See :class:`DotProductAttention`.
        softcap: See :class:`DotProductAttention`.
        scale: See :class:`DotProductAttention` (None: ``1 / sqrt(h/H)``).
        sinks: Learn an attention sink per head: the weight ``sinks (H,)``, zeros at first,
            a logit each head's softmax also sums over (``exp(sinks[h])`` joins the
            denominator, not scaled, pooling no value).
        context_parallel: The inputs are this device's shard of a sequence split across
            devices, and the attention reaches the others' (torch, and Keras on torch: True,
            a process group or ``backends.torch.ContextParallel``; Flax, and Keras on JAX
            inside ``shard_map``: a mesh axis name or ``backends.jax.ContextParallel``);
            None for one device. Such a layer keeps
            no attention weights, and a call cannot return them.
    """

    num_hiddens: int
    num_heads: int
    dropout: float = 0.0
    bias: bool | str = False
    _: KW_ONLY
    keep_attention_weights: bool = True
    implementation: str | None = None
    num_kv_heads: int | None = None
    positional: str | None = None
    rotary_base: float = 10000.0
    window: int | None = None
    softcap: float | None = None
    scale: float | None = None
    sinks: bool = False
    context_parallel: Any = None
    sizes: ClassVar[Mapping[str, Size]] = QKV_SIZES

    def check(self) -> None:
        heads = checks.check_heads(self.num_hiddens, self.num_heads)
        self.normalise("num_hiddens", lambda _: heads[0])
        self.normalise("num_heads", lambda _: heads[1])
        super().check()
        _check_rotary_heads(self)
        _normalise_context_parallel(self)

    def own_weight_shapes(self, **dims: int | None) -> W.Spec:
        return W.multi_head_spec(
            self.num_hiddens, self.num_heads, self.bias,
            dims.get("q_in"), dims.get("k_in"), dims.get("v_in"), self.num_kv_heads,
            self.sinks,
        )

    def attend(self, run: Run, *args: Any, **options: Any) -> Any:
        q, k, v, valid_lens = args
        return multihead.multi_head_attention(  # the options were checked when it was made
            q, k, v, run.weights, self.num_heads, valid_lens,
            implementation=self.pooling(run), num_kv_heads=self.num_kv_heads, **options,
            context_parallel=self.context_parallel, _layer=True,
        )


@dataclass(eq=False)
class RelativeMultiHeadAttention(_Attention):
    """Multi-head attention with relative position representations (Shaw et al., 2018).

    Args:
        num_hiddens: h, the width of the projections and of the output.
        num_heads: H; must divide ``num_hiddens``.
        max_relative_position: m: offsets between a key and a query are clipped to [-m, m].
        dropout: Dropout rate on the attention weights in training.
        bias: Whether the four projections have biases.
        relative_values: Also add the offsets' vectors to the values (``rel_v.embedding``).
        keep_attention_weights: Keep each call's weights.
    """

    num_hiddens: int
    num_heads: int
    max_relative_position: int
    dropout: float = 0.0
    bias: bool = False
    _: KW_ONLY
    relative_values: bool = True
    keep_attention_weights: bool = True
    sizes: ClassVar[Mapping[str, Size]] = QKV_SIZES

    def own_weight_shapes(self, **dims: int | None) -> W.Spec:
        return W.relative_multi_head_spec(
            self.num_hiddens, self.num_heads, self.max_relative_position, self.bias,
            self.relative_values, dims.get("q_in"), dims.get("k_in"), dims.get("v_in"),
        )

    cache_arguments: ClassVar[tuple[str, ...]] = CACHE_ARGUMENTS

    def compute(
        self, run: Run, queries: Array, keys: Array | None = None, values: Array | None = None,
        valid_lens: Any = None, *, mask: Any = None, causal: bool = False, cache: Any = None,
        start: Any = 0, capacity: int | None = None, lengths: Any = None,
        padding: str = "right", padding_mask: Any = None,
    ) -> Any:
        """Attends ``queries (B, Q, Dq)`` to ``keys (B, K, Dk)`` over ``values (B, K, Dv)``.

        Keys default to the queries and values to the keys. With ``cache`` or ``capacity``
        the call is causal over a key/value cache and returns ``(output, cache)``, as
        :class:`MultiHeadAttention`'s.
        """
        if cache is None and capacity is None:
            multihead.ragged_arguments(cache, capacity, lengths, padding, padding_mask)
            return super().compute(run, queries, keys, values, valid_lens, mask=mask,
                                   causal=causal)
        return _with_cache(run, multihead.relative_multi_head_attention(
            queries, keys, values, run.weights, self.num_heads, valid_lens, mask=mask,
            causal=causal, dropout=run.dropout, return_weights=run.need, cache=cache,
            start=start, capacity=capacity, lengths=lengths, padding=padding,
            padding_mask=padding_mask, ops=run.ops))

    def attend(self, run: Run, *args: Any, **options: Any) -> Any:
        q, k, v, valid_lens = args
        return multihead.relative_multi_head_attention(
            q, k, v, run.weights, self.num_heads, valid_lens, **options
        )


# -- positions -------------------------------------------------------------------------------


@dataclass(eq=False)
class PositionalEncoding(Declaration):
    """Adds the sinusoidal table ``P`` (shape ``(1, max_len, num_hiddens)``) to the input.

    Args:
        num_hiddens: h, the width of the input and of the table.
        dropout: Dropout rate on the sum, in training.
        max_len: Rows of the table, the longest sequence the layer takes.
    """

    num_hiddens: int
    dropout: float = 0.0
    max_len: int = positional.DEFAULT_MAX_LEN
    cast_inputs: ClassVar[tuple[str, ...]] = ("X",)

    def check(self) -> None:
        for name in ("num_hiddens", "max_len"):
            self.normalise(name, functools.partial(checks.check_positive_int, name))
        super().check()

    def constants(self, dtype: str) -> dict[str, np.ndarray]:
        return {"P": positional.sinusoidal_encoding(self.max_len, self.num_hiddens, dtype)[None]}

    def compute(self, run: Run, X: Array) -> Array:
        """Adds ``P[:, :T]`` to ``X (B, T, h)``, then dropout."""
        return positional.add_positions(X, run.constants["P"], run.dropout, ops=run.ops)


@dataclass(eq=False)
class RotaryEmbedding(Declaration):
    """Rotates each pair of features ``(t, t + d/2)`` by the angle ``p * base^(-2t/d)``.

    Rotary position embeddings (Su et al., 2021) in the "rotate half" layout of GPT-NeoX,
    Llama and KerasHub, for ``X`` ``(B, T, d)`` or ``(B, T, H, d)`` (axis 1 the sequence),
    ``d`` even. Position ``p`` of row ``t`` is ``start_index + t``, or ``positions[..., t]``.

    Args:
        base: The base of the frequencies.
    """

    base: float = 10000.0
    cast_inputs: ClassVar[tuple[str, ...]] = ("X",)

    def check(self) -> None:
        self.normalise("base", functools.partial(checks.check_rotary_base, name="base"))
        super().check()

    def compute(self, run: Run, X: Array, start_index: Any = None, *, positions: Any = None
                ) -> Array:
        """``X`` rotated at positions ``start_index ..`` (None: 0) or ``positions``.

        ``start_index`` is an int or an integer scalar array; ``positions`` are integers
        ``(T,)`` or ``(B, T)``.
        """
        return positional.rotate_at(X, start_index, positions, self.base, run.ops,
                                    ("start_index", "base"))


@dataclass(eq=False)
class LearnedPositionalEncoding(Declaration):
    """Adds a learned table ``P`` (shape ``(1, max_len, num_hiddens)``) to the input.

    Args:
        num_hiddens: h, the width of the input and of the table.
        dropout: Dropout rate on the sum, in training.
        max_len: Rows of the table, the longest sequence the layer takes.
    """

    num_hiddens: int
    dropout: float = 0.0
    max_len: int = positional.DEFAULT_MAX_LEN
    cast_inputs: ClassVar[tuple[str, ...]] = ("X",)

    def own_weight_shapes(self, **dims: int | None) -> W.Spec:
        return W.learned_positional_spec(self.num_hiddens, self.max_len)

    def compute(self, run: Run, X: Array) -> Array:
        """Adds ``P[:, :T]`` to ``X (B, T, h)``, then dropout."""
        return positional.add_positions(X, run.weights["P"], run.dropout, ops=run.ops)


# -- the Transformer encoder -----------------------------------------------------------------


@dataclass(eq=False)
class PositionWiseFFN(Declaration):
    """Two dense layers with an activation between, applied at every position.

    Args:
        ffn_num_hiddens: Width of the hidden layer.
        ffn_num_outputs: Width of the output.
        activation: ``"relu"``, ``"gelu"`` (exact, with erf) or ``"swiglu"``
            (``dense2(silu(gate(X)) * dense1(X))``, with the weight ``gate.kernel``).
        bias: Whether the dense layers have biases.
    """

    ffn_num_hiddens: int
    ffn_num_outputs: int
    _: KW_ONLY
    activation: str = "relu"
    bias: bool = True
    cast_inputs: ClassVar[tuple[str, ...]] = ("X",)
    sizes: ClassVar[Mapping[str, Size]] = {"d_in": Size("X", "dense1.kernel")}

    def check(self) -> None:
        self.normalise("bias", functools.partial(checks.check_flag, "bias"))
        super().check()

    def own_weight_shapes(self, **dims: int | None) -> W.Spec:
        return W.ffn_spec(self.ffn_num_hiddens, self.ffn_num_outputs, dims.get("d_in"),
                          self.activation, self.bias)

    def check_inputs(self, ops: Ops, **arguments: Any) -> None:
        checks.check_rank(ops, "X", arguments["X"], (3,), "(B, T, d)")

    def compute(self, run: Run, X: Array) -> Array:
        """``dense2(act(dense1(X)))`` for ``X (B, T, d)``."""
        return transformer.position_wise_ffn(X, run.weights, activation=self.activation,
                                             bias=self.bias, ops=run.ops)


@dataclass(eq=False)
class AddNorm(Declaration):
    """Residual connection followed by normalisation over the last axis.

    Args:
        num_hiddens: h, the width normalised over.
        dropout: Dropout rate on the sublayer's output ``Y``, in training.
        norm: ``"layer"`` (LayerNorm: ``ln.gamma``, ``ln.beta``) or ``"rms"`` (RMSNorm:
            ``ln.gamma`` only).
        eps: The norm's epsilon; None for its default (1e-5 layer, 1e-6 rms).
    """

    num_hiddens: int
    dropout: float = 0.0
    _: KW_ONLY
    norm: str = "layer"
    eps: float | None = None
    cast_inputs: ClassVar[tuple[str, ...]] = ("X", "Y")

    def own_weight_shapes(self, **dims: int | None) -> W.Spec:
        return W.add_norm_spec(self.num_hiddens, self.norm)

    def check_inputs(self, ops: Ops, **arguments: Any) -> None:
        checks.check_last_dim(ops, "X", arguments["X"], self.num_hiddens)

    def compute(self, run: Run, X: Array, Y: Array) -> Array:
        """``Norm(dropout(Y) + X)`` for ``X``, ``Y`` ``(B, T, h)``."""
        return transformer.add_norm(X, Y, run.weights, run.dropout, norm=self.norm,
                                    eps=self.eps, ops=run.ops)


@dataclass(eq=False)
class TransformerEncoderBlock(Declaration):
    """Self-attention and a position-wise FFN, each wrapped in add & norm.

    Args:
        num_hiddens: h, the model width.
        ffn_num_hiddens: Width of the FFN's hidden layer.
        num_heads: H; must divide ``num_hiddens``.
        dropout: Dropout rate of the attention weights and both residual branches, in training.
        bias: Whether the attention projections have biases: True, False, or ``"qkv"``
            (see :class:`MultiHeadAttention`).
        keep_attention_weights: Keep each call's self-attention weights; False lets the core
            pool without forming them.
        implementation: See :class:`DotProductAttention`.
        scale: The self-attention's (see :class:`MultiHeadAttention`).
        sinks: Whether the self-attention learns sinks (see :class:`MultiHeadAttention`).
        num_kv_heads: The self-attention's key/value heads (see :class:`MultiHeadAttention`).
        positional: The self-attention's positions (see :class:`DotProductAttention`).
        rotary_base: See :class:`DotProductAttention`.
        window: The self-attention's sliding window (see :class:`DotProductAttention`).
        softcap: The self-attention's soft-capping (see :class:`DotProductAttention`).
        norm_first: Pre-norm: each sublayer takes its norm's output and adds to its input,
            ``x + dropout(f(norm(x)))``; False: ``norm(x + dropout(f(x)))``.
        norm: ``"layer"`` (LayerNorm) or ``"rms"`` (RMSNorm, no ``ln.beta``).
        norm_eps: The norms' epsilon; None for the norm's default (1e-5 layer, 1e-6 rms).
        activation: The FFN's (see :class:`PositionWiseFFN`).
        ffn_bias: Whether the FFN's dense layers have biases.
        context_parallel: See :class:`MultiHeadAttention` (the self-attention's).
    """

    num_hiddens: int
    ffn_num_hiddens: int
    num_heads: int
    dropout: float = 0.0
    bias: bool | str = False
    _: KW_ONLY
    keep_attention_weights: bool = True
    implementation: str | None = None
    scale: float | None = None
    sinks: bool = False
    context_parallel: Any = None
    num_kv_heads: int | None = None
    positional: str | None = None
    rotary_base: float = 10000.0
    window: int | None = None
    softcap: float | None = None
    norm_first: bool = False
    norm: str = "layer"
    norm_eps: float | None = None
    activation: str = "relu"
    ffn_bias: bool = True
    cast_inputs: ClassVar[tuple[str, ...]] = ("X",)
    sequences: ClassVar[tuple[str, ...]] = ("X",)
    attention_kind: ClassVar[str | None] = "single"

    def check(self) -> None:
        _normalise_score_options(self)
        super().check()
        _check_rotary_heads(self)
        _normalise_context_parallel(self)

    def sublayers(self) -> dict[str, Sublayer]:
        h, dropout = self.num_hiddens, self.dropout
        mha = MultiHeadAttention(h, self.num_heads, dropout, self.bias, sinks=self.sinks,
                                 **_head_options(self).kwargs())
        return {
            "attention": Sublayer(mha, {"q_in": h, "k_in": h, "v_in": h}),
            "addnorm1": _norm_part(self),
            "ffn": _ffn_part(self),
            "addnorm2": _norm_part(self),
        }

    def check_inputs(self, ops: Ops, **arguments: Any) -> None:
        checks.check_rank(ops, "X", arguments["X"], (3,), "(B, T, num_hiddens)")
        checks.check_last_dim(ops, "X", arguments["X"], self.num_hiddens)

    def compute(
        self, run: Run, X: Array, valid_lens: Any = None, *, mask: Any = None,
        causal: bool = False, score_bias: Any = None,
    ) -> Any:
        """One block over ``X (B, T, h)``.

        ``causal`` and ``score_bias`` apply to the self-attention, as in
        :class:`MultiHeadAttention`.
        """
        return transformer.transformer_encoder_block(
            X, run.weights, self.num_heads, valid_lens, mask=mask, causal=causal,
            score_bias=score_bias, dropout=run.dropout,
            return_weights=run.need, implementation=self.pooling(run),
            options=_head_options(self), block=_block_options(self), ops=run.ops,
        )


@dataclass(eq=False)
class TransformerEncoder(Declaration):
    """The Transformer encoder: scaled token embedding, sinusoidal encoding, ``num_blks`` blocks.

    Args:
        vocab_size: V, the number of token ids.
        num_hiddens: h, the model width.
        ffn_num_hiddens: Width of the blocks' FFN hidden layers.
        num_heads: H; must divide ``num_hiddens``.
        num_blks: Number of blocks.
        dropout: Dropout rate of the encoding's sum and inside every block, in training.
        bias: Whether the attention projections have biases.
        keep_attention_weights: Keep each block's self-attention weights (a list, one
            ``(B, H, T, T)`` array per block).
        implementation: See :class:`DotProductAttention`.
        max_len: Rows of the sinusoidal table ``P`` ``(1, max_len, h)``, the longest sequence
            the encoder takes.
        scale: Every block's (see :class:`TransformerEncoderBlock`).
        sinks: Every block's (see :class:`TransformerEncoderBlock`).
        num_kv_heads: Every block's (see :class:`TransformerEncoderBlock`).
        positional: Every block's; with ``"rotary"`` or ``"alibi"`` the sinusoidal table is
            not added (the attention places the tokens).
        rotary_base: See :class:`DotProductAttention`.
        window: Every block's.
        softcap: Every block's.
        norm_first: Pre-norm blocks (each sublayer takes its norm's output and adds to its input,
            ``x + dropout(f(norm(x)))``), and the output normalised last by ``norm.*``.
        norm: ``"layer"`` (LayerNorm) or ``"rms"`` (RMSNorm, no ``ln.beta``).
        norm_eps: The norms' epsilon; None for the norm's default (1e-5 layer, 1e-6 rms).
        activation: The FFN's (see :class:`PositionWiseFFN`).
        ffn_bias: Whether the FFN's dense layers have biases.
        scale_embeddings: Multiply the token embeddings by sqrt(h).
        context_parallel: See :class:`MultiHeadAttention` (the self-attention's).
    """

    vocab_size: int
    num_hiddens: int
    ffn_num_hiddens: int
    num_heads: int
    num_blks: int
    dropout: float = 0.0
    bias: bool | str = False
    _: KW_ONLY
    keep_attention_weights: bool = True
    implementation: str | None = None
    max_len: int = positional.DEFAULT_MAX_LEN
    scale: float | None = None
    sinks: bool = False
    context_parallel: Any = None
    num_kv_heads: int | None = None
    positional: str | None = None
    rotary_base: float = 10000.0
    window: int | None = None
    softcap: float | None = None
    norm_first: bool = False
    norm: str = "layer"
    norm_eps: float | None = None
    activation: str = "relu"
    ffn_bias: bool = True
    scale_embeddings: bool = True
    id_inputs: ClassVar[tuple[str, ...]] = ("tokens",)
    sequences: ClassVar[tuple[str, ...]] = ("tokens",)
    attention_kind: ClassVar[str | None] = "blocks"

    def check(self) -> None:
        for name in ("vocab_size", "num_blks", "max_len"):
            self.normalise(name, functools.partial(checks.check_positive_int, name))
        _normalise_score_options(self)
        super().check()
        _check_rotary_heads(self)
        _normalise_context_parallel(self)

    def check_inputs(self, ops: Ops, **arguments: Any) -> None:
        transformer.check_token_ids(arguments["tokens"], self.vocab_size, ops=ops)

    def own_weight_shapes(self, **dims: int | None) -> W.Spec:
        num_hiddens = checks.check_positive_int("num_hiddens", self.num_hiddens)
        return {"token.embedding": (self.vocab_size, num_hiddens)}

    def sublayers(self) -> dict[str, Sublayer]:
        block = TransformerEncoderBlock(
            self.num_hiddens, self.ffn_num_hiddens, self.num_heads, self.dropout, self.bias,
            keep_attention_weights=self.keep_attention_weights,
            implementation=self.implementation, sinks=self.sinks,
            **_head_options(self).kwargs(), **_block_arguments(self),
        )
        return {**{f"blks.{i}": Sublayer(block) for i in range(self.num_blks)},
                **_final_norm(self)}

    def unkept(self) -> list[None]:
        return [None] * self.num_blks

    def kept_parts(self, kept: Any) -> dict[str, Any]:
        return {f"blks.{i}": part for i, part in enumerate(kept)}

    def constants(self, dtype: str) -> dict[str, np.ndarray]:
        return PositionalEncoding(self.num_hiddens, max_len=self.max_len).constants(dtype)

    def compute(
        self, run: Run, tokens: Array, valid_lens: Any = None, *, mask: Any = None,
    ) -> Any:
        """Embeds ``tokens (B, T)``, adds positions and runs the blocks: ``(B, T, h)``."""
        return transformer.transformer_encoder(
            tokens, run.weights, self.num_heads, valid_lens, mask=mask, dropout=run.dropout,
            return_weights=run.need, implementation=self.pooling(run),
            positions=run.constants["P"], options=_head_options(self),
            block=_block_options(self), ops=run.ops,
        )


# -- the Transformer decoder and the encoder-decoder -----------------------------------------


@dataclass(eq=False)
class TransformerDecoderBlock(Declaration):
    """A post-norm decoder block: causal self-attention, cross-attention, position-wise FFN.

    Each sublayer is followed by add & norm. The cross-attention attends to the encoder
    outputs; a ``decoder_only`` block has none.

    Args:
        num_hiddens: h, the model width (also the encoder outputs' width).
        ffn_num_hiddens: Width of the FFN's hidden layer.
        num_heads: H; must divide ``num_hiddens``.
        dropout: Dropout rate of the attention weights and every residual branch, in training.
        bias: Whether the attention projections have biases.
        decoder_only: No cross-attention (a GPT-style block); calls then take no
            ``enc_outputs``. Its add & norms are ``addnorm1`` and ``addnorm2``.
        keep_attention_weights: Keep each call's attention weights, ``[self, cross]``
            (``[self]`` when ``decoder_only``); False lets the core pool without forming them.
        implementation: See :class:`DotProductAttention`.
        num_kv_heads: The self-attention's key/value heads (see :class:`MultiHeadAttention`);
            its cache holds that many heads.
        positional: The self-attention's positions (see :class:`DotProductAttention`).
        rotary_base: See :class:`DotProductAttention`.
        window: The self-attention's sliding window (see :class:`DotProductAttention`).
        softcap: The self-attention's soft-capping (see :class:`DotProductAttention`).
        scale: Both attentions' (see :class:`MultiHeadAttention`).
        sinks: Whether both attentions learn sinks (see :class:`MultiHeadAttention`).
        norm_first: Pre-norm: each sublayer takes its norm's output and adds to its input,
            ``x + dropout(f(norm(x)))``; False: ``norm(x + dropout(f(x)))``.
        norm: ``"layer"`` (LayerNorm) or ``"rms"`` (RMSNorm, no ``ln.beta``).
        norm_eps: The norms' epsilon; None for the norm's default (1e-5 layer, 1e-6 rms).
        activation: The FFN's (see :class:`PositionWiseFFN`).
        ffn_bias: Whether the FFN's dense layers have biases.
        context_parallel: See :class:`MultiHeadAttention` (the self-attention's).
    """

    num_hiddens: int
    ffn_num_hiddens: int
    num_heads: int
    dropout: float = 0.0
    bias: bool | str = False
    _: KW_ONLY
    decoder_only: bool = False
    keep_attention_weights: bool = True
    implementation: str | None = None
    num_kv_heads: int | None = None
    positional: str | None = None
    rotary_base: float = 10000.0
    window: int | None = None
    softcap: float | None = None
    scale: float | None = None
    sinks: bool = False
    context_parallel: Any = None
    norm_first: bool = False
    norm: str = "layer"
    norm_eps: float | None = None
    activation: str = "relu"
    ffn_bias: bool = True
    cast_inputs: ClassVar[tuple[str, ...]] = ("X", "enc_outputs")
    sequences: ClassVar[tuple[str, ...]] = ("X", "enc_outputs")
    attention_kind: ClassVar[str | None] = "nested"
    cache_arguments: ClassVar[tuple[str, ...]] = CACHE_ARGUMENTS

    def check(self) -> None:
        self.normalise("decoder_only", functools.partial(checks.check_flag, "decoder_only"))
        _normalise_score_options(self)
        super().check()
        _check_rotary_heads(self)
        _normalise_context_parallel(self)

    def sublayers(self) -> dict[str, Sublayer]:
        h, dropout = self.num_hiddens, self.dropout
        dims = {"q_in": h, "k_in": h, "v_in": h}
        attention = MultiHeadAttention(h, self.num_heads, dropout, self.bias,
                                       sinks=self.sinks, **_head_options(self).kwargs())
        parts = {"self_attention": Sublayer(attention, dims), "addnorm1": _norm_part(self)}
        if not self.decoder_only:
            parts["cross_attention"] = Sublayer(MultiHeadAttention(
                h, self.num_heads, dropout, self.bias, scale=self.scale, sinks=self.sinks), dims)
            parts["addnorm2"] = _norm_part(self)
        parts["ffn"] = _ffn_part(self)
        parts[f"addnorm{2 if self.decoder_only else 3}"] = _norm_part(self)
        return parts

    def unkept(self) -> list[None]:
        return [None] * (1 if self.decoder_only else 2)

    def kept_parts(self, kept: Any) -> dict[str, Any]:
        return dict(zip(("self_attention", "cross_attention"), kept, strict=False))

    def check_inputs(self, ops: Ops, **arguments: Any) -> None:
        checks.check_rank(ops, "X", arguments["X"], (3,), "(B, T, num_hiddens)")
        checks.check_last_dim(ops, "X", arguments["X"], self.num_hiddens)
        _check_encoder_outputs(self, ops, arguments)

    def padding_masks(self, ops: Ops, arguments: Mapping[str, Any], paddings: Mapping[str, Any]
                      ) -> dict[str, Any]:
        return _decoder_padding_masks(ops, arguments, paddings, "X")

    def compute(
        self, run: Run, X: Array, enc_outputs: Array | None = None, enc_valid_lens: Any = None,
        *, valid_lens: Any = None, mask: Any = None, enc_mask: Any = None, past: Any = None,
        cache: Any = None, start: Any = 0, capacity: int | None = None, lengths: Any = None,
        padding: str = "right", padding_mask: Any = None,
    ) -> Any:
        """One block over ``X (B, T, h)``, attending to ``enc_outputs (B, S, h)``.

        With ``cache`` or ``capacity``, ``X`` holds positions ``start .. start + T - 1`` (per
        example with ``lengths`` or ``padding_mask``) and the call returns ``(output, cache)``
        (:func:`attention_core.transformer.cached_decoder_block`); with ``past``, the block's
        earlier inputs are the self-attention's first keys, as in the d2l book's prediction
        loop.
        """
        ragged = multihead.ragged_arguments(cache, capacity, lengths, padding, padding_mask)
        if cache is None and capacity is None:
            return transformer.transformer_decoder_block(
                X, run.weights, self.num_heads, enc_outputs, enc_valid_lens,
                valid_lens=valid_lens, mask=mask, enc_mask=enc_mask, past=past,
                dropout=run.dropout, return_weights=run.need, implementation=self.pooling(run),
                options=_head_options(self), block=_block_options(self), ops=run.ops,
            )
        multihead.refuse_in_cached_call(valid_lens=valid_lens, mask=mask, past=past)
        return _with_cache(run, transformer.cached_decoder_block(
            X, run.weights, self.num_heads, cache, start, enc_outputs, enc_valid_lens,
            enc_mask=enc_mask, capacity=capacity, dropout=run.dropout, return_weights=run.need,
            implementation=self.pooling(run), options=_head_options(self),
            block=_block_options(self), ragged=ragged, ops=run.ops,
        ))


def _with_cache(run: Run, cached: tuple[Any, Any]) -> Any:
    """A cached forward's ``(result, cache)`` as :meth:`Declaration.finish` takes it.

    The call returns ``(output, cache)``; the attention weights, when formed, stay beside it.
    """
    result, cache = cached
    if not run.need:
        return result, cache
    out, kept = result
    return (out, cache), kept


def _check_encoder_outputs(layer: Any, ops: Ops, arguments: Mapping[str, Any]) -> None:
    """Checks ``enc_outputs``: of width ``num_hiddens``, given unless the layer is decoder-only.

    A cached call whose cache holds their projections may leave them out.
    """
    enc_outputs = arguments.get("enc_outputs")
    if enc_outputs is None and arguments.get("cache") is not None:
        return  # the cache's cross pairs are checked by the core
    first = layer.sequences[0]  # X or tokens
    transformer.check_encoder_outputs(ops, enc_outputs, not layer.decoder_only,
                                      like=(first, arguments[first]))
    if enc_outputs is not None:
        checks.check_last_dim(ops, "enc_outputs", enc_outputs, layer.num_hiddens)


def _decoder_padding_masks(ops: Ops, arguments: Mapping[str, Any], paddings: Mapping[str, Any],
                           first: str) -> dict[str, Any]:
    """Keras padding masks of a decoder's input (``first``) and of the encoder outputs.

    The input's padding hides rows and keys of the self-attention (``mask``) and rows of the
    cross-attention; the encoder outputs' padding hides their keys (``enc_mask``).
    """
    out = {}
    pad, enc_pad = paddings.get(first), paddings.get("enc_outputs")
    shape = ops.shape(arguments[first])
    if pad is not None:
        scores = (shape[0], None, shape[1], shape[1])
        out["mask"] = masks.with_padding(ops, arguments.get("mask"), scores, pad, pad)
    enc = arguments.get("enc_outputs")
    if enc is not None and (pad is not None or enc_pad is not None):
        scores = (shape[0], None, shape[1], ops.shape(enc)[1])
        out["enc_mask"] = masks.with_padding(ops, arguments.get("enc_mask"), scores, pad, enc_pad)
    return out


@dataclass(eq=False)
class TransformerDecoder(Declaration):
    """The Transformer decoder: embedding, positions, ``num_blks`` blocks, and the logits.

    The token embedding is scaled by sqrt(h) and the sinusoidal encoding added; a dense layer
    maps the last block's output to the vocabulary.

    Args:
        vocab_size: V, the number of token ids (in and out).
        num_hiddens: h, the model width (also the encoder outputs' width).
        ffn_num_hiddens: Width of the blocks' FFN hidden layers.
        num_heads: H; must divide ``num_hiddens``.
        num_blks: Number of blocks.
        dropout: Dropout rate of the encoding's sum and inside every block, in training.
        bias: Whether the attention projections have biases.
        decoder_only: Blocks without cross-attention (a GPT-style model); calls then take no
            ``enc_outputs``.
        keep_attention_weights: Keep each call's attention weights: ``[self, cross]``, one
            list of per-block weights each, as the d2l book's decoder keeps them (``[self]``
            when ``decoder_only``).
        implementation: See :class:`DotProductAttention`.
        max_len: Rows of the sinusoidal table ``P`` ``(1, max_len, h)``, the longest sequence
            the decoder takes.
        num_kv_heads: Every block's self-attention key/value heads (see
            :class:`TransformerDecoderBlock`).
        positional: Every block's self-attention positions; with ``"rotary"`` or ``"alibi"``
            the sinusoidal table is not added (the attention places the tokens).
        rotary_base: See :class:`DotProductAttention`.
        window: Every block's self-attention window.
        softcap: Every block's self-attention soft-capping.
        scale: Every block's (see :class:`TransformerDecoderBlock`).
        sinks: Every block's (see :class:`TransformerDecoderBlock`).
        norm_first: Pre-norm blocks (each sublayer takes its norm's output and adds to its input,
            ``x + dropout(f(norm(x)))``), and the last block's output normalised by
            ``norm.*`` before the logits.
        norm: ``"layer"`` (LayerNorm) or ``"rms"`` (RMSNorm, no ``ln.beta``).
        norm_eps: The norms' epsilon; None for the norm's default (1e-5 layer, 1e-6 rms).
        activation: The FFN's (see :class:`PositionWiseFFN`).
        ffn_bias: Whether the FFN's dense layers have biases.
        output_bias: Whether the logits have a bias ``dense.bias``.
        tie_output: The logits are ``X @ token.embedding^T``: no ``dense.kernel``.
        scale_embeddings: Multiply the token embeddings by sqrt(h).
        context_parallel: See :class:`MultiHeadAttention` (the self-attention's).
    """

    vocab_size: int
    num_hiddens: int
    ffn_num_hiddens: int
    num_heads: int
    num_blks: int
    dropout: float = 0.0
    bias: bool | str = False
    _: KW_ONLY
    decoder_only: bool = False
    keep_attention_weights: bool = True
    implementation: str | None = None
    max_len: int = positional.DEFAULT_MAX_LEN
    num_kv_heads: int | None = None
    positional: str | None = None
    rotary_base: float = 10000.0
    window: int | None = None
    softcap: float | None = None
    scale: float | None = None
    sinks: bool = False
    context_parallel: Any = None
    norm_first: bool = False
    norm: str = "layer"
    norm_eps: float | None = None
    activation: str = "relu"
    ffn_bias: bool = True
    output_bias: bool = True
    tie_output: bool = False
    scale_embeddings: bool = True
    cast_inputs: ClassVar[tuple[str, ...]] = ("enc_outputs",)
    id_inputs: ClassVar[tuple[str, ...]] = ("tokens",)
    sequences: ClassVar[tuple[str, ...]] = ("tokens", "enc_outputs")
    attention_kind: ClassVar[str | None] = "nested"
    cache_arguments: ClassVar[tuple[str, ...]] = CACHE_ARGUMENTS

    def check(self) -> None:
        for name in ("vocab_size", "num_blks", "max_len"):
            self.normalise(name, functools.partial(checks.check_positive_int, name))
        self.normalise("decoder_only", functools.partial(checks.check_flag, "decoder_only"))
        _normalise_score_options(self)
        super().check()
        _check_rotary_heads(self)
        _normalise_context_parallel(self)

    def check_inputs(self, ops: Ops, **arguments: Any) -> None:
        transformer.check_token_ids(arguments["tokens"], self.vocab_size, ops=ops)
        _check_encoder_outputs(self, ops, arguments)

    def own_weight_shapes(self, **dims: int | None) -> W.Spec:
        h = checks.check_positive_int("num_hiddens", self.num_hiddens)
        return {"token.embedding": (self.vocab_size, h),
                **W.output_spec(h, self.vocab_size, _block_options(self))}

    def sublayers(self) -> dict[str, Sublayer]:
        block = TransformerDecoderBlock(
            self.num_hiddens, self.ffn_num_hiddens, self.num_heads, self.dropout, self.bias,
            decoder_only=self.decoder_only, keep_attention_weights=self.keep_attention_weights,
            implementation=self.implementation, sinks=self.sinks, **_head_options(self).kwargs(),
            **_block_arguments(self),
        )
        return {**{f"blks.{i}": Sublayer(block) for i in range(self.num_blks)},
                **_final_norm(self)}

    def unkept(self) -> list[list[None]]:
        return [[None] * self.num_blks for _ in range(1 if self.decoder_only else 2)]

    def kept_parts(self, kept: Any) -> dict[str, Any]:
        return {f"blks.{i}": [per_kind[i] for per_kind in kept] for i in range(self.num_blks)}

    def constants(self, dtype: str) -> dict[str, np.ndarray]:
        return PositionalEncoding(self.num_hiddens, max_len=self.max_len).constants(dtype)

    def padding_masks(self, ops: Ops, arguments: Mapping[str, Any], paddings: Mapping[str, Any]
                      ) -> dict[str, Any]:
        return _decoder_padding_masks(ops, arguments, paddings, "tokens")

    def compute(
        self, run: Run, tokens: Array, enc_outputs: Array | None = None,
        enc_valid_lens: Any = None, *, valid_lens: Any = None, mask: Any = None,
        enc_mask: Any = None, cache: Any = None, start: Any = 0, capacity: int | None = None,
        lengths: Any = None, padding: str = "right", padding_mask: Any = None,
    ) -> Any:
        """The logits ``(B, T, V)`` of ``tokens (B, T)``, attending to ``enc_outputs``.

        With ``cache`` or ``capacity``, ``tokens`` are positions ``start .. start + T - 1``
        (per example with ``lengths`` or ``padding_mask``, a ragged batch) and the call
        returns ``(logits, cache)`` (:func:`attention_core.transformer.cached_decoder`).
        """
        ragged = multihead.ragged_arguments(cache, capacity, lengths, padding, padding_mask)
        if cache is None and capacity is None:
            return transformer.transformer_decoder(
                tokens, run.weights, self.num_heads, enc_outputs, enc_valid_lens,
                valid_lens=valid_lens, mask=mask, enc_mask=enc_mask, dropout=run.dropout,
                return_weights=run.need, implementation=self.pooling(run),
                positions=run.constants["P"], options=_head_options(self),
                block=_block_options(self), ops=run.ops,
            )
        multihead.refuse_in_cached_call(valid_lens=valid_lens, mask=mask)
        return _with_cache(run, transformer.cached_decoder(
            tokens, run.weights, self.num_heads, cache, start, enc_outputs, enc_valid_lens,
            enc_mask=enc_mask, capacity=capacity, dropout=run.dropout, return_weights=run.need,
            implementation=self.pooling(run), positions=run.constants["P"],
            options=_head_options(self), block=_block_options(self), ops=run.ops, **ragged,
        ))


@dataclass(eq=False)
class Transformer(Declaration):
    """The encoder-decoder Transformer, returning the target's logits.

    A :class:`TransformerEncoder` over the source and a :class:`TransformerDecoder` over the
    target whose cross-attention attends to the encoder's outputs.

    Args:
        src_vocab_size: Token ids of the source.
        tgt_vocab_size: Token ids of the target (in and out).
        num_hiddens: h, the model width.
        ffn_num_hiddens: Width of the FFN hidden layers.
        num_heads: H; must divide ``num_hiddens``.
        num_blks: Blocks of the encoder and of the decoder.
        dropout: Dropout rate everywhere, in training.
        bias: Whether the attention projections have biases.
        keep_attention_weights: Keep each call's attention weights: ``[encoder, decoder self,
            decoder cross]``, one list of per-block weights each.
        implementation: See :class:`DotProductAttention`.
        max_len: Rows of the sinusoidal table, the longest source or target.
        scale: Every attention's (see :class:`MultiHeadAttention`).
        sinks: Whether every attention learns sinks (see :class:`MultiHeadAttention`).
        norm_first: Pre-norm blocks (each sublayer takes its norm's output and adds to its input,
            ``x + dropout(f(norm(x)))``), the encoder's and the decoder's outputs
            normalised last by their ``norm.*``.
        norm: ``"layer"`` (LayerNorm) or ``"rms"`` (RMSNorm, no ``ln.beta``).
        norm_eps: The norms' epsilon; None for the norm's default (1e-5 layer, 1e-6 rms).
        activation: The FFN's (see :class:`PositionWiseFFN`).
        ffn_bias: Whether the FFN's dense layers have biases.
    """

    src_vocab_size: int
    tgt_vocab_size: int
    num_hiddens: int
    ffn_num_hiddens: int
    num_heads: int
    num_blks: int
    dropout: float = 0.0
    bias: bool | str = False
    _: KW_ONLY
    keep_attention_weights: bool = True
    implementation: str | None = None
    max_len: int = positional.DEFAULT_MAX_LEN
    scale: float | None = None
    sinks: bool = False
    norm_first: bool = False
    norm: str = "layer"
    norm_eps: float | None = None
    activation: str = "relu"
    ffn_bias: bool = True
    id_inputs: ClassVar[tuple[str, ...]] = ("src_tokens", "tgt_tokens")
    attention_kind: ClassVar[str | None] = "nested"

    def check(self) -> None:
        for name in ("src_vocab_size", "tgt_vocab_size", "num_blks", "max_len"):
            self.normalise(name, functools.partial(checks.check_positive_int, name))
        super().check()

    def check_inputs(self, ops: Ops, **arguments: Any) -> None:
        for side in ("src", "tgt"):
            transformer.check_token_ids(arguments[f"{side}_tokens"],
                                        getattr(self, f"{side}_vocab_size"), ops=ops, side=side)
        checks.check_batch(ops, "tgt_tokens", arguments["tgt_tokens"], "src_tokens",
                           arguments["src_tokens"])

    def sublayers(self) -> dict[str, Sublayer]:
        sizes = (self.num_hiddens, self.ffn_num_hiddens, self.num_heads, self.num_blks,
                 self.dropout, self.bias)
        options: dict[str, Any] = {
            "keep_attention_weights": self.keep_attention_weights,
            "implementation": self.implementation, "max_len": self.max_len,
            "scale": self.scale, "sinks": self.sinks, **_block_arguments(self),
        }
        encoder = TransformerEncoder(self.src_vocab_size, *sizes, **options)
        decoder = TransformerDecoder(self.tgt_vocab_size, *sizes, **options)
        return {"encoder": Sublayer(encoder), "decoder": Sublayer(decoder)}

    def unkept(self) -> list[list[None]]:
        return [[None] * self.num_blks for _ in range(3)]

    def kept_parts(self, kept: Any) -> dict[str, Any]:
        return {"encoder": kept[0], "decoder": kept[1:]}

    def constants(self, dtype: str) -> dict[str, np.ndarray]:
        return PositionalEncoding(self.num_hiddens, max_len=self.max_len).constants(dtype)

    def compute(
        self, run: Run, src_tokens: Array, tgt_tokens: Array, src_valid_lens: Any = None, *,
        tgt_valid_lens: Any = None,
    ) -> Any:
        """The logits ``(B, T, V_tgt)`` of ``tgt_tokens (B, T)`` given ``src_tokens (B, S)``."""
        return transformer.transformer_encoder_decoder(
            src_tokens, tgt_tokens, run.weights, self.num_heads, src_valid_lens,
            tgt_valid_lens=tgt_valid_lens, dropout=run.dropout, return_weights=run.need,
            implementation=self.pooling(run), positions=run.constants["P"], scale=self.scale,
            block=_block_options(self), ops=run.ops,
        )


# -- attention pooling with a kernel (Nadaraya-Watson) ---------------------------------------


@dataclass(eq=False)
class NadarayaWatson(Declaration):
    """Nadaraya-Watson attention pooling with a Gaussian kernel.

    Args:
        parametric: Learn the kernel's inverse width ``w`` (weight ``w`` of shape ``(1,)``).
    """

    parametric: bool = False
    cast_inputs: ClassVar[tuple[str, ...]] = ("queries", "keys", "values")
    attention_kind: ClassVar[str | None] = "single"
    always_keeps: ClassVar[bool] = True

    def own_weight_shapes(self, **dims: int | None) -> W.Spec:
        return W.nadaraya_watson_spec(self.parametric)

    def compute(self, run: Run, queries: Array, keys: Array, values: Array) -> Any:
        """Pools ``values`` by a Gaussian kernel of the ``queries``' distance to the ``keys``."""
        w = run.weights.get("w")
        result = attention.nadaraya_watson(
            queries, keys, values, w, return_weights=run.need, ops=run.ops
        )
        return result


# -- declarations made elsewhere -------------------------------------------------------------


def register(declaration: type[_D]) -> type[_D]:
    """Declares a layer made outside this module, so that adapters can hold it natively.

    A backend's native class for it is then ``class Name(Layer, declaration): ...`` with that
    backend's ``Layer`` (see ``tests/test_declaring.py``). Returns the declaration, so this can
    decorate it (under ``@dataclass(eq=False)``).

    Raises:
        ValueError: If another declaration has the name already.
    """
    known = LAYERS.get(declaration.__name__)
    if known is not None and known is not declaration:
        raise ValueError(f"declaration must have a new name, got {declaration.__name__!r}, "
                         f"which {known.__module__}.{known.__qualname__} has")
    LAYERS[declaration.__name__] = declaration
    return declaration


# -- shared by adapters (numpy, torch, tensorflow, mxnet) ------------------------------------


class KeptAttention:
    """``attention_weights``: the last call's, formed when first read.

    An adapter keeps what a call's :meth:`Declaration.finish` gives in ``_attention_kept``
    (an array, a :class:`~attention_core.attention.WeightsOnRead`, or a list of them, one per
    block); reading ``attention_weights`` forms what is not formed yet. Assigning to it
    replaces what is kept (``layer.attention_weights = None``).
    """

    _attention_kept: Any = None

    @property
    def attention_weights(self) -> Any:
        """The last call's attention weights ``(B, H, Q, K)``, before dropout.

        A list, one per block, for an encoder; None before a call that keeps them.
        """
        return attention.formed(self._attention_kept)

    @attention_weights.setter
    def attention_weights(self, value: Any) -> None:
        self._attention_kept = value


# -- shared by adapters (tensorflow) -----------------------------------------------------------


class ClassSignature:
    """A layer class's ``__signature__``: its constructor's, for the class only.

    ``inspect.signature(layer)`` of an instance then reads its ``__call__`` (as
    ``tf.function(layer)`` does), not the constructor's signature.
    """

    def __init__(self, signature: inspect.Signature) -> None:
        self.signature = signature

    def __get__(self, instance: Any, owner: type) -> inspect.Signature:
        if instance is not None:
            raise AttributeError("__signature__")
        return self.signature


def with_padding_masks(
    layer: Declaration, ops: Ops, arguments: Mapping[str, Any], paddings: Mapping[str, Any]
) -> Any:
    """A call's attention mask ANDed with padding masks of its :attr:`Declaration.sequences`.

    Padding masks (Keras' ``_keras_mask``: ``(B, T)``, True = a real position) are given by
    input name. The first sequence input is the queries: its padding hides rows; the others'
    (or, alone, the first's) are ANDed into the keys' padding, which hides keys
    (:func:`attention_core.masks.with_padding`).
    """
    first, *rest = layer.sequences
    keys = rest or [first]
    found = [paddings[name] for name in keys if paddings.get(name) is not None]
    keys_mask = functools.reduce(ops.logical_and, found) if found else None
    q_shape, k_shape = ops.shape(arguments[first]), ops.shape(arguments[keys[0]])
    scores = (q_shape[0], None, q_shape[1], k_shape[1])  # (B, H, Q, K)
    return masks.with_padding(ops, arguments.get("mask"), scores, paddings.get(first), keys_mask)


# -- shared by adapters (torch) ---------------------------------------------------------------


def with_call_signature(
    cls: type[Declaration], method: Callable[..., Any], name: str,
    *extra: inspect.Parameter,
) -> Callable[..., Any]:
    """A method calling ``method(self, *args, **kwargs)`` that shows ``cls``'s call signature.

    For ``help()``, IDEs and the frameworks that read the names of a layer's call arguments
    (``torch.export``'s ``dynamic_shapes``): the generic ``method`` takes ``*args, **kwargs``.
    ``extra`` are the backend's own keyword-only call arguments (NumPy's ``training``).
    """

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        return method(self, *args, **kwargs)

    this = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    params = [this, *cls.call_signature().parameters.values(), *extra]
    call.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    call.__name__, call.__qualname__ = name, f"{cls.__qualname__}.{name}"
    call.__module__ = cls.__module__
    call.__doc__ = cls.compute.__doc__
    return call
