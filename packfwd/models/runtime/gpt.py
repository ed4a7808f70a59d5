"""Decoders of packfwd's families (:mod:`packfwd.models.families`) as Megatron-Core ``GPTModel`` s: whole models,
pipeline stages, value models.

The model is :class:`packfwd.models.runtime.model.PackedGPTModel`: Megatron-Core's own ``GPTModel`` over the layers
of :mod:`packfwd.models.runtime.spec` (each layer's token mixer and MLP, RMSNorm, tied or untied embeddings), with
Megatron's tensor-parallel linears and embeddings, and packfwd's parts chosen by its constructor (THD RoPE without
host syncs, the value head).  This module is the builder, the top of :mod:`packfwd.models` below its HF conversion:

* :func:`build_model`, which builds the whole model or one pipeline stage (``pp_rank``, ``vpp_rank``) with the
  layers ``packfwd.layers.layer_partition`` assigns to it; Megatron-Core numbers them (``layer_number``, 1-based,
  global) and the model checks the numbers against the partition;
* :func:`model_args`, the :class:`ModelArgs` a built model was made from.

It also re-exports :class:`ValueHead` and :func:`is_value_model` (:mod:`packfwd.models.runtime.value`) and
:func:`unwrap` (:mod:`packfwd._validate`).  Megatron-Core is imported inside the functions only.
"""

from __future__ import annotations

import torch

from packfwd._validate import unwrap as unwrap

from ..args import ModelArgs
from ..mixers import mixers
from ..mlp import DENSE
from .config import transformer_config
from .value import ValueHead as ValueHead
from .value import is_value_model as is_value_model

__all__ = ["ValueHead", "build_model", "is_value_model", "model_args", "unwrap"]


