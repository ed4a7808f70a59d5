"""``gptmodel_forward_model_engine``: verl's forward for jagged nested batches, with packfwd's transforms inside.

Signature and results of verl 0.9.1's ``verl.models.mcore.model_forward.gptmodel_forward_model_engine`` (named
``gptmodel_forward_no_padding`` in earlier verl).  ``input_ids`` is a jagged nested tensor ``[b, j]``
(``torch.nested``, ``layout=torch.jagged``); outputs are jagged like it.

* ``data_format="thd"``: packed into ``[1, t]`` in verl's layout (each sequence padded to ``2*tp*cp``, or ``tp``
  without CP; the last one further to ``pad_to_length_bucket``; the CP zigzag split), with verl's
  ``PackedSeqParams``; the model computes positions itself (``position_ids=None``, as in verl).
* ``data_format="bshd"``: padded into ``[b, w]`` (``w``: ``forced_max_seqlen`` or the longest sequence, rounded
  up to ``2*tp*cp``, or ``tp``); under CP each row is cut into ``2*cp`` chunks and this rank keeps chunks ``r`` and
  ``2*cp-1-r``.  The model gets the ids, the padding mask ``[b, w/cp]`` (True at real tokens) and positions.

Processor arguments are jagged like ``input_ids`` and packed the same way; ``"label"`` is first replaced by each
token's next token *in its own sequence* (0 at each sequence's last token), ``"loss_mask"`` and
``"response_attention_mask"`` are not passed on (verl pops them; packfwd leaves the caller's dict alone).
Differences from verl: docs/verl.md.

The forward is packfwd's engine (:class:`packfwd.engine.Engine`) with verl's layouts (:mod:`packfwd.verl.layouts`:
``VerlThd``, ``VerlBshd``), verl's calling conventions (:func:`_thd_call`, :func:`_bshd_call`; the processor called in
the model's output layout) and, for MTP training, :class:`packfwd.verl.mtp.VerlMtp`.
"""

from __future__ import annotations

import functools
from typing import Callable, Mapping

import torch
from torch import Tensor

from packfwd.engine import Batch, Engine, model_facts
from packfwd.forward.moe import RoutingReplay
from packfwd.forward.scored import Scoring
from packfwd.layout import shift_in_sequence
from packfwd.layout.rules import round_up, verl_alignment

from ._common import PARALLEL_FIX, check_value_width, fp8_padding, multimodal_kwargs, read_parallel
from .layouts import VerlBshd, VerlThd, widen
from .mtp import VerlMtp, check_mtp_model, engine_loss_mask

__all__ = ["gptmodel_forward_model_engine"]

_FORMATS = ("thd", "bshd")
_NOT_PASSED = ("loss_mask", "response_attention_mask")  # read by verl's MTP only


