"""HF transformers multi-head latent attention weights (DeepSeek-V3's ``self_attn``) <-> packfwd's MLA layer's
(:mod:`packfwd.models.mixers.mla`, Megatron-Core's MLA names), TP-sharded: pure functions.

One layer's attention (``H`` heads, ``dq = dn + dr``; prefixes ``model.layers.{i}.self_attn.`` and
``decoder.layers.{j}.self_attention.``)::

    HF                                          Megatron-Core                   TP rank r holds
    q_proj.weight             [H * dq, h]       linear_q_proj.weight            rows: heads [r H/tp, (r+1) H/tp)
    q_a_proj.weight           [q_lora, h]       linear_q_down_proj.weight       rows: q_lora / tp
    q_a_layernorm.weight      [q_lora]          q_layernorm.weight              all
    q_b_proj.weight           [H * dq, q_lora]  linear_q_up_proj.weight         rows: its heads
    kv_a_proj_with_mqa.weight [kv_lora + dr, h] linear_kv_down_proj.weight      rows: (kv_lora + dr) / tp
    kv_a_layernorm.weight     [kv_lora]         kv_layernorm.weight             all
    kv_b_proj.weight          [H * (dn + dv), kv_lora]  linear_kv_up_proj.weight  rows: its heads
    o_proj.weight             [h, H * dv]       linear_proj.weight              columns: its heads

(``q_proj`` when ``q_lora_rank`` is None, else ``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``.)  The down
projections are column-parallel as in Megatron-Core's MLA (their outputs gathered in the forward), so their
widths must divide by TP.  Every tensor is copied both ways, dtype kept.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import Tensor

from .latent import Mla

__all__ = ["mla_from_hf", "mla_to_hf"]


def _pairs(mla: Mla) -> tuple[tuple[str, str, str], ...]:
    """(HF name, Megatron name, how it is split: "rows", "cols" or "all") of one layer's attention weights."""
    q = (("q_proj", "linear_q_proj", "rows"),) if mla.q_lora_rank is None else (
        ("q_a_proj", "linear_q_down_proj", "rows"), ("q_a_layernorm", "q_layernorm", "all"),
        ("q_b_proj", "linear_q_up_proj", "rows"))
    return (*q, ("kv_a_proj_with_mqa", "linear_kv_down_proj", "rows"), ("kv_a_layernorm", "kv_layernorm", "all"),
            ("kv_b_proj", "linear_kv_up_proj", "rows"), ("o_proj", "linear_proj", "cols"))


def mla_from_hf(sd: Mapping[str, Tensor], hf: str, mg: str, mla: Mla, *, tp_size: int = 1,
                tp_rank: int = 0) -> dict[str, Tensor]:
    """TP rank ``tp_rank``'s Megatron tensors of the attention ``hf`` (``"model.layers.0.self_attn."``) under
    ``mg`` (``"decoder.layers.0.self_attention."``).  New tensors.

    >>> mla = Mla(kv_lora_rank=4, qk_nope_head_dim=2, qk_rope_head_dim=2, v_head_dim=2)
    >>> names = {"q_proj": (8, 6), "kv_a_proj_with_mqa": (6, 6), "kv_a_layernorm": (4,), "kv_b_proj": (8, 4),
    ...          "o_proj": (6, 4)}
    >>> sd = {f"a.{n}.weight": torch.randn(*s) for n, s in names.items()}
    >>> shards = [mla_from_hf(sd, "a.", "m.", mla, tp_size=2, tp_rank=r) for r in (0, 1)]
    >>> tuple(shards[1]["m.linear_q_proj.weight"].shape), tuple(shards[1]["m.linear_proj.weight"].shape)
    ((4, 6), (6, 2))
    >>> back = mla_to_hf(shards, "a.", "m.", mla)
    >>> sorted(back) == sorted(sd) and all(torch.equal(back[n], t) for n, t in sd.items())
    True
    """
    out = {}
    for hf_name, mg_name, split in _pairs(mla):
        name = f"{hf}{hf_name}.weight"
        if name not in sd:
            raise ValueError(f"no {name} in the HF state dict: a DeepSeek-V3 attention with q_lora_rank="
                             f"{mla.q_lora_rank} has it (q_proj without a q_lora_rank, q_a_proj/q_b_proj with one)")
        t = sd[name]
        if split != "all" and t.shape[split == "cols"] % tp_size:
            raise ValueError(f"{name} of shape {tuple(t.shape)} does not split over tp_size={tp_size}; pick a TP "
                             "size that divides the heads and the latent widths")
        part = t if split == "all" else t.chunk(tp_size, dim=int(split == "cols"))[tp_rank]
        out[f"{mg}{mg_name}.weight"] = part.clone()
    return out


def mla_to_hf(shards: Sequence[Mapping[str, Tensor]], hf: str, mg: str, mla: Mla) -> dict[str, Tensor]:
    """The inverse of :func:`mla_from_hf`: the HF tensors from every TP rank's state dict, in rank order."""
    out = {}
    for hf_name, mg_name, split in _pairs(mla):
        parts = [s[f"{mg}{mg_name}.weight"] for s in shards]
        whole = parts[0].clone() if split == "all" else torch.cat(parts, dim=int(split == "cols"))
        out[f"{hf}{hf_name}.weight"] = whole
    return out
