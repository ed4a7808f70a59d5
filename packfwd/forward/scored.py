"""Scored tokens only: the head computes the tokens whose numbers are used, and gives exactly 0 at the others.

A token is **scored** when it is a real token (not a layout pad), its label is not ignored (``labels >= 0``,
when the processor is given labels) and it lies inside every loss mask the caller passed (the processor's
``token_mask``, the forward's ``loss_mask``; verl's ``label_mask`` / ``loss_mask`` in :mod:`packfwd.verl`).  The
other tokens skip the vocab projection and the log-softmax: on the fused head the selected rows alone go through
:func:`packfwd.logits.fused_log_probs_and_entropy` (``token_mask`` and ``token_count``); on the logits head the
model returns its final hidden states (``return_hidden=True``) and :func:`packfwd.logits.selected_logits`
projects the scored rows only, then the processor runs on those ``[n, v]`` logits.  Every output of the
processor is exactly 0 at a token not scored (entropy included), and sends no gradient there; at the scored
tokens values and gradients are the full head's (to the rounding of a matmul over fewer rows).

How many rows: :func:`packfwd.logits.select_rows` puts the scored tokens into a fixed number of slots, a host
int, so nothing reads the device:

* the caller's count, ``scored_tokens=`` (``run_micro_batches`` passes the loss tokens of each micro-batch,
  which it counts once per step): no host sync;
* else, when the forward plans from the mask anyway (no ``seqlens=``, no ``plan=``): the count read back once,
  before the model runs (one more host sync on CUDA);
* else (``seqlens=`` or ``plan=`` given, no count: the caller asked for no host sync): every row computed and
  the outputs masked, as with a plain ``token_mask`` (the same numbers, no saving).

The slots are the count rounded up to a bucket (:func:`slots_for`: at most 1/16 more, so ``torch.compile`` and
CUDA graphs see few shapes), never more than the packed tokens.  More scored tokens than slots raise (an
asynchronous device assert on CUDA).

Left as before: a value model, a forward without a processor (the logits), a processor given neither labels nor
a mask, a pipeline stage before the last.  The logits head projects only the scored rows when the model's
``forward`` takes ``return_hidden`` (packfwd's ``PackedGPTModel``) with an output layer without bias or MuP
scaling, and the forward has no MTP (whose depths need the model's output layer) or padded-mask call (a vision
model's); otherwise the model computes every logit and the processor still runs on the scored rows only.
``make_forward(..., scored_only=False)`` scores every token.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch
from torch import Tensor

__all__ = ["Scoring", "Selection", "check_scoring", "slots_for"]


def slots_for(count: int, tokens: int) -> int:
    """The slots for ``count`` scored tokens of ``tokens``: the count rounded up to a multiple of
    ``2**(bits(count) - 5)`` (at least 64; at most 1/16 more), capped at ``tokens``.

    >>> slots_for(1000, 4096), slots_for(5000, 4096), slots_for(10_000, 20_000), slots_for(0, 8)
    (1024, 4096, 10240, 0)
    """
    step = max(64, 1 << max(int(count).bit_length() - 5, 0))
    return min(-(-int(count) // step) * step, int(tokens))


@dataclasses.dataclass(frozen=True)
class Selection:
    """One call's scored tokens: ``mask [t]`` bool in the layout's token order; ``slots``: the rows the head
    computes (None: every row, outputs masked); ``hidden``: the logits head projects the scored rows itself."""

    mask: Tensor
    slots: int | None
    hidden: bool = False


@dataclasses.dataclass(frozen=True)
class Scoring:
    """Which processor arguments say what is scored: ``labels`` (negative = ignored) and ``masks`` (True = scored);
    ``hidden``: the logits head may ask the model for hidden states (False with MTP)."""

    labels: str = "labels"
    masks: tuple = ("token_mask",)
    hidden: bool = True

    def select(self, step, call: dict, head) -> Selection | None:
        """At planning: the scored mask and its slots (module docstring), or None to score every token.  Sets
        ``call["return_hidden"]`` when the logits head projects the scored rows itself."""
        if step.empty or step.processor is None or step.facts.value_model or not step.facts.post_process:
            return None
        pads = step.layout.padding_mask(step.plan).reshape(-1)  # [t], True at the layout's padding slots
        t = pads.shape[0]
        wanted = [step.args.get(self.labels)] if isinstance(step.args.get(self.labels), Tensor) else []
        masks = [m >= 0 for m in wanted if m.dim() == 1 and m.shape[0] == t]
        masks += [_bool(step.args[k], k, t) for k in self.masks if isinstance(step.args.get(k), Tensor)]
        loss_mask = step.batch.options.get("loss_mask")
        if loss_mask is not None:
            packed = step.layout.pack_arg(loss_mask, step.plan, step.batch.input_ids, name="loss_mask")
            masks.append(_bool(packed, "loss_mask", t))
        if not masks:
            if step.batch.options.get("scored_tokens") is not None:
                raise TypeError(f"scored_tokens= sizes the scored tokens, but this call marks none: give the "
                                f"processor {self.labels} (negative = ignored) or a loss_mask, or drop scored_tokens")
            return None
        mask = ~pads
        for m in masks:
            mask = mask & m
        count = step.batch.options.get("scored_tokens")
        if count is None and step.batch.seqlens is None and step.batch.plan is None:
            count = int(mask.sum())  # a host sync on CUDA: the forward planned from the device mask already
        if count is None:
            return Selection(mask, None)
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise TypeError(f"scored_tokens must be a host int >= 0 (the scored tokens, or more), got {count!r}")
        hidden = head is None and self.hidden and _projects(step.model, call)
        if hidden:
            call["return_hidden"] = True
        return Selection(mask, slots_for(count, t), hidden)

    def heads(self, out, step, head, rows: bool) -> dict:
        """The head on the scored tokens: ``{name: [t, ...]}`` in the layout's token order, 0 where not scored."""
        from ..engine import seq_major
        from ..engine.checks import check_results, takes
        from ..logits import select_rows
        from .head import _unbind

        sel = step.selection
        if head is not None:  # the fused head selects its rows itself (after a sequence-parallel gather)
            fused = _unbind(step.processor)[0].fused
            args = dict(step.args)
            if sel.slots is not None and takes(fused, "token_mask") and takes(fused, "token_count"):
                args.update(token_mask=sel.mask, token_count=sel.slots)
            elif sel.slots is None:  # every row, no host sync: a token_mask would read its count back
                args.pop("token_mask", None)
                if takes(fused, "real_tokens"):  # the unscored tokens' temperatures are not read
                    args["real_tokens"] = sel.mask
            results, t = head.run(step.processor, step.model, step.facts, out, args)
            return {k: _zero_outside(v, sel.mask) for k, v in check_results(results, t).items()}
        t = sel.mask.shape[0]
        b = out.shape[1] if sel.hidden else 1  # hidden states [s, b, h]: rows in [s, b] order
        order = (lambda x: seq_major(x, b)) if b > 1 else (lambda x: x)  # noqa: E731
        if sel.slots is None:
            logits, picked = step.tokens(out), None
        else:
            picked = select_rows(order(sel.mask), sel.slots)
            logits = _project(out, step, picked) if sel.hidden else picked.take(step.tokens(out))
        base = dict(step.args)
        if picked is None and isinstance(base.get("real_tokens"), Tensor):  # every row computed, the unscored
            base["real_tokens"] = base["real_tokens"] & sel.mask  # zeroed after: their temperatures are not read
        args = {k: order(v) if _per_token(v, t) else v for k, v in base.items()}  # the rows' order
        if picked is not None:
            args = {k: picked.take(v) if _per_token(v, t) else v for k, v in args.items()}
        if rows and picked is None:  # verl's processors see the model's output layout
            got = step.processor(step.rows(logits), **{k: step.rows(v) if _per_token(v, t) else v
                                                       for k, v in args.items()})
            got = {k: step.tokens(v) if isinstance(v, Tensor) else v for k, v in got.items()}
        elif rows:  # the scored rows as one packed row [1, n, v]
            n = logits.shape[0]
            got = step.processor(logits[None], **{k: v[None] if _per_token(v, n) else v for k, v in args.items()})
            got = {k: v[0] if isinstance(v, Tensor) else v for k, v in got.items()}
        else:
            got = step.processor(logits, **args)
        got = check_results(got, logits.shape[0])
        if picked is None:
            return {k: _zero_outside(v, sel.mask) for k, v in got.items()}
        back = (lambda x: seq_major(x, b, inverse=True)) if b > 1 else (lambda x: x)  # noqa: E731
        return {k: back(picked.put(v)) for k, v in got.items()}


