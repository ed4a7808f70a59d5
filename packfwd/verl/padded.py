"""``model_forward_gen``: verl's forward for padded ``[b, s]`` batches, with packfwd's transforms inside.

The returned ``model_forward`` has the signature and results of verl 0.9.1's
(``verl.models.mcore.model_forward.model_forward_gen``):

* ``data_format="thd"``: the batch is packed into one row ``[1, t]`` in exactly verl's layout (each sequence
  padded to ``2*tp*cp``, or ``tp`` without CP; the CP zigzag split), the model gets verl's ``PackedSeqParams``
  (an MoE model also the plan's layout pads as ``padding_mask``, so its routers skip them; verl passes none),
  and every output comes back as ``[b, s, ...]`` with zeros at padding (CP ranks' outputs all-gathered first);
* ``data_format="bshd"``: each row's real tokens moved left into ``[b, w]`` (``w`` the longest row, rounded up
  to ``tp`` under sequence parallelism), the model gets that batch and the compacted positions, causal over each
  row (the pads sit after every real token: no mask needed; an MoE model's routers get them as ``padding_mask``);
  a stage before the last hands on ``[w, b, h]``, as verl's does.

With ``logits_processor``, it is called as verl calls it: ``logits_processor(output [1, t, v] (THD) or
[b, w, v] (BSHD), **args)`` where each tensor of ``logits_processor_args`` (``[b, s, ...]``) is packed the same
way; each tensor of the dict it returns is unpacked to ``[b, s, ...]``.  A pipeline stage without the output layer
(``post_process`` False) returns the model's output as is.  Differences from verl: docs/verl.md.

The forward is packfwd's engine (:class:`packfwd.engine.Engine`) with verl's layouts (:mod:`packfwd.verl.layouts`:
THD ``VerlThd``, BSHD the engine's own ``Bshd``), verl's calling conventions (:func:`_verl_call`; the processor
called in the model's output layout) and, for MTP training, :class:`packfwd.verl.mtp.VerlMtp`.
"""

from __future__ import annotations

import functools
from typing import Callable, Mapping

import torch
from torch import Tensor

from packfwd.engine import Batch, Bshd, Engine, model_facts
from packfwd.forward.scored import Scoring
from packfwd.forward.vision import takes_packing, vision_kwargs

from ._common import PARALLEL_FIX, check_value_width, fp8_padding, multimodal_kwargs, read_parallel
from .layouts import VerlThd
from .mtp import VerlMtp, check_mtp_model

__all__ = ["model_forward_gen"]

_FORMATS = ("thd", "bshd")


