"""Softmax attention with grouped queries (Llama, Qwen2/3, Mixtral, GLM-4.5): the token mixer of every family but
DeepSeek-V3, as one component (:class:`~packfwd.models.component.Component`).

It owns these :class:`~packfwd.models.args.ModelArgs` fields, their checks, their Megatron-Core config fields and
their HF weights: ``num_query_groups`` (kv heads), ``head_dim``, ``qkv_bias`` (a bias on q, k and v only: Qwen2),
``qk_norm`` (RMSNorm over ``head_dim`` on q and k before RoPE: Qwen3), ``rotary_percent`` (partial RoPE: GLM-4.5),
``rope_scaling_factor`` (Llama-3), ``mrope_section`` (multimodal RoPE: Qwen2-VL; with partial RoPE its sections
cover the rotated channels), ``mrope_interleaved`` (Qwen3-VL / Qwen3.5's interleaved sections), and GPT-OSS's
``attention_windows`` (per layer a sliding window of W tokens or full attention: Megatron-Core's ``window_size =
(W - 1, 0)`` with ``window_attn_skip_freq`` one flag per layer), ``attention_sinks`` (``softmax_type =
"learnable"``: the core attention's ``softmax_offset``) and ``rope_yarn`` (YaRN's inverse frequencies in the
rotary module; its cos/sin factor ``f``, which multiplies q and k alike, folded into the softmax scale as ``f**2``:
the same scores).  A family reads them from its HF config with :func:`hf_attention_fields` (and its own readers).

Layer spec (names as in the state dict): Megatron-Core's ``SelfAttention`` with packfwd's core attention::

    linear_qkv      ColumnParallelLinear, fused [q, k, v] grouped by query group (bias: add_qkv_bias)
    q_layernorm     RMSNorm over head_dim with QK-norm, else IdentityOp (k_layernorm likewise)
    core_attention  packfwd CoreAttention (THD via PackedSeqParams, or BSHD); params: backend, rope
    linear_proj     RowParallelLinear

Weights (``ng`` query groups, ``r = heads / ng``, ``d`` head dim; HF under ``model.layers.{i}.self_attn.``)::

    linear_qkv.weight  [ng * (r + 2) * d, hidden]   q_proj, k_proj, v_proj: per group its r query heads, k_g, v_g
    linear_proj.weight [hidden, heads * d]          o_proj (TP: columns)
    q_layernorm.weight [d]                          q_norm (k_layernorm: k_norm; replicated: every head has it)
    core_attention.softmax_offset [heads]           sinks (TP: its heads)
"""

from __future__ import annotations

from ..component import Component
from ..mapping import Weight
from .latent import Yarn, yarn_inv_freq
from .rotary import check_mrope_section, check_rotary_percent

__all__ = ["SOFTMAX", "SoftmaxAttention", "hf_attention_fields"]


def _qkv(suffix: str) -> tuple[str, str, str]:
    return tuple(f"self_attn.{x}_proj.{suffix}" for x in "qkv")


_QKV_BIAS = lambda args: args.qkv_bias or args.linear_bias  # noqa: E731  (Megatron-Core: add_qkv_bias or all)
_LINEAR_BIAS = lambda args: args.linear_bias  # noqa: E731
_QK_NORM = lambda args: args.qk_norm  # noqa: E731
_SINKS = lambda args: args.attention_sinks  # noqa: E731

# One layer's attention weights: Megatron-Core (under decoder.layers.{j}.) <- HF (under model.layers.{i}.).
WEIGHTS = (
    Weight("self_attention.linear_qkv.weight", _qkv("weight"), "qkv"),
    Weight("self_attention.linear_qkv.bias", _qkv("bias"), "qkv", when=_QKV_BIAS),
    Weight("self_attention.linear_proj.weight", "self_attn.o_proj.weight", "cols"),
    Weight("self_attention.linear_proj.bias", "self_attn.o_proj.bias", when=_LINEAR_BIAS),
    Weight("self_attention.q_layernorm.weight", "self_attn.q_norm.weight", when=_QK_NORM),
    Weight("self_attention.k_layernorm.weight", "self_attn.k_norm.weight", when=_QK_NORM),
    Weight("self_attention.core_attention.softmax_offset", "self_attn.sinks", "rows", when=_SINKS),
)


