"""Gated DeltaNet (the linear attention of Qwen3-Next and Qwen3.5) as a token-mixer component: its description
(:class:`DeltaNet`, the ``ModelArgs.linear_attention`` field: sizes and which layers have it), its checks, its
layer spec and its weight mapping.  The math is :mod:`packfwd.models.mixers.deltanet`'s, the Megatron-Core module
:mod:`packfwd.models.mixers.gdn`'s (imported when a model is built).  No Megatron-Core here.

A hybrid model's layers are of two kinds: ``DeltaNet.layers`` (0-based) hold Gated DeltaNet, the others the
model's attention (:func:`packfwd.models.mixers.mixer` says which per layer).  transformers' configs give the
pattern as ``layer_types`` (``"linear_attention"`` / ``"full_attention"``; older Qwen3-Next configs as
``full_attention_interval``, which transformers turns into ``layer_types``): :func:`linear_layers`.

Weights (``hk`` key heads of ``dk``, ``hv`` value heads of ``dv``, ``r = hv / hk``; Megatron-Core's
``GatedDeltaNet`` names and layout under ``decoder.layers.{j}.self_attention.``, HF under
``model.layers.{i}.linear_attn.``)::

    Megatron-Core                          HF (Qwen3.5: flat)           HF (Qwen3-Next: grouped per key head)
    in_proj.weight  [2hk dk + 2hv dv + 2hv, h]  in_proj_qkv [q|k|v], in_proj_z,   in_proj_qkvz [hk, (q k v_r z_r)],
                    [q | k | v | z | b | a]     in_proj_b, in_proj_a            in_proj_ba [hk, (b_r a_r)]
    conv1d.weight   [2hk dk + hv dv, 1, w]      conv1d.weight [q | k | v]
    A_log, dt_bias  [hv]                        A_log, dt_bias
    out_norm.weight [dv]                        norm.weight (the gated RMSNorm, replicated)
    out_proj.weight [h, hv dv]                  out_proj.weight

Tensor parallelism splits the heads as Megatron-Core does: rank ``p`` of ``tp`` holds key heads ``[p hk/tp, (p+1)
hk/tp)`` and the value heads they serve, so its rows of ``in_proj`` are ``[q_p | k_p | v_p | z_p | b_p | a_p]``
(each section cut in ``tp``), of ``conv1d`` ``[q_p | k_p | v_p]``, of ``A_log`` / ``dt_bias`` its value heads; the
columns of ``out_proj`` its value channels.  Context parallelism keeps the weights whole on every CP rank: the
module cuts each TP rank's heads over the CP ranks at run time (an all-to-all trading tokens for heads,
:mod:`packfwd.models.mixers.gdn`), so the mapping does not change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
from torch import Tensor

from ..component import Component
from .deltanet import DeltaNetShape

__all__ = ["DeltaNet", "GATED_DELTANET", "GatedDeltaNetMixer", "linear_layers"]

_HF_FLAT = ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight")
_HF_GROUPED = ("in_proj_qkvz.weight", "in_proj_ba.weight")
_SAME = (("A_log", "A_log"), ("dt_bias", "dt_bias"))


@dataclass(frozen=True)
class DeltaNet:
    """The Gated DeltaNet layers of a hybrid model: their sizes (transformers' ``linear_*`` config fields) and
    which layers they are.

    >>> DeltaNet(num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8, layers=(0, 1, 2)).in_proj_sections()
    (16, 16, 32, 32, 4, 4)
    """

    num_k_heads: int  # query/key heads (linear_num_key_heads)
    num_v_heads: int  # value heads, a multiple of num_k_heads (linear_num_value_heads)
    head_k_dim: int  # linear_key_head_dim
    head_v_dim: int  # linear_value_head_dim
    conv_kernel_dim: int = 4  # the short causal convolution's width (linear_conv_kernel_dim)
    layers: tuple[int, ...] = ()  # 0-based layers that are Gated DeltaNet (layer_types "linear_attention")
    grouped_projections: bool = False  # HF projections grouped per key head (Qwen3-Next), else flat (Qwen3.5)
    chunk_size: int = 64  # tokens per chunk of the delta rule (chunk boundaries restart at every sequence)

    def __post_init__(self):
        for name in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "conv_kernel_dim", "chunk_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DeltaNet.{name} must be a positive int, got {value!r}")
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"DeltaNet.num_v_heads={self.num_v_heads} must be a multiple of "
                             f"num_k_heads={self.num_k_heads} (each key head serves num_v_heads / num_k_heads)")
        layers = tuple(self.layers)
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers) or len(set(layers)) != len(layers):
            raise ValueError(f"DeltaNet.layers={self.layers!r}: pass distinct 0-based layer indices")
        object.__setattr__(self, "layers", tuple(sorted(layers)))
        if not isinstance(self.grouped_projections, bool):
            raise TypeError(f"DeltaNet.grouped_projections must be True or False, got {self.grouped_projections!r}")

    def in_proj_sections(self, tp_size: int = 1) -> tuple[int, ...]:
        """The widths of ``in_proj``'s sections ``(q, k, v, z, b, a)`` on one of ``tp_size`` ranks."""
        kd, vd, hv = self.num_k_heads * self.head_k_dim, self.num_v_heads * self.head_v_dim, self.num_v_heads
        return tuple(w // tp_size for w in (kd, kd, vd, vd, hv, hv))

    def shape(self, hidden_size: int, eps: float, tp_size: int = 1) -> DeltaNetShape:
        """The :class:`~packfwd.models.mixers.deltanet.DeltaNetShape` of one of ``tp_size`` ranks (its heads)."""
        return DeltaNetShape(hidden_size, self.num_k_heads // tp_size, self.num_v_heads // tp_size, self.head_k_dim,
                             self.head_v_dim, self.conv_kernel_dim, "silu", eps)

    @classmethod
    def from_hf(cls, cfg, *, grouped_projections: bool) -> "DeltaNet":
        """From a transformers config with the ``linear_*`` fields and ``layer_types`` (Qwen3-Next, Qwen3.5)."""
        return cls(cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                   cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim, linear_layers(cfg),
                   grouped_projections=grouped_projections)


def linear_layers(cfg) -> tuple[int, ...]:
    """The 0-based layers of a transformers config that are linear attention: ``layer_types[i] ==
    "linear_attention"`` (every other entry must be ``"full_attention"``).

    >>> from types import SimpleNamespace
    >>> linear_layers(SimpleNamespace(num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"]))
    (0, 1, 2)
    """
    types = list(getattr(cfg, "layer_types", None) or [])
    if len(types) != cfg.num_hidden_layers:
        raise ValueError(f"layer_types has {len(types)} entries for num_hidden_layers={cfg.num_hidden_layers}; "
                         "give one per layer ('linear_attention' or 'full_attention')")
    unknown = sorted(set(types) - {"linear_attention", "full_attention"})
    if unknown:
        raise ValueError(f"layer_types holds {unknown}: packfwd builds 'linear_attention' (Gated DeltaNet) and "
                         "'full_attention' layers only")
    return tuple(i for i, kind in enumerate(types) if kind == "linear_attention")


def _grouped_to_flat(qkvz: Tensor, ba: Tensor, d: DeltaNet) -> tuple[Tensor, ...]:
    """Qwen3-Next's grouped ``in_proj_qkvz`` / ``in_proj_ba`` as the flat sections ``(q, k, v, z, b, a)``."""
    hk, r = d.num_k_heads, d.num_v_heads // d.num_k_heads
    h = qkvz.shape[1:]
    q, k, v, z = qkvz.reshape(hk, -1, *h).split([d.head_k_dim, d.head_k_dim, r * d.head_v_dim, r * d.head_v_dim], 1)
    b, a = ba.reshape(hk, 2 * r, *h).split([r, r], 1)
    return tuple(x.reshape(-1, *h) for x in (q, k, v, z, b, a))


def _flat_to_grouped(q, k, v, z, b, a, d: DeltaNet) -> tuple[Tensor, Tensor]:
    hk = d.num_k_heads
    h = q.shape[1:]
    qkvz = torch.cat([x.reshape(hk, -1, *h) for x in (q, k, v, z)], 1).reshape(-1, *h)
    return qkvz, torch.cat([x.reshape(hk, -1, *h) for x in (b, a)], 1).reshape(-1, *h)


def _cut(sections: Sequence[Tensor], tp: int, rank: int) -> Tensor:
    """Rank ``rank``'s rows: each section cut in ``tp``, the rank's pieces in order (new tensor)."""
    return torch.cat([x.chunk(tp, dim=0)[rank] for x in sections]).clone()


def _join(parts: Sequence[Tensor], widths: Sequence[int]) -> list[Tensor]:
    """The inverse of :func:`_cut`: every rank's rows (``widths`` the local sections) -> the whole sections."""
    pieces = [p.split(list(widths), dim=0) for p in parts]
    return [torch.cat([piece[i] for piece in pieces]) for i in range(len(widths))]


class GatedDeltaNetMixer(Component):
    """Gated DeltaNet as a token-mixer component (module docstring).  A model has it where
    ``ModelArgs.linear_attention`` is a :class:`DeltaNet`, on its ``layers``; the other layers keep the model's
    attention.

    >>> from packfwd.models.args import ModelArgs
    >>> args = ModelArgs(vocab_size=64, hidden_size=32, ffn_hidden_size=64, num_layers=2, num_attention_heads=2,
    ...                  family="qwen3_5", head_dim=16, qk_norm=True, attention_output_gate=True,
    ...                  norm_zero_centered=True, linear_attention=DeltaNet(2, 4, 8, 8, layers=(0,)))
    >>> GATED_DELTANET.tp_widths(args)
    (('linear_num_key_heads', 2), ('linear_num_value_heads', 4))
    """

    name = "gated deltanet"
    fields = ("linear_attention",)

    def check(self, args) -> None:
        d = args.linear_attention
        if not isinstance(d, DeltaNet):
            raise TypeError(f"ModelArgs.linear_attention must be a packfwd.models.mixers.DeltaNet or None, got "
                            f"{type(d).__name__}")
        outside = [i for i in d.layers if i >= args.num_layers]
        if outside:
            raise ValueError(f"DeltaNet.layers {outside} lie outside num_layers={args.num_layers}; pass 0-based "
                             "indices of the model's layers")

    def config_fields(self, args) -> dict:
        """Megatron-Core's ``linear_*`` fields (what its own ``GatedDeltaNet`` reads; packfwd's module takes the
        description from its spec)."""
        d = args.linear_attention
        return dict(linear_conv_kernel_dim=d.conv_kernel_dim, linear_key_head_dim=d.head_k_dim,
                    linear_value_head_dim=d.head_v_dim, linear_num_key_heads=d.num_k_heads,
                    linear_num_value_heads=d.num_v_heads)

    def tp_widths(self, args) -> tuple[tuple[str, int], ...]:
        d = args.linear_attention
        return (("linear_num_key_heads", d.num_k_heads), ("linear_num_value_heads", d.num_v_heads))

    def layer_spec(self, args, layer: int, **params):
        """:func:`packfwd.models.mixers.gdn.gated_deltanet_spec` (the build options of softmax attention ignored)."""
        from .gdn import gated_deltanet_spec

        return gated_deltanet_spec(args)

    def hf_to_megatron(self, args, sd: Mapping[str, Tensor], hf_layer: str, mg_layer: str, *, tp_size: int,
                       tp_rank: int) -> dict[str, Tensor]:
        d, h, m = args.linear_attention, hf_layer + "linear_attn.", mg_layer + "self_attention."
        names = _HF_GROUPED if d.grouped_projections else _HF_FLAT
        missing = [h + n for n in (*names, "conv1d.weight", "A_log", "dt_bias", "norm.weight", "out_proj.weight")
                   if h + n not in sd]
        if missing:
            raise ValueError(f"no {missing[0]} in the HF state dict: the model's config says layer {hf_layer} is "
                             f"Gated DeltaNet with {'grouped' if d.grouped_projections else 'flat'} projections; "
                             "check that the config matches the checkpoint")
        if d.grouped_projections:
            q, k, v, z, b, a = _grouped_to_flat(sd[h + names[0]], sd[h + names[1]], d)
        else:
            q, k, v = sd[h + names[0]].split(d.in_proj_sections()[:3])
            z, b, a = (sd[h + n] for n in names[1:])
        conv = sd[h + "conv1d.weight"]
        out = {m + "in_proj.weight": _cut((q, k, v, z, b, a), tp_size, tp_rank),
               m + "conv1d.weight": _cut(conv.split(d.in_proj_sections()[:3]), tp_size, tp_rank),
               m + "out_norm.weight": sd[h + "norm.weight"].clone(),
               m + "out_proj.weight": sd[h + "out_proj.weight"].chunk(tp_size, dim=1)[tp_rank].clone()}
        out.update({m + mg: sd[h + name].chunk(tp_size)[tp_rank].clone() for mg, name in _SAME})
        return out

    def megatron_to_hf(self, args, shards: Sequence[Mapping[str, Tensor]], mg_layer: str,
                       hf_layer: str) -> dict[str, Tensor]:
        d, h, m = args.linear_attention, hf_layer + "linear_attn.", mg_layer + "self_attention."
        tp = len(shards)
        q, k, v, z, b, a = _join([s[m + "in_proj.weight"] for s in shards], d.in_proj_sections(tp))
        out = {h + "conv1d.weight": torch.cat(_join([s[m + "conv1d.weight"] for s in shards],
                                                    d.in_proj_sections(tp)[:3])),
               h + "norm.weight": shards[0][m + "out_norm.weight"].clone(),
               h + "out_proj.weight": torch.cat([s[m + "out_proj.weight"] for s in shards], dim=1)}
        out.update({h + name: torch.cat([s[m + mg] for s in shards]) for mg, name in _SAME})
        if d.grouped_projections:
            out.update(zip((h + n for n in _HF_GROUPED), _flat_to_grouped(q, k, v, z, b, a, d)))
        else:
            out.update(zip((h + n for n in _HF_FLAT), (torch.cat((q, k, v)), z, b, a)))
        return out


GATED_DELTANET = GatedDeltaNetMixer()
