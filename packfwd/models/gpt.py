"""Llama/Qwen2-style decoders as Megatron-Core ``GPTModel`` s: whole models, pipeline stages, value models.

The model is :class:`packfwd.models.model.PackedGPTModel`: Megatron-Core's own ``GPTModel`` over the layers of
:mod:`packfwd.models.spec` (RMSNorm, SwiGLU MLP, RoPE, grouped-query attention, optional QKV bias, tied or untied
embeddings), with Megatron's tensor-parallel linears and embeddings, and packfwd's parts chosen by its
constructor (THD RoPE without host syncs, the value head).  This module holds what needs no Megatron-Core:

* :class:`ModelArgs`, the architecture in one frozen dataclass, and :func:`transformer_config` from it;
* :func:`build_model`, which builds the whole model or one pipeline stage (``pp_rank``, ``vpp_rank``) with the
  layers ``packfwd.layers.layer_partition`` assigns to it; Megatron-Core numbers them (``layer_number``, 1-based,
  global) and the model checks the numbers against the partition;
* :class:`ValueHead`: a value model's width-1 output layer, so the model returns ``[b, s, 1]`` (packfwd's
  forward squeezes it to ``[b, s]``); :func:`is_value_model`, :func:`unwrap`, :func:`model_args`.

Megatron-Core is imported inside the functions only.  (A little over 300 lines: the architecture, its Megatron
config and the builder are one story, and the model facts the forward needs must not import Megatron-Core.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ModelArgs", "ValueHead", "build_model", "is_value_model", "model_args", "transformer_config", "unwrap"]


@dataclass(frozen=True)
class ModelArgs:
    """The architecture of a Llama/Qwen2-style decoder.

    >>> args = ModelArgs(vocab_size=128, hidden_size=64, ffn_hidden_size=128, num_layers=2, num_attention_heads=4,
    ...                  num_query_groups=2)
    >>> args.kv_channels, args.query_groups
    (16, 2)
    """

    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int | None = None  # None: one kv head per query head (no GQA)
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling_factor: float | None = None  # Llama-3.x frequency scaling (low 1, high 4, original 8192)
    qkv_bias: bool = False  # Qwen2
    linear_bias: bool = False  # a bias on every linear (Llama with attention_bias and mlp_bias)
    tie_embeddings: bool = False
    max_position_embeddings: int = 4096
    value_head: bool = False  # output layer of width 1 (a critic / reward model)
    value_head_bias: bool = False
    mtp_num_layers: int = 0  # multi-token prediction depths (DeepSeek-V3's MTP), built on the last stage
    mtp_loss_scaling_factor: float = 0.1  # Megatron-Core's weight of the MTP loss (Megatron's default)
    mrope_section: tuple[int, int, int] | None = None  # Qwen2-VL multimodal RoPE: (t, h, w) frequencies, sum d/2

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "ffn_hidden_size", "num_layers", "num_attention_heads",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelArgs.{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.query_groups:
            raise ValueError(f"num_query_groups={self.num_query_groups} must divide "
                             f"num_attention_heads={self.num_attention_heads}")
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads, or pass head_dim")
        if isinstance(self.mtp_num_layers, bool) or not isinstance(self.mtp_num_layers, int) or self.mtp_num_layers < 0:
            raise ValueError(f"ModelArgs.mtp_num_layers must be an int >= 0 (0: no MTP), got {self.mtp_num_layers!r}")
        if self.mtp_num_layers and self.value_head:
            raise ValueError("a value model (value_head=True) has no vocabulary head to predict tokens with; "
                             "use mtp_num_layers=0")
        if self.mrope_section is not None:
            object.__setattr__(self, "mrope_section", check_mrope_section(self.mrope_section, self.kv_channels))
            if self.rope_scaling_factor is not None or self.mtp_num_layers:
                raise ValueError("mrope_section with rope_scaling_factor or mtp_num_layers: multimodal RoPE is built "
                                 "without Llama-3 scaling and without MTP layers; drop one of them")

    @property
    def kv_channels(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        return self.num_query_groups if self.num_query_groups is not None else self.num_attention_heads


def check_mrope_section(section, kv_channels: int) -> tuple[int, int, int]:
    """``section`` as three positive ints summing to ``kv_channels // 2`` (:mod:`packfwd.models.mrope`).

    >>> check_mrope_section([16, 24, 24], 128)
    (16, 24, 24)
    """
    values = tuple(section) if isinstance(section, (list, tuple)) else ()
    if (len(values) != 3 or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values)
            or sum(values) * 2 != kv_channels):
        raise ValueError(
            f"mrope_section={section!r}: pass three positive ints (temporal, height, width frequencies) that sum to "
            f"head_dim // 2 = {kv_channels // 2}, as in the HF config's rope_parameters['mrope_section']"
        )
    return values


def transformer_config(
    args: ModelArgs,
    *,
    params_dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    tp_size: int = 1,
    cp_size: int = 1,
    sequence_parallel: bool = False,
    pp_size: int = 1,
    vpp_size: int = 1,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
    init: bool = True,
):
    """Megatron-Core's ``TransformerConfig`` for ``args``: no dropout, no fused kernels (the unfused paths run
    on every device and match HF transformers' math), parameters placed for ``device``
    (:func:`packfwd.models.cpu.config_overrides`).  ``init=False`` skips weight initialisation (for loading).

    >>> args = ModelArgs(vocab_size=128, hidden_size=64, ffn_hidden_size=128, num_layers=2, num_attention_heads=4,
    ...                  num_query_groups=2)
    >>> config = transformer_config(args)
    >>> config.num_query_groups, config.kv_channels, config.normalization, config.gated_linear_unit
    (2, 16, 'RMSNorm', True)
    """
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    from .cpu import config_overrides

    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.query_groups,
        kv_channels=args.kv_channels,
        normalization="RMSNorm",
        layernorm_epsilon=args.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=args.linear_bias,
        add_qkv_bias=args.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        tensor_model_parallel_size=tp_size,
        context_parallel_size=cp_size,
        sequence_parallel=sequence_parallel,
        pipeline_model_parallel_size=pp_size,
        virtual_pipeline_model_parallel_size=vpp_size if vpp_size > 1 else None,
        num_layers_in_first_pipeline_stage=first_stage_layers,
        num_layers_in_last_pipeline_stage=last_stage_layers,
        perform_initialization=init,
        mtp_num_layers=args.mtp_num_layers or None,
        mrope_section=list(args.mrope_section) if args.mrope_section is not None else None,
        mtp_loss_scaling_factor=args.mtp_loss_scaling_factor,
        **config_overrides(device),
    )


class ValueHead(torch.nn.Linear):
    """The width-1 output layer of a value model, called like Megatron's output layer:
    ``(hidden [s, b, h], weight=None, runtime_gather_output=None) -> ([s, b, 1], None)``.

    Replicated on every TP rank; under sequence parallelism the token slices are gathered first.

    >>> import torch
    >>> head = ValueHead(4, bias=False)
    >>> head(torch.ones(3, 2, 4))[0].shape
    torch.Size([3, 2, 1])
    """

    def __init__(self, hidden_size: int, *, bias: bool, dtype: torch.dtype = torch.float32,
                 sequence_parallel: bool = False, tp_group=None):
        super().__init__(hidden_size, 1, bias=bias, dtype=dtype)
        self.sequence_parallel = sequence_parallel
        self.tp_group = tp_group

    def forward(self, hidden: torch.Tensor, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, group=self.tp_group)
        return super().forward(hidden), None


def build_model(
    args: ModelArgs,
    *,
    device: torch.device | str = "cpu",
    params_dtype: torch.dtype = torch.float32,
    attention_backend: str | None = None,
    tp_size: int | None = None,
    cp_size: int | None = None,
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
    """A :class:`~packfwd.models.model.PackedGPTModel` (Megatron-Core's ``GPTModel``) for ``args`` on ``device``:
    the whole model, or one pipeline stage.

    Parallel sizes come from ``megatron.core.parallel_state`` (``tp_size``/``cp_size``, when given, must match
    it); without ``torch.distributed`` a one-process world is created first
    (:func:`packfwd.models.runtime.ensure_model_parallel`).  The stage ``(pp_rank, vpp_rank)`` of a
    ``pp_size x vpp_size`` pipeline holds ``layer_partition(num_layers, pp_size, vpp_size, ...)[pp_rank][vpp_rank]``;
    it embeds tokens only if it is the first stage (``pre_process``) and has the output layer only if it is the
    last (``post_process``); a later stage takes its input through ``model.set_input_tensor``.  Any stage can be
    built in a single process (see :func:`packfwd.models.runtime.stage_process_groups`).

    ``sequence_parallel=True`` on the CPU (gloo): the forward works as is, the backward must run inside
    ``packfwd.models.cpu.host_collectives()`` (Megatron allocates its gather buffers on CUDA otherwise; see
    :mod:`packfwd.models.cpu`, point 5).

    ``attention_backend``: see :mod:`packfwd.models.varlen`.  ``init=False`` leaves weights uninitialised (fast;
    for loading).  Weights are randomly initialised by Megatron otherwise (on the CPU from torch's default
    generator: seed it with ``torch.manual_seed``).  ``packed_rope=False``: Megatron-Core's own THD RoPE (two
    host syncs per call; for comparison) instead of packfwd's (:mod:`packfwd.models.rope`).

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
    from .model import PackedGPTModel
    from .runtime import ensure_model_parallel, stage_process_groups

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
    ensure_model_parallel(tp_size=tp_size, cp_size=cp_size)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    _check_divisible(args, tp)
    config = transformer_config(
        args, params_dtype=params_dtype, device=device, tp_size=tp,
        cp_size=parallel_state.get_context_parallel_world_size(), sequence_parallel=sequence_parallel,
        pp_size=pp_size, vpp_size=vpp_size, first_stage_layers=first_stage_layers,
        last_stage_layers=last_stage_layers, init=init,
    )
    if not is_host(device):
        ensure_cuda_rng_tracker()
    elif sequence_parallel:
        ensure_host_rng_tracker()  # Megatron enters the RNG tracker in sequence-parallel regions (cpu.py)
    return PackedGPTModel(
        config, args, layers=partition[pp_rank][vpp_rank], device=device, attention_backend=attention_backend,
        packed_rope=packed_rope, pre_process=pp_rank == 0 and vpp_rank == 0,
        post_process=pp_rank == pp_size - 1 and vpp_rank == vpp_size - 1,
        pg_collection=stage_process_groups(pp_rank, pp_size), vp_stage=vpp_rank if vpp_size > 1 else None,
    )


