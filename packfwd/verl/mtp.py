"""Multi-token prediction (MTP) training in packfwd.verl's forwards: what verl 0.9.1 does with
``mtp_config.enable_train`` (``model_forward_gen``) and ``mtp_enable_train`` (``gptmodel_forward_model_engine``).

verl hands the packed labels and loss mask to the model as ``labels=``/``loss_mask=``; its patched
``GPTModel._postprocess`` (``verl/models/mcore/mtp_patch.py``) then, per depth ``k``: rolls them one more place
over the packed buffer, computes the cross entropy of the depth's logits, masked, and hangs
``mtp_loss_scaling_factor / D * loss / num_tokens`` (with ``calculate_per_token_loss``:
``* original_num_tokens / num_tokens`` instead of ``/ num_tokens``) on the backward of the output through
Megatron-Core's ``MTPLossAutoScaler``; in training mode it records the per-depth mean loss in
``MTPLossLoggingHelper``'s tracker (which verl's engine reads); it returns the logits.  On a Megatron-Core without
``process_mtp_loss`` (0.16) it detaches the output layer for the MTP logits; with it (0.19), only when the
config says ``mtp_detach_heads``, and it scales by ``_verl_mtp_loss_normalization_factor`` when set.

packfwd does the same, except where the labels come from: every depth's ids, labels and mask are the caller's
shifted ``k`` places *within each sequence*, in the caller's layout (``packfwd.layout.labels.shift_in_sequence``),
then packed with the forward's plan; the model's MTP layers embed the given ids (``packfwd.models.runtime.mtp``).  So no
label crosses into another sequence, a pad, or the wrong CP chunk.  The model must be packfwd's
(``packfwd.models.build_model`` with ``mtp_num_layers``), unpatched.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from packfwd.models.runtime.gpt import unwrap
from packfwd.forward.mtp import MtpIds, mtp_depth
from packfwd.logits import log_probs

__all__ = ["VerlMtp", "attach_mtp_loss", "check_mtp_model", "engine_loss_mask"]


def check_mtp_model(model, mtp_config=None) -> int:
    """The model's MTP depth; errors for what packfwd cannot run as verl would."""
    depth = mtp_depth(model)
    gpt = unwrap(model)
    layers = gpt.mtp.layers if hasattr(gpt, "mtp") else []
    patched = ["_postprocess"] * ("_postprocess" in vars(gpt))
    patched += [f"mtp.layers.{i}._get_embeddings" for i, layer in enumerate(layers) if "_get_embeddings" in vars(layer)]
    if patched:
        raise ValueError(f"the model's {patched} were replaced (verl's patch_engine_mtp); packfwd computes the MTP "
                         "loss itself: undo the patch (verl.models.mcore.mtp_patch.unpatch_postprocess, "
                         "unpatch_mtp_layer_get_embeddings) before using packfwd.verl's forward")
    if getattr(mtp_config, "detach_encoder", False):
        raise NotImplementedError("mtp_config.detach_encoder=True (verl applies it by patching the model's MTP "
                                  "layers) is not built in packfwd's MTP path; set detach_encoder=False")
    return depth


class VerlMtp(MtpIds):
    """The engine extension of verl's MTP training: every depth's ids, labels and mask packed with the plan
    (:class:`packfwd.forward.mtp.MtpIds`, from ``batch.options``' ``mtp_labels`` / ``mtp_loss_mask``: the main
    head's, aligned with the next token), and on the last stage the loss hung on the logits' backward
    (:func:`attach_mtp_loss`); the head then reads the logits as verl's would.  ``normalization_factor``: verl's
    ``mtp_loss_normalization_factor`` (THD engine forward only)."""

    def __init__(self, normalization_factor: float | None = None):
        self.normalization_factor = normalization_factor

    def targets(self, batch) -> dict:
        return {"labels": batch.options["mtp_labels"], "loss_mask": batch.options["mtp_loss_mask"]}

    def model_kwargs(self, step) -> dict:
        return {**super().model_kwargs(step), "mtp_detach_head": legacy_verl()}

    def finish(self, out, step):
        logits, mtp_logits = self.depths(out, step)
        gpt = unwrap(step.model)
        group = getattr(getattr(gpt, "output_layer", None), "tp_group", None)
        if group is not None and torch.distributed.get_world_size(group) == 1:
            group = None
        packed, depth = step.packed, mtp_logits.shape[0]
        hung = attach_mtp_loss(step.model, logits, mtp_logits.reshape(depth, -1, mtp_logits.shape[-1]),
                               packed["mtp_labels"], packed["mtp_mask"], packed["mtp_main_mask"], group,
                               self.normalization_factor)
        return hung, {}


def engine_loss_mask(input_ids: Tensor, loss_mask: Tensor, response_attention_mask) -> Tensor:
    """verl's engine MTP loss mask, jagged like ``input_ids``: zeros over each prompt, then the response's mask
    (``loss_mask`` jagged over the responses, or padded ``[b, r]`` with ``response_attention_mask``)."""
    offsets = input_ids.offsets()
    lengths = offsets.diff()
    if loss_mask.is_nested:
        responses, values = loss_mask.offsets().diff(), loss_mask.values()
        starts = loss_mask.offsets()[:-1]
    else:
        if response_attention_mask is None or response_attention_mask.shape != loss_mask.shape:
            raise ValueError("a padded loss_mask [b, r] needs response_attention_mask of the same shape (verl's)")
        responses = response_attention_mask.to(torch.int64).sum(-1)
        values, starts = loss_mask.reshape(-1), torch.arange(loss_mask.shape[0]) * loss_mask.shape[1]
    if bool((responses > lengths.to(responses.device)).any()):
        raise ValueError("a response is longer than its sequence; loss_mask cannot be longer than input_ids")
    token = torch.arange(int(offsets[-1]), device=offsets.device)
    seq = torch.searchsorted(offsets[1:], token, right=True)
    pos = token - offsets[seq]
    prompt = (lengths - responses.to(lengths.device))[seq]
    index = (starts.to(seq.device)[seq] + (pos - prompt).clamp(min=0)).clamp(max=max(values.shape[0] - 1, 0))
    picked = values[index.to(values.device)] if values.shape[0] else values.new_zeros(token.shape[0])
    full = torch.where((pos >= prompt).to(values.device), picked, torch.zeros_like(picked))
    return torch.nested.nested_tensor_from_jagged(full, offsets)


