"""HF transformers MoE weights (Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V3's MoE block) <-> a packfwd MoE layer's,
TP-sharded: the routed experts (:func:`experts_from_hf`, :func:`experts_to_hf`; the router, its bias and the shared
experts are :mod:`packfwd.models.mlp.moe`'s table ``WEIGHTS``), and the experts' expert-parallel shards
(:func:`expert_shard`, :func:`merge_expert_shards`, :func:`expert_tp_shard`): pure functions.  The experts stay
functions, not table rows: transformers 5 stores them fused ``[E, 2f, h]`` (older checkpoints per expert, read too),
Megatron-Core one module per expert, renumbered per expert-parallel rank.

One MoE MLP, ``E`` experts of width ``f``, hidden ``h`` (transformers 5 stores the experts fused, as
``Qwen3MoeExperts`` / ``MixtralExperts`` / ``DeepseekV3Experts`` do; a checkpoint's per-expert names are read
too)::

    HF                                          packfwd (Megatron-Core's MoELayer, SequentialMLP experts)
    mlp.gate.weight              [E, h]         mlp.router.weight                                [E, h]
    mlp.experts.gate_up_proj     [E, 2f, h]     mlp.experts.local_experts.{e}.linear_fc1.weight  [2f, h] [gate; up]
    mlp.experts.down_proj        [E, h, f]      mlp.experts.local_experts.{e}.linear_fc2.weight  [h, f]
    (mlp.experts.{e}.gate_proj / up_proj / down_proj .weight: [f, h], [f, h], [h, f])
  with an expert bias (DeepSeek-V3's routing-only correction; a float32 buffer on both sides):
    mlp.gate.e_score_correction_bias [E]        mlp.router.expert_bias                           [E]
  with shared experts of width fs (every token also goes through them; Megatron's SharedExpertMLP):
    mlp.shared_experts.gate_proj.weight [fs, h] mlp.shared_experts.linear_fc1.weight             [2fs, h] [gate; up]
    mlp.shared_experts.up_proj.weight   [fs, h]
    mlp.shared_experts.down_proj.weight [h, fs] mlp.shared_experts.linear_fc2.weight             [h, fs]
  with a gated shared expert (Qwen2-MoE: its output times sigmoid(gate . x); HF names it in the singular):
    mlp.shared_expert.{gate,up,down}_proj       mlp.shared_experts.linear_fc1 / linear_fc2       as above
    mlp.shared_expert_gate.weight       [1, h]  mlp.shared_experts.gate_weight                   [1, h]

Every tensor keeps its dtype both ways: a float32 ``gate.weight`` (transformers keeps it float32 in a bf16 GLM-4.5 /
DeepSeek-V3) lands in the router's float32 weight when the router has its own dtype (``Moe.router_dtype``), so it
converts bit for bit.  A TP rank holds ``[gate_r; up_r]`` rows of each ``linear_fc1`` and the matching columns of
``linear_fc2`` (the experts' tensor-parallel size is the model's, Megatron-Core's default
``expert_tensor_parallel_size``); the router and its bias are replicated.  With ``expert_tensor_parallel_size=1`` the
experts are whole on every TP rank (:func:`expert_tp_shard` cuts them as TP's would be, for the way back).  An
expert-parallel rank holds the experts ``experts`` (global ids), numbered ``local_experts.0 ...`` in order.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import re

import torch
from torch import Tensor

__all__ = ["expert_shard", "expert_tp_shard", "experts_from_hf", "experts_to_hf", "interleaved_experts_from_hf",
           "interleaved_experts_to_hf", "merge_expert_shards"]

def experts_from_hf(sd: Mapping[str, Tensor], hf: str, mg: str, experts: Sequence[int], *, tp_size: int = 1,
                    tp_rank: int = 0) -> dict[str, Tensor]:
    """TP rank ``tp_rank``'s tensors of the routed experts ``experts`` (global ids) of the MoE MLP ``hf`` (a prefix
    such as ``"model.layers.1.mlp."``) under Megatron's prefix ``mg`` (``"decoder.layers.1.mlp."``), numbered
    ``local_experts.0 ...`` in order.  New tensors.

    >>> E, f, h = 2, 4, 4
    >>> sd = {"m.experts.gate_up_proj": torch.randn(E, 2 * f, h), "m.experts.down_proj": torch.randn(E, h, f)}
    >>> out = experts_from_hf(sd, "m.", "g.", range(E))
    >>> torch.equal(out["g.experts.local_experts.1.linear_fc1.weight"], sd["m.experts.gate_up_proj"][1])
    True
    >>> shards = [experts_from_hf(sd, "m.", "g.", range(E), tp_size=2, tp_rank=r) for r in (0, 1)]
    >>> back = experts_to_hf(shards, "m.", "g.", E)
    >>> sorted(back) == sorted(sd) and all(torch.equal(back[k], v) for k, v in sd.items())
    True
    """
    out = {}
    for local, e in enumerate(experts):
        out.update(_mlp_from_hf(*_expert(sd, hf, e), f"{mg}experts.local_experts.{local}.", tp_size, tp_rank))
    return out


def experts_to_hf(shards: Sequence[Mapping[str, Tensor]], hf: str, mg: str, num_experts: int) -> dict[str, Tensor]:
    """The inverse of :func:`experts_from_hf` for all ``num_experts`` experts (every TP rank's state dict, in rank
    order; no expert parallelism): the fused HF tensors transformers' own state dict holds.  New tensors."""
    experts = [_mlp_to_hf(shards, f"{mg}experts.local_experts.{e}.") for e in range(num_experts)]
    return {hf + "experts.gate_up_proj": torch.stack([torch.cat(gate_up) for *gate_up, _ in experts]),
            hf + "experts.down_proj": torch.stack([down for *_, down in experts])}


