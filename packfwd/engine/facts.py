"""What the engine must know about the model it runs, read once per call and checked against the forward's own
parallel arguments (:func:`model_facts`, :func:`check_cp`); the model's output for a batch with no real token,
made without running it (:func:`empty_output`); whether the model is a value model or has MoE layers, and the
refusal of an empty batch under expert parallelism.  Everything is read from the model's attributes (its
Megatron-Core config, its output layer): no Megatron-Core import at import time, no import of packfwd.models.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from packfwd._validate import unwrap


__all__ = ["ModelFacts", "check_cp", "check_every_ep_rank_runs", "empty_output", "is_moe", "is_value_model", "model_facts"]


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """What the forward must know about the model (defaults for a plain module without a Megatron config)."""

    post_process: bool = True
    pre_process: bool = True  # this pipeline stage embeds the ids
    sequence_parallel: bool = False
    fp8: object = None  # the config's FP8 recipe (verl's forwards pad for "e4m3" / "hybrid")
    value_model: bool = False
    tp_size: int = 1  # the output layer's vocab is split over this many ranks (1: full vocab)
    tp_group: object = None
    out_width: int | None = None  # v_local (1 for a value head) on the last stage, the hidden size elsewhere
    dtype: torch.dtype | None = None
    rope_coords: int | str | None = "any"  # position coordinates per token: 3 (multimodal RoPE), None (1-D), "any"


def model_facts(model, tp_size: int, cp_size: int, fix: str | None = None) -> ModelFacts:
    """Read the model's parallel layout and head; raise when the forward's arguments contradict it.  ``fix``:
    what the caller should do then, where it is not "pass tp_size= / cp_size=" (verl's forwards read the sizes
    from Megatron's parallel state)."""
    gpt = unwrap(model)
    config = getattr(gpt, "config", None)
    if config is None:
        return ModelFacts(post_process=getattr(gpt, "post_process", True), pre_process=getattr(gpt, "pre_process", True))
    model_tp = getattr(config, "tensor_model_parallel_size", 1) or 1
    if getattr(config, "sequence_parallel", False) and model_tp != tp_size:
        raise ValueError(f"the model is sequence parallel over {model_tp} ranks, the forward runs tp_size={tp_size}; "
                         + (fix or f"pass tp_size={model_tp} to make_forward"))
    cp = getattr(config, "context_parallel_size", 1)
    if cp != cp_size:
        raise ValueError(f"the model's context_parallel_size is {cp}, the forward runs cp_size={cp_size}; "
                         + (fix or f"pass cp_size={cp} (and cp_rank, cp_group)"))
    post, value = getattr(gpt, "post_process", True), is_value_model(gpt)
    head = getattr(gpt, "output_layer", None)
    group = getattr(head, "tp_group", None)
    if model_tp > 1 and group is None and not value:
        from megatron.core import parallel_state

        group = parallel_state.get_tensor_model_parallel_group()
    if not post:
        width = config.hidden_size
    elif value:
        width = 1
    else:
        width = getattr(gpt, "vocab_size", 0) // model_tp or None
    return ModelFacts(post_process=post, pre_process=bool(getattr(gpt, "pre_process", True)),
                       sequence_parallel=bool(getattr(config, "sequence_parallel", False)),
                       fp8=getattr(config, "fp8", None), value_model=value, tp_size=1 if value else model_tp,
                       tp_group=group, out_width=width, dtype=getattr(config, "params_dtype", None),
                       rope_coords=_rope_coords(getattr(gpt, "position_embedding_type", None)))


def _rope_coords(embedding: str | None) -> int | str | None:
    """Position coordinates per token a model takes: 3 (multimodal RoPE), None (1-D), "any" (a model that does not
    say: not a Megatron-Core GPT model)."""
    return "any" if embedding is None else 3 if embedding == "mrope" else None


def check_cp(model, cp_size: int, cp_rank: int, cp_group) -> None:
    """The three sources of a forward's context-parallel place must agree, checked once per call on the host (no
    collective): the forward's ``cp_size``/``cp_rank`` (the batch is packed for that rank), the model
    (``config.context_parallel_size``, and the CP group its attention communicates over, ``pg_collection.cp``),
    and ``cp_group``, over which the outputs are gathered (the same ranks as the model's).  Any disagreement gives
    another rank's numbers, so it raises.  (``model_facts`` compares ``cp_size`` with the config; the plan then
    carries the place to the attention, which the model checks against its group: ``packfwd.layout.params``.)"""
    import torch.distributed as dist

    gpt = unwrap(model)
    model_group = getattr(getattr(gpt, "pg_collection", None), "cp", None)
    if model_group is not None and dist.is_available() and dist.is_initialized():
        size = model_group.size()
        rank = model_group.rank() if size > 1 else 0
        config_cp = getattr(getattr(gpt, "config", None), "context_parallel_size", size)
        if size != config_cp:
            raise ValueError(
                f"the model's config says context_parallel_size={config_cp} but its attention's CP group has {size} "
                "ranks; build the model under the parallel state it runs in (packfwd.models.build_model reads it)"
            )
        if (size, rank) != (cp_size, cp_rank):
            raise ValueError(f"cp_size={cp_size}, cp_rank={cp_rank} but the model's attention runs as CP rank {rank} "
                             f"of {size}; pass cp_size={size}, cp_rank={rank} (and that CP group)")
    if cp_size == 1:
        return
    if dist.get_world_size(cp_group) != cp_size or dist.get_rank(cp_group) != cp_rank:
        raise ValueError(
            f"cp_group has {dist.get_world_size(cp_group)} ranks and this process is its rank "
            f"{dist.get_rank(cp_group)}, but make_forward was given cp_size={cp_size}, cp_rank={cp_rank}; pass the "
            "context-parallel group (parallel_state.get_context_parallel_group()) and this process's rank in it"
        )
    if model_group is not None and dist.get_process_group_ranks(cp_group) != dist.get_process_group_ranks(model_group):
        raise ValueError(
            f"cp_group holds ranks {dist.get_process_group_ranks(cp_group)} but the model's attention communicates "
            f"over ranks {dist.get_process_group_ranks(model_group)}: the outputs would be gathered from other ranks "
            "than the attention split the sequences over; pass the model's CP group "
            "(parallel_state.get_context_parallel_group())"
        )


def empty_output(model, facts: ModelFacts, shape) -> Tensor:
    """The model's output for a batch with no real token, without running it: zeros of the model's output shape
    for zero tokens, tied to the parameters so that a backward pass gives them zero gradients."""
    if facts.out_width is None:
        raise ValueError(
            "the batch has no real token and packfwd cannot tell this model's output width; skip the call for an "
            "empty batch"
        )
    params = [p for p in model.parameters() if p.requires_grad]
    device = params[0].device if params else None
    out = torch.zeros(*shape, facts.out_width, dtype=facts.dtype, device=device)
    if params and torch.is_grad_enabled():
        out = out + sum(p.reshape(-1)[:1].sum() for p in params).to(out.dtype) * 0
    return out


def is_value_model(model: torch.nn.Module) -> bool:
    """True if ``model`` (possibly wrapped) ends in a value head: an output layer that says so
    (``value_head = True``, as :class:`packfwd.models.runtime.value.ValueHead` does).

    >>> is_value_model(torch.nn.Linear(2, 2))
    False
    """
    return getattr(getattr(unwrap(model), "output_layer", None), "value_head", False) is True


def is_moe(model: torch.nn.Module) -> bool:
    """Whether ``model`` (any wrapper) has MoE layers (its config's ``num_moe_experts``).

    >>> is_moe(torch.nn.Linear(2, 2))
    False
    """
    return bool(getattr(getattr(unwrap(model), "config", None), "num_moe_experts", None))


def check_every_ep_rank_runs(model, empty: bool) -> None:
    """Under expert parallelism every rank's MoE layers exchange tokens with the others, so a rank that skips the
    model (an empty batch or micro-batch) leaves them waiting, or pairs their exchanges with its next batch's:
    a ValueError when ``empty`` on an expert-parallel ``model`` (or list of pipeline stages)."""
    if not empty:
        return
    stages = model if isinstance(model, (list, tuple)) else [model]
    if any((getattr(getattr(unwrap(stage), "config", None), "expert_model_parallel_size", 1) or 1) > 1
           for stage in stages):
        raise ValueError(
            "an empty batch (or micro-batch) on an expert-parallel model: its expert-parallel peers exchange tokens "
            "in every MoE layer and would wait for this rank; give every expert-parallel rank at least one sequence "
            "per step (with plan_micro_batches: fewer micro-batches, so none is empty)"
        )
