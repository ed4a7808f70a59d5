"""What both verl forwards share before they hand the batch to packfwd's engine: Megatron's parallel state read
once, the model's facts under it, the FP8 padding rule and the multimodal inputs.

Megatron-Core is imported inside the functions only.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import Tensor

# The multimodal inputs verl hands to the model as keyword arguments (moved to the ids' device).
MULTIMODAL_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
# Qwen2.5-VL's seconds per temporal grid step: verl drops it; packfwd passes it to a model that takes it.
VIDEO_TIMING = "second_per_grid_ts"
FP8_PADDED_RECIPES = ("e4m3", "hybrid")


@dataclass(frozen=True)
class Parallel:
    """Tensor- and context-parallel facts of this rank, read from ``megatron.core.parallel_state`` once."""

    tp: int
    cp: int
    cp_rank: int
    cp_group: Any  # None when cp == 1
    model_cp: int  # the CP size the model is built for (cp, but for dynamic CP)


def read_parallel(local_cp_size: int | None = None) -> Parallel:
    """This rank's TP size and CP size, rank and group, as verl reads them (dynamic CP when ``local_cp_size``)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    if not mpu.model_parallel_is_initialized():
        raise RuntimeError(
            "megatron.core.parallel_state is not initialised; call parallel_state.initialize_model_parallel(...) "
            "(or packfwd.models.runtime.ensure_model_parallel()) before the forward, as verl's workers do"
        )
    tp, cp = mpu.get_tensor_model_parallel_world_size(), mpu.get_context_parallel_world_size()
    if local_cp_size is not None:
        groups = getattr(mpu, "get_dynamic_data_context_parallel_groups", None)
        if groups is None:
            raise NotImplementedError(
                "local_cp_size (dynamic context parallelism) needs a Megatron-Core with "
                "parallel_state.get_dynamic_data_context_parallel_groups; this one has none: pass local_cp_size=None"
            )
        group = groups(group_size=local_cp_size)
        return Parallel(tp, local_cp_size, dist.get_rank(group=group), group, cp)
    if cp == 1:
        return Parallel(tp, 1, 0, None, 1)
    return Parallel(tp, cp, mpu.get_context_parallel_rank(), mpu.get_context_parallel_group(), cp)


# what a caller whose model disagrees with Megatron's parallel state must do (verl passes no sizes)
PARALLEL_FIX = "initialise megatron.core.parallel_state with the sizes the model was built for"


def fp8_padding(facts) -> bool:
    """Whether verl pads for FP8: the model's config names a recipe that needs it."""
    return facts.fp8 in FP8_PADDED_RECIPES


def multimodal_kwargs(model, multi_modal_inputs: Mapping[str, Tensor] | None, device: torch.device) -> dict:
    """verl's four image/video inputs, on ``device``; other keys are not passed (as in verl).  ``second_per_grid_ts``
    (Qwen2.5-VL videos: the temporal spacing of their RoPE positions), which verl drops, goes to a model whose
    forward takes it (``packfwd.vision.VisionLanguageModel`` does); for any other model it raises, since the model
    would place the video's tokens at other positions than the caller's timing gives."""
    inputs = multi_modal_inputs or {}
    out = {k: inputs[k].to(device) for k in MULTIMODAL_KEYS if k in inputs}
    timing = inputs.get(VIDEO_TIMING)
    if timing is not None:
        if not _takes(model, VIDEO_TIMING):
            from packfwd.models.runtime.gpt import unwrap  # imports no Megatron-Core

            raise ValueError(
                f"multi_modal_inputs has {VIDEO_TIMING!r} (the videos' temporal spacing), but "
                f"{type(unwrap(model)).__name__}.forward takes no {VIDEO_TIMING} parameter, so its video positions "
                f"would ignore it (verl drops it silently); use a model that takes it "
                f"(packfwd.vision.from_hf(hf)), or leave it out where every video has 1 second per grid step"
            )
        out[VIDEO_TIMING] = timing.to(device) if isinstance(timing, Tensor) else timing
    return out


def _takes(model, name: str) -> bool:
    from packfwd.models.runtime.gpt import unwrap  # imports no Megatron-Core

    try:
        return name in inspect.signature(unwrap(model).forward).parameters
    except (TypeError, ValueError):
        return False


def check_value_width(logits: Tensor, empty: bool = False) -> None:
    """``value_model=True`` on a model without packfwd's value head takes the one column of a width-1 output layer
    (a critic built as verl builds it); a wider output (a language model's logits) has no value to take.  An empty
    batch (the model not run: zeros as wide as the model's config says) passes."""
    if logits.shape[-1] != 1 and not empty:
        raise ValueError(
            f"value_model=True but the model's output has {logits.shape[-1]} columns per token, not one: it is not a "
            "value model (a critic's output layer has width 1); build the critic with a value head "
            "(packfwd.models.from_hf of a ...ForTokenClassification with num_labels=1) or pass value_model=False"
        )