def interleaved_experts_from_hf(sd: Mapping[str, Tensor], hf: str, mg: str, experts: Sequence[int], *,
                                tp_size: int = 1, tp_rank: int = 0) -> dict[str, Tensor]:
    """:func:`experts_from_hf` for GPT-OSS's layout: ``experts.gate_up_proj [E, h, 2f]`` (transposed; gate and up
    interleaved, ``[..., ::2]`` gate and ``[..., 1::2]`` up) with ``gate_up_proj_bias [E, 2f]`` (interleaved too),
    ``down_proj [E, f, h]`` with ``down_proj_bias [E, h]``: Megatron-Core's ``linear_fc1`` ``[gate; up]`` rows
    (weight and bias, TP rank ``tp_rank``'s ``[gate_r; up_r]``), ``linear_fc2`` columns and its whole bias (a
    row-parallel bias).  New tensors.

    >>> E, f, h = 2, 2, 3
    >>> sd = {"m.experts.gate_up_proj": torch.randn(E, h, 2 * f), "m.experts.gate_up_proj_bias": torch.randn(E, 2 * f),
    ...       "m.experts.down_proj": torch.randn(E, f, h), "m.experts.down_proj_bias": torch.randn(E, h)}
    >>> out = interleaved_experts_from_hf(sd, "m.", "g.", range(E))
    >>> fc1, w = out["g.experts.local_experts.1.linear_fc1.weight"], sd["m.experts.gate_up_proj"][1]
    >>> torch.equal(fc1[:f], w[:, ::2].T), torch.equal(fc1[f:], w[:, 1::2].T)   # [gate; up] of expert 1: [2f, h]
    (True, True)
    >>> shards = [interleaved_experts_from_hf(sd, "m.", "g.", range(E), tp_size=2, tp_rank=r) for r in (0, 1)]
    >>> back = interleaved_experts_to_hf(shards, "m.", "g.", E)
    >>> sorted(back) == sorted(sd) and all(torch.equal(back[k], v) for k, v in sd.items())
    True
    """
    if hf + "experts.gate_up_proj" not in sd:
        quantized = hf + "experts.gate_up_proj_blocks" in sd
        raise ValueError(f"no {hf}experts.gate_up_proj in the state dict" + (
            ": these experts are MXFP4 blocks and scales; load the checkpoint dequantized (transformers' "
            "Mxfp4Config(dequantize=True)) and convert that model" if quantized else
            "; pass a GptOssForCausalLM's state dict"))
    out = {}
    for local, e in enumerate(experts):
        p = f"{mg}experts.local_experts.{local}."
        gate_up, bias = sd[hf + "experts.gate_up_proj"][e].T, sd[hf + "experts.gate_up_proj_bias"][e]  # [2f, h], [2f]
        halves = torch.cat([gate_up[0::2], gate_up[1::2]])  # interleaved rows -> [gate; up]
        out.update(_mlp_from_hf(halves, sd[hf + "experts.down_proj"][e].T, p, tp_size, tp_rank))
        gate, up = bias[0::2].chunk(tp_size)[tp_rank], bias[1::2].chunk(tp_size)[tp_rank]
        out[p + "linear_fc1.bias"] = torch.cat([gate, up]).clone()
        out[p + "linear_fc2.bias"] = sd[hf + "experts.down_proj_bias"][e].clone()
    return out


