"""HF transformers MoE weights (Qwen3-MoE, Mixtral) <-> a packfwd MoE layer's, TP-sharded: pure functions.

One MoE MLP, ``E`` experts of width ``f``, hidden ``h`` (transformers 5 stores the experts fused, as
``Qwen3MoeExperts`` / ``MixtralExperts`` do; a checkpoint's per-expert names are read too)::

    HF                                          packfwd (Megatron-Core's MoELayer, SequentialMLP experts)
    mlp.gate.weight              [E, h]         mlp.router.weight                                [E, h]
    mlp.experts.gate_up_proj     [E, 2f, h]     mlp.experts.local_experts.{e}.linear_fc1.weight  [2f, h] [gate; up]
    mlp.experts.down_proj        [E, h, f]      mlp.experts.local_experts.{e}.linear_fc2.weight  [h, f]
    (mlp.experts.{e}.gate_proj / up_proj / down_proj .weight: [f, h], [f, h], [h, f])

A TP rank holds ``[gate_r; up_r]`` rows of ``linear_fc1`` and the matching columns of ``linear_fc2`` (the
experts' tensor-parallel size is the model's); the router is replicated.  An expert-parallel rank holds the
experts ``experts`` (global ids), numbered ``local_experts.0 ...`` in order.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import Tensor

__all__ = ["moe_from_hf", "moe_to_hf"]


def moe_from_hf(
    sd: Mapping[str, Tensor], hf: str, mg: str, experts: Sequence[int], *, tp_size: int = 1, tp_rank: int = 0,
) -> dict[str, Tensor]:
    """TP rank ``tp_rank``'s tensors of the MoE MLP ``hf`` (a prefix such as ``"model.layers.1.mlp."``) under
    Megatron's prefix ``mg`` (``"decoder.layers.1.mlp."``), for the global experts ``experts``.  New tensors.

    >>> E, f, h = 2, 3, 4
    >>> sd = {"m.gate.weight": torch.randn(E, h), "m.experts.gate_up_proj": torch.randn(E, 2 * f, h),
    ...       "m.experts.down_proj": torch.randn(E, h, f)}
    >>> out = moe_from_hf(sd, "m.", "g.", range(E))
    >>> torch.equal(out["g.experts.local_experts.1.linear_fc1.weight"], sd["m.experts.gate_up_proj"][1])
    True
    >>> back = moe_to_hf([out], "m.", "g.", E)
    >>> sorted(back) == sorted(sd) and all(torch.equal(back[k], v) for k, v in sd.items())
    True
    """
    out = {mg + "router.weight": sd[hf + "gate.weight"].clone()}
    for local, e in enumerate(experts):
        gate_up, down = _expert(sd, hf, e)
        gate, up = gate_up.chunk(2, dim=0)
        p = f"{mg}experts.local_experts.{local}."
        out[p + "linear_fc1.weight"] = torch.cat([gate.chunk(tp_size)[tp_rank], up.chunk(tp_size)[tp_rank]]).clone()
        out[p + "linear_fc2.weight"] = down.chunk(tp_size, dim=1)[tp_rank].clone()
    return out


def moe_to_hf(shards: Sequence[Mapping[str, Tensor]], hf: str, mg: str, num_experts: int) -> dict[str, Tensor]:
    """The inverse of :func:`moe_from_hf` for all ``num_experts`` experts (every TP rank's state dict, in rank
    order; no expert parallelism): the fused HF tensors transformers' own state dict holds.  New tensors."""
    gate_up, down = [], []
    for e in range(num_experts):
        p = f"{mg}experts.local_experts.{e}."
        gates, ups = zip(*(s[p + "linear_fc1.weight"].chunk(2, dim=0) for s in shards))
        gate_up.append(torch.cat([*gates, *ups]))
        down.append(torch.cat([s[p + "linear_fc2.weight"] for s in shards], dim=1))
    return {hf + "gate.weight": shards[0][mg + "router.weight"].clone(),
            hf + "experts.gate_up_proj": torch.stack(gate_up), hf + "experts.down_proj": torch.stack(down)}


def _expert(sd: Mapping[str, Tensor], hf: str, e: int) -> tuple[Tensor, Tensor]:
    """Expert ``e``'s ``([gate; up] [2f, h], down [h, f])`` from the fused or the per-expert HF names."""
    if hf + "experts.gate_up_proj" in sd:
        return sd[hf + "experts.gate_up_proj"][e], sd[hf + "experts.down_proj"][e]
    p = f"{hf}experts.{e}."
    if p + "gate_proj.weight" not in sd:
        raise ValueError(f"no weights of expert {e} under {hf!r}: expected {hf}experts.gate_up_proj (transformers 5) "
                         f"or {p}gate_proj.weight")
    return torch.cat([sd[p + "gate_proj.weight"], sd[p + "up_proj.weight"]]), sd[p + "down_proj.weight"]
