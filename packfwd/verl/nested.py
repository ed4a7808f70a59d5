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
Differences from verl: the README's "Coming from verl".

The layouts are ``make_forward``'s adapters in verl's flavour (:mod:`packfwd.verl.layouts`): ``VerlThd``,
``VerlBshd``.
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch
from torch import Tensor

from packfwd.layout.rules import round_up, verl_alignment

from ._common import Parallel, fp8_padding, model_facts, multimodal_kwargs, packers, read_parallel, run_and_unpack
from .layouts import VerlBshd, VerlThd, router_padding, widen
from .mtp import check_mtp_model, engine_loss_mask, mtp_call, mtp_targets

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
    sequence, hung on the backward as verl's model does (``packfwd.verl.mtp``).

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
    facts = model_facts(model, par)
    mtp = bool(mtp_enable_train) and facts.post_process
    targets = _mtp_targets(model, input_ids, logits_processor_args or {}) if mtp else None
    extra = multimodal_kwargs(model, multi_modal_inputs, input_ids.device)
    if data_format == "thd":
        layout = VerlThd(par.tp, par.cp, par.cp_rank, par.cp_group, fp8_padding=fp8_padding(facts),
                         length_bucket=pad_to_length_bucket, local_cp_size=local_cp_size)
        info, call = _thd(layout, input_ids, par, facts, vision_model, pad_token_id, mtp_loss_normalization_factor,
                          mtp)
        if vision_model:  # verl's vision input: the model packs after embedding; verl's mask as verl passes it
            extra.update({} if router_padding_mask is None else {"padding_mask": router_padding_mask})
        else:  # the plan's layout pads (an MoE model) OR verl's mask: no pad reaches a router
            extra.update(router_padding(model, info, router_padding_mask))
    else:
        layout = VerlBshd(par.tp, par.cp, par.cp_rank, par.cp_group, fp8_padding=fp8_padding(facts),
                          forced_width=forced_max_seqlen)
        info, call = _bshd(layout, input_ids, facts, vision_model, pad_token_id, mtp)
    pack, unpack = packers(layout, info, input_ids)
    finish = None
    if mtp:  # verl reads the normalization factor from the THD PackedSeqParams only
        factor = mtp_loss_normalization_factor if data_format == "thd" else None
        mtp_kwargs, finish = mtp_call(model, targets, pack, factor)
        call.update(mtp_kwargs)
    result = run_and_unpack(model, {**call, **extra}, facts, unpack, logits_processor, lambda: {
        k: _pack_arg(k, v, pack) for k, v in (logits_processor_args or {}).items() if k not in _NOT_PASSED}, finish)
    if not facts.post_process:
        return result  # a middle pipeline stage: hidden states for the next one
    if value_model and isinstance(result, Tensor):
        result = result.squeeze(-1)
    return result


def _pack_arg(name: str, value, pack):
    if not isinstance(value, Tensor) or value.dim() == 0:
        return value
    if not value.is_nested:
        raise ValueError(f"logits_processor_args[{name!r}] has shape {tuple(value.shape)}; give per-token values as a "
                         "jagged nested tensor like input_ids")
    return pack(next_in_sequence(value) if name == "label" else value)


def next_in_sequence(label: Tensor) -> Tensor:
    """``[b, j]`` jagged: each token's next token in its own sequence, 0 at each sequence's last token.

    >>> import torch
    >>> ids = torch.nested.nested_tensor([torch.tensor([1, 2, 3]), torch.tensor([4, 5])], layout=torch.jagged)
    >>> next_in_sequence(ids).values().tolist()
    [2, 3, 0, 5, 0]
    """
    values, offsets = label.values(), label.offsets()
    token = torch.arange(1, values.shape[0] + 1, device=values.device)
    is_last = torch.isin(token, offsets[1:].to(values.device))
    shifted = torch.roll(values, -1, 0)
    nxt = torch.where(is_last.view(-1, *[1] * (values.dim() - 1)), torch.zeros_like(shifted), shifted)
    return torch.nested.nested_tensor_from_jagged(nxt, offsets)


def _mtp_targets(model, input_ids, args):
    """verl's engine MTP inputs: ``label`` (the tokens themselves, jagged or padded ``[b, s]`` cut to each
    length) and the loss mask built from ``loss_mask``/``response_attention_mask``; each depth's read within its
    own sequence (``packfwd.verl.mtp``)."""
    depth = check_mtp_model(model)
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
    return mtp_targets(input_ids, None, label, mask, depth, offset=1)


def _thd(layout: VerlThd, input_ids, par: Parallel, facts, vision, pad_token_id, mtp_norm, mtp=False):
    """The plan and the model's arguments of one THD forward (verl's engine layout; positions: None, as verl's)."""
    info, ids = layout.pack(input_ids, None)
    params = layout.model_kwargs(info)["packed_seq_params"]
    if mtp_norm is not None:
        params._verl_mtp_loss_normalization_factor = mtp_norm  # where verl puts it (read by its MTP patches)
    call = dict(input_ids=ids if facts.pre_process or mtp else input_ids, attention_mask=None, position_ids=None,
                packed_seq_params=params)
    if vision:  # verl's vision input: the ids padded to the longest sequence rounded up to align, and the mask
        width = round_up(info.seq_len, verl_alignment(par.tp, par.cp).seq_align)
        mask = torch.arange(width, device=input_ids.device) < input_ids.offsets().diff()[:, None]
        ids = input_ids.to_padded_tensor(0, output_size=(input_ids.shape[0], width))
        call["input_ids"], call["attention_mask"] = _pad_with(ids, mask, pad_token_id), mask
    return info, call


def _bshd(layout: VerlBshd, input_ids, facts, vision, pad_token_id, mtp=False):
    """The plan and the model's arguments of one BSHD forward (verl's engine layout: this CP rank's zigzag pair of
    every row, the padding mask and positions split the same way)."""
    info, ids = layout.pack(input_ids, None)
    mask = layout.attention_mask(info)  # [b, w_local] bool
    call = dict(input_ids=ids if facts.pre_process or mtp else input_ids, attention_mask=mask,
                position_ids=layout.positions(info, ids, None, input_ids))
    if vision:  # verl's vision input: the whole rows, padded to the forced or longest length rounded up to align
        width = layout.row_width(info, fp8_padding=False)
        vision_mask = widen(info.attention_mask, width)
        padded = widen(input_ids.to_padded_tensor(0, output_size=(input_ids.shape[0], info.width)), width)
        call.update(input_ids=_pad_with(padded, vision_mask, pad_token_id), attention_mask=vision_mask,
                    position_ids=None)
    return info, call


def _pad_with(ids: Tensor, mask: Tensor, pad_token_id: int | None) -> Tensor:
    return ids if pad_token_id is None else ids.masked_fill(~mask, pad_token_id)
