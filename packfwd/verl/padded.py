"""``model_forward_gen``: verl's forward for padded ``[b, s]`` batches, with packfwd's transforms inside.

The returned ``model_forward`` has the signature and results of verl 0.9.1's
(``verl.models.mcore.model_forward.model_forward_gen``):

* ``data_format="thd"``: the batch is packed into one row ``[1, t]`` in exactly verl's layout (each sequence
  padded to ``2*tp*cp``, or ``tp`` without CP; the CP zigzag split), the model gets verl's ``PackedSeqParams``
  (an MoE model also the plan's layout pads as ``padding_mask``, so its routers skip them; verl passes none),
  and every output comes back as ``[b, s, ...]`` with zeros at padding (CP ranks' outputs all-gathered first);
* ``data_format="bshd"``: each row's real tokens moved left into ``[b, w]`` (``w`` the longest row, rounded up
  to ``tp`` under sequence parallelism), the model gets that batch, the compacted mask and positions.

With ``logits_processor``, it is called as verl calls it: ``logits_processor(output [1, t, v] (THD) or
[b, w, v] (BSHD), **args)`` where each tensor of ``logits_processor_args`` (``[b, s, ...]``) is packed the same
way; each tensor of the dict it returns is unpacked to ``[b, s, ...]``.  A pipeline stage without the output layer
(``post_process`` False) returns the model's output as is.  Differences from verl: the README's "Coming from verl".

The layouts are ``make_forward``'s adapters in verl's flavour (:mod:`packfwd.verl.layouts`): THD ``VerlThd``, BSHD
``make_forward``'s own ``Bshd``.
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch
from torch import Tensor

from packfwd.forward.layouts import Bshd
from packfwd.forward.vision import takes_packing, vision_call

from ._common import fp8_padding, model_facts, multimodal_kwargs, packers, read_parallel, run_and_unpack
from .layouts import VerlThd, router_padding
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
    embedding the images itself, as verl's vision models do.  A model that declares packfwd's ``packing`` hook
    (``packfwd.vision.VisionLanguageModel``; :mod:`packfwd.forward.vision`) gets the call
    ``make_forward(vision=True)`` makes, with verl's plan: the hook, and the caller's ``position_ids`` (``[3, b,
    s]`` or ``[b, s]``; None: the model computes them); any other model gets verl's call (no positions: it computes
    them).  ``second_per_grid_ts`` goes to a model that takes it, and raises for one that does not (verl drops it).
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
        par = read_parallel()
        facts = model_facts(model, par)
        mtp = bool(mtp_config is not None and getattr(mtp_config, "enable_train", False)) and facts.post_process
        if mtp:
            depth = check_mtp_model(model, mtp_config)
            args = logits_processor_args or {}
            if "label" not in args or "label_mask" not in args:
                raise ValueError("MTP training (mtp_config.enable_train) reads logits_processor_args['label'] and "
                                 "['label_mask'] ([b, s], the next token and its mask), as verl does; pass both")
            targets = mtp_targets(input_ids, attention_mask, args["label"], args["label_mask"], depth)
        if data_format == "thd":
            layout = VerlThd(par.tp, par.cp, par.cp_rank, par.cp_group, fp8_padding=fp8_padding(facts))
        else:
            if par.cp > 1:
                raise ValueError("data_format='bshd' has no context parallelism (neither has verl's); use "
                                 "data_format='thd'")
            if facts.fp8 is not None:
                raise ValueError("data_format='bshd' does not support fp8 (neither does verl's); use data_format='thd'")
            layout = Bshd(par.tp if facts.sequence_parallel else 1)
        info, ids = layout.pack(input_ids, attention_mask)
        call = _model_call(model, layout, info, ids, input_ids, attention_mask, position_ids, data_format == "thd",
                           vision_model, facts.pre_process or mtp)
        pack, unpack = packers(layout, info, input_ids)
        finish = None
        if mtp:
            mtp_kwargs, finish = mtp_call(model, targets, pack)
            call.update(mtp_kwargs)
        extra = multimodal_kwargs(model, multi_modal_inputs, input_ids.device)
        result = run_and_unpack(model, {**call, **extra}, facts, unpack, logits_processor, lambda: {
            k: pack(v) if isinstance(v, Tensor) and v.dim() else v for k, v in (logits_processor_args or {}).items()},
            finish)
        if not facts.post_process:
            return result  # a middle pipeline stage: hidden states for the next one
        if value_model and isinstance(result, Tensor):
            result = result[..., 0]
        return result

    return model_forward


def _model_call(model, layout, info, ids, input_ids, attention_mask, position_ids, thd: bool, vision: bool,
                packed_ids: bool) -> dict:
    """The model's arguments (multimodal inputs aside).  Text: the packed ids (the padded ones on a pipeline stage
    without the embedding, unless MTP needs them) and the caller's positions packed like them, or None.  A vision
    model with packfwd's hook: ``make_forward(vision=True)``'s call (:func:`packfwd.forward.vision.vision_call`);
    any other vision model: verl's (THD: the padded ids and mask; BSHD: the compacted ones; no positions)."""
    mask = info.attention_mask.to(attention_mask.dtype) if not thd else None  # BSHD: [b, w], real tokens first
    if vision and takes_packing(model):
        return vision_call(model, layout, info, ids, input_ids, attention_mask, position_ids)
    if vision:
        if thd:
            return dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=None,
                        **layout.model_kwargs(info))
        return dict(input_ids=ids, position_ids=None, attention_mask=mask)
    positions = None if position_ids is None else layout.positions(info, ids, position_ids, input_ids)
    pads = router_padding(model, info) if thd else {}  # an MoE model's routers never see the layout pads
    return dict(input_ids=ids if packed_ids else input_ids, position_ids=positions,
                attention_mask=mask, **layout.model_kwargs(info), **pads)
