"""``make_forward(..., mtp=True)``: the engine extension of a model with multi-token prediction (MTP) layers,
computing every depth's log-probs and loss beside the main outputs.

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

from ..engine import Extension
from ..layout.labels import mtp_targets
from ..logits import log_probs

__all__ = ["Mtp", "MtpIds", "mtp_depth"]


def mtp_depth(model) -> int:
    """The number of MTP depths of ``model`` (possibly wrapped); an error when it has none or cannot take
    packfwd's per-depth ids."""
    from .._validate import unwrap

    gpt = unwrap(model)
    depth = getattr(getattr(gpt, "config", None), "mtp_num_layers", None) or 0
    if not depth:
        raise ValueError("make_forward(..., mtp=True) needs a model with MTP layers; build it with "
                         "packfwd.models.ModelArgs(mtp_num_layers=...), or drop mtp=True")
    if getattr(gpt, "post_process", True) and "mtp_input_ids" not in inspect.signature(gpt.forward).parameters:
        raise TypeError(f"{type(gpt).__name__} does not take per-depth MTP ids (mtp_input_ids); MTP needs "
                        "packfwd's model (packfwd.models.build_model with mtp_num_layers)")
    return depth


class MtpIds(Extension):
    """The part every MTP forward shares: each depth's ids, labels and masks (:func:`packfwd.layout.mtp_targets`,
    from the batch's ids and ``targets(batch)``'s main-head labels and mask) packed with the batch's plan, the
    model given ``mtp_input_ids [D, *ids]``; on the last stage the model returns ``(logits, mtp_logits)``, and
    :meth:`depths` hands the head the main logits.  Subclasses say what the depths' logits become."""

    def targets(self, batch) -> dict:
        """The main head's ``labels`` / ``loss_mask`` for :func:`mtp_targets` (none: the next tokens, every one)."""
        return {}

    def inputs(self, step) -> dict:
        depth = mtp_depth(step.model)
        got = mtp_targets(step.batch.input_ids, step.attention_mask, depth, **self.targets(step.batch))
        step.state[self] = got
        return {f"mtp_{k}": v for k, v in got.items()}

    def model_kwargs(self, step) -> dict:
        ids = step.packed["mtp_ids"]  # [t', D] (t' = packed tokens in the model's token order)
        return {"mtp_input_ids": ids.T.reshape(ids.shape[1], *step.ids.shape)}  # [D, 1, t] or [D, b, s_c]

    def depths(self, out, step) -> tuple[Tensor, Tensor]:
        """``(logits, mtp_logits [D, ...])``; an empty batch's zero logits stand for every depth."""
        if step.empty:
            return out, out[None].expand(step.packed["mtp_ids"].shape[1], *out.shape)
        return out


class Mtp(MtpIds):
    """``make_forward(mtp=True)``: ``"mtp_log_probs" [b, s, D]`` and ``"mtp_loss" [D]`` (module docstring); the
    main head's loss mask is the call's ``mtp_loss_mask`` (None: every token)."""

    def targets(self, batch) -> dict:
        return {"loss_mask": batch.options.get("mtp_loss_mask")}

    def finish(self, out, step):
        logits, mtp_logits = self.depths(out, step)
        facts, labels = step.facts, step.packed["mtp_labels"]  # [t, D]
        group = facts.tp_group if facts.tp_size > 1 else None
        lp = torch.stack([log_probs(step.tokens(mtp_logits[k]), labels[:, k], tp_group=group)
                          for k in range(labels.shape[1])], dim=-1)  # [t, D]
        full = step.unpack(lp)  # [b, s, D]
        return logits, {"mtp_log_probs": full, "mtp_loss": _mean_loss(full, step.state[self]["mask"])}


def _mean_loss(log_prob: Tensor, mask: Tensor) -> Tensor:
    """``[b, s, D]`` (or jagged) -> ``[D]``: ``-sum(mask * log_prob) / max(sum(mask), 1)`` per depth."""
    if log_prob.is_nested:
        log_prob, mask = log_prob.values(), mask.values()
    weights = mask.to(log_prob.dtype).reshape(-1, mask.shape[-1])
    total = (log_prob.reshape(-1, log_prob.shape[-1]) * weights).sum(0)
    return -total / weights.sum(0).clamp(min=1)
