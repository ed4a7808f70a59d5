"""One rank's micro-batches as the step runs them: each micro-batch's inputs cut from the global batch
(:func:`micro_batch_inputs`), and the micro-batches' outputs put back together as a :class:`StepResult`
(:func:`step_result`).  Both the step (``step.py``) and the pipeline schedules (``pipeline.py``) use them; this
module imports neither.

An MTP forward's ``"mtp_loss" [D]`` is one number per depth for the whole call, not a row: the result holds the
global batch's token-weighted MTP loss per depth instead (``StepResult.mtp_loss``), each micro-batch's loss weighted
by its MTP loss-token count per depth over the count of the whole global batch, so that with one DP rank it is the
``mtp_loss`` of one forward over the whole batch, and over DP ranks the ranks' values add up to it.  A
``moe_aux_loss=True`` forward's ``"moe_aux_loss"`` (one number per call) likewise becomes the token-weighted
``StepResult.moe_aux_loss``: each micro-batch's loss weighted by its real tokens over the global batch's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np
import torch
from torch import Tensor

from ..layout.labels import mtp_loss_mask
from ..layout.source import to_device

__all__ = ["MicroBatchInputs", "StepResult", "detach_outputs", "in_row_order", "micro_batch_inputs", "step_result"]


@dataclass(frozen=True)
class StepResult:
    """``outputs``: the forward's outputs (a tensor or a dict of tensors) for the rank's sequences, detached, row
    ``k`` for global index ``rows[k]`` (ascending; with one DP rank, the caller's order); None when the rank ran
    no sequence.  ``loss``: the rank's share of the global loss (a detached 0-d tensor; 0 without ``loss_fn``).
    ``mtp_loss`` (an ``mtp=True`` forward, else None): ``[D]``, the rank's share of the global batch's
    token-weighted MTP loss per depth (module docstring); the per-row ``outputs`` then hold no ``"mtp_loss"``.
    ``moe_aux_loss`` (a ``moe_aux_loss=True`` forward, else None): 0-d, the rank's share of the global batch's
    token-weighted load-balancing loss (module docstring), likewise taken out of ``outputs``; detached, like ``loss``
    (to train on the loss, add ``out["moe_aux_loss"]`` in the ``loss_fn``: docs/moe.md)."""

    outputs: Any
    rows: list
    loss: Tensor
    mtp_loss: Tensor | None = None
    moe_aux_loss: Tensor | None = None


@dataclass(frozen=True)
class MicroBatchInputs:
    """One micro-batch's share of the global batch: the forward's ``args`` / ``kwargs`` (its rows, host
    ``seqlens``), and what its loss needs."""

    indices: list
    args: tuple
    kwargs: dict
    loss_kwargs: dict
    loss_mask: Tensor
    weights: Tensor | None

    def loss(self, loss_fn: Callable[..., Tensor], out) -> Tensor:
        """The micro-batch's share of the global loss: ``loss_fn``'s per-token losses, masked and weighted."""
        return _weighted_sum(loss_fn(out, **self.loss_kwargs), self.loss_mask, self.weights)


def micro_batch_inputs(plan, input_ids, attention_mask, *, dp_rank, position_ids=None, loss_mask=None,
                       loss_args=None, weights=None, multi_modal_inputs=None, **processor_args):
    """Each non-empty micro-batch of ``dp_rank`` as :class:`MicroBatchInputs` (rows cut from every ``[b, ...]``
    tensor; positions ``[b, s]`` or ``[k, b, s]``; the rows' multimodal inputs concatenated)."""
    for indices in plan.micro_batches[dp_rank]:
        if not indices:
            continue
        rows = to_device(np.asarray(indices, dtype=np.int64), input_ids.device)  # no sync: through pinned memory
        take = _taker(rows, input_ids.shape[0])
        positions = None if position_ids is None else _take_positions(position_ids, rows)
        w = None if weights is None else to_device(np.asarray([weights[i] for i in indices], dtype=np.float64),
                                                   input_ids.device)
        vision = {} if multi_modal_inputs is None else {"multi_modal_inputs": _concat_rows(multi_modal_inputs, indices)}
        yield MicroBatchInputs(
            indices=list(indices),
            args=(take(input_ids), take(attention_mask), positions),
            kwargs={"seqlens": [plan.seqlens[i] for i in indices], **vision,
                    **{k: take(v) for k, v in processor_args.items()}},
            loss_kwargs={k: take(v) for k, v in (loss_args or {}).items()},
            loss_mask=take(attention_mask if loss_mask is None else loss_mask),
            weights=w,
        )


def step_result(pieces: list, mbs: list, loss: Tensor, batch_masks: tuple) -> StepResult:
    """The rank's result from its micro-batches' detached outputs ``pieces`` (one per entry of ``mbs``, in order).

    ``batch_masks``: the global batch's ``(mtp_loss_mask or None, attention_mask)``, which an MTP forward's loss
    is normalised over (module docstring)."""
    order = [i for mb in mbs for i in mb.indices]
    mtp = None
    if pieces and isinstance(pieces[0], Mapping) and {"mtp_loss", "mtp_log_probs"} <= pieces[0].keys():
        mtp = _global_mtp_loss([p["mtp_loss"] for p in pieces], mbs, *batch_masks)
        pieces = [{k: v for k, v in p.items() if k != "mtp_loss"} for p in pieces]
    moe = None
    if pieces and isinstance(pieces[0], Mapping) and "moe_aux_loss" in pieces[0]:  # sum_m loss_m * n_m / N
        total = sum(p["moe_aux_loss"].double() * mb.args[1].sum() for p, mb in zip(pieces, mbs))
        moe = (total / batch_masks[1].sum().clamp(min=1)).to(pieces[0]["moe_aux_loss"].dtype)
        pieces = [{k: v for k, v in p.items() if k != "moe_aux_loss"} for p in pieces]
    return StepResult(outputs=in_row_order(pieces, order), rows=sorted(order), loss=loss, mtp_loss=mtp,
                      moe_aux_loss=moe)


def _global_mtp_loss(losses: list, mbs: list, loss_mask, attention_mask) -> Tensor:
    """``sum_m mtp_loss_m * n_m / N`` per depth: ``n_m`` micro-batch ``m``'s MTP loss tokens, ``N`` the global
    batch's, so the forward's ``-sum(mask * log_prob) / max(n_m, 1)`` of each micro-batch becomes the global
    ``-sum(mask * log_prob) / max(N, 1)`` (no device sync: the counts stay on the device)."""
    depth = losses[0].shape[-1]
    total = sum(loss.double() * _mtp_tokens(mb.kwargs.get("mtp_loss_mask"), mb.args[1], depth).to(loss.device)
                for loss, mb in zip(losses, mbs))
    tokens = _mtp_tokens(loss_mask, attention_mask, depth).to(total.device)
    return (total / tokens.clamp(min=1)).to(losses[0].dtype)


def _mtp_tokens(loss_mask, attention_mask, depth: int) -> Tensor:
    """``[D]`` float64: the MTP loss tokens per depth of these rows, as the MTP forward counts them."""
    return mtp_loss_mask(loss_mask, attention_mask, depth).reshape(-1, depth).sum(0, dtype=torch.float64)


def _concat_rows(multi_modal_inputs, indices) -> dict | None:
    """The micro-batch's multimodal inputs: each key's tensors of its rows, concatenated in row order."""
    rows = [multi_modal_inputs[i] for i in indices if multi_modal_inputs[i]]
    keys = list(dict.fromkeys(k for row in rows for k in row))
    return {k: torch.cat([row[k] for row in rows if k in row]) for k in keys} or None


def _taker(rows: Tensor, b: int) -> Callable:
    def take(value):
        if isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == b:
            return value.index_select(0, rows.to(value.device))
        return value

    return take


def _take_positions(position_ids: Tensor, rows: Tensor) -> Tensor:
    dim = 1 if position_ids.dim() == 3 else 0  # [k, b, s] multimodal positions
    return position_ids.index_select(dim, rows.to(position_ids.device))


def _weighted_sum(per_token: Tensor, mask: Tensor, w: Tensor) -> Tensor:
    if not isinstance(per_token, Tensor) or tuple(per_token.shape) != tuple(mask.shape):
        got = tuple(per_token.shape) if isinstance(per_token, Tensor) else type(per_token).__name__
        raise ValueError(f"loss_fn returned {got}; return per-token losses shaped like the rows {tuple(mask.shape)} "
                         "(a loss_args tensor is cut to the micro-batch's rows only when its first dimension is the "
                         "global batch's b; any other reaches loss_fn whole)")
    w = w.to(device=per_token.device, dtype=per_token.dtype)
    return (per_token * mask.to(per_token.dtype) * w[:, None]).sum()


def detach_outputs(out):
    if isinstance(out, Mapping):
        return {k: v.detach() for k, v in out.items()}
    return out.detach()


def in_row_order(pieces: list, order: list[int]):
    """The micro-batches' outputs concatenated and put in ascending global index."""
    if not pieces:
        return None
    if isinstance(pieces[0], Mapping) and not pieces[0]:
        return {}
    host = np.argsort(np.asarray(order, dtype=np.int64), kind="stable")
    first = next(iter(pieces[0].values())) if isinstance(pieces[0], Mapping) else pieces[0]
    perm = to_device(host, first.device)  # no sync: through pinned memory
    if isinstance(pieces[0], Mapping):
        return {k: torch.cat([p[k] for p in pieces]).index_select(0, perm.to(pieces[0][k].device)) for k in pieces[0]}
    return torch.cat(pieces).index_select(0, perm)