def interleaved_experts_to_hf(shards: Sequence[Mapping[str, Tensor]], hf: str, mg: str,
                              num_experts: int) -> dict[str, Tensor]:
    """The inverse of :func:`interleaved_experts_from_hf` for all ``num_experts`` experts (every TP rank's state
    dict, in rank order): GPT-OSS's four fused tensors.  New tensors."""
    gate_up, gate_up_bias, down, down_bias = [], [], [], []
    for e in range(num_experts):
        p = f"{mg}experts.local_experts.{e}."
        gate, up, fc2 = _mlp_to_hf(shards, p)
        gates, ups = zip(*(s[p + "linear_fc1.bias"].chunk(2) for s in shards))
        gate_up.append(torch.stack([gate, up], dim=1).reshape(-1, gate.shape[1]).T)  # rows interleaved, transposed
        gate_up_bias.append(torch.stack([torch.cat(gates), torch.cat(ups)], dim=1).reshape(-1))
        down.append(fc2.T)
        down_bias.append(shards[0][p + "linear_fc2.bias"])
    return {hf + "experts.gate_up_proj": torch.stack(gate_up),
            hf + "experts.gate_up_proj_bias": torch.stack(gate_up_bias),
            hf + "experts.down_proj": torch.stack(down), hf + "experts.down_proj_bias": torch.stack(down_bias)}


_LOCAL = re.compile(r"^(.*\.experts\.local_experts\.)(\d+)(\..*)$")


def expert_shard(state: Mapping[str, Tensor], num_experts: int, ep_size: int, ep_rank: int) -> dict[str, Tensor]:
    """Expert-parallel rank ``ep_rank``'s part of a Megatron-Core state dict of all ``num_experts`` experts per MoE
    layer: every tensor but the experts', and experts ``[r * E / ep, (r + 1) * E / ep)`` renumbered from
    ``local_experts.0`` (Megatron-Core numbers a rank's experts locally).  The same tensors, not copies.  Of a TP
    rank's state dict (the experts TP-sharded as the dense MLP, at TP's size), rank ``(tp, ep)``'s part.

    >>> sd = {f"l.mlp.experts.local_experts.{e}.linear_fc2.weight": torch.full((1,), e) for e in range(4)}
    >>> sd["l.mlp.router.weight"] = torch.zeros(4, 1)
    >>> shard = expert_shard(sd, 4, ep_size=2, ep_rank=1)
    >>> sorted(shard), shard["l.mlp.experts.local_experts.0.linear_fc2.weight"].item()
    (['l.mlp.experts.local_experts.0.linear_fc2.weight', 'l.mlp.experts.local_experts.1.linear_fc2.weight', \
'l.mlp.router.weight'], 2)
    >>> back = merge_expert_shards([expert_shard(sd, 4, 2, r) for r in (0, 1)])
    >>> sorted(back) == sorted(sd) and all(back[k] is v for k, v in sd.items())
    True
    """
    if ep_size < 1 or not 0 <= ep_rank < ep_size or num_experts % ep_size:
        raise ValueError(f"ep_size={ep_size}, ep_rank={ep_rank} for {num_experts} experts: pass 0 <= ep_rank < "
                         "ep_size with ep_size dividing the number of experts")
    local = num_experts // ep_size
    out = {}
    for name, t in state.items():
        m = _LOCAL.match(name)
        if m is None:
            out[name] = t
        elif ep_rank * local <= int(m[2]) < (ep_rank + 1) * local:
            out[f"{m[1]}{int(m[2]) - ep_rank * local}{m[3]}"] = t
    return out


