"""Greedy and beam search over any backend's decoding step, one implementation for all.

A step is a function ``step(tokens, cache, start) -> (logits, cache)``: the logits
``(N, t, V)`` of the tokens ``(N, t)`` at positions ``start .. start + t - 1``, given the cache
its previous call returned (None at the first call, which makes it). A cached decoder layer
makes one in a line (``lambda ids, c, s: dec(ids, enc, lens, cache=c, start=s)`` with
``capacity=`` when ``c`` is None); so does a full recomputation that ignores the cache. The
search itself (argmax, log-softmax, top-k, the beams' bookkeeping) runs on the host in float64,
reading one row of logits per sequence and step; the step runs where the framework runs it.

Beam search keeps ``beam_size`` hypotheses per example. Rows are example-major: row
``b * beam_size + k`` is beam k of example b, so the step's other inputs (encoder outputs,
lengths) are repeated ``beam_size`` times per example (:func:`repeat_rows`). A hypothesis ends
at ``eos``; it is ranked by ``log P / L ** length_penalty``, L its length counting ``eos``
(the d2l book's rule, with 0.75 its usual exponent).

:func:`generate` continues a batch of prompts by greedy decoding or sampling
(:func:`attention_core.sampling.choose`: temperature, top-k, top-p), choosing every token on
the device; it reads one ``(B,)`` bool per step (whether every row has ended) when given an
``eos``. Each row ends at its own ``eos``, and its later tokens are ``pad_id``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from attention_core import checks, sampling
from attention_core.host import host_array, plain
from attention_core.ops import Array, SamplingOps
from attention_core.registry import ops_for

#: A decoding step: ``(tokens (N, t), cache or None, start) -> (logits (N, t, V), cache)``;
#: for ragged prompts also ``lengths=`` and ``padding=`` at the first call, ``start`` ``(N,)``.
Step = Callable[..., tuple[Array, Any]]


def decoder_step(decoder: Callable[..., Any], capacity: int, *args: Any, **kwargs: Any) -> Step:
    """The decoding step of a cached decoder: a layer, or anything called as one.

    ``step(tokens, cache, start, **ragged)`` is ``decoder(tokens, *args, capacity=capacity,
    start=start, **ragged, **kwargs)`` at the first call (cache None: it makes the cache of
    ``capacity`` positions; ``ragged`` holds :func:`generate`'s ``lengths`` and ``padding``),
    then ``decoder(tokens, *args, cache=cache, start=start, **kwargs)``. For a Flax module,
    pass ``functools.partial(module.apply, variables)``.
    """
    capacity = checks.check_positive_int("capacity", capacity)

    def step(tokens: Array, cache: Any, start: Any, **ragged: Any) -> tuple[Array, Any]:
        if cache is None:
            return decoder(tokens, *args, capacity=capacity, start=start, **ragged, **kwargs)
        return decoder(tokens, *args, cache=cache, start=start, **kwargs)

    return step


class Generated(NamedTuple):
    """What a search returns.

    Attributes:
        tokens: ``(B, L)`` int64 ids after the start token, ``eos`` where a sequence ended
            and after it.
        lengths: ``(B,)`` tokens up to and including the first ``eos`` (L when none).
        scores: ``(B,)`` the sum of the tokens' log-probabilities (beam search: divided by
            ``length ** length_penalty``).
    """

    tokens: np.ndarray
    lengths: np.ndarray
    scores: np.ndarray


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """``log softmax`` over the last axis, in float64."""
    x = logits.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _check_token_id(name: str, value: Any, vocab_size: int | None) -> int | None:
    """Checks an id argument: None, or an integer (any framework's scalar) in ``[0, V)``."""
    value = plain(value)
    got = type(value).__name__
    if getattr(value, "shape", None) == () and not isinstance(value, (int, float)):
        array = np.asarray(host_array(value))  # a 0-d array of any framework
        value, got = (int(array), got) if array.dtype.kind in "iu" else (value, f"a {array.dtype} array")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be None or an int token id, got {got}")
    return _in_vocabulary(name, value, value, vocab_size)


def _in_vocabulary(name: str, low: int, high: int, vocab_size: int | None) -> int:
    """Checks ids ``low .. high`` (their least and greatest) against ``[0, vocab_size)``."""
    if low < 0 and vocab_size is None:
        raise ValueError(f"{name} must be in [0, vocab_size), got {low}")
    if vocab_size is not None and (low < 0 or high >= vocab_size):
        bad = low if low < 0 else high
        raise ValueError(f"{name} must be in [0, vocab_size) = [0, {vocab_size}), got {bad}")
    return low


def _start_tokens(bos: Any, vocab_size: int | None) -> np.ndarray:
    """``bos`` as an int64 ``(B,)`` array: integers of any framework, NumPy or a list."""
    try:
        first = np.asarray(host_array(bos))
    except (TypeError, ValueError):  # a ragged list (NumPy 2), an object that is no array
        first = np.empty(0, object)
    if first.dtype == object:  # a ragged list (NumPy 1), any other object
        raise TypeError(f"bos must be integer start tokens of shape (B,), got "
                        f"{type(bos).__name__}")
    if first.dtype.kind not in "iu":
        raise TypeError(f"bos must be integer start tokens of shape (B,), got dtype {first.dtype}")
    if first.ndim != 1 or first.size == 0:
        raise ValueError(f"bos must be integer start tokens of shape (B,) with B >= 1, got shape "
                         f"{first.shape}")
    _in_vocabulary("bos", int(first.min()), int(first.max()), vocab_size)
    return first.astype(np.int64)


class _Search(NamedTuple):
    """The checked arguments of a search."""

    first: np.ndarray
    steps: int
    size: int
    eos: int | None
    alpha: float
    vocab_size: int | None


def _check_search(bos: Any, max_steps: Any, beam_size: Any, eos: Any, length_penalty: Any,
                  vocab_size: Any) -> _Search:
    """Checks every argument of a search before its first step.

    Ids are checked against ``vocab_size`` when given; else against the first step's V, by
    :func:`_check_vocabulary`.
    """
    vocab = None if vocab_size is None else checks.check_positive_int("vocab_size", vocab_size)
    steps = checks.check_positive_int("max_steps", max_steps)
    size = checks.check_positive_int("beam_size", beam_size)
    alpha = plain(length_penalty)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise TypeError(f"length_penalty must be a real number >= 0, got "
                        f"{type(alpha).__name__}")
    if not 0 <= alpha < np.inf:
        raise ValueError(f"length_penalty must be a finite number >= 0, got {length_penalty!r}")
    return _Search(_start_tokens(bos, vocab), steps, size, _check_token_id("eos", eos, vocab),
                   float(alpha), vocab)


def _check_vocabulary(search: _Search, vocab: int) -> None:
    """Checks the first step's V against ``vocab_size``, or the ids against it."""
    if search.vocab_size is not None and vocab != search.vocab_size:
        raise ValueError(f"the step must return logits of shape (N, t, V) with V = vocab_size "
                         f"= {search.vocab_size}, got V = {vocab}")
    _in_vocabulary("bos", int(search.first.min()), int(search.first.max()), vocab)
    if search.eos is not None:
        _in_vocabulary("eos", search.eos, search.eos, vocab)


def _last_row(logits: Any, rows: int, vocab: int | None) -> np.ndarray:
    """The last position's logits ``(N, V)`` of a step's ``(N, t, V)`` output, on the host.

    ``vocab``: the V of the first step's logits, which every later step must keep.
    """
    values = np.asarray(host_array(logits))
    if values.ndim != 3 or values.shape[0] != rows or 0 in values.shape or (
            vocab is not None and values.shape[2] != vocab):
        want = f"N = {rows}" + ("" if vocab is None else f", V = {vocab}")
        raise ValueError(f"the step must return logits of shape (N, t, V) with {want}, got "
                         f"shape {values.shape}")
    return values[:, -1]


def _like(x: Any, values: np.ndarray) -> Any:
    """``values`` as an array of ``x``'s framework (NumPy for a list or a NumPy array)."""
    try:
        ops = ops_for(x)
    except TypeError:  # not a backend's array: the NumPy backend takes NumPy
        return values
    return ops.from_numpy(values)


def _ids_like(x: Any, ids: np.ndarray) -> Any:
    """Token ids ``(N,)`` as the int32 ``(N, 1)`` input of a step, in ``x``'s framework."""
    return _like(x, ids.astype(np.int32)[:, None])


def greedy_search(step: Step, bos: Any, max_steps: int, *, eos: int | None = None,
                  vocab_size: int | None = None) -> Generated:
    """Decodes by taking the most likely token at each step: a beam search of one beam.

    Args:
        step: The decoding step (see the module's docstring).
        bos: The start token of each sequence, ``(B,)`` integers: an array of any framework,
            a NumPy array or a list (see :func:`beam_search`).
        max_steps: The most tokens to generate, a positive int.
        eos: The end token, an int in ``[0, V)``: a sequence that emits it is finished (its
            later tokens are ``eos``); the search stops when all are. None to always
            generate ``max_steps``.
        vocab_size: V, to check ``bos`` and ``eos`` against before the first step; None to
            check them against the first step's logits.

    Returns:
        A :class:`Generated`; ``scores`` holds each sequence's log-probability up to its end.
    """
    return beam_search(step, bos, max_steps, beam_size=1, eos=eos, length_penalty=0.0,
                       vocab_size=vocab_size)


def repeat_rows(x: Any, times: int) -> Any:
    """Each row (axis 0) of ``x`` repeated ``times`` times in a row, in ``x``'s framework.

    For the step's inputs in beam search (encoder outputs, their lengths): row ``b`` becomes
    rows ``b * times .. b * times + times - 1``.
    """
    times = checks.check_positive_int("times", times)
    return _like(x, np.repeat(np.asarray(host_array(x)), times, axis=0))


def reorder_cache(cache: Any, rows: np.ndarray) -> Any:
    """The cache with its rows (axis 0 of every array) taken in the order ``rows``.

    Works on any nesting of lists and tuples; each array is gathered by the backend's own
    lookup (flattened to ``(N, -1)``), so the cache stays where it is.
    """
    if cache is None:
        return None
    if isinstance(cache, (list, tuple)):
        return type(cache)(reorder_cache(part, rows) for part in cache)
    ops = ops_for(cache)
    shape = ops.shape(cache)
    flat = ops.reshape(cache, (shape[0], -1))
    taken = ops.take(flat, ops.from_numpy(rows.astype(np.int32)))
    return ops.reshape(taken, (len(rows), *shape[1:]))


def beam_search(
    step: Step,
    bos: Any,
    max_steps: int,
    *,
    beam_size: int = 4,
    eos: int | None = None,
    length_penalty: float = 0.75,
    vocab_size: int | None = None,
) -> Generated:
    """Decodes by keeping the ``beam_size`` most likely hypotheses of each example.

    At each step every live hypothesis is extended by every token; the ``beam_size`` best
    extensions of each example (by summed log-probability) are kept, and the cache's rows are
    reordered to follow them. A hypothesis that emits ``eos`` is finished: it keeps its score
    and extends only by ``eos``, at no cost. The search stops when every hypothesis has
    finished or after ``max_steps`` tokens; each example's result is the hypothesis with the
    best ``score / length ** length_penalty``.

    Args:
        step: The decoding step, called on ``B * beam_size`` rows, example-major (see the
            module's docstring; :func:`repeat_rows` for its other inputs).
        bos: The start token of each example, ``(B,)`` integers in ``[0, V)``: an array of
            any framework, a NumPy array or a list. The first step gets its ids as an array
            of ``bos``'s framework (a NumPy array for a list), the later steps as one of the
            logits' framework.
        max_steps: The most tokens to generate, a positive int.
        beam_size: Hypotheses per example, a positive int; 1 is greedy search.
        eos: The end token, an int in ``[0, V)``, or None.
        length_penalty: The exponent of the length that divides a finished score, a real
            number >= 0; 0 ranks by log-probability alone.
        vocab_size: V, to check ``bos`` and ``eos`` against before the first step; None to
            check them against the first step's logits (before any is read).

    Returns:
        A :class:`Generated` of the best hypothesis of each example.

    Raises:
        TypeError: An argument of the wrong type (``bos`` not integers, ``eos`` not an int,
            ``length_penalty`` not a real number).
        ValueError: An argument out of its range, ``bos`` not of shape ``(B,)``, or logits
            not ``(N, t, V)``.
    """
    search = _check_search(bos, max_steps, beam_size, eos, length_penalty, vocab_size)
    first, steps, size, eos = search.first, search.steps, search.size, search.eos
    batch = first.shape[0]
    rows = batch * size
    logits, cache = step(_ids_like(bos, np.repeat(first, size)), None, 0)
    scores = np.tile(np.r_[0.0, np.full(size - 1, -np.inf)], batch)  # one live beam at first
    tokens = np.zeros((rows, 0), np.int64)
    done = np.zeros(rows, bool)
    lengths = np.full(rows, steps, np.int64)
    vocab = None
    for t in range(steps):
        last = _last_row(logits, rows, vocab)
        if vocab is None:
            vocab = last.shape[1]
            _check_vocabulary(search, vocab)
        logp = log_softmax(last)
        if eos is not None:  # a finished hypothesis extends by eos alone, at no cost
            logp[done] = -np.inf
            logp[done, eos] = 0.0
        total = (scores[:, None] + logp).reshape(batch, size * vocab)
        best = np.argsort(-total, axis=1, kind="stable")[:, :size]  # (B, K)
        parent = (best // vocab + np.arange(batch)[:, None] * size).reshape(rows)
        chosen = (best % vocab).reshape(rows)
        scores = np.take_along_axis(total, best, axis=1).reshape(rows)
        tokens = np.concatenate([tokens[parent], chosen[:, None]], axis=1)
        done, lengths = done[parent], lengths[parent]
        if eos is not None:
            ended = ~done & (chosen == eos)
            lengths[ended] = t + 1
            done |= ended
        if (eos is not None and done.all()) or t + 1 == steps:
            break
        if not np.array_equal(parent, np.arange(rows)):  # never with one beam: rows stay put
            cache = reorder_cache(cache, parent)
        logits, cache = step(_ids_like(logits, chosen), cache, t + 1)
    lengths = np.minimum(lengths, tokens.shape[1])
    ranked = (scores / lengths.astype(np.float64) ** search.alpha).reshape(batch, size)
    pick = np.arange(batch) * size + ranked.argmax(axis=1)
    return Generated(tokens[pick], lengths[pick], ranked.max(axis=1))


def generate(
    step: Step,
    prompts: Any,
    *,
    max_new_tokens: int,
    eos: int | None = None,
    pad_id: int = 0,
    temperature: float | None = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    vocab_size: int | None = None,
    lengths: Any = None,
    padding: str = "left",
) -> Generated:
    """Continues each prompt by up to ``max_new_tokens`` tokens, greedily or by sampling.

    The step first runs on the whole prompts (positions ``0 .. T - 1``, cache None); the
    next token comes from the last position's logits, then each step feeds the chosen tokens
    ``(B, 1)`` at the next position. Prompts of different lengths (``lengths``) share the
    batch padded on one side: the first step gets ``start`` zeros ``(B,)``, ``lengths=`` and
    ``padding=`` (a cached decoder takes them as they are, see :func:`decoder_step`), the next
    token comes from each prompt's last real position, and row ``b`` continues at position
    ``lengths[b]``, so each equals its prompt generated alone. Tokens are chosen on the device by
    :func:`attention_core.sampling.choose`, drawing from the framework's own generator seeded
    by ``seed`` (the same seed gives the same tokens again on one backend; the streams differ
    between backends, and MXNet's generator is global).

    Args:
        step: The decoding step (see the module's docstring).
        prompts: ``(B, T)`` integer token ids, all of length T: an array of any framework
            (given to the first step as it is), a NumPy array or nested lists (given as a
            NumPy array).
        max_new_tokens: The most tokens to generate per row, a positive int.
        eos: The end token, an int in ``[0, V)``, or None: a row that emits it has ended,
            and generation stops when every row has.
        pad_id: The token an ended row gets after its ``eos``, an int in ``[0, V)``.
        temperature: 0 or None for greedy decoding; else a finite number > 0.
        top_k: None, or an int in ``[1, V]`` (see :func:`~attention_core.sampling.choose`).
        top_p: None, or a number in ``(0, 1]``.
        seed: The seed of the generator, an int >= 0 (unused when greedy).
        vocab_size: V, to check ``eos``, ``pad_id``, ``top_k`` and host prompts before the
            first step; None to check them against the first step's logits.
        lengths: None (every prompt fills its row), or integers ``(B,)`` in ``[1, T]`` on the
            host: each prompt's real tokens, the rest of its row padding.
        padding: Where a shorter prompt's padding sits: ``"left"`` or ``"right"``.

    Returns:
        A :class:`Generated`: ``tokens (B, L)`` (``L <= max_new_tokens``), ``lengths`` up
        to and including each row's ``eos``, and ``scores``, the sum of the generated tokens'
        log-probabilities under the step's logits (before temperature and filtering).

    Raises:
        TypeError: An argument of the wrong type.
        ValueError: An argument out of its range, prompts not ``(B, T)``, or logits not
            ``(B, t, V)``.
    """
    run = _check_generate(prompts, max_new_tokens, eos, pad_id, temperature, top_k, top_p,
                          seed, vocab_size)
    real = _prompt_lengths(lengths, padding, run.batch, run.width)
    if real is None:  # every row at positions 0 .. T - 1: the next start is the scalar T
        logits, cache = step(run.prompts, None, 0)
        start: Any = run.width
    else:
        logits, cache = step(run.prompts, None, np.zeros(run.batch, np.int32), lengths=real,
                             padding=padding)
        start = real
    ops: Any = ops_for(logits)
    run = _first_logits(ops, logits, run)
    last = _next_logits(ops, logits, run, None if padding == "left" else real)
    state = ops.new_sampling_state(run.seed, like=last) if run.settings.temperature else None
    live = ops.from_numpy(np.ones(run.batch, bool), like=last)
    chosen, scores = [], ops.from_numpy(np.zeros((run.batch, 1), np.float32), like=last)
    for t in range(run.steps):
        tokens, state = sampling.choose(ops, last, temperature=run.settings.temperature,
                                        top_k=run.settings.top_k, top_p=run.settings.top_p,
                                        state=state)
        scores = scores + ops.where(ops.expand_dims(live, 1), _log_prob(ops, last, tokens), 0.0)
        tokens = ops.where(live, tokens, run.pad_id)
        chosen.append(ops.expand_dims(tokens, 1))
        if run.eos is not None:
            live = ops.logical_and(live, tokens != run.eos)
            if not ops.to_numpy(live).any():  # the one host read of a step
                break
        if t + 1 == run.steps:
            break
        logits, cache = step(ops.reshape(tokens, (run.batch, 1)), cache, start + t)
        last = _next_logits(ops, logits, run)
    return _generated(ops, chosen, scores, run.eos)


class _Generate(NamedTuple):
    """The checked arguments of :func:`generate`."""

    prompts: Any
    batch: int
    width: int
    host: np.ndarray | None
    steps: int
    eos: int | None
    pad_id: int
    settings: sampling.Sampling
    seed: int
    vocab_size: int | None


def _check_generate(prompts: Any, max_new_tokens: Any, eos: Any, pad_id: Any, temperature: Any,
                    top_k: Any, top_p: Any, seed: Any, vocab_size: Any) -> _Generate:
    """Checks every argument of :func:`generate` before its first step."""
    vocab = None if vocab_size is None else checks.check_positive_int("vocab_size", vocab_size)
    given, host = _prompts(prompts, vocab)
    steps = checks.check_positive_int("max_new_tokens", max_new_tokens)
    pad = _pad_id(pad_id, vocab)
    settings = sampling.check_sampling(temperature, top_k, top_p, vocab)
    seed = plain(seed)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int in [0, 2**31), got {type(seed).__name__}")
    if not 0 <= seed < 2**31:
        raise ValueError(f"seed must be an int in [0, 2**31), got {seed}")
    shape = tuple(int(d) for d in (host.shape if host is not None else ops_for(given).shape(given)))
    return _Generate(given, shape[0], shape[1], host, steps, _check_token_id("eos", eos, vocab),
                     pad, settings, seed, vocab)


def _pad_id(pad_id: Any, vocab_size: int | None) -> int:
    """Checks ``pad_id``: an int (Python or NumPy) in ``[0, vocab_size)``."""
    value = plain(pad_id)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"pad_id must be an int token id, got {type(value).__name__}")
    return _in_vocabulary("pad_id", value, value, vocab_size)


def _prompts(prompts: Any, vocab_size: int | None) -> tuple[Any, np.ndarray | None]:
    """The prompts as the first step gets them, and their values when on the host.

    A framework's array is checked by shape and dtype only (its values are not read); NumPy
    arrays and lists are read, and their ids checked against ``[0, vocab_size)``.
    """
    try:
        ops = ops_for(prompts)
    except TypeError:
        ops = None
    host = None
    if ops is None or ops.name == "numpy":
        try:
            host = np.asarray(prompts)
        except (TypeError, ValueError):  # a ragged list (NumPy 2)
            host = np.empty(0, object)
        if host.dtype == object:
            raise TypeError(f"prompts must be integer token ids of shape (B, T), got "
                            f"{type(prompts).__name__}")
        shape, dtype = host.shape, host.dtype.name
    else:
        shape, dtype = ops.shape(prompts), ops.dtype_name(prompts)
    if np.dtype(dtype).kind not in "iu":
        raise TypeError(f"prompts must be integer token ids of shape (B, T), got dtype {dtype}")
    if len(shape) != 2 or 0 in shape:
        raise ValueError(f"prompts must be integer token ids of shape (B, T) with B, T >= 1, "
                         f"got shape {tuple(shape)}")
    if host is None:
        return prompts, None
    _in_vocabulary("prompts", int(host.min()), int(host.max()), vocab_size)
    return host, host


def _first_logits(ops: Any, logits: Any, run: _Generate) -> _Generate:
    """Checks the first step's logits, and the ids and ``top_k`` against their V.

    Returns the arguments with ``vocab_size`` set to that V, which later steps must keep.
    """
    vocab = _next_logits_shape(ops, logits, run)[2]
    if run.host is not None:
        _in_vocabulary("prompts", int(run.host.min()), int(run.host.max()), vocab)
    for name, value in (("eos", run.eos), ("pad_id", run.pad_id)):
        if value is not None:
            _in_vocabulary(name, value, value, vocab)
    sampling.check_sampling(None, run.settings.top_k, None, vocab)
    return run._replace(vocab_size=vocab)


def _next_logits_shape(ops: Any, logits: Any, run: _Generate) -> tuple[int, ...]:
    """The shape of a step's logits, which must be ``(B, t, V)`` (V that of the first step)."""
    shape = tuple(ops.shape(logits))
    vocab = run.vocab_size
    if len(shape) != 3 or shape[0] != run.batch or 0 in shape or (
            vocab is not None and shape[2] != vocab):
        want = f"N = {run.batch}" + ("" if vocab is None else f", V = {vocab}")
        raise ValueError(f"the step must return logits of shape (N, t, V) with {want}, got "
                         f"shape {shape}")
    return shape


def _next_logits(ops: Any, logits: Any, run: _Generate, lengths: np.ndarray | None = None
                 ) -> Any:
    """The last position's logits ``(B, V)`` of a step's ``(B, t, V)``.

    With ``lengths``, those of position ``lengths[b] - 1`` of row b (right-padded prompts).
    """
    batch, t, vocab = _next_logits_shape(ops, logits, run)
    if lengths is None:
        return ops.reshape(ops.slice(logits, 1, t - 1, 1), (batch, vocab))
    picked = ops.from_numpy(np.arange(t)[None, :, None] == (lengths - 1)[:, None, None],
                            like=logits)
    return ops.reshape(ops.sum(ops.where(picked, logits, 0.0), 1), (batch, vocab))


def _prompt_lengths(lengths: Any, padding: Any, batch: int, width: int) -> np.ndarray | None:
    """Checks :func:`generate`'s ``lengths`` and ``padding``.

    Returns:
        The lengths (host integers ``(B,)`` in ``[1, T]``) as int32, or None when not given.
    """
    if padding not in ("left", "right"):
        raise ValueError(f"padding must be 'left' or 'right', got {padding!r}")
    if lengths is None:
        return None
    given = host_array(lengths)
    if given.dtype.kind not in "iu":
        raise TypeError(f"lengths must have an integer dtype, got {given.dtype.name}")
    if given.shape != (batch,):
        raise ValueError(f"lengths must have shape (B,) = ({batch},), got {given.shape}")
    if given.size and (given.min() < 1 or given.max() > width):
        raise ValueError(f"lengths must be in [1, T] = [1, {width}], got {given.tolist()}")
    return given.astype(np.int32)


def _log_prob(ops: Any, logits: Any, tokens: Any) -> Any:
    """``log softmax(logits)[b, tokens[b]]`` as ``(B, 1)`` float32, on the device."""
    x = ops.astype(logits, "float64" if ops.dtype_name(logits) == "float64" else "float32")
    x = x - ops.max(x, 1)
    logp = x - ops.log(ops.sum(ops.exp(x), 1))
    picked = ops.expand_dims(ops.arange(ops.shape(x)[1]), 0) == ops.expand_dims(tokens, 1)
    return ops.astype(ops.sum(ops.where(picked, logp, 0.0), 1), "float32")


def _generated(ops: SamplingOps, chosen: list[Any], scores: Any, eos: int | None) -> Generated:
    """The tokens and scores read once, and each row's length up to its ``eos``."""
    tokens = np.asarray(ops.to_numpy(ops.concatenate(chosen, 1))).astype(np.int64)
    lengths = np.full(tokens.shape[0], tokens.shape[1], np.int64)
    if eos is not None:
        ended = tokens == eos
        first = ended.argmax(axis=1)
        lengths = np.where(ended.any(axis=1), first + 1, lengths)
    return Generated(tokens, lengths, np.asarray(ops.to_numpy(scores), np.float64)[:, 0])
