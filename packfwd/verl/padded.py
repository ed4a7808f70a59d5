"""``model_forward_gen``: verl's forward for padded ``[b, s]`` batches, with packfwd's transforms inside.

The returned ``model_forward`` has the signature and results of verl 0.9.1's
(``verl.models.mcore.model_forward.model_forward_gen``):

* ``data_format="thd"``: the batch is packed into one row ``[1, t]`` in exactly verl's layout (each sequence
  padded to ``2*tp*cp``, or ``tp`` without CP; the CP zigzag split), the model gets verl's ``PackedSeqParams``,
  and every output comes back as ``[b, s, ...]`` with zeros at padding (CP ranks' outputs all-gathered first);
* ``data_format="bshd"``: each row's real tokens moved left into ``[b, w]`` (``w`` the longest row, rounded up
  to ``tp`` under sequence parallelism), the model gets that batch, the compacted mask and positions.

With ``logits_processor``, it is called as verl calls it: ``logits_processor(output [1, t, v] (THD) or
[b, w, v] (BSHD), **args)`` where each tensor of ``logits_processor_args`` (``[b, s, ...]``) is packed the same
way; each tensor of the dict it returns is unpacked to ``[b, s, ...]``.  A pipeline stage without the output layer
(``post_process`` False) returns the model's output as is.  Differences from verl: ``docs/VERL.md``.
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch
from torch import Tensor

from packfwd import from_bshd, from_thd, plan_bshd, to_bshd, to_thd
from packfwd.forward.vision import VisionPacking

from ._common import (Parallel, gather_cp, model_facts, multimodal_kwargs, plan_verl_thd, read_parallel,
                      run_and_unpack, verl_packed_seq_params)
from .mtp import check_mtp_model, mtp_call, mtp_targets

__all__ = ["model_forward_gen"]

_FORMATS = ("thd", "bshd")


def model_forward_gen(vision_model: bool = False) -> Callable:
    """verl's ``model_forward_gen``: returns ``model_forward(model, input_ids, attention_mask, position_ids,
    multi_modal_inputs, logits_processor=None, logits_processor_args=None, value_model=False, data_format="thd",
    mtp_config=None)`` (see the module docstring).

    ``input_ids``, ``attention_mask`` (bool or 0/1), ``position_ids``: ``[b, s]``.  Parallel sizes, ranks and
    groups come from ``megatron.core.parallel_state``; sequence parallelism and FP8 from the model's config.
    ``vision_model=True``: the model gets the padded ids and mask with ``PackedSeqParams`` (THD) and packs after
    embedding the images itself, as verl's vision models do; a model that declares packfwd's ``packing`` hook
    (``packfwd.vision.VisionLanguageModel``; :mod:`packfwd.forward.vision`) also gets it, with verl's plan.
    ``mtp_config`` with ``enable_train`` set (a packfwd model with MTP layers): the MTP loss of
    ``logits_processor_args``' ``label``/``label_mask``, each depth's labels shifted within its own sequence, hung
    on the backward as verl's model does (``packfwd.verl.mtp``), in THD and BSHD (verl's BSHD forward passes no
    labels, so trains no MTP).

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
        facts = model_facts(model)
        mtp = bool(mtp_config is not None and getattr(mtp_config, "enable_train", False)) and facts.post_process
        if mtp:
            depth = check_mtp_model(model, mtp_config)
            args = logits_processor_args or {}
            if "label" not in args or "label_mask" not in args:
                raise ValueError("MTP training (mtp_config.enable_train) reads logits_processor_args['label'] and "
                                 "['label_mask'] ([b, s], the next token and its mask), as verl does; pass both")
            targets = mtp_targets(input_ids, attention_mask, args["label"], args["label_mask"], depth)
        par = read_parallel()
        extra = multimodal_kwargs(multi_modal_inputs, input_ids.device)
        if data_format == "thd":
            call, pack, unpack = _thd(input_ids, attention_mask, position_ids, par, facts, vision_model, mtp)
        else:
            call, pack, unpack = _bshd(input_ids, attention_mask, position_ids, par, facts, vision_model, mtp)
        finish = None
        if mtp:
            mtp_kwargs, finish = mtp_call(model, targets, pack)
            call.update(mtp_kwargs)
        result = run_and_unpack(model, {**call, **extra}, facts, unpack, logits_processor, lambda: {
            k: pack(v) if isinstance(v, Tensor) and v.dim() else v for k, v in (logits_processor_args or {}).items()},
            finish)
        if not facts.post_process:
            return result  # a middle pipeline stage: hidden states for the next one
        if value_model and isinstance(result, Tensor):
            result = result[..., 0]
        return result

    return model_forward


def _thd(input_ids, attention_mask, position_ids, par: Parallel, facts, vision: bool, mtp: bool = False):
    """The model's arguments and the pack/unpack of one THD forward (verl's layout).  With MTP the last stage
    gets the packed ids too (as in verl)."""
    info = plan_verl_thd(attention_mask, par, fp8_padding=facts.fp8_padding)
    call = dict(
        input_ids=to_thd(input_ids, info)[0][None] if (facts.pre_process or mtp) and not vision else input_ids,
        attention_mask=attention_mask if vision else None,
        # packed like the ids (verl passes the padded [b, s] positions, which Megatron's RoPE never reads)
        position_ids=None if vision else _packed_positions(position_ids, info),
        packed_seq_params=verl_packed_seq_params(info, par),
    )
    if vision and facts.takes_packing:  # packfwd's vision models pack their embeddings with verl's plan
        call["packing"] = VisionPacking(info)

    def pack(v: Tensor) -> Tensor:  # [b, s, *] -> [1, t_local, *]
        return to_thd(v, info)[0][None]

    def unpack(y: Tensor) -> Tensor:  # [1, t_local, *] -> [b, s, *]
        return from_thd(gather_cp(y[0], par), info)

    return call, pack, unpack


def _packed_positions(position_ids, info):
    if position_ids is None or position_ids.dim() != 2:
        return position_ids  # none, or a multimodal layout: passed on as verl does
    return to_thd(position_ids, info)[0][None]


def _bshd(input_ids, attention_mask, position_ids, par: Parallel, facts, vision: bool, mtp: bool = False):
    """The model's arguments and the pack/unpack of one BSHD forward (verl's compacted layout)."""
    if par.cp > 1:
        raise ValueError("data_format='bshd' has no context parallelism (neither has verl's); use data_format='thd'")
    if facts.fp8 is not None:
        raise ValueError("data_format='bshd' does not support fp8 (neither does verl's); use data_format='thd'")
    info = plan_bshd(attention_mask, tp_size=par.tp if facts.sequence_parallel else 1)
    positions = None if vision or position_ids is None else to_bshd(position_ids, info)[0]
    call = dict(
        input_ids=to_bshd(input_ids, info)[0] if facts.pre_process or vision or mtp else input_ids,
        position_ids=positions,
        attention_mask=info.attention_mask.to(attention_mask.dtype),  # [b, w], real tokens first
    )
    if vision and facts.takes_packing:  # packfwd's vision models: the hook of the compacted layout
        call["packing"] = VisionPacking(info)

    def pack(v: Tensor) -> Tensor:  # [b, s, *] -> [b, w, *]
        return to_bshd(v, info)[0]

    def unpack(y: Tensor) -> Tensor:  # [b, w, *] -> [b, s, *]
        return from_bshd(y, info)

    return call, pack, unpack
