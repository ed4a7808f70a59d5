"""The Gated DeltaNet layer (Qwen3-Next's linear attention) over a THD-packed batch, in torch: exact on the CPU, the
reference the CUDA path (fla's varlen kernels) and the Megatron-Core component will be checked against.

Given the layer's weights as transformers names them (``Qwen3NextGatedDeltaNet``: ``in_proj_qkvz``, ``in_proj_ba``,
``conv1d``, ``dt_bias``, ``A_log``, ``norm``, ``out_proj``; or Qwen3.5's ``Qwen3_5GatedDeltaNet``, whose projections
are ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``), :func:`gated_deltanet_packed` computes, for
``hidden: [t, hidden_size]`` packed as ``cu_seqlens`` says::

    q, k, v, z, b, a = in_proj_qkvz(x), in_proj_ba(x)      Qwen3-Next: grouped per key head (Qwen3.5: flat)
    q, k, v = silu(causal_conv([q k v]))                   restarted at every sequence
    o = delta_rule(q, k, v, g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b))   per-sequence zero state
    out = out_proj(rms_norm(o) * norm.weight * silu(z))

with transformers' head layout: ``num_k_heads`` query/key heads of ``head_k_dim``, ``num_v_heads`` value heads of
``head_v_dim``, each key head serving ``num_v_heads // num_k_heads`` consecutive value heads.  The two sequence
operators are :mod:`~packfwd.models.mixers.deltanet_ops`.  The component is
:mod:`~packfwd.models.mixers.gated_deltanet`, its Megatron-Core module (tensor and context parallelism)
:mod:`~packfwd.models.mixers.gdn`; both run :func:`deltanet_mix`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor

from ..._validate import check_tensor
from .deltanet_ops import causal_conv1d_packed, chunk_gated_delta_rule_packed

__all__ = ["DeltaNetShape", "deltanet_mix", "gated_deltanet_packed", "gated_rms_norm", "kda_mix"]

_SHARED = ("conv1d.weight", "dt_bias", "A_log", "norm.weight", "out_proj.weight")
_NEXT = ("in_proj_qkvz.weight", "in_proj_ba.weight")  # Qwen3-Next: grouped per key head
_QWEN35 = ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight")  # Qwen3.5: flat


@dataclass(frozen=True)
class DeltaNetShape:
    """A Gated DeltaNet layer's sizes, named as transformers' ``Qwen3NextConfig`` names them (``linear_*``).

    >>> DeltaNetShape(hidden_size=32, num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8).conv_dim
    64
    """

    hidden_size: int
    num_k_heads: int  # query/key heads
    num_v_heads: int  # value heads: a multiple of num_k_heads
    head_k_dim: int
    head_v_dim: int
    conv_kernel_dim: int = 4  # Qwen3-Next's short convolution
    activation: str = "silu"  # of the convolution (transformers' hidden_act)
    eps: float = 1e-6  # of the gated RMSNorm (rms_norm_eps)

    def __post_init__(self):
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"num_v_heads={self.num_v_heads} must be a multiple of num_k_heads={self.num_k_heads}")

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:  # channels of the convolution: q, k and v
        return 2 * self.key_dim + self.value_dim

    @classmethod
    def from_hf(cls, config) -> "DeltaNetShape":
        """From a transformers config with Qwen3-Next's ``linear_*`` fields (Qwen3-Next, Qwen3.5)."""
        return cls(config.hidden_size, config.linear_num_key_heads, config.linear_num_value_heads,
                   config.linear_key_head_dim, config.linear_value_head_dim, config.linear_conv_kernel_dim,
                   config.hidden_act, config.rms_norm_eps)


def gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float = 1e-6, *, sigmoid: bool = False) -> Tensor:
    """transformers' ``Qwen3NextRMSNormGated``: ``weight * rms_norm(x) * silu(gate)`` over the last dim, the norm
    and the gate in ``x``'s dtype promoted to at least float32, ``weight`` applied in ``x``'s dtype as transformers
    does.  ``sigmoid=True``: ``KimiLinearRMSNormGated``, ``weight * rms_norm(x) * sigmoid(gate)`` with ``weight``
    applied in the promoted dtype too (as Kimi-Linear does).

    >>> gated_rms_norm(torch.ones(1, 2), torch.zeros(1, 2), torch.ones(2)).tolist()
    [[0.0, 0.0]]
    >>> gated_rms_norm(torch.ones(1, 2), torch.zeros(1, 2), torch.ones(2), sigmoid=True).round(decimals=4).tolist()
    [[0.5, 0.5]]
    """
    cdt = torch.promote_types(x.dtype, torch.float32)
    xc = x.to(cdt)
    normed = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
    if sigmoid:
        return (weight.to(cdt) * normed * torch.sigmoid(gate.to(cdt))).to(x.dtype)
    return (weight * normed.to(x.dtype) * F.silu(gate.to(cdt))).to(x.dtype)


def gated_deltanet_packed(hidden: Tensor, weights, config, cu_seqlens: Tensor, *,
                          cu_seqlens_padded: Tensor | None = None, max_seqlen: int | None = None,
                          chunk_size: int = 64) -> Tensor:
    """The Gated DeltaNet layer (Qwen3-Next's or Qwen3.5's) over packed ``hidden: [t, hidden_size]``: ``[t, hidden_size]``, each sequence as
    if alone (its convolution and state start at its first token), pad rows zero before ``out_proj`` (so zero out).

    ``weights``: a transformers ``Qwen3NextGatedDeltaNet`` or ``Qwen3_5GatedDeltaNet`` (its parameters are used, so
    gradients reach them) or a mapping with its parameter names.  ``config``: a :class:`DeltaNetShape` or a transformers config.
    ``cu_seqlens`` / ``cu_seqlens_padded`` / ``max_seqlen``: Megatron-Core's (``ThdInfo``'s); see
    :mod:`~packfwd.models.mixers.deltanet_ops`.

    >>> shape = DeltaNetShape(hidden_size=8, num_k_heads=1, num_v_heads=2, head_k_dim=4, head_v_dim=4)
    >>> w = {"in_proj_qkvz.weight": torch.randn(24, 8), "in_proj_ba.weight": torch.randn(4, 8),
    ...      "conv1d.weight": torch.randn(16, 1, 4), "dt_bias": torch.ones(2), "A_log": torch.zeros(2),
    ...      "norm.weight": torch.ones(4), "out_proj.weight": torch.randn(8, 8)}
    >>> gated_deltanet_packed(torch.randn(5, 8), w, shape, torch.tensor([0, 2, 5])).shape
    torch.Size([5, 8])
    """
    shape = config if isinstance(config, DeltaNetShape) else DeltaNetShape.from_hf(config)
    w = _weights(weights)
    check_tensor("hidden", hidden)
    if hidden.dim() != 2 or hidden.shape[1] != shape.hidden_size:
        raise ValueError(f"hidden must be [t, {shape.hidden_size}] (packed THD), got {tuple(hidden.shape)}; "
                         "pack a [b, s, h] batch with packfwd.to_thd first")
    q, k, v, z, b, a = _project(hidden, w, shape)
    o = deltanet_mix(torch.cat((q, k, v), -1), z, b, a, w, shape, cu_seqlens, cu_seqlens_padded=cu_seqlens_padded,
                     max_seqlen=max_seqlen, chunk_size=chunk_size)
    return F.linear(o, w["out_proj.weight"], w.get("out_proj.bias"))


