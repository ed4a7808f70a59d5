"""``make_forward(..., moe_aux_loss=True)``: the engine extension that gives ``"moe_aux_loss"``, the
load-balancing loss of the batch's real tokens, every MoE layer of the decoder pooled as transformers'
``load_balancing_loss_func`` pools them (:func:`packfwd.models.mlp.routing.load_balancing_loss`).

The routers record their statistics while the model runs (:func:`packfwd.models.mlp.moe.routing_stats`, the
decoder's routers only: an MTP block's MoE layers, which transformers never runs, are not pooled, so the loss is
the same with ``mtp=True`` or not).  On pipeline stages a stage before the last hands on ``(hidden, routing
sums)`` (:func:`~packfwd.models.mlp.aux_loss.stage_routing_sums`, its layers pooled plus those it was given as
``moe_routing=``), and the last stage pools them into the loss.  Carried sums are checked against this batch: the
tokens they count must be a whole number of this batch's real tokens per MoE layer (another micro-batch's sums
raise, eagerly on the CPU, with ``torch._assert_async`` on CUDA).
"""

from __future__ import annotations

import contextlib

import torch

from .._validate import unwrap
from ..engine import Extension
from ..models.mlp.aux_loss import check_stage_routing, model_aux_loss, stage_routing_sums
from ..models.mlp.moe import routing_stats

__all__ = ["MoeAuxLoss"]


class MoeAuxLoss(Extension):
    """The MoE load-balancing loss (module docstring); ``batch.options["moe_routing"]``: the earlier stages' sums."""

    def check(self, model, facts, batch) -> None:
        check_stage_routing(model, batch.options.get("moe_routing"), True)

    def context(self, step):
        @contextlib.contextmanager
        def recording():
            decoder = getattr(unwrap(step.model), "decoder", step.model)
            with routing_stats(decoder) as stats:
                step.state[self] = stats
                yield

        return recording()

    def hand_on(self, out, step):
        carried = self._carried(step)
        return out, stage_routing_sums(step.model, step.state[self], carried)

    def finish(self, out, step):
        loss = model_aux_loss(step.model, step.state[self], device=step.ids.device, carried=self._carried(step))
        return out, {"moe_aux_loss": loss}

    def _carried(self, step):
        """The given sums, checked to count a whole number of this batch's routed tokens per layer."""
        carried = step.batch.options.get("moe_routing")
        if carried is None:
            return None
        mask = step.call.get("padding_mask")  # True at slots kept from the routers
        routed = step.plan.source.total if mask is None else (~mask.bool()).sum()
        config = unwrap(step.model).config
        if config.sequence_parallel and config.tensor_model_parallel_size > 1:
            return carried  # each TP rank routes its own slice: no per-rank count to compare with
        tokens = carried[-1]
        ok = (tokens.remainder(torch.as_tensor(routed, dtype=tokens.dtype, device=tokens.device).clamp(min=1)) == 0)
        message = ("moe_routing= counts routed tokens that are not a whole number of this batch's real tokens per MoE "
                   "layer: it comes from another micro-batch; pass the previous stage's sums of this micro-batch")
        if tokens.device.type == "cpu":
            if not bool(ok):
                raise ValueError(f"{message} ({int(tokens)} carried, {int(routed)} real tokens here)")
        else:
            torch._assert_async(ok, message)
        return carried
