"""``make_forward``'s call arguments, checked before the engine plans: processor arguments without a processor,
multimodal inputs to a text forward, and the ``real_tokens`` a processor checks a tensor temperature with."""

from __future__ import annotations

import torch
from torch import Tensor

from ..engine.checks import takes

__all__ = ["check_call_args", "check_temperature_in_batch"]


def check_call_args(processor_args: dict, logits_processor, multi_modal_inputs, vision: bool,
                    attention_mask: Tensor | None = None, loss_mask: Tensor | None = None,
                    scored_only: bool = True) -> None:
    """The forward's keyword arguments.  With a tensor ``temperature`` and a processor that takes ``real_tokens``
    (``packfwd.logits``' do), adds ``real_tokens`` (ones like the temperature) to ``processor_args``, the forward's
    own keyword dict: packed with the other arguments it is False exactly at the layout's padding slots, where the
    packed temperature holds the layout's fill, so the processor checks the temperature at real tokens only.
    A CPU tensor temperature is also checked here, in the caller's ``[b]`` or ``[b, s]`` with ``attention_mask``
    (and ``labels``, ``token_mask``, ``loss_mask``: the tokens it scales), so that a bad value is named by its row
    (and column), not by its place among the packed tokens."""
    if processor_args and logits_processor is None:
        raise TypeError(f"got processor arguments {sorted(processor_args)} but no logits_processor; build the forward "
                        "with make_forward(..., logits_processor=...) (e.g. packfwd.logits.log_probs_and_entropy), "
                        "or drop them")
    if multi_modal_inputs and not vision:
        raise ValueError("multi_modal_inputs given to a text forward; build it with make_forward(..., vision=True)")
    temperature = processor_args.get("temperature")
    wrong_2d = (isinstance(temperature, Tensor) and temperature.dim() == 2 and isinstance(attention_mask, Tensor)
                and not attention_mask.is_nested and attention_mask.dim() == 2
                and tuple(temperature.shape) != tuple(attention_mask.shape))  # e.g. [b, 1]
    if isinstance(temperature, Tensor) and (temperature.dim() > 2 or wrong_2d):
        raise ValueError(f"temperature has shape {tuple(temperature.shape)}; pass a number, a tensor [b] (per "
                         "sequence) or [b, s] like input_ids (per token)")
    if isinstance(temperature, Tensor) and temperature.dim() > 0 and takes(logits_processor, "real_tokens"):
        # packfwd.logits' rule (a processor of one's own may read a temperature by another)
        check_temperature_in_batch(processor_args, attention_mask, loss_mask, scored_only)
        if "real_tokens" not in processor_args:
            processor_args["real_tokens"] = torch.ones_like(temperature, dtype=torch.bool)


def check_temperature_in_batch(processor_args: dict, attention_mask, loss_mask, scored_only: bool) -> None:
    """A bad ``temperature`` (<= 0, NaN or inf) named by its row and column of the caller's batch: eagerly, for CPU
    tensors of the batch's shape, at exactly the tokens the logits' own check reads: the real tokens, inside
    ``token_mask`` and, where the forward scores only the scored tokens (``scored_only``, make_forward's default),
    inside ``loss_mask`` with a label that is not ignored (``labels >= 0``).  A mask of another shape or device
    leaves the check to the logits (their index is in the packed order).  ``run_micro_batches`` calls it on the
    whole batch, so the row is the batch's, not the micro-batch's.  Called for processors that take
    ``real_tokens`` (``packfwd.logits``'): one of the caller's own may read a temperature by another rule."""
    temperature = processor_args.get("temperature")
    if not isinstance(temperature, Tensor) or temperature.dim() == 0 or not isinstance(attention_mask, Tensor):
        return
    b = attention_mask.shape[0] if attention_mask.dim() == 2 else None
    if (temperature.device.type != "cpu" or attention_mask.device.type != "cpu" or attention_mask.is_nested
            or temperature.is_nested or b is None or temperature.shape[0] != b
            or (temperature.dim() == 2 and temperature.shape != attention_mask.shape)):
        return
    scored = attention_mask != 0  # [b, s]
    masks = [("token_mask", processor_args.get("token_mask"))]
    if scored_only:
        masks += [("labels", processor_args.get("labels")), ("loss_mask", loss_mask)]
    for name, value in masks:
        if value is None:
            continue
        if isinstance(value, Tensor) and value.dim() == 1 and value.shape[0] == b:
            value = value[:, None].expand(attention_mask.shape)  # per sequence: each of its tokens
        if (not isinstance(value, Tensor) or value.is_nested or value.device.type != "cpu"
                or value.shape != attention_mask.shape):
            return
        scored = scored & ((value >= 0) if name == "labels" else (value != 0))
    with torch.no_grad():
        t = temperature.detach()
        bad = ~((t > 0) & torch.isfinite(t)) & (scored if t.dim() == 2 else scored.any(1))
        if not bad.any():
            return
        where = [int(i) for i in bad.nonzero()[0]]
    place = f"row {where[0]}, column {where[1]}" if len(where) == 2 else f"row {where[0]} (a per-sequence value)"
    exempt = "tokens whose label is ignored and tokens token_mask or loss_mask leave out" if scored_only else \
        "tokens token_mask leaves out (scored_only=False scores every other real token)"
    raise ValueError(f"temperature is {t[tuple(where)].item()} at {place} of the batch: temperature must be positive "
                     f"and finite at every token it scales (use 1.0 for no scaling); padding tokens and {exempt} may "
                     "hold anything")
