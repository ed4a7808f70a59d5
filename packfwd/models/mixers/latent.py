"""Multi-head latent attention (MLA, DeepSeek-V2/V3) as a frozen description (:class:`Mla`, with its YaRN RoPE
scaling :class:`Yarn`), read from a transformers config, and the numbers derived from it: pure functions.

MLA projects each token to two small latents, normalises them and projects them up per head (transformers'
names; ``H`` heads, ``dn``/``dr`` the non-rotated/rotated query-key channels, ``dv`` the value channels)::

    q  = q_b_proj(q_a_layernorm(q_a_proj(x)))      [H, dn + dr]   (q_lora_rank None: q_proj(x))
    kv_a_proj_with_mqa(x) = [latent (kv_lora_rank), k_rot (dr, one head shared by all)]
    k_nope, v = split(kv_b_proj(kv_a_layernorm(latent)))   [H, dn], [H, dv]
    q_rot, k_rot rotated by RoPE; key = [k_nope, k_rot], query = [q_nope, q_rot]; attention; o_proj

so the query-key head dim ``dn + dr`` is not the value's ``dv``.  With ``rope_interleave`` (DeepSeek-V3's
checkpoints) the rotated channels come in interleaved pairs; transformers turns pair ``j`` by frequency ``j`` and
writes the results de-interleaved (the even channels' results, then the odd ones'), which is Megatron-Core's
half-split rotation of the de-interleaved channels, bit for bit.  The latent norms have transformers' fixed
``eps=1e-6`` (``Mla.latent_norm_eps``), whatever ``rms_norm_eps`` is.

YaRN (``rope_type="yarn"``, :class:`Yarn`): inverse frequencies blended between interpolated (``1 / (factor *
base ** (2i / dr))``) and extrapolated ones by a linear ramp between the correction dims of ``beta_fast`` and
``beta_slow`` (:func:`yarn_inv_freq`); cos and sin times ``attention_factor`` (:meth:`Yarn.cos_sin_factor`); and
the softmax scale ``(dn + dr) ** -0.5`` times ``mscale(factor, mscale_all_dim) ** 2`` when ``mscale_all_dim`` is
set (:meth:`Mla.softmax_scale`): transformers 5's formulas, in float32 for the frequencies as it computes them.

MLA as a token-mixer component (:class:`LatentAttention`, ``MLA``) owns the ``ModelArgs.mla`` field and refuses the
softmax attention's fields it does not build; its Megatron-Core config is ``MLATransformerConfig``
(:func:`mla_config_fields`), its spec and module live in :mod:`packfwd.models.mixers.mla` (imported when a model is
built), its weights are the table ``WEIGHTS``.  The DeepSeek-V3 family reads ``Mla`` from its config
(:mod:`packfwd.models.families.deepseek_v3`).  No Megatron-Core here.

Weights (``H`` heads, ``dq = dn + dr``; Megatron-Core under ``decoder.layers.{j}.self_attention.``, HF under
``model.layers.{i}.self_attn.``; the down projections are column-parallel as in Megatron-Core's MLA, their outputs
gathered in the forward, so their widths must divide by TP)::

    HF                                          Megatron-Core                   TP rank r holds
    q_proj.weight             [H * dq, h]       linear_q_proj.weight            rows: its heads  (q_lora_rank None)
    q_a_proj.weight           [q_lora, h]       linear_q_down_proj.weight       rows: q_lora / tp  (else)
    q_a_layernorm.weight      [q_lora]          q_layernorm.weight              all
    q_b_proj.weight           [H * dq, q_lora]  linear_q_up_proj.weight         rows: its heads
    kv_a_proj_with_mqa.weight [kv_lora + dr, h] linear_kv_down_proj.weight      rows: (kv_lora + dr) / tp
    kv_a_layernorm.weight     [kv_lora]         kv_layernorm.weight             all
    kv_b_proj.weight          [H * (dn + dv), kv_lora]  linear_kv_up_proj.weight  rows: its heads
    o_proj.weight             [h, H * dv]       linear_proj.weight              columns: its heads
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..component import Component
from ..mapping import Weight

__all__ = ["MLA", "LatentAttention", "Mla", "Yarn", "mla_config_fields", "mla_tp_widths", "yarn_inv_freq",
           "yarn_mscale"]


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(scale) + 1`` (1 for ``scale <= 1``).

    >>> yarn_mscale(40.0, 1.0) == 0.1 * math.log(40.0) + 1, yarn_mscale(0.5, 3.0)
    (True, 1.0)
    """
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class Yarn:
    """YaRN RoPE scaling as DeepSeek-V3 configs give it (``rope_parameters`` with ``rope_type="yarn"``).

    >>> Yarn(factor=40.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0).cos_sin_factor()
    1.0
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # cos/sin scale; None: from factor, mscale and mscale_all_dim
    truncate: bool = True  # the correction range rounded outwards to whole dims (transformers' default)

    def __post_init__(self):
        for name in ("factor", "beta_fast", "beta_slow"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"Yarn.{name}={value!r}: pass a positive number (rope_parameters['{name}'])")
        if (isinstance(self.original_max_position_embeddings, bool)
                or not isinstance(self.original_max_position_embeddings, int)
                or self.original_max_position_embeddings < 1):
            raise ValueError(f"Yarn.original_max_position_embeddings={self.original_max_position_embeddings!r}: "
                             "pass a positive int (rope_parameters['original_max_position_embeddings'])")

    def cos_sin_factor(self) -> float:
        """What cos and sin are multiplied by (transformers' ``attention_factor``): the given one, else
        ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` when both are set (and nonzero), else
        ``mscale(factor)``."""
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return float(yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim))
        return yarn_mscale(self.factor)

    def softmax_mscale(self) -> float:
        """The softmax scale is multiplied by this twice: ``mscale(factor, mscale_all_dim)`` when ``mscale_all_dim``
        is set (and nonzero), else 1 (transformers' ``yarn_apply_mscale``)."""
        return yarn_mscale(self.factor, self.mscale_all_dim) if self.mscale_all_dim else 1.0


def yarn_inv_freq(yarn: Yarn, theta: float, dim: int) -> torch.Tensor:
    """``[dim / 2]`` float32: YaRN's inverse frequencies of ``dim`` rotated channels (module docstring),
    computed in float32 with transformers' order of operations (its ``_compute_yarn_parameters``' bits).

    >>> inv = yarn_inv_freq(Yarn(factor=4.0, original_max_position_embeddings=64), 10000.0, 16)
    >>> plain = 1.0 / (10000.0 ** (torch.arange(0, 16, 2).float() / 16))
    >>> bool(inv[0] == plain[0]), bool(torch.isclose(inv[-1], plain[-1] / 4))   # fast dims kept, slow ones / 4
    (True, True)
    """
    def correction_dim(rotations: float) -> float:
        return dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    powers = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolated, interpolated = 1.0 / powers, 1.0 / (yarn.factor * powers)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # the weight of the extrapolated (unscaled) frequency
    return interpolated * (1 - keep) + extrapolated * keep


@dataclass(frozen=True)
class Mla:
    """Multi-head latent attention (module docstring): its ranks and head dims, and its RoPE's layout and scaling.

    >>> mla = Mla(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, q_lora_rank=12)
    >>> mla.qk_head_dim, mla.softmax_scale() == 12 ** -0.5
    (12, True)
    """

    kv_lora_rank: int  # the key-value latent's width (kv_a_layernorm over it)
    qk_nope_head_dim: int  # query-key channels per head without RoPE
    qk_rope_head_dim: int  # query-key channels per head with RoPE (k's shared by all heads)
    v_head_dim: int  # value channels per head
    q_lora_rank: int | None = None  # the query latent's width (q_a_layernorm over it); None: a plain q_proj
    rope_interleave: bool = True  # the rotated channels come in interleaved pairs (DeepSeek-V3's checkpoints)
    yarn: Yarn | None = None  # YaRN scaling of the RoPE; None: plain RoPE ("default")
    latent_norm_eps: float = 1e-6  # eps of q_a_layernorm / kv_a_layernorm (transformers' fixed value)
    rope: bool = True  # False: no position encoding at all, the qk_rope_head_dim channels kept as they are
    #                    (Kimi-Linear's MLA: "NoPE", the shared key channels still shared)

    def __post_init__(self):
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            _check_int(f"Mla.{name}", getattr(self, name))
        if self.q_lora_rank is not None:
            _check_int("Mla.q_lora_rank", self.q_lora_rank)
        if not isinstance(self.rope, bool):
            raise ValueError(f"Mla.rope={self.rope!r}: pass True or False")
        if self.rope and self.qk_rope_head_dim % 2:
            raise ValueError(f"Mla.qk_rope_head_dim={self.qk_rope_head_dim}: RoPE turns pairs of channels; pass an "
                             "even number")
        if not isinstance(self.rope_interleave, bool):
            raise ValueError(f"Mla.rope_interleave={self.rope_interleave!r}: pass True or False")
        if self.yarn is not None and not isinstance(self.yarn, Yarn):
            raise TypeError(f"Mla.yarn must be a packfwd.models.mixers.latent.Yarn or None, got {type(self.yarn)}")

    @property
    def qk_head_dim(self) -> int:
        """Query-key channels per head: ``qk_nope_head_dim + qk_rope_head_dim``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def softmax_scale(self) -> float:
        """``qk_head_dim ** -0.5``, times YaRN's ``mscale_all_dim`` correction twice (:meth:`Yarn.softmax_mscale`;
        transformers' order of operations, its bits)."""
        m = self.yarn.softmax_mscale() if self.yarn is not None else 1.0
        return self.qk_head_dim ** (-0.5) * m * m

    def cos_sin_factor(self) -> float:
        """What RoPE's cos and sin are multiplied by: YaRN's attention factor, else 1."""
        return self.yarn.cos_sin_factor() if self.yarn is not None else 1.0

    def inv_freq(self, theta: float) -> torch.Tensor:
        """``[qk_rope_head_dim / 2]`` float32 inverse frequencies (plain, or YaRN's)."""
        if self.yarn is not None:
            return yarn_inv_freq(self.yarn, theta, self.qk_rope_head_dim)
        return 1.0 / (theta ** (torch.arange(0, self.qk_rope_head_dim, 2, dtype=torch.float32) / self.qk_rope_head_dim))


def _check_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def mla_tp_widths(mla: Mla | None) -> tuple[tuple[str, int], ...]:
    """The (name, width) pairs of an MLA layer that tensor parallelism splits (none without ``mla``).

    >>> mla_tp_widths(Mla(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, q_lora_rank=12))
    (('kv_lora_rank + qk_rope_head_dim', 20), ('q_lora_rank', 12))
    """
    if mla is None:
        return ()
    widths = (("kv_lora_rank + qk_rope_head_dim", mla.kv_lora_rank + mla.qk_rope_head_dim),)
    return widths + ((("q_lora_rank", mla.q_lora_rank),) if mla.q_lora_rank is not None else ())


def mla_config_fields(mla: Mla, theta: float) -> dict:
    """Megatron-Core ``MLATransformerConfig`` fields of ``mla`` (RoPE theta ``theta``).  packfwd's module computes
    the RoPE and the softmax scale itself (:mod:`packfwd.models.mixers.mla`); the YaRN fields describe it to readers of
    the config (Megatron-Core's own softmax scale from them is the same, ``mscale_all_dim`` 0 where unset).

    >>> mla_config_fields(Mla(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6), 1e4)["rope_type"]
    'rope'
    """
    fields = dict(multi_latent_attention=True, q_lora_rank=mla.q_lora_rank, kv_lora_rank=mla.kv_lora_rank,
                  qk_head_dim=mla.qk_nope_head_dim, qk_pos_emb_head_dim=mla.qk_rope_head_dim,
                  v_head_dim=mla.v_head_dim, rotary_base=theta, rope_type="rope", rotary_scaling_factor=1.0)
    if mla.yarn is not None:
        y = mla.yarn
        fields.update(rope_type="yarn", rotary_scaling_factor=y.factor, beta_fast=y.beta_fast,
                      beta_slow=y.beta_slow, original_max_position_embeddings=y.original_max_position_embeddings,
                      mscale=float(y.mscale) if y.mscale is not None else 1.0,
                      mscale_all_dim=float(y.mscale_all_dim or 0.0))
    return fields


def _q_lora(args) -> bool:
    return args.mla.q_lora_rank is not None


def _no_q_lora(args) -> bool:
    return args.mla.q_lora_rank is None


# One layer's attention weights (module docstring): Megatron-Core <- HF, under the layer prefixes.
WEIGHTS = (
    Weight("self_attention.linear_q_proj.weight", "self_attn.q_proj.weight", "rows", when=_no_q_lora),
    Weight("self_attention.linear_q_down_proj.weight", "self_attn.q_a_proj.weight", "rows", when=_q_lora),
    Weight("self_attention.q_layernorm.weight", "self_attn.q_a_layernorm.weight", when=_q_lora),
    Weight("self_attention.linear_q_up_proj.weight", "self_attn.q_b_proj.weight", "rows", when=_q_lora),
    Weight("self_attention.linear_kv_down_proj.weight", "self_attn.kv_a_proj_with_mqa.weight", "rows"),
    Weight("self_attention.kv_layernorm.weight", "self_attn.kv_a_layernorm.weight"),
    Weight("self_attention.linear_kv_up_proj.weight", "self_attn.kv_b_proj.weight", "rows"),
    Weight("self_attention.linear_proj.weight", "self_attn.o_proj.weight", "cols"),
)

# The softmax attention's fields MLA does not build, and the value each must keep (None: derived from mla).
_NOT_BUILT = dict(num_query_groups=None, qk_norm=False, qkv_bias=False, linear_bias=False, rope_scaling_factor=None,
                  rotary_percent=1.0, mrope_section=None, mrope_interleaved=False, mtp_num_layers=0,
                  attention_windows=None, attention_sinks=False, rope_yarn=None)


class LatentAttention(Component):
    """Multi-head latent attention as a token-mixer component (module docstring).

    >>> from packfwd.models.args import ModelArgs
    >>> args = ModelArgs(vocab_size=64, hidden_size=32, ffn_hidden_size=64, num_layers=1, num_attention_heads=2,
    ...                  family="deepseek_v3", mla=Mla(kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4,
    ...                  v_head_dim=6))
    >>> args.head_dim, MLA.config_fields(args)["kv_lora_rank"], [w.mg for w in MLA.weights(args)][0]
    (8, 8, 'self_attention.linear_q_proj.weight')
    """

    name = "multi-head latent attention"
    fields = ("mla",)
    field = "mla"  # the ModelArgs field holding its description
    hint = "mla=Mla(...) (packfwd.models.mixers.Mla)"  # what to pass for it
    config_class = "MLATransformerConfig"
    rotates_itself = True  # Megatron-Core computes no BSHD angles for MLA; the model hands its module per-token ones

    def check(self, args) -> None:
        """``args.mla`` an :class:`Mla`, and none of the softmax attention's options (the head dim is the
        query-key one, ``qk_nope_head_dim + qk_rope_head_dim``)."""
        if not isinstance(args.mla, Mla):
            raise TypeError(f"ModelArgs.mla must be a packfwd.models.mixers.latent.Mla or None, got {type(args.mla)}")
        if args.head_dim is None:
            object.__setattr__(args, "head_dim", args.mla.qk_head_dim)
        wrong = {name: getattr(args, name) for name, keep in _NOT_BUILT.items()
                 if getattr(args, name) != keep and not (name == "num_query_groups"
                                                        and args.query_groups == args.num_attention_heads)}
        if args.head_dim != args.mla.qk_head_dim:
            wrong = {"head_dim": args.head_dim, **wrong}
        if wrong:
            raise ValueError(f"ModelArgs {wrong} with mla: multi-head latent attention is built with head_dim = "
                             f"qk_nope_head_dim + qk_rope_head_dim = {args.mla.qk_head_dim} (or None), one key and "
                             "value per head, no QK-norm, no biases, full RoPE (YaRN in mla.yarn) and no MTP layers; "
                             "leave these at their defaults")

    def config_fields(self, args) -> dict:
        return dict(num_query_groups=args.num_attention_heads, kv_channels=args.kv_channels, qk_layernorm=False,
                    add_qkv_bias=False, **mla_config_fields(args.mla, args.rope_theta))

    def tp_widths(self, args) -> tuple[tuple[str, int], ...]:
        return (("num_attention_heads", args.num_attention_heads), *mla_tp_widths(args.mla))

    def weights(self, args) -> tuple[Weight, ...]:
        return WEIGHTS

    def layer_spec(self, args, layer: int, *, attention_backend: str | None = None, rope=None, qk_norm=None):
        """:func:`packfwd.models.mixers.mla.mla_attention_spec` (``rope``: the model's ``MlaRope``)."""
        from .mla import mla_attention_spec

        return mla_attention_spec(args, attention_backend=attention_backend, rope=rope)

    def rotary_modules(self, config, args, *, packed: bool, cp_group):
        """The rotated channels' rotary module, plain or YaRN, and the ``MlaRope`` each layer reads."""
        from .mla import mla_rotary_modules

        return mla_rotary_modules(args.mla, args.rope_theta, packed=packed, fused=args.fused)


MLA = LatentAttention()
