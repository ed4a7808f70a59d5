"""The one forward engine: every packfwd forward is argument translation around :class:`Engine`.

A call runs five named steps:

1. **plan** the batch with the layout adapter (:mod:`packfwd.engine.adapters`: THD, BSHD, or verl's flavours), or
   take the caller's plan; the ids go to the model's layout with it;
2. **pack** every per-token input with the same plan: the processor's arguments and each extension's inputs
   (labels, loss masks, MTP ids, a caller's router mask, recorded routing...), given in the caller's layout
   (``[b, s, ...]``, ``[b]`` per sequence, or jagged);
3. **call** the model: the call strategy turns the packed batch into the model's keywords (text, vision hook,
   verl's conventions), the engine adds the router mask (:func:`router_padding`: an MoE model's routers never
   see a layout pad) and each extension's keywords; an empty batch is not run (:func:`~.facts.empty_output`);
4. **heads and extensions**: on the last pipeline stage each extension takes its part of the model's output
   (MTP logits, routing statistics) and gives named outputs, then the head (the logits, a logits processor, or
   a fused head on the hidden states) gives the main ones; a stage before the last hands its hidden states on,
   with what each extension carries (:meth:`Extension.hand_on`);
5. **unpack** every output to the caller's layout (CP ranks gathered first).

An :class:`Extension` is one feature of a forward (MTP, the MoE aux loss, ...): a few hooks, each a no-op by
default, that see the packed batch in a :class:`Step`.  A new per-token input needs no new code: put it in
:attr:`Batch.inputs` (a processor argument) or return it from :meth:`Extension.inputs`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Mapping

import torch
from torch import Tensor

from .checks import bind_processor, check_ids, check_processor_args, check_results, checked_call
from .facts import ModelFacts, check_cp, check_every_ep_rank_runs, empty_output, is_moe, model_facts

__all__ = ["Batch", "Engine", "Extension", "Result", "Step", "router_padding", "seq_major", "text_call"]


@dataclasses.dataclass(frozen=True)
class Batch:
    """One call's batch, in the caller's layout.

    ``inputs``: the processor's arguments (``[b, s, ...]`` per token, ``[b]`` per sequence, jagged like jagged
    ids, or anything else passed unchanged); the engine packs them with the batch's plan.  ``model_inputs``: model
    keywords passed as they are (multimodal inputs, a router mask already in the packed layout).  ``options``: the
call's arguments for its extensions (an MTP loss mask, carried routing sums), read by them.  ``plan``: the
    batch's plan made ahead (``forward.plan``), then ``attention_mask`` and ``seqlens`` are None."""

    input_ids: Tensor | None
    attention_mask: Tensor | None = None
    position_ids: Tensor | None = None
    seqlens: Any = None
    plan: Any = None
    inputs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    model_inputs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Step:
    """One call after planning: what the model call, the heads and the extensions read.

    ``packed``: each extension input ``[t, ...]`` in the model's token order (``layout.tokens`` order); ``args``:
    the processor's arguments packed the same way; ``state``: per-extension scratch for this call (keyed by the
    extension), e.g. the routing statistics recorded during the model call."""

    model: torch.nn.Module
    batch: Batch
    facts: ModelFacts
    layout: Any
    plan: Any
    ids: Tensor
    processor: Callable | None
    args: dict
    packed: dict
    call: dict = dataclasses.field(default_factory=dict)
    state: dict = dataclasses.field(default_factory=dict)
    selection: Any = None  # the scored tokens the head computes (``Engine.scoring``), or None for every token

    @property
    def attention_mask(self) -> Tensor | None:
        """The caller's ``[b, s]`` mask: the call's, or the plan's when it was made ahead (None for jagged ids)."""
        given = self.batch.attention_mask
        return given if given is not None else self.plan.source.mask

    @property
    def empty(self) -> bool:
        return self.plan.source.total == 0

    def unpack(self, y: Tensor) -> Tensor:
        """``[t, ...]`` in the model's token order -> the caller's layout."""
        return self.layout.unpack(y, self.plan)

    def tokens(self, out: Tensor) -> Tensor:
        """The model's output -> ``[t, ...]`` (one row per packed token)."""
        return self.layout.tokens(out, self.plan)

    def rows(self, y: Tensor) -> Tensor:
        """``[t, ...]`` -> the model's output layout (THD ``[1, t, ...]``, BSHD ``[b, s_c, ...]``)."""
        return self.layout.output_rows(y, self.plan)


