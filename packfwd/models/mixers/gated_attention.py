"""Softmax attention with an output gate (the full-attention layers of Qwen3-Next and Qwen3.5) as a token-mixer
component: softmax attention (:mod:`packfwd.models.mixers.softmax`, whose fields it keeps) whose query projection
also emits a gate per query channel; the attention output is multiplied by ``sigmoid(gate)`` before ``o_proj``
(Megatron-Core's ``attention_output_gate``).  It owns ``ModelArgs.attention_output_gate``.  No Megatron-Core here.

transformers' ``q_proj`` emits ``[heads, 2 d]``: per head its ``d`` query channels, then its ``d`` gate channels.
Megatron-Core's ``linear_qkv`` holds, per query group ``g`` (``r`` query heads each), ``[q heads of g, gate heads
of g, k_g, v_g]`` (``[ng * (2 r + 2) * d, hidden]``), and TP rank ``p`` the rows of its ``ng / tp`` groups.  The gate
is applied in the output's dtype promoted to float32 at least (Megatron-Core's in float32, which would round a
float64 model's).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import Tensor

from ..mapping import rows_to_hf, rows_to_megatron
from .softmax import WEIGHTS, SoftmaxAttention

__all__ = ["GATED_ATTENTION", "GatedAttention"]

_QKV = "self_attention.linear_qkv.weight"
_REST = tuple(w for w in WEIGHTS if w.mg != _QKV)


class GatedAttention(SoftmaxAttention):
    """Softmax attention with an output gate (module docstring).

    >>> from packfwd.models.args import ModelArgs
    >>> args = ModelArgs(vocab_size=64, hidden_size=32, ffn_hidden_size=64, num_layers=1, num_attention_heads=4,
    ...                  num_query_groups=2, head_dim=8, family="qwen3_5", qk_norm=True, attention_output_gate=True,
    ...                  norm_zero_centered=True)
    >>> GATED_ATTENTION.config_fields(args)["attention_output_gate"]
    True
    """

    name = "gated softmax attention"
    fields = SoftmaxAttention.fields + ("attention_output_gate",)
    field = "attention_output_gate"  # the ModelArgs field that selects it
    hint = "attention_output_gate=True"

    def check(self, args) -> None:
        super().check(args)
        if args.qkv_bias or args.linear_bias:
            raise ValueError("qkv_bias / linear_bias with attention_output_gate: the gated attention is built without "
                             "biases (Qwen3-Next, Qwen3.5: attention_bias=False); pass False")

    def config_fields(self, args) -> dict:
        return dict(super().config_fields(args), attention_output_gate=True)

    def layer_spec(self, args, layer: int, *, attention_backend: str | None = None, rope=None, qk_norm=None):
        """The softmax attention's spec with :class:`packfwd.models.mixers.gdn.GatedSelfAttention` as the module."""
        from .gdn import GatedSelfAttention

        spec = super().layer_spec(args, layer, attention_backend=attention_backend, rope=rope, qk_norm=qk_norm)
        spec.module = GatedSelfAttention
        return spec

    def hf_to_megatron(self, args, sd: Mapping[str, Tensor], hf_layer: str, mg_layer: str, *, tp_size: int,
                       tp_rank: int) -> dict[str, Tensor]:
        out = rows_to_megatron(_REST, args, sd, hf_layer, mg_layer, tp_size, tp_rank)
        h = hf_layer + "self_attn."
        missing = [h + f"{x}_proj.weight" for x in "qkv" if h + f"{x}_proj.weight" not in sd]
        if missing:
            raise ValueError(f"no {missing[0]} in the HF state dict; check that the config matches the checkpoint")
        ng, d = args.query_groups, args.kv_channels
        if ng % tp_size:
            raise ValueError(f"num_query_groups={ng} does not split over tp_size={tp_size}; pick a TP size that "
                             "divides it")
        q_gate = sd[h + "q_proj.weight"]
        width = q_gate.shape[1:]
        q, gate = q_gate.reshape(ng, -1, 2, d, *width).unbind(2)  # [ng, r, d, hidden] each
        k, v = (sd[h + f"{x}_proj.weight"].reshape(ng, d, *width) for x in "kv")
        fused = torch.cat([q.flatten(1, 2), gate.flatten(1, 2), k, v], dim=1)  # [ng, (2r + 2) d, hidden]
        out[mg_layer + _QKV] = fused.chunk(tp_size)[tp_rank].reshape(-1, *width).clone()
        return out

    def megatron_to_hf(self, args, shards: Sequence[Mapping[str, Tensor]], mg_layer: str,
                       hf_layer: str) -> dict[str, Tensor]:
        out = rows_to_hf(_REST, args, shards, mg_layer, hf_layer)
        ng, d = args.query_groups, args.kv_channels
        r = args.num_attention_heads // ng
        fused = torch.cat([s[mg_layer + _QKV] for s in shards])
        width = fused.shape[1:]
        q, gate, k, v = fused.reshape(ng, (2 * r + 2) * d, *width).split([r * d, r * d, d, d], dim=1)
        q_gate = torch.stack([q.reshape(ng, r, d, *width), gate.reshape(ng, r, d, *width)], dim=2)
        h = hf_layer + "self_attn."
        out[h + "q_proj.weight"] = q_gate.reshape(-1, *width)
        out[h + "k_proj.weight"], out[h + "v_proj.weight"] = k.reshape(-1, *width).clone(), v.reshape(-1, *width).clone()
        return out


GATED_ATTENTION = GatedAttention()
