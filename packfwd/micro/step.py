"""``run_micro_batches``: one DP rank's forward (and backward) over its micro-batches of a planned global batch.

For each micro-batch of ``plan.micro_batches[dp_rank]`` it selects the micro-batch's rows of the global batch
(``input_ids``, ``attention_mask``, ``position_ids`` and every tensor argument whose first dimension is the batch),
calls a ``make_forward`` forward with the planned lengths as host ints (``seqlens=``: no device sync), and with a
``loss_fn`` runs the backward of the micro-batch's share of the loss, so gradients accumulate in ``.grad`` and
only one micro-batch's activations are alive at a time.  Outputs come back detached, in the rank's rows.

**Loss normalisation.**  ``loss_fn(outputs, **loss_args)`` returns per-token losses ``[b_mb, s]``; the step weighs
token ``t`` of sequence ``i`` by ``loss_mask[i, t] * w_i`` and sums, with ``w_i`` fixed by the *global* batch:

* ``"token_mean"``:    ``w_i = 1 / N``, ``N`` the loss tokens of the whole global batch (every DP rank's);
* ``"sequence_mean"``: ``w_i = 1 / (n_i * S)``, ``n_i`` sequence ``i``'s loss tokens, ``S`` the number of
  sequences with at least one (sequences without any weigh 0);
* ``"sum"``:           ``w_i = 1``.

So the losses of all micro-batches of all ranks add up to the loss of the whole batch in one piece, and so do
their gradients: sum the gradients over DP (an all-reduce SUM; a DDP that averages needs them scaled by
``dp_size``).  The counts ``n_i`` come from ``loss_tokens`` (host ints) when given; otherwise from the loss mask,
read back once per step (one device sync; none on the CPU), or from ``plan.seqlens`` without a loss mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import Tensor

from .plan import MicroBatchPlan

__all__ = ["StepResult", "agree_micro_batch_count", "run_micro_batches", "sequence_weights"]

NORMALIZE = ("token_mean", "sequence_mean", "sum")


@dataclass(frozen=True)
class StepResult:
    """``outputs``: the forward's outputs (a tensor or a dict of tensors) for the rank's sequences, detached, row
    ``k`` for global index ``rows[k]`` (ascending; with one DP rank, the caller's order); None when the rank ran
    no sequence.  ``loss``: the rank's share of the global loss (a detached 0-d tensor; 0 without ``loss_fn``)."""

    outputs: Any
    rows: list
    loss: Tensor


def run_micro_batches(
    forward: Callable,
    model: torch.nn.Module,
    plan: MicroBatchPlan,
    input_ids: Tensor,
    attention_mask: Tensor,
    *,
    dp_rank: int,
    pp_group=None,
    schedule: str = "packfwd",
    position_ids: Tensor | None = None,
    loss_fn: Callable[..., Tensor] | None = None,
    loss_mask: Tensor | None = None,
    loss_args: Mapping[str, Any] | None = None,
    loss_tokens: Sequence[int] | None = None,
    normalize: str = "token_mean",
    multi_modal_inputs: Sequence[Mapping[str, Tensor] | None] | None = None,
    **processor_args,
) -> StepResult | None:
    """Run rank ``dp_rank``'s micro-batches of ``plan`` (see the module docstring).

    ``input_ids``, ``attention_mask`` ``[b, s]``: the whole global batch (``b = len(plan.seqlens)``);
    ``position_ids`` ``[b, s]`` or ``[k, b, s]``; ``processor_args`` go to the forward's logits processor and
    ``loss_args`` to ``loss_fn``, tensors whose first dimension is ``b`` cut to the micro-batch's rows.  Without
    ``loss_fn`` the forwards run under ``torch.no_grad()``.  Empty micro-batches are skipped.

    ``multi_modal_inputs`` (a vision forward, ``make_forward(..., vision=True)``): one dict per sequence (or None
    for a text-only one), as verl keeps them (``non_tensor_batch["multi_modal_inputs"]``); each micro-batch gets
    its sequences' entries concatenated in its row order (``pixel_values``, ``image_grid_thw``, ...), the order in
    which their vision tokens appear.  One dict for the whole batch is refused: its concatenated pixel values
    cannot be cut per micro-batch without each sequence's share.

    Pipeline parallelism: with ``pp_group``, ``model`` is the list of this rank's virtual stages and the
    micro-batches go through ``packfwd.parallel.pipeline_forward_backward`` (packfwd's point-to-point schedule;
    ``schedule="megatron"``: Megatron-Core's ``get_forward_backward_func()`` instead (CUDA; 1F1B, or interleaved
    with several stages on 3 or more pipeline ranks: on 2 its shape exchange is refused, see
    ``packfwd.micro.pipeline``), which needs ``pp_group`` to be Megatron's pipeline group and every stage's config to
    have ``variable_seq_lengths=True`` (micro-batches differ in packed length) and ``calculate_per_token_loss=True``
    (the loss is already normalised over the global batch: Megatron must not divide it by the micro-batch count).
    Every rank of ``pp_group`` passes the same batch and plan; the result comes back on the rank that holds the
    last stage, None on the others.
    """
    if schedule not in ("packfwd", "megatron"):
        raise ValueError(f"schedule={schedule!r}; pass 'packfwd' or 'megatron'")
    if schedule == "megatron" and pp_group is None:
        raise ValueError("schedule='megatron' runs a pipeline: pass pp_group (Megatron's pipeline group)")
    _check_step(plan, input_ids, dp_rank, normalize, loss_fn, loss_mask)
    _check_multi_modal(multi_modal_inputs, len(plan.seqlens))
    weights = None
    if loss_fn is not None:
        weights = sequence_weights(_loss_counts(plan, loss_mask, loss_tokens), normalize)
    mbs = micro_batch_inputs(plan, input_ids, attention_mask, dp_rank=dp_rank, position_ids=position_ids,
                             loss_mask=loss_mask, loss_args=loss_args, weights=weights,
                             multi_modal_inputs=multi_modal_inputs, **processor_args)
    if pp_group is not None:
        from . import pipeline

        if not isinstance(model, (list, tuple)) or not all(isinstance(m, torch.nn.Module) for m in model):
            raise TypeError("with pp_group, pass this rank's stages as a list of modules (one per virtual stage)")

        run = pipeline.megatron_schedule if schedule == "megatron" else pipeline.packfwd_schedule
        return run(forward, model, list(mbs), pp_group, loss_fn)
    total, pieces, order = None, [], []
    for mb in mbs:
        with torch.set_grad_enabled(loss_fn is not None and torch.is_grad_enabled()):
            out = forward(model, *mb.args, **mb.kwargs)
            if loss_fn is not None:
                loss = mb.loss(loss_fn, out)
                if loss.requires_grad:
                    loss.backward()
                total = loss.detach() if total is None else total + loss.detach()  # stays on the device
        pieces.append(detach_outputs(out))
        order.extend(mb.indices)
    loss = torch.zeros(()) if total is None else total
    return StepResult(outputs=in_row_order(pieces, order), rows=sorted(order), loss=loss)


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
        rows = torch.tensor(indices, dtype=torch.long).to(input_ids.device, non_blocking=True)
        take = _taker(rows, input_ids.shape[0])
        positions = None if position_ids is None else _take_positions(position_ids, rows)
        w = None if weights is None else torch.tensor([weights[i] for i in indices], dtype=torch.float64)
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


def sequence_weights(loss_counts: Sequence[int], normalize: str = "token_mean") -> list[float]:
    """The weight ``w_i`` of each sequence's loss tokens for ``normalize`` (module docstring), from the loss-token
    count of every sequence of the global batch.

    >>> sequence_weights([2, 0, 6], "token_mean"), sequence_weights([2, 0, 6], "sequence_mean")
    ([0.125, 0.125, 0.125], [0.25, 0.0, 0.08333333333333333])
    """
    if normalize not in NORMALIZE:
        raise ValueError(f"normalize={normalize!r}; pass one of {NORMALIZE}")
    counts = [int(c) for c in loss_counts]
    if normalize == "sum":
        return [1.0] * len(counts)
    if normalize == "token_mean":
        total = sum(counts)
        return [1.0 / total if total else 0.0] * len(counts)
    with_tokens = sum(1 for c in counts if c)
    return [1.0 / (c * with_tokens) if c else 0.0 for c in counts]


def agree_micro_batch_count(n_local: int, group=None) -> int:
    """The largest of every rank's micro-batch count, over ``group`` (one all-reduce MAX of one integer).

    For ranks that each plan their own sequences (``dp_size=1`` locally): plan, agree, and plan again with
    ``min_micro_batches=`` the agreed count, so every rank runs the same number of micro-batches.  (Should a
    re-plan come back with more, which takes a budget so tight that the packing needs an extra step, agree again.)
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return int(n_local)
    backend = str(dist.get_backend(group)).lower()
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
    count = torch.tensor([int(n_local)], dtype=torch.int64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    return int(count.item())


def _check_step(plan, input_ids, dp_rank, normalize, loss_fn, loss_mask) -> None:
    if not isinstance(plan, MicroBatchPlan):
        raise TypeError(f"plan must be a MicroBatchPlan (from plan_micro_batches), got {type(plan).__name__}")
    if isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or not 0 <= dp_rank < plan.dp_size:
        raise ValueError(f"dp_rank={dp_rank!r}; pass this rank's index in [0, {plan.dp_size - 1}] (plan.dp_size)")
    if not isinstance(input_ids, Tensor) or input_ids.dim() < 2 or input_ids.shape[0] != len(plan.seqlens):
        shape = tuple(input_ids.shape) if isinstance(input_ids, Tensor) else type(input_ids).__name__
        raise ValueError(
            f"input_ids has shape {shape} but the plan has {len(plan.seqlens)} sequences; pass the whole global "
            "batch [b, s] that the plan was made for"
        )
    if normalize not in NORMALIZE:
        raise ValueError(f"normalize={normalize!r}; pass one of {NORMALIZE}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError("loss_fn must be callable: loss_fn(outputs, **loss_args) -> per-token losses [b, s]")
    if loss_mask is not None and tuple(loss_mask.shape) != tuple(input_ids.shape[:2]):
        raise ValueError(f"loss_mask has shape {tuple(loss_mask.shape)}; pass [b, s] = {list(input_ids.shape[:2])}")


def _check_multi_modal(multi_modal_inputs, b: int) -> None:
    if multi_modal_inputs is None:
        return
    if isinstance(multi_modal_inputs, Mapping):
        raise TypeError(
            "multi_modal_inputs is one dict for the whole batch; for micro-batches pass one dict per sequence (None "
            "for text-only ones), as verl's non_tensor_batch['multi_modal_inputs'] holds them: the batch's "
            "concatenated pixel values cannot be cut per micro-batch without each sequence's share"
        )
    if len(multi_modal_inputs) != b:
        raise ValueError(f"multi_modal_inputs has {len(multi_modal_inputs)} entries; pass one per sequence ({b})")
    for i, entry in enumerate(multi_modal_inputs):
        tensors = isinstance(entry, Mapping) and all(isinstance(v, Tensor) for v in entry.values())
        if entry is not None and not tensors:
            raise TypeError(f"multi_modal_inputs[{i}] must be a dict of tensors or None, got {type(entry).__name__}")


def _concat_rows(multi_modal_inputs, indices) -> dict | None:
    """The micro-batch's multimodal inputs: each key's tensors of its rows, concatenated in row order."""
    rows = [multi_modal_inputs[i] for i in indices if multi_modal_inputs[i]]
    keys = list(dict.fromkeys(k for row in rows for k in row))
    return {k: torch.cat([row[k] for row in rows if k in row]) for k in keys} or None


def _loss_counts(plan, loss_mask, loss_tokens) -> list[int]:
    if loss_tokens is not None:
        counts = [int(c) for c in loss_tokens]
        if len(counts) != len(plan.seqlens):
            raise ValueError(f"loss_tokens has {len(counts)} entries; pass one per sequence ({len(plan.seqlens)})")
        return counts
    if loss_mask is None:
        return list(plan.seqlens)
    return loss_mask.ne(0).sum(-1).tolist()  # the one host sync of a step (none for a CPU mask)


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
        raise ValueError(f"loss_fn returned {got}; return per-token losses shaped like the rows {tuple(mask.shape)}")
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
    perm = torch.tensor(sorted(range(len(order)), key=order.__getitem__), dtype=torch.long)
    if isinstance(pieces[0], Mapping):
        return {k: torch.cat([p[k] for p in pieces]).index_select(0, perm.to(pieces[0][k].device)) for k in pieces[0]}
    return torch.cat(pieces).index_select(0, perm.to(pieces[0].device))
