"""The vocabulary of packfwd's weight mappings: one :class:`Weight` row per Megatron-Core tensor, naming the HF
tensor(s) it is made of and how tensor parallelism cuts it; and the two pure functions that apply a table of rows
(:func:`rows_to_megatron`, :func:`rows_to_hf`).  Pure torch, no Megatron-Core.

A component (a token mixer, an MLP) keeps the table of one layer's tensors under its own module, names relative
to the layer (``self_attention.linear_proj.weight`` under ``decoder.layers.{j}.``, ``self_attn.o_proj.weight``
under ``model.layers.{i}.``); a family's table is its components' tables with the decoder's own rows
(:mod:`packfwd.models.families.entry`); :mod:`packfwd.models.convert.hf_weights` applies it, layer by layer.  As
Megatron-Bridge's ``MegatronMappingRegistry`` keeps one table per model, with these cuts (``split``):

======== ================================================== ===============================================
split    TP rank ``r`` of ``tp`` holds                       from HF
======== ================================================== ===============================================
same     the whole tensor (norms, routers, row-parallel      the tensor
         biases)
rows     rows ``[r n / tp, (r + 1) n / tp)`` (column-        the tensor
         parallel linears, the embedding)
cols     those columns (row-parallel linears)                the tensor
qkv      ``ng / tp`` whole query groups of Megatron's        ``(q, k, v)``, heads contiguous
         ``[q heads of group g, k_g, v_g]`` layout
gate_up  ``[gate_r; up_r]``                                  ``(gate, up)``
======== ================================================== ===============================================

``when`` is the row's condition on the model's :class:`~packfwd.models.args.ModelArgs` (None: always): a bias only
with ``qkv_bias``, a query latent only with ``q_lora_rank``.

>>> table = (Weight("norm.weight", "ln.weight"), Weight("fc.weight", "proj.weight", "cols"),
...          Weight("fc.bias", "proj.bias", when=lambda args: args))  # args: here a bool
>>> sd = {"h.ln.weight": torch.ones(4), "h.proj.weight": torch.arange(8.).view(2, 4)}
>>> shard = rows_to_megatron(table, False, sd, "h.", "m.", tp_size=2, tp_rank=1)
>>> sorted(shard), shard["m.fc.weight"].tolist()
(['m.fc.weight', 'm.norm.weight'], [[2.0, 3.0], [6.0, 7.0]])
>>> back = rows_to_hf(table, False, [rows_to_megatron(table, False, sd, "h.", "m.", 2, r) for r in (0, 1)], "m.", "h.")
>>> all(torch.equal(back[k], v) for k, v in sd.items()) and sorted(back) == sorted(sd)
True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import Tensor

__all__ = ["SPLITS", "Weight", "rows_to_hf", "rows_to_megatron"]

SPLITS = ("same", "rows", "cols", "qkv", "gate_up")


@dataclass(frozen=True)
class Weight:
    """One Megatron-Core tensor of a mapping table: its name, the HF name(s) it is made of, its TP cut and its
    condition (module docstring).

    >>> Weight("linear_fc1.weight", ("gate_proj.weight", "up_proj.weight"), "gate_up").hf_names
    ('gate_proj.weight', 'up_proj.weight')
    """

    mg: str  # the Megatron-Core name
    hf: str | tuple[str, ...]  # the HF name; (q, k, v) for "qkv", (gate, up) for "gate_up"
    split: str = "same"
    when: Callable[[Any], bool] | None = None  # of the model's ModelArgs; None: always

    def __post_init__(self):
        if self.split not in SPLITS:
            raise ValueError(f"Weight({self.mg!r}): split={self.split!r} is not one of {SPLITS}")
        wants = {"qkv": 3, "gate_up": 2}.get(self.split, 1)
        if len(self.hf_names) != wants:
            raise ValueError(f"Weight({self.mg!r}, split={self.split!r}) takes {wants} HF name(s), got {self.hf!r}")

    @property
    def hf_names(self) -> tuple[str, ...]:
        return (self.hf,) if isinstance(self.hf, str) else tuple(self.hf)

    def applies(self, args) -> bool:
        return self.when is None or bool(self.when(args))


def rows_to_megatron(table: Sequence[Weight], args, sd: Mapping[str, Tensor], hf: str, mg: str, tp_size: int = 1,
                     tp_rank: int = 0) -> dict[str, Tensor]:
    """TP rank ``tp_rank``'s Megatron-Core tensors of ``table`` (the rows ``args`` takes): HF names under the prefix
    ``hf`` read from ``sd``, Megatron-Core names under ``mg``.  New tensors; a missing HF tensor or one that does not
    split over ``tp_size`` is a ValueError naming it."""
    out = {}
    for row in table:
        if not row.applies(args):
            continue
        names = [hf + n for n in row.hf_names]
        missing = [n for n in names if n not in sd]
        if missing:
            raise ValueError(f"no {missing[0]} in the HF state dict: the model's config says it has one (for "
                             f"{mg + row.mg}); check that the config matches the checkpoint")
        tensors = [sd[n] for n in names]
        whole = args.query_groups if row.split == "qkv" else tensors[0].shape[int(row.split == "cols")]
        if row.split != "same" and whole % tp_size:
            raise ValueError(f"{names[0]} of shape {tuple(tensors[0].shape)} does not split over tp_size={tp_size}"
                             f"{' (its query groups)' if row.split == 'qkv' else ''}; pick a TP size that divides it")
        out[mg + row.mg] = _cut(row.split, tensors, args, tp_size, tp_rank)
    return out


def rows_to_hf(table: Sequence[Weight], args, shards: Sequence[Mapping[str, Tensor]], mg: str,
               hf: str) -> dict[str, Tensor]:
    """The inverse of :func:`rows_to_megatron`: the HF tensors of ``table`` from every TP rank's state dict, in rank
    order.  New tensors."""
    out = {}
    for row in table:
        if not row.applies(args):
            continue
        parts = [s[mg + row.mg] for s in shards]
        out.update(zip((hf + n for n in row.hf_names), _join(row.split, parts, args)))
    return out


def _cut(split: str, tensors: list[Tensor], args, tp: int, rank: int) -> Tensor:
    if split == "same":
        return tensors[0].clone()
    if split in ("rows", "cols"):
        return tensors[0].chunk(tp, dim=int(split == "cols"))[rank].clone()
    if split == "gate_up":
        return torch.cat([t.chunk(tp, dim=0)[rank] for t in tensors])
    q, k, v = tensors  # qkv: [q; k; v] (heads contiguous) -> rank's rows of the per-group [q heads, k, v] layout
    ng, d = args.query_groups, args.kv_channels
    trail = q.shape[1:]
    fused = torch.cat([q.reshape(ng, -1, *trail), k.reshape(ng, d, *trail), v.reshape(ng, d, *trail)], dim=1)
    return fused.chunk(tp, dim=0)[rank].reshape(-1, *trail).clone()


def _join(split: str, parts: list[Tensor], args) -> tuple[Tensor, ...]:
    if split == "same":
        return (parts[0].clone(),)
    if split in ("rows", "cols"):
        return (torch.cat(parts, dim=int(split == "cols")),)
    if split == "gate_up":
        gates, ups = zip(*(p.chunk(2, dim=0) for p in parts))
        return torch.cat(gates), torch.cat(ups)
    ng, d = args.query_groups, args.kv_channels
    r = args.num_attention_heads // ng
    fused = torch.cat(parts, dim=0)
    trail = fused.shape[1:]
    q, k, v = fused.reshape(ng, (r + 2) * d, *trail).split([r * d, d, d], dim=1)
    return tuple(t.reshape(-1, *trail).clone() for t in (q, k, v))