def build_model(
    args: ModelArgs,
    *,
    device: torch.device | str = "cpu",
    params_dtype: torch.dtype = torch.float32,
    attention_backend: str | None = None,
    tp_size: int | None = None,
    cp_size: int | None = None,
    ep_size: int | None = None,
    expert_tp_size: int | None = None,
    sequence_parallel: bool = False,
    pp_rank: int = 0,
    pp_size: int = 1,
    vpp_rank: int = 0,
    vpp_size: int = 1,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
    init: bool = True,
    packed_rope: bool = True,
):
    """A :class:`~packfwd.models.runtime.model.PackedGPTModel` (Megatron-Core's ``GPTModel``) for ``args`` on ``device``:
    the whole model, or one pipeline stage.

    Parallel sizes come from ``megatron.core.parallel_state`` (``tp_size``/``cp_size``, when given, must match
    it); without ``torch.distributed`` a one-process world is created first
    (:func:`packfwd.models.runtime.ensure_model_parallel`).  The stage ``(pp_rank, vpp_rank)`` of a
    ``pp_size x vpp_size`` pipeline holds ``layer_partition(num_layers, pp_size, vpp_size, ...)[pp_rank][vpp_rank]``;
    it embeds tokens only if it is the first stage (``pre_process``) and has the output layer only if it is the
    last (``post_process``); a later stage takes its input through ``model.set_input_tensor``.  Any stage can be
    built in a single process (see :func:`packfwd.models.runtime.stage_process_groups`).

    Expert parallelism (``ep_size``, Megatron-Core's ``expert_model_parallel_size``; None: whatever
    ``parallel_state`` says): an MoE layer holds experts ``[r * E / ep, (r + 1) * E / ep)`` of expert-parallel rank
    ``r``; expert-parallel ranks are data-parallel ranks, each with a batch of its own shape
    (:mod:`packfwd.models.mlp.dispatch`; on the CPU run the backward inside ``host_collectives()``).  Built and tested
    with CP >= 1 (the expert-parallel ranks drawn from the CP x DP ranks), PP >= 1, and TP = 1 or TP > 1 with
    ``sequence_parallel=True``; the experts' TP size
    ``expert_tp_size`` (Megatron-Core's ``expert_tensor_parallel_size``; None: TP's) is TP's or 1 (whole experts,
    the expert-parallel group then made of TP ranks); other combinations raise NotImplementedError.

    ``sequence_parallel=True`` on the CPU (gloo): the forward works as is, the backward must run inside
    ``packfwd.models.runtime.cpu.host_collectives()`` (Megatron allocates its gather buffers on CUDA otherwise; see
    :mod:`packfwd.models.runtime.cpu`, point 5).

    ``attention_backend``: see :mod:`packfwd.models.mixers.varlen`.  ``init=False`` leaves weights uninitialised (fast;
    for loading).  Weights are randomly initialised by Megatron otherwise (on the CPU from torch's default
    generator: seed it with ``torch.manual_seed``).  ``packed_rope=False``: Megatron-Core's own THD RoPE (two
    host syncs per call; for comparison) instead of packfwd's (:mod:`packfwd.models.mixers.rope`).

    >>> args = ModelArgs(vocab_size=128, hidden_size=64, ffn_hidden_size=128, num_layers=4, num_attention_heads=4)
    >>> model = build_model(args)
    >>> model(torch.randint(0, 128, (2, 5)), None, None).shape  # [b, s, v]
    torch.Size([2, 5, 128])
    >>> stage = build_model(args, pp_rank=1, pp_size=2, init=False)
    >>> [layer.layer_number for layer in stage.decoder.layers], stage.pre_process, stage.post_process
    ([3, 4], False, True)
    """
    from megatron.core import parallel_state

    from packfwd.layers import layer_partition

    from .cpu import ensure_cuda_rng_tracker, ensure_host_rng_tracker, is_host
    from ..mlp.dispatch import pad_expert_parallel
    from .model import PackedGPTModel
    from .parallel_state import ensure_pipeline, stage_process_groups

    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device}: packfwd's models run on 'cpu' or 'cuda' devices")
    if not isinstance(args, ModelArgs):
        raise TypeError(f"args must be a packfwd.models.ModelArgs, got {type(args).__name__}")
    partition = layer_partition(args.num_layers, pp_size, vpp_size, first_stage_layers=first_stage_layers,
                                last_stage_layers=last_stage_layers)
    if not 0 <= pp_rank < pp_size or not 0 <= vpp_rank < vpp_size:
        raise ValueError(f"pp_rank={pp_rank}, vpp_rank={vpp_rank} must lie in [0, pp_size={pp_size}) and "
                         f"[0, vpp_size={vpp_size})")
    ensure_pipeline(pp_size, vpp_size, tp_size=tp_size, cp_size=cp_size, ep_size=ep_size, etp_size=expert_tp_size)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    _check_divisible(args, tp)
    etp = parallel_state.get_expert_tensor_parallel_world_size()
    ep = _check_expert_parallel(args, parallel_state.get_expert_model_parallel_world_size(), tp, pp_size,
                                sequence_parallel, etp)
    config = transformer_config(
        args, params_dtype=params_dtype, device=device, tp_size=tp,
        cp_size=parallel_state.get_context_parallel_world_size(), sequence_parallel=sequence_parallel,
        pp_size=pp_size, vpp_size=vpp_size, first_stage_layers=first_stage_layers,
        last_stage_layers=last_stage_layers, init=init,
    )
    config.expert_model_parallel_size = ep  # Megatron-Core's MoE layers read their groups; keep the config true
    if args.moe is not None:
        config.expert_tensor_parallel_size = etp  # 1: whole experts (from_hf and to_hf_state_dict read it)
    if not is_host(device):
        ensure_cuda_rng_tracker()
    elif sequence_parallel:
        ensure_host_rng_tracker()  # Megatron enters the RNG tracker in sequence-parallel regions (cpu.py)
    model = PackedGPTModel(
        config, args, layers=partition[pp_rank][vpp_rank], device=device, attention_backend=attention_backend,
        packed_rope=packed_rope, pre_process=pp_rank == 0 and vpp_rank == 0,
        post_process=pp_rank == pp_size - 1 and vpp_rank == vpp_size - 1,
        pg_collection=stage_process_groups(pp_rank, pp_size), vp_stage=vpp_rank if vpp_size > 1 else None,
    )
    pad_expert_parallel(model)  # the ordered combine; ranks with batches of their own shape under EP (dispatch.py)
    return model if init else _mark_tensor_parallel(model)


