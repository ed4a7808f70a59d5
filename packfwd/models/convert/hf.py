"""HF transformers models <-> packfwd's Megatron-Core models: configs, and weights loaded into modules.

The families converted are the entries of :data:`packfwd.models.families.FAMILIES` (Llama, Qwen2, ...).
:func:`args_from_hf_config` reads a transformers config through its family's entry; :func:`from_hf` builds a
model (TP-sharded, any pipeline stage) with a transformers model's weights and :func:`to_hf_state_dict` reads them
back, through the pure state-dict conversions of :mod:`packfwd.models.convert.hf_weights` (which also describes the
weight layout).
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import Tensor

from ..args import ModelArgs
from ..families import family_of_hf_config
from ..mlp.moe_weights import expert_shard, expert_tp_shard, merge_expert_shards
from .hf_weights import hf_to_megatron, megatron_to_hf

__all__ = ["args_from_hf_config", "from_hf", "load_weights", "to_hf_state_dict"]


def args_from_hf_config(hf_config, *, value_head: bool = False) -> ModelArgs:
    """:class:`ModelArgs` of a transformers config of one of packfwd's families (``LlamaConfig``,
    ``Qwen2Config``, ...: :data:`packfwd.models.families.FAMILIES`, read by the family's entry);
    ``value_head``: a width-1 head.

    >>> from transformers import Qwen2Config
    >>> args = args_from_hf_config(Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    ...                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=128))
    >>> args.family, args.num_query_groups, args.qkv_bias, args.rope_theta
    ('qwen2', 2, True, 10000.0)
    """
    fields = family_of_hf_config(hf_config).hf_fields(hf_config)
    return ModelArgs(
        **fields,
        value_head=value_head,
        value_head_bias=value_head and bool(getattr(hf_config, "token_classification_bias", True)),
    )


# ----------------------------------------------------------------------------------------------- modules


def load_weights(model: torch.nn.Module, weights: Mapping[str, Tensor]) -> torch.nn.Module:
    """Copy ``weights`` into ``model``'s parameters and persistent buffers (an MoE router's ``expert_bias``; in
    place; returns ``model``).  The names must be exactly theirs: a missing or extra name is a ValueError, a shape
    mismatch too.

    >>> layer = torch.nn.Linear(2, 1)
    >>> load_weights(layer, {"weight": torch.ones(1, 2), "bias": torch.zeros(1)})(torch.ones(2)).item()
    2.0
    """
    params = _weights(model)
    missing, extra = sorted(set(params) - set(weights)), sorted(set(weights) - set(params))
    if missing or extra:
        raise ValueError(f"weights do not match the model's parameters: missing {missing}, unexpected {extra}")
    with torch.no_grad():
        for name, p in params.items():
            w = weights[name]
            if tuple(w.shape) != tuple(p.shape):
                raise ValueError(f"{name}: weight of shape {tuple(w.shape)} for a parameter of shape {tuple(p.shape)}")
            p.copy_(w)
    return model


def from_hf(
    hf_model: torch.nn.Module,
    *,
    value_head: bool | None = None,
    device: torch.device | str | None = None,
    params_dtype: torch.dtype | None = None,
    attention_backend: str | None = None,
    tp_size: int | None = None,
    tp_rank: int | None = None,
    ep_size: int | None = None,
    ep_rank: int | None = None,
    expert_tp_size: int | None = None,
    sequence_parallel: bool = False,
    pp_rank: int = 0,
    pp_size: int = 1,
    vpp_rank: int = 0,
    vpp_size: int = 1,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
    fused: bool = True,
    mtp_state_dict: Mapping[str, Tensor] | None = None,
):
    """packfwd's Megatron-Core model (or pipeline stage) with the weights of a transformers causal LM of one of
    packfwd's families (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ...: :data:`packfwd.models.families.FAMILIES`),
    or its ``...ForTokenClassification`` with one label, as a value model (a ``...ForSequenceClassification`` reward
    model too: its score head at every token, the reward the value at the sequence's last token).

    Works in a fresh Python process: when ``torch.distributed`` is not initialised it creates a single-process
    gloo world and Megatron-Core's model-parallel state (sizes 1) itself; under a real launcher it uses the
    existing ``megatron.core.parallel_state`` and loads this process's TP shard.  ``tp_size``/``tp_rank``, when
    given, must match that state; so must ``ep_size``/``ep_rank`` (expert parallelism: this rank holds experts
    ``[r * E / ep, (r + 1) * E / ep)`` of each MoE layer, :func:`packfwd.models.mlp.moe_weights.expert_shard`; see
    :func:`packfwd.models.build_model`), and ``expert_tp_size`` (the experts' TP size, None: TP's; 1: each rank's
    experts whole, the dense weights TP-sharded).

    ``value_head``: None = a width-1 head exactly when the HF model has one (``score``); True on a causal LM
    gives a value model whose head keeps its random initialisation.  ``device``/``params_dtype`` default to the
    HF model's.  Pipeline arguments as in :func:`packfwd.models.build_model`.  ``fused``: ``ModelArgs.fused``
    (False: Megatron-Core's plain modules, for checking; the weights are the same either way).

    ``mtp_state_dict``: the checkpoint's ``mtp.*`` tensors (as safetensors reads them; transformers drops them),
    for a family with an MTP mapping (Qwen3.5, Qwen3.5-MoE, Qwen3-Next): the model is built with the config's
    ``mtp_num_hidden_layers`` MTP depths (``ModelArgs.mtp_num_layers``, on the last stage; Qwen3-Next's configs name
    none: 1) and loads them (routed experts fused or one tensor per expert); :func:`to_hf_state_dict` gives them
    back under the same names (the routed experts fused, as transformers names the decoder's).  Missing, unexpected
    or misshapen tensors are a ValueError naming them.

    >>> from transformers import Qwen2Config, Qwen2ForCausalLM
    >>> hf = Qwen2ForCausalLM(Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    ...                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=128)).eval()
    >>> model = from_hf(hf)
    >>> ids = torch.randint(0, 128, (1, 6))
    >>> torch.allclose(model(ids, None, None), hf(ids).logits, atol=1e-5)
    True
    """
    from megatron.core import parallel_state

    from packfwd.layers import layer_partition

    from ..runtime.gpt import build_model
    from ..runtime.parallel_state import ensure_pipeline

    _check_whole_model(hf_model)
    has_score = hasattr(hf_model, "score")
    if value_head is None:
        value_head = has_score
    if has_score and getattr(hf_model.config, "num_labels", 1) != 1:
        raise ValueError(
            f"the HF model's score head has num_labels={hf_model.config.num_labels}; a value model needs 1"
        )
    if has_score and not value_head:
        raise ValueError("the HF model has a score (value) head; pass value_head=True or None")
    args = args_from_hf_config(hf_model.config, value_head=value_head)
    if value_head:  # the head's bias as the model has it (a ...ForSequenceClassification's score has none)
        args = _replace(args, value_head_bias=has_score and getattr(hf_model.score, "bias", None) is not None)
    args = _replace(args, fused=fused)
    hf_state = hf_model.state_dict()
    if mtp_state_dict is not None:
        args = _replace(args, mtp_num_layers=_mtp_depths(hf_model, mtp_state_dict))
        hf_state = {**hf_state, **_checked_mtp_state(hf_model, args, mtp_state_dict)}
    first = next(hf_model.parameters())
    device = first.device if device is None else torch.device(device)
    params_dtype = first.dtype if params_dtype is None else params_dtype
    ensure_pipeline(pp_size, vpp_size, warn=False, tp_size=tp_size, ep_size=ep_size, etp_size=expert_tp_size)
    tp, rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    if tp_rank is not None and tp_rank != rank:
        raise ValueError(f"tp_rank={tp_rank} but this process is TP rank {rank}; pass tp_rank={rank} or None")
    erank = parallel_state.get_expert_model_parallel_rank()
    if ep_rank is not None and ep_rank != erank:
        raise ValueError(f"ep_rank={ep_rank} but this process is expert-parallel rank {erank}; pass ep_rank={erank} "
                         "or None")
    model = build_model(
        args, device=device, params_dtype=params_dtype, attention_backend=attention_backend, ep_size=ep_size,
        expert_tp_size=expert_tp_size, sequence_parallel=sequence_parallel, pp_rank=pp_rank, pp_size=pp_size,
        vpp_rank=vpp_rank, vpp_size=vpp_size, first_stage_layers=first_stage_layers,
        last_stage_layers=last_stage_layers, init=False,
    )
    layers = layer_partition(args.num_layers, pp_size, vpp_size, first_stage_layers=first_stage_layers,
                             last_stage_layers=last_stage_layers)[pp_rank][vpp_rank]
    weights = hf_to_megatron(hf_state, args, tp_size=tp, tp_rank=rank, layers=layers,
                             pre_process=model.pre_process, post_process=model.post_process)
    if args.moe is not None and model.config.expert_tensor_parallel_size != tp:  # 1 (build_model): whole experts
        whole = hf_to_megatron(hf_state, args, layers=layers, pre_process=False,  # the MTP layer's experts too
                               post_process=model.post_process and args.mtp_num_layers > 0)
        weights.update({n: t for n, t in whole.items() if ".local_experts." in n})
    ep = model.config.expert_model_parallel_size
    if ep > 1:
        weights = expert_shard(weights, args.moe.num_experts, ep, erank)
    if value_head and not has_score:  # keep the head as initialised
        weights.update({n: p.detach() for n, p in model.named_parameters() if n.startswith("output_layer.")})
    return load_weights(model, weights)


def _mtp_depths(hf_model, mtp_state_dict) -> int:
    """The MTP depths ``mtp_state_dict`` is read into: the config's, for a family with an MTP mapping."""
    if not isinstance(mtp_state_dict, Mapping) or not all(isinstance(t, Tensor) for t in mtp_state_dict.values()):
        raise TypeError(f"mtp_state_dict must map the checkpoint's mtp.* names to tensors (as safetensors' load_file "
                        f"reads them), got {type(mtp_state_dict).__name__}")
    depths = family_of_hf_config(hf_model.config).mtp_depths(hf_model.config)
    if not depths:
        raise ValueError("mtp_state_dict given, but the config has no MTP layers (mtp_num_hidden_layers is 0 or "
                         "absent); set config.mtp_num_hidden_layers as the checkpoint's config.json says (1 where it "
                         "names none and its files hold mtp.layers.0), or leave mtp_state_dict out")
    return depths


def _checked_mtp_state(hf_model, args: ModelArgs, mtp_state_dict) -> dict[str, Tensor]:
    """``mtp_state_dict`` checked against what the family's mapping reads, names and shapes: its own weights'
    (``Family.mtp_weights``: norms of the hidden size, the projection ``[hidden, 2 hidden]``) and the inner layer's,
    which are those of the model's decoder layers of the same components (the HF model's own tensors).  The routed
    experts may come fused (transformers' ``experts.gate_up_proj`` / ``down_proj``) or one tensor per expert
    (``experts.{e}.gate_proj.weight`` ..., as Qwen3-Next's safetensors files hold them)."""
    from ..families import family

    entry, h = family(args.family), args.hidden_size
    want = {f"mtp.{w.hf}": (h, 2 * h) if w.split == "rows" else (h,) for w in entry.mtp_weights}
    inner = entry.components(args, args.num_layers)
    like = next((i for i in range(args.num_layers) if entry.components(args, i) == inner), None)
    if like is None:
        raise ValueError(f"the MTP layer's components {[c.name for c in inner]} are in none of the decoder's layers, "
                         "whose tensors would give their names; mtp_state_dict cannot be checked")
    prefix = f"model.layers.{like}."
    want.update({f"mtp.layers.0.{n[len(prefix):]}": tuple(t.shape) for n, t in hf_model.state_dict().items()
                 if n.startswith(prefix)})
    want = _per_expert_names(want, mtp_state_dict)
    missing, extra = sorted(set(want) - set(mtp_state_dict)), sorted(set(mtp_state_dict) - set(want))
    if missing or extra:
        raise ValueError(f"mtp_state_dict does not match {entry.name}'s MTP layer: missing {missing}, unexpected "
                         f"{extra}; pass the checkpoint's mtp.* tensors, named as in its safetensors files")
    wrong = [f"{n} {tuple(t.shape)} (want {want[n]})" for n, t in mtp_state_dict.items() if tuple(t.shape) != want[n]]
    if wrong:
        raise ValueError(f"mtp_state_dict has tensors of the wrong shape: {', '.join(wrong)}; pass the mtp.* tensors "
                         "of this model's checkpoint")
    return dict(mtp_state_dict)


def _per_expert_names(want: dict, mtp_state_dict) -> dict:
    """``want`` (names -> shapes) with the MTP layer's fused routed experts named per expert where
    ``mtp_state_dict`` names them so: ``gate_proj`` / ``up_proj`` ``[f, h]`` and ``down_proj`` ``[h, f]`` of each of
    the ``E`` experts of ``gate_up_proj [E, 2f, h]``."""
    fused = [n for n in want if n.endswith(".experts.gate_up_proj")]
    for name in fused:
        experts = name[: -len("gate_up_proj")]
        if not any(n.startswith(experts) and n[len(experts):].split(".")[0].isdigit() for n in mtp_state_dict):
            continue
        (num, f2, h), down = want.pop(name), want.pop(experts + "down_proj")
        for e in range(num):
            want.update({f"{experts}{e}.gate_proj.weight": (f2 // 2, h), f"{experts}{e}.up_proj.weight": (f2 // 2, h),
                         f"{experts}{e}.down_proj.weight": down[1:]})
    return want


def _check_whole_model(hf_model) -> None:
    """``from_hf`` takes the model with its head (``LlamaForCausalLM``, ``...ForTokenClassification``), whose
    state dict names start with ``model.``; a bare decoder (``hf.model``) has neither the head nor those names."""
    if not isinstance(hf_model, torch.nn.Module) or not hasattr(hf_model, "config"):
        raise TypeError(f"from_hf takes a transformers model, got {type(hf_model).__name__}")
    if not hasattr(hf_model, "lm_head") and not hasattr(hf_model, "score"):
        raise ValueError(
            f"{type(hf_model).__name__} has no output head (lm_head or score): it is the bare decoder. Pass the "
            "whole model, e.g. from_hf(hf) for a LlamaForCausalLM rather than from_hf(hf.model)"
        )
    # a vision-language model (a vision tower's config beside the text one: Qwen3.5's model_type is no family's)
    if getattr(hf_model.config, "vision_config", None) is not None or family_of_hf_config(hf_model.config).mrope:
        raise ValueError(
            f"{type(hf_model).__name__} is a vision-language model: build it with packfwd.vision.from_hf(hf) (vision "
            "tower + language model), or its language model alone with packfwd.models.convert.hf_vl.language_model_from_hf(hf)"
        )


def to_hf_state_dict(model: torch.nn.Module) -> dict[str, Tensor]:
    """The HF transformers state dict of a packfwd model (its part of it, for a pipeline stage), on the
    model's device.  Under tensor parallelism it gathers every TP rank's shard, under expert parallelism the experts
    of every expert-parallel rank (collectives: call it on all of those ranks; each gets the whole state dict);
    whole experts (``expert_tensor_parallel_size=1``) are cut as TP's would be before the TP gather.

    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> hf = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    ...                                   num_attention_heads=4, vocab_size=128, tie_word_embeddings=True))
    >>> state = to_hf_state_dict(from_hf(hf))
    >>> sorted(state) == sorted(hf.state_dict()) and all(torch.equal(state[k], v) for k, v in hf.state_dict().items())
    True
    """
    from megatron.core import parallel_state

    from ..runtime.gpt import model_args, unwrap

    gpt = unwrap(model)
    args = model_args(gpt)
    layers = [layer.layer_number - 1 for layer in gpt.decoder.layers]
    shard = {n: p.detach() for n, p in _weights(gpt).items()}
    tp, etp = gpt.config.tensor_model_parallel_size, gpt.config.expert_tensor_parallel_size
    if gpt.config.expert_model_parallel_size > 1:  # the experts' TP size is TP's or 1 (gpt._check_expert_parallel)
        merged = merge_expert_shards(_gather(shard, parallel_state.get_expert_model_parallel_group()))
        if etp != tp:  # the expert-parallel peers are other TP ranks: keep this rank's dense shard
            merged.update({n: t for n, t in shard.items() if ".local_experts." not in n})
        shard = merged
    if args.moe is not None and etp != tp:
        shard = expert_tp_shard(shard, tp, parallel_state.get_tensor_model_parallel_rank())
    shards = [shard]
    if tp > 1:
        shards = _gather(shard, parallel_state.get_tensor_model_parallel_group())
    return megatron_to_hf(shards, args, layers=layers, pre_process=gpt.pre_process, post_process=gpt.post_process)


def _gather(shard: dict[str, Tensor], group) -> list[dict[str, Tensor]]:
    """Every rank of ``group``'s ``shard``, in rank order (gathered as objects: bitwise, any device)."""
    import torch.distributed as dist

    shards: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(shards, shard, group=group)
    return [{n: t.to(next(iter(shard.values())).device) for n, t in s.items()} for s in shards]


def _weights(model: torch.nn.Module) -> dict[str, Tensor]:
    """``model``'s parameters and persistent buffers (what its state dict holds besides extra state)."""
    kept = set(model.state_dict(keep_vars=True))
    return {**dict(model.named_parameters()), **{n: b for n, b in model.named_buffers() if n in kept}}


def _replace(args: ModelArgs, **changes) -> ModelArgs:
    from dataclasses import replace

    return replace(args, **changes)