def expert_tp_shard(state: Mapping[str, Tensor], tp_size: int, tp_rank: int) -> dict[str, Tensor]:
    """``state`` (a Megatron-Core state dict with whole experts: ``expert_tensor_parallel_size=1``) with every
    expert's ``linear_fc1.weight`` / ``linear_fc2.weight`` cut to TP rank ``tp_rank``'s part as at the experts'
    default TP size (``[gate_r; up_r]`` rows, ``down`` columns), so that the TP ranks' dicts merge like the dense
    MLP's (:func:`moe_to_hf`).  Other tensors are the same tensors; cut ones are new.

    >>> e = "l.mlp.experts.local_experts.0."
    >>> sd = {e + "linear_fc1.weight": torch.arange(8.).view(4, 2),
    ...       e + "linear_fc2.weight": torch.arange(4.).view(2, 2)}
    >>> parts = [expert_tp_shard(sd, 2, r) for r in (0, 1)]
    >>> parts[1][e + "linear_fc1.weight"].tolist()  # rank 1: gate row 1, then up row 1 ([gate; up] = rows 0-1, 2-3)
    [[2.0, 3.0], [6.0, 7.0]]
    >>> gate, up, down = _mlp_to_hf(parts, e)  # the TP ranks' parts merge back like a dense MLP's
    >>> torch.equal(torch.cat([gate, up]), sd[e + "linear_fc1.weight"]), torch.equal(down, sd[e + "linear_fc2.weight"])
    (True, True)
    """
    out = dict(state)
    for name, t in state.items():
        m = _LOCAL.match(name)
        if m is not None and m[3] == ".linear_fc1.weight":
            prefix = name[:-len("linear_fc1.weight")]
            out.update(_mlp_from_hf(t, state[prefix + "linear_fc2.weight"], prefix, tp_size, tp_rank))
            if prefix + "linear_fc1.bias" in state:  # [gate_r; up_r] too (linear_fc2's bias is whole on every rank)
                gate, up = state[prefix + "linear_fc1.bias"].chunk(2)
                out[prefix + "linear_fc1.bias"] = torch.cat([gate.chunk(tp_size)[tp_rank], up.chunk(tp_size)[tp_rank]])
    return out


def merge_expert_shards(shards: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """The inverse of :func:`expert_shard`: one state dict of all experts from every expert-parallel rank's, in rank
    order (each rank holds as many experts; the other tensors are taken from rank 0)."""
    if not shards:
        raise ValueError("shards is empty; pass one state dict per expert-parallel rank, in rank order")
    local = 1 + max((int(m[2]) for m in map(_LOCAL.match, shards[0]) if m is not None), default=-1)
    out = {name: t for name, t in shards[0].items() if _LOCAL.match(name) is None}
    for rank, shard in enumerate(shards):
        for name, t in shard.items():
            m = _LOCAL.match(name)
            if m is not None:
                out[f"{m[1]}{int(m[2]) + rank * local}{m[3]}"] = t
    return out


def _mlp_from_hf(gate_up: Tensor, down: Tensor, mg: str, tp_size: int, tp_rank: int) -> dict[str, Tensor]:
    """One SwiGLU MLP's ``[gate; up] [2f, h]`` and ``down [h, f]`` as TP rank ``tp_rank``'s linears under ``mg``."""
    if down.shape[1] % tp_size:
        raise ValueError(f"an MLP of width {down.shape[1]} under {mg!r} does not split over tp_size={tp_size}; pick "
                         "a TP size that divides the experts' widths")
    gate, up = gate_up.chunk(2, dim=0)
    return {mg + "linear_fc1.weight": torch.cat([gate.chunk(tp_size)[tp_rank], up.chunk(tp_size)[tp_rank]]).clone(),
            mg + "linear_fc2.weight": down.chunk(tp_size, dim=1)[tp_rank].clone()}


def _mlp_to_hf(shards: Sequence[Mapping[str, Tensor]], mg: str) -> tuple[Tensor, Tensor, Tensor]:
    """``(gate, up, down)`` of one MLP from every TP rank's linears under ``mg``."""
    gates, ups = zip(*(s[mg + "linear_fc1.weight"].chunk(2, dim=0) for s in shards))
    return torch.cat(gates), torch.cat(ups), torch.cat([s[mg + "linear_fc2.weight"] for s in shards], dim=1)


def _expert(sd: Mapping[str, Tensor], hf: str, e: int) -> tuple[Tensor, Tensor]:
    """Expert ``e``'s ``([gate; up] [2f, h], down [h, f])`` from the fused or the per-expert HF names."""
    if hf + "experts.gate_up_proj" in sd:
        return sd[hf + "experts.gate_up_proj"][e], sd[hf + "experts.down_proj"][e]
    p = f"{hf}experts.{e}."
    if p + "gate_proj.weight" not in sd:
        raise ValueError(f"no weights of expert {e} under {hf!r}: expected {hf}experts.gate_up_proj (transformers 5) "
                         f"or {p}gate_proj.weight")
    return torch.cat([sd[p + "gate_proj.weight"], sd[p + "up_proj.weight"]]), sd[p + "down_proj.weight"]
