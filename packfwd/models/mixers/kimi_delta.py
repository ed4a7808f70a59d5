"""Kimi Delta Attention (KDA, the linear attention of Kimi-Linear) as a token-mixer component: its description
(:class:`Kda`, the ``ModelArgs.linear_attention`` field of a Kimi-Linear model: sizes and which layers have it), its
checks, its layer spec and its weight mapping.  The math is :func:`packfwd.models.mixers.deltanet.kda_mix` (Gated
DeltaNet's convolution, chunked delta rule and gated norm, the forget gate per key channel), the Megatron-Core
module :class:`packfwd.models.mixers.kda.PackedKimiDeltaAttention` (imported when a model is built).  No
Megatron-Core here.

KDA is Gated DeltaNet with ``H`` heads of ``d`` channels for queries, keys and values alike, a forget gate ``g`` per
key channel from a low-rank projection (``f_b_proj(f_a_proj(x))`` plus ``dt_bias``, per channel; ``A_log`` per
head), and an output gate from another (``g_b_proj(g_a_proj(x))``) through a sigmoid-gated RMSNorm.

Weights (Megatron-Core-style names under ``decoder.layers.{j}.self_attention.``, HF under
``model.layers.{i}.self_attn.``; TP rank ``p`` of ``tp`` holds heads ``[p H/tp, (p+1) H/tp)``)::

    packfwd                          HF                                 TP rank p holds
    in_proj.weight  [3Hd + H, h]     [q_proj | k_proj | v_proj | b_proj]  each section's rows of its heads
    conv1d.weight   [3Hd, 1, w]      conv1d.weight [q | k | v]          each section's rows of its heads
    f_a_proj.weight [d, h]           forget_gate.f_a_proj.weight        rows: d / tp (outputs gathered)
    f_b_proj.weight [Hd, d]          forget_gate.f_b_proj.weight        rows: its heads
    dt_bias         [Hd]             forget_gate.dt_bias                its heads
    A_log           [H]              forget_gate.A_log [1, 1, H, 1]     its heads
    g_a_proj.weight [d, h]           g_a_proj.weight                    rows: d / tp (outputs gathered)
    g_b_proj.weight [Hd, d]          g_b_proj.weight                    rows: its heads
    out_norm.weight [d]              o_norm.weight                      all
    out_proj.weight [h, Hd]          o_proj.weight                      columns: its heads

The low-rank down projections are column-parallel with their outputs gathered, as multi-head latent attention's
are (:mod:`packfwd.models.mixers.mla`), so ``d`` must divide by TP.  Context parallelism keeps the weights whole on
every CP rank and trades tokens for heads at run time, as for Gated DeltaNet (:mod:`packfwd.models.mixers.gdn`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
from torch import Tensor

from ..component import Component
from .deltanet import DeltaNetShape
from .gated_deltanet import _cut, _join, linear_layers

__all__ = ["KIMI_DELTA_ATTENTION", "Kda", "KimiDeltaAttentionMixer"]

_PER_HEAD = (("f_b_proj.weight", "forget_gate.f_b_proj.weight"), ("dt_bias", "forget_gate.dt_bias"),
             ("g_b_proj.weight", "g_b_proj.weight"))
_LOW_RANK = (("f_a_proj.weight", "forget_gate.f_a_proj.weight"), ("g_a_proj.weight", "g_a_proj.weight"))


@dataclass(frozen=True)
class Kda:
    """The Kimi Delta Attention layers of a Kimi-Linear model: their sizes (transformers' ``linear_*`` config
    fields) and which layers they are.

    >>> Kda(num_heads=2, head_dim=8, layers=(0, 2)).sections()
    (16, 16, 16, 16, 2, 16)
    """

    num_heads: int  # query, key and value heads (linear_num_heads)
    head_dim: int  # their channels, and the rank of the gates' low-rank projections (linear_head_dim)
    conv_kernel_dim: int = 4  # the short causal convolution's width (linear_conv_kernel_dim)
    layers: tuple[int, ...] = ()  # 0-based layers that are KDA (layer_types "linear_attention")
    chunk_size: int = 64  # tokens per chunk of the delta rule (chunk boundaries restart at every sequence)

    def __post_init__(self):
        for name in ("num_heads", "head_dim", "conv_kernel_dim", "chunk_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Kda.{name} must be a positive int, got {value!r}")
        layers = tuple(self.layers)
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers) or len(set(layers)) != len(layers):
            raise ValueError(f"Kda.layers={self.layers!r}: pass distinct 0-based layer indices")
        object.__setattr__(self, "layers", tuple(sorted(layers)))

    # Gated DeltaNet's names, for the code the two share (the CP head count, the module's checks)
    @property
    def num_k_heads(self) -> int:
        return self.num_heads

    @property
    def num_v_heads(self) -> int:
        return self.num_heads

    def sections(self, tp_size: int = 1) -> tuple[int, ...]:
        """The widths, on one of ``tp_size`` ranks, of the per-head inputs of the math ``(q, k, v, f, b, gate)``
        (:func:`~packfwd.models.mixers.deltanet.kda_mix`)."""
        hd, h = self.num_heads * self.head_dim // tp_size, self.num_heads // tp_size
        return (hd, hd, hd, hd, h, hd)

    def in_proj_sections(self, tp_size: int = 1) -> tuple[int, ...]:
        """The widths of ``in_proj``'s sections ``(q, k, v, b)`` on one of ``tp_size`` ranks."""
        q, k, v, _, b, _ = self.sections(tp_size)
        return (q, k, v, b)

    def shape(self, hidden_size: int, eps: float, tp_size: int = 1) -> DeltaNetShape:
        """The :class:`~packfwd.models.mixers.deltanet.DeltaNetShape` of one of ``tp_size`` ranks (its heads)."""
        h = self.num_heads // tp_size
        return DeltaNetShape(hidden_size, h, h, self.head_dim, self.head_dim, self.conv_kernel_dim, "silu", eps)

    @classmethod
    def from_hf(cls, cfg) -> "Kda":
        """From a transformers ``KimiLinearConfig`` (``linear_num_heads``, ``linear_head_dim``,
        ``linear_conv_kernel_dim``, ``layer_types``)."""
        return cls(cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_dim, linear_layers(cfg))


