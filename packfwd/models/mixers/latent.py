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

The module is :mod:`packfwd.models.mixers.mla`, the weight mapping :mod:`packfwd.models.mixers.mla_weights`.  No Megatron-Core here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["Mla", "Yarn", "mla_config_fields", "mla_from_hf_config", "mla_tp_widths", "yarn_inv_freq", "yarn_mscale"]


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

    def __post_init__(self):
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            _check_int(f"Mla.{name}", getattr(self, name))
        if self.q_lora_rank is not None:
            _check_int("Mla.q_lora_rank", self.q_lora_rank)
        if self.qk_rope_head_dim % 2:
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


_YARN_KEYS = {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast",
              "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate", "partial_rotary_factor"}


def mla_from_hf_config(cfg) -> Mla:
    """The :class:`Mla` of a ``DeepseekV3Config``; ValueError (naming the field and the fix) for what packfwd
    does not build: ``num_key_value_heads`` other than ``num_attention_heads`` (every MLA head has its own key and
    value), partial RoPE, a RoPE type other than ``"default"`` and ``"yarn"``, a YaRN without ``factor``.

    >>> from transformers import DeepseekV3Config
    >>> mla = mla_from_hf_config(DeepseekV3Config(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=40.0,
    ...     original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0, beta_fast=32, beta_slow=1)))
    >>> mla.q_lora_rank, mla.kv_lora_rank, mla.qk_head_dim, mla.v_head_dim, mla.rope_interleave, mla.yarn.factor
    (1536, 512, 192, 128, True, 40.0)
    """
    heads, kv_heads = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    if kv_heads != heads:
        raise ValueError(f"num_key_value_heads={kv_heads} with num_attention_heads={heads}: multi-head latent "
                         "attention gives every head its own key and value (kv_b_proj); set num_key_value_heads="
                         f"{heads}")
    params = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    kind = params.get("rope_type", params.get("type", "default"))
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"partial_rotary_factor={params['partial_rotary_factor']}: MLA rotates all of its "
                         "qk_rope_head_dim channels; set it to 1.0 (or leave it out)")
    yarn = None
    if kind == "yarn":
        unknown = sorted(set(params) - _YARN_KEYS)
        if unknown:
            raise ValueError(f"rope_parameters keys {unknown} are not read by packfwd's YaRN; drop them")
        if params.get("factor") is None:
            raise ValueError("rope_parameters['factor'] is None: packfwd's YaRN needs the scaling factor given "
                             "(transformers' softmax correction reads it too); set it")
        yarn = Yarn(factor=float(params["factor"]),
                    original_max_position_embeddings=int(params["original_max_position_embeddings"]),
                    beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                    mscale=params.get("mscale"), mscale_all_dim=params.get("mscale_all_dim"),
                    attention_factor=params.get("attention_factor"), truncate=bool(params.get("truncate", True)))
    elif kind != "default":
        raise ValueError(f"rope_type={kind!r}: packfwd builds DeepSeek-V3's RoPE as 'default' or 'yarn'; use one")
    return Mla(kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
               qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, q_lora_rank=cfg.q_lora_rank,
               rope_interleave=bool(getattr(cfg, "rope_interleave", True)), yarn=yarn)


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