class Extension:
    """One feature of a forward beyond its main output (module docstring).  Every hook is a no-op here."""

    def check(self, model, facts: ModelFacts, batch: Batch) -> None:
        """Eager checks, in the planning step (before the model runs)."""

    def inputs(self, step: Step) -> dict:
        """Per-token inputs in the caller's layout, for the engine to pack with the plan (``step.packed``);
        ``step.packed`` is not filled yet."""
        return {}

    def model_kwargs(self, step: Step) -> dict:
        """Keywords for the model call."""
        return {}

    def context(self, step: Step):
        """A context manager to hold open around the model call, or None."""
        return None

    def hand_on(self, out, step: Step):
        """A pipeline stage before the last: what it hands on (its hidden states, with anything carried)."""
        return out

    def finish(self, out, step: Step) -> tuple[Any, dict]:
        """The last stage, before the head: ``(what the head reads, {name: output in the caller's layout})``."""
        return out, {}


@dataclasses.dataclass(frozen=True)
class Result:
    """What an engine call gives: on the last stage ``outputs`` (``{name: tensor}`` in the caller's layout; the
    head's ``"logits"`` or the processor's names, then the extensions'), elsewhere ``hand_on``."""

    outputs: dict | None = None
    hand_on: Any = None
    empty: bool = False  # the batch had no real token: the model did not run (its outputs are zeros)


def text_call(step: Step) -> dict:
    """The model keywords of a text batch: the packed ids, their positions (the caller's packed, or each token's
    place in its sequence) and the layout's own keywords (THD: ``packed_seq_params``)."""
    batch = step.batch
    return dict(input_ids=step.ids, attention_mask=None,
                position_ids=step.layout.positions(step.plan, step.ids, batch.position_ids, batch.input_ids,
                                                   step.facts.rope_coords),
                **step.layout.model_kwargs(step.plan))