def attach_mtp_loss(model, output: Tensor, mtp_logits: Tensor, labels: Tensor, mask: Tensor, main_mask: Tensor,
                    tp_group=None, normalization_factor: float | None = None) -> Tensor:
    """``output`` with verl's MTP loss hung on its backward (see the module docstring).  ``mtp_logits [D, t, v]``
    (this rank's packed tokens), ``labels``/``mask [t, D]``, ``main_mask [t]`` (the main loss mask, for
    ``calculate_per_token_loss``)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    config = unwrap(model).config
    depth = mtp_logits.shape[0]
    scaling = config.mtp_loss_scaling_factor
    if normalization_factor is not None and not legacy_verl() and config.calculate_per_token_loss:
        if normalization_factor <= 0:
            raise ValueError(f"MTP loss normalization factor must be positive, got {normalization_factor}")
        scaling = scaling * normalization_factor
    original = main_mask.sum()
    hung = 0.0
    for k in range(depth):
        loss = -log_probs(mtp_logits[k], labels[:, k], tp_group=tp_group) * mask[:, k]  # [t]
        num = mask[:, k].sum()
        if unwrap(model).training:
            _log(loss, num, mtp_logits[k], labels[:, k], mask[:, k], k, depth, tp_group)
        if config.calculate_per_token_loss:
            hung = hung + scaling / depth * loss * (original / num.clamp(min=1))
        else:
            hung = hung + scaling / depth * loss / num.clamp(min=1)
    return _HangLoss.apply(output, hung, MTPLossAutoScaler.main_loss_backward_scale)


class _HangLoss(torch.autograd.Function):
    """``output`` unchanged; its backward also sends ``scale`` (Megatron-Core's ``MTPLossAutoScaler`` loss scale)
    into ``loss``: what ``MTPLossAutoScaler`` does, but the output is a new tensor, not a view of the input, so a
    logits processor may change it in place (verl's engine processor divides by the temperature in place; verl
    hangs the loss on the hidden states before the output layer, packfwd on the logits after it)."""

    @staticmethod
    def forward(ctx, output, loss, scale):
        ctx.save_for_backward(loss)
        ctx.scale = scale
        return output.detach()

    @staticmethod
    def backward(ctx, grad):
        (loss,) = ctx.saved_tensors
        return grad, torch.ones_like(loss) * ctx.scale, None


def legacy_verl() -> bool:
    """verl's MTP branch on this Megatron-Core: the legacy one (no ``process_mtp_loss``, output layer detached)."""
    from megatron.core.transformer import multi_token_prediction

    return not hasattr(multi_token_prediction, "process_mtp_loss")


def _as_bool(x: Tensor) -> Tensor:
    if x.is_nested:
        return torch.nested.nested_tensor_from_jagged(x.values().bool(), x.offsets())
    return x.bool()


def _log(loss, num, logits, labels, mask, k, depth, tp_group) -> None:
    """The per-depth mean loss (and, on Megatron-Cores that track it, the acceptance) in Megatron-Core's
    ``MTPLossLoggingHelper`` tracker, as verl's patched model records it."""
    from megatron.core import parallel_state
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from packfwd.models.runtime.cpu import host_collectives, is_host

    mean = loss.sum().detach() * (num > 0) / num.clamp(min=1)
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    on_host = is_host(logits.device)
    # the tracker allocates on the current CUDA device: on the host, that is the CPU
    with host_collectives() if on_host else contextlib.nullcontext():
        if hasattr(MTPLossLoggingHelper, "save_metrics_to_tracker"):
            correct, total = _acceptance(logits, labels, mask, tp_group)
            MTPLossLoggingHelper.save_metrics_to_tracker(mean, correct, total, k, depth, avg_group=group)
        else:
            MTPLossLoggingHelper.save_loss_to_tracker(mean, k, depth, avg_group=group)


def _acceptance(logits: Tensor, labels: Tensor, mask: Tensor, tp_group) -> tuple[Tensor, Tensor]:
    """Masked tokens whose label is the (vocab-parallel) argmax, and the masked tokens."""
    with torch.no_grad():
        local = logits.float()
        top = local.max(-1).values
        start = 0 if tp_group is None else torch.distributed.get_rank(tp_group) * local.shape[-1]
        col = labels - start
        mine = (col >= 0) & (col < local.shape[-1])
        at_label = torch.where(mine, local.gather(-1, col.clamp(0, local.shape[-1] - 1)[:, None])[:, 0],
                               torch.full_like(top, -torch.inf))
        if tp_group is not None:
            both = torch.stack([top, at_label])
            torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.MAX, group=tp_group)
            top, at_label = both
        valid = mask.bool()
        return ((at_label >= top) & valid).sum().float(), valid.sum().float()
