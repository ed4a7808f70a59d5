"""What the engine checks in its planning step: the processor it may call on a vocabulary slice, the ids and
positions, the processor's results, and (with a ``check_group``) that every rank of the group planned the same
batch or raises the same error.  The model's own facts are :mod:`packfwd.engine.facts`."""

from __future__ import annotations

import functools
import inspect
import types
import weakref
from typing import Mapping

import torch
from torch import Tensor

from .._validate import check_positions as _check_positions
from .._validate import unwrap
from .facts import ModelFacts

__all__ = ["bind_processor", "check_ids", "check_processor_args", "check_positions", "check_results", "checked_call", "takes"]


def bind_processor(processor, facts: ModelFacts):
    """The processor to call on ``[t, v_local]`` logits: given the model's TP group when it takes one; an error
    when it cannot give full-vocabulary numbers (or when the model has a value head, not logits)."""
    if processor is None:
        return None
    if facts.value_model:
        raise ValueError(
            "the model has a value head: its output is [b, s] (one value per token), not logits, so it takes no "
            "logits_processor; call make_forward without logits_processor for a value model"
        )
    if facts.tp_size == 1:
        return processor
    fn, bound = processor, {}
    while isinstance(fn, functools.partial):
        bound = {**fn.keywords, **bound}
        fn = fn.func
    if "tp_group" not in bound and not getattr(fn, "takes_tp_group", False):
        name = getattr(fn, "__name__", type(fn).__name__)
        raise ValueError(
            f"the model's output layer is split over {facts.tp_size} tensor-parallel ranks, so each rank holds "
            f"logits [t, v/{facts.tp_size}]; logits_processor {name!r} does not declare that it handles a vocabulary "
            "slice and would return numbers of this rank's slice only. Use packfwd.logits.log_probs / entropy / "
            "log_probs_and_entropy (make_forward passes them the model's TP group), or decorate yours with "
            "packfwd.logits.vocab_parallel and reduce over its tp_group argument (or bind tp_group yourself with "
            "functools.partial)"
        )
    group = bound.get("tp_group")
    if group is None:
        return functools.partial(processor, tp_group=facts.tp_group)
    import torch.distributed as dist

    mine = facts.tp_group is not None and dist.get_rank(group) != dist.get_rank(facts.tp_group)
    if dist.get_world_size(group) != facts.tp_size or mine:
        raise ValueError(
            f"logits_processor is bound to a tp_group of {dist.get_world_size(group)} ranks (this rank "
            f"{dist.get_rank(group)}) that is not the model's output-layer group ({facts.tp_size} ranks); leave "
            "tp_group unbound and make_forward passes the model's group"
        )
    return processor


def takes(processor, name: str) -> bool:
    """Whether ``processor`` (through ``functools.partial`` layers) has a parameter ``name`` of its own."""
    while isinstance(processor, functools.partial):
        processor = processor.func
    try:
        return name in inspect.signature(processor).parameters
    except (TypeError, ValueError):  # not callable, or a builtin without a signature
        return False


# what the engine or a head passes a processor itself: never the caller's to give
SUPPLIED = frozenset({"tp_group", "real_tokens", "token_count", "sequence_parallel", "token_mask"})


def check_processor_args(processor, given) -> None:
    """A TypeError naming each argument ``processor`` requires (no default) that the call does not give
    (``given``: the processor arguments' names), instead of the processor's own bare complaint after the model
    ran; ``labels`` with the way to make them."""
    missing = [n for n in _required(processor) if n not in given]
    if missing:
        fn = processor
        while isinstance(fn, functools.partial):
            fn = fn.func
        name = getattr(fn, "__name__", type(fn).__name__)
        how = (" (labels: the next token of each position, -100 where there is none: "
               "labels=packfwd.next_token_labels(input_ids, attention_mask))" if "labels" in missing else "")
        raise TypeError(f"logits_processor {name!r} needs {', '.join(f'{n}=' for n in missing)}: pass "
                        f"{'it' if len(missing) == 1 else 'them'} to the forward call{how}")