@dataclasses.dataclass(frozen=True)
class Engine:
    """The forward (module docstring).  ``layout``: the adapter that plans, packs and unpacks; ``processor``:
    ``processor(logits [t, v_local], **args) -> {name: [t, ...]}`` or None (the logits); ``head``: None, or a
    head that reads hidden states (``packfwd.forward.head.FusedHead``); ``call``: ``call(step) -> model keywords``
    (:func:`text_call`); ``rows=True``: the processor is called in the model's output layout (verl's convention:
    ``[1, t, v]`` THD, ``[b, s_c, v]`` BSHD), its arguments too.  ``tp_size``/``cp_size``/``cp_rank``/
    ``cp_group``: the forward's parallel place, checked against the model's (``check_cp=False``: the model's own
    group is authoritative, as for verl's dynamic CP); ``bind_tp=False``: the processor is called on this rank's
    vocabulary slice as it is (verl's processors reduce over TP themselves), not checked and given the model's TP
    group (:func:`~packfwd.engine.checks.bind_processor`); ``facts_fix``: what a mismatch's message tells the caller
    to do.  ``check_group``: every rank of it validates and plans, then all agree before the model runs.
    ``squeeze_value``: a value model's ``[..., 1]`` output comes back as ``[b, s]`` (False: as the model gives it).
    ``scoring``: which tokens the head computes (``packfwd.forward.scored.Scoring``: the scored ones, 0 at the
    others), or None for every token."""

    layout: Any
    processor: Callable | None = None
    head: Any = None
    extensions: tuple = ()
    call: Callable[[Step], dict] = text_call
    rows: bool = False
    tp_size: int = 1
    cp_size: int = 1
    cp_rank: int = 0
    cp_group: Any = None
    check_cp: bool = True
    bind_tp: bool = True
    facts_fix: str | None = None
    check_group: Any = None
    squeeze_value: bool = True
    scoring: Any = None

    def __call__(self, model, batch: Batch) -> Result:
        step = checked_call(self.check_group, self.layout, lambda: self.prepare(model, batch))
        check_every_ep_rank_runs(model, step.empty)
        out = self.run(step)
        if not step.facts.post_process:
            for ext in self.extensions:
                out = ext.hand_on(out, step)
            return Result(hand_on=out)
        extra = {}
        for ext in self.extensions:
            out, more = ext.finish(out, step)
            extra.update(more)
        outputs = self.heads(out, step)
        clash = sorted(set(outputs) & set(extra))
        if clash:
            raise ValueError(f"the logits processor returned {clash}, names the forward's own outputs take; rename them")
        return Result(outputs={**outputs, **extra}, empty=step.empty)

    def prepare(self, model, batch: Batch) -> Step:
        """Steps 1-2 and the call's keywords: validation, the plan, every input packed.  Eager errors only."""
        facts = model_facts(model, self.tp_size, self.cp_size, self.facts_fix)
        if self.check_cp:
            check_cp(model, self.cp_size, self.cp_rank, self.cp_group)
        processor = bind_processor(self.processor, facts) if self.bind_tp else self.processor
        if processor is not None and facts.post_process:  # an earlier pipeline stage never calls it
            check_processor_args(processor, batch.inputs)
        if self.head is not None:
            self.head.check_model(model, facts)
        if batch.input_ids is not None:  # a later pipeline stage may be given none: its mask alone plans
            check_ids(batch.input_ids, batch.attention_mask, model)
        for ext in self.extensions:
            ext.check(model, facts, batch)
        if batch.input_ids is None:
            plan, ids = self.layout.plan(None, batch.attention_mask, batch.seqlens), None
        elif batch.plan is None:
            plan, ids = self.layout.pack(batch.input_ids, batch.attention_mask, batch.seqlens)
        else:
            plan = batch.plan
            ids = self.layout.pack_planned(plan, batch.input_ids, batch.attention_mask, batch.seqlens)
        pack = lambda k, v: self.layout.pack_arg(v, plan, batch.input_ids, name=k)  # noqa: E731
        step = Step(model=model, batch=batch, facts=facts, layout=self.layout, plan=plan, ids=ids,
                    processor=processor, args={k: pack(k, v) for k, v in batch.inputs.items()}, packed={})
        for ext in self.extensions:
            step.packed.update({k: pack(k, v) for k, v in ext.inputs(step).items()})
        call = dict(self.call(step))
        for ext in self.extensions:
            call.update(ext.model_kwargs(step))
        call.update(batch.model_inputs)
        if self.head is not None:
            call.update(self.head.model_kwargs)
        if self.scoring is not None:
            step.selection = self.scoring.select(step, call, self.head)
        mask = router_padding(model, lambda: self.layout.padding_mask(plan), call.get("padding_mask"))
        if mask is not None:
            call["padding_mask"] = mask
        step.call = call
        return step

    def run(self, step: Step):
        """Step 3: the model on the packed batch, inside the extensions' contexts; an empty batch is not run."""
        contexts = [c for c in (ext.context(step) for ext in self.extensions) if c is not None]

        def call():
            if step.empty:  # nothing to run: Megatron's attention cannot take an empty batch
                shape = self.layout.empty_shape(step.plan, step.facts.post_process)
                return empty_output(step.model, step.facts, shape)
            return step.model(**step.call)

        if not contexts:  # no `with` unless needed: dynamo cannot resume a graph break inside a context manager
            return call()
        with contextlib.ExitStack() as stack:
            for c in contexts:
                stack.enter_context(c)
            return call()

    def heads(self, out, step: Step) -> dict:
        """Step 4's head and step 5: ``{"logits": ...}`` (a value model's ``[b, s]``), or the processor's outputs,
        in the caller's layout."""
        if step.selection is not None:  # scored tokens only: 0 at the others
            return {k: step.unpack(v) for k, v in self.scoring.heads(out, step, self.head, self.rows).items()}
        if self.head is not None and not step.empty:  # the fused head: out holds the hidden states [s, b, h]
            results, t = self.head.run(step.processor, step.model, step.facts, out, step.args)
            return {k: step.unpack(v) for k, v in check_results(results, t).items()}
        logits = step.tokens(out)  # [t, v]
        if step.processor is None:
            full = step.unpack(logits)
            return {"logits": full.squeeze(-1) if step.facts.value_model and self.squeeze_value else full}
        if self.rows:  # the processor sees the model's output layout; its results come back as tokens
            args = {k: step.rows(v) if _per_token(v, logits.shape[0]) else v for k, v in step.args.items()}
            got = step.processor(step.rows(logits), **args)
            if isinstance(got, Mapping):
                got = {k: step.tokens(v) if isinstance(v, Tensor) else v for k, v in got.items()}
        else:
            got = step.processor(logits, **step.args)
        return {k: step.unpack(v) for k, v in check_results(got, logits.shape[0]).items()}