def gptmodel_forward_model_engine(
    model: torch.nn.Module,
    input_ids: Tensor,
    multi_modal_inputs: Mapping[str, Tensor] | None,
    logits_processor: Callable | None = None,
    logits_processor_args: Mapping | None = None,
    value_model: bool = False,
    vision_model: bool = False,
    pad_token_id: int | None = None,
    data_format: str = "thd",
    mtp_enable_train: bool = False,
    local_cp_size: int | None = None,
    forced_max_seqlen: int | None = None,
    pad_to_length_bucket: int | None = None,
    cp_layout: str = "zigzag",
    router_padding_mask: Tensor | None = None,
    mtp_loss_normalization_factor: float | None = None,
    *,
    scored_only: bool = True,
    routed_experts: Tensor | None = None,
    replay_mask: Tensor | None = None,
):
    """verl's nested-tensor forward (see the module docstring).

    ``pad_to_length_bucket`` (THD): the padded token total becomes a multiple of it.  ``forced_max_seqlen``
    (BSHD): the width before alignment, at least the longest sequence.  ``local_cp_size``: dynamic CP (needs a
    Megatron-Core that has it).  ``cp_layout``: ``"zigzag"`` (``"contiguous"`` only without CP).
    ``vision_model``: the model gets the ids padded with ``pad_token_id`` and their mask.  ``router_padding_mask``
    (``[1, t]`` bool, True at slots to keep from the routers) is passed to the model as ``padding_mask`` (THD),
    OR-ed for an MoE model with the plan's layout pads (alignment, FP8, ``pad_to_length_bucket``), which an MoE
    model always gets, so no pad is routed (verl passes only its own mask).  ``mtp_enable_train=True`` (a packfwd
    model with MTP layers): the MTP loss of ``label`` and ``loss_mask`` (verl's), each depth read within its own
    sequence, hung on the backward as verl's model does (``packfwd.verl.mtp``).  ``scored_only=True``
    (packfwd's; verl passes nothing): with a processor and ``logits_processor_args``' ``loss_mask``, only the tokens
    whose next token is inside it (the mask verl's losses roll onto the log-probs) go through the output layer and
    the processor, and every output is 0 at the others (:mod:`packfwd.forward.scored`); ``False``: every token.
    ``routed_experts`` (packfwd's; verl's engine hands its ``model_inputs["routed_experts"]`` to its patched
    routers instead): router replay, the routes verl records (R2) or takes from the rollout (R3, aligned to the
    ids), jagged like ``input_ids`` ``[b, j, L, k]`` in any integer dtype: each token of MoE layer ``l`` goes to
    those experts (``make_forward``'s ``routed_experts=``, :class:`packfwd.forward.moe.RoutingReplay`).
    ``replay_mask`` (verl's name for what its R3 mode hands its routers; jagged ``[b, j]`` bool like
    ``input_ids``): replay only where True, the other tokens routed natively by the current router, their rows of
    ``routed_experts`` ignored (verl's zero placeholder row is fine).  verl's R3 inputs, its routes aligned and its
    mask: :func:`packfwd.verl.r3_replay_inputs`; R2 passes no mask (every token replayed).

    >>> import torch
    >>> from packfwd.models.runtime import ensure_model_parallel
    >>> from packfwd.testing import OneHotModel as Toy   # one-hot "logits" of the ids, under any packing
    >>> ensure_model_parallel()               # verl's workers initialise Megatron's parallel state
    >>> ids = torch.nested.nested_tensor([torch.tensor([3, 4]), torch.tensor([2, 1, 4])], layout=torch.jagged)
    >>> gptmodel_forward_model_engine(Toy(), ids, {}).argmax(-1).values().tolist()
    [3, 4, 2, 1, 4]
    >>> def processor(logits, label):         # verl's shapes: [1, t, v], [1, t]
    ...     return {"label": label, "logit": logits.gather(-1, label[..., None])[..., 0]}
    >>> out = gptmodel_forward_model_engine(Toy(), ids, {}, logits_processor=processor,
    ...                                     logits_processor_args={"label": ids})
    >>> out["label"].values().tolist()        # the next token of the same sequence, 0 at each last token
    [4, 0, 1, 4, 0]
    """
    if data_format not in _FORMATS:
        raise ValueError(f"data_format={data_format!r}; pass one of {_FORMATS}")
    if cp_layout not in ("zigzag", "contiguous"):
        raise ValueError(f"Unsupported context parallel layout cp_layout={cp_layout!r}; pass 'zigzag' or 'contiguous'")
    if not (isinstance(input_ids, Tensor) and input_ids.is_nested):
        raise TypeError("input_ids must be a jagged nested tensor [b, j] (torch.nested.nested_tensor(..., "
                        "layout=torch.jagged)); for padded [b, s] batches use packfwd.verl.model_forward_gen")
    if data_format == "bshd" and local_cp_size is not None:
        raise ValueError("local_cp_size (dynamic CP) needs data_format='thd' (as in verl)")
    par = read_parallel(local_cp_size)
    if data_format == "thd" and cp_layout == "contiguous" and par.cp > 1:
        raise NotImplementedError("cp_layout='contiguous' with context parallelism is not built in packfwd; "
                                  "use cp_layout='zigzag'")
    facts = model_facts(model, par.tp, par.model_cp, PARALLEL_FIX)
    mtp = bool(mtp_enable_train) and facts.post_process
    args = logits_processor_args or {}
    options = _mtp_options(model, input_ids, args) if mtp else {}
    extra = multimodal_kwargs(model, multi_modal_inputs, input_ids.device)
    if router_padding_mask is not None and data_format == "thd":
        extra["padding_mask"] = router_padding_mask  # OR-ed with the layout's pads for an MoE model (the engine)
    packed_ids = facts.pre_process or mtp
    if data_format == "thd":
        layout = VerlThd(par.tp, par.cp, par.cp_rank, par.cp_group, fp8_padding=fp8_padding(facts),
                         length_bucket=pad_to_length_bucket, local_cp_size=local_cp_size)
        call = functools.partial(_thd_call, par=par, vision=vision_model, pad_token_id=pad_token_id,
                                 mtp_norm=mtp_loss_normalization_factor, packed_ids=packed_ids)
    else:
        layout = VerlBshd(par.tp, par.cp, par.cp_rank, par.cp_group, fp8_padding=fp8_padding(facts),
                          forced_width=forced_max_seqlen)
        call = functools.partial(_bshd_call, vision=vision_model, pad_token_id=pad_token_id, packed_ids=packed_ids)
    # verl reads the MTP normalization factor from the THD PackedSeqParams only
    factor = mtp_loss_normalization_factor if data_format == "thd" else None
    if scored_only and logits_processor is not None and args.get("loss_mask") is not None:
        scored = engine_loss_mask(input_ids, args["loss_mask"], args.get("response_attention_mask"))
        options = {**options, "loss_mask": shift_in_sequence(scored, None, 1, 0)}  # verl rolls it onto the log-probs
    if routed_experts is not None and not (isinstance(routed_experts, Tensor) and routed_experts.is_nested):
        raise TypeError("routed_experts must be jagged like input_ids ([b, j, L, k], torch.nested with "
                            "layout=torch.jagged), as verl records them")
    replaying = routed_experts is not None or replay_mask is not None  # RoutingReplay checks them together
    if replaying:
        options = {**options, "routed_experts": routed_experts, "replay_mask": replay_mask}
    replay = (RoutingReplay(False),) if replaying else ()
    engine = Engine(layout, processor=logits_processor, extensions=replay + (VerlMtp(factor),) * mtp, rows=True,
                    call=call,
                    tp_size=par.tp, cp_size=par.model_cp, cp_rank=par.cp_rank, cp_group=par.cp_group,
                    check_cp=False, bind_tp=False, facts_fix=PARALLEL_FIX,
                    scoring=Scoring(labels="label", masks=(), hidden=not mtp) if scored_only else None)
    inputs = {k: _processor_arg(k, v) for k, v in args.items() if k not in _NOT_PASSED} if logits_processor else {}
    result = engine(model, Batch(input_ids, inputs=inputs, model_inputs=extra, options=options))
    if result.outputs is None:
        return result.hand_on  # a middle pipeline stage: hidden states for the next one
    if logits_processor is not None:
        return result.outputs
    logits = result.outputs["logits"]
    if value_model and not facts.value_model:
        check_value_width(logits, result.empty)
        return logits.squeeze(-1)
    return logits


