"""``make_forward(..., mtp=True)``: the forward of a model with multi-token prediction (MTP) layers, computing
every depth's log-probs and loss beside the main outputs.

Everything the MTP layers need is computed in the caller's layout, before any packing, and packed like the ids
with the same plan (THD, BSHD, jagged, any CP split); nothing is rolled over the packed buffer:

* depth ``k``'s input ids: the token ``k`` places later in the same sequence, 0 where there is none
  (``shift_in_sequence``), given to the model as ``mtp_input_ids [D, *ids]`` (``packfwd.models.runtime.mtp``);
* depth ``k``'s labels: the token ``k + 1`` places later (``mtp_labels``), and its loss mask: the caller's main
  loss mask read ``k`` tokens later (``mtp_loss_mask``).

The model returns ``(logits, mtp_logits)``; each depth's log-probs are ``packfwd.logits.log_probs`` of its
logits (vocab-parallel over the model's TP group), unpacked (all-gathered under CP) to ``[b, s, D]``.  Outputs:
the main ones as ``make_forward`` gives them (the processor's dict, or ``"logits"``), plus

* ``"mtp_log_probs" [b, s, D]`` float32: depth ``k``'s log-prob of its label at every token that has one, 0
  elsewhere;
* ``"mtp_loss" [D]``: per depth, the mean of ``-log_prob`` over its loss mask (Megatron-Core's per-depth MTP
  loss, ``sum(mask * loss) / max(sum(mask), 1)``), the same on every CP rank (computed from the gathered
  log-probs; the gather's backward keeps each rank's share, as for the main outputs).
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor

from ..layout.labels import mtp_labels, mtp_loss_mask, shift_in_sequence
from ..logits import log_probs
from .guards import (bind_processor, check_call_args, check_cp, check_ids, check_results, checked_call, empty_output,
                     model_facts)

__all__ = ["make_mtp_forward", "mtp_depth"]


def mtp_depth(model) -> int:
    """The number of MTP depths of ``model`` (possibly wrapped); an error when it has none or cannot take
    packfwd's per-depth ids."""
    from ..models.runtime.gpt import unwrap  # imports no Megatron-Core

    gpt = unwrap(model)
    depth = getattr(getattr(gpt, "config", None), "mtp_num_layers", None) or 0
    if not depth:
        raise ValueError("make_forward(..., mtp=True) needs a model with MTP layers; build it with "
                         "packfwd.models.ModelArgs(mtp_num_layers=...), or drop mtp=True")
    if getattr(gpt, "post_process", True) and "mtp_input_ids" not in inspect.signature(gpt.forward).parameters:
        raise TypeError(f"{type(gpt).__name__} does not take per-depth MTP ids (mtp_input_ids); MTP needs "
                        "packfwd's model (packfwd.models.build_model with mtp_num_layers)")
    return depth


def mtp_targets(input_ids: Tensor, attention_mask, loss_mask, depth: int) -> dict[str, Tensor]:
    """What every MTP depth needs, in the caller's layout, ``[b, s, D]`` each (jagged like ``input_ids``):
    ``ids`` (embedded), ``labels`` (predicted) and ``mask`` (the loss mask; ``loss_mask=None``: every token)."""
    if loss_mask is None and input_ids.is_nested:
        values = torch.ones_like(input_ids.values(), dtype=torch.bool)
        loss_mask = torch.nested.nested_tensor_from_jagged(values, input_ids.offsets())
    return {"ids": shift_in_sequence(input_ids, attention_mask, list(range(1, depth + 1)), 0),
            "labels": mtp_labels(input_ids, attention_mask, depth),
            "mask": mtp_loss_mask(loss_mask, attention_mask, depth)}


def make_mtp_forward(layout, *, logits_processor, tp_size: int, cp_size: int, cp_rank: int,
                     cp_group, check_group):
    """``make_forward``'s forward in MTP mode (see the module docstring); ``layout`` is its THD or BSHD adapter."""

    def forward(model, input_ids, attention_mask=None, position_ids=None, multi_modal_inputs=None, *,
                seqlens=None, mtp_loss_mask=None, **processor_args):
        check_call_args(processor_args, logits_processor, multi_modal_inputs, vision=False)

        def prepare():
            facts = model_facts(model, tp_size, cp_size)
            check_cp(model, cp_size, cp_rank, cp_group)
            processor = bind_processor(logits_processor, facts)
            depth = mtp_depth(model)
            check_ids(input_ids, attention_mask, model)
            plan, ids = layout.pack(input_ids, attention_mask, seqlens)
            positions = layout.positions(plan, ids, position_ids, input_ids)
            args = {k: layout.pack_arg(v, plan, input_ids) for k, v in processor_args.items()}
            targets = mtp_targets(input_ids, attention_mask, mtp_loss_mask, depth)
            packed = {k: layout.pack_arg(v, plan, input_ids) for k, v in targets.items()}  # [t, D] each
            return dict(facts=facts, processor=processor, depth=depth, plan=plan, ids=ids, positions=positions,
                        args=args, targets=targets, packed=packed)

        got = checked_call(check_group, layout, prepare)
        facts, processor, depth, plan = got["facts"], got["processor"], got["depth"], got["plan"]
        ids, positions, args, targets, packed = (got[k] for k in ("ids", "positions", "args", "targets", "packed"))
        if plan.source.total == 0:  # nothing to run: Megatron's attention cannot take an empty batch
            out = empty_output(model, facts, layout.empty_shape(plan, facts.post_process))
            if not facts.post_process:
                return out
            out = (out, out[None].expand(depth, *out.shape))
        else:
            depth_ids = packed["ids"].T.reshape(depth, *ids.shape)  # [t', D] -> [D, *ids]: [D, 1, t] or [D, b, s_c]
            out = model(input_ids=ids, position_ids=positions, attention_mask=None, mtp_input_ids=depth_ids,
                        **layout.model_kwargs(plan), **dict(multi_modal_inputs or {}))
            if not facts.post_process:
                return out  # a middle pipeline stage: hidden states for the next one
        logits, mtp_logits = out
        logits = layout.tokens(logits, plan)  # [t, v]
        if processor is None:
            results = {"logits": layout.unpack(logits, plan)}
        else:
            results = {k: layout.unpack(v, plan) for k, v in check_results(processor(logits, **args),
                                                                           logits.shape[0]).items()}
        group = facts.tp_group if facts.tp_size > 1 else None
        lp = torch.stack([log_probs(layout.tokens(mtp_logits[k], plan), packed["labels"][:, k], tp_group=group)
                          for k in range(depth)], dim=-1)  # [t, D]
        full = layout.unpack(lp, plan)  # [b, s, D]
        results["mtp_log_probs"] = full
        results["mtp_loss"] = _mean_loss(full, targets["mask"])
        return results

    return forward


def _mean_loss(log_prob: Tensor, mask: Tensor) -> Tensor:
    """``[b, s, D]`` (or jagged) -> ``[D]``: ``-sum(mask * log_prob) / max(sum(mask), 1)`` per depth."""
    if log_prob.is_nested:
        log_prob, mask = log_prob.values(), mask.values()
    weights = mask.to(log_prob.dtype).reshape(-1, mask.shape[-1])
    total = (log_prob.reshape(-1, log_prob.shape[-1]) * weights).sum(0)
    return -total / weights.sum(0).clamp(min=1)