def deltanet_mix(qkv: Tensor, z: Tensor, b: Tensor, a: Tensor, weights: Mapping[str, Tensor], shape: DeltaNetShape,
                 cu_seqlens: Tensor, *, cu_seqlens_padded: Tensor | None = None, max_seqlen: int | None = None,
                 chunk_size: int = 64) -> Tensor:
    """The layer between its projections, over packed rows: ``qkv: [t, conv_dim]`` (``[q | k | v]``, heads
    contiguous), ``z: [t, value_dim]``, ``b, a: [t, num_v_heads]`` -> ``[t, value_dim]``, what ``out_proj`` takes
    (pad rows zero).  ``weights`` holds ``conv1d.weight`` (``[conv_dim, 1, w]``; ``conv1d.bias`` optional),
    ``A_log``, ``dt_bias`` and ``norm.weight`` (transformers' names; a tensor-parallel rank passes its own heads'
    with ``shape`` counting its heads).  The one home of the layer's math: :func:`gated_deltanet_packed` and the
    Megatron-Core module (:mod:`packfwd.models.mixers.gdn`) call it.

    >>> shape = DeltaNetShape(hidden_size=8, num_k_heads=1, num_v_heads=2, head_k_dim=4, head_v_dim=4)
    >>> w = {"conv1d.weight": torch.randn(16, 1, 4), "dt_bias": torch.ones(2), "A_log": torch.zeros(2),
    ...      "norm.weight": torch.ones(4)}
    >>> deltanet_mix(torch.randn(5, 16), torch.randn(5, 8), torch.randn(5, 2), torch.randn(5, 2), w, shape,
    ...              torch.tensor([0, 2, 5])).shape
    torch.Size([5, 8])
    """
    t = qkv.shape[0]
    qkv = _short_conv(qkv, weights, shape, cu_seqlens, cu_seqlens_padded)
    q, k, v = qkv.split([shape.key_dim, shape.key_dim, shape.value_dim], -1)
    beta = b.sigmoid()
    cdt = torch.promote_types(a.dtype, torch.float32)  # transformers: A_log.float(), a.float() (fp16 safety)
    g = -weights["A_log"].to(cdt).exp() * F.softplus(a.to(cdt) + weights["dt_bias"])
    o = chunk_gated_delta_rule_packed(
        q.reshape(t, shape.num_k_heads, shape.head_k_dim), k.reshape(t, shape.num_k_heads, shape.head_k_dim),
        v.reshape(t, shape.num_v_heads, shape.head_v_dim), g, beta, cu_seqlens, chunk_size,
        cu_seqlens_padded=cu_seqlens_padded, max_seqlen=max_seqlen, use_qk_l2norm_in_kernel=True)
    o = gated_rms_norm(o, z.reshape(t, shape.num_v_heads, shape.head_v_dim), weights["norm.weight"], shape.eps)
    return o.reshape(t, shape.value_dim)


def _short_conv(qkv: Tensor, weights: Mapping[str, Tensor], shape: DeltaNetShape, cu_seqlens: Tensor,
                cu_seqlens_padded: Tensor | None) -> Tensor:
    """The short causal convolution over ``[q | k | v]``, restarted at every sequence (both layers' first step)."""
    conv_w = weights["conv1d.weight"]
    return causal_conv1d_packed(qkv, conv_w.reshape(conv_w.shape[0], -1), weights.get("conv1d.bias"), cu_seqlens,
                                cu_seqlens_padded=cu_seqlens_padded, activation=shape.activation)