def _processor_arg(name: str, value):
    """A processor argument in the caller's layout for the engine to pack: jagged like the ids; ``"label"`` becomes
    each token's next token in its own sequence (0 at each sequence's last token)."""
    if not isinstance(value, Tensor) or value.dim() == 0:
        return value
    if not value.is_nested:
        raise ValueError(f"logits_processor_args[{name!r}] has shape {tuple(value.shape)}; give per-token values as a "
                         "jagged nested tensor like input_ids")
    return shift_in_sequence(value, None, 1, 0) if name == "label" else value


def _mtp_options(model, input_ids, args) -> dict:
    """verl's engine MTP inputs as the main head's labels and mask (:class:`packfwd.verl.mtp.VerlMtp`): ``label``
    (the tokens themselves, jagged or padded ``[b, s]`` cut to each length) and the loss mask built from
    ``loss_mask``/``response_attention_mask``, each read one token later in its own sequence."""
    check_mtp_model(model)
    if "label" not in args or "loss_mask" not in args:
        raise ValueError("MTP training (mtp_enable_train) reads logits_processor_args['label'] and ['loss_mask'], "
                         "as verl does; pass both")
    label = args["label"]
    if not label.is_nested:
        lengths = input_ids.offsets().diff()
        if label.shape[1] < int(lengths.max()):
            raise ValueError(f"label has {label.shape[1]} columns but a sequence has {int(lengths.max())} tokens; "
                             "pass the labels jagged like input_ids or padded to the longest sequence")
        keep = torch.arange(label.shape[1], device=label.device) < lengths.to(label.device)[:, None]
        label = torch.nested.nested_tensor_from_jagged(label[keep], input_ids.offsets())
    mask = engine_loss_mask(input_ids, args["loss_mask"], args.get("response_attention_mask"))
    return {"mtp_labels": shift_in_sequence(label, None, 1, -100),
            "mtp_loss_mask": shift_in_sequence(mask, None, 1, 0)}  # mtp_targets reads it as bool