def _required(processor) -> tuple[str, ...]:
    bound, skip = set(), 0
    while isinstance(processor, functools.partial):
        bound |= set(processor.keywords)
        skip += len(processor.args)
        processor = processor.func
    params = _parameters(processor)
    positional = [name for name, kind, _ in params if kind in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")]
    first = set(positional[: 1 + skip])  # the logits, and what a partial bound by position
    return tuple(name for name, kind, required in params
                 if required and kind in ("POSITIONAL_OR_KEYWORD", "KEYWORD_ONLY")
                 and name not in first and name not in bound and name not in SUPPLIED)


_PARAMETERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # a function's, read once (not kept alive)


def _parameters(fn) -> tuple:
    """``(name, kind, required)`` of ``fn``'s own parameters (a ``functools.wraps`` wrapper's, not the wrapped
    function's: the wrapper may fill some itself); () for what has no signature."""
    cacheable = isinstance(fn, types.FunctionType)
    if cacheable and fn in _PARAMETERS:
        return _PARAMETERS[fn]
    try:
        sig = inspect.signature(fn, follow_wrapped=False)
    except (TypeError, ValueError):  # not callable, or a builtin without a signature
        return ()
    got = tuple((p.name, p.kind.name, p.default is p.empty) for p in sig.parameters.values())
    if cacheable:
        _PARAMETERS[fn] = got
    return got


def checked_call(check_group, layout, prepare):
    """``prepare()``: a forward's validation and planning, returning its step (with its ``plan``).  Without
    ``check_group`` an error is raised at once; with it every rank of the group first compares the outcome
    (``packfwd.parallel.check_across_ranks``: the same error on every rank, or the same plan everywhere)."""
    error = got = None
    try:
        got = prepare()
    except (ValueError, TypeError) as exc:
        if check_group is None:
            raise
        error = exc
    if check_group is not None:
        from ..parallel import check_across_ranks

        fingerprint = () if error is not None else layout.fingerprint(got.plan)
        check_across_ranks(check_group, error=error, values=fingerprint, what="batches")
    return got


def check_ids(input_ids, attention_mask=None, model=None) -> None:
    """Token ids: a ``[b, s]`` (or jagged) int64 / int32 tensor (what an embedding indexes with), and, when the
    model has a ``vocab_size``, every real token's id in ``[0, vocab_size)``: checked before the model runs,
    eagerly on the CPU, with ``torch._assert_async`` on CUDA (no host sync; it fails at the next synchronisation
    with this message, instead of the embedding's index error).  Padding positions may hold anything."""
    if not isinstance(input_ids, Tensor):
        raise TypeError(f"input_ids must be a torch.Tensor of token ids [b, s], got {type(input_ids).__name__}")
    dtype = input_ids.dtype
    if dtype == torch.bool or dtype.is_floating_point or dtype.is_complex:
        raise TypeError(f"input_ids has dtype {dtype}; pass integer token ids (e.g. input_ids.long())")
    if dtype not in (torch.int64, torch.int32):
        raise TypeError(
            f"input_ids has dtype {dtype}, which an embedding does not take (and which may not hold every token id of "
            "a vocabulary); pass int64 token ids: input_ids.long() (int32 works too)"
        )
    if input_ids.dim() != 2:
        hint = " (drop the trailing dim: input_ids.squeeze(-1))" if input_ids.dim() == 3 and input_ids.shape[-1] == 1 else ""
        raise ValueError(f"input_ids must be [b, s] token ids, got shape {tuple(input_ids.shape)}{hint}")
    vocab = _vocab_size(model)
    if vocab is not None:
        _check_id_range(input_ids, attention_mask, vocab)


def _vocab_size(model) -> int | None:
    """The model's (padded) vocabulary size, or None when it does not say (a plain module)."""
    if model is None:
        return None
    vocab = getattr(unwrap(model), "vocab_size", None)
    return vocab if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab > 0 else None


def _check_id_range(input_ids: Tensor, attention_mask, vocab: int) -> None:
    if input_ids.is_nested:
        ids, real = input_ids.values(), None  # every value is a real token
    elif isinstance(attention_mask, Tensor) and attention_mask.shape == input_ids.shape and (
            attention_mask.device == input_ids.device):
        ids, real = input_ids, attention_mask != 0
    else:
        return  # no usable mask: planning names the problem
    fix = "check that the tokenizer matches the model, and that labels (-100) are not passed as ids"
    if ids.device.type != "cpu":
        in_range = (ids >= 0) & (ids < vocab)
        torch._assert_async((in_range if real is None else in_range | ~real).all(),  # CUDA: under 255 characters
                            f"input_ids hold a token id outside [0, vocab_size={vocab}) at a real token; {fix}")
        return
    ids = ids if real is None else ids[real]
    if ids.numel() == 0:
        return
    lo, hi = (int(x) for x in torch.aminmax(ids))
    if lo < 0 or hi >= vocab:
        raise ValueError(f"input_ids hold token ids in [{lo}, {hi}] at real tokens, outside the model's vocabulary "
                         f"[0, {vocab}) (vocab_size={vocab}); {fix}")


def check_positions(position_ids, input_ids, coords: int | str | None = "any") -> None:
    """The caller's positions beside ``input_ids``: ``[b, s]``, ``[k, b, s]`` (``coords``: the model's ``k``, None
    for 1-D RoPE, ``"any"`` where the model is not known), or jagged like jagged ids
    (:func:`packfwd._validate.check_positions`, the one check the models use too)."""
    _check_positions(position_ids, input_ids, coords=coords)


def check_results(results, t: int) -> Mapping[str, Tensor]:
    if not isinstance(results, Mapping):
        raise TypeError(f"logits_processor must return a dict of [t, ...] tensors, got {type(results).__name__}")
    for key, value in results.items():
        if not isinstance(value, Tensor) or value.dim() == 0 or value.shape[0] != t:
            got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise ValueError(
                f"logits_processor returned {key!r} with shape {got}, but it was given logits of t={t} packed "
                "tokens; a processor must return one row per token it was given ([t, ...])"
            )
    return results
