"""``run_micro_batches`` through a pipeline: one rank's stages, the planned micro-batches, and either packfwd's
point-to-point schedule (``packfwd.parallel.pipeline_forward_backward``, CPU and GPU) or Megatron-Core's
``get_forward_backward_func()`` (CUDA).  Both return the last stage's :class:`~packfwd.micro.batches.StepResult`
(None on the other ranks) and leave the gradients, weighted over the global batch, in every stage's ``.grad``.

Megatron-Core's interleaved schedule (several virtual stages) is refused on a pipeline of two ranks: it sends a
gradient back and an activation on in one batch of point-to-point ops and, with ``variable_seq_lengths``, exchanges
both shapes first in the order (to previous, from previous, to next, from next).  With two ranks the previous and
the next rank are one peer, so the peer's first receive (an activation's shape) gets the first send (a gradient's
shape) -- a shape mismatch on 2 x H200 with megatron-core 0.19.2.  One virtual stage, three or more ranks, and
packfwd's schedule are not affected.

A ``moe_aux_loss=True`` forward's stages hand on their routing sums beside the hidden states (the loss pools every
layer of every stage), a ``record_routing=True`` forward's their record of the routing so far (the last stage's
``"routed_experts"`` holds every stage's MoE layers): packfwd's schedule carries them, each to the keyword the
forward names (``forward.carried``), and the sums' gradients back; Megatron-Core's sends one tensor per stage, so it
is refused for such a forward."""

from __future__ import annotations

from typing import Mapping

import torch

from .batches import StepResult, detach_outputs, step_result


def packfwd_schedule(forward, stages, mbs, pp_group, loss_fn, batch_masks) -> StepResult | None:
    from packfwd.parallel import pipeline_forward_backward

    outs = pipeline_forward_backward(
        stages, lambda stage, mb, *handed: forward(stage, *mb.args, **mb.kwargs, **_carried(forward, handed)), mbs,
        pp_group=pp_group,
        loss_fn=None if loss_fn is None else (lambda out, mb: mb.loss(loss_fn, out)),
    )
    if outs is None:
        return None
    total = sum((mb.loss(loss_fn, out).detach() for mb, out in zip(mbs, outs)), torch.zeros(())) if loss_fn else None
    return step_result([detach_outputs(o) for o in outs], mbs, torch.zeros(()) if total is None else total,
                       batch_masks)


def _carried(forward, handed: tuple) -> dict:
    """The keywords of what a stage handed on beside its hidden states, by the names ``forward.carried`` gives
    (``packfwd.make_forward``: a ``record_routing=True`` forward's record, then a ``moe_aux_loss=True`` forward's
    routing sums); a forward without the attribute hands on at most the routing sums.  The first stage gets none."""
    names = getattr(forward, "carried", ("moe_routing",)[:len(handed)])
    if handed and len(handed) != len(names):
        raise TypeError(f"a pipeline stage handed on {len(handed)} tensors beside its hidden states; this forward "
                        f"takes {len(names)} from the previous stage ({', '.join(names) or 'none'})")
    return dict(zip(names, handed))


def megatron_schedule(forward, stages, mbs, pp_group, loss_fn, batch_masks) -> StepResult | None:
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if pp_group is not parallel_state.get_pipeline_model_parallel_group():
        raise ValueError("schedule='megatron' takes its pipeline group from megatron.core.parallel_state; pass "
                         "pp_group=parallel_state.get_pipeline_model_parallel_group()")
    carried = getattr(forward, "carried", ("moe_routing",) if getattr(forward, "moe_aux_loss", False) else ())
    if carried and torch.distributed.get_world_size(pp_group) > 1:
        what = {"moe_routing": "moe_aux_loss=True", "recorded_routing": "record_routing=True"}
        raise ValueError(
            f"schedule='megatron' with a {' and '.join(what.get(n, n) for n in reversed(carried))} forward: its "
            f"stages hand on {', '.join(carried)} with the hidden states (the load-balancing loss pools every "
            "stage's routing, the record joins every stage's layers), and Megatron-Core's schedule sends one tensor "
            "per stage; use schedule='packfwd'"
        )
    if len(stages) > 1 and torch.distributed.get_world_size(pp_group) == 2:
        raise ValueError(
            "schedule='megatron' with several virtual stages on 2 pipeline ranks: Megatron-Core's interleaved schedule "
            "mixes up activation and gradient shapes of variable-length micro-batches when the previous and next "
            "pipeline rank are the same; use schedule='packfwd' (same result), one virtual stage per rank, or a "
            "pipeline of 3 or more ranks"
        )
    for stage in stages:
        config = stage.config
        if not (getattr(config, "variable_seq_lengths", False) and getattr(config, "calculate_per_token_loss", False)):
            raise ValueError(
                "schedule='megatron' needs config.variable_seq_lengths=True (packed micro-batches differ in length) "
                "and config.calculate_per_token_loss=True (the step's loss is normalised over the global batch "
                "already); set both on every stage's config"
            )

    def forward_step(data_iterator, stage):
        mb = next(data_iterator)
        out = forward(stage, *mb.args, **mb.kwargs)

        def loss_func(output):
            loss = mb.loss(loss_fn, output) if loss_fn is not None else torch.zeros((), device=_device(output))
            one = torch.ones((), dtype=torch.int, device=loss.device)
            return loss, one, {"output": detach_outputs(output), "loss": loss.detach()}

        return out, loss_func

    many = len(stages) > 1
    stored = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=[iter(mbs) for _ in stages] if many else iter(mbs),
        model=list(stages) if many else stages[0], num_microbatches=len(mbs), seq_length=1, micro_batch_size=1,
        forward_only=loss_fn is None,
    )
    if not stored:
        return None
    total = sum((x["loss"] for x in stored), torch.zeros((), device=stored[0]["loss"].device))
    return step_result([x["output"] for x in stored], mbs, total, batch_masks)


def _device(output):
    return next(iter(output.values())).device if isinstance(output, Mapping) else output.device