def _check_divisible(args: ModelArgs, tp: int) -> None:
    for name, value in (("vocab_size", args.vocab_size), ("num_query_groups", args.query_groups),
                        ("num_attention_heads", args.num_attention_heads), ("ffn_hidden_size", args.ffn_hidden_size)):
        if value % tp:
            raise ValueError(f"{name}={value} is not divisible by the tensor-parallel size {tp}; pick a TP size "
                             "that divides it")


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The ``GPTModel`` inside wrappers that keep it as ``.module`` (DDP, Megatron's Float16Module, ...).

    >>> import torch
    >>> class Wrapper(torch.nn.Module):
    ...     def __init__(self, module):
    ...         super().__init__()
    ...         self.module = module
    >>> inner = torch.nn.Linear(2, 2)
    >>> unwrap(Wrapper(Wrapper(inner))) is inner
    True
    """
    seen = 0
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module) and seen < 8:
        model, seen = model.module, seen + 1
    return model


def is_value_model(model: torch.nn.Module) -> bool:
    """True if ``model`` (possibly wrapped) ends in a :class:`ValueHead`.

    >>> args = ModelArgs(vocab_size=128, hidden_size=64, ffn_hidden_size=128, num_layers=1, num_attention_heads=4,
    ...                  value_head=True)
    >>> is_value_model(build_model(args, init=False))
    True
    """
    return isinstance(getattr(unwrap(model), "output_layer", None), ValueHead)


def model_args(model: torch.nn.Module) -> ModelArgs:
    """The :class:`ModelArgs` a built model (or stage) was made from, read back from its config and modules.

    The model does not keep ``rope_scaling_factor``: it reads back as None (the weights do not depend on it).

    >>> args = ModelArgs(vocab_size=128, hidden_size=64, ffn_hidden_size=128, num_layers=2, num_attention_heads=4,
    ...                  num_query_groups=2, head_dim=16, tie_embeddings=True)
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
        qkv_bias=cfg.add_qkv_bias,
        linear_bias=cfg.add_bias_linear,
        tie_embeddings=gpt.share_embeddings_and_output_weights,
        max_position_embeddings=gpt.max_sequence_length,
        value_head=value,
        value_head_bias=value and head.bias is not None,
        mtp_num_layers=cfg.mtp_num_layers or 0,
        mrope_section=tuple(cfg.mrope_section) if cfg.mrope_section is not None else None,
        mtp_loss_scaling_factor=cfg.mtp_loss_scaling_factor,
    )