def _project(out: Tensor, step, picked) -> Tensor:
    """The output layer on the picked rows of the hidden states ``out [s, b, h]``."""
    from ..logits import selected_logits
    from ..models.runtime.gpt import unwrap
    from .head import output_weight

    gpt = unwrap(step.model)
    sp = bool(getattr(gpt.config, "sequence_parallel", False)) and step.facts.tp_size > 1
    group = step.facts.tp_group if step.facts.tp_size > 1 else None
    return selected_logits(out.reshape(-1, out.shape[-1]), output_weight(gpt), picked, tp_group=group,
                           sequence_parallel=sp)


def _projects(model, call: dict) -> bool:
    """Whether the logits head can ask this model for hidden states and project the scored rows itself."""
    from ..models.runtime.gpt import unwrap

    gpt = unwrap(model)
    try:
        takes_hidden = "return_hidden" in inspect.signature(gpt.forward).parameters
    except (TypeError, ValueError):
        return False
    head = getattr(gpt, "output_layer", None)
    return (takes_hidden and head is not None and getattr(head, "bias", None) is None
            and not getattr(getattr(gpt, "config", None), "use_mup", False)
            and call.get("attention_mask") is None and call.get("mtp_input_ids") is None)


def _bool(x: Any, name: str, t: int) -> Tensor:
    if not isinstance(x, Tensor) or x.dim() != 1 or x.shape[0] != t:
        raise ValueError(f"{name} must be per token ([b, s] like input_ids, or [b] per sequence); got "
                         f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
    if name == "token_mask" and x.dtype != torch.bool:  # the processor's own argument: its rule
        raise TypeError(f"token_mask must be a bool tensor [t] (True: compute this token), got {x.dtype}")
    return x if x.dtype == torch.bool else x != 0


def _per_token(v, t: int) -> bool:
    return isinstance(v, Tensor) and v.dim() > 0 and v.shape[0] == t


def _zero_outside(v: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask.reshape(-1, *([1] * (v.dim() - 1))), v, 0)


def check_scoring(loss_mask, scored_tokens, processor, scored_only: bool, processor_args: dict) -> None:
    """The forward's ``loss_mask`` / ``scored_tokens``: refused where they would not be used; ``loss_mask`` also goes
    to a processor that takes one (``processor_args`` updated)."""
    from ..engine.checks import takes

    for name, value in (("loss_mask", loss_mask), ("scored_tokens", scored_tokens)):
        if value is None:
            continue
        if processor is None or not scored_only:
            why = "has no logits processor" if processor is None else "scores every token (scored_only=False)"
            raise TypeError(f"{name}= chooses the tokens a logits processor computes, and this forward {why}; "
                            f"drop {name}, or build make_forward(..., logits_processor=..., scored_only=True)")
    if loss_mask is not None and takes(processor, "loss_mask"):
        processor_args["loss_mask"] = loss_mask
