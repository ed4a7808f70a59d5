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
``dp_size``).  Under expert parallelism the expert-parallel ranks are data-parallel ranks holding *different*
experts (``local_experts.0`` is another expert on each): sum only the parameters Megatron-Core marks
``allreduce=True`` over DP, and the experts' (``allreduce=False``) over their expert-data-parallel group.  The loss tokens are ``loss_mask``'s; without one the real tokens with a label (``labels >= 0``) when
``labels`` are given, else every real token (:func:`loss_token_counts`: a loss mask marking padding or an ignored label
is refused).  The counts ``n_i`` come from ``loss_tokens`` (host ints, one per sequence) when given; otherwise from
that mask, read back once per step (one device sync; none on the CPU), or from ``plan.seqlens`` without either.

**The plan and the forward's layout agree.**  The plan's budget is the footprint of the layout it was made for; a
``make_forward`` forward carries its own (``forward.layout``), and the step refuses a plan made for another:

* THD: the plan's ``tp_size``, ``cp_size`` and ``seq_align`` must be the forward's (plan with
  ``plan_micro_batches(..., **forward.layout.plan_args)``);
* BSHD: every row of a micro-batch is padded to its longest, ``rows x round_up(longest, tp_size)`` tokens, which
  the planner (THD's footprint) does not bound: the plan must have the forward's ``tp_size`` and ``cp_size=1``, and
  every micro-batch of every rank is checked against ``max_tokens`` in that footprint (a refusal names the fix).

Both checks are host arithmetic on the plan, the same on every rank.  A callable without a ``ForwardLayout``
``layout`` attribute (the caller's own wrapper; ``functools.wraps`` copies the attribute) is run as given: the
caller vouches that it packs the way the plan assumed.

**Outputs of an MTP forward** (``make_forward(..., mtp=True)``): ``"mtp_loss"`` is one value per depth, not a row;
``StepResult.mtp_loss`` holds the global batch's token-weighted MTP loss per depth (:mod:`packfwd.micro.batches`).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from ..forward.factory import ForwardLayout
from ..layout.source import to_device
from ..engine.checks import takes
from ..forward.args import check_temperature_in_batch
from ..engine.facts import check_every_ep_rank_runs
from . import pipeline
from .batches import StepResult, detach_outputs, micro_batch_inputs, step_result
from .graphs import ModelTensors, StepGraphs, capturable, graphed_step, why_eager
from .plan import MicroBatchPlan

__all__ = ["StepResult", "agree_micro_batch_count", "loss_token_counts", "padding_pays", "run_micro_batches", "sequence_weights"]

NORMALIZE = ("token_mean", "sequence_mean", "sum")


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
    graphs: bool | StepGraphs | None = False,
    buckets: bool | None = None,
    **processor_args,
) -> StepResult | None:
    """Run rank ``dp_rank``'s micro-batches of ``plan`` (see the module docstring).

    ``input_ids``, ``attention_mask`` ``[b, s]``: the whole global batch (``b = len(plan.seqlens)``);
    ``position_ids`` ``[b, s]`` or ``[k, b, s]``; ``processor_args`` go to the forward's logits processor and
    ``loss_args`` to ``loss_fn``, tensors whose first dimension is ``b`` cut to the micro-batch's rows.  Without
    ``loss_fn`` the forwards run under ``torch.no_grad()``; with it, grad mode must be on (under ``no_grad`` or
    ``inference_mode`` no gradient could accumulate: RuntimeError).  Empty micro-batches are skipped.  ``plan``
    must be made for the forward's layout (module docstring).

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

    ``buckets`` (micro-batches padded to their buckets, ``plan.buckets(dp_rank)``, and run eagerly: the shapes recur
    step after step, so the automatic attention takes cuDNN's ragged kernel, which builds a graph per shape, where
    it has passed its check): ``None`` (default) where that was measured to pay, a CUDA batch whose model's
    attention runs cuDNN on bucket plans (:func:`padding_pays`; on one H100 a 1B Llama's RL step ran 1.07 x the
    plain step at 0.84 x its memory, an 8-layer Qwen3-MoE's 1.01-1.04 x: benchmarks/RESULTS.md); ``True``:
    wherever the padded step can run (else the plain one, with one warning naming why); ``False``: never.  What ran
    is kept on ``forward.padded_steps`` (a ``StepGraphs(capture=False)``: the micro-batches it ran, ``eager``, and
    ``reason``, why the plain step ran instead).

    ``graphs=True`` (CUDA; off by default: not faster than the padded eager step on the RL steps timed, and a pool of
    about one micro-batch's activations more; docs/micro-batches.md): each micro-batch is padded to its bucket and its
    forward and backward replayed from CUDA graphs captured once per bucket and kept in ``forward.step_graphs`` (a
    :class:`~packfwd.micro.graphs.StepGraphs`; pass your own to hold it elsewhere).  Where graphs cannot work (the
    CPU; see :mod:`packfwd.micro.graphs`) the step runs as ``buckets`` says, with one warning naming why (on CUDA).
    ``graphs=None``: the same where graphs can work, quietly where they cannot (``forward.step_graphs.reason`` says
    why, on CUDA).  ``graphs=False``: no graphs.  Graphs pad to the buckets: ``buckets=False`` with graphs asked is a
    ValueError.
    """
    if schedule not in ("packfwd", "megatron"):
        raise ValueError(f"schedule={schedule!r}; pass 'packfwd' or 'megatron'")
    if schedule == "megatron" and pp_group is None:
        raise ValueError("schedule='megatron' runs a pipeline: pass pp_group (Megatron's pipeline group)")
    _check_step(plan, input_ids, dp_rank, normalize, loss_fn, loss_mask)
    if buckets is not None and not isinstance(buckets, bool):
        raise TypeError(f"buckets must be None, True or False, got {buckets!r}")
    if buckets is False and graphs is not False:
        raise ValueError(f"graphs={graphs!r} pads every micro-batch to its bucket, which buckets=False refuses; pass "
                         "graphs=False with buckets=False (or leave buckets=None)")
    if buckets is True and pp_group is not None:
        warnings.warn("packfwd: run_micro_batches(buckets=True) runs the plain step: pipeline parallelism "
                      "(pp_group=)", stacklevel=2)
    check_layout(forward, plan)
    check_every_ep_rank_runs(model, any(not mb for rank in plan.micro_batches for mb in rank))
    _check_multi_modal(multi_modal_inputs, len(plan.seqlens))
    engine = getattr(forward, "engine", None)
    if engine is not None:  # a forward of one's own may take other tensors whole
        _check_batch_args(processor_args, len(plan.seqlens))
    temperature = processor_args.get("temperature")
    if (engine is not None and isinstance(temperature, Tensor) and temperature.dim() > 0
            and takes(engine.processor, "real_tokens")):  # a bad temperature named by its row of this batch, not of a
        # micro-batch (packfwd.logits' rule: a processor of one's own may read a temperature by another)
        check_temperature_in_batch(processor_args, attention_mask, loss_mask if _scores(forward, loss_mask) else None,
                                   scored_only=getattr(engine, "scoring", None) is not None)
    if loss_fn is not None and not torch.is_grad_enabled():
        raise RuntimeError(
            "run_micro_batches(loss_fn=...) with grad mode off (inside torch.no_grad() or torch.inference_mode()): "
            "no gradient would accumulate; call it outside no_grad / inference_mode, or drop loss_fn for a "
            "forward-only pass"
        )
    weights = counts = weigh = None
    if loss_fn is not None or _scores(forward, loss_mask):
        counts, weigh = loss_token_counts(plan, attention_mask, loss_mask, loss_tokens, processor_args.get("labels"),
                                          loss=loss_fn is not None)
    if loss_fn is not None:
        weights = sequence_weights(counts, normalize)
    mbs = micro_batch_inputs(plan, input_ids, attention_mask, dp_rank=dp_rank, position_ids=position_ids,
                             loss_mask=weigh, loss_args=loss_args, weights=weights,
                             multi_modal_inputs=multi_modal_inputs, **processor_args)
    batch_masks = (processor_args.get("mtp_loss_mask"), attention_mask)  # what an MTP loss is normalised over
    if pp_group is not None:
        if not isinstance(model, (list, tuple)) or not all(isinstance(m, torch.nn.Module) for m in model):
            raise TypeError("with pp_group, pass this rank's stages as a list of modules (one per virtual stage)")

        run = pipeline.megatron_schedule if schedule == "megatron" else pipeline.packfwd_schedule
        return _zero_when_idle(run(forward, model, list(mbs), pp_group, loss_fn, batch_masks), forward, model,
                               input_ids.device)
    bucketed = _step_graphs(graphs, forward, model, input_ids, multi_modal_inputs, processor_args)
    if bucketed is None:
        bucketed = _padded_steps(buckets, forward, model, input_ids, multi_modal_inputs, processor_args)
    if bucketed is not None:
        shapes = iter([shape for shape, mb in zip(plan.buckets(dp_rank), plan.micro_batches[dp_rank]) if mb])
        canvas = {"width": input_ids.shape[1], "batch": {k for k, v in processor_args.items() if isinstance(v, Tensor)
                                                         and v.dim() > 0 and v.shape[0] == input_ids.shape[0]}}
        tensors = ModelTensors(model)  # walked once per call, not per micro-batch
    total, pieces, done = None, [], []
    for mb in mbs:
        with torch.set_grad_enabled(loss_fn is not None):
            if bucketed is not None:
                out, loss = graphed_step(bucketed, forward, model, mb, next(shapes), canvas, loss_fn, tensors,
                                         counts if _scores(forward, loss_mask) else None)
            else:
                out, loss = _eager_step(forward, model, mb, loss_fn, counts if _scores(forward, loss_mask) else None)
            if loss is not None:
                total = loss if total is None else total + loss  # stays on the device
        pieces.append(out)
        done.append(mb)
    zero = torch.zeros((), device=input_ids.device)
    return _zero_when_idle(step_result(pieces, done, zero if total is None else total, batch_masks), forward, model,
                           input_ids.device)


def _zero_when_idle(result: StepResult | None, forward, model, device) -> StepResult | None:
    """A rank that ran no sequence (fewer sequences than DP ranks): its loss 0 on the batch's ``device``, and with a
    ``moe_aux_loss=True`` forward its share of that loss 0, not None, in the other ranks' dtype (the routers' score
    dtype): the ranks' values add up, or are all-reduced over DP (NCCL: on the device), on every rank alike."""
    if result is None:
        return result
    if result.loss.device != device:  # the pipeline schedules' 0 of no micro-batch or no loss_fn: a CPU 0
        # made again on the device (a copy from pageable host memory would wait for the stream: a sync)
        result = dataclasses.replace(result, loss=torch.zeros((), dtype=result.loss.dtype, device=device))
    if result.moe_aux_loss is not None or getattr(forward, "moe_aux_loss", False) is not True:
        return result
    from ..models.mlp.aux_loss import check_aux_loss_model, score_dtype

    last = model[-1] if isinstance(model, (list, tuple)) else model
    dtype = score_dtype(check_aux_loss_model(last).config)
    return dataclasses.replace(result, moe_aux_loss=torch.zeros((), dtype=dtype, device=device))


def _eager_step(forward, model, mb, loss_fn, counts=None):
    """One micro-batch as it is: the forward, then with ``loss_fn`` its share of the loss and the backward.
    ``counts`` (a scoring forward given a loss mask): each sequence's loss tokens, so the forward computes its
    head on the loss mask's tokens only, sized without a host sync (``packfwd.forward.scored``)."""
    kwargs = mb.kwargs
    if counts is not None:
        kwargs = {**kwargs, "loss_mask": mb.loss_mask, "scored_tokens": sum(counts[i] for i in mb.indices)}
    out = forward(model, *mb.args, **kwargs)
    loss = None
    if loss_fn is not None:
        loss = mb.loss(loss_fn, out)
        if loss.requires_grad:
            loss.backward()
        loss = loss.detach()
    return detach_outputs(out), loss


def _step_graphs(graphs, forward, model, input_ids, multi_modal_inputs, processor_args) -> StepGraphs | None:
    """The step's :class:`StepGraphs`, or None for the eager step (``graphs=False``, or graphs cannot work here:
    the reason is kept in ``StepGraphs.reason``, and said once on a CUDA device unless ``graphs=None`` asked for
    graphs only where they work)."""
    if graphs is False:
        return None
    quiet = graphs is None
    if graphs is True or graphs is None:
        held = getattr(forward, "step_graphs", None)
        if held is None and capturable(input_ids) and getattr(forward, "engine", None) is not None:
            held = StepGraphs()
            forward.step_graphs = held  # the forward holds its graphs: no global cache
        graphs = held
        if graphs is None:
            return None
    elif not isinstance(graphs, StepGraphs):
        raise TypeError(f"graphs must be None, True, False or a packfwd.micro.StepGraphs, got {type(graphs).__name__}")
    reason = why_eager(forward, model, input_ids, multi_modal_inputs=multi_modal_inputs,
                       processor_args=processor_args, cuda=graphs.capture)
    graphs.reason = reason
    if reason is not None:
        if capturable(input_ids) and not quiet:
            graphs.warn_once(f"packfwd: run_micro_batches runs the eager step without CUDA graphs: {reason} "
                             "(graphs=None graphs only where they can work, quietly; graphs=False never)")
        return None
    return graphs


def _padded_steps(buckets, forward, model, input_ids, multi_modal_inputs, processor_args) -> StepGraphs | None:
    """The padded eager steps (``forward.padded_steps``, a ``StepGraphs(capture=False)``), or None for the plain
    step: ``buckets=False``; the padded step cannot run here; or ``buckets=None`` and padding was not measured to
    pay (:func:`padding_pays`).  The reason is kept on ``forward.padded_steps.reason`` (said once for ``True``)."""
    if buckets is False:
        return None
    if getattr(forward, "engine", None) is None:  # a callable not make_forward's holds nothing: the plain step
        if buckets is True:
            warnings.warn("packfwd: run_micro_batches(buckets=True) runs the plain step: the forward is not one "
                          "make_forward made (its plan= path is what the padded step runs)", stacklevel=3)
        return None
    held = getattr(forward, "padded_steps", None)
    if held is None:
        held = forward.padded_steps = StepGraphs(capture=False)
    reason = why_eager(forward, model, input_ids, multi_modal_inputs=multi_modal_inputs,
                       processor_args=processor_args, cuda=False)
    if reason is None and buckets is None:
        try:
            reason = padding_pays(model, input_ids)
        except Exception as e:  # noqa: BLE001 - an odd model: the plain step is always right
            reason = f"could not tell whether padding pays for this model ({type(e).__name__}: {e})"
    held.reason = reason
    if reason is not None:
        if buckets is True:
            held.warn_once(f"packfwd: run_micro_batches(buckets=True) runs the plain step: {reason}")
        return None
    return held


def padding_pays(model, input_ids: Tensor) -> str | None:
    """Why ``buckets=None`` runs the plain step for ``model`` on ``input_ids``' device (None: it pads to the
    buckets: a CUDA batch, and cuDNN's attention on bucket plans, which the automatic choice takes there and a model
    built with ``attention_backend="prefer_cudnn"`` or ``"cudnn"`` takes everywhere).  Measured on one H100
    (benchmarks/RESULTS.md, history 22): padded to the buckets, a 1B Llama's RL step took cuDNN's attention and ran
    1.07 x the plain step (torch's flash kernel) at 28.6 against 34.1 GiB, an 8-layer Qwen3-MoE's 1.01-1.04 x in
    two runs (history 21: with the flash kernel in both the padding gained nothing).

    >>> padding_pays(torch.nn.Linear(2, 2), torch.zeros(1, 2, dtype=torch.long))
    'not a CUDA batch: no attention kernel here plans per shape'
    """
    from ..models.mixers.attention import attention_backends
    from ..models.runtime.gpt import unwrap

    if not capturable(input_ids):
        return "not a CUDA batch: no attention kernel here plans per shape"
    bucketed = attention_backends(unwrap(model), bucket_plans=True)
    if "cudnn" not in bucketed:
        return (f"the attention runs {', '.join(bucketed) or 'nothing'} on bucket plans, not cuDNN's, which pays for "
                "the padding (it needs nvidia-cudnn-frontend and its check on the device; not a named other backend, "
                "not under batch_invariant)")
    return None


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


def _check_batch_args(processor_args: Mapping, b: int) -> None:
    """Every tensor argument of the forward is the global batch's (the step cuts each micro-batch's rows): a rank's
    or a micro-batch's rows are refused here, where the message can speak of the global batch."""
    for name, value in processor_args.items():
        if isinstance(value, Tensor) and value.dim() > 0 and not value.is_nested and value.shape[0] != b:
            raise ValueError(
                f"{name} has shape {tuple(value.shape)}; run_micro_batches takes every tensor argument for the whole "
                f"global batch, first dimension b={b} like input_ids (all ranks' rows: it cuts each micro-batch's "
                "rows itself), not one rank's or one micro-batch's"
            )


def check_layout(forward: Callable, plan: MicroBatchPlan) -> None:
    """Refuse a plan whose budget the forward's layout cannot hold (module docstring); a forward without a
    :class:`ForwardLayout` is the caller's word."""
    spec = getattr(forward, "layout", None)
    if not isinstance(spec, ForwardLayout):
        return
    fix = "plan_micro_batches(seqlens, max_tokens=..., **forward.layout.plan_args)"
    if spec.data_format == "thd":
        differ = [k for k, v in spec.plan_args.items() if getattr(plan, k) != v]
        if differ:
            worst = max(spec.footprint([plan.seqlens[i] for i in mb]) for mbs in plan.micro_batches for mb in mbs)
            raise ValueError(
                f"the plan was made for {_named(plan, differ)} but the forward packs with "
                f"{_named(spec, differ)}: its costliest micro-batch would take {worst} padded tokens per CP rank "
                f"(the plan's budget is max_tokens={plan.max_tokens} in its own layout); plan with the forward's "
                f"layout: {fix}"
            )
        return
    if plan.cp_size != 1 or plan.tp_size != spec.tp_size:
        raise ValueError(
            f"the plan was made for {_named(plan, ['tp_size', 'cp_size'])} but the BSHD forward packs with "
            f"{_named(spec, ['tp_size', 'cp_size'])}; plan with the forward's layout: {fix}"
        )
    for r, mbs in enumerate(plan.micro_batches):
        for m, mb in enumerate(mbs):
            need = spec.footprint([plan.seqlens[i] for i in mb])
            if need > plan.max_tokens:
                raise ValueError(
                    f"micro-batch {m} of dp_rank {r} takes {need} tokens in BSHD ({len(mb)} rows padded to the "
                    f"longest), over the plan's max_tokens={plan.max_tokens}: the planner budgets THD's footprint "
                    "(sequences end to end), which BSHD exceeds by the padding of its rows; use "
                    "make_forward('thd', ...) with planned micro-batches"
                )


def _named(layout, names) -> str:
    return ", ".join(f"{k}={getattr(layout, k)}" for k in names)


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


def _scores(forward, loss_mask) -> bool:
    """Whether the step hands ``loss_mask`` to the forward: a ``make_forward`` forward that scores only the loss
    tokens (a processor, ``scored_only=True``) and a loss mask given."""
    engine = getattr(forward, "engine", None)
    return loss_mask is not None and getattr(engine, "scoring", None) is not None and engine.processor is not None


def loss_token_counts(plan, attention_mask: Tensor, loss_mask: Tensor | None, loss_tokens=None,
                      labels: Tensor | None = None, *, loss: bool = True) -> tuple[list[int], Tensor | None]:
    """Each sequence's loss-token count ``n_i`` and the mask the per-token losses are weighed with (None: the
    attention mask).

    The loss tokens are ``loss_mask``'s; without one, the real tokens that have a label (``labels >= 0``) when the
    step is given ``labels`` (a sequence's last token has none: its log-prob is 0, not a score, and must not count
    in a mean), else every real token.  A ``loss_mask`` may mark only such tokens: one that marks padding or a token
    whose label is ignored (typically a response mask not shifted to packfwd's next-token labels) is refused, and so
    are ``loss_tokens`` that disagree with the mask.  The counts cost one device read per step (none on the CPU, none
    with ``loss_tokens``, none without a loss mask and labels); with ``loss_tokens`` a CUDA batch is checked by an
    asynchronous device assert, a CPU batch at once, naming the row (a failed device assert leaves the process's CUDA
    context unusable: restart it).  ``loss=False`` (no ``loss_fn``: the counts only size a scoring forward's head,
    where more is harmless): the mask's tokens are counted, not checked."""
    b = attention_mask.shape[0]
    given = None
    if loss_tokens is not None:
        host = (isinstance(loss_tokens, Tensor) and loss_tokens.device.type == "cpu" and loss_tokens.dim() == 1) or (
            isinstance(loss_tokens, np.ndarray) and loss_tokens.ndim == 1) or (
            isinstance(loss_tokens, Sequence) and not isinstance(loss_tokens, (str, bytes)))
        if not host:
            what = (f"a {loss_tokens.device.type} tensor (reading it would sync with the device)"
                    if isinstance(loss_tokens, Tensor) and loss_tokens.dim() == 1 else
                    f"{type(loss_tokens).__name__} {getattr(loss_tokens, 'shape', '')}".rstrip())
            raise TypeError(f"loss_tokens must be host ints, one per sequence of the batch (a list, a 1-D numpy "
                            f"array or CPU tensor of {b}), got {what}")
        values = loss_tokens.tolist() if isinstance(loss_tokens, (Tensor, np.ndarray)) else list(loss_tokens)
        given = [int(c) for c in values]
        if any(g != c or g < 0 for g, c in zip(given, values)):
            i = next(i for i, (g, c) in enumerate(zip(given, values)) if g != c or g < 0)
            raise ValueError(f"loss_tokens[{i}]={values[i]!r}; each sequence's loss tokens are a count, an int >= 0")
        if len(given) != b:
            raise ValueError(f"loss_tokens has {len(given)} entries; pass one per sequence ({b}), each sequence's "
                             "loss tokens (not the batch's total)")
    labelled = (isinstance(labels, Tensor) and not labels.is_nested
                and tuple(labels.shape) == tuple(attention_mask.shape))
    if loss_mask is None and not labelled:
        if given is not None and given != list(plan.seqlens):
            i = next(i for i, (g, n) in enumerate(zip(given, plan.seqlens)) if g != n)
            raise ValueError(f"loss_tokens[{i}]={given[i]} but sequence {i} has {plan.seqlens[i]} real tokens, every "
                             "one a loss token without a loss_mask or labels; pass the loss_mask the counts are of")
        return list(plan.seqlens), None
    allowed = attention_mask.ne(0)
    if labelled:
        allowed = allowed & labels.to(allowed.device).ge(0)
    marked = allowed if loss_mask is None else loss_mask.ne(0)
    bad = None if loss_mask is None or not loss else marked & ~allowed
    weigh = allowed if loss_mask is None else loss_mask
    if marked.device.type != "cpu" and given is not None:  # no device read: the device asserts it
        ok = marked.sum(-1) == to_device(np.asarray(given, dtype=np.int64), marked.device)
        if bad is not None:
            ok = ok & ~bad.any(-1)
        torch._assert_async(ok.all(), "run_micro_batches: loss_mask marks padding or a token whose label is "
                            "ignored, or loss_tokens disagree with it (a CPU batch names the row and column)")
        return given, weigh
    wrong = bad.sum(-1) if bad is not None else torch.zeros_like(marked[:, 0], dtype=torch.long)
    counts, wrong = torch.stack([marked.sum(-1), wrong]).tolist()  # the one host sync of a step (none on the CPU)
    if any(wrong):
        i = next(i for i, w in enumerate(wrong) if w)
        j = int(bad[i].nonzero()[0, 0])
        if not bool(attention_mask[i, j]):
            raise ValueError(
                f"loss_mask marks {sum(wrong)} token(s) that cannot be loss tokens: row {i}, column {j} is padding in "
                "the attention mask, and would count in the normalisation; pass loss_mask & attention_mask"
            )
        raise ValueError(
            f"loss_mask marks {sum(wrong)} token(s) that cannot be loss tokens: row {i}, column {j} has its label "
            f"ignored (labels[{i}, {j}] = {int(labels[i, j])}): its log-prob is 0, not a score, yet the token would "
            "count in the normalisation. packfwd's labels are the next token's (label t is token t + 1, "
            "packfwd.next_token_labels): align a mask of the response tokens themselves by shifting it left by one "
            "(loss_mask[:, :-1] = response_mask[:, 1:]), or pass loss_mask & (labels >= 0)"
        )
    if given is not None and given != counts:
        i = next(i for i, (g, n) in enumerate(zip(given, counts)) if g != n)
        raise ValueError(f"loss_tokens[{i}]={given[i]} but the loss mask marks {counts[i]} loss tokens in sequence "
                         f"{i}; pass each sequence's count of the mask's tokens (or leave loss_tokens out)")
    return counts, weigh