def _mark_tensor_parallel(model):
    """Megatron-Core tags a tensor-parallel weight (``tensor_model_parallel``, ``partition_dim``,
    ``partition_stride``) only while it initialises it; a model built for loading (``init=False``) gets the same
    tags here.  Megatron's grad-norm clipping reads them (an untagged shard counts as a duplicate on every TP rank
    but the first), and so do checkpoint exporters."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    gated = model.config.gated_linear_unit
    for name, module in model.named_modules():
        dim = 1 if isinstance(module, RowParallelLinear) else 0
        weight = getattr(module, "weight", None)
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)) or weight is None:
            continue
        if not getattr(weight, "tensor_model_parallel", False):
            stride = 2 if gated and name.endswith("linear_fc1") else 1  # [gate; up] interleaved per rank
            weight.tensor_model_parallel, weight.partition_dim, weight.partition_stride = True, dim, stride
    return model


def _check_expert_parallel(args: ModelArgs, ep: int, tp: int, pp_size: int, sequence_parallel: bool = False,
                           etp: int | None = None) -> int:
    """The expert-parallel size of ``args``'s model in a world of ``ep`` expert-parallel ranks (1 for a dense
    model); ValueError / NotImplementedError where the experts cannot be split as asked.

    With TP the experts' tensor-parallel size ``etp`` (None: TP's) is TP's (Megatron-Core's default
    ``expert_tensor_parallel_size``: HF weights shard the experts like the dense MLP) or 1 (whole experts, as
    Qwen3-MoE recipes run; the expert-parallel group is then made of TP ranks); the dispatcher gathers the tokens of
    the ETP x EP group: built with sequence parallelism only (each TP rank routes its own slice of the tokens).
    Another ETP, or ETP=1 without expert parallelism, is a NotImplementedError (not built: HF weights and the way
    back are split at TP's size or 1 only).

    With PP each stage's MoE layers exchange tokens over that stage's TP x EP group (Megatron-Core's pipeline
    groups are the same for the expert and the dense parts), the EP peers of a stage running the same layers on
    their own batches in the same order (tested: PP=2 x EP=2 through ``packfwd.parallel.pipeline_forward_backward``).
    With CP Megatron-Core draws the expert-parallel ranks from the CP x DP ranks (its expert grid has no CP): a
    rank's tokens are its CP share of its batch, exchanged with the other shares and batches as any ranks' tokens
    of their own count are (routing is per token, the plan's pads are routed nowhere; tested: CP=2 x DP=2, EP=4)."""
    if args.moe is None:
        return 1
    if args.linear_bias and tp > 1 and etp != 1:
        raise ValueError(f"tp_size={tp} with biased experts (linear_bias: GPT-OSS): Megatron-Core adds an expert's "
                         "row-parallel bias on every TP rank of the experts, so it builds biased experts whole only "
                         "(expert_tensor_parallel_size=1); pass expert_tp_size=1 with ep_size > 1")
    if etp is not None and etp != tp and (etp != 1 or ep == 1):
        raise NotImplementedError(f"ep_size={ep} with expert_tensor_parallel_size={etp} and tp_size={tp}: packfwd "
                                  "builds the experts TP-sharded like the dense MLP, or whole (size 1) under expert "
                                  "parallelism; initialise megatron.core.parallel_state with "
                                  "expert_tensor_parallel_size=None (TP's size), or 1 with ep_size > 1")
    if ep == 1:
        return 1
    if args.moe.num_experts % ep:
        raise ValueError(f"num_experts={args.moe.num_experts} does not split over ep_size={ep}; pick an "
                         "expert-parallel size that divides it")
    if tp > 1 and not sequence_parallel:
        raise NotImplementedError(f"ep_size={ep} with tp_size={tp} and sequence_parallel=False: packfwd builds and "
                                  "tests expert parallelism with TP under sequence parallelism only; pass "
                                  "sequence_parallel=True")
    return ep


def _check_divisible(args: ModelArgs, tp: int) -> None:
    """Every width tensor parallelism splits (the vocabulary, and each layer component's) divides by ``tp``."""
    widths = (("vocab_size", args.vocab_size), *(w for m in mixers(args) for w in m.tp_widths(args)),
              *DENSE.tp_widths(args))
    for name, value in widths:
        if value % tp:
            raise ValueError(f"{name}={value} is not divisible by the tensor-parallel size {tp}; pick a TP size "
                             "that divides it")


def model_args(model: torch.nn.Module) -> ModelArgs:
    """The :class:`ModelArgs` a built model (or stage) was made from, read back from its config and modules (its
    ``family``, ``moe`` and ``fused`` from what the constructor keeps; a model built by other means reads as a
    plain Llama).

    The model does not keep ``rope_scaling_factor``: it reads back as None (the weights do not depend on it).

    >>> args = ModelArgs(vocab_size=128, hidden_size=64, ffn_hidden_size=128, num_layers=2, num_attention_heads=4,
    ...                  num_query_groups=2, head_dim=16, tie_embeddings=True, family="qwen2")
    >>> model_args(build_model(args, init=False)) == args
    True
    """
    gpt = unwrap(model)
    cfg = gpt.config
    head = getattr(gpt, "output_layer", None)
    value = isinstance(head, ValueHead)
    return ModelArgs(
        vocab_size=gpt.vocab_size,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size,
        num_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        head_dim=cfg.kv_channels,
        norm_eps=cfg.layernorm_epsilon,
        rope_theta=gpt.rotary_base,
        rope_scaling_factor=None,
        rotary_percent=gpt.rotary_percent,
        qkv_bias=cfg.add_qkv_bias,
        qk_norm=cfg.qk_layernorm,
        linear_bias=cfg.add_bias_linear,
        tie_embeddings=gpt.share_embeddings_and_output_weights,
        max_position_embeddings=gpt.max_sequence_length,
        value_head=value,
        value_head_bias=value and head.bias is not None,
        mtp_num_layers=cfg.mtp_num_layers or 0,
        mrope_section=tuple(cfg.mrope_section) if cfg.mrope_section is not None else None,
        mrope_interleaved=bool(getattr(getattr(gpt, "rotary_pos_emb", None), "mrope_interleaved", False)),
        mtp_loss_scaling_factor=cfg.mtp_loss_scaling_factor,
        family=getattr(gpt, "family", "llama"),
        moe=getattr(gpt, "moe", None),
        mla=getattr(gpt, "mla", None),
        fused=getattr(gpt, "fused", False),
        attention_output_gate=bool(getattr(cfg, "attention_output_gate", False)),
        linear_attention=getattr(gpt, "linear_attention", None),
        norm_zero_centered=bool(getattr(cfg, "layernorm_zero_centered_gamma", False)),
        attention_windows=_windows(cfg),
        attention_sinks=getattr(cfg, "softmax_type", "vanilla") == "learnable",
        rope_yarn=getattr(getattr(gpt, "rotary_pos_emb", None), "yarn", None),
    )


def _windows(cfg) -> tuple[int | None, ...] | None:
    """``ModelArgs.attention_windows`` of a config (Megatron-Core's ``window_size`` on the layers
    ``window_attn_skip_freq`` marks, as :func:`~packfwd.models.mixers.softmax.SoftmaxAttention.config_fields`
    writes them)."""
    size, layers = getattr(cfg, "window_size", None), getattr(cfg, "window_attn_skip_freq", None)
    if not size:
        return None
    return tuple(size[0] + 1 if flag else None for flag in layers)