def model_forward_gen(vision_model: bool = False, *, scored_only: bool = True) -> Callable:
    """verl's ``model_forward_gen``: returns ``model_forward(model, input_ids, attention_mask, position_ids,
    multi_modal_inputs, logits_processor=None, logits_processor_args=None, value_model=False, data_format="thd",
    mtp_config=None)`` (see the module docstring).

    ``input_ids``, ``attention_mask`` (bool or 0/1), ``position_ids``: ``[b, s]``.  Parallel sizes, ranks and
    groups come from ``megatron.core.parallel_state``; sequence parallelism and FP8 from the model's config.
    ``vision_model=True``: the model gets the padded ids and mask with ``PackedSeqParams`` (THD) and packs after
    embedding the images itself, as verl's vision models do.  A model that declares packfwd's ``packing`` hook
    (``packfwd.vision.VisionLanguageModel``; :mod:`packfwd.forward.vision`) gets the call
    ``make_forward(vision=True)`` makes, with verl's plan: the hook, and the caller's ``position_ids`` (``[3, b,
    s]`` or ``[b, s]``; None: the model computes them); any other model gets verl's call (no positions: it computes
    them).  ``second_per_grid_ts`` goes to a model that takes it, and raises for one that does not (verl drops it).
    ``mtp_config`` with ``enable_train`` set (a packfwd model with MTP layers): the MTP loss of
    ``logits_processor_args``' ``label``/``label_mask``, each depth's labels shifted within its own sequence, hung
    on the backward as verl's model does (``packfwd.verl.mtp``), in THD and BSHD.
    ``scored_only=True`` (packfwd's; verl passes nothing): with a processor and ``logits_processor_args``'
    ``label_mask``, only the tokens inside it go through the output layer and the processor, and every output is
    0 at the others (verl's actor reads the response's tokens, all inside it; :mod:`packfwd.forward.scored`);
    ``False``: every token, as verl computes them.

    >>> import torch
    >>> from packfwd.models.runtime import ensure_model_parallel
    >>> from packfwd.testing import OneHotModel as Toy   # one-hot "logits" of the ids, under any packing
    >>> ensure_model_parallel()               # verl's workers initialise Megatron's parallel state
    >>> ids = torch.tensor([[0, 3, 4], [2, 1, 0]]); mask = ids != 0
    >>> model_forward_gen()(Toy(), ids, mask, None, {}).argmax(-1).tolist()
    [[0, 3, 4], [2, 1, 0]]
    """

    def model_forward(
        model: torch.nn.Module,
        input_ids: Tensor,
        attention_mask: Tensor,
        position_ids: Tensor | None,
        multi_modal_inputs: Mapping[str, Tensor] | None,
        logits_processor: Callable | None = None,
        logits_processor_args: Mapping | None = None,
        value_model: bool = False,
        data_format: str = "thd",
        mtp_config=None,
    ):
        if data_format not in _FORMATS:
            raise ValueError(f"data_format={data_format!r}; pass one of {_FORMATS}")
        par = read_parallel()
        facts = model_facts(model, par.tp, par.model_cp, PARALLEL_FIX)
        mtp = bool(mtp_config is not None and getattr(mtp_config, "enable_train", False)) and facts.post_process
        args = dict(logits_processor_args or {})
        options = {}
        if mtp:
            check_mtp_model(model, mtp_config)
            if "label" not in args or "label_mask" not in args:
                raise ValueError("MTP training (mtp_config.enable_train) reads logits_processor_args['label'] and "
                                 "['label_mask'] ([b, s], the next token and its mask), as verl does; pass both")
            options = {"mtp_labels": args["label"], "mtp_loss_mask": args["label_mask"]}
        if data_format == "thd":
            layout = VerlThd(par.tp, par.cp, par.cp_rank, par.cp_group, fp8_padding=fp8_padding(facts))
        else:
            if par.cp > 1:
                raise ValueError("data_format='bshd' has no context parallelism (neither has verl's); use "
                                 "data_format='thd'")
            if facts.fp8 is not None:
                raise ValueError("data_format='bshd' does not support fp8 (neither does verl's); use data_format='thd'")
            layout = Bshd(par.tp if facts.sequence_parallel else 1)
        if scored_only and logits_processor is not None and args.get("label_mask") is not None:
            options = {**options, "loss_mask": args["label_mask"]}  # verl's: True where the label is scored
        engine = Engine(layout, processor=logits_processor, extensions=(VerlMtp(),) * mtp, rows=True,
                        call=functools.partial(_verl_call, thd=data_format == "thd", vision=vision_model,
                                               packed_ids=facts.pre_process or mtp),
                        tp_size=par.tp, cp_size=par.model_cp, cp_rank=par.cp_rank, cp_group=par.cp_group,
                        check_cp=False, bind_tp=False, facts_fix=PARALLEL_FIX,
                        scoring=Scoring(labels="label", masks=(), hidden=not mtp) if scored_only else None)
        extra = multimodal_kwargs(model, multi_modal_inputs, input_ids.device)
        batch = Batch(input_ids, attention_mask, position_ids, inputs=args if logits_processor else {},
                      model_inputs=extra, options=options)
        result = engine(model, batch)
        if result.outputs is None:
            return result.hand_on  # a middle pipeline stage: hidden states for the next one
        if logits_processor is not None:
            return result.outputs
        logits = result.outputs["logits"]
        if value_model and not facts.value_model:
            check_value_width(logits, result.empty)
            return logits[..., 0]
        return logits

    return model_forward


def _verl_call(step, *, thd: bool, vision: bool, packed_ids: bool) -> dict:
    """The model's arguments (multimodal inputs aside).  Text: the packed ids (the padded ones on a pipeline stage
    without the embedding, unless MTP needs them) and the caller's positions packed like them, or None.  A vision
    model with packfwd's hook: ``make_forward(vision=True)``'s call (:func:`packfwd.forward.vision.vision_kwargs`);
    any other vision model: verl's (THD: the padded ids and mask; BSHD: the compacted ones; no positions)."""
    batch, layout, plan, ids = step.batch, step.layout, step.plan, step.ids
    if vision and takes_packing(step.model):
        return vision_kwargs(step.model, layout, plan, ids, batch.input_ids, batch.attention_mask, batch.position_ids,
                             step.facts.rope_coords)
    if vision:
        if thd:
            return dict(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=None,
                        **layout.model_kwargs(plan))
        return dict(input_ids=ids, position_ids=None, attention_mask=plan.attention_mask.to(batch.attention_mask.dtype))
    positions = None
    if batch.position_ids is not None:
        positions = layout.positions(plan, ids, batch.position_ids, batch.input_ids, step.facts.rope_coords)
    return dict(input_ids=ids if packed_ids else batch.input_ids, position_ids=positions, attention_mask=None,
                **layout.model_kwargs(plan))
