"""``make_forward``'s call arguments, checked before the engine plans: processor arguments without a processor,
multimodal inputs to a text forward, and the ``real_tokens`` a processor checks a tensor temperature with."""

from __future__ import annotations

import torch
from torch import Tensor

from ..engine.checks import takes

__all__ = ["check_call_args"]


def check_call_args(processor_args: dict, logits_processor, multi_modal_inputs, vision: bool,
                    attention_mask: Tensor | None = None) -> None:
    """The forward's keyword arguments.  With a tensor ``temperature`` and a processor that takes ``real_tokens``
    (``packfwd.logits``' do), adds ``real_tokens`` (ones like the temperature) to ``processor_args``, the forward's
    own keyword dict: packed with the other arguments it is False exactly at the layout's padding slots, where the
    packed temperature holds the layout's fill, so the processor checks the temperature at real tokens only.
    A CPU tensor temperature is also checked here, in the caller's ``[b]`` or ``[b, s]`` with ``attention_mask``,
    so that a bad value is named by its row (and column), not by its place among the packed tokens."""
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
        _check_temperature_in_batch(temperature, attention_mask, processor_args.get("token_mask"))
    if (isinstance(temperature, Tensor) and temperature.dim() > 0 and "real_tokens" not in processor_args
            and takes(logits_processor, "real_tokens")):
        processor_args["real_tokens"] = torch.ones_like(temperature, dtype=torch.bool)


def _check_temperature_in_batch(temperature: Tensor, attention_mask: Tensor, token_mask) -> None:
    """A bad temperature (<= 0, NaN or inf) at a real token the processor scales, by row and column: eagerly for
    CPU tensors of the batch's shape (the logits' own check, asynchronous on CUDA, stays for the others)."""
    b = attention_mask.shape[0] if attention_mask.dim() == 2 else None
    if (temperature.device.type != "cpu" or attention_mask.device.type != "cpu" or attention_mask.is_nested
            or temperature.is_nested or b is None or temperature.shape[0] != b
            or (temperature.dim() == 2 and temperature.shape != attention_mask.shape)):
        return
    scaled = attention_mask != 0  # [b, s]: the tokens whose logits the temperature divides
    if isinstance(token_mask, Tensor) and token_mask.shape == attention_mask.shape and token_mask.device.type == "cpu":
        scaled = scaled & (token_mask != 0)
    with torch.no_grad():
        t = temperature.detach()
        bad = ~((t > 0) & torch.isfinite(t)) & (scaled if t.dim() == 2 else scaled.any(1))
        if not bad.any():
            return
        where = [int(i) for i in bad.nonzero()[0]]
    place = f"row {where[0]}, column {where[1]}" if len(where) == 2 else f"row {where[0]} (a per-sequence value)"
    raise ValueError(f"temperature is {t[tuple(where)].item()} at {place} of the batch: temperature must be positive "
                     "and finite at every token it scales (use 1.0 for no scaling); padding tokens and tokens "
                     "token_mask leaves out may hold anything")
