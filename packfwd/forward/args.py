"""``make_forward``'s call arguments, checked before the engine plans: processor arguments without a processor,
multimodal inputs to a text forward, and the ``real_tokens`` a processor checks a tensor temperature with."""

from __future__ import annotations

import torch
from torch import Tensor

from ..engine.checks import takes

__all__ = ["check_call_args"]


def check_call_args(processor_args: dict, logits_processor, multi_modal_inputs, vision: bool) -> None:
    """The forward's keyword arguments.  With a tensor ``temperature`` and a processor that takes ``real_tokens``
    (``packfwd.logits``' do), adds ``real_tokens`` (ones like the temperature) to ``processor_args``, the forward's
    own keyword dict: packed with the other arguments it is False exactly at the layout's padding slots, where the
    packed temperature holds the layout's fill, so the processor checks the temperature at real tokens only."""
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
    if (isinstance(temperature, Tensor) and temperature.dim() > 0 and "real_tokens" not in processor_args
            and takes(logits_processor, "real_tokens")):
        processor_args["real_tokens"] = torch.ones_like(temperature, dtype=torch.bool)
