"""What both verl forwards share: Megatron's parallel state read once, verl's alignment, the THD plan that
reproduces verl's layout, verl's ``PackedSeqParams``, the CP gather verl's unpacking does, and the model call.

Megatron-Core is imported inside the functions only.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import Tensor

from packfwd import plan_thd

# The multimodal inputs verl hands to the model as keyword arguments (moved to the ids' device).
MULTIMODAL_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
FP8_PADDED_RECIPES = ("e4m3", "hybrid")


@dataclass(frozen=True)
class Parallel:
    """Tensor- and context-parallel facts of this rank, read from ``megatron.core.parallel_state`` once."""

    tp: int
    cp: int
    cp_rank: int
    cp_group: Any  # None when cp == 1

    @property
    def align(self) -> int:
        """verl's per-sequence alignment: ``2*tp*cp`` under CP (zigzag chunks split by SP), else ``tp``."""
        return 2 * self.tp * self.cp if self.cp > 1 else self.tp


def read_parallel(local_cp_size: int | None = None) -> Parallel:
    """This rank's TP size and CP size, rank and group, as verl reads them (dynamic CP when ``local_cp_size``)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    if not mpu.model_parallel_is_initialized():
        raise RuntimeError(
            "megatron.core.parallel_state is not initialised; call parallel_state.initialize_model_parallel(...) "
            "(or packfwd.models.runtime.ensure_model_parallel()) before the forward, as verl's workers do"
        )
    tp = mpu.get_tensor_model_parallel_world_size()
    if local_cp_size is not None:
        groups = getattr(mpu, "get_dynamic_data_context_parallel_groups", None)
        if groups is None:
            raise NotImplementedError(
                "local_cp_size (dynamic context parallelism) needs a Megatron-Core with "
                "parallel_state.get_dynamic_data_context_parallel_groups; this one has none: pass local_cp_size=None"
            )
        group = groups(group_size=local_cp_size)
        return Parallel(tp, local_cp_size, dist.get_rank(group=group), group)
    cp = mpu.get_context_parallel_world_size()
    if cp == 1:
        return Parallel(tp, 1, 0, None)
    return Parallel(tp, cp, mpu.get_context_parallel_rank(), mpu.get_context_parallel_group())


@dataclass(frozen=True)
class ModelFacts:
    """What verl reads from the (unwrapped) model: its pipeline position and its config."""

    pre_process: bool
    post_process: bool
    sequence_parallel: bool
    fp8: Any
    takes_packing: bool = False  # declares packfwd's vision hook (packfwd.forward.vision): it gets one

    @property
    def fp8_padding(self) -> bool:
        return self.fp8 in FP8_PADDED_RECIPES


def model_facts(model: torch.nn.Module) -> ModelFacts:
    from packfwd.forward.vision import takes_packing
    from packfwd.models.gpt import unwrap  # imports no Megatron-Core

    inner = unwrap(model)
    config = inner.config
    return ModelFacts(
        pre_process=bool(getattr(inner, "pre_process", True)),
        post_process=bool(getattr(inner, "post_process", True)),
        sequence_parallel=bool(getattr(config, "sequence_parallel", False)),
        fp8=getattr(config, "fp8", None),
        takes_packing=takes_packing(model),
    )


def multimodal_kwargs(multi_modal_inputs: Mapping[str, Tensor] | None, device: torch.device) -> dict:
    """verl's four image/video inputs, on ``device``; other keys are not passed (as in verl)."""
    inputs = multi_modal_inputs or {}
    return {k: inputs[k].to(device) for k in MULTIMODAL_KEYS if k in inputs}


def plan_verl_thd(mask: Tensor | None, par: Parallel, *, fp8_padding: bool = False, bucket: int | None = None,
                  x: Tensor | None = None):
    """``plan_thd`` laid out as verl lays it out: each sequence padded to a multiple of ``par.align`` (with
    FP8 padding: of ``lcm(16, align)``), and the last sequence's padding extended so the padded total divides by
    ``128 * align`` (FP8) and by ``bucket`` (verl's ``pad_to_length_bucket``).

    ``plan_thd`` extends the last sequence until each CP rank's token count divides by its ``tp_size``; asking
    for a multiple of ``unit // cp`` per rank is asking for a padded total that divides by ``unit``.
    """
    seq_align = math.lcm(16, par.align) if fp8_padding else par.align
    unit = seq_align
    if fp8_padding:
        unit = math.lcm(unit, 128 * par.align)
    if bucket is not None:
        if isinstance(bucket, bool) or not isinstance(bucket, int) or bucket <= 0:
            raise ValueError(f"pad_to_length_bucket must be a positive integer, got {bucket!r}")
        unit = math.lcm(unit, bucket)
    per_rank = par.tp if unit == seq_align else unit // par.cp
    return plan_thd(mask, x=x, tp_size=per_rank, cp_size=par.cp, cp_rank=par.cp_rank, seq_align=seq_align)


def verl_packed_seq_params(info, par: Parallel, local_cp_size: int | None = None):
    """verl's ``PackedSeqParams``: ``cu_seqlens_q/kv`` hold the *padded* offsets, like ``*_padded`` (pads sit at
    each sequence's tail, so attention over them changes no real token)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    extra = {} if local_cp_size is None else {"local_cp_size": local_cp_size, "cp_group": par.cp_group}
    if "cp_partition_mode" in {f.name for f in dataclasses.fields(PackedSeqParams)}:
        extra["cp_partition_mode"] = "zigzag"  # newer Megatron-Cores name the CP split; verl names it too
    cu = info.cu_seqlens_padded
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                           cu_seqlens_kv_padded=cu, max_seqlen_q=info.max_seqlen, max_seqlen_kv=info.max_seqlen,
                           **extra)


def gather_cp(y: Tensor, par: Parallel) -> list[Tensor]:
    """Every CP rank's ``y`` (same shape on each), in rank order.  As in verl, the others' are detached copies:
    gradients reach this rank's share only, and every rank must compute the same loss from the gathered outputs."""
    if par.cp == 1:
        return [y]
    parts = [torch.empty_like(y) for _ in range(par.cp)]
    torch.distributed.all_gather(parts, y.detach().contiguous(), group=par.cp_group)
    parts[par.cp_rank] = y
    return parts


def run_and_unpack(model, kwargs: dict, facts: ModelFacts, unpack, processor, processor_args, finish=None):
    """The model on the packed call; on the last stage its output (through ``finish`` first, when given: the MTP
    loss, ``packfwd.verl.mtp``) or the processor's, called with ``processor_args()``, unpacked; a middle pipeline
    stage's hidden states as they are."""
    output = model(**kwargs)
    if not facts.post_process:
        return output
    if finish is not None:
        output = finish(output)
    if processor is None:
        return unpack(output)
    return {k: unpack(v) for k, v in processor(output, **processor_args()).items()}