class KimiDeltaAttentionMixer(Component):
    """Kimi Delta Attention as a token-mixer component (module docstring).  A model has it where
    ``ModelArgs.linear_attention`` is a :class:`Kda`, on its ``layers``; the other layers keep the model's
    attention (Kimi-Linear: multi-head latent attention without RoPE).

    >>> KIMI_DELTA_ATTENTION.tp_widths(type("Args", (), {"linear_attention": Kda(4, 8)})())
    (('linear_num_heads', 4), ('linear_head_dim', 8))
    """

    name = "kimi delta attention"
    fields = ("linear_attention",)

    def check(self, args) -> None:
        d = args.linear_attention
        if not isinstance(d, Kda):
            raise TypeError(f"ModelArgs.linear_attention must be a packfwd.models.mixers.Kda here, got "
                            f"{type(d).__name__}")
        outside = [i for i in d.layers if i >= args.num_layers]
        if outside:
            raise ValueError(f"Kda.layers {outside} lie outside num_layers={args.num_layers}; pass 0-based "
                             "indices of the model's layers")

    def config_fields(self, args) -> dict:
        """Megatron-Core's ``linear_*`` fields, as for Gated DeltaNet (packfwd's module reads its spec's ``kda``)."""
        d = args.linear_attention
        return dict(linear_conv_kernel_dim=d.conv_kernel_dim, linear_key_head_dim=d.head_dim,
                    linear_value_head_dim=d.head_dim, linear_num_key_heads=d.num_heads,
                    linear_num_value_heads=d.num_heads)

    def tp_widths(self, args) -> tuple[tuple[str, int], ...]:
        d = args.linear_attention
        return (("linear_num_heads", d.num_heads), ("linear_head_dim", d.head_dim))

    def layer_spec(self, args, layer: int, **params):
        """:func:`packfwd.models.mixers.kda.kda_spec` (the build options of the model's attention ignored)."""
        from .kda import kda_spec

        return kda_spec(args)

    def hf_to_megatron(self, args, sd: Mapping[str, Tensor], hf_layer: str, mg_layer: str, *, tp_size: int,
                       tp_rank: int) -> dict[str, Tensor]:
        d, h, m = args.linear_attention, hf_layer + "self_attn.", mg_layer + "self_attention."
        names = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "b_proj.weight", "conv1d.weight",
                 "forget_gate.A_log", "o_norm.weight", "o_proj.weight", *(n for _, n in _PER_HEAD + _LOW_RANK))
        missing = [h + n for n in names if h + n not in sd]
        if missing:
            raise ValueError(f"no {missing[0]} in the HF state dict: the model's config says layer {hf_layer} is "
                             "Kimi Delta Attention; check that the config matches the checkpoint")
        conv = sd[h + "conv1d.weight"]
        out = {m + "in_proj.weight": _cut([sd[h + n] for n in names[:4]], tp_size, tp_rank),
               m + "conv1d.weight": _cut(conv.split(d.in_proj_sections()[:3]), tp_size, tp_rank),
               m + "A_log": sd[h + "forget_gate.A_log"].reshape(-1).chunk(tp_size)[tp_rank].clone(),
               m + "out_norm.weight": sd[h + "o_norm.weight"].clone(),
               m + "out_proj.weight": sd[h + "o_proj.weight"].chunk(tp_size, dim=1)[tp_rank].clone()}
        out.update({m + mg: sd[h + n].chunk(tp_size)[tp_rank].clone() for mg, n in _PER_HEAD + _LOW_RANK})
        return out

    def megatron_to_hf(self, args, shards: Sequence[Mapping[str, Tensor]], mg_layer: str,
                       hf_layer: str) -> dict[str, Tensor]:
        d, h, m = args.linear_attention, hf_layer + "self_attn.", mg_layer + "self_attention."
        tp = len(shards)
        q, k, v, b = _join([s[m + "in_proj.weight"] for s in shards], d.in_proj_sections(tp))
        out = {h + "q_proj.weight": q, h + "k_proj.weight": k, h + "v_proj.weight": v, h + "b_proj.weight": b,
               h + "conv1d.weight": torch.cat(_join([s[m + "conv1d.weight"] for s in shards],
                                                    d.in_proj_sections(tp)[:3])),
               h + "forget_gate.A_log": torch.cat([s[m + "A_log"] for s in shards]).reshape(1, 1, -1, 1),
               h + "o_norm.weight": shards[0][m + "out_norm.weight"].clone(),
               h + "o_proj.weight": torch.cat([s[m + "out_proj.weight"] for s in shards], dim=1)}
        out.update({h + n: torch.cat([s[m + mg] for s in shards]) for mg, n in _PER_HEAD + _LOW_RANK})
        return out


KIMI_DELTA_ATTENTION = KimiDeltaAttentionMixer()