def kda_mix(qkv: Tensor, f: Tensor, b: Tensor, gate: Tensor, weights: Mapping[str, Tensor], shape: DeltaNetShape,
            cu_seqlens: Tensor, *, cu_seqlens_padded: Tensor | None = None, max_seqlen: int | None = None,
            chunk_size: int = 64) -> Tensor:
    """Kimi Delta Attention (Kimi-Linear's linear attention) between its projections, over packed rows: Gated
    DeltaNet's layer with a forget gate per key channel.  ``qkv: [t, 3 H d]`` (``[q | k | v]``, ``H`` heads of
    ``d`` channels, queries, keys and values alike: ``shape`` with ``num_k_heads == num_v_heads``, ``head_k_dim ==
    head_v_dim``), ``f: [t, H d]`` (the forget gate's low-rank projection ``f_b_proj(f_a_proj(x))``), ``b: [t, H]``
    (``b_proj(x)``), ``gate: [t, H d]`` (``g_b_proj(g_a_proj(x))``) -> ``[t, H d]``, what ``o_proj`` takes (pad rows
    zero)::

        q, k, v = silu(causal_conv([q k v]))                         restarted at every sequence
        g = -exp(A_log[h]) softplus(f + dt_bias)                     [t, H, d]: per key channel
        o = delta_rule(q, k, v, g, beta = sigmoid(b))                per-sequence zero state
        out = norm.weight * rms_norm(o) * sigmoid(gate)

    ``weights``: ``conv1d.weight`` (``[3 H d, 1, w]``), ``A_log`` (``[H]``), ``dt_bias`` (``[H d]``),
    ``norm.weight`` (``[d]``); a tensor-parallel rank passes its own heads' with ``shape`` counting its heads.  The
    convolution, the chunked delta rule (its per-channel form) and the norm are Gated DeltaNet's
    (:func:`deltanet_mix`).

    >>> shape = DeltaNetShape(hidden_size=8, num_k_heads=2, num_v_heads=2, head_k_dim=4, head_v_dim=4)
    >>> w = {"conv1d.weight": torch.randn(24, 1, 4), "dt_bias": torch.ones(8), "A_log": torch.zeros(2),
    ...      "norm.weight": torch.ones(4)}
    >>> kda_mix(torch.randn(5, 24), torch.randn(5, 8), torch.randn(5, 2), torch.randn(5, 8), w, shape,
    ...         torch.tensor([0, 2, 5])).shape
    torch.Size([5, 8])
    """
    if shape.num_k_heads != shape.num_v_heads or shape.head_k_dim != shape.head_v_dim:
        raise ValueError(f"Kimi Delta Attention has as many key as value heads of one size; got {shape}")
    t, h, d = qkv.shape[0], shape.num_v_heads, shape.head_v_dim
    qkv = _short_conv(qkv, weights, shape, cu_seqlens, cu_seqlens_padded)
    q, k, v = (x.reshape(t, h, d) for x in qkv.split([h * d] * 3, -1))
    cdt = torch.promote_types(f.dtype, torch.float32)  # transformers: the gate and A_log in float32 at least
    g = -weights["A_log"].to(cdt).exp()[:, None] * F.softplus((f.to(cdt) + weights["dt_bias"].to(cdt)).view(t, h, d))
    o = chunk_gated_delta_rule_packed(q, k, v, g, b.sigmoid(), cu_seqlens, chunk_size,
                                      cu_seqlens_padded=cu_seqlens_padded, max_seqlen=max_seqlen,
                                      use_qk_l2norm_in_kernel=True)
    o = gated_rms_norm(o, gate.reshape(t, h, d), weights["norm.weight"], shape.eps, sigmoid=True)
    return o.reshape(t, h * d)


def _weights(weights) -> Mapping[str, Tensor]:
    w = dict(weights.named_parameters()) if isinstance(weights, torch.nn.Module) else dict(weights)
    names = _SHARED + (_QWEN35 if "in_proj_qkv.weight" in w else _NEXT)
    missing = [name for name in names if name not in w]
    if missing:
        raise KeyError(f"weights lack {missing}; pass a transformers Qwen3NextGatedDeltaNet or Qwen3_5GatedDeltaNet, "
                       f"or a dict with its parameter names ({list(_SHARED + _NEXT)}, or Qwen3.5's {list(_QWEN35)})")
    return w


def _project(x: Tensor, w: Mapping[str, Tensor], shape: DeltaNetShape):
    """``q, k: [t, key_dim]``, ``v, z: [t, value_dim]``, ``b, a: [t, hv]``.  Qwen3-Next (transformers'
    ``fix_query_key_value_ordering``): the projections are grouped per key head, ``[q k v z]`` and ``[b a]``.
    Qwen3.5: one projection each, flat (``[q | k | v]``)."""
    t, hk, r = x.shape[0], shape.num_k_heads, shape.num_v_heads // shape.num_k_heads
    if "in_proj_qkv.weight" in w:
        q, k, v = F.linear(x, w["in_proj_qkv.weight"]).split([shape.key_dim, shape.key_dim, shape.value_dim], -1)
        return q, k, v, F.linear(x, w["in_proj_z.weight"]), F.linear(x, w["in_proj_b.weight"]), F.linear(x, w["in_proj_a.weight"])
    qkvz = F.linear(x, w["in_proj_qkvz.weight"]).view(t, hk, 2 * shape.head_k_dim + 2 * r * shape.head_v_dim)
    ba = F.linear(x, w["in_proj_ba.weight"]).view(t, hk, 2 * r)
    q, k, v, z = qkvz.split([shape.head_k_dim, shape.head_k_dim, r * shape.head_v_dim, r * shape.head_v_dim], -1)
    b, a = ba.split([r, r], -1)
    return (q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1), z.reshape(t, -1),
            b.reshape(t, shape.num_v_heads), a.reshape(t, shape.num_v_heads))