def _per_token(v, t: int) -> bool:
    return isinstance(v, Tensor) and v.dim() > 0 and v.shape[0] == t


def router_padding(model, pads: Callable[[], Tensor], given: Tensor | None = None) -> Tensor | None:
    """The model's ``padding_mask`` (True at slots kept from the routers): for an MoE model the layout's pads
    (``pads()``, the adapter's ``padding_mask(plan)``: alignment, CP, FP8, SP padding), OR-ed with a mask the caller gave in the model's
    layout (verl's ``router_padding_mask``, or a ``[b, s]`` mask packed with the plan); ``given`` alone for a
    dense model; None when neither.  The one place a router mask is made.

    >>> import torch
    >>> from packfwd.layout import plan_thd
    >>> pads = plan_thd(torch.tensor([[1, 1, 1]]).bool(), seq_align=4).padding_mask
    >>> router_padding(torch.nn.Linear(2, 2), pads), router_padding(torch.nn.Linear(2, 2), pads, torch.ones(1, 4) > 0)
    (None, tensor([[True, True, True, True]]))
    """
    pads = pads() if is_moe(model) else None
    if given is None:
        return pads
    if pads is not None and tuple(given.shape) != tuple(pads.shape):
        raise ValueError(f"the router mask (padding_mask / router_padding_mask) has shape {tuple(given.shape)} but this "
                         f"rank's packed batch has {tuple(pads.shape)} slots; pass a bool mask of the packed tokens, "
                         "True at the slots to keep from the routers")
    given = given.to(torch.bool)
    return given if pads is None else given | pads


def seq_major(x: Tensor, b: int, *, inverse: bool = False) -> Tensor:
    """A per-token ``[t, ...]`` tensor from the layout's token order (``[b, s]``, row after row) to the model's
    hidden-state order (``[s, b]``: what Megatron-Core's layers, routers and output layer see, and what sequence
    parallelism splits), or back with ``inverse``.  THD has ``b = 1``: nothing moves.

    >>> seq_major(torch.arange(6), 2).tolist(), seq_major(seq_major(torch.arange(6), 2), 2, inverse=True).tolist()
    ([0, 3, 1, 4, 2, 5], [0, 1, 2, 3, 4, 5])
    """
    if b == 1:
        return x
    t, rest = x.shape[0], x.shape[1:]
    shape = (t // b, b) if inverse else (b, t // b)
    return x.reshape(*shape, *rest).transpose(0, 1).reshape(t, *rest)