def hf_attention_fields(cfg, *, qkv_bias: bool = False, qk_norm: bool = False, partial_rope: bool = False) -> dict:
    """The ModelArgs fields of this component in a transformers config (``qkv_bias`` and ``qk_norm`` as the
    family reads them): kv heads (``num_key_value_heads``, else one per head), ``head_dim`` (the config's when
    set: Qwen3's is explicit; else ``hidden_size // num_attention_heads``), and with ``partial_rope`` the fraction of
    channels RoPE rotates (``rope_parameters["partial_rotary_factor"]``; transformers' GLM-4.5 rotates
    ``int(head_dim * factor)`` channels).

    >>> from transformers import Qwen3Config
    >>> hf_attention_fields(Qwen3Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    ...                     qk_norm=True)
    {'num_query_groups': 2, 'head_dim': 16, 'qkv_bias': False, 'qk_norm': True, 'rotary_percent': 1.0}
    """
    heads = cfg.num_attention_heads
    percent = 1.0
    if partial_rope:
        params = getattr(cfg, "rope_parameters", None) or {}
        percent = float(params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None) or 1.0))
    return dict(num_query_groups=getattr(cfg, "num_key_value_heads", None) or heads,
                head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads, qkv_bias=bool(qkv_bias),
                qk_norm=bool(qk_norm), rotary_percent=percent)