def _thd_call(step, *, par, vision, pad_token_id, mtp_norm, packed_ids) -> dict:
    """The model's arguments of one THD forward (verl's engine layout; positions: None, as verl's)."""
    input_ids, plan = step.batch.input_ids, step.plan
    params = step.layout.model_kwargs(plan)["packed_seq_params"]
    if mtp_norm is not None:
        params._verl_mtp_loss_normalization_factor = mtp_norm  # where verl puts it (read by its MTP patches)
    call = dict(input_ids=step.ids if packed_ids else input_ids, attention_mask=None, position_ids=None,
                packed_seq_params=params)
    if vision:  # verl's vision input: the ids padded to the longest sequence rounded up to align, and the mask
        width = round_up(plan.seq_len, verl_alignment(par.tp, par.cp).seq_align)
        mask = torch.arange(width, device=input_ids.device) < input_ids.offsets().diff()[:, None]
        ids = input_ids.to_padded_tensor(0, output_size=(input_ids.shape[0], width))
        call["input_ids"], call["attention_mask"] = _pad_with(ids, mask, pad_token_id), mask
    return call


def _bshd_call(step, *, vision, pad_token_id, packed_ids) -> dict:
    """The model's arguments of one BSHD forward (verl's engine layout: this CP rank's zigzag pair of every row,
    the positions split the same way).  Without CP the rows' pads sit after every real token, so causal
    attention needs no mask and a stage before the last hands on ``[w, b, h]`` as verl's does; under CP the
    model gets the rank's padding mask ``[b, w/cp]`` (True at real tokens), as verl's."""
    input_ids, layout, plan, ids = step.batch.input_ids, step.layout, step.plan, step.ids
    mask = layout.attention_mask(plan) if layout.cp > 1 else None
    call = dict(input_ids=ids if packed_ids else input_ids, attention_mask=mask,
                position_ids=layout.positions(plan, ids, None, input_ids))
    if vision:  # verl's vision input: the whole rows, padded to the forced or longest length rounded up to align
        width = layout.row_width(plan, fp8_padding=False)
        vision_mask = widen(plan.attention_mask, width)
        padded = widen(input_ids.to_padded_tensor(0, output_size=(input_ids.shape[0], plan.width)), width)
        call.update(input_ids=_pad_with(padded, vision_mask, pad_token_id), attention_mask=vision_mask,
                    position_ids=None)
    return call


def _pad_with(ids: Tensor, mask: Tensor, pad_token_id: int | None) -> Tensor:
    return ids if pad_token_id is None else ids.masked_fill(~mask, pad_token_id)
