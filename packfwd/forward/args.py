"""``make_forward``'s call arguments, checked before the engine plans: processor arguments without a processor,
multimodal inputs to a text forward, and the ``real_tokens`` a processor checks a tensor temperature with."""

from __future__ import annotations

import torch
from torch import Tensor

from ..engine.checks import takes

__all__ = ["check_call_args"]


def check_call_args(processor_args: dict, logits_processor, multi_modal_inputs, vision: bool,
                    attention_mask: Tensor | None = None, loss_mask: Tensor | None = None) -> None:
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
    if isinstance(temperature, Tensor) and temperature.dim() > 2:
        raise ValueError(f"temperature has shape {tuple(temperature.shape)}; pass a number, a tensor [b] (per "
                         "sequence) or [b, s] like input_ids (per token)")
    if isinstance(temperature, Tensor) and temperature.dim() > 0 and isinstance(attention_mask, Tensor):
        _check_temperature_in_batch(temperature, attention_mask, processor_args, loss_mask)
    if (isinstance(temperature, Tensor) and temperature.dim() > 0 and "real_tokens" not in processor_args
            and takes(logits_processor, "real_tokens")):
        processor_args["real_tokens"] = torch.ones_like(temperature, dtype=torch.bool)


def _check_temperature_in_batch(temperature: Tensor, attention_mask: Tensor, processor_args: dict,
                                loss_mask) -> None:
    """A bad temperature (<= 0, NaN or inf) named by its row and column: eagerly, for CPU tensors of the batch's
    shape, at the tokens the logits' own check reads whatever the forward's options (real tokens whose label is
    not ignored, inside ``token_mask`` and ``loss_mask``), so it refuses nothing that check accepts.  A mask of
    another shape or device leaves the check to the logits (their index is in the packed order)."""
    b = attention_mask.shape[0] if attention_mask.dim() == 2 else None
    if (temperature.device.type != "cpu" or attention_mask.device.type != "cpu" or attention_mask.is_nested
            or temperature.is_nested or b is None or temperature.shape[0] != b
            or (temperature.dim() == 2 and temperature.shape != attention_mask.shape)):
        return
    scored = attention_mask != 0  # [b, s]
    for name, value in (("labels", processor_args.get("labels")), ("token_mask", processor_args.get("token_mask")),
                        ("loss_mask", loss_mask)):
        if value is None:
            continue
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
    raise ValueError(f"temperature is {t[tuple(where)].item()} at {place} of the batch: temperature must be positive "
                     "and finite at every token it scales (use 1.0 for no scaling); padding tokens, tokens whose "
                     "label is ignored and tokens token_mask or loss_mask leave out may hold anything")