class SoftmaxAttention(Component):
    """The softmax-attention component (module docstring).

    >>> from packfwd.models.args import ModelArgs
    >>> args = ModelArgs(vocab_size=64, hidden_size=32, ffn_hidden_size=64, num_layers=1, num_attention_heads=4,
    ...                  num_query_groups=2, qkv_bias=True)
    >>> SOFTMAX.config_fields(args)["add_qkv_bias"], [w.mg for w in SOFTMAX.weights(args)][:2]
    (True, ['self_attention.linear_qkv.weight', 'self_attention.linear_qkv.bias'])
    """

    name = "softmax attention"
    fields = ("num_query_groups", "head_dim", "qkv_bias", "qk_norm", "rotary_percent", "rope_scaling_factor",
              "mrope_section", "mrope_interleaved", "attention_windows", "attention_sinks", "rope_yarn")
    config_class = "TransformerConfig"  # Megatron-Core's config class of a model of this mixer
    rotates_itself = False  # Megatron-Core's _preprocess computes the BSHD angles (MLA's module rotates itself)

    def check(self, args) -> None:
        for name in ("qkv_bias", "qk_norm"):
            if not isinstance(getattr(args, name), bool):
                raise TypeError(f"ModelArgs.{name} must be True or False, got {getattr(args, name)!r}")
        if args.num_attention_heads % args.query_groups:
            raise ValueError(f"num_query_groups={args.num_query_groups} must divide "
                             f"num_attention_heads={args.num_attention_heads}")
        if args.head_dim is None and args.hidden_size % args.num_attention_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads, or pass head_dim")
        object.__setattr__(args, "rotary_percent", check_rotary_percent(args.rotary_percent, args.kv_channels))
        if not isinstance(args.mrope_interleaved, bool):
            raise TypeError(f"ModelArgs.mrope_interleaved must be True or False, got {args.mrope_interleaved!r}")
        if args.mrope_interleaved and args.mrope_section is None:
            raise ValueError("mrope_interleaved=True without mrope_section: pass the multimodal sections too")
        if args.mrope_section is not None:  # the sections split the rotated channels' frequencies
            rotated = int(args.kv_channels * args.rotary_percent)
            object.__setattr__(args, "mrope_section", check_mrope_section(args.mrope_section, rotated,
                                                                          interleaved=args.mrope_interleaved))
            if args.rope_scaling_factor is not None or args.mtp_num_layers:
                raise ValueError("mrope_section with rope_scaling_factor or mtp_num_layers: multimodal RoPE is built "
                                 "without Llama-3 scaling and without MTP layers; drop one of them")
        self._check_gpt_oss_fields(args)

    @staticmethod
    def _check_gpt_oss_fields(args) -> None:
        """``attention_windows``, ``attention_sinks``, ``rope_yarn`` (GPT-OSS's)."""
        if not isinstance(args.attention_sinks, bool):
            raise TypeError(f"ModelArgs.attention_sinks must be True or False, got {args.attention_sinks!r}")
        if args.rope_yarn is not None:
            if not isinstance(args.rope_yarn, Yarn):
                raise TypeError(f"ModelArgs.rope_yarn must be a packfwd.models.mixers.Yarn or None, got "
                                f"{type(args.rope_yarn).__name__}")
            if args.rope_scaling_factor is not None or args.mrope_section is not None:
                raise ValueError("rope_yarn with rope_scaling_factor or mrope_section: one RoPE scaling at a time; "
                                 "drop one of them")
        windows = args.attention_windows
        if windows is None:
            return
        windows = tuple(windows)
        if len(windows) != args.num_layers or any(
                w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1) for w in windows):
            raise ValueError(f"ModelArgs.attention_windows={args.attention_windows!r}: pass one entry per layer "
                             f"({args.num_layers}), each a window of W >= 1 tokens or None (full attention)")
        if len({w for w in windows if w is not None}) > 1:
            raise ValueError(f"ModelArgs.attention_windows={windows}: Megatron-Core's config has one window_size for "
                             "every windowed layer; give them one W")
        if args.mtp_num_layers and any(w is not None for w in windows):
            raise ValueError("attention_windows with mtp_num_layers: packfwd builds MTP layers with full attention "
                             "only; pass mtp_num_layers=0")
        object.__setattr__(args, "attention_windows", windows)

    def config_fields(self, args) -> dict:
        fields = dict(num_query_groups=args.query_groups, kv_channels=args.kv_channels, qk_layernorm=args.qk_norm,
                      add_qkv_bias=args.qkv_bias,
                      mrope_section=list(args.mrope_section) if args.mrope_section is not None else None)
        sizes = {w for w in args.attention_windows or () if w is not None}
        if sizes:  # Megatron-Core's fields, read by packfwd's core attention as by its DotProductAttention
            fields.update(window_size=(sizes.pop() - 1, 0),
                          window_attn_skip_freq=[int(w is not None) for w in args.attention_windows])
        if args.attention_sinks:
            fields.update(softmax_type="learnable")
        if args.rope_yarn is not None:  # cos and sin times f: every score times f**2 (module docstring)
            fields.update(softmax_scale=args.kv_channels**-0.5 * args.rope_yarn.cos_sin_factor() ** 2)
        return fields

    def tp_widths(self, args) -> tuple[tuple[str, int], ...]:
        return (("num_query_groups", args.query_groups), ("num_attention_heads", args.num_attention_heads))

    def weights(self, args) -> tuple[Weight, ...]:
        return WEIGHTS

    def layer_spec(self, args, layer: int, *, attention_backend: str | None = None, rope=None, qk_norm=None):
        """Megatron-Core's ``SelfAttention`` (fused QKV, grouped-query) with packfwd's core attention;
        ``qk_norm`` the norm class of QK-norm (:func:`packfwd.models.runtime.spec.norm_class`)."""
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
        from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
        from megatron.core.transformer.enums import AttnMaskType
        from megatron.core.transformer.identity_op import IdentityOp
        from megatron.core.transformer.spec_utils import ModuleSpec

        from .attention import CoreAttention

        norm = qk_norm if args is not None and args.qk_norm else IdentityOp
        return ModuleSpec(
            module=SelfAttention,
            params={"attn_mask_type": AttnMaskType.causal},
            submodules=SelfAttentionSubmodules(
                linear_qkv=ColumnParallelLinear,
                core_attention=ModuleSpec(module=CoreAttention, params={"backend": attention_backend, "rope": rope}),
                linear_proj=RowParallelLinear,
                q_layernorm=norm,
                k_layernorm=norm,
            ),
        )

    def rotary_modules(self, config, args, *, packed: bool, cp_group):
        """The rotary module and the THD RoPE (None with ``packed=False``) of a model of ``args``: plain RoPE (Llama-3
        scaling, partial), or multimodal RoPE when ``args.mrope_section`` is set (:mod:`.rope`, :mod:`.mrope`)."""
        from .mrope import MropeRope, MropeRotaryEmbedding
        from .rope import PackedRope, PackedRotaryEmbedding

        kwargs = dict(kv_channels=config.kv_channels, rotary_percent=args.rotary_percent,
                      rotary_interleaved=config.rotary_interleaved,
                      use_cpu_initialization=config.use_cpu_initialization, cp_group=cp_group, packed=packed,
                      rotary_base=args.rope_theta, rope_scaling=args.rope_scaling_factor is not None,
                      rope_scaling_factor=args.rope_scaling_factor or 8.0)
        if args.mrope_section is None:
            rotary = PackedRotaryEmbedding(**kwargs)
            rotary.yarn = args.rope_yarn  # what model_args reads back
            if args.rope_yarn is not None:  # Megatron-Core's table and PackedRope read these frequencies
                rotary.inv_freq = yarn_inv_freq(args.rope_yarn, args.rope_theta, rotary.inv_freq.numel() * 2).to(
                    rotary.inv_freq.device)
            return rotary, PackedRope(rotary, fused=args.fused) if packed else None
        if not packed:
            raise ValueError(
                "packed_rope=False with mrope_section: Megatron-Core's THD RoPE cannot take per-token multimodal "
                "positions (it cuts one angle table per CP rank as if the batch were one sequence); use "
                "packed_rope=True"
            )
        rotary = MropeRotaryEmbedding(mrope_section=args.mrope_section, mrope_interleaved=args.mrope_interleaved,
                                      **kwargs)
        return rotary, MropeRope(rotary, fused=args.fused)


SOFTMAX = SoftmaxAttention()
