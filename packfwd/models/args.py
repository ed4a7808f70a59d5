"""The architecture of one decoder in one frozen dataclass (:class:`ModelArgs`: its family's entry and its
numbers), and Megatron-Core's ``TransformerConfig`` from it (:func:`transformer_config`).

Near the bottom of :mod:`packfwd.models`: it imports :mod:`packfwd.models.families.family` (the families and MLP kinds)
and :mod:`packfwd.models.runtime.cpu` (inside :func:`transformer_config`) only, and Megatron-Core only inside that
function.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .families.family import Moe, family, mlp_kind
from .mixers.latent import Mla, mla_config_fields

__all__ = ["ModelArgs", "check_mrope_section", "check_rotary_percent", "transformer_config"]


@dataclass(frozen=True)
class ModelArgs:
    """The architecture of a decoder: ``family`` names its entry of :data:`packfwd.models.families.family.FAMILIES` (QK-norm,
    which linears carry a bias, the HF weight names), the other fields its numbers and per-model choices.

    >>> args = ModelArgs(vocab_size=128, hidden_size=64, ffn_hidden_size=128, num_layers=2, num_attention_heads=4,
    ...                  num_query_groups=2)
    >>> args.kv_channels, args.query_groups
    (16, 2)
    >>> ModelArgs(vocab_size=64, hidden_size=32, ffn_hidden_size=64, num_layers=1, num_attention_heads=4,
    ...           family="qwen2").qkv_bias
    True
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
    rotary_percent: float = 1.0  # partial RoPE: the first int(head_dim * this) channels of each head rotate (GLM-4.5)
    qkv_bias: bool | None = None  # a bias on q, k, v only; None: the family's (Qwen2: True)
    qk_norm: bool | None = None  # RMSNorm over head_dim on q and k before RoPE; None: the family's (Qwen3: True)
    linear_bias: bool = False  # a bias on every linear (Llama with attention_bias and mlp_bias)
    tie_embeddings: bool = False
    max_position_embeddings: int = 4096
    value_head: bool = False  # output layer of width 1 (a critic / reward model)
    value_head_bias: bool = False
    mtp_num_layers: int = 0  # multi-token prediction depths (DeepSeek-V3's MTP), built on the last stage
    mtp_loss_scaling_factor: float = 0.1  # Megatron-Core's weight of the MTP loss (Megatron's default)
    mrope_section: tuple[int, int, int] | None = None  # Qwen2-VL multimodal RoPE: (t, h, w) frequencies, sum d/2
    family: str = "llama"  # the entry of packfwd.models.families.family.FAMILIES
    moe: Moe | None = None  # a Mixture-of-Experts MLP (but on moe.dense_layers); None: dense SwiGLU everywhere
    mla: Mla | None = None  # multi-head latent attention (DeepSeek-V3; packfwd.models.mixers.latent); None: grouped-query
    fused: bool = True  # packfwd's fused kernels on CUDA (RMSNorm, SwiGLU, THD RoPE; same weights, numbers within
    #  rounding, the torch path elsewhere); False: Megatron-Core's plain modules, for checking

    def __post_init__(self):
        entry = family(self.family)
        if not isinstance(self.fused, bool):
            raise TypeError(f"ModelArgs.fused must be True (packfwd's fused kernels) or False (Megatron-Core's plain "
                            f"modules), got {self.fused!r}")
        if self.qkv_bias is None:
            object.__setattr__(self, "qkv_bias", entry.qkv_bias)
        if self.qk_norm is None:
            object.__setattr__(self, "qk_norm", entry.qk_norm)
        for name in ("vocab_size", "hidden_size", "ffn_hidden_size", "num_layers", "num_attention_heads",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelArgs.{name} must be a positive int, got {value!r}")
        self._check_mla(entry)
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
        object.__setattr__(self, "rotary_percent", check_rotary_percent(self.rotary_percent, self.kv_channels))
        if self.mrope_section is not None:
            if self.rotary_percent != 1.0:
                raise ValueError(f"mrope_section with rotary_percent={self.rotary_percent}: multimodal RoPE rotates "
                                 "every channel; pass rotary_percent=1.0")
            object.__setattr__(self, "mrope_section", check_mrope_section(self.mrope_section, self.kv_channels))
            if self.rope_scaling_factor is not None or self.mtp_num_layers:
                raise ValueError("mrope_section with rope_scaling_factor or mtp_num_layers: multimodal RoPE is built "
                                 "without Llama-3 scaling and without MTP layers; drop one of them")
        if self.moe is not None:
            if not isinstance(self.moe, Moe):
                raise TypeError(f"ModelArgs.moe must be a packfwd.models.families.family.Moe or None, got {type(self.moe)}")
            if self.moe.dense_layers and self.moe.dense_layers[-1] >= self.num_layers:
                raise ValueError(f"Moe.dense_layers={self.moe.dense_layers} names a layer beyond num_layers="
                                 f"{self.num_layers}")

    def _check_mla(self, entry) -> None:
        """``mla`` exactly for a family with latent attention, and none of the grouped-query attention's options
        (its head dim is the query-key one, ``qk_nope_head_dim + qk_rope_head_dim``)."""
        wants = entry.read_mla is not None
        if self.mla is None:
            if wants:
                raise ValueError(f"family={self.family!r} has multi-head latent attention: pass mla=Mla(...) "
                                 "(packfwd.models.mixers.latent), e.g. through args_from_hf_config")
            return
        if not isinstance(self.mla, Mla):
            raise TypeError(f"ModelArgs.mla must be a packfwd.models.mixers.latent.Mla or None, got {type(self.mla)}")
        if not wants:
            raise ValueError(f"mla given for family={self.family!r}, whose attention is grouped-query; pass "
                             "family='deepseek_v3' or mla=None")
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.mla.qk_head_dim)
        wrong = {name: value for name, value in (
            ("head_dim", self.head_dim if self.head_dim != self.mla.qk_head_dim else None),
            ("num_query_groups", self.num_query_groups if self.query_groups != self.num_attention_heads else None),
            ("qk_norm", self.qk_norm or None), ("qkv_bias", self.qkv_bias or None),
            ("linear_bias", self.linear_bias or None), ("rope_scaling_factor", self.rope_scaling_factor),
            ("rotary_percent", self.rotary_percent if self.rotary_percent != 1.0 else None),
            ("mrope_section", self.mrope_section), ("mtp_num_layers", self.mtp_num_layers or None)) if value}
        if wrong:
            raise ValueError(f"ModelArgs {wrong} with mla: multi-head latent attention is built with head_dim = "
                             f"qk_nope_head_dim + qk_rope_head_dim = {self.mla.qk_head_dim} (or None), one key and "
                             "value per head, no QK-norm, no biases, full RoPE (YaRN in mla.yarn) and no MTP layers; "
                             "leave these at their defaults")

    def dense_mlp(self, layer: int) -> bool:
        """Whether global layer ``layer`` (0-based) has a dense SwiGLU MLP (else the MLP ``moe`` describes)."""
        return self.moe is None or layer in self.moe.dense_layers

    @property
    def kv_channels(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        return self.num_query_groups if self.num_query_groups is not None else self.num_attention_heads


def check_rotary_percent(percent, kv_channels: int) -> float:
    """``percent`` as a float if ``0 < percent <= 1`` and ``int(kv_channels * percent)`` (the channels RoPE rotates,
    Megatron-Core's and transformers' rounding; the rest pass through) is even and positive; else ValueError.

    >>> check_rotary_percent(0.5, 128)
    0.5
    >>> check_rotary_percent(0.375, 8)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: rotary_percent=0.375 of head_dim=8 rotates int(8 * 0.375) = 3 channels; RoPE turns pairs of ...
    """
    if isinstance(percent, bool) or not isinstance(percent, (int, float)) or not 0 < percent <= 1:
        raise ValueError(f"rotary_percent={percent!r}: pass a float in (0, 1], the fraction of each head's channels "
                         "RoPE rotates (transformers' partial_rotary_factor)")
    dims = int(kv_channels * percent)
    if dims < 2 or dims % 2:
        raise ValueError(f"rotary_percent={percent} of head_dim={kv_channels} rotates int({kv_channels} * {percent}) "
                         f"= {dims} channels; RoPE turns pairs of channels, so pick a fraction giving an even number "
                         ">= 2")
    return float(percent)


def check_mrope_section(section, kv_channels: int) -> tuple[int, int, int]:
    """``section`` as three positive ints summing to ``kv_channels // 2`` (:mod:`packfwd.models.mixers.mrope`).

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
    """Megatron-Core's ``TransformerConfig`` for ``args``: no dropout, none of Megatron-Core's fused kernels (its
    unfused paths run on every device and match HF transformers' math), parameters placed for ``device``
    (:func:`packfwd.models.runtime.cpu.config_overrides`).  ``init=False`` skips weight initialisation (for loading).

    ``args.fused`` sets ``use_te_activation_func``: Megatron-Core's MLPs then call the activation module of their
    spec (:class:`packfwd.ops.swiglu.SwiGLU`, which packfwd's specs always name; Megatron-Core ignores it without
    the flag) instead of their own unfused ``glu``.

    >>> args = ModelArgs(vocab_size=128, hidden_size=64, ffn_hidden_size=128, num_layers=2, num_attention_heads=4,
    ...                  num_query_groups=2)
    >>> config = transformer_config(args)
    >>> config.num_query_groups, config.kv_channels, config.normalization, config.gated_linear_unit
    (2, 16, 'RMSNorm', True)
    """
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    from .runtime.cpu import config_overrides

    config_class, mla = (TransformerConfig, {}) if args.mla is None else (
        MLATransformerConfig, mla_config_fields(args.mla, args.rope_theta))
    return config_class(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.query_groups,
        kv_channels=args.kv_channels,
        normalization={"rmsnorm": "RMSNorm"}[family(args.family).norm],
        qk_layernorm=args.qk_norm,
        layernorm_epsilon=args.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        use_te_activation_func=args.fused,  # the spec's activation module (packfwd.ops.swiglu.SwiGLU), see above
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
        **(mlp_kind(args.moe).config_fields(args) if args.moe is not None else {}),
        **mla,
    )
